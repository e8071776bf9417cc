"""The fast cpu paths equal the reference kernels bit for bit (runtime/kernels/conv.py, "Fast paths").

Oracles, none of them the fast code's own earlier output:
- ``requant_floor_terms`` against ``multiply_by_quantized_multiplier`` on Python ints (that primitive
  is itself pinned to the exact rational definitions in tests/oracle/test_fixedpoint.py);
- every fast kernel against its readable ``*_ref`` kernel (loops on Python ints, pinned to TFLite
  BUILTIN_REF and to transcriptions of MACE's C++ in tests/oracle/test_conv_oracle.py), on random and
  adversarial inputs: exact ties of both rounding steps, accumulators at the edges of the exactness
  bounds and far beyond them, reductions longer than 256, int8 data, per-channel parameters;
- a whole model run on the runtime's fast kernels against the same model run on the ``*_ref`` kernels,
  every intermediate tensor, on real images.
Each test also checks which path the plans took, so the fast paths are really exercised. The Conv2D and
DepthwiseConv2d tests run twice (fixture ``loops``): on the compiled loops of runtime/kernels/jit.py and on
the numpy fast paths.
"""
from __future__ import annotations

import importlib
import multiprocessing
import random
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest

from maceq.app.pipeline import quantize
from maceq.datasets.images import ImageFolder
from maceq.datasets.preprocess import PRESETS
from maceq.errors import MaceqError
from maceq.quant.config import QuantConfig
from maceq.runtime import load
from maceq.runtime.fixedpoint import INT32_MAX, INT32_MIN, multiply_by_quantized_multiplier, requant_floor_terms
from maceq.runtime.kernels import conv as k_conv
from maceq.runtime.kernels import eltwise as k_elt
from maceq.runtime.kernels.conv import (
    FloatRequant,
    conv2d_plan,
    conv2d_ref,
    depthwise_conv2d_plan,
    depthwise_conv2d_ref,
    fully_connected,
    fully_connected_fixed,
    fully_connected_fixed_ref,
    fully_connected_plan,
    fully_connected_ref,
)

X_EDGES = [INT32_MIN, INT32_MIN + 1, -(1 << 30) - 1, -(1 << 30), -(1 << 22), -3, -2, -1, 0, 1, 2, 3,
           (1 << 22), (1 << 30), (1 << 30) + 1, INT32_MAX - 1, INT32_MAX]
Q_EDGES = [0, 1, 3, (1 << 30) - 1, 1 << 30, (1 << 30) + 1, 3 << 29, INT32_MAX]


# ----------------------------------------------------------------------------- requant_floor_terms

def _floor_form(x: int, q: int, shift: int, zp: int) -> int:
    k, c0, theta = requant_floor_terms(q, shift, zp)
    corr = (1 << 31) if theta is not None and x < theta else 0
    return (x * q + c0 - corr) >> k  # Python's >> floors


def _mismatches(cases) -> tuple[int, int]:
    bad = n = 0
    for x, q, shift, zp in cases:
        n += 1
        bad += _floor_form(x, q, shift, zp) != multiply_by_quantized_multiplier(x, q, shift) + zp
    return bad, n


def test_requant_floor_terms_int32_edges():
    cases = [(x, q, -e, zp) for x in X_EDGES for q in Q_EDGES for e in range(32) for zp in (0, 3, 255, -128)]
    assert _mismatches(cases) == (0, len(cases))


def test_requant_floor_terms_exact_ties():
    """Ties of RoundingDivideByPOT (both signs) and of SaturatingRoundingDoublingHighMul."""
    cases = []
    for e in range(1, 32):
        for j in range(-4, 4):
            s = j * (1 << e) + (1 << (e - 1))  # s / 2^e is exactly half way
            for x in (2 * s - 1, 2 * s, 2 * s + 1):  # SRDHM(x, 2^30) = floor(x/2 + 1/2) is s or s +- 1
                if INT32_MIN <= x <= INT32_MAX:
                    cases += [(x, 1 << 30, -e, zp) for zp in (0, 7, 255)]
    # q = 3*2^29: x*q + 2^30 is a multiple of 2^31 exactly when x = 2 mod 4 (first-step ties)
    cases += [(x, 3 << 29, -e, zp) for x in range(-2050, 2051) for e in (0, 1, 2, 5) for zp in (0, 9)]
    bad, n = _mismatches(cases)
    assert (bad, n > 30000) == (0, True)


def test_requant_floor_terms_random():
    rnd = random.Random(7)
    cases = []
    for _ in range(30000):
        x = rnd.choice([rnd.randint(INT32_MIN, INT32_MAX), rnd.randint(-70000, 70000)])
        q = rnd.choice([rnd.randint(0, INT32_MAX), rnd.randint(1 << 30, INT32_MAX), rnd.randint(1, 1 << 20)])
        cases.append((x, q, -rnd.randint(0, 31), rnd.randint(-128, 255)))
    assert _mismatches(cases) == (0, 30000)


