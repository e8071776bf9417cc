"""MACE's NEON float kernels (the cpu device): vectorised models against scalar transcriptions and golden data.

Oracles:
- Golden data from a real MACE build (../shared/data/mace_arm, README section D3): the fp32 3x3
  stride-2 depthwise of mobilenet_v2_fp32 (float taps of 2 images) and the whole model on its 3
  stored inputs. Acceptance: 0 differing float32 values (bit patterns).
- Scalar transcriptions of MACE's C++ loops (``*_neon_ref`` in runtime/kernels/float_ops.py and
  the small loops below), with fused steps from the exact rational ``cfloat.fmaf_exact``.
  Acceptance: bit-equal.
"""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from maceq.mace.enums import ReduceType
from maceq.runtime import load
from maceq.runtime.kernels import cfloat
from maceq.runtime.kernels import float_ops as K
from maceq.runtime.kernels.cfloat import fmaf_exact
from maceq.runtime.model import QTensor

F32 = np.float32
RNG = np.random.default_rng(20250301)
DW_IN = "/features/features.2/conv/conv.0/conv.0.2/Clip_output_0"
DW_OUT = "/features/features.2/conv/conv.1/conv.1.2/Clip_output_0"


def bits_differ(a: np.ndarray, b: np.ndarray) -> int:
    a, b = np.ascontiguousarray(a, F32), np.ascontiguousarray(b, F32)
    assert a.shape == b.shape, (a.shape, b.shape)
    return int(np.count_nonzero(a.view(np.uint32) != b.view(np.uint32)))


def randn(*shape, s=1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * s).astype(F32)


# ------------------------------------------------------------------------------------------------
# C float steps
# ------------------------------------------------------------------------------------------------

@pytest.mark.unit
def test_f32_rounds_floats_as_numpy_does():
    # the struct cast of a Python float against numpy's float32 conversion: random doubles of every magnitude,
    # halfway points between neighbouring floats (ties to even), subnormals, the overflow threshold, specials
    f32max = float(np.finfo(np.float32).max)
    ulp_top = 2.0 ** 104  # the spacing of float32 at its largest binade
    ties = [float(np.float32(v)) + float(np.spacing(np.float32(v))) / 2 for v in RNG.uniform(-1e3, 1e3, 2000)]
    vals = np.concatenate([RNG.standard_normal(20_000) * 10.0 ** RNG.integers(-50, 50, 20_000),
                           RNG.integers(0, 2 ** 64, 20_000, dtype=np.uint64).view(np.float64), ties,
                           [f32max, f32max + ulp_top / 2, f32max + ulp_top / 2 * (1 - 2 ** -30), -f32max - ulp_top,
                            1e-45, 7e-46, 2 ** -150, 2 ** -149 * 1.5, 0.0, -0.0, np.inf, -np.inf, 1e300, -1e300]])
    with np.errstate(over="ignore", invalid="ignore"):
        want = vals.astype(np.float32)
    got = np.array([cfloat.f32(float(v)) for v in vals], dtype=np.float64)
    same = (got == want.astype(np.float64)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), vals[~same][:5]
    assert np.array_equal(np.signbit(got), np.signbit(want))
    assert cfloat.f32(f32max + ulp_top / 2) == np.inf and cfloat.f32(-f32max - ulp_top) == -np.inf
    assert cfloat.f32(16777217) == 16777216.0 and cfloat.f32(np.float64(0.1)) == float(np.float32(0.1))


