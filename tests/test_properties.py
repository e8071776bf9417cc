"""Property tests (hypothesis) of the fixed-point and requantization primitives.

Every property compares maceq's implementation -- the scalar path and, where one exists, the
vectorised numpy path -- with a slow reference written here in Python ints and
``fractions.Fraction``. The references are taken from the upstream definitions, not from
maceq's code:

- gemmlowp ``fixedpoint/fixedpoint.h``: SaturatingRoundingDoublingHighMul (``(ab + nudge) /
  2^31`` with C's truncating division, ``nudge = ab >= 0 ? 2^30 : 1 - 2^30``, saturating only
  INT32_MIN * INT32_MIN) and RoundingDivideByPOT (mask / threshold form).
- TFLite ``kernels/internal/quantization_util.cc`` QuantizeMultiplier (frexp, TfLiteRound of
  ``q * 2^31``, halve when it reaches 2^31, flush to (0, 0) below shift -31) and
  ``kernels/internal/common.h`` MultiplyByQuantizedMultiplier (double rounding, int32 left shift).
- OpenCL C ``convert_float_rte``, IEEE binary32 ``*`` and ``+`` and ``convert_uchar_sat_rte``
  for the gpu requantization (docs/semantics.md, "gpu device"); each binary32 step is modelled
  as the exact rational result rounded once to nearest-even binary32 (``rne_f32`` below).
- XiaoMi/nnlib ``hexagon/src/dwconv2dbbb_c.c`` (d32 requantization: ``sum <<= recip_shift;
  lsum = ((int64)sum*recip + 0x40000000) >> 31``, min/max of ``(int)lsum``, clamp to [0, 255]),
  ``op_fully_connected.c`` ``superfc_execute_ref`` (``((int64)(sum + outadd)*scalef31 +
  (1u << 30)) >> 31``, ``saturate_u8``) and ``hexagon/include/quantize.h`` (``roundf_i32``,
  ``fast_roundf`` = ``convert_sf2w`` nearest-even saturating, ``(int)f`` = truncating
  saturating, ``saturate_u8``), plus ``quantize_execute_ref`` for nnlib Quantize.

Explicit ``@example`` cases pin the boundary values (int32 edges, exact ties of both signs,
exponents 0 and 31, the 2^31 renormalisation, the flush to zero, float32 subnormals and
float32 max, float32-only ties) so they run on every invocation, not only when hypothesis
happens to draw them.
"""
from __future__ import annotations

import math
import struct
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from maceq.errors import MaceqError
from maceq.runtime import fixedpoint as fp
from maceq.runtime.kernels import dsp
from maceq.runtime.kernels import gpu
from maceq.runtime.kernels import nnlib_ref as nr

INT32_MIN = -(1 << 31)
INT32_MAX = (1 << 31) - 1
F32_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]
F32_MIN_SUB = struct.unpack("<f", struct.pack("<I", 1))[0]         # 2^-149
F32_MIN_NORMAL = struct.unpack("<f", struct.pack("<I", 0x00800000))[0]  # 2^-126

FAST = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MEDIUM = settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

int32s = st.integers(INT32_MIN, INT32_MAX)
f32s = st.floats(width=32, allow_nan=False, allow_infinity=False)


def f32_between(lo: float, hi: float):
    """float32 values in [f32(lo), f32(hi)] (hypothesis wants float32-exact bounds)."""
    return st.floats(float(np.float32(lo)), float(np.float32(hi)), width=32)


# ==============================================================================================
# Exact references (Python ints / Fractions only)
# ==============================================================================================

def wrap32(v: int) -> int:
    """v mod 2^32 into [-2^31, 2^31): what int32 hardware keeps."""
    return (v + (1 << 31)) % (1 << 32) - (1 << 31)


def c_div_trunc(n: int, d: int) -> int:
    """C's ``/`` on integers: the quotient truncated toward zero (d > 0)."""
    q = abs(n) // d
    return q if n >= 0 else -q


def ref_srdhm(a: int, b: int) -> int:
    """gemmlowp SaturatingRoundingDoublingHighMul, literally: overflow check, nudge, C division."""
    if a == b == INT32_MIN:
        return INT32_MAX
    ab = a * b
    nudge = (1 << 30) if ab >= 0 else 1 - (1 << 30)
    return c_div_trunc(ab + nudge, 1 << 31)


def ref_rdbpot(x: int, e: int) -> int:
    """x / 2^e rounded to nearest with ties away from zero (the value RoundingDivideByPOT computes)."""
    v = Fraction(x, 1 << e)
    s = -1 if v < 0 else 1
    return s * math.floor(abs(v) + Fraction(1, 2))


def ref_mbqm(x: int, q: int, shift: int) -> int:
    """TFLite MultiplyByQuantizedMultiplier without TFLITE_SINGLE_ROUNDING."""
    left, right = max(shift, 0), max(-shift, 0)
    return ref_rdbpot(ref_srdhm(wrap32(x * (1 << left)), q), right)


