"""gemmlowp / TFLite fixed-point primitives, exact, on Python ints and numpy arrays.

Every function here accepts either Python ints (or floats where noted) or numpy
arrays, elementwise. Integer arguments are values of int32 range carried in
Python ints or ``np.int64`` arrays; the int64 carrier is wide enough that no
intermediate below overflows (each function argues its bound). A Python scalar
in gives a Python scalar out; an array in gives an ``np.int64`` array out.

Upstream sources transcribed (cited per function):
- gemmlowp ``fixedpoint/fixedpoint.h``: SaturatingRoundingDoublingHighMul,
  RoundingDivideByPOT, SaturatingRoundingMultiplyByPOT, FixedPoint ``operator*``,
  exp_on_negative_values, one_over_one_plus_x_for_x_in_0_1 (the uint8 Softmax), and their
  int16 instances with TFLite's ``SaturatingDoublingHighMul``/``SaturatingLeftShift``
  (reference/hard_swish.h, the uint8 HardSwish).
- TFLite ``tensorflow/lite/kernels/internal/common.h``:
  MultiplyByQuantizedMultiplier (the double-rounding build, i.e. without
  TFLITE_SINGLE_ROUNDING, as the ai-edge-litert 2.3.0 wheel is built).
- TFLite ``tensorflow/lite/kernels/internal/quantization_util.cc``:
  QuantizeMultiplier.
- MACE ``mace/core/quantize.h``: QuantizeMultiplier, GetOutputMultiplierAndShift.
- MACE ``mace/ops/arm/q8/quantization_util.cc``: GetBiasData (bias rescale).
"""
from __future__ import annotations

import math

import numpy as np

from maceq.errors import MaceqError

INT32_MIN = -(1 << 31)
INT32_MAX = (1 << 31) - 1

__all__ = [
    "INT32_MIN",
    "INT32_MAX",
    "round_half_away",
    "wrap_int32",
    "quantize_multiplier",
    "mace_output_multiplier",
    "mace_float_multiplier",
    "mace_bias_needs_rescale",
    "mace_rescale_bias",
    "saturating_rounding_doubling_high_mul",
    "rounding_divide_by_pot",
    "multiply_by_quantized_multiplier",
    "requant_floor_terms",
    "saturating_rounding_multiply_by_pot",
    "fixed_point_mul",
    "exp_on_interval_between_negative_one_quarter_and_0_excl",
    "exp_on_negative_values",
    "one_over_one_plus_x_for_x_in_0_1",
    "count_leading_zeros32",
    "wrap_int16",
    "c_div_trunc",
    "srdhm16",
    "sdhm16",
    "rdbp16",
    "sat_lshift16",
]


def _as_i64(x):
    """(array, was_scalar): ``x`` as an np.int64 array, remembering if it was a scalar."""
    scalar = np.ndim(x) == 0 and not isinstance(x, np.ndarray)
    return np.asarray(x, dtype=np.int64), scalar


def _out(a: np.ndarray, scalar: bool):
    return int(a) if scalar else a


def round_half_away(x):
    """Contract: the nearest integer to float ``x``, ties away from zero, exact; -> int / np.int64.

    This is C's ``round``/``roundf``/``roundl`` and TFLite's ``TfLiteRound``.
    ``np.round`` rounds ties to even and must not be used for these kernels.
    Exactness: ``t = trunc(x)`` and ``f = x - t`` are both exact in the input's
    own float format (the fraction of a float is a float of the same format),
    so the tie test ``|f| >= 0.5`` is exact; float32 input is handled in float32.
    """
    if isinstance(x, (int, np.integer)):
        return int(x)
    scalar = np.ndim(x) == 0 and not isinstance(x, np.ndarray)
    a = np.asarray(x)
    if not np.issubdtype(a.dtype, np.floating):
        a = a.astype(np.float64)
    if not np.all(np.isfinite(a)):
        raise MaceqError("round_half_away: non-finite value")
    t = np.trunc(a)
    f = a - t  # exact: |f| < 1 and shares the ulp grid of a
    step = (np.abs(f) >= 0.5).astype(np.int64) * np.where(a < 0, -1, 1)
    r = t.astype(np.int64) + step
    return int(r) if scalar else r


