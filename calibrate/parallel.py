"""Parallel calibration: the image list sharded over local processes or Ray tasks, merged exactly.

:func:`collect_parallel` returns the :class:`~maceq.calibrate.stats.StatsCollector` that
:func:`maceq.calibrate.runner.collect` gives on the whole folder in one process, bit for bit
(tests/test_parallel.py proves it against onnxruntime run directly and a plain-numpy histogram).

Sharding rule (:func:`shard_ranges`)
------------------------------------
The sorted file list of the :class:`~maceq.datasets.images.ImageFolder` is cut into batches of
``batch_size`` files, ``files[b*B:(b+1)*B]``, exactly as a single-process pass would batch them
when every file is readable. The ``nb`` batches go to ``S = min(workers, nb)`` shards as
contiguous runs: shard ``s`` takes batches ``floor(s*nb/S) .. floor((s+1)*nb/S) - 1``. Each shard
is one task: it decodes its files with the folder's :class:`Preprocess`, skips unreadable ones
(as :meth:`ImageFolder.iter_batches` does; a shard with no readable file contributes empty
statistics), builds its own onnxruntime session from the serialized model and its own
StatsCollector, and ships back ``StatsCollector.to_dict()`` with its image count, the paths it
skipped and its UnreadableImageWarning messages.

Merge rule and why it is exact
------------------------------
The parent merges the shards in shard order with :meth:`StatsCollector.merge` (the rule is
in calibrate/stats.py):

* count is a sum of ints; min and max are min and max of exact floats: exact in any order, so
  ``min_max`` ranges are bit-identical to a single-process run.
* the histogram lives on the grid of width ``2**e`` anchored at 0, where ``e`` and the window
  base are functions of the global (min, max) only; re-binning a shard's counts to the merged
  grid is ``k -> k >> (e_merged - e_shard)``, and ``floor(floor(x / 2**a) / 2**d) ==
  floor(x / 2**(a + d))``, so every value lands in the bin a single pass over all data gives it.
  Counts are int64 sums. Hence the merged histogram is identical for any sharding and any merge
  order, and so are ``percentile``, ``mse`` and ``kl``, which are pure functions of it.
* the per-sample activations themselves do not depend on the sharding: onnxruntime's CPU
  kernels give each sample the same float32 values whatever the batch composition and the
  intra-op thread count (measured on MobileNetV2: 0 differing tensors of 64 across batch sizes
  1/3/8 and 1/2/default threads; the tests check the end result on every run).

Memory: a worker holds one batch at a time and gives the heap's free pages back to the OS after
each batch (:func:`trimmed_batches`), so its peak resident size does not grow with the number of
images.

Skipped files: the shard counts are summed and the skipped paths concatenated in shard order,
which is file order, so ``data.skipped`` and ``data.skipped_paths`` equal those of a
single-process pass; the warnings are re-emitted in the parent in the same order.

Executors (:class:`Executor`, :class:`TaskPool`)
-----------------------------------------------
* ``local``: :class:`concurrent.futures.ProcessPoolExecutor` with the ``forkserver`` start method where the
  platform has it, else ``spawn`` (onnxruntime's thread pools do not survive ``fork``; the forkserver is a clean
  process that imports the simulation once, calibrate/forkserver.py). ``workers == 1`` runs
  :func:`~maceq.calibrate.runner.collect` in this process instead (on the same batches: the
  result is the same function of the data either way). Each process gets
  ``max(1, cpu_count // workers)`` onnxruntime intra-op threads unless told otherwise.
* ``ray``: one Ray task per shard (``num_cpus=1``, one intra-op thread). Ray is started with
  ``ray.init(address=ray_address)`` when an address is given (or ``RAY_ADDRESS`` is set), else
  as a local instance with ``num_cpus=workers``; a Ray already initialised in this process is
  used as it is. Install it with ``pip install 'maceq[ray]'``. On a multi-node cluster every
  node must see the image files (and, for the mixed-precision search, the source ONNX) at the
  same paths, and have maceq installed; see docs/parallel.md.

The same pool runs the candidate evaluations of the mixed-precision search (app/mixed.py).
"""
from __future__ import annotations

import ctypes
import os
import sys
import warnings
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from tqdm import tqdm

from maceq.calibrate import forkserver
from maceq.calibrate.runner import as_model_proto, collect, expose_outputs
from maceq.calibrate.stats import DEFAULT_BINS, StatsCollector
from maceq.datasets.images import ImageFolder, UnreadableImageWarning
from maceq.datasets.preprocess import Preprocess
from maceq.errors import MaceqError
from maceq.runtime import threads

if TYPE_CHECKING:  # onnx is imported where it is used: it takes about a second to import
    import onnx