def frexp_exact(v: Fraction) -> tuple[Fraction, int]:
    """C frexp on an exact nonzero value: (m, e) with v = m * 2^e and 0.5 <= |m| < 1."""
    a = abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length()  # 2^(e-1) <= a < 2^(e+1)
    if a >= Fraction(2) ** e:
        e += 1
    m = v / Fraction(2) ** e
    assert Fraction(1, 2) <= abs(m) < 1
    return m, e


def round_half_away_exact(v: Fraction) -> int:
    """C ``round`` / TfLiteRound on an exact value."""
    s = -1 if v < 0 else 1
    return s * math.floor(abs(v) + Fraction(1, 2))


def round_half_even_exact(v: Fraction) -> int:
    """rint / convert_*_rte on an exact value: nearest, ties to even."""
    n = math.floor(v)
    r = v - n
    if r > Fraction(1, 2) or (r == Fraction(1, 2) and n % 2 == 1):
        n += 1
    return n


def ref_quantize_multiplier_tflite(d: float) -> tuple[int, int]:
    """TFLite QuantizeMultiplier (quantization_util.cc), exact: returns (q_fixed, shift).

    ``q = frexp(d, &shift)``; ``q_fixed = TfLiteRound(q * 2^31)``; ``if (q_fixed == 2^31) {q_fixed
    /= 2; ++shift;}``; ``if (shift < -31) {shift = 0; q_fixed = 0;}``. The renormalisation test is
    literally ``== 2^31``: a negative multiplier may produce q_fixed = -2^31 (INT32_MIN).
    """
    if d == 0.0:
        return 0, 0
    m, e = frexp_exact(Fraction(d))
    q = round_half_away_exact(m * (1 << 31))
    if q == (1 << 31):
        q //= 2
        e += 1
    if e < -31:
        return 0, 0
    return q, e


def rne_f32(v: Fraction) -> float:
    """The binary32 value nearest to the exact rational v (ties to even), as a Python float.

    Handles the subnormal range (a 2^-149 grid) and overflow (to +-inf, as IEEE round-to-nearest
    does once the value reaches 2^128 - 2^103, the midpoint between FLT_MAX and 2^128).
    """
    if v == 0:
        return 0.0
    sign = -1 if v < 0 else 1
    a = abs(v)
    _, e = frexp_exact(a)                 # 2^(e-1) <= a < 2^e
    ulp_exp = max(e - 24, -149)           # 24-bit significand; subnormals share 2^-149
    n = round_half_even_exact(a / Fraction(2) ** ulp_exp)
    r = Fraction(n) * Fraction(2) ** ulp_exp
    if r >= Fraction(2) ** 128:
        return sign * math.inf
    return sign * float(r)


def is_f32(x: float) -> bool:
    return math.isfinite(x) and rne_f32(Fraction(x)) == x


# ==============================================================================================
# round_half_away
# ==============================================================================================

@FAST
@given(st.one_of(f32s, st.floats(allow_nan=False, allow_infinity=False, min_value=-2.0 ** 62,
                                  max_value=2.0 ** 62)))
@example(0.5)
@example(-0.5)
@example(2.5)
@example(-2.5)
@example(0.49999999999999994)
@example(-0.49999999999999994)
@example(float(np.float32(0.49999997)))
@example(2.0 ** 52 + 1)
@example(-(2.0 ** 51) - 0.5)
def test_round_half_away_matches_c_round(x):
    """round_half_away == C round (ties away from zero) on float64 and float32 input, scalar and array."""
    want = round_half_away_exact(Fraction(x))
    if abs(want) >= 2 ** 63:
        return
    assert fp.round_half_away(x) == want
    if is_f32(x):
        arr = np.array([x, -x], dtype=np.float32)
        assert fp.round_half_away(arr).tolist() == [want, round_half_away_exact(Fraction(-x))]


def test_round_half_away_rejects_non_finite():
    for bad in (math.inf, -math.inf, math.nan):
        with pytest.raises(MaceqError):
            fp.round_half_away(bad)


# ==============================================================================================
# quantize_multiplier
# ==============================================================================================

def _check_quantize_multiplier(d: float):
    want_q, want_e = ref_quantize_multiplier_tflite(d)
    got_q, got_e = fp.quantize_multiplier(d)
    assert isinstance(got_q, int) and isinstance(got_e, int)
    if want_q == INT32_MIN:
        # Documented deviation (fixedpoint.quantize_multiplier: "|q| in [2^30, 2^31)"): maceq
        # renormalises -2^31 too, giving (-2^30, shift + 1). Same real value; keeps -q in int32.
        # Reachable only from a float64 multiplier: a float32 has 24 significant bits, so
        # |m * 2^31| <= 2^31 - 2^7 never rounds to 2^31.
        assert (got_q, got_e) == (-(1 << 30), want_e + 1)
    else:
        assert (got_q, got_e) == (want_q, want_e)
    # the contract's representation: q == 0 only as the flush, else 2^30 <= |q| < 2^31, and
    # q * 2^(shift-31) is d rounded to 31 significant bits (relative error <= 2^-31)
    if got_q == 0:
        assert got_e == 0
        assert abs(Fraction(d)) < Fraction(1, 1 << 32)
    else:
        assert (1 << 30) <= abs(got_q) < (1 << 31)
        approx = Fraction(got_q) * Fraction(2) ** (got_e - 31)
        assert abs(approx - Fraction(d)) <= abs(Fraction(d)) * Fraction(1, 1 << 31)
    # the same value as a numpy float32 / float64 scalar gives the same answer
    assert fp.quantize_multiplier(np.float64(d)) == (got_q, got_e)
    if is_f32(d):
        assert fp.quantize_multiplier(np.float32(d)) == (got_q, got_e)


