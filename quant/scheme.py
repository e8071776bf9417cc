"""Quantization parameters of each device's scheme, as MACE's converter computes them.

Source: XiaoMi/mace tools/python/quantize/quantize_util.py (adjust_range,
quantize, quantize_with_scale_and_zero) and tools/python/transform/transformer.py
(add_quantize_tensor_range, quantize_weights). The arithmetic is Python float64,
exactly as the converter does it; the results are stored in the model as float32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from maceq.errors import MaceqError
from maceq.quant.converter import (
    gpu_quantize_weights,
    mace_adjust_range_for_hexagon,
    mace_quantize_bias,
    mace_quantize_tensor,
)
from maceq.runtime.devices import Device, WeightScheme, device_spec
from maceq.runtime.qtypes import QInfo


def adjust_range(in_min: float, in_max: float, *, non_zero: bool) -> QInfo:
    """MACE's adjust_range (CPU/GPU): make 0 exactly representable.

    With ``non_zero`` (weights), the range is widened so that no weight quantizes
    to 0 (gemmlowp's LHS must stay in [1, 255]) and the zero point is rounded up
    when it is not an integer.
    """
    in_min, in_max = float(in_min), float(in_max)
    if not (math.isfinite(in_min) and math.isfinite(in_max)):
        raise MaceqError(f"range [{in_min}, {in_max}] is not finite")
    out_max = max(0.0, in_max)
    out_min = min(0.0, in_min)
    if non_zero:
        out_min = min(out_min, in_min - (out_max - in_min) / 254.0)
    scale = (out_max - out_min) / 255.0
    eps = 1e-6
    if out_min < -eps and out_max > eps:
        zero = -out_min / scale
        zero_int = int(round(zero))  # Python round: half to even, as the converter
        if abs(zero - zero_int) > eps and non_zero:
            zero_int = int(math.ceil(zero))
    elif out_min > -eps:
        zero_int = 0
    else:
        zero_int = 255
    if scale == 0.0:
        # A constant-zero tensor: MACE would divide by zero. Any positive scale
        # represents it exactly; use the smallest normal float32.
        scale = float(np.finfo(np.float32).tiny)
    return QInfo(scale, zero_int, -zero_int * scale, (255 - zero_int) * scale)


def quantize_weights(w: np.ndarray) -> tuple[np.ndarray, QInfo]:
    """MACE's quantize(data, device=CPU, non_zero=True): per-tensor uint8 weights."""
    data = np.asarray(w, dtype=np.float64)
    p = adjust_range(data.min(), data.max(), non_zero=True)
    q = np.clip(np.round(p.zero_point + data / p.scale).astype(np.int32), 0, 255).astype(np.uint8)
    return q, p


def quantize_bias(b: np.ndarray, scale: float) -> np.ndarray:
    """MACE's quantize_with_scale_and_zero(bias, s_in * s_w, 0) as int32."""
    data = np.asarray(b, dtype=np.float64)
    q = np.round(data / scale)
    if np.any(np.abs(q) > 2**31 - 1):
        raise MaceqError("bias does not fit in int32 at scale %g" % scale)
    return q.astype(np.int32)


# -- per-device weight schemes -------------------------------------------------------------


@dataclass(frozen=True)
class QuantizedWeights:
    """Quantized weights in the MACE layout the op reads.

    ``params`` is the per-tensor affine quantization (uint8 schemes); ``channel_scales`` the
    float32 per-output-channel scales (symmetric int8 schemes), in output-channel order.
    """

    codes: np.ndarray
    params: QInfo | None = None
    channel_scales: np.ndarray | None = None


class CpuScheme:
    """MACE's CPU converter rules: uint8 asymmetric per-tensor weights in [1, 255], int32 bias at s_in*s_w."""

    def activation(self, lo: float, hi: float) -> QInfo:
        return adjust_range(lo, hi, non_zero=False)

    def weights(self, w: np.ndarray, *, out_axis_last_two: bool = False) -> QuantizedWeights:
        q, p = quantize_weights(w)
        return QuantizedWeights(q, params=p)

    def bias(self, b: np.ndarray, s_in: float, qw: QuantizedWeights) -> tuple[np.ndarray, QInfo]:
        """int32 bias codes and the quantization stored with them."""
        s_b = float(np.float32(s_in)) * float(np.float32(qw.params.scale))
        return quantize_bias(b, s_b), QInfo(s_b, 0, 0.0, 0.0)


class GpuScheme(CpuScheme):
    """The gpu device: uint8 activations, int8 symmetric per-output-channel weights, int32 bias per channel.

    Weight codes come from :func:`maceq.quant.converter.gpu_quantize_weights` (scale = max|w|/127
    in float32, round half to even); the bias of channel c is round(b[c] / (s_in * s_w[c])), with the
    product in float32, as the gpu kernels' host code forms it.
    """

    def weights(self, w: np.ndarray, *, out_axis_last_two: bool = False) -> QuantizedWeights:
        w = np.asarray(w, dtype=np.float32)
        if out_axis_last_two:  # depthwise [KH, KW, C, M]: output channel c*M + m
            kh, kw, c, m = w.shape
            flat = w.reshape(kh * kw, c * m).T
            q, scales = gpu_quantize_weights(flat)
            return QuantizedWeights(q.T.reshape(kh, kw, c, m), channel_scales=scales)
        q, scales = gpu_quantize_weights(w)
        return QuantizedWeights(q, channel_scales=scales)

    def bias(self, b: np.ndarray, s_in: float, qw: QuantizedWeights) -> tuple[np.ndarray, QInfo]:
        s_c = (np.float32(s_in) * qw.channel_scales.astype(np.float32)).astype(np.float64)
        data = np.asarray(b, dtype=np.float64)
        # A channel with tiny weights has a tiny scale: its bias saturates to int32, as TFLite's
        # per-channel bias quantization clamps it.
        q = np.clip(np.round(data / s_c), -(2**31 - 1), 2**31 - 1)
        return q.astype(np.int32), QInfo(0.0, 0, 0.0, 0.0)


class DspScheme(CpuScheme):
    """The dsp device (MACE's HEXAGON converter rules): ranges from ``adjust_range_for_hexagon``,
    uint8 weights over the hexagon-adjusted range, int32 bias symmetric over 2^32 levels (quantize_bias_for_hexagon).

    The min/max stored with each tensor are what nnlib's ops consume.
    """

    def activation(self, lo: float, hi: float) -> QInfo:
        mn, mx, scale, zp = mace_adjust_range_for_hexagon(lo, hi)
        if scale == 0.0:
            scale = float(np.finfo(np.float32).tiny)
        return QInfo(scale, zp, mn, mx)

    def weights(self, w: np.ndarray, *, out_axis_last_two: bool = False) -> QuantizedWeights:
        q, mn, mx = mace_quantize_tensor(w)
        p = self.activation(mn, mx)
        return QuantizedWeights(q, params=QInfo(p.scale, p.zero_point, mn, mx))

    def bias(self, b: np.ndarray, s_in: float, qw: QuantizedWeights) -> tuple[np.ndarray, QInfo]:
        q, mn, mx = mace_quantize_bias(b)
        return q, QInfo((mx - mn) / 2**32, 0, mn, mx)


SCHEMES = {WeightScheme.MACE_CPU: CpuScheme(), WeightScheme.INT8_PER_CHANNEL: GpuScheme(),
           WeightScheme.MACE_HEXAGON: DspScheme()}


def scheme_for(device: "Device | str") -> CpuScheme:
    """The quantization scheme the device's spec names."""
    return SCHEMES[device_spec(device).scheme]
