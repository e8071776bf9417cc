"""dsp device (Hexagon nnlib) kernels: fast numpy kernels == scalar nnlib transcription, and the
transcription itself checked against exact rational arithmetic on hand-built cases.

Oracles: ``runtime/kernels/nnlib_ref.py`` (plain-int / explicit-binary32 transcription of
XiaoMi/nnlib's C) for bit-exactness; ``fractions.Fraction`` and numpy's IEEE binary32 for the
transcription's own primitives. Every equality test counts mismatching elements and asserts 0.
"""
from __future__ import annotations

import functools
import math
from fractions import Fraction

import numpy as np
import pytest

from maceq.errors import MaceqError
from maceq.quant import converter as qc
from maceq.runtime.kernels import cfloat, dsp
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
        bad = sum(cfloat.f32_from_fraction(Fraction(float(v))) != float(np.float32(v)) for v in vals)
    assert bad == 0


def test_flt_div_255_is_correctly_rounded_division():
    """quantize.h claims its fused k1*x + k2*x is as accurate as x/255.0f: check vs the exact quotient."""
    rng = np.random.default_rng(2)
    xs = [r.f32(float(v)) for v in np.concatenate([rng.uniform(-1e4, 1e4, 4000), rng.uniform(1e-6, 1, 2000)])]
    xs += [255.0, 1.0, 255 / 16, 255 / 64, r.f32(11.9)]
    bad = sum(r.flt_div_255(x) != cfloat.f32_from_fraction(Fraction(x) / 255) for x in xs)
    assert bad == 0


