"""Oracle tests for the uint8 MUL kernel (runtime/kernels/mul.py) against TFLite BUILTIN_REF MUL.

1. Every one of the 65,536 (a, b) code pairs over random scale / zero-point configurations
   (fixed seeds), multipliers below and above 1, exact ties (power-of-two multipliers), left
   shifts >= 16 (int32 wrap of the shifted product), and the fused RELU / RELU6 clamps.
2. Broadcast shapes: b as [C], [1, 1, 1, C], [N, 1, 1, C] (squeeze-and-excite), a broadcast
   against b, and both broadcast.
3. The multiplier is the C float expression ``s_a * s_b / s_out`` (two float32 operations), not
   the double one: on scales where the two give different Q31 multipliers, the kernel equals
   TFLite and the double-multiplier arithmetic does not.
4. fast (65,536-entry table) == ref (per-element Python ints), bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest

from maceq.errors import MaceqError
from maceq.runtime.fixedpoint import multiply_by_quantized_multiplier, quantize_multiplier
from maceq.runtime.kernels.mul import mul, mul_params, mul_ref
from maceq.tests.oracle.tflite_builder import (
    TensorSpec,
    build_single_op_model,
    fused_activation_range,
    run_ref,
)

F32 = np.float32
# every (a, b) pair once: a varies along H, b along W
A_ALL = np.broadcast_to(np.arange(256, dtype=np.uint8).reshape(1, 256, 1, 1), (1, 256, 256, 1)).copy()
B_ALL = np.broadcast_to(np.arange(256, dtype=np.uint8).reshape(1, 1, 256, 1), (1, 256, 256, 1)).copy()


def _f32(v: float) -> float:
    return float(F32(v))


def _tflite_mul(a, b, sa, za, sb, zb, so, zo, activation="NONE") -> np.ndarray:
    out_shape = np.broadcast_shapes(a.shape, b.shape)
    model = build_single_op_model("MUL", [TensorSpec(a.shape, sa, za), TensorSpec(b.shape, sb, zb)],
                                  [TensorSpec(out_shape, so, zo)],
                                  options={"fused_activation_function": activation})
    (out,) = run_ref(model, [a, b])
    return out


def _configs(seed: int, n: int):
    """(s_a, zp_a, s_b, zp_b, s_out, zp_out); multiplier s_a s_b / s_out over 10^-4 .. 10^1.5."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        sa, sb = _f32(10 ** rng.uniform(-3, 0.5)), _f32(10 ** rng.uniform(-3, 0.5))
        so = _f32(sa * sb / 10 ** rng.uniform(-4, 1.5))
        yield (sa, int(rng.integers(0, 256)), sb, int(rng.integers(0, 256)), so, int(rng.integers(0, 256)))


def _mismatches(a, b) -> int:
    assert a.shape == b.shape and a.dtype == b.dtype == np.uint8
    return int(np.count_nonzero(a != b))


def test_mul_every_pair_vs_tflite():
    configs = list(_configs(1, 24))
    configs += [  # exact ties: M = 2^-k; left shifts >= 16 (the shifted product wraps in int32)
        (1.0, 128, 1.0, 127, 2.0, 128), (1.0, 128, 1.0, 128, 8.0, 100), (0.5, 0, 0.25, 255, 1.0, 3),
        (1.0, 128, 1.0, 127, 2.0 ** -17, 128), (1.0, 100, 1.0, 50, 2.0 ** -20, 7),
    ]
    assert mul_params(a_scale=1.0, a_zp=0, b_scale=1.0, b_zp=0, out_scale=2.0 ** -20, out_zp=0).shift == 21
    bad = 0
    for i, (sa, za, sb, zb, so, zo) in enumerate(configs):
        activation = ("NONE", "RELU", "RELU6")[i % 3]
        act_min, act_max = fused_activation_range(activation, so, zo)
        expected = _tflite_mul(A_ALL, B_ALL, sa, za, sb, zb, so, zo, activation)
        got = mul(A_ALL, B_ALL, a_scale=sa, a_zp=za, b_scale=sb, b_zp=zb, out_scale=so, out_zp=zo,
                  act_min=act_min, act_max=act_max)
        bad += _mismatches(got, expected)
    assert bad == 0


