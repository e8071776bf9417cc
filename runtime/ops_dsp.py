"""The dsp device's kernel overrides: Hexagon nnlib ops, as nnlib's HVX kernels compute them.

MACE ops map onto nnlib's compositions: Conv2D -> Supernode_8x8p32to8, DepthwiseConv2d ->
DepthwiseSupernode_8x8p32to8, FullyConnected -> SuperFC_8x8p32to8, Eltwise SUM/SUB ->
QuantizedAdd/Sub_8p8to8, Concat -> QuantizedConcat_8, Pooling -> QuantizedMaxPool_8 /
QuantizedAvgPool_8, Reduce (mean) -> QuantizedMean_8, input Quantize -> QuantizeINPUT_f_to_8,
Dequantize -> DequantizeOUTPUT_8tof. Tensors carry float
min/max ranges (the QInfo's minval/maxval), as nnlib passes them between ops.

Ops nnlib lacks (no override here: Softmax, ResizeBilinear, ...) and configurations it rejects
(``supports_conv``: dilation > 1, pads no padding mode expresses, depthwise filters it cannot run;
Concat off the depth axis with a 1x1 output; FullyConnected with an input depth below 32 or not a
multiple of 16) run the cpu profile's kernel instead; :func:`placement` reports which.
The scale/zero point of a dsp tensor are nnlib's (level size, code of 0.0) for its range, so a
cpu kernel reads the same real values from it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from maceq.errors import MaceqError
from maceq.runtime import ops as cpu_ops
from maceq.runtime.ops import bits_f32, f32_bits, op_pads
from maceq.runtime.graph import RtOp
from maceq.runtime.kernels import dsp as K
from maceq.runtime.kernels import nnlib_ref as R
from maceq.runtime.profiles import Device
from maceq.runtime.qtypes import QInfo, QTensor
from maceq.runtime.registry import register

DSP = Device.DSP



def rng(q: QInfo) -> tuple[float, float]:
    """A tensor's float range: the stored min/max, else the one its scale/zero point imply."""
    if q.minval != 0.0 or q.maxval != 0.0:
        return float(q.minval), float(q.maxval)
    return -q.zero_point * q.scale, (255 - q.zero_point) * q.scale


def qinfo_of_range(mn: float, mx: float) -> QInfo:
    zero, level = R.get_qu8_level_size_zero(mn, mx)
    return QInfo(float(level), int(zero), float(mn), float(mx))


@dataclass(frozen=True)
class DspConvParams:
    on_dsp: bool
    reason: str
    strides: tuple[int, int]
    padding: int  # nnlib Padding (unused for conv: the mode is found at run time from the input size)
    out_range_bits: tuple[int, int]  # float32 bits of the stored output min/max
    cpu: object = None  # the cpu kernel's params when the op falls back
    variant: K.SupernodeVariant = K.SupernodeVariant.D32  # the profile's supernode_variant
    kernel: tuple[int, int] = (1, 1)
    pads: tuple[int, int, int, int] = (0, 0, 0, 0)  # (top, left, bottom, right) from padding_values
    padding_arg: int | None = None  # a MACE ``padding`` argument (TensorFlow models)


def conv_padding(p, in_hw) -> R.Padding:
    """The nnlib padding mode of a conv / pooling op on an input of size ``in_hw`` (MACE's converter rule)."""
    t, l, b, r = p.pads
    out_hw = tuple((n + lo + hi - k) // s + 1 for n, lo, hi, k, s in
                   zip(in_hw, (t, l), (b, r), p.kernel, p.strides))
    return K.mace_padding_mode(in_hw=in_hw, out_hw=out_hw, kernel=p.kernel, strides=p.strides,
                               padding_arg=p.padding_arg)


def _bias(inputs, n_out: int):
    """(codes, min, max) of the bias input, or MACE's add_bias (zeros over [0, 0]) when there is none."""
    if len(inputs) > 2:
        b = inputs[2]
        return b.values, b.qinfo.minval, b.qinfo.maxval
    return np.zeros(n_out, np.int32), 0.0, 0.0




