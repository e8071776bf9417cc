"""Oracle tests for MACE's uint8 Reduce MEAN (runtime/kernels/reduce.py).

MACE (mace/ops/reduce.cc) outputs ``(sum + n / 2) / n`` over the n reduced codes, in integers:
the mean rounded half up, kept in the input's quantization.

TFLite's uint8 MEAN is not that arithmetic, so it is not the oracle here. Its 4-D keep_dims
{1, 2} path computes MultiplyByQuantizedMultiplier(sum, QM(1/n)) without a left shift (double
rounding on a small accumulator); its other paths divide with truncation or in float. Measured
on the ai-edge-litert 2.3.0 wheel: the 4-D path equals MACE for n <= 3 only (n = 4, sum 1:
TFLite 1, MACE 0), and the float path (scales differing) rounds as if the sum were one larger
((sum + 1) / n), which the published source does not explain; see test_tflite_mean_differs.

TFLite's uint8 AVERAGE_POOL_2D reference does compute ``(acc + count / 2) / count`` with an
int32 sum: exactly MACE's mean. So the oracle moves the reduced axes into the pooling window:
x is transposed to (kept axes..., reduced axes...), reshaped to (1, n, 1, outputs) and pooled
with a (n, 1) VALID window. The readable reference transcribes MACE's Simplify +
Reduce{1..4}Dims loops; ``_mean_half_up`` states the rule in plain integers.
"""
from __future__ import annotations

import numpy as np
import pytest

from maceq.errors import MaceqError
from maceq.runtime.kernels.reduce import reduce_mean, reduce_mean_ref
from maceq.tests.oracle.tflite_builder import TensorSpec, build_single_op_model, run_ref


def _tflite_avgpool_mean(x: np.ndarray, axes, keepdims: bool) -> np.ndarray:
    axes = tuple(sorted({a % x.ndim for a in axes})) if axes else tuple(range(x.ndim))
    kept = tuple(i for i in range(x.ndim) if i not in axes)
    n = int(np.prod([x.shape[a] for a in axes]))
    m = int(np.prod([x.shape[a] for a in kept])) if kept else 1
    cols = np.transpose(x, axes + kept).reshape(1, n, 1, m)
    model = build_single_op_model(
        "AVERAGE_POOL_2D", [TensorSpec(cols.shape, 0.05, 3)], [TensorSpec((1, 1, 1, m), 0.05, 3)],
        options={"padding": "VALID", "stride_h": 1, "stride_w": 1, "filter_height": n,
                 "filter_width": 1, "fused_activation_function": "NONE"})
    (out,) = run_ref(model, [cols])
    out_shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape) if keepdims or i not in axes)
    return out.reshape(out_shape)


def _tflite_mean(x, axes, keepdims, in_scale, out_scale, zp=0) -> np.ndarray:
    axes = tuple(a % x.ndim for a in axes)
    out_shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape) if keepdims or i not in axes)
    model = build_single_op_model(
        "MEAN", [TensorSpec(x.shape, in_scale, zp),
                 TensorSpec((len(axes),), None, None, dtype="int32", data=np.array(axes, dtype=np.int32))],
        [TensorSpec(out_shape, out_scale, zp)], options={"keep_dims": keepdims})
    (out,) = run_ref(model, [x])
    return out


