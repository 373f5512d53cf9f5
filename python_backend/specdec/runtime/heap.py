"""Keep the memory a decoder process frees, so the large arrays it allocates under load reuse pages it has
already touched.

Under load a decoder allocates and frees arrays of tens to hundreds of MB: a batch's gathered context
(specdec.runtime.context_buffer), a partial wave's gather, logits. glibc's malloc serves each from a fresh
`mmap` and unmaps it on free, so the next one faults every page in again; on a VM whose freed guest pages go
back to the host (this machine's do after ~2 s), a fault costs ~3 ms per MB: a 250 MB gather took 450-800 ms
into fresh pages against ~20 ms into pages the process kept. With every allocation served from the heap and
the heap never trimmed, the process holds its peak and reuses it; its resident memory stays at that peak
(what a deployment provisions for anyway) instead of following the load down.

Only the thread that runs the forwards matters: glibc's heap-only mode applies to the main arena, the one
Triton's Python backend runs `execute` in (a secondary thread's arena still maps allocations larger than its
64 MB heaps).
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # glibc mallopt parameters (malloc.h)
M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Ask glibc to serve every allocation from its heap (no `mmap`) and never return freed heap memory to the
    kernel. False where the C library is not glibc (nothing changes there)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc only
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
