"""Tests for MACE's NEON Quantize / AdjustRange / Dequantize (runtime/kernels/quantize.py).

Oracle: the C++ expressions of mace/core/quantize.h and quantize.cc re-evaluated in exact
rational arithmetic, each float32 operation rounded to nearest-even by ``_rn32`` below (an
explicit IEEE-754 binary32 rounding, subnormals and overflow included). This shares no code
with the kernel, which uses numpy float32. TFLite's QUANTIZE rounds x / s in another way
(the oracle notes measured ~1,100 differing codes out of 54,096), so it is not an oracle for
Quantize; TFLite's DEQUANTIZE computes float(double(scale) * (q - zp)), which is the same single
rounding of an exact product as MACE's float32 multiply, so it is one for Dequantize.
"""
from __future__ import annotations

import math
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest

from maceq.errors import MaceqError
from maceq.runtime.kernels.quantize import (
    adjust_range,
    dequantize,
    find_range,
    quantize,
    quantize_neon,
    quantize_neon_ref,
)
from maceq.tests.oracle.tflite_builder import TensorSpec, build_single_op_model, run_ref

INF = float("inf")


def _rn32(q) -> float:
    """Round an exact rational (or float) to the nearest binary32 value, ties to even."""
    if isinstance(q, float):
        if math.isnan(q) or math.isinf(q):
            return q
        q = Fraction(q)
    if q == 0:
        return 0.0
    sign = -1 if q < 0 else 1
    a = abs(q)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    e = max(e, -126)                       # subnormals share the smallest exponent
    ulp = Fraction(2) ** (e - 23)
    m = a / ulp
    fl = math.floor(m)
    rem = m - fl
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and fl % 2 == 1):
        fl += 1
    v = fl * ulp
    if v >= Fraction(2) ** 128:
        return sign * INF
    return sign * float(v)


def _add(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b):
        return float(np.float32(a) + np.float32(b))  # IEEE special cases only
    return _rn32(Fraction(a) + Fraction(b))


def _mul(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b):
        with np.errstate(invalid="ignore"):
            return float(np.float32(a) * np.float32(b))
    return _rn32(Fraction(a) * Fraction(b))


def _to_u8(v: float) -> int:
    """float -> int32 as ARM FCVTZS (NaN 0, saturating), then Saturate to [0, 255]."""
    if math.isnan(v):
        return 0
    return 0 if v <= 0 else 255 if v >= 255 else int(v)


def _mace_quantize(values, scale: float, zp: int) -> list[int]:
    """quantize.cc's NEON QuantizeWithScaleAndZeropoint, element by element."""
    recip = _rn32(Fraction(1) / Fraction(_rn32(scale)))
    vzero = _rn32(Fraction(1, 2) + zp)
    body = len(values) // 16 * 16
    out = []
    for i, x in enumerate(values):
        x = float(np.float32(x))
        if i < body:  # vcvtq_s32_f32(vmlaq_f32(vzero, x, recip)): mul, add, truncate
            t = _add(_mul(x, recip), vzero)
            out.append(_to_u8(t if not math.isfinite(t) else float(math.trunc(t))))
        else:         # Saturate<uint8_t>(roundf(zero_point + recip_scale * x))
            t = _add(float(zp), _mul(recip, x))
            r = t if not math.isfinite(t) else math.copysign(math.floor(abs(t) + 0.5), t)
            out.append(_to_u8(r))
    return out


def _mace_adjust_range(lo: float, hi: float, non_zero: bool) -> tuple[float, int]:
    """AdjustRange<uint8_t> with every float operation rounded to binary32."""
    lo, hi = _rn32(lo), _rn32(hi)
    out_max, out_min = max(0.0, hi), min(0.0, lo)
    if non_zero:
        out_min = min(out_min, _add(lo, -_rn32(Fraction(_add(out_max, -lo)) / 254)))
    scale = _rn32(Fraction(_add(out_max, -out_min)) / 255)
    eps = _rn32(1e-6)
    if out_min < -eps and out_max > eps:
        qz = _rn32(Fraction(-out_min) / Fraction(scale))
        zp = int(math.copysign(math.floor(abs(qz) + 0.5), qz))
        if abs(_add(qz, -float(zp))) > eps and non_zero:
            zp = math.ceil(qz)
        return scale, zp
    return scale, (0 if out_min > -eps else 255)