@FAST
@given(f32s)
@example(1.0)
@example(0.5)
@example(-1.0)
@example(F32_MAX)                      # huge: shift 128
@example(-F32_MAX)
@example(F32_MIN_SUB)                  # subnormal: flushed
@example(F32_MIN_NORMAL)
@example(2.0 ** -31)                   # shift -30
@example(2.0 ** -32)                   # shift -31: the last one kept
@example(2.0 ** -33)                   # shift -32: flushed
@example(float(np.nextafter(np.float32(2.0 ** -32), np.float32(0))))  # just below 2^-32: flushed
@example(float(np.float32(1 - 2.0 ** -24)))  # largest float32 below 1
@example(0.0)
@example(-0.0)
def test_quantize_multiplier_float32_range(d):
    """QuantizeMultiplier over every float32 (normal, subnormal, huge, negative) == TFLite's, exactly."""
    _check_quantize_multiplier(d)


@FAST
@given(st.floats(allow_nan=False, allow_infinity=False))
@example(1 - 2.0 ** -53)                        # m*2^31 rounds to 2^31: halve, shift + 1 -> (2^30, 1)
@example(-(1 - 2.0 ** -53))                     # negative: upstream INT32_MIN, maceq (-2^30, 1)
@example((2 ** 31 - 0.5) / 2 ** 31)             # exact tie at the top: rounds away to 2^31
@example((2 ** 30 + 0.5) / 2 ** 31)             # exact tie: away from zero -> 2^30 + 1
@example(-(2 ** 30 + 0.5) / 2 ** 31)
@example(2.0 ** -32 * (1 - 2.0 ** -40))         # frexp shift -32, renormalised to -31: NOT flushed
@example(2.0 ** -33 * (1 - 2.0 ** -40))         # renormalised to -32: flushed
@example(5e-324)                                # float64 subnormal
@example(1.7976931348623157e308)                # float64 max: shift 1024
@example(2.0 ** 31 - 1)
@example(1e-12)
def test_quantize_multiplier_float64(d):
    """QuantizeMultiplier on any finite double, including the 2^31 renormalisation and the flush boundary."""
    _check_quantize_multiplier(d)


def test_quantize_multiplier_non_finite_raises():
    """Contract: a non-finite multiplier raises MaceqError (TFLite would CHECK-fail or return garbage)."""
    for bad in (math.inf, -math.inf, math.nan, np.float32("inf"), np.float32("nan")):
        with pytest.raises(MaceqError):
            fp.quantize_multiplier(bad)


# ==============================================================================================
# saturating_rounding_doubling_high_mul
# ==============================================================================================

@st.composite
def srdhm_ties(draw):
    """(a, b) with a*b = odd * 2^30 exactly: a*b / 2^31 is a half-integer (both signs)."""
    j = draw(st.integers(0, 30))
    b = draw(st.sampled_from([1, -1])) * (1 << j)
    odd = draw(st.integers(-(1 << j), (1 << j) - 1)) * 2 + 1       # a = odd * 2^(30-j) stays in int32
    return odd * (1 << (30 - j)), b


@FAST
@given(st.one_of(st.tuples(int32s, int32s), srdhm_ties()))
@example((INT32_MIN, INT32_MIN))       # the one overflow: saturates to INT32_MAX
@example((INT32_MIN, INT32_MIN + 1))   # exactly INT32_MAX, no saturation needed
@example((INT32_MIN, INT32_MAX))
@example((INT32_MAX, INT32_MAX))
@example((INT32_MIN, 1))
@example((1, 1 << 30))                 # +0.5 -> 1 (tie toward +inf)
@example((-1, 1 << 30))                # -0.5 -> 0 (tie toward +inf)
@example((3, 1 << 30))                 # 1.5 -> 2
@example((-3, 1 << 30))                # -1.5 -> -1
@example((0, INT32_MIN))
def test_srdhm_matches_gemmlowp(ab):
    """SRDHM == gemmlowp's nudge + truncating division; ties go toward +inf; INT32_MIN^2 saturates."""
    a, b = ab
    want = ref_srdhm(a, b)
    assert fp.saturating_rounding_doubling_high_mul(a, b) == want
    # the closed form of the docs: floor(a*b/2^31 + 1/2), except the saturation
    if not a == b == INT32_MIN:
        assert want == math.floor(Fraction(a * b, 1 << 31) + Fraction(1, 2))
    # vectorised: int64 arrays (and commutativity through the array path)
    arr = fp.saturating_rounding_doubling_high_mul(np.array([a, b], dtype=np.int64),
                                                  np.array([b, a], dtype=np.int64))
    assert arr.dtype == np.int64 and arr.tolist() == [want, want]


