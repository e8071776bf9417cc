"""Run the float model on calibration batches with onnxruntime and collect statistics.

:func:`collect` exposes every requested tensor as a graph output (once, also
when it already is one), runs the model on the CPUExecutionProvider, fetches
only the requested tensors, and folds each run's activations into a
:class:`~maceq.calibrate.stats.StatsCollector` before the next run, releasing
each array once it is folded in. A requested tensor that is a graph input is
taken from the feed.

Memory: a run's fetched activations are all held at its end (MobileNetV2 at
224x224: 28 MB per image), and ``InferenceSession.run`` returns copies of them.
So a batch whose activations exceed ``fetch_bytes`` (default :data:`FETCH_BYTES`)
runs as consecutive runs of as many samples as fit (at least one, or a multiple
of the batch the model's input fixes; per-sample bytes from the outputs' declared
shapes, else from a first run of one sample), and a run of one sample (or of the
batch the model fixes) returns read-only views of onnxruntime's own buffers
(``run_with_ort_values`` and DLPack) instead of copies. Each array is released
once folded in, and the session before :func:`collect` returns.

The statistics do not depend on the runs: each sample's activations are the same
whatever batch it runs in (docs/parallel.md), and the statistics of any split of
the data, folded in any order, are identical (calibrate/stats.py). An output
whose first dimension is not the run's sample count has no batch dimension and is
folded in once per batch, on the batch's first run, as BatchedSession treats such
outputs; so is an output whose declared shape fixes its first dimension at another
number than the input's batch dimension. NaN or Inf in a batch that ran in parts
is reported from the whole batch, as if it had run at once.

Speed: onnxruntime runs on a second thread, one run ahead: while it computes the
next run's activations, this thread decodes the next batch and folds the previous
run in (onnxruntime and the compiled statistics release the GIL). Runs are folded
in order, so the result does not depend on the timing. Unless told otherwise,
onnxruntime gets half the CPUs (:func:`_inference_threads`): with its default,
every core, its worker threads keep spinning through the statistics on small
machines.
"""
from __future__ import annotations

import itertools
import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np
import onnxruntime as ort
from tqdm import tqdm

from maceq.calibrate.stats import DEFAULT_BINS, StatsCollector
from maceq.errors import MaceqError
from maceq.yamlio import one_line

if TYPE_CHECKING:  # onnx is imported where it is used: it takes about a second to import
    import onnx

__all__ = ["BatchedSession", "FETCH_BYTES", "as_model_proto", "collect", "expose_outputs", "fixed_batch", "load_onnx",
           "make_session", "redeclare_input", "summed_outputs"]

#: Bytes of activations one onnxruntime run of :func:`collect` fetches, at most (at least one sample's).
FETCH_BYTES = 32 << 20


def make_session(
    model: "bytes | onnx.ModelProto | str | os.PathLike",
    *,
    intra_op_threads: int | None = None,
    optimize: bool = True,
    input_shape: "Sequence[int] | None" = None,
    spin: bool = True,
) -> ort.InferenceSession:
    """The one onnxruntime CPU session maceq opens: for a serialized model, a ModelProto or a file.

    ``intra_op_threads`` None (or 0) keeps onnxruntime's default (one thread per physical core).
    ``optimize=False`` disables onnxruntime's graph optimisations: a tensor's float value then does
    not depend on which other tensors are requested as outputs (fusions change the float rounding),
    which the per-layer analysis and bias correction need. Warnings are silenced (severity 3).
    ``input_shape``: the size the model was quantized at, where it differs from a size the model's
    input fixes (``--input-shape`` re-declares it; see :func:`redeclare_input`).
    ``spin=False``: the pool's threads sleep as soon as a run ends (``session.intra_op.allow_spinning`` 0), for a
    session whose runs alternate with the simulation's in one process. Spinning, they kept a core from the
    simulation for about 90 ms after each float run (MobileNetV2 at batch 1 on 2 vCPUs: the simulation's first four
    runs after a float run took 21-24 ms, the fifth 17, against 11); onnxruntime's own runs are then about 15% slower.
    """
    if isinstance(model, (str, os.PathLike)) and not os.path.isfile(model):
        raise MaceqError(f"{os.fspath(model)}: float model not found (pass --float-model)")
    if input_shape is not None and isinstance(model, (str, os.PathLike)):
        sess = _session(os.fspath(model), intra_op_threads, optimize, spin)
        if not _declared_elsewhere(sess, input_shape):
            return sess  # the file declares the size (or leaves it open): no need to parse it here
    if input_shape is not None:
        model = redeclare_input(as_model_proto(model), input_shape)
    if not isinstance(model, (bytes, bytearray, str, os.PathLike)):
        model = model.SerializeToString()  # a ModelProto
    return _session(model if isinstance(model, (bytes, bytearray)) else os.fspath(model), intra_op_threads, optimize,
                    spin)


