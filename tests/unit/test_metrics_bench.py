"""bench's arithmetic: percentiles, per-cell figures, speedup, the model bound, the iteration split, reports."""

from __future__ import annotations

import pytest
from specdec_client import bench
from specdec_client.scrape import Scrape


def test_percentile_interpolates_like_numpy():
    assert bench.percentile([], 50) is None
    assert bench.percentile([3.0], 99) == 3.0
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert bench.percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)


def cell(mode: str, latency: float, tokens: int, server: dict[str, float], n: int = 4) -> bench.Cell:
    c = bench.Cell("json", mode, 1, wall_s=latency * n, server=server)
    for i in range(n):
        c.records.append(bench.Record("json", mode, 1, 0, i, latency, 0.01, tokens,
                                      draft_tokens=40 if mode == bench.SPECULATIVE else 0,
                                      accepted_draft_tokens=30 if mode == bench.SPECULATIVE else 0))
    return c


def test_summary_speedup_bound_and_split():
    # plain: 128 target calls of 4 ms compute; speculative: 40 passes of k=4 (2 ms per draft call), 6 ms verify.
    plain = cell(bench.PLAIN, 1.0, 128, {"target_calls": 4 * 129, "target_compute_us": 4 * 129 * 4000,
                                          "target_queue_us": 0, "draft_calls": 0})
    spec = cell(bench.SPECULATIVE, 0.5, 128, {
        "passes": 160, "proposed": 160, "accepted": 120, "target_calls": 4 * 41, "draft_calls": 160,
        "target_compute_us": 4 * 41 * 6000, "draft_compute_us": 160 * 8000, "target_queue_us": 0,
        "draft_queue_us": 0})
    summaries = []
    for c in (plain, spec):
        s = c.summary()
        s["draft_calls_per_target_call"] = c.server["draft_calls"] / c.server["target_calls"]
        summaries.append(s)
    p, s = summaries
    assert p["tok_per_s"] == pytest.approx(128) and s["tok_per_s"] == pytest.approx(256)
    assert s["alpha"] == pytest.approx(0.75) and s["tau"] == pytest.approx(280 / 160)
    assert s["k_mean"] == pytest.approx(1.0) and s["itl_mean_s"] == pytest.approx((0.5 - 0.01) / 127)
    ratios = bench.derived(summaries, ["json"])["json"]
    assert ratios["speedup"] == pytest.approx(2.0)
    c, v = 8.0 / 1.0 / 4.0, 6.0 / 4.0
    assert ratios["c"] == pytest.approx(c) and ratios["v"] == pytest.approx(v)
    assert ratios["model_bound"] == pytest.approx((280 / 160) / (1.0 * c + v))
    split = ratios["iteration_split_ms"]
    assert split["target_compute_ms"] == pytest.approx(6.0)
    assert split["draft_compute_ms"] == pytest.approx(8.0 * 160 / 164)
    assert sum(split.values()) == pytest.approx(ratios["iteration_ms"])


def test_server_deltas_filter_by_task_and_model():
    text = """
specdec_verification_passes_total{model="speculative_decoding",task="json"} 10
specdec_verification_passes_total{model="speculative_decoding",task="code"} 99
nv_inference_compute_infer_duration_us{model="target_model",version="1"} 5000
nv_inference_compute_infer_duration_us{model="draft_model",version="1"} 700
"""
    deltas = bench.server_deltas(Scrape.parse(text), "json")
    assert deltas["passes"] == 10 and deltas["target_compute_us"] == 5000 and deltas["draft_compute_us"] == 700


def test_reports_are_written(tmp_path):
    plain = cell(bench.PLAIN, 1.0, 128, {})
    spec = cell(bench.SPECULATIVE, 0.5, 128, {})
    hf = cell(bench.HF_ASSISTED, 0.8, 128, {})
    summaries = [c.summary() for c in (plain, spec, hf)]
    results = {"machine": {"time_utc": "t", "git_commit": "c", "cpu": "cpu", "cores": 2, "load_average": [1, 1, 1],
                           "models": {"target_model": {"num_hidden_layers": 12, "hidden_size": 256}}},
               "cells": summaries, "derived": bench.derived(summaries, ["json"]), "memory": None,
               "fidelity": bench.fidelity({("json", m, 1): c for m, c in
                                           ((bench.PLAIN, plain), (bench.SPECULATIVE, spec))})}
    report = bench.markdown(results)
    assert "| json | speculative | 1 | 4 |" in report and "2.00×" in report
    assert results["fidelity"][bench.SPECULATIVE] == {"equal": 4, "compared": 4}
    written = bench.plots(results, tmp_path)
    assert [p.name for p in written] == ["speedup.png", "throughput.png"]
    assert all(p.stat().st_size > 10_000 for p in written)


