"""Oracle tests for the uint8 activation kernels (runtime/kernels/activation.py).

Oracles:
1. TFLite BUILTIN_REF (ai-edge-litert 2.3.0) single-op models for LOGISTIC, TANH, HARD_SWISH,
   LEAKY_RELU, PRELU and the RELU family: every one of the 256 input codes, over many random
   (scale, zero point) configurations (fixed seeds), including multipliers > 1, exact ties and
   the degenerate exponents. Required: 0 mismatching elements, for the fast path and the ref.
2. HardSigmoid and Clip have no TFLite uint8 kernel: they are checked against a plain-int
   transcription of their definition below (``_exact_code``, dyadic numerators and denominators
   from ``float.as_integer_ratio``; no Fraction, no kernel code), on configurations full of exact
   ties; Clip also against TFLite's RELU6 / RELU_N1_TO_1 / RELU_0_TO_1 / RELU where the two
   definitions coincide, and where they do not (negative ties with unequal scales) the
   difference is pinned.
3. fast == ref bit for bit (random tensors, all codes), and the int16 fixed-point primitives'
   scalar and vectorised twins agree on edge values.

The tflite_builder has no PRELU / RELU_N1_TO_1 / RELU_0_TO_1 entry: ``_extra_ops`` adds them
(no options) to its op table for the duration of a test, without editing the builder.
"""
from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction
from unittest import mock

import numpy as np
import pytest

from maceq.errors import MaceqError
from maceq.runtime import fixedpoint as fp
from maceq.runtime.fixedpoint import quantize_multiplier
from maceq.runtime.kernels import activation as act
from maceq.tests.oracle import tflite_builder
from maceq.tests.oracle.tflite_builder import TensorSpec, build_single_op_model, run_ref

F32 = np.float32
ALL = np.arange(256, dtype=np.uint8).reshape(1, 4, 8, 8)  # every code once, NHWC


def _f32(v: float) -> float:
    return float(F32(v))


def _rand_scale(rng, lo_exp: float, hi_exp: float) -> float:
    return _f32(10.0 ** rng.uniform(lo_exp, hi_exp))


def _extra_ops():
    return mock.patch.dict(tflite_builder._OPTIONS_TABLE,
                           {"PRELU": None, "RELU_N1_TO_1": None, "RELU_0_TO_1": None})


def _tflite_unary(op: str, x, s_in, zp_in, s_out, zp_out, options=None) -> np.ndarray:
    model = build_single_op_model(op, [TensorSpec(x.shape, s_in, zp_in)],
                                  [TensorSpec(x.shape, s_out, zp_out)], options=options)
    (out,) = run_ref(model, [x])
    return out


def _mismatches(a, b) -> int:
    assert a.shape == b.shape and a.dtype == b.dtype == np.uint8
    return int(np.count_nonzero(a != b))


