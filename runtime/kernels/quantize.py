"""MACE CPU Quantize / Dequantize (float32 <-> uint8), as the ARM NEON build computes them.

Upstream sources transcribed here (XiaoMi/mace):
- ``mace/core/quantize.h``: ``AdjustRange<uint8_t>``, ``FindMinMax``, ``Saturate<uint8_t>``,
  ``QuantizeUtil::Quantize`` / ``Dequantize``;
- ``mace/core/quantize.cc``: the ``MACE_ENABLE_NEON`` specialisations of
  ``QuantizeWithScaleAndZeropoint`` and ``Dequantize`` for uint8;
- ``mace/ops/arm/q8/quantize.cc``: the ``Quantize`` op (``find_range_every_time``, ``non_zero``).

Every float step is done in float32, the type the C++ uses, one IEEE rounding per operation.
The NEON quantize body is ``vcvtq_s32_f32(vmlaq_f32(vzero, x, vrecip))``: ``vmlaq_f32`` is a
multiply followed by a separately rounded add (not a fused multiply-add), ``vzero`` is
``0.5f + float(zero_point)``, and ``vcvtq_s32_f32`` truncates toward zero (NaN gives 0,
out-of-range values saturate). The last ``size % 16`` elements take the scalar path
``Saturate<uint8_t>(roundf(zero_point + recip_scale * x))`` instead, with ``roundf`` rounding
half away from zero.

A constant-zero input (edge case, docs/edge-cases.md): with ``find_range_every_time`` the op
recomputes the range from the input; ``FindMinMax`` gives [0, 0] (also for an all-NaN input: the
loop leaves (FLT_MAX, -FLT_MAX) and AdjustRange clamps both to 0), ``AdjustRange<uint8_t>`` gives
``scale = 0 / 255 = 0`` and ``zero_point = 0``, and MACE goes on: ``recip_scale = 1 / 0 = +inf``,
``0 * inf = NaN``, which both paths turn into code 0 (FCVTZS), and the op stores scale 0 in the
output tensor (quantize.cc ``output->SetScale(scale)``). These functions do exactly that, with no
floating-point warning. The failure comes one op later: every uint8 consumer that requantizes
(Conv2D, DepthwiseConv2d, FullyConnected/Gemv) calls ``GetOutputMultiplierAndShift`` with
``lhs_scale = 0``, whose ``MACE_CHECK(real_multiplier > 0.f && real_multiplier < 1.f)`` aborts
the process (a Conv2D with a bias first divides by ``input_scale * filter_scale = 0`` in
``GetBiasData``, mace/ops/arm/q8/quantization_util.cc). maceq raises a MaceqError there
(:func:`maceq.runtime.fixedpoint.mace_rescale_bias` / ``mace_output_multiplier``). A consumer
that only moves codes (Dequantize, pooling, reshape) works, as on the device.
"""
from __future__ import annotations

import math

import numpy as np

from maceq.errors import MaceqError
from maceq.runtime.kernels import jit
from maceq.runtime.kernels.cfloat import c_roundf, roundf

_F32 = np.float32
# MACE's NEON quantize processes whole blocks of 16 floats; the rest go through the scalar loop.
NEON_QUANT_BLOCK = 16


def _as_f32(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32))


# ----------------------------------------------------------------------------------------------
# Range: FindMinMax + AdjustRange<uint8_t>
# ----------------------------------------------------------------------------------------------