def test_float_to_int_conversions():
    # roundf_i32 = (int)(x + copysignf(0.5f, x)): the float add rounds, so 0.49999997f -> 1
    assert r.roundf_i32(r.f32(0.49999997)) == 1
    assert [r.roundf_i32(v) for v in (2.5, -2.5, 1.49, -0.5, 0.0)] == [3, -3, 1, -1, 0]
    assert [r.fast_roundf(v) for v in (2.5, 3.5, -2.5, -0.5, 1e10, -1e10)] == [2, 4, -2, 0, 2**31 - 1, -2**31]
    assert [cfloat.c_roundf(v) for v in (2.5, -2.5, 0.49999997)] == [3.0, -3.0, 0.0]
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
        a, b, s, zp = qc.mace_adjust_range_for_hexagon(lo, hi)
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
        out = qc.mace_adjust_range_for_hexagon(*out)[:2]
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
    # flat op (op_avgpool.c): (sum*sath(0x8000/n) + 0x4000) >> 15
    x3 = np.array([[[[1], [4], [5]]]], dtype=np.uint8)
    assert r.avgpool_ref(x3, x_min=0, x_max=1, kernel=(1, 3), strides=(1, 1), padding="VALID")[0][0, 0, 0, 0] \
        == (10 * (0x8000 // 3) + 0x4000) >> 15
    # the d32 op nnlib runs: a 1x1 output (avgpool_reduce_to_1x1). In units rdiff = 1/765 the sum
    # is 10 and in_zero 0; the range [0, 10*rdiff] is below 255.1*rdiff, so it widens to
    # [0, 255.1/765]; scale = rdiff*255/range ~ 0.9996 (rsh 0, fac 32755), offset 0:
    # y = ((2*10*32755*2 + 0x8000) >> 16 + 1) >> 1 = 10.
    y, mn, mx = dsp.quantized_avgpool(x3, x_min=0, x_max=1, kernel=(1, 3), strides=(1, 1), padding="VALID")
    assert y[0, 0, 0, 0] == 10 and mn == 0.0 and abs(mx - 255.1 / 765) < 1e-6
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
    return qc.mace_adjust_range_for_hexagon(lo, hi)[:2]


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
    return qc.mace_adjust_range_for_hexagon(-float(rng.uniform(0.1, 8)), float(rng.uniform(0.1, 8)))[:2]


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
        bias, b_min, b_max = qc.mace_quantize_bias(rng.normal(size=o) * float(10 ** rng.uniform(-2, 1)))
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
    """All three nodes nnlib runs for Supernode_8x8p32to8: _d32, InputSupernode, the flat op."""
    rng = np.random.default_rng(11)
    tally = _Tally()
    nodes = set()
    for i in range(40):
        x, w, bias, kw = _conv_case(rng, depthwise=False)
        if i % 3 == 0:  # deeper inputs: Supernode_8x8p32to8_d32 (depth padded to 32)
            x = np.concatenate([x] * 3, axis=3)[..., :9]
            w = rng.integers(0, 256, (*w.shape[:2], 9, w.shape[3]), dtype=np.uint8)
        node = r.supernode_node(x.shape[3], kw["strides"][1])
        nodes.add(node.name if node else "flat")
        try:
            want = r.supernode_d32_ref(x, w, bias, **kw)
        except MaceqError:
            with pytest.raises(MaceqError):
                dsp.supernode(x, w, bias, variant=dsp.SupernodeVariant.D32, **kw)
            continue
        tally.add(want, dsp.supernode(x, w, bias, variant=dsp.SupernodeVariant.D32, **kw))
    assert tally.counts() == (0, 0)
    assert nodes == {"Supernode_8x8p32to8_d32", "InputSupernode_8x8p32to8_outd32", "flat"}


def test_d32_nodes_keep_their_first_pass_and_take_codes_from_the_tiles(monkeypatch):
    """A pointwise Supernode_8x8p32to8_d32 and a DepthwiseSupernode run twice on the same filter, as a model's node
    runs on every image: equal to the scalar reference each time, over open, half-open and fixed output ranges (the
    open ones retry). The second run takes the kept first pass (one range set-up fewer); the pointwise node takes its
    codes from the integer tiles without keeping sums wherever the CPU has them, the depthwise node from its compiled
    sums wherever numba runs, and it finds the sums at its discarded columns only where an open range needs them."""
    from maceq.runtime.kernels import intgemm, jit

    rng = np.random.default_rng(13)
    setups, codes = [], []
    real_setup, real_codes, real_dw = r.setup_initial_output_range, intgemm.dsp_pointwise, jit.dsp_dw_codes
    monkeypatch.setattr(r, "setup_initial_output_range", lambda *a: setups.append(1) or real_setup(*a))
    monkeypatch.setattr(intgemm, "dsp_pointwise", lambda *a: codes.append("pointwise") or real_codes(*a))
    monkeypatch.setattr(jit, "dsp_dw_codes", lambda *a: codes.append("depthwise") or real_dw(*a))
    junk, real_junk = [], jit.dsp_junk_sums
    monkeypatch.setattr(jit, "dsp_junk_sums", lambda *a: junk.append(1) or real_junk(*a))
    tiles = intgemm.available() and jit.gemm_available()
    tally, retried = _Tally(), []
    ranges = [(-INF, INF), (0.0, INF), (-INF, 2.0), qc.mace_adjust_range_for_hexagon(-3.0, 5.0)[:2], (0.0, 0.2)]
    for out_min, out_max in ranges:
        for depthwise in (False, True):
            c, o = (40, 40) if depthwise else (40, 33)
            x = rng.integers(0, 256, (1, 5, 7, c), dtype=np.uint8)
            w = rng.integers(0, 256, (3, 3, c, 1) if depthwise else (1, 1, c, o), dtype=np.uint8)
            bias, b_min, b_max = qc.mace_quantize_bias(rng.normal(size=o))
            kw = dict(x_min=-1.0, x_max=3.0, w_min=-0.5, w_max=0.7, bias_min=b_min, bias_max=b_max, out_min=out_min,
                      out_max=out_max, strides=(1, 1), padding="SAME" if depthwise else "VALID")
            ref, fast = ((r.depthwise_supernode_ref, dsp.depthwise_supernode) if depthwise else
                         (r.supernode_d32_ref, functools.partial(dsp.supernode, variant=dsp.SupernodeVariant.D32)))
            want = ref(x, w, bias, **kw)
            counts = []
            for _ in range(2):
                setups.clear()
                codes.clear()
                junk.clear()
                tally.add(want, fast(x, w, bias, **kw))
                if depthwise and jit.available():  # the discarded columns' sums only where the range is open
                    assert bool(junk) == (not (math.isfinite(out_min) and math.isfinite(out_max)))
                counts.append(len(setups))
                assert set(codes) == ({"depthwise"} if jit.available() else set()) if depthwise else \
                    ({"pointwise"} if tiles else set())
            assert counts[1] == counts[0] - 1, (out_min, out_max, depthwise, counts)
            retried.append(counts[1] > 0)
    assert tally.counts() == (0, 0) and tally.elements > 2000
    assert any(retried) and not all(retried)


def test_node_calls_run_every_input_of_their_shape():
    """supernode_call / depthwise_supernode_call prepare a node once for an input shape (runtime/ops_dsp.py keeps one
    per op, input shape and ranges): every later input of that shape gives the scalar reference's codes and range,
    over open ranges (which retry), a half-open and a fixed one; an input of another shape is refused."""
    rng = np.random.default_rng(17)
    tally = _Tally()
    ranges = [(-INF, INF), (0.0, INF), qc.mace_adjust_range_for_hexagon(-3.0, 5.0)[:2]]
    for out_min, out_max in ranges:
        for depthwise, c, o, hw in ((False, 40, 33, (5, 7)), (False, 3, 8, (6, 5)), (True, 40, 40, (5, 7))):
            w = rng.integers(0, 256, (3, 3, c, 1) if depthwise else (1 if c > 4 else 3, 1 if c > 4 else 3, c, o),
                             dtype=np.uint8)
            bias, b_min, b_max = qc.mace_quantize_bias(rng.normal(size=o))
            kw = dict(x_min=-1.0, x_max=3.0, w_min=-0.5, w_max=0.7, bias_min=b_min, bias_max=b_max, out_min=out_min,
                      out_max=out_max, strides=(1, 1), padding="SAME" if depthwise or c < 4 else "VALID")
            make, ref = ((dsp.depthwise_supernode_call, r.depthwise_supernode_ref) if depthwise else
                         (functools.partial(dsp.supernode_call, variant=dsp.SupernodeVariant.D32), r.supernode_d32_ref))
            x = rng.integers(0, 256, (1, *hw, c), dtype=np.uint8)
            call = make(x, w, bias, **kw)
            for _ in range(3):
                x = rng.integers(0, 256, x.shape, dtype=np.uint8)
                tally.add(ref(x, w, bias, **kw), call(x))
            with pytest.raises(MaceqError, match="made for uint8 input"):
                call(x[:, :-1])
    assert tally.counts() == (0, 0) and tally.elements > 5000


def test_depthwise_fast_equals_scalar():
    rng = np.random.default_rng(12)
    tally = _Tally()
    for i in range(40):
        x, w, bias, kw = _conv_case(rng, depthwise=True)
        if i % 4 == 0:  # 40 channels, 3x3: junk columns reading the next slice's depth-padding lanes
            x = rng.integers(0, 256, (1, 3, 8, 40), dtype=np.uint8)
            w = rng.integers(0, 256, (3, 3, 40, 1), dtype=np.uint8)
            bias, kw["bias_min"], kw["bias_max"] = qc.mace_quantize_bias(rng.normal(size=40))
            kw.update(strides=(1, 2), padding="SAME", out_min=-INF, out_max=INF)
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
        bias, b_min, b_max = qc.mace_quantize_bias(rng.normal(size=o) * float(10 ** rng.uniform(-2, 1)))
        out_min, out_max = _out_range(rng)
        kw = dict(x_min=_rand_range(rng)[0], x_max=_rand_range(rng)[1], w_min=_rand_range(rng, allow_positive=False)[0],
                  w_max=float(rng.uniform(0.1, 2)), bias_min=b_min, bias_max=b_max, out_min=out_min, out_max=out_max)
        tally.add(r.superfc_ref(x, w, bias, **kw), dsp.superfc(x, w, bias, variant=dsp.SuperFCVariant.REF, **kw))
    assert tally.counts() == (0, 0)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "float64"])
