"""One small kernel class per MACE op, registered by (op_type, device).

``prepare(op, in_q, ctx)`` turns the op's arguments and its inputs' quantization
into a frozen dataclass (float32 values as ``np.float32``, rules as enums),
computed once per model and input quantization; the conv kernels' ``plan`` builds
their weight-derived data once; ``run(prepared, inputs)`` applies the integer
kernel from ``maceq.runtime.kernels``. Each rule a kernel follows comes from
``ctx.spec`` (see docs/semantics.md), never from the device's name.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from maceq.errors import MaceqError
from maceq.mace.enums import EltwiseType, PoolingType, ReduceType
from maceq.runtime import fixedpoint as fp
from maceq.runtime.graph import RtOp
from maceq.runtime.kernel import Kernel
from maceq.runtime.kernels import concat as k_concat
from maceq.runtime.kernels import conv as k_conv
from maceq.runtime.kernels import dw3x3_arm as k_dw3
from maceq.runtime.kernels import eltwise as k_eltwise
from maceq.runtime.kernels import layout as k_layout
from maceq.runtime.kernels import pooling as k_pool
from maceq.runtime.kernels import quantize as k_quant
from maceq.runtime.kernels import reduce as k_reduce
from maceq.runtime.kernels import softmax as k_softmax
from maceq.runtime.devices import InputQuantize, MultiplierRule, Requant
from maceq.runtime.qtypes import QInfo, QTensor, shared_qinfo
from maceq.runtime.registry import register


def op_pads(op: RtOp) -> tuple[int, int, int, int]:
    """(top, left, bottom, right) of a conv/pool op: MACE's ``padding_values`` are totals per spatial dim."""
    return k_conv.mace_pads(*op.arg("padding_values", [0, 0]))


def _require_q(op: RtOp, q, what: str) -> QInfo:
    if q is None:
        raise MaceqError(f"op '{op.name}' ({op.type}): {what} has no quantization info")
    return q


def _multiplier(profile, s_in, s_w, s_out) -> tuple[int, int]:
    if profile.multiplier_rule is MultiplierRule.FLOAT32:
        return fp.mace_output_multiplier(s_in, s_w, s_out)
    return fp.quantize_multiplier(float(np.float64(np.float32(s_in)) * np.float64(np.float32(s_w))
                                        / np.float64(np.float32(s_out))))


_FLOAT_ROUNDING = {Requant.FLOAT32_ROUNDF: k_conv.FloatRequant.ADD_ZP_THEN_ROUND,
                   Requant.FLOAT32_ROUND_THEN_ZP: k_conv.FloatRequant.ROUND_THEN_ADD_ZP}


@dataclass(frozen=True)
class ConvParams:
    x_zp: int
    w_zp: int
    out_zp: int
    #: GEMMLOWP requantization: the quantized multiplier and its shift (TFLite convention)
    multiplier: int
    shift: int
    #: the float requantization rules: f32(f32(s_in * s_w) / s_out)
    float_multiplier: np.float32
    requant: Requant
    strides: tuple[int, int]
    pads: tuple[int, int, int, int]
    dilations: tuple[int, int]
    group: int
    act_min: int
    act_max: int
    weights: str
    bias: tuple[int, ...] | None
    out_scale: np.float32
    #: uint8 depthwise on MACE's ARM CPU: the TFLite 3x3 fast path runs where it is supported.
    fast3x3: bool = False

    @functools.cached_property
    def out_q(self) -> QInfo:  # one object for every run: Plan.prepared's key of the next op
        return QInfo(float(self.out_scale), self.out_zp)


@dataclass(frozen=True)
class WeightPlan:
    """A kernel plan of runtime/kernels/conv.py built from one weight array; it runs on that array only."""

    weights: np.ndarray
    kernel: object


