"""The gpu device's kernel overrides: OpenCL int8 kernels, simulated exactly in numpy.

Each class reads the same MACE op as the cpu kernel and calls the simulation in
``runtime/kernels/gpu.py`` (whose OpenCL twins in ``runtime/opencl/`` are checked
against it on PoCL). Weights are int8 symmetric per output channel: the op's
extra input ``<weights>__scales`` holds the float32 channel scales. Ops without a
gpu override run the default kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from maceq.errors import MaceqError
from maceq.runtime.graph import RtOp
from maceq.runtime.kernels import gpu as K
from maceq.runtime.ops import op_pads
from maceq.runtime.profiles import Device
from maceq.runtime.qtypes import QInfo, QTensor
from maceq.runtime.registry import register

GPU = Device.GPU


class NumpyGpuBackend:
    """The default gpu backend: the numpy simulation, with the OpenCLBackend's method names."""

    def __getattr__(self, name):
        return getattr(K, "gpu_" + name)


NUMPY = NumpyGpuBackend()


class _UsesBackend:
    #: Set by the model to an OpenCLBackend for `--backend opencl`; the numpy simulation otherwise.
    backend = NUMPY



@dataclass(frozen=True)
class GpuConvParams:
    x_zp: int
    out_zp: int
    scale_c_bits: tuple[int, ...]  # float32 bit patterns of s_in * s_w[c] / s_out
    strides: tuple[int, int]
    pads: tuple[int, int, int, int]
    dilations: tuple[int, int]
    out_scale_bits: int

    @property
    def scale_c(self) -> np.ndarray:
        return np.array(self.scale_c_bits, dtype=np.int32).view(np.float32)

    @property
    def out_q(self) -> QInfo:
        return QInfo(float(np.int32(self.out_scale_bits).view(np.float32)), self.out_zp)


class _GpuConvBase(_UsesBackend):
    def prepare(self, op: RtOp, in_q, ctx) -> GpuConvParams:
        if len(op.inputs) < 4 or op.inputs[3] not in ctx.consts:
            raise MaceqError(f"op '{op.name}' ({op.type}): the gpu device needs int8 per-channel weights with a "
                             f"'<weights>__scales' input; this model was not quantized for the gpu "
                             "(quantize --device gpu)")
        if in_q[0] is None or not op.out_qinfo:
            raise MaceqError(f"op '{op.name}': missing quantization info")
        s_w = ctx.consts[op.inputs[3]]
        scale_c = K.gpu_requant_scales(in_q[0].scale, s_w, op.out_qinfo[0].scale)
        return GpuConvParams(in_q[0].zero_point, op.out_qinfo[0].zero_point,
                             tuple(int(v) for v in np.asarray(scale_c, np.float32).view(np.int32)),
                             tuple(op.arg("strides", [1, 1])), op_pads(op), tuple(op.arg("dilations", [1, 1])),
                             int(np.float32(op.out_qinfo[0].scale).view(np.int32)))


@register("Conv2D", device=GPU)
class GpuConv2D(_GpuConvBase):
    def run(self, p: GpuConvParams, inputs):
        y = self.backend.conv2d(inputs[0].values, inputs[1].values, inputs[2].values, x_zp=p.x_zp, out_zp=p.out_zp,
                         scale_c=p.scale_c, strides=p.strides, pads=p.pads, dilations=p.dilations)
        return [QTensor(y, p.out_q)]


@register("DepthwiseConv2d", device=GPU)
class GpuDepthwiseConv2d(_GpuConvBase):
    def run(self, p: GpuConvParams, inputs):
        y = self.backend.depthwise_conv2d(inputs[0].values, inputs[1].values, inputs[2].values, x_zp=p.x_zp,
                                   out_zp=p.out_zp, scale_c=p.scale_c, strides=p.strides, pads=p.pads,
                                   dilations=p.dilations)
        return [QTensor(y, p.out_q)]


@register("FullyConnected", device=GPU)
class GpuFullyConnected(_GpuConvBase):
    def run(self, p: GpuConvParams, inputs):
        x, w = inputs[0].values, inputs[1].values
        n = x.shape[0]
        y = self.backend.fully_connected(x.reshape(n, -1), w.reshape(w.shape[0], -1), inputs[2].values, x_zp=p.x_zp,
                                  out_zp=p.out_zp, scale_c=p.scale_c)
        return [QTensor(y.reshape(n, 1, 1, -1), p.out_q)]