def wrap_int32(x):
    """Contract: ``x`` reduced to int32 two's complement (x mod 2^32 in [-2^31, 2^31)); int64 in.

    Models what 32-bit hardware does on overflow of an int32 sum/product or a
    left shift (C leaves signed overflow undefined; every compiler/ISA MACE and
    TFLite run on wraps).
    """
    a, scalar = _as_i64(x)
    r = ((a - INT32_MIN) & 0xFFFFFFFF) + INT32_MIN
    return _out(r, scalar)


def quantize_multiplier(real_multiplier: float) -> tuple[int, int]:
    """Contract: (q, shift) with real ~= q * 2^(shift - 31), q in [2^30, 2^31) or (0, 0).

    TFLite ``QuantizeMultiplier`` (quantization_util.cc), computed in double:
    ``m, e = frexp(real)``; ``q = round_half_away(m * 2^31)`` (exact: m*2^31 is a
    double with the same significand); if ``q == 2^31`` then q /= 2, e += 1;
    if ``e < -31`` the result is (0, 0) (flush to zero). ``shift > 0`` means a
    left shift. MACE's QuantizeMultiplier (quantize.h) is the same except it has
    no flush; for e < -31 MACE's right shift of >= 32 also gives 0, so (0, 0) is
    equivalent there too. Negative multipliers keep their sign in q.
    """
    d = float(real_multiplier)
    if d == 0.0:
        return 0, 0
    if not math.isfinite(d):
        raise MaceqError(f"quantize_multiplier: non-finite multiplier {d!r}")
    m, e = math.frexp(d)
    q = round_half_away(m * (1 << 31))
    if abs(q) == (1 << 31):
        q //= 2
        e += 1
    if e < -31:
        return 0, 0
    return int(q), int(e)


def mace_float_multiplier(s_in, s_w, s_out) -> np.float32:
    """Contract: float32(float32(s_in * s_w) / s_out), every op rounded in float32.

    The expression ``lhs_scale * rhs_scale / output_scale`` on floats, as in
    MACE ``GetOutputMultiplierAndShift`` (mace/core/quantize.h), q8 ``Gemv``
    (mace/ops/arm/q8/gemv.cc) and ``DepthwiseConv2dGeneral``
    (mace/ops/depthwise_conv2d.cc). Scales are taken as float32 (the values
    stored in the model). Multiplication commutes exactly in IEEE arithmetic,
    so the operand order of s_in and s_w does not matter.
    """
    a, b, c = np.float32(s_in), np.float32(s_w), np.float32(s_out)
    if c == 0:
        raise MaceqError("mace_float_multiplier: output scale is zero")
    with np.errstate(over="ignore", under="ignore"):
        return np.float32(np.float32(a * b) / c)


def mace_output_multiplier(s_in, s_w, s_out) -> tuple[int, int]:
    """Contract: MACE GetOutputMultiplierAndShift as (q, shift), TFLite convention, shift <= 0.

    mace/core/quantize.h: ``float real = lhs_scale * rhs_scale / output_scale``
    (float32), ``MACE_CHECK(real > 0 && real < 1)``, then QuantizeMultiplier on
    the float32 value widened to double. MACE returns ``right_shift = -exponent``;
    here ``shift = exponent`` (<= 0) so it plugs into
    :func:`multiply_by_quantized_multiplier` like TFLite's.
    Raises MaceqError when the float32 multiplier is not in (0, 1): MACE's runtime aborts there
    (``MACE_CHECK(real_multiplier > 0.f && real_multiplier < 1.f)``; docs/edge-cases.md). A zero
    input scale (constant-zero input, find_range_every_time) gives 0; an output range much narrower
    than the input range times the weight range gives a multiplier >= 1.
    """
    real = mace_float_multiplier(s_in, s_w, s_out)
    if not (real > 0 and real < 1):
        raise MaceqError(
            f"MACE requires 0 < s_in*s_w/s_out < 1 (mace/core/quantize.h; the device aborts), got {float(real)!r} "
            f"from s_in={float(np.float32(s_in))!r}, s_w={float(np.float32(s_w))!r}, "
            f"s_out={float(np.float32(s_out))!r}")
    q, shift = quantize_multiplier(float(real))
    assert shift <= 0
    return q, shift


