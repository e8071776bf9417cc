"""The integer tiles (runtime/kernels/intgemm.py), AVX-512 VNNI and AVX2: exact int64 sums, the convolution paths that
use them, and stock MACE's whole MobileNetV2 on them. Each instruction set's checks run where the CPU has it (an
AVX-512 VNNI CPU runs both); where neither runs, the float32-GEMM paths do, and these checks skip."""
from __future__ import annotations

import json

import numpy as np
import pytest

from maceq.runtime import load
from maceq.runtime.kernels import conv as k_conv
from maceq.runtime.kernels import intgemm, jit
from maceq.runtime.kernels.intgemm import Isa

pytestmark = pytest.mark.skipif(not intgemm.available(), reason="this CPU has neither AVX-512 VNNI nor AVX2 (or "
                                "MACEQ_NO_INTGEMM is set)")


def _isa_param(isa: Isa):
    return pytest.param(isa, id=isa.value, marks=pytest.mark.skipif(
        isa not in intgemm.supported(), reason=f"this CPU has no {isa.value}"))


ISAS = [_isa_param(i) for i in Isa]


def _filter(rng, o, k, *, spread=255):
    """An offset filter w' = w - w_zp [O, K] as a convolution's: each channel's values within ``spread`` of each
    other, the first channel all at -255..0 and the second at 0..255 (the extremes of both signs)."""
    w = rng.integers(0, spread + 1, (o, k))
    zp = rng.integers(0, 256 - spread, o) if spread < 255 else np.zeros(o, np.int64)
    wo = w + zp[:, None] - rng.integers(0, 256, o)[:, None]
    wo = np.clip(wo, -255, 255)
    wo[0], wo[min(1, o - 1)] = -rng.integers(0, 256, k), rng.integers(0, 256, k)
    return wo


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows, k, o", [(1, 4, 1), (5, 16, 17), (13, 96, 33), (64, 144, 64), (7, 1280, 70),
                                        (3, 320, 130), (22, 36, 1000)])
def test_tiles_equal_int64_sums(isa, rows, k, o):
    # every tail: rows past a multiple of 4, channels past 16 and 64 (VNNI tiles of 1 to 4 vectors), K down to 4
    rng = np.random.default_rng(rows * 1000 + k + o)
    wo = _filter(rng, o, k)
    f = intgemm.PackedFilter(wo, isa)
    for zx in (0, 255, int(rng.integers(1, 255))):
        x = rng.integers(0, 256, (rows, k), dtype=np.uint8)
        x[0] = 255  # the largest products of both signs
        assert np.array_equal(intgemm.pointwise_sums(x, zx, f), (x.astype(np.int64) - zx) @ wo.T)


@pytest.mark.parametrize("isa", ISAS)
def test_tiles_over_a_block_of_several_chunks(isa):
    """One block of 133 rows on one thread, 200 channels at K = 1,280: on AVX2 chunks of 64, 64 and 5 rows (the last
    tile with zero rows below) and groups of two 16-channel panels, the last group with the channel tail; on VNNI
    tiles of 4 rows over every panel, the last with zero rows below."""
    from maceq.runtime import threads

    rows, k, o = 133, 1280, 200
    assert 2 * intgemm.CHUNK_ROWS < rows and intgemm.PANEL_GROUP_BYTES // (k * 16 * 2) * 16 < o
    rng = np.random.default_rng(133)
    wo = _filter(rng, o, k)
    f = intgemm.PackedFilter(wo, isa)
    with threads.section(1):
        assert intgemm._rows_per_block(rows, o) >= rows  # one block: its chunks are the kernel's
        for zx in (0, 255, 77):
            x = rng.integers(0, 256, (rows, k), dtype=np.uint8)
            x[0], x[-1] = 255, 0
            assert np.array_equal(intgemm.pointwise_sums(x, zx, f), (x.astype(np.int64) - zx) @ wo.T)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows, k, o", [(1, 16, 3), (37, 40, 33), (1001, 96, 24), (6, 300, 70), (37, 40, 32),
                                        (1001, 24, 64)])