def test_fmaf_is_the_exactly_rounded_fused_multiply_add():
    a, b = randn(4000), randn(4000)
    c = randn(4000) * RNG.choice(np.array([1e-9, 1.0, 1e9], F32), 4000)
    c[:1000] = -(a[:1000].astype(np.float64) * b[:1000]).astype(F32)  # cancellation: the low bits of a*b
    c[1000:1100] = 0.0
    a[1100:1200] = (1 + randn(100, s=0.3)) * F32(2.0 ** -70)
    b[1100:1200] = (1 + randn(100, s=0.3)) * F32(2.0 ** -70)  # products in the float32 subnormal range
    c[1100:1150] = 0.0
    c[1150:1200] = randn(50) * F32(2.0 ** -140)
    want = np.array([fmaf_exact(float(x), float(y), float(z)) for x, y, z in zip(a, b, c)], F32)
    assert bits_differ(cfloat.fmaf(a, b, c), want) == 0
    assert bits_differ(cfloat.fmaf(a, b, c), a * b + c) > 0  # fused differs from mul-then-add


def test_fmaf_broadcasts_and_propagates_specials():
    got = cfloat.fmaf(np.array([[1.5], [2.0]], F32), np.array([2.0, 3.0], F32), F32(0.25))
    assert got.shape == (2, 2) and got.dtype == F32
    assert np.isinf(cfloat.fmaf(F32(np.inf), F32(1), F32(1)))
    assert np.isnan(cfloat.fmaf(F32(np.inf), F32(0), F32(1)))
    assert cfloat.fmaf(F32(-0.0), F32(1.0), F32(0.0)).view(np.uint32) == 0  # -0 + +0 = +0


def test_compiled_fma_equals_fmaf():
    from numba import njit

    @njit
    def run(a, b, c, out):
        for i in range(a.size):
            out[i] = cfloat.fma32(a[i], b[i], c[i])

    a, b = randn(20000), randn(20000)
    c = -(a.astype(np.float64) * b).astype(F32)  # the exact low bits of a*b decide
    c[::3] = randn(len(c[::3]), s=1e3)
    out = np.empty_like(a)
    run(a, b, c, out)
    assert bits_differ(out, cfloat.fmaf(a, b, c)) == 0


def test_horizontal_adds_associate_as_the_instructions_do():
    v = np.array([1.0, 2.0 ** -24, 2.0 ** -24, -1.0], F32)
    assert cfloat.hadd4(v) == F32(2.0 ** -24)       # (1 + e) + (e - 1): 1 + (e - 1), e - 1 exact
    assert cfloat.hsum4_seq(v) == F32(0.0)          # ((1 + e) + e) - 1: each e is lost (tie to even)
    w = np.array([2.0 ** -24, 2.0 ** -24, 1.0, -1.0], F32)
    assert cfloat.hadd4(w) == F32(2.0 ** -23)
    assert cfloat.hsum4_seq(w) == F32(2.0 ** -23)
    u = np.array([1.0, -1.0, 2.0 ** -24, 2.0 ** -24], F32)
    assert cfloat.hsum4_seq(u) == F32(2.0 ** -23)


def test_libm_functions_are_correctly_rounded():
    x = randn(20000, s=6.0)
    for fn, ref in ((cfloat.expf, np.exp), (cfloat.tanhf, np.tanh)):
        assert bits_differ(fn(x), ref(x.astype(np.float64)).astype(F32)) == 0
    y = np.abs(x) + F32(1)
    assert bits_differ(cfloat.logf(y), np.log(y.astype(np.float64)).astype(F32)) == 0
    assert bits_differ(cfloat.expf(x), np.exp(x)) > 0  # numpy's float32 exp is not correctly rounded


# ------------------------------------------------------------------------------------------------
# 3x3 depthwise (DepthwiseConv2dK3x3S1/S2, D3)
# ------------------------------------------------------------------------------------------------

def test_neon_region_of_the_golden_layer():
    """README D3: 112x112 -> 56x56, stride 2, padding_values [2, 2]: NEON rows 1..54, cols 1..52."""
    assert K.neon_valid_region((56, 56), (2, 2), (2, 2)) == (1, 55, 1, 55)
    mask = K.depthwise3x3_neon_mask((56, 56), (2, 2), 2)
    rows, cols = np.nonzero(mask.any(axis=1))[0], np.nonzero(mask.any(axis=0))[0]
    assert (rows[0], rows[-1], cols[0], cols[-1]) == (1, 54, 1, 52)
    assert mask.sum() == 54 * 52


