"""uint8 MEAN (runtime/kernels/mean.py) against TFLite BUILTIN_REF MEAN on the ai-edge-litert 2.3.0 wheel.

The kernel transcribes reference_ops::QuantizedMeanOrSum (M' = (M << k) / n, double-rounding
MultiplyByQuantizedMultiplier). The oracle is the wheel's MEAN itself, over random ranks,
axis sets (negative, duplicated, empty), keep_dims, equal and unequal scales (ratios from
2^-30 to 2^10, where the k = 31 + e clamp acts), zero points and tie-heavy data. The fast
path equals ``mean_ref`` bit for bit. Every comparison requires 0 mismatching elements.
"""
from __future__ import annotations

import numpy as np
import pytest

from maceq.errors import MaceqError
from maceq.runtime.kernels.mean import mean, mean_ref, tflite_mean_multiplier
from maceq.tests.oracle.tflite_builder import TensorSpec, build_single_op_model, run_ref


def _tflite_mean(x, axes, keepdims, in_scale, in_zp, out_scale, out_zp):
    resolved = []
    for a in axes:
        r = a % x.ndim
        if r not in resolved:
            resolved.append(r)
    out_shape = tuple(1 if i in resolved else d for i, d in enumerate(x.shape) if keepdims or i not in resolved)
    model = build_single_op_model(
        "MEAN", [TensorSpec(x.shape, in_scale, in_zp),
                 TensorSpec((len(axes),), None, None, "int32", np.array(axes, np.int32).reshape(len(axes)))],
        [TensorSpec(out_shape, out_scale, out_zp)], options={"keep_dims": keepdims})
    (out,) = run_ref(model, [x])
    return out


def _f32(v) -> float:
    return float(np.float32(v))


def _data(rng, shape, fill):
    if fill == "ties":  # 0/1/254/255: many exact halves and quarters
        return rng.choice(np.array([0, 1, 254, 255], np.uint8), shape)
    if fill == "low":
        return rng.integers(0, 3, shape, dtype=np.uint8)
    return rng.integers(0, 256, shape, dtype=np.uint8)


def _check(x, axes, keepdims, s_in, z_in, s_out, z_out, *, with_ref=True):
    want = _tflite_mean(x, axes, keepdims, s_in, z_in, s_out, z_out)
    kw = dict(axes=axes, keepdims=keepdims, in_scale=s_in, in_zp=z_in, out_scale=s_out, out_zp=z_out)
    got = mean(x, **kw)
    assert got.shape == want.shape
    if with_ref:
        assert np.array_equal(mean_ref(x, **kw), got)
    return int(np.sum(got != want)), got.size


def test_mean_matches_tflite_random_configs():
    rng = np.random.default_rng(800)
    bad = total = 0
    for i in range(220):
        nd = int(rng.integers(1, 5))
        shape = tuple(int(v) for v in rng.integers(1, 7, nd))
        k = int(rng.integers(1, nd + 1))
        axes = [int(a) for a in rng.choice(nd, k, replace=False)]
        if i % 5 == 0:
            axes.append(axes[0] - nd)  # a negative duplicate
        keepdims = bool(i % 2)
        s_in = _f32(np.exp(rng.uniform(-6, -1)))
        regime = i % 4
        if regime == 0:
            s_out = s_in
        elif regime == 1:
            s_out = _f32(np.nextafter(np.float32(s_in), np.float32(1)))  # one ulp apart
        else:
            s_out = _f32(s_in * np.exp(rng.uniform(-1.5, 1.5)))
        z_in, z_out = (int(v) for v in rng.integers(0, 256, 2))
        x = _data(rng, shape, ["random", "ties", "low"][i % 3])
        b, t = _check(x, axes, keepdims, s_in, z_in, s_out, z_out)
        bad += b
        total += t
    assert bad == 0
    assert total > 1000


@pytest.mark.parametrize("shape", [(1, 7, 7, 16), (2, 3, 5, 8), (1, 2, 2, 257), (1, 3, 1, 40), (1, 6, 7, 9)])
def test_mean_4d_spatial_keepdims_path(shape):
    """The 4-D keep_dims {1, 2} case, which published sources route to a separate integer kernel."""
    rng = np.random.default_rng(801)
    for fill in ("random", "ties", "low"):
        x = _data(rng, shape, fill)
        for s_out in (0.05, 0.0625, 0.031):
            for axes in ([1, 2], [2, 1]):
                assert _check(x, axes, True, 0.05, 3, s_out, 3, with_ref=shape[3] < 100)[0] == 0