def _declared_elsewhere(sess: ort.InferenceSession, shape: Sequence[int]) -> bool:
    """Whether the session's first input fixes a dimension past the batch to another size than ``shape``'s (what
    :func:`redeclare_input` changes), read from onnxruntime's view of the model (no ONNX parse, no onnx import:
    a worker process then starts about a second sooner)."""
    dims = sess.get_inputs()[0].shape
    return len(dims) == len(shape) and any(isinstance(d, int) and d != int(w) for d, w in zip(dims[1:], shape[1:]))


def _session(model: "bytes | str", intra_op_threads: int | None, optimize: bool, spin: bool = True
             ) -> ort.InferenceSession:
    so = ort.SessionOptions()
    if intra_op_threads:
        so.intra_op_num_threads = int(intra_op_threads)
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    try:
        return ort.InferenceSession(model, sess_options=so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own exception types
        raise MaceqError(f"onnxruntime cannot load the model: {str(e).splitlines()[0]}") from None


def load_onnx(path: "str | os.PathLike") -> onnx.ModelProto:
    """Read an ONNX file; a missing, unreadable or empty model is a one-line MaceqError."""
    import onnx  # here, not at import: onnx takes about a second to import (ml_dtypes)

    path = os.fspath(path)
    if os.path.isdir(path):
        raise MaceqError(f"{path}: is a folder, not an ONNX model file")
    if not os.path.isfile(path):
        raise MaceqError(f"{path}: no such model file")
    try:
        model = onnx.load(path)
    except Exception as e:  # noqa: BLE001 - onnx raises protobuf's and its own errors
        raise MaceqError(f"{path}: not a readable ONNX model ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if not model.graph.node:
        raise MaceqError(f"{path}: the ONNX graph has no nodes")
    return model


def as_model_proto(model: "onnx.ModelProto | bytes | str | os.PathLike") -> onnx.ModelProto:
    """A ModelProto from a ModelProto, a serialized model or a file; MaceqError naming what is wrong."""
    import onnx  # here, not at import: onnx takes about a second to import (ml_dtypes)

    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (bytes, bytearray)):
        try:
            return onnx.load_model_from_string(bytes(model))
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError
            raise MaceqError(f"cannot parse the serialized ONNX model ({type(e).__name__})") from None
    return load_onnx(model)


def redeclare_input(model: onnx.ModelProto, shape: Sequence[int]) -> onnx.ModelProto:
    """``model`` with its (first) input declared at ``shape`` where its fixed spatial dims differ, and
    every other declared shape dropped, so onnxruntime runs it at that size; ``model`` itself when
    nothing differs. The import (quant.onnx_import) has refused graphs with an op that pins the size."""
    import onnx  # here, not at import: onnx takes about a second to import (ml_dtypes)

    inits = {t.name for t in model.graph.initializer}
    inp = next((i for i in model.graph.input if i.name not in inits), None)
    if inp is None:
        return model
    dims = inp.type.tensor_type.shape.dim
    if len(dims) != len(shape) or not any(d.HasField("dim_value") and d.dim_value != w
                                          for d, w in zip(list(dims)[1:], list(shape)[1:])):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    new_in = next(i for i in out.graph.input if i.name == inp.name)
    for d, w in zip(new_in.type.tensor_type.shape.dim, shape):
        d.Clear()
        d.dim_value = int(w)
    del out.graph.value_info[:]
    for o in out.graph.output:
        if o.type.HasField("tensor_type"):
            o.type.tensor_type.ClearField("shape")
    return out


def fixed_batch(sess: ort.InferenceSession, input_name: str | None = None) -> int | None:
    """The batch size the model's input fixes (its first dimension is a number), or None when it is free."""
    inputs = sess.get_inputs()
    inp = next((i for i in inputs if i.name == input_name), inputs[0]) if inputs else None
    dims = inp.shape if inp is not None else None
    return int(dims[0]) if dims and isinstance(dims[0], int) and dims[0] > 0 else None


class BatchedSession:
    """An onnxruntime session that takes feeds of any batch size.

    A model whose input fixes its batch (``rows``), or whose graph does while its input does not (a
    Reshape to ``[1, -1]`` after an export with a free batch: found when a larger batch fails and one
    sample runs), gets its feed in chunks of ``rows`` samples; the last chunk is filled up by repeating
    its final sample, and the outputs are joined with the filler dropped. An output whose first
    dimension is not ``rows`` has no batch dimension: the first chunk's value is returned.
    An onnxruntime error is a MaceqError with onnxruntime's whole message on one line.
    """

    def __init__(self, sess: ort.InferenceSession, input_name: str | None = None):
        self.sess = sess
        self.rows = fixed_batch(sess, input_name)

    def run(self, fetch: Sequence[str] | None, feed: Mapping[str, np.ndarray], *,
            what: str = "the float model") -> list[np.ndarray]:
        n = _batch_len(feed)
        if self.rows is None and n > 1:
            outs = self._whole(fetch, feed, n, what)
            if outs is not None:
                return outs
            self.rows = 1
        if self.rows is None or n == self.rows:
            return _run(self.sess, fetch, feed, what)
        parts = []
        for start in range(0, n, self.rows):
            chunk = {k: _fill(v[start:start + self.rows], self.rows) for k, v in feed.items()}
            parts.append((_run(self.sess, fetch, chunk, what), min(self.rows, n - start)))
        first = parts[0][0]
        return [np.concatenate([outs[i][:k] for outs, k in parts]) if first[i].shape[:1] == (self.rows,)
                else first[i] for i in range(len(first))]

    def _whole(self, fetch, feed, n: int, what: str) -> list[np.ndarray] | None:
        """The whole feed in one run, or None when the graph turns out to fix the batch at one sample:
        the run fails and one sample runs, or an output's first dimension is not ``n`` and differs from
        that output's shape on one sample (a Reshape that merged the batch)."""
        one = {k: v[:1] for k, v in feed.items()}
        try:
            outs = _run(self.sess, fetch, feed, what)
        except MaceqError:
            _run(self.sess, fetch, one, what)  # raises when one sample fails too
            return None
        odd = [i for i, o in enumerate(outs) if o.ndim and o.shape[0] != n]
        if odd:
            single = _run(self.sess, fetch, one, what)
            if any(single[i].shape != outs[i].shape for i in odd):
                return None
        return outs


def summed_outputs(model: onnx.ModelProto, names: Sequence[str], batches: Iterable[Any], *, input_name: str,
                   report=None) -> dict[str, float]:
    """Each output in ``names`` summed (float64) over every sample of ``batches`` (Batch objects), through a
    :class:`BatchedSession`: outputs that keep the batch dimension (per-sample sums) count each image once,
    whatever batch the model takes. ``report(n)`` is called after each batch of ``n`` samples."""
    runner = BatchedSession(make_session(model, optimize=False), input_name)
    names = list(dict.fromkeys(names))
    sums = dict.fromkeys(names, 0.0)
    for batch in batches:
        for name, v in zip(names, runner.run(names, {input_name: batch.data})):
            sums[name] += float(np.asarray(v, dtype=np.float64).sum())
        if report is not None:
            report(len(batch.data))
    return sums


def _fill(a: np.ndarray, rows: int) -> np.ndarray:
    """``a`` with its last sample repeated up to ``rows`` samples."""
    return a if a.shape[0] == rows else np.concatenate([a, np.repeat(a[-1:], rows - a.shape[0], axis=0)])


def _run(sess: ort.InferenceSession, fetch, feed, what: str) -> list[np.ndarray]:
    try:
        return sess.run(fetch, dict(feed))
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own exception types
        raise MaceqError(f"onnxruntime failed on {what}: {' '.join(str(e).split())}") from None


def expose_outputs(model: onnx.ModelProto, tensor_names: Sequence[str]) -> onnx.ModelProto:
    """A copy of ``model`` whose graph outputs include every name (each once).

    Names must be node outputs or graph inputs; anything else raises
    MaceqError naming the tensor. Graph inputs are not added as outputs.
    """
    import onnx  # here, not at import: onnx takes about a second to import (ml_dtypes)

    graph = model.graph
    produced = {o for n in graph.node for o in n.output if o}
    inputs = {i.name for i in graph.input}
    for name in tensor_names:
        if name not in produced and name not in inputs:
            raise MaceqError(f"tensor '{name}' is not produced by any node of the model")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    have = {o.name for o in out.graph.output}
    known_vi = {vi.name: vi for vi in out.graph.value_info}
    for name in dict.fromkeys(tensor_names):
        if name in have or name in inputs:
            continue
        vi = out.graph.output.add()
        if name in known_vi:
            vi.CopyFrom(known_vi[name])
        else:
            vi.name = name
        have.add(name)
    return out


def _feed(item: Any, input_name: str) -> dict[str, np.ndarray]:
    data = getattr(item, "data", None)
    if data is not None and hasattr(item, "paths"):
        return {input_name: np.asarray(data, dtype=np.float32)}
    if isinstance(item, Mapping):
        return {str(k): np.asarray(v) for k, v in item.items()}
    if isinstance(item, np.ndarray):
        return {input_name: item}
    raise MaceqError(f"calibration batch of type {type(item).__name__}: expected a Batch, dict or array")


def _batch_len(feed: Mapping[str, np.ndarray]) -> int:
    for v in feed.values():
        return int(v.shape[0]) if v.ndim else 1
    return 0


def _update(stats: StatsCollector, name: str, arr: np.ndarray, item: Any, batch: int, first: int) -> None:
    """Fold one run's values of tensor ``name`` into ``stats``; NaN or Inf raises MaceqError naming
    the tensor and the first image (or sample) that holds one."""
    a = np.asarray(arr)
    try:
        stats.stats[name].update(a)  # checks min and max: one pass when all is finite
    except MaceqError:
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            raise MaceqError(_nonfinite_message(name, a, item, batch, first)) from None
        raise


def _nonfinite_message(name: str, a: np.ndarray, item: Any, batch: int, first: int) -> str:
    n_nan, n_inf = int(np.isnan(a).sum()), int(np.isinf(a).sum())
    what = f"{n_nan} NaN and {n_inf} Inf value(s)"
    paths = getattr(item, "paths", None)
    if a.ndim >= 1 and paths is not None and a.shape[0] == len(paths):
        bad = ~np.isfinite(a.reshape(a.shape[0], -1)).all(axis=1)
        k = int(np.argmax(bad))
        where = f"image {one_line(str(paths[k]))}"
        if int(bad.sum()) > 1:
            where += f" (and {int(bad.sum()) - 1} more in calibration batch {batch})"
    elif a.ndim >= 1 and a.shape[0] > 1:
        bad = ~np.isfinite(a.reshape(a.shape[0], -1)).all(axis=1)
        where = f"sample {first + int(np.argmax(bad))} (calibration batch {batch})"
    else:
        where = f"calibration batch {batch} (sample {first})"
    return (f"tensor '{one_line(name)}': {what} in the float model's activations on {where}; "
            f"ranges need finite activations: check the model and the preprocessing for this input")


class _RunPlan:
    """How batches are cut into onnxruntime runs (module docstring): whole batches while their
    fetched activations fit ``budget`` bytes, else as many samples as fit, at least ``unit`` (the
    model's fixed batch, or 1); and which outputs have no batch dimension."""

    def __init__(self, sess: ort.InferenceSession, input_name: str, fetch: Sequence[str], budget: int) -> None:
        self.budget = budget
        self.unbatched = _declared_unbatched(sess, input_name, fetch)
        self.per_sample = _declared_sample_bytes(sess, [n for n in fetch if n not in self.unbatched])

    def next(self, remaining: int, unit: int) -> int:
        """Samples in the next run of a batch with ``remaining`` samples left."""
        if self.per_sample is None:  # learnt from a first run of one unit
            return min(remaining, unit)
        fit = max(unit, self.budget // max(1, self.per_sample) // unit * unit)
        return min(remaining, fit)

    def learn(self, outs: Sequence[np.ndarray], samples: int) -> None:
        if self.per_sample is None and samples > 0:
            per_sample = sum(o.nbytes for o in outs if o.ndim and o.shape[0] == samples)
            self.per_sample = -(-per_sample // samples)

    def per_sample_output(self, name: str, arr: np.ndarray, samples: int) -> bool:
        """Whether output ``name`` of a run of ``samples`` samples holds one row per sample: its
        first dimension is the sample count, and its declared shape does not fix that dimension
        at another value."""
        return bool(arr.ndim) and arr.shape[0] == samples and name not in self.unbatched


_ITEMSIZE = {"tensor(float)": 4, "tensor(double)": 8, "tensor(float16)": 2, "tensor(bfloat16)": 2,
             "tensor(int64)": 8, "tensor(int32)": 4, "tensor(int16)": 2, "tensor(int8)": 1, "tensor(uint8)": 1,
             "tensor(bool)": 1}


def _declared_sample_bytes(sess: ort.InferenceSession, fetch: Sequence[str]) -> int | None:
    """Bytes of one sample of the ``fetch`` outputs from their declared shapes; None when a
    shape past the batch dimension or an element type is not known."""
    declared = {o.name: o for o in sess.get_outputs()}
    total = 0
    for name in fetch:
        o = declared.get(name)
        dims = list(o.shape[1:]) if o is not None and o.shape else None
        size = _ITEMSIZE.get(o.type) if o is not None else None
        if dims is None or size is None or not all(isinstance(d, int) and d >= 0 for d in dims):
            return None
        total += math.prod(dims) * size
    return total


def _declared_unbatched(sess: ort.InferenceSession, input_name: str, fetch: Sequence[str]) -> frozenset[str]:
    """The outputs whose declared shape has no batch dimension: a scalar, or a first dimension
    fixed at a number other than the input's batch dimension."""
    inp = next((i for i in sess.get_inputs() if i.name == input_name), None)
    batch = inp.shape[0] if inp is not None and inp.shape else None
    if batch is None:
        return frozenset()
    wanted = set(fetch)
    return frozenset(o.name for o in sess.get_outputs() if o.name in wanted and o.shape is not None
                     and (len(o.shape) == 0 or (isinstance(o.shape[0], int) and o.shape[0] != batch)))


def _parts(feed: Mapping[str, np.ndarray], n: int, samples: int) -> bool:
    """Whether the batch may run in parts of ``samples``: every feed has the batch dimension."""
    return 0 < samples < n and all(v.ndim >= 1 and v.shape[0] == n for v in feed.values())


@dataclass
class _Run:
    """One onnxruntime run: samples ``start:stop`` of batch number ``batch`` (whose first sample is
    sample ``first`` of the calibration set); ``split`` when the batch runs in parts."""

    item: Any
    feed: dict[str, np.ndarray]
    batch: int
    first: int
    start: int
    stop: int
    split: bool

    def part(self) -> dict[str, np.ndarray]:
        return {k: v[self.start:self.stop] for k, v in self.feed.items()} if self.split else self.feed

    @property
    def last(self) -> bool:
        return self.stop >= _batch_len(self.feed)


def _inference_threads() -> int:
    """onnxruntime's intra-op threads when the caller does not say: half the CPUs this process may
    use (at least one); the statistics of the previous run take another core meanwhile."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // 2)


def _plan_runs(batches: Iterable[Any], input_name: str, from_feed: list[str], fetch: list[str],
               runner: BatchedSession, plan: _RunPlan):
    """The runs of every batch in order; a batch is read (decoded) when its first run is asked for."""
    first = 0
    for batch, item in enumerate(batches):
        feed = _feed(item, input_name)
        for name in from_feed:
            if name not in feed:
                raise MaceqError(f"calibration batch {batch} does not feed input '{name}'")
        n = _batch_len(feed)
        start = 0
        while True:
            size = plan.next(n - start, runner.rows or 1) if fetch else n
            split = start > 0 or _parts(feed, n, size)
            stop = start + size if split else n
            yield _Run(item, feed, batch, first, start, stop, split)
            if stop >= n:
                break
            start = stop
        first += n


def _infer(runner: BatchedSession, fetch: list[str], part: dict[str, np.ndarray], samples: int,
           what: str) -> list[np.ndarray]:
    """onnxruntime's ``fetch`` outputs for one run. Where BatchedSession would run the feed as it is
    (one sample, or the batch the model fixes), the arrays are read-only views of onnxruntime's own
    buffers (DLPack), not copies: a run's activations are then held once, not twice."""
    if not fetch:
        return []
    if runner.rows != samples and not (samples == 1 and runner.rows is None):
        return runner.run(fetch, part, what=what)
    try:
        values = runner.sess.run_with_ort_values(
            fetch, {k: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v)) for k, v in part.items()})
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own exception types
        raise MaceqError(f"onnxruntime failed on {what}: {' '.join(str(e).split())}") from None
    try:
        return [np.from_dlpack(v) for v in values]
    except (TypeError, RuntimeError, BufferError):  # an element type DLPack does not carry
        return [v.numpy() for v in values]


def _fold_run(stats: StatsCollector, plan: _RunPlan, fetch: list[str], from_feed: list[str], run: _Run,
              outs: list[np.ndarray]) -> None:
    """Fold one run's activations in, releasing each array once it is folded in."""
    item = _part_item(run.item, run.start, run.stop, run.split)
    part = run.part()
    at = run.first + run.start
    for name in from_feed:
        _update(stats, name, part[name], item, run.batch, at)
    for i, name in enumerate(fetch):
        arr, outs[i] = outs[i], None
        if not run.split or plan.per_sample_output(name, arr, run.stop - run.start):
            _update(stats, name, arr, item, run.batch, at)
        elif run.start == 0:  # no batch dimension: once per batch
            _update(stats, name, arr, run.item, run.batch, run.first)
        del arr


def _run_all(stats: StatsCollector, runner: BatchedSession, plan: _RunPlan, fetch: list[str], from_feed: list[str],
             runs, bar) -> int:
    """Run and fold every run; the next run's inference (on a second thread: onnxruntime and the
    compiled statistics release the GIL) and the next batch's decoding overlap the folding of the
    previous run. Returns the number of batches."""
    def infer(run: _Run) -> list[np.ndarray]:
        outs = _infer(runner, fetch, run.part(), run.stop - run.start, f"calibration batch {run.batch}")
        plan.learn(outs, run.stop - run.start)
        return outs

    batches = 0
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="maceq-calibrate") as pool:
        pending = ahead = None
        for run in itertools.chain(runs, [None]):
            ahead = None if run is None else (run, pool.submit(infer, run))
            if pending is not None:
                done, outs = pending[0], pending[1].result()
                try:
                    _fold_run(stats, plan, fetch, from_feed, done, outs)
                except MaceqError:
                    if done.split:  # NaN or Inf: reported from the whole batch, once the run in flight ends
                        if ahead is not None and not ahead[1].cancel():
                            wait([ahead[1]])
                        _raise_for_whole_batch(runner, fetch, from_feed, done.feed, done.item, done.batch, done.first)
                    raise
                del outs
                if done.last:
                    batches += 1
                    bar.update(_batch_len(done.feed))
            pending = ahead
    return batches


