"""The dsp kernels' vectorised bias words and weight sums equal nnlib_ref's scalar transcriptions
(fill_bias_buf, superfc_fill_bias_buf, the gemsumb variants), on random and adversarial inputs."""
from __future__ import annotations

import numpy as np
import pytest

from maceq.errors import MaceqError
from maceq.runtime.kernels import dsp
from maceq.runtime.kernels import nnlib_ref as r

pytestmark = pytest.mark.oracle


def _scalings(rng, n: int):
    for _ in range(n):
        prod = float(np.float32(10.0 ** rng.uniform(-7, -2)))
        yield r.D32Scaling(int(rng.integers(0, 256)), prod, float(np.float32(prod * 3)), 1 << 30, 3)


@pytest.mark.parametrize("seed", range(4))
def test_fill_bias_buf_equals_the_scalar_reference(seed):
    rng = np.random.default_rng(seed)
    for sc in _scalings(rng, 6):
        o = int(rng.integers(1, 70))
        bias = rng.integers(-(2 ** 31), 2 ** 31, size=o)
        gemsumb = list(rng.integers(-(2 ** 20), 2 ** 20, size=(o + 31) & ~31))
        bmin = -float(rng.uniform(0.01, 50.0))
        bmax = -bmin
        out_min = -float(rng.uniform(0.0, 8.0))
        try:
            want = r.fill_bias_buf(bias, bmin, bmax, sc, out_min, gemsumb)
        except MaceqError as e:
            with pytest.raises(MaceqError, match="bias word out of int32 range"):
                dsp.fill_bias_buf(bias, bmin, bmax, sc, out_min, gemsumb)
            assert "bias word out of int32 range" in str(e)
            continue
        np.testing.assert_array_equal(dsp.fill_bias_buf(bias, bmin, bmax, sc, out_min, gemsumb), want)
        # the nodes' cached form: the same words, once per value of the arguments
        cached = dsp._fill_bias_buf_cached(bias, bmin, bmax, sc, out_min, gemsumb)
        np.testing.assert_array_equal(cached, want)
        assert dsp._fill_bias_buf_cached(bias.copy(), bmin, bmax, sc, out_min, list(gemsumb)) is cached
        want_fc = r.superfc_fill_bias_buf(bias, bmin, bmax, sc, out_min, gemsumb)
        np.testing.assert_array_equal(dsp.superfc_fill_bias_buf(bias, bmin, bmax, sc, out_min, gemsumb), want_fc)


def test_fill_bias_buf_at_the_rounding_ties():
    """minout - gemsumb*in_offset landing on .5 in binary32: nearest-even in both."""
    sc = r.D32Scaling(3, 1.0, 1.0, 1 << 30, 3)
    bias = np.zeros(32, dtype=np.int64)
    gemsumb = list(range(32))
    for out_min in (-0.5, -1.5, -2.5, -1000000.5, -8388607.5):
        want = r.fill_bias_buf(bias, -1.0, 1.0, sc, out_min, gemsumb)
        np.testing.assert_array_equal(dsp.fill_bias_buf(bias, -1.0, 1.0, sc, out_min, gemsumb), want)
    with pytest.raises(MaceqError, match="bias word out of int32 range"):
        dsp.fill_bias_buf(bias, -1.0, 1.0, sc, -3e9, gemsumb)


@pytest.mark.parametrize("shape", [(3, 3, 3, 5), (1, 1, 40, 33), (3, 3, 64, 32), (5, 5, 7, 1)])
def test_weight_sums_equal_the_scalar_reference(shape):
    rng = np.random.default_rng(sum(shape))
    w = rng.integers(0, 256, size=shape, dtype=np.uint8)
    for fo in (0, 1, 128, 255):
        np.testing.assert_array_equal(dsp.padded_gemsumb(w, fo, (shape[2] + 31) & ~31), r.supernode_d32_gemsumb(w, fo))
        np.testing.assert_array_equal(dsp.padded_gemsumb(w, fo, (shape[2] + 3) & ~3), r.shortin_gemsumb(w, fo))
        dw = w[:, :, :, :1]
        np.testing.assert_array_equal(dsp.dwise_gemsumb(dw, fo), r.dwise_gemsumb(dw, fo))
        fc = w.reshape(-1, shape[3])
        np.testing.assert_array_equal(dsp.superfc_gemsumb(fc, fo), r.superfc_gemsumb(fc, fo))
        assert dsp.dwise_gemsumb(dw, fo) is dsp.dwise_gemsumb(dw, fo)  # kept per live filter array and offset


