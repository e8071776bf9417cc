"""Run the float model on calibration batches with onnxruntime and collect statistics.

:func:`collect` exposes every requested tensor as a graph output (once, also
when it already is one), runs the model batch by batch on the
CPUExecutionProvider, fetches only the requested tensors, and folds each
batch's activations into a :class:`~maceq.calibrate.stats.StatsCollector`
before the next batch runs, so memory holds the activations of one batch at a
time. A requested tensor that is a graph input is taken from the feed.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from tqdm import tqdm

from maceq.calibrate.stats import DEFAULT_BINS, StatsCollector
from maceq.errors import MaceqError
from maceq.yamlio import one_line

__all__ = ["BatchedSession", "as_model_proto", "collect", "expose_outputs", "fixed_batch", "load_onnx", "make_session",
           "redeclare_input"]


def make_session(
    model: "bytes | onnx.ModelProto | str | os.PathLike",
    *,
    intra_op_threads: int | None = None,
    optimize: bool = True,
    input_shape: "Sequence[int] | None" = None,
) -> ort.InferenceSession:
    """The one onnxruntime CPU session maceq opens: for a serialized model, a ModelProto or a file.

    ``intra_op_threads`` None (or 0) keeps onnxruntime's default (one thread per physical core).
    ``optimize=False`` disables onnxruntime's graph optimisations: a tensor's float value then does
    not depend on which other tensors are requested as outputs (fusions change the float rounding),
    which the per-layer analysis and bias correction need. Warnings are silenced (severity 3).
    ``input_shape``: the size the model was quantized at, where it differs from a size the model's
    input fixes (``--input-shape`` re-declares it; see :func:`redeclare_input`).
    """
    if input_shape is not None:
        model = redeclare_input(as_model_proto(model), input_shape)
    if isinstance(model, onnx.ModelProto):
        model = model.SerializeToString()
    elif not isinstance(model, (bytes, bytearray)):
        model = os.fspath(model)
        if not os.path.isfile(model):
            raise MaceqError(f"{model}: float model not found (pass --float-model)")
    so = ort.SessionOptions()
    if intra_op_threads:
        so.intra_op_num_threads = int(intra_op_threads)
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    try:
        return ort.InferenceSession(model, sess_options=so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own exception types
        raise MaceqError(f"onnxruntime cannot load the model: {str(e).splitlines()[0]}") from None


def load_onnx(path: "str | os.PathLike") -> onnx.ModelProto:
    """Read an ONNX file; a missing, unreadable or empty model is a one-line MaceqError."""
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
    """Fold one batch of tensor ``name`` into ``stats``; NaN or Inf raises MaceqError naming the
    tensor and the first image (or sample) that holds one."""
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
) -> StatsCollector:
    """Statistics of ``tensor_names`` over all ``batches``.

    ``batches``: :class:`~maceq.datasets.images.Batch` objects (fed to
    ``input_name``, by default the model's only input), dicts input name ->
    array, or arrays. ``total``: the number of samples, for the progress bar,
    which advances by each batch's leading dimension; it is shown on stderr
    when ``progress`` is true and stderr is a terminal.
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
    sess = make_session(expose_outputs(model, names).SerializeToString(), intra_op_threads=intra_op_threads)
    runner = BatchedSession(sess, input_name)
    fetch = [n for n in names if n not in graph_inputs]
    from_feed = [n for n in names if n in graph_inputs]

    stats = StatsCollector(names, num_bins=num_bins)
    show = bool(progress) and sys.stderr.isatty()
    seen = 0
    first = 0  # index of the batch's first sample in the whole calibration set
    with tqdm(total=total, disable=not show, unit="img", desc="calibrate", leave=False) as bar:
        for item in batches:
            feed = _feed(item, input_name)
            n_samples = _batch_len(feed)
            outs = runner.run(fetch, feed, what=f"calibration batch {seen}") if fetch else []
            for name in from_feed:
                if name not in feed:
                    raise MaceqError(f"calibration batch {seen} does not feed input '{name}'")
                _update(stats, name, feed[name], item, seen, first)
            for name, arr in zip(fetch, outs):
                _update(stats, name, arr, item, seen, first)
            del outs, feed
            seen += 1
            first += n_samples
            bar.update(n_samples)
    if seen == 0:
        raise MaceqError("no calibration batches")
    return stats
