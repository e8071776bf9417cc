"""Weight-grid check: name the layers that a device's 8-bit weight grid cannot compute.

Rounding a layer's weights to the device's grid (per-tensor uint8 on cpu and dsp, per-output-channel
int8 on gpu; quant/scheme.py) changes its output by ``e = f(x; Wq) - f(x; W)``: the layer (bias and fused
activation included) applied to its own float input ``x`` with the grid's weights, minus its float
output. The check measures it exactly, in float, on a few calibration images: one onnxruntime run of
the float graph with, beside each uint8 layer, its twin on the grid, the difference and the sums of
squares per image, so nothing larger than one number per image leaves the session.
``SQNR = 10 log10(sum y^2 / sum e^2)`` with ``y`` the layer's float output.

Most layers sit far above 20 dB. A layer below 0 dB has a weight-rounding error larger than its
output: the typical cause is a layer whose output is a small difference of large terms (a bias and a
weight cancelling a large near-constant input channel), which no 8-bit grid over the weights' whole
range can resolve, and no choice of activation ranges recovers. ``quantize`` warns, naming the layer
and the ``--fp32`` flag that keeps it in float, and records the figures in each device's ``.yml``
(``maceq: weight_grid``).

Where AdaRound ran (``Calibration.device_weights``), the grid values it chose are measured instead of
round-to-nearest. The figure is the weights' share of the error only: the activations' rounding comes on top, and the
gpu's per-channel grid is usually finer than the per-tensor grids of cpu and dsp.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
from onnx import helper, numpy_helper

from maceq.calibrate.runner import summed_outputs
from maceq.datasets.images import ImageFolder
from maceq.quant.build import check_supported, select_nodes
from maceq.quant.ir import Graph, Node, onnx_nodes, sum_squares_per_sample
from maceq.quant.scheme import scheme_for
from maceq.runtime.devices import Device

__all__ = ["COLLAPSE_DB", "GRID_IMAGES", "GridLoss", "WeightGridWarning", "check_weight_grid", "collapse_warnings",
           "grid_meta", "weight_grid_losses"]

#: A layer whose weight rounding alone leaves an output SQNR below this (dB) is named.
COLLAPSE_DB = 0.0
#: Calibration images the check runs on.
GRID_IMAGES = 4
_WEIGHTED = ("Conv", "Gemm", "MatMul")


class WeightGridWarning(UserWarning):
    """A layer that the device's 8-bit weight grid cannot compute (its figure is below COLLAPSE_DB)."""


@dataclass(frozen=True)
class GridLoss:
    """One uint8 layer on one device: the output SQNR its weight rounding alone leaves."""

    node: str  # IR node name
    origin: str  # the source model's node name (what --fp32 takes)
    op_type: str
    device: Device
    sqnr_db: float


def _origin(n: Node) -> str:
    return (n.attrs.get("maceq_names") or [n.name])[0]


def _out_axis(n: Node) -> int:
    """The weight axis of the output channels (the gpu's per-channel grid runs along it)."""
    if n.op_type == "MatMul" or (n.op_type == "Gemm" and not int(n.attrs.get("transB", 0))):
        return 1
    return 0


def device_grid(w: np.ndarray, device: Device, out_axis: int = 0) -> np.ndarray:
    """The float values of ``w`` on the device's weight grid (the codes the builder writes, dequantized)."""
    w = np.asarray(w, dtype=np.float32)
    moved = np.moveaxis(w, out_axis, 0)
    qw = scheme_for(device).weights(moved)
    codes = qw.codes.astype(np.float64)
    if qw.channel_scales is not None:
        shape = (-1,) + (1,) * (codes.ndim - 1)
        deq = codes * qw.channel_scales.astype(np.float64).reshape(shape)
    else:
        deq = (codes - qw.params.zero_point) * float(qw.params.scale)
    return np.moveaxis(deq, 0, out_axis)


def _layers(g: Graph, placement: dict) -> list[Node]:
    """The device's uint8 layers with constant weights (Conv, Gemm, MatMul with a constant right operand)."""
    return [n for n in g.nodes if placement.get(n.name) == "uint8" and n.op_type in _WEIGHTED
            and len(n.inputs) > 1 and g.is_const(n.inputs[1]) and not g.is_const(n.inputs[0])]