def test_dsp_codes_on_the_tiles_equal_sums_then_requant(isa, rows, k, o):
    # nnlib's d32 requantization block by block from the tiles' sums (no sums kept) equals the sums, then the
    # requantization: codes and the min / max raw values, over shifts up to 31 and the largest multiplier
    from maceq.runtime.kernels import jit

    rng = np.random.default_rng(rows + k + o)
    wo = _filter(rng, o, k)
    f = intgemm.PackedFilter(wo, isa)
    x = rng.integers(0, 256, (rows, k), dtype=np.uint8)
    x[0] = 255
    sums = (x.astype(np.int64) - 77) @ wo.T
    for recip, shamt in ((1 << 30, 0), (2 ** 31 - 1, 5), (int(rng.integers(1, 2 ** 31)), 31), (1 << 13, 0)):
        word = rng.integers(-(2 ** 31), 2 ** 31, o) if shamt else rng.integers(-(2 ** 20), 2 ** 20, o)
        got = intgemm.dsp_pointwise(x, 77, f, word, recip, shamt)
        want = jit.d32_requant(sums, recip, shamt, word)
        assert np.array_equal(got[0], want[0]) and got[1:] == want[1:]
    assert 0 < np.count_nonzero((want[0] > 0) & (want[0] < 255))  # the last case: codes inside (0, 255) too


@pytest.mark.parametrize("isa", [_isa_param(Isa.AVX2)])
@pytest.mark.parametrize("rows, k, o", [(3, 16, 16), (1001, 16, 96), (70, 27, 32), (2050, 144, 24), (9, 320, 1280)])
def test_avx2_codes_from_sums_stored_straight_or_through_a_tile(isa, rows, k, o):
    # AVX2 blocks keep G in int32: with O a multiple of 16 the tiles store into G itself (each block has whole
    # tiles of rows: row counts past a multiple of 4, several blocks), else through a 4 x 16k tile; the codes equal
    # the int64 sums requantized by the same compiled steps
    from maceq.runtime.kernels import conv as k_conv
    from maceq.runtime.kernels import jit

    rng = np.random.default_rng(rows + k + o)
    w, bias, kw = _plan_case(rng, k, o)
    rq = k_conv.conv2d_plan(w, bias, **kw).rq
    wo = w.reshape(o, k).astype(np.int64) - kw["w_zp"]
    f = intgemm.PackedFilter(wo, isa)
    assert intgemm._g_like(f).dtype == np.int32 and (f.n16 == o) == (o % 16 == 0)  # the store each case takes
    x = rng.integers(0, 256, (rows, k), dtype=np.uint8)
    x[0] = 255
    got = np.empty((rows, o), np.uint8)
    intgemm.pointwise_conv(x, kw["x_zp"], f, rq, got)
    want = np.empty((rows, o), np.uint8)
    jit.requant_store((x.astype(np.int64) - kw["x_zp"]) @ wo.T, rq, want, affine=True)
    assert np.array_equal(got, want) and 0 < np.count_nonzero((want > 0) & (want < 255))


@pytest.mark.parametrize("isa", [_isa_param(Isa.AVX2)])
@pytest.mark.parametrize("rows, k, o", [(1, 1, 3), (6, 27, 32), (9, 3, 40), (5, 321, 17)])
def test_avx2_tiles_take_any_reduction_length(isa, rows, k, o):
    # K odd or below 4 (a first 3x3 convolution's 27): the int16 rows end in a zero pad
    rng = np.random.default_rng(k)
    wo = _filter(rng, o, k)
    x = rng.integers(0, 256, (rows, k), dtype=np.uint8)
    x[0] = 0
    assert np.array_equal(intgemm.pointwise_sums(x, 255, intgemm.PackedFilter(wo, isa)),
                          (x.astype(np.int64) - 255) @ wo.T)