class _Fallback:
    """Runs the cpu profile's kernel for configurations nnlib rejects."""

    cpu_kernel: type

    @property
    def _cpu(self):
        k = self.__dict__.get("_cpu_instance")
        if k is None:  # one cpu kernel per dsp kernel: its plans are built once
            k = self.__dict__["_cpu_instance"] = self.cpu_kernel()
        return k

    def _fallback(self, op, in_q, ctx, reason):
        return DspConvParams(False, reason, (1, 1), 0, (0, 0), self._cpu.prepare(op, in_q, ctx))

    def _run_cpu(self, p, inputs):
        return self._cpu.run(p.cpu, inputs)

    def deviation(self, p, in_shapes) -> str | None:
        """The cpu kernel's deviation note when the op falls back to it (see ops.DepthwiseConv2d)."""
        note = getattr(self._cpu, "deviation", None)
        if p.on_dsp or note is None:
            return None
        return note(p.cpu, in_shapes)


class _DspConv(_Fallback):
    depthwise = False

    def prepare(self, op: RtOp, in_q, ctx) -> DspConvParams:
        w = ctx.consts[op.inputs[1]]
        kernel = (w.shape[0], w.shape[1]) if self.depthwise else (w.shape[1], w.shape[2])
        strides = tuple(int(v) for v in op.arg("strides", [1, 1]))
        # the padding mode depends on the input size (MACE's converter rule): found at run time
        ok, why = K.supports_conv(strides=strides, dilations=op.arg("dilations", [1, 1]), pads="VALID",
                                  kernel=kernel, depthwise=self.depthwise,
                                  depth_multiplier=w.shape[3] if self.depthwise else 1)
        if not ok:
            return self._fallback(op, in_q, ctx, why)
        lo, hi = rng(op.out_qinfo[0])
        p = DspConvParams(True, "", strides, 0, (f32_bits(lo), f32_bits(hi)),
                          variant=ctx.profile.supernode_variant or K.SupernodeVariant.D32, kernel=tuple(kernel), pads=op_pads(op),
                          padding_arg=op.arg("padding"))
        if op.output_shapes:  # the smallest input giving this output: MACE's converter must find a mode
            t, l, b, r = p.pads
            in_hw = tuple((o - 1) * s + k - lo_ - hi_ for o, s, k, lo_, hi_ in
                          zip(op.output_shapes[0][1:3], strides, kernel, (t, l), (b, r)))
            try:
                conv_padding(p, in_hw)
            except MaceqError as e:
                return self._fallback(op, in_q, ctx, str(e))
        return p

    def run(self, p: DspConvParams, inputs):
        if not p.on_dsp:
            return self._run_cpu(p, inputs)
        x, w = inputs[:2]
        x_lo, x_hi = rng(x.qinfo)
        w_lo, w_hi = rng(w.qinfo)
        n_out = w.values.shape[2] if self.depthwise else w.values.shape[0]
        b, b_lo, b_hi = _bias(inputs, n_out)
        out_lo, out_hi = (bits_f32(v) for v in p.out_range_bits)
        kw = dict(x_min=x_lo, x_max=x_hi, w_min=w_lo, w_max=w_hi, bias_min=b_lo, bias_max=b_hi, out_min=out_lo,
                  out_max=out_hi, strides=p.strides, padding=conv_padding(p, x.values.shape[1:3]))
        if self.depthwise:
            y, mn, mx = K.depthwise_supernode(x.values, w.values, b, **kw)
        else:
            y, mn, mx = K.supernode(x.values, K.ohwi_to_hwio(w.values), b, variant=p.variant, **kw)
        return [QTensor(y, qinfo_of_range(mn, mx))]


@register("Conv2D", device=DSP)
class DspConv2D(_DspConv):
    cpu_kernel = cpu_ops.Conv2D


@register("DepthwiseConv2d", device=DSP)
class DspDepthwiseConv2d(_DspConv):
    cpu_kernel = cpu_ops.DepthwiseConv2d
    depthwise = True


