"""The AVX-512 VNNI tiles (runtime/kernels/vnni.py): exact int64 sums, the convolution path that uses them, and stock
MACE's whole MobileNetV2 on them. Skipped where the CPU has no AVX-512 VNNI (the other paths then run)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from maceq.runtime import load
from maceq.runtime.kernels import conv as k_conv
from maceq.runtime.kernels import vnni

pytestmark = pytest.mark.skipif(not vnni.available(), reason="this CPU has no AVX-512 VNNI (or MACEQ_NO_VNNI is set)")


def _filter(rng, o, k, *, spread=255):
    """An offset filter w' = w - w_zp [O, K] as a convolution's: each channel's values within ``spread`` of each
    other, the first channel all at -255..0 and the second at 0..255 (the extremes of both signs)."""
    w = rng.integers(0, spread + 1, (o, k))
    zp = rng.integers(0, 256 - spread, o) if spread < 255 else np.zeros(o, np.int64)
    wo = w + zp[:, None] - rng.integers(0, 256, o)[:, None]
    wo = np.clip(wo, -255, 255)
    wo[0], wo[min(1, o - 1)] = -rng.integers(0, 256, k), rng.integers(0, 256, k)
    return wo


@pytest.mark.parametrize("rows, k, o", [(1, 4, 1), (5, 16, 17), (13, 96, 33), (64, 144, 64), (7, 1280, 70),
                                        (3, 320, 130), (22, 36, 1000)])
def test_tiles_equal_int64_sums(rows, k, o):
    # every tail: rows past a multiple of 4, channels past 16 and 64 (tiles of 1 to 4 vectors), K down to 4
    rng = np.random.default_rng(rows * 1000 + k + o)
    wo = _filter(rng, o, k)
    f = vnni.PackedFilter(wo)
    for zx in (0, 255, int(rng.integers(1, 255))):
        x = rng.integers(0, 256, (rows, k), dtype=np.uint8)
        x[0] = 255  # the largest products of both signs
        assert np.array_equal(vnni.pointwise_sums(x, zx, f), (x.astype(np.int64) - zx) @ wo.T)


def test_tiles_at_the_longest_reduction():
    # K = 65,792 products of 255 * -128 is the largest |sum| the int32 lanes hold: w' = -255 (shift 127) and
    # w' = 0 (shift -128) are both stored as s = -128
    k = vnni.MAX_TERMS
    wo = np.full((16, k), -255, np.int64)
    wo[1::2] = 0
    f = vnni.PackedFilter(wo)
    assert (f.data == -128).sum() == 16 * k
    x = np.full((4, k), 255, np.uint8)
    want = x.astype(np.int64) @ wo.T
    assert np.array_equal(vnni.pointwise_sums(x, 0, f), want) and want.min() == -255 * 255 * k
    for bad_k in (k + 4, 0, 6):  # past the int32 bound, empty, not a multiple of 4
        with pytest.raises(ValueError, match="multiple of 4"):
            vnni.PackedFilter(np.zeros((16, bad_k), np.int64))


def test_pack_filter_refuses_what_the_tiles_cannot_do():
    rng = np.random.default_rng(3)
    assert vnni.pack_filter(_filter(rng, 64, 96)) is not None
    assert vnni.pack_filter(_filter(rng, 64, 98)) is None  # K not a multiple of 4
    wide = _filter(rng, 64, 96)
    wide[5, :2] = (-200, 100)  # one channel spanning 300: no int8 form
    assert vnni.pack_filter(wide) is None
    assert vnni.pack_filter(_filter(rng, 16, 96)) is None  # 1,536 entries: the float32 GEMM path is faster


def _plan_case(rng, c, o):
    w = rng.integers(0, 256, (o, 1, 1, c), dtype=np.uint8)
    # zero points near the codes' middle, so that the sums (and the codes) spread around the output zero point
    kw = dict(x_zp=int(rng.integers(108, 149)), w_zp=int(rng.integers(108, 149)), out_zp=int(rng.integers(0, 256)),
              multiplier=rng.integers(1 << 30, (1 << 31) - 1, o), shift=rng.integers(-12, -6, o))
    return w, rng.integers(-5000, 5000, o).astype(np.int32), kw


@pytest.mark.parametrize("c, o", [(64, 48), (96, 24), (160, 960), (384, 64)])
def test_conv_plan_takes_the_tiles_and_equals_the_other_paths(c, o, monkeypatch):
    rng = np.random.default_rng(c + o)
    w, bias, kw = _plan_case(rng, c, o)
    x = rng.integers(0, 256, (2, 5, 7, c), dtype=np.uint8)
    x[0, 0, 0] = 255
    plan = k_conv.conv2d_plan(w, bias, **kw)
    calls = []
    real = vnni.pointwise_conv
    monkeypatch.setattr(vnni, "pointwise_conv", lambda *a: calls.append(1) or real(*a))
    got = plan(x)
    assert calls == [1]  # the tiles ran
    monkeypatch.setenv("MACEQ_NO_VNNI", "1")
    sgemm = plan(x)
    monkeypatch.setenv("MACEQ_NO_JIT", "1")
    numpy_path = plan(x)
    assert calls == [1]
    want = k_conv.conv2d_ref(x, w, bias, **kw)
    assert np.array_equal(got, want) and np.array_equal(sgemm, want) and np.array_equal(numpy_path, want)
    assert 0 < np.count_nonzero((want > 0) & (want < 255))  # codes inside the range


def test_stock_mace_mobilenet_v2_taps_on_the_tiles(shared_data, monkeypatch):
    # every uint8 tensor of stock MACE's MobileNetV2 (one photo) with the 1x1 convolutions on the tiles
    base = shared_data / "mace_arm"
    meta = json.loads((base / "taps" / "mobilenet_v2_cpu_taps.json").read_text())
    taps = np.load(base / "taps" / "mobilenet_v2_cpu_taps.npz")
    m = load(base / "models" / "mobilenet_v2_cpu" / "mobilenet_v2.yml")
    x = np.load(base / "models" / "mobilenet_v2_cpu" / "inputs.npy")[:1]
    calls = []
    real = vnni.pointwise_conv
    monkeypatch.setattr(vnni, "pointwise_conv", lambda *a: calls.append(1) or real(*a))
    res = m.run({"input": x}, device="cpu", intermediates=True)
    assert len(calls) >= 25  # MobileNetV2's 1x1 convolutions of 2,048 entries and more
    uint8 = [t for t in meta["taps"] if t["dtype"] == "uint8"]
    assert len(uint8) >= 65
    for t in uint8:
        got = np.asarray(res.tensors[t["tensor"]].values)
        assert np.array_equal(got.reshape(taps[t["tensor"]][0].shape), taps[t["tensor"]][0]), t["tensor"]


def test_gpu_convolutions_on_the_tiles_equal_the_other_paths(monkeypatch):
    # the gpu's sums in integers, then f32(G + bias) as float_rte rounds the int32: both sum paths (a bias past
    # 2^24 takes the float64 one), im2col rows past 1x1, and the FullyConnected
    from maceq.runtime.kernels import gpu as g

    rng = np.random.default_rng(9)
    calls = []
    real = vnni.gpu_pointwise
    monkeypatch.setattr(vnni, "gpu_pointwise", lambda *a: calls.append(1) or real(*a))
    cases = [(64, 48, 1, (1, 1), (0, 0, 0, 0), 50_000), (300, 12, 1, (1, 1), (0, 0, 0, 0), 50_000),
             (24, 96, 1, (1, 1), (0, 0, 0, 0), 2 ** 26), (40, 64, 3, (2, 1), (1, 0, 2, 1), 50_000)]
    for c, o, k, st, pads, bias_max in cases:
        x = rng.integers(0, 256, (2, 6, 7, c), dtype=np.uint8)
        w = rng.integers(-128, 128, (o, k, k, c), dtype=np.int8)
        w[0], x[0, 0] = -128, 255
        bias = rng.integers(-bias_max, bias_max, o).astype(np.int32)
        kw = dict(x_zp=17, out_zp=131, strides=st, pads=pads, scale_c=g.gpu_requant_scales(
            np.float32(0.02), np.float32(rng.uniform(1e-3, 1e-2, o)).astype(np.float32),
            np.float32(0.05 if bias_max < 2 ** 20 else 400.0)))
        got = g.gpu_conv2d(x, w, bias, **kw)
        with monkeypatch.context() as m:
            m.setenv("MACEQ_NO_VNNI", "1")
            assert np.array_equal(got, g.gpu_conv2d(x, w, bias, **kw))
        want = g.gpu_conv2d_ref(x[:1, :3], w, bias, **kw) if k == 1 else g.gpu_conv2d_ref(x, w, bias, **kw)
        assert np.array_equal(got[:1, :3] if k == 1 else got, want)
        assert 0 < np.count_nonzero((want > 0) & (want < 255))
    x = rng.integers(0, 256, (3, 700), dtype=np.uint8)
    w = rng.integers(-127, 128, (9, 700), dtype=np.int8)
    bias = rng.integers(-2 ** 20, 2 ** 20, 9).astype(np.int32)
    kw = dict(x_zp=40, out_zp=120, scale_c=g.gpu_requant_scales(np.float32(0.02), np.float32(
        rng.uniform(1e-4, 1e-3, 9)).astype(np.float32), np.float32(0.5)))
    got = g.gpu_fully_connected(x, w, bias, **kw)
    assert np.array_equal(got, g.gpu_fully_connected_ref(x, w, bias, **kw))
    assert calls == [1] * (len(cases) + 1)


@pytest.mark.parametrize("case", [((1, 1), 300, 16, (1, 1), (0, 0), (6, 6)), ((3, 3), 40, 64, (2, 1), (1, 1), (3, 8)),
                                  ((1, 1), 33_100, 3, (1, 1), (0, 0), (1, 1))], ids=["1x1", "3x3", "wraps"])
def test_dsp_sums_on_the_tiles_equal_int64_sums(case, monkeypatch):
    # nnlib's convolution sums (in_offset at the taps outside x), wrapped to int32 where they can leave it
    from maceq.runtime.kernels import dsp

    (kh, kw), c, o, strides, before, out_hw = case
    rng = np.random.default_rng(c)
    hw = 1 if c > 1000 else 6
    x = rng.integers(0, 256, (1, hw, hw, c), dtype=np.uint8)
    w = rng.integers(0, 256, (kh, kw, c, o), dtype=np.uint8)
    io, wo = (0, 0) if c > 1000 else (int(rng.integers(0, 256)), int(rng.integers(0, 256)))
    if c > 1000:
        x[:], w[:] = 255, 255  # every product at its largest: the sum passes 2^31
    calls = []
    real = vnni.pointwise_sums
    monkeypatch.setattr(vnni, "pointwise_sums", lambda *a: calls.append(1) or real(*a))
    got = dsp._conv_sums(x, w, io, wo, strides, before, out_hw)
    want = np.zeros((1, *out_hw, o), dtype=np.int64)
    for oy, ox, i, j in np.ndindex(*out_hw, kh, kw):
        iy, ix = oy * strides[0] + i - before[0], ox * strides[1] + j - before[1]
        if 0 <= iy < hw and 0 <= ix < hw:
            want[0, oy, ox] += (x[0, iy, ix].astype(np.int64) - io) @ (w[i, j].astype(np.int64) - wo)
    assert calls == [1] and np.array_equal(got, dsp._wrap32(want))
    assert (c > 1000) == bool(np.any(want != dsp._wrap32(want)))


def test_the_tiles_need_numba_to_compile_for_this_cpu(monkeypatch):
    # a portable numba target (NUMBA_CPU_NAME=generic) has no VNNI: the float32 paths run instead
    from numba.core import config

    monkeypatch.setattr(config, "CPU_NAME", "generic")
    assert not vnni.available()
    monkeypatch.setattr(config, "CPU_NAME", None)
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2")
    assert not vnni.available()
    monkeypatch.setattr(config, "CPU_FEATURES", None)
    assert vnni.available()
    monkeypatch.setenv("MACEQ_NO_VNNI", "1")
    assert not vnni.available()