def test_mean_extreme_scale_ratios_and_long_reductions():
    """Ratios 2^-30 .. 2^10 (k clamped to 31 + e at the small end), n up to 12288."""
    rng = np.random.default_rng(802)
    for ratio in (2.0 ** -30, 2.0 ** -29, 1e-6, 0.003, 0.5, 1.0, 3.7, 2.0 ** 10):
        for shape, axes in (((1, 64, 64, 3), [1, 2]), ((3, 4096), [1]), ((2, 5, 7), [0, 2])):
            x = _data(rng, shape, "random")
            s_in = 0.02
            s_out = _f32(s_in / ratio)
            z_in, z_out = (int(v) for v in rng.integers(0, 256, 2))
            assert _check(x, axes, bool(rng.integers(2)), s_in, z_in, s_out, z_out, with_ref=False)[0] == 0


def test_mean_no_axes_is_a_requantization():
    rng = np.random.default_rng(803)
    x = rng.integers(0, 256, (2, 3, 4), dtype=np.uint8)
    assert _check(x, [], True, 0.02, 7, 0.03, 100)[0] == 0
    assert _check(x, [], False, 0.02, 7, 0.02, 7)[0] == 0


def test_pinned_double_rounding_examples():
    """The module docstring's examples: true means 0.25 and 0.4 both come out as 1."""
    x = np.array([1, 0, 0, 0], np.uint8).reshape(1, 2, 2, 1)
    assert tflite_mean_multiplier(0.05, 0.05, 4) == (1 << 30, -1)
    assert mean(x, axes=[1, 2], keepdims=True, in_scale=0.05, in_zp=0, out_scale=0.05, out_zp=0).item() == 1
    assert _tflite_mean(x, [1, 2], True, 0.05, 0, 0.05, 0).item() == 1
    y = np.array([1, 1, 0, 0, 0], np.uint8).reshape(5, 1)
    nudged = _f32(np.nextafter(np.float32(2.0 ** -7), np.float32(1)))
    assert mean(y, axes=[0], keepdims=False, in_scale=nudged, in_zp=0, out_scale=2.0 ** -7, out_zp=0).item() == 1
    assert _tflite_mean(y, [0], False, nudged, 0, 2.0 ** -7, 0).item() == 1


def test_fast_equals_reference_and_int32_wrap():
    rng = np.random.default_rng(804)
    for i in range(60):
        nd = int(rng.integers(1, 5))
        shape = tuple(int(v) for v in rng.integers(1, 6, nd))
        axes = [int(a) for a in rng.choice(nd, int(rng.integers(0, nd + 1)), replace=False)]
        kw = dict(axes=axes, keepdims=bool(i % 2), in_scale=_f32(np.exp(rng.uniform(-8, 0))),
                  in_zp=int(rng.integers(0, 256)), out_scale=_f32(np.exp(rng.uniform(-8, 0))),
                  out_zp=int(rng.integers(0, 256)))
        x = rng.integers(0, 256, shape, dtype=np.uint8)
        assert np.array_equal(mean(x, **kw), mean_ref(x, **kw)), i
    # the int32 scratch wraps past 2^31: n = 2^24 codes of 255, sum 255 * 2^24 > 2^31
    n = 1 << 24
    x = np.full((1, n), 255, np.uint8)
    got = mean(x, axes=[1], keepdims=False, in_scale=1.0, in_zp=0, out_scale=1.0, out_zp=0)
    wrapped = 255 * n - (1 << 32)  # what the int32 scratch holds
    assert wrapped < 0
    assert got.item() == 0  # a negative shifted sum clamps to 0, not 255
    assert _tflite_mean(x, [1], False, 1.0, 0, 1.0, 0).item() == 0


def test_bad_axes_raise():
    with pytest.raises(MaceqError, match="axis 3"):
        mean(np.zeros((2, 2), np.uint8), axes=[3], keepdims=True, in_scale=1, in_zp=0, out_scale=1, out_zp=0)
