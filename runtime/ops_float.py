"""MACE float ops (``T = DT_FLOAT``) in the runtime: one kernel class per op type, registered for DType.FLOAT.

Layout rule (docs/float-ops.md). MACE's float CPU kernels index 4-D tensors as NCHW.
maceq holds a tensor as the op that reads it expects, decided by the op's ``data_format`` arg:

- ``data_format`` NONE (0, also when absent) or NCHW (2): **raw**. The kernel sees the array as
  stored, exactly as MACE's kernel sees its buffer: a fixed-format op (Conv2D, DepthwiseConv2d,
  Deconv2D, Pooling, BatchNorm, Resize*, PReLU, 4-D Softmax, FullyConnected) reads NCHW memory,
  and every axis / padding / begin-end argument indexes the stored dimensions. This is what
  ``maceq.quant.float_emit`` emits inside a uint8 model: explicit Transpose ops put the tensor
  in NCHW around each fixed-format op, and the other ops carry physical (NHWC) arguments.
- ``data_format`` AUTO (1000) or NHWC (1): **NHWC-held**. This is how MACE's converter writes a
  float model; MACE's NetDefAdapter then runs it in NCHW. maceq keeps such 4-D tensors NHWC
  (as ``Model.run`` feeds them), so a fixed-format kernel transposes to NCHW and back, and
  ``has_data_format`` arguments (already in NHWC form, transformer.py ``transpose_data_format``)
  index the NHWC array directly.

``prepare`` decodes the arguments (and const inputs) once; ``run`` applies the numpy kernel from
``maceq.runtime.kernels.float_ops`` and returns ``QTensor(values, None)``.

Arithmetic. On the cpu device the kernels follow MACE's NEON float code order for order
(``*_neon`` kernels: fused multiply-adds where MACE uses ``vfmaq``/``fmla``, its accumulation
orders, correctly rounded ``expf``/``tanhf``/``logf``; docs/float-neon.md). Other devices (the
gpu's float path, cpu fallbacks of the dsp) keep the plain float32 kernels.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from maceq.errors import MaceqError
from maceq.mace.enums import (
    DataFormat,
    EltwiseType,
    FrameworkType,
    Padding,
    PoolingType,
    ReduceType,
    ResizeCoordinateMode,
)
from maceq.runtime.graph import RtOp
from maceq.runtime.kernel import Kernel
from maceq.runtime.kernels import float_ops as K
from maceq.runtime.qtypes import QTensor
from maceq.runtime.registry import DType, register

#: the ``data_format`` arguments a float op may carry: raw (NONE, NCHW) or NHWC-held (NHWC, AUTO)
DATA_FORMATS = (DataFormat.NONE, DataFormat.NHWC, DataFormat.NCHW, DataFormat.AUTO)
TO_NCHW, TO_NHWC = (0, 3, 1, 2), (0, 2, 3, 1)
#: NCHW-form axis -> NHWC axis of the same dimension (4-D)
NCHW_TO_NHWC_AXIS = (0, 3, 1, 2)


def _out(values) -> QTensor:
    return QTensor(np.ascontiguousarray(values, dtype=np.float32), None)


def _fail(op: RtOp, msg: str) -> MaceqError:
    return MaceqError(f"op '{op.name}' ({op.type}, float): {msg}")


def _nhwc_held(op: RtOp) -> bool:
    df = op.arg("data_format", DataFormat.NONE)
    if df not in DATA_FORMATS:
        raise _fail(op, f"data_format {df} is not supported")
    return df in (DataFormat.NHWC, DataFormat.AUTO)


def _const(op: RtOp, ctx, idx: int, what: str) -> np.ndarray:
    if len(op.inputs) <= idx:
        raise _fail(op, f"missing input {idx} ({what})")
    name = op.inputs[idx]
    if name not in ctx.consts:
        raise _fail(op, f"{what} '{name}' must be a constant tensor")
    return np.asarray(ctx.consts[name])


def _opt_const(op: RtOp, ctx, idx: int) -> np.ndarray | None:
    if len(op.inputs) > idx and op.inputs[idx] in ctx.consts:
        return np.asarray(ctx.consts[op.inputs[idx]])
    return None


def _neon(ctx) -> bool:
    """Whether the op runs MACE's NEON fp32 kernels (the device spec's ``neon_float_kernels``); without
    a context (a kernel called on its own), the reference float kernels."""
    return ctx is not None and ctx.spec.neon_float_kernels


def _norm_axis(op: RtOp, axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise _fail(op, f"axis {axis} out of range for rank {rank}")
    return axis % rank


# ------------------------------------------------------------------------------------------
# Activation arguments (fused into Conv2D / DepthwiseConv2d / Deconv2D / FullyConnected / BatchNorm)
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ActParams:
    kind: K.ActKind
    limit: float
    coefficient: float
    hs_alpha: float
    hs_beta: float
    exact_libm: bool = False  # cpu device: correctly rounded expf/tanhf

    def apply(self, x: np.ndarray) -> np.ndarray:
        return K.activation(x, self.kind, limit=self.limit, coefficient=self.coefficient,
                            hs_alpha=self.hs_alpha, hs_beta=self.hs_beta, exact_libm=self.exact_libm)


def act_params(op: RtOp, ctx=None) -> ActParams:
    """``activation`` (string), ``max_limit``, ``activation_coefficient`` (MACE master) or
    ``leakyrelu_coefficient`` (older MACE), ``hardsigmoid_alpha``, ``hardsigmoid_beta``."""
    name = str(op.arg("activation", "NOOP")).upper()
    try:
        kind = K.ActKind(name)
    except ValueError:
        raise _fail(op, f"unknown activation '{name}'") from None
    coef = op.arg("activation_coefficient", None)
    if coef is None:
        coef = op.arg("leakyrelu_coefficient", 0.0)
    return ActParams(kind, float(op.arg("max_limit", 0.0)), float(coef),
                     float(op.arg("hardsigmoid_alpha", 0.0)), float(op.arg("hardsigmoid_beta", 0.0)),
                     _neon(ctx))


# ------------------------------------------------------------------------------------------
# Conv / pooling geometry (mace/ops/conv_pool_2d_base.h, common/conv_pool_2d_util.cc)
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Geometry:
    strides: tuple[int, int]
    dilations: tuple[int, int]
    padding_values: tuple[int, int] | None  # totals per spatial dim
    padding_mode: Padding | None            # VALID or SAME when padding_values is absent

    def pads(self, in_hw, k_hw) -> tuple[int, int, int, int]:
        """(top, left, bottom, right): MACE gives top/left ``total / 2``."""
        if self.padding_values is not None:
            th, tw = self.padding_values
        elif self.padding_mode is Padding.VALID:
            th = tw = 0
        else:  # SAME: out = (in - 1) / s + 1, total = (out-1)*s + extent - in
            th, tw = (max(0, ((i - 1) // s) * s + (k - 1) * d + 1 - i)
                      for i, k, s, d in zip(in_hw, k_hw, self.strides, self.dilations))
        return th // 2, tw // 2, th - th // 2, tw - tw // 2


def geometry(op: RtOp) -> Geometry:
    pv = op.arg("padding_values", None)
    if pv:
        return Geometry(tuple(op.arg("strides", [1, 1])), tuple(op.arg("dilations", [1, 1])), tuple(pv), None)
    mode = int(op.arg("padding", Padding.VALID))
    if mode not in (Padding.VALID, Padding.SAME):
        raise _fail(op, f"padding mode {mode} is not supported")
    return Geometry(tuple(op.arg("strides", [1, 1])), tuple(op.arg("dilations", [1, 1])), None, Padding(mode))


def _fixed_in(x: np.ndarray, nhwc: bool, op: RtOp) -> np.ndarray:
    if x.ndim != 4:
        raise _fail(op, f"expected a 4-D input, got shape {x.shape}")
    return x.transpose(TO_NCHW) if nhwc else x


def _fixed_out(y: np.ndarray, nhwc: bool) -> np.ndarray:
    return y.transpose(TO_NHWC) if nhwc else y


@dataclass(frozen=True)
class ConvParams:
    nhwc: bool
    geom: Geometry
    act: ActParams
    filter: np.ndarray = field(compare=False, repr=False)
    bias: np.ndarray | None = field(compare=False, repr=False)
    neon: bool = False


class _ConvBase(Kernel):
    def prepare(self, op: RtOp, in_q, ctx) -> ConvParams:
        if int(op.arg("group", 1)) != 1 and op.type == "Conv2D":
            raise _fail(op, f"group {op.arg('group')} (MACE's float Conv2D has no groups)")
        w = _const(op, ctx, 1, "filter").astype(np.float32)
        if w.ndim != 4:
            raise _fail(op, f"filter must be 4-D, got {w.shape}")
        bias = _opt_const(op, ctx, 2)
        return ConvParams(_nhwc_held(op), geometry(op), act_params(op, ctx), w,
                          None if bias is None else bias.astype(np.float32), _neon(ctx))


@register("Conv2D", dtype=DType.FLOAT)
class Conv2D(_ConvBase):
    """Filter OIHW (``mace/ops/ref/conv_2d.cc``); bias, then the fused activation."""

    def run(self, prepared, inputs):
        p, op = prepared.params, prepared.op
        x = _fixed_in(inputs[0].values, p.nhwc, op)
        pads = p.geom.pads(x.shape[2:], p.filter.shape[2:])
        conv = K.conv2d_neon if p.neon else K.conv2d
        y = conv(x, p.filter, p.bias, strides=p.geom.strides, pads=pads, dilations=p.geom.dilations)
        return [_out(_fixed_out(p.act.apply(y), p.nhwc))]


@register("DepthwiseConv2d", dtype=DType.FLOAT)
class DepthwiseConv2d(_ConvBase):
    """Filter ``[M, C, KH, KW]``, output channel ``c*M + m`` (``mace/ops/ref/depthwise_conv_2d.cc``)."""

    def run(self, prepared, inputs):
        p, op = prepared.params, prepared.op
        x = _fixed_in(inputs[0].values, p.nhwc, op)
        pads = p.geom.pads(x.shape[2:], p.filter.shape[2:])
        conv = K.depthwise_conv2d_neon if p.neon else K.depthwise_conv2d
        y = conv(x, p.filter, p.bias, strides=p.geom.strides, pads=pads, dilations=p.geom.dilations)
        return [_out(_fixed_out(p.act.apply(y), p.nhwc))]


@register("Deconv2D", dtype=DType.FLOAT)
class Deconv2D(_ConvBase):
    """ONNX/Caffe framework form: inputs ``[x, filter OIHW, bias]``, ``padding_values`` totals (ref/deconv_2d.cc)."""

    def prepare(self, op: RtOp, in_q, ctx) -> ConvParams:
        if int(op.arg("framework_type", FrameworkType.ONNX)) == FrameworkType.TENSORFLOW:
            raise _fail(op, "TensorFlow-style Deconv2D (output_shape input) is not supported")
        if int(op.arg("group", 1)) != 1:
            raise _fail(op, "grouped Deconv2D is not supported")
        if any(d != 1 for d in op.arg("dilations", [1, 1])):
            raise _fail(op, "dilated Deconv2D is not supported")
        if op.arg("padding_values", None) is None and int(op.arg("padding", Padding.VALID)) != Padding.VALID:
            raise _fail(op, "Deconv2D needs padding_values")
        w = _const(op, ctx, 1, "filter").astype(np.float32)
        bias = _opt_const(op, ctx, 2)
        return ConvParams(_nhwc_held(op), geometry(op), act_params(op, ctx), w,
                          None if bias is None else bias.astype(np.float32))

    def run(self, prepared, inputs):
        p, op = prepared.params, prepared.op
        x = _fixed_in(inputs[0].values, p.nhwc, op)
        total = p.geom.padding_values or (0, 0)
        y = K.deconv2d(x, p.filter, p.bias, strides=p.geom.strides, pad_total=total)
        return [_out(_fixed_out(p.act.apply(y), p.nhwc))]


@dataclass(frozen=True)
class PoolParams:
    nhwc: bool
    geom: Geometry
    max_pool: bool
    kernel: tuple[int, int]
    ceil: bool
    neon: bool = False


@register("Pooling", dtype=DType.FLOAT)
class Pooling(Kernel):
    """``pooling_type`` AVG 1 / MAX 2 (default AVG), ``kernels``, ``round_mode`` FLOOR 0 / CEIL 1 (default CEIL)."""

    def prepare(self, op: RtOp, in_q, ctx) -> PoolParams:
        kind = int(op.arg("pooling_type", PoolingType.AVG))
        if kind not in tuple(PoolingType):
            raise _fail(op, f"pooling_type {kind}")
        k = op.arg("kernels", None)
        if not k or len(k) != 2:
            raise _fail(op, "needs 'kernels' [kh, kw]")
        return PoolParams(_nhwc_held(op), geometry(op), kind == PoolingType.MAX, tuple(k),
                          int(op.arg("round_mode", 1)) == 1, _neon(ctx))

    def run(self, prepared, inputs):
        p, op = prepared.params, prepared.op
        x = _fixed_in(inputs[0].values, p.nhwc, op)
        top, left, bottom, right = p.geom.pads(x.shape[2:], p.kernel)
        y = K.pooling(x, max_pool=p.max_pool, kernel=p.kernel, strides=p.geom.strides,
                      pad_total=(top + bottom, left + right), dilations=p.geom.dilations, ceil=p.ceil)
        if p.neon and not p.max_pool and y.shape[2:] == (1, 1) and tuple(p.kernel) == tuple(x.shape[2:]):
            y = K.global_avg_pool_neon(x)  # MACE's whole-plane branch: four-lane partial sums
        return [_out(_fixed_out(y, p.nhwc))]


@dataclass(frozen=True)
class FCParams:
    nhwc: bool
    act: ActParams
    weight: np.ndarray = field(compare=False, repr=False)
    bias: np.ndarray | None = field(compare=False, repr=False)
    neon: bool = False


@register("FullyConnected", dtype=DType.FLOAT)
class FullyConnected(Kernel):
    """Weight ``[O, C, H, W]`` against the input's stored ``[N, C, H, W]`` (fully_connected.cc): both are
    flattened in memory order. Output ``[N, O, 1, 1]`` (NHWC-held: ``[N, 1, 1, O]``)."""

    def prepare(self, op: RtOp, in_q, ctx) -> FCParams:
        w = _const(op, ctx, 1, "weight").astype(np.float32)
        bias = _opt_const(op, ctx, 2)
        return FCParams(_nhwc_held(op), act_params(op, ctx), w, None if bias is None else bias.astype(np.float32),
                        _neon(ctx))

    def run(self, prepared, inputs):
        p, op = prepared.params, prepared.op
        x = inputs[0].values
        if x.ndim == 4 and p.nhwc:
            x = x.transpose(TO_NCHW)
        if x.ndim == 4 and p.weight.ndim == 4 and tuple(x.shape[1:]) != tuple(p.weight.shape[1:]):
            raise _fail(op, f"input {x.shape} does not match weight {p.weight.shape}")
        if int(np.prod(x.shape[1:])) != int(np.prod(p.weight.shape[1:])):
            raise _fail(op, f"input {x.shape} does not match weight {p.weight.shape}")
        fc = K.fully_connected_neon if p.neon else K.fully_connected
        y = p.act.apply(fc(x, p.weight, p.bias))
        n, o = y.shape
        return [_out(y.reshape(n, 1, 1, o) if p.nhwc else y.reshape(n, o, 1, 1))]


@dataclass(frozen=True)
class MatMulParams:
    transpose_a: bool
    transpose_b: bool
    has_bias: bool
    neon: bool = False


@register("MatMul", dtype=DType.FLOAT)
class MatMul(Kernel):
    """``transpose_a``/``transpose_b``; optional third input: a 1-D bias over the columns (matmul.cc)."""

    def prepare(self, op: RtOp, in_q, ctx) -> MatMulParams:
        return MatMulParams(bool(op.arg("transpose_a", 0)), bool(op.arg("transpose_b", 0)), len(op.inputs) >= 3,
                            _neon(ctx))

    def run(self, prepared, inputs):
        p = prepared.params
        bias = inputs[2].values if p.has_bias else None
        mm = K.matmul_neon if p.neon else K.matmul
        return [_out(mm(inputs[0].values, inputs[1].values, bias, transpose_a=p.transpose_a,
                        transpose_b=p.transpose_b))]


@dataclass(frozen=True)
class LayoutActParams:
    nhwc: bool
    act: ActParams


@register("BatchNorm", dtype=DType.FLOAT)
class BatchNorm(Kernel):
    """Folded form, inputs ``[x, scale, offset]``: ``scale[c] * x + offset[c]``, then the fused activation."""

    def prepare(self, op: RtOp, in_q, ctx) -> LayoutActParams:
        if len(op.inputs) != 3:
            raise _fail(op, "only the folded form [input, scale, offset] is supported")
        return LayoutActParams(_nhwc_held(op), act_params(op, ctx))

    def run(self, prepared, inputs):
        p = prepared.params
        x = inputs[0].values
        axis = (3 if p.nhwc else 1) if x.ndim == 4 else x.ndim - 1
        y = K.batch_norm(x, inputs[1].values, inputs[2].values, channel_axis=axis)
        return [_out(p.act.apply(y))]


# ------------------------------------------------------------------------------------------
# Element-wise
# ------------------------------------------------------------------------------------------

@register("Activation", dtype=DType.FLOAT)
class Activation(Kernel):
    """``activation`` RELU/RELUX/LEAKYRELU/TANH/SIGMOID/HARDSIGMOID/ELU/PRELU (PRELU: alpha = input 1)."""

    def prepare(self, op: RtOp, in_q, ctx) -> LayoutActParams:
        p = act_params(op, ctx)
        if p.kind is K.ActKind.PRELU and len(op.inputs) < 2:
            raise _fail(op, "PRELU needs an alpha input")
        return LayoutActParams(_nhwc_held(op), p)

    def run(self, prepared, inputs):
        p = prepared.params
        x = inputs[0].values
        if p.act.kind is K.ActKind.PRELU:
            axis = (3 if p.nhwc else 1) if x.ndim == 4 else min(1, x.ndim - 1)
            return [_out(K.activation(x, K.ActKind.PRELU, prelu_alpha=inputs[1].values, channel_axis=axis))]
        return [_out(p.act.apply(x))]


@dataclass(frozen=True)
class EltParams:
    kind: EltwiseType
    coeff: tuple[float, ...]
    scalar: float
    scalar_index: int
    has_df: bool
    nhwc: bool
    const_inputs: tuple[bool, ...]


@register("Eltwise", dtype=DType.FLOAT)
class Eltwise(Kernel):
    """MACE float Eltwise (eltwise.cc): ``type``; one input plus ``scalar_input`` at ``scalar_input_index``
    (default 1.0 at 1), or two inputs broadcast from the tail; ``coeff`` for SUM weights and CLIP bounds.

    ``has_data_format`` = 1 restricts broadcasting to a channel vector (MACE's per-channel path).
    NHWC-held constants of rank 4 (written NCHW by MACE's converter) are transposed to NHWC.
    """

    def prepare(self, op: RtOp, in_q, ctx) -> EltParams:
        t = int(op.arg("type", -1))
        try:
            kind = EltwiseType(t)
        except ValueError:
            raise _fail(op, f"Eltwise type {t} is not supported") from None
        if not 1 <= len(op.inputs) <= 2:
            raise _fail(op, f"{len(op.inputs)} inputs")
        coeff = tuple(float(v) for v in (op.arg("coeff", []) or []))
        return EltParams(kind, coeff, float(op.arg("scalar_input", 1.0)), int(op.arg("scalar_input_index", 1)),
                         bool(op.arg("has_data_format", 0)), _nhwc_held(op),
                         tuple(i in ctx.consts for i in op.inputs))

    def _operand(self, p: EltParams, v: np.ndarray, is_const: bool, ref_ndim: int) -> np.ndarray:
        if p.has_df and v.ndim == 1 and ref_ndim == 4:  # per-channel vector
            return v.reshape((1, 1, 1, -1) if p.nhwc else (1, -1, 1, 1))
        if p.nhwc and is_const and ref_ndim == 4 and 0 < v.ndim <= 4 and v.size > 1:
            return v.reshape((1,) * (4 - v.ndim) + v.shape).transpose(TO_NHWC)
        return v

    def run(self, prepared, inputs):
        p, op = prepared.params, prepared.op
        a = inputs[0].values
        if len(inputs) == 1:
            if p.kind in (EltwiseType.NEG, EltwiseType.ABS, EltwiseType.CLIP):
                return [_out(K.eltwise(a, None, p.kind, coeff=p.coeff))]
            b = np.float32(p.scalar)
            return [_out(K.eltwise(a, b, p.kind, coeff=p.coeff, swapped=p.scalar_index == 0))]
        b = inputs[1].values
        rank = max(a.ndim, b.ndim)
        a = self._operand(p, a, p.const_inputs[0], rank)
        b = self._operand(p, b, p.const_inputs[1], rank)
        try:
            np.broadcast_shapes(a.shape, b.shape)
        except ValueError:
            raise _fail(op, f"shapes {a.shape} and {b.shape} do not broadcast") from None
        return [_out(K.eltwise(a, b, p.kind, coeff=p.coeff))]


# ------------------------------------------------------------------------------------------
# Softmax, Reduce
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SoftmaxParams:
    nhwc: bool
    axis: int | None
    use_log: bool
    neon: bool = False


@register("Softmax", dtype=DType.FLOAT)
class Softmax(Kernel):
    """4-D: over dim 1 of the stored NCHW tensor (softmax.cc); 2-D/3-D: over the last dim.
    An explicit ``axis`` arg (MACE master) indexes the stored dims (NCHW form when NHWC-held)."""

    def prepare(self, op: RtOp, in_q, ctx) -> SoftmaxParams:
        ax = op.arg("axis", None)
        return SoftmaxParams(_nhwc_held(op), None if ax is None else int(ax), bool(op.arg("use_log", 0)), _neon(ctx))

    def run(self, prepared, inputs):
        p, op = prepared.params, prepared.op
        x = inputs[0].values
        if p.axis is None:
            axis = (3 if p.nhwc else 1) if x.ndim == 4 else x.ndim - 1
        else:
            axis = _norm_axis(op, p.axis, x.ndim)
            if p.nhwc and x.ndim == 4:
                axis = NCHW_TO_NHWC_AXIS[axis]
        if p.neon:
            nchw = x.ndim == 4 and axis == (3 if p.nhwc else 1)  # RunForNCHW; else RunForNHWC (last dim)
            if nchw or axis == x.ndim - 1:
                return [_out(K.softmax_neon(x, axis, use_log=p.use_log, nchw=nchw))]
        return [_out(K.softmax(x, axis, use_log=p.use_log))]


def _data_axis(op: RtOp, axis: int, rank: int, *, has_df: bool, nhwc: bool) -> int:
    """An axis argument as an index into the stored array.

    NHWC-held 4-D: with ``has_data_format`` the converter already wrote it in NHWC form; without,
    it is NCHW form and is moved to the NHWC position. Raw: as given.
    """
    axis = _norm_axis(op, axis, rank)
    if nhwc and rank == 4 and not has_df:
        return NCHW_TO_NHWC_AXIS[axis]
    return axis


@dataclass(frozen=True)
class ReduceParams:
    kind: ReduceType
    axes: tuple[int, ...]
    keepdims: bool
    has_df: bool
    nhwc: bool
    neon: bool = False


@register("Reduce", dtype=DType.FLOAT)
class Reduce(Kernel):
    """``reduce_type`` MEAN 0 / MIN 1 / MAX 2 / PROD 3 / SUM 4, ``axis`` (empty: all), ``keepdims`` (default 0)."""

    def prepare(self, op: RtOp, in_q, ctx) -> ReduceParams:
        try:
            kind = ReduceType(int(op.arg("reduce_type", ReduceType.MEAN)))
        except ValueError:
            raise _fail(op, f"reduce_type {op.arg('reduce_type')}") from None
        return ReduceParams(kind, tuple(op.arg("axis", []) or []), bool(op.arg("keepdims", 0)),
                            bool(op.arg("has_data_format", 0)), _nhwc_held(op), _neon(ctx))

    def run(self, prepared, inputs):
        p, op = prepared.params, prepared.op
        x = inputs[0].values
        axes = tuple(_data_axis(op, a, x.ndim, has_df=p.has_df, nhwc=p.nhwc) for a in p.axes)
        if p.neon and not (p.nhwc and x.ndim == 4):  # MACE's loops over the array as stored
            return [_out(K.reduce_neon(x, p.kind, axes, keepdims=p.keepdims))]
        return [_out(K.reduce(x, p.kind, axes, keepdims=p.keepdims))]


# ------------------------------------------------------------------------------------------
# Data movement
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AxisParams:
    axis: int
    has_df: bool
    nhwc: bool
    sizes: tuple[int, ...] | None = None  # Split: part sizes; Concat: indices of constant inputs


@register("Concat", dtype=DType.FLOAT)
class Concat(Kernel):
    """``axis`` (default 3) over the stored dims; ``has_data_format``: NHWC form (concat.cc).
    NHWC-held: 4-D constant inputs (NCHW in MACE's float model) are transposed to NHWC."""

    def prepare(self, op: RtOp, in_q, ctx) -> AxisParams:
        consts = tuple(k for k, i in enumerate(op.inputs) if i in ctx.consts)
        return AxisParams(int(op.arg("axis", 3)), bool(op.arg("has_data_format", 0)), _nhwc_held(op),
                          consts or None)

    def run(self, prepared, inputs):
        p, op = prepared.params, prepared.op
        xs = [t.values for t in inputs]
        if p.nhwc and p.sizes:
            xs = [x.transpose(TO_NHWC) if k in p.sizes and x.ndim == 4 else x for k, x in enumerate(xs)]
        axis = _data_axis(op, p.axis, xs[0].ndim, has_df=p.has_df, nhwc=p.nhwc)
        try:
            return [_out(np.concatenate(xs, axis=axis))]
        except ValueError as e:
            raise _fail(op, str(e)) from None


@register("Split", dtype=DType.FLOAT)
class Split(Kernel):
    """``axis`` (default 3); equal parts, one per output, or the sizes of a const int32 second input."""

    def prepare(self, op: RtOp, in_q, ctx) -> AxisParams:
        sizes = _opt_const(op, ctx, 1)
        return AxisParams(int(op.arg("axis", 3)), bool(op.arg("has_data_format", 0)), _nhwc_held(op),
                          None if sizes is None else tuple(int(v) for v in sizes.ravel()))

    def run(self, prepared, inputs):
        p, op = prepared.params, prepared.op
        x = inputs[0].values
        axis = _data_axis(op, p.axis, x.ndim, has_df=p.has_df, nhwc=p.nhwc)
        n_out = len(op.outputs)
        if p.sizes is None:
            if x.shape[axis] % n_out:
                raise _fail(op, f"dim {x.shape[axis]} does not split into {n_out} equal parts")
            parts = np.split(x, n_out, axis=axis)
        else:
            if len(p.sizes) != n_out or sum(p.sizes) != x.shape[axis]:
                raise _fail(op, f"split sizes {p.sizes} do not fit dim {x.shape[axis]} / {n_out} outputs")
            parts = np.split(x, np.cumsum(p.sizes)[:-1], axis=axis)
        return [_out(v) for v in parts]


@dataclass(frozen=True)
class SliceParams:
    begin: tuple[int, ...]
    end: tuple[int, ...]
    strides: tuple[int, ...]
    begin_mask: int
    end_mask: int
    shrink_mask: int
    is_slice: bool
    has_df: bool
    nhwc: bool


def _mask_nhwc_to_nchw(m: int) -> int:
    """TransposeMaskValueFromNHWCToNCHW (strided_slice.cc): bit order (N, H, W, C) -> (N, C, H, W)."""
    bits = [(m >> i) & 1 for i in range(4)]
    new = [bits[0], bits[3], bits[1], bits[2]]
    return sum(b << i for i, b in enumerate(new)) | (m & ~0xF)


@register("StridedSlice", dtype=DType.FLOAT)
class StridedSlice(Kernel):
    """Inputs ``[x, begin, end, strides]`` (int32 consts), ``begin_mask``/``end_mask``/``shrink_axis_mask``;
    ``slice`` = 1 reads the second/third inputs as begin/size (strided_slice.cc)."""

    def prepare(self, op: RtOp, in_q, ctx) -> SliceParams:
        if op.arg("ellipsis_mask", 0) or op.arg("new_axis_mask", 0):
            raise _fail(op, "ellipsis_mask / new_axis_mask are not supported (as in MACE)")
        b = tuple(int(v) for v in _const(op, ctx, 1, "begin").ravel())
        e = tuple(int(v) for v in _const(op, ctx, 2, "end").ravel())
        s_arr = _opt_const(op, ctx, 3)
        s = tuple(int(v) for v in s_arr.ravel()) if s_arr is not None else (1,) * len(b)
        return SliceParams(b, e, s, int(op.arg("begin_mask", 0)), int(op.arg("end_mask", 0)),
                           int(op.arg("shrink_axis_mask", 0)), bool(op.arg("slice", 0)),
                           bool(op.arg("has_data_format", 0)), _nhwc_held(op))

    def run(self, prepared, inputs):
        p, op = prepared.params, prepared.op
        x = inputs[0].values
        b, e, s = list(p.begin), list(p.end), list(p.strides)
        bm, em, sm = p.begin_mask, p.end_mask, p.shrink_mask
        if x.ndim == 4 and p.has_df and not p.nhwc:
            # raw NCHW storage with NHWC-form arguments: MACE moves them to NCHW
            def t(v):
                v = list(v) + [None] * (4 - len(v))
                return [v[0], v[3], v[1], v[2]]
            b, e, s = t(b), t(e), t(s)
            bm, em, sm = (_mask_nhwc_to_nchw(m) for m in (bm, em, sm))
            b = [0 if v is None else v for v in b]
            s = [1 if v is None else v for v in s]
            e = [x.shape[i] if v is None else v for i, v in enumerate(e)]
        if p.is_slice:
            if len(b) != x.ndim or len(e) != x.ndim:
                raise _fail(op, "slice: begin and size need one entry per dimension")
            size = [x.shape[i] - b[i] if e[i] == -1 else e[i] for i in range(x.ndim)]
            return [_out(K.strided_slice(x, b, [b[i] + size[i] for i in range(x.ndim)], [1] * x.ndim))]
        return [_out(K.strided_slice(x, b, e, s, begin_mask=bm, end_mask=em, shrink_axis_mask=sm))]


@dataclass(frozen=True)
class PadParams:
    paddings: tuple[int, ...]
    constant: float
    mode: int


@register("Pad", dtype=DType.FLOAT)
class Pad(Kernel):
    """``paddings`` [b0, e0, b1, e1, ...] (8 values, 4-D), ``constant_value``, ``pad_type`` (pad.cc)."""

    def prepare(self, op: RtOp, in_q, ctx) -> PadParams:
        p = list(op.arg("paddings", []) or [])
        if len(p) != 8:
            raise _fail(op, f"paddings must hold 8 values (MACE_CHECK), got {len(p)}")
        has_df, nhwc = bool(op.arg("has_data_format", 0)), _nhwc_held(op)
        if nhwc and not has_df:     # NCHW-form pairs -> NHWC order
            p = [p[i] for i in (0, 1, 4, 5, 6, 7, 2, 3)]
        elif has_df and not nhwc:   # NHWC-form pairs on raw NCHW storage (pad.cc transposes)
            p = [p[i] for i in (0, 1, 6, 7, 2, 3, 4, 5)]
        return PadParams(tuple(int(v) for v in p), float(op.arg("constant_value", 0.0)), int(op.arg("pad_type", 0)))

    def run(self, prepared, inputs):
        p = prepared.params
        return [_out(K.pad(inputs[0].values, p.paddings, constant=p.constant, mode=p.mode))]


@dataclass(frozen=True)
class DimsParams:
    dims: tuple[int, ...]


@register("Transpose", dtype=DType.FLOAT)
class Transpose(Kernel):
    """``dims``: output dim i is input dim ``dims[i]`` (transpose.cc; ranks 2-4)."""

    def prepare(self, op: RtOp, in_q, ctx) -> DimsParams:
        dims = op.arg("dims", None)
        if not dims:
            raise _fail(op, "needs 'dims'")
        return DimsParams(tuple(int(d) for d in dims))

    def run(self, prepared, inputs):
        p, op = prepared.params, prepared.op
        x = inputs[0].values
        if x.ndim != len(p.dims) or sorted(p.dims) != list(range(x.ndim)):
            raise _fail(op, f"dims {p.dims} do not permute a rank-{x.ndim} tensor")
        return [_out(x.transpose(p.dims))]


@register("Reshape", dtype=DType.FLOAT)
class Reshape(Kernel):
    """Target from the int32 shape input (reshape.cc), else the ``dim`` arg, else ``output_shape``;
    0 copies an input dim, one -1 is inferred. A raw reshape of the stored array."""

    def prepare(self, op: RtOp, in_q, ctx) -> DimsParams:
        shape = _opt_const(op, ctx, 1)
        if shape is not None:
            return DimsParams(tuple(int(v) for v in shape.ravel()))
        dims = op.arg("dim", None)
        if dims:
            return DimsParams(tuple(int(v) for v in dims))
        if op.output_shapes:
            return DimsParams((0,) + tuple(op.output_shapes[0][1:]))
        raise _fail(op, "no target shape (shape input, 'dim' arg or output_shape)")

    def run(self, prepared, inputs):
        p = prepared.params
        x = inputs[0].values
        return [_out(x.reshape(K.reshape_target(x.shape, p.dims)))]


@register("Squeeze", dtype=DType.FLOAT)
class Squeeze(Kernel):
    """``axis``: the size-1 dims to drop (all size-1 dims when empty)."""

    def prepare(self, op: RtOp, in_q, ctx) -> DimsParams:
        return DimsParams(tuple(int(a) for a in (op.arg("axis", []) or [])))

    def run(self, prepared, inputs):
        p, op = prepared.params, prepared.op
        x = inputs[0].values
        axes = tuple(a % x.ndim for a in p.dims) if p.dims else tuple(i for i, d in enumerate(x.shape) if d == 1)
        if any(x.shape[a] != 1 for a in axes):
            raise _fail(op, f"cannot squeeze axes {axes} of {x.shape}")
        return [_out(np.squeeze(x, axis=axes))]


# ------------------------------------------------------------------------------------------
# Resize
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ResizeParams:
    nhwc: bool
    size: tuple[int, int] | None
    scales: tuple[float, float] | None
    align_corners: bool
    mode: ResizeCoordinateMode


def _resize_params(op: RtOp, ctx, *, size_input: bool) -> ResizeParams:
    size = op.arg("size", None)
    size = tuple(int(v) for v in size) if size and all(int(v) > 0 for v in size) else None
    if size_input:
        t = _opt_const(op, ctx, 1)
        if t is not None:
            size = tuple(int(v) for v in t.ravel()[-2:])
    hs, ws = op.arg("height_scale", None), op.arg("width_scale", None)
    scales = (float(hs), float(ws)) if hs and ws else None
    if size is None and scales is None:
        raise _fail(op, "needs a size (arg or input) or height_scale/width_scale")
    try:
        mode = ResizeCoordinateMode(int(op.arg("coordinate_transformation_mode", ResizeCoordinateMode.NONE)))
    except ValueError:
        raise _fail(op, f"coordinate_transformation_mode {op.arg('coordinate_transformation_mode')}") from None
    return ResizeParams(_nhwc_held(op), size, scales, bool(op.arg("align_corners", 0)), mode)


def _resize_out(p: ResizeParams, in_hw) -> tuple[int, int]:
    if p.size is not None:
        return p.size
    return tuple(int(math.floor(i * s)) for i, s in zip(in_hw, p.scales))


@register("ResizeBilinear", dtype=DType.FLOAT)
class ResizeBilinear(Kernel):
    """``size`` [oh, ow] (or height/width scales), ``align_corners``, ``coordinate_transformation_mode``."""

    def prepare(self, op: RtOp, in_q, ctx) -> ResizeParams:
        return _resize_params(op, ctx, size_input=False)

    def run(self, prepared, inputs):
        p, op = prepared.params, prepared.op
        x = _fixed_in(inputs[0].values, p.nhwc, op)
        y = K.resize_bilinear(x, _resize_out(p, x.shape[2:]), align_corners=p.align_corners, mode=p.mode)
        return [_out(_fixed_out(y, p.nhwc))]


@register("ResizeNearestNeighbor", dtype=DType.FLOAT)
class ResizeNearestNeighbor(Kernel):
    """Size from the int32 second input (resize_nearest_neighbor.cc) or the ``size`` arg; ``align_corners``."""

    def prepare(self, op: RtOp, in_q, ctx) -> ResizeParams:
        p = _resize_params(op, ctx, size_input=True)
        if p.mode is not ResizeCoordinateMode.NONE:
            raise _fail(op, "coordinate_transformation_mode is not modelled for nearest-neighbour resize")
        nm = op.arg("nearest_mode", None)
        if nm not in (None, "floor") or (nm == "floor" and p.align_corners):
            raise _fail(op, f"nearest_mode '{nm}' is not modelled")
        return p

    def run(self, prepared, inputs):
        p, op = prepared.params, prepared.op
        x = _fixed_in(inputs[0].values, p.nhwc, op)
        y = K.resize_nearest(x, _resize_out(p, x.shape[2:]), align_corners=p.align_corners)
        return [_out(_fixed_out(y, p.nhwc))]