def test_fidelity_compares_each_concurrency_with_plain_at_that_concurrency():
    def texts(mode: str, concurrency: int, outputs: list[str]) -> bench.Cell:
        c = bench.Cell("code", mode, concurrency)
        c.records = [bench.Record("code", mode, concurrency, 0, i, 1.0, 0.1, 8, text=t)
                     for i, t in enumerate(outputs)]
        return c

    cells = {("code", bench.PLAIN, 1): texts(bench.PLAIN, 1, ["a", "b"]),
             ("code", bench.SPECULATIVE, 1): texts(bench.SPECULATIVE, 1, ["a", "b "]),
             ("code", bench.PLAIN, 4): texts(bench.PLAIN, 4, ["a", "b", "a", "b"]),
             ("code", bench.SPECULATIVE, 4): texts(bench.SPECULATIVE, 4, ["a", "x", "a", "b"]),
             ("code", bench.SPECULATIVE, 16): texts(bench.SPECULATIVE, 16, ["a"])}  # no plain cell to compare
    result = bench.fidelity(cells)
    assert result[bench.SPECULATIVE] == {"equal": 2, "compared": 2}
    assert result[f"{bench.SPECULATIVE} at concurrency 4"] == {"equal": 3, "compared": 4}
    assert result[f"{bench.SPECULATIVE} at concurrency 16"] == {"equal": 0, "compared": 0}


def test_fidelity_mismatches_say_where_an_output_leaves_plain_decoding():
    def texts(mode: str, outputs: list[str]) -> bench.Cell:
        c = bench.Cell("json", mode, 1)
        c.records = [bench.Record("json", mode, 1, 0, i, 1.0, 0.1, 8, text=t) for i, t in enumerate(outputs)]
        return c

    cells = {("json", bench.PLAIN, 1): texts(bench.PLAIN, ['{"a": 1, "b": 2}', "same"]),
             ("json", bench.SPECULATIVE, 1): texts(bench.SPECULATIVE, ['{"a": 1, "c": 2}', "same "])}
    [mismatch] = bench.fidelity_mismatches(cells)
    assert mismatch["prompt"] == 0 and mismatch["mode"] == bench.SPECULATIVE and mismatch["concurrency"] == 1
    assert mismatch["first_difference_char"] == 10
    assert mismatch["plain"].endswith('"b": 2}') and mismatch["speculative"].endswith('"c": 2}')
    report = bench.markdown({"machine": {"time_utc": "t", "git_commit": "c", "cpu": "cpu", "cores": 2,
                                         "load_average": [1, 1, 1], "models": {}},
                             "cells": [], "derived": {}, "memory": None, "fidelity": bench.fidelity(cells),
                             "fidelity_mismatches": [mismatch]})
    assert "- differs: json request 0" in report and "from character 10" in report


def test_gpu_memory_is_attributed_to_the_decoders_processes():
    used = bench.parse_compute_apps("4100, 2150\n4101, 610\n4101, 10\n4200, 600\nNo running processes found\n")
    assert used == {4100: 2150 * 2**20, 4101: 620 * 2**20, 4200: 600 * 2**20}
    instances = {"target_model_0_0": 4100, "draft_model_0_0": 4101, "eagle_draft_0_1": 4200,
                 "speculative_decoding_0_0": 4300, "draft_model_0_1": 4999}  # 4999: not on a GPU
    per_model = bench.gpu_memory_per_model(instances, used)
    assert per_model == {"target_model": 2150 * 2**20, "draft_model": 620 * 2**20, "eagle_draft": 600 * 2**20}
    model = {"resident": 2**30, "proportional": 2**30, "unique": 2**29, "kv_cache_bytes": 2**28}
    memory = {"per_model": {"target_model": model, "draft_model": model}, "footprint_bytes": 2**32,
              "footprint_source": "PSS", "overhead_fraction": 0.1, "kv_cache_overhead_fraction": 0.03,
              "gpu": {"per_model_bytes": per_model, "drafters_overhead_fraction": 1220 / 2150}}
    report = bench.markdown({"machine": {"time_utc": "t", "git_commit": "c", "cpu": "cpu", "cores": 2,
                                         "load_average": [1, 1, 1], "models": {}, "gpus": ["NVIDIA H200"]},
                             "cells": [], "derived": {}, "memory": memory})
    assert "GPU: NVIDIA H200" in report and "target_model 2150 MiB" in report and "**57%** of the target's" in report