def test_vnni_tiles_at_the_longest_reduction():
    # K = 65,792 products of 255 * -128 is the largest |sum| the int32 lanes hold: w' = -255 (shift 127) and
    # w' = 0 (shift -128) are both stored as s = -128
    if Isa.VNNI not in intgemm.supported():
        pytest.skip("this CPU has no avx512-vnni")
    k = intgemm.MAX_TERMS[Isa.VNNI]
    wo = np.full((16, k), -255, np.int64)
    wo[1::2] = 0
    f = intgemm.PackedFilter(wo, Isa.VNNI)
    assert (f.data == -128).sum() == 16 * k
    x = np.full((4, k), 255, np.uint8)
    want = x.astype(np.int64) @ wo.T
    assert np.array_equal(intgemm.pointwise_sums(x, 0, f), want) and want.min() == -255 * 255 * k


@pytest.mark.parametrize("isa", [_isa_param(Isa.AVX2)])
def test_avx2_tiles_at_the_longest_reduction(isa):
    # K = 33,025 products of (-255) * 255 and 255 * 255: the largest |sum| (2,147,450,625) the int32 lanes hold
    k = intgemm.MAX_TERMS[isa]
    wo = np.full((17, k), 255, np.int64)
    wo[::2] = -255
    x = np.full((5, k), 0, np.uint8)
    x[1::2] = 255
    want = (x.astype(np.int64) - 0) @ wo.T
    got = intgemm.pointwise_sums(x, 0, intgemm.PackedFilter(wo, isa))
    assert np.array_equal(got, want) and want.max() == 255 * 255 * k == -want.min()
    assert np.array_equal(intgemm.pointwise_sums(255 - x, 255, intgemm.PackedFilter(wo, isa)), -want)


def test_packed_filter_refuses_what_the_tiles_cannot_hold():
    for bad_k in (intgemm.MAX_TERMS[Isa.VNNI] + 4, 0, 6):  # past the int32 bound, empty, not a multiple of 4
        with pytest.raises(ValueError, match="multiple of 4"):
            intgemm.PackedFilter(np.zeros((16, bad_k), np.int64), Isa.VNNI)
    for bad_k in (intgemm.MAX_TERMS[Isa.AVX2] + 1, 0):
        with pytest.raises(ValueError, match="between 1 and 33025"):
            intgemm.PackedFilter(np.zeros((16, bad_k), np.int64), Isa.AVX2)
    with pytest.raises(ValueError, match=r"\[-255, 255\]"):
        intgemm.PackedFilter(np.full((16, 8), 256, np.int64), Isa.AVX2)


def test_pack_filter_refuses_what_the_tiles_cannot_do():
    rng = np.random.default_rng(3)
    assert intgemm.pack_filter(_filter(rng, 64, 96), Isa.VNNI) is not None
    assert intgemm.pack_filter(_filter(rng, 64, 98), Isa.VNNI) is None  # K not a multiple of 4
    assert intgemm.pack_filter(_filter(rng, 64, 98), Isa.AVX2) is not None  # any K
    wide = _filter(rng, 64, 96)
    wide[5, :2] = (-200, 100)  # one channel spanning 300: no int8 form, but int16 holds it
    assert intgemm.pack_filter(wide, Isa.VNNI) is None
    assert intgemm.pack_filter(wide, Isa.AVX2) is not None
    # 1,536 entries: on VNNI the float32 GEMM path is faster; the AVX2 tiles take every size
    assert intgemm.pack_filter(_filter(rng, 16, 96), Isa.VNNI) is None
    assert intgemm.pack_filter(_filter(rng, 16, 96), Isa.AVX2) is not None


