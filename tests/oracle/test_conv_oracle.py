"""Conv2D / DepthwiseConv2d / FullyConnected kernels against TFLite BUILTIN_REF and MACE transcriptions.

Oracles:
- TFLite's reference CONV_2D / DEPTHWISE_CONV_2D (uint8 per-tensor, int8
  per-channel), run on single-op models from tflite_builder. The kernels get
  the (q, shift) that TFLite itself derives from the float32 scales stored in
  the model (see _tflite_multiplier: uint8 multiplies the scales in float32,
  per-channel in double). This tests the integer pipeline; MACE's float32
  multiplier is tested separately in test_fixedpoint.py.
- MACE's float32 requantizations (q8 Gemv, DepthwiseConv2dGeneral), against
  scalar transcriptions of the C++ written below in plain Python ints and
  numpy float32 scalars.
- The fast paths against the ``*_ref`` loops, bit for bit.
Every comparison requires 0 mismatching elements.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from maceq.runtime.fixedpoint import mace_float_multiplier, quantize_multiplier
from maceq.runtime.kernels.conv import (
    FloatRequant,
    _fmaf,
    conv2d,
    conv2d_ref,
    depthwise_conv2d,
    depthwise_conv2d_ref,
    fully_connected,
    fully_connected_fixed,
    fully_connected_fixed_ref,
    fully_connected_ref,
    mace_pads,
    requantize_float,
    tflite_same_pads,
)
from maceq.tests.oracle.tflite_builder import (
    TensorSpec,
    build_single_op_model,
    fused_activation_range,
    run_ref,
)

ACTS = ["NONE", "RELU", "RELU6"]


# ----------------------------------------------------------------------------- helpers

def _f32(v) -> float:
    return float(np.float32(v))


class Operands:
    """Random operands of one config: data near the zero points, scales sized to the accumulators."""

    def __init__(self, rng, kind: str, x_shape, w_shape, k: int, dtype: str = "uint8",
                 w_symmetric: bool = False):
        """``kind`` picks the multiplier regime: lt1 (< 1, every MACE layer), gt1 (in (1, 16],
        TFLite's left shift; data kept near the zero points so outputs stay in range) or pow2
        (all scales powers of two: M = 2^j exactly, so both rounding steps meet exact ties).
        ``k`` is the reduction length; s_out is chosen so the outputs spread over ~+-40 codes."""
        lo, hi = (0, 255) if dtype == "uint8" else (-128, 127)
        spread = int(rng.choice({"lt1": [6, 40, 255], "gt1": [1, 2, 3], "pow2": [3, 20, 255]}[kind]))
        self.x_zp = int(rng.integers(lo, hi + 1))
        self.w_zp = 0 if w_symmetric else int(rng.integers(lo, hi + 1))
        self.out_zp = int(rng.integers(lo + 64, hi - 63))
        w_lo = -127 if w_symmetric else lo
        self.x = np.clip(self.x_zp + rng.integers(-spread, spread + 1, x_shape), lo, hi).astype(dtype)
        self.w = np.clip(self.w_zp + rng.integers(-spread, spread + 1, w_shape), w_lo, hi).astype(dtype)
        dx = float(np.sqrt(np.mean((self.x.astype(float) - self.x_zp) ** 2))) + 0.5
        dw = float(np.sqrt(np.mean((self.w.astype(float) - self.w_zp) ** 2))) + 0.5
        self.acc_std = float(np.sqrt(max(k, 1)) * dx * dw) + 1.0
        target = 40.0 / self.acc_std * float(np.exp(rng.uniform(-0.7, 0.7)))
        if kind == "pow2":
            a, b = int(rng.integers(3, 9)), int(rng.integers(3, 9))
            j = int(np.clip(np.round(np.log2(target)), -20, 3))
            self.s_in, self.s_w, self.s_out = 2.0 ** -a, 2.0 ** -b, 2.0 ** (-a - b - j)
        else:
            m = min(target, 0.999) if kind == "lt1" else float(np.clip(target, 1.01, 16.0))
            self.s_in = _f32(np.exp(rng.uniform(-6, -2)))
            self.s_w = _f32(np.exp(rng.uniform(-7, -3)))
            self.s_out = _f32(self.s_in * self.s_w / m)

    def bias(self, rng, n: int) -> np.ndarray:
        r = int(2 * self.acc_std) + 1
        return rng.integers(-r, r + 1, n).astype(np.int32)


def _tflite_multiplier(s_in, s_w, s_out, *, per_channel: bool = False) -> tuple[int, int]:
    """The (q, shift) TFLite's conv Prepare derives (tensorflow/lite/kernels/kernel_util.cc).

    uint8 per-tensor: GetQuantizedConvolutionMultipler computes
    ``double(float32(s_in * s_w)) / double(s_out)``: the scale product is a
    float32 multiply. Per-channel (int8): PopulateConvolutionQuantizationParams
    computes ``double(s_in) * double(s_w[c]) / double(s_out)``. The two differ
    in the last bits, which flips outputs near ties.
    """
    a, b, c = np.float32(s_in), np.float32(s_w), np.float32(s_out)
    if per_channel:
        return quantize_multiplier(float(a) * float(b) / float(c))
    return quantize_multiplier(float(np.float32(a * b)) / float(c))


def _bias_scale(s_in, s_w) -> float:
    return float(np.float32(np.float32(s_in) * np.float32(s_w)))


def _rand_u8(rng, shape):
    return rng.integers(0, 256, shape, dtype=np.uint8)


def _pad_choice(rng, h, w, kh, kw, strides, dilations):
    """('SAME'|'VALID'|'EXPLICIT', (top, left, bottom, right))."""
    mode = ["SAME", "VALID", "EXPLICIT"][int(rng.integers(3))]
    if mode == "SAME":
        return mode, tflite_same_pads(h, w, kh, kw, strides=strides, dilations=dilations)
    if mode == "VALID":
        return mode, (0, 0, 0, 0)
    return mode, tuple(int(v) for v in rng.integers(0, 3, 4))


def _fits(h, w, kh, kw, strides, dilations, pads) -> bool:
    t, l, b, r = pads
    return (h + t + b >= dilations[0] * (kh - 1) + 1) and (w + l + r >= dilations[1] * (kw - 1) + 1)


def _out_hw(h, w, kh, kw, strides, dilations, pads):
    t, l, b, r = pads
    return ((h + t + b - dilations[0] * (kh - 1) - 1) // strides[0] + 1,
            (w + l + r - dilations[1] * (kw - 1) - 1) // strides[1] + 1)


def _tflite_input(x, x_zp, mode, pads):
    """Explicit pads become a numpy pre-pad with the zero point plus VALID."""
    if mode != "EXPLICIT":
        return x, mode
    t, l, b, r = pads
    return np.pad(x, ((0, 0), (t, b), (l, r), (0, 0)), constant_values=x_zp), "VALID"


# ----------------------------------------------------------------------------- Conv2D vs TFLite

def _conv_config(rng, i):
    kind = ["lt1", "lt1", "gt1", "pow2"][i % 4]
    for _ in range(100):
        n = int(rng.integers(1, 3))
        h, w = int(rng.integers(1, 13)), int(rng.integers(1, 13))
        group = int(rng.choice([1, 1, 1, 2, 3]))
        cg = int(rng.integers(1, 7))
        og = int(rng.integers(1, 5))
        kh, kw = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        strides = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
        dilations = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
        mode, pads = _pad_choice(rng, h, w, kh, kw, strides, dilations)
        if _fits(h, w, kh, kw, strides, dilations, pads):
            return kind, n, h, w, group, cg, og, kh, kw, strides, dilations, mode, pads
    raise AssertionError("no config")


def test_conv2d_uint8_matches_tflite():
    rng = np.random.default_rng(100)
    total = inside = 0
    for i in range(400):
        kind, n, h, w, group, cg, og, kh, kw, strides, dilations, mode, pads = _conv_config(rng, i)
        c, o = cg * group, og * group
        op = Operands(rng, kind, (n, h, w, c), (o, kh, kw, cg), kh * kw * cg)
        x, wt, x_zp, w_zp, out_zp = op.x, op.w, op.x_zp, op.w_zp, op.out_zp
        s_in, s_w, s_out = op.s_in, op.s_w, op.s_out
        act = ACTS[i % 3]
        has_bias = i % 5 != 0
        bias = op.bias(rng, o) if has_bias else None
        oh, ow = _out_hw(h, w, kh, kw, strides, dilations, pads)

        xt, padding = _tflite_input(x, x_zp, mode, pads)
        model = build_single_op_model(
            "CONV_2D",
            [TensorSpec(xt.shape, s_in, x_zp), TensorSpec(wt.shape, s_w, w_zp, data=wt),
             # TFLite's quantized conv requires a bias tensor: zeros stand for "no bias"
             TensorSpec((o,), _bias_scale(s_in, s_w), 0, "int32",
                        bias if has_bias else np.zeros(o, np.int32))],
            [TensorSpec((n, oh, ow, o), s_out, out_zp)],
            options={"padding": padding, "stride_h": strides[0], "stride_w": strides[1],
                     "dilation_h_factor": dilations[0], "dilation_w_factor": dilations[1],
                     "fused_activation_function": act})
        (expected,) = run_ref(model, [xt])
        q, shift = _tflite_multiplier(s_in, s_w, s_out)
        lo, hi = fused_activation_range(act, s_out, out_zp)
        got = conv2d(x, wt, bias, x_zp=x_zp, w_zp=w_zp, out_zp=out_zp, multiplier=q, shift=shift,
                     strides=strides, pads=pads, dilations=dilations, group=group,
                     act_min=lo, act_max=hi)
        assert got.shape == expected.shape
        assert int(np.sum(got != expected)) == 0, (i, kind, mode, pads, q, shift)
        total += got.size
        inside += int(np.sum((got > lo) & (got < hi)))
    assert total > 15000
    assert inside > total // 3  # most outputs are not clamped: the rounding is what is compared


def test_conv2d_exact_ties_match_tflite():
    """Crafted accumulators: a 1x1 conv with acc = x - x_zp + bias over -511..511 and M = 2^k.

    With s_in * s_w / s_out = 2^-1 .. 2^-4 every accumulator residue occurs,
    so both rounding steps (high-mul ties toward +inf, divide-by-POT ties away
    from zero) meet exact .5 ties of both signs; 2^1 and 2^2 exercise the left
    shift. The output zero point sits mid-range so nothing saturates.
    """
    x = np.arange(256, dtype=np.uint8).reshape(1, 16, 16, 1)
    wt = np.full((2, 1, 1, 1), 201, np.uint8)  # w - w_zp = +1 and -1 for the two channels
    w_zps = 200
    wt[1] = 199
    checked = 0
    for k in (-1, -2, -3, -4, 1, 2):
        for x_zp in (0, 255, 128):
            for b in (-256, 0, 255):
                s_in, s_w, s_out = 2.0 ** -4, 2.0 ** -3, 2.0 ** (-7 - k)
                out_zp = 128
                bias = np.array([b, -b], np.int32)
                model = build_single_op_model(
                    "CONV_2D",
                    [TensorSpec(x.shape, s_in, x_zp), TensorSpec(wt.shape, s_w, w_zps, data=wt),
                     TensorSpec((2,), s_in * s_w, 0, "int32", bias)],
                    [TensorSpec((1, 16, 16, 2), s_out, out_zp)],
                    options={"padding": "VALID", "stride_h": 1, "stride_w": 1})
                (expected,) = run_ref(model, [x])
                q, shift = _tflite_multiplier(s_in, s_w, s_out)
                assert (q, shift) == (1 << 30, k + 1)
                got = conv2d(x, wt, bias, x_zp=x_zp, w_zp=w_zps, out_zp=out_zp, multiplier=q, shift=shift)
                assert int(np.sum(got != expected)) == 0, (k, x_zp, b)
                checked += got.size
    assert checked == 6 * 9 * 512


def test_tflite_uint8_conv_multiplier_uses_float32_scale_product():
    """Pins which multiplier TFLite's uint8 conv uses (found by a randomized-config mismatch).

    With these float32 scales, double(s_in)*double(s_w)/double(s_out) =
    1.00999999602 gives q = 1084479238 and 50 * M = 50.4999998 -> 50, while
    double(float32(s_in*s_w))/double(s_out) gives q = 1084479252 and 50.5000007 -> 51.
    CONV_2D and DEPTHWISE_CONV_2D (uint8) answer 51; FULLY_CONNECTED answers 50
    (it requantizes in double from the double product).
    """
    s_in, s_w, s_out = 0.00372136989608407, 0.0012209524866193533, 4.498629550653277e-06
    assert _tflite_multiplier(s_in, s_w, s_out) == (1084479252, 1)
    assert _tflite_multiplier(s_in, s_w, s_out, per_channel=True) == (1084479238, 1)
    x = np.array([0, 50, 150, 250], np.uint8).reshape(1, 1, 4, 1)
    wt = np.full((1, 1, 1, 1), 130, np.uint8)  # w - w_zp = 1: acc = x
    b_spec = TensorSpec((1,), _bias_scale(s_in, s_w), 0, "int32", np.zeros(1, np.int32))
    for op in ("CONV_2D", "DEPTHWISE_CONV_2D"):
        opts = {"padding": "VALID", "stride_h": 1, "stride_w": 1}
        if op == "DEPTHWISE_CONV_2D":
            opts["depth_multiplier"] = 1
        model = build_single_op_model(
            op, [TensorSpec(x.shape, s_in, 0), TensorSpec(wt.shape, s_w, 129, data=wt), b_spec],
            [TensorSpec(x.shape, s_out, 0)], options=opts)
        (expected,) = run_ref(model, [x])
        assert expected.ravel().tolist() == [0, 51, 152, 253]
        q, shift = _tflite_multiplier(s_in, s_w, s_out)
        got = conv2d(x, wt, None, x_zp=0, w_zp=129, out_zp=0, multiplier=q, shift=shift)
        assert np.array_equal(got, expected)
    model = build_single_op_model(
        "FULLY_CONNECTED", [TensorSpec((4, 1), s_in, 0), TensorSpec((1, 1), s_w, 129, data=wt.reshape(1, 1)),
                            b_spec], [TensorSpec((4, 1), s_out, 0)])
    (fc,) = run_ref(model, [x.reshape(4, 1)])
    assert fc.ravel().tolist() == [0, 50, 151, 252]


def test_conv2d_int8_per_channel_matches_tflite():
    rng = np.random.default_rng(101)
    for i in range(100):
        kind, n, h, w, _, c, o, kh, kw, strides, dilations, mode, pads = _conv_config(rng, i)
        op = Operands(rng, kind, (n, h, w, c), (o, kh, kw, c), kh * kw * c, "int8", w_symmetric=True)
        x, wt, x_zp, out_zp, s_in, s_out = op.x, op.w, op.x_zp, op.out_zp, op.s_in, op.s_out
        s_ws = [_f32(op.s_w * np.exp(rng.uniform(-0.5, 0.5))) for _ in range(o)]
        bias = op.bias(rng, o)
        act = ACTS[i % 3]
        oh, ow = _out_hw(h, w, kh, kw, strides, dilations, pads)
        xt, padding = _tflite_input(x, x_zp, mode, pads)
        model = build_single_op_model(
            "CONV_2D",
            [TensorSpec(xt.shape, s_in, x_zp, "int8"),
             TensorSpec(wt.shape, s_ws, [0] * o, "int8", data=wt, quantized_dimension=0),
             TensorSpec((o,), [_bias_scale(s_in, s) for s in s_ws], [0] * o, "int32", bias)],
            [TensorSpec((n, oh, ow, o), s_out, out_zp, "int8")],
            options={"padding": padding, "stride_h": strides[0], "stride_w": strides[1],
                     "dilation_h_factor": dilations[0], "dilation_w_factor": dilations[1],
                     "fused_activation_function": act})
        (expected,) = run_ref(model, [xt])
        qs = [_tflite_multiplier(s_in, s, s_out, per_channel=True) for s in s_ws]
        lo, hi = fused_activation_range(act, s_out, out_zp, "int8")
        got = conv2d(x, wt, bias, x_zp=x_zp, w_zp=0, out_zp=out_zp,
                     multiplier=[q for q, _ in qs], shift=[s for _, s in qs], strides=strides,
                     pads=pads, dilations=dilations, act_min=lo, act_max=hi, out_dtype=np.int8)
        assert int(np.sum(got != expected)) == 0, i


# ----------------------------------------------------------------------------- DepthwiseConv2d vs TFLite

def _dw_config(rng, i):
    kind = ["lt1", "lt1", "gt1", "pow2"][i % 4]
    for _ in range(100):
        n = int(rng.integers(1, 3))
        h, w = int(rng.integers(1, 14)), int(rng.integers(1, 14))
        c, mult = int(rng.integers(1, 9)), int(rng.choice([1, 1, 2, 3]))
        kh, kw = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        strides = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
        dilations = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
        mode, pads = _pad_choice(rng, h, w, kh, kw, strides, dilations)
        if _fits(h, w, kh, kw, strides, dilations, pads):
            return kind, n, h, w, c, mult, kh, kw, strides, dilations, mode, pads
    raise AssertionError("no config")


@pytest.mark.parametrize("dtype", ["uint8", "int8"])
def test_depthwise_conv2d_matches_tflite(dtype):
    rng = np.random.default_rng(200 if dtype == "uint8" else 201)
    count = 400 if dtype == "uint8" else 100
    total = inside = 0
    for i in range(count):
        kind, n, h, w, c, mult, kh, kw, strides, dilations, mode, pads = _dw_config(rng, i)
        o = c * mult
        act = ACTS[i % 3]
        op = Operands(rng, kind, (n, h, w, c), (kh, kw, c, mult), kh * kw, dtype,
                      w_symmetric=dtype == "int8")
        x, wt, x_zp, w_zp, out_zp = op.x, op.w, op.x_zp, op.w_zp, op.out_zp
        s_in, s_out = op.s_in, op.s_out
        if dtype == "uint8":
            s_ws = [op.s_w]
        else:  # per-channel weight scales
            s_ws = [_f32(op.s_w * np.exp(rng.uniform(-0.5, 0.5))) for _ in range(o)]
        has_bias = i % 5 != 0
        bias = op.bias(rng, o) if has_bias else None
        oh, ow = _out_hw(h, w, kh, kw, strides, dilations, pads)
        xt, padding = _tflite_input(x, x_zp, mode, pads)
        per_channel = len(s_ws) > 1
        w_spec = TensorSpec((1, kh, kw, o), s_ws if per_channel else s_ws[0],
                            [0] * o if per_channel else w_zp, dtype,
                            data=wt.reshape(1, kh, kw, o), quantized_dimension=3)
        b_scales = [_bias_scale(s_in, s) for s in s_ws]
        b_spec = TensorSpec((o,), b_scales if per_channel else b_scales[0],
                            [0] * o if per_channel else 0, "int32",
                            bias if has_bias else np.zeros(o, np.int32))
        model = build_single_op_model(
            "DEPTHWISE_CONV_2D",
            [TensorSpec(xt.shape, s_in, x_zp, dtype), w_spec, b_spec],
            [TensorSpec((n, oh, ow, o), s_out, out_zp, dtype)],
            options={"padding": padding, "stride_h": strides[0], "stride_w": strides[1],
                     "dilation_h_factor": dilations[0], "dilation_w_factor": dilations[1],
                     "depth_multiplier": mult, "fused_activation_function": act})
        (expected,) = run_ref(model, [xt])
        qs = [_tflite_multiplier(s_in, s, s_out, per_channel=per_channel) for s in s_ws]
        lo, hi = fused_activation_range(act, s_out, out_zp, dtype)
        got = depthwise_conv2d(x, wt, bias, x_zp=x_zp, w_zp=w_zp, out_zp=out_zp,
                               multiplier=[q for q, _ in qs] if per_channel else qs[0][0],
                               shift=[s for _, s in qs] if per_channel else qs[0][1],
                               strides=strides, pads=pads, dilations=dilations,
                               act_min=lo, act_max=hi, out_dtype=np.dtype(dtype).type)
        assert got.shape == expected.shape
        assert int(np.sum(got != expected)) == 0, (i, kind, mode, pads)
        total += got.size
        inside += int(np.sum((got > lo) & (got < hi)))
    assert total > (15000 if dtype == "uint8" else 3000)
    assert inside > total // 3


# ----------------------------------------------------------------------------- FullyConnected, fixed point

def test_fully_connected_fixed_matches_tflite_1x1_conv():
    rng = np.random.default_rng(300)
    for i in range(60):
        kind = ["lt1", "gt1", "pow2"][i % 3]
        n, k, o = int(rng.integers(1, 5)), int(rng.integers(1, 300)), int(rng.integers(1, 20))
        op = Operands(rng, kind, (n, k), (o, k), k)
        x, wt, x_zp, w_zp, out_zp = op.x, op.w, op.x_zp, op.w_zp, op.out_zp
        s_in, s_w, s_out = op.s_in, op.s_w, op.s_out
        bias = op.bias(rng, o)
        act = ACTS[i % 3]
        model = build_single_op_model(
            "CONV_2D",
            [TensorSpec((n, 1, 1, k), s_in, x_zp),
             TensorSpec((o, 1, 1, k), s_w, w_zp, data=wt.reshape(o, 1, 1, k)),
             TensorSpec((o,), _bias_scale(s_in, s_w), 0, "int32", bias)],
            [TensorSpec((n, 1, 1, o), s_out, out_zp)],
            options={"padding": "VALID", "stride_h": 1, "stride_w": 1,
                     "fused_activation_function": act})
        (expected,) = run_ref(model, [x.reshape(n, 1, 1, k)])
        q, shift = _tflite_multiplier(s_in, s_w, s_out)
        lo, hi = fused_activation_range(act, s_out, out_zp)
        got = fully_connected_fixed(x, wt, bias, x_zp=x_zp, w_zp=w_zp, out_zp=out_zp,
                                    multiplier=q, shift=shift, act_min=lo, act_max=hi)
        assert int(np.sum(got != expected.reshape(n, o))) == 0, i


def test_tflite_fully_connected_builder_double_requant():
    """The builder's FULLY_CONNECTED runs, and computes round(double(acc) * M) + zp.

    docs/oracle-notes.md: since LiteRT commit 921360770 the reference FC
    requantizes in double. This checks the builder/oracle, not a maceq kernel
    (MACE's FC is the float32 Gemv tested below).
    """
    rng = np.random.default_rng(301)
    for i in range(20):
        n, k, o = int(rng.integers(1, 4)), int(rng.integers(1, 200)), int(rng.integers(1, 12))
        op = Operands(rng, "lt1", (n, k), (o, k), k)
        x, wt, x_zp, w_zp, out_zp = op.x, op.w, op.x_zp, op.w_zp, op.out_zp
        s_in, s_w, s_out = op.s_in, op.s_w, op.s_out
        bias = op.bias(rng, o)
        model = build_single_op_model(
            "FULLY_CONNECTED",
            [TensorSpec((n, k), s_in, x_zp), TensorSpec((o, k), s_w, w_zp, data=wt),
             TensorSpec((o,), _bias_scale(s_in, s_w), 0, "int32", bias)],
            [TensorSpec((n, o), s_out, out_zp)],
            options={"fused_activation_function": "NONE"})
        (expected,) = run_ref(model, [x])
        acc = (x.astype(np.int64) - x_zp) @ (wt.astype(np.int64) - w_zp).T + bias
        m = Fraction(_f32(s_in)) * Fraction(_f32(s_w)) / Fraction(_f32(s_out))
        m = float(m)  # double(s_in)*double(s_w)/double(s_out): product exact, one rounding
        want = [[min(max(_round_away(Fraction(float(a) * m)) + out_zp, 0), 255) for a in row]
                for row in acc.tolist()]
        assert int(np.sum(expected != np.array(want))) == 0, i


def _round_away(v: Fraction) -> int:
    s = -1 if v < 0 else 1
    return s * int(abs(v) + Fraction(1, 2))


# ----------------------------------------------------------------------------- FullyConnected, MACE Gemv float32

def _u32(v: int) -> int:
    return v % (1 << 32)


def _i32(v: int) -> int:
    v %= 1 << 32
    return v - (1 << 32) if v >= 1 << 31 else v


def mace_gemv_scalar(lhs, rhs, bias, lhs_zp, rhs_zp, out_zp, m: np.float32, fused: bool):
    """Scalar transcription of mace/ops/arm/q8/gemv.cc (uint8 output), one batch row.

    lhs = weight [H, W], rhs = input [W]. The NEON loop accumulates in uint32
    (dot, sum_lhs, sum_rhs) and combines them as
    ``ret = dot - sum_lhs*rhs_zp - sum_rhs*lhs_zp + zero_point_dot`` in
    uint32 -> int32, adds the int32 bias, and writes
    ``Saturate<uint8_t>(roundf(ret * output_multiplier_float + output_zero_point))``
    (output zero point per docs/oracle-notes.md). ``fused`` evaluates the
    multiply-add as one fmaf (exact rational, one float32 rounding).
    """
    width = len(rhs)
    sum_rhs = _u32(sum(int(v) for v in rhs))
    out = []
    for h in range(len(lhs)):
        dot = _u32(sum(int(a) * int(b) for a, b in zip(lhs[h], rhs)))
        sum_lhs = _u32(sum(int(a) for a in lhs[h]))
        zero_point_dot = _i32(lhs_zp * rhs_zp * width)
        ret = _i32(dot - sum_lhs * rhs_zp - sum_rhs * lhs_zp + zero_point_dot)
        ret = _i32(ret + int(bias[h]))
        a = np.float32(ret)  # int32 -> float
        if fused:
            exact = Fraction(float(a)) * Fraction(float(m)) + out_zp
            v = _fraction_to_f32(exact)
        else:
            v = np.float32(np.float32(a * m) + np.float32(out_zp))
        r = _round_away(Fraction(float(v)))  # roundf
        out.append(min(max(r, 0), 255))      # Saturate<uint8_t>
    return out


def _fraction_to_f32(v: Fraction) -> np.float32:
    """Nearest float32 to a rational, ties to even, by exhaustive neighbour comparison."""
    guess = np.float32(float(v))
    cands = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    best = min(cands, key=lambda c: (abs(Fraction(float(c)) - v),
                                     int(np.asarray(c).view(np.int32)) & 1))
    return np.float32(best)


@pytest.mark.parametrize("rounding", [FloatRequant.ADD_ZP_THEN_ROUND, FloatRequant.FMA_ZP_THEN_ROUND])
def test_fully_connected_float_matches_mace_gemv(rounding):
    rng = np.random.default_rng(400 if rounding is FloatRequant.ADD_ZP_THEN_ROUND else 401)
    fused = rounding is FloatRequant.FMA_ZP_THEN_ROUND
    total = 0
    for i in range(60):
        n = int(rng.integers(1, 4))
        k = int(rng.choice([int(rng.integers(1, 40)), int(rng.integers(40, 300)), 3000]))
        o = int(rng.integers(1, 16))
        op = Operands(rng, "pow2" if i % 4 == 3 else "lt1", (n, k), (o, k), k)
        x, wt, x_zp, w_zp, out_zp = op.x, op.w, op.x_zp, op.w_zp, op.out_zp
        m = mace_float_multiplier(op.s_w, op.s_in, op.s_out)  # Gemv: lhs (weight) * rhs (input)
        bias = op.bias(rng, o)
        got = fully_connected(x, wt, bias, x_zp=x_zp, w_zp=w_zp, out_zp=out_zp, multiplier=m,
                              rounding=rounding)
        want = np.array([mace_gemv_scalar(wt, x[b], bias, w_zp, x_zp, out_zp, m, fused)
                         for b in range(n)])
        assert int(np.sum(got != want)) == 0, i
        total += got.size
    assert total > 500


def test_float_requant_ties_and_fma_difference():
    """Crafted accumulators: exact .5 ties of both signs, int -> float rounding, fmaf vs mul-then-add."""
    # acc = x - 128 in [-128, 127]; M = 1/4 puts acc = 2 mod 4 on exact ties.
    x = np.arange(256, dtype=np.uint8).reshape(-1, 1)
    one = np.ones((1, 1), np.uint8)
    m = np.float32(0.25)
    for zp in (0, 3, 128, 255):
        for rounding in FloatRequant:
            got = fully_connected(x, one, None, x_zp=128, w_zp=0, out_zp=zp, multiplier=m,
                                  rounding=rounding).ravel().tolist()
            if rounding is FloatRequant.ROUND_THEN_ADD_ZP:
                want = [min(max(_round_away(Fraction(a - 128, 4)) + zp, 0), 255) for a in range(256)]
            else:  # acc/4 + zp is exact in float32 here, so fused == unfused
                want = [min(max(_round_away(Fraction(a - 128, 4) + zp), 0), 255) for a in range(256)]
            assert got == want, (zp, rounding)
    # The two zero-point orders differ on negative ties: roundf(-0.5) + 10 = 9, roundf(9.5) = 10.
    a = np.array([-2], np.int64)
    assert requantize_float(a, multiplier=m, out_zp=10, rounding=FloatRequant.ROUND_THEN_ADD_ZP).tolist() == [9]
    assert requantize_float(a, multiplier=m, out_zp=10, rounding=FloatRequant.ADD_ZP_THEN_ROUND).tolist() == [10]

    # int32 -> float32 conversion of the accumulator rounds to even past 2^24:
    # ret = 401 * 2^16 - 1 is odd, becomes 401 * 2^16, and ret * 2^-17 = 200.5 -> 201,
    # where the exact 200.5 - 2^-17 would round to 200.
    ret = 401 * (1 << 16) - 1
    got = fully_connected(one, one, np.array([ret - 1], np.int32), x_zp=0, w_zp=0, out_zp=0,
                          multiplier=np.float32(2.0 ** -17))
    assert got.tolist() == [[201]]
    assert mace_gemv_scalar(one, one[0], [ret - 1], 0, 0, 0, np.float32(2.0 ** -17), False) == [201]

    # fmaf(acc, M, zp) and (acc * M) + zp are different float32 numbers for some inputs;
    # the vectorised fmaf equals the exactly rounded rational every time.
    rng = np.random.default_rng(402)
    small = rng.integers(-3000, 3000, 200000).astype(np.float32)
    mm = np.float32(0.1)
    unfused = (small * mm) + np.float32(77)
    fused = _fmaf(small, mm, np.float32(77))
    diff = np.nonzero(unfused != fused)[0]
    assert diff.size > 1000
    for j in diff[:200]:
        exact = Fraction(float(small[j])) * Fraction(float(mm)) + 77
        assert fused[j] == _fraction_to_f32(exact)


def mace_dw_general_scalar(x, w, bias, x_zp, w_zp, out_zp, m: np.float32, strides, paddings, dilations):
    """Scalar transcription of DepthwiseConv2dGeneral (mace/ops/depthwise_conv2d.cc), NHWC uint8.

    ``paddings`` is MACE's padding_values (total per spatial dim); the op uses
    top = total_h >> 1, left = total_w >> 1 and CalcOutputSize with FLOOR.
    Per output: int32 sum over in-image taps, ``sum += bias[m]``,
    ``sum = int32(std::round(sum * output_multiplier))`` (float32 product,
    std::round on float: half away from zero), ``sum += output_zero``, clamp to [0, 255].
    """
    n, in_h, in_w, c = x.shape
    kh, kw, _, mult = w.shape
    pad_top, pad_left = paddings[0] >> 1, paddings[1] >> 1
    out_h = (in_h + paddings[0] - dilations[0] * (kh - 1) - 1) // strides[0] + 1
    out_w = (in_w + paddings[1] - dilations[1] * (kw - 1) - 1) // strides[1] + 1
    out = np.zeros((n, out_h, out_w, c * mult), np.uint8)
    for b in range(n):
        for h in range(out_h):
            for wo in range(out_w):
                for mo in range(c * mult):
                    ci, o = mo // mult, mo % mult
                    ih_base = h * strides[0] - pad_top
                    iw_base = wo * strides[1] - pad_left
                    s = 0
                    for fy in range(kh):
                        ih = ih_base + fy * dilations[0]
                        for fx in range(kw):
                            iw = iw_base + fx * dilations[1]
                            if 0 <= ih < in_h and 0 <= iw < in_w:
                                s += (int(x[b, ih, iw, ci]) - x_zp) * (int(w[fy, fx, ci, o]) - w_zp)
                    if bias is not None:
                        s += int(bias[mo])
                    s = _round_away(Fraction(float(np.float32(np.float32(s) * m))))
                    s += out_zp
                    out[b, h, wo, mo] = min(255, max(0, s))
    return out


def test_dilated_depthwise_float_matches_mace_general():
    rng = np.random.default_rng(500)
    done = 0
    for i in range(80):
        kind, n, h, w, c, mult, kh, kw, strides, dilations, mode, pads = _dw_config(rng, i)
        dilations = (dilations[0] + 1, dilations[1]) if i % 2 else (dilations[0], dilations[1] + 1)
        th, tw = int(rng.integers(0, 5)), int(rng.integers(0, 5))  # MACE padding_values
        pads = mace_pads(th, tw)
        if not _fits(h, w, kh, kw, strides, dilations, pads):
            continue
        op = Operands(rng, "pow2" if i % 3 == 0 else kind, (n, h, w, c), (kh, kw, c, mult), kh * kw)
        x, wt, x_zp, w_zp, out_zp = op.x, op.w, op.x_zp, op.w_zp, op.out_zp
        m = mace_float_multiplier(op.s_in, op.s_w, op.s_out)
        bias = op.bias(rng, c * mult) if i % 4 else None
        got = depthwise_conv2d(x, wt, bias, x_zp=x_zp, w_zp=w_zp, out_zp=out_zp, float_multiplier=m,
                               strides=strides, pads=pads, dilations=dilations)
        want = mace_dw_general_scalar(x, wt, bias, x_zp, w_zp, out_zp, m, strides, (th, tw), dilations)
        assert int(np.sum(got != want)) == 0, i
        done += 1
    assert done >= 40


# ----------------------------------------------------------------------------- fast == reference

def test_conv2d_fast_equals_ref():
    rng = np.random.default_rng(600)
    for i in range(60):
        kind, n, h, w, group, cg, og, kh, kw, strides, dilations, mode, pads = _conv_config(rng, i)
        c, o = cg * group, og * group
        x, wt = _rand_u8(rng, (n, h, w, c)), _rand_u8(rng, (o, kh, kw, cg))
        bias = rng.integers(-(1 << 31), (1 << 31) - 1, o).astype(np.int32) if i % 3 else None
        per_channel = i % 4 == 0
        q = rng.integers(1 << 30, (1 << 31) - 1, o) if per_channel else int(rng.integers(1 << 30, 1 << 31))
        s = rng.integers(-20, 4, o) if per_channel else int(rng.integers(-20, 4))
        zw = rng.integers(0, 256, o) if per_channel else int(rng.integers(0, 256))
        kw_args = dict(x_zp=int(rng.integers(256)), w_zp=zw, out_zp=int(rng.integers(256)),
                       multiplier=q, shift=s, strides=strides, pads=pads, dilations=dilations,
                       group=group, act_min=int(rng.integers(0, 60)), act_max=int(rng.integers(200, 256)))
        assert np.array_equal(conv2d(x, wt, bias, **kw_args), conv2d_ref(x, wt, bias, **kw_args)), i


def test_depthwise_fast_equals_ref():
    rng = np.random.default_rng(601)
    for i in range(60):
        kind, n, h, w, c, mult, kh, kw, strides, dilations, mode, pads = _dw_config(rng, i)
        x, wt = _rand_u8(rng, (n, h, w, c)), _rand_u8(rng, (kh, kw, c, mult))
        bias = rng.integers(-(1 << 31), (1 << 31) - 1, c * mult).astype(np.int32) if i % 3 else None
        common = dict(x_zp=int(rng.integers(256)), w_zp=int(rng.integers(256)),
                      out_zp=int(rng.integers(256)), strides=strides, pads=pads, dilations=dilations)
        if i % 2:
            req = dict(multiplier=int(rng.integers(1 << 30, 1 << 31)), shift=int(rng.integers(-20, 4)))
        else:
            req = dict(float_multiplier=np.float32(rng.uniform(1e-4, 2)),
                       float_rounding=list(FloatRequant)[i % 3])
        a = depthwise_conv2d(x, wt, bias, **common, **req)
        b = depthwise_conv2d_ref(x, wt, bias, **common, **req)
        assert np.array_equal(a, b), i


def test_fully_connected_fast_equals_ref():
    rng = np.random.default_rng(602)
    for i in range(40):
        n, k, o = int(rng.integers(1, 4)), int(rng.integers(1, 200)), int(rng.integers(1, 10))
        x, wt = _rand_u8(rng, (n, k)), _rand_u8(rng, (o, k))
        bias = rng.integers(-(1 << 31), (1 << 31) - 1, o).astype(np.int32) if i % 3 else None
        zps = dict(x_zp=int(rng.integers(256)), w_zp=int(rng.integers(256)), out_zp=int(rng.integers(256)))
        rounding = list(FloatRequant)[i % 3]
        m = np.float32(rng.uniform(1e-5, 0.05))
        assert np.array_equal(
            fully_connected(x, wt, bias, **zps, multiplier=m, rounding=rounding),
            fully_connected_ref(x, wt, bias, **zps, multiplier=m, rounding=rounding)), i
        q, s = int(rng.integers(1 << 30, 1 << 31)), int(rng.integers(-20, 4))
        assert np.array_equal(
            fully_connected_fixed(x, wt, bias, **zps, multiplier=q, shift=s),
            fully_connected_fixed_ref(x, wt, bias, **zps, multiplier=q, shift=s)), i


def test_conv2d_wraps_int32_like_c():
    """A 1x1 conv over 40000 channels of extreme codes overflows int32; both paths wrap."""
    x = np.full((1, 1, 1, 40000), 255, np.uint8)
    wt = np.full((1, 1, 1, 40000), 255, np.uint8)
    kw_args = dict(x_zp=0, w_zp=0, out_zp=0, multiplier=1 << 30, shift=-20)
    acc = 40000 * 255 * 255  # 2,601,000,000 > 2^31 - 1
    wrapped = acc - (1 << 32)
    assert wrapped < 0
    assert conv2d(x, wt, None, **kw_args)[0, 0, 0, 0] == 0
    assert conv2d_ref(x, wt, None, **kw_args)[0, 0, 0, 0] == 0


# ----------------------------------------------------------------------------- builder smoke tests, other ops

def test_builder_other_ops():
    rng = np.random.default_rng(700)
    x = _rand_u8(rng, (2, 6, 6, 3))
    y = _rand_u8(rng, (2, 6, 6, 3))
    s, zp = 0.05, 10
    spec = TensorSpec((2, 6, 6, 3), s, zp)

    # ADD / SUB with equal scales: exact integer results
    (add,) = run_ref(build_single_op_model("ADD", [spec, spec], [spec],
                                           options={"fused_activation_function": "NONE"}), [x, y])
    assert np.array_equal(add, np.clip(x.astype(int) + y - zp, 0, 255))
    (sub,) = run_ref(build_single_op_model("SUB", [spec, spec], [spec],
                                           options={"fused_activation_function": "NONE"}), [x, y])
    assert np.array_equal(sub, np.clip(x.astype(int) - y + zp, 0, 255))

    # MAX_POOL_2D / AVERAGE_POOL_2D 2x2 stride 2, same quantization
    pool_opts = {"padding": "VALID", "stride_h": 2, "stride_w": 2, "filter_height": 2,
                 "filter_width": 2, "fused_activation_function": "NONE"}
    out_spec = TensorSpec((2, 3, 3, 3), s, zp)
    blocks = x.reshape(2, 3, 2, 3, 2, 3).astype(int)
    (mx,) = run_ref(build_single_op_model("MAX_POOL_2D", [spec], [out_spec], options=pool_opts), [x])
    assert np.array_equal(mx, blocks.max(axis=(2, 4)))
    (av,) = run_ref(build_single_op_model("AVERAGE_POOL_2D", [spec], [out_spec], options=pool_opts), [x])
    assert np.array_equal(av, (blocks.sum(axis=(2, 4)) + 2) // 4)  # (sum + count/2) / count

    # CONCATENATION on channels, same quantization: a copy
    (cat,) = run_ref(build_single_op_model("CONCATENATION", [spec, spec], [TensorSpec((2, 6, 6, 6), s, zp)],
                                           options={"axis": 3, "fused_activation_function": "NONE"}),
                     [x, y])
    assert np.array_equal(cat, np.concatenate([x, y], axis=3))

    # MEAN over H, W of a per-channel constant image: the constant
    const = np.broadcast_to(rng.integers(0, 256, (2, 1, 1, 3)), (2, 6, 6, 3)).astype(np.uint8)
    axis = TensorSpec((2,), None, None, "int32", data=np.array([1, 2], np.int32))
    (mean,) = run_ref(build_single_op_model("MEAN", [spec, axis], [TensorSpec((2, 1, 1, 3), s, zp)],
                                            options={"keep_dims": True}), [const])
    assert np.array_equal(mean, const[:, :1, :1, :])

    # SOFTMAX: one dominant logit takes all the mass (1.0 saturates to 255 at scale 1/256)
    logits = np.zeros((2, 5), np.uint8)
    logits[0, 3] = 255
    logits[1, 0] = 255
    (sm,) = run_ref(build_single_op_model("SOFTMAX", [TensorSpec((2, 5), 1.0, 0)],
                                          [TensorSpec((2, 5), 1 / 256, 0)], options={"beta": 1.0}),
                    [logits])
    want = np.zeros((2, 5), np.uint8)
    want[0, 3] = want[1, 0] = 255
    assert np.array_equal(sm, want)


def test_fused_activation_range():
    # RELU6 bound is zp + round_half_away(float32(6) / float32(s)): 6 / 0.048 = 125 exactly? no: 124.99..
    lo, hi = fused_activation_range("RELU6", 0.048, 3)
    assert lo == 3 and hi == 3 + int(np.round(np.float32(6) / np.float32(0.048)))
    assert fused_activation_range("RELU6", 0.5, 0) == (0, 12)
    assert fused_activation_range("RELU6", 6 / 2.5, 0) == (0, 3)   # 2.5 -> 3, away from zero
    assert fused_activation_range("RELU", 0.1, 200) == (200, 255)
    assert fused_activation_range("NONE", 0.1, 5, "int8") == (-128, 127)
