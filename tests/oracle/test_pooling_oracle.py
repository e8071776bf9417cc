"""Oracle tests for MACE's uint8 max / average pooling (runtime/kernels/pooling.py).

TFLite's uint8 AVERAGE_POOL_2D reference sums the in-bounds taps in int32, divides by the
in-bounds count with ``(acc + count / 2) / count`` and clamps; MAX_POOL_2D starts at 0 and
takes the max of the in-bounds taps. MACE (mace/ops/pooling.cc) does the same, except that its
average accumulates in uint16, so the two agree whenever a window sum stays below 65536
(any window of at most 257 taps). TFLite's SAME padding puts total / 2 on the top/left, as
MACE does. Explicit asymmetric pads are tested for max pooling by pre-padding the input with
0 (the max's initial value) and running TFLite with VALID padding; the uint16 wrap is checked
against hand-computed integers.
"""
from __future__ import annotations

import numpy as np
import pytest

from maceq.errors import MaceqError
from maceq.runtime.kernels.pooling import (
    avg_pool,
    avg_pool_ref,
    global_avg_pool,
    global_avg_pool_ref,
    max_pool,
    max_pool_ref,
)
from maceq.tests.oracle.tflite_builder import TensorSpec, build_single_op_model, run_ref


def _tflite_pads(h: int, w: int, kernel, strides, padding: str):
    """TFLite's output size and MACE-style (top, left, bottom, right) pads for SAME / VALID."""
    (kh, kw), (sh, sw) = kernel, strides
    if padding == "VALID":
        return (0, 0, 0, 0)
    oh, ow = -(-h // sh), -(-w // sw)
    th = max((oh - 1) * sh + kh - h, 0)
    tw = max((ow - 1) * sw + kw - w, 0)
    return (th // 2, tw // 2, th - th // 2, tw - tw // 2)


def _tflite_pool(op: str, x: np.ndarray, kernel, strides, padding: str, out_shape) -> np.ndarray:
    model = build_single_op_model(
        op, [TensorSpec(x.shape, 0.05, 7)], [TensorSpec(tuple(out_shape), 0.05, 7)],
        options={"padding": padding, "stride_h": strides[0], "stride_w": strides[1],
                 "filter_height": kernel[0], "filter_width": kernel[1],
                 "fused_activation_function": "NONE"})
    (out,) = run_ref(model, [x])
    return out


def _random_case(rng):
    n = int(rng.integers(1, 3))
    h, w = (int(v) for v in rng.integers(1, 12, 2))
    c = int(rng.integers(1, 20))
    kernel = (int(rng.integers(1, min(h, 5) + 1)), int(rng.integers(1, min(w, 5) + 1)))
    strides = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
    padding = "SAME" if rng.random() < 0.5 else "VALID"
    x = rng.integers(0, 256, (n, h, w, c), dtype=np.uint8)
    if rng.random() < 0.3:  # saturated inputs: the largest sums and ties in the division
        x[...] = rng.choice(np.array([0, 128, 255], dtype=np.uint8), x.shape)
    return x, kernel, strides, padding


@pytest.mark.parametrize("op", ["AVERAGE_POOL_2D", "MAX_POOL_2D"])
def test_matches_tflite_same_and_valid(op):
    rng = np.random.default_rng(101 if op == "MAX_POOL_2D" else 102)
    kern, ref = (max_pool, max_pool_ref) if op == "MAX_POOL_2D" else (avg_pool, avg_pool_ref)
    total = mismatches = 0
    for _ in range(60):
        x, kernel, strides, padding = _random_case(rng)
        pads = _tflite_pads(x.shape[1], x.shape[2], kernel, strides, padding)
        got = kern(x, kernel=kernel, strides=strides, pads=pads)
        want = _tflite_pool(op, x, kernel, strides, padding, got.shape)
        assert got.shape == want.shape
        total += got.size
        mismatches += int((got != want).sum())
        assert np.array_equal(got, ref(x, kernel=kernel, strides=strides, pads=pads))
    assert total > 3000
    assert mismatches == 0


def test_global_average_matches_tflite_full_kernel_avg_pool():
    rng = np.random.default_rng(103)
    for h, w, c in [(7, 7, 32), (1, 1, 8), (5, 3, 17), (16, 16, 4), (14, 14, 9)]:
        x = rng.integers(0, 256, (2, h, w, c), dtype=np.uint8)
        x[0, ...] = 255  # the largest sum that still fits in uint16 for 16x16 (65280)
        got = global_avg_pool(x)
        want = _tflite_pool("AVERAGE_POOL_2D", x, (h, w), (1, 1), "VALID", (2, 1, 1, c))
        assert np.array_equal(got, want)
        assert np.array_equal(got, global_avg_pool_ref(x))


def test_average_rounds_half_up_on_exact_ties():
    # windows of 2 taps: (sum + 1) // 2, so exact halves go up
    x = np.array([1, 2, 2, 3, 0, 4, 254, 255], dtype=np.uint8).reshape(1, 1, 8, 1)
    got = avg_pool(x, kernel=(1, 2), strides=(1, 2), pads=(0, 0, 0, 0)).ravel().tolist()
    assert got == [2, 3, 2, 255]  # 1.5->2, 2.5->3, 2.0->2, 254.5->255


def test_uint16_accumulator_wraps_like_mace():
    """17 x 17 = 289 taps of 255 sum to 73695, which a uint16 buffer holds as 73695 - 65536."""
    x = np.full((1, 17, 17, 3), 255, dtype=np.uint8)
    x[..., 1] = 200  # 57800: no wrap
    want = [(73695 - 65536 + 144) // 289, (57800 + 144) // 289, (73695 - 65536 + 144) // 289]
    assert want == [28, 200, 28]
    assert global_avg_pool(x).ravel().tolist() == want
    assert global_avg_pool_ref(x).ravel().tolist() == want


def test_max_pool_explicit_asymmetric_pads_against_tflite_valid_on_zero_padded_input():
    rng = np.random.default_rng(104)
    for _ in range(20):
        x = rng.integers(0, 256, (1, int(rng.integers(2, 9)), int(rng.integers(2, 9)), 5), dtype=np.uint8)
        pads = tuple(int(v) for v in rng.integers(0, 3, 4))
        kernel = (int(rng.integers(pads[0] + 1, pads[0] + 3)), int(rng.integers(pads[1] + 1, pads[1] + 3)))
        strides = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
        xp = np.pad(x, ((0, 0), (pads[0], pads[2]), (pads[1], pads[3]), (0, 0)))
        if xp.shape[1] < kernel[0] or xp.shape[2] < kernel[1]:
            continue
        got = max_pool(x, kernel=kernel, strides=strides, pads=pads)
        want = _tflite_pool("MAX_POOL_2D", xp, kernel, strides, "VALID", got.shape)
        assert np.array_equal(got, want)
        assert np.array_equal(got, max_pool_ref(x, kernel=kernel, strides=strides, pads=pads))


def test_avg_pool_explicit_pads_fast_equals_reference_and_excludes_padding():
    rng = np.random.default_rng(105)
    for _ in range(30):
        x = rng.integers(0, 256, (2, int(rng.integers(3, 9)), int(rng.integers(3, 9)), 4), dtype=np.uint8)
        kernel = (int(rng.integers(2, 4)), int(rng.integers(2, 4)))
        pads = tuple(int(rng.integers(0, kernel[k % 2])) for k in range(4))
        strides = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
        got = avg_pool(x, kernel=kernel, strides=strides, pads=pads)
        assert np.array_equal(got, avg_pool_ref(x, kernel=kernel, strides=strides, pads=pads))
    # corner window of a 3x3 kernel with pads 1: only the 4 in-bounds taps count
    x = np.arange(16, dtype=np.uint8).reshape(1, 4, 4, 1)
    corner = avg_pool(x, kernel=(3, 3), strides=(1, 1), pads=(1, 1, 1, 1))[0, 0, 0, 0]
    assert corner == (0 + 1 + 4 + 5 + 2) // 4


def test_empty_average_window_raises():
    x = np.zeros((1, 4, 4, 1), dtype=np.uint8)
    with pytest.raises(MaceqError):
        avg_pool(x, kernel=(2, 2), strides=(1, 1), pads=(0, 0, 2, 0))
    with pytest.raises(MaceqError):
        avg_pool_ref(x, kernel=(2, 2), strides=(1, 1), pads=(0, 0, 2, 0))