def test_d32_requant_compiled_equals_numpy_and_the_scalar_reference(monkeypatch):
    from maceq.runtime.kernels import jit

    if not jit.available():
        pytest.skip("numba not available: the numpy path is the only one")
    rng = np.random.default_rng(7)
    for shamt in (0, 1, 3, 7, 31):
        recip = int(rng.integers(1, 2 ** 31)) if shamt < 31 else 2 ** 31 - 1  # the largest product: 2^31 * recip
        # sums inside int32, past it (the wrap), and where the shift wraps again
        s = np.concatenate([rng.integers(-(2 ** 31), 2 ** 31, 4991), rng.integers(-(2 ** 40), 2 ** 40, 5000),
                            np.array([0, 1, -1, 2 ** 31 - 1, -(2 ** 31), 2 ** 31, 2 ** 32 - 1, 2 ** 24, -(2 ** 24)])])
        s = s.reshape(100, 10, 10)  # any shape: [N, OH, OW, O] sums in the kernels
        got, want = jit.d32_requant(s, recip, shamt), dsp._d32_requant_numpy(s, recip, shamt)
        assert got[0].shape == want[0].shape and np.array_equal(got[0], want[0]) and got[1:] == want[1:]
        flat = np.asarray(s).reshape(-1)
        for k in range(0, flat.size, 997):  # nnlib_ref's scalar d32_requant on a sample
            assert r.d32_requant(int(flat[k]), recip, shamt)[0] == int(got[0].reshape(-1)[k])
        # a bias word per channel (last axis), added inside the pass: as adding it first
        word = rng.integers(-(2 ** 33), 2 ** 33, 10)
        got, want = jit.d32_requant(s, recip, shamt, word), dsp._d32_requant_numpy(s + word, recip, shamt)
        assert np.array_equal(got[0], want[0]) and got[1:] == want[1:]
        assert dsp._d32_requant(s, recip, shamt, word)[1:] == want[1:]
    assert jit.d32_requant(np.zeros(0, np.int64), 1 << 30, 0)[1:] == (1 << 24, -(1 << 24))
    # the kernels take the compiled path while it is available
    calls = []
    monkeypatch.setattr(jit, "d32_requant", lambda *a: calls.append(a) or dsp._d32_requant_numpy(*a[:3]))
    dsp._d32_requant(np.arange(10), 1 << 30, 0)
    assert len(calls) == 1


@pytest.mark.parametrize("case", [((1, 1), 100, (1, 1), (0, 0), (6, 6)), ((1, 1), 300, (1, 1), (0, 0), (6, 6)),
                                  ((3, 3), 40, (1, 1), (1, 1), (6, 6)), ((1, 1), 33_100, (1, 1), (0, 0), (1, 1)),
                                  ((3, 3), 3, (2, 2), (0, 1), (3, 3)), ((3, 3), 40, (2, 1), (1, 1), (3, 8))],
                         ids=["pointwise-one-gemm", "pointwise-chunked", "3x3", "pointwise-wraps", "3x3s2-rgb",
                              "3x3-past-the-input"])
def test_conv_sums_equal_plain_int64_sums(case, loops, monkeypatch):
    # the float32 / float64 sums of the supernode equal int64 sums of (x - in_offset) * (w - w_offset) over the
    # taps inside x, wrapped to int32 where the bound says a sum can leave it (33,100 products of up to 255 * 255
    # can); the compiled GEMMs (im2col rows past 1x1; output columns past the input, as InputSupernode computes
    # them, read only padding) and numpy's
    from maceq.runtime.kernels import jit

    monkeypatch.setenv("MACEQ_NO_INTGEMM", "1")  # the float32 GEMMs (the integer tiles: tests/test_intgemm.py)
    calls = []
    real = jit.dsp_pointwise_sums
    monkeypatch.setattr(jit, "dsp_pointwise_sums", lambda *a: calls.append(1) or real(*a))
    (kh, kw), c, strides, before, out_hw = case
    rng = np.random.default_rng(c)
    hw = 1 if c > 1000 else 6
    x = rng.integers(0, 256, (1, hw, hw, c), dtype=np.uint8)
    w = rng.integers(0, 256, (kh, kw, c, 3), dtype=np.uint8)
    if c > 1000:  # every product at its largest, one sign: the sum passes 2^31
        x[:], w[:], io, wo = 255, 255, 0, 0
    else:
        io, wo = int(rng.integers(0, 256)), int(rng.integers(0, 256))
    got = dsp._conv_sums(x, w, io, wo, strides, before, out_hw)
    want = np.zeros((1, *out_hw, 3), dtype=np.int64)
    for oy, ox, i, j in np.ndindex(*out_hw, kh, kw):
        iy, ix = oy * strides[0] + i - before[0], ox * strides[1] + j - before[1]
        if 0 <= iy < hw and 0 <= ix < hw:
            want[0, oy, ox] += (x[0, iy, ix].astype(np.int64) - io) @ (w[i, j].astype(np.int64) - wo)
    assert np.array_equal(got, dsp._wrap32(want))
    assert (c > 1000) == bool(np.any(want != dsp._wrap32(want)))
    assert len(calls) == (loops == "compiled")  # which path ran