@register("FullyConnected", device=DSP)
class DspFullyConnected(_Fallback):
    cpu_kernel = cpu_ops.FullyConnected

    def prepare(self, op: RtOp, in_q, ctx) -> DspConvParams:
        w = ctx.consts[op.inputs[1]]
        ok, why = R.superfc_supported(int(np.prod(w.shape[1:])))  # SuperFC_8x8p32to8 runs superfc_execute_hvx
        if not ok:
            return self._fallback(op, in_q, ctx, f"SuperFC: {why}")
        lo, hi = rng(op.out_qinfo[0])
        return DspConvParams(True, "", (1, 1), 0, (f32_bits(lo), f32_bits(hi)))

    def run(self, p: DspConvParams, inputs):
        if not p.on_dsp:
            return self._run_cpu(p, inputs)
        x, w = inputs[:2]
        n = x.values.shape[0]
        x_lo, x_hi = rng(x.qinfo)
        w_lo, w_hi = rng(w.qinfo)
        b, b_lo, b_hi = _bias(inputs, w.values.shape[0])
        out_lo, out_hi = (bits_f32(v) for v in p.out_range_bits)
        y, mn, mx = K.superfc(x.values.reshape(n, -1), K.fc_weight_to_dsp(w.values), b, x_min=x_lo, x_max=x_hi,
                              w_min=w_lo, w_max=w_hi, bias_min=b_lo, bias_max=b_hi, out_min=out_lo, out_max=out_hi)
        return [QTensor(y.reshape(n, 1, 1, -1), qinfo_of_range(mn, mx))]


@dataclass(frozen=True)
class DspEltwiseParams:
    subtract: bool
    out_range_bits: tuple[int, int]


@register("Eltwise", device=DSP)
class DspEltwise:
    def prepare(self, op: RtOp, in_q, ctx) -> DspEltwiseParams:
        kind = int(op.arg("type", 0))
        if kind not in (0, 1):
            raise MaceqError(f"op '{op.name}': nnlib's uint8 Eltwise is QuantizedAdd/Sub only")
        lo, hi = rng(op.out_qinfo[0])
        return DspEltwiseParams(kind == 1, (f32_bits(lo), f32_bits(hi)))

    def run(self, p: DspEltwiseParams, inputs):
        a, b = inputs
        (a_lo, a_hi), (b_lo, b_hi) = rng(a.qinfo), rng(b.qinfo)
        out_lo, out_hi = (bits_f32(v) for v in p.out_range_bits)
        fn = K.quantized_sub if p.subtract else K.quantized_add
        y, mn, mx = fn(a.values, b.values, a_min=a_lo, a_max=a_hi, b_min=b_lo, b_max=b_hi, out_min=out_lo,
                       out_max=out_hi)
        return [QTensor(y, qinfo_of_range(mn, mx))]


@dataclass(frozen=True)
class DspConcatParams:
    on_dsp: bool
    reason: str
    axis: int
    cpu: object = None


@register("Concat", device=DSP)
class DspConcat:
    _concat = cpu_ops.Concat()

    def prepare(self, op: RtOp, in_q, ctx) -> DspConcatParams:
        axis = int(op.arg("axis", 3))
        shape = op.output_shapes[0] if op.output_shapes else None
        # QuantizedConcat_8_d32 takes any axis; the flat op (kept for 1x1 outputs) depth only
        if axis % 4 != 3 and (shape is None or len(shape) != 4 or not R.concat_runs_d32(shape)):
            return DspConcatParams(False, f"axis {axis}: nnlib's flat concat (1x1 outputs) concatenates depth only",
                                   axis, self._concat.prepare(op, in_q, ctx))
        return DspConcatParams(True, "", axis)

    def run(self, p: DspConcatParams, inputs):
        if not p.on_dsp:
            return self._concat.run(p.cpu, inputs)
        y, mn, mx = K.quantized_concat([t.values for t in inputs], axis=p.axis,
                                       in_ranges=[rng(t.qinfo) for t in inputs])
        return [QTensor(y, qinfo_of_range(mn, mx))]