__all__ = ["Executor", "TaskPool", "collect_parallel", "shard_ranges", "default_intra_op_threads"]

RAY_HINT = "pip install 'maceq[ray]'"


class Executor(Enum):
    """Where shards and candidate evaluations run."""

    LOCAL = "local"
    RAY = "ray"

    @classmethod
    def parse(cls, value: "str | Executor") -> "Executor":
        if isinstance(value, Executor):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        raise MaceqError(f"executor must be one of {', '.join(e.value for e in cls)}, got {value!r}")


def check_workers(workers: Any) -> int:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise MaceqError(f"workers must be a positive int, got {workers!r}")
    return workers


def default_intra_op_threads(executor: "str | Executor", workers: int) -> int:
    """onnxruntime intra-op threads per shard: the local cores split over the workers; 1 on Ray."""
    if Executor.parse(executor) is Executor.RAY:
        return 1
    return max(1, (os.cpu_count() or 1) // max(1, workers))


def shard_ranges(n_files: int, *, batch_size: int, shards: int) -> list[tuple[int, int]]:
    """``[start, stop)`` file-index ranges of the shards (module docstring): whole batches of
    ``batch_size`` files, split into ``min(shards, n_batches)`` contiguous runs of
    ``floor(s*nb/S) .. floor((s+1)*nb/S) - 1`` batches."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise MaceqError(f"batch size must be a positive int, got {batch_size!r}")
    check_workers(shards)
    nb = -(-n_files // batch_size)
    s_count = min(shards, nb)
    out = []
    for s in range(s_count):
        b0, b1 = s * nb // s_count, (s + 1) * nb // s_count
        out.append((b0 * batch_size, min(b1 * batch_size, n_files)))
    return out


# ------------------------------------------------------------------------------------------------
# The task pool: local processes or Ray tasks
# ------------------------------------------------------------------------------------------------

# State of a local worker process, set once by the pool's initializer.
_WORKER_SHARED: Any = None
_WORKER_QUEUE: Any = None


def _init_local_worker(shared: Any, queue: Any) -> None:
    global _WORKER_SHARED, _WORKER_QUEUE
    _WORKER_SHARED, _WORKER_QUEUE = shared, queue
    _one_thread()


def _one_thread() -> None:
    """Workers are one per core already: their simulations run single-threaded (runtime/threads.py)."""
    threads.limit(1)


def _run_local(fn: Callable, item: Any) -> Any:
    report = None if _WORKER_QUEUE is None else _WORKER_QUEUE.put
    return fn(_WORKER_SHARED, item, report)


def _run_ray(fn: Callable, shared: Any, item: Any) -> Any:
    # Ray resolves the top-level ObjectRef argument ``shared`` to its value before the call.
    _one_thread()
    return fn(shared, item, None)


def import_ray():
    """The ``ray`` module, or MaceqError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise MaceqError(f"--executor ray needs the Ray package: {RAY_HINT}") from None
    return ray


def init_ray(*, address: str | None, num_cpus: int):
    """``ray`` after making sure it is initialised (see the module docstring); returns the module."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    address = address or os.environ.get("RAY_ADDRESS") or None
    try:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    except Exception as e:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ValueError...
        where = f"the Ray cluster at {address}" if address else "a local Ray instance"
        raise MaceqError(f"cannot start or reach {where}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") \
            from None
    return ray


class TaskPool:
    """Runs ``fn(shared, item, report)`` for each item on local processes or Ray tasks.

    ``shared`` is shipped once per local process (pool initializer) or once to Ray's object
    store. ``fn`` must be a module-level function; ``report(n)``, when not None, advances the
    caller's progress bar from inside a local task (None on Ray: the bar advances as tasks end).
    :meth:`map` returns the results in item order. A MaceqError raised in a task is raised again
    here with its one-line message.
    """

    def __init__(self, shared: Any, *, executor: "str | Executor" = "local", workers: int = 2,
                 ray_address: str | None = None, progress_queue: bool = False) -> None:
        self.executor = Executor.parse(executor)
        self.workers = check_workers(workers)
        self._pool = None
        self._queue = None
        self._ray = None
        if self.executor is Executor.LOCAL:
            ctx = forkserver.context()
            self._queue = ctx.Queue() if progress_queue else None
            self._pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=ctx,
                                             initializer=_init_local_worker, initargs=(shared, self._queue))
        else:
            ray = self._ray = init_ray(address=ray_address, num_cpus=self.workers)
            self._shared_ref = ray.put(shared)
            self._remote = ray.remote(num_cpus=1, max_retries=0)(_run_ray)

    def __enter__(self) -> "TaskPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._queue is not None:
            self._queue.close()
            self._queue.join_thread()
            self._queue = None
        self._shared_ref = None

    def map(self, fn: Callable, items: Sequence[Any], *, on_progress: Callable[[int], None] | None = None,
            on_done: Callable[[int, Any], None] | None = None) -> list:
        """``[fn(shared, item, report) for item in items]``, run concurrently.

        ``on_progress(n)``: called in this process with each ``report(n)`` of a local task.
        ``on_done(i, result)``: called as task ``i`` finishes (in completion order).
        """
        items = list(items)
        if self.executor is Executor.LOCAL:
            return self._map_local(fn, items, on_progress, on_done)
        return self._map_ray(fn, items, on_done)

    def _drain(self, on_progress) -> None:
        q = self._queue
        if q is None:
            return
        import queue as _q

        while True:
            try:
                n = q.get_nowait()
            except _q.Empty:
                return
            if on_progress is not None:
                on_progress(n)

    def _map_local(self, fn, items, on_progress, on_done) -> list:
        if self._pool is None:
            raise MaceqError("task pool is closed")
        futures = [self._pool.submit(_run_local, fn, it) for it in items]
        index = {f: i for i, f in enumerate(futures)}
        pending = set(futures)
        try:
            while pending:
                done, pending = wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)
                self._drain(on_progress)
                for f in sorted(done, key=index.__getitem__):
                    result = f.result()  # raises the task's exception
                    if on_done is not None:
                        on_done(index[f], result)
        except MaceqError as e:
            for f in pending:
                f.cancel()
            raise MaceqError(str(e)) from None
        except BrokenProcessPool:
            raise MaceqError("a worker process died (out of memory?); try fewer --workers") from None
        except BaseException:
            for f in pending:
                f.cancel()
            raise
        self._drain(on_progress)
        return [f.result() for f in futures]

    def _map_ray(self, fn, items, on_done) -> list:
        """At most ``workers`` tasks in flight (a cluster of more CPUs would otherwise run more at once), the next
        item submitted as one ends."""
        ray = self._ray
        refs: list = []
        index: dict = {}
        pending: list = []
        try:
            while pending or len(refs) < len(items):
                while len(pending) < self.workers and len(refs) < len(items):
                    r = self._remote.remote(fn, self._shared_ref, items[len(refs)])
                    index[r] = len(refs)
                    refs.append(r)
                    pending.append(r)
                done, pending = ray.wait(pending, num_returns=1)
                for r in done:
                    result = ray.get(r)
                    if on_done is not None:
                        on_done(index[r], result)
            return ray.get(refs)
        except ray.exceptions.RayTaskError as e:
            for r in pending:
                ray.cancel(r)
            cause = getattr(e, "cause", None)
            if isinstance(cause, MaceqError):
                raise MaceqError(str(cause)) from None
            raise
        except BaseException:
            for r in pending:
                ray.cancel(r)
            raise


# ------------------------------------------------------------------------------------------------
# Calibration shards
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ShardJob:
    """What every shard needs, shipped once per worker: the model with the tensors exposed."""

    model: bytes
    names: tuple[str, ...]
    input_name: str | None
    preprocess: Preprocess
    batch_size: int
    num_bins: int
    intra_op_threads: int


_MALLOC_TRIM: Any = None


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None where the C library has none, e.g. macOS or musl)."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            fn = ctypes.CDLL(None).malloc_trim
            fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
            _MALLOC_TRIM = fn
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    return _MALLOC_TRIM or None


def trimmed_batches(data: ImageFolder, batch_size: int, report: Callable[[int], None] | None = None):
    """``data.iter_batches(batch_size)``; after each batch has been folded in (collect() asks for
    the next one only then) the heap's free pages go back to the OS (``malloc_trim(0)``) and
    ``report(n_images)`` is called.

    Why: a batch's activations are hundreds of MB of arrays (MobileNetV2, batch 8: 225 MB) of
    many sizes; glibc serves the ones under its adaptive mmap threshold (up to 32 MB) from the
    heap, and fragmentation there made the resident size creep up with the number of batches
    (+5% in one process, +14% over two workers, from 32 to 512 images). Trimming after each
    batch keeps the peak at one batch's worth, whatever the image count (bench/calibration.py).
    """
    trim = _malloc_trim()
    for b in data.iter_batches(batch_size):
        yield b
        if trim is not None:
            trim(0)
        if report is not None:
            report(len(b.paths))


def _shard_folder(files: list[str], preprocess: Preprocess) -> ImageFolder | None:
    """An ImageFolder over exactly ``files`` (None when none of them exists any more)."""
    root = next((f for f in files if Path(f).is_file()), None)
    if root is None:
        return None
    folder = ImageFolder(root, preprocess, labels=None)  # a file root: the folder is [root] ...
    folder.files = [Path(f) for f in files]               # ... then exactly this shard's files
    return folder


def collect_shard(job: ShardJob, item: tuple[int, list[str]], report: Callable[[int], None] | None) -> dict:
    """One shard (module docstring): its statistics as ``StatsCollector.to_dict()`` and its
    readable/skipped files. Runs in a worker process or Ray task."""
    import onnx  # here, not at import: onnx takes about a second to import, which evaluation workers need not pay

    index, files = item
    folder = _shard_folder(files, job.preprocess)
    if folder is None:
        return {"shard": index, "stats": StatsCollector(job.names, num_bins=job.num_bins).to_dict(), "images": 0,
                "skipped_paths": list(files),
                "warnings": [f"{f}: skipped, cannot decode image (FileNotFoundError: no such file)" for f in files]}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnreadableImageWarning)
        try:
            stats = collect(onnx.load_model_from_string(job.model), job.names,
                            trimmed_batches(folder, job.batch_size, report), input_name=job.input_name,
                            progress=False, num_bins=job.num_bins, intra_op_threads=job.intra_op_threads)
        except MaceqError:
            if folder.skipped != len(folder.files):
                raise
            stats = StatsCollector(job.names, num_bins=job.num_bins)  # no readable file in this shard
    return {"shard": index, "stats": stats.to_dict(), "images": len(folder.files) - folder.skipped,
            "skipped_paths": list(folder.skipped_paths),
            "warnings": [str(w.message) for w in caught if issubclass(w.category, UnreadableImageWarning)]}


def collect_parallel(
    model: "onnx.ModelProto | bytes | str | os.PathLike",
    tensor_names: Sequence[str],
    data: ImageFolder,
    *,
    workers: int,
    executor: "str | Executor" = "local",
    ray_address: str | None = None,
    batch_size: int = 8,
    input_name: str | None = None,
    progress: bool = True,
    num_bins: int = DEFAULT_BINS,
    intra_op_threads: int | None = None,
) -> StatsCollector:
    """Statistics of ``tensor_names`` over every image of ``data``, sharded over ``workers``.

    The result equals ``collect(model, tensor_names, data.iter_batches(batch_size), ...)`` bit
    for bit, and ``data.skipped`` / ``data.skipped_paths`` are set as that pass sets them (see
    the module docstring). ``model``: an onnx.ModelProto, its serialized bytes, or a path.
    ``workers == 1`` with the local executor runs in this process. ``intra_op_threads``: per
    shard (default :func:`default_intra_op_threads`). The progress bar (stderr, when a terminal)
    advances per batch on local processes and per finished shard on Ray.
    """
    workers = check_workers(workers)
    executor = Executor.parse(executor)
    if not isinstance(data, ImageFolder):
        raise TypeError("data must be a maceq.datasets.images.ImageFolder")
    names = tuple(dict.fromkeys(tensor_names))
    if not names:
        raise MaceqError("no tensors to calibrate")
    proto = as_model_proto(model)
    if executor is Executor.LOCAL and workers == 1:
        return collect(proto, names, trimmed_batches(data, batch_size), input_name=input_name, total=len(data),
                       progress=progress, num_bins=num_bins, intra_op_threads=intra_op_threads)
    shards = shard_ranges(len(data.files), batch_size=batch_size, shards=workers)
    job = ShardJob(expose_outputs(proto, names).SerializeToString(), names, input_name, data.preprocess, batch_size,
                   num_bins, intra_op_threads or default_intra_op_threads(executor, workers))
    items = [(s, [str(p) for p in data.files[a:b]]) for s, (a, b) in enumerate(shards)]
    show = bool(progress) and sys.stderr.isatty()
    with tqdm(total=len(data), disable=not show, unit="img", desc=f"calibrate x{len(items)}", leave=False) as bar:
        on_done = None
        if executor is Executor.RAY:
            def on_done(i, r):
                bar.update(r["images"])
        with TaskPool(job, executor=executor, workers=min(workers, len(items)), ray_address=ray_address,
                      progress_queue=show) as pool:
            results = pool.map(collect_shard, items, on_progress=bar.update, on_done=on_done)
    total = StatsCollector(names, num_bins=num_bins)
    skipped: list[str] = []
    n_images = 0
    for r in results:  # shard order = file order
        total = total.merge(StatsCollector.from_dict(r["stats"]))
        skipped.extend(r["skipped_paths"])
        n_images += r["images"]
        for msg in r["warnings"]:
            warnings.warn(msg, UnreadableImageWarning, stacklevel=2)
    data.skipped, data.skipped_paths = len(skipped), skipped
    if n_images == 0:
        raise MaceqError(f"{data.root}: no readable image ({data.skipped} file(s) could not be decoded)")
    return total