@MEDIUM
@given(st.lists(st.tuples(int32s, int32s), min_size=1, max_size=40))
def test_srdhm_vectorised_elementwise(pairs):
    """The array path equals the reference element by element (mixed signs, edges, broadcasting a scalar)."""
    a = np.array([p[0] for p in pairs], dtype=np.int64)
    b = np.array([p[1] for p in pairs], dtype=np.int64)
    got = fp.saturating_rounding_doubling_high_mul(a, b)
    assert got.tolist() == [ref_srdhm(x, y) for x, y in pairs]
    got_s = fp.saturating_rounding_doubling_high_mul(a, pairs[0][1])
    assert got_s.tolist() == [ref_srdhm(x, pairs[0][1]) for x in a.tolist()]


# ==============================================================================================
# rounding_divide_by_pot
# ==============================================================================================

def ref_rdbpot_gemmlowp(x: int, e: int) -> int:
    """gemmlowp RoundingDivideByPOT in int32 terms: mask, remainder, threshold, arithmetic shift."""
    mask = (1 << e) - 1
    remainder = x & mask
    threshold = (mask >> 1) + (1 if x < 0 else 0)
    return (x >> e) + (1 if remainder > threshold else 0)


@st.composite
def rdbpot_ties(draw):
    """(x, e) with x / 2^e exactly a half-integer, both signs, inside int32."""
    e = draw(st.integers(1, 31))
    lim = 1 << (31 - e)
    m = draw(st.integers(-lim, lim - 1))
    return (2 * m + 1) * (1 << (e - 1)), e


@FAST
@given(st.one_of(st.tuples(int32s, st.integers(0, 31)), rdbpot_ties()))
@example((INT32_MIN, 0))
@example((INT32_MAX, 0))
@example((INT32_MIN, 31))               # -1 exactly
@example((INT32_MAX, 31))               # 0.99999... -> 1
@example((1 << 30, 31))                 # +0.5 -> 1 (away from zero)
@example((-(1 << 30), 31))              # -0.5 -> -1 (away from zero)
@example((-(1 << 30) - 1, 31))          # just below -0.5 -> -1
@example((-(1 << 30) + 1, 31))          # just above -0.5 -> 0
@example((3, 1))                        # 1.5 -> 2
@example((-3, 1))                       # -1.5 -> -2
@example((-1, 1))                       # -0.5 -> -1
@example((1, 1))
@example((-1, 31))
@example((0, 31))
def test_rounding_divide_by_pot(xe):
    """RDBPOT == x / 2^e rounded half away from zero == gemmlowp's mask form, for 0 <= e <= 31."""
    x, e = xe
    want = ref_rdbpot(x, e)
    assert want == ref_rdbpot_gemmlowp(x, e)
    assert fp.rounding_divide_by_pot(x, e) == want
    got = fp.rounding_divide_by_pot(np.array([x, -x if x != INT32_MIN else x], dtype=np.int64), e)
    assert got.tolist() == [want, ref_rdbpot(-x if x != INT32_MIN else x, e)]
    # per-element exponents (per-channel) broadcast against x
    es = np.array([0, e, 31], dtype=np.int64)
    assert fp.rounding_divide_by_pot(x, es).tolist() == [ref_rdbpot(x, k) for k in (0, e, 31)]


@SLOW
@given(int32s, st.sampled_from([-1, 32, 40, -31]))
def test_rounding_divide_by_pot_rejects_bad_exponent(x, e):
    """Contract: 0 <= exponent <= 31, otherwise MaceqError (gemmlowp would shift by >= 32: UB)."""
    with pytest.raises(MaceqError):
        fp.rounding_divide_by_pot(x, e)


# ==============================================================================================
# multiply_by_quantized_multiplier (and the fast kernels' floor identity)
# ==============================================================================================

qs = st.one_of(st.integers(1 << 30, INT32_MAX), st.sampled_from([0, 1 << 30, INT32_MAX]),
               st.integers(-INT32_MAX, -(1 << 30)))


