"""peer-bench's pure parts: the requests each engine gets, the SSE parsing, the pooled figures, ratios, tables."""

from __future__ import annotations

import pytest
from specdec_client import peers
from specdec_client.peers import LLAMA_F32, LLAMA_Q4, OURS, VLLM, Cell, Sample

REQUEST = {"message": "Write a Python function to flatten a nested list of integers.", "task": "code"}


def test_chat_requests_are_the_user_turns_of_the_held_out_prompts():
    requests = peers.chat_requests()
    prompts = peers.load_prompts()
    assert len(requests) == len(prompts) >= 24
    assert requests[0]["message"].startswith("Produce a JSON object for a hotel booking")
    assert {r["task"] for r in requests} == {"json", "code", "text"}
    # The message is exactly what sits between the user markers: no template left inside it.
    for r, p in zip(requests, prompts, strict=True):
        assert f"<|im_start|>user\n{r['message']}<|im_end|>" in p["prompt"]
        assert "<|im_" not in r["message"]
    with pytest.raises(ValueError):
        peers.chat_requests([{"prompt": "no chat markers", "task": "text"}])


def test_greedy_body_is_the_same_request_on_every_engine_but_engine_options():
    bodies = {e: peers.request_body(e, "m", REQUEST, "greedy", 3, 128) for e in peers.ENGINES}
    for body in bodies.values():
        assert body["messages"] == [{"role": "user", "content": REQUEST["message"]}]
        assert body["max_tokens"] == 128 and body["temperature"] == 0.0
        assert "seed" not in body and "top_p" not in body
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert bodies[OURS]["task"] == "code"
    assert "task" not in bodies[VLLM]
    for llama in (LLAMA_Q4, LLAMA_F32):  # llama-server's truncating defaults are switched off
        assert bodies[llama]["top_k"] == 0 and bodies[llama]["min_p"] == 0.0
    assert "top_k" not in bodies[OURS] and "top_k" not in bodies[VLLM]


def test_sampled_bodies_carry_the_same_seed_per_request_index_on_every_engine():
    seeds = {e: peers.request_body(e, "m", REQUEST, "t0.7", 5, 64)["seed"] for e in peers.ENGINES}
    assert set(seeds.values()) == {peers.SEED_BASE + 5}
    body = peers.request_body(VLLM, "m", REQUEST, "t0.7", 6, 64)
    assert body["seed"] == peers.SEED_BASE + 6 and body["temperature"] == 0.7 and body["top_p"] == 0.95


def test_fixed_length_uses_each_engines_own_option_and_streaming_can_be_off():
    ours = peers.request_body(OURS, "m", REQUEST, "greedy", 0, 32, fixed_length=True, task_hint=False,
                              stream=False)
    assert ours["min_tokens"] == 32 and "task" not in ours and "stream" not in ours and "stream_options" not in ours
    assert peers.request_body(VLLM, "m", REQUEST, "greedy", 0, 32, fixed_length=True)["min_tokens"] == 32
    llama = peers.request_body(LLAMA_Q4, "m", REQUEST, "greedy", 0, 32, fixed_length=True)
    assert llama["ignore_eos"] is True and "min_tokens" not in llama


