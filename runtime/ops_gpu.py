"""The gpu device's kernel overrides: OpenCL int8 kernels, simulated exactly in numpy.

Each class reads the same MACE op as the cpu kernel and calls the simulation in
``runtime/kernels/gpu.py`` (whose OpenCL twins in ``runtime/opencl/`` are checked
against it on PoCL). Weights are int8 symmetric per output channel: the op's
extra input ``<weights>__scales`` holds the float32 channel scales. Ops without a
gpu override run the default kernels.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from maceq.errors import MaceqError
from maceq.mace.enums import EltwiseType, PoolingType, ReduceType
from maceq.runtime import ops_float as _F
from maceq.runtime.devices import Device
from maceq.runtime.graph import RtOp
from maceq.runtime.kernel import CallCache, Kernel
from maceq.runtime.kernels import float_ops as KF
from maceq.runtime.kernels import gpu as K
from maceq.runtime.kernels.derived import view_ident
from maceq.runtime.ops import op_pads, pooling_type
from maceq.runtime.qtypes import QInfo, QTensor, shared_qinfo
from maceq.runtime.registry import DType, register

GPU = Device.GPU


class NumpyGpuBackend:
    """The default gpu backend: the numpy simulation, with the OpenCLBackend's method names."""

    def __getattr__(self, name):
        return getattr(K, "gpu_" + name)


NUMPY = NumpyGpuBackend()


class _GpuKernel(Kernel):
    """A gpu kernel: its plan is the backend that runs it (``ctx.backend``; the numpy simulation when None)."""

    def plan(self, op: RtOp, params, ctx):
        return NUMPY if ctx.backend is None else ctx.backend


@dataclass(frozen=True)
class GpuConvParams:
    x_zp: int
    out_zp: int
    scale_c: tuple[np.float32, ...]  # s_in * s_w[c] / s_out per output channel
    strides: tuple[int, int]
    pads: tuple[int, int, int, int]
    dilations: tuple[int, int]
    out_scale: np.float32

    @functools.cached_property
    def out_q(self) -> QInfo:  # one object for every run: Plan.prepared's key of the next op
        return QInfo(float(self.out_scale), self.out_zp)


@dataclass(frozen=True)
class GpuConvPlan:
    backend: object
    scale_c: np.ndarray  # the params' scale_c as the float32 buffer the kernels take
    # the simulation's prepared call (derived.ShapedCall) per input shape, with the weight and bias arrays
    calls: CallCache = field(default_factory=CallCache, compare=False, repr=False)

    def run(self, kind: str, x: np.ndarray, w: np.ndarray, b: np.ndarray, **kwargs) -> np.ndarray:
        """``backend.<kind>(x, w, b, scale_c=..., **kwargs)``; on the simulation through a ShapedCall made on the first
        run with this input shape and these arrays (a model's constants: the same objects every run)."""
        if self.backend is not NUMPY:
            return getattr(self.backend, kind)(x, w, b, scale_c=self.scale_c, **kwargs)
        hit = self.calls.get(x.shape)
        if hit is not None and hit[0] is w and hit[1] is b:  # the same objects as last run
            return hit[3](x)
        ident = (_ident(w), _ident(b))
        if hit is None or hit[2] != ident:
            if len(self.calls) >= 8:  # a few batch sizes at a time
                self.calls.clear()
            call = getattr(K, f"gpu_{kind}_call")(x, w, b, scale_c=self.scale_c, **kwargs)
            hit = (w, b, ident, call)
        self.calls[x.shape] = (w, b) + hit[2:]  # w and b kept alive: the ids in ident stay theirs
        return hit[3](x)


def _ident(a: np.ndarray) -> tuple:
    """What makes ``a`` the same array as on an earlier run: the id of the array owning its memory and the view of
    it (derived.view_ident; a reshape made on every run is the same array)."""
    root, view = view_ident(a)
    return (id(root),) + view


class _GpuConvBase(_GpuKernel):
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
                             tuple(np.asarray(scale_c, np.float32)),
                             tuple(op.arg("strides", [1, 1])), op_pads(op), tuple(op.arg("dilations", [1, 1])),
                             np.float32(op.out_qinfo[0].scale))

    def plan(self, op: RtOp, params: GpuConvParams, ctx) -> GpuConvPlan:
        return GpuConvPlan(super().plan(op, params, ctx), np.array(params.scale_c, dtype=np.float32))


@register("Conv2D", device=GPU)
class GpuConv2D(_GpuConvBase):
    def run(self, prepared, inputs):
        p, plan = prepared.params, prepared.plan
        y = plan.run("conv2d", inputs[0].values, inputs[1].values, inputs[2].values, x_zp=p.x_zp, out_zp=p.out_zp,
                     strides=p.strides, pads=p.pads, dilations=p.dilations)
        return [QTensor(y, p.out_q)]