class _PartItem:
    """The image paths of one part of a batch, for the NaN/Inf message."""

    def __init__(self, paths: Sequence[Any]) -> None:
        self.paths = paths


def _part_item(item: Any, start: int, stop: int, split: bool) -> Any:
    paths = getattr(item, "paths", None)
    return _PartItem(paths[start:stop]) if split and paths is not None else item


def _raise_for_whole_batch(runner: BatchedSession, fetch: list[str], from_feed: list[str], feed: dict[str, np.ndarray],
                           item: Any, batch: int, first: int) -> None:
    """NaN or Inf in a batch that ran in parts: the error a run of the whole batch gives (the first
    tensor, in order, with a non-finite value in the batch; the counts and images of the batch)."""
    outs = dict(zip(fetch, runner.run(fetch, feed, what=f"calibration batch {batch}")))
    for name in from_feed + fetch:
        a = np.asarray(feed[name] if name in from_feed else outs[name])
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            raise MaceqError(_nonfinite_message(name, a, item, batch, first)) from None


def collect(
    model: onnx.ModelProto,
    tensor_names: Sequence[str],
    batches: Iterable[Any],
    *,
    input_name: str | None = None,
    total: int | None = None,
    progress: bool = True,
    num_bins: int = DEFAULT_BINS,
    intra_op_threads: int | None = None,
    fetch_bytes: int = FETCH_BYTES,
) -> StatsCollector:
    """Statistics of ``tensor_names`` over all ``batches``.

    ``batches``: :class:`~maceq.datasets.images.Batch` objects (fed to
    ``input_name``, by default the model's only input), dicts input name ->
    array, or arrays. ``total``: the number of samples, for the progress bar,
    which advances by each batch's leading dimension; it is shown on stderr
    when ``progress`` is true and stderr is a terminal. ``fetch_bytes``: the
    activations one onnxruntime run may return (module docstring).
    """
    names = list(dict.fromkeys(tensor_names))
    if not names:
        raise MaceqError("no tensors to calibrate")
    graph_inputs = [i.name for i in model.graph.input
                    if i.name not in {t.name for t in model.graph.initializer}]
    if input_name is None:
        if len(graph_inputs) != 1:
            raise MaceqError(f"model has {len(graph_inputs)} inputs {graph_inputs}; name the one to feed")
        input_name = graph_inputs[0]
    elif input_name not in graph_inputs:
        raise MaceqError(f"model has no input '{input_name}' (inputs: {', '.join(graph_inputs)})")
    # the exposed copy and its serialization are dropped as soon as the session holds the model
    runner = BatchedSession(make_session(expose_outputs(model, names).SerializeToString(),
                                         intra_op_threads=intra_op_threads or _inference_threads()), input_name)
    fetch = [n for n in names if n not in graph_inputs]
    from_feed = [n for n in names if n in graph_inputs]
    plan = _RunPlan(runner.sess, input_name, fetch, fetch_bytes)
    stats = StatsCollector(names, num_bins=num_bins)
    show = bool(progress) and sys.stderr.isatty()
    with tqdm(total=total, disable=not show, unit="img", desc="calibrate", leave=False) as bar:
        seen = _run_all(stats, runner, plan, fetch, from_feed,
                        _plan_runs(batches, input_name, from_feed, fetch, runner, plan), bar)
    del runner  # the session and its buffers go before the caller goes on
    if seen == 0:
        raise MaceqError("no calibration batches")
    return stats
