"""The gpu device: the OpenCL kernels (runtime/opencl/*.cl) run on PoCL against the numpy simulation.

Oracle: the OpenCL C kernels, compiled by PoCL (LLVM) and run on its CPU device, are an
implementation independent of the numpy simulation in runtime/kernels/gpu.py; every test
here requires 0 differing elements between the two. Readable scalar references (Python
ints and numpy float32 scalars) check the vectorised conv/depthwise/FC paths, and exact
rational arithmetic checks the host-side float32 expressions.

pyopencl and pocl-binary-distribution are required: without them the backend tests FAIL
(they are the gpu device's oracle and are never skipped).
"""
from __future__ import annotations

import os
from fractions import Fraction

import numpy as np
import pytest

from maceq.errors import MaceqError
from maceq.quant import converter as qc
from maceq.runtime.kernels import gpu as g
from maceq.runtime.opencl import OpenCLBackend, kernel_source

F32 = np.float32


@pytest.fixture(scope="module")
def be(tmp_path_factory):
    old = os.environ.get("POCL_CACHE_DIR")
    os.environ["POCL_CACHE_DIR"] = str(tmp_path_factory.mktemp("pocl-cache"))
    try:
        import pyopencl  # noqa: F401
    except ImportError as e:
        pytest.fail("the gpu device tests need pyopencl and PoCL: "
                    f"pip install pyopencl==2026.1.4 pocl-binary-distribution==3.0 ({e})")
    backend = OpenCLBackend()
    try:
        backend.device_name
    except MaceqError as e:
        pytest.fail(f"the gpu device tests need an OpenCL device (PoCL): {e}")
    yield backend
    if old is None:
        os.environ.pop("POCL_CACHE_DIR", None)
    else:
        os.environ["POCL_CACHE_DIR"] = old


def _mismatch(a: np.ndarray, b: np.ndarray) -> int:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    if a.dtype.kind == "f":  # compare bits (-0 != +0); any NaN equals any NaN (payloads carry nothing)
        same = (a.view(f"u{a.itemsize}") == b.view(f"u{b.itemsize}")) | (np.isnan(a) & np.isnan(b))
        return int(np.sum(~same))
    return int(np.sum(a != b))


def _log_uniform(rng, lo, hi, size=None):
    return np.exp(rng.uniform(np.log(lo), np.log(hi), size))


# ----------------------------------------------------------------------------
# exact float32 rounding of a rational (independent of numpy's float32 arithmetic)


def _f32_of(fr: Fraction) -> np.float32:
    """The float32 nearest to ``fr``, ties to even (checks the three neighbours of a guess)."""
    guess = F32(float(fr))
    cands = [np.nextafter(guess, F32(-np.inf)), guess, np.nextafter(guess, F32(np.inf))]
    best = min(cands, key=lambda c: (abs(Fraction(float(c)) - fr), int(np.array(c).view(np.uint32)) & 1))
    return F32(best)


def test_requant_scales_and_inverse_are_float32_expressions():
    rng = np.random.default_rng(1)
    for _ in range(300):
        s_in, s_out = F32(_log_uniform(rng, 1e-4, 1.0)), F32(_log_uniform(rng, 1e-3, 10.0))
        s_w = F32(_log_uniform(rng, 1e-5, 1e-1, 3)).astype(F32)
        got = g.gpu_requant_scales(s_in, s_w, s_out)
        assert got.dtype == np.float32
        for c in range(3):
            prod = _f32_of(Fraction(float(s_in)) * Fraction(float(s_w[c])))
            want = _f32_of(Fraction(float(prod)) / Fraction(float(s_out)))
            assert got[c] == want
        assert g.gpu_inverse_scale(s_out) == _f32_of(1 / Fraction(float(s_out)))
    assert list(g.gpu_requant_scales(0.5, [0.25, 3.0], 0.125)) == [1.0, 12.0]


