"""Per-layer quantization error of a MACE uint8 model against its float source graph.

For each quantized layer (a uint8 op other than Quantize/Dequantize whose output is a tensor of
the optimised float graph the model was written from) two comparisons are made, both against
onnxruntime's float value of that tensor:

- ``accumulated``: the whole int8 model (``Model.run(..., intermediates=True)``), so the error
  of every layer before it is included;
- ``isolated``: only this layer quantized (PPQ / AIMET "one at a time"): its float inputs from
  onnxruntime are quantized with the quantization the model gives that input, using the
  device's own Quantize kernel (see :func:`quantize_input`), the single op runs with
  :meth:`Model.run_op` (:class:`OpRunner`), and its output is dequantized.

The int8 output is dequantized as the device tensor states it, ``float32(scale) * (code - zp)``
(:meth:`QTensor.dequantize`), taken from NHWC to NCHW (4-D) or reshaped to the float tensor's
shape (FullyConnected's [N, 1, 1, O] against Gemm's [N, O]), and compared element by element.

Statistics are accumulated over all elements of all images, in float64, as running sums
(memory does not grow with the number of images):

    S_ff = sum f^2, S_ee = sum (f - q)^2, S_fq = sum f*q, S_qq = sum q^2, M = max |f - q|
    SQNR   = 10 log10(S_ff / S_ee) dB     (+inf when S_ee == 0, -inf when S_ff == 0 < S_ee)
    cosine = S_fq / sqrt(S_ff * S_qq)      (1 when both are 0, 0 when only one is)
    rel_l2 = sqrt(S_ee / S_ff)             (0 when S_ee == 0, +inf when S_ff == 0 < S_ee)

These are pooled over the data set (not averages of per-image values). Tensors are matched by
exact name only: a MACE tensor's source-graph name is ``Model.tensor_map.get(name, name)``.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable

import numpy as np
import onnx
import onnxruntime as ort
from tqdm import tqdm

from maceq.calibrate.runner import make_session
from maceq.datasets.images import ImageFolder
from maceq.errors import MaceqError
from maceq.quant.ir import Graph
from maceq.quant.prepare import prepare_graph
from maceq.reports.evaluate import sqnr_db
from maceq.runtime.graph import RtOp
from maceq.runtime.kernels.jit import available as jit_available
from maceq.runtime.kernels.layout import nchw_to_nhwc
from maceq.runtime.model import Model, QTensor

try:  # numba is a declared dependency; RunningError.add stays as the fallback
    from numba import njit
except ImportError:  # pragma: no cover - exercised only without numba
    njit = None

DT_UINT8 = 2
BOUNDARY_OPS = ("Quantize", "Dequantize")


class Mode(Enum):
    ACCUMULATED = "accumulated"
    ISOLATED = "isolated"

    @classmethod
    def parse(cls, value: "str | Mode") -> "Mode":
        if isinstance(value, Mode):
            return value
        try:
            return cls(str(value))
        except ValueError:
            raise MaceqError(f"unknown analysis mode '{value}' (choose from "
                             f"{', '.join(m.value for m in cls)})") from None


def _finite_or_str(v: float):
    """JSON has no infinities: +-inf become the strings 'inf' / '-inf'."""
    return v if math.isfinite(v) else ("inf" if v > 0 else "-inf")


@dataclass(frozen=True)
class ErrorStats:
    """Pooled error of one layer's int8 output against float (see the module docstring)."""

    sqnr_db: float
    cosine: float
    rel_l2: float
    max_abs: float
    elements: int

    def to_dict(self) -> dict:
        return {k: _finite_or_str(v) if isinstance(v, float) else v for k, v in self.__dict__.items()}