def _crafted(scale: float, zp: int) -> np.ndarray:
    """Values whose x / s lands on, or one to three ulps around, every code's half-way point."""
    vals = []
    for k in range(-2, 258):
        half = np.float32((k - zp + 0.5) * np.float32(scale))
        up = down = half
        vals.append(half)
        for _ in range(3):
            up = np.nextafter(up, np.float32(np.inf), dtype=np.float32)
            down = np.nextafter(down, np.float32(-np.inf), dtype=np.float32)
            vals.extend([up, down])
        vals.append(np.float32((k - zp) * np.float32(scale)))  # exact codes
    return np.array(vals, dtype=np.float32)


SCALES = [(0.0235294122248888, 128), (0.1, 0), (1.0 / 255, 0), (0.05, 255), (0.0078125, 77), (2.3, 13)]


def _fused_body(values, scale: float, zp: int) -> list[int]:
    """What a fused multiply-add (one rounding of x * r + zp + 0.5) would give: not MACE's NEON."""
    recip = Fraction(_rn32(Fraction(1) / Fraction(_rn32(scale))))
    return [_to_u8(float(math.trunc(_rn32(Fraction(float(x)) * recip + Fraction(2 * zp + 1, 2))))) for x in values]


def test_quantize_matches_exact_transcription_on_halfway_points(loops):
    total = mismatches = differs_from_round = differs_from_fma = 0
    for scale, zp in SCALES:
        scale = float(np.float32(scale))
        vals = _crafted(scale, zp)
        for shift in (0, 5):  # realign so the crafted values also fall in the scalar tail
            x = np.concatenate([vals[shift:], vals[:shift], vals[:11]])
            got = quantize_neon(x, scale=scale, zero_point=zp)
            want = _mace_quantize(list(x), scale, zp)
            total += got.size
            mismatches += int((got != np.array(want, dtype=np.uint8)).sum())
            naive = np.clip(np.round(x.astype(np.float64) / scale) + zp, 0, 255).astype(np.uint8)
            differs_from_round += int((got != naive).sum())
            if shift == 0:
                body = x.size // 16 * 16
                differs_from_fma += int((got[:body] != np.array(_fused_body(x[:body], scale, zp))).sum())
    assert mismatches == 0
    assert total > 24_000
    # the crafted points separate MACE's arithmetic from round(x/s)+zp and from a fused multiply-add
    assert differs_from_round > 100
    assert differs_from_fma > 100


def test_quantize_random_specials_and_saturation(loops):
    rng = np.random.default_rng(501)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3e38, -3e38, 1e-45, -1e-45, 1e30], dtype=np.float32)
    for scale, zp in SCALES:
        scale = float(np.float32(scale))
        x = np.concatenate([rng.normal(0, 200 * scale, 997).astype(np.float32), specials, specials[:3]])
        got = quantize_neon(x, scale=scale, zero_point=zp)
        assert got.tolist() == _mace_quantize(list(x), scale, zp)
        assert np.array_equal(got, quantize_neon_ref(x, scale=scale, zero_point=zp))


def test_fast_equals_reference_all_sizes(loops):
    rng = np.random.default_rng(502)
    for size in list(range(0, 40)) + [255, 256, 1000]:
        x = rng.normal(0, 3, size).astype(np.float32)
        assert np.array_equal(quantize_neon(x, scale=0.03, zero_point=120),
                              quantize_neon_ref(x, scale=0.03, zero_point=120))
    x = _crafted(0.05, 255).reshape(-1, 2)
    assert np.array_equal(quantize_neon(x, scale=0.05, zero_point=255), quantize_neon_ref(x, scale=0.05, zero_point=255))


