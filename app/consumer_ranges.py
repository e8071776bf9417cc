"""Activation ranges chosen by their consumers' error (range method ``consumer``).

A tensor's range decides how it is rounded and clipped, but the error that matters is what its
consumers compute from it. For each tensor whose every consumer is a weighted layer (Conv, Gemm,
MatMul with constant weights, the tensor as its data input), the method tries a few clip ranges and
keeps the one whose consumers' outputs move least:

    cost(lo, hi) = sum over consumers c, images, positions of (c(Q(x; lo, hi)) - c(x))^2

``Q`` is the uint8 grid the range gives (quant/scheme.py ``adjust_range``: the zero point nudged to an
integer, the range widened to hold 0), applied as onnxruntime's QuantizeLinear/DequantizeLinear
(round half to even, saturating: clipping included); ``c`` is the consumer as the float model has it,
bias and fused activation included, so a channel the consumer weighs heavily counts more than one it
ignores, and values a consumer's ReLU6 clips anyway count for nothing. Everything runs in one
onnxruntime session on a few calibration images (``RANGE_IMAGES``), one sum per image leaving it.

Candidates per tensor: the exact ``[min, max]``, the stats-only ``mse`` range, percentiles 99.99, 99.9
and 99, and ``[min, max]`` scaled by 0.9 down to 0.4. A tensor read by anything else (Add, Concat,
pooling, a graph output, the graph input) keeps the ``mse`` range, which is also what the method
gives from statistics alone (calibrate/methods.py).
"""
from __future__ import annotations

import numpy as np
from onnx import helper, numpy_helper
from tqdm import tqdm

from maceq.calibrate.methods import RangeMethod, compute_range
from maceq.calibrate.runner import summed_outputs
from maceq.datasets.images import ImageFolder
from maceq.quant.ir import Graph, Node, onnx_nodes, sum_squares_per_sample
from maceq.quant.scheme import adjust_range

__all__ = ["RANGE_IMAGES", "consumer_ranges", "range_candidates"]

#: Calibration images the candidates are scored on.
RANGE_IMAGES = 16
_FRACTIONS = (0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.5, 0.4)
_PERCENTILES = (99.99, 99.9, 99.0)
_WEIGHTED = ("Conv", "Gemm", "MatMul")


def range_candidates(stats) -> list[tuple[float, float]]:
    """The clip ranges tried for one tensor, distinct on the uint8 grid, widest first."""
    mn, mx = float(stats.min), float(stats.max)
    cands = [(mn, mx), compute_range(stats, RangeMethod.MSE)]
    cands += [compute_range(stats, RangeMethod.PERCENTILE, percentile=p) for p in _PERCENTILES]
    cands += [(mn * f, mx * f) for f in _FRACTIONS]
    seen, out = set(), []
    for lo, hi in sorted(cands, key=lambda c: c[0] - c[1]):
        q = adjust_range(lo, hi, non_zero=False)
        key = (float(np.float32(q.scale)), int(q.zero_point))
        if key not in seen:
            seen.add(key)
            out.append((float(lo), float(hi)))
    return out


def _scored_tensors(g: Graph, tensors) -> dict[str, list[Node]]:
    """tensor -> its consumers, for the tensors every consumer of which is a weighted layer reading it as data."""
    consumers = g.consumers()
    inputs = {v.name for v in g.inputs}
    out = {}
    for t in tensors:
        cs = consumers.get(t, [])
        if (t in inputs or t in g.outputs or not cs
                or not all(c.op_type in _WEIGHTED and len(c.inputs) > 1 and c.inputs[0] == t and t not in c.inputs[1:]
                           and g.is_const(c.inputs[1]) for c in cs)):
            continue
        out[t] = cs
    return out


def _probe_model(g: Graph, scored: dict[str, list[Node]], cands: dict[str, list[tuple[float, float]]]):
    """The float graph plus, per (tensor, candidate), the tensor on the candidate's grid, each consumer
    on it, and the sum of squares of the consumers' change. Returns the model and {(tensor, k): name}."""
    model = g.to_onnx()
    nodes, inits, fetch = model.graph.node, model.graph.initializer, {}
    for ti, (t, cs) in enumerate(scored.items()):
        for k, (lo, hi) in enumerate(cands[t]):
            q = adjust_range(lo, hi, non_zero=False)
            tag = f"__maceq_cr{ti}_{k}"
            inits.append(numpy_helper.from_array(np.array(q.scale, np.float32), tag + "_s"))
            inits.append(numpy_helper.from_array(np.array(q.zero_point, np.uint8), tag + "_z"))
            nodes.append(helper.make_node("QuantizeLinear", [t, tag + "_s", tag + "_z"], [tag + "_q"]))
            nodes.append(helper.make_node("DequantizeLinear", [tag + "_q", tag + "_s", tag + "_z"], [tag + "_x"]))
            sums = []
            for ci, c in enumerate(cs):
                ctag = f"{tag}_c{ci}"
                twin = Node(ctag, c.op_type, [tag + "_x", *c.inputs[1:]], [ctag + "_y"], dict(c.attrs))
                nodes.extend(onnx_nodes(twin, opset=g.opset))
                nodes.append(helper.make_node("Sub", [ctag + "_y", c.outputs[0]], [ctag + "_e"]))
                nodes.extend(sum_squares_per_sample(ctag + "_e", ctag + "_ee", opset=g.opset))
                sums.append(ctag + "_ee")
            if len(sums) > 1:
                nodes.append(helper.make_node("Sum", sums, [tag + "_cost"]))
            else:
                nodes.append(helper.make_node("Identity", sums, [tag + "_cost"]))
            fetch[(t, k)] = tag + "_cost"
    for name in fetch.values():
        model.graph.output.append(helper.make_empty_tensor_value_info(name))
    return model, fetch


def consumer_ranges(g: Graph, stats, tensors, *, calib_dir, preprocess, batch_size: int = 8,
                    images: int = RANGE_IMAGES, progress: bool = False) -> tuple[dict, dict]:
    """Ranges for ``tensors`` by their consumers' error (module docstring).

    ``stats``: tensor -> TensorStats of the calibration. Returns ({tensor: (lo, hi)} for every tensor
    given, the scored ones by their consumers and the others by ``mse``; a summary for the record)."""
    ranges = {t: compute_range(stats[t], RangeMethod.MSE) for t in tensors}
    scored = _scored_tensors(g, tensors)
    if not scored:
        return ranges, {"scored": 0, "changed": 0}
    cands = {t: range_candidates(stats[t]) for t in scored}
    model, fetch = _probe_model(g, scored, cands)
    in_name = g.inputs[0].name
    data = ImageFolder(calib_dir, preprocess, labels=None, limit=images)
    bar = tqdm(total=min(images, len(data)), desc="consumer ranges", unit="img", disable=not progress, leave=False)
    cost = summed_outputs(model, list(fetch.values()), data.iter_batches(batch_size), input_name=in_name,
                          report=bar.update)
    bar.close()
    changed = 0
    for t in scored:
        best = min(range(len(cands[t])), key=lambda k: (cost[fetch[(t, k)]], k))
        changed += cands[t][best] != ranges[t]
        ranges[t] = cands[t][best]
    return ranges, {"scored": len(scored), "changed": int(changed), "images": min(images, len(data))}