@FAST
@given(int32s, qs, st.integers(-31, 31))
@example(INT32_MIN, INT32_MAX, 0)
@example(INT32_MIN, 1 << 30, 31)       # left shift wraps: INT32_MIN << 31 == 0 in int32
@example(INT32_MAX, INT32_MAX, 31)     # INT32_MAX << 31 wraps to INT32_MIN
@example(1, 1 << 30, 1)                # 1 * 0.5 * 2 = 1
@example(1, 1 << 30, -1)               # 1/4 -> SRDHM gives 1 (0.5 up), then 1/2 -> 1: double rounding
@example(-3, 1 << 30, -1)              # -1.5 -> -1 then /2 = -0.5 -> -1
@example(-1, 1 << 30, 0)               # -0.5 -> 0 (SRDHM tie toward +inf)
@example(12345, 0, -5)
@example(INT32_MIN, INT32_MIN + 1, -31)
@example(5, 1 << 30, -31)
def test_multiply_by_quantized_multiplier(x, q, shift):
    """MBQM == RDBPOT(SRDHM(wrap32(x << left), q), right) for left and right shifts, scalar and array."""
    want = ref_mbqm(x, q, shift)
    assert fp.multiply_by_quantized_multiplier(x, q, shift) == want
    got = fp.multiply_by_quantized_multiplier(np.array([x, 0, INT32_MIN], dtype=np.int64), q, shift)
    assert got.tolist() == [want, ref_mbqm(0, q, shift), ref_mbqm(INT32_MIN, q, shift)]
    # per-channel q and shift arrays broadcast against x
    qq = np.array([q, 1 << 30], dtype=np.int64)
    ss = np.array([shift, -shift], dtype=np.int64)
    got_pc = fp.multiply_by_quantized_multiplier(np.array([[x, x]], dtype=np.int64), qq, ss)
    assert got_pc.tolist() == [[want, ref_mbqm(x, 1 << 30, -shift)]]


@MEDIUM
@given(int32s, qs, st.integers(32, 40))
def test_multiply_by_quantized_multiplier_rejects_left_shift_above_31(x, q, shift):
    with pytest.raises(MaceqError):
        fp.multiply_by_quantized_multiplier(x, q, shift)


@MEDIUM
@given(int32s, st.integers(0, INT32_MAX), st.integers(-31, 0), st.integers(-255, 255))
@example(INT32_MIN, 1 << 30, 0, 0)
@example(-1, 1 << 30, -1, 0)
@example(INT32_MIN, INT32_MAX, -31, 255)
@example(-(1 << 30), 1, -31, 0)
def test_requant_floor_terms_identity(x, q, shift, zp):
    """The fast kernels' one-floor form equals MBQM + zp (requant_floor_terms' contract)."""
    k, c0, theta = fp.requant_floor_terms(q, shift, zp)
    lt = 1 if (theta is not None and x < theta) else 0
    assert (x * q + c0 - (1 << 31) * lt) // (1 << k) == ref_mbqm(x, q, shift) + zp


# ==============================================================================================
# gpu: float32 RTE requantization (no FMA)
# ==============================================================================================

def ref_gpu_requant(acc: int, scale_c: float, zp: int) -> int:
    """``convert_uchar_sat_rte(f32(f32(convert_float_rte(acc) * scale_c) + (float)zp))``, exactly.

    Each binary32 operation is the exact rational result rounded once (rne_f32); no step is
    fused and no intermediate is kept in double.
    """
    f = rne_f32(Fraction(acc))
    if math.isinf(scale_c):
        raise AssertionError("finite scales only")
    y = rne_f32(Fraction(f) * Fraction(scale_c))
    if math.isinf(y):
        return 255 if y > 0 else 0
    y = rne_f32(Fraction(y) + zp)
    if math.isinf(y):
        return 255 if y > 0 else 0
    return min(255, max(0, round_half_even_exact(Fraction(y))))


@st.composite
def gpu_ties(draw):
    """(acc, scale, zp): acc*scale = k + 1/2 exactly with scale = 2^-j, so every float32 step is exact."""
    j = draw(st.integers(1, 20))
    k = draw(st.integers(-300, 300))
    acc = (2 * k + 1) * (1 << (j - 1))
    if not INT32_MIN <= acc <= INT32_MAX:
        acc = 2 * k + 1
        j = 1
    return acc, 2.0 ** -j, draw(st.integers(0, 255))


gpu_scales = st.one_of(
    f32_between(1e-7, 4.0),
    f32_between(F32_MIN_SUB, F32_MAX),
)


@FAST
@given(st.one_of(st.tuples(int32s, gpu_scales, st.integers(0, 255)), gpu_ties(),
                 st.tuples(st.integers(-(1 << 26), 1 << 26), f32_between(1e-4, 1.0),
                           st.integers(0, 255))))