@dataclass
class RunningError:
    """Running sums of one layer's comparison; :meth:`add` one image's tensors at a time."""

    s_ff: float = 0.0
    s_ee: float = 0.0
    s_fq: float = 0.0
    s_qq: float = 0.0
    max_abs: float = 0.0
    elements: int = 0

    def add(self, f: np.ndarray, q: np.ndarray) -> None:
        f = np.asarray(f, dtype=np.float64).ravel()
        q = np.asarray(q, dtype=np.float64).ravel()
        if f.shape != q.shape:
            raise MaceqError(f"float tensor has {f.size} elements, int8 tensor {q.size}")
        e = f - q
        # einsum's own loop, not BLAS: a BLAS dot sums in an order that depends on its thread count
        self.s_ff += float(np.einsum("i,i->", f, f))
        self.s_ee += float(np.einsum("i,i->", e, e))
        self.s_fq += float(np.einsum("i,i->", f, q))
        self.s_qq += float(np.einsum("i,i->", q, q))
        if e.size:
            self.max_abs = max(self.max_abs, float(np.max(np.abs(e))))
        self.elements += int(f.size)

    def add_tensor(self, f: np.ndarray, t: QTensor) -> None:
        """:meth:`add` of ``f`` and the device tensor ``t`` dequantized in the float layout
        (:func:`to_float_layout`): for uint8 codes one compiled pass over f and the codes, without the
        dequantized copy (the same sums to about 1e-15, in a fixed order: no thread count changes them), else
        :meth:`add` itself."""
        if error_sums_path(f, t) == "numpy":
            self.add(f, to_float_layout(t.dequantize(), f))
            return
        f4, q4 = _as_nchw_nhwc(np.asarray(f, dtype=np.float32), t.values)
        sums = np.zeros(5)
        _error_sums(f4, q4, np.float32(t.qinfo.scale), np.int32(t.qinfo.zero_point), sums)
        self.s_ff += float(sums[0])
        self.s_ee += float(sums[1])
        self.s_fq += float(sums[2])
        self.s_qq += float(sums[3])
        self.max_abs = max(self.max_abs, float(sums[4]))
        self.elements += int(f4.size)

    def stats(self) -> ErrorStats:
        if self.s_ff == 0.0 and self.s_qq == 0.0:
            cosine = 1.0
        elif self.s_ff == 0.0 or self.s_qq == 0.0:
            cosine = 0.0
        else:
            cosine = self.s_fq / math.sqrt(self.s_ff * self.s_qq)
        if self.s_ee == 0.0:
            rel = 0.0
        elif self.s_ff == 0.0:
            rel = math.inf
        else:
            rel = math.sqrt(self.s_ee / self.s_ff)
        return ErrorStats(sqnr_db(self.s_ff, self.s_ee), float(cosine), float(rel), float(self.max_abs),
                          self.elements)


def error_sums_path(f: np.ndarray, t: QTensor) -> str:
    """``"compiled"`` where :meth:`RunningError.add_tensor` takes the compiled pass (uint8 codes with their
    quantization, float32 values of as many elements, numba on), else ``"numpy"``."""
    f, q = np.asarray(f), t.values
    ok = (njit is not None and jit_available() and t.qinfo is not None and q.dtype == np.uint8
          and f.dtype == np.float32 and f.size == q.size
          and (f.ndim != 4 or q.ndim != 4 or q.shape == (f.shape[0], f.shape[2], f.shape[3], f.shape[1])))
    return "compiled" if ok else "numpy"