def _plan_case(rng, c, o, k=1):
    w = rng.integers(0, 256, (o, k, k, c), dtype=np.uint8)
    # zero points near the codes' middle, so that the sums (and the codes) spread around the output zero point
    kw = dict(x_zp=int(rng.integers(108, 149)), w_zp=int(rng.integers(108, 149)), out_zp=int(rng.integers(0, 256)),
              multiplier=rng.integers(1 << 30, (1 << 31) - 1, o), shift=rng.integers(-12, -6, o))
    return w, rng.integers(-5000, 5000, o).astype(np.int32), kw


@pytest.mark.parametrize("c, o, k, strides, pads", [
    (64, 48, 1, (1, 1), (0, 0, 0, 0)), (96, 24, 1, (1, 1), (0, 0, 0, 0)), (160, 960, 1, (1, 1), (0, 0, 0, 0)),
    (384, 64, 1, (1, 1), (0, 0, 0, 0)), (4, 64, 3, (2, 2), (1, 1, 1, 1)), (3, 32, 3, (2, 2), (0, 1, 0, 1))],
    ids=["1x1-48", "1x1-24", "1x1-960", "1x1-64", "3x3s2-k36", "3x3s2-rgb"])
def test_conv_plan_takes_the_tiles_and_equals_the_other_paths(c, o, k, strides, pads, monkeypatch):
    # 1x1 on the rows of x, larger windows on im2col rows (x_zp at the taps outside x); a first RGB convolution
    # (K = 27) takes the AVX2 tiles, not the VNNI ones (K not a multiple of 4)
    rng = np.random.default_rng(c + o)
    w, bias, kw = _plan_case(rng, c, o, k)
    kw.update(strides=strides, pads=pads)
    # 70 rows (4 * 17 + 2), or 6 (4 + 2) for the widest filter: the scalar reference takes 1 s a million products
    x = rng.integers(0, 256, (2, 5, 7, c) if o < 960 else (1, 2, 3, c), dtype=np.uint8)
    x[0, 0, 0] = 255
    plan = k_conv.conv2d_plan(w, bias, **kw)
    calls = []
    real = intgemm._pointwise  # the tiles' compiled pass, called once per convolution
    monkeypatch.setattr(intgemm, "_pointwise", lambda *a: calls.append(1) or real(*a))
    got = plan(x)
    tiled = [1] if intgemm.isa() is Isa.AVX2 or k * k * c % 4 == 0 else []
    assert calls == tiled  # the tiles ran
    monkeypatch.setenv("MACEQ_NO_INTGEMM", "1")
    sgemm = plan(x)
    monkeypatch.setenv("MACEQ_NO_JIT", "1")
    numpy_path = plan(x)
    assert calls == tiled
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
    real = intgemm._pointwise  # the tiles' compiled pass, called once per convolution
    monkeypatch.setattr(intgemm, "_pointwise", lambda *a: calls.append(1) or real(*a))
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
    real = intgemm.GpuPointwiseCall.__call__
    monkeypatch.setattr(intgemm.GpuPointwiseCall, "__call__", lambda self, x: calls.append(1) or real(self, x))
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
            m.setenv("MACEQ_NO_INTGEMM", "1")
            assert np.array_equal(got, g.gpu_conv2d(x, w, bias, **kw))
        want = g.gpu_conv2d_ref(x[:1, :3], w, bias, **kw) if k == 1 else g.gpu_conv2d_ref(x, w, bias, **kw)
        assert np.array_equal(got[:1, :3] if k == 1 else got, want)
        assert 0 < np.count_nonzero((want > 0) & (want < 255))
    # the FullyConnected: from 4 rows on the tiles, fewer by the int32 sums of jit.fc_sums
    few = []
    real_fc = jit.fc_sums
    monkeypatch.setattr(jit, "fc_sums", lambda *a: few.append(1) or real_fc(*a))
    w = rng.integers(-127, 128, (9, 700), dtype=np.int8)
    w[0, :] = -127
    bias = rng.integers(-2 ** 20, 2 ** 20, 9).astype(np.int32)
    kw = dict(x_zp=40, out_zp=120, scale_c=g.gpu_requant_scales(np.float32(0.02), np.float32(
        rng.uniform(1e-4, 1e-3, 9)).astype(np.float32), np.float32(0.5)))
    for rows in (3, 5, 1):
        x = rng.integers(0, 256, (rows, 700), dtype=np.uint8)
        x[0] = 255
        got = g.gpu_fully_connected(x, w, bias, **kw)
        assert np.array_equal(got, g.gpu_fully_connected_ref(x, w, bias, **kw))
    assert calls == [1] * (len(cases) + 1) and few == [1, 1]


