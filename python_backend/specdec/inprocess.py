"""ModelBackends that call the engines in this process: for tests, tools and Triton-free benchmarks.

`InProcessBackend` serves each call alone, at once. `BatchingBackend` behaves like Triton's sequence
batcher in front of a decoder instance: steps of concurrent sequences that arrive while a forward runs are
served together in the next engine step, and the forward runs in a worker thread, so the event loop (the
other generations) goes on meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from specdec.drafting.spec import DRAFTER_MODELS, ModelDrafterName
from specdec.engines import DraftEngine, StepRequest, StepResult, TargetEngine


class InProcessBackend:
    def __init__(self, target: TargetEngine, draft: DraftEngine | None = None,
                 eagle: DraftEngine | None = None) -> None:
        self.target = target
        self.draft = draft
        self.eagle = eagle

    async def target_step(self, request: StepRequest) -> StepResult:
        return self.target.step([request])[0]

    async def target_steps(self, requests: list[StepRequest]) -> list[StepResult]:
        return [await self.target_step(request) for request in requests]  # each alone, as target_step

    async def drafter_step(self, drafter: ModelDrafterName, request: StepRequest) -> StepResult:
        engine = {"model": self.draft, "eagle": self.eagle}[drafter]
        if engine is None:
            raise RuntimeError(f"no {DRAFTER_MODELS[drafter]} is loaded")
        return engine.step([request])[0]


class _Batcher:
    """The queue of one engine: a worker task serves everything queued since its last step in one step."""

    def __init__(self, engine: TargetEngine | DraftEngine, on_batch: Callable[[list[StepRequest]], None]) -> None:
        self.engine = engine
        self.on_batch = on_batch
        self._pending: list[tuple[StepRequest, asyncio.Future[StepResult]]] = []
        self._worker: asyncio.Task[None] | None = None

    async def submit(self, request: StepRequest) -> StepResult:
        done: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        self._pending.append((request, done))
        if self._worker is None:
            self._worker = asyncio.create_task(self._serve())
        return await done

    async def submit_all(self, requests: list[StepRequest]) -> list[StepResult]:
        """Several steps queued at once: served in one engine step."""
        return list(await asyncio.gather(*(self.submit(request) for request in requests)))

    async def _serve(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            requests = [request for request, _ in batch]
            self.on_batch(requests)
            try:
                results = await asyncio.to_thread(self.engine.step, requests)
            except Exception as exc:  # the whole step failed: every caller of it gets the error
                for _, done in batch:
                    done.set_exception(exc)
                continue
            for (_, done), result in zip(batch, results, strict=True):
                done.set_result(result)
        self._worker = None


class BatchingBackend:
    """Batches concurrent steps per engine as Triton's sequence batcher does; `on_batch(model, requests)`
    sees every engine step (tests and benchmarks use it to see what ran together)."""

    def __init__(self, target: TargetEngine, draft: DraftEngine | None = None,
                 on_batch: Callable[[str, list[StepRequest]], None] = lambda model, requests: None,
                 eagle: DraftEngine | None = None) -> None:
        self._target = _Batcher(target, lambda requests: on_batch("target", requests))
        self._drafters = {name: _Batcher(engine, lambda requests, label=label: on_batch(label, requests))
                          for name, label, engine in (("model", "draft", draft), ("eagle", "eagle", eagle))
                          if engine is not None}

    async def target_step(self, request: StepRequest) -> StepResult:
        return await self._target.submit(request)

    async def target_steps(self, requests: list[StepRequest]) -> list[StepResult]:
        return await self._target.submit_all(requests)

    async def drafter_step(self, drafter: ModelDrafterName, request: StepRequest) -> StepResult:
        if drafter not in self._drafters:
            raise RuntimeError(f"no {DRAFTER_MODELS[drafter]} is loaded")
        return await self._drafters[drafter].submit(request)
