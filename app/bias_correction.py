"""Empirical bias correction (Nagel et al. 2019, section 4.2, the empirical variant).

Quantization shifts the mean of a layer's output: ``E[y_q] - E[y]`` is not zero, because
the quantized weights ``W_q`` differ from ``W`` and the quantized inputs ``x_q`` (carrying
the errors of every layer before) differ from ``x``. A constant per-channel shift is the
one part of that error a bias can absorb, so each Conv/Gemm bias becomes ``b - shift``.

The shift of output channel ``o`` is measured on the calibration images, before the
layer's activation clamp, in float64:

    shift[o] = sum_{i, ky, kx} (W_q[o, i, ky, kx] * m_q[i, ky, kx] - W[o, i, ky, kx] * m[i, ky, kx])

where ``m[i, ky, kx]`` is the mean, over images and output positions, of the input value
that kernel tap ``(ky, kx)`` of input channel ``i`` reads (zero where it reads padding),
so ``sum W * m + b`` is exactly the mean pre-activation output of the convolution, padding
and strides included; ``m`` comes from the float graph in onnxruntime, ``m_q`` from the
device's fixed-point simulation of the quantized model (the dequantized input codes), and
``W_q`` is ``W`` quantized and dequantized by the device's scheme (quant/scheme.py; AdaRound's
weights when it ran before, app/adaround.py). The
requantization rounding of the output is not in the shift: it has mean about zero.

The correction of a layer changes what every later layer receives, so the layers are corrected
one after the other, in execution order (Gauss-Seidel; correcting all layers at once from one
measurement overshoots, and the overshoot compounds with depth): the quantized model runs once,
op by op, on all the measurement images as one batch, and just before each Conv/Gemm op runs,
its shift is measured on the inputs it actually receives (from the layers before it, already
corrected) and its int32 bias is replaced by the codes the writer will store for ``b - shift``
(the device scheme's ``bias`` rule). The final model written from the corrected float biases is
therefore exactly the model this run simulated (a test checks its outputs bit for bit).
Everything is deterministic: images in sorted order, float64 sums.

Layers in float32 (mixed precision) are left alone; their output is not quantized.
"""
from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass, field

import numpy as np
from maceq.calibrate.runner import BatchedSession, expose_outputs, make_session
from maceq.errors import MaceqError
from maceq.quant.build import check_supported, select_nodes
from maceq.quant.export import write_quantized
from maceq.quant.ir import Graph
from maceq.quant.scheme import scheme_for
from maceq.runtime import load
from maceq.runtime.devices import Device
from maceq.runtime.qtypes import QInfo
from tqdm import tqdm

__all__ = ["BiasCorrection", "correct_biases", "dequantized_weights", "tap_means"]


@dataclass
class BiasCorrection:
    """The corrected float biases of one device, keyed by IR node name, and the trail."""

    device: Device
    biases: dict[str, np.ndarray] = field(default_factory=dict)
    shifts: list[float] = field(default_factory=list)  # mean |shift| per corrected layer, in order
    images: int = 0
    outputs: dict = field(default_factory=dict, repr=False)  # the corrected model's outputs on the images

    def to_dict(self) -> dict:
        return {"device": self.device.value, "layers": len(self.biases), "images": self.images,
                "mean_abs_shift": float(np.mean(self.shifts)) if self.shifts else 0.0,
                "max_layer_shift": float(np.max(self.shifts)) if self.shifts else 0.0}


@dataclass(frozen=True)
class _Layer:
    node: str
    kind: str  # "conv" | "gemm"
    x: str  # IR input tensor
    out: str  # IR output tensor
    w: np.ndarray  # float64, conv OIHW or gemm [O, K] (alpha applied)
    b: np.ndarray  # float64 [O] (beta applied)
    group: int = 1
    strides: tuple[int, int] = (1, 1)
    dilations: tuple[int, int] = (1, 1)
    pads: tuple[int, int, int, int] = (0, 0, 0, 0)  # top, left, bottom, right


