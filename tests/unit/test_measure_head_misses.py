"""build/measure_head_misses.py: which spellings of a context token count as a copy, and that an unknown domain is
refused before any model loads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "build"))

import measure_head_misses  # noqa: E402

VOCAB = {"Ġhumidity": 1, "humidity": 2, "Humidity": 3, "Ġgrade": 4, "grade": 5, "{": 6, "Ġ{": 7, "ĠMaria": 8}


def test_spelling_variants_add_or_drop_the_leading_space_or_flip_the_first_letters_case() -> None:
    spelling = {i: s for s, i in VOCAB.items()}
    assert measure_head_misses.spelling_variants(1, VOCAB, spelling) == {2}  # " humidity" -> "humidity"
    assert measure_head_misses.spelling_variants(2, VOCAB, spelling) == {1, 3}
    assert measure_head_misses.spelling_variants(5, VOCAB, spelling) == {4}
    assert measure_head_misses.spelling_variants(6, VOCAB, spelling) == {7}  # no case to flip
    assert measure_head_misses.spelling_variants(8, VOCAB, spelling) == set()  # "Maria" is not a token here


def test_an_unknown_domain_is_refused_before_any_model_loads(capsys) -> None:
    with pytest.raises(SystemExit):
        measure_head_misses.main(["--domains", "json,poetry"])
    assert "poetry" in capsys.readouterr().err
