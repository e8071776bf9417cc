"""IR node -> MACE float ops (``T = DT_FLOAT``) that run inside an otherwise uint8 MACE model.

Layout contract (docs/float-ops.md, with the MACE sources):

- In a uint8 model MACE's NetDefAdapter runs every CPU op with ``data_format`` AUTO as NHWC
  (``mace/core/net_def_adapter.cc`` ``GetDefaultDataFormat``: quantized model -> NHWC), but MACE's
  float CPU kernels index 4-D tensors as NCHW (``mace/ops/ref/conv_2d.cc``,
  ``ref/depthwise_conv_2d.cc``, ``ref/deconv_2d.cc``, ``pooling.cc``, ``resize_*.cc``, PReLU in
  ``activation.cc``, 4-D ``softmax.cc``; ``eltwise.cc`` per-channel broadcasting with
  ``has_data_format``). A float Conv2D with AUTO data format inside a uint8 model would therefore
  read NHWC memory as NCHW.
- So every op emitted here has ``data_format`` = NONE (0): the adapter leaves it alone
  (``op_registration_info.cc`` default selector returns the op's own format; NONE never triggers
  a transpose) and the kernel reads the tensor as stored. 4-D activations between ops are stored
  NHWC, as the uint8 ops store them. Each op whose float kernel is NCHW-only is wrapped in explicit
  ``Transpose`` ops (dims [0, 3, 1, 2] before, [0, 2, 3, 1] after); the other ops (Eltwise, Concat,
  Reduce, Pad, Split, StridedSlice, Transpose, Reshape, Activation except PReLU) get their axis /
  padding / broadcast arguments in the stored NHWC order, without ``has_data_format``.
- Tensors that are not 4-D are stored in ONNX order. ``output_shape`` is always the stored shape.
- Weights use MACE's float layouts: Conv2D OIHW, DepthwiseConv2d ``[M, C, KH, KW]``, Deconv2D
  OIHW (ONNX ``[Cin, Cout, KH, KW]`` transposed 1,0,2,3), MatMul weight ``[N, K]`` with
  ``transpose_b`` = 1, BatchNorm folded ``scale``/``offset`` — as MACE's converter writes them in
  ``../shared/data/mace_reference/fmnist_fp32.pb``.

Consecutive float ops leave back-to-back inverse Transposes; :func:`cancel_inverse_transposes`
removes them from a finished op list.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from maceq.errors import MaceqError
from maceq.quant.ir import ACT_ATTR, Graph, Node
from maceq.mace import add_arg, mace_pb2
from maceq.runtime.kernels import float_ops as K  # MACE's resize index / weight formulas

DT_FLOAT, DT_INT32 = mace_pb2.DT_FLOAT, mace_pb2.DT_INT32
FRAMEWORK_ONNX = 2
DF_NONE = 0
TO_NCHW, TO_NHWC = (0, 3, 1, 2), (0, 2, 3, 1)
#: ONNX (NCHW) axis -> position in the stored NHWC tensor, and back
A2P, P2A = (0, 3, 1, 2), (0, 2, 3, 1)
FLT_MAX = float(np.finfo(np.float32).max)
ELT = {"Add": 0, "Sub": 1, "Mul": 2, "Div": 3, "Min": 4, "Max": 5}
ELT_CLIP, ELT_PROD = 12, 2
REDUCE = {"ReduceMean": 0, "ReduceMin": 1, "ReduceMax": 2, "ReduceProd": 3, "ReduceSum": 4,
          "GlobalAveragePool": 0, "GlobalMaxPool": 2}
POOL_AVG, POOL_MAX = 1, 2

FLOAT_EMITTABLE = frozenset({
    "Conv", "ConvTranspose", "Gemm", "MatMul",
    "Add", "Sub", "Mul", "Div", "Max", "Min",
    "Relu", "Clip", "HardSigmoid", "HardSwish", "Sigmoid", "Tanh", "LeakyRelu", "PRelu",
    "BatchNormalization", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool",
    "ReduceMean", "ReduceMax", "ReduceMin", "ReduceSum", "ReduceProd",
    "Concat", "Softmax", "LogSoftmax", "Resize", "Upsample", "Transpose", "Pad", "Split", "Slice",
    "Flatten", "Reshape", "Squeeze", "Unsqueeze",
})


@dataclass
class FloatEmission:
    """The MACE ops for one IR node, in execution order, and the const tensors they read."""

    ops: list = field(default_factory=list)      # mace_pb2.OperatorDef, T = DT_FLOAT
    tensors: list = field(default_factory=list)  # (mace_pb2.ConstTensor, np.ndarray) float32 / int32


def stored_shape(shape) -> list[int]:
    """The shape MACE stores an ONNX-shaped activation in: NHWC for 4-D, unchanged otherwise."""
    shape = [int(d) for d in shape]
    return [shape[0], shape[2], shape[3], shape[1]] if len(shape) == 4 else shape


def emit_float_node(node: Node, *, graph: Graph, shapes: dict, inputs: Sequence[str],
                    output: str | Sequence[str], op_name: str) -> FloatEmission:
    """MACE float ops computing ``node``.

    ``inputs`` are the MACE tensor names holding ``node.inputs`` (one per IR input; constant
    operands may be given any name, they are read from ``graph``); ``output`` is the MACE name of
    the output (a list for Split); ``op_name`` names the main op (helper ops and const tensors get
    names derived from it). ``shapes`` maps IR tensor names to static NCHW shapes. A node
    attribute ``maceq_act`` = (lo, hi) adds the clamp: as ``activation`` args on
    Conv2D/DepthwiseConv2d/Deconv2D/BatchNorm when lo == 0, else as a following op.
    Unsupported nodes and attribute combinations raise MaceqError naming the node.
    """
    if node.op_type not in FLOAT_EMITTABLE:
        raise MaceqError(f"node '{node.name}': op type '{node.op_type}' has no MACE float emitter")
    outs = [output] if isinstance(output, str) else list(output)
    if len(outs) != len(node.outputs):
        raise MaceqError(f"node '{node.name}' ({node.op_type}): {len(node.outputs)} outputs, "
                         f"{len(outs)} MACE output names given")
    if len(inputs) < len([i for i in node.inputs if i]):
        raise MaceqError(f"node '{node.name}' ({node.op_type}): {len(inputs)} MACE input names for "
                         f"{len(node.inputs)} inputs")
    em = _Emitter(node, graph, shapes, list(inputs), outs, op_name)
    getattr(em, "op_" + node.op_type)()
    return FloatEmission(em.ops, em.tensors)


def cancel_inverse_transposes(ops: list, *, keep=frozenset()) -> list:
    """Remove ``Transpose(p^-1)`` ops that read a ``Transpose(p)`` output: their readers read the first op's input.

    The first Transpose goes too when nothing else reads it. ``keep`` names tensors that must
    survive (graph outputs). Returns a new op list; the ops are modified in place.
    """
    ops = list(ops)
    changed = True
    while changed:
        changed = False
        producer = {o: op for op in ops for o in op.output}
        for second in ops:
            if second.type != "Transpose" or second.output[0] in keep:
                continue
            first = producer.get(second.input[0])
            if first is None or first.type != "Transpose":
                continue
            d1, d2 = _arg_ints(first, "dims"), _arg_ints(second, "dims")
            if len(d1) != len(d2) or [d1[d] for d in d2] != list(range(len(d1))):
                continue
            src, dst = first.input[0], second.output[0]
            ops = [op for op in ops if op is not second]
            for op in ops:
                for k, name in enumerate(op.input):
                    if name == dst:
                        op.input[k] = src
            if first.output[0] not in keep and not any(first.output[0] in op.input for op in ops):
                ops = [op for op in ops if op is not first]
            changed = True
            break
    return ops


def _arg_ints(op, name) -> list[int]:
    for a in op.arg:
        if a.name == name:
            return [int(v) for v in a.ints]
    return []


def _ivals(a) -> list[int]:
    return [int(v) for v in np.asarray(a).ravel()]


class _Emitter:
    def __init__(self, node: Node, graph: Graph, shapes, inputs, outs, op_name):
        self.n, self.g, self.shapes = node, graph, shapes
        self.ins, self.outs, self.name = inputs, outs, op_name
        self.ops: list = []
        self.tensors: list = []
        self._names: set[str] = set()
        self.act = node.attrs.get(ACT_ATTR)

    # -- basics -------------------------------------------------------------------------------
    def err(self, msg: str) -> MaceqError:
        return MaceqError(f"node '{self.n.name}' ({self.n.op_type}): {msg}")

    def attr(self, key, default=None):
        return self.n.attrs.get(key, default)

    def has(self, i: int) -> bool:
        return len(self.n.inputs) > i and bool(self.n.inputs[i])

    def shape(self, i: int) -> list[int]:
        name = self.n.inputs[i]
        if self.g.is_const(name):
            return list(np.shape(self.g.const(name)))
        if name not in self.shapes:
            raise self.err(f"unknown shape of input '{name}'")
        return [int(d) for d in self.shapes[name]]

    def oshape(self, j: int = 0) -> list[int]:
        name = self.n.outputs[j]
        if name not in self.shapes:
            raise self.err(f"unknown shape of output '{name}'")
        return [int(d) for d in self.shapes[name]]

    def is_const(self, i: int) -> bool:
        return self.has(i) and self.g.is_const(self.n.inputs[i])

    def const(self, i: int, what: str) -> np.ndarray:
        if not self.is_const(i):
            raise self.err(f"{what} (input {i}) must be a constant")
        return np.asarray(self.g.const(self.n.inputs[i]))

    def src(self, i: int) -> str:
        if self.is_const(i):
            raise self.err(f"input {i} is a constant where an activation is expected")
        return self.ins[i]

    def _unique(self, base: str) -> str:
        name, k = base, 1
        while name in self._names:
            k += 1
            name = f"{base}_{k}"
        self._names.add(name)
        return name

    def tmp(self, tag: str) -> str:
        return self._unique(f"{self.outs[0]}__maceq_{tag}")

    def add_op(self, op_type: str, inputs, outputs, out_shapes, *, tag: str | None = None):
        op = mace_pb2.OperatorDef()
        op.input.extend(inputs)
        op.output.extend(outputs)
        op.name = self.name if tag is None else self._unique(f"{self.name}__maceq_{tag}")
        op.type = op_type
        self._arg(op, "T", DT_FLOAT)
        self._arg(op, "framework_type", FRAMEWORK_ONNX)
        self._arg(op, "data_format", DF_NONE)
        for s in out_shapes:
            op.output_shape.add().dims.extend(int(d) for d in s)
        self.ops.append(op)
        return op

    @staticmethod
    def _arg(op, name, value):
        return add_arg(op, name, value)

    def add_const(self, role: str, arr, dtype=DT_FLOAT) -> str:
        arr = np.ascontiguousarray(arr, dtype=np.float32 if dtype == DT_FLOAT else np.int32)
        t = mace_pb2.ConstTensor()
        t.dims.extend(int(d) for d in arr.shape)
        t.data_type = dtype
        t.name = self._unique(f"{self.name}_{role}")
        self.tensors.append((t, arr))
        return t.name

    def transpose(self, src: str, src_shape, perm, *, dst: str | None = None, tag: str = "t"):
        out_shape = [int(src_shape[p]) for p in perm]
        dst = dst or self.tmp(tag)
        op = self.add_op("Transpose", [src], [dst], [out_shape], tag=tag)
        self._arg(op, "dims", list(perm))
        return dst, out_shape

    # -- fused activation -----------------------------------------------------------------------
    def act_args(self, op) -> bool:
        """Put ``maceq_act`` on ``op`` as MACE activation args when it is ReLU/ReLUX; False if it is not."""
        if self.act is None:
            return True
        lo, hi = self.act
        if lo != 0.0:
            return False
        self._relu_args(op, hi)
        return True

    def _relu_args(self, op, hi: float):
        """RELU, or RELUX with ``max_limit`` (onnx_converter.py convert_clip / transformer.py fold_activation)."""
        if math.isinf(hi):
            self._arg(op, "activation", "RELU")
        else:
            self._arg(op, "activation", "RELUX")
            self._arg(op, "max_limit", float(hi))

    def clamp_op(self, src: str, dst: str, shape, lo: float, hi: float, *, tag: str = "act"):
        if lo == 0.0:
            op = self.add_op("Activation", [src], [dst], [shape], tag=tag)
            self._relu_args(op, hi)
            return op
        lo_f, hi_f = max(float(lo), -FLT_MAX), min(float(hi), FLT_MAX)
        if not lo_f < hi_f:
            raise self.err(f"clip bounds ({lo}, {hi}) need min < max (MACE's CLIP check)")
        op = self.add_op("Eltwise", [src], [dst], [shape], tag=tag)
        self._arg(op, "type", ELT_CLIP)
        self._arg(op, "coeff", [lo_f, hi_f])
        return op

    def result(self, fusable: bool) -> tuple[str, bool]:
        """(name the main computation writes, whether a clamp op must follow)."""
        if self.act is None:
            return self.outs[0], False
        if fusable and self.act[0] == 0.0:
            return self.outs[0], False
        return self.tmp("preact"), True

    def finish(self, main_out: str, trailing: bool, shape):
        if trailing:
            self.clamp_op(main_out, self.outs[0], shape, *self.act)

    # -- NCHW sandwich ----------------------------------------------------------------------------
    def nchw_in(self, i: int = 0) -> str:
        shp = self.shape(i)
        if len(shp) != 4:
            raise self.err(f"expected a 4-D input, got shape {shp}")
        name, _ = self.transpose(self.src(i), stored_shape(shp), TO_NCHW, tag="to_nchw")
        return name

    def nhwc_out(self, src: str, nchw_shape, dst: str):
        self.transpose(src, nchw_shape, TO_NHWC, dst=dst, tag="to_nhwc")

    # -- geometry ---------------------------------------------------------------------------------
    def spatial_pads(self, in_hw, kernel, strides, dilations) -> list[int]:
        """ONNX [top, left, bottom, right] from ``pads`` / ``auto_pad``."""
        auto = self.attr("auto_pad", "NOTSET") or "NOTSET"
        if auto == "NOTSET":
            p = [int(v) for v in (self.attr("pads") or [0, 0, 0, 0])]
            if len(p) != 4:
                raise self.err(f"pads {p}: only 2-D spatial padding is supported")
            return p
        if auto == "VALID":
            return [0, 0, 0, 0]
        if auto in ("SAME_UPPER", "SAME_LOWER"):
            tot = [max(0, (-(-i // s) - 1) * s + (k - 1) * d + 1 - i)
                   for i, k, s, d in zip(in_hw, kernel, strides, dilations)]
            first = [t // 2 if auto == "SAME_UPPER" else t - t // 2 for t in tot]
            return [first[0], first[1], tot[0] - first[0], tot[1] - first[1]]
        raise self.err(f"auto_pad={auto} is not supported")

    @staticmethod
    def mace_pads_ok(p) -> bool:
        t, l, b, r = p
        return t == (t + b) >> 1 and l == (l + r) >> 1

    def pad_nchw(self, src: str, nchw_shape, p, value: float) -> tuple[str, list[int]]:
        t, l, b, r = p
        out = [nchw_shape[0], nchw_shape[1], nchw_shape[2] + t + b, nchw_shape[3] + l + r]
        dst = self.tmp("pad")
        op = self.add_op("Pad", [src], [dst], [out], tag="pad")
        self._arg(op, "pad_type", 0)
        self._arg(op, "paddings", [0, 0, 0, 0, t, b, l, r])
        self._arg(op, "constant_value", float(value))
        return dst, out

    # -- convolutions -----------------------------------------------------------------------------
    def op_Conv(self):
        x_shape = self.shape(0)
        w = self.const(1, "weight").astype(np.float32)
        if w.ndim != 4 or len(x_shape) != 4:
            raise self.err("only 2-D convolution (4-D input and weight) is supported")
        n, c, h, wd = x_shape
        o, cg, kh, kw = w.shape
        group = int(self.attr("group", 1))
        strides = [int(v) for v in self.attr("strides", [1, 1])]
        dil = [int(v) for v in self.attr("dilations", [1, 1])]
        if c != cg * group:
            raise self.err(f"weight {w.shape} with group {group} does not fit {c} input channels")
        bias = self.const(2, "bias").astype(np.float32) if self.has(2) else None
        pads = self.spatial_pads((h, wd), (kh, kw), strides, dil)
        out_nchw = self.oshape()
        x = self.nchw_in(0)
        xs = [n, c, h, wd]
        if not self.mace_pads_ok(pads):
            x, xs = self.pad_nchw(x, xs, pads, 0.0)
            pads = [0, 0, 0, 0]
        dst, trailing = self.result(fusable=True)
        y = self.tmp("nchw")
        pv = [pads[0] + pads[2], pads[1] + pads[3]]
        depthwise = group > 1 and group == c and cg == 1

        def conv(op_type, src, filt_name, bias_name, out_shape, grp, outname, tag=None):
            op = self.add_op(op_type, [src, filt_name] + ([bias_name] if bias_name else []), [outname],
                             [out_shape], tag=tag)
            self._arg(op, "strides", strides)
            self._arg(op, "kernels", [kh, kw])
            self._arg(op, "padding_values", pv)
            self._arg(op, "group", grp)
            self._arg(op, "dilations", dil)
            if not trailing:
                self.act_args(op)
            return op

        if depthwise:
            m = o // c
            filt = w.reshape(c, m, kh, kw).transpose(1, 0, 2, 3)  # [M, C, KH, KW]
            conv("DepthwiseConv2d", x, self.add_const("filter", filt),
                 self.add_const("bias", bias) if bias is not None else None, out_nchw, c, y)
        elif group == 1:
            conv("Conv2D", x, self.add_const("filter", w),
                 self.add_const("bias", bias) if bias is not None else None, out_nchw, 1, y)
        else:
            og = o // group
            parts = [self.tmp(f"g{k}") for k in range(group)]
            part_shape = [xs[0], cg, xs[2], xs[3]]
            sp = self.add_op("Split", [x], parts, [part_shape] * group, tag="split")
            self._arg(sp, "axis", 1)
            outs = []
            for k in range(group):
                yk = self.tmp(f"gy{k}")
                conv("Conv2D", parts[k], self.add_const(f"filter_g{k}", w[k * og:(k + 1) * og]),
                     self.add_const(f"bias_g{k}", bias[k * og:(k + 1) * og]) if bias is not None else None,
                     [out_nchw[0], og, out_nchw[2], out_nchw[3]], 1, yk, tag=f"conv_g{k}")
                outs.append(yk)
            cat = self.add_op("Concat", outs, [y], [out_nchw], tag="concat")
            self._arg(cat, "axis", 1)
        self.nhwc_out(y, out_nchw, dst)
        self.finish(dst, trailing, stored_shape(out_nchw))

    def op_ConvTranspose(self):
        x_shape = self.shape(0)
        w = self.const(1, "weight").astype(np.float32)
        if w.ndim != 4 or len(x_shape) != 4:
            raise self.err("only 2-D transposed convolution is supported")
        if int(self.attr("group", 1)) != 1:
            raise self.err("group > 1 is not supported (MACE Deconv2D has no groups)")
        if any(int(d) != 1 for d in self.attr("dilations", [1, 1])):
            raise self.err("dilations != 1 are not supported (MACE's converter rejects them)")
        if (self.attr("auto_pad", "NOTSET") or "NOTSET") != "NOTSET" or self.attr("output_shape") is not None:
            raise self.err("auto_pad / output_shape are not supported; use explicit pads")
        n, ci, h, wd = x_shape
        _, co, kh, kw = w.shape
        strides = [int(v) for v in self.attr("strides", [1, 1])]
        t, l, b, r = [int(v) for v in (self.attr("pads") or [0, 0, 0, 0])]
        oph, opw = [int(v) for v in (self.attr("output_padding") or [0, 0])]
        out_nchw = self.oshape()
        full = [n, co, (h - 1) * strides[0] + kh, (wd - 1) * strides[1] + kw]
        bias = self.const(2, "bias").astype(np.float32) if self.has(2) else None
        direct = oph == 0 and opw == 0 and self.mace_pads_ok([t, l, b, r])
        if not direct and (t + out_nchw[2] > full[2] or l + out_nchw[3] > full[3]):
            raise self.err("output_padding beyond the transposed convolution's extent is not supported")
        x = self.nchw_in(0)
        dst, trailing = self.result(fusable=True)
        y = self.tmp("nchw")
        dec_out = y if direct else self.tmp("full")
        op = self.add_op("Deconv2D", [x, self.add_const("filter", w.transpose(1, 0, 2, 3))]
                         + ([self.add_const("bias", bias)] if bias is not None else []),
                         [dec_out], [out_nchw if direct else full])
        self._arg(op, "strides", strides)
        self._arg(op, "kernels", [kh, kw])
        self._arg(op, "padding_values", [t + b, l + r] if direct else [0, 0])
        self._arg(op, "group", 1)
        self._arg(op, "dilations", [1, 1])
        if not trailing:
            self.act_args(op)
        if not direct:  # crop rows t.., columns l.. of the full output
            self.strided_slice(dec_out, y, full, [0, 0, t, l], [0, 0, t + out_nchw[2], l + out_nchw[3]],
                               mask=0b0011, out_shape=out_nchw)
        self.nhwc_out(y, out_nchw, dst)
        self.finish(dst, trailing, stored_shape(out_nchw))

    def strided_slice(self, src, dst, in_shape, begin, end, *, mask: int, out_shape, tag="slice"):
        r = len(in_shape)
        op = self.add_op("StridedSlice", [src, self.add_const("begin", np.array(begin), DT_INT32),
                                          self.add_const("end", np.array(end), DT_INT32),
                                          self.add_const("strides", np.ones(r), DT_INT32)],
                         [dst], [out_shape], tag=tag)
        self._arg(op, "begin_mask", mask)
        self._arg(op, "end_mask", mask)
        return op

    # -- matrix products ----------------------------------------------------------------------------
    def op_Gemm(self):
        if int(self.attr("transA", 0)):
            raise self.err("transA = 1 is not supported")
        a_shape = self.shape(0)
        if len(a_shape) != 2:
            raise self.err(f"input of rank {len(a_shape)}")
        b = self.const(1, "weight B").astype(np.float64)
        wmat = b if int(self.attr("transB", 0)) else b.T          # [N, K]
        wmat = wmat * float(self.attr("alpha", 1.0))
        nout = wmat.shape[0]
        bias = None
        if self.has(2):
            c = self.const(2, "bias C").astype(np.float64) * float(self.attr("beta", 1.0))
            if c.size == 1:
                bias = np.full(nout, c.ravel()[0])
            elif c.shape in ((nout,), (1, nout)):
                bias = c.reshape(nout)
            else:
                raise self.err(f"bias of shape {c.shape} (only a per-output vector is supported)")
        dst, trailing = self.result(fusable=False)
        ins = [self.src(0), self.add_const("weight", wmat.astype(np.float32))]
        if bias is not None:
            ins.append(self.add_const("bias", bias.astype(np.float32)))
        op = self.add_op("MatMul", ins, [dst], [self.oshape()])
        self._arg(op, "transpose_a", 0)
        self._arg(op, "transpose_b", 1)
        self.finish(dst, trailing, self.oshape())

    def op_MatMul(self):
        a_c, b_c = self.is_const(0), self.is_const(1)
        if a_c:
            raise self.err("a constant left operand is not supported")
        ra = len(self.shape(0))
        if ra == 4 or ra < 2:
            raise self.err(f"left operand of rank {ra} (ranks 2 and 3 are supported)")
        dst, trailing = self.result(fusable=False)
        if b_c:
            b = self.const(1, "B").astype(np.float32)
            if b.ndim != 2:
                raise self.err("a constant right operand must be 2-D")
            op = self.add_op("MatMul", [self.src(0), self.add_const("weight", b.T)], [dst], [self.oshape()])
            self._arg(op, "transpose_a", 0)
            self._arg(op, "transpose_b", 1)
        else:
            rb = len(self.shape(1))
            if rb == 4 or rb < 2:
                raise self.err(f"right operand of rank {rb} (ranks 2 and 3 are supported)")
            op = self.add_op("MatMul", [self.src(0), self.src(1)], [dst], [self.oshape()])
            self._arg(op, "transpose_a", 0)
            self._arg(op, "transpose_b", 0)
        self.finish(dst, trailing, self.oshape())

    # -- element-wise ----------------------------------------------------------------------------------
    def _const_operand(self, c: np.ndarray, out_rank: int) -> np.ndarray:
        c = np.asarray(c, np.float32)
        if c.ndim > out_rank:
            raise self.err(f"constant of rank {c.ndim} broadcast to rank {out_rank}")
        if out_rank == 4:
            c = c.reshape((1,) * (4 - c.ndim) + c.shape).transpose(TO_NHWC)
        return c

    def binary(self, kind: int, a: int, b: int, src_a: str | None, src_b: str | None, dst: str, out_shape):
        """Eltwise ``type`` = kind on IR inputs a, b (``src_*`` overrides their MACE names)."""
        out_rank = len(out_shape)
        ca, cb = self.is_const(a) and src_a is None, self.is_const(b) and src_b is None
        if ca and cb:
            raise self.err("both operands are constants (fold them first)")
        phys_out = stored_shape(out_shape)
        if ca or cb:
            ci, xi = (a, b) if ca else (b, a)
            xs = self.shape(xi)
            if len(xs) != out_rank:
                raise self.err(f"activation of rank {len(xs)} broadcast to rank {out_rank} by a constant")
            c = self._const_operand(self.g.const(self.n.inputs[ci]), out_rank)
            x = (src_a if xi == a else src_b) or self.src(xi)
            if c.size == 1:
                op = self.add_op("Eltwise", [x], [dst], [phys_out], tag=None if dst == self.outs[0] else "elt")
                self._arg(op, "type", kind)
                self._arg(op, "scalar_input", float(c.ravel()[0]))
                self._arg(op, "scalar_input_index", 0 if ca else 1)
                return op
            cname = self.add_const(f"operand{ci}", c)
            ins = [cname, x] if ca else [x, cname]
        else:
            sa, sb = (self.shape(a) if src_a is None else None), (self.shape(b) if src_b is None else None)
            ra = len(sa) if sa is not None else out_rank
            rb = len(sb) if sb is not None else out_rank
            if ra != rb and 4 in (ra, rb):
                small = sa if ra < rb else sb
                if small is None or int(np.prod(small)) != 1:
                    raise self.err("a lower-rank activation broadcast against a 4-D one is not supported")
            ins = [src_a or self.src(a), src_b or self.src(b)]
        op = self.add_op("Eltwise", ins, [dst], [phys_out], tag=None if dst == self.outs[0] else "elt")
        self._arg(op, "type", kind)
        return op

    def _eltwise(self):
        kind = ELT[self.n.op_type]
        k = len(self.n.inputs)
        if k < 2:
            raise self.err("needs at least two inputs")
        out_shape = self.oshape()
        dst, trailing = self.result(fusable=False)
        if k == 2:
            self.binary(kind, 0, 1, None, None, dst, out_shape)
        else:  # Max/Min with more inputs: a chain of binary ops
            if any(self.is_const(i) for i in range(k)):
                raise self.err("constant operands in a variadic Max/Min are not supported")
            acc = self.src(0)
            for i in range(1, k):
                nxt = dst if i == k - 1 else self.tmp(f"chain{i}")
                self.binary(kind, 0, i, acc, None, nxt, out_shape)
                acc = nxt
        self.finish(dst, trailing, stored_shape(out_shape))

    op_Add = op_Sub = op_Mul = op_Div = op_Max = op_Min = _eltwise

    def _activation(self, kind: str, **args):
        shp = stored_shape(self.oshape())
        dst, trailing = self.result(fusable=False)
        op = self.add_op("Activation", [self.src(0)], [dst], [shp])
        self._arg(op, "activation", kind)
        for k, v in args.items():
            self._arg(op, k, float(v))
        self.finish(dst, trailing, shp)
        return op

    def op_Relu(self):
        self._activation("RELU")

    def op_Sigmoid(self):
        self._activation("SIGMOID")

    def op_Tanh(self):
        self._activation("TANH")

    def op_LeakyRelu(self):
        a = float(self.attr("alpha", 0.01))
        # MACE master reads activation_coefficient, older releases leakyrelu_coefficient: write both.
        self._activation("LEAKYRELU", activation_coefficient=a, leakyrelu_coefficient=a)

    def op_HardSigmoid(self):
        self._activation("HARDSIGMOID", hardsigmoid_alpha=float(self.attr("alpha", 0.2)),
                         hardsigmoid_beta=float(self.attr("beta", 0.5)))

    def op_HardSwish(self):
        # MACE has no HardSwish: x * HardSigmoid(x) with alpha = 1/6, beta = 0.5 (ONNX HardSwish definition).
        shp = stored_shape(self.oshape())
        hs = self.tmp("hardsigmoid")
        op = self.add_op("Activation", [self.src(0)], [hs], [shp], tag="hardsigmoid")
        self._arg(op, "activation", "HARDSIGMOID")
        self._arg(op, "hardsigmoid_alpha", float(np.float32(1.0 / 6.0)))
        self._arg(op, "hardsigmoid_beta", 0.5)
        dst, trailing = self.result(fusable=False)
        prod = self.add_op("Eltwise", [self.src(0), hs], [dst], [shp])
        self._arg(prod, "type", ELT_PROD)
        self.finish(dst, trailing, shp)

    def op_Clip(self):
        lo, hi = -math.inf, math.inf
        if "min" in self.n.attrs or "max" in self.n.attrs:
            lo, hi = float(self.attr("min", -math.inf)), float(self.attr("max", math.inf))
        if self.has(1):
            lo = float(self.const(1, "min").ravel()[0])
        if self.has(2):
            hi = float(self.const(2, "max").ravel()[0])
        shp = stored_shape(self.oshape())
        dst, trailing = self.result(fusable=False)
        self.clamp_op(self.src(0), dst, shp, lo, hi, tag=None)
        self.finish(dst, trailing, shp)

    def op_PRelu(self):
        slope = self.const(1, "slope").astype(np.float32)
        x_shape = self.shape(0)
        if slope.size == 1:
            a = float(slope.ravel()[0])
            self._activation("LEAKYRELU", activation_coefficient=a, leakyrelu_coefficient=a)
            return
        full = slope.reshape((1,) * (len(x_shape) - slope.ndim) + slope.shape) if slope.ndim <= len(x_shape) else None
        if len(x_shape) != 4 or full is None or full.shape != (1, x_shape[1], 1, 1):
            raise self.err(f"slope of shape {slope.shape}: only a scalar or a per-channel slope on a 4-D "
                           "input is supported")
        out_nchw = self.oshape()
        x = self.nchw_in(0)
        dst, trailing = self.result(fusable=False)
        y = self.tmp("nchw")
        op = self.add_op("Activation", [x, self.add_const("alpha", full.reshape(-1))], [y], [out_nchw])
        self._arg(op, "activation", "PRELU")
        self.nhwc_out(y, out_nchw, dst)
        self.finish(dst, trailing, stored_shape(out_nchw))

    def op_BatchNormalization(self):
        if int(self.attr("training_mode", 0)):
            raise self.err("training_mode = 1 is not supported")
        x_shape = self.shape(0)
        if len(x_shape) != 4:
            raise self.err("MACE's BatchNorm needs a 4-D input")
        gamma, beta, mean, var = (self.const(i, what).astype(np.float64)
                                  for i, what in ((1, "scale"), (2, "B"), (3, "mean"), (4, "var")))
        eps = float(self.attr("epsilon", 1e-5))
        # onnx_converter.py convert_fused_batchnorm: in float64, stored as float32
        scale = (1.0 / np.sqrt(var + eps)) * gamma
        offset = (-mean * scale) + beta
        out_nchw = self.oshape()
        x = self.nchw_in(0)
        dst, trailing = self.result(fusable=True)
        y = self.tmp("nchw")
        op = self.add_op("BatchNorm", [x, self.add_const("scale", scale), self.add_const("offset", offset)],
                         [y], [out_nchw])
        if not trailing:
            self.act_args(op)
        self.nhwc_out(y, out_nchw, dst)
        self.finish(dst, trailing, stored_shape(out_nchw))

    # -- pooling / reduce ------------------------------------------------------------------------------
    def _pool(self, max_pool: bool):
        x_shape = self.shape(0)
        k = [int(v) for v in self.attr("kernel_shape", [])]
        if len(x_shape) != 4 or len(k) != 2:
            raise self.err("only 2-D pooling is supported")
        if int(self.attr("storage_order", 0)):
            raise self.err("storage_order = 1 is not supported")
        strides = [int(v) for v in self.attr("strides", [1, 1])]
        dil = [int(v) for v in self.attr("dilations", [1, 1])]
        pads = self.spatial_pads(x_shape[2:], k, strides, dil)
        ceil = bool(self.attr("ceil_mode", 0))
        if not max_pool and int(self.attr("count_include_pad", 0)) and any(pads):
            raise self.err("count_include_pad = 1 with padding is not supported (MACE excludes padding)")
        out_nchw = self.oshape()
        x = self.nchw_in(0)
        xs = list(x_shape)
        if not self.mace_pads_ok(pads):
            if not max_pool:
                raise self.err(f"pads {pads} cannot be expressed as MACE padding_values (top must be total // 2)")
            x, xs = self.pad_nchw(x, xs, pads, -FLT_MAX)
            pads = [0, 0, 0, 0]
        pv = [pads[0] + pads[2], pads[1] + pads[3]]
        for ax in (0, 1):  # MACE's output size (CalcNCHWOutputSize, FLOOR/CEIL) must equal ONNX's
            span = xs[2 + ax] + pv[ax] - (k[ax] - 1) * dil[ax] - 1
            size = (-(-span // strides[ax]) if ceil else span // strides[ax]) + 1
            if size != out_nchw[2 + ax]:
                raise self.err(f"MACE's pooling output size {size} differs from ONNX's {out_nchw[2 + ax]}")
        y = self.tmp("nchw")
        op = self.add_op("Pooling", [x], [y], [out_nchw])
        self._arg(op, "strides", strides)
        self._arg(op, "kernels", k)
        self._arg(op, "padding_values", pv)
        self._arg(op, "pooling_type", POOL_MAX if max_pool else POOL_AVG)
        self._arg(op, "round_mode", 1 if ceil else 0)
        self._arg(op, "dilations", dil)
        dst, trailing = self.result(fusable=False)
        self.nhwc_out(y, out_nchw, dst)
        self.finish(dst, trailing, stored_shape(out_nchw))

    def op_MaxPool(self):
        self._pool(True)

    def op_AveragePool(self):
        self._pool(False)

    def _reduce(self, axes, keepdims: bool):
        x_shape = self.shape(0)
        r = len(x_shape)
        axes = sorted({int(a) % r for a in axes}) if axes else list(range(r))
        out_shape = self.oshape()
        if not keepdims and len(axes) == r:
            raise self.err("reducing every axis without keepdims (a rank-0 output) is not supported")
        phys = sorted(A2P[a] for a in axes) if r == 4 else axes
        dst, trailing = self.result(fusable=False)
        remaining = [p for p in range(r) if p not in phys]
        order = [P2A[p] for p in remaining] if r == 4 else remaining
        needs_perm = r == 4 and not keepdims and order != sorted(order)
        red_out = self.tmp("reduced") if needs_perm else dst
        red_shape = stored_shape(out_shape) if not needs_perm else [x_shape[a] for a in order]
        op = self.add_op("Reduce", [self.src(0)], [red_out], [red_shape],
                         tag="reduce" if needs_perm else None)
        self._arg(op, "reduce_type", REDUCE[self.n.op_type])
        self._arg(op, "axis", phys)
        self._arg(op, "keepdims", 1 if keepdims else 0)
        if needs_perm:  # the kept axes come out in NHWC order; the tensor (rank < 4) must be in ONNX order
            perm = sorted(range(len(order)), key=lambda i: order[i])
            self.transpose(red_out, red_shape, perm, dst=dst, tag="onnx_order")
        self.finish(dst, trailing, stored_shape(out_shape))

    def op_GlobalAveragePool(self):
        r = len(self.shape(0))
        if r < 3:
            raise self.err("needs a rank >= 3 input")
        self._reduce(list(range(2, r)), True)

    op_GlobalMaxPool = op_GlobalAveragePool

    def _reduce_node(self):
        axes = self.attr("axes")
        if axes is None and self.has(1):
            axes = _ivals(self.const(1, "axes"))
        if not axes and int(self.attr("noop_with_empty_axes", 0)):
            raise self.err("noop_with_empty_axes = 1 is not supported")
        self._reduce(axes or [], bool(int(self.attr("keepdims", 1))))

    op_ReduceMean = op_ReduceMax = op_ReduceMin = op_ReduceSum = op_ReduceProd = _reduce_node

    # -- softmax ------------------------------------------------------------------------------------------
    def _softmax(self, use_log: bool):
        x_shape = self.shape(0)
        r = len(x_shape)
        axis = int(self.attr("axis", -1 if self.g.opset >= 13 else 1)) % r
        if self.g.opset < 13 and axis != r - 1 and int(np.prod(x_shape[axis + 1:])) != 1:
            raise self.err("opset < 13 softmax over several flattened axes is not supported")
        shp = stored_shape(x_shape)
        dst, trailing = self.result(fusable=False)

        def sm(src, out, out_shape, mace_axis, tag=None):
            op = self.add_op("Softmax", [src], [out], [out_shape], tag=tag)
            if use_log:
                self._arg(op, "use_log", 1)
            self._arg(op, "axis", mace_axis)

        if r in (2, 3):
            if axis != r - 1:
                raise self.err(f"softmax over axis {axis} of a rank-{r} tensor (MACE: last axis only)")
            sm(self.src(0), dst, shp, r - 1)
        elif r == 4:
            p = A2P[axis]  # MACE's 4-D float softmax runs over dim 1 of the stored tensor
            if p == 1:
                sm(self.src(0), dst, shp, 1)
            else:
                perm = [0, p] + [d for d in (1, 2, 3) if d != p]
                t, ts = self.transpose(self.src(0), shp, perm, tag="to_axis1")
                y = self.tmp("softmax")
                sm(t, y, ts, 1, tag=None)
                inv = [perm.index(d) for d in range(4)]
                self.transpose(y, ts, inv, dst=dst, tag="from_axis1")
        else:
            raise self.err(f"softmax on a rank-{r} tensor is not supported")
        self.finish(dst, trailing, shp)

    def op_Softmax(self):
        self._softmax(False)

    def op_LogSoftmax(self):
        self._softmax(True)

    # -- data movement ------------------------------------------------------------------------------------
    def op_Concat(self):
        out_shape = self.oshape()
        r = len(out_shape)
        axis = int(self.attr("axis")) % r
        ins = []
        for i in range(len(self.n.inputs)):
            if self.is_const(i):
                c = np.asarray(self.g.const(self.n.inputs[i]), np.float32)
                ins.append(self.add_const(f"input{i}", c.transpose(TO_NHWC) if r == 4 else c))
            else:
                ins.append(self.src(i))
        dst, trailing = self.result(fusable=False)
        op = self.add_op("Concat", ins, [dst], [stored_shape(out_shape)])
        self._arg(op, "axis", A2P[axis] if r == 4 else axis)
        self.finish(dst, trailing, stored_shape(out_shape))

    def op_Transpose(self):
        x_shape = self.shape(0)
        r = len(x_shape)
        perm = [int(p) for p in (self.attr("perm") or list(range(r))[::-1])]
        if r == 4:
            dims = [A2P[perm[P2A[i]]] for i in range(4)]
        elif r in (2, 3):
            dims = perm
        else:
            raise self.err(f"rank {r} (MACE's Transpose takes ranks 2-4)")
        dst, trailing = self.result(fusable=False)
        self.transpose(self.src(0), stored_shape(x_shape), dims, dst=dst, tag="transpose")
        self.ops[-1].name = self.name
        self.finish(dst, trailing, stored_shape(self.oshape()))

    def op_Pad(self):
        mode = self.attr("mode", "constant") or "constant"
        if mode not in ("constant", "reflect"):
            raise self.err(f"mode '{mode}' is not supported")
        if self.has(3):
            raise self.err("the axes input is not supported")
        pads = self.attr("pads")
        if pads is None:
            pads = _ivals(self.const(1, "pads"))
        value = float(self.attr("value", 0.0))
        if self.has(2):
            value = float(self.const(2, "constant_value").ravel()[0])
        x_shape = self.shape(0)
        if len(x_shape) != 4:
            raise self.err("MACE's Pad needs a 4-D input")
        pads = [int(p) for p in pads]
        if min(pads) < 0:
            raise self.err("negative pads (cropping) are not supported")
        paddings = []
        for p in range(4):
            a = P2A[p]
            paddings += [pads[a], pads[a + 4]]
        dst, trailing = self.result(fusable=False)
        op = self.add_op("Pad", [self.src(0)], [dst], [stored_shape(self.oshape())])
        self._arg(op, "pad_type", 0 if mode == "constant" else 1)
        self._arg(op, "paddings", paddings)
        self._arg(op, "constant_value", value)
        self.finish(dst, trailing, stored_shape(self.oshape()))

    def op_Split(self):
        x_shape = self.shape(0)
        r = len(x_shape)
        axis = int(self.attr("axis", 0)) % r
        sizes = self.attr("split")
        if sizes is None and self.has(1):
            sizes = _ivals(self.const(1, "split"))
        k = len(self.n.outputs)
        if sizes is None:
            sizes = [int(self.oshape(j)[axis]) for j in range(k)]
        sizes = [int(s) for s in sizes]
        if len(sizes) != k or sum(sizes) != x_shape[axis]:
            raise self.err(f"split sizes {sizes} do not fit {x_shape[axis]} / {k} outputs")
        if self.act is not None:
            raise self.err("a fused activation on Split is not supported")
        pa = A2P[axis] if r == 4 else axis
        phys_in = stored_shape(x_shape)
        out_shapes = [stored_shape(self.oshape(j)) for j in range(k)]
        if k >= 2 and len(set(sizes)) == 1:
            op = self.add_op("Split", [self.src(0)], list(self.outs), out_shapes)
            self._arg(op, "axis", pa)
            return
        start = 0
        mask = ((1 << r) - 1) & ~(1 << pa)  # full range on every other dimension
        for j, s in enumerate(sizes):
            begin, end = [0] * r, [0] * r
            begin[pa], end[pa] = start, start + s
            op = self.strided_slice(self.src(0), self.outs[j], phys_in, begin, end, mask=mask,
                                    out_shape=out_shapes[j], tag=f"part{j}")
            if j == 0:
                op.name = self.name
            start += s

    def op_Slice(self):
        x_shape = self.shape(0)
        r = len(x_shape)
        if self.g.opset < 10:
            starts, ends = self.attr("starts"), self.attr("ends")
            axes, steps = self.attr("axes"), None
        else:
            starts, ends = _ivals(self.const(1, "starts")), _ivals(self.const(2, "ends"))
            axes = _ivals(self.const(3, "axes")) if self.has(3) else None
            steps = _ivals(self.const(4, "steps")) if self.has(4) else None
        axes = [int(a) % r for a in (axes if axes is not None else range(len(starts)))]
        steps = [int(s) for s in (steps if steps is not None else [1] * len(axes))]
        if any(s <= 0 for s in steps):
            raise self.err("only positive steps are supported")
        begin, end, stride = [0] * r, [0] * r, [1] * r
        mask = (1 << r) - 1
        for a, s0, e0, st in zip(axes, starts, ends, steps):
            dim = x_shape[a]
            s0, e0 = int(s0), int(e0)
            s0 = min(max(s0 + dim if s0 < 0 else s0, 0), dim)
            e0 = min(max(e0 + dim if e0 < 0 else e0, 0), dim)
            p = A2P[a] if r == 4 else a
            begin[p], end[p], stride[p] = s0, e0, st
            mask &= ~(1 << p)
        if any(d == 0 for d in self.oshape()):
            raise self.err("an empty slice is not supported")
        dst, trailing = self.result(fusable=False)
        op = self.add_op("StridedSlice", [self.src(0), self.add_const("begin", np.array(begin), DT_INT32),
                                          self.add_const("end", np.array(end), DT_INT32),
                                          self.add_const("strides", np.array(stride), DT_INT32)],
                         [dst], [stored_shape(self.oshape())])
        self._arg(op, "begin_mask", mask)
        self._arg(op, "end_mask", mask)
        self.finish(dst, trailing, stored_shape(self.oshape()))

    # -- reshapes --------------------------------------------------------------------------------------------
    @staticmethod
    def _order_matters(shape4) -> bool:
        """NHWC and NCHW memory orders differ only when C > 1 and H*W > 1."""
        return shape4[1] > 1 and shape4[2] * shape4[3] > 1

    def _reshape(self):
        in_shape, out_shape = self.shape(0), self.oshape()
        dst, trailing = self.result(fusable=False)
        cur, cur_shape = self.src(0), stored_shape(in_shape)
        if len(in_shape) == 4 and self._order_matters(in_shape):
            cur, cur_shape = self.transpose(cur, cur_shape, TO_NCHW, tag="to_nchw")
        post = len(out_shape) == 4 and self._order_matters(out_shape)
        target = list(out_shape) if post else stored_shape(out_shape)
        if target and cur_shape and target[0] == cur_shape[0]:
            target[0] = 0  # MACE Reshape: 0 copies the input's dim (keeps the batch dynamic)
        red = self.tmp("onnx_order") if post else dst
        shape_name = self.add_const("shape", np.array(target), DT_INT32)
        op = self.add_op("Reshape", [cur, shape_name], [red],
                         [list(out_shape) if post else stored_shape(out_shape)])
        self._arg(op, "dim", target)
        if post:
            self.transpose(red, out_shape, TO_NHWC, dst=dst, tag="to_nhwc")
        self.finish(dst, trailing, stored_shape(out_shape))

    op_Flatten = op_Reshape = op_Squeeze = op_Unsqueeze = _reshape

    # -- resize ----------------------------------------------------------------------------------------------
    def _resize_scales(self, in_hw, out_hw) -> tuple[float, float]:
        """The per-axis scales onnxruntime uses (given scales, or out/in from sizes)."""
        scales = None
        if self.n.op_type == "Upsample":
            scales = self.attr("scales")
            if scales is None:
                scales = [float(v) for v in self.const(1, "scales").ravel()]
        else:
            if self.g.opset < 11:
                scales = [float(v) for v in self.const(1, "scales").ravel()]
            elif self.has(2) and self.const(2, "scales").size:
                scales = [float(v) for v in self.const(2, "scales").ravel()]
        if scales is not None:
            if len(scales) != 4 or scales[0] != 1.0 or scales[1] != 1.0:
                raise self.err(f"scales {scales}: only H and W may be resized")
            return float(np.float32(scales[2])), float(np.float32(scales[3]))
        return tuple(float(np.float32(o) / np.float32(i)) for i, o in zip(in_hw, out_hw))

    def _onnx_coords(self, ct: str, in_size: int, out_size: int, scale: float) -> np.ndarray:
        """x_original per output index, float32, as onnxruntime's upsamplebase.h computes it."""
        x = np.arange(out_size, dtype=np.float32)
        s = np.float32(scale)
        if ct == "half_pixel":
            return (x + np.float32(0.5)) / s - np.float32(0.5)
        if ct == "pytorch_half_pixel":
            return (x + np.float32(0.5)) / s - np.float32(0.5) if out_size > 1 else np.zeros(out_size, np.float32)
        if ct == "align_corners":
            if out_size == 1:
                return np.zeros(1, np.float32)
            return x * np.float32(in_size - 1) / np.float32(out_size - 1)
        if ct == "asymmetric":
            return x / s
        if ct == "tf_half_pixel_for_nn":
            return (x + np.float32(0.5)) / s
        raise self.err(f"coordinate_transformation_mode '{ct}' is not supported")

    def op_Resize(self):
        self._resize()

    def op_Upsample(self):
        self._resize()

    def _resize(self):
        x_shape, out_nchw = self.shape(0), self.oshape()
        if len(x_shape) != 4 or out_nchw[:2] != x_shape[:2]:
            raise self.err("only 4-D inputs resized over H and W are supported")
        for key, ok in (("antialias", 0), ("exclude_outside", 0)):
            if int(self.attr(key, ok)) != ok:
                raise self.err(f"{key} = {self.attr(key)} is not supported")
        if self.attr("axes") is not None or (self.attr("keep_aspect_ratio_policy", "stretch") or "stretch") != "stretch":
            raise self.err("axes / keep_aspect_ratio_policy are not supported")
        mode = self.attr("mode", "nearest") or "nearest"
        upsample = self.n.op_type == "Upsample"
        ct = "asymmetric" if upsample else (self.attr("coordinate_transformation_mode", "half_pixel") or "half_pixel")
        if ct == "tf_crop_and_resize":
            raise self.err("tf_crop_and_resize is not supported")
        in_hw, out_hw = x_shape[2:], out_nchw[2:]
        scales = self._resize_scales(in_hw, out_hw)

        if mode == "nearest":
            nm = "simple" if upsample else (self.attr("nearest_mode", "round_prefer_floor") or "round_prefer_floor")
            want = [self._onnx_nearest(ct, nm, i, o, s) for i, o, s in zip(in_hw, out_hw, scales)]
            choice = None
            for align in (False, True):
                got = [K.nearest_index(i, o, align_corners=align) for i, o in zip(in_hw, out_hw)]
                if all(np.array_equal(a, b) for a, b in zip(got, want)):
                    choice = align
                    break
            if choice is None:
                raise self.err(f"nearest resize ({ct}, {nm}) {in_hw} -> {out_hw} matches neither of MACE's index "
                               "rules (floor(i*in/out) or roundf(i*(in-1)/(out-1)))")
            x = self.nchw_in(0)
            y = self.tmp("nchw")
            size = self.add_const("size", np.array(out_hw), DT_INT32)
            op = self.add_op("ResizeNearestNeighbor", [x, size], [y], [out_nchw])
            self._arg(op, "size", list(out_hw))
            self._arg(op, "align_corners", int(choice))
        elif mode in ("linear", "bilinear"):
            want = [np.clip(self._onnx_coords(ct, i, o, s), 0, i - 1) for i, o, s in zip(in_hw, out_hw, scales)]
            choice = None
            for align, cmode in ((False, K.CoordMode.NONE), (True, K.CoordMode.NONE),
                                 (False, K.CoordMode.HALF_PIXEL)):
                ok = True
                for (i, o), w in zip(zip(in_hw, out_hw), want):
                    lower, upper, lerp = K.bilinear_weights(i, o, align_corners=align, mode=cmode)
                    eff = np.where(upper == lower, lower, lower + lerp)
                    ok &= bool(np.allclose(eff, w, rtol=0, atol=1e-5))
                if ok:
                    choice = (align, cmode)
                    break
            if choice is None:
                raise self.err(f"linear resize ({ct}) {in_hw} -> {out_hw} with scales {scales} matches none of "
                               "MACE's coordinate rules")
            x = self.nchw_in(0)
            y = self.tmp("nchw")
            op = self.add_op("ResizeBilinear", [x], [y], [out_nchw])
            self._arg(op, "size", list(out_hw))
            self._arg(op, "align_corners", int(choice[0]))
            if choice[1] is not K.CoordMode.NONE:
                self._arg(op, "coordinate_transformation_mode", choice[1].value)
        else:
            raise self.err(f"mode '{mode}' is not supported")
        dst, trailing = self.result(fusable=False)
        self.nhwc_out(y, out_nchw, dst)
        self.finish(dst, trailing, stored_shape(out_nchw))

    def _onnx_nearest(self, ct: str, nm: str, in_size: int, out_size: int, scale: float) -> np.ndarray:
        """Input index per output index, as onnxruntime's nearest resize picks it (then clamped)."""
        x = self._onnx_coords(ct, in_size, out_size, scale)
        tr = np.trunc(x)
        tie = x == tr + np.float32(0.5)  # static_cast<int64_t>(x) + 0.5f == x
        away = np.where(np.abs(x - tr) >= np.float32(0.5), tr + np.sign(x), tr)  # std::round, exactly
        if nm == "round_prefer_floor":
            idx = np.where(tie, tr, away)
        elif nm == "round_prefer_ceil":
            idx = np.where(tie, np.ceil(x), away)
        elif nm == "floor":
            idx = np.floor(x)
        elif nm == "ceil":
            idx = np.ceil(x)
        elif nm == "simple":  # Upsample: ceil when downsampling, truncation otherwise
            idx = np.ceil(x) if scale < 1 else np.trunc(x)
        else:
            raise self.err(f"nearest_mode '{nm}' is not supported")
        return np.clip(idx.astype(np.int64), 0, in_size - 1)
