"""One load cell against a running server's OpenAI endpoint (port 9000): CONCURRENCY REQUESTS MODE TAG.

Prints output tok/s, time to first token (median, P90), P99 latency and errors; writes each answer's text to
/tmp/texts_TAG_cCONCURRENCY_MODE.json so greedy outputs can be compared between runs."""

from __future__ import annotations

import asyncio
import json
import statistics
import sys

from specdec_client import peers


def quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    concurrency, count, mode, tag = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    requests = peers.chat_requests()
    bodies = [peers.request_body("ours", "ensemble", requests[i % len(requests)], mode, i, 128, task_hint=True)
              for i in range(count)]
    wall, samples = asyncio.run(peers._run_cell("http://127.0.0.1:9000/v1", bodies, concurrency, 600))
    tokens = sum(s.completion_tokens for s in samples)
    errors = sum(1 for s in samples if s.error)
    ttft = sorted(s.ttft_s for s in samples if s.ttft_s is not None)
    latency = sorted(s.latency_s for s in samples)
    print(f"{tag} c{concurrency} {mode}: {tokens / wall:.1f} tok/s  ttft med {statistics.median(ttft):.2f} "
          f"p90 {quantile(ttft, 0.9):.2f} s  latency p99 {quantile(latency, 0.99):.1f} s  errors {errors}", flush=True)
    with open(f"/tmp/texts_{tag}_c{concurrency}_{mode}.json", "w", encoding="utf-8") as out:
        json.dump([s.text for s in samples], out)


if __name__ == "__main__":
    main()