@pytest.mark.parametrize("a_shape,b_shape", [
    ((2, 5, 7, 8), (8,)),
    ((2, 5, 7, 8), (1, 1, 1, 8)),
    ((2, 5, 7, 8), (2, 1, 1, 8)),
    ((1, 1, 1, 8), (2, 5, 7, 8)),
    ((2, 5, 7, 8), (1, 5, 1, 1)),
    ((2, 1, 7, 8), (2, 5, 1, 8)),
    ((2, 5, 7, 8), (2, 5, 7, 8)),
])
def test_mul_broadcast_vs_tflite_and_ref(a_shape, b_shape):
    rng = np.random.default_rng(len(a_shape) * 10 + len(b_shape) + sum(b_shape))
    bad = 0
    for sa, za, sb, zb, so, zo in _configs(sum(a_shape) + sum(b_shape), 5):
        a = rng.integers(0, 256, a_shape).astype(np.uint8)
        b = rng.integers(0, 256, b_shape).astype(np.uint8)
        kw = dict(a_scale=sa, a_zp=za, b_scale=sb, b_zp=zb, out_scale=so, out_zp=zo)
        expected = _tflite_mul(a, b, sa, za, sb, zb, so, zo)
        got = mul(a, b, **kw)
        bad += _mismatches(got, expected) + _mismatches(mul_ref(a, b, **kw), got)
    assert bad == 0


def _mul_with_double_multiplier(a, b, sa, za, sb, zb, so, zo) -> np.ndarray:
    """The same arithmetic with the multiplier computed in double (what the source does NOT do)."""
    q, shift = quantize_multiplier(_f32(sa) * _f32(sb) / _f32(so))
    acc = (a.astype(np.int64) - za) * (b.astype(np.int64) - zb)
    return np.clip(zo + multiply_by_quantized_multiplier(acc, q, shift), 0, 255).astype(np.uint8)


# Scales (float32 values) whose float32 and double multipliers differ in the last bits of the Q31
# value AND change some output code; found by a seeded search over 10^-3..1 (about 1 draw in 400).
MULTIPLIER_WITNESSES = [  # (s_a, zp_a, s_b, zp_b, s_out, zp_out)
    (0.007766869384795427, 101, 0.44648823142051697, 138, 0.9199824333190918, 128),
    (0.9352028965950012, 52, 0.0017639438156038523, 42, 0.5366091132164001, 128),
    (0.0642915889620781, 23, 0.00838523544371128, 172, 0.17085956037044525, 128),
    (0.05584488436579704, 55, 0.0720352903008461, 11, 0.15036015212535858, 128),
    (0.06473932415246964, 215, 0.0036022805143147707, 153, 0.07361669093370438, 128),
]


def test_mul_multiplier_is_the_float32_expression():
    bad = double_bad = 0
    for sa, za, sb, zb, so, zo in MULTIPLIER_WITNESSES:
        q32 = quantize_multiplier(float(F32(F32(F32(sa) * F32(sb)) / F32(so))))
        assert q32 != quantize_multiplier(_f32(sa) * _f32(sb) / _f32(so))
        assert mul_params(a_scale=sa, a_zp=za, b_scale=sb, b_zp=zb, out_scale=so, out_zp=zo).multiplier == q32[0]
        expected = _tflite_mul(A_ALL, B_ALL, sa, za, sb, zb, so, zo)
        bad += _mismatches(mul(A_ALL, B_ALL, a_scale=sa, a_zp=za, b_scale=sb, b_zp=zb, out_scale=so,
                               out_zp=zo), expected)
        double_bad += _mismatches(_mul_with_double_multiplier(A_ALL, B_ALL, sa, za, sb, zb, so, zo), expected)
    assert bad == 0
    assert double_bad == 25  # 4 + 2 + 1 + 17 + 1 pairs: the double multiplier is not TFLite's


def test_mul_fast_equals_ref_every_pair():
    for sa, za, sb, zb, so, zo in list(_configs(4, 2)) + [(1.0, 128, 1.0, 127, 2.0 ** -17, 128)]:
        a, b = A_ALL[:, ::4], B_ALL[:, ::4]  # 16,384 pairs: every b code with 64 a codes
        kw = dict(a_scale=sa, a_zp=za, b_scale=sb, b_zp=zb, out_scale=so, out_zp=zo, act_min=3, act_max=250)
        assert np.array_equal(mul(a, b, **kw), mul_ref(a, b, **kw))


def test_mul_argument_checks():
    a = np.zeros((1, 2, 2, 3), np.uint8)
    kw = dict(a_scale=1.0, a_zp=0, b_scale=1.0, b_zp=0, out_scale=1.0, out_zp=0)
    with pytest.raises(MaceqError, match="uint8"):
        mul(a, a.astype(np.int32), **kw)
    with pytest.raises(MaceqError, match="broadcast"):
        mul(a, np.zeros((4,), np.uint8), **kw)
    with pytest.raises(MaceqError, match="act_min"):
        mul(a, a, **kw, act_min=200, act_max=100)
    with pytest.raises(MaceqError, match="b_scale"):
        mul(a, a, **{**kw, "b_scale": -1.0})
