"""A ModelBackend that calls the engines in this process: for tests, tools and Triton-free benchmarks."""

from __future__ import annotations

from specdec.engines import DraftEngine, StepRequest, StepResult, TargetEngine


class InProcessBackend:
    def __init__(self, target: TargetEngine, draft: DraftEngine | None = None) -> None:
        self.target = target
        self.draft = draft

    async def target_step(self, request: StepRequest) -> StepResult:
        return self.target.step([request])[0]

    async def draft_step(self, request: StepRequest) -> StepResult:
        if self.draft is None:
            raise RuntimeError("no draft model is loaded")
        return self.draft.step([request])[0]