@dataclass(frozen=True)
class GpuEltwiseParams:
    subtract: bool
    out_scale_bits: int
    out_zp: int


@register("Eltwise", device=GPU)
class GpuEltwise(_UsesBackend):
    def prepare(self, op: RtOp, in_q, ctx) -> GpuEltwiseParams:
        kind = int(op.arg("type", 0))
        if kind not in (0, 1):
            raise MaceqError(f"op '{op.name}': the gpu integer Eltwise supports SUM and SUB only")
        return GpuEltwiseParams(kind == 1, int(np.float32(op.out_qinfo[0].scale).view(np.int32)),
                                op.out_qinfo[0].zero_point)

    def run(self, p: GpuEltwiseParams, inputs):
        a, b = inputs
        out_scale = float(np.int32(p.out_scale_bits).view(np.float32))
        y = self.backend.eltwise_add(a.values, b.values, a_scale=a.qinfo.scale, a_zp=a.qinfo.zero_point,
                              b_scale=b.qinfo.scale, b_zp=b.qinfo.zero_point, out_scale=out_scale,
                              out_zp=p.out_zp, subtract=p.subtract)
        return [QTensor(y, QInfo(out_scale, p.out_zp))]


@dataclass(frozen=True)
class GpuPoolParams:
    kind: int
    kernel: tuple[int, int]
    strides: tuple[int, int]
    pads: tuple[int, int, int, int]


@register("Pooling", device=GPU)
class GpuPooling(_UsesBackend):
    def prepare(self, op: RtOp, in_q, ctx) -> GpuPoolParams:
        return GpuPoolParams(int(op.require("pooling_type")), tuple(op.require("kernels")),
                             tuple(op.arg("strides", [1, 1])), op_pads(op))

    def run(self, p: GpuPoolParams, inputs):
        fn = self.backend.max_pool if p.kind == 2 else self.backend.avg_pool
        return [QTensor(fn(inputs[0].values, kernel=p.kernel, strides=p.strides, pads=p.pads), inputs[0].qinfo)]


@dataclass(frozen=True)
class GpuReduceParams:
    axes: tuple[int, ...]


@register("Reduce", device=GPU)
class GpuReduce(_UsesBackend):
    def prepare(self, op: RtOp, in_q, ctx) -> GpuReduceParams:
        axes = tuple(op.arg("axis", [1, 2]))
        if int(op.arg("reduce_type", 0)) != 0 or axes != (1, 2):
            raise MaceqError(f"op '{op.name}': the gpu integer Reduce is the spatial mean only")
        return GpuReduceParams(axes)

    def run(self, p: GpuReduceParams, inputs):
        return [QTensor(self.backend.global_avg_pool(inputs[0].values), inputs[0].qinfo)]


@dataclass(frozen=True)
class GpuConcatParams:
    axis: int
    out_scale_bits: int
    out_zp: int


@register("Concat", device=GPU)
class GpuConcat(_UsesBackend):
    def prepare(self, op: RtOp, in_q, ctx) -> GpuConcatParams:
        return GpuConcatParams(int(op.arg("axis", 3)), int(np.float32(op.out_qinfo[0].scale).view(np.int32)),
                               op.out_qinfo[0].zero_point)

    def run(self, p: GpuConcatParams, inputs):
        out_scale = float(np.int32(p.out_scale_bits).view(np.float32))
        y = self.backend.concat([t.values for t in inputs], axis=p.axis, in_qinfos=[t.qinfo for t in inputs],
                         out_scale=out_scale, out_zp=p.out_zp)
        return [QTensor(y, QInfo(out_scale, p.out_zp))]


@dataclass(frozen=True)
class GpuSoftmaxParams:
    out_scale_bits: int
    out_zp: int


@register("Softmax", device=GPU)
class GpuSoftmax(_UsesBackend):
    """No integer kernel: MACE's fp16_fp32 float path (half storage at the op boundaries)."""

    def prepare(self, op: RtOp, in_q, ctx) -> GpuSoftmaxParams:
        return GpuSoftmaxParams(int(np.float32(op.out_qinfo[0].scale).view(np.int32)), op.out_qinfo[0].zero_point)

    def run(self, p: GpuSoftmaxParams, inputs):
        x = inputs[0]
        out_scale = float(np.int32(p.out_scale_bits).view(np.float32))
        y = self.backend.float_softmax(x.values, in_scale=x.qinfo.scale, in_zp=x.qinfo.zero_point, out_scale=out_scale,
                                out_zp=p.out_zp)
        return [QTensor(y, QInfo(out_scale, p.out_zp))]


