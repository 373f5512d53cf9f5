"""The docs' result folders: every folder under docs/bench is cited by a document, and the index lists them all
(scripts/bench_index.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_result_folder_is_cited_and_the_index_is_current():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_index.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
