"""How two runtimes' logits are compared (exports, engines, devices): one definition for tests and tools."""

from __future__ import annotations

import numpy as np


def logit_parity(expected: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    """(max |difference| over finite logits, argmax agreement) of two [positions, vocab] arrays.

    A draft with a proposal vocabulary gives -inf outside it (specdec.checkpoint.read_proposal_vocab): both
    runtimes must put their -inf at the same places, which is checked, and only finite logits are compared
    (-inf - -inf is nan)."""
    finite = np.isfinite(expected)
    if not np.array_equal(finite, np.isfinite(got)):
        raise AssertionError("the runtimes disagree on which logits are -inf")
    return float(np.abs(expected[finite] - got[finite]).max()), float((expected.argmax(-1) == got.argmax(-1)).mean())