def find_range(x) -> tuple[float, float]:
    """``FindMinMax`` (mace/core/quantize.h): the min and max of ``x`` as float32 values.

    The C++ loop is ``max_v = std::max(max_v, x[i])`` starting from ``lowest()`` (and the
    mirror for min). ``std::max(a, b)`` returns ``a`` when ``a < b`` is false, so NaN inputs
    never replace the running value: NaNs are skipped. An all-NaN input gives
    ``(FLT_MAX, -FLT_MAX)``, exactly what the loop leaves behind. Empty input raises
    (``MACE_CHECK(input.size() != 0)``).
    """
    v = _as_f32(x).ravel()
    if v.size == 0:
        raise MaceqError("Quantize: empty input tensor (MACE_CHECK(input.size() != 0))")
    if jit.available():  # the C++ loop itself, compiled
        return jit.find_range(v)
    finite_or_inf = v[~np.isnan(v)]
    if finite_or_inf.size == 0:
        return float(np.finfo(np.float32).max), float(-np.finfo(np.float32).max)
    return float(finite_or_inf.min()), float(finite_or_inf.max())


def adjust_range(in_min: float, in_max: float, *, non_zero: bool = False) -> tuple[float, int]:
    """``AdjustRange<uint8_t>`` (mace/core/quantize.h): (scale, zero_point) for a float range.

    All arithmetic in float32, as the C++ ``float`` locals:
      out_max = max(0, in_max); out_min = min(0, in_min)
      if non_zero: out_min = min(out_min, in_min - (out_max - in_min) / 254)
      scale = (out_max - out_min) / 255
      if out_min < -eps and out_max > eps (eps = 1e-6f):
          q0 = -out_min / scale; zp = (int)roundf(q0)            # half away from zero
          if non_zero and |q0 - zp| > eps: zp = (int)ceil(q0)
      elif out_min > -eps: zp = 0
      else: zp = 255
    Returns the scale widened to a Python float (the float32 bits are kept) and the int zp.
    """
    in_min_f = _F32(in_min)
    in_max_f = _F32(in_max)
    out_max = max(_F32(0.0), in_max_f)
    out_min = min(_F32(0.0), in_min_f)
    if non_zero:
        # (quantized_max - quantized_min - 1) is the int 254; float / int -> float.
        nudged = _F32(in_min_f - _F32(_F32(out_max - in_min_f) / _F32(254)))
        out_min = min(out_min, nudged)
    scale = _F32(_F32(out_max - out_min) / _F32(255))
    k_eps = _F32(1e-6)
    if out_min < -k_eps and out_max > k_eps:
        quantized_zero = _F32(-out_min / scale)
        zp = int(c_roundf(quantized_zero))
        if non_zero and abs(_F32(quantized_zero - _F32(zp))) > k_eps:
            zp = int(math.ceil(float(quantized_zero)))
    elif out_min > -k_eps:
        zp = 0
    else:
        zp = 255
    return float(scale), zp


# ----------------------------------------------------------------------------------------------
# Quantize (NEON body + scalar tail)
# ----------------------------------------------------------------------------------------------

def _recip(scale: float) -> np.float32:
    """``float recip_scale = 1 / scale`` in float32; scale 0 gives +inf, as in C (IEEE division)."""
    with np.errstate(divide="ignore", over="ignore"):
        return _F32(_F32(1.0) / _F32(scale))


def _saturate_u8_from_int_like(v: float) -> int:
    """``Saturate<uint8_t>(float)`` after rounding, with ARM's float->int conversion.

    ``static_cast<int>`` of NaN or of a value outside int range is undefined in C++; ARM's
    FCVTZS gives 0 for NaN and saturates otherwise, so NaN -> 0 and +-inf -> 255 / 0.
    """
    if math.isnan(v):
        return 0
    if v <= 0:
        return 0
    if v >= 255:
        return 255
    return int(v)