def test_superfc_hvx_fast_equals_scalar(compiled, monkeypatch):
    """SuperFC's sums in int32 by jit.fc_sums (1-3 rows), on the integer tiles (from 4 rows, where the CPU has them)
    and by the float64 GEMM, each equal to the scalar reference; the calls of the compiled paths counted."""
    from maceq.runtime.kernels import intgemm, jit

    calls = []
    real_tiles, real_fc = intgemm.pointwise_sums, jit.fc_sums
    monkeypatch.setattr(intgemm, "pointwise_sums", lambda *a: calls.append("tiles") or real_tiles(*a))
    monkeypatch.setattr(jit, "fc_sums", lambda *a: calls.append("rows") or real_fc(*a))
    if not compiled:
        monkeypatch.setattr(dsp, "_packed", lambda *a: None)
        monkeypatch.setattr(jit, "available", lambda: False)
    rng = np.random.default_rng(24)
    tally = _Tally()
    for _ in range(30):
        n, k, o = int(rng.integers(1, 7)), int(rng.choice([32, 48, 64, 96])), int(rng.integers(1, 40))
        x = rng.integers(0, 256, (n, k), dtype=np.uint8)
        w = rng.integers(0, 256, (k, o), dtype=np.uint8)
        bias, b_min, b_max = qc.mace_quantize_bias(rng.normal(size=o) * float(10 ** rng.uniform(-2, 1)))
        out_min, out_max = _out_range(rng)
        x_min, x_max = _rand_range(rng)
        kw = dict(x_min=min(x_min, -0.01), x_max=x_max, w_min=_rand_range(rng, allow_positive=False)[0],
                  w_max=float(rng.uniform(0.1, 2)), bias_min=b_min, bias_max=b_max, out_min=out_min, out_max=out_max)
        tally.add(r.superfc_hvx_ref(x, w, bias, **kw), dsp.superfc(x, w, bias, **kw))
    assert tally.counts() == (0, 0)
    # (with VNNI, a filter of fewer than intgemm.MIN_ENTRIES entries takes the float64 GEMM)
    tiles = compiled and intgemm.available() and jit.gemm_available()
    assert ("rows" in calls, "tiles" in calls) == (compiled, tiles) and (compiled or not calls)
    x = np.zeros((1, 40), np.uint8)
    with pytest.raises(MaceqError):  # superfc_recalculate_strategy: "in_depth not a multiple of 16"
        dsp.superfc(x, np.zeros((40, 2), np.uint8), [0, 0], x_min=-1, x_max=1, w_min=-1, w_max=1, bias_min=0,
                    bias_max=0)


def test_add_sub_fast_equals_scalar_on_all_pairs(loops, monkeypatch):
    # the compiled path looks the 65,536 pairs up in tables of every pair, the numpy path runs the steps on them
    from maceq.runtime.kernels import jit

    looked_up = []
    real, real_codes = jit.lut_pairs_range, jit.lut_pairs
    monkeypatch.setattr(jit, "lut_pairs_range", lambda *x: looked_up.append("range") or real(*x))
    monkeypatch.setattr(jit, "lut_pairs", lambda *x: looked_up.append("codes") or real_codes(*x))
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
    # the fixed ranges look up the outputs alone; the open one tracks the min and max, then reruns
    assert looked_up == (["codes"] * 3 + ["range", "codes"] + ["codes"] if loops == "compiled" else [])
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
              qc.mace_adjust_range_for_hexagon(ra[0] + rb[0], ra[1] + rb[1])[:2]][int(k)]
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