class _ConvBase(Kernel):
    def requant_rule(self, op: RtOp, prof) -> Requant:
        return prof.conv_requant

    def fast3x3(self, prof, requant: Requant) -> bool:
        return False

    def rescales_bias(self, prof) -> bool:
        return prof.conv_rescales_bias

    def prepare(self, op: RtOp, in_q, ctx) -> ConvParams:
        prof = ctx.spec
        xq = _require_q(op, in_q[0], "input")
        wq = _require_q(op, in_q[1], "filter")
        out_q = _require_q(op, op.out_qinfo[0] if op.out_qinfo else None, "output")
        bias = None
        if len(op.inputs) > 2:
            bq = in_q[2]
            b = ctx.consts[op.inputs[2]]
            if bq is not None and self.rescales_bias(prof):
                b = fp.mace_rescale_bias(b, xq.scale, wq.scale, bq.scale)
            bias = tuple(int(v) for v in np.asarray(b).ravel())
        requant = self.requant_rule(op, prof)
        if requant is Requant.GEMMLOWP:
            mult, shift = _multiplier(prof, xq.scale, wq.scale, out_q.scale)
            fmult = np.float32(0.0)
        else:
            mult, shift = 0, 0
            fmult = np.float32(fp.mace_float_multiplier(xq.scale, wq.scale, out_q.scale))
        act_min, act_max = 0, 255
        if prof.honours_activation_args:
            raise MaceqError(f"op '{op.name}': activation args are not implemented for this profile")
        return ConvParams(xq.zero_point, wq.zero_point, out_q.zero_point, mult, shift, fmult, requant,
                          tuple(op.arg("strides", [1, 1])), op_pads(op), tuple(op.arg("dilations", [1, 1])),
                          int(op.arg("group", 1)), act_min, act_max, op.inputs[1], bias,
                          np.float32(out_q.scale), self.fast3x3(prof, requant))

    def plan(self, op: RtOp, params: ConvParams, ctx) -> WeightPlan | None:
        """The kernel plan for the op's constant weights (offset and folded float64 weights), built once."""
        w = ctx.consts.get(op.inputs[1])
        return None if w is None else WeightPlan(w, self._make_plan(params, w))

    def _make_plan(self, p: ConvParams, w: np.ndarray):
        raise NotImplementedError

    def _plan_for(self, prepared, w: np.ndarray):
        """The prepared plan when ``w`` is the array it was built from, else one built now."""
        plan = prepared.plan
        return plan.kernel if plan is not None and plan.weights is w else self._make_plan(prepared.params, w)

    @staticmethod
    def _bias(p: ConvParams):
        return None if p.bias is None else np.asarray(p.bias, dtype=np.int32)


@register("Conv2D")
class Conv2D(_ConvBase):
    def _make_plan(self, p: ConvParams, w):
        return k_conv.conv2d_plan(w, self._bias(p), x_zp=p.x_zp, w_zp=p.w_zp, out_zp=p.out_zp,
                                  multiplier=p.multiplier, shift=p.shift, strides=p.strides, pads=p.pads,
                                  dilations=p.dilations, group=p.group, act_min=p.act_min, act_max=p.act_max)

    def run(self, prepared, inputs):
        y = self._plan_for(prepared, inputs[1].values)(inputs[0].values)
        return [QTensor(y, prepared.params.out_q)]


