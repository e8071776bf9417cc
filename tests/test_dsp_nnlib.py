"""dsp device (Hexagon nnlib) kernels: fast numpy kernels == scalar nnlib transcription, and the
transcription itself checked against exact rational arithmetic on hand-built cases.

Oracles: ``runtime/kernels/nnlib_ref.py`` (plain-int / explicit-binary32 transcription of
XiaoMi/nnlib's C) for bit-exactness; ``fractions.Fraction`` and numpy's IEEE binary32 for the
transcription's own primitives. Every equality test counts mismatching elements and asserts 0.
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from maceq.errors import MaceqError
from maceq.runtime.kernels import dsp
from maceq.runtime.kernels import nnlib_ref as r

INF = math.inf


# ----------------------------------------------------------------------------------------------
# Primitives against independent definitions
# ----------------------------------------------------------------------------------------------

def test_f32_from_fraction_matches_numpy_binary32():
    rng = np.random.default_rng(1)
    vals = np.concatenate([rng.normal(size=3000) * 10.0 ** rng.integers(-40, 39, 3000),
                           [1e-45, 7e-46, 3.4028235e38, 3.5e38, -1e-40, 0.1, 1 / 3]])
    with np.errstate(over="ignore"):
        bad = sum(r.f32_from_fraction(Fraction(float(v))) != float(np.float32(v)) for v in vals)
    assert bad == 0


def test_flt_div_255_is_correctly_rounded_division():
    """quantize.h claims its fused k1*x + k2*x is as accurate as x/255.0f: check vs the exact quotient."""
    rng = np.random.default_rng(2)
    xs = [r.f32(float(v)) for v in np.concatenate([rng.uniform(-1e4, 1e4, 4000), rng.uniform(1e-6, 1, 2000)])]
    xs += [255.0, 1.0, 255 / 16, 255 / 64, r.f32(11.9)]
    bad = sum(r.flt_div_255(x) != r.f32_from_fraction(Fraction(x) / 255) for x in xs)
    assert bad == 0


def test_float_to_int_conversions():
    # roundf_i32 = (int)(x + copysignf(0.5f, x)): the float add rounds, so 0.49999997f -> 1
    assert r.roundf_i32(r.f32(0.49999997)) == 1
    assert [r.roundf_i32(v) for v in (2.5, -2.5, 1.49, -0.5, 0.0)] == [3, -3, 1, -1, 0]
    assert [r.fast_roundf(v) for v in (2.5, 3.5, -2.5, -0.5, 1e10, -1e10)] == [2, 4, -2, 0, 2**31 - 1, -2**31]
    assert [r.c_roundf(v) for v in (2.5, -2.5, 0.49999997)] == [3.0, -3.0, 0.0]
    assert [r.roundf_u32(v) for v in (-3.0, 0.4, 0.5, 5e9)] == [0, 0, 1, 0xFFFFFFFF]
    assert r.c_trunc_i32(-7.9) == -7 and r.c_trunc_i32(3e9) == 2**31 - 1
    for v in (0.75, 1.0, 3.0e-3, 12345.678, 2.0 ** -100):
        m, e = math.frexp(r.f32(v))
        assert r.flt_getexp(r.f32(v)) == e and r.flt_getfrac(r.f32(v)) == r.f32(m)


def test_range_adjustment_rules():
    # quantize.c's own example: fixed min, -1.3 .. 10.6 (z = 27.857) -> min moves to -1.3074 (z = 28)
    mn, mx, code = r.adjust_minmax_for_zero_with_constraints(-1.3, 10.6, 1)
    assert code == 1 and mx == r.f32(10.6) and abs(mn + 1.3074) < 1e-4
    z = Fraction(-255) * Fraction(mn) / (Fraction(mx) - Fraction(mn))
    assert abs(z - 28) < Fraction(1, 2**14)
    rng = np.random.default_rng(3)
    for _ in range(300):
        lo, hi = -float(rng.uniform(0.01, 10)), float(rng.uniform(0.01, 10))
        ar = r.quantize_adjust_range(lo, hi)
        assert ar.minval <= r.f32(lo) and ar.maxval >= r.f32(hi)
        z = -Fraction(ar.minval) * 255 / (Fraction(ar.maxval) - Fraction(ar.minval))
        assert abs(z - round(z)) < Fraction(1, 2**12)
        for c in range(4):
            a, b, _ = r.adjust_minmax_for_zero_with_constraints(lo, hi, c)
            z = -Fraction(a) * 255 / (Fraction(b) - Fraction(a))
            assert abs(z - round(z)) < Fraction(1, 2**12)
        s, zp, a, b = r.mace_adjust_range_for_hexagon(lo, hi)
        assert 0 <= zp <= 255 and abs(a + zp * s) < 1e-12 and abs(b - (255 - zp) * s) < 1e-9
    assert dsp.quantize_adjust_range(0.0, 6.0)[:2] == (0.0, 6.0)
    assert dsp.quantize_adjust_range(0.0, 6.0)[3] == 0


# ----------------------------------------------------------------------------------------------
# Hand-built dyadic cases: every float step exact, so the C formula reduces to integers
# ----------------------------------------------------------------------------------------------
# x range [0, 255/16] (level 1/16, zero 0), w range [-2, 127/64] (level 1/64, zero 128),
# out level 1/1024, bias range +-2^21 over 2^32 levels (bias_mpy = 1). Output range [0, 255/256]:
# flat reference recip = 0xff0000 / 1020 = 16384 -> y = (s*16384 + 2^15) >> 16 = floor(s/4 + 1/2);
# d32 recip_val = 2^29 -> y = (s*2^29 + 2^30) >> 31 = floor(s/4 + 1/2); SuperFC scalef31 = 2^29.

DY = dict(x_min=0.0, x_max=255 / 16, w_min=-2.0, w_max=127 / 64, bias_min=-2.0**21, bias_max=2.0**21,
          out_min=0.0, out_max=255 / 256)


def _exact_conv(x, w, bias, before, strides, out_hw, w_zero):
    n, h, wd, c = x.shape
    kh, kw, _, o = w.shape
    out = np.zeros((n, *out_hw, o), dtype=object)
    for b in range(n):
        for i in range(out_hw[0]):
            for j in range(out_hw[1]):
                for oz in range(o):
                    s = int(bias[oz])
                    for fy in range(kh):
                        for fx in range(kw):
                            iy, ix = i * strides[0] - before[0] + fy, j * strides[1] - before[1] + fx
                            if 0 <= iy < h and 0 <= ix < wd:
                                s += sum(int(x[b, iy, ix, z]) * (int(w[fy, fx, z, oz]) - w_zero) for z in range(c))
                    out[b, i, j, oz] = s
    return out


def _half_up_quarter(s):
    return max(0, min(255, math.floor(Fraction(s, 4) + Fraction(1, 2))))


@pytest.mark.parametrize("variant", [dsp.SupernodeVariant.REF, dsp.SupernodeVariant.D32])
def test_supernode_dyadic_case_matches_exact_formula(variant):
    rng = np.random.default_rng(4)
    x = rng.integers(0, 256, (1, 5, 6, 3), dtype=np.uint8)
    w = rng.integers(0, 256, (3, 3, 3, 4), dtype=np.uint8)
    bias = rng.integers(-4000, 4000, 4)
    ref = r.supernode_ref if variant == dsp.SupernodeVariant.REF else r.supernode_d32_model_ref
    y, mn, mx = ref(x, w, bias, strides=(1, 2), padding="SAME", **DY)
    _, _, bh, bw = r._geometry((5, 6), (3, 3), (1, 2), r.Padding.SAME, op="t")
    exact = _exact_conv(x, w, bias, (bh, bw), (1, 2), y.shape[1:3], 128)
    want = np.vectorize(_half_up_quarter)(exact).astype(np.uint8)
    assert (mn, mx) == (0.0, 255 / 256)
    assert int(np.sum(y != want)) == 0
    ties = int(np.sum(np.vectorize(lambda s: s % 4 == 2)(exact)))
    sat = int(np.sum((want == 0) | (want == 255)))
    assert ties > 0 and sat > 0  # the case does exercise ties and saturation


def test_depthwise_and_fc_dyadic_cases_match_exact_formula():
    rng = np.random.default_rng(5)
    x = rng.integers(0, 256, (1, 6, 6, 4), dtype=np.uint8)
    w = rng.integers(0, 256, (3, 5, 4, 1), dtype=np.uint8)
    bias = rng.integers(-3000, 3000, 4)
    y, _, _ = r.depthwise_supernode_ref(x, w, bias, strides=(2, 1), padding="VALID", **DY)
    got = 0
    for ch in range(4):
        e = _exact_conv(x[..., ch:ch + 1], w[:, :, ch:ch + 1, :], bias[ch:ch + 1], (0, 0), (2, 1), y.shape[1:3], 128)
        got += int(np.sum(y[..., ch:ch + 1] != np.vectorize(_half_up_quarter)(e).astype(np.uint8)))
    assert got == 0
    xf = rng.integers(0, 256, (3, 20), dtype=np.uint8)
    wf = rng.integers(0, 256, (20, 6), dtype=np.uint8)
    bf = rng.integers(-3000, 3000, 6)
    yf, mn, mx = r.superfc_ref(xf, wf, bf, **DY)
    e = (xf.astype(object) @ (wf.astype(object) - 128)) + bf.astype(object)
    assert int(np.sum(yf != np.vectorize(_half_up_quarter)(e).astype(np.uint8))) == 0
    assert (mn, mx) == (0.0, 255 / 256)


def test_add_first_stage_is_floor_of_scaled_sum_and_output_is_close_to_ideal():
    rng = np.random.default_rng(6)
    a, b = np.meshgrid(np.arange(256), np.arange(256), indexing="ij")
    for trial in range(6):
        rng_a = (-float(rng.uniform(0.1, 4)), float(rng.uniform(0.1, 4)))
        rng_b = (-float(rng.uniform(0.1, 4)), float(rng.uniform(0.1, 4)))
        out = (rng_a[0] + rng_b[0], rng_a[1] + rng_b[1])
        subtract = trial % 2 == 1
        if subtract:
            out = (rng_a[0] - rng_b[1], rng_a[1] - rng_b[0])
        out = dsp.mace_adjust_range_for_hexagon(*out)[:2]
        za, sa = r.get_qu8_level_size_zero(r.f32(rng_a[0]), r.f32(rng_a[1]))
        zb, sb = r.get_qu8_level_size_zero(r.f32(rng_b[0]), r.f32(rng_b[1]))
        omin, omax, _ = r.adjust_minmax_for_zero_with_constraints(out[0], out[1], 3)
        sp = r.set_addsub_scaling(omin, omax, (za, zb), (sa, sb), subtract=subtract, fixed_range=True)
        if not sp.underrange:
            bad = sum(r.addsub_first_stage(int(i), int(j), sp) != (int(i) * sp.a_scale + int(j) * sp.b_scale) // 256
                      for i, j in zip(a.ravel()[::7], b.ravel()[::7]))
            assert bad == 0
        y, mn, mx = dsp.quantized_sub(a.astype(np.uint8), b.astype(np.uint8), a_min=rng_a[0], a_max=rng_a[1],
                                      b_min=rng_b[0], b_max=rng_b[1], out_min=out[0], out_max=out[1]) if subtract \
            else dsp.quantized_add(a.astype(np.uint8), b.astype(np.uint8), a_min=rng_a[0], a_max=rng_a[1],
                                   b_min=rng_b[0], b_max=rng_b[1], out_min=out[0], out_max=out[1])
        real = (a - za) * sa + (-1 if subtract else 1) * (b - zb) * sb
        ideal = np.clip(np.round((real - mn) / ((mx - mn) / 255)), 0, 255)
        assert np.abs(y.astype(int) - ideal).max() <= 1


def test_dequantize_rounds_the_exact_product_half_up():
    for lo, hi in [(-1.3, 2.7), (0.0, 6.0), (-100.0, 0.5), (-3e-3, 1e-2), (-7.0, 7.0)]:
        step, qz = r.dequantize_step_zero(lo, hi)
        got = dsp.dequantize(np.arange(256, dtype=np.uint8), min=lo, max=hi)
        bad = 0
        for q in range(256):
            v = abs(Fraction(q - qz) * Fraction(step))
            if v == 0:
                want = 0.0
            else:
                e = v.numerator.bit_length() - v.denominator.bit_length()
                if Fraction(2) ** e > v:
                    e -= 1
                m = math.floor(v * Fraction(2) ** (23 - e) + Fraction(1, 2))  # half up on the magnitude
                want = math.copysign(float(Fraction(m) * Fraction(2) ** (e - 23)), q - qz)
            bad += float(got[q]) != want
        assert bad == 0


def test_pool_and_concat_hand_cases():
    x = np.arange(256, dtype=np.uint8).reshape(1, 16, 16, 1)
    y, _, _ = dsp.quantized_avgpool(x, x_min=0, x_max=1, kernel=(1, 1), strides=(1, 1), padding="VALID")
    assert np.array_equal(y, x)  # count 1 -> sath(0x8000) = 32767: (x*32767 + 2^14) >> 15 == x
    x3 = np.array([[[[1], [4], [5]]]], dtype=np.uint8)
    assert dsp.quantized_avgpool(x3, x_min=0, x_max=1, kernel=(1, 3), strides=(1, 1), padding="VALID")[0][0, 0, 0, 0] \
        == (10 * (0x8000 // 3) + 0x4000) >> 15
    same = [np.full((1, 2, 2, 2), 255, np.uint8), np.full((1, 2, 2, 1), 7, np.uint8)]
    yc, mn, mx = dsp.quantized_concat(same, axis=3, in_ranges=[(-1, 2), (-1, 2)])
    assert (mn, mx) == (-1.0, 2.0) and yc[0, 0, 0, 1] == 255 and yc[0, 0, 0, 2] == 7  # unity gain: copied


# ----------------------------------------------------------------------------------------------
# Randomised: fast kernels == scalar transcription on every element
# ----------------------------------------------------------------------------------------------

def _rand_range(rng, *, allow_positive=True):
    kind = rng.integers(0, 4)
    if kind == 0 and allow_positive:
        return 0.0, float(rng.uniform(0.05, 8))
    if kind == 1:
        return -float(10 ** rng.uniform(-3, 2)), float(10 ** rng.uniform(-3, 2))  # extreme ratios
    lo, hi = -float(rng.uniform(0.05, 5)), float(rng.uniform(0.05, 5))
    if kind == 2:
        return lo, hi  # unadjusted: nnlib's own zero handling applies
    return dsp.mace_adjust_range_for_hexagon(lo, hi)[:2]


def _out_range(rng):
    k = rng.integers(0, 7)
    if k == 0:
        return -INF, INF
    if k == 1:
        return 0.0, INF
    if k == 2:
        return -INF, float(rng.uniform(0.5, 8))
    if k == 3:
        return 0.0, float(rng.uniform(0.01, 0.3))  # saturating
    if k == 4:
        return -float(rng.uniform(50, 500)), float(rng.uniform(50, 500))  # coarse
    return dsp.mace_adjust_range_for_hexagon(-float(rng.uniform(0.1, 8)), float(rng.uniform(0.1, 8)))[:2]


def _same(a, b):
    """(mismatching elements, ranges equal)."""
    ya, *ra = a
    yb, *rb = b
    assert ya.shape == yb.shape and ya.dtype == yb.dtype
    return int(np.sum(ya != yb)), all(float(p) == float(q) for p, q in zip(ra, rb))


class _Tally:
    """Mismatching elements and mismatching output ranges over many (scalar, fast) result pairs."""

    def __init__(self):
        self.mismatches = self.bad_ranges = self.elements = 0

    def add(self, want, got):
        m, ok = _same(want, got)
        self.mismatches += m
        self.bad_ranges += not ok
        self.elements += want[0].size

    def counts(self):
        return self.mismatches, self.bad_ranges


def _conv_case(rng, *, depthwise):
    n = int(rng.integers(1, 3))
    h, w = (int(v) for v in rng.integers(3, 8, 2))
    c = int(rng.integers(1, 5))
    if depthwise:
        kh, kw = int(rng.integers(2, 4)), int(rng.choice([3, 5]))
        wt = rng.integers(0, 256, (kh, kw, c, 1), dtype=np.uint8)
        o = c
        strides = (int(rng.integers(1, 4)), int(rng.integers(1, 3)))
    else:
        kh, kw = (int(v) for v in rng.integers(1, 4, 2))
        o = int(rng.integers(1, 5))
        wt = rng.integers(0, 256, (kh, kw, c, o), dtype=np.uint8)
        strides = tuple(int(v) for v in rng.integers(1, 4, 2))
    padding = ["SAME", "VALID", "SAME_CAFFE"][int(rng.integers(0, 3))]
    if padding == "VALID" and (kh > h or kw > w):
        padding = "SAME"
    x = rng.integers(0, 256, (n, h, w, c), dtype=np.uint8)
    if rng.random() < 0.3:
        x[..., 0] = 0  # constant channels: exact zero-point terms
    x_min, x_max = _rand_range(rng)
    w_min, w_max = _rand_range(rng, allow_positive=False)
    if rng.random() < 0.2:
        bias, b_min, b_max = np.zeros(o, np.int32), 0.0, 0.0  # MACE's add_bias (range 0..0)
    else:
        bias, b_min, b_max = dsp.mace_quantize_bias(rng.normal(size=o) * float(10 ** rng.uniform(-2, 1)))
    out_min, out_max = _out_range(rng)
    return x, wt, bias, dict(x_min=x_min, x_max=x_max, w_min=w_min, w_max=w_max, bias_min=b_min, bias_max=b_max,
                             out_min=out_min, out_max=out_max, strides=strides, padding=padding)


def test_supernode_ref_fast_equals_scalar():
    rng = np.random.default_rng(10)
    tally = _Tally()
    for i in range(60):
        x, w, bias, kw = _conv_case(rng, depthwise=False)
        quirk = i % 4 == 3
        tally.add(r.supernode_ref(x, w, bias, ref_pad_quirk=quirk, **kw),
                  dsp.supernode(x, w, bias, ref_pad_quirk=quirk, **kw))
    assert tally.counts() == (0, 0) and tally.elements > 1500


def test_supernode_d32_fast_equals_scalar():
    rng = np.random.default_rng(11)
    tally = _Tally()
    for _ in range(30):
        x, w, bias, kw = _conv_case(rng, depthwise=False)
        tally.add(r.supernode_d32_model_ref(x, w, bias, **kw),
                  dsp.supernode(x, w, bias, variant=dsp.SupernodeVariant.D32, **kw))
    assert tally.counts() == (0, 0)


def test_depthwise_fast_equals_scalar():
    rng = np.random.default_rng(12)
    tally = _Tally()
    for _ in range(40):
        x, w, bias, kw = _conv_case(rng, depthwise=True)
        tally.add(r.depthwise_supernode_ref(x, w, bias, **kw), dsp.depthwise_supernode(x, w, bias, **kw))
    assert tally.counts() == (0, 0)


def test_relu_is_expressed_through_the_output_range():
    rng = np.random.default_rng(13)
    x, w, bias, kw = _conv_case(rng, depthwise=False)
    kw.update(out_min=-2.0, out_max=9.0)
    y, mn, mx = dsp.supernode(x, w, bias, relu=("relux", 6.0), **kw)
    kw.update(out_min=0.0, out_max=6.0)
    assert _same((y, mn, mx), r.supernode_ref(x, w, bias, **kw)) == (0, True)
    kw.update(out_min=-INF, out_max=INF)
    assert dsp.supernode(x, w, bias, relu="relu", **kw)[1] == 0.0


def test_superfc_fast_equals_scalar():
    rng = np.random.default_rng(14)
    tally = _Tally()
    for _ in range(40):
        n, k, o = int(rng.integers(1, 4)), int(rng.integers(1, 60)), int(rng.integers(1, 9))
        x = rng.integers(0, 256, (n, k), dtype=np.uint8)
        w = rng.integers(0, 256, (k, o), dtype=np.uint8)
        bias, b_min, b_max = dsp.mace_quantize_bias(rng.normal(size=o) * float(10 ** rng.uniform(-2, 1)))
        out_min, out_max = _out_range(rng)
        kw = dict(x_min=_rand_range(rng)[0], x_max=_rand_range(rng)[1], w_min=_rand_range(rng, allow_positive=False)[0],
                  w_max=float(rng.uniform(0.1, 2)), bias_min=b_min, bias_max=b_max, out_min=out_min, out_max=out_max)
        tally.add(r.superfc_ref(x, w, bias, **kw), dsp.superfc(x, w, bias, **kw))
    assert tally.counts() == (0, 0)


def test_add_sub_fast_equals_scalar_on_all_pairs():
    rng = np.random.default_rng(15)
    a, b = (g.astype(np.uint8).reshape(1, 256, 256, 1) for g in np.meshgrid(np.arange(256), np.arange(256),
                                                                             indexing="ij"))
    configs = [  # (a range, b range, out range, subtract)
        ((-1.0, 1.0), (-2.0, 0.5), (-3.0, 1.5), False),
        ((-1.0, 1.0), (-0.5, 0.5), (-0.01, 0.02), False),  # fixed tiny out range: underrange path
        ((-0.02, 0.03), (-0.01, 0.01), (-0.001, 0.002), False),
        ((-1.0, 1.0), (-2.0, 0.5), (-INF, INF), False),  # self-found range, one rerun
        ((0.0, 6.0), (-1.0, 3.0), (-4.0, 7.0), True),
    ]
    tally = _Tally()
    for ra, rb, ro, sub in configs:
        kw = dict(a_min=ra[0], a_max=ra[1], b_min=rb[0], b_max=rb[1], out_min=ro[0], out_max=ro[1])
        fast = dsp.quantized_sub(a, b, **kw) if sub else dsp.quantized_add(a, b, **kw)
        tally.add(r.quantized_addsub_ref(a, b, subtract=sub, **kw), fast)
    assert tally.counts() == (0, 0)
    za, sa = r.get_qu8_level_size_zero(-1.0, 1.0)
    zb, sb = r.get_qu8_level_size_zero(-0.5, 0.5)
    assert r.set_addsub_scaling(*r.adjust_minmax_for_zero_with_constraints(-0.01, 0.02, 3)[:2], (za, zb), (sa, sb),
                                subtract=False, fixed_range=True).underrange


def test_add_sub_fast_equals_scalar_random_configs():
    rng = np.random.default_rng(16)
    tally = _Tally()
    for i in range(40):
        shape = (1, int(rng.integers(1, 9)), int(rng.integers(1, 9)), int(rng.integers(1, 9)))
        a = rng.integers(0, 256, shape, dtype=np.uint8)
        b = rng.integers(0, 256, shape, dtype=np.uint8)
        ra, rb = _rand_range(rng), _rand_range(rng)
        k = rng.integers(0, 4)
        ro = [(-INF, INF), (0.0, INF), (-INF, float(rng.uniform(0.5, 5))),
              dsp.mace_adjust_range_for_hexagon(ra[0] + rb[0], ra[1] + rb[1])[:2]][int(k)]
        kw = dict(a_min=ra[0], a_max=ra[1], b_min=rb[0], b_max=rb[1], out_min=ro[0], out_max=ro[1])
        sub = i % 3 == 0
        try:
            want = r.quantized_addsub_ref(a, b, subtract=sub, **kw)
        except MaceqError:
            with pytest.raises(MaceqError):
                dsp.quantized_sub(a, b, **kw) if sub else dsp.quantized_add(a, b, **kw)
            continue
        tally.add(want, dsp.quantized_sub(a, b, **kw) if sub else dsp.quantized_add(a, b, **kw))
    assert tally.counts() == (0, 0)


def test_concat_and_pools_fast_equal_scalar():
    rng = np.random.default_rng(17)
    tally = _Tally()
    for _ in range(20):
        n, h, w = 1, int(rng.integers(1, 6)), int(rng.integers(1, 6))
        parts = [rng.integers(0, 256, (n, h, w, int(rng.integers(1, 5))), dtype=np.uint8)
                 for _ in range(int(rng.integers(1, 4)))]
        rngs = [_rand_range(rng) for _ in parts]
        if rng.random() < 0.3:
            rngs = [rngs[0]] * len(parts)  # unity gain: the asm copy shortcut
        tally.add(r.concat_ref(parts, axis=3, in_ranges=rngs), dsp.quantized_concat(parts, axis=3, in_ranges=rngs))
    for _ in range(30):
        x = rng.integers(0, 256, (int(rng.integers(1, 3)), int(rng.integers(2, 9)), int(rng.integers(2, 9)),
                                  int(rng.integers(1, 4))), dtype=np.uint8)
        kernel = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
        strides = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
        padding = ["SAME", "VALID", "SAME_CAFFE"][int(rng.integers(0, 3))]
        kw = dict(x_min=-1.0, x_max=2.0, kernel=kernel, strides=strides, padding=padding)
        if padding == "VALID" and (kernel[0] > x.shape[1] or kernel[1] > x.shape[2]):
            with pytest.raises(MaceqError):
                dsp.quantized_maxpool(x, **kw)
            continue
        for ref, fast in ((r.maxpool_ref, dsp.quantized_maxpool), (r.avgpool_ref, dsp.quantized_avgpool)):
            tally.add(ref(x, **kw), fast(x, **kw))
    assert tally.counts() == (0, 0)


def test_quantize_dequantize_fast_equal_scalar():
    rng = np.random.default_rng(18)
    tally = _Tally()
    for i in range(25):
        scale = float(10 ** rng.uniform(-4, 3))
        x = (rng.normal(size=int(rng.integers(1, 400))) * scale).astype(np.float32)
        if i % 5 == 0:
            x = np.abs(x)  # no negatives: min = -0.0 path
        if i % 7 == 0:
            x[: len(x) // 2] = 0.0
        tally.add(r.quantize_input_ref(x), dsp.quantize_input(x))
        lo, hi = -float(rng.uniform(0.01, 3)) * scale, float(rng.uniform(0.01, 3)) * scale
        tally.add(r.quantize_ref(x, min=lo, max=hi), dsp.quantize(x, min=lo, max=hi))
        q = rng.integers(0, 256, 300, dtype=np.uint8)
        tally.add((r.dequantize_ref(q, min=lo, max=hi).view(np.uint32),),
                  (dsp.dequantize(q, min=lo, max=hi).view(np.uint32),))
    assert tally.counts() == (0, 0)
    # the quantizer is close to round((x - min)/step): within one code
    x = (rng.normal(size=1000) * 3).astype(np.float32)
    q, mn, mx = dsp.quantize_input(x)
    assert np.abs(q.astype(float) - np.clip(np.round((x - mn) / ((mx - mn) / 255)), 0, 255)).max() <= 1


# ----------------------------------------------------------------------------------------------
# What nnlib rejects
# ----------------------------------------------------------------------------------------------

def test_rejected_configurations_are_reported():
    assert dsp.supports_conv(strides=(1, 1), dilations=(1, 1), pads="SAME", kernel=(3, 3)) == (True, "")
    assert not dsp.supports_conv(strides=(1, 1), dilations=(2, 2), pads="SAME", kernel=(3, 3))[0]
    assert not dsp.supports_conv(strides=(1, 1), dilations=(1, 1), pads="NA", kernel=(3, 3))[0]
    ok, why = dsp.supports_conv(strides=(1, 1), dilations=(1, 1), pads=(1, 1, 1, 1), kernel=(3, 3), in_hw=(8, 8))
    assert ok, why
    # TF-style SAME for an even input with stride 2: (0, 0, 1, 1) is SAME, not SAME_CAFFE
    assert dsp.padding_for_pads(in_hw=(8, 8), kernel=(3, 3), strides=(2, 2), pads=(0, 0, 1, 1)) == dsp.Padding.SAME
    assert dsp.padding_for_pads(in_hw=(8, 8), kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1)) \
        == dsp.Padding.SAME_CAFFE
    assert not dsp.supports_conv(strides=(1, 1), dilations=(1, 1), pads=(2, 0, 0, 0), kernel=(3, 3), in_hw=(8, 8))[0]
    for kernel, strides, mult in (((3, 1), (1, 1), 1), ((1, 3), (1, 1), 1), ((3, 4), (1, 1), 1),
                                  ((3, 3), (1, 3), 1), ((3, 3), (1, 1), 2), ((3, 9), (1, 1), 1)):
        ok, why = dsp.supports_conv(strides=strides, dilations=(1, 1), pads="SAME", kernel=kernel, depthwise=True,
                                    depth_multiplier=mult)
        assert not ok and why
    x = np.zeros((1, 4, 4, 2), np.uint8)
    with pytest.raises(MaceqError):
        dsp.depthwise_supernode(x, np.zeros((3, 2, 2, 1), np.uint8), [0, 0], x_min=0, x_max=1, w_min=-1, w_max=1,
                                bias_min=0, bias_max=0, strides=(1, 1), padding="SAME")
    with pytest.raises(MaceqError):
        dsp.quantized_concat([x, x], axis=2, in_ranges=[(0, 1), (0, 1)])
    with pytest.raises(MaceqError):
        dsp.quantized_add(x, x[:, :1], a_min=0, a_max=1, b_min=0, b_max=1)
    with pytest.raises(MaceqError):
        dsp.quantized_maxpool(x, x_min=0, x_max=1, kernel=(2, 2), strides=(1, 1), padding="NA")


def test_layout_converters():
    w = np.arange(2 * 3 * 3 * 4).reshape(2, 3, 3, 4)  # OHWI
    assert dsp.ohwi_to_hwio(w)[1, 2, 3, 1] == w[1, 1, 2, 3]
    fc = np.arange(5 * 2 * 2 * 3).reshape(5, 2, 2, 3)
    assert dsp.fc_weight_to_dsp(fc).shape == (12, 5) and dsp.fc_weight_to_dsp(fc)[7, 4] == fc.reshape(5, 12)[4, 7]
    q, mn, mx = dsp.mace_quantize_bias([0.5, -2.0, 1.0])
    assert (mn, mx) == (-2.0, 2.0) and q[1] == -(2**31)