@register("DepthwiseConv2d", device=GPU)
class GpuDepthwiseConv2d(_GpuConvBase):
    def run(self, prepared, inputs):
        p, plan = prepared.params, prepared.plan
        y = plan.run("depthwise_conv2d", inputs[0].values, inputs[1].values, inputs[2].values, x_zp=p.x_zp,
                     out_zp=p.out_zp, strides=p.strides, pads=p.pads, dilations=p.dilations)
        return [QTensor(y, p.out_q)]


@register("FullyConnected", device=GPU)
class GpuFullyConnected(_GpuConvBase):
    def run(self, prepared, inputs):
        p, plan = prepared.params, prepared.plan
        x, w = inputs[0].values, inputs[1].values
        n = x.shape[0]
        y = plan.run("fully_connected", x.reshape(n, -1), w.reshape(w.shape[0], -1), inputs[2].values,
                     x_zp=p.x_zp, out_zp=p.out_zp)
        return [QTensor(y.reshape(n, 1, 1, -1), p.out_q)]


@dataclass(frozen=True)
class GpuEltwiseParams:
    subtract: bool
    out_scale: np.float32
    out_zp: int


@register("Eltwise", device=GPU)
class GpuEltwise(_GpuKernel):
    def prepare(self, op: RtOp, in_q, ctx) -> GpuEltwiseParams:
        kind = int(op.arg("type", EltwiseType.SUM))
        if kind not in (EltwiseType.SUM, EltwiseType.SUB):
            raise MaceqError(f"op '{op.name}': the gpu integer Eltwise supports SUM and SUB only")
        return GpuEltwiseParams(kind == EltwiseType.SUB, np.float32(op.out_qinfo[0].scale), op.out_qinfo[0].zero_point)

    def run(self, prepared, inputs):
        p = prepared.params
        a, b = inputs
        out_scale = float(p.out_scale)
        y = prepared.plan.eltwise_add(a.values, b.values, a_scale=a.qinfo.scale, a_zp=a.qinfo.zero_point,
                                      b_scale=b.qinfo.scale, b_zp=b.qinfo.zero_point, out_scale=out_scale,
                                      out_zp=p.out_zp, subtract=p.subtract)
        return [QTensor(y, shared_qinfo(out_scale, p.out_zp))]


@dataclass(frozen=True)
class GpuPoolParams:
    kind: PoolingType
    kernel: tuple[int, int]
    strides: tuple[int, int]
    pads: tuple[int, int, int, int]


@register("Pooling", device=GPU)
class GpuPooling(_GpuKernel):
    def prepare(self, op: RtOp, in_q, ctx) -> GpuPoolParams:
        return GpuPoolParams(pooling_type(op), tuple(op.require("kernels")), tuple(op.arg("strides", [1, 1])),
                             op_pads(op))

    def run(self, prepared, inputs):
        p, backend = prepared.params, prepared.plan
        fn = backend.max_pool if p.kind is PoolingType.MAX else backend.avg_pool
        return [QTensor(fn(inputs[0].values, kernel=p.kernel, strides=p.strides, pads=p.pads), inputs[0].qinfo)]


@dataclass(frozen=True)
class GpuReduceParams:
    axes: tuple[int, ...]


@register("Reduce", device=GPU)
class GpuReduce(_GpuKernel):
    def prepare(self, op: RtOp, in_q, ctx) -> GpuReduceParams:
        axes = tuple(op.arg("axis", [1, 2]))
        if int(op.arg("reduce_type", ReduceType.MEAN)) != ReduceType.MEAN or axes != (1, 2):
            raise MaceqError(f"op '{op.name}': the gpu integer Reduce is the spatial mean only")
        return GpuReduceParams(axes)

    def run(self, prepared, inputs):
        return [QTensor(prepared.plan.global_avg_pool(inputs[0].values), inputs[0].qinfo)]


@dataclass(frozen=True)
class GpuConcatParams:
    axis: int
    out_scale: np.float32
    out_zp: int


@register("Concat", device=GPU)
class GpuConcat(_GpuKernel):
    def prepare(self, op: RtOp, in_q, ctx) -> GpuConcatParams:
        return GpuConcatParams(int(op.arg("axis", 3)), np.float32(op.out_qinfo[0].scale), op.out_qinfo[0].zero_point)

    def run(self, prepared, inputs):
        p = prepared.params
        out_scale = float(p.out_scale)
        y = prepared.plan.concat([t.values for t in inputs], axis=p.axis, in_qinfos=[t.qinfo for t in inputs],
                                 out_scale=out_scale, out_zp=p.out_zp)
        return [QTensor(y, shared_qinfo(out_scale, p.out_zp))]