@example((1, 0.5, 0))                    # 0.5 -> 0 (even)
@example((3, 0.5, 0))                    # 1.5 -> 2
@example((-1, 0.5, 0))                   # -0.5 -> -0 -> 0
@example((5, 0.5, 0))                    # 2.5 -> 2
@example((1, 0.5, 128))                  # 128.5 -> 128
@example((3, 0.5, 128))                  # 129.5 -> 130
@example((-1, 0.5, 128))                 # 127.5 -> 128
@example((3 * (1 << 24) - 1, 2.0 ** -25, 0))   # float_rte(acc) = 3*2^24: 1.5 -> 2 (exact value 1.4999 -> 1)
@example((459, float(np.float32(0.3061002194881439)), 0))   # f32 product = 140.5 -> 140; exact -> 141
@example((91783, float(np.float32(0.0015743656549602747)), 0))  # f32 144.5 -> 144; exact -> 145
@example((79842, float(np.float32(0.0010207659797742963)), 0))  # f32 81.5 -> 82; exact -> 81
@example((1, float(np.float32(0.49999997)), 129))  # f32 add: 129.49999997 -> 129.5 -> 130; double -> 129
@example((INT32_MAX, F32_MAX, 0))        # overflow to +inf: saturates to 255
@example((INT32_MIN, F32_MAX, 255))      # -inf: 0
@example((INT32_MIN, 1.0, 0))
@example((INT32_MAX, 2.0 ** -31, 0))     # float_rte(INT32_MAX) = 2^31 -> 1.0
@example((255, 1.0, 1))                  # 256 saturates
@example((0, F32_MIN_SUB, 0))
def test_gpu_requantize_float32_rte(case):
    """gpu requant == exact binary32 steps + RTE + saturation; scalar ref and vectorised kernel agree."""
    acc, scale, zp = case
    scale = float(np.float32(scale))
    want = ref_gpu_requant(acc, scale, zp)
    with np.errstate(over="ignore"):  # float32 overflow to inf is a defined step here (saturates)
        assert gpu.gpu_requantize_acc_ref(acc, np.float32(scale), zp) == want
        got = gpu.gpu_requantize_acc(np.array([acc], dtype=np.int32), np.float32(scale), zp)
    assert got.dtype == np.uint8 and got.tolist() == [want]


def test_gpu_requantize_rounds_in_float32_not_double():
    """The pinned cases really discriminate: evaluating the same expression in float64 differs."""
    for acc, s, zp in [(459, 0.3061002194881439, 0), (1, 0.49999997, 129), (3 * (1 << 24) - 1, 2.0 ** -25, 0)]:
        s32 = float(np.float32(s))
        double_path = min(255, max(0, round_half_even_exact(Fraction(float(acc) * s32 + zp))))
        assert ref_gpu_requant(acc, s32, zp) != double_path
        assert gpu.gpu_requantize_acc_ref(acc, np.float32(s32), zp) == ref_gpu_requant(acc, s32, zp)


@MEDIUM
@given(st.lists(int32s, min_size=1, max_size=12), st.lists(f32_between(1e-6, 2.0), min_size=1, max_size=4),
       st.integers(0, 255))
def test_gpu_requantize_per_channel_vectorised(accs, scales, zp):
    """Per-channel scale vector on the last axis: every element equals the exact reference."""
    c = len(scales)
    acc = np.array([accs[i % len(accs)] for i in range(3 * c)], dtype=np.int32).reshape(3, c)
    got = gpu.gpu_requantize_acc(acc, np.array(scales, dtype=np.float32), zp)
    want = [[ref_gpu_requant(int(acc[i, j]), float(np.float32(scales[j])), zp) for j in range(c)] for i in range(3)]
    assert got.tolist() == want


# ==============================================================================================
# dsp (nnlib): 32 -> 8 bit requantization
# ==============================================================================================

def ref_d32_requant(s: int, recip: int, shamt: int) -> tuple[int, int]:
    """dwconv2dbbb_c.c: ``sum <<= recip_shift`` (int32), ``lsum = ((int64)sum*recip + 0x40000000) >> 31``,
    the min/max tracker sees ``(int)lsum``, the output byte is lsum clamped to [0, 0xff]."""
    s = wrap32(s << shamt)
    lsum = math.floor(Fraction(s * recip + 0x40000000, 1 << 31))
    return min(255, max(0, lsum)), wrap32(lsum)


@FAST
@given(int32s, st.one_of(st.integers(0, 0x7FFFFFFF), st.sampled_from([0, 1, 0x40000000, 0x7FFFFFFF])),
       st.integers(0, 8))
@example(INT32_MIN, 0x7FFFFFFF, 0)
@example(INT32_MAX, 0x7FFFFFFF, 0)
@example(INT32_MAX, 0x7FFFFFFF, 8)     # the shift wraps
@example(255, 1 << 30, 1)              # 255 << 1 = 510, * 0.5 -> 255
@example(1, 0x40000000, 0)             # 0.5 -> 1 (half up)
@example(-1, 0x40000000, 0)            # -0.5 -> 0 (half up)
@example(511, 0x40000000, 0)           # 255.5 -> 256 -> saturates 255
@example(-3, 0x40000000, 0)            # -1.5 -> -1 -> 0
@example(0, 0, 0)
def test_nnlib_d32_requant(s, recip, shamt):
    """nnlib d32 requant: scalar transcription and numpy kernel == dwconv2dbbb_c.c's arithmetic."""
    want_q, want_raw = ref_d32_requant(s, recip, shamt)
    assert nr.d32_requant(s, recip, shamt) == (want_q, want_raw)
    y, vmin, vmax = dsp._d32_requant(np.array([s, 0], dtype=np.int64), recip, shamt)
    assert y.dtype == np.uint8 and y.tolist() == [want_q, 0]
    # the min / max trackers start at 2^24 / -2^24 (supernode_execute_strategy) and see (int)lsum
    assert vmin == min(1 << 24, want_raw, 0) and vmax == max(-(1 << 24), want_raw, 0)