def mace_bias_needs_rescale(s_in, s_w, s_bias) -> bool:
    """Contract: MACE's test ``fabs(s_in * s_w - s_bias) > 1e-6``, float32 ops, double compare.

    mace/ops/arm/q8/quantization_util.cc (GetBiasData): the product and the
    difference are float32 operations; the comparison is against the double
    literal 1e-6 (the float difference widens to double exactly).
    """
    prod = np.float32(np.float32(s_in) * np.float32(s_w))
    diff = np.float32(prod - np.float32(s_bias))
    return abs(float(diff)) > 1e-6


def mace_rescale_bias(bias, s_in, s_w, s_bias) -> np.ndarray:
    """Contract: the int32 bias MACE's uint8 Conv2D/DepthwiseConv2d actually add; int32 array out.

    mace/ops/arm/q8/quantization_util.cc (GetBiasData): when
    :func:`mace_bias_needs_rescale`, each entry becomes
    ``int32(roundf(float(bias[i]) * adjust))`` with
    ``adjust = float32(s_bias / float32(s_in * s_w))``: the int32 -> float
    conversion rounds to nearest-even (|bias| > 2^24 loses bits), the product is
    float32, roundf is half away from zero. Otherwise the bias is returned
    unchanged. ``bias=None`` is not accepted here (MACE then uses zeros; the
    caller passes ``None`` to the kernel instead).
    """
    b = np.asarray(bias)
    if not np.issubdtype(b.dtype, np.integer):
        raise MaceqError(f"mace_rescale_bias: bias must be integer, got {b.dtype}")
    b = b.astype(np.int64)
    if b.size and (b.min() < INT32_MIN or b.max() > INT32_MAX):
        raise MaceqError("mace_rescale_bias: bias outside int32")
    if not mace_bias_needs_rescale(s_in, s_w, s_bias):
        return b.astype(np.int32)
    prod = np.float32(np.float32(s_in) * np.float32(s_w))
    if prod == 0:
        # MACE computes adjust = s_bias / 0 = inf and casts roundf(bias * inf) to int32 (undefined
        # behaviour), then aborts in GetOutputMultiplierAndShift (real_multiplier = 0): no defined
        # result to model. The usual cause: an input Quantize op with find_range_every_time saw a
        # constant-zero input, so its scale is 0 (runtime/kernels/quantize.py, docs/edge-cases.md).
        raise MaceqError(
            f"MACE cannot run this uint8 op: input scale x weight scale is 0 (s_in={float(np.float32(s_in))!r}, "
            f"s_w={float(np.float32(s_w))!r}; a constant-zero input gives the input Quantize op scale 0): "
            f"GetBiasData divides by it and GetOutputMultiplierAndShift aborts on MACE_CHECK(0 < multiplier < 1) "
            f"(mace/ops/arm/q8/quantization_util.cc, mace/core/quantize.h)")
    adjust = np.float32(np.float32(s_bias) / prod)
    v = b.astype(np.float32) * adjust  # float32 * float32 -> float32
    r = round_half_away(v)
    r = np.asarray(r, dtype=np.int64)
    if r.size and (r.min() < INT32_MIN or r.max() > INT32_MAX):
        raise MaceqError("mace_rescale_bias: rescaled bias outside int32")
    return r.astype(np.int32)