def _unary_configs(seed: int, n: int):
    """(s_in, zp_in, s_out, zp_out): scales over 1e-3..10, output/input ratio over 1/30..30."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        s_in = _rand_scale(rng, -3, 1)
        yield (s_in, int(rng.choice([0, 255, *rng.integers(0, 256, 3)])),
               _f32(s_in * 10.0 ** rng.uniform(-1.5, 1.5)), int(rng.integers(0, 256)))


# ---------------------------------------------------------------------------------------------
# LOGISTIC / TANH: TFLite's reference builds a float32 LUT in Prepare (LUTPopulate)
# ---------------------------------------------------------------------------------------------

_LUT_EDGES = [(1e-6, 0), (1e-6, 255), (2.0 ** -4, 128), (0.1, 128), (10.0, 0), (10.0, 255), (64.0, 7)]


def test_logistic_all_codes_vs_tflite():
    configs = [(s, zp) for s, zp, _, _ in _unary_configs(1, 60)] + [(_f32(s), zp) for s, zp in _LUT_EDGES]
    bad = 0
    for s, zp in configs:
        expected = _tflite_unary("LOGISTIC", ALL, s, zp, 1.0 / 256, 0)
        bad += _mismatches(act.logistic(ALL, in_scale=s, in_zp=zp), expected)
        bad += _mismatches(act.logistic_ref(ALL, in_scale=s, in_zp=zp), expected)
    assert bad == 0


def test_tanh_all_codes_vs_tflite():
    configs = [(s, zp, 1.0 / 128, 128) for s, zp, _, _ in _unary_configs(2, 60)]
    configs += [(_f32(s), zp, 1.0 / 128, 128) for s, zp in _LUT_EDGES]
    # TFLite's reference TanhPrepare accepts any output quantization: the LUT follows it.
    configs += list(_unary_configs(3, 10))
    bad = 0
    for s, zp, so, zo in configs:
        expected = _tflite_unary("TANH", ALL, s, zp, so, zo)
        bad += _mismatches(act.tanh(ALL, in_scale=s, in_zp=zp, out_scale=so, out_zp=zo), expected)
        bad += _mismatches(act.tanh_ref(ALL, in_scale=s, in_zp=zp, out_scale=so, out_zp=zo), expected)
    assert bad == 0


def test_tflite_lut_rounds_half_away_then_adds_zero_point():
    # transform = identity, s_in = 1, s_out = 2: rescaled = roundf(v / 2) then + zp_out.
    lut = act.tflite_lut(lambda v: v, in_scale=1.0, in_zp=128, out_scale=2.0, out_zp=100)
    v = np.arange(256) - 128
    expected = 100 + np.where(v >= 0, (v + 1) // 2, -((-v + 1) // 2))  # ties away from zero
    assert np.array_equal(lut, np.clip(expected, 0, 255).astype(np.uint8))


# ---------------------------------------------------------------------------------------------
# HARD_SWISH: int16 fixed point (reference/hard_swish.h)
# ---------------------------------------------------------------------------------------------

def test_hard_swish_all_codes_vs_tflite():
    configs = [c for c in _unary_configs(4, 80) if c[0] < 128 * c[2]]
    configs += [  # reluish exponent > 0 (large s_in), < 0 (small s_in), output exponent 0 and <= -16
        (_f32(100.0), 100, _f32(30.0), 30), (_f32(1000.0), 3, _f32(200.0), 250),
        (_f32(1e-6), 128, _f32(1e-7), 0), (_f32(0.05), 100, _f32(0.05 / 64), 30),
        (_f32(1e-4), 100, 1.0, 30), (_f32(1e-3), 0, 10.0, 255), (_f32(3 / 128), 128, _f32(3 / 128), 128),
    ]
    bad = 0
    for s, zp, so, zo in configs:
        expected = _tflite_unary("HARD_SWISH", ALL, s, zp, so, zo)
        kw = dict(in_scale=s, in_zp=zp, out_scale=so, out_zp=zo)
        bad += _mismatches(act.hard_swish(ALL, **kw), expected)
        bad += _mismatches(act.hard_swish_ref(ALL, **kw), expected)
    assert bad == 0


def test_hard_swish_rejects_what_tflite_prepare_rejects():
    s, so = _f32(0.05), _f32(0.05 / 130)  # s_in / (128 s_out) > 1: exponent 1 > 0
    with pytest.raises(Exception):
        _tflite_unary("HARD_SWISH", ALL, s, 0, so, 0)
    with pytest.raises(MaceqError, match="HardSwish"):
        act.hard_swish(ALL, in_scale=s, in_zp=0, out_scale=so, out_zp=0)


def test_int16_primitives_scalar_equals_vectorised():
    rng = np.random.default_rng(5)
    vals = np.concatenate([np.array([-32768, -32767, -16385, -16384, -1, 0, 1, 16383, 16384, 32767]),
                           rng.integers(-32768, 32768, 300)]).astype(np.int64)
    mults = [-32768, -1, 0, 1, 16384, 32767] + [int(m) for m in rng.integers(-32768, 32768, 10)]
    for b in mults:
        assert [fp.srdhm16(int(a), b) for a in vals] == fp.srdhm16_v(vals, b).tolist()
        bb = np.full_like(vals, b)
        assert [fp.sdhm16(int(a), b) for a in vals] == fp.sdhm16_v(vals, bb).tolist()
    for e in range(0, 32):
        assert [fp.rdbp16(int(a), e) for a in vals] == fp.rdbp16_v(vals, e).tolist()
    for e in range(0, 31):
        assert [fp.sat_lshift16(int(a), e) for a in vals] == fp.sat_lshift16_v(vals, e).tolist()
    # int16 RoundingDivideByPOT: ties away from zero below 16; the Dup<int16> mask wraps to -1
    # from exponent 16 on, which gives +1 / -1 (the TFLite oracle above exercises exponent 20).
    assert [fp.rdbp16(v, 1) for v in (-3, -1, 1, 3)] == [-2, -1, 1, 2]
    assert [fp.rdbp16(v, 16) for v in (-5, -1, 0, 5)] == [-1, -1, 1, 1]


# ---------------------------------------------------------------------------------------------
# LEAKY_RELU (reference/leaky_relu.h)
# ---------------------------------------------------------------------------------------------

def test_leaky_relu_all_codes_vs_tflite():
    rng = np.random.default_rng(6)
    configs = []
    for s, zp, so, zo in _unary_configs(7, 60):
        configs.append((_f32(rng.uniform(-2, 2)), s, zp, so, zo))
    # exact ties: negative power-of-two alphas with equal scales make xq/2^31 a half-integer, where
    # -MBQM(x, -q) (leaky_relu.h's "safe" multiplier) and MBQM(x, q) differ; also alpha 0 and 1.
    for alpha in (-0.5, -0.25, -1.0, -2.0, 0.0, 1.0, 0.5, 0.125):
        configs.append((alpha, 0.1, 128, 0.1, 128))
        configs.append((alpha, _f32(0.02), 200, _f32(0.01), 50))  # identity multiplier 2 (> 1)
    bad = 0
    for alpha, s, zp, so, zo in configs:
        expected = _tflite_unary("LEAKY_RELU", ALL, s, zp, so, zo, options={"alpha": alpha})
        kw = dict(alpha=alpha, in_scale=s, in_zp=zp, out_scale=so, out_zp=zo)
        bad += _mismatches(act.leaky_relu(ALL, **kw), expected)
        bad += _mismatches(act.leaky_relu_ref(ALL, **kw), expected)
    assert bad == 0
    # The tie case really discriminates: x - zp = -1, alpha = -0.5 gives 128 (the plain
    # negative-multiplier form would give 129).
    assert int(act.leaky_relu(np.array([127], np.uint8), alpha=-0.5, in_scale=0.1, in_zp=128,
                              out_scale=0.1, out_zp=128)[0]) == 128


# ---------------------------------------------------------------------------------------------
# PRELU (reference/prelu.h)
# ---------------------------------------------------------------------------------------------

def _tflite_prelu(x, alpha, s_in, zp_in, s_a, zp_a, s_out, zp_out):
    with _extra_ops():
        model = build_single_op_model(
            "PRELU", [TensorSpec(x.shape, s_in, zp_in), TensorSpec(alpha.shape, s_a, zp_a, data=alpha)],
            [TensorSpec(x.shape, s_out, zp_out)])
        (out,) = run_ref(model, [x])
    return out


@pytest.mark.parametrize("alpha_shape", [(5,), (1, 1, 5), (1, 1, 1, 5), (4, 1, 5), (1, 4, 64, 5)])
def test_prelu_all_codes_vs_tflite(alpha_shape):
    rng = np.random.default_rng(8 + len(alpha_shape))
    # every input code in every channel
    x = np.broadcast_to(np.arange(256, dtype=np.uint8).reshape(1, 4, 64, 1), (1, 4, 64, 5)).copy()
    bad = 0
    for s, zp, so, zo in _unary_configs(9 + len(alpha_shape), 12):
        s_a = _rand_scale(rng, -3, 0)
        zp_a = int(rng.integers(0, 256))
        alpha = rng.integers(0, 256, alpha_shape).astype(np.uint8)
        kw = dict(in_scale=s, in_zp=zp, alpha_scale=s_a, alpha_zp=zp_a, out_scale=so, out_zp=zo)
        expected = _tflite_prelu(x, alpha, s, zp, s_a, zp_a, so, zo)
        bad += _mismatches(act.prelu(x, alpha, **kw), expected)
        bad += _mismatches(act.prelu_ref(x, alpha, **kw), expected)
    assert bad == 0


def test_prelu_every_pair_and_ties_vs_tflite():
    # all 65,536 (input, alpha) pairs: alpha varies along C; power-of-two multipliers give ties
    x = np.broadcast_to(np.arange(256, dtype=np.uint8).reshape(1, 1, 256, 1), (1, 1, 256, 256)).copy()
    alpha = np.arange(256, dtype=np.uint8)
    bad = 0
    for s, zp, s_a, zp_a, so, zo in [(0.5, 128, 0.25, 128, 1.0, 128), (0.125, 100, 0.5, 7, 2.0 ** -6, 60),
                                     (_f32(0.0374), 31, _f32(0.0049), 200, _f32(0.011), 140)]:
        kw = dict(in_scale=s, in_zp=zp, alpha_scale=s_a, alpha_zp=zp_a, out_scale=so, out_zp=zo)
        expected = _tflite_prelu(x, alpha, s, zp, s_a, zp_a, so, zo)
        bad += _mismatches(act.prelu(x, alpha, **kw), expected)
    assert bad == 0


def test_prelu_rejects_alpha_that_changes_the_shape():
    with pytest.raises(MaceqError, match="Prelu"):
        act.prelu(np.zeros((1, 2, 2, 3), np.uint8), np.zeros((2, 1, 1, 3), np.uint8), in_scale=1.0,
                  in_zp=0, alpha_scale=1.0, alpha_zp=0, out_scale=1.0, out_zp=0)


# ---------------------------------------------------------------------------------------------
# Multipliers are C float expressions (float32), not double
# ---------------------------------------------------------------------------------------------
# Witnesses from a seeded search: configurations where computing the real multipliers in double
# changes some output code. The kernels (float32 expressions, as activations.cc) equal TFLite; the
# double variant (the same kernel arithmetic with double multipliers) does not.

def _qm16(real: float) -> tuple[int, int]:
    q, e = quantize_multiplier(real)
    return act._downscale_int32_to_int16_multiplier(q), e


def test_multipliers_are_float32_expressions():
    bad = double_bad = 0
    for alpha, s, zp, so, zo in [(-0.6892570853233337, 0.7390279769897461, 150, 0.08154791593551636, 141),
                                 (0.9963010549545288, 0.21838314831256866, 254, 0.38098257780075073, 225),
                                 (0.22029441595077515, 0.004908198025077581, 124, 0.003552236594259739, 106)]:
        expected = _tflite_unary("LEAKY_RELU", ALL, s, zp, so, zo, options={"alpha": alpha}).ravel()
        p = act.leaky_relu_params(alpha=alpha, in_scale=s, in_zp=zp, out_scale=so, out_zp=zo)
        (qa, sa), (qi, si) = quantize_multiplier(s * alpha / so), quantize_multiplier(s / so)
        double = replace(p, alpha_multiplier=qa, alpha_shift=sa, identity_multiplier=qi, identity_shift=si)
        bad += _mismatches(act.leaky_relu(ALL, alpha=alpha, in_scale=s, in_zp=zp, out_scale=so, out_zp=zo).ravel(),
                           expected)
        double_bad += _mismatches(act._leaky_relu_lut_v(double), expected)
    for s, zp, so, zo in [(0.04734351485967636, 119, 0.637154757976532, 17),
                          (0.03383268043398857, 99, 0.023104626685380936, 19),
                          (0.027356185019016266, 57, 0.006718689110130072, 91)]:
        expected = _tflite_unary("HARD_SWISH", ALL, s, zp, so, zo).ravel()
        p = act.hard_swish_params(in_scale=s, in_zp=zp, out_scale=so, out_zp=zo)
        (mo, eo), (mr, er) = _qm16(s / 128 / so), _qm16(s / 128 / (3 / 32768))
        double = replace(p, out_multiplier16=mo, out_exponent=eo, reluish_multiplier16=mr, reluish_exponent=er)
        bad += _mismatches(act.hard_swish(ALL, in_scale=s, in_zp=zp, out_scale=so, out_zp=zo).ravel(), expected)
        double_bad += _mismatches(act._hard_swish_lut_v(double), expected)
    x = np.broadcast_to(np.arange(256, dtype=np.uint8).reshape(1, 1, 256, 1), (1, 1, 256, 256)).copy()
    alpha = np.arange(256, dtype=np.uint8)
    for s, zp, sa, za, so, zo in [
            (0.018567394465208054, 166, 0.0148208262398839, 202, 0.024731170386075974, 186),
            (0.009446091949939728, 192, 0.0019277724204584956, 219, 0.0012724868720397353, 2),
            (0.004991347901523113, 231, 0.003372394712641835, 234, 0.01673177070915699, 21)]:
        expected = _tflite_prelu(x, alpha, s, zp, sa, za, so, zo).reshape(256, 256)
        p = act.prelu_params(in_scale=s, in_zp=zp, alpha_scale=sa, alpha_zp=za, out_scale=so, out_zp=zo)
        (q1, e1), (q2, e2) = quantize_multiplier(s / so), quantize_multiplier(s * sa / so)
        double = replace(p, multiplier_1=q1, shift_1=e1, multiplier_2=q2, shift_2=e2)
        got = act.prelu(x, alpha, in_scale=s, in_zp=zp, alpha_scale=sa, alpha_zp=za, out_scale=so, out_zp=zo)
        bad += _mismatches(got.reshape(256, 256), expected)
        double_bad += _mismatches(act._prelu_table_v(double), expected)
    assert bad == 0
    assert double_bad == 3 + 4 + 17  # leaky 1+1+1, hard swish 1+2+1, prelu 13+2+2


# ---------------------------------------------------------------------------------------------
# HardSigmoid and Clip: exact tables, checked against a plain-int transcription
# ---------------------------------------------------------------------------------------------

def _ratio(v: float) -> tuple[int, int]:
    return F32(v).item().as_integer_ratio()


def _exact_code(num: int, den: int, s_out: float, zp_out: int) -> int:
    """clamp(zp_out + round_half_away((num/den) / s_out), 0, 255) in integers (den > 0)."""
    on, od = _ratio(s_out)
    n, d = num * od, den * on                 # value / s_out = n / d, d > 0
    q = (2 * abs(n) + d) // (2 * d)           # floor(|n/d| + 1/2)
    return min(255, max(0, zp_out + (q if n >= 0 else -q)))


def _hard_sigmoid_int(c, alpha, beta, s_in, zp_in, s_out, zp_out) -> int:
    (an, ad), (bn, bd), (sn, sd) = _ratio(alpha), _ratio(beta), _ratio(s_in)
    den = ad * sd * bd
    num = an * sn * (c - zp_in) * bd + bn * ad * sd  # alpha * x + beta = num / den
    num = min(den, max(0, num))                      # max(0, min(1, .))
    return _exact_code(num, den, s_out, zp_out)


def _clip_int(c, lo, hi, s_in, zp_in, s_out, zp_out) -> int:
    sn, sd = _ratio(s_in)
    num, den = sn * (c - zp_in), sd
    if lo is not None:
        ln, ld = _ratio(lo)
        if num * ld < ln * den:
            num, den = ln, ld
    if hi is not None:
        hn, hd = _ratio(hi)
        if num * hd > hn * den:
            num, den = hn, hd
    return _exact_code(num, den, s_out, zp_out)


def _is_tie(num: int, den: int, s_out: float) -> bool:
    on, od = _ratio(s_out)
    return (2 * num * od) % (den * on) == 0 and (num * od) % (den * on) != 0


def _vs_integer_definition(fast, ref, int_code, configs, names) -> int:
    """Mismatches of ``fast`` and ``ref`` against ``int_code(c, *config)`` on every code."""
    bad = 0
    for config in configs:
        kw = dict(zip(names, config))
        expected = np.array([int_code(c, *config) for c in range(256)], np.uint8).reshape(ALL.shape)
        bad += _mismatches(fast(ALL, **kw), expected) + _mismatches(ref(ALL, **kw), expected)
    return bad


def test_hard_sigmoid_vs_integer_definition():
    rng = np.random.default_rng(11)
    configs = [(0.2, 0.5, *c) for c in _unary_configs(12, 25)]
    configs += [(_f32(rng.uniform(0.01, 1)), _f32(rng.uniform(-1, 2)), *c) for c in _unary_configs(13, 25)]
    # dyadic configurations where alpha*x + beta lands on half codes (exact ties), both signs of x
    configs += [(0.25, 0.5, 2.0 ** -4, 128, 2.0 ** -5, 0), (1 / 6, 0.5, 0.125, 128, 2.0 ** -8, 3),
                (0.5, 0.25, 2.0 ** -3, 100, 2.0 ** -6, 17)]
    configs += [(int(rng.integers(1, 64)) / 64, int(rng.integers(-64, 128)) / 64, 2.0 ** -int(rng.integers(2, 7)),
                 int(rng.integers(0, 256)), 2.0 ** -int(rng.integers(3, 9)), int(rng.integers(0, 256)))
                for _ in range(30)]
    names = ("alpha", "beta", "in_scale", "in_zp", "out_scale", "out_zp")
    assert _vs_integer_definition(act.hard_sigmoid, act.hard_sigmoid_ref, _hard_sigmoid_int, configs, names) == 0
    ties = 0
    for alpha, beta, s, zp, so, _ in configs:
        (an, ad), (bn, bd), (sn, sd) = _ratio(alpha), _ratio(beta), _ratio(s)
        nums = [an * sn * (c - zp) * bd + bn * ad * sd for c in range(256)]
        ties += sum(_is_tie(n, ad * sd * bd, so) for n in nums if 0 < n < ad * sd * bd)
    assert ties >= 100, ties  # the tie rule is exercised (115 exact ties)


def _clip_configs(seed: int, n: int):
    rng = np.random.default_rng(seed)
    for s, zp, so, zo in _unary_configs(seed + 1, n):
        lo = None if rng.random() < 0.15 else _f32(rng.uniform(-5, 1))
        hi = None if rng.random() < 0.15 else _f32(rng.uniform(-1, 8))
        yield lo, hi, s, zp, so, zo


def test_clip_vs_integer_definition():
    configs = list(_clip_configs(14, 50))
    configs += [(-1.0, 1.0, 2.0 ** -3, 128, 2.0 ** -4, 128), (0.0, 6.0, 0.125, 10, 0.25, 3),
                (2.0, -1.0, 0.1, 128, 0.1, 128), (-0.375, 0.625, 0.25, 128, 0.25, 128)]  # lo > hi; ties
    names = ("lo", "hi", "in_scale", "in_zp", "out_scale", "out_zp")
    assert _vs_integer_definition(act.clip, act.clip_ref, _clip_int, configs, names) == 0


def test_clip_with_equal_quantization_is_a_clamp_of_codes():
    configs = [(lo, hi, s, zp) for lo, hi, s, zp, _, _ in _clip_configs(16, 60)]
    configs += [(-0.375, 0.625, 0.25, 128), (0.125, 0.375, 0.25, 7),  # bounds on exact half codes
                (2.0, -1.0, 0.1, 128), (None, None, 0.3, 5), (-100.0, 100.0, 0.01, 250)]
    for lo, hi, s, zp in configs:
        qlo, qhi = act.clip_code_bounds(lo=lo, hi=hi, scale=s, zp=zp)
        got = act.clip(ALL, lo=lo, hi=hi, in_scale=s, in_zp=zp, out_scale=s, out_zp=zp)
        assert np.array_equal(got, np.minimum(np.maximum(ALL, qlo), qhi)), (lo, hi, s, zp)
    assert act.clip_code_bounds(lo=-0.375, hi=0.625, scale=0.25, zp=128) == (126, 131)  # -1.5, 2.5 away


_RELU_FAMILY = [("RELU", 0.0, None), ("RELU6", 0.0, 6.0), ("RELU_N1_TO_1", -1.0, 1.0), ("RELU_0_TO_1", 0.0, 1.0)]


def test_clip_equals_tflite_relu_family_with_equal_quantization():
    bad = 0
    with _extra_ops():
        for op, lo, hi in _RELU_FAMILY:
            for s, zp, _, _ in _unary_configs(17, 15):
                expected = _tflite_unary(op, ALL, s, zp, s, zp)
                bad += _mismatches(act.clip(ALL, lo=lo, hi=hi, in_scale=s, in_zp=zp, out_scale=s, out_zp=zp),
                                   expected)
    assert bad == 0


def test_clip_differs_from_tflite_relu_n1_to_1_only_at_negative_ties():
    # s_in / s_out = 0.5 exactly: odd x - zp are ties. TFLite's ReluX requantizes with
    # MultiplyByQuantizedMultiplier (ties toward +inf at this step); clip rounds ties away from 0.
    s_in, s_out = _f32(0.1), _f32(0.2)
    with _extra_ops():
        expected = _tflite_unary("RELU_N1_TO_1", ALL, s_in, 100, s_out, 100).ravel()
    got = act.clip(ALL, lo=-1.0, hi=1.0, in_scale=s_in, in_zp=100, out_scale=s_out, out_zp=100).ravel()
    v = np.arange(256) - 100
    negative_ties = (v < 0) & (v % 2 == 1) & (v >= -10)  # -1 <= x < 0 within the clip range
    assert np.array_equal(np.nonzero(got != expected)[0], np.nonzero(negative_ties)[0])
    assert np.all(got[negative_ties].astype(int) == expected[negative_ties].astype(int) - 1)


# ---------------------------------------------------------------------------------------------
# make_lut, lut_apply, fast == ref, argument checks
# ---------------------------------------------------------------------------------------------

def test_make_lut_rounding_and_specials():
    # fn(x) = x with s_in = 1, s_out = 2: exact halves round away from zero, then + zp
    lut = act.make_lut(lambda x: x, in_scale=1.0, in_zp=128, out_scale=2.0, out_zp=100)
    v = np.arange(256) - 128
    assert np.array_equal(lut, np.clip(100 + np.sign(v) * ((np.abs(v) + 1) // 2), 0, 255))
    lut = act.make_lut(lambda x: math.inf if x > 0 else -math.inf, in_scale=1.0, in_zp=128,
                       out_scale=1.0, out_zp=0)
    assert lut[129] == 255 and lut[127] == 0
    with pytest.raises(MaceqError, match="NaN"):
        act.make_lut(lambda x: math.nan, in_scale=1.0, in_zp=0, out_scale=1.0, out_zp=0)
    # fn may return a Fraction: the quotient and its rounding stay exact (+-5/4 / 0.5 = +-2.5 -> +-3)
    lut = act.make_lut(lambda x: Fraction(5, 4) if x > 0 else Fraction(-5, 4), in_scale=1.0, in_zp=128,
                       out_scale=0.5, out_zp=128)
    assert (lut[129], lut[127]) == (131, 125)


def test_fast_equals_ref_on_random_tensors():
    rng = np.random.default_rng(18)
    for s, zp, so, zo in _unary_configs(19, 8):
        x = rng.integers(0, 256, (2, 5, 7, 3)).astype(np.uint8)
        alpha = rng.integers(0, 256, (3,)).astype(np.uint8)
        pairs = [
            (act.logistic, act.logistic_ref, dict(in_scale=s, in_zp=zp)),
            (act.tanh, act.tanh_ref, dict(in_scale=s, in_zp=zp)),
            (act.leaky_relu, act.leaky_relu_ref, dict(alpha=-0.3, in_scale=s, in_zp=zp, out_scale=so, out_zp=zo)),
            (act.hard_sigmoid, act.hard_sigmoid_ref,
             dict(alpha=0.2, beta=0.5, in_scale=s, in_zp=zp, out_scale=so, out_zp=zo)),
            (act.clip, act.clip_ref, dict(lo=-0.5, hi=3.0, in_scale=s, in_zp=zp, out_scale=so, out_zp=zo)),
        ]
        if s < 128 * so:
            pairs.append((act.hard_swish, act.hard_swish_ref, dict(in_scale=s, in_zp=zp, out_scale=so, out_zp=zo)))
        for fast, ref, kw in pairs:
            got = fast(x, **kw)
            assert got.shape == x.shape and np.array_equal(got, ref(x, **kw)), fast.__name__
        kw = dict(in_scale=s, in_zp=zp, alpha_scale=0.01, alpha_zp=128, out_scale=so, out_zp=zo)
        assert np.array_equal(act.prelu(x, alpha, **kw), act.prelu_ref(x, alpha, **kw))
        assert np.array_equal(act.lut_apply(x, act.make_lut(lambda v: v, in_scale=s, in_zp=zp, out_scale=so,
                                                            out_zp=zo)),
                              act.clip_ref(x, lo=None, hi=None, in_scale=s, in_zp=zp, out_scale=so, out_zp=zo))


def test_argument_checks():
    x = np.zeros((1, 2, 2, 1), np.uint8)
    with pytest.raises(MaceqError, match="uint8"):
        act.logistic(x.astype(np.int8), in_scale=0.1, in_zp=0)
    with pytest.raises(MaceqError, match="in_zp"):
        act.tanh(x, in_scale=0.1, in_zp=256)
    with pytest.raises(MaceqError, match="in_scale"):
        act.leaky_relu(x, alpha=0.1, in_scale=0.0, in_zp=0, out_scale=1.0, out_zp=0)
    with pytest.raises(MaceqError, match="table"):
        act.lut_apply(x, np.zeros(255, np.uint8))
