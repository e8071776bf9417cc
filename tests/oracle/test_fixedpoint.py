"""maceq.runtime.fixedpoint against exact Python-int / Fraction references.

Each reference below is the mathematical definition of the primitive, written
with Python's unbounded ints or Fractions, not a copy of the implementation:
- SaturatingRoundingDoublingHighMul(a, b) = floor(a*b / 2^31 + 1/2), saturating
  only for INT32_MIN*INT32_MIN (ties toward +inf; docs/oracle-notes.md);
- RoundingDivideByPOT(x, e) = x / 2^e rounded half away from zero;
- QuantizeMultiplier by exact binary decomposition of the double;
- MACE's float32 multiplier by exact rationals rounded once to float32
  (via ``struct``, which rounds a double to the nearest float32).
"""
from __future__ import annotations

import math
import struct
from fractions import Fraction

import numpy as np
import pytest

from maceq.errors import MaceqError
from maceq.runtime.fixedpoint import (
    INT32_MAX,
    INT32_MIN,
    mace_bias_needs_rescale,
    mace_float_multiplier,
    mace_output_multiplier,
    mace_rescale_bias,
    multiply_by_quantized_multiplier,
    quantize_multiplier,
    round_half_away,
    rounding_divide_by_pot,
    saturating_rounding_doubling_high_mul,
    wrap_int32,
)

EDGES = [INT32_MIN, INT32_MIN + 1, -(1 << 30) - 1, -(1 << 30), -3, -2, -1, 0, 1, 2, 3,
         (1 << 30), (1 << 30) + 1, INT32_MAX - 1, INT32_MAX]


# ----------------------------------------------------------------------------- references

def ref_round_half_away(v: Fraction) -> int:
    s = -1 if v < 0 else 1
    return s * math.floor(abs(v) + Fraction(1, 2))


def ref_srdhm(a: int, b: int) -> int:
    if a == INT32_MIN and b == INT32_MIN:
        return INT32_MAX
    return math.floor(Fraction(a * b, 1 << 31) + Fraction(1, 2))


def ref_rdbpot(x: int, e: int) -> int:
    return ref_round_half_away(Fraction(x, 1 << e))


def ref_wrap(v: int) -> int:
    return (v + (1 << 31)) % (1 << 32) - (1 << 31)


def ref_mbqm(x: int, q: int, shift: int) -> int:
    left, right = max(shift, 0), max(-shift, 0)
    return ref_rdbpot(ref_srdhm(ref_wrap(x * (1 << left)), q), right)


def ref_quantize_multiplier(d: float) -> tuple[int, int]:
    if d == 0:
        return 0, 0
    v = Fraction(d)
    e = 0
    while abs(v) >= 1:  # normalise to m in [0.5, 1): d = m * 2^e
        v /= 2
        e += 1
    while abs(v) < Fraction(1, 2):
        v *= 2
        e -= 1
    q = ref_round_half_away(v * (1 << 31))
    if abs(q) == 1 << 31:
        q //= 2
        e += 1
    if e < -31:
        return 0, 0
    return q, e