def _as_nchw_nhwc(f: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(f as 4-D NCHW, q as 4-D NHWC) with ``q`` in the device layout of ``f`` (:func:`to_float_layout`): 4-D both,
    else both flattened to [1, size, 1, 1] and [1, 1, 1, size]."""
    if f.ndim == 4 and q.ndim == 4:
        return f, q
    return f.reshape(1, f.size, 1, 1), np.ascontiguousarray(q).reshape(1, 1, 1, q.size)


if njit is not None:
    @njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
    def _error_sums(f, q, scale, zp, out):
        """out = [sum f^2, sum e^2, sum f*q', sum q'^2, max |e|] for f [N, C, H, W] float32 and the codes q
        [N, H, W, C], q' = float32(scale * float32(q - zp)) (QTensor.dequantize's rounding), e = f - q' in
        float64. Along W four partial sums of each kind, added in a fixed order."""
        n_, c_, h_, w_ = f.shape
        acc = np.zeros((4, 4))
        top = 0.0
        for n in range(n_):
            for c in range(c_):
                for h in range(h_):
                    fr, qr = f[n, c, h], q[n, h]
                    for w in range(w_):
                        fv = np.float64(fr[w])
                        qv = np.float64(scale * np.float32(np.int32(qr[w, c]) - zp))
                        e = fv - qv
                        j = w & 3
                        acc[0, j] += fv * fv
                        acc[1, j] += e * e
                        acc[2, j] += fv * qv
                        acc[3, j] += qv * qv
                        top = max(top, abs(e))
        for k in range(4):
            out[k] = (acc[k, 0] + acc[k, 1]) + (acc[k, 2] + acc[k, 3])
        out[4] = top


@dataclass(frozen=True)
class LayerError:
    """One quantized layer: the MACE op, the source-graph tensor and node, and its errors."""

    op: str            # MACE op name
    op_type: str       # MACE op type (Conv2D, DepthwiseConv2d, Eltwise, ...)
    tensor: str        # the source-graph tensor the op produces
    node: str | None   # the source-graph node producing it (the name fp32_nodes / --fp32 take)
    accumulated: ErrorStats | None = None
    isolated: ErrorStats | None = None

    def to_dict(self) -> dict:
        return {"op": self.op, "op_type": self.op_type, "tensor": self.tensor, "node": self.node,
                "accumulated": None if self.accumulated is None else self.accumulated.to_dict(),
                "isolated": None if self.isolated is None else self.isolated.to_dict()}


@dataclass(frozen=True)
class QuantLayer:
    """A uint8 op of the model that produces a source-graph tensor."""

    index: int        # position in Model.ops
    op: RtOp
    tensor: str       # source-graph name of op.outputs[0]
    node: str | None


# ------------------------------------------------------------------------------------------------
# The float reference
# ------------------------------------------------------------------------------------------------

@dataclass
class FloatReference:
    """onnxruntime on the float graph the model was written from, with extra tensor outputs."""

    model: onnx.ModelProto
    producers: dict[str, str]  # tensor -> node name
    input_name: str
    session: ort.InferenceSession | None = field(default=None, repr=False)

    def open(self, tensors: Iterable[str]) -> None:
        want = [t for t in dict.fromkeys(tensors)]
        missing = [t for t in want if t not in self.producers and t != self.input_name]
        if missing:
            raise MaceqError(f"tensor '{missing[0]}' of the quantized model is not in the float graph "
                             "(pass the optimised graph the model was written from)")
        m = onnx.ModelProto()
        m.CopyFrom(self.model)
        have = {o.name for o in m.graph.output}
        for t in want:
            if t not in have:
                m.graph.output.append(onnx.helper.make_empty_tensor_value_info(t))
                have.add(t)
        self.session = make_session(m, optimize=False, spin=False)  # its runs alternate with the simulation's

    def run(self, x: np.ndarray, tensors: list[str]) -> dict[str, np.ndarray]:
        got = self.session.run([t for t in tensors if t != self.input_name], {self.input_name: x})
        out = dict(zip([t for t in tensors if t != self.input_name], got))
        if self.input_name in tensors:
            out[self.input_name] = x
        return out


def float_reference(float_model, model: Model) -> FloatReference:
    """The float side from a :class:`maceq.quant.ir.Graph` (the optimised graph: preferred), an
    ``onnx.ModelProto`` of that graph, or a path to the source ONNX (imported and optimised again
    exactly as the quantizer does, with the model's recorded input shape)."""
    if isinstance(float_model, (str, os.PathLike)):
        shape = model.maceq_meta.get("input_shape")
        float_model, _, _ = prepare_graph(float_model, input_shape=list(shape) if shape else None)
    if isinstance(float_model, Graph):
        producers = {o: n.name for n in float_model.nodes for o in n.outputs}
        if len(float_model.inputs) != 1:
            raise MaceqError(f"layer analysis needs a one-input model, the float graph has "
                             f"{len(float_model.inputs)}")
        return FloatReference(float_model.to_onnx(), producers, float_model.inputs[0].name)
    if isinstance(float_model, onnx.ModelProto):
        inits = {i.name for i in float_model.graph.initializer}
        ins = [i.name for i in float_model.graph.input if i.name not in inits]
        if len(ins) != 1:
            raise MaceqError(f"layer analysis needs a one-input model, the float model has {len(ins)}")
        producers = {o: n.name for n in float_model.graph.node for o in n.output}
        return FloatReference(float_model, producers, ins[0])
    raise MaceqError(f"float model must be a Graph, an onnx.ModelProto or a path, got {type(float_model).__name__}")


# ------------------------------------------------------------------------------------------------
# Layers and the isolated run
# ------------------------------------------------------------------------------------------------

def quantized_layers(model: Model, producers: dict[str, str]) -> list[QuantLayer]:
    """The model's uint8 ops (not Quantize/Dequantize) whose first output is a source-graph tensor
    (``producers``: source tensor -> node), in execution order."""
    tmap = model.tensor_map
    layers = []
    for idx, op in enumerate(model.ops):
        if op.arg("T") != DT_UINT8 or op.type in BOUNDARY_OPS or not op.outputs:
            continue
        tensor = tmap.get(op.outputs[0], op.outputs[0])
        if tensor in producers:
            layers.append(QuantLayer(idx, op, tensor, producers[tensor]))
    return layers


def to_device_layout(x: np.ndarray) -> np.ndarray:
    """A float tensor in the device's layout: NCHW -> NHWC for 4-D, unchanged otherwise."""
    return nchw_to_nhwc(x) if x.ndim == 4 else np.ascontiguousarray(x)


def to_float_layout(q: np.ndarray, like: np.ndarray) -> np.ndarray:
    """A device tensor compared with a float one: NHWC -> NCHW when both are 4-D, else reshaped."""
    if q.ndim == 4 and like.ndim == 4:
        q = q.transpose(0, 3, 1, 2)
    if q.size != like.size:
        raise MaceqError(f"int8 tensor of shape {q.shape} cannot be compared with float shape {like.shape}")
    return q.reshape(like.shape)


class OpRunner:
    """:meth:`Model.run_op` with each op's PreparedOp kept per input quantization.

    ``run_op`` prepares the op on every call (for a conv that rebuilds its weight plan); the
    isolated analysis runs every layer once per image, so this keeps the :meth:`Model.prepare`
    result per (op name, input QInfos), as :meth:`Model.run` does per op. It is prepared as
    ``run_op`` prepares it, so the results are those of ``run_op`` (tests/test_analysis.py checks it).
    """

    def __init__(self, model: Model, device: str):
        self.model = model
        self.ctx = model.context(device)
        self._prepared: dict = {}

    def __call__(self, op: RtOp, inputs: list) -> list:
        m = self.model
        ins = [t if t is not None else QTensor(m.consts[name], m.const_qinfo.get(name))
               for name, t in zip(op.inputs, list(inputs) + [None] * (len(op.inputs) - len(inputs)))]
        key = (op.name, op.type, tuple(t.qinfo for t in ins))
        prepared = self._prepared.get(key)
        if prepared is None:
            if len(self._prepared) > 4096:
                self._prepared.clear()
            prepared = self._prepared[key] = m.prepare(op, key[2], self.ctx)
        return prepared.run(ins)


def quantize_input(run_op, producer: RtOp | None, name: str, x_dev: np.ndarray) -> QTensor:
    """The uint8 version of the float tensor ``x_dev`` (device layout), as the device makes it.

    ``run_op(op, inputs)``: runs one op on the device (an :class:`OpRunner`).

    - If the model makes this uint8 tensor with a Quantize op (the graph input, whose range is
      recomputed per input on cpu/dsp, or a float32 -> uint8 boundary), that very op runs on the
      float value.
    - Otherwise the tensor comes from a uint8 op; a Quantize op with that op's stored
      quantize_info (``find_range_every_time`` = 0) runs on the device. On cpu this is MACE's
      NEON quantize, ``clamp(trunc(zp + 0.5 + x * (1/s)), 0, 255)`` in float32 steps (round half
      away from zero of zp + x/s, then clamp to [0, 255]); on gpu ``sat_rte(x * (1/s) + zp)``;
      on dsp nnlib's quantize over the stored [min, max].
    """
    if producer is not None and producer.type == "Quantize":
        return run_op(producer, [QTensor(x_dev, None)])[0]
    if producer is None or not producer.out_qinfo:
        raise MaceqError(f"tensor '{name}': no quantization info to quantize it with")
    k = producer.outputs.index(name)
    q = RtOp(name + "__isolated_quantize", "Quantize", (name + "__isolated_float",), (name,),
             {"T": DT_UINT8, "find_range_every_time": 0}, (producer.out_qinfo[k],), ())
    return run_op(q, [QTensor(x_dev, None)])[0]


def _through_pads(name: str, tmap, producer_op, float_tensors) -> tuple[str, str, tuple]:
    """(MACE tensor, source-graph tensor, Pad ops to apply) for a layer input.

    A safe form's explicit Pad (quant/safe_forms.py) makes a tensor the float graph does not have:
    the input is then its Pad's input, padded again on the device after quantizing.
    """
    pads = []
    while tmap.get(name, name) not in float_tensors and name in producer_op and producer_op[name].type == "Pad":
        pads.append(producer_op[name])
        name = producer_op[name].inputs[0]
    return name, tmap.get(name, name), tuple(reversed(pads))


def _padded(run_op, pads: tuple, t: QTensor) -> QTensor:
    for op in pads:
        t = run_op(op, [t])[0]
    return t


# ------------------------------------------------------------------------------------------------
# The engine
# ------------------------------------------------------------------------------------------------

def analyze_layers(model: Model, float_model, data: ImageFolder, *, device: str = "cpu",
                   modes: Iterable[str | Mode] = ("accumulated", "isolated"), batch_size: int = 4,
                   progress: bool = True) -> list[LayerError]:
    """Per-layer error of ``model`` on ``device`` over the images of ``data`` (see module docstring).

    ``float_model``: the optimised float graph the model was written from (``Calibration.graph``),
    its ONNX, or the source ONNX path. Returns one :class:`LayerError` per quantized layer, in the
    model's execution order. Images run one at a time through the int8 side (the input Quantize
    recomputes its range per input); onnxruntime runs ``batch_size`` images at a time.
    """
    modes = tuple(dict.fromkeys(Mode.parse(m) for m in modes))
    if not modes:
        raise MaceqError("layer analysis: give at least one mode (accumulated, isolated)")
    if len(model.input_names) != 1:
        raise MaceqError(f"layer analysis needs a one-input model, this one has {len(model.input_names)}")
    ref = float_reference(float_model, model)
    layers = quantized_layers(model, ref.producers)
    if not layers:
        raise MaceqError("layer analysis: no uint8 layer of the model produces a tensor of the float graph "
                         "(pass the optimised graph the model was written from)")
    tmap = model.tensor_map
    producer_op = {o: op for op in model.ops for o in op.outputs}
    consts = set(model.consts)
    # Per layer input: (MACE name, source-graph name, Pad ops between them), or None for a constant
    # (run_op looks it up).
    in_names = {L.index: [None if i in consts else _through_pads(i, tmap, producer_op, ref.producers)
                          for i in L.op.inputs] for L in layers}
    need = [L.tensor for L in layers]
    if Mode.ISOLATED in modes:
        need += [e[1] for L in layers for e in in_names[L.index] if e is not None]
    need = list(dict.fromkeys(need))
    ref.open(need)
    acc = {L.index: RunningError() for L in layers} if Mode.ACCUMULATED in modes else None
    iso = {L.index: RunningError() for L in layers} if Mode.ISOLATED in modes else None
    in_name = model.input_names[0]
    run_op = OpRunner(model, device)
    n = 0
    bar = tqdm(total=len(data), desc=f"layers {device}", unit="img",
               disable=not progress or not sys.stderr.isatty(), leave=False)
    for batch in data.iter_batches(batch_size):
        floats = ref.run(batch.data, need)
        for k in range(len(batch.data)):
            # One section per image, as Model.run has per run: the single ops of the isolated pass then
            # run with BLAS held to one thread, not beside BLAS's spinning threads (runtime/threads.py).
            with model.section(device):
                if acc is not None:
                    run = model.run({in_name: batch.data[k:k + 1]}, device=device, intermediates=True)
                    for L in layers:
                        f = floats[L.tensor][k:k + 1]
                        acc[L.index].add_tensor(f, run.tensors[L.op.outputs[0]])
                    del run
                if iso is not None:
                    for L in layers:
                        ins = [None if e is None else
                               _padded(run_op, e[2], quantize_input(run_op, producer_op.get(e[0]), e[0],
                                                                    to_device_layout(floats[e[1]][k:k + 1])))
                               for e in in_names[L.index]]
                        y = run_op(L.op, ins)[0]
                        f = floats[L.tensor][k:k + 1]
                        iso[L.index].add_tensor(f, y)
            n += 1
        del floats
        bar.update(len(batch.data))
    bar.close()
    if n == 0:
        raise MaceqError(f"{data.root}: no readable image to analyse")
    return [LayerError(L.op.name, L.op.type, L.tensor, L.node,
                       None if acc is None else acc[L.index].stats(),
                       None if iso is None else iso[L.index].stats()) for L in layers]