def _layers(g: Graph, placement: dict[str, str]) -> list[_Layer]:
    out = []
    for n in g.nodes:
        if placement.get(n.name) != "uint8" or n.op_type not in ("Conv", "Gemm"):
            continue
        if not g.is_const(n.inputs[1]) or (len(n.inputs) > 2 and n.inputs[2] and not g.is_const(n.inputs[2])):
            continue
        w = np.asarray(g.const(n.inputs[1]), dtype=np.float64)
        has_b = len(n.inputs) > 2 and bool(n.inputs[2])
        if n.op_type == "Conv":
            if w.ndim != 4:
                continue
            b = np.asarray(g.const(n.inputs[2]), np.float64).reshape(-1) if has_b else np.zeros(w.shape[0])
            p = [int(v) for v in n.attr("pads", [0, 0, 0, 0])]
            out.append(_Layer(n.name, "conv", n.inputs[0], n.outputs[0], w, b, int(n.attr("group", 1)),
                              tuple(int(v) for v in n.attr("strides", [1, 1])),
                              tuple(int(v) for v in n.attr("dilations", [1, 1])), (p[0], p[1], p[2], p[3])))
        else:
            if n.attr("transA", 0):
                continue
            if not n.attr("transB", 0):
                w = w.T
            w = w * float(n.attr("alpha", 1.0))
            b = (np.broadcast_to(np.asarray(g.const(n.inputs[2]), np.float64).reshape(-1), (w.shape[0],))
                 * float(n.attr("beta", 1.0)) if has_b else np.zeros(w.shape[0]))
            out.append(_Layer(n.name, "gemm", n.inputs[0], n.outputs[0], w, np.array(b, dtype=np.float64)))
    return out


def dequantized_weights(layer: _Layer, device: Device, in_channels: int | None = None) -> np.ndarray:
    """``W_q``: the layer's weights quantized by ``device``'s scheme and dequantized, in IR layout."""
    return _quantized_weights(layer, device, in_channels)[1]


def _quantized_weights(layer: _Layer, device: Device, in_channels: int | None = None):
    """(QuantizedWeights in the MACE layout, ``W_q`` dequantized in IR layout)."""
    w_mace, depthwise = mace_layout(layer, in_channels)
    qw = scheme_for(device).weights(w_mace.astype(np.float32), out_axis_last_two=depthwise)
    codes = qw.codes.astype(np.float64)
    if qw.params is not None:
        deq = (codes - qw.params.zero_point) * float(np.float32(qw.params.scale))
    else:
        deq = codes * channel_scales(qw, codes.shape, depthwise)
    return qw, ir_layout(deq, layer, depthwise)