def test_neon_region_stride1_row_pairs():
    # 9 valid rows: 4 pairs on NEON, the 9th goes to the scalar bottom loop; 7 valid columns: one block
    mask = K.depthwise3x3_neon_mask((11, 9), (2, 2), 1)
    assert K.neon_valid_region((11, 9), (2, 2), (1, 1)) == (1, 10, 1, 8)
    assert list(np.nonzero(mask.any(axis=1))[0]) == list(range(1, 9))
    assert list(np.nonzero(mask.any(axis=0))[0]) == [1, 2, 3, 4]


DW_CASES = [c for c in itertools.product((1, 2), ((0, 0), (2, 2), (1, 3), (4, 1)), ((6, 9), (7, 12), (13, 5)),
                                         ((1, 1), (3, 2), (8, 1)))]


@pytest.mark.parametrize("stride,pad_total,hw,cm", DW_CASES[::3] + DW_CASES[1::7])
def test_depthwise3x3_vectorised_equals_scalar_reference(stride, pad_total, hw, cm):
    c, mult = cm
    x = randn(2, c, *hw)
    w = randn(mult, c, 3, 3, s=0.7)
    bias = randn(c * mult, s=0.3)
    top, left = pad_total[0] >> 1, pad_total[1] >> 1
    pads = (top, left, pad_total[0] - top, pad_total[1] - left)
    want = K.depthwise3x3_neon_ref(x, w, bias, stride=stride, pad_total=pad_total)
    got = K.depthwise_conv2d_neon(x, w, bias, strides=(stride, stride), pads=pads, dilations=(1, 1))
    assert bits_differ(got, want) == 0


def test_depthwise3x3_without_bias_and_fused_border_difference():
    x, w = randn(1, 4, 10, 16), randn(1, 4, 3, 3)
    want = K.depthwise3x3_neon_ref(x, w, None, stride=1, pad_total=(2, 2))
    got = K.depthwise_conv2d_neon(x, w, None, strides=(1, 1), pads=(1, 1, 1, 1), dilations=(1, 1))
    assert bits_differ(got, want) == 0
    plain = K.depthwise_conv2d(x, w, None, strides=(1, 1), pads=(1, 1, 1, 1), dilations=(1, 1))
    assert bits_differ(got, plain) > 0  # the FMA interior is not the plain float32 sum


def _depthwise_ref_loops(x, w, strides, pads, dil):
    """ref::DepthwiseConv2d<float>: per output ``sum += in * filter`` over the in-input taps."""
    n, c, h, wd = x.shape
    mult, _, kh, kw = w.shape
    oh = (h + pads[0] + pads[2] - (kh - 1) * dil[0] - 1) // strides[0] + 1
    ow = (wd + pads[1] + pads[3] - (kw - 1) * dil[1] - 1) // strides[1] + 1
    out = np.zeros((n, c * mult, oh, ow), F32)
    for b, ch, m, y, xx in np.ndindex(n, c, mult, oh, ow):
        s = F32(0)
        for i, j in np.ndindex(kh, kw):
            iy, ix = y * strides[0] - pads[0] + i * dil[0], xx * strides[1] - pads[1] + j * dil[1]
            if 0 <= iy < h and 0 <= ix < wd:
                s = F32(s + F32(x[b, ch, iy, ix] * w[m, ch, i, j]))
        out[b, ch * mult + m, y, xx] = s
    return out


@pytest.mark.parametrize("k,strides,pads,dil", [((3, 3), (1, 2), (1, 1, 1, 1), (1, 1)), ((5, 5), (1, 1), (2, 2, 2, 2), (1, 1)),
                                                ((3, 3), (1, 1), (2, 2, 2, 2), (2, 2)), ((3, 3), (3, 3), (1, 0, 2, 1), (1, 1)),
                                                ((1, 3), (2, 1), (0, 1, 0, 1), (1, 1))])
