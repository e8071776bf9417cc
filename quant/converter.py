"""The MACE converter's quantization math, as its Python tools compute it (float64) or as the gpu
device's quantizer computes it: weight codes, bias codes and the hexagon range rule. The runtime never
needs these; the schemes (quant/scheme.py) and the tests that build models do."""
from __future__ import annotations

import math

import numpy as np

from maceq.errors import MaceqError

_F32 = np.float32

__all__ = ["gpu_quantize_weights", "mace_adjust_range_for_hexagon", "mace_quantize_bias", "mace_quantize_tensor"]


def mace_adjust_range_for_hexagon(in_min: float, in_max: float) -> tuple[float, float, float, int]:
    """MACE quantize_util.py ``adjust_range_for_hexagon`` (Python float64) -> (min, max, scale, zero).

    MACE's converter applies this to weights and to every activation range it hands nnlib.
    """
    out_max = max(0.0, float(in_max))
    out_min = min(0.0, float(in_min))
    scale = (out_max - out_min) / 255.0
    eps = 1e-6
    if out_min < -eps and out_max > eps:
        zero = -out_min / scale
        zero_int = int(round(zero))
        ceil = int(math.ceil(zero))
        keep_max = (ceil - zero) / out_max < (zero + 1 - ceil) / -out_min
        if zero_int <= 0 or (zero_int < 254 and keep_max):
            zero_int = ceil
            scale = out_max / (255.0 - zero_int)
        else:
            scale = -out_min / zero_int
    elif out_min > -eps:
        zero_int = 0
    else:
        zero_int = 255
    return -zero_int * scale, (255 - zero_int) * scale, scale, zero_int


def mace_quantize_bias(bias) -> tuple[np.ndarray, float, float]:
    """MACE ``quantize_bias_for_hexagon``: symmetric over 2^32 levels -> (int32 codes, min, max)."""
    data = np.asarray(bias, dtype=np.float64)
    max_val = float(max(abs(data.min()), abs(data.max()))) if data.size else 0.0
    if max_val == 0.0:
        return np.zeros(data.shape, dtype=np.int32), 0.0, 0.0
    scale = (2 * max_val) / 2 ** 32
    q = np.clip(np.round(data / scale).astype(np.int64), -2 ** 31, 2 ** 31 - 1).astype(np.int32)
    return q, -max_val, max_val


def mace_quantize_tensor(data) -> tuple[np.ndarray, float, float]:
    """MACE ``quantize(data, HEXAGON, non_zero=False)`` (weights): -> (uint8 codes, min, max)."""
    data = np.asarray(data, dtype=np.float64)
    mn, mx, scale, zero = mace_adjust_range_for_hexagon(float(data.min()), float(data.max()))
    q = np.clip(np.round(zero + data / scale).astype(np.int64), 0, 255).astype(np.uint8)
    return q, mn, mx


def gpu_quantize_weights(w_float) -> tuple[np.ndarray, np.ndarray]:
    """Contract: symmetric per-output-channel int8 weights (axis 0 is the output channel).

    For each channel c, over every element of ``w[c]`` (float32 values):
    ``amax = max |w|`` (exact), ``scale = f32(amax / 127)`` (one float32 division, as TFLite's
    ``SymmetricPerChannelQuantization`` in tensorflow/lite/tools/optimize/quantization_utils.cc),
    ``q = clip(rint(f32(w / scale)), -127, 127)`` with ``rint`` half to even (TFLite rounds
    half away from zero; the gpu device's quantizer rounds like its kernels). A channel that
    is all zeros (amax = 0) gets ``scale = 1.0`` and codes 0, so its requantization scale
    stays finite and its output is the quantized bias alone.
    Returns ``(w_int8, scales float32[O])``.
    """
    w = np.asarray(w_float, dtype=np.float64).astype(_F32)
    if w.ndim < 1 or w.shape[0] == 0:
        raise MaceqError(f"gpu_quantize_weights: need at least one output channel, got shape {w.shape}")
    if not np.all(np.isfinite(w)):
        raise MaceqError("gpu_quantize_weights: weights must be finite")
    flat = w.reshape(w.shape[0], -1)
    amax = np.abs(flat).max(axis=1) if flat.shape[1] else np.zeros(w.shape[0], _F32)
    scales = np.where(amax > 0, amax / _F32(127), _F32(1)).astype(_F32)
    q = np.rint(flat / scales[:, None])
    q = np.clip(q, -127, 127).astype(np.int8).reshape(w.shape)
    return q, scales
