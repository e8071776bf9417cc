"""uint8 activation kernels with TFLite's reference semantics, plus exact lookup-table activations.

Every kernel takes NHWC (any shape) uint8 codes and returns uint8 codes of the same shape.
Quantization arguments are keyword-only: scales are the float32 values stored in a model (a
Python float is rounded to float32 first), zero points are ints in [0, 255].

Each kernel comes twice: a readable ``*_ref`` (plain Python ints / float32 scalars, one element
at a time, transcribing the TFLite C++), and a fast path. Every op here is a function of one
input code (PReLU: of the pair (input code, alpha code)), so the fast path evaluates the same
arithmetic, vectorised in numpy, once over all 256 codes (65,536 pairs for PReLU) and then
gathers: the table is exact by construction. tests/oracle/test_activation_oracle.py proves
fast == ref bit for bit and both == TFLite BUILTIN_REF (ai-edge-litert 2.3.0).

Upstream sources (google-ai-edge/LiteRT, tflite/kernels/...; identical in tensorflow/lite):

- ``activations.cc``: Prepare/Eval of LOGISTIC, TANH, HARD_SWISH, LEAKY_RELU, PRELU.
  With the reference kernel type, uint8 LOGISTIC and TANH do NOT take the gemmlowp fixed-point
  path (``input_multiplier``/``input_left_shift``/``input_range_radius`` are only computed for
  ``kFixedPointOptimized``): Prepare fills a 256-entry LUT with ``LUTPopulate<uint8_t>`` and
  Eval is ``LookupTable``.
- ``internal/common.h``: ``LUTPopulateInt8`` (float32 LUT construction), ``LUTLookup``.
- ``internal/reference/hard_swish.h``: ``HardSwish`` (int16 fixed point),
  ``SaturatingLeftShift``, ``SaturatingDoublingHighMul``; ``DownScaleInt32ToInt16Multiplier``.
- ``internal/reference/leaky_relu.h``: ``QuantizeLeakyRelu``.
- ``internal/reference/prelu.h``: ``BroadcastPrelu4DSlow`` / ``Prelu``.
- gemmlowp ``fixedpoint/fixedpoint.h``: the int16 ``SaturatingRoundingDoublingHighMul`` and
  ``RoundingDivideByPOT``.

Multipliers: TFLite computes the real multipliers of these ops as C ``float`` expressions
(``input->params.scale / output->params.scale`` is a float32 division), widened to double only
when passed to ``QuantizeMultiplier``. The kernels reproduce that: every ``*_params`` function
rounds each intermediate to float32.

HardSigmoid and Clip have no uint8 TFLite kernel; they are defined here (and in
docs/semantics.md) as exact lookup tables, see :func:`make_lut`.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from maceq.errors import MaceqError
from maceq.runtime import fixedpoint as fp
from maceq.runtime.fixedpoint import (
    multiply_by_quantized_multiplier,
    quantize_multiplier,
    round_half_away,
)
from maceq.runtime.kernels.softmax import expf

__all__ = [
    "LOGISTIC_OUT_SCALE",
    "LOGISTIC_OUT_ZP",
    "TANH_OUT_SCALE",
    "TANH_OUT_ZP",
    "lut_apply",
    "make_lut",
    "tflite_lut",
    "tanhf",
    "logistic",
    "logistic_ref",
    "tanh",
    "tanh_ref",
    "HardSwishParams",
    "hard_swish_params",
    "hard_swish",
    "hard_swish_ref",
    "LeakyReluParams",
    "leaky_relu_params",
    "leaky_relu",
    "leaky_relu_ref",
    "PreluParams",
    "prelu_params",
    "prelu",
    "prelu_ref",
    "hard_sigmoid",
    "hard_sigmoid_ref",
    "clip",
    "clip_ref",
    "clip_code_bounds",
]

_F32 = np.float32
LOGISTIC_OUT_SCALE = 1.0 / 256  # TFLite requires output scale 1/256, zero point 0 (uint8)
LOGISTIC_OUT_ZP = 0
TANH_OUT_SCALE = 1.0 / 128      # the converter's fixed uint8 TANH output quantization
TANH_OUT_ZP = 128

def _libm_float_function(name: str):
    """The C library's ``float name(float)`` through ctypes."""
    fn = getattr(ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6"), name)
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return fn


_tanhf = _libm_float_function("tanhf")


def tanhf(v) -> np.float32:
    """The C library's float ``tanhf`` on one float32 value (what ``std::tanh(float)`` calls)."""
    return _F32(_tanhf(float(_F32(v))))


# ----------------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------------

def _scale(op: str, name: str, s) -> float:
    """The float32 value of a positive finite scale, as a Python float."""
    v = _F32(s)
    if not (np.isfinite(v) and v > 0):
        raise MaceqError(f"{op}: {name} must be a positive finite float32, got {s!r}")
    return float(v)


def _zp(op: str, name: str, zp) -> int:
    if isinstance(zp, (bool, np.bool_)) or not isinstance(zp, (int, np.integer)) or not 0 <= zp <= 255:
        raise MaceqError(f"{op}: {name} must be an int in [0, 255] for uint8, got {zp!r}")
    return int(zp)


def _codes(op: str, x) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype != np.uint8:
        raise MaceqError(f"{op}: expected uint8 codes, got {a.dtype}")
    return a


def _clamp_u8(v):
    """Python int or int64 array clamped to [0, 255] (the ``std::min/max`` with T's limits)."""
    if isinstance(v, np.ndarray):
        return np.clip(v, 0, 255)
    return min(255, max(0, v))


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


_CODES = np.arange(256, dtype=np.int64)


# ----------------------------------------------------------------------------------------------
# Lookup tables
# ----------------------------------------------------------------------------------------------

def lut_apply(x, lut) -> np.ndarray:
    """Contract: ``lut[x]`` elementwise; ``x`` uint8 of any shape, ``lut`` uint8 of shape (256,).

    TFLite ``LookupTable`` / ``LUTLookup`` (internal/reference/integer_ops/lut.h, common.h).
    """
    x = _codes("lut_apply", x)
    t = np.asarray(lut)
    if t.shape != (256,) or t.dtype != np.uint8:
        raise MaceqError(f"lut_apply: the table must be uint8 of shape (256,), got {t.dtype} {t.shape}")
    return t[x]


def _round_half_away_exact(v: Fraction) -> int:
    """The integer nearest to the rational ``v``, ties away from zero (exact)."""
    n, d = abs(v.numerator), v.denominator
    r = (2 * n + d) // (2 * d)  # floor(|v| + 1/2)
    return r if v >= 0 else -r


def _quantize_exact(v, s_out: Fraction, zp_out: int) -> int:
    """clamp(zp_out + round_half_away(v / s_out), 0, 255), the division and rounding exact."""
    if isinstance(v, float):
        if math.isnan(v):
            raise MaceqError("make_lut: the function returned NaN")
        if math.isinf(v):
            return 255 if v > 0 else 0
    return _clamp_u8(zp_out + _round_half_away_exact(Fraction(v) / s_out))


def make_lut(fn, *, in_scale: float, in_zp: int, out_scale: float, out_zp: int) -> np.ndarray:
    """Contract: the exact uint8 table of a real function ``fn``; a read-write (256,) uint8 array.

    For each input code c::

        x      = s_in * (c - zp_in)                      (exact: a Python float)
        lut[c] = clamp(zp_out + round_half_away(fn(x) / s_out), 0, 255)

    ``x`` is exact in float64 (a 24-bit float32 significand times a 9-bit integer). ``fn`` may
    return a float, an int or a ``fractions.Fraction``; the division by ``s_out`` and the rounding
    (ties away from zero, as TFLite's ``TfLiteRound``) are carried out exactly on rationals, so
    the only rounding before the final one is whatever ``fn`` itself does. A piecewise-linear
    ``fn`` computed on Fractions (:func:`hard_sigmoid`, :func:`clip`) therefore yields the code
    nearest to the exact real value. +-inf saturates to 255 / 0; NaN raises MaceqError.
    The zero point is added after rounding (as TFLite's LUTPopulate and QUANTIZE do).
    """
    s_in = Fraction(_scale("make_lut", "in_scale", in_scale))
    s_out = Fraction(_scale("make_lut", "out_scale", out_scale))
    zp_in = _zp("make_lut", "in_zp", in_zp)
    zp_out = _zp("make_lut", "out_zp", out_zp)
    lut = np.empty(256, dtype=np.uint8)
    for c in range(256):
        x = float(s_in * (c - zp_in))  # exact, see above
        lut[c] = _quantize_exact(fn(x), s_out, zp_out)
    return lut


def _f32_to_int32_trunc(v: np.float32) -> int:
    """``static_cast<int32_t>(float)``: truncation; outside int32 (or NaN) is undefined in C++."""
    if not np.isfinite(v) or not (-2.0 ** 31 <= float(v) < 2.0 ** 31):
        raise MaceqError(f"tflite_lut: value {float(v)!r} does not fit int32 (undefined in TFLite)")
    return int(np.trunc(v))


def tflite_lut(transform, *, in_scale: float, in_zp: int, out_scale: float, out_zp: int) -> np.ndarray:
    """Contract: TFLite ``LUTPopulate<uint8_t>`` (internal/common.h ``LUTPopulateInt8``), scalar.

    ``transform`` maps one np.float32 to one np.float32 (the C++ ``float (*)(float)``). Every step
    is a float32 operation, in this order::

        inverse_scale = 1.0f / s_out
        for val in 0..255:
            dequantized = s_in * float(val - zp_in)
            transformed = transform(dequantized)
            rescaled    = roundf(transformed * inverse_scale)      # ties away from zero
            quantized   = int32(rescaled + float(zp_out))          # truncation
            lut[val]    = clamp(quantized, 0, 255)
    """
    s_in = _F32(_scale("tflite_lut", "in_scale", in_scale))
    s_out = _F32(_scale("tflite_lut", "out_scale", out_scale))
    zp_in, zp_out = _zp("tflite_lut", "in_zp", in_zp), _zp("tflite_lut", "out_zp", out_zp)
    inverse_scale = _F32(_F32(1) / s_out)
    lut = np.empty(256, dtype=np.uint8)
    for val in range(256):
        dequantized = _F32(s_in * _F32(val - zp_in))
        transformed = _F32(transform(dequantized))
        rescaled = _F32(round_half_away(_F32(transformed * inverse_scale)))
        quantized = _f32_to_int32_trunc(_F32(rescaled + _F32(zp_out)))
        lut[val] = _clamp_u8(quantized)
    return lut


def _tflite_lut_vec(transform_vec, s_in: float, zp_in: int, s_out: float, zp_out: int) -> np.ndarray:
    """:func:`tflite_lut` evaluated on float32 arrays (``transform_vec``: float32 array -> array)."""
    inverse_scale = _F32(_F32(1) / _F32(s_out))
    dequantized = _F32(s_in) * (_CODES - zp_in).astype(np.float32)        # float32 * float32
    transformed = np.asarray(transform_vec(dequantized), dtype=np.float32)
    rescaled = round_half_away(transformed * inverse_scale).astype(np.float32)  # |.| <= 2^24: exact
    summed = rescaled + _F32(zp_out)
    if not np.all(np.isfinite(summed)) or np.abs(summed).max() >= 2.0 ** 31:
        raise MaceqError("tflite_lut: a table value does not fit int32 (undefined in TFLite)")
    return _clamp_u8(np.trunc(summed).astype(np.int64)).astype(np.uint8)


# ----------------------------------------------------------------------------------------------
# LOGISTIC and TANH (activations.cc SigmoidPrepare / TanhPrepare, kReference, uint8)
# ----------------------------------------------------------------------------------------------

def _sigmoid_f32(v: np.float32) -> np.float32:
    """The lambda ``1.0f / (1.0f + std::exp(-value))`` of SigmoidPrepare: float32, libm expf."""
    return _F32(_F32(1) / _F32(_F32(1) + expf(-v)))


def _sigmoid_f32_vec(v: np.ndarray) -> np.ndarray:
    e = np.array([expf(t) for t in -v], dtype=np.float32)  # libm expf, one call per code
    return _F32(1) / (_F32(1) + e)


def _tanh_f32_vec(v: np.ndarray) -> np.ndarray:
    return np.array([tanhf(t) for t in v], dtype=np.float32)


def _lookup_ref(x: np.ndarray, lut: np.ndarray) -> np.ndarray:
    """The reference ``LookupTable`` loop: ``output[i] = lut[input[i]]``, one element at a time."""
    out = np.empty(x.shape, dtype=np.uint8)
    flat_in, flat_out = x.ravel(), out.reshape(-1)
    for i in range(flat_in.size):
        flat_out[i] = lut[int(flat_in[i])]
    return out


@functools.lru_cache(maxsize=256)
def _logistic_lut(s_in: float, zp_in: int) -> np.ndarray:
    return _readonly(_tflite_lut_vec(_sigmoid_f32_vec, s_in, zp_in, LOGISTIC_OUT_SCALE, LOGISTIC_OUT_ZP))


@functools.lru_cache(maxsize=256)
def _tanh_lut(s_in: float, zp_in: int, s_out: float, zp_out: int) -> np.ndarray:
    return _readonly(_tflite_lut_vec(_tanh_f32_vec, s_in, zp_in, s_out, zp_out))


def logistic_ref(x, *, in_scale: float, in_zp: int) -> np.ndarray:
    """Reference uint8 LOGISTIC: scalar LUTPopulate with ``1/(1+expf(-v))``, then the lookup loop.

    Output quantization is TFLite's fixed 1/256, zero point 0 (SigmoidPrepare checks the scale).
    """
    x = _codes("logistic", x)
    lut = tflite_lut(_sigmoid_f32, in_scale=in_scale, in_zp=in_zp,
                     out_scale=LOGISTIC_OUT_SCALE, out_zp=LOGISTIC_OUT_ZP)
    return _lookup_ref(x, lut)


def logistic(x, *, in_scale: float, in_zp: int) -> np.ndarray:
    """TFLite BUILTIN_REF uint8 LOGISTIC (output scale 1/256, zp 0); bit-exact with the ref."""
    x = _codes("logistic", x)
    return _logistic_lut(_scale("logistic", "in_scale", in_scale), _zp("logistic", "in_zp", in_zp))[x]


def tanh_ref(x, *, in_scale: float, in_zp: int, out_scale: float = TANH_OUT_SCALE,
             out_zp: int = TANH_OUT_ZP) -> np.ndarray:
    """Reference uint8 TANH: scalar LUTPopulate with libm ``tanhf``, then the lookup loop.

    TFLite's reference TanhPrepare does not check the output quantization; the converter
    always writes 1/128, 128 for uint8, which are the defaults here.
    """
    x = _codes("tanh", x)
    lut = tflite_lut(tanhf, in_scale=in_scale, in_zp=in_zp, out_scale=out_scale, out_zp=out_zp)
    return _lookup_ref(x, lut)


def tanh(x, *, in_scale: float, in_zp: int, out_scale: float = TANH_OUT_SCALE,
         out_zp: int = TANH_OUT_ZP) -> np.ndarray:
    """TFLite BUILTIN_REF uint8 TANH; bit-exact with :func:`tanh_ref`."""
    x = _codes("tanh", x)
    lut = _tanh_lut(_scale("tanh", "in_scale", in_scale), _zp("tanh", "in_zp", in_zp),
                    _scale("tanh", "out_scale", out_scale), _zp("tanh", "out_zp", out_zp))
    return lut[x]


# ----------------------------------------------------------------------------------------------
# HARD_SWISH (activations.cc HardSwishPrepare, reference/hard_swish.h)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HardSwishParams:
    """TFLite ``HardSwishParams`` for uint8 (int16 multipliers, TFLite shift convention)."""

    in_zp: int
    out_zp: int
    out_multiplier16: int
    out_exponent: int          # <= 0 (HardSwishPrepare ensures it)
    reluish_multiplier16: int
    reluish_exponent: int


def _downscale_int32_to_int16_multiplier(m: int) -> int:
    """TFLite ``DownScaleInt32ToInt16Multiplier``: round the Q31 multiplier to Q15, saturating."""
    if m < 0:
        raise MaceqError(f"HardSwish: negative multiplier {m}")
    if m >= (2 ** 31 - 1) - (1 << 15):
        return 32767
    return (m + (1 << 15)) >> 16


def hard_swish_params(*, in_scale: float, in_zp: int, out_scale: float, out_zp: int) -> HardSwishParams:
    """HardSwishPrepare (activations.cc), every float step in float32::

        hires_input_scale  = (1.0f / 128.0f) * s_in
        reluish_scale      = 3.0f / 32768.0f
        output_multiplier  = hires_input_scale / s_out      -> QuantizeMultiplier -> int16
        reluish_multiplier = hires_input_scale / reluish_scale -> QuantizeMultiplier -> int16

    Raises MaceqError where TFLite's Prepare fails (output exponent > 0, i.e. about s_in >= 128 s_out).
    """
    s_in = _F32(_scale("HardSwish", "in_scale", in_scale))
    s_out = _F32(_scale("HardSwish", "out_scale", out_scale))
    hires = _F32(_F32(1.0 / 128.0) * s_in)
    reluish_scale = _F32(_F32(3.0) / _F32(32768.0))
    q_out, e_out = quantize_multiplier(float(_F32(hires / s_out)))
    if e_out > 0:
        raise MaceqError(f"HardSwish: s_in / (128 s_out) = {float(hires / s_out)!r} >= 1; "
                         "TFLite requires output_multiplier_exponent <= 0")
    q_rel, e_rel = quantize_multiplier(float(_F32(hires / reluish_scale)))
    if e_rel > 31:
        raise MaceqError(f"HardSwish: reluish exponent {e_rel} > 31 (undefined shift in TFLite)")
    return HardSwishParams(_zp("HardSwish", "in_zp", in_zp), _zp("HardSwish", "out_zp", out_zp),
                           _downscale_int32_to_int16_multiplier(q_out), e_out,
                           _downscale_int32_to_int16_multiplier(q_rel), e_rel)


@dataclass(frozen=True)
class _Int16Ops:
    """One implementation of the int16 primitives: scalar Python ints, or vectorised int64 arrays."""

    srdhm: object
    sdhm: object
    rdbp: object
    sat_lshift: object


_SCALAR16 = _Int16Ops(fp.srdhm16, fp.sdhm16, fp.rdbp16, fp.sat_lshift16)
_VECTOR16 = _Int16Ops(fp.srdhm16_v, fp.sdhm16_v, fp.rdbp16_v, fp.sat_lshift16_v)


def _hard_swish_arith(input_value, p: HardSwishParams, ops: _Int16Ops):
    """reference_ops::HardSwish (hard_swish.h) after ``input_value = x - zp_in``, int16 arithmetic.

    ``input_value`` is one Python int (the reference, with :data:`_SCALAR16`) or the int64 array
    of all 256 codes (the fast table, with :data:`_VECTOR16`).
    """
    hires = input_value * (1 << 7)               # |x - zp| <= 255: |.| <= 32640 < 2^15, fits int16
    preshift_out = ops.srdhm(hires, p.out_multiplier16)
    reluish = hires
    if p.reluish_exponent > 0:
        reluish = ops.sat_lshift(reluish, p.reluish_exponent - 1)
    reluish = ops.srdhm(reluish, p.reluish_multiplier16)
    if p.reluish_exponent > 0:
        reluish = ops.sat_lshift(reluish, 1)
    if p.reluish_exponent < 0:
        reluish = ops.rdbp(reluish, -p.reluish_exponent)
    reluish = (reluish + (1 << 15)) >> 1         # [-2^15, 2^15) -> [0, 2^15): fits int16
    preshift_value = ops.sdhm(reluish, preshift_out)
    out = ops.rdbp(preshift_value, -p.out_exponent)
    return _clamp_u8(fp.wrap_int16(out + p.out_zp))   # int16 += int32 converts back to int16 (wraps)


def _hard_swish_lut_v(p: HardSwishParams) -> np.ndarray:
    return _hard_swish_arith(_CODES - p.in_zp, p, _VECTOR16).astype(np.uint8)


_hard_swish_table = functools.lru_cache(maxsize=256)(lambda p: _readonly(_hard_swish_lut_v(p)))


def hard_swish_ref(x, *, in_scale: float, in_zp: int, out_scale: float, out_zp: int) -> np.ndarray:
    """Reference uint8 HARD_SWISH: reference_ops::HardSwish, element by element."""
    x = _codes("HardSwish", x)
    p = hard_swish_params(in_scale=in_scale, in_zp=in_zp, out_scale=out_scale, out_zp=out_zp)
    out = [_hard_swish_arith(int(c) - p.in_zp, p, _SCALAR16) for c in x.ravel()]
    return np.array(out, dtype=np.uint8).reshape(x.shape)


def hard_swish(x, *, in_scale: float, in_zp: int, out_scale: float, out_zp: int) -> np.ndarray:
    """TFLite BUILTIN_REF uint8 HARD_SWISH; bit-exact with :func:`hard_swish_ref`."""
    x = _codes("HardSwish", x)
    p = hard_swish_params(in_scale=in_scale, in_zp=in_zp, out_scale=out_scale, out_zp=out_zp)
    return _hard_swish_table(p)[x]


# ----------------------------------------------------------------------------------------------
# LEAKY_RELU (activations.cc LeakyReluPrepare, reference/leaky_relu.h)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LeakyReluParams:
    """TFLite ``LeakyReluParams`` for uint8 (Q31 multipliers, shift > 0 is a left shift)."""

    in_zp: int
    out_zp: int
    alpha_multiplier: int      # signed: a negative alpha gives a negative multiplier
    alpha_shift: int
    identity_multiplier: int
    identity_shift: int


def leaky_relu_params(*, alpha: float, in_scale: float, in_zp: int, out_scale: float,
                      out_zp: int) -> LeakyReluParams:
    """LeakyReluPrepare (activations.cc): float32 expressions, then QuantizeMultiplier::

        alpha_multiplier    = s_in * alpha / s_out     (float32 ops, left to right)
        identity_multiplier = s_in / s_out
    """
    s_in = _F32(_scale("LeakyRelu", "in_scale", in_scale))
    s_out = _F32(_scale("LeakyRelu", "out_scale", out_scale))
    a = _F32(alpha)
    if not np.isfinite(a):
        raise MaceqError(f"LeakyRelu: alpha must be finite, got {alpha!r}")
    qa, sa = quantize_multiplier(float(_F32(_F32(s_in * a) / s_out)))
    qi, si = quantize_multiplier(float(_F32(s_in / s_out)))
    if max(sa, si) > 31:
        raise MaceqError(f"LeakyRelu: multiplier left shift above 31 "
                         f"(s_in={float(s_in)!r}, s_out={float(s_out)!r}, alpha={float(a)!r})")
    return LeakyReluParams(_zp("LeakyRelu", "in_zp", in_zp), _zp("LeakyRelu", "out_zp", out_zp),
                           qa, sa, qi, si)


def _leaky_relu_code(c: int, p: LeakyReluParams) -> int:
    """reference_ops::QuantizeLeakyRelu on one code. A negative alpha multiplier is applied as
    ``-MultiplyByQuantizedMultiplier(x, -q, shift)`` (the "safe" multiplier of leaky_relu.h)."""
    input_value = c - p.in_zp                   # in [-255, 255]
    if input_value >= 0:
        scaled = multiply_by_quantized_multiplier(input_value, p.identity_multiplier, p.identity_shift)
    else:
        scaled = multiply_by_quantized_multiplier(input_value, abs(p.alpha_multiplier), p.alpha_shift)
        if p.alpha_multiplier < 0:
            scaled = -scaled
    return _clamp_u8(p.out_zp + scaled)


def _leaky_relu_lut_v(p: LeakyReluParams) -> np.ndarray:
    v = _CODES - p.in_zp
    pos = multiply_by_quantized_multiplier(v, p.identity_multiplier, p.identity_shift)
    neg = multiply_by_quantized_multiplier(v, abs(p.alpha_multiplier), p.alpha_shift)
    neg = -neg if p.alpha_multiplier < 0 else neg
    return _clamp_u8(p.out_zp + np.where(v >= 0, pos, neg)).astype(np.uint8)


_leaky_relu_table = functools.lru_cache(maxsize=256)(lambda p: _readonly(_leaky_relu_lut_v(p)))


def leaky_relu_ref(x, *, alpha: float, in_scale: float, in_zp: int, out_scale: float,
                   out_zp: int) -> np.ndarray:
    """Reference uint8 LEAKY_RELU: reference_ops::QuantizeLeakyRelu, element by element."""
    x = _codes("LeakyRelu", x)
    p = leaky_relu_params(alpha=alpha, in_scale=in_scale, in_zp=in_zp, out_scale=out_scale, out_zp=out_zp)
    return np.array([_leaky_relu_code(int(c), p) for c in x.ravel()], dtype=np.uint8).reshape(x.shape)


def leaky_relu(x, *, alpha: float, in_scale: float, in_zp: int, out_scale: float,
               out_zp: int) -> np.ndarray:
    """TFLite BUILTIN_REF uint8 LEAKY_RELU; bit-exact with :func:`leaky_relu_ref`."""
    x = _codes("LeakyRelu", x)
    p = leaky_relu_params(alpha=alpha, in_scale=in_scale, in_zp=in_zp, out_scale=out_scale, out_zp=out_zp)
    return _leaky_relu_table(p)[x]


# ----------------------------------------------------------------------------------------------
# PRELU (activations.cc PreluPrepare, reference/prelu.h)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PreluParams:
    """TFLite ``PreluParams`` for uint8 (offsets stored as zero points here)."""

    in_zp: int
    alpha_zp: int
    out_zp: int
    multiplier_1: int          # x >= 0: s_in / s_out
    shift_1: int
    multiplier_2: int          # x < 0: s_in * s_alpha / s_out
    shift_2: int


def prelu_params(*, in_scale: float, in_zp: int, alpha_scale: float, alpha_zp: int,
                 out_scale: float, out_zp: int) -> PreluParams:
    """PreluPrepare (activations.cc): ``real_multiplier_1 = s_in / s_out`` and
    ``real_multiplier_2 = s_in * s_alpha / s_out``, float32 expressions, then QuantizeMultiplier."""
    s_in = _F32(_scale("Prelu", "in_scale", in_scale))
    s_a = _F32(_scale("Prelu", "alpha_scale", alpha_scale))
    s_out = _F32(_scale("Prelu", "out_scale", out_scale))
    q1, e1 = quantize_multiplier(float(_F32(s_in / s_out)))
    q2, e2 = quantize_multiplier(float(_F32(_F32(s_in * s_a) / s_out)))
    if max(e1, e2) > 31:
        raise MaceqError("Prelu: multiplier left shift above 31")
    return PreluParams(_zp("Prelu", "in_zp", in_zp), _zp("Prelu", "alpha_zp", alpha_zp),
                       _zp("Prelu", "out_zp", out_zp), q1, e1, q2, e2)


def _prelu_code(c: int, a: int, p: PreluParams) -> int:
    """The ``op`` lambda of reference_ops::BroadcastPrelu4DSlow on one (input, alpha) pair."""
    input_value = c - p.in_zp                          # params.input_offset + input_val
    if input_value >= 0:
        out = multiply_by_quantized_multiplier(input_value, p.multiplier_1, p.shift_1)
    else:
        alpha_value = a - p.alpha_zp
        # |input_value * alpha_value| <= 255 * 255 < 2^16: no int32 overflow
        out = multiply_by_quantized_multiplier(input_value * alpha_value, p.multiplier_2, p.shift_2)
    return _clamp_u8(out + p.out_zp)


def _prelu_table_v(p: PreluParams) -> np.ndarray:
    """(256, 256) uint8: out[input code, alpha code], vectorised."""
    v = (_CODES - p.in_zp)[:, None]
    av = (_CODES - p.alpha_zp)[None, :]
    pos = multiply_by_quantized_multiplier(v, p.multiplier_1, p.shift_1)
    neg = multiply_by_quantized_multiplier(v * av, p.multiplier_2, p.shift_2)
    out = np.where(v >= 0, pos, neg) + p.out_zp
    return _clamp_u8(out).astype(np.uint8)


_prelu_table = functools.lru_cache(maxsize=64)(lambda p: _readonly(_prelu_table_v(p)))


def _prelu_prepare(x, alpha_codes):
    x = _codes("Prelu", x)
    a = _codes("Prelu", alpha_codes)
    try:
        out_shape = np.broadcast_shapes(x.shape, a.shape)
    except ValueError:
        raise MaceqError(f"Prelu: alpha shape {a.shape} does not broadcast with input {x.shape}") from None
    if out_shape != x.shape:
        raise MaceqError(f"Prelu: broadcasting alpha {a.shape} changes the input shape {x.shape} "
                         "(TFLite requires the output shape to equal the input's)")
    return x, np.broadcast_to(a, x.shape)


def prelu_ref(x, alpha_codes, *, in_scale: float, in_zp: int, alpha_scale: float, alpha_zp: int,
              out_scale: float, out_zp: int) -> np.ndarray:
    """Reference uint8 PRELU (reference_ops::BroadcastPrelu4DSlow), element by element.

    ``alpha_codes`` (uint8) broadcasts against ``x`` numpy-style, e.g. [C] or [1, 1, C] over NHWC.
    """
    x, a = _prelu_prepare(x, alpha_codes)
    p = prelu_params(in_scale=in_scale, in_zp=in_zp, alpha_scale=alpha_scale, alpha_zp=alpha_zp,
                     out_scale=out_scale, out_zp=out_zp)
    out = [_prelu_code(int(c), int(al), p) for c, al in zip(x.ravel(), a.ravel())]
    return np.array(out, dtype=np.uint8).reshape(x.shape)


def prelu(x, alpha_codes, *, in_scale: float, in_zp: int, alpha_scale: float, alpha_zp: int,
          out_scale: float, out_zp: int) -> np.ndarray:
    """TFLite BUILTIN_REF uint8 PRELU; bit-exact with :func:`prelu_ref` (a 256 x 256 table)."""
    x, a = _prelu_prepare(x, alpha_codes)
    p = prelu_params(in_scale=in_scale, in_zp=in_zp, alpha_scale=alpha_scale, alpha_zp=alpha_zp,
                     out_scale=out_scale, out_zp=out_zp)
    index = (x.astype(np.uint16) << 8) | a             # input code * 256 + alpha code
    return _prelu_table(p).reshape(-1)[index]


# ----------------------------------------------------------------------------------------------
# HardSigmoid and Clip: exact lookup tables (no TFLite uint8 kernel)
# ----------------------------------------------------------------------------------------------

def _f32_fraction(op: str, name: str, v) -> Fraction:
    f = _F32(v)
    if not np.isfinite(f):
        raise MaceqError(f"{op}: {name} must be finite, got {v!r}")
    return Fraction(float(f))


def _hard_sigmoid_fn(alpha: Fraction, beta: Fraction):
    def fn(x: float) -> Fraction:
        return min(Fraction(1), max(Fraction(0), alpha * Fraction(x) + beta))
    return fn


def _bound(op: str, name: str, v) -> Fraction | None:
    """A Clip bound: None or +-inf means unbounded; otherwise its float32 value, exactly."""
    if v is None or (np.isinf(_F32(v))):
        return None
    return _f32_fraction(op, name, v)


def _clip_fn(lo: Fraction | None, hi: Fraction | None):
    def fn(x: float) -> Fraction:
        v = Fraction(x)
        if lo is not None:
            v = max(v, lo)
        if hi is not None:
            v = min(v, hi)
        return v
    return fn


@functools.lru_cache(maxsize=256)
def _hard_sigmoid_lut(alpha: float, beta: float, s_in: float, zp_in: int, s_out: float, zp_out: int):
    fn = _hard_sigmoid_fn(Fraction(alpha), Fraction(beta))
    return _readonly(make_lut(fn, in_scale=s_in, in_zp=zp_in, out_scale=s_out, out_zp=zp_out))


@functools.lru_cache(maxsize=256)
def _clip_lut(lo, hi, s_in: float, zp_in: int, s_out: float, zp_out: int):
    fn = _clip_fn(None if lo is None else Fraction(lo), None if hi is None else Fraction(hi))
    return _readonly(make_lut(fn, in_scale=s_in, in_zp=zp_in, out_scale=s_out, out_zp=zp_out))


def _elementwise_exact_ref(op, x, fn, in_scale, in_zp, out_scale, out_zp) -> np.ndarray:
    """Per element: clamp(zp_out + round_half_away(fn(s_in (x - zp_in)) / s_out)), exact."""
    x = _codes(op, x)
    s_in = Fraction(_scale(op, "in_scale", in_scale))
    s_out = Fraction(_scale(op, "out_scale", out_scale))
    zp_in, zp_out = _zp(op, "in_zp", in_zp), _zp(op, "out_zp", out_zp)
    out = [_quantize_exact(fn(float(s_in * (int(c) - zp_in))), s_out, zp_out) for c in x.ravel()]
    return np.array(out, dtype=np.uint8).reshape(x.shape)


def hard_sigmoid_ref(x, *, alpha: float, beta: float, in_scale: float, in_zp: int,
                     out_scale: float, out_zp: int) -> np.ndarray:
    """Reference HardSigmoid: ``y = max(0, min(1, alpha x + beta))`` (ONNX), exact per element.

    alpha and beta are taken as float32 (ONNX attributes); see :func:`make_lut` for the rule.
    """
    fn = _hard_sigmoid_fn(_f32_fraction("HardSigmoid", "alpha", alpha),
                          _f32_fraction("HardSigmoid", "beta", beta))
    return _elementwise_exact_ref("HardSigmoid", x, fn, in_scale, in_zp, out_scale, out_zp)


def hard_sigmoid(x, *, alpha: float, beta: float, in_scale: float, in_zp: int, out_scale: float,
                 out_zp: int) -> np.ndarray:
    """uint8 HardSigmoid as the exact table of :func:`make_lut`; bit-exact with the ref."""
    x = _codes("HardSigmoid", x)
    lut = _hard_sigmoid_lut(float(_f32_fraction("HardSigmoid", "alpha", alpha)),
                            float(_f32_fraction("HardSigmoid", "beta", beta)),
                            _scale("HardSigmoid", "in_scale", in_scale), _zp("HardSigmoid", "in_zp", in_zp),
                            _scale("HardSigmoid", "out_scale", out_scale), _zp("HardSigmoid", "out_zp", out_zp))
    return lut[x]


def clip_ref(x, *, lo: float | None, hi: float | None, in_scale: float, in_zp: int,
             out_scale: float, out_zp: int) -> np.ndarray:
    """Reference Clip: ``y = min(max(x, lo), hi)`` (ONNX order: lo > hi gives hi), exact per element.

    lo/hi are float32 values; None or +-inf leaves that side open.
    """
    fn = _clip_fn(_bound("Clip", "lo", lo), _bound("Clip", "hi", hi))
    return _elementwise_exact_ref("Clip", x, fn, in_scale, in_zp, out_scale, out_zp)


def clip(x, *, lo: float | None, hi: float | None, in_scale: float, in_zp: int, out_scale: float,
         out_zp: int) -> np.ndarray:
    """uint8 Clip as the exact table of :func:`make_lut`; bit-exact with :func:`clip_ref`.

    With equal input and output quantization this is a clamp of the codes to
    :func:`clip_code_bounds` (proved in the semantics notes, checked by the tests).
    """
    x = _codes("Clip", x)
    lo_q, hi_q = _bound("Clip", "lo", lo), _bound("Clip", "hi", hi)
    lut = _clip_lut(None if lo_q is None else float(lo_q), None if hi_q is None else float(hi_q),
                    _scale("Clip", "in_scale", in_scale), _zp("Clip", "in_zp", in_zp),
                    _scale("Clip", "out_scale", out_scale), _zp("Clip", "out_zp", out_zp))
    return lut[x]


def clip_code_bounds(*, lo: float | None, hi: float | None, scale: float, zp: int) -> tuple[int, int]:
    """Contract: (qlo, qhi) = (zp + R(lo / s), zp + R(hi / s)), each clamped to [0, 255].

    R rounds the exact quotient half away from zero; an open side gives 0 / 255. When
    in_scale == out_scale and in_zp == out_zp, ``clip(x) == min(max(x, qlo), qhi)``.
    """
    s = Fraction(_scale("Clip", "scale", scale))
    z = _zp("Clip", "zp", zp)
    lo_q, hi_q = _bound("Clip", "lo", lo), _bound("Clip", "hi", hi)
    qlo = 0 if lo_q is None else _clamp_u8(z + _round_half_away_exact(lo_q / s))
    qhi = 255 if hi_q is None else _clamp_u8(z + _round_half_away_exact(hi_q / s))
    return qlo, qhi