def test_depthwise_general_shapes_follow_the_reference_kernel(k, strides, pads, dil):
    x, w = randn(1, 3, 9, 11), randn(2, 3, *k)
    got = K.depthwise_conv2d_neon(x, w, None, strides=strides, pads=pads, dilations=dil)
    assert bits_differ(got, _depthwise_ref_loops(x, w, strides, pads, dil)) == 0


# ------------------------------------------------------------------------------------------------
# Golden data: mobilenet_v2_fp32 (README D3)
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mbv2_fp32(shared_data):
    root = shared_data / "mace_arm"
    model = load(root / "models" / "mobilenet_v2_fp32" / "mobilenet_v2.yml")
    taps = np.load(root / "taps" / "mobilenet_v2_fp32_taps.npz")
    meta = {t["tensor"]: t for t in json.loads((root / "taps" / "mobilenet_v2_fp32_taps.json").read_text())["taps"]}
    return model, taps, meta, root


def _dequantized_tap(taps, meta, name: str, i: int) -> np.ndarray:
    scale, zp = meta[name]["scale_per_image"][i], meta[name]["zero_point_per_image"][i]
    return (F32(scale) * (taps[name][i:i + 1].astype(np.int32) - zp)).astype(F32)


def _float_segment(model, x: np.ndarray, device: str) -> np.ndarray:
    """The Transpose -> DepthwiseConv2d (float, RELUX 6) -> Transpose ops of features.2, run one by one."""
    ops = [op for op in model.ops if op.name.startswith(DW_OUT.replace("_output_0", "")) and op.arg("T") == 1
           and op.type in ("Transpose", "DepthwiseConv2d")]
    assert [op.type for op in ops] == ["Transpose", "DepthwiseConv2d", "Transpose"]
    t = QTensor(x, None)
    for op in ops:
        t = model.run_op(op, [t], device=device)[0]
    return t.values


def test_golden_fp32_depthwise_taps_bit_exact(mbv2_fp32):
    model, taps, meta, _ = mbv2_fp32
    for i in range(2):
        x = _dequantized_tap(taps, meta, DW_IN, i)
        want = taps[DW_OUT][i:i + 1]
        assert bits_differ(_float_segment(model, x, "cpu"), want) == 0
        # the plain float32 order (kept for the gpu's float path) is not what MACE's CPU computes
        assert bits_differ(_float_segment(model, x, "gpu"), want) > 10000


def test_golden_mobilenet_v2_fp32_whole_model(mbv2_fp32):
    """All 3 stored images: logits bit-identical; for the 2 tapped images also every tapped tensor."""
    model, taps, meta, root = mbv2_fp32
    inputs = np.load(root / "models" / "mobilenet_v2_fp32" / "inputs.npy")
    outputs = np.load(root / "models" / "mobilenet_v2_fp32" / "mace_outputs.npy")
    name, out_name = model.input_names[0], model.output_names[0]
    for k in range(len(inputs)):
        res = model.run({name: inputs[k:k + 1]}, device="cpu", intermediates=True)
        got = res.outputs[out_name]
        assert bits_differ(got, outputs[k:k + 1].reshape(got.shape)) == 0, f"image {k}"
        if k not in (0, 2):
            continue
        i = 0 if k == 0 else 1
        for tensor in taps.files:
            want = taps[tensor][i:i + 1]
            have = res.tensors[tensor].values.reshape(want.shape)
            if want.dtype == F32:
                assert bits_differ(have, want) == 0, tensor
            else:
                assert np.array_equal(have, want), tensor


# ------------------------------------------------------------------------------------------------
# Conv2D (direct / Gemm kernels), Gemm, Gemv, MatMul, FullyConnected
# ------------------------------------------------------------------------------------------------