def mace_layout(layer: _Layer, in_channels: int | None = None) -> tuple[np.ndarray, bool]:
    """(the layer's weights in the layout the builder quantizes them in, whether it is depthwise):
    FullyConnected [O, 1, 1, K], DepthwiseConv2d [KH, KW, C, M], Conv2D OHWI (quant/build.py)."""
    w = layer.w
    depthwise = layer.kind == "conv" and layer.group > 1 and w.shape[1] == 1 and layer.group == in_channels
    if layer.kind == "gemm":
        return w.reshape(w.shape[0], 1, 1, w.shape[1]), False
    if depthwise:
        o, _, kh, kw = w.shape
        return w.reshape(layer.group, o // layer.group, kh, kw).transpose(2, 3, 0, 1), True
    return w.transpose(0, 2, 3, 1), False


def ir_layout(arr: np.ndarray, layer: _Layer, depthwise: bool) -> np.ndarray:
    """An array in :func:`mace_layout`'s layout back in the IR layout of ``layer.w``."""
    if layer.kind == "gemm":
        return arr.reshape(layer.w.shape)
    if depthwise:  # [KH, KW, C, M]
        kh, kw, c, m = arr.shape
        return arr.transpose(2, 3, 0, 1).reshape(c * m, 1, kh, kw)
    return arr.transpose(0, 3, 1, 2)


def channel_scales(qw, shape, depthwise: bool) -> np.ndarray:
    """A per-channel scheme's float32 channel scales, as float64, broadcastable to the MACE-layout ``shape``."""
    s = qw.channel_scales.astype(np.float64)
    if depthwise:
        return s.reshape(shape[2], shape[3])
    return s.reshape((-1,) + (1,) * (len(shape) - 1))


def tap_means(x: np.ndarray, layer: _Layer, kh: int, kw: int) -> np.ndarray:
    """Sum over images and output positions of the value each tap reads, float64 [C, KH, KW]
    (conv; ``x`` NCHW) or the sum over images of ``x`` [K] (gemm; ``x`` [N, K]). Divide by the
    number of (image, position) pairs for the mean."""
    x = np.asarray(x, dtype=np.float64)
    if layer.kind == "gemm":
        return x.reshape(x.shape[0], -1).sum(axis=0)
    n, c, h, w = x.shape
    top, left, bottom, right = layer.pads
    sh, sw = layer.strides
    dh, dw = layer.dilations
    oh = (h + top + bottom - dh * (kh - 1) - 1) // sh + 1
    ow = (w + left + right - dw * (kw - 1) - 1) // sw + 1
    xp = np.zeros((n, c, h + top + bottom, w + left + right))
    xp[:, :, top:top + h, left:left + w] = x
    out = np.empty((c, kh, kw))
    for ky in range(kh):
        for kx in range(kw):
            win = xp[:, :, ky * dh: ky * dh + (oh - 1) * sh + 1: sh, kx * dw: kx * dw + (ow - 1) * sw + 1: sw]
            out[:, ky, kx] = win.sum(axis=(0, 2, 3))
    return out


def _positions(x_shape, layer: _Layer, kh: int, kw: int) -> int:
    if layer.kind == "gemm":
        return 1
    _, _, h, w = x_shape
    top, left, bottom, right = layer.pads
    oh = (h + top + bottom - layer.dilations[0] * (kh - 1) - 1) // layer.strides[0] + 1
    ow = (w + left + right - layer.dilations[1] * (kw - 1) - 1) // layer.strides[1] + 1
    return oh * ow


def _mean_output(w: np.ndarray, m: np.ndarray, layer: _Layer) -> np.ndarray:
    """sum over (input channel, tap) of W * m per output channel, honouring groups."""
    if layer.kind == "gemm":
        return w @ m
    o = w.shape[0]
    og, cg = o // layer.group, w.shape[1]
    out = np.empty(o)
    for gi in range(layer.group):
        ws = w[gi * og:(gi + 1) * og]
        ms = m[gi * cg:(gi + 1) * cg]
        out[gi * og:(gi + 1) * og] = np.einsum("oikl,ikl->o", ws, ms)
    return out


def _float_sums(cal, layers: list[_Layer], batches, kernel_sizes) -> tuple[dict, dict, int]:
    """Per layer: the sum of the float model's tap means of its input over ``batches``, and the count."""
    want = list(dict.fromkeys(lay.x for lay in layers))
    names = [t for t in want if t != cal.graph.inputs[0].name]
    sess = BatchedSession(make_session(expose_outputs(cal.graph.to_onnx(), names), optimize=False),
                          cal.graph.inputs[0].name)  # a model that fixes its batch gets chunks it takes
    sums = {lay.node: 0.0 for lay in layers}
    counts = {lay.node: 0 for lay in layers}
    n_img = 0
    for batch in batches:
        x = batch.data
        got = dict(zip(names, sess.run(names, {cal.graph.inputs[0].name: x}, what="the float model (bias correction)")))
        got[cal.graph.inputs[0].name] = x
        n_img += x.shape[0]
        for lay in layers:
            xv = got[lay.x]
            kh, kw = kernel_sizes[lay.node]
            sums[lay.node] = sums[lay.node] + tap_means(xv, lay, kh, kw)
            counts[lay.node] += xv.shape[0] * _positions(xv.shape, lay, kh, kw)
    return sums, counts, n_img


def _layer_input(xq, crop) -> np.ndarray:
    """The float value of a layer's quantized input in the IR's layout (NCHW); ``crop`` (top, bottom,
    left, right) undoes a safe form's explicit Pad, so that the layer is measured on its own input."""
    v = np.asarray(xq.dequantize() if xq.qinfo is not None else xq.values, dtype=np.float64)
    if crop is not None:
        t, b, lft, r = crop
        v = v[:, t:v.shape[1] - b, lft:v.shape[2] - r, :]
    return v.transpose(0, 3, 1, 2) if v.ndim == 4 else v  # NHWC -> NCHW


def correct_biases(cal, *, device: "Device | str", data, fp32_nodes: frozenset[str] = frozenset(),
                   batch_size: int = 8, progress: bool = False) -> BiasCorrection:
    """Empirical bias correction of ``cal`` (a :class:`maceq.app.pipeline.Calibration`) for ``device``.

    ``data``: a :class:`maceq.datasets.images.ImageFolder` of the images to measure on (read twice:
    once for the float side, once for the quantized side, where they run as one batch). Returns the
    corrected float32 biases by IR node name; ``cal`` is not modified.
    """

    device = Device.parse(device)
    fp32 = select_nodes(cal.graph, cal.config.fp32_layers) | set(fp32_nodes)
    placement = check_supported(cal.graph, device=device, shapes=cal.shapes, fp32=fp32)
    layers = _layers(cal.graph, placement)
    result = BiasCorrection(device)
    if not layers:
        return result
    # W_q comes from the weights the device's model is written with (AdaRound's, when it ran)
    rounded = {lay.node: lay for lay in _layers(cal.weights_for(device.value, fp32), placement)}
    scheme = scheme_for(device)
    ksz = {lay.node: (lay.w.shape[2], lay.w.shape[3]) if lay.kind == "conv" else (1, 1) for lay in layers}
    f_sums, f_counts, n_img = _float_sums(cal, layers, data.iter_batches(batch_size), ksz)
    if n_img == 0:
        raise MaceqError("bias correction: no image could be read")
    result.images = n_img
    f_mean = {lay.node: _mean_output(lay.w, f_sums[lay.node] / f_counts[lay.node], lay) for lay in layers}
    biases: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory(prefix="maceq-bc-") as tmp:
        built = write_quantized(cal, output_dir=tmp, devices=(device,), fp32_nodes=set(fp32_nodes), model_name="bc")
        model = load(built.files.yml)
    tmap = model.tensor_map
    by_op: dict[int, _Layer] = {}
    by_out = {lay.out: lay for lay in layers}
    seen = set()
    for idx, op in enumerate(model.ops):
        lay = by_out.get(tmap.get(op.outputs[0], op.outputs[0])) if op.outputs else None
        if lay is not None and lay.node not in seen and len(op.inputs) > 2:
            by_op[idx] = lay
            seen.add(lay.node)
    missing = [lay.node for lay in layers if lay.node not in seen]
    if missing:
        raise MaceqError(f"bias correction: layer '{missing[0]}' has no op with a bias in the quantized model")
    shifts = []
    bar = tqdm(total=len(by_op), desc=f"bias correction ({device.value})", unit="layer", leave=False,
               disable=not progress or not sys.stderr.isatty())

    crops = {p.outputs[0]: tuple(p.arg("paddings")[2:6]) for p in model.ops if p.type == "Pad"}

    def before_op(idx, op, ins) -> bool:
        lay = by_op.get(idx)
        if lay is None:
            return False
        bar.update(1)
        xq = ins[0]
        v = _layer_input(xq, crops.get(op.inputs[0]))
        shape = cal.shapes[lay.x]
        v = v.reshape((v.shape[0],) + tuple(shape[1:])) if lay.kind == "conv" else v.reshape(v.shape[0], -1)
        kh, kw = ksz[lay.node]
        m_q = tap_means(v, lay, kh, kw) / (v.shape[0] * _positions(v.shape, lay, kh, kw))
        qw, w_deq = _quantized_weights(rounded[lay.node], device, shape[1] if len(shape) > 1 else None)
        shift = _mean_output(w_deq, m_q, lay) - f_mean[lay.node]
        b_new = (lay.b - shift).astype(np.float32)
        biases[lay.node] = b_new
        shifts.append(float(np.abs(shift).mean()))
        # the int32 codes the writer will store for b_new (quant/build.py _weights_and_bias)
        codes, bp = scheme.bias(b_new, float(np.float32(xq.qinfo.scale)), qw)
        name = op.inputs[2]
        model.consts[name] = np.asarray(codes, dtype=model.consts[name].dtype).reshape(model.consts[name].shape)
        model.const_qinfo[name] = QInfo(float(np.float32(bp.scale)), int(bp.zero_point),
                                        float(np.float32(bp.minval)), float(np.float32(bp.maxval)))
        return True

    x = np.concatenate([b.data for b in data.iter_batches(batch_size)])
    try:
        outputs = model.run({model.input_names[0]: x}, device=device, before_op=before_op)
    finally:
        bar.close()
    result.biases = biases
    result.shifts = shifts
    result.outputs = outputs
    return result