def test_add_sub_broadcast_fast_equals_scalar():
    """Broadcasting QuantizedAdd/Sub (the d32 op): B onto A, A onto B (sub becomes op_subtract_rev),
    all-ones inputs with both output ends open (mode_broadcast_1111), given and open ranges."""
    rng = np.random.default_rng(17)
    tally = _Tally()
    for i in range(40):
        full = (int(rng.integers(1, 3)), int(rng.integers(1, 6)), int(rng.integers(1, 6)), int(rng.choice([1, 3, 33])))
        small = (1, 1, 1, 1) if i % 4 == 0 else tuple(d if rng.random() < 0.4 else 1 for d in full)
        sa, sb = (small, full) if i % 2 else (full, small)
        a, b = rng.integers(0, 256, sa, dtype=np.uint8), rng.integers(0, 256, sb, dtype=np.uint8)
        ra, rb = _rand_range(rng), _rand_range(rng)
        ro = [(-INF, INF), (-INF, INF), (0.0, INF), (-INF, 3.0), (-4.0, 5.0)][i % 5]
        kw = dict(a_min=ra[0], a_max=ra[1], b_min=rb[0], b_max=rb[1], out_min=ro[0], out_max=ro[1])
        sub = i % 3 == 0
        fn = dsp.quantized_sub if sub else dsp.quantized_add
        try:
            want = r.quantized_addsub_ref(a, b, subtract=sub, **kw)
        except MaceqError:
            with pytest.raises(MaceqError):
                fn(a, b, **kw)
            continue
        got = fn(a, b, **kw)
        assert got[0].shape == tuple(max(x, y) for x, y in zip(sa, sb))
        tally.add(want, got)
    assert tally.counts() == (0, 0)


def test_add_broadcast_plan_and_scalar_scaling_hand_cases():
    """check_compatible_elementwise_d32 and addsub_setup_scaling's mode_broadcast_1111, by hand."""
    assert r.addsub_broadcast_plan((1, 6, 6, 32), (1, 1, 1, 32)) == ((1, 6, 6, 32), False, False)
    assert r.addsub_broadcast_plan((1, 6, 6, 1), (1, 6, 6, 16)) == ((1, 6, 6, 16), True, False)
    assert r.addsub_broadcast_plan((1, 1, 1, 1), (2, 3, 4, 5)) == ((2, 3, 4, 5), True, True)
    assert r.addsub_broadcast_plan((1, 1, 1, 1), (1, 1, 1, 1))[2]  # equal dims of 1 count as broadcast
    with pytest.raises(MaceqError):  # H broadcasts B onto A, W A onto B: one direction only
        r.addsub_broadcast_plan((1, 4, 1, 2), (1, 1, 4, 2))
    with pytest.raises(MaceqError):
        r.addsub_broadcast_plan((1, 4, 4, 2), (1, 4, 4, 3))
    # a in [-1, 1]: step f32(2/255), zero roundf(1/step) = roundf(127.49999) = 127; b in [0, 2.55]:
    # zero 0, step 0.01. b = 10 adds 0.1: new zero 127 - 0.1/step = 114.25 -> the range moves to
    # -114 steps, the codes are copied (scale 32768 saturates to 32767, offset 0)
    astep = r.flt_div_255(2.0)
    assert r.get_qu8_level_size_zero(-1.0, 1.0) == (127, astep)
    scale, offs, mn, mx = r.addsub_1111_scaling((-1.0, 1.0), (0.0, 2.55), 10, "add")
    assert (scale, offs) == (32767, 0) and mn == r.fmul(-114.0, astep) and mx == r.fadd(mn, 2.0)
    # b = 255 adds 2.55: zero < -0.25, min pinned at 0, max 3.55, codes squeezed:
    # scale = round(32768*2/3.55) = 18461, offs = 128*255 - (255*18461 >> 8) = 14252
    scale, offs, mn, mx = r.addsub_1111_scaling((-1.0, 1.0), (0.0, 2.55), 255, "add")
    assert (scale, offs, mn) == (18461, 14252, 0.0) and mx == r.fadd(1.0, r.fmul(255.0, r.flt_div_255(2.55)))
    assert r.scaled_copy_u8(0, scale, offs) == (14252 * 256 + 16384) >> 15 == 111
    # reverse subtract (B - A): code_scale 32768 negated (saturate_i16 keeps -32768), offset
    # 255*128: the codes are complemented, the range negated
    scale, offs, mn, mx = r.addsub_1111_scaling((-1.0, 1.0), (0.0, 2.55), 10, "sub_rev")
    assert (scale, offs) == (-32768, 255 * 128) and [r.scaled_copy_u8(v, scale, offs) for v in (0, 7, 255)] == [255, 248, 0]