@pytest.mark.parametrize("q, shift", [(-1, 0), (INT32_MAX + 1, 0), (1 << 30, 1), (1 << 30, -32)])
def test_requant_floor_terms_domain(q, shift):
    with pytest.raises(MaceqError):
        requant_floor_terms(q, shift, 0)


# ----------------------------------------------------------------------------- Conv2D

def _conv_args(rng, o, *, x_zp, lo, hi, bias_bits, per_channel, big_shift=False):
    q = rng.integers(1 << 30, 1 << 31, o) if per_channel else int(rng.integers(1 << 30, 1 << 31))
    e_hi = 31 if big_shift else 12
    shift = -rng.integers(0, e_hi + 1, o) if per_channel else -int(rng.integers(0, e_hi + 1))
    bias = rng.integers(-(1 << bias_bits), 1 << bias_bits, o).astype(np.int32)
    return bias, dict(x_zp=x_zp, multiplier=q, shift=shift, out_zp=int(rng.integers(lo, hi + 1)),
                      act_min=int(rng.integers(lo, lo + 40)), act_max=int(rng.integers(hi - 40, hi + 1)))


def test_conv2d_ties_and_the_negative_correction(loops):
    """acc = +-(x - x_zp) + bias over 256 consecutive values per channel: every tie of both rounding
    steps for shifts 0..12, with out_zp well inside the clamp so negative accumulators matter."""
    rng = np.random.default_rng(1)
    o = 52
    x = np.arange(256, dtype=np.uint8).reshape(1, 16, 16, 1)
    w_zp = rng.integers(1, 255, o)
    w = (w_zp + rng.choice([-1, 1], o)).astype(np.uint8).reshape(o, 1, 1, 1)
    q = np.where(np.arange(o) % 3 == 0, 1 << 30, rng.integers(1 << 30, 1 << 31, o))
    q[1::7] = 3 << 29
    shift = -(np.arange(o) % 13)
    bias = rng.integers(-300, 300, o).astype(np.int32)
    for out_zp, lo, hi in [(100, 0, 255), (250, 3, 251), (-5, -128, 127)]:
        dt = np.uint8 if lo >= 0 else np.int8
        kw = dict(x_zp=128, w_zp=w_zp, out_zp=out_zp, multiplier=q, shift=shift, act_min=lo, act_max=hi,
                  out_dtype=dt)
        plan = conv2d_plan(w, bias, **kw)
        assert plan.path() == ("g32" if loops == "compiled" else "folded")
        assert np.array_equal(plan(x), conv2d_ref(x, w, bias, **kw))