def ref_fast_roundf(x: float) -> int:
    """convert_sf2w: nearest-even, saturating to int32."""
    if math.isinf(x):
        return INT32_MAX if x > 0 else INT32_MIN
    return min(INT32_MAX, max(INT32_MIN, round_half_even_exact(Fraction(x))))


def ref_trunc_i32(x: float) -> int:
    """convert_sf2w_chop: toward zero, saturating to int32."""
    if math.isinf(x):
        return INT32_MAX if x > 0 else INT32_MIN
    return min(INT32_MAX, max(INT32_MIN, math.trunc(Fraction(x))))


def ref_roundf_i32(x: float) -> int:
    """quantize.h roundf_i32: (int)(x + copysignf(0.5f, x)), the add in binary32."""
    if math.isinf(x):
        return ref_trunc_i32(x)
    return ref_trunc_i32(rne_f32(Fraction(x) + (Fraction(1, 2) if math.copysign(1, x) > 0 else -Fraction(1, 2))))


@FAST
@given(st.floats(width=32, allow_nan=False))
@example(2147483520.0)                     # largest float32 below 2^31
@example(2147483648.0)                     # 2^31: saturates
@example(-2147483648.0)                    # exactly INT32_MIN
@example(-2147483904.0)                    # below: saturates
@example(float(np.float32(0.49999997)))    # roundf_i32 gives 1 (the add rounds)
@example(2.5)
@example(-2.5)
@example(-0.5)
@example(math.inf)
@example(-math.inf)
def test_nnlib_float_to_int_conversions(x):
    """fast_roundf / (int) / roundf_i32 saturate at the int32 limits; scalar == vectorised."""
    want_fast, want_trunc, want_ri = ref_fast_roundf(x), ref_trunc_i32(x), ref_roundf_i32(x)
    assert nr.fast_roundf(x) == want_fast
    assert nr.c_trunc_i32(x) == want_trunc
    assert nr.roundf_i32(x) == want_ri
    a = np.array([x], dtype=np.float32)
    assert dsp._fast_round(a).tolist() == [want_fast]
    assert dsp._trunc_i32(a).tolist() == [want_trunc]
    assert dsp._roundf_i32(a).tolist() == [want_ri]


@st.composite
def sane_ranges(draw):
    """A Quantize range nnlib accepts: finite, min <= 0 <= max, max - min >= 1e-8."""
    mn = draw(f32_between(-1e4, 0.0))
    mx = draw(f32_between(0.0, 1e4))
    if mx - mn < 1e-6:
        mx = 1.0
    return mn, mx


@MEDIUM
@given(sane_ranges(), st.lists(f32_between(-2e4, 2e4), min_size=0, max_size=8))
@example((-1.0, 1.0), [])
@example((0.0, 1.0), [0.0, 1.0, 2.0, -1.0])
@example((-1.0, 0.0), [-1.0, 0.0])
@example((-3.4e3, 7.1e3), [-1e4, 1e4])
def test_nnlib_quantize_requant_and_range_limits(rng_, xs):
    """nnlib Quantize_ref: the scalar transcription == the quantize_execute_ref steps; the HVX
    Quantize op (``dsp.quantize``) == its scalar transcription ``quantize_hvx_ref``.

    ``q = saturate_u8(roundf_i32(f32(f32(x - min') * recip)))`` with (min', max', recip) from
    quantize_adjust_range. At the range limits: min' gives 0, max' gives 255, anything outside
    saturates.
    """
    mn, mx = rng_
    ar = nr.quantize_adjust_range(mn, mx)
    lo, hi = ar.minval, ar.maxval
    xs = [lo, hi, 0.0] + list(xs) + [lo - abs(hi - lo) - 1.0, hi + abs(hi - lo) + 1.0]
    xs = [float(np.float32(v)) for v in xs]

    def ref(v: float) -> int:
        d = rne_f32(Fraction(v) - Fraction(lo))
        p = rne_f32(Fraction(d) * Fraction(ar.recip_stepsize))
        return min(255, max(0, ref_roundf_i32(p)))

    want = [ref(v) for v in xs]
    assert want[0] == 0 and want[1] == 255 and want[-2] == 0 and want[-1] == 255
    q_ref, rmin, rmax = nr.quantize_ref(np.array(xs, dtype=np.float32), min=mn, max=mx)
    assert q_ref.tolist() == want
    assert (rmin, rmax) == (lo, hi)
    # dsp.quantize is the HVX Quantize op (quantize_execute_opt, fixed point; far-out values wrap,
    # measured under QEMU): vectorised == its scalar transcription.
    q_hvx, hmin, hmax = nr.quantize_hvx_ref(np.array(xs, dtype=np.float32), min=mn, max=mx)
    q_fast, fmin, fmax = dsp.quantize(np.array(xs, dtype=np.float32), min=mn, max=mx)
    assert q_fast.tolist() == q_hvx.tolist()
    assert (fmin, fmax) == (hmin, hmax)


