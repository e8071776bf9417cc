"""How many threads the cpu simulation uses, and the section in which it uses them.

The compiled kernels (runtime/kernels/jit.py) split a convolution into blocks of output
rows and run them on numba's thread pool (``prange``); each block calls BLAS itself
(runtime/kernels/blas.py). Results do not depend on the number of threads: every output
element is computed by one block, by the same code, and every GEMM is exact
(tests/test_threads.py runs whole models with 1, 2 and 3 threads and compares every tensor).

- The number: ``MACEQ_NUM_THREADS`` if set, else the CPUs this process may run on (capped by
  numba's own limit, ``NUMBA_NUM_THREADS``), less those other processes keep busy when the run
  starts (:func:`current`). :func:`limit` overrides it for the process; parallel calibration's
  worker processes use ``limit(1)``.
- :func:`section` wraps one model run: numba's pool gets that many threads. From the run's first
  compiled convolution on (:func:`blas_held`), or from its start when it has one thread, BLAS is
  held to one thread (threadpoolctl), because
  the blocks call it themselves and two pools of spinning threads on the same cores were measured
  20x slower on a busy machine. Nested and concurrent sections share one BLAS limit, restored
  when the last one ends. The first section of a process also sets glibc's heap thresholds
  (runtime/heap.py), so that each run reuses the previous run's large buffers.

Why numba's pool rather than Python threads: a dispatch to a sleeping Python thread was measured
at 60-70 us on this project's 2-vCPU machines (waking a halted vCPU, then a GIL hand-off), more
than most of MobileNetV2's kernels take; numba's OpenMP layer keeps its workers spinning briefly
and dispatches in about 3 us.
"""
from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

from maceq.errors import MaceqError
from maceq.runtime import heap
from maceq.runtime.kernels import blas

try:  # numba is a declared dependency; without it the numpy paths run on one thread
    import numba
except ImportError:  # pragma: no cover
    numba = None

__all__ = ["default_threads", "limit", "current", "busy_cpus", "section", "blas_held", "run_memo"]

_LIMIT: int | None = None
_LOCK = threading.Lock()
_DEPTH = 0
_BLAS_CTX = None
_RUN = threading.local()  # .memo: the calling thread's innermost section's memo


def run_memo() -> dict | None:
    """The memo of the calling thread's current :func:`section` (one model run), None outside one. It holds the
    run's thread count (``"threads"``, what numba's pool has in the section) and whatever the kernels ask once per
    run instead of once per layer (the settings read from the environment: runtime/kernels/jit.py
    ``available``, runtime/kernels/intgemm.py ``supported``): numba's and the environment's answers cost 3-5 us a
    question, asked a few times by each of a model's layers."""
    return getattr(_RUN, "memo", None)


def _numba_max() -> int:
    return 1 if numba is None else max(1, int(numba.config.NUMBA_NUM_THREADS))