def test_memory_overhead_counts_every_loaded_drafter_and_each_alone():
    class FakeScrape:
        uss = {"target_model": 1800, "draft_model": 200, "eagle_draft": 210, "speculative_decoding": 60}

        def total(self, name: str, model: str) -> float:
            if name == "specdec_kv_cache_bytes":
                return {"target_model": 720, "draft_model": 24, "eagle_draft": 24}.get(model, 0) * 2**20
            return self.uss[model] * 2**20 * (1.02 if "proportional" in name else 1.0)

    memory = bench.server_memory(FakeScrape(), server=None)
    assert memory["drafters_loaded"] == ["draft_model", "eagle_draft"]
    footprint = sum(FakeScrape.uss.values()) * 1.02  # PSS of the reporting processes
    assert memory["overhead_fraction"] == pytest.approx(410 / (footprint - 410))
    assert memory["overhead_fraction_each"]["eagle_draft"] == pytest.approx(210 / (footprint - 410))
    report = bench.markdown({"machine": {"time_utc": "t", "git_commit": "c", "cpu": "cpu", "cores": 2,
                                         "load_average": [1, 1, 1], "models": {}},
                             "cells": [], "derived": {}, "memory": memory})
    assert "The drafter processes loaded (draft_model, eagle_draft)" in report
    assert "each alone (a repository holding only that drafter model): draft_model" in report

    FakeScrape.uss = {**FakeScrape.uss, "draft_model": 0}  # a repository that left the draft model out
    alone = bench.server_memory(FakeScrape(), server=None)
    assert alone["drafters_loaded"] == ["eagle_draft"]
    assert alone["overhead_fraction"] == pytest.approx(alone["overhead_fraction_each"]["eagle_draft"])


def test_repeated_share_counts_the_words_inside_repeated_4grams():
    assert bench.repeated_share("") == 0.0 and bench.repeated_share("one two three") == 0.0
    loop = "I am the one. " * 3  # the 4-grams of a 4-word phrase said 3 times: every word inside one
    assert bench.repeated_share(loop) == 1.0
    assert bench.repeated_share(loop + " ".join(f"w{i}" for i in range(12))) == pytest.approx(12 / 24)
    assert bench.repeated_share("a b c d a b c d x y") == 0.0  # twice is not a loop


def test_speedup_without_looping_answers_pairs_the_same_requests():
    """Only the (round, prompt) pairs where neither answer loops count; sampled labels stay out of fidelity."""
    looping, varied = "go on and on " * 10, " ".join(f"w{i}" for i in range(40))

    def texts(label: str, mode: str, outputs: list[tuple[str, float]]) -> bench.Cell:
        c = bench.Cell(label, mode, 1)
        c.records = [bench.Record(label, mode, 1, 0, i, latency, 0.1, 40, text=t)
                     for i, (t, latency) in enumerate(outputs)]
        return c

    cells = {("json t0.7", bench.PLAIN, 1): texts("json t0.7", bench.PLAIN, [(looping, 4.0), (varied, 2.0)]),
             ("json t0.7", bench.SPECULATIVE, 1): texts("json t0.7", bench.SPECULATIVE,
                                                          [(looping, 1.0), (varied + " x", 1.6)])}
    got = bench.not_looping_speedup(cells, "json t0.7", bench.SPECULATIVE)
    assert got["not_looping_pairs"] == 1 and got["pairs"] == 2
    assert got["speedup_not_looping"] == pytest.approx(2.0 / 1.6)
    summary = cells[("json t0.7", bench.SPECULATIVE, 1)].summary()
    assert summary["looping_requests"] == 1 and summary["repeated_share"] == pytest.approx(0.5)
    assert bench.fidelity(cells)[bench.SPECULATIVE] == {"equal": 0, "compared": 0}  # sampled: not compared
    assert bench.label_of("json", "greedy") == "json" and bench.label_of("json", "t1.0") == "json t1.0"
