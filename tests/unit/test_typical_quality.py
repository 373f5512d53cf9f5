"""typical-quality's checks of an answer (JSON that parses, Python that parses) and its summary figures."""

from __future__ import annotations

from specdec_client.typical_quality import json_parses, markdown, python_parses, summarise


def test_json_is_taken_from_a_fence_or_the_first_value():
    assert json_parses('Here it is:\n```json\n{"a": [1, 2]}\n```\nEnjoy.')
    assert json_parses('Sure! {"name": "x", "tags": ["a"]} as asked.')
    assert json_parses('[{"id": 1}]')
    assert not json_parses('```json\n{"a": 1,\n```')  # cut short
    assert not json_parses("No JSON here.")


def test_python_is_taken_from_fences_or_the_whole_answer():
    assert python_parses("```python\ndef f(x):\n    return x + 1\n```\nThis adds one.")
    assert python_parses("def f(x):\n    return x")
    assert not python_parses("```python\ndef f(x:\n```")
    assert not python_parses("This function returns the sum of a list.\n```python\nfor\n```")


def test_summary_compares_each_mode_with_plain():
    def record(text: str, tokens: int, latency: float, drafted: int = 0, accepted: int = 0) -> dict:
        return {"id": "x", "text": text, "tokens": tokens, "latency_s": latency, "drafted": drafted,
                "accepted": accepted}

    results = {"json": {
        "plain": [record('{"a": 1}', 10, 1.0), record('{"b": 2}', 10, 1.0)],
        "typical 0.7": [record('{"a": 1}', 10, 0.5, 8, 6), record('{"b": 3', 10, 0.5, 8, 2)],
    }}
    summary = summarise(results)
    plain, typical = summary["json"]["plain"], summary["json"]["typical 0.7"]
    assert plain["equal_to_plain"] == 2 and plain["bleu_vs_plain"] == 100.0 and plain["json_valid"] == 2
    assert typical["equal_to_plain"] == 1 and typical["json_valid"] == 1 and typical["speedup"] == 2.0
    assert typical["alpha"] == 0.5 and 0 < typical["bleu_vs_plain"] < 100
    assert "| json | typical 0.7 | 2 | 1 | 1 |" in markdown(summary)