def _mean_half_up(x, axes, keepdims) -> np.ndarray:
    """Plain-int statement of the rule: floor(sum / n + 1/2) per output."""
    axes = tuple(a % x.ndim for a in axes)
    s = x.astype(np.int64).sum(axis=axes, keepdims=keepdims)
    n = int(np.prod([x.shape[a] for a in axes]))
    return ((2 * s + n) // (2 * n)).astype(np.uint8)


CASES = [
    ((1, 7, 7, 16), (1, 2), True), ((1, 7, 7, 16), (1, 2), False), ((2, 5, 3, 8), (1, 2), True),
    ((2, 4, 6, 3), (1,), True), ((3, 4, 5, 6), (2,), True), ((2, 3, 4, 5), (3,), False),
    ((2, 3, 4, 5), (0, 2), True), ((2, 3, 4, 5), (1, 3), False), ((4, 9), (1,), True),
    ((4, 9), (0,), False), ((5, 1, 6), (0, 2), True), ((1, 1, 10, 3), (2,), True),
    ((2, 6, 6, 4), (-3, -2), False), ((3, 2, 2, 7), (0, 1, 2), True), ((1, 32, 32, 2), (1, 2), True),
    ((6,), (0,), False), ((2, 2, 2, 2), (), False), ((4, 8, 8, 64), (1, 2), True),
    ((2, 16, 3, 20), (2,), False),
]


def test_matches_tflite_average_pool_arithmetic():
    rng = np.random.default_rng(301)
    total = mismatches = 0
    for shape, axes, keepdims in CASES:
        for fill in ("random", "ties", "low"):
            x = rng.integers(0, 256, shape, dtype=np.uint8)
            if fill == "ties":  # values 0/1/254/255 make many exact halves
                x = rng.choice(np.array([0, 1, 254, 255], dtype=np.uint8), shape)
            if fill == "low":  # means near 0: halves and quarters of small sums
                x = rng.integers(0, 3, shape, dtype=np.uint8)
            got = reduce_mean(x, axes=axes, keepdims=keepdims)
            want = _tflite_avgpool_mean(x, axes, keepdims)
            assert got.shape == want.shape
            total += got.size
            mismatches += int((got != want).sum())
    assert mismatches == 0
    assert total > 3000


def test_tflite_mean_differs():
    """Documents why TFLite's MEAN is not the oracle (see the module docstring)."""
    x = np.array([1, 0, 0, 0], dtype=np.uint8).reshape(1, 2, 2, 1)  # sum 1, n 4: mean 0.25
    assert reduce_mean(x, axes=(1, 2), keepdims=True).item() == 0
    # srdhm(1, 2^30) = 1 (0.5 rounds up), then RoundingDivideByPOT(1, 1) = 1 (0.5 away from 0)
    assert _tflite_mean(x, (1, 2), True, 0.05, 0.05).item() == 1
    # float path (scales differ by one ulp): sum 2 over 5 (0.4) comes out as 1
    y = np.array([1, 1, 0, 0, 0], dtype=np.uint8).reshape(5, 1)
    nudged = float(np.nextafter(np.float32(2.0 ** -7), np.float32(1)))
    assert reduce_mean(y, axes=(0,), keepdims=False).item() == 0
    assert _tflite_mean(y, (0,), False, nudged, 2.0 ** -7).item() == 1


@pytest.mark.parametrize("hw", [(1, 1), (1, 2), (2, 1)])
def test_matches_tflite_mean_fixed_point_path_for_one_and_two_elements(hw):
    """Where TFLite's MEAN arithmetic is provably MACE's: n <= 2 on the 4-D {1, 2} path, zp 0."""
    rng = np.random.default_rng(302)
    x = rng.integers(0, 256, (3, hw[0], hw[1], 257), dtype=np.uint8)
    x[0, ..., :256] = np.arange(256, dtype=np.uint8)
    if hw != (1, 1):
        x[1].reshape(2, 257)[1, :256] = np.arange(256, dtype=np.uint8)  # odd sums: exact halves
    got = reduce_mean(x, axes=(1, 2), keepdims=True)
    assert np.array_equal(got, _tflite_mean(x, (1, 2), True, 0.05, 0.05))


def test_reference_and_fast_equal_the_half_up_mean():
    rng = np.random.default_rng(303)
    shapes_axes = list(CASES) + [
        ((2, 1, 5, 1, 3), (2,), True), ((2, 3, 1, 4, 5), (1, 3), False),
        ((1, 1, 1, 8), (1, 2), True), ((1, 4, 1, 5), (0, 2), True), ((3, 1, 4), (1,), False),
    ]
    for shape, axes, keepdims in shapes_axes:
        x = rng.integers(0, 256, shape, dtype=np.uint8)
        fast = reduce_mean(x, axes=axes, keepdims=keepdims)
        ref = reduce_mean_ref(x, axes=axes, keepdims=keepdims)
        rule = _mean_half_up(x, axes if axes else tuple(range(x.ndim)), keepdims)
        assert fast.shape == ref.shape == rule.shape
        assert np.array_equal(fast, ref)
        assert np.array_equal(fast, rule)


def test_unsupported_layouts_raise():
    x = np.zeros((2, 3, 4, 5, 6), dtype=np.uint8)  # reduce, keep, reduce, keep, reduce: 5 groups
    with pytest.raises(MaceqError):
        reduce_mean(x, axes=(0, 2, 4), keepdims=True)
    with pytest.raises(MaceqError):
        reduce_mean_ref(x, axes=(0, 2, 4), keepdims=True)
    with pytest.raises(MaceqError):
        reduce_mean(np.zeros((1, 1, 1, 1), dtype=np.uint8), axes=(1, 2))
    with pytest.raises(MaceqError):
        reduce_mean(np.zeros((1, 2, 2, 1), dtype=np.uint8), axes=(4,))