def test_quantize_weights_symmetric_per_channel():
    w = np.array([[127.0, -63.5, 31.75, 0.5, 1.5, 2.5],
                  [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                  [-254.0, 5.0, 7.0, -1.0, 3.0, 253.0]], dtype=np.float32)
    q, s = qc.gpu_quantize_weights(w)
    assert q.dtype == np.int8 and s.dtype == np.float32
    assert list(s) == [1.0, 1.0, 2.0]  # a zero channel gets scale 1
    assert q.tolist() == [[127, -64, 32, 0, 2, 2], [0] * 6, [-127, 2, 4, 0, 2, 126]]
    rng = np.random.default_rng(2)
    w = rng.standard_normal((5, 3, 3, 4)).astype(np.float32)
    q, s = qc.gpu_quantize_weights(w)
    assert np.all(np.abs(q).reshape(5, -1).max(axis=1) == 127)
    assert np.all(np.abs(q.astype(np.float32) * s[:, None, None, None] - w) <= s[:, None, None, None] / 2 * 1.0001)


# ----------------------------------------------------------------------------
# Conv2D / DepthwiseConv2d / FullyConnected


def _conv_config(rng, depthwise: bool):
    while True:
        n, h, w = int(rng.integers(1, 3)), int(rng.integers(1, 10)), int(rng.integers(1, 10))
        c = int(rng.integers(1, 9))
        kh, kw = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        strides = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
        dil = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
        pads = tuple(int(p) for p in rng.integers(0, 3, 4))
        if h + pads[0] + pads[2] >= dil[0] * (kh - 1) + 1 and w + pads[1] + pads[3] >= dil[1] * (kw - 1) + 1:
            break
    x = rng.integers(0, 256, (n, h, w, c), dtype=np.uint8)
    if depthwise:
        m = int(rng.integers(1, 4))
        wt = rng.integers(-127, 128, (kh, kw, c, m), dtype=np.int8)
        o = c * m
    else:
        o = int(rng.integers(1, 7))
        wt = rng.integers(-128, 128, (o, kh, kw, c), dtype=np.int8)
    kind = rng.integers(0, 4)
    if kind == 0:  # ordinary biases
        bias = rng.integers(-20000, 20000, o).astype(np.int32)
    elif kind == 1:  # |acc| > 2^24: the int32 -> float32 conversion rounds
        bias = (rng.choice([-1, 1], o) * rng.integers(2 ** 24, 2 ** 30, o)).astype(np.int32)
    elif kind == 2:  # int32 wraparound
        bias = rng.choice([2 ** 31 - 1 - 200, -(2 ** 31) + 200], o).astype(np.int32)
    else:
        bias = None
    s_in = F32(_log_uniform(rng, 1e-3, 0.1))
    s_w = F32(_log_uniform(rng, 1e-4, 1e-2, o)).astype(F32)
    s_out = F32(_log_uniform(rng, 1e-4, 1.0)) if kind != 1 else F32(_log_uniform(rng, 1e-1, 1e2))
    kwargs = dict(x_zp=int(rng.integers(0, 256)), out_zp=int(rng.integers(0, 256)),
                  scale_c=g.gpu_requant_scales(s_in, s_w, s_out), strides=strides, pads=pads, dilations=dil)
    return x, wt, bias, kwargs


@pytest.mark.parametrize("depthwise", [False, True], ids=["conv2d", "depthwise"])
def test_conv_random_configs_opencl_equals_numpy_and_scalar_ref(be, depthwise):
    rng = np.random.default_rng(10 + depthwise)
    sim = g.gpu_depthwise_conv2d if depthwise else g.gpu_conv2d
    ref = g.gpu_depthwise_conv2d_ref if depthwise else g.gpu_conv2d_ref
    run = be.depthwise_conv2d if depthwise else be.conv2d
    elements = mism_cl = mism_ref = saturated = 0
    for i in range(60):
        x, w, bias, kw = _conv_config(rng, depthwise)
        want = sim(x, w, bias, **kw)
        mism_cl += _mismatch(run(x, w, bias, **kw), want)
        if i % 2 == 0:
            mism_ref += _mismatch(ref(x, w, bias, **kw), want)
        elements += want.size
        saturated += int(np.sum((want == 0) | (want == 255)))
    assert (mism_cl, mism_ref) == (0, 0)
    assert elements > 3000 and 0 < saturated < elements


def _one_tap_conv(acc: np.ndarray, scale_c: np.ndarray, out_zp: int):
    """A 1x1 conv on a 1-channel image with w = 1, x - x_zp = 0: the output is requant(bias)."""
    o = acc.size
    x = np.zeros((1, 1, 1, 1), dtype=np.uint8)
    w = np.ones((o, 1, 1, 1), dtype=np.int8)
    return x, w, acc.astype(np.int32), dict(x_zp=0, out_zp=out_zp, scale_c=scale_c.astype(F32))


def test_conv_requant_ties_large_acc_and_no_fma(be):
    rng = np.random.default_rng(20)
    cases = []
    # exact ties: scale 2^-k with acc = j * 2^(k-1) for odd j gives (.5) + zp
    for k in range(1, 6):
        acc = np.arange(-600, 601, dtype=np.int64) * 2 ** (k - 1)
        cases.append((acc, np.full(acc.size, 2.0 ** -k), int(rng.integers(0, 256))))
    # |acc| > 2^24: float(acc) rounds; random large accumulators ...
    acc = rng.choice([-1, 1], 4000) * rng.integers(2 ** 24, 2 ** 31 - 1, 4000)
    cases.append((acc, 2.0 ** -rng.integers(17, 25, 4000) * rng.uniform(1, 2, 4000), 128))
    # ... and ones where it moves the code: acc = (2j+1) * 2^(k-1) -/+ 1 > 2^24 rounds to the
    # tie (2j+1) * 2^(k-1), scale 2^-k, so the exact j + 1/2 -/+ tiny meets float32's j + 1/2.
    # out_zp = 0: a larger zero point would round the tiny part away in the add as well.
    for k in (25, 26, 27):
        j = np.arange(0, 2 ** (32 - k) // 2)
        for d in (-1, 1):
            a = (2 * j + 1) * 2 ** (k - 1) + d
            cases.append((a[a < 2 ** 31], np.full(int(np.sum(a < 2 ** 31)), 2.0 ** -k), 0))
    # double rounding: f32(acc * s) lies in a lower binade than the result + zp, near a code's .5,
    # where a fused multiply-add (one rounding) gives the neighbouring code
    acc = rng.integers(1000, 2 ** 22, 100_000)
    zp = rng.integers(1, 256, acc.size)
    top = 2.0 ** (np.floor(np.log2(zp)) + 1)  # first power of two above zp
    target = np.floor(top + rng.uniform(0, 1, acc.size) * zp) + 0.5 - zp  # acc*s + zp ~ k + 0.5 >= top
    s = np.nextafter((target / acc).astype(F32), F32(np.inf))
    f = acc.astype(F32)
    fused = (f.astype(np.float64) * s.astype(np.float64) + zp).astype(F32)
    differ = np.rint(fused) != np.rint(f * s + zp.astype(F32))
    assert differ.sum() > 5000
    for z in np.unique(zp[differ])[:40]:
        sel = differ & (zp == z)
        cases.append((acc[sel], s[sel], int(z)))

    tie_codes = moved_by_float_acc = 0
    for acc, scale, out_zp in cases:
        x, w, b, kw = _one_tap_conv(np.asarray(acc), np.asarray(scale), out_zp)
        want = g.gpu_conv2d(x, w, b, **kw)
        assert _mismatch(be.conv2d(x, w, b, **kw), want) == 0
        exact = [Fraction(int(a)) * Fraction(float(sc)) + out_zp for a, sc in zip(b, kw["scale_c"])]
        tie_codes += sum(v.denominator == 2 for v in exact)
        # exact rational rounding of acc * scale + zp (Python's round on a Fraction is half to even)
        # differs from the code only through float32 rounding of acc or of the product
        moved_by_float_acc += sum(
            min(max(round(v), 0), 255) != int(q) and int(F32(int(a))) != int(a)
            and Fraction(float(F32(int(a)))) * Fraction(float(sc)) == Fraction(float(F32(F32(int(a)) * sc)))
            for v, a, sc, q in zip(exact, b, kw["scale_c"], want.reshape(-1)))
        # the scalar reference agrees element by element
        assert all(g.gpu_requantize_acc_ref(int(a), sc, out_zp) == int(q)
                   for a, sc, q in zip(b[:300], kw["scale_c"][:300], want.reshape(-1)[:300]))
    assert tie_codes > 1000 and moved_by_float_acc > 100
    # pinned values: half to even, saturation, and float(acc) rounding
    x, w, b, kw = _one_tap_conv(np.array([1, 3, -1, -3, 5, 2 ** 24 + 1, 1000, -1000]),
                                np.array([0.5, 0.5, 0.5, 0.5, 0.5, 2.0 ** -24, 1.0, 1.0]), 0)
    assert be.conv2d(x, w, b, **kw).reshape(-1).tolist() == [0, 2, 0, 0, 2, 1, 255, 0]


@pytest.mark.parametrize("depthwise", [False, True], ids=["conv2d", "depthwise"])
def test_each_bias_path_equals_the_scalar_reference(depthwise):
    # the numpy path adds the bias in float32, float64 or with the int32 wrap, by a bound on the sums;
    # each, taken as sum_path says, gives the reference's codes (1x1 conv: the one-GEMM float32 sums)
    rng = np.random.default_rng(40)
    x = rng.integers(0, 256, (1, 5, 6, 8), dtype=np.uint8)
    kh = 3 if depthwise else 1
    w = rng.integers(-128, 128, (kh, kh, 8, 1) if depthwise else (4, 1, 1, 8), dtype=np.int8)
    o = 8 if depthwise else 4
    terms = kh * kh * (1 if depthwise else 8)
    sim, ref = ((g.gpu_depthwise_conv2d, g.gpu_depthwise_conv2d_ref) if depthwise else
                (g.gpu_conv2d, g.gpu_conv2d_ref))
    paths = ((10_000, 20_000, "float32"), (2 ** 26, 2 ** 27, "float64"), (2 ** 31 - 200, 2 ** 31 - 1, "wrap"))
    for lo, hi, path in paths:
        bias = (rng.choice([-1, 1], o) * rng.integers(lo, hi, o)).astype(np.int32)
        assert g.sum_path(terms, bias.astype(np.int64), np.float32) == path
        scale = np.full(o, 2.0 ** -12 if path == "float32" else 2.0 ** -26, F32)
        kw = dict(x_zp=int(rng.integers(0, 256)), out_zp=128, scale_c=scale, pads=(1, 1, 1, 1) if depthwise else
                  (0, 0, 0, 0))
        want = ref(x, w, bias, **kw)
        assert _mismatch(sim(x, w, bias, **kw), want) == 0
        assert 0 < np.count_nonzero((want > 0) & (want < 255))  # codes inside the range, not only saturated


def _compiled_numpy_and_reference_agree(monkeypatch, sim, ref, x, w, bias, kw):
    """sim's codes (compiled path) equal its numpy path's and the reference's, some inside the range."""
    from maceq.runtime.kernels import jit

    got = sim(x, w, bias, **kw)
    with monkeypatch.context() as m:
        m.setattr(jit, "available", lambda: False)
        assert np.array_equal(got, sim(x, w, bias, **kw))
    want = ref(x, w, bias, **kw)
    assert _mismatch(want, got) == 0 and 0 < np.count_nonzero((want > 0) & (want < 255))


def _fma_points(rng):
    """(acc, s, zp): 500 int32 sums and float32 scales whose codes f32(f32(acc) * s) + zp lie in [32, 52] (inside the
    range, f32(acc * s) a binade below them) and where a fused multiply-add would give the neighbouring code."""
    acc = rng.integers(1000, 2 ** 22, 20_000)
    zp = 20
    target = np.floor(32 + rng.uniform(0, 1, acc.size) * zp) + 0.5 - zp
    s = np.nextafter((target / acc).astype(F32), F32(np.inf))
    fused = (acc.astype(F32).astype(np.float64) * s.astype(np.float64) + zp).astype(F32)
    differ = np.rint(fused) != np.rint(acc.astype(F32) * s + F32(zp))
    assert np.count_nonzero(differ) >= 500
    return acc[differ][:500], s[differ][:500], zp


def test_compiled_gpu_depthwise_equals_the_numpy_path_and_the_reference(monkeypatch):
    # the float32-GEMM compiled paths (the integer tiles: tests/test_intgemm.py)
    from maceq.runtime.kernels import jit

    monkeypatch.setenv("MACEQ_NO_INTGEMM", "1")
    if not jit.available():
        pytest.skip("numba not available: the numpy path is the only one")
    rng = np.random.default_rng(50)
    calls = []
    compiled = jit.gpu_depthwise
    monkeypatch.setattr(jit, "gpu_depthwise", lambda *a: calls.append(1) or compiled(*a))
    cases = 0
    for k, st, dil, pads in (((3, 3), (1, 1), (1, 1), (1, 1, 1, 1)), ((3, 3), (2, 2), (1, 1), (0, 1, 0, 1)),
                             ((5, 5), (1, 2), (2, 1), (2, 1, 3, 0)), ((1, 1), (1, 1), (1, 1), (0, 0, 0, 0))):
        c = int(rng.integers(1, 40))
        x = rng.integers(0, 256, (2, 9, 11, c), dtype=np.uint8)
        w = rng.integers(-128, 128, (*k, c, 1), dtype=np.int8)
        bias = rng.integers(-50_000, 50_000, c).astype(np.int32)
        kw = dict(x_zp=int(rng.integers(0, 256)), out_zp=int(rng.integers(0, 256)), strides=st, dilations=dil,
                  pads=pads, scale_c=g.gpu_requant_scales(F32(0.02), F32(rng.uniform(1e-3, 1e-2, c)).astype(F32),
                                                         F32(0.05)))
        got = g.gpu_depthwise_conv2d(x, w, bias, **kw)
        with monkeypatch.context() as m:
            m.setattr(jit, "available", lambda: False)
            numpy_path = g.gpu_depthwise_conv2d(x, w, bias, **kw)
        assert np.array_equal(got, numpy_path) and _mismatch(g.gpu_depthwise_conv2d_ref(x, w, bias, **kw), got) == 0
        cases += 1
    assert len(calls) == cases  # every case took the compiled path
    # the requantization's two float32 roundings (no FMA) on crafted points: a 1x1 depthwise with x = x_zp
    # gives requant(bias) per channel
    acc, s, zp = _fma_points(rng)
    x = np.zeros((1, 1, 1, acc.size), dtype=np.uint8)
    w = np.ones((1, 1, acc.size, 1), dtype=np.int8)
    got = g.gpu_depthwise_conv2d(x, w, acc.astype(np.int32), x_zp=0, out_zp=zp, scale_c=s)
    assert [g.gpu_requantize_acc_ref(int(a), sc, zp) for a, sc in zip(acc, s)] == got.reshape(-1).tolist()
    assert np.all((got > 30) & (got < 55))  # not saturated: the roundings decide every code
    assert len(calls) == cases + 1


def test_compiled_gpu_convolutions_equal_the_numpy_path_and_the_reference(monkeypatch):
    # convs: GEMM (on im2col rows past 1x1 stride 1) and requantization per block of rows, compiled (float32 sums;
    # float32 chunks summed in float64 past 256 terms or with a large bias); the integer tiles: tests/test_intgemm.py
    from maceq.runtime.kernels import jit

    monkeypatch.setenv("MACEQ_NO_INTGEMM", "1")
    if not jit.available():
        pytest.skip("numba not available: the numpy path is the only one")
    rng = np.random.default_rng(51)
    pointwise, requants, rows = [], [], []
    compiled_pw, compiled_rq, compiled_fc = jit.gpu_pointwise, jit.gpu_requant, jit.fc_sums
    monkeypatch.setattr(jit, "gpu_pointwise", lambda *a, **k: pointwise.append(k["wide"]) or compiled_pw(*a, **k))
    monkeypatch.setattr(jit, "gpu_requant", lambda *a: requants.append(1) or compiled_rq(*a))
    monkeypatch.setattr(jit, "fc_sums", lambda *a: rows.append(1) or compiled_fc(*a))
    for c, o, k, st, pads, dil, bias_max in (
            (24, 16, 1, (1, 1), (0, 0, 0, 0), (1, 1), 50_000), (300, 12, 1, (1, 1), (0, 0, 0, 0), (1, 1), 50_000),
            (24, 16, 1, (1, 1), (0, 0, 0, 0), (1, 1), 2 ** 26), (24, 16, 1, (2, 2), (0, 0, 0, 0), (1, 1), 50_000),
            (3, 8, 3, (2, 2), (1, 1, 1, 1), (1, 1), 50_000), (40, 6, 3, (1, 2), (2, 0, 1, 2), (2, 1), 50_000)):
        x = rng.integers(0, 256, (2, 6, 7, c), dtype=np.uint8)
        w = rng.integers(-128, 128, (o, k, k, c), dtype=np.int8)
        bias = rng.integers(-bias_max, bias_max, o).astype(np.int32)
        kw = dict(x_zp=17, out_zp=131, strides=st, pads=pads, dilations=dil, scale_c=g.gpu_requant_scales(
            F32(0.02), F32(rng.uniform(1e-3, 1e-2, o)).astype(F32), F32(0.05 if bias_max < 2 ** 20 else 400.0)))
        _compiled_numpy_and_reference_agree(monkeypatch, g.gpu_conv2d, g.gpu_conv2d_ref, x, w, bias, kw)
    assert pointwise == [False, True, True, False, False, True]  # 3x3x40 = 360 terms: float64
    # FullyConnected: from 4 rows the same compiled 1x1 conv, fewer rows by jit.fc_sums' int32 sums
    for n, k in ((3, 100), (5, 100), (5, 700)):
        x = rng.integers(0, 256, (n, k), dtype=np.uint8)
        w = rng.integers(-127, 128, (9, k), dtype=np.int8)
        bias = rng.integers(-2 ** 20, 2 ** 20, 9).astype(np.int32)
        kw = dict(x_zp=40, out_zp=120, scale_c=g.gpu_requant_scales(F32(0.02), F32(rng.uniform(1e-4, 1e-3, 9))
                                                                    .astype(F32), F32(0.5)))
        _compiled_numpy_and_reference_agree(monkeypatch, g.gpu_fully_connected, g.gpu_fully_connected_ref, x, w,
                                            bias, kw)
    assert pointwise[6:] == [False, True] and rows == [1]
    # a depthwise conv with multiplier 2 (numpy float32 sums) takes the compiled requantization alone
    x = rng.integers(0, 256, (1, 5, 6, 8), dtype=np.uint8)
    w = rng.integers(-128, 128, (3, 3, 8, 2), dtype=np.int8)
    bias = rng.integers(-50_000, 50_000, 16).astype(np.int32)
    kw = dict(x_zp=3, out_zp=100, pads=(1, 1, 1, 1), scale_c=g.gpu_requant_scales(
        F32(0.02), F32(rng.uniform(1e-3, 1e-2, 16)).astype(F32), F32(0.05)))
    got = g.gpu_depthwise_conv2d(x, w, bias, **kw)
    assert _mismatch(g.gpu_depthwise_conv2d_ref(x, w, bias, **kw), got) == 0 and requants == [1]
    # the float64 path's roundings on crafted points (x = x_zp: the sums are 0, the codes requant(bias)), over
    # 300 channels: one float32 rounding of the int32, then the multiply's and the add's, no FMA
    acc, s, zp = _fma_points(rng)
    x = np.full((1, 1, 1, 300), 9, dtype=np.uint8)
    w = rng.integers(-128, 128, (acc.size, 1, 1, 300), dtype=np.int8)
    got = g.gpu_conv2d(x, w, acc.astype(np.int32), x_zp=9, out_zp=zp, scale_c=s)
    assert [g.gpu_requantize_acc_ref(int(a), sc, zp) for a, sc in zip(acc, s)] == got.reshape(-1).tolist()
    assert pointwise[-1] is True and np.all((got > 30) & (got < 55))


def test_conv_wraps_int32_like_the_kernel(be):
    x = np.full((1, 1, 3, 2), 255, dtype=np.uint8)
    w = np.full((2, 1, 3, 2), 127, dtype=np.int8)
    bias = np.array([2 ** 31 - 1000, -(2 ** 31) + 10], dtype=np.int32)
    kw = dict(x_zp=0, out_zp=100, scale_c=np.array([2.0 ** -30, 2.0 ** -30], F32), pads=(0, 1, 0, 1))
    want = g.gpu_conv2d(x, w, bias, **kw)
    assert _mismatch(be.conv2d(x, w, bias, **kw), want) == 0
    assert _mismatch(g.gpu_conv2d_ref(x, w, bias, **kw), want) == 0
    # channel 0 wraps past INT32_MAX to about -2^31: f32(-2^31 * 2^-30) + 100 = 98
    assert want[0, 0, 1, 0] == 98 and want[0, 0, 1, 1] == 98


def test_fully_connected_random(be):
    rng = np.random.default_rng(30)
    mism = mism_ref = 0
    for i in range(16):
        n, k, o = int(rng.integers(1, 5)), int(rng.integers(1, 3000)), int(rng.integers(1, 40))
        x = rng.integers(0, 256, (n, k), dtype=np.uint8)
        w = rng.integers(-127, 128, (o, k), dtype=np.int8)
        bias = rng.integers(-2 ** 20, 2 ** 20, o).astype(np.int32) if i % 3 else None
        sc = g.gpu_requant_scales(_log_uniform(rng, 1e-3, 0.1), _log_uniform(rng, 1e-4, 1e-2, o),
                                  _log_uniform(rng, 1e-2, 10.0))
        kw = dict(x_zp=int(rng.integers(0, 256)), out_zp=int(rng.integers(0, 256)), scale_c=sc)
        want = g.gpu_fully_connected(x, w, bias, **kw)
        mism += _mismatch(be.fully_connected(x, w, bias, **kw), want)
        if k * o * n < 20000:
            mism_ref += _mismatch(g.gpu_fully_connected_ref(x, w, bias, **kw), want)
        # FC is the 1x1 conv on a 1x1 image
        conv = g.gpu_conv2d(x[:, None, None, :], w[:, None, None, :], bias, **kw)
        mism += _mismatch(conv.reshape(n, o), want)
    assert (mism, mism_ref) == (0, 0)


# ----------------------------------------------------------------------------
# uint8 <-> float32 ops


def _all_pairs():
    a = np.repeat(np.arange(256, dtype=np.uint8), 256).reshape(1, 256, 256, 1)
    return a, np.ascontiguousarray(a.transpose(0, 2, 1, 3))


def test_eltwise_add_sub_all_pairs(be):
    rng = np.random.default_rng(40)
    a, b = _all_pairs()
    configs = [dict(a_scale=0.5, a_zp=128, b_scale=0.25, b_zp=3, out_scale=1.0, out_zp=100),  # exact ties
               dict(a_scale=0.125, a_zp=0, b_scale=0.125, b_zp=255, out_scale=0.25, out_zp=0)]
    for _ in range(4):
        configs.append(dict(a_scale=_log_uniform(rng, 1e-3, 1), a_zp=int(rng.integers(0, 256)),
                            b_scale=_log_uniform(rng, 1e-3, 1), b_zp=int(rng.integers(0, 256)),
                            out_scale=_log_uniform(rng, 1e-3, 1), out_zp=int(rng.integers(0, 256))))
    mism = 0
    for cfg in configs:
        for sub in (False, True):
            want = g.gpu_eltwise_add(a, b, **cfg, subtract=sub)
            mism += _mismatch(be.eltwise_add(a, b, **cfg, subtract=sub), want)
    # broadcast
    xa = rng.integers(0, 256, (2, 4, 5, 3), dtype=np.uint8)
    xb = rng.integers(0, 256, (1, 1, 1, 3), dtype=np.uint8)
    want = g.gpu_eltwise_add(xa, xb, **configs[2])
    mism += _mismatch(be.eltwise_add(xa, xb, **configs[2]), want)
    assert mism == 0
    # pinned: 0.5*(a-128) + 0.25*(b-3) at a=129, b=3 -> 0.5 -> 0 + 100 (half to even: 100.5 -> 100)
    got = g.gpu_eltwise_add(np.array([129, 131], np.uint8), np.array([3, 3], np.uint8), **configs[0])
    assert got.tolist() == [100, 102]


def test_eltwise_table_path_equals_the_float_steps(monkeypatch):
    # from 4,096 elements the compiled path looks each pair up in a table of the kernel's float32 steps on every
    # pair: the same codes as those steps on the elements (all pairs, ties, both signs, broadcast)
    from maceq.runtime.kernels import jit

    if not jit.available():
        pytest.skip("numba not available: the numpy path is the only one")
    rng = np.random.default_rng(41)
    a, b = _all_pairs()
    a, b = (np.concatenate([v.reshape(-1), rng.integers(0, 256, 70_001, dtype=np.uint8)]) for v in (a, b))
    looked_up = []
    real = jit.lut_pairs
    monkeypatch.setattr(jit, "lut_pairs", lambda *x: looked_up.append(1) or real(*x))
    for cfg in (dict(a_scale=0.5, a_zp=128, b_scale=0.25, b_zp=3, out_scale=1.0, out_zp=100),
                dict(a_scale=F32(0.0173), a_zp=31, b_scale=F32(0.411), b_zp=200, out_scale=F32(0.093), out_zp=7)):
        for sub in (False, True):
            got = g.gpu_eltwise_add(a, b, **cfg, subtract=sub)
            with monkeypatch.context() as m:
                m.setattr(jit, "available", lambda: False)
                assert np.array_equal(got, g.gpu_eltwise_add(a, b, **cfg, subtract=sub))
    xa = rng.integers(0, 256, (2, 60, 70, 8), dtype=np.uint8)
    xb = rng.integers(0, 256, (1, 1, 1, 8), dtype=np.uint8)
    got = g.gpu_eltwise_add(xa, xb, a_scale=0.02, a_zp=9, b_scale=0.03, b_zp=250, out_scale=0.04, out_zp=128)
    ref = g._eltwise_codes(*np.broadcast_arrays(xa, xb), F32(0.02), 9, F32(0.03), 250, g.gpu_inverse_scale(0.04),
                           128, False)
    assert np.array_equal(got, ref) and looked_up == [1] * 5


def test_concat_requantizes_only_differing_inputs(be):
    rng = np.random.default_rng(50)
    mism = 0
    for _ in range(12):
        axis = int(rng.integers(-4, 4))
        base = list(rng.integers(1, 5, 4))
        out_q = (float(_log_uniform(rng, 1e-3, 1)), int(rng.integers(0, 256)))
        xs, qs = [], []
        for _ in range(int(rng.integers(1, 4))):
            shape = list(base)
            shape[axis] = int(rng.integers(1, 4))
            xs.append(rng.integers(0, 256, shape, dtype=np.uint8))
            qs.append(out_q if rng.random() < 0.3 else (float(_log_uniform(rng, 1e-3, 1)), int(rng.integers(0, 256))))
        want = g.gpu_concat(xs, axis=axis, in_qinfos=qs, out_scale=out_q[0], out_zp=out_q[1])
        mism += _mismatch(be.concat(xs, axis=axis, in_qinfos=qs, out_scale=out_q[0], out_zp=out_q[1]), want)
    assert mism == 0
    x = np.array([[0, 4, 5, 255]], dtype=np.uint8)
    same = g.gpu_concat([x], axis=1, in_qinfos=[(0.3, 7)], out_scale=0.3, out_zp=7)
    assert np.array_equal(same, x)  # copied, not requantized
    half = g.gpu_concat([x], axis=1, in_qinfos=[(0.5, 3)], out_scale=1.0, out_zp=3)
    assert half.tolist() == [[2, 4, 4, 129]]  # -1.5 -> -2, 0.5 -> 0, 1 -> 1, 126 -> 126 (+3)


def test_quantize_dequantize(be):
    rng = np.random.default_rng(60)
    mism = 0
    for _ in range(6):
        scale, zp = F32(_log_uniform(rng, 1e-3, 10)), int(rng.integers(0, 256))
        k = np.arange(-300, 300, dtype=np.float64)
        mid = ((k + 0.5 - zp) * np.float64(scale)).astype(F32)  # near every code's half-way point
        pts = [mid, np.nextafter(mid, F32(np.inf)), np.nextafter(mid, F32(-np.inf)),
               (rng.standard_normal(5000) * 300 * scale).astype(F32),
               np.array([np.nan, np.inf, -np.inf, 3e38, -3e38, 1e-45, -1e-45, 0.0, -0.0], F32)]
        x = np.concatenate(pts)
        want = g.gpu_quantize(x, scale=scale, zero_point=zp)
        mism += _mismatch(be.quantize(x, scale=scale, zero_point=zp), want)
        codes = np.arange(256, dtype=np.uint8)
        mism += _mismatch(be.dequantize(codes, scale=scale, zero_point=zp),
                          g.gpu_dequantize(codes, scale=scale, zero_point=zp))
        mism += _mismatch(be.dequantize_half(codes, scale=scale, zero_point=zp),
                          g.gpu_dequantize_half(codes, scale=scale, zero_point=zp))
        with np.errstate(over="ignore"):
            h = x.astype(np.float16)
        mism += _mismatch(be.quantize_half(h, scale=scale, zero_point=zp),
                          g.gpu_quantize_half(h, scale=scale, zero_point=zp))
    assert mism == 0
    assert g.gpu_quantize(np.array([0.5, 1.5, 2.5, -0.5, np.nan, np.inf, 1e9], F32),
                          scale=1.0, zero_point=0).tolist() == [0, 2, 2, 0, 0, 255, 255]


def _pool_ref(x, kernel, strides, pads, average: bool, ties: list | None = None):
    """Scalar pooling: max of the in-bounds codes, or the exact mean rounded half to even (Fraction).

    ``ties`` collects the exact means that lie on a .5.
    """
    (kh, kw), (sh, sw), (t, l, b, r) = kernel, strides, pads
    n, h, w, c = x.shape
    oh, ow = (h + t + b - kh) // sh + 1, (w + l + r - kw) // sw + 1
    out = np.zeros((n, oh, ow, c), dtype=np.uint8)
    for bn in range(n):
        for y in range(oh):
            for xx in range(ow):
                for ci in range(c):
                    vals = [int(x[bn, i, j, ci]) for i in range(y * sh - t, y * sh - t + kh) if 0 <= i < h
                            for j in range(xx * sw - l, xx * sw - l + kw) if 0 <= j < w]
                    mean = Fraction(sum(vals), len(vals))
                    out[bn, y, xx, ci] = round(mean) if average else max(vals)
                    if ties is not None and average and mean.denominator == 2:
                        ties.append(mean)
    return out


def test_pooling(be):
    rng = np.random.default_rng(70)
    mism, ties = 0, []
    for i in range(30):
        kh, kw = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        h, w = int(rng.integers(kh, 12)), int(rng.integers(kw, 12))
        pads = (int(rng.integers(0, kh)), int(rng.integers(0, kw)), int(rng.integers(0, kh)), int(rng.integers(0, kw)))
        hi = 2 if i % 3 == 0 else 256  # codes {0, 1}: many exact .5 means
        x = rng.integers(0, hi, (int(rng.integers(1, 3)), h, w, int(rng.integers(1, 6))), dtype=np.uint8)
        kwargs = dict(kernel=(kh, kw), strides=(int(rng.integers(1, 4)), int(rng.integers(1, 4))), pads=pads)
        mx, avg = g.gpu_max_pool(x, **kwargs), g.gpu_avg_pool(x, **kwargs)
        mism += _mismatch(be.max_pool(x, **kwargs), mx) + _mismatch(be.avg_pool(x, **kwargs), avg)
        # independent scalar oracle: with fewer than 2^16 taps, f32(sum / n) lands on a .5 only when
        # the exact mean is one, so rint(f32(sum / n)) is the exact mean rounded half to even
        mism += _mismatch(_pool_ref(x, **kwargs, average=False), mx)
        mism += _mismatch(_pool_ref(x, **kwargs, average=True, ties=ties), avg)
    for shape in [(1, 7, 7, 8), (2, 16, 16, 3), (1, 1, 1, 4), (1, 20, 20, 2)]:
        x = rng.integers(0, 256, shape, dtype=np.uint8)
        want = g.gpu_global_avg_pool(x)
        mism += _mismatch(be.global_avg_pool(x), want)
        mism += _mismatch(_pool_ref(x, (shape[1], shape[2]), (1, 1), (0, 0, 0, 0), True), want)
    assert mism == 0 and len(ties) > 100
    # pinned: means 1.5 -> 2, 0.5 -> 0, 2.5 -> 2 (half to even); padding is not counted
    x = np.array([1, 2, 0, 1, 2, 3], dtype=np.uint8).reshape(1, 1, 6, 1)
    assert g.gpu_avg_pool(x, kernel=(1, 2), strides=(1, 2)).reshape(-1).tolist() == [2, 0, 2]
    assert g.gpu_avg_pool(x, kernel=(1, 2), strides=(1, 2), pads=(0, 1, 0, 0)).reshape(-1).tolist() == [1, 1, 2]


def test_avg_pool_divides(be):
    """Every window sum s in [0, 255 n] for window sizes n where f32(s) * f32(1/n) would round differently."""
    mism, ties = 0, 0
    for kh, kw in [(2, 7), (2, 13), (5, 6), (6, 10)]:
        n = kh * kw
        s = np.arange(255 * n + 1)
        x = (s[None, :] // n + (np.arange(n)[:, None] < s[None, :] % n)).astype(np.uint8)  # n taps summing to s
        x = np.ascontiguousarray(x.reshape(1, kh, kw, s.size))
        want = g.gpu_global_avg_pool(x)
        mism += _mismatch(be.global_avg_pool(x), want)
        exact = [round(Fraction(int(v), n)) for v in s]  # half to even
        mism += int(np.sum(want.reshape(-1) != np.array(exact)))
        ties += sum(Fraction(int(v), n).denominator == 2 for v in s)
        recip = np.rint(s.astype(F32) * (F32(1) / F32(n)))
        assert np.sum(recip != want.reshape(-1)) > 0  # a reciprocal multiply would be caught
    assert mism == 0 and ties > 100


# ----------------------------------------------------------------------------
# float path: half storage, float32 arithmetic


def test_exp_f32_is_within_2ulp():
    x = np.concatenate([np.linspace(-86, 88, 400_001, dtype=F32),
                        np.array([0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5], F32)])
    y = g.gpu_exp_f32(x)
    ref = np.exp(x.astype(np.float64))
    ulp = np.spacing(ref.astype(F32)).astype(np.float64)
    assert np.max(np.abs(y.astype(np.float64) - ref) / ulp) <= 2.0
    sp = g.gpu_exp_f32(np.array([np.nan, np.inf, -np.inf, 88.5, -86.5, 1000, -1000], F32))
    assert np.isnan(sp[0]) and sp[1:].tolist() == [np.inf, 0.0, np.inf, 0.0, np.inf, 0.0]


def test_exp_f32_kernel_bit_for_bit(be):
    rng = np.random.default_rng(75)
    x = np.concatenate([np.linspace(-90, 90, 200_001, dtype=F32), (rng.standard_normal(100_000) * 30).astype(F32),
                        np.array([np.nan, np.inf, -np.inf, 88.0, -86.0, 1e-40, -0.0], F32)])
    assert _mismatch(be.exp_f32(x), g.gpu_exp_f32(x)) == 0


def test_float_softmax(be):
    rng = np.random.default_rng(80)
    mism = 0
    for depth, rows, s_in in [(10, 50, 0.1), (1, 7, 0.5), (32, 20, 0.01), (1000, 6, 0.05), (5, 40, 1.0), (64, 8, 3.0)]:
        x = rng.integers(0, 256, (rows, depth), dtype=np.uint8)
        q = dict(in_scale=s_in, in_zp=int(rng.integers(0, 256)), out_scale=1 / 256, out_zp=0)
        mism += _mismatch(be.float_softmax(x, **q), g.gpu_float_softmax(x, **q))
    # half in/out directly; at depth 1000 the float32 summation order shows in ~1 of 2000 halves
    for shape, sd in [((3, 4, 5, 33), 8.0), ((100, 1000), 2.0)]:
        h = (rng.standard_normal(shape) * sd).astype(np.float16)
        mism += _mismatch(be.half_softmax(h), g.gpu_half_softmax(h))
    assert mism == 0


def test_float_activations_every_code(be):
    rng = np.random.default_rng(90)
    codes = np.arange(256, dtype=np.uint8).reshape(1, 4, 64, 1)
    mism = 0
    for kind, ab in [(g.GpuActivation.SIGMOID, {}), (g.GpuActivation.HARD_SWISH, {}),
                     (g.GpuActivation.HARD_SIGMOID, {}), (g.GpuActivation.HARD_SIGMOID, dict(alpha=1 / 6, beta=0.5))]:
        for _ in range(5):
            q = dict(in_scale=_log_uniform(rng, 1e-3, 0.5), in_zp=int(rng.integers(0, 256)),
                     out_scale=_log_uniform(rng, 1e-3, 0.1), out_zp=int(rng.integers(0, 256)))
            want = g.gpu_float_activation(codes, kind=kind, **ab, **q)
            mism += _mismatch(be.float_activation(codes, kind=kind, **ab, **q), want)
        every_half = np.arange(65536, dtype=np.uint16).view(np.float16)  # the whole input domain
        mism += _mismatch(be.half_activation(every_half, kind=kind, **ab),
                          g.gpu_half_activation(every_half, kind=kind, **ab))
    assert mism == 0
    h = np.array([0.0, 3.0, -3.0, -4.0, 1e4], np.float16)
    assert g.gpu_half_activation(h, kind=g.GpuActivation.SIGMOID)[0] == 0.5
    assert g.gpu_half_activation(h, kind=g.GpuActivation.HARD_SWISH).tolist() == [0.0, 3.0, -0.0, -0.0, 1e4]
    assert g.gpu_half_activation(h, kind=g.GpuActivation.HARD_SIGMOID).tolist() == [0.5, 1.0, 0.0, 0.0, 1.0]


def test_float_mul_all_pairs(be):
    a, b = _all_pairs()
    rng = np.random.default_rng(100)
    mism = 0
    configs = [dict(a_scale=0.05, a_zp=128, b_scale=0.02, b_zp=0, out_scale=0.1, out_zp=10),
               dict(a_scale=3.0, a_zp=0, b_scale=2.0, b_zp=0, out_scale=300.0, out_zp=0)]  # products overflow half
    configs += [dict(a_scale=_log_uniform(rng, 1e-3, 1), a_zp=int(rng.integers(0, 256)),
                     b_scale=_log_uniform(rng, 1e-3, 1), b_zp=int(rng.integers(0, 256)),
                     out_scale=_log_uniform(rng, 1e-4, 1), out_zp=int(rng.integers(0, 256))) for _ in range(2)]
    for cfg in configs:
        mism += _mismatch(be.float_mul(a, b, **cfg), g.gpu_float_mul(a, b, **cfg))
    xa = rng.integers(0, 256, (1, 3, 4, 6), dtype=np.uint8)
    xb = rng.integers(0, 256, (1, 1, 1, 6), dtype=np.uint8)
    mism += _mismatch(be.float_mul(xa, xb, **configs[0]), g.gpu_float_mul(xa, xb, **configs[0]))
    assert mism == 0
    assert np.isinf(g.gpu_half_mul(np.array([300.0], np.float16), np.array([300.0], np.float16))[0])


def test_float_resize_bilinear(be):
    rng = np.random.default_rng(110)
    mism = 0
    for i in range(24):
        ac, hp = [(False, False), (True, False), (False, True)][i % 3]
        n, h, w, c = int(rng.integers(1, 3)), int(rng.integers(1, 9)), int(rng.integers(1, 9)), int(rng.integers(1, 5))
        out_hw = (int(rng.integers(1, 17)), int(rng.integers(1, 17)))
        x = rng.integers(0, 256, (n, h, w, c), dtype=np.uint8)
        q = dict(in_scale=_log_uniform(rng, 1e-3, 1), in_zp=int(rng.integers(0, 256)),
                 out_scale=_log_uniform(rng, 1e-3, 1), out_zp=int(rng.integers(0, 256)))
        kw = dict(out_hw=out_hw, align_corners=ac, half_pixel_centers=hp)
        mism += _mismatch(be.float_resize_bilinear(x, **kw, **q), g.gpu_float_resize_bilinear(x, **kw, **q))
    assert mism == 0
    # half in/out directly on ~130k outputs: an FMA in the interpolation shows in ~1 of 4000 halves
    h = (rng.standard_normal((1, 40, 52, 8)) * 50).astype(np.float16)
    for ac, hp in [(False, False), (True, False), (False, True)]:
        kw = dict(out_hw=(77, 101), align_corners=ac, half_pixel_centers=hp)
        mism += _mismatch(be.half_resize_bilinear(h, **kw), g.gpu_half_resize_bilinear(h, **kw))
    assert mism == 0
    # pinned: 2x upsampling of [0, 1] (half pixel): coordinates 0, 0.25, 0.75, 1 -> 0, 0.25, 0.75, 1
    h = np.array([0.0, 1.0], np.float16).reshape(1, 1, 2, 1)
    out = g.gpu_half_resize_bilinear(h, out_hw=(1, 4), half_pixel_centers=True)
    assert out.reshape(-1).tolist() == [0.0, 0.25, 0.75, 1.0]


# ----------------------------------------------------------------------------
# sources and errors


def test_every_cl_file_disables_fp_contraction():
    for name in ["common.cl", "conv.cl", "eltwise.cl", "pool.cl", "quantize.cl", "float_ops.cl"]:
        assert "#pragma OPENCL FP_CONTRACT OFF" in kernel_source(name), name


def test_errors_are_maceq_errors():
    with pytest.raises(MaceqError, match="no OpenCL device"):
        OpenCLBackend(device="no-such-device-xyz").device_name
    x = np.zeros((1, 2, 2, 1), np.uint8)
    with pytest.raises(MaceqError, match="int8"):
        g.gpu_conv2d(x, np.zeros((1, 1, 1, 1), np.uint8), x_zp=0, out_zp=0, scale_c=np.ones(1, F32))
    with pytest.raises(MaceqError, match="scale_c"):
        g.gpu_conv2d(x, np.zeros((1, 1, 1, 1), np.int8), x_zp=0, out_zp=0, scale_c=np.ones(1))
    bad = np.array([np.inf], F32)
    for _ in range(2):  # the check is kept per scale array: the second call refuses it too
        with pytest.raises(MaceqError, match="finite and >= 0"):
            g.gpu_conv2d(x, np.zeros((1, 1, 1, 1), np.int8), x_zp=0, out_zp=0, scale_c=bad)
    with pytest.raises(MaceqError, match="finite and >= 0"):
        g.gpu_conv2d(x, np.zeros((1, 1, 1, 1), np.int8), x_zp=0, out_zp=0, scale_c=np.array([-1.0], F32))
    with pytest.raises(MaceqError, match="smaller than the kernel"):
        g.gpu_max_pool(x, kernel=(2, 2), strides=(1, 1), pads=(2, 0, 0, 0))
    with pytest.raises(MaceqError, match="alpha"):
        g.gpu_half_activation(np.zeros(2, np.float16), kind=g.GpuActivation.SIGMOID, alpha=0.1)


@pytest.mark.unit
def test_gpu_plan_keeps_one_call_per_input_shape(monkeypatch):
    """A model's convolution (runtime/ops_gpu.py GpuConvPlan.run on the simulation) checks and converts its arguments
    on its first run with an input shape and reuses them: every later input of that shape gives the scalar
    reference's codes, other weights or another shape make a new call, and the FullyConnected's weights reshaped on
    every run count as the same weights."""
    from maceq.runtime import ops_gpu

    rng = np.random.default_rng(41)
    made = []
    for kind in ("conv2d", "depthwise_conv2d", "fully_connected"):
        real = getattr(g, f"gpu_{kind}_call")
        monkeypatch.setattr(g, f"gpu_{kind}_call", lambda *a, _real=real, _kind=kind, **k: made.append(_kind)
                            or _real(*a, **k))
    o = 6
    w = rng.integers(-128, 128, (o, 3, 3, 8), dtype=np.int8)
    bias = rng.integers(-3000, 3000, o).astype(np.int32)
    scale = g.gpu_requant_scales(F32(0.02), rng.uniform(1e-3, 1e-2, o).astype(F32), F32(0.05))
    plan = ops_gpu.GpuConvPlan(ops_gpu.NUMPY, scale)
    kw = dict(x_zp=9, out_zp=120, strides=(1, 2), pads=(1, 1, 1, 0), dilations=(1, 1))
    for shape in [(1, 5, 7, 8), (1, 5, 7, 8), (1, 5, 7, 8), (2, 4, 6, 8)]:
        x = rng.integers(0, 256, shape, dtype=np.uint8)
        assert np.array_equal(plan.run("conv2d", x, w, bias, **kw), g.gpu_conv2d_ref(x, w, bias, scale_c=scale, **kw))
    assert made == ["conv2d", "conv2d"]
    w2 = w.copy()
    w2[0, 0, 0, 0] ^= 1
    assert np.array_equal(plan.run("conv2d", x, w2, bias, **kw), g.gpu_conv2d_ref(x, w2, bias, scale_c=scale, **kw))
    assert made == ["conv2d"] * 3
    with pytest.raises(MaceqError, match="made for uint8 input"):
        plan.calls[x.shape][-1](x[:1])
    wd = rng.integers(-128, 128, (3, 3, o, 1), dtype=np.int8)
    dplan = ops_gpu.GpuConvPlan(ops_gpu.NUMPY, scale)
    for _ in range(2):
        x = rng.integers(0, 256, (1, 5, 7, o), dtype=np.uint8)
        assert np.array_equal(dplan.run("depthwise_conv2d", x, wd, bias, **kw),
                              g.gpu_depthwise_conv2d_ref(x, wd, bias, scale_c=scale, **kw))
    wf = rng.integers(-128, 128, (o, 2, 2, 8), dtype=np.int8)
    fplan = ops_gpu.GpuConvPlan(ops_gpu.NUMPY, scale)
    for _ in range(3):
        x = rng.integers(0, 256, (2, 32), dtype=np.uint8)
        assert np.array_equal(fplan.run("fully_connected", x, wf.reshape(o, -1), bias, x_zp=3, out_zp=7),
                              g.gpu_fully_connected_ref(x, wf.reshape(o, -1), bias, x_zp=3, out_zp=7, scale_c=scale))
    assert made[3:] == ["depthwise_conv2d", "fully_connected"]