def test_add_flat_and_d32_range_logic_differ_with_only_max_given():
    """op_add.c tracks the output min / max only when max is open (``!max_precalc || !max_precalc``);
    op_add_d32.c whenever an end is open. With max given and min open the flat op keeps its first
    guess (1/8 of the theoretical range, max kept: min 0 here) and the d32 op moves min down."""
    a = np.zeros((1, 1, 2, 1), np.uint8)  # -4.0 each
    kw = dict(a_min=-4.0, a_max=4.0, b_min=-4.0, b_max=4.0, out_min=-INF, out_max=2.0, subtract=False)
    core = r._addsub_scalar_core(a.ravel(), a.ravel(), a.shape)
    y_flat, mn_flat, _ = r.addsub_execute(core=core, **kw)
    y_d32, mn_d32, _ = r.addsub_execute(core=core, d32=True, **kw)
    assert mn_flat == 0.0 and y_flat.tolist() == [[[[0], [0]]]]
    assert mn_d32 < -8.0  # the found min -8, padded by 0.15 of the found range, zero-adjusted
    assert abs(int(y_d32.max()) - round((-8.0 - mn_d32) * 255 / (2.0 - mn_d32))) <= 1


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
        axis = 3 if rng.random() < 0.7 else int(rng.integers(1, 3))
        if axis != 3:
            parts = [rng.integers(0, 256, (n, h + (i if axis == 1 else 0), w + (i if axis == 2 else 0), 3),
                                  dtype=np.uint8) for i in range(len(parts))]
        tally.add(r.quantized_concat_ref(parts, axis=axis, in_ranges=rngs),
                  dsp.quantized_concat(parts, axis=axis, in_ranges=rngs))
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
        for ref, fast in ((r.maxpool_ref, dsp.quantized_maxpool), (r.avgpool_d32_ref, dsp.quantized_avgpool)):
            tally.add(ref(x, **kw), fast(x, **kw))
    assert tally.counts() == (0, 0)


def test_avgpool_d32_paths_fast_equal_scalar():
    """Every QuantizedAvgPool_8_d32 path: 1x1 output (range from the data), 3x3 stride 1 (zapped
    edges), 2x2 stride_w 2 (replicated edges), the integral image (scaled edge padding, windows
    larger than the input)."""
    rng = np.random.default_rng(25)
    tally = _Tally()
    paths = set()
    for i in range(48):
        n, h, w = int(rng.integers(1, 3)), int(rng.integers(2, 9)), int(rng.integers(2, 9))
        c = int(rng.choice([1, 3, 33]))
        kernel, strides = [((h, w), (1, 1)), ((3, 3), (1, 1)), ((2, 2), (int(rng.integers(1, 3)), 2)),
                           ((int(rng.integers(1, 6)), int(rng.integers(1, 6))),
                            (int(rng.integers(1, 4)), int(rng.integers(1, 4)))),
                           ((h + int(rng.integers(1, 4)), w + int(rng.integers(1, 4))), (1, 1))][i % 5]
        padding = ["VALID", "SAME", "SAME_CAFFE"][int(rng.integers(0, 3))] if i % 5 else "VALID"
        x = rng.integers(0, 256, (n, h, w, c), dtype=np.uint8)
        lo, hi = _rand_range(rng)
        kw = dict(x_min=min(lo, -0.01), x_max=hi, kernel=kernel, strides=strides, padding=padding)
        try:
            want = r.avgpool_d32_ref(x, **kw)
        except MaceqError:
            with pytest.raises(MaceqError):
                dsp.quantized_avgpool(x, **kw)
            continue
        paths.add(r.avgpool_d32_path(r.integral_buffer_plan((h, w), kernel, strides, padding)))
        tally.add(want, dsp.quantized_avgpool(x, **kw))
    assert tally.counts() == (0, 0)
    assert paths == {"reduce_1x1", "3x3", "2x2", "integral"}


def test_mean_fast_equals_scalar():
    rng = np.random.default_rng(26)
    tally = _Tally()
    for _ in range(30):
        x = rng.integers(0, 256, (1, int(rng.integers(1, 7)), int(rng.integers(1, 7)), int(rng.integers(1, 40))),
                         dtype=np.uint8)
        axes = [[1, 2], [2], [1], [3], [1, 2, 3]][int(rng.integers(0, 5))]
        lo, hi = _rand_range(rng)
        out = [(None, None), _rand_range(rng), (0.0, float(rng.uniform(0.1, 6)))][int(rng.integers(0, 3))]
        kw = dict(x_min=min(lo, -0.01), x_max=hi, axes=axes, out_min=out[0], out_max=out[1])
        tally.add(r.quantized_mean_ref(x, **kw), dsp.quantized_mean(x, **kw))
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
        xq = np.concatenate([x, np.float32([lo * 1.5, hi * 3, hi * 40, -hi * 1e6, 3e38])])  # out of range
        tally.add(r.quantize_hvx_ref(xq, min=lo, max=hi), dsp.quantize(xq, min=lo, max=hi))
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
    x11 = np.zeros((1, 1, 1, 2), np.uint8)  # 1x1 output: the flat op, depth only ("only depth")
    with pytest.raises(MaceqError):
        dsp.quantized_concat([x11, x11], axis=0, in_ranges=[(0, 1), (0, 1)])
    assert dsp.quantized_concat([x, x], axis=2, in_ranges=[(0, 1), (0, 1)])[0].shape == (1, 4, 8, 2)  # d32: any axis
    with pytest.raises(MaceqError):  # broadcast in both directions ("unsupported broadcast mode")
        dsp.quantized_add(x[:, :, :1], x[:, :1], a_min=0, a_max=1, b_min=0, b_max=1)
    with pytest.raises(MaceqError):  # QuantizedMaxPool_8_d32: 6 columns of left padding needed, 4 there
        dsp.quantized_maxpool(np.zeros((1, 8, 13, 2), np.uint8), x_min=0, x_max=1, kernel=(8, 13), strides=(3, 1),
                              padding="SAME")
    with pytest.raises(MaceqError):
        dsp.quantized_maxpool(x, x_min=0, x_max=1, kernel=(2, 2), strides=(1, 1), padding="NA")