@register("DepthwiseConv2d")
class DepthwiseConv2d(_ConvBase):
    def requant_rule(self, op: RtOp, prof) -> Requant:
        if any(d != 1 for d in op.arg("dilations", [1, 1])):
            return prof.dilated_depthwise_requant
        return prof.depthwise_requant

    def fast3x3(self, prof, requant: Requant) -> bool:
        return prof.depthwise_3x3_fast_path and requant is Requant.GEMMLOWP

    def _make_plan(self, p: ConvParams, w):
        if p.requant is Requant.GEMMLOWP:
            fixed = dict(multiplier=p.multiplier, shift=p.shift)
        else:
            fixed = dict(float_multiplier=p.float_multiplier, float_rounding=_FLOAT_ROUNDING[p.requant])
        plan = k_conv.depthwise_conv2d_plan(w, self._bias(p), x_zp=p.x_zp, w_zp=p.w_zp, out_zp=p.out_zp,
                                            strides=p.strides, pads=p.pads, dilations=p.dilations,
                                            act_min=p.act_min, act_max=p.act_max, **fixed)
        edges = None
        if p.fast3x3 and w.shape[:2] == (3, 3) and w.shape[3] == 1:
            edges = k_dw3.Fast3x3Edges(w, self._bias(p), x_zp=p.x_zp, w_zp=p.w_zp, out_zp=p.out_zp,
                                       multiplier=p.multiplier, shift=p.shift)
        return plan, edges

    @staticmethod
    def fast3x3_shape(p: ConvParams, w_shape, x_shape) -> "k_dw3.Fast3x3Shape | None":
        """The fast path's geometry for inputs of ``x_shape`` (NHWC), or None where MACE runs the generic kernel."""
        if not p.fast3x3:
            return None
        _, h, wd, c = x_shape
        kh, kw, _, mult = w_shape
        top, left, bottom, right = p.pads
        oh = k_conv.conv_output_size(h, kh, stride=p.strides[0], dilation=1, pad_before=top, pad_after=bottom)
        ow = k_conv.conv_output_size(wd, kw, stride=p.strides[1], dilation=1, pad_before=left, pad_after=right)
        ok = k_dw3.fast3x3_supported(in_h=h, in_w=wd, in_c=c, kh=kh, kw=kw, depth_multiplier=mult,
                                     stride_h=p.strides[0], stride_w=p.strides[1], pad_h=top, pad_w=left,
                                     dilated=any(d != 1 for d in p.dilations), out_h=oh, out_w=ow,
                                     right_shift=-p.shift)
        return k_dw3.Fast3x3Shape(h, wd, c, p.strides[0], top, oh, ow) if ok else None

    def deviation(self, p: ConvParams, in_shapes) -> str | None:
        """Why the device's result departs from the model's convolution for inputs of ``in_shapes``, or None."""
        if not p.fast3x3 or in_shapes[0] is None or in_shapes[1] is None or len(in_shapes[0]) != 4:
            return None
        s = self.fast3x3_shape(p, in_shapes[1], in_shapes[0])
        return None if s is None else k_dw3.border_defect(s)

    def run(self, prepared, inputs):
        p = prepared.params
        x, w = inputs[0].values, inputs[1].values
        plan, edges = self._plan_for(prepared, w)
        y = plan(x)
        if edges is not None:
            # Where the border is right (no defect), HandlePadding's outputs equal the kernel's
            # (tests/test_dw3x3_arm.py proves the equivalence), so the pass is skipped.
            key = (x.shape, w.shape)
            if key not in edges.defects:
                s = self.fast3x3_shape(p, w.shape, x.shape)
                edges.defects[key] = s if s is not None and k_dw3.border_defect(s) is not None else None
            if edges.defects[key] is not None:
                edges(x, y, edges.defects[key])
        return [QTensor(y, p.out_q)]


@register("FullyConnected")
class FullyConnected(_ConvBase):
    def requant_rule(self, op: RtOp, prof) -> Requant:
        return prof.fc_requant

    def rescales_bias(self, prof) -> bool:
        return prof.fc_rescales_bias

    def _make_plan(self, p: ConvParams, w):
        w2 = w.reshape(w.shape[0], -1)
        if p.requant is not Requant.GEMMLOWP:
            return k_conv.fully_connected_plan(w2, self._bias(p), x_zp=p.x_zp, w_zp=p.w_zp, out_zp=p.out_zp,
                                               multiplier=p.float_multiplier, act_min=p.act_min,
                                               act_max=p.act_max, rounding=_FLOAT_ROUNDING[p.requant])
        return k_conv.fully_connected_fixed_plan(w2, self._bias(p), x_zp=p.x_zp, w_zp=p.w_zp, out_zp=p.out_zp,
                                                 multiplier=p.multiplier, shift=p.shift, act_min=p.act_min,
                                                 act_max=p.act_max)

    def run(self, prepared, inputs):
        p = prepared.params
        x, w = inputs[0].values, inputs[1].values
        n = x.shape[0]
        x2 = x.reshape(n, -1)
        k = int(np.prod(w.shape[1:]))
        if x2.shape[1] != k:
            raise MaceqError(f"FullyConnected '{p.weights}': input has {x2.shape[1]} features, weights {k}")
        y = self._plan_for(prepared, w)(x2)
        return [QTensor(y.reshape(n, 1, 1, -1), p.out_q)]


@dataclass(frozen=True)
class EltwiseParams:
    subtract: bool
    a_scale: np.float32
    a_zp: int
    b_scale: np.float32
    b_zp: int
    out_scale: np.float32
    out_zp: int


@register("Eltwise")
class Eltwise(Kernel):
    def prepare(self, op: RtOp, in_q, ctx) -> EltwiseParams:
        kind = int(op.arg("type", EltwiseType.SUM))
        if kind not in (EltwiseType.SUM, EltwiseType.SUB):
            raise MaceqError(f"op '{op.name}': uint8 Eltwise supports SUM (0) and SUB (1) only, got type {kind}")
        if len(op.inputs) != 2:
            raise MaceqError(f"op '{op.name}': uint8 Eltwise needs two tensor inputs")
        a = _require_q(op, in_q[0], "input 0")
        b = _require_q(op, in_q[1], "input 1")
        o = _require_q(op, op.out_qinfo[0] if op.out_qinfo else None, "output")
        return EltwiseParams(kind == EltwiseType.SUB, np.float32(a.scale), a.zero_point, np.float32(b.scale),
                             b.zero_point, np.float32(o.scale), o.zero_point)

    def run(self, prepared, inputs):
        p = prepared.params
        y = k_eltwise.eltwise_add(inputs[0].values, inputs[1].values, a_scale=float(p.a_scale), a_zp=p.a_zp,
                                  b_scale=float(p.b_scale), b_zp=p.b_zp, out_scale=float(p.out_scale),
                                  out_zp=p.out_zp, subtract=p.subtract)
        return [QTensor(y, shared_qinfo(float(p.out_scale), p.out_zp))]


