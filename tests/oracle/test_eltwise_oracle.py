"""Oracle tests for the MACE ARM NEON uint8 Eltwise SUM/SUB kernel (runtime/kernels/eltwise.py).

Oracles:
1. TFLite ADD/SUB (BUILTIN_REF). TFLite's uint8 arithmetic is gemmlowp's left-shift-20 scheme,
   the same as MACE's scalar tail. The NEON body differs only in the rescale of the input with
   the smaller scale (floor shift instead of RoundingDivideByPOT) and in a 16-bit wrap that
   needs |result| >= 2^15. With equal input scales both inputs have (M, e) = (2^30, 0) and the
   rescale is exact, so the kernel must equal TFLite on every element.
2. ``_mace_neon_scalar`` below: a plain-Python-int transcription of mace/ops/arm/q8/eltwise.cc
   and of the NEON intrinsics' semantics (VQRDMULH, VSHL by a negative count, gemmlowp's NEON
   RoundingDivideByPOT = VQADD fix-up + VRSHL, VMOVN, VADDQ_S16, VQMOVUN), written without the
   kernel's code or maceq.runtime.fixedpoint. With ``rescale="rdbp"`` (the tail's arithmetic on
   every element) it must equal TFLite ADD on unequal scales too, which checks the
   transcription itself; with the real NEON rules it must equal the kernel everywhere.
3. The vectorised kernel equals the readable reference bit for bit.
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from maceq.runtime.kernels.eltwise import eltwise_add, eltwise_add_ref
from maceq.tests.oracle.tflite_builder import TensorSpec, build_single_op_model, run_ref

I32_MIN, I32_MAX = -(1 << 31), (1 << 31) - 1


# ---------------------------------------------------------------------------------------------
# Independent scalar transcription (plain Python ints)
# ---------------------------------------------------------------------------------------------

def _c_div(a: int, b: int) -> int:
    """C integer division (truncates toward zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def _sat32(v: int) -> int:
    return max(I32_MIN, min(I32_MAX, v))


def _wrap16(v: int) -> int:
    v &= 0xFFFF
    return v - 0x10000 if v >= 0x8000 else v


def _vqrdmulh(a: int, b: int) -> int:
    """ARM VQRDMULH.S32: saturate((2*a*b + 2^31) >> 32)."""
    return _sat32((2 * a * b + (1 << 31)) >> 32)


def _gemmlowp_srdhm(a: int, b: int) -> int:
    """gemmlowp fixedpoint.h scalar SaturatingRoundingDoublingHighMul (nudge + C division)."""
    if a == b == I32_MIN:
        return I32_MAX
    ab = a * b
    nudge = (1 << 30) if ab >= 0 else 1 - (1 << 30)
    return _c_div(ab + nudge, 1 << 31)


def _gemmlowp_rdbp(x: int, exponent: int) -> int:
    """gemmlowp fixedpoint.h scalar RoundingDivideByPOT (mask / threshold form)."""
    mask = (1 << exponent) - 1
    remainder = x & mask
    threshold = (mask >> 1) + (1 if x < 0 else 0)
    return (x >> exponent) + (1 if remainder > threshold else 0)


def _neon_rdbp(x: int, exponent: int) -> int:
    """gemmlowp fixedpoint_neon.h RoundingDivideByPOT(int32x4_t): VAND/VSHR fix-up, VQADD, VRSHL."""
    shift = -exponent  # vdupq_n_s32(-exponent)
    fixup = -1 if (x & shift) < 0 else 0  # vshrq_n_s32(vandq_s32(x, shift), 31)
    fixed = _sat32(x + fixup)  # vqaddq_s32
    if shift >= 0:  # vrshlq_s32 by a non-negative count: plain left shift (here always 0)
        return fixed << shift
    n = -shift
    return (fixed + (1 << (n - 1))) >> n  # rounding right shift, computed without overflow


def _vshl_s32(x: int, count: int) -> int:
    """ARM VSHL.S32 by register: left shift for count >= 0, truncating arithmetic right shift else."""
    return x << count if count >= 0 else x >> -count


def _mace_quantize_multiplier(d: float) -> tuple[int, int]:
    """mace/core/quantize.h QuantizeMultiplier: frexp, roundl(q * 2^31), renormalise 2^31."""
    q, shift = math.frexp(d)
    v = Fraction(q) * (1 << 31)
    qint = int(v.__floor__() + 1) if v - v.__floor__() >= Fraction(1, 2) else int(v.__floor__())
    if qint == (1 << 31):
        qint //= 2
        shift += 1
    return qint, shift


def _mace_neon_scalar(a, b, *, a_scale, a_zp, b_scale, b_zp, out_scale, out_zp, subtract,
                      rescale: str = "neon") -> np.ndarray:
    """Element-by-element transcription of arm/q8/eltwise.cc (NEON loop + scalar tail).

    rescale="neon": the real device code. rescale="rdbp": the scalar tail's arithmetic on every
    element (what TFLite computes), used to validate this transcription against TFLite.
    """
    s0, s1, so = (float(np.float32(s)) for s in (a_scale, b_scale, out_scale))
    left_shift = 20
    doubled_scale = float(np.float32(2) * np.float32(max(s0, s1)))  # 2 * std::max(float, float)
    out_den = float(np.float32(1 << left_shift) * np.float32(so))   # (1 << 20) * float
    m0, sh0 = _mace_quantize_multiplier(s0 / doubled_scale)
    m1, sh1 = _mace_quantize_multiplier(s1 / doubled_scale)
    mo, sho = _mace_quantize_multiplier(doubled_scale / out_den)
    fa = [int(v) for v in np.asarray(a).ravel()]
    fb = [int(v) for v in np.broadcast_to(np.asarray(b), np.asarray(a).shape).ravel()]
    size = len(fa)
    out = []
    for i in range(size):
        if rescale == "neon" and i < size - size % 8:
            o0 = (fa[i] - a_zp) << left_shift  # vaddq_s16 offsets, vmovl, vshlq_s32(.., 20)
            o1 = (fb[i] - b_zp) << left_shift
            o0 = _vshl_s32(_vqrdmulh(o0, m0), sh0)
            o1 = _vshl_s32(_vqrdmulh(o1, m1), sh1)
            res = o0 - o1 if subtract else o0 + o1
            res = _neon_rdbp(_vqrdmulh(res, mo), -sho)
            v = _wrap16(_wrap16(res) + _wrap16(out_zp))  # vmovn_s32, vaddq_s16
            out.append(min(255, max(0, v)))               # vqmovun_s16
        else:
            o0 = (fa[i] - a_zp) * (1 << left_shift)
            o1 = (fb[i] - b_zp) * (1 << left_shift)
            o0 = _gemmlowp_rdbp(_gemmlowp_srdhm(o0, m0), -sh0)
            o1 = _gemmlowp_rdbp(_gemmlowp_srdhm(o1, m1), -sh1)
            res = o0 - o1 if subtract else o0 + o1
            v = _gemmlowp_rdbp(_gemmlowp_srdhm(res, mo), -sho) + out_zp
            out.append(min(255, max(0, v)))               # Saturate<uint8_t>
    return np.array(out, dtype=np.uint8).reshape(np.asarray(a).shape)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

def _tflite(op: str, a, b, *, a_scale, a_zp, b_scale, b_zp, out_scale, out_zp) -> np.ndarray:
    a, b = np.asarray(a), np.asarray(b)
    model = build_single_op_model(
        op,
        [TensorSpec(a.shape, a_scale, a_zp), TensorSpec(b.shape, b_scale, b_zp)],
        [TensorSpec(a.shape, out_scale, out_zp)],
        options={"fused_activation_function": "NONE"})
    (out,) = run_ref(model, [a, b])
    return out


def _random_config(rng, *, equal_scales: bool) -> dict:
    a_scale = float(np.float32(rng.uniform(0.003, 0.2)))
    b_scale = a_scale if equal_scales else float(np.float32(a_scale * rng.uniform(0.05, 1.0)))
    if not equal_scales and rng.random() < 0.5:
        a_scale, b_scale = b_scale, a_scale
    out_scale = float(np.float32(max(a_scale, b_scale) * rng.uniform(0.6, 3.0)))
    return dict(a_scale=a_scale, a_zp=int(rng.integers(0, 256)), b_scale=b_scale,
                b_zp=int(rng.integers(0, 256)), out_scale=out_scale, out_zp=int(rng.integers(0, 256)))


def _all_pairs(extra: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Every (a, b) code pair once (65536 elements, all in the NEON body), plus ``extra`` more."""
    a = np.repeat(np.arange(256, dtype=np.uint8), 256)
    b = np.tile(np.arange(256, dtype=np.uint8), 256)
    if extra:
        a = np.concatenate([a, a[:extra][::-1]])
        b = np.concatenate([b, b[:extra]])
    return a.reshape(1, 1, -1, 1), b.reshape(1, 1, -1, 1)


SHAPES = [(1, 3, 5, 7), (2, 4, 4, 8), (1, 1, 1, 13), (1, 6, 6, 16), (1, 1, 1, 5)]


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["ADD", "SUB"])
def test_equal_scales_match_tflite_every_element(op):
    rng = np.random.default_rng(11 if op == "ADD" else 12)
    total = mismatches = 0
    for k in range(24):
        cfg = _random_config(rng, equal_scales=True)
        shape = SHAPES[k % len(SHAPES)]
        a = rng.integers(0, 256, shape, dtype=np.uint8)
        b = rng.integers(0, 256, shape, dtype=np.uint8)
        got = eltwise_add(a, b, subtract=(op == "SUB"), **cfg)
        want = _tflite(op, a, b, **cfg)
        total += got.size
        mismatches += int((got != want).sum())
    # all 65536 input pairs for a few more configs, plus a tail of 5
    for _ in range(4):
        cfg = _random_config(rng, equal_scales=True)
        a, b = _all_pairs(extra=5)
        got = eltwise_add(a, b, subtract=(op == "SUB"), **cfg)
        want = _tflite(op, a, b, **cfg)
        total += got.size
        mismatches += int((got != want).sum())
    assert total > 250_000
    assert mismatches == 0


@pytest.mark.parametrize("op", ["ADD", "SUB"])
def test_transcription_in_rdbp_mode_matches_tflite_on_unequal_scales(op):
    """Validates the test's own scalar transcription against TFLite where the two are the same."""
    rng = np.random.default_rng(21 if op == "ADD" else 22)
    mismatches = total = 0
    for k in range(4):
        cfg = _random_config(rng, equal_scales=False)
        a, b = _all_pairs(extra=k)
        want = _tflite(op, a, b, **cfg)
        got = _mace_neon_scalar(a, b, subtract=(op == "SUB"), rescale="rdbp", **cfg)
        total += got.size
        mismatches += int((got != want).sum())
    assert total > 260_000
    assert mismatches == 0


@pytest.mark.parametrize("subtract", [False, True])
def test_kernel_matches_neon_transcription_on_all_pairs(subtract):
    rng = np.random.default_rng(31 + subtract)
    mismatches = total = 0
    for k in range(6):
        cfg = _random_config(rng, equal_scales=False)
        a, b = _all_pairs(extra=3 + k)
        want = _mace_neon_scalar(a, b, subtract=subtract, **cfg)
        got = eltwise_add(a, b, subtract=subtract, **cfg)
        total += got.size
        mismatches += int((got != want).sum())
    assert total > 390_000
    assert mismatches == 0


# Configurations (float32 scales, zero points) found by a search over random scales, where the
# NEON floor rescale changes one of the 65536 (a, b) pairs; about 1 random config in 40 does.
TRUNCATION_VISIBLE = {
    False: [(0.01594742387533188, 166, 0.013543372042477131, 88, 0.010632546618580818, 57),
            (0.06136162951588631, 234, 0.00853864848613739, 18, 0.09072016924619675, 115),
            (0.06393763422966003, 1, 0.004914992954581976, 0, 0.08628562092781067, 150)],
    True: [(0.09804391115903854, 204, 0.059843700379133224, 48, 0.12737904489040375, 92),
           (0.08427713811397552, 154, 0.038906343281269073, 67, 0.22027012705802917, 34),
           (0.03160716965794563, 6, 0.030847162008285522, 189, 0.02220652811229229, 36)],
}


@pytest.mark.parametrize("subtract", [False, True])
def test_truncating_rescale_is_visible_and_modelled(subtract):
    """Where NEON's floor rescale changes an output code, the kernel follows the device, not TFLite."""
    a, b = _all_pairs()
    for sa, za, sb, zb, so, zo in TRUNCATION_VISIBLE[subtract]:
        cfg = dict(a_scale=sa, a_zp=za, b_scale=sb, b_zp=zb, out_scale=so, out_zp=zo)
        got = eltwise_add(a, b, subtract=subtract, **cfg)
        neon = _mace_neon_scalar(a, b, subtract=subtract, **cfg)
        tail_rule = _mace_neon_scalar(a, b, subtract=subtract, rescale="rdbp", **cfg)
        assert int((got != neon).sum()) == 0
        assert int((neon != tail_rule).sum()) >= 1
        if not subtract:
            assert np.array_equal(tail_rule, _tflite("ADD", a, b, **cfg))


def test_kernel_matches_transcription_on_saturation_and_int16_wrap():
    """Output scales far below the input scales: clamps, and the VMOVN/VADDQ_S16 wrap."""
    wrapped_seen = 0
    for out_scale in (2e-4, 5e-5, 1e-5):
        cfg = dict(a_scale=0.5, a_zp=128, b_scale=float(np.float32(0.37)), b_zp=3,
                   out_scale=out_scale, out_zp=250)
        a, b = _all_pairs(extra=7)
        for subtract in (False, True):
            want = _mace_neon_scalar(a, b, subtract=subtract, **cfg)
            got = eltwise_add(a, b, subtract=subtract, **cfg)
            assert int((got != want).sum()) == 0
            tail_rule = _mace_neon_scalar(a, b, subtract=subtract, rescale="rdbp", **cfg)
            wrapped_seen += int((want != tail_rule).sum())
    assert wrapped_seen > 1000  # the 16-bit wrap changes many saturated codes


def test_fast_equals_reference():
    rng = np.random.default_rng(51)
    for k in range(30):
        cfg = _random_config(rng, equal_scales=bool(k % 3 == 0))
        shape = SHAPES[k % len(SHAPES)]
        a = rng.integers(0, 256, shape, dtype=np.uint8)
        b = rng.integers(0, 256, shape, dtype=np.uint8)
        subtract = bool(k % 2)
        lo, hi = (0, 255) if k % 4 else (int(rng.integers(0, 100)), int(rng.integers(150, 256)))
        fast = eltwise_add(a, b, subtract=subtract, act_min=lo, act_max=hi, **cfg)
        ref = eltwise_add_ref(a, b, subtract=subtract, act_min=lo, act_max=hi, **cfg)
        assert np.array_equal(fast, ref)


def test_per_channel_broadcast_matches_tflite_broadcast_add():
    rng = np.random.default_rng(61)
    for _ in range(6):
        cfg = _random_config(rng, equal_scales=True)
        a = rng.integers(0, 256, (1, 5, 3, 6), dtype=np.uint8)
        b = rng.integers(0, 256, (6,), dtype=np.uint8)
        got = eltwise_add(a, b, **cfg)
        want = _tflite("ADD", a, b, **cfg)
        assert np.array_equal(got, want)
        assert np.array_equal(got, eltwise_add(a, np.broadcast_to(b, a.shape).copy(), **cfg))