def test_adjust_range_matches_exact_transcription():
    rng = np.random.default_rng(503)
    pairs = [(-1.0, 1.0), (0.0, 6.0), (-6.0, 0.0), (0.0, 0.0), (-5e-7, 5e-7), (2.0, 3.0), (-3.0, -2.0),
             (-1e-6, 10.0), (-2e-6, 10.0), (-0.3, 2.7), (-127.5, 127.5), (-1.0, 254.0)]
    pairs += [tuple(sorted(rng.normal(0, 10, 2).tolist())) for _ in range(300)]
    pairs += [(float(-rng.uniform(0, 1e-3)), float(rng.uniform(0, 1e-3))) for _ in range(100)]
    for lo, hi in pairs:
        for non_zero in (False, True):
            got = adjust_range(lo, hi, non_zero=non_zero)
            want = _mace_adjust_range(lo, hi, non_zero)
            assert got == want, (lo, hi, non_zero)


def test_find_range_and_quantize_end_to_end(loops):
    rng = np.random.default_rng(504)
    x = rng.normal(0.3, 2.0, (1, 28, 28, 1)).astype(np.float32)
    x[0, 3, 4, 0] = np.nan  # skipped by std::max / std::min
    lo, hi = find_range(x)
    finite = x[~np.isnan(x)]
    assert (lo, hi) == (float(finite.min()), float(finite.max()))
    q, scale, zp = quantize(x)
    assert (scale, zp) == _mace_adjust_range(lo, hi, False)
    assert q.tolist() == np.array(_mace_quantize(list(x.ravel()), scale, zp), dtype=np.uint8).reshape(x.shape).tolist()
    with pytest.raises(MaceqError):
        find_range(np.zeros((0,), dtype=np.float32))


def _find_min_max_loop(values) -> tuple[float, float]:
    """FindMinMax's C++ loop on float32 values: std::min / std::max from (FLT_MAX, lowest())."""
    lo, hi = np.float32(np.finfo(np.float32).max), np.float32(-np.finfo(np.float32).max)
    for v in values:
        lo = v if v < lo else lo  # std::min(lo, v) keeps lo unless v < lo
        hi = v if hi < v else hi  # std::max(hi, v) keeps hi unless hi < v
    return float(lo), float(hi)


def test_find_range_compiled_equals_the_loop_signed_zeros_and_infinities(monkeypatch):
    """The compiled FindMinMax (numpy's vectorized min and max where they decide it, else the loop): equal to the
    C++ loop value for value and sign for sign (a zero's sign is the first zero's), with NaNs, infinities and
    all-NaN inputs; the loop ran exactly for the inputs with a NaN or a zero extreme."""
    from maceq.runtime.kernels import jit as k_jit

    real, calls = k_jit._find_range, Counter()
    monkeypatch.setattr(k_jit, "_find_range", lambda v: (calls.update(["loop"]), real(v))[1])
    rng = np.random.default_rng(505)
    inf, nan = np.inf, np.nan
    cases = [rng.normal(0.3, 2.0, 1000), [nan, 1.0, -2.0, nan], [nan] * 5, [inf, inf], [-inf, -inf],
             [inf, -inf, 3.0], [-0.0, 0.0, 1.0, 2.0], [0.0, -0.0, 1.0], [-3.0, 0.0, -0.0], [-3.0, -0.0, 0.0], [5.0], rng.uniform(0, 1, 99)]
    loop_cases = 0
    for case in cases:
        x = np.asarray(case, dtype=np.float32)
        want = _find_min_max_loop([np.float32(v) for v in x])
        got = k_jit.find_range(x)
        assert got == want and [math.copysign(1, v) for v in got] == [math.copysign(1, v) for v in want], case
        loop_cases += bool(np.isnan(x).any() or (x.size and (np.nanmin(x) == 0 or np.nanmax(x) == 0)))
    assert loop_cases == 6 and calls["loop"] == loop_cases


def test_dequantize_matches_tflite_and_exact_product():
    codes = np.arange(256, dtype=np.uint8).reshape(1, 1, 16, 16)
    for scale, zp in SCALES + [(3.0e-5, 200)]:
        scale = float(np.float32(scale))
        got = dequantize(codes, scale=scale, zero_point=zp)
        model = build_single_op_model("DEQUANTIZE", [TensorSpec(codes.shape, scale, zp)],
                                      [TensorSpec(codes.shape, None, None, dtype="float32")])
        (want,) = run_ref(model, [codes])
        assert got.dtype == np.float32
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
        exact = [_rn32(Fraction(scale) * (int(c) - zp)) for c in codes.ravel()]
        assert got.ravel().tolist() == exact