def test_layout_converters():
    w = np.arange(2 * 3 * 3 * 4).reshape(2, 3, 3, 4)  # OHWI
    assert dsp.ohwi_to_hwio(w)[1, 2, 3, 1] == w[1, 1, 2, 3]
    fc = np.arange(5 * 2 * 2 * 3).reshape(5, 2, 2, 3)
    assert dsp.fc_weight_to_dsp(fc).shape == (12, 5) and dsp.fc_weight_to_dsp(fc)[7, 4] == fc.reshape(5, 12)[4, 7]
    q, mn, mx = qc.mace_quantize_bias([0.5, -2.0, 1.0])
    assert (mn, mx) == (-2.0, 2.0) and q[1] == -(2**31)


# ----------------------------------------------------------------------------------------------
# The HVX kernels' behaviour (nnlib df7ad3c, v60 kernel set), derived by hand from the source
# ----------------------------------------------------------------------------------------------

def test_d32_nodes_start_open_ranges_at_their_own_defaults():
    """setup_initial_output_range's defaults: supernode_check (0, 0.5), shortin_supernode_check
    (-1/128, 1/128), dwise_supernode_check (-0.125, 0.125). With both ends open the zero fix
    (constraint 0) sees z = 127.5 for the symmetric ones: (zf-1)*min == zf*max, so max moves out
    to min - 255*min/127 = |min|*128/127."""
    st = r.setup_initial_output_range(-INF, INF, r.SUPERNODE_D32)
    assert (st.out_min, st.out_max, st.flags, st.firstguess) == (0.0, 0.5, 0, True)
    for node, m in ((r.INPUT_SUPERNODE, 2.0 ** -7), (r.DEPTHWISE_D32, 0.125)):
        st = r.setup_initial_output_range(-INF, INF, node)
        assert st.out_min == -m and abs(st.out_max - m * 128 / 127) < 1e-9
    assert r.supernode_node(3, 2) is r.INPUT_SUPERNODE and r.supernode_node(5, 1) is r.SUPERNODE_D32
    assert r.supernode_node(4, 3) is None and r.supernode_node(3, 5) is r.SUPERNODE_D32  # flat op; stride > 4
    with pytest.raises(MaceqError):  # "supernode: invalid input min/max"
        r.setup_initial_output_range(0.5, 2.0, r.SUPERNODE_D32)


def test_fill_bias_buf_subtracts_gemsumb_in_float32():
    """fill_bias_buf: fast_i64_roundf(minout - (float)(gemsumb*in_offset)). With minout = 0.75
    and gemsumb*in_offset = 2^24 + 1 (float 2^24): f32(0.75 - 2^24) = -16777215 (the ulp below 2^24
    is 1), where the exact round(0.75) - (2^24 + 1) is -16777216."""
    sc = r.D32Scaling(in_offset=1, prod_level_size=1.0, output_level_size=1.0, recip_val=1 << 30, recip_shamt=0)
    assert r.fill_bias_buf([0], 0.0, 0.0, sc, -0.75, [2 ** 24 + 1]) == [-16777215]
    assert r.fill_bias_buf([0], 0.0, 0.0, sc, -0.75, [1000]) == [1 - 1000]  # small products: exact
    assert r.superfc_fill_bias_buf([0], 0.0, 0.0, sc, -0.75, [2 ** 24 + 1]) == [1 + 2 ** 24 + 1]  # SuperFC: int32