@dataclass(frozen=True)
class PoolParams:
    kind: PoolingType
    kernel: tuple[int, int]
    strides: tuple[int, int]
    pads: tuple[int, int, int, int]
    out_scale: np.float32
    out_zp: int


def pooling_type(op: RtOp) -> PoolingType:
    """The op's ``pooling_type`` argument (required), or MaceqError."""
    kind = int(op.require("pooling_type"))
    if kind not in tuple(PoolingType):
        raise MaceqError(f"op '{op.name}': unknown pooling_type {kind}")
    return PoolingType(kind)


@register("Pooling")
class Pooling(Kernel):
    def prepare(self, op: RtOp, in_q, ctx) -> PoolParams:
        q = _require_q(op, in_q[0], "input")
        kind = pooling_type(op)
        if any(d != 1 for d in op.arg("dilations", [1, 1])):
            raise MaceqError(f"op '{op.name}': dilated pooling is not supported")
        return PoolParams(kind, tuple(op.require("kernels")), tuple(op.arg("strides", [1, 1])), op_pads(op),
                          np.float32(q.scale), q.zero_point)

    def run(self, prepared, inputs):
        p = prepared.params
        x = inputs[0].values
        if p.kind is PoolingType.MAX:
            y = k_pool.max_pool(x, kernel=p.kernel, strides=p.strides, pads=p.pads)
        else:
            y = k_pool.avg_pool(x, kernel=p.kernel, strides=p.strides, pads=p.pads)
        return [QTensor(y, inputs[0].qinfo)]


@dataclass(frozen=True)
class ReduceParams:
    """MEAN over ``axes`` of the codes; the output keeps the input's quantization (reduce.cc)."""

    axes: tuple[int, ...]
    keepdims: bool


@register("Reduce")
class Reduce(Kernel):
    def prepare(self, op: RtOp, in_q, ctx) -> ReduceParams:
        if int(op.arg("reduce_type", ReduceType.MEAN)) != ReduceType.MEAN:
            raise MaceqError(f"op '{op.name}': uint8 Reduce supports MEAN (reduce_type 0) only")
        _require_q(op, in_q[0], "input")
        return ReduceParams(tuple(op.arg("axis", [1, 2])), bool(op.arg("keepdims", 1)))

    def run(self, prepared, inputs):
        p = prepared.params
        y = k_reduce.reduce_mean(inputs[0].values, axes=p.axes, keepdims=p.keepdims)
        # reduce.cc: output->SetScale(input->scale()) -- the stored output info is not used.
        return [QTensor(y, inputs[0].qinfo)]


@dataclass(frozen=True)
class ConcatParams:
    axis: int
    in_scales: tuple[np.float32, ...]
    in_zps: tuple[int, ...]
    out_scale: np.float32
    out_zp: int


@register("Concat")
class Concat(Kernel):
    def prepare(self, op: RtOp, in_q, ctx) -> ConcatParams:
        qs = [_require_q(op, q, f"input {k}") for k, q in enumerate(in_q)]
        o = _require_q(op, op.out_qinfo[0] if op.out_qinfo else None, "output")
        return ConcatParams(int(op.arg("axis", 3)), tuple(np.float32(q.scale) for q in qs),
                            tuple(q.zero_point for q in qs), np.float32(o.scale), o.zero_point)

    def run(self, prepared, inputs):
        p = prepared.params
        in_q = [QInfo(float(s), z) for s, z in zip(p.in_scales, p.in_zps)]
        out_scale = float(p.out_scale)
        y = k_concat.concat([t.values for t in inputs], axis=p.axis, in_qinfos=in_q, out_scale=out_scale,
                            out_zp=p.out_zp)
        return [QTensor(y, shared_qinfo(out_scale, p.out_zp))]


@dataclass(frozen=True)
class SoftmaxParams:
    in_scale: np.float32
    in_zp: int
    out_scale: np.float32
    out_zp: int