def test_derived_arrays_are_kept_per_live_array_and_dropped_with_it():
    w = np.arange(2 * 3 * 4 * 5, dtype=np.uint8).reshape(2, 3, 4, 5).copy()  # owns its data
    a = dsp.ohwi_to_hwio(w)
    assert a is dsp.ohwi_to_hwio(w) and not a.flags.writeable and a.base is None  # a copy: w can be freed
    assert np.array_equal(a, np.transpose(w, (1, 2, 3, 0)))
    for _ in range(2):  # computed, then from the cache: both the scalar reference's
        assert np.array_equal(dsp.padded_gemsumb(a, 3, 32), r.supernode_d32_gemsumb(a, 3))
    from maceq.runtime.kernels import derived

    key = id(w)
    assert key in derived._CACHE
    del w, a
    import gc

    gc.collect()
    assert key not in derived._CACHE
    with pytest.raises(ValueError, match="view of its source"):
        derived.derived(np.zeros(4), "view", lambda v: v[1:])
    # a view per call (a kernel reshaping the constant each run) finds the base's entry for that view
    base = np.arange(24, dtype=np.int8)
    made = []
    first = derived.derived(base.reshape(4, 6), "f", lambda v: made.append(1) or v.astype(np.float32))
    again = derived.derived(base.reshape(4, 6), "f", lambda v: made.append(1) or v.astype(np.float32))
    other = derived.derived(base.reshape(6, 4), "f", lambda v: made.append(1) or v.astype(np.float32))
    tail = derived.derived(base[12:].reshape(2, 6), "f", lambda v: made.append(1) or v.astype(np.float32))
    assert first is again and made == [1, 1, 1] and other.shape == (6, 4) and tail[0, 0] == 12
    key = id(base)
    del base
    gc.collect()
    assert key not in derived._CACHE


