"""Oracle tests for MACE's uint8 Softmax (runtime/kernels/softmax.py).

MACE departs from TFLite here: its output scale is 1/255 (TFLite forces 1/256), below depth
32 it computes in float32 and truncates p * 255, and its fixed-point path scales the input
as ``trunc(in_scale * 2^25) * delta`` in Q6.25 where TFLite uses a rounded multiplier in
Q5.26. So the oracle is ``_softmax_scalar`` below: a plain-Python-int (and numpy float32
scalar) transcription of mace/ops/softmax.cc and of gemmlowp's fixedpoint.h, written apart
from the kernel. Run in TFLite's configuration (Q5.26 input, MultiplyByQuantizedMultiplier-
GreaterThanOne scaling, diff_min radius) the same transcription must equal TFLite's SOFTMAX
(BUILTIN_REF) on every element, which checks its gemmlowp parts (exp_on_negative_values,
one_over_one_plus_x_for_x_in_0_1, the reciprocal and the final RoundingDivideByPOT); in MACE's
configuration it must equal the kernel on every element.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math

import numpy as np
import pytest

from maceq.errors import MaceqError
from maceq.runtime.kernels.softmax import OUT_SCALE, softmax, softmax_ref
from maceq.tests.oracle.test_eltwise_oracle import _gemmlowp_rdbp as rdbp
from maceq.tests.oracle.test_eltwise_oracle import _gemmlowp_srdhm as srdhm
from maceq.tests.oracle.tflite_builder import TensorSpec, build_single_op_model, run_ref

I32_MIN, I32_MAX = -(1 << 31), (1 << 31) - 1
F32 = np.float32

_libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
_libm.expf.restype = ctypes.c_float
_libm.expf.argtypes = [ctypes.c_float]


# ---------------------------------------------------------------------------------------------
# gemmlowp fixedpoint.h, scalar int32 (plain Python ints)
# ---------------------------------------------------------------------------------------------

def _srmbpot(x: int, exponent: int) -> int:
    """SaturatingRoundingMultiplyByPOT<exponent>."""
    if exponent == 0:
        return x
    if exponent < 0:
        return rdbp(x, -exponent)
    threshold = (1 << (31 - exponent)) - 1
    if x > threshold:
        return I32_MAX
    if x < -threshold:
        return I32_MIN
    return x * (1 << exponent)


def _exp_quarter(a: int) -> int:
    """exp_on_interval_between_negative_one_quarter_and_0_excl, Q0.31 in and out."""
    constant_term, constant_1_over_3 = 1895147668, 715827883
    x = a + (1 << 28)
    x2 = srdhm(x, x)
    x3 = srdhm(x2, x)
    x4 = srdhm(x2, x2)
    x4_over_4 = _srmbpot(x4, -2)
    x4_over_24_plus_x3_over_6_plus_x2_over_2 = _srmbpot(srdhm(x4_over_4 + x3, constant_1_over_3) + x2, -1)
    return constant_term + srdhm(constant_term, x + x4_over_24_plus_x3_over_6_plus_x2_over_2)


def _exp_neg(a: int, integer_bits: int) -> int:
    """exp_on_negative_values<integer_bits>: Q(integer_bits) in, Q0.31 out."""
    fractional_bits = 31 - integer_bits
    one_quarter = 1 << (fractional_bits - 2)
    a_mod_quarter_minus_one_quarter = (a & (one_quarter - 1)) - one_quarter
    result = _exp_quarter(_srmbpot(a_mod_quarter_minus_one_quarter, integer_bits))  # Rescale<0>
    remainder = a_mod_quarter_minus_one_quarter - a
    for exponent, multiplier in ((-2, 1672461947), (-1, 1302514674), (0, 790015084), (1, 290630308),
                                 (2, 39332535), (3, 720401), (4, 242)):
        if integer_bits > exponent and remainder & (1 << (fractional_bits + exponent)):
            result = srdhm(result, multiplier)
    if integer_bits > 5 and a < -(1 << (36 - integer_bits)):
        result = 0
    if a == 0:
        result = I32_MAX
    return result


def _one_over_one_plus_x(a: int) -> int:
    """one_over_one_plus_x_for_x_in_0_1, Q0.31 in and out."""
    s = a + I32_MAX
    half_denominator = (s + 1) // 2 if s >= 0 else -((1 - s) // 2)  # RoundingHalfSum: (s + sign) / 2 in C
    x = 1515870810 + srdhm(half_denominator, -1010580540)  # 48/17 - 32/17 * d, Q2.29
    for _ in range(3):
        half_denominator_times_x = srdhm(half_denominator, x)
        one_minus_half_denominator_times_x = (1 << 29) - half_denominator_times_x
        x = x + _srmbpot(srdhm(x, one_minus_half_denominator_times_x), 2)
    return _srmbpot(x, 1)  # Rescale<0>(ExactMulByPot<-1>(x))


# ---------------------------------------------------------------------------------------------
# The two softmax variants, element by element
# ---------------------------------------------------------------------------------------------

def _quantize_multiplier_gt_one(d: float) -> tuple[int, int]:
    m, e = math.frexp(d)
    q = int(math.floor(m * (1 << 31) + 0.5))  # m * 2^31 is exact; + 0.5 exact below 2^52
    if q == 1 << 31:
        q //= 2
        e += 1
    assert e >= 0
    return q, e


def _softmax_scalar(x: np.ndarray, in_scale: float, *, mode: str) -> np.ndarray:
    """mode="mace": mace/ops/softmax.cc uint8; mode="tflite": TFLite's reference uint8 Softmax."""
    rows = x.reshape(-1, x.shape[-1])
    depth = rows.shape[1]
    out = np.zeros(rows.shape, dtype=np.uint8)
    s_in = F32(in_scale)
    for b, row in enumerate(rows):
        codes = [int(v) for v in row]
        mx = max(codes)
        if mode == "mace" and depth < 32:
            exps = [F32(_libm.expf(float(F32(F32(c - mx) * s_in)))) for c in codes]
            total = F32(0)
            for e in exps:
                total = F32(total + e)
            total = max(total, F32(np.finfo(np.float32).tiny))
            for d, e in enumerate(exps):
                out[b, d] = math.trunc(float(F32(e / total)) * 255.0)
            continue
        if mode == "mace":
            int_bits = 6
            scale_q = int(min(float(s_in) * (1 << 25), (1 << 31) - 1.0))
            limit = -(I32_MAX // scale_q)

            def scaled(delta):
                return scale_q * delta
        else:
            int_bits = 5
            multiplier, left_shift = _quantize_multiplier_gt_one(min(1.0 * float(s_in) * (1 << 26), (1 << 31) - 1.0))
            limit = -math.floor(31.0 * (1 << 26) / (1 << left_shift))  # -CalculateInputRadius(5, ls, 31)

            def scaled(delta):
                return srdhm(delta * (1 << left_shift), multiplier)
        total = 0
        for c in codes:
            if c - mx >= limit:
                total += _srmbpot(_exp_neg(scaled(c - mx), int_bits), -12)  # Rescale<12>
        assert 0 < total < (1 << 28)
        headroom = 32 - total.bit_length()
        tail = 12 - headroom
        recip = _one_over_one_plus_x(((total << headroom) & 0xFFFFFFFF) - (1 << 31))
        for d, c in enumerate(codes):
            if c - mx >= limit:
                o = rdbp(srdhm(recip, _exp_neg(scaled(c - mx), int_bits)), tail + 31 - 8)
                out[b, d] = max(0, min(255, o))
    return out.reshape(x.shape)


def _tflite_softmax(x: np.ndarray, in_scale: float, in_zp: int) -> np.ndarray:
    model = build_single_op_model("SOFTMAX", [TensorSpec(x.shape, in_scale, in_zp)],
                                  [TensorSpec(x.shape, 1.0 / 256, 0)], options={"beta": 1.0})
    (out,) = run_ref(model, [x])
    return out


def _rows(rng, n: int, depth: int) -> np.ndarray:
    x = rng.integers(0, 256, (n, depth), dtype=np.uint8)
    if depth < 256:  # (wider rows would make the exponential sum reach 512, which raises)
        x[0] = 200                                            # all equal: uniform output
        x[1] = rng.integers(250, 256, depth, dtype=np.uint8)  # small deltas
    x[2, :] = 0
    x[2, 0] = 255                                         # one dominant class
    x[3] = np.sort(x[3])                                  # all 256 deltas spread out
    return x


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------

def test_scalar_transcription_matches_tflite_in_tflite_configuration():
    rng = np.random.default_rng(401)
    total = mismatches = 0
    for k in range(16):
        depth = int(rng.choice([1, 5, 10, 31, 32, 100, 257]))
        in_scale = float(F32(rng.uniform(0.005, 0.3)))
        x = _rows(rng, 6, depth)
        want = _tflite_softmax(x, in_scale, int(rng.integers(0, 256)))
        got = _softmax_scalar(x, in_scale, mode="tflite")
        total += got.size
        mismatches += int((got != want).sum())
    assert mismatches == 0
    assert total > 3000


def test_kernel_fixed_point_path_matches_scalar_transcription():
    rng = np.random.default_rng(402)
    total = mismatches = 0
    for in_scale in (0.004, 0.02, 0.0625, 0.1, 0.17, 0.2509):
        for depth in (32, 33, 100, 1000):
            if depth == 1000 and in_scale < 0.05:
                continue
            x = _rows(rng, 5, depth)
            want = _softmax_scalar(x, float(F32(in_scale)), mode="mace")
            got = softmax(x, in_scale=in_scale)
            total += got.size
            mismatches += int((got != want).sum())
    assert mismatches == 0
    assert total > 20_000


def test_kernel_float_path_matches_scalar_transcription():
    rng = np.random.default_rng(403)
    total = mismatches = 0
    for _ in range(40):
        depth = int(rng.integers(1, 32))
        in_scale = float(F32(rng.uniform(0.001, 0.5)))
        x = _rows(rng, 8, depth) if depth >= 4 else rng.integers(0, 256, (8, depth), dtype=np.uint8)
        want = _softmax_scalar(x, in_scale, mode="mace")
        got = softmax(x, in_scale=in_scale)
        total += got.size
        mismatches += int((got != want).sum())
    assert mismatches == 0
    assert total > 3000


def test_float_path_truncates_p_times_255():
    # two equal logits: p = 0.5 exactly, 127.5 truncates to 127 (TFLite's 1/256 scale gives 128)
    x = np.array([[7, 7]], dtype=np.uint8)
    assert softmax(x, in_scale=0.1).tolist() == [[127, 127]]
    # depth 1: p = 1, 255
    assert softmax(np.array([[3]], dtype=np.uint8), in_scale=0.1).tolist() == [[255]]
    assert OUT_SCALE == float(np.float32(1) / np.float32(255))


def test_fast_equals_reference_nhwc_and_depth_boundary():
    rng = np.random.default_rng(404)
    for shape in [(1, 3, 4, 31), (1, 3, 4, 32), (2, 1, 1, 10), (4, 64), (2, 2, 2, 1)]:
        for in_scale in (0.01, 0.08, 0.4):
            x = rng.integers(0, 256, shape, dtype=np.uint8)
            assert np.array_equal(softmax(x, in_scale=in_scale), softmax_ref(x, in_scale=in_scale))


def test_deltas_below_limit_give_zero_and_large_sums_raise():
    # in_scale 0.5: scale_q = 2^24, limit = -127; deltas below it are never written by MACE
    x = np.zeros((1, 40), dtype=np.uint8)
    x[0, :3] = (255, 200, 100)
    got = softmax(x, in_scale=0.5)
    assert got[0, 2:].tolist() == [0] * 38
    assert np.array_equal(got, _softmax_scalar(x, 0.5, mode="mace"))
    # 600 equal logits: sum of exponentials 600 >= 512, RoundingDivideByPOT exponent 32
    flat = np.full((1, 600), 9, dtype=np.uint8)
    with pytest.raises(MaceqError):
        softmax(flat, in_scale=0.1)
    with pytest.raises(MaceqError):
        softmax_ref(flat, in_scale=0.1)