def f32(x: float) -> float:
    """The float32 nearest to double x (ties to even), as a double."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def ref_mace_float_multiplier(a: float, b: float, c: float) -> float:
    a, b, c = f32(a), f32(b), f32(c)
    prod = f32(float(Fraction(a) * Fraction(b)))  # exact product, one rounding
    # Fraction -> float rounds once to double; double -> float32 then is
    # innocuous for a quotient (53 >= 2*24 + 2).
    return f32(float(Fraction(prod) / Fraction(c)))


# ----------------------------------------------------------------------------- round_half_away

def test_round_half_away_ties_and_random():
    rng = np.random.default_rng(1)
    ties = np.arange(-1000, 1001) + 0.5
    near = np.array([0.49999999999999994, -0.49999999999999994, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5,
                     2.0 ** 52 + 1, -(2.0 ** 52) - 1, 2.0 ** 51 + 0.5, -(2.0 ** 51) - 0.5, 0.0, -0.0,
                     np.nextafter(2.5, 3), np.nextafter(2.5, 2), np.nextafter(-2.5, -3)])
    rnd = rng.normal(scale=1e3, size=20000)
    for arr in (ties, near, rnd):
        got = round_half_away(arr)
        assert got.dtype == np.int64
        exp = np.array([ref_round_half_away(Fraction(float(v))) for v in arr])
        assert int(np.sum(got != exp)) == 0
    # float32 arrays, including float32 ties and values whose float64 widening is exact
    r32 = np.concatenate([rng.normal(scale=300, size=20000).astype(np.float32),
                          (np.arange(-300, 300) + 0.5).astype(np.float32),
                          np.array([np.nextafter(np.float32(0.5), np.float32(0))], np.float32)])
    got = round_half_away(r32)
    exp = np.array([ref_round_half_away(Fraction(float(v))) for v in r32])
    assert int(np.sum(got != exp)) == 0
    # scalars stay scalars; numpy's half-even rounding differs on ties
    assert round_half_away(2.5) == 3 and isinstance(round_half_away(2.5), int)
    assert round_half_away(-2.5) == -3 and round_half_away(np.float32(0.5)) == 1
    assert np.round(2.5) == 2.0


def test_wrap_int32():
    vals = [0, 1, -1, INT32_MAX, INT32_MIN, INT32_MAX + 1, INT32_MIN - 1, 1 << 40, -(1 << 40) + 5,
            3 * (1 << 32) + 7]
    got = wrap_int32(np.array(vals, dtype=np.int64))
    assert got.tolist() == [ref_wrap(v) for v in vals]
    assert wrap_int32(INT32_MAX + 1) == INT32_MIN


# ----------------------------------------------------------------------------- SRDHM / RDBPOT / MBQM

def test_saturating_rounding_doubling_high_mul():
    rng = np.random.default_rng(2)
    a = [x for x in EDGES for _ in EDGES]
    b = [y for _ in EDGES for y in EDGES]
    # exact ties of a*b/2^31 at +-k/2: odd a times 2^30
    odd = (rng.integers(-(1 << 20), 1 << 20, 2000) * 2 + 1).tolist()
    a += odd
    b += [1 << 30] * len(odd)
    a += rng.integers(INT32_MIN, INT32_MAX, 20000, endpoint=True).tolist()
    b += rng.integers(INT32_MIN, INT32_MAX, 20000, endpoint=True).tolist()
    got = saturating_rounding_doubling_high_mul(np.array(a, np.int64), np.array(b, np.int64))
    exp = np.array([ref_srdhm(x, y) for x, y in zip(a, b)])
    assert int(np.sum(got != exp)) == 0
    assert saturating_rounding_doubling_high_mul(INT32_MIN, INT32_MIN) == INT32_MAX
    assert saturating_rounding_doubling_high_mul(-1, 1 << 30) == 0      # -0.5 -> 0 (toward +inf)
    assert saturating_rounding_doubling_high_mul(1, 1 << 30) == 1       # +0.5 -> 1
    assert saturating_rounding_doubling_high_mul(-3, 1 << 30) == -1     # -1.5 -> -1


def test_rounding_divide_by_pot():
    rng = np.random.default_rng(3)
    xs, es = [], []
    for e in range(32):
        for x in EDGES:
            xs.append(x)
            es.append(e)
        if e > 0:  # exact ties (2k+1) * 2^(e-1), both signs, within int32
            k = rng.integers(-(1 << (31 - e)), (1 << (31 - e)) - 1, 200)
            t = ((2 * k + 1) << (e - 1)).tolist()
            xs += t
            es += [e] * len(t)
        r = rng.integers(INT32_MIN, INT32_MAX, 500, endpoint=True).tolist()
        xs += r
        es += [e] * len(r)
    got = rounding_divide_by_pot(np.array(xs, np.int64), np.array(es, np.int64))
    exp = np.array([ref_rdbpot(x, e) for x, e in zip(xs, es)])
    assert int(np.sum(got != exp)) == 0
    assert rounding_divide_by_pot(5, 0) == 5
    assert rounding_divide_by_pot(INT32_MIN, 31) == -1
    assert rounding_divide_by_pot(-(1 << 30), 31) == -1   # -0.5 -> -1 (away from zero)
    assert rounding_divide_by_pot((1 << 30), 31) == 1
    with pytest.raises(MaceqError):
        rounding_divide_by_pot(1, 32)


def test_multiply_by_quantized_multiplier():
    rng = np.random.default_rng(4)
    n = 30000
    x = rng.integers(INT32_MIN, INT32_MAX, n, endpoint=True)
    # mostly accumulator-sized values, where rounding matters
    x[: n // 2] = rng.integers(-(1 << 20), 1 << 20, n // 2)
    q = rng.integers(1 << 30, INT32_MAX, n, endpoint=True)
    q[:2000] = 1 << 30  # power-of-two multipliers: ties in both rounding steps
    shift = rng.integers(-31, 9, n)  # left shifts up to 8 wrap on large x
    got = multiply_by_quantized_multiplier(x, q, shift)
    exp = np.array([ref_mbqm(int(a), int(b), int(c)) for a, b, c in zip(x, q, shift)])
    assert int(np.sum(got != exp)) == 0
    # docs/oracle-notes.md: double rounding is visible
    assert multiply_by_quantized_multiplier(1, 1 << 30, -1) == 1      # 1 * 1/4 = 0.25 -> 1
    assert multiply_by_quantized_multiplier(-6, 1 << 30, -1) == -2    # -6/4 = -1.5 -> -2
    assert multiply_by_quantized_multiplier(INT32_MIN, INT32_MIN, 0) == INT32_MAX
    # left shift wraps: (2^30) * 2 = 2^31 -> INT32_MIN, times 1/2 (q=2^30) -> -2^30
    assert multiply_by_quantized_multiplier(1 << 30, 1 << 30, 1) == -(1 << 30)


# ----------------------------------------------------------------------------- QuantizeMultiplier

def test_quantize_multiplier():
    rng = np.random.default_rng(5)
    vals = list(rng.uniform(0, 1, 3000)) + list(np.exp(rng.uniform(-30, 5, 3000)))
    vals += [1.0, 0.5, 0.25, 3.0, 1 - 2.0 ** -53, 1 - 2.0 ** -33, (2 ** 30 + 0.5) / 2 ** 31,
             (2 ** 31 - 0.5) / 2 ** 31, 2.0 ** -31, 2.0 ** -32, 2.0 ** -33, 1e-12, 0.0, -0.3, 7.99]
    for d in vals:
        got = quantize_multiplier(float(d))
        assert got == ref_quantize_multiplier(float(d)), d
        q, e = got
        assert q == 0 or (1 << 30) <= abs(q) < (1 << 31)
    assert quantize_multiplier(1 - 2.0 ** -53) == (1 << 30, 1)       # rounds up to 2^31: halve
    assert quantize_multiplier((2 ** 30 + 0.5) / 2 ** 31) == ((1 << 30) + 1, 0)  # tie away
    assert quantize_multiplier(2.0 ** -32) == (1 << 30, -31)
    assert quantize_multiplier(2.0 ** -33) == (0, 0)                 # flushed


def test_mace_output_multiplier_float32():
    rng = np.random.default_rng(6)
    differs_from_double = 0
    n = 0
    while n < 3000:
        s_in = float(np.float32(np.exp(rng.uniform(-9, 1))))
        s_w = float(np.float32(np.exp(rng.uniform(-9, 0))))
        s_out = float(np.float32(np.exp(rng.uniform(-8, 2))))
        m = ref_mace_float_multiplier(s_in, s_w, s_out)
        if not 0 < m < 1:
            with pytest.raises(MaceqError):
                mace_output_multiplier(s_in, s_w, s_out)
            continue
        n += 1
        assert float(mace_float_multiplier(s_in, s_w, s_out)) == m
        got = mace_output_multiplier(s_in, s_w, s_out)
        assert got == ref_quantize_multiplier(m)
        assert got[1] <= 0
        differs_from_double += got != ref_quantize_multiplier(s_in * s_w / s_out)
    # MACE's float32 multiplier and TFLite's double one are different numbers:
    # their Q31 forms differ for a large share of scale triples.
    assert differs_from_double > 100
    with pytest.raises(MaceqError):
        mace_output_multiplier(1.0, 1.0, 1.0)      # == 1 is rejected
    with pytest.raises(MaceqError):
        mace_output_multiplier(0.5, 0.5, 0.1)      # > 1
    with pytest.raises(MaceqError):
        mace_output_multiplier(0.5, -0.5, 1.0)     # <= 0


# ----------------------------------------------------------------------------- bias rescale

def ref_mace_bias(b: list[int], s_in: float, s_w: float, s_bias: float) -> list[int]:
    """Scalar transcription of mace/ops/arm/q8/quantization_util.cc GetBiasData."""
    prod = f32(f32(s_in) * f32(s_w))
    if not abs(f32(prod - f32(s_bias))) > 1e-6:
        return list(b)
    adjust = f32(float(Fraction(f32(s_bias)) / Fraction(prod)))
    out = []
    for v in b:
        fv = f32(float(v))  # int32 -> float, nearest even
        out.append(ref_round_half_away(Fraction(f32(float(Fraction(fv) * Fraction(adjust))))))
    return out


def test_mace_rescale_bias():
    rng = np.random.default_rng(7)
    cases = 0
    rescaled = 0
    for _ in range(400):
        s_in = float(np.float32(np.exp(rng.uniform(-5, 0))))
        s_w = float(np.float32(np.exp(rng.uniform(-8, -2))))
        prod = float(np.float32(s_in) * np.float32(s_w))
        kind = rng.integers(3)
        if kind == 0:
            s_bias = prod                                     # equal: untouched
        elif kind == 1:
            s_bias = prod + float(rng.uniform(-2e-6, 2e-6))   # straddles the 1e-6 threshold
        else:
            s_bias = prod * float(rng.uniform(0.5, 2))        # clearly different
        s_bias = float(np.float32(s_bias))
        b = rng.integers(-(1 << 26), 1 << 26, 16)
        b[:4] = [0, 1, -1, (1 << 24) + 1]
        got = mace_rescale_bias(b.astype(np.int32), s_in, s_w, s_bias)
        exp = ref_mace_bias([int(v) for v in b], s_in, s_w, s_bias)
        assert got.dtype == np.int32
        assert got.tolist() == exp
        cases += 1
        rescaled += mace_bias_needs_rescale(s_in, s_w, s_bias)
    assert 50 < rescaled < cases  # both branches exercised
    assert not mace_bias_needs_rescale(0.5, 0.5, 0.25 + 1e-6 * 0.5)
    assert mace_bias_needs_rescale(0.5, 0.5, 0.25 + 2e-6)