def ref_superfc_output(tmp: list[int], outadd: int, scalef31: int) -> list[int]:
    """superfc_execute_ref's last loop: ``val = tmp + outadd`` (int32), ``out_i = ((int64)val*scalef31 +
    (1u<<30)) >> 31`` stored to int32, ``saturate_u8``."""
    out = []
    for t in tmp:
        val = wrap32(t + outadd)
        out_i = wrap32(math.floor(Fraction(val * scalef31 + (1 << 30), 1 << 31)))
        out.append(min(255, max(0, out_i)))
    return out


@SLOW
@given(st.integers(1, 6), st.integers(1, 4), st.data())
def test_nnlib_superfc_requant_stage(k, o, data):
    """SuperFC with a given output range: every output == the C's 32->8 requant of the exact int32 sum.

    The output range is drawn narrower and wider than the data, so outputs saturate at both ends.
    """
    x = np.array(data.draw(st.lists(st.integers(0, 255), min_size=2 * k, max_size=2 * k)), dtype=np.uint8).reshape(2, k)
    w = np.array(data.draw(st.lists(st.integers(0, 255), min_size=k * o, max_size=k * o)), dtype=np.uint8).reshape(k, o)
    bias = np.array(data.draw(st.lists(st.integers(-(1 << 20), 1 << 20), min_size=o, max_size=o)), dtype=np.int64)
    x_min = data.draw(f32_between(-4.0, -0.01))
    x_max = data.draw(f32_between(0.01, 4.0))
    w_min = data.draw(f32_between(-2.0, -0.01))
    w_max = data.draw(f32_between(0.01, 2.0))
    b_abs = data.draw(f32_between(0.01, 8.0))
    out_min = data.draw(f32_between(-40.0, -0.001))
    out_max = data.draw(f32_between(0.001, 40.0))
    kw = dict(x_min=x_min, x_max=x_max, w_min=w_min, w_max=w_max, bias_min=-b_abs, bias_max=b_abs,
              out_min=out_min, out_max=out_max)
    # parameters (nnlib's float chain, transcribed in nnlib_ref and tested in test_dsp_nnlib.py)
    in_off, filt_off, out_level, bias_mpy = nr.superfc_ref_params(x_min, x_max, w_min, w_max, -b_abs, b_abs)
    # biasbuf[i] = fast_roundf((float)bias[i] * bias_mpy_amt): one binary32 product, then nearest-even
    biasbuf = [ref_fast_roundf(rne_f32(Fraction(rne_f32(Fraction(int(b)))) * Fraction(bias_mpy))) for b in bias]
    tmp = []
    for bi in range(2):
        for oz in range(o):
            s = biasbuf[oz]
            for z in range(k):
                s = wrap32(s + (int(x[bi, z]) - in_off) * (int(w[z, oz]) - filt_off))
            tmp.append(s)
    minsum, maxsum = min(0, min(tmp)), max(0, max(tmp))
    fmin_, fmax_, outadd, scalef31 = nr.superfc_ref_output(minsum, maxsum, out_level, out_min, out_max)
    want = ref_superfc_output(tmp, outadd, scalef31)
    y_ref, rmin, rmax = nr.superfc_ref(x, w, bias, **kw)
    y_fast, qmin, qmax = dsp.superfc(x, w, bias, variant=dsp.SuperFCVariant.REF, **kw)
    assert y_ref.ravel().tolist() == want
    assert y_fast.ravel().tolist() == want
    assert (rmin, rmax) == (qmin, qmax) == (fmin_, fmax_)


def test_nnlib_superfc_saturates_at_both_range_limits():
    """A fixed output range [-0.5, 0.5] far narrower than the data: codes pin to 0 and 255."""
    x = np.array([[255, 0], [0, 255]], dtype=np.uint8)
    w = np.array([[255], [0]], dtype=np.uint8)
    kw = dict(x_min=-2.0, x_max=2.0, w_min=-2.0, w_max=2.0, bias_min=-1.0, bias_max=1.0,
              out_min=-0.5, out_max=0.5)
    y_ref, _, _ = nr.superfc_ref(x, w, np.zeros(1, dtype=np.int64), **kw)
    y_fast, _, _ = dsp.superfc(x, w, np.zeros(1, dtype=np.int64), variant=dsp.SuperFCVariant.REF, **kw)
    # row 0: 2*2 + (-2)*(-2) = 8 > 0.5 -> 255; row 1: (-2)*2 + 2*(-2) = -8 < -0.5 -> 0
    assert y_ref.ravel().tolist() == y_fast.ravel().tolist()
    assert sorted(y_ref.ravel().tolist()) == [0, 255]
