"""perf_analyzer 2.51 (from the tritonclient wheel) drives the streaming ensemble for a few seconds."""

from __future__ import annotations

import json
import subprocess

import pytest
from specdec_client.bench_prompts import PERF_DIR, SCENARIOS, perf_analyzer_data
from specdec_client.perf_tools import perf_analyzer_binary, perf_analyzer_command, tool_environment
from specdec_client.scrape import scrape, wait_for

pytestmark = pytest.mark.integration
REQUESTS = 4
MAX_TOKENS = 16


def test_committed_input_data_matches_the_scenarios():
    for scenario, (_, task, max_tokens) in SCENARIOS.items():
        data = json.loads((PERF_DIR / f"{scenario}.json").read_text())["data"]
        assert len(data) >= 16
        assert {entry["max_tokens"]["content"][0] for entry in data} == {max_tokens}
        assert {entry["task"]["content"][0] for entry in data} == {task}
        assert all(entry["text_input"]["content"][0].strip() for entry in data)


def test_perf_analyzer_streams_against_the_ensemble(server, tmp_path):
    assert perf_analyzer_binary().exists()
    prompts = [entry["text_input"]["content"][0]
               for entry in json.loads((PERF_DIR / "prose.json").read_text())["data"][:2]]
    data = tmp_path / "input.json"
    data.write_text(json.dumps(perf_analyzer_data(prompts, MAX_TOKENS, "text")))
    export = tmp_path / "export.json"
    before = scrape(server.metrics_url)
    command = perf_analyzer_command(server.grpc_url, data, "1", request_count=REQUESTS, export=export)
    done = subprocess.run(command, env=tool_environment(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Throughput" in done.stdout and "p99 latency" in done.stdout
    assert export.exists() and export.stat().st_size, "empty export: " + done.stdout[-3000:] + done.stderr[-3000:]

    requests = [r for experiment in json.loads(export.read_text())["experiments"] for r in experiment["requests"]]
    assert len(requests) == REQUESTS
    for request in requests:
        outputs = request["response_outputs"]
        assert len(outputs) == len(request["response_timestamps"]) >= 1
        assert 1 <= outputs[-1]["num_output_tokens"] <= MAX_TOKENS
        assert "".join(o["text_output"] for o in outputs).strip()

    ensemble = {"model": "ensemble"}
    after = wait_for(server.metrics_url,
                     lambda now: (now - before).total("specdec_requests_total", task="text") >= REQUESTS)
    delta = after - before
    assert delta.total("nv_inference_request_success", **ensemble) == REQUESTS
    assert delta.total("specdec_requests_total", task="text") == REQUESTS
    assert delta.total("specdec_output_tokens_total", task="text") == sum(
        r["response_outputs"][-1]["num_output_tokens"] for r in requests)