def test_hvx_quantize_compiled_equals_numpy_and_the_scalar_reference(monkeypatch):
    from maceq.runtime.kernels import jit

    if not jit.available():
        pytest.skip("numba not available: the numpy path is the only one")
    rng = np.random.default_rng(11)
    for lo, hi in ((-1.0, 1.0), (0.0, 6.0), (-300.5, 0.25), (-1e-3, 2e-3), (0.0, 1e6)):
        p = r.find_scaling_for_hvx_quant(-r.f32(lo), r.f32(hi))
        # values in and around the range, and every kind of bit pattern (zeros, subnormals, inf, NaN)
        x = np.concatenate([rng.uniform(lo * 1.5, hi * 1.5, 20_000).astype(np.float32),
                            rng.integers(0, 2 ** 32, 5_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
                            np.array([0.0, -0.0, lo, hi, np.inf, -np.inf, 1e-45, 3.0], dtype=np.float32)])
        x = x.reshape(8, -1)  # any shape
        got = jit.hvx_quantize(x, p.common_exp, p.min_offset, p.scaling & 0xFFFF)
        assert got.shape == x.shape and np.array_equal(got, dsp._hvx_quantize_numpy(x, p))
        flat = x.reshape(-1)
        assert all(r.hvx_quantize_word(float(flat[k]), p) == int(got.reshape(-1)[k]) for k in range(0, 20_000, 211))
    calls = []
    monkeypatch.setattr(jit, "hvx_quantize", lambda *a: calls.append(1) or dsp._hvx_quantize_numpy(a[0], p))
    dsp.quantize_input(np.linspace(-1, 1, 64, dtype=np.float32))
    assert calls == [1]  # the kernels take the compiled path while it is available


def _plain_dw_sums(x, w, io, wo, strides, before, out_hw):
    """int64 depthwise sums of (x - io) * (w - wo) over the taps inside x, by explicit loops over the taps."""
    n, h, wd, c = x.shape
    kh, kw = w.shape[:2]
    want = np.zeros((n, *out_hw, c), np.int64)
    for oy in range(out_hw[0]):
        for ox in range(out_hw[1]):
            for i in range(kh):
                for j in range(kw):
                    iy, ix = oy * strides[0] + i - before[0], ox * strides[1] + j - before[1]
                    if 0 <= iy < h and 0 <= ix < wd:
                        want[:, oy, ox] += (x[:, iy, ix].astype(np.int64) - io) * (w[i, j, :, 0].astype(np.int64) - wo)
    return want


@pytest.mark.parametrize("geometry", [((3, 3), (1, 1), (1, 1), (7, 9)), ((3, 3), (2, 2), (0, 1), (4, 5)),
                                      ((5, 5), (2, 1), (2, 2), (4, 9)), ((3, 3), (1, 2), (2, 0), (8, 3))],
                         ids=["3x3s1", "3x3s2", "5x5s2x1", "pad-past-taps"])
def test_dw_sums_compiled_equal_numpy_and_plain_int64_sums(geometry, monkeypatch):
    from maceq.runtime.kernels import jit

    (kh, kw), strides, before, out_hw = geometry
    rng = np.random.default_rng(kh * 10 + strides[0])
    x = rng.integers(0, 256, (2, 8, 9, 37), dtype=np.uint8)
    w = rng.integers(0, 256, (kh, kw, 37, 1), dtype=np.uint8)
    x[0, :2], w[0, 0, :5] = 255, 0  # the largest products, both signs after the offsets
    for io, wo in ((0, 255), (255, 0), (int(rng.integers(0, 256)), int(rng.integers(0, 256)))):
        want = _plain_dw_sums(x, w, io, wo, strides, before, out_hw)
        numpy_path = dsp._dw_sums_numpy(x, w, io, wo, strides, before, out_hw)
        assert np.array_equal(numpy_path, want)
        if jit.available():
            wz = w[:, :, :, 0].astype(np.int32) - wo
            assert np.array_equal(jit.dsp_dw_sums(x, wz, io, strides, before, out_hw), want)
            # the codes in the same pass equal the sums, then the requantization
            for recip, shamt in ((1 << 30, 0), (2 ** 31 - 1, 7), (1 << 14, 0)):
                word = rng.integers(-(2 ** 20), 2 ** 20, 37) if shamt == 0 else rng.integers(-(2 ** 31), 2 ** 31, 37)
                got, ref = jit.dsp_dw_codes(x, wz, io, strides, before, out_hw, word, recip, shamt), \
                    jit.d32_requant(want, recip, shamt, word)
                assert np.array_equal(got[0], ref[0]) and got[1:] == ref[1:]
            assert 0 < np.count_nonzero((ref[0] > 0) & (ref[0] < 255))
    if not jit.available():
        return  # the numpy path, checked above, is the only one
    calls = []
    monkeypatch.setattr(jit, "dsp_dw_sums", lambda *a: calls.append(1) or _plain_dw_sums(x, w, 3, 4, strides,
                                                                                          before, out_hw))
    dsp._dw_sums(x, w, 3, 4, strides, before, out_hw)
    assert calls == [1]  # the kernels take the compiled path while it is available


@pytest.mark.parametrize("geometry", [((3, 3), (2, 2), (0, 1), (4, 5)), ((3, 3), (1, 1), (1, 1), (6, 6)),
                                      ((3, 3), (1, 1), (0, 0), (9, 5))], ids=["3x3s2", "3x3s1", "3x3s1-unpadded"])
def test_dw_junk_sums_compiled_equal_numpy(geometry, monkeypatch):
    # the sums at the columns the depthwise kernel computes outside the output: the compiled pass and the
    # numpy gather and einsums give the same int64 sums for every in_offset (only the 3x3 kernels have such
    # columns)
    from maceq.runtime.kernels import jit

    if not jit.available():
        pytest.skip("numba not available: the numpy path is the only one")
    (kh, kw), strides, before, out_hw = geometry
    rng = np.random.default_rng(kh + out_hw[1])
    x = rng.integers(0, 256, (2, 11, 11, 40), dtype=np.uint8)
    w = rng.integers(0, 256, (kh, kw, 40, 1), dtype=np.uint8)
    args = (x, w, int(rng.integers(0, 256)), strides, before, out_hw)
    calls = []
    real = jit.dsp_junk_sums
    monkeypatch.setattr(jit, "dsp_junk_sums", lambda *a: calls.append(1) or real(*a))
    compiled = dsp._dw_junk_sums(*args)
    assert calls == []  # the sums are found on the first call (a node whose range is given never asks)
    first = compiled(0)
    assert calls == [1]  # the compiled pass ran (on the int32 index)
    monkeypatch.setenv("MACEQ_NO_JIT", "1")
    numpy_path = dsp._dw_junk_sums(*args)
    if first is None:
        pytest.fail("this geometry has no discarded columns: the test checks nothing")
    for io in (0, 255, int(rng.integers(0, 256))):
        a, b = compiled(io), numpy_path(io)
        assert a.shape == b.shape and a.size and np.array_equal(a, b)
    assert calls == [1]  # once for every in_offset