@pytest.mark.parametrize("case", [((1, 1), 300, 16, (1, 1), (0, 0), (6, 6)), ((3, 3), 40, 64, (2, 1), (1, 1), (3, 8)),
                                  ((1, 1), 33_100, 3, (1, 1), (0, 0), (1, 1))], ids=["1x1", "3x3", "wraps"])
def test_dsp_sums_on_the_tiles_equal_int64_sums(case, monkeypatch):
    # nnlib's convolution sums (in_offset at the taps outside x), wrapped to int32 where they can leave it; the
    # AVX2 tiles hold K <= 33,025, so there the sums that wrap (K = 33,100) take the float32-GEMM path
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
    real = intgemm.pointwise_sums
    monkeypatch.setattr(intgemm, "pointwise_sums", lambda *a: calls.append(1) or real(*a))
    got = dsp._conv_sums(x, w, io, wo, strides, before, out_hw)
    want = np.zeros((1, *out_hw, o), dtype=np.int64)
    for oy, ox, i, j in np.ndindex(*out_hw, kh, kw):
        iy, ix = oy * strides[0] + i - before[0], ox * strides[1] + j - before[1]
        if 0 <= iy < hw and 0 <= ix < hw:
            want[0, oy, ox] += (x[0, iy, ix].astype(np.int64) - io) @ (w[i, j].astype(np.int64) - wo)
    assert calls == ([1] if kh * kw * c <= intgemm.MAX_TERMS[intgemm.isa()] else [])
    assert np.array_equal(got, dsp._wrap32(want))
    assert (c > 1000) == bool(np.any(want != dsp._wrap32(want)))


def test_the_tiles_need_numba_to_compile_for_this_cpu(monkeypatch):
    # a portable numba target (NUMBA_CPU_NAME=generic) has neither instruction set: the float32 paths run instead
    from numba.core import config

    monkeypatch.setattr(config, "CPU_NAME", "generic")
    assert not intgemm.available()
    monkeypatch.setattr(config, "CPU_NAME", None)
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2")
    assert not intgemm.available()
    monkeypatch.setattr(config, "CPU_FEATURES", None)
    assert intgemm.available()
    monkeypatch.setenv("MACEQ_NO_INTGEMM", "1")
    assert not intgemm.available()


def test_the_tiles_hold_blas_to_one_thread_for_the_rest_of_the_run():
    # numba's threads run the tiles from here on: a later numpy GEMM of the run must not start BLAS's spinning
    # threads beside them (runtime/threads.py blas_held)
    from threadpoolctl import ThreadpoolController

    from maceq.runtime import threads
    from maceq.runtime.kernels import blas

    path = blas.gemm().path

    def blas_threads() -> int:
        return next(i["num_threads"] for i in ThreadpoolController().info() if i["filepath"] == path)

    before = blas_threads()
    if before == 1:
        pytest.skip("numpy's BLAS runs one thread here already")
    rng = np.random.default_rng(4)
    wo = _filter(rng, 64, 96)
    x = rng.integers(0, 256, (9, 96), dtype=np.uint8)
    with threads.section(2):
        assert blas_threads() == before
        assert np.array_equal(intgemm.pointwise_sums(x, 3, intgemm.PackedFilter(wo, intgemm.isa())),
                              (x.astype(np.int64) - 3) @ wo.T)
        assert blas_threads() == 1
    assert blas_threads() == before