def saturating_rounding_doubling_high_mul(a, b):
    """Contract: floor(a*b / 2^31 + 1/2) for int32 a, b; INT32_MIN*INT32_MIN -> INT32_MAX.

    gemmlowp fixedpoint.h ``SaturatingRoundingDoublingHighMul`` (= ARM VQRDMULH):
    ``ab = a*b`` in int64, ``nudge = ab >= 0 ? 2^30 : 1 - 2^30``, then
    ``(ab + nudge) / 2^31`` with C's truncating division; saturate the one
    overflow case. Computed here as ``(ab + 2^30) >> 31`` (an arithmetic,
    flooring shift), which is the same number: write ab = k*2^31 + r with
    0 <= r < 2^31; both forms give k + [r >= 2^30] (for ab < 0 the truncation
    is a ceiling of (r + 1 - 2^30) / 2^31 in (-1/2, 1/2]). Ties therefore go
    toward +inf. Bounds: |ab| <= 2^62, so ab + 2^30 fits int64; the only
    result above INT32_MAX is 2^31, from INT32_MIN*INT32_MIN, which the
    final minimum saturates (INT32_MIN*(INT32_MIN+1) gives exactly INT32_MAX).
    """
    aa, sa = _as_i64(a)
    bb, sb = _as_i64(b)
    r = np.asarray(aa * bb, dtype=np.int64)
    r += 1 << 30
    r >>= 31
    np.minimum(r, INT32_MAX, out=r)
    return _out(r, sa and sb)


def rounding_divide_by_pot(x, exponent):
    """Contract: x / 2^exponent rounded to nearest, ties away from zero; 0 <= exponent <= 31.

    gemmlowp fixedpoint.h ``RoundingDivideByPOT``: ``mask = 2^e - 1``,
    ``remainder = x & mask``, ``threshold = (mask >> 1) + (x < 0)``, result
    ``(x >> e) + (remainder > threshold)`` with an arithmetic shift. Exponent 0
    returns x. ``exponent`` may be an array (per-channel) broadcast against x.
    """
    xx, sx = _as_i64(x)
    ee, se = _as_i64(exponent)
    if np.any(ee < 0) or np.any(ee > 31):
        raise MaceqError(f"rounding_divide_by_pot: exponent out of [0, 31]: {exponent!r}")
    mask = (np.int64(1) << ee) - 1
    remainder = xx & mask
    threshold = (mask >> 1) + (xx < 0)  # bool adds as 0/1
    r = (xx >> ee) + (remainder > threshold)
    return _out(r, sx and se)


def multiply_by_quantized_multiplier(x, quantized_multiplier, shift):
    """Contract: TFLite MultiplyByQuantizedMultiplier (double rounding); int32 x, q, shift in.

    tensorflow/lite/kernels/internal/common.h (non-TFLITE_SINGLE_ROUNDING):
    ``left = max(shift, 0)``, ``right = max(-shift, 0)``;
    ``RoundingDivideByPOT(SaturatingRoundingDoublingHighMul(x * 2^left, q), right)``.
    ``x * 2^left`` is an int32 product: it wraps (see :func:`wrap_int32`), it
    does not saturate. With shift <= 0 (every MACE multiplier) this is also
    gemmlowp's OutputStageQuantizeDownInt32ByFixedPoint. q and shift may be
    per-channel arrays broadcast against x.
    """
    xx, sx = _as_i64(x)
    qq, sq = _as_i64(quantized_multiplier)
    ss, ssh = _as_i64(shift)
    left = np.maximum(ss, 0)
    right = np.maximum(-ss, 0)
    if np.any(left > 31):
        raise MaceqError(f"multiply_by_quantized_multiplier: left shift > 31: {shift!r}")
    if np.any(left > 0):
        xx = wrap_int32(xx << left)  # |x| < 2^31, left <= 31: < 2^62, fits int64
    r = rounding_divide_by_pot(saturating_rounding_doubling_high_mul(xx, qq), right)
    return _out(np.asarray(r, dtype=np.int64), sx and sq and ssh)