def default_threads() -> int:
    """MACEQ_NUM_THREADS if set, else the CPUs this process may use; at most numba's limit."""
    env = os.environ.get("MACEQ_NUM_THREADS", "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise MaceqError(f"MACEQ_NUM_THREADS must be a positive integer, got '{env}'")
    else:
        try:
            n = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            n = os.cpu_count() or 1
    return max(1, min(n, _numba_max()))


def limit(threads: int | None) -> None:
    """Use ``threads`` threads in this process from now on (None: back to the default)."""
    global _LIMIT
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise MaceqError(f"threads must be a positive integer, got {threads!r}")
    _LIMIT = threads


def busy_cpus() -> int | None:
    """Tasks of other processes running or ready to run right now: the kernel's running count
    (/proc/loadavg's fourth field) minus this process's own running threads; None without /proc."""
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
        own = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:  # the thread ended meanwhile
                continue
            own += stat[stat.rindex(")") + 2] == "R"
    except (OSError, ValueError, IndexError):
        return None
    return max(0, running - own)


#: How long :func:`current` reuses an answer of :func:`busy_cpus`: reading /proc took 45-55 us a file on a VM (one
#: file per thread of the process besides /proc/loadavg: 0.15-0.25 ms, 2% of a MobileNetV2 run at batch 1), and
#: a neighbour that starts is still seen within this time.
BUSY_TTL_S = 0.05
_BUSY_SEEN: tuple = (None, 0.0, None)  # (the busy_cpus function asked, time.monotonic() then, its answer)


def _busy_recent() -> int | None:
    """:func:`busy_cpus`, its answer reused for BUSY_TTL_S seconds."""
    global _BUSY_SEEN
    fn, when, answer = _BUSY_SEEN
    now = time.monotonic()
    if fn is not busy_cpus or now - when >= BUSY_TTL_S:
        answer = busy_cpus()
        _BUSY_SEEN = (busy_cpus, now, answer)
    return answer


def current() -> int:
    """The number of threads the kernels use now: an explicit count (:func:`limit`,
    ``MACEQ_NUM_THREADS``) as given; the default, less the CPUs other processes keep busy at this
    moment (:func:`busy_cpus`, its answer reused for BUSY_TTL_S seconds), at least one. A parallel block waits for its slowest thread, so a
    thread that shares its core with another process's makes the whole run wait for the scheduler:
    on 2 vCPUs beside other jobs, 2 threads were measured 5-25x slower than 1."""
    if _LIMIT is not None:
        return max(1, min(_LIMIT, _numba_max()))
    n = default_threads()
    if n > 1 and not os.environ.get("MACEQ_NUM_THREADS", "").strip():
        busy = _busy_recent()
        if busy:
            n = max(1, n - busy)
    return n


@contextmanager
def section(threads: int | None = None, *, hold_blas: bool = False):
    """One model run: numba's pool sized to ``threads`` (default :func:`current`). BLAS is held to one
    thread from the first compiled convolution of the run (:func:`blas_held`) to the run's end, or
    from the start with ``hold_blas`` or when the run has one thread (asked for, or the rest busy:
    BLAS's spinning threads on shared cores made the gpu's GEMMs 2-4x slower). The gpu and dsp
    simulations call BLAS from numpy on GEMMs too small to share: MobileNetV2 at batch 1 took the
    same time with one BLAS thread as with two, and half the CPU time, so their runs hold it."""
    global _DEPTH, _BLAS_CTX
    n = current() if threads is None else threads
    if not isinstance(n, int) or n < 1:
        raise MaceqError(f"threads must be a positive integer, got {n!r}")
    n = min(n, _numba_max())
    heap.steady()  # once per process: the run's large buffers reused by the next run
    if numba is None:
        yield n
        return
    previous = numba.get_num_threads()
    numba.set_num_threads(n)  # per calling thread in numba
    outer_memo, _RUN.memo = run_memo(), {"threads": n}
    with _LOCK:
        _DEPTH += 1
        if (n == 1 or hold_blas) and _BLAS_CTX is None:  # BLAS on one thread for the whole run
            _BLAS_CTX = blas.single_threaded()
            _BLAS_CTX.__enter__()
    try:
        yield n
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0 and _BLAS_CTX is not None:
                ctx, _BLAS_CTX = _BLAS_CTX, None
                ctx.__exit__(None, None, None)
        _RUN.memo = outer_memo
        numba.set_num_threads(previous)


@contextmanager
def blas_held():
    """BLAS on one thread while compiled blocks run on numba's threads (some call BLAS themselves, the
    integer tiles do not, but a later numpy GEMM's spinning BLAS threads would take their cores: with the
    tiles and BLAS left free, a cpu run of MobileNetV2 took 40 ms instead of 14 on 2 vCPUs): inside a
    :func:`section` until the section ends (entered once per run), else for this block only."""
    global _BLAS_CTX
    with _LOCK:
        inside = _DEPTH > 0
        if inside and _BLAS_CTX is None:
            _BLAS_CTX = blas.single_threaded()
            _BLAS_CTX.__enter__()
    if inside:
        yield
        return
    with blas.single_threaded():
        yield
