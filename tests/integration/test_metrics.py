"""/metrics after known traffic: the specdec_* figures agree with what the responses reported."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
from specdec.metrics import (
    ACCEPTANCE_RATE,
    ACCEPTED_BY_POSITION,
    ACCEPTED_DRAFT_TOKENS,
    ACTIVE_REQUESTS,
    DRAFT_TOKENS,
    ERRORS,
    ITL,
    KV_CACHE_BYTES,
    KV_SLOTS,
    KV_SLOTS_IN_USE,
    MEAN_ACCEPTED_LENGTH,
    OUTPUT_TOKENS,
    PROPORTIONAL_MEMORY,
    REQUESTS,
    RESIDENT_MEMORY,
    SPECULATION_LENGTH,
    TTFT,
    UNIQUE_MEMORY,
    VERIFICATION_PASSES,
)
from specdec_client.api import GenerationError, generate_grpc, generate_http
from specdec_client.scrape import scrape, wait_for

pytestmark = pytest.mark.integration
MODEL = "speculative_decoding"
REPO_ROOT = Path(__file__).resolve().parents[2]
K = 4


def test_metrics_agree_with_the_responses(server, all_prompts):
    json_prompts = [p for d, p in all_prompts if d == "json"][:3]
    code_prompts = [p for d, p in all_prompts if d == "code"][:2]
    before = scrape(server.metrics_url)

    # The draft model alone: every proposal is K long (prompt lookup in front would propose its own length).
    spec = [generate_grpc(server.grpc_url, {"text_input": p, "max_tokens": 24, "num_draft_tokens": K,
                                            "task": "json", "stream": True, "drafter": "model"})
            for p in json_prompts]
    plain = [generate_http(server.http_url, {"text_input": p, "max_tokens": 16, "num_draft_tokens": 0,
                                             "task": "code"}) for p in code_prompts]
    with pytest.raises(GenerationError, match="beam_width"):
        generate_grpc(server.grpc_url, {"text_input": "x", "max_tokens": 4, "beam_width": 2, "task": "text"})

    def settled(now) -> bool:
        return (now - before).total(REQUESTS.name, model=MODEL) >= len(spec) + len(plain) + 1

    after = wait_for(server.metrics_url, settled)
    delta = after - before
    json_, code = {"model": MODEL, "task": "json"}, {"model": MODEL, "task": "code"}

    assert delta.total(REQUESTS.name, **json_) == len(spec)
    assert delta.total(REQUESTS.name, **code, outcome="length") == len(plain)
    assert delta.total(REQUESTS.name, model=MODEL, outcome="error", task="unknown") == 1
    assert delta.total(ERRORS.name, model=MODEL, kind="unsupported") == 1

    accepted = sum(r.stats["total_accepted_draft_tokens"] for r in spec)
    proposed = sum(r.stats["total_draft_tokens"] for r in spec)
    assert proposed > 0
    assert delta.total(OUTPUT_TOKENS.name, **json_) == sum(r.num_output_tokens for r in spec)
    assert delta.total(OUTPUT_TOKENS.name, **code) == sum(r.num_output_tokens for r in plain) == 16 * len(plain)
    assert delta.total(DRAFT_TOKENS.name, **json_) == proposed
    assert delta.total(ACCEPTED_DRAFT_TOKENS.name, **json_) == accepted
    assert delta.total(ACCEPTED_BY_POSITION.name, **json_) == accepted
    assert {labels["position"] for labels, v in delta.values(ACCEPTED_BY_POSITION.name, **json_) if v} <= {
        str(i) for i in range(K)}
    assert delta.total(DRAFT_TOKENS.name, **code) == 0 and delta.total(VERIFICATION_PASSES.name, **code) == 0
    passes = delta.total(VERIFICATION_PASSES.name, **json_)
    assert passes > 0

    # The windowed gauges see exactly this test's json requests (no other test sends task=json).
    # The windowed gauge also counts other tests' json traffic inside its window: only its range is known.
    assert 0.0 <= after.total(ACCEPTANCE_RATE.name, **json_) <= 1.0
    # Windowed like the acceptance gauge (other tests' json traffic shares the window): its range is known.
    assert 1.0 <= after.total(MEAN_ACCEPTED_LENGTH.name, **json_) <= K + 1
    assert 1 <= after.total(SPECULATION_LENGTH.name, **json_) <= K  # the latest step's k (shorter near the end)
    assert after.total(SPECULATION_LENGTH.name, **code) == 0

    # Histograms: one observation per request; TTFT no later than the client saw the first text.
    for labels, requests in ((json_, spec), (code, plain)):
        assert delta.total(TTFT.name + "_count", **labels) == len(requests)
        assert delta.total(ITL.name + "_count", **labels) == len(requests)
        assert delta.total(TTFT.name + "_bucket", **labels, le="+Inf") == len(requests)
    assert 0 < delta.total(TTFT.name + "_sum", **json_) <= sum(r.time_to_first_token_s for r in spec)

    # Resources: every model process reports memory; slots are all free again; nothing is in flight (these
    # gauges are published by a background thread every second).
    after = wait_for(server.metrics_url, lambda now: now.total(KV_SLOTS_IN_USE.name) == 0
                     and now.total(ACTIVE_REQUESTS.name, model=MODEL) == 0)
    for model in ("target_model", "draft_model", MODEL):
        assert after.total(RESIDENT_MEMORY.name, model=model) > 20 << 20, model
        assert 0 < after.total(UNIQUE_MEMORY.name, model=model) <= after.total(PROPORTIONAL_MEMORY.name, model=model)
        assert after.total(PROPORTIONAL_MEMORY.name, model=model) <= after.total(RESIDENT_MEMORY.name, model=model)
    for model in ("target_model", "draft_model"):
        assert after.total(KV_SLOTS.name, model=model) >= 1
        assert after.total(KV_CACHE_BYTES.name, model=model) > 0
        assert after.total(KV_SLOTS_IN_USE.name, model=model) == 0
    assert after.total(ACTIVE_REQUESTS.name, model=MODEL) == 0

    # Triton's own tier-1 families sit next to ours on the same port.
    assert delta.total("nv_inference_request_success", model="ensemble") == len(spec) + len(plain)
    # (2.51 counts one failed ensemble request twice, both with reason OTHER.)
    assert delta.total("nv_inference_request_failure", model="ensemble") >= 1


GUIDED_SCHEMA = '{"type": "object", "properties": {"name": {"type": "string"}, "size": {"type": "integer"}}, ' \
                '"required": ["name", "size"], "additionalProperties": false}'


def test_dashboard_queries_return_data_on_a_real_prometheus(server, all_prompts, tmp_path):
    """Every PromQL query of the Grafana dashboard parses and (GPU panels aside) returns series."""
    spec = importlib.util.spec_from_file_location("check_queries", REPO_ROOT / "docker/monitoring/check_queries.py")
    check_queries = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_queries)
    target = server.metrics_url.split("//", 1)[1].split("/", 1)[0]
    prompts = [p for d, p in all_prompts if d == "code"]
    with check_queries.local_prometheus(target, tmp_path) as prometheus:
        # Traffic until Prometheus has two scrapes that saw it (rate() needs two points), then one more scrape.
        # A prompt holding its own greedy continuation, so prompt lookup in front of the draft model proposes
        # (and has tokens accepted) when the target writes that continuation again.
        echo = generate_grpc(server.grpc_url, {"text_input": prompts[1], "max_tokens": 24, "task": "code",
                                               "num_draft_tokens": 0, "exclude_input_in_output": True}).text
        repeating = prompts[1] + echo + "\n\n" + prompts[1]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            generate_grpc(server.grpc_url, {"text_input": prompts[0], "max_tokens": 12, "task": "code"})
            generate_grpc(server.grpc_url, {"text_input": repeating, "max_tokens": 24, "task": "code",
                                            "drafter": "model+ngram"})
            # Constrained requests: a schema's keys are drafted by its grammar, and the draft model's code-like
            # proposals for a run of digits are cut.
            generate_grpc(server.grpc_url, {"text_input": prompts[0], "max_tokens": 24, "drafter": "model",
                                            "guided_decoding_guide_type": "json_schema",
                                            "guided_decoding_guide": GUIDED_SCHEMA})
            generate_grpc(server.grpc_url, {"text_input": prompts[0], "max_tokens": 12, "drafter": "model",
                                            "guided_decoding_guide_type": "regex",
                                            "guided_decoding_guide": "[0-9]{12}"})
            if all(check_queries.evaluate(prometheus, f"sum(rate({name}[1m])) > 0")[1]
                   for name in ("specdec_output_tokens_total", "specdec_lookup_accepted_draft_tokens_total",
                                "specdec_grammar_accepted_draft_tokens_total",
                                "specdec_grammar_pruned_draft_tokens_total")):
                break
        time.sleep(2)
        rows = check_queries.check(prometheus, rate="1m", range_="2m")
    assert len(rows) >= 30
    failed = [(r["panel"], r["expr"], r["error"]) for r in rows
              if r["status"] != "success" or (not r["series"] and not r["may_be_empty"])]
    assert failed == [], failed