def test_depthwise_3x3_kernels_compute_the_padded_output_row():
    """dwise_supernode_recalculate_strategy: opt_3x3 runs out_width_total columns from
    -out_left_pad, out_left_pad = (in_left_pad 4 - pad_before)/stride_w; MxN kernels only real
    columns (their extra lanes repeat a real sum)."""
    assert r.dwise_computed_cols((3, 3), 1, 8, 1) == range(-3, 9)  # 3 + 8 + 1 = 12 = 3 vectors of 4
    assert r.dwise_computed_cols((3, 3), 2, 4, 0) == range(-2, 6)  # SAME, W = 8: pad before 0
    assert r.dwise_computed_cols((3, 3), 2, 3, 0) == range(-2, 6)  # VALID, W = 7: 4/2 left
    assert r.dwise_computed_cols((5, 3), 1, 8, 1) == range(0, 8)
    # Convert_to_d32 layout, W = 8: 4 + 8 + 0 columns per slice; column 16 of slice 0 is image
    # column 0 of slice 1 (channel 32 + z); its depth-padding lanes hold the next flat bytes
    x = np.arange(2 * 8 * 40, dtype=np.int64).reshape(1, 2, 8, 40).astype(np.uint8)
    pad = -1  # in_offset, a value no byte has
    assert r.d32_input_read(x, pad, 0, 0, 16, 3) == x[0, 0, 0, 35]
    assert r.d32_input_read(x, pad, 0, 0, 14, 3) == pad  # next slice's left padding (zapped)
    assert r.d32_input_read(x, pad, 0, 0, 16, 20) == x.reshape(-1)[52]  # lane 20 of slice 1: byte 32 + 20
    assert r.d32_input_read(x, pad, 0, 0, 16 + 12, 3) == x[0, 1, 0, 3]  # past the last slice: next row
    assert r.d32_input_read(x, pad, 0, 1, 16 + 12, 3) == pad  # below the last row


def test_hvx_quantizer_saturates_outside_the_range():
    """quantize_floats_to_8b_asm: vmpye, vpack:sat, vpacko - values beyond the range give 0 / 255
    (not the low bits of a wrapped product); vlsr with a negative amount shifts left (6-bit
    amount: 3e38 against common_exp 132 shifts right by 6). Measured under QEMU with nnlib's
    Quantize (tools/nnlib/run.py quantize_op, range [-1, 1])."""
    x = np.float32([-1000, -100, -20, -17, -16, -15.9, -8, -2, -1.01, -1, 0, 1, 1.01, 2, 8, 15.9, 16, 17, 20, 100,
                    1000, 1e6, -1e6, 3e38])
    nnlib = [0] * 10 + [127, 254] + [255] * 10 + [0, 239]
    q, mn, mx = dsp.quantize(x, min=-1.0, max=1.0)
    assert q.tolist() == nnlib and (mn, float(np.float32(mx))) == (-1.0, 1.0078740119934082)


# ----------------------------------------------------------------------------------------------
# Measured on nnlib's HVX kernels under QEMU (tools/nnlib/run.py, v60 build of df7ad3c):
# output SHA-256 prefix and float32 bits of the output range
# ----------------------------------------------------------------------------------------------

def _sha(a) -> str:
    import hashlib
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


def _bits(v) -> int:
    return int(np.float32(v).view(np.uint32))


def test_addsub_rerun_pads_the_range_with_float_015():
    """check_addsub_need_rerun: 0.15f*out_range (0.15 as a double gives a max one ulp lower here)."""
    a = np.frombuffer(bytes.fromhex("c1dca1e75ad4f97028456bd2bd5baceb36f94b6248ca41ca"), np.uint8).reshape(1, 2, 3, 4)
    b = np.frombuffer(bytes.fromhex("9c32b7fba10407dc12141334c139e6773494eb715ba26636"), np.uint8).reshape(1, 2, 3, 4)
    _, mn, mx = dsp.quantized_add(a, b, a_min=-0.2903525678526624, a_max=0.3314606553208216,
                                  b_min=-0.4972697037657968, b_max=0.8811118800908815)
    assert (_bits(mn), _bits(mx)) == (3210390863, 1068636423)


def _golden_conv(seed, shape, kshape, o, **kw):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, shape, dtype=np.uint8)
    w = rng.integers(0, 256, (*kshape, shape[3], o), dtype=np.uint8)
    bias, bmin, bmax = qc.mace_quantize_bias(rng.normal(0, 1, o))
    return x, w, bias, dict(x_min=-1.0, x_max=1.0, w_min=-1.0, w_max=0.5, bias_min=bmin, bias_max=bmax, **kw)


@pytest.mark.parametrize("case", [
    # (what nnlib ran, seed, input, stride, output range, sha, min bits, max bits)
    ("Supernode_8x8p32to8_d32, open range from (0, 0.5)", 7, (1, 7, 9, 8), (1, 1), (-INF, INF),
     "b2aba31518ab0ed4", 3238071816, 1092106224),
    ("InputSupernode_8x8p32to8_outd32, open range from (-1/128, 1/128)", 7, (1, 7, 9, 3), (2, 2), (-INF, INF),
     "4fba6930518c8288", 3231283473, 1085605107),
    ("flat Supernode_8x8p32to8 (depth 3, stride 3: supernode_execute_hvx)", 8, (1, 14, 15, 3), (3, 3), (-3.0, 3.0),
     "7ec8c0959bcad89a", 3225419776, 1077936128),
])
def test_supernode_matches_nnlib(case):
    _, seed, shape, strides, (lo, hi), sha, bmn, bmx = case
    x, w, bias, kw = _golden_conv(seed, shape, (3, 3), 8, strides=strides, padding="SAME", out_min=lo, out_max=hi)
    y, mn, mx = dsp.supernode(x, w, bias, variant=dsp.SupernodeVariant.D32, **kw)
    assert (_sha(y), _bits(mn), _bits(mx)) == (sha, bmn, bmx)


