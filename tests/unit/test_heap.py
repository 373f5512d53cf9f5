"""specdec.runtime.heap: a process that keeps its freed memory holds a large array's pages after freeing it
(and reuses them), where glibc's default unmaps them at once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CHILD = """
import sys
import numpy as np
sys.path.insert(0, {backend!r})
from specdec.runtime.heap import keep_freed_memory

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

kept = keep_freed_memory() if {keep} else False
before = rss_mib()
array = np.ones(64 << 18, dtype=np.float32)  # 64 MiB, every page touched
del array
print(kept, round(rss_mib() - before))
"""


def rss_kept_after_free(keep: bool) -> tuple[str, int]:
    backend = str(Path(__file__).resolve().parents[2] / "python_backend")
    out = subprocess.run([sys.executable, "-c", CHILD.format(backend=backend, keep=keep)], check=True,
                         capture_output=True, text=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not Path("/proc/self/status").exists() or sys.platform != "linux", reason="Linux /proc only")
def test_freed_memory_stays_in_the_process_only_when_asked():
    kept, held = rss_kept_after_free(keep=True)
    if kept != "True":
        pytest.skip("not glibc")
    assert held >= 60  # the 64 MiB array's pages stay resident, ready for the next array
    assert rss_kept_after_free(keep=False)[1] < 8  # glibc's default: unmapped on free
