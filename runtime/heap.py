"""The C heap of a process that runs the simulation: large buffers reused from run to run.

A model run allocates and frees the same large arrays every time (padded inputs, im2col rows,
accumulators, outputs: about 30 MB a run for MobileNetV2 at batch 8). glibc serves a request above
its mmap threshold with a fresh mapping, and gives back the top of its heap once more than its trim
threshold lies free there; either way the next run touches new pages, one page fault per 4 KiB.
glibc adapts both thresholds to the largest chunk freed so far, which holds for one array at a
time but not for several freed together: three 12 MB arrays allocated and freed in a loop fault
about 1,500 times a round with glibc's own settings and never after the first with the settings
below (tests/test_heap.py). Measured on MobileNetV2 at batch 8 after onnxruntime had run in the same
process (as in ``maceq report`` and bench/speed.py): 7,500 page faults a run and 80-90 ms, against
40 faults and 57-67 ms with these settings.

:func:`steady` fixes the mmap threshold at glibc's largest (32 MiB), so that freed arrays up to that
size stay in the heap, and the trim threshold at 256 MiB, so that up to that much free memory stays
mapped for the next run. The cost is resident memory: freed memory is not handed back to the system
until more than 256 MiB lie free at the top of the heap. It is done once per process, on the first
model run (runtime/threads.py's ``section``); ``MACEQ_NO_MALLOPT=1`` leaves glibc's settings alone,
and on a C library other than glibc nothing is done.
"""
from __future__ import annotations

import ctypes
import os
import threading

__all__ = ["steady", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]

MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit systems
TRIM_THRESHOLD = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h
_LOCK = threading.Lock()
_STATE: bool | None = None


def _glibc():
    """glibc's handle, or None where the process's C library is another one."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it
    except (OSError, AttributeError):
        return None
    return libc


def steady() -> bool:
    """Once per process: glibc's mmap threshold at 32 MiB and trim threshold at 256 MiB. True when
    they are set (now or before), False with ``MACEQ_NO_MALLOPT=1`` or a C library other than glibc."""
    global _STATE
    with _LOCK:
        if _STATE is None:
            libc = None if os.environ.get("MACEQ_NO_MALLOPT", "").strip() else _glibc()
            _STATE = bool(libc is not None
                          and libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                          and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
        return _STATE