def test_conv2d_fast_equals_ref_random(loops):
    rng = np.random.default_rng(2)
    paths = Counter()
    for i in range(150):
        group = int(rng.choice([1, 1, 1, 2, 3]))
        cg = int(rng.choice([1, 3, 6, 20, 60, 300])) if group == 1 else int(rng.integers(1, 7))
        og = int(rng.integers(1, 5))
        kh, kw = (1, 1) if cg >= 60 else (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
        h, w_ = int(rng.integers(kh, 7)), int(rng.integers(kw, 7))
        dtype = np.uint8 if i % 5 else np.int8
        lo, hi = (0, 255) if dtype == np.uint8 else (-128, 127)
        c, o = cg * group, og * group
        x = rng.integers(lo, hi + 1, (int(rng.integers(1, 3)), h, w_, c)).astype(dtype)
        w_zp = rng.integers(lo, hi + 1, o) if i % 2 else int(rng.integers(lo, hi + 1))
        wt = rng.integers(lo, hi + 1, (o, kh, kw, cg)).astype(dtype)
        bias, kw_args = _conv_args(rng, o, x_zp=0 if i % 7 == 0 else int(rng.integers(lo, hi + 1)), lo=lo, hi=hi,
                                   bias_bits=int(rng.choice([8, 16, 21, 31])), per_channel=i % 3 == 0,
                                   big_shift=i % 11 == 0)
        kw_args.update(w_zp=w_zp, strides=tuple(int(v) for v in rng.integers(1, 3, 2)),
                       dilations=tuple(int(v) for v in rng.integers(1, 3, 2)),
                       pads=tuple(int(v) for v in rng.integers(0, 3, 4)), group=group, out_dtype=dtype)
        if (h + kw_args["pads"][0] + kw_args["pads"][2] < kw_args["dilations"][0] * (kh - 1) + 1
                or w_ + kw_args["pads"][1] + kw_args["pads"][3] < kw_args["dilations"][1] * (kw - 1) + 1):
            kw_args["dilations"] = (1, 1)
        plan = conv2d_plan(wt, bias, **kw_args)
        paths[plan.path(dtype)] += 1
        assert np.array_equal(plan(x), conv2d_ref(x, wt, bias, **kw_args)), i
    if loops == "compiled":  # the compiled requantization makes G + one pass beat the folded GEMM
        assert paths["folded"] == 0 and paths["g32"] >= 50 and paths["generic"] >= 5, paths
    else:
        assert paths["folded"] >= 30 and paths["g32"] >= 20 and paths["generic"] >= 5, paths


def test_conv2d_compiled_im2col_blocks_of_rows(monkeypatch):
    """The compiled im2col convolution on float GEMMs (kernels past 1x1 where the integer tiles do not run: int8
    data, hosts without AVX2, MACEQ_NO_INTGEMM) works on blocks of whole output rows: blocks of 1-4 rows that
    cross images and end short, with padding, strides and dilations, equal conv2d_ref; the compiled pass ran for
    every case."""
    from maceq.runtime.kernels import jit as k_jit

    monkeypatch.setenv("MACEQ_NO_INTGEMM", "1")
    assert k_jit.gemm_available()
    rng = np.random.default_rng(23)
    real, calls, rows_per = k_jit._im2col, Counter(), [1]
    monkeypatch.setattr(k_jit, "_im2col", lambda *a: (calls.update(["compiled"]), real(*a))[1])
    for i in range(24):
        n, c, o = int(rng.integers(1, 4)), int(rng.integers(1, 6)), int(rng.integers(1, 6))
        kh, kw = int(rng.integers(2, 4)), int(rng.integers(1, 4))
        x = rng.integers(0, 256, (n, int(rng.integers(kh + 2, 12)), int(rng.integers(kw + 2, 12)), c)).astype(np.uint8)
        wt = rng.integers(0, 256, (o, kh, kw, c)).astype(np.uint8)
        bias, kw_args = _conv_args(rng, o, x_zp=int(rng.integers(0, 256)), lo=0, hi=255, bias_bits=16,
                                   per_channel=i % 2 == 0)
        kw_args.update(w_zp=int(rng.integers(0, 256)), strides=tuple(int(v) for v in rng.integers(1, 3, 2)),
                       dilations=(1 + i % 2, 1), pads=tuple(int(v) for v in rng.integers(0, 2, 4)))
        rows_per[0] = 1 + i % 4
        plan = conv2d_plan(wt, bias, **kw_args)
        ow = (x.shape[2] + kw_args["pads"][1] + kw_args["pads"][3] - kw) // kw_args["strides"][1] + 1
        monkeypatch.setattr(k_jit, "_block_rows", lambda *a, ow=ow: rows_per[0] * ow)
        assert np.array_equal(plan(x), conv2d_ref(x, wt, bias, **kw_args)), i
    assert calls["compiled"] == 24


@pytest.mark.parametrize("k, spread, path", [(600, 100, "g32"), (2000, 127, "g64")])
def test_conv2d_beyond_the_exact_region(k, spread, path, loops):
    """Long reductions where |G|*q can pass 2^53 (bound B fails): the saturation argument must carry
    the accumulators far outside the exact region to the right clamp, on both sides."""
    rng = np.random.default_rng(k)
    o = 6
    w_zp = 128
    wt = (w_zp + rng.choice([-spread, spread - 1], (o, 1, 1, k))).astype(np.uint8)
    signs = np.where(wt[:, 0, 0, :] > w_zp, 255, 0).astype(np.uint8)
    x = np.concatenate([signs, 255 - signs, rng.integers(0, 256, (4, k)), np.full((2, k), 128)])
    x = x.astype(np.uint8).reshape(1, 2, -1, k)
    q = rng.integers(1 << 30, 1 << 31, o)
    shift = -rng.integers(0, 10, o)
    bias = rng.integers(-1000, 1000, o).astype(np.int32)
    kw = dict(x_zp=128, w_zp=w_zp, out_zp=117, multiplier=q, shift=shift)
    plan = conv2d_plan(wt, bias, **kw)
    assert plan.path() == path
    assert not plan.rq.folded_ok(128)  # bound B does not hold: the saturation argument is needed
    assert np.array_equal(plan(x), conv2d_ref(x, wt, bias, **kw))


# ----------------------------------------------------------------------------- DepthwiseConv2d

def test_depthwise_ties_and_the_negative_correction(loops):
    rng = np.random.default_rng(3)
    c = 60
    x = np.arange(256, dtype=np.uint8).reshape(1, 16, 16, 1).repeat(c, axis=3)
    w_zp = 77
    w = (w_zp + rng.choice([-1, 1], c)).astype(np.uint8).reshape(1, 1, c, 1)
    q = np.where(np.arange(c) % 2 == 0, 1 << 30, rng.integers(1 << 30, 1 << 31, c))
    shift = -(np.arange(c) % 12)
    bias = rng.integers(-300, 300, c).astype(np.int32)
    kw = dict(x_zp=128, w_zp=w_zp, out_zp=90, multiplier=q, shift=shift)
    plan = depthwise_conv2d_plan(w, bias, **kw)
    assert plan.path() == "g32" and plan.rq.correct
    assert np.array_equal(plan(x), depthwise_conv2d_ref(x, w, bias, **kw))


def test_depthwise_fast_equals_ref_random(loops, monkeypatch):
    from maceq.runtime.kernels import jit as k_jit

    real = k_jit._depthwise_rows  # the compiled pass (through the plan's kept DepthwiseCall), counted
    monkeypatch.setattr(k_jit, "_depthwise_rows", lambda *a: (paths.update(["compiled"]), real(*a))[1])
    rng = np.random.default_rng(4)
    paths, fixed_m1 = Counter(), Counter()
    for i in range(120):
        c, mult = int(rng.integers(1, 9)), int(rng.choice([1, 1, 2, 3]))
        kh, kw = int(rng.integers(1, 4)), int(rng.integers(1, 6))  # kw 3: the compiled loop's own case
        big = i % 17 == 1  # 20x20 taps of extreme weights: X*L1 >= 2^24, float64 accumulators
        if big:
            c, mult, kh, kw = 2, 1, 20, 20
        h, w_ = int(rng.integers(kh, kh + 3 if big else kh + 6)), int(rng.integers(kw, kw + 6))
        dtype = np.uint8 if i % 5 else np.int8
        lo, hi = (0, 255) if dtype == np.uint8 else (-128, 127)
        x = rng.integers(lo, hi + 1, (int(rng.integers(1, 3)), h, w_, c)).astype(dtype)
        wt = rng.integers(lo, hi + 1, (kh, kw, c, mult)).astype(dtype)
        if big:
            wt[...] = np.where(rng.random(wt.shape) < 0.97, hi, lo)
        bias, kw_args = _conv_args(rng, c * mult, x_zp=int(rng.integers(lo, hi + 1)), lo=lo, hi=hi,
                                   bias_bits=int(rng.choice([8, 16, 21, 31])), per_channel=i % 3 == 0,
                                   big_shift=i % 11 == 0)
        w_zp = rng.integers(lo, hi + 1, c * mult) if i % 2 else int(rng.integers(lo, hi + 1))
        kw_args.update(w_zp=lo if big else w_zp, strides=tuple(int(v) for v in rng.integers(1, 3, 2)),
                       dilations=(1, 1) if big else tuple(int(v) for v in rng.integers(1, 3, 2)),
                       pads=tuple(int(v) for v in rng.integers(0, 3, 4)), out_dtype=dtype)
        if (h + kw_args["pads"][0] + kw_args["pads"][2] < kw_args["dilations"][0] * (kh - 1) + 1
                or w_ + kw_args["pads"][1] + kw_args["pads"][3] < kw_args["dilations"][1] * (kw - 1) + 1):
            kw_args["dilations"] = (1, 1)
        if i % 4 == 3 and dtype == np.uint8:  # MACE's float requantization (dilated depthwise)
            for key in ("multiplier", "shift"):
                kw_args.pop(key)
            kw_args.update(float_multiplier=np.float32(rng.uniform(1e-4, 0.3)),
                           float_rounding=list(FloatRequant)[i % 3], act_min=0, act_max=255)
        plan = depthwise_conv2d_plan(wt, bias, **kw_args)
        paths[plan.path(dtype)] += 1
        assert np.array_equal(plan(x), depthwise_conv2d_ref(x, wt, bias, **kw_args)), i
        assert np.array_equal(plan(x), depthwise_conv2d_ref(x, wt, bias, **kw_args)), i  # the kept call again
        fixed_m1[plan.rq is not None and mult == 1 and plan.path(dtype) != "generic"] += 1
    assert paths["g32"] >= 50 and paths["g64"] >= 2 and paths["generic"] >= 5, paths
    # the compiled pass ran twice for every fixed-point, multiplier-1 case with compiled loops, else never
    assert paths["compiled"] == (2 * fixed_m1[True] if loops == "compiled" else 0) and fixed_m1[True] >= 30, paths


def test_dw3x3_vector_blocks_equal_the_tap_sums():
    """runtime/kernels/simd.py: the 3x3 depthwise sums of the first 8*floor(C/8) channels, with strides and
    dilations, equal numpy's sums of the same float32 products (exact integers); float64 rows are left to the
    caller (0 channels done)."""
    from numba import njit

    from maceq.runtime.kernels import simd

    blocks = njit(lambda r0, r1, r2, sw, dw, wk, acc: simd.dw3x3_blocks(r0, r1, r2, sw, dw, wk, acc))
    rng = np.random.default_rng(31)
    for i in range(40):
        c, sw, dw, ow = int(rng.integers(1, 42)), 1 + i % 2, 1 + (i // 2) % 2, int(rng.integers(1, 12))
        wp = (ow - 1) * sw + 2 * dw + 1
        rows = rng.integers(-255, 256, (3, wp, c)).astype(np.float32)
        wk = rng.integers(-255, 256, (3, 3, c)).astype(np.float32)
        acc = np.full((ow, c), np.nan, np.float32)
        done = blocks(rows[0].ravel(), rows[1].ravel(), rows[2].ravel(), sw, dw, wk.ravel(), acc.ravel())
        want = sum(rows[ky, kx * dw:kx * dw + (ow - 1) * sw + 1:sw].astype(np.float64) * wk[ky, kx]
                   for ky in range(3) for kx in range(3))
        assert done == c - c % 8, (i, c)
        assert np.array_equal(acc[:, :done], want[:, :done]) and np.isnan(acc[:, done:]).all(), i
    r64 = np.zeros(30)
    assert blocks(r64, r64, r64, 1, 1, np.zeros(18), np.zeros(4)) == 0


def test_depthwise_3x3_on_vector_blocks_equals_ref(monkeypatch):
    """Whole 3x3 depthwise convolutions with 8-41 channels (vector blocks and a channel tail), strides, dilations,
    paddings, uint8 and int8: equal to the reference kernel, through the compiled pass (counted)."""
    from maceq.runtime.kernels import jit as k_jit

    real, calls = k_jit._depthwise_rows, Counter()
    monkeypatch.setattr(k_jit, "_depthwise_rows", lambda *a: (calls.update(["compiled"]), real(*a))[1])
    rng = np.random.default_rng(32)
    for i in range(16):
        c = int(rng.choice([8, 13, 16, 24, 41]))
        dtype = np.uint8 if i % 3 else np.int8
        lo, hi = (0, 255) if dtype == np.uint8 else (-128, 127)
        x = rng.integers(lo, hi + 1, (1 + i % 2, int(rng.integers(3, 9)), int(rng.integers(3, 12)), c)).astype(dtype)
        wt = rng.integers(lo, hi + 1, (3, 3, c, 1)).astype(dtype)
        bias, kw_args = _conv_args(rng, c, x_zp=int(rng.integers(lo, hi + 1)), lo=lo, hi=hi, bias_bits=16,
                                   per_channel=i % 2 == 0)
        kw_args.update(w_zp=int(rng.integers(lo, hi + 1)), strides=(1 + i % 2, 1 + (i // 2) % 2),
                       dilations=(1, 1 + (i // 4) % 2), pads=tuple(int(v) for v in rng.integers(0, 3, 4)),
                       out_dtype=dtype)
        plan = depthwise_conv2d_plan(wt, bias, **kw_args)
        assert plan.path(dtype) == "g32", i
        assert np.array_equal(plan(x), depthwise_conv2d_ref(x, wt, bias, **kw_args)), i
    assert calls["compiled"] == 16


def test_depthwise_on_a_non_contiguous_input(loops):
    # an NHWC view of NCHW memory (a layout transpose upstream), no padding, stride 1: the numpy path once
    # strode over the input as if it were C-ordered and read outside it
    rng = np.random.default_rng(8)
    for c, (sh, sw), pads in ((24, (1, 1), (0, 0, 0, 0)), (8, (2, 2), (0, 0, 0, 0)), (16, (1, 1), (1, 0, 1, 2))):
        nchw = rng.integers(0, 256, (1, c, 12, 9), dtype=np.uint8)
        x = nchw.transpose(0, 2, 3, 1)
        assert not x.flags.c_contiguous
        wt = rng.integers(0, 256, (3, 3, c, 1), dtype=np.uint8)
        bias, kw_args = _conv_args(rng, c, x_zp=int(rng.integers(256)), lo=0, hi=255, bias_bits=16,
                                   per_channel=False, big_shift=False)
        kw_args.update(w_zp=int(rng.integers(256)), strides=(sh, sw), dilations=(1, 1), pads=pads, out_dtype=np.uint8)
        plan = depthwise_conv2d_plan(wt, bias, **kw_args)
        assert plan.path(np.uint8) == "g32"
        want = depthwise_conv2d_ref(np.ascontiguousarray(x), wt, bias, **kw_args)
        assert np.array_equal(plan(x), want) and np.array_equal(plan(np.ascontiguousarray(x)), want)


# ----------------------------------------------------------------------------- im2col rows

def test_im2col_rows_compiled_equal_the_numpy_reference(monkeypatch):
    """Windows inside, across and wholly outside x (negative padding crops), strides, dilations, integer dtypes:
    the compiled copy equals the padded-window reference value for value, and ran (counted)."""
    from maceq.runtime.kernels import jit as k_jit

    calls = Counter()
    real = k_jit._im2col_rows

    def counted(*args):
        calls["compiled"] += 1
        return real(*args)

    monkeypatch.setattr(k_jit, "_im2col_rows", counted)
    rng = np.random.default_rng(11)
    for i in range(300):
        n, h, w, c = (int(v) for v in rng.integers(1, [3, 12, 12, 6]))
        kh, kw, sh, sw, dh, dw = (int(v) for v in rng.integers(1, 4, 6))
        top, left = (int(v) for v in rng.integers(-2, 4, 2))
        geom = dict(kernel=(kh, kw), strides=(sh, sw), dilations=(dh, dw), before=(top, left),
                    out_hw=tuple(int(v) for v in rng.integers(1, 8, 2)))
        x = rng.integers(0, 120, (n, h, w, c)).astype([np.uint8, np.int16, np.int32][i % 3])
        got, want = k_conv.im2col_rows(x, 7 + i % 5, **geom), k_conv.im2col_rows_ref(x, 7 + i % 5, **geom)
        assert got.dtype == want.dtype and np.array_equal(got, want), (i, geom)
    assert calls["compiled"] == 300
    # a first RGB layer: 3x3, stride 2, SAME padding on the right and bottom only
    x = rng.integers(0, 256, (2, 9, 9, 3), dtype=np.uint8)
    geom = dict(kernel=(3, 3), strides=(2, 2), dilations=(1, 1), before=(0, 0), out_hw=(5, 5))
    rows = k_conv.im2col_rows(x, 128, **geom)
    assert rows.shape == (50, 27) and np.array_equal(rows[0], x[0, :3, :3].reshape(-1))
    window = rows[4].reshape(3, 3, 3)  # output column 4 reads input columns 8, 9 and 10 (x has 9)
    assert np.array_equal(window[:, 0], x[0, :3, 8]) and np.array_equal(window[:, 1:], np.full((3, 2, 3), 128))


def test_pad_compiled_equals_the_reference_on_every_axis(monkeypatch):
    """4-D uint8 Pad by one compiled pass: paddings on N, H, W and C (C padding takes the per-pixel loop), empty
    inputs, equal to layout.pad_ref's element-by-element rule; the compiled pass ran for every non-empty one."""
    from maceq.runtime.kernels import jit as k_jit
    from maceq.runtime.kernels import layout as k_layout

    calls = Counter()
    real = k_jit._pad4
    monkeypatch.setattr(k_jit, "_pad4", lambda *a: (calls.update(["compiled"]), real(*a))[1])
    rng = np.random.default_rng(12)
    for i in range(60):
        shape = tuple(int(v) for v in rng.integers(0 if i == 59 else 1, [3, 7, 7, 5]))
        pads = [(int(rng.integers(0, 3)) * (i % 4 == 0 or d > 0), int(rng.integers(0, 3))) for d in range(4)]
        if i % 3:
            pads[3] = (0, 0)  # the common form: H and W only, each row's inside copied as one run
        x = rng.integers(0, 256, shape, dtype=np.uint8)
        code = int(rng.integers(0, 256))
        got = k_layout.pad(x, pads, pad_code=code)
        assert np.array_equal(got, k_layout.pad_ref(x, pads, pad_code=code)), (shape, pads)
    assert calls["compiled"] == 60  # the last input is empty on an axis: its output is all pad code


def test_nchw_to_nhwc_compiled_equals_numpys_transpose(monkeypatch):
    """The graph inputs' layout change by one compiled pass: equal to numpy's transposed copy for float32, float64
    and uint8, 1-5 channels, non-contiguous and empty inputs; the compiled pass ran for every non-empty one and the
    result is a C-contiguous copy."""
    from maceq.runtime.kernels import jit as k_jit
    from maceq.runtime.kernels import layout as k_layout

    calls = Counter()
    real = k_jit._nchw_to_nhwc
    monkeypatch.setattr(k_jit, "_nchw_to_nhwc", lambda *a: (calls.update(["compiled"]), real(*a))[1])
    rng = np.random.default_rng(21)
    for i, dtype in enumerate([np.float32, np.float64, np.uint8] * 8):
        shape = (int(rng.integers(1, 4)), int(rng.integers(1, 6)), int(rng.integers(1, 9)), int(rng.integers(1, 9)))
        x = (rng.standard_normal(shape) * 50).astype(dtype)
        if i % 4 == 3:
            x = np.asfortranarray(x)
        got = k_layout.nchw_to_nhwc(x)
        assert got.flags.c_contiguous and got.dtype == x.dtype
        assert np.array_equal(got, x.transpose(0, 2, 3, 1)), (shape, dtype)
    assert calls["compiled"] == 24
    assert k_layout.nchw_to_nhwc(np.zeros((0, 3, 4, 4), np.float32)).shape == (0, 4, 4, 3)
    assert calls["compiled"] == 24
    with pytest.raises(MaceqError, match="4-D"):
        k_layout.nchw_to_nhwc(np.zeros((3, 4, 4), np.float32))


def test_reduce_mean_compiled_equals_the_reference(monkeypatch):
    """Reduce MEAN over H and W (a global average pool) by one compiled pass: equal to reduce.reduce_mean_ref's
    transcription of MACE's loops, axes given either way, with and without keepdims; other axes keep the numpy
    path. Past 2^32 / 255 elements the sum wraps as MACE's uint32 accumulator does, equal to the numpy path."""
    from maceq.runtime.kernels import jit as k_jit
    from maceq.runtime.kernels import reduce as k_reduce

    calls = Counter()
    real = k_jit._hw_sums
    monkeypatch.setattr(k_jit, "_hw_sums", lambda *a: (calls.update(["compiled"]), real(*a))[1])
    rng = np.random.default_rng(22)
    for i in range(24):
        shape = (int(rng.integers(1, 4)), int(rng.integers(1, 8)), int(rng.integers(1, 8)), int(rng.integers(1, 40)))
        x = rng.integers(0, 256, shape, dtype=np.uint8) if i % 3 else np.full(shape, 255 * (i % 2), np.uint8)
        for axes in ((1, 2), (-3, -2), (1,), (2, 3)):
            for keep in (True, False):
                got = k_reduce.reduce_mean(x, axes=axes, keepdims=keep)
                want = k_reduce.reduce_mean_ref(x, axes=axes, keepdims=keep)
                assert got.shape == want.shape and np.array_equal(got, want), (shape, axes, keep)
    assert calls["compiled"] == 24 * 4
    big = np.full((1, 4105, 4105, 1), 255, np.uint8)  # 4105^2 * 255 > 2^32: the accumulator wraps
    got = k_reduce.reduce_mean(big, axes=(1, 2))
    monkeypatch.setenv("MACEQ_NO_JIT", "1")
    assert calls["compiled"] == 24 * 4 + 1 and np.array_equal(got, k_reduce.reduce_mean(big, axes=(1, 2)))
    assert int(got[0, 0, 0, 0]) == (4105 * 4105 * 255 - 2 ** 32 + 4105 * 4105 // 2) // (4105 * 4105)


# ----------------------------------------------------------------------------- FullyConnected

def test_fully_connected_fast_equals_ref(loops, monkeypatch):
    """FullyConnected's sums: compiled in int32 (K up to 33,025) or by float32 / float64 GEMMs, then
    the int32 wrap with the raw bias and the float requantization; equal to the reference, and the sums' path
    counted."""
    from maceq.runtime.kernels import jit as k_jit

    calls = Counter()
    real = k_jit._fc_sums
    monkeypatch.setattr(k_jit, "_fc_sums", lambda *a: (calls.update(["compiled"]), real(*a))[1])
    rng = np.random.default_rng(5)
    dts = Counter()
    for i in range(40):
        k = int(rng.choice([5, 100, 300, 1500])) if i else 33_100
        n, o = (int(rng.integers(1, 4)), int(rng.integers(1, 6))) if i else (1, 2)  # the long K: a cheap reference
        x = rng.integers(0, 256, (n, k), dtype=np.uint8)
        wt = rng.integers(0, 256, (o, k), dtype=np.uint8)
        bias = rng.integers(-(1 << 31), (1 << 31) - 1, o).astype(np.int32) if i % 3 else None
        w_zp = int(rng.integers(256)) if i % 2 else rng.integers(0, 256, o)  # one, or one per channel
        zps = dict(x_zp=int(rng.integers(256)), w_zp=w_zp, out_zp=int(rng.integers(256)))
        rounding = list(FloatRequant)[i % 3]
        m = np.float32(rng.uniform(1e-6, 0.05))
        plan = fully_connected_plan(wt, bias, **zps, multiplier=m, rounding=rounding)
        dts[len(plan.wt)] += 1
        assert np.array_equal(plan(x), fully_connected_ref(x, wt, bias, **zps, multiplier=m, rounding=rounding)), i
        assert np.array_equal(fully_connected(x, wt, bias, **zps, multiplier=m, rounding=rounding), plan(x)), i
        q, s = int(rng.integers(1 << 30, 1 << 31)), int(rng.integers(-20, 1))
        assert np.array_equal(fully_connected_fixed(x, wt, bias, **zps, multiplier=q, shift=s),
                              fully_connected_fixed_ref(x, wt, bias, **zps, multiplier=q, shift=s)), i
    assert dts[2] >= 10 and dts[1] >= 5, dts  # plans with float32 (sgemm) and float64-only GEMMs
    # the compiled sums run for every plan but the first (K = 33,100: an int32 sum could wrap), three times a case
    assert calls["compiled"] == (3 * 39 if loops == "compiled" else 0), calls


# ----------------------------------------------------------------------------- Eltwise tables

def test_eltwise_tables_equal_ref(loops, monkeypatch):
    """From _LUT_MIN elements eltwise_add looks codes up in per-rule 256x256 tables: NEON body and scalar tail, the
    compiled look-ups (counted) in chunks of 2^14 elements whose last one holds the tail."""
    from maceq.runtime.kernels import jit as k_jit

    real, calls = k_jit._lut_pairs, Counter()
    monkeypatch.setattr(k_jit, "_lut_pairs", lambda *a: (calls.update(["compiled"]), real(*a))[1])
    rng = np.random.default_rng(6)
    for i in range(9):
        n = k_elt._LUT_MIN + int(rng.integers(0, 20))  # a tail of 0..7 elements
        if i == 8:  # two chunks, the tail in the second
            n = k_jit._CHUNK + int(rng.integers(9, 20))
        a = rng.integers(0, 256, n, dtype=np.uint8)
        b = rng.integers(0, 256, n, dtype=np.uint8)
        if i == 7:  # a per-channel b, broadcast over a's leading axis
            a, b = rng.integers(0, 256, (n // 7 + 1, 7), dtype=np.uint8), rng.integers(0, 256, 7, dtype=np.uint8)
        cfg = dict(a_scale=float(rng.uniform(0.01, 0.1)), a_zp=int(rng.integers(256)),
                   b_scale=float(rng.uniform(0.01, 0.1)), b_zp=int(rng.integers(256)),
                   out_scale=float(rng.uniform(0.005, 0.2)) if i % 4 else 1e-4, out_zp=int(rng.integers(256)),
                   subtract=bool(i % 2), act_min=int(rng.integers(0, 30)), act_max=int(rng.integers(200, 256)))
        assert a.size >= k_elt._LUT_MIN
        assert np.array_equal(k_elt.eltwise_add(a, b, **cfg), k_elt.eltwise_add_ref(a, b, **cfg)), i
    assert calls["compiled"] == (9 if loops == "compiled" else 0)


# ----------------------------------------------------------------------------- a whole model

@pytest.fixture(scope="module")
def fmnist_model(tmp_path_factory, shared_data):
    out = tmp_path_factory.mktemp("fmnist_fast")
    res = quantize(shared_data / "models" / "fmnist_mobilenet.onnx", shared_data / "fashion_mnist" / "calib",
                   output_dir=out, preprocess=PRESETS["fmnist"], config=QuantConfig(), progress=False)
    return res.files.yml


class _RefPlan:
    """A plan-shaped wrapper running a ``*_ref`` kernel."""

    def __init__(self, fn, w, bias, kwargs):
        self.fn, self.w, self.bias, self.kwargs = fn, w, bias, kwargs

    def __call__(self, x):
        return self.fn(x, self.w, self.bias, **self.kwargs)


def _use_reference_kernels(setattr_=setattr) -> None:
    """Point the runtime's kernel factories (runtime/ops.py calls them) at the ``*_ref`` kernels."""
    for name, ref in [("conv2d_plan", k_conv.conv2d_ref), ("depthwise_conv2d_plan", k_conv.depthwise_conv2d_ref),
                      ("fully_connected_plan", k_conv.fully_connected_ref),
                      ("fully_connected_fixed_plan", k_conv.fully_connected_fixed_ref)]:
        setattr_(k_conv, name, lambda w, bias=None, _ref=ref, **kwargs: _RefPlan(_ref, w, bias, kwargs))
    setattr_(k_elt, "eltwise_add", k_elt.eltwise_add_ref)


def _run(yml, x) -> tuple[dict, dict]:
    res = load(yml).run({"input": x}, intermediates=True)
    return {name: (t.values, t.qinfo) for name, t in res.tensors.items()}, res.outputs


def _reference_run(yml, x) -> tuple[dict, dict]:
    """In a worker process: the model on the reference kernels."""
    _use_reference_kernels()
    return _run(yml, x)


def test_model_on_fast_kernels_equals_reference_kernels(fmnist_model, shared_data, monkeypatch):
    """Two real images, one batch each (the input Quantize finds its range per batch). The reference
    kernels loop in Python, so one image's reference run goes to a second process."""
    images = ImageFolder(shared_data / "fashion_mnist" / "test", PRESETS["fmnist"], labels=None, limit=2)
    batch = next(images.iter_batches(2)).data
    xs = [batch[:1], batch[1:]]
    fast = [_run(fmnist_model, x) for x in xs]
    module = importlib.import_module("maceq.tests.test_fast_paths")  # importable by the spawned worker
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        other = pool.submit(module._reference_run, str(fmnist_model), xs[1])
        _use_reference_kernels(monkeypatch.setattr)
        slow = [_run(fmnist_model, xs[0]), other.result()]
    for (f_tensors, f_out), (s_tensors, s_out) in zip(fast, slow):
        assert set(f_tensors) == set(s_tensors) and len(s_tensors) > 25
        for name, (values, qinfo) in s_tensors.items():
            assert np.array_equal(f_tensors[name][0], values), name
            assert f_tensors[name][1] == qinfo, name
        for name, y in s_out.items():
            assert np.array_equal(f_out[name], y), name