def test_stream_events_give_ttft_text_usage_and_errors():
    sample, pieces = Sample(0), []
    started = peers.time.perf_counter()
    peers._consume({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, sample, started, pieces)
    assert sample.ttft_s is None  # the role chunk carries no text
    peers._consume({"choices": [{"delta": {"content": "Hi"}, "finish_reason": None}]}, sample, started, pieces)
    first = sample.ttft_s
    peers._consume({"choices": [{"delta": {"content": " there"}, "finish_reason": "stop"}]}, sample, started, pieces)
    peers._consume({"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 31}}, sample, started, pieces)
    assert first is not None and sample.ttft_s == first
    assert "".join(pieces) == "Hi there" and sample.finish_reason == "stop"
    assert sample.completion_tokens == 3 and sample.prompt_tokens == 31 and sample.error is None
    whole = Sample(1)
    peers._consume({"choices": [{"message": {"content": "ok"}, "finish_reason": "length"}],
                    "usage": {"completion_tokens": 7, "prompt_tokens": 9}}, whole, started, [])
    assert whole.completion_tokens == 7 and whole.finish_reason == "length" and whole.ttft_s is None
    failed = Sample(2)
    peers._consume({"error": {"message": "boom"}}, failed, started, [])
    assert "boom" in failed.error


def cell(engine: str, block: int, wall: float, tokens: list[int], latency: float = 1.0, texts: list[str] | None = None,
         error_at: int | None = None) -> Cell:
    samples = [Sample(i, latency_s=latency + i * 0.1, ttft_s=0.05, completion_tokens=t, prompt_tokens=31,
                      finish_reason="length", text=(texts or [""] * len(tokens))[i],
                      error="HTTP 500" if i == error_at else None) for i, t in enumerate(tokens)]
    return Cell(engine, "greedy", 2, block, wall, samples)


def test_figures_pool_blocks_count_only_answered_tokens_and_compare_texts():
    cells = [cell(OURS, 0, 2.0, [100, 100], texts=["a", "b"]), cell(OURS, 1, 2.0, [100, 100], texts=["a", "b"]),
             cell(VLLM, 0, 4.0, [100, 100], texts=["a", "x"]), cell(VLLM, 1, 1.0, [100, 50], texts=["a", "b"],
                                                                  error_at=1)]
    figures = peers.aggregate(cells)
    ours, vllm = figures[OURS]["greedy c=2"], figures[VLLM]["greedy c=2"]
    assert ours["tok_per_s"] == 100.0 and ours["tok_per_s_per_block"] == [100.0, 100.0]
    assert ours["requests"] == 4 and ours["errors"] == 0 and ours["mean_prompt_tokens"] == 31
    assert "same_text_as_ours" not in ours
    # The failed request's 50 tokens do not count: 300 tokens over 5 s.
    assert vllm["tok_per_s"] == 60.0 and vllm["tok_per_s_per_block"] == [50.0, 100.0] and vllm["errors"] == 1
    assert vllm["same_text_as_ours"] == pytest.approx(2 / 3, abs=1e-3)
    assert vllm["p50_latency_s"] == 1.0 and vllm["p99_latency_s"] == pytest.approx(1.098)

    r = peers.ratios(figures)
    assert set(r) == {VLLM}
    assert r[VLLM]["greedy c=2"]["tok_per_s"] == pytest.approx(100 / 60, abs=1e-3)
    assert r[VLLM]["greedy c=2"]["tok_per_s_per_block"] == [2.0, 1.0]
    assert r[VLLM]["greedy c=2"]["p50_latency"] == pytest.approx(1.05 / 1.0)


def test_markdown_has_one_row_per_engine_one_column_per_cell_and_the_ratios():
    cells = [cell(OURS, 0, 2.0, [100, 100]), cell(LLAMA_Q4, 0, 4.0, [100, 100])]
    results = {"figures": peers.aggregate(cells), "machine": {"time_utc": "T"},
               "labels": {OURS: "ours (x)", LLAMA_Q4: "llama.cpp (GGUF Q4_1 as shipped)"},
               "settings": {"max_tokens": 128, "stream": True, "fixed_length": False, "blocks": 1, "requests": 0},
               "idle": {OURS: {"cpu_percent": 1.5, "rss_mib": 2048, "processes": 5}}}
    results["ratios"] = peers.ratios(results["figures"])
    text = peers.markdown(results)
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| engine"))
    assert header == "| engine (weights) | greedy c=2 |"
    assert "| ours (x) | **100.0** · 1.05 / 1.10 · 0.050 |" in lines
    assert "| llama.cpp (GGUF Q4_1 as shipped) | **50.0** · 1.05 / 1.10 · 0.050 |" in lines
    assert "| llama.cpp (GGUF Q4_1 as shipped) | **2.00×** · 1.00× |" in lines
    assert "ours (x) 1.5% of a core, 2048 MiB RSS" in text


def test_missing_names_what_install_must_make(tmp_path):
    layout = peers.Layout(tmp_path)
    assert peers.missing(layout, [OURS]) == []
    assert peers.missing(layout, [VLLM]) == [str(layout.vllm_bin)]
    assert peers.missing(layout, [LLAMA_Q4, LLAMA_F32]) == sorted([str(layout.llama_server), str(layout.f32_gguf)])