@register("Softmax")
class Softmax(Kernel):
    def prepare(self, op: RtOp, in_q, ctx) -> SoftmaxParams:
        q = _require_q(op, in_q[0], "input")
        o = _require_q(op, op.out_qinfo[0] if op.out_qinfo else None, "output")
        return SoftmaxParams(np.float32(q.scale), q.zero_point, np.float32(o.scale), o.zero_point)

    def run(self, prepared, inputs):
        y = k_softmax.softmax(inputs[0].values, in_scale=float(prepared.params.in_scale))
        # softmax.cc sets the output's scale/zero point itself (1/255, 0), whatever the model stored.
        return [QTensor(y, shared_qinfo(float(np.float32(k_softmax.OUT_SCALE)), int(k_softmax.OUT_ZP)))]


@dataclass(frozen=True)
class QuantizeParams:
    find_range: bool
    scale: np.float32
    zero_point: int
    rule: InputQuantize


@register("Quantize")
class Quantize(Kernel):
    def prepare(self, op: RtOp, in_q, ctx) -> QuantizeParams:
        o = _require_q(op, op.out_qinfo[0] if op.out_qinfo else None, "output")
        prof = ctx.spec
        # quantize.cc: the range is recomputed when find_range_every_time is set or no scale is stored.
        find = (bool(op.arg("find_range_every_time", 0)) and prof.find_range_every_time) or o.scale == 0.0
        return QuantizeParams(find, np.float32(o.scale), o.zero_point, prof.input_quantize)

    def run(self, prepared, inputs):
        p = prepared.params
        x = np.asarray(inputs[0].values, dtype=np.float32)
        if p.rule is not InputQuantize.NEON_TRUNC:
            raise MaceqError(f"input quantize rule {p.rule.value} is not implemented")
        if p.find_range:
            lo, hi = k_quant.find_range(x)
            scale, zp = k_quant.adjust_range(lo, hi, non_zero=False)
        else:
            scale, zp = float(p.scale), p.zero_point
        y = k_quant.quantize_neon(x, scale=scale, zero_point=zp)
        return [QTensor(y, shared_qinfo(float(np.float32(scale)), int(zp)))]


@dataclass(frozen=True)
class PadParams:
    paddings: tuple[int, ...]  # NHWC: (before, after) per dim
    fill: int  # the constant's code


@register("Pad")
class Pad(Kernel):
    """uint8 Pad (mace/ops/pad.cc, ``PadOp<RT_CPU, uint8_t>``): NHWC paddings, CONSTANT mode.

    The fill code is ``Quantize<uint8_t>(constant_value, scale, zp)`` =
    ``Saturate(roundf(f32(f32(value / scale) + zp)))``; the output keeps the input's scale and zero point.
    """

    def prepare(self, op: RtOp, in_q, ctx) -> PadParams:
        q = _require_q(op, in_q[0], "input")
        pads = tuple(int(v) for v in op.require("paddings"))
        if len(pads) != 8 or min(pads) < 0:
            raise MaceqError(f"op '{op.name}': uint8 Pad needs 8 non-negative paddings, got {list(pads)}")
        if int(op.arg("pad_type", 0)) != 0:
            raise MaceqError(f"op '{op.name}': only CONSTANT uint8 Pad (pad_type 0) is implemented")
        v = np.float32(op.arg("constant_value", 0.0))
        code = fp.round_half_away(np.float32(np.float32(v / np.float32(q.scale)) + np.float32(q.zero_point)))
        return PadParams(pads, int(np.clip(code, 0, 255)))

    def run(self, prepared, inputs):
        p = prepared.params
        x = inputs[0].values
        if x.ndim != 4:
            raise MaceqError(f"uint8 Pad: input must be 4-D NHWC, got shape {x.shape}")
        pairs = list(zip(p.paddings[0::2], p.paddings[1::2]))
        y = k_layout.pad(x, pairs, pad_code=p.fill)
        return [QTensor(y, inputs[0].qinfo)]


@dataclass(frozen=True)
class DequantizeParams:
    pass


@register("Dequantize")
class Dequantize(Kernel):
    def prepare(self, op: RtOp, in_q, ctx) -> DequantizeParams:
        _require_q(op, in_q[0], "input")
        return DequantizeParams()

    def run(self, prepared, inputs):
        t = inputs[0]
        y = k_quant.dequantize(t.values, scale=t.qinfo.scale, zero_point=t.qinfo.zero_point)
        return [QTensor(y, None)]
