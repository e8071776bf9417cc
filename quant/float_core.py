"""The core of the float-op emitter: one IR node's operands, MACE names, const tensors, ops and fused clamp.

The layout contract the emitted ops follow is described in :mod:`maceq.quant.float_emit`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from maceq.errors import MaceqError
from maceq.mace import add_arg, mace_pb2
from maceq.mace.enums import DataFormat, DataType, EltwiseType, FrameworkType
from maceq.quant.ir import ACT_ATTR, Graph, Node

TO_NCHW, TO_NHWC = (0, 3, 1, 2), (0, 2, 3, 1)
#: ONNX (NCHW) axis -> position in the stored NHWC tensor, and back
A2P, P2A = (0, 3, 1, 2), (0, 2, 3, 1)
FLT_MAX = float(np.finfo(np.float32).max)


@dataclass
class FloatEmission:
    """The MACE ops for one IR node, in execution order, and the const tensors they read."""

    ops: list = field(default_factory=list)      # mace_pb2.OperatorDef, T = DT_FLOAT
    tensors: list = field(default_factory=list)  # (mace_pb2.ConstTensor, np.ndarray) float32 / int32


def stored_shape(shape) -> list[int]:
    """The shape MACE stores an ONNX-shaped activation in: NHWC for 4-D, unchanged otherwise."""
    shape = [int(d) for d in shape]
    return [shape[0], shape[2], shape[3], shape[1]] if len(shape) == 4 else shape


def ivals(a) -> list[int]:
    """The values of an array-like, flattened, as Python ints."""
    return [int(v) for v in np.asarray(a).ravel()]


class Emitter:
    """Collects the MACE float ops and const tensors for one IR node."""

    def __init__(self, node: Node, graph: Graph, shapes, inputs, outs, op_name):
        self.n, self.g, self.shapes = node, graph, shapes
        self.ins, self.outs, self.name = inputs, outs, op_name
        self.ops: list = []
        self.tensors: list = []
        self._names: set[str] = set()
        self.act = node.attrs.get(ACT_ATTR)

    # -- the node -------------------------------------------------------------------------------
    def err(self, msg: str) -> MaceqError:
        """An error naming the node."""
        return MaceqError(f"node '{self.n.name}' ({self.n.op_type}): {msg}")

    def attr(self, key, default=None):
        """The node's attribute ``key``."""
        return self.n.attrs.get(key, default)

    def has(self, i: int) -> bool:
        """Whether input ``i`` is given."""
        return len(self.n.inputs) > i and bool(self.n.inputs[i])

    def shape(self, i: int) -> list[int]:
        """The ONNX shape of input ``i``."""
        name = self.n.inputs[i]
        if self.g.is_const(name):
            return list(np.shape(self.g.const(name)))
        if name not in self.shapes:
            raise self.err(f"unknown shape of input '{name}'")
        return [int(d) for d in self.shapes[name]]

    def oshape(self, j: int = 0) -> list[int]:
        """The ONNX shape of output ``j``."""
        name = self.n.outputs[j]
        if name not in self.shapes:
            raise self.err(f"unknown shape of output '{name}'")
        return [int(d) for d in self.shapes[name]]

    def is_const(self, i: int) -> bool:
        """Whether input ``i`` is a graph constant."""
        return self.has(i) and self.g.is_const(self.n.inputs[i])

    def const(self, i: int, what: str) -> np.ndarray:
        """The value of constant input ``i`` (``what`` names it in the error when it is not constant)."""
        if not self.is_const(i):
            raise self.err(f"{what} (input {i}) must be a constant")
        return np.asarray(self.g.const(self.n.inputs[i]))

    def src(self, i: int) -> str:
        """The MACE name of activation input ``i``."""
        if self.is_const(i):
            raise self.err(f"input {i} is a constant where an activation is expected")
        return self.ins[i]

    # -- names, ops, consts ---------------------------------------------------------------------
    def unique(self, base: str) -> str:
        """``base``, or ``base_<k>`` when this node already used that name."""
        name, k = base, 1
        while name in self._names:
            k += 1
            name = f"{base}_{k}"
        self._names.add(name)
        return name

    def tmp(self, tag: str) -> str:
        """A fresh name for an intermediate tensor."""
        return self.unique(f"{self.outs[0]}__maceq_{tag}")

    def add_op(self, op_type: str, inputs, outputs, out_shapes, *, tag: str | None = None):
        """Append a float op (the node's main op when ``tag`` is None, else a helper op named by ``tag``)."""
        op = mace_pb2.OperatorDef()
        op.input.extend(inputs)
        op.output.extend(outputs)
        op.name = self.name if tag is None else self.unique(f"{self.name}__maceq_{tag}")
        op.type = op_type
        add_arg(op, "T", DataType.DT_FLOAT)
        add_arg(op, "framework_type", FrameworkType.ONNX)
        add_arg(op, "data_format", DataFormat.NONE)
        for s in out_shapes:
            op.output_shape.add().dims.extend(int(d) for d in s)
        self.ops.append(op)
        return op

    def add_const(self, role: str, arr, dtype=DataType.DT_FLOAT) -> str:
        """Add a float32 (or int32) const tensor named after the op and ``role``; return its name."""
        arr = np.ascontiguousarray(arr, dtype=np.float32 if dtype == DataType.DT_FLOAT else np.int32)
        t = mace_pb2.ConstTensor()
        t.dims.extend(int(d) for d in arr.shape)
        t.data_type = dtype
        t.name = self.unique(f"{self.name}_{role}")
        self.tensors.append((t, arr))
        return t.name

    # -- data movement --------------------------------------------------------------------------
    def transpose(self, src: str, src_shape, perm, *, dst: str | None = None, tag: str = "t"):
        """A Transpose op; returns (its output name, its output shape)."""
        out_shape = [int(src_shape[p]) for p in perm]
        dst = dst or self.tmp(tag)
        op = self.add_op("Transpose", [src], [dst], [out_shape], tag=tag)
        add_arg(op, "dims", list(perm))
        return dst, out_shape

    def nchw_in(self, i: int = 0) -> str:
        """Input ``i`` (4-D) transposed to NCHW for a kernel that reads NCHW."""
        shp = self.shape(i)
        if len(shp) != 4:
            raise self.err(f"expected a 4-D input, got shape {shp}")
        name, _ = self.transpose(self.src(i), stored_shape(shp), TO_NCHW, tag="to_nchw")
        return name

    def nhwc_out(self, src: str, nchw_shape, dst: str):
        """Transpose an NCHW kernel result back to the stored NHWC layout."""
        self.transpose(src, nchw_shape, TO_NHWC, dst=dst, tag="to_nhwc")

    def strided_slice(self, src, dst, in_shape, begin, end, *, mask: int, out_shape, strides=None,
                      tag: str | None = "slice"):
        """A StridedSlice (unit strides unless given); ``mask`` marks the dims kept whole (begin = end mask)."""
        strides = np.ones(len(in_shape)) if strides is None else np.array(strides)
        op = self.add_op("StridedSlice", [src, self.add_const("begin", np.array(begin), DataType.DT_INT32),
                                          self.add_const("end", np.array(end), DataType.DT_INT32),
                                          self.add_const("strides", strides, DataType.DT_INT32)],
                         [dst], [out_shape], tag=tag)
        add_arg(op, "begin_mask", mask)
        add_arg(op, "end_mask", mask)
        return op

    # -- fused activation -----------------------------------------------------------------------
    def act_args(self, op):
        """Put the fused ReLU/ReLUX clamp on ``op`` as MACE activation args (used only where it fuses)."""
        if self.act is not None and self.act[0] == 0.0:
            relu_args(op, self.act[1])

    def clamp_op(self, src: str, dst: str, shape, lo: float, hi: float, *, tag: str | None = "act"):
        """A clamp to [lo, hi]: Activation RELU/RELUX when lo == 0, else Eltwise CLIP."""
        if lo == 0.0:
            op = self.add_op("Activation", [src], [dst], [shape], tag=tag)
            relu_args(op, hi)
            return
        lo_f, hi_f = max(float(lo), -FLT_MAX), min(float(hi), FLT_MAX)
        if not lo_f < hi_f:
            raise self.err(f"clip bounds ({lo}, {hi}) need min < max (MACE's CLIP check)")
        op = self.add_op("Eltwise", [src], [dst], [shape], tag=tag)
        add_arg(op, "type", EltwiseType.CLIP)
        add_arg(op, "coeff", [lo_f, hi_f])

    def result(self, fusable: bool) -> tuple[str, bool]:
        """(name the main computation writes, whether a clamp op must follow)."""
        if self.act is None:
            return self.outs[0], False
        if fusable and self.act[0] == 0.0:
            return self.outs[0], False
        return self.tmp("preact"), True

    def finish(self, main_out: str, trailing: bool, shape):
        """Add the trailing clamp op when the fused activation could not go on the main op."""
        if trailing:
            self.clamp_op(main_out, self.outs[0], shape, *self.act)


def relu_args(op, hi: float):
    """RELU, or RELUX with ``max_limit`` (onnx_converter.py convert_clip / transformer.py fold_activation)."""
    if math.isinf(hi):
        add_arg(op, "activation", "RELU")
    else:
        add_arg(op, "activation", "RELUX")
        add_arg(op, "max_limit", float(hi))