def test_conv_kernel_choice_follows_conv_2d_cc():
    CK = K.ConvKernel
    table = [((1, 1), (1, 1), (1, 1), 3, 3, CK.K1X1), ((1, 1), (2, 2), (1, 1), 3, 3, CK.GENERAL),
             ((3, 3), (1, 1), (1, 1), 8, 8, CK.WINOGRAD), ((3, 3), (1, 1), (1, 1), 8, 7, CK.K3X3S1),
             ((3, 3), (1, 1), (1, 1), 7, 16, CK.K3X3S1), ((3, 3), (2, 2), (1, 1), 32, 32, CK.K3X3S2),
             ((3, 3), (1, 1), (2, 2), 32, 32, CK.GENERAL), ((5, 5), (1, 1), (1, 1), 4, 4, CK.K5X5S1),
             ((7, 7), (3, 3), (1, 1), 4, 4, CK.K7X7), ((7, 1), (1, 1), (1, 1), 4, 4, CK.K1X7_7X1),
             ((1, 15), (1, 1), (1, 1), 4, 4, CK.K1X15_15X1), ((3, 3), (1, 2), (1, 1), 4, 4, CK.GENERAL)]
    for k, s, d, cin, cout, want in table:
        assert K.conv2d_neon_kernel(k, s, d, cin, cout) is want, (k, s, d, cin, cout)
    assert {k for k in CK if k.fused} == {CK.K1X1, CK.K3X3S1, CK.K3X3S2, CK.K7X7, CK.K1X7_7X1}


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("k,strides,pads,dil", [((1, 1), (1, 1), (0, 0, 0, 0), (1, 1)), ((3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),
                                                ((3, 3), (1, 1), (0, 1, 1, 2), (2, 1)), ((2, 3), (1, 2), (1, 0, 1, 1), (1, 1))])
def test_conv_chain_vectorised_equals_scalar(fused, k, strides, pads, dil, loops):
    x, w = randn(2, 3, 7, 8), randn(4, 3, *k)
    want = K.conv2d_chain_ref(x, w, strides=strides, pads=pads, dilations=dil, fused=fused)
    got = K.conv2d_chain(x, w, strides=strides, pads=pads, dilations=dil, fused=fused)
    assert bits_differ(got, want) == 0


def test_conv2d_neon_adds_the_bias_after_the_sum_and_keeps_winograd_plain():
    x, w, b = randn(1, 4, 9, 9), randn(5, 4, 3, 3), randn(5)
    got = K.conv2d_neon(x, w, b, strides=(2, 2), pads=(1, 1, 1, 1), dilations=(1, 1))
    chain = K.conv2d_chain(x, w, strides=(2, 2), pads=(1, 1, 1, 1), dilations=(1, 1), fused=True)
    assert bits_differ(got, chain + b.reshape(1, -1, 1, 1)) == 0
    x8, w8 = randn(1, 8, 6, 6), randn(8, 8, 3, 3)
    plain = K.conv2d(x8, w8, None, strides=(1, 1), pads=(1, 1, 1, 1), dilations=(1, 1))
    assert bits_differ(K.conv2d_neon(x8, w8, None, strides=(1, 1), pads=(1, 1, 1, 1), dilations=(1, 1)), plain) == 0


def _gemv_loops(lhs, rhs, bias):
    """Gemv<float>::Compute (aarch64) for one rhs vector, transcribed: lanes, vaddq, vaddvq, leftovers."""
    h, k = lhs.shape
    out = np.zeros(h, F32)
    for r in range(h):
        s = F32(bias[r]) if bias is not None else F32(0)
        if k // 8:
            vo0, vo0n = np.zeros(4, F32), np.zeros(4, F32)
            for blk in range(k // 8):
                for j in range(4):
                    vo0[j] = F32(vo0[j] + F32(lhs[r, 8 * blk + j] * rhs[8 * blk + j]))
                    vo0n[j] = F32(vo0n[j] + F32(lhs[r, 8 * blk + 4 + j] * rhs[8 * blk + 4 + j]))
            v = [F32(vo0[j] + vo0n[j]) for j in range(4)]
            s = F32(s + F32(F32(v[0] + v[1]) + F32(v[2] + v[3])))
        for col in range(8 * (k // 8), k):
            s = F32(s + F32(lhs[r, col] * rhs[col]))
        out[r] = s
    return out


@pytest.mark.parametrize("k", [3, 8, 19, 64])
def test_gemv_equals_transcription(k):
    lhs, rhs, bias = randn(6, k), randn(k), randn(6)
    for b in (bias, None):
        assert bits_differ(K.gemv_neon(lhs, rhs, b), _gemv_loops(lhs, rhs, b)) == 0


def test_gemm_is_an_fma_chain_over_depth(loops):
    a, b = randn(3, 2, 13), randn(13, 5)
    want = np.zeros((3, 2, 5), F32)
    for i, r, c in np.ndindex(3, 2, 5):
        acc = F32(0)
        for d in range(13):
            acc = F32(fmaf_exact(float(a[i, r, d]), float(b[d, c]), float(acc)))
        want[i, r, c] = acc
    assert bits_differ(K.gemm_neon(a, b), want) == 0


def test_matmul_dispatch_gemv_or_gemm():
    x, w, bias = randn(1, 20), randn(7, 20), randn(7)
    got = K.matmul_neon(x, w, bias, transpose_a=False, transpose_b=True)          # rows == 1: Gemv
    assert bits_differ(got, _gemv_loops(w, x[0], bias)[None]) == 0
    xb = randn(3, 20)                                                               # rows == 3: Gemm + bias
    got = K.matmul_neon(xb, w, bias, transpose_a=False, transpose_b=True)
    assert bits_differ(got, K.gemm_neon(xb, w.T) + bias) == 0
    a, col = randn(2, 5, 11), randn(11, 1)                                          # cols == 1: Gemv of A
    got = K.matmul_neon(a, col, None, transpose_a=False, transpose_b=False)
    assert bits_differ(got[1, :, 0], _gemv_loops(a[1], col[:, 0], None)) == 0
    fc = K.fully_connected_neon(randn(2, 3, 2, 2), w[:, :12].reshape(7, 3, 2, 2), bias)
    assert fc.shape == (2, 7)


# ------------------------------------------------------------------------------------------------
# Reduce, global average pooling, softmax, activations
# ------------------------------------------------------------------------------------------------

def _reduce_loops(x, kind, axes):
    """ReduceOp<RT_CPU, float>::Reduce{1..4}Dims for SUM/MEAN/PROD, loop for loop (kept groups out)."""
    d, first = K.mace_reduce_groups(x.shape, axes or tuple(range(x.ndim)))  # no axis: reduce all
    g = x.reshape(d)
    if len(d) == 1 and not first:
        return g.copy()
    order = {(1, True): lambda: [[g[i] for i in range(d[0])]],
             (2, True): lambda: [[g[j, i] for j in range(d[0])] for i in range(d[1])],
             (2, False): lambda: [[g[i, j] for j in range(d[1])] for i in range(d[0])],
             (3, True): lambda: [[g[k, i, j] for j in range(d[2]) for k in range(d[0])] for i in range(d[1])],
             (3, False): lambda: [[g[i, k, j] for k in range(d[1])] for i in range(d[0]) for j in range(d[2])],
             (4, True): lambda: [[g[t, i, k, j] for k in range(d[2]) for t in range(d[0])]
                                 for i in range(d[1]) for j in range(d[3])],
             (4, False): lambda: [[g[i, k, j, t] for k in range(d[1]) for t in range(d[3])]
                                  for i in range(d[0]) for j in range(d[2])]}[(len(d), first)]()
    out = []
    for vals in order:
        s = F32(1) if kind is ReduceType.PROD else F32(0)
        for v in vals:
            s = F32(s * v) if kind is ReduceType.PROD else F32(s + v)
        out.append(F32(s / F32(len(vals))) if kind is ReduceType.MEAN else s)
    return np.array(out, F32)


@pytest.mark.parametrize("shape,axes", [((1, 7, 7, 16), (1, 2)), ((2, 5, 6, 3), (0, 2)), ((3, 4, 5, 6), (1, 3)),
                                        ((2, 1, 9, 4), (1, 2)), ((6, 40), (0,)), ((6, 40), (1,)), ((4, 3, 5), ()),
                                        ((2, 3, 4, 5), (0, 2)), ((1, 1, 300), (2,))])
@pytest.mark.parametrize("kind", [ReduceType.SUM, ReduceType.MEAN, ReduceType.PROD])
def test_reduce_follows_mace_loop_order(shape, axes, kind):
    x = randn(*shape, s=3.0) if kind is not ReduceType.PROD else (1 + randn(*shape, s=0.1))
    got = K.reduce_neon(x, kind, axes, keepdims=False)
    assert bits_differ(got.ravel(), _reduce_loops(x, kind, axes)) == 0
    assert K.reduce_neon(x, kind, axes, keepdims=True).ndim == x.ndim


@pytest.mark.parametrize("hw", [(1, 3), (2, 2), (7, 7), (5, 9)])
def test_global_average_pool_four_lanes(hw):
    x = randn(2, 3, *hw, s=5.0)
    n = hw[0] * hw[1]
    want = np.zeros((2, 3), F32)
    for b, c in np.ndindex(2, 3):
        v = x[b, c].ravel()
        res, i = F32(0), 0
        if n >= 4:
            lanes = v[0:4].copy()
            for i in range(4, n - 3, 4):
                lanes = lanes + v[i:i + 4]
            i = 4 * (n // 4)
            res = F32(res + F32(F32(F32(lanes[0] + lanes[1]) + lanes[2]) + lanes[3]))
        for j in range(i, n):
            res = F32(res + v[j])
        want[b, c] = F32(res / F32(n))
    assert bits_differ(K.global_avg_pool_neon(x).reshape(2, 3), want) == 0


@pytest.mark.parametrize("classes", [3, 4, 10, 1000])
def test_softmax_last_axis_four_lanes_and_reciprocal(classes):
    x = randn(2, classes, s=4.0)
    got = K.softmax_neon(x, 1, nchw=False)
    for r in range(2):
        e = cfloat.expf(x[r] - x[r].max())
        lanes, s = None, F32(0)
        blocks = classes // 4
        for blk in range(blocks):
            lanes = e[0:4].copy() if blk == 0 else lanes + e[4 * blk:4 * blk + 4]
        if blocks:
            s = F32(s + cfloat.hsum4_seq(lanes))
        for c in range(4 * blocks, classes):
            s = F32(s + e[c])
        want = np.concatenate([e[:4 * blocks] * (F32(1) / s), e[4 * blocks:] / s])
        assert bits_differ(got[r], want) == 0
    nchw = K.softmax_neon(x.reshape(2, classes, 1, 1), 1, nchw=True).reshape(2, classes)
    e = cfloat.expf(x - x.max(axis=1, keepdims=True))
    seq = np.zeros(2, F32)
    for c in range(classes):
        seq = seq + e[:, c]
    assert bits_differ(nchw, e / seq[:, None]) == 0


def test_activations_use_correctly_rounded_libm_on_request():
    x = randn(5000, s=4.0)
    sig = K.activation(x, K.ActKind.SIGMOID, exact_libm=True)
    assert bits_differ(sig, F32(1) / (F32(1) + cfloat.expf(-x))) == 0
    assert bits_differ(K.activation(x, K.ActKind.TANH, exact_libm=True), cfloat.tanhf(x)) == 0
    elu = K.activation(x, K.ActKind.ELU, coefficient=0.7, exact_libm=True)
    assert bits_differ(elu, np.where(x < 0, (cfloat.expf(x) - F32(1)) * F32(0.7), x)) == 0
    relu6 = K.activation(x, K.ActKind.RELUX, limit=6.0, exact_libm=True)
    assert bits_differ(relu6, K.activation(x, K.ActKind.RELUX, limit=6.0)) == 0