@dataclass(frozen=True)
class DspPoolParams:
    kind: int  # 1 avg, 2 max
    kernel: tuple[int, int]
    strides: tuple[int, int]
    pads: tuple[int, int, int, int]
    padding_arg: int | None = None


@register("Pooling", device=DSP)
class DspPooling:
    def prepare(self, op: RtOp, in_q, ctx) -> DspPoolParams:
        return DspPoolParams(int(op.require("pooling_type")), tuple(int(v) for v in op.require("kernels")),
                             tuple(int(v) for v in op.arg("strides", [1, 1])), op_pads(op), op.arg("padding"))

    def run(self, p: DspPoolParams, inputs):
        x = inputs[0]
        lo, hi = rng(x.qinfo)
        mode = conv_padding(p, x.values.shape[1:3])
        fn = K.quantized_maxpool if p.kind == 2 else K.quantized_avgpool
        y, mn, mx = fn(x.values, x_min=lo, x_max=hi, kernel=p.kernel, strides=p.strides, padding=mode)
        if (mn, mx) == (R.f32(lo), R.f32(hi)):
            return [QTensor(y, x.qinfo)]
        return [QTensor(y, qinfo_of_range(mn, mx))]  # avgpool to 1x1 finds its range from the data


@dataclass(frozen=True)
class DspMeanParams:
    axes: tuple[int, ...]
    out_range_bits: tuple[int, int]


@register("Reduce", device=DSP)
class DspReduce:
    """MACE's Hexagon converter turns Reduce (mean, keep_dims) into QuantizedMean_8 with the op's
    output range (convert_reduce)."""

    def prepare(self, op: RtOp, in_q, ctx) -> DspMeanParams:
        if int(op.arg("reduce_type", 0)) != 0:
            raise MaceqError(f"op '{op.name}': the dsp Reduce is the mean only ('Hexagon Reduce only supports Mean')")
        if not int(op.arg("keepdims", 1)):
            raise MaceqError(f"op '{op.name}': the dsp Reduce keeps dims only ('Hexagon Reduce Mean only supports "
                             "keep dims')")
        lo, hi = rng(op.out_qinfo[0])
        return DspMeanParams(tuple(int(a) for a in op.arg("axis", [1, 2])), (f32_bits(lo), f32_bits(hi)))

    def run(self, p: DspMeanParams, inputs):
        x = inputs[0]
        lo, hi = rng(x.qinfo)
        out_lo, out_hi = (bits_f32(v) for v in p.out_range_bits)
        y, mn, mx = K.quantized_mean(x.values, x_min=lo, x_max=hi, axes=p.axes, out_min=out_lo, out_max=out_hi)
        return [QTensor(y, qinfo_of_range(mn, mx))]


@dataclass(frozen=True)
class DspQuantizeParams:
    find_range: bool
    range_bits: tuple[int, int]


@register("Quantize", device=DSP)
class DspQuantize:
    def prepare(self, op: RtOp, in_q, ctx) -> DspQuantizeParams:
        lo, hi = rng(op.out_qinfo[0])
        return DspQuantizeParams(bool(op.arg("find_range_every_time", 0)), (f32_bits(lo), f32_bits(hi)))

    def run(self, p: DspQuantizeParams, inputs):
        x = np.asarray(inputs[0].values, np.float32)
        if p.find_range:
            q, mn, mx = K.quantize_input(x)
        else:
            lo, hi = (bits_f32(v) for v in p.range_bits)
            q, mn, mx = K.quantize(x, min=lo, max=hi)
        return [QTensor(q, qinfo_of_range(mn, mx))]


@dataclass(frozen=True)
class DspDequantizeParams:
    pass


@register("Dequantize", device=DSP)
class DspDequantize:
    def prepare(self, op: RtOp, in_q, ctx) -> DspDequantizeParams:
        return DspDequantizeParams()

    def run(self, p, inputs):
        t = inputs[0]
        lo, hi = rng(t.qinfo)
        return [QTensor(K.dequantize(t.values, min=lo, max=hi), None)]