def _probe_model(g: Graph, layers: dict[Device, list[Node]], chosen: dict):
    """The float graph plus, per (device, layer), the layer with its weights on the device's grid
    (bias and fused activation kept), its difference from the float output and the two sums of squares.

    Returns the ONNX model and the fetch list [(device, node, signal name, error name)]."""
    model = g.to_onnx()
    nodes, inits, fetch = model.graph.node, model.graph.initializer, []
    signal = {}
    for device, nodes_of in layers.items():
        for n in nodes_of:
            w = g.const(n.inputs[1])
            tag = f"{n.name}__maceq_grid_{device.value}"
            picked = (chosen.get(device.value) or {}).get(n.name)  # AdaRound's grid values, where it ran
            wq = np.asarray(picked if picked is not None else device_grid(w, device, _out_axis(n)), np.float32)
            inits.append(numpy_helper.from_array(wq, tag + "_w"))
            twin = Node(tag, n.op_type, [n.inputs[0], tag + "_w", *n.inputs[2:]], [tag + "_y"], dict(n.attrs))
            nodes.extend(onnx_nodes(twin, opset=g.opset))
            nodes.append(helper.make_node("Sub", [tag + "_y", n.outputs[0]], [tag + "_e"]))
            nodes.extend(sum_squares_per_sample(tag + "_e", tag + "_ee", opset=g.opset))
            if n.name not in signal:
                signal[n.name] = f"{n.name}__maceq_grid_yy"
                nodes.extend(sum_squares_per_sample(n.outputs[0], signal[n.name], opset=g.opset))
            fetch.append((device, n, signal[n.name], tag + "_ee"))
    for name in dict.fromkeys([f[2] for f in fetch] + [f[3] for f in fetch]):
        model.graph.output.append(helper.make_empty_tensor_value_info(name))
    return model, fetch


def weight_grid_losses(cal, devices, *, fp32=frozenset(), images: int = GRID_IMAGES) -> list[GridLoss]:
    """Every uint8 layer's weight-rounding SQNR on each device, worst first (see the module docstring).

    ``cal``: a Calibration (quant/export.py) with its ``calib_dir``; ``fp32``: nodes kept in float."""
    g = cal.graph
    layers = {}
    for d in (Device.parse(x) for x in devices):
        placement = check_supported(g, device=d, shapes=cal.shapes, fp32=frozenset(fp32))
        layers[d] = _layers(g, placement)
    if not any(layers.values()) or cal.calib_dir is None:
        return []
    model, fetch = _probe_model(g, layers, getattr(cal, "device_weights", None) or {})
    in_name = g.inputs[0].name
    data = ImageFolder(cal.calib_dir, cal.preprocess, labels=None, limit=images)
    sums = summed_outputs(model, [f[2] for f in fetch] + [f[3] for f in fetch],
                          data.iter_batches(cal.config.batch_size), input_name=in_name)
    out = [GridLoss(n.name, _origin(n), n.op_type, d, _sqnr_db(sums[s], sums[e])) for d, n, s, e in fetch]
    return sorted(out, key=lambda r: (r.sqnr_db, r.device.value, r.node))


def _sqnr_db(signal: float, noise: float) -> float:
    if noise <= 0.0:
        return math.inf
    if signal <= 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def collapse_warnings(losses: list[GridLoss], *, threshold_db: float = COLLAPSE_DB) -> list[str]:
    """One line per layer below ``threshold_db`` on some device: its figure per device and the flag."""
    by_node: dict[str, list[GridLoss]] = {}
    for r in losses:
        if r.sqnr_db < threshold_db:
            by_node.setdefault(r.node, []).append(r)
    lines = []
    for rows in by_node.values():
        rows = sorted(rows, key=lambda r: r.device.value)
        figures = ", ".join(f"{r.sqnr_db:.1f} dB on {r.device.value}" for r in rows)
        r = rows[0]
        lines.append(f"layer '{r.origin}' ({r.op_type}): rounding its weights to the device's 8-bit grid alone leaves "
                     f"an output SQNR of {figures} (error larger than the signal): the quantized model cannot "
                     f"compute it; keep it in float32 with --fp32 {r.origin}")
    return lines


def grid_meta(losses: list[GridLoss], device: Device, *, worst: int = 5) -> dict:
    """The ``.yml`` record for one device: the layers below the threshold and the worst few figures."""
    rows = [r for r in losses if r.device == device]
    def entry(r):  # no error at all (inf) is written as null: report.json is strict JSON
        db = round(r.sqnr_db, 2) if math.isfinite(r.sqnr_db) else None
        return {"layer": r.origin, "node": r.node, "op": r.op_type, "sqnr_db": db}
    return {"threshold_db": COLLAPSE_DB, "layers_measured": len(rows),
            "collapsed": [entry(r) for r in rows if r.sqnr_db < COLLAPSE_DB],
            "worst": [entry(r) for r in rows[:worst]]}


def check_weight_grid(cal, devices, *, fp32_nodes=frozenset()) -> dict:
    """Measure every uint8 layer on each device, warn once per layer below the threshold
    (WeightGridWarning) and return the per-device ``.yml`` records ({device: {"weight_grid": ...}}).

    Layers kept in float32 (the config's ``fp32_layers`` and ``fp32_nodes``) are not measured."""
    devs = tuple(Device.parse(d) for d in devices)
    fp32 = select_nodes(cal.graph, cal.config.fp32_layers) | set(fp32_nodes)
    losses = weight_grid_losses(cal, devs, fp32=fp32)
    for line in collapse_warnings(losses):
        warnings.warn(line, WeightGridWarning, stacklevel=2)
    return {d.value: {"weight_grid": grid_meta(losses, d)} for d in devs}