def quantize_neon_ref(x, *, scale: float, zero_point: int) -> np.ndarray:
    """Readable scalar reference of MACE's NEON ``QuantizeWithScaleAndZeropoint`` (uint8).

    For flat index i < 16 * (size // 16) (the NEON body):
        q = clamp(trunc(f32(f32(x * r) + f32(0.5 + zp))), 0, 255)     r = f32(1 / scale)
    for the remaining tail:
        q = clamp(roundf(f32(f32(zp) + f32(r * x))), 0, 255)
    NaN gives 0 on both paths (FCVTZS semantics).
    """
    v = _as_f32(x)
    flat = v.ravel()
    recip = _recip(scale)
    vzero = _F32(_F32(0.5) + _F32(zero_point))
    zp_f = _F32(zero_point)
    body_end = (flat.size // NEON_QUANT_BLOCK) * NEON_QUANT_BLOCK
    out = np.empty(flat.size, dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        for i in range(flat.size):
            if i < body_end:
                t = _F32(_F32(flat[i] * recip) + vzero)  # vmlaq_f32: mul, round, add, round
                d = float(t)
                out[i] = _saturate_u8_from_int_like(math.trunc(d) if math.isfinite(d) else d)
            else:
                t = _F32(zp_f + _F32(recip * flat[i]))
                out[i] = _saturate_u8_from_int_like(c_roundf(t))
    return out.reshape(v.shape)


def quantize_neon(x, *, scale: float, zero_point: int) -> np.ndarray:
    """Vectorised MACE NEON uint8 quantize; bit-exact with :func:`quantize_neon_ref`.

    Contract: ``x`` is any float array (converted to float32); ``scale`` is the float32 scale
    stored in the model (a Python float holding its bits), ``zero_point`` an int in [0, 255].
    Returns uint8 codes of the same shape.
    """
    v = _as_f32(x)
    flat = v.ravel()
    recip = _recip(scale)
    vzero = _F32(_F32(0.5) + _F32(zero_point))
    body_end = (flat.size // NEON_QUANT_BLOCK) * NEON_QUANT_BLOCK
    if jit.available():  # the same float32 steps in one compiled pass
        return jit.quantize_neon(flat, recip, vzero, _F32(zero_point), body_end).reshape(v.shape)
    out = np.empty(flat.size, dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        body = (flat[:body_end] * recip).astype(np.float32) + vzero  # two float32 roundings
        out[:body_end] = _clamp_u8(np.trunc(body.astype(np.float64)))
        tail = (_F32(zero_point) + (recip * flat[body_end:]).astype(np.float32)).astype(np.float32)
        out[body_end:] = _clamp_u8(roundf(tail.astype(np.float64)))
    return out.reshape(v.shape)


def _clamp_u8(d: np.ndarray) -> np.ndarray:
    """Integral float64 values -> uint8 with saturation; NaN -> 0 (ARM FCVTZS)."""
    d = np.where(np.isnan(d), 0.0, d)
    return np.clip(d, 0.0, 255.0).astype(np.uint8)


def quantize(x, *, non_zero: bool = False) -> tuple[np.ndarray, float, int]:
    """The Quantize op with ``find_range_every_time=1`` (mace/ops/arm/q8/quantize.cc).

    The range is recomputed from this input with :func:`find_range` and :func:`adjust_range`,
    then the input is quantized with :func:`quantize_neon`. Returns (codes, scale, zero_point);
    the scale and zero point become the output tensor's quantize info. A constant-zero input gives
    codes 0 with scale 0.0 and zero point 0, as MACE's op does (see the module docstring).
    """
    lo, hi = find_range(x)
    scale, zp = adjust_range(lo, hi, non_zero=non_zero)
    return quantize_neon(x, scale=scale, zero_point=zp), scale, zp


# ----------------------------------------------------------------------------------------------
# Dequantize
# ----------------------------------------------------------------------------------------------

def dequantize(q, *, scale: float, zero_point: int) -> np.ndarray:
    """``Dequantize`` (mace/core/quantize.cc, NEON and scalar alike): f32(scale) * f32(q - zp).

    ``q - zp`` is an exact int32, converted exactly to float32 (|q - zp| < 2^24), then one
    float32 multiply. Returns float32.
    """
    diff = np.asarray(q).astype(np.int64) - int(zero_point)
    return (_F32(scale) * diff.astype(np.float32)).astype(np.float32)
