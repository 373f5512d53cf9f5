"""The 30-second version of `make soak` (10 minutes): concurrency 32 on loopback, no errors, every KV slot free
afterwards, resident memory of the server and its model processes flat after warm-up."""

from __future__ import annotations

import pytest
from specdec_client.soak import Soak

pytestmark = pytest.mark.integration
MAX_MEMORY_GROWTH_PCT = 5.0


def test_thirty_second_soak_at_concurrency_32(server):
    report = Soak(server.grpc_url, server.metrics_url, server.process.pid, concurrency=32, duration_s=30,
                  max_tokens=(16, 32, 64), sample_s=5, warmup_s=10).run()
    print(report.text())
    assert report.error_count == 0, report.errors
    assert report.completed >= 32 and report.latency_p99_s is not None
    assert report.final_kv_slots_in_use == 0
    assert report.memory_growth_pct is not None and report.memory_growth_pct < MAX_MEMORY_GROWTH_PCT