def requant_floor_terms(quantized_multiplier: int, shift: int, out_zp: int = 0) -> tuple[int, int, int | None]:
    """Contract: (k, c0, theta) with, for every int32 ``x``,
    ``MultiplyByQuantizedMultiplier(x, q, shift) + out_zp == floor((x*q + c0 - 2^31*[x < theta]) / 2^k)``
    (``[x < theta]`` is 0 when theta is None). Python ints in and out. Requires 0 <= q <= INT32_MAX and
    -31 <= shift <= 0 (every MACE multiplier); raises MaceqError otherwise.

    It turns the double rounding of gemmlowp/TFLite into one floor of an affine function of x, which the
    fast kernels evaluate exactly in float64 (runtime/kernels/conv.py). Derivation, with e = -shift:

    - SRDHM(x, q) = s = floor((x*q + 2^30) / 2^31) (contract of
      :func:`saturating_rounding_doubling_high_mul`; its one saturating case needs q = INT32_MIN).
    - e = 0: RoundingDivideByPOT is the identity, so the result is floor((x*q + 2^30 + zp*2^31) / 2^31):
      k = 31, c0 = 2^30 + zp*2^31, theta None.
    - e >= 1: gemmlowp RoundingDivideByPOT(s, e) = (s >> e) + (rem > (2^(e-1) - 1) + n) with
      rem = s mod 2^e and n = [s < 0]. Writing h = 2^(e-1), ``rem > h - 1 + n`` is
      ``rem + h - n >= 2^e`` and 0 <= rem + h - n < 2^(e+1), so the result is floor((s + h - n) / 2^e).
      Since floor((floor(a / 2^31) + m) / 2^e) == floor((a + m*2^31) / 2^(31+e)) for integers a, m
      (nested floors with integer offsets and positive integer divisors), the result plus zp is
      floor((x*q + 2^30 + h*2^31 - n*2^31 + zp*2^k) / 2^k) with k = 31 + e.
    - n = [x*q + 2^30 < 0]. For q > 0 and integer x: x*q < -2^30 <=> x < -2^30/q <=> x < ceil(-2^30/q)
      = -floor(2^30/q) = theta (0 for q > 2^30, -1 for q = 2^30). For q = 0, s = 0 and n = 0 (theta None).
    Hence c0 = 2^30 + h*2^31 + zp*2^k. The test tests/test_fast_paths.py checks the identity against
    :func:`multiply_by_quantized_multiplier` on int32 edges, exact ties and random values.
    """
    q, e, zp = int(quantized_multiplier), -int(shift), int(out_zp)
    if not (0 <= q <= INT32_MAX) or not (0 <= e <= 31):
        raise MaceqError(f"requant_floor_terms: needs 0 <= q <= INT32_MAX and -31 <= shift <= 0, got {q}, {shift}")
    k = 31 + e
    if e == 0:
        return k, (1 << 30) + zp * (1 << 31), None
    c0 = (1 << 30) + (1 << (e - 1)) * (1 << 31) + zp * (1 << k)
    theta = None if q == 0 else -((1 << 30) // q)
    return k, c0, theta


# ----------------------------------------------------------------------------------------------
# gemmlowp fixed-point functions on int32 raw values (np.int64 carriers; Python ints work too)
# ----------------------------------------------------------------------------------------------

def saturating_rounding_multiply_by_pot(x, exponent: int):
    """Contract: gemmlowp ``SaturatingRoundingMultiplyByPOT<exponent>``: x * 2^exponent.

    exponent > 0: left shift saturating to int32 (|x| > 2^(31-e) - 1 saturates);
    exponent < 0: RoundingDivideByPOT(x, -exponent); 0: x.
    """
    x = np.asarray(x, dtype=np.int64)
    if exponent == 0:
        return x
    if exponent < 0:
        return np.asarray(rounding_divide_by_pot(x, -exponent), dtype=np.int64)
    threshold = (1 << (31 - exponent)) - 1
    return np.where(x > threshold, INT32_MAX, np.where(x < -threshold, INT32_MIN, x << exponent))


def fixed_point_mul(a, b):
    """Contract: gemmlowp FixedPoint ``operator*`` = SaturatingRoundingDoublingHighMul on the raw values."""
    return np.asarray(saturating_rounding_doubling_high_mul(np.asarray(a, dtype=np.int64),
                                                            np.asarray(b, dtype=np.int64)), dtype=np.int64)


def exp_on_interval_between_negative_one_quarter_and_0_excl(a):
    """Contract: gemmlowp ``exp_on_interval_between_negative_one_quarter_and_0_excl``: exp(a) for a in
    [-1/4, 0), a and result in Q0.31.

    Taylor expansion around -1/8: with x = a + 1/8,
    exp(a) = e^(-1/8) * (1 + x + x^2/2 + x^3/6 + x^4/24). Every operand is in (-1, 1) of
    Q0.31, so products and the sums below stay inside int32 (gemmlowp's design).
    """
    a = np.asarray(a, dtype=np.int64)
    constant_term = 1895147668      # exp(-1/8) in Q0.31
    constant_1_over_3 = 715827883   # 1/3 in Q0.31
    x = a + (1 << 28)               # + 1/8
    x2 = fixed_point_mul(x, x)
    x3 = fixed_point_mul(x2, x)
    x4 = fixed_point_mul(x2, x2)
    x4_over_4 = saturating_rounding_multiply_by_pot(x4, -2)
    poly = saturating_rounding_multiply_by_pot(fixed_point_mul(x4_over_4 + x3, constant_1_over_3) + x2, -1)
    return constant_term + fixed_point_mul(constant_term, x + poly)


# (exponent, multiplier) of GEMMLOWP_EXP_BARREL_SHIFTER: exp(-2^exponent) in Q0.31.
_EXP_BARREL = ((-2, 1672461947), (-1, 1302514674), (0, 790015084), (1, 290630308),
               (2, 39332535), (3, 720401), (4, 242))


def exp_on_negative_values(a, int_bits: int):
    """Contract: gemmlowp ``exp_on_negative_values``: exp(a) for a <= 0 in Q(int_bits), result in Q0.31.

    a = (a mod 1/4) - 1/4 - k/4: the first part goes through the Taylor step above, then
    exp(-2^j) factors are multiplied in for each set bit of the remainder; inputs below -32
    give 0 when int_bits > 5; a == 0 gives the Q0.31 maximum (One()).
    """
    a = np.asarray(a, dtype=np.int64)
    frac_bits = 31 - int_bits
    one_quarter = 1 << (frac_bits - 2)
    a_mod_quarter_minus_one_quarter = (a & (one_quarter - 1)) - one_quarter
    result = exp_on_interval_between_negative_one_quarter_and_0_excl(
        saturating_rounding_multiply_by_pot(a_mod_quarter_minus_one_quarter, int_bits))  # Rescale<0>
    remainder = a_mod_quarter_minus_one_quarter - a
    for exponent, multiplier in _EXP_BARREL:
        if int_bits > exponent:
            bit = 1 << (frac_bits + exponent)
            result = np.where((remainder & bit) != 0, fixed_point_mul(result, multiplier), result)
    if int_bits > 5:
        clamp = -(1 << (36 - int_bits))  # -32.0
        result = np.where(a < clamp, 0, result)
    return np.where(a == 0, INT32_MAX, result)


def one_over_one_plus_x_for_x_in_0_1(a):
    """Contract: gemmlowp ``one_over_one_plus_x_for_x_in_0_1``: 1 / (1 + a) for a in [0, 1) of Q0.31,
    result in Q0.31 (Newton-Raphson, 3 steps).

    half_denominator = RoundingHalfSum(a, One) is (1 + a) / 2 in Q0.31; x starts at
    48/17 - 32/17 * half_denominator in Q2.29; each step x += x * (1 - d * x) (Q4 product
    rescaled to Q2 by a saturating left shift of 2); the result x / 2 is rescaled to Q0.31
    by a saturating left shift of 1.
    """
    a = np.asarray(a, dtype=np.int64)
    s = a + INT32_MAX                           # int64 sum in RoundingHalfSum
    half_denominator = np.where(s >= 0, (s + 1) // 2, -((-(s - 1)) // 2))  # (s + sign) / 2, truncating
    constant_48_over_17 = 1515870810            # Q2.29
    constant_neg_32_over_17 = -1010580540       # Q2.29
    x = constant_48_over_17 + fixed_point_mul(half_denominator, constant_neg_32_over_17)
    one_q2 = 1 << 29
    for _ in range(3):
        half_denominator_times_x = fixed_point_mul(half_denominator, x)
        one_minus_half_denominator_times_x = one_q2 - half_denominator_times_x
        x = x + saturating_rounding_multiply_by_pot(fixed_point_mul(x, one_minus_half_denominator_times_x), 2)
    return saturating_rounding_multiply_by_pot(x, 1)


def count_leading_zeros32(v: np.ndarray) -> np.ndarray:
    """Contract: the leading zeros of positive int32 values (frexp is exact for integers below 2^53)."""
    _, e = np.frexp(v.astype(np.float64))
    return 32 - e.astype(np.int64)


# ----------------------------------------------------------------------------------------------
# int16 gemmlowp primitives for HARD_SWISH (scalar Python ints, and vectorised int64 arrays)
# ----------------------------------------------------------------------------------------------
# Each scalar function takes and returns Python ints holding int16 values; the C arithmetic is
# done in int (promotion) and converted back to int16, which wraps (wrap_int16). The "_v" twins
# compute the same on np.int64 arrays; the test checks them equal on every code.

def wrap_int16(v):
    """Contract: conversion to int16, v mod 2^16 into [-2^15, 2^15) (Python int or int64 array)."""
    return ((v + 0x8000) & 0xFFFF) - 0x8000


def c_div_trunc(n: int, d: int) -> int:
    """Contract: C's ``n / d`` for d > 0, the quotient truncated toward zero."""
    q = abs(n) // d
    return q if n >= 0 else -q


def srdhm16(a: int, b: int) -> int:
    """Contract: gemmlowp ``SaturatingRoundingDoublingHighMul(int16, int16)`` (fixedpoint.h)."""
    if a == b == -32768:
        return 32767
    ab = a * b                                    # |ab| <= 2^30: exact in int32
    nudge = (1 << 14) if ab >= 0 else 1 - (1 << 14)
    return wrap_int16(c_div_trunc(ab + nudge, 1 << 15))


def sdhm16(a: int, b: int) -> int:
    """Contract: TFLite ``SaturatingDoublingHighMul(int16, int16)`` (hard_swish.h): truncating, no nudge."""
    if a == b == -32768:
        return 32767
    return wrap_int16(c_div_trunc(a * b, 1 << 15))


def rdbp16(x: int, exponent: int) -> int:
    """Contract: gemmlowp ``RoundingDivideByPOT<int16_t>`` as compiled, including exponents >= 16.

    ``mask = Dup<int16_t>((1ll << exponent) - 1)`` converts to int16, so for exponent >= 16 the
    mask is -1 (the result is then 1 for x >= 0 and -1 for x < 0); below 16 it is the usual
    round-to-nearest, ties away from zero.
    """
    mask = wrap_int16((1 << exponent) - 1)
    remainder = x & mask
    threshold = wrap_int16((mask >> 1) + (1 if x < 0 else 0))
    return wrap_int16((x >> exponent) + (1 if remainder > threshold else 0))


def sat_lshift16(v: int, amount: int) -> int:
    """Contract: TFLite ``SaturatingLeftShift(int16, amount)`` (hard_swish.h): int64 product, clamp to int16."""
    return max(-32768, min(32767, v * (1 << amount)))


def c_div_trunc_v(n: np.ndarray, d: int) -> np.ndarray:
    """Contract: :func:`c_div_trunc` on np.int64 arrays."""
    return np.where(n >= 0, n // d, -((-n) // d))


def srdhm16_v(a: np.ndarray, b: int) -> np.ndarray:
    """Contract: :func:`srdhm16` on np.int64 arrays."""
    ab = a * b
    nudge = np.where(ab >= 0, 1 << 14, 1 - (1 << 14))
    r = wrap_int16(c_div_trunc_v(ab + nudge, 1 << 15))
    return np.where((a == -32768) & (b == -32768), 32767, r)


def sdhm16_v(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Contract: :func:`sdhm16` on np.int64 arrays."""
    r = wrap_int16(c_div_trunc_v(a * b, 1 << 15))
    return np.where((a == -32768) & (b == -32768), 32767, r)


def rdbp16_v(x: np.ndarray, exponent: int) -> np.ndarray:
    """Contract: :func:`rdbp16` on np.int64 arrays."""
    mask = wrap_int16((1 << exponent) - 1)
    remainder = x & mask
    threshold = wrap_int16((mask >> 1) + (x < 0))
    return wrap_int16((x >> exponent) + (remainder > threshold))


def sat_lshift16_v(v: np.ndarray, amount: int) -> np.ndarray:
    """Contract: :func:`sat_lshift16` on np.int64 arrays."""
    return np.clip(v * (1 << amount), -32768, 32767)