def test_depthwise_open_range_counts_the_padded_columns():
    """DepthwiseSupernode_8x8p32to8_d32, 3x3 SAME, open range: nnlib's range comes from the
    padded output row (without those columns the first pass gives -8.0115, 4.7568)."""
    rng = np.random.default_rng(93)
    x = rng.integers(0, 256, (1, 6, 8, 8), dtype=np.uint8)
    w = rng.integers(0, 256, (3, 3, 8, 1), dtype=np.uint8)
    bias, bmin, bmax = qc.mace_quantize_bias(rng.normal(0, 3, 8))
    y, mn, mx = dsp.depthwise_supernode(x, w, bias, x_min=-1.0, x_max=1.0, w_min=-1.0, w_max=1.0, bias_min=bmin,
                                        bias_max=bmax, strides=(1, 1), padding="SAME")
    assert (_sha(y), _bits(mn), _bits(mx)) == ("cd6d7d28149a45c3", 3238002688, 1085677294)


def test_other_ops_match_nnlib():
    rng = np.random.default_rng(9)  # SuperFC_8x8p32to8 (superfc_execute_hvx), open range
    x = rng.integers(0, 256, (2, 64), dtype=np.uint8)
    w = rng.integers(0, 256, (64, 10), dtype=np.uint8)
    bias, bmin, bmax = qc.mace_quantize_bias(rng.normal(0, 1, 10))
    y, mn, mx = dsp.superfc(x, w, bias, x_min=-1.0, x_max=1.0, w_min=-1.0, w_max=0.5, bias_min=bmin, bias_max=bmax)
    assert (_sha(y), _bits(mn), _bits(mx)) == ("c33e038b4a42a755", 3229665123, 1085605107)
    rng = np.random.default_rng(10)  # QuantizedConcat_8_d32
    parts = [rng.integers(0, 256, (1, 3, 4, d), dtype=np.uint8) for d in (5, 40)]
    y, mn, mx = dsp.quantized_concat(parts, axis=3, in_ranges=[(-1.0, 2.0), (-0.3, 0.7)])
    assert (_sha(y), _bits(mn), _bits(mx)) == ("243578f50f62ebe9", 3212836864, 1073741824)
    for kernel, strides, sha in (((3, 3), (1, 1), "9b98979fa72751d3"), ((5, 5), (2, 2), "4c614db016d8a10b")):
        x = np.random.default_rng(11).integers(0, 256, (1, 7, 9, 8), dtype=np.uint8)  # QuantizedAvgPool_8_d32
        y, mn, mx = dsp.quantized_avgpool(x, x_min=-1.0, x_max=1.0, kernel=kernel, strides=strides, padding="SAME")
        assert (_sha(y), _bits(mn), _bits(mx)) == (sha, 3212836864, 1065353216)
    x = np.random.default_rng(12).integers(0, 256, (1, 5, 6, 16), dtype=np.uint8)  # QuantizedMean_8
    y, mn, mx = dsp.quantized_mean(x, x_min=-1.0, x_max=1.0, axes=[1, 2], out_min=-0.5, out_max=0.75)
    assert (_sha(y), _bits(mn), _bits(mx)) == ("6c65fa2a3c9243c9", 3204448256, 1061158912)


@pytest.mark.parametrize("case", [
    # (seed, a shape, b shape, subtract, output range, sha, min bits, max bits); nnlib ran _d32 ops
    (21, (1, 5, 6, 40), (1, 1, 1, 40), False, (-2.0, 3.0), "2d0dbdf1e86c1543", 3221225472, 1077936128),  # B11D
    (22, (1, 1, 6, 16), (2, 5, 6, 16), True, (-INF, INF), "68f6374e5b3a368d", 3225515568, 1073805685),  # A onto B
    (23, (1, 1, 1, 1), (1, 3, 4, 8), True, (-INF, INF), "7336661e97dec5be", 3221595558, 2147483648),  # 1111, B - A
    (24, (1, 4, 5, 8), (1, 4, 1, 8), False, (0.0, 3.0), "3c5980853db3eb66", 0, 1077936128),  # mixed (W)
    (25, (1, 3, 4, 8), (1, 1, 1, 1), False, (-INF, INF), "df1700370e56c15e", 3211718384, 1065912456),  # 1111
])
def test_broadcast_add_sub_match_nnlib(case):
    seed, sa, sb, sub, (lo, hi), sha, bmn, bmx = case
    rng = np.random.default_rng(seed)
    a, b = rng.integers(0, 256, sa, dtype=np.uint8), rng.integers(0, 256, sb, dtype=np.uint8)
    fn = dsp.quantized_sub if sub else dsp.quantized_add
    y, mn, mx = fn(a, b, a_min=-1.0, a_max=1.0, b_min=-0.5, b_max=1.5, out_min=lo, out_max=hi)
    assert (_sha(y), _bits(mn), _bits(mx)) == (sha, bmn, bmx)