@dataclass(frozen=True)
class GpuSoftmaxParams:
    out_scale: np.float32
    out_zp: int


@register("Softmax", device=GPU)
class GpuSoftmax(_GpuKernel):
    """No integer kernel: MACE's fp16_fp32 float path (half storage at the op boundaries)."""

    def prepare(self, op: RtOp, in_q, ctx) -> GpuSoftmaxParams:
        return GpuSoftmaxParams(np.float32(op.out_qinfo[0].scale), op.out_qinfo[0].zero_point)

    def run(self, prepared, inputs):
        p = prepared.params
        x = inputs[0]
        out_scale = float(p.out_scale)
        y = prepared.plan.float_softmax(x.values, in_scale=x.qinfo.scale, in_zp=x.qinfo.zero_point,
                                        out_scale=out_scale, out_zp=p.out_zp)
        return [QTensor(y, shared_qinfo(out_scale, p.out_zp))]


@dataclass(frozen=True)
class GpuQuantizeParams:
    scale: np.float32
    zero_point: int


@register("Quantize", device=GPU)
class GpuQuantize(_GpuKernel):
    def prepare(self, op: RtOp, in_q, ctx) -> GpuQuantizeParams:
        q = op.out_qinfo[0]
        return GpuQuantizeParams(np.float32(q.scale), q.zero_point)

    def run(self, prepared, inputs):
        p, backend = prepared.params, prepared.plan
        scale = float(p.scale)
        x = inputs[0].values
        if x.dtype == np.float16:  # a half-stored float tensor (fp16_fp32 mode)
            y = backend.quantize_half(x, scale=scale, zero_point=p.zero_point)
        else:
            y = backend.quantize(np.asarray(x, np.float32), scale=scale, zero_point=p.zero_point)
        return [QTensor(y, shared_qinfo(scale, p.zero_point))]


@dataclass(frozen=True)
class GpuDequantizeParams:
    pass


@register("Dequantize", device=GPU)
class GpuDequantize(_GpuKernel):
    def prepare(self, op: RtOp, in_q, ctx) -> GpuDequantizeParams:
        return GpuDequantizeParams()

    def run(self, prepared, inputs):
        # fp16_fp32 mode: the Dequantize op's output image is half
        t = inputs[0]
        return [QTensor(prepared.plan.dequantize_half(t.values, scale=t.qinfo.scale, zero_point=t.qinfo.zero_point),
                        None)]


# -- the float path (fp16_fp32 mode): ops whose OpenCL float kernels the simulation reproduces exactly --

#: the float activations the gpu's ``activation_half`` kernel computes
_HALF_ACTIVATIONS = {KF.ActKind.SIGMOID: K.GpuActivation.SIGMOID, KF.ActKind.HARDSIGMOID: K.GpuActivation.HARD_SIGMOID}


@register("Activation", device=GPU, dtype=DType.FLOAT)
class GpuFloatActivation(_GpuKernel, _F.Activation):
    """SIGMOID and HARDSIGMOID run the gpu's ``activation_half`` kernel; other kinds the float32 kernel."""

    half_storage = True

    def run(self, prepared, inputs):
        act = prepared.params.act
        kind = _HALF_ACTIVATIONS.get(act.kind)
        x = inputs[0].values
        if kind is None or x.dtype != np.float16:  # every input (PRELU's alpha too), widened
            out = super().run(prepared, [QTensor(t.values.astype(np.float32), t.qinfo) for t in inputs])
            return [QTensor(out[0].values.astype(np.float16), None)]
        alpha = beta = None
        if kind is K.GpuActivation.HARD_SIGMOID:
            alpha, beta = act.hs_alpha, act.hs_beta
        return [QTensor(prepared.plan.half_activation(x, kind=kind, alpha=alpha, beta=beta), None)]


@register("Eltwise", device=GPU, dtype=DType.FLOAT)
class GpuFloatEltwise(_GpuKernel, _F.Eltwise):
    """PROD of two half tensors runs the gpu's ``mul_half``; the rest the float32 kernel, stored half."""

    half_storage = True

    def run(self, prepared, inputs):
        vals = [t.values for t in inputs]
        ep = prepared.params
        if (ep.kind is EltwiseType.PROD and len(vals) == 2 and not any(ep.const_inputs)
                and all(v.dtype == np.float16 for v in vals)):
            return [QTensor(prepared.plan.half_mul(vals[0], vals[1]), None)]
        out = super().run(prepared, [QTensor(v.astype(np.float32) if v.dtype == np.float16 else v, t.qinfo)
                                     for v, t in zip(vals, inputs)])
        return [QTensor(out[0].values.astype(np.float16), None)]