@dataclass(frozen=True)
class GpuQuantizeParams:
    scale_bits: int
    zero_point: int


@register("Quantize", device=GPU)
class GpuQuantize(_UsesBackend):
    def prepare(self, op: RtOp, in_q, ctx) -> GpuQuantizeParams:
        q = op.out_qinfo[0]
        return GpuQuantizeParams(int(np.float32(q.scale).view(np.int32)), q.zero_point)

    def run(self, p: GpuQuantizeParams, inputs):
        scale = float(np.int32(p.scale_bits).view(np.float32))
        x = inputs[0].values
        if x.dtype == np.float16:  # a half-stored float tensor (fp16_fp32 mode)
            y = self.backend.quantize_half(x, scale=scale, zero_point=p.zero_point)
        else:
            y = self.backend.quantize(np.asarray(x, np.float32), scale=scale, zero_point=p.zero_point)
        return [QTensor(y, QInfo(scale, p.zero_point))]


@dataclass(frozen=True)
class GpuDequantizeParams:
    pass


@register("Dequantize", device=GPU)
class GpuDequantize(_UsesBackend):
    def prepare(self, op: RtOp, in_q, ctx) -> GpuDequantizeParams:
        return GpuDequantizeParams()

    def run(self, p, inputs):
        # fp16_fp32 mode: the Dequantize op's output image is half
        t = inputs[0]
        return [QTensor(self.backend.dequantize_half(t.values, scale=t.qinfo.scale, zero_point=t.qinfo.zero_point),
                    None)]


# -- the float path (fp16_fp32 mode): ops whose OpenCL float kernels the simulation reproduces exactly --
from maceq.runtime import ops_float as _F  # noqa: E402
from maceq.runtime.registry import DType  # noqa: E402


def _float_params(p):
    """The float kernels' prepared params (ops_float wraps them with their op)."""
    return p[1] if isinstance(p, tuple) else p


@register("Activation", device=GPU, dtype=DType.FLOAT)
class GpuFloatActivation(_UsesBackend):
    """SIGMOID and HARDSIGMOID run the gpu's ``activation_half`` kernel; other kinds the float32 kernel."""

    half_storage = True

    def prepare(self, op: RtOp, in_q, ctx):
        return _F.Activation().prepare(op, in_q, ctx)

    def run(self, p, inputs):
        act = _float_params(p).act
        kind = {"SIGMOID": K.GpuActivation.SIGMOID, "HARDSIGMOID": K.GpuActivation.HARD_SIGMOID}.get(act.kind.name)
        x = inputs[0].values
        if kind is None or x.dtype != np.float16:
            out = _F.Activation().run(p, [QTensor(x.astype(np.float32), None)])
            return [QTensor(out[0].values.astype(np.float16), None)]
        alpha = beta = None
        if kind is K.GpuActivation.HARD_SIGMOID:
            alpha, beta = act.hs_alpha, act.hs_beta
        return [QTensor(self.backend.half_activation(x, kind=kind, alpha=alpha, beta=beta), None)]


@register("Eltwise", device=GPU, dtype=DType.FLOAT)
class GpuFloatEltwise(_UsesBackend):
    """PROD of two half tensors runs the gpu's ``mul_half``; the rest the float32 kernel, stored half."""

    half_storage = True

    def prepare(self, op: RtOp, in_q, ctx):
        return _F.Eltwise().prepare(op, in_q, ctx)

    def run(self, p, inputs):
        vals = [t.values for t in inputs]
        ep = _float_params(p)
        if (ep.kind.name == "PROD" and len(vals) == 2 and not any(ep.const_inputs)
                and all(v.dtype == np.float16 for v in vals)):
            return [QTensor(self.backend.half_mul(vals[0], vals[1]), None)]
        out = _F.Eltwise().run(p, [QTensor(v.astype(np.float32) if v.dtype == np.float16 else v, t.qinfo)
                                   for v, t in zip(vals, inputs)])
        return [QTensor(out[0].values.astype(np.float16), None)]
