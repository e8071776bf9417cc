"""uint8 TransposeConv against TFLite BUILTIN_REF TRANSPOSE_CONV, and the ONNX mapping against onnxruntime.

Oracles:
- TFLite's reference TRANSPOSE_CONV on single-op models (the kernel gets the (q, shift)
  TFLite derives: float32 product of the scales, pinned by a discriminating test).
- The ONNX ConvTranspose mapping (weights [I, O, KH, KW], pads, output_padding,
  output_shape, auto_pad) against onnxruntime's float ConvTranspose on small integers,
  where float32 is exact and the requantization is the identity (q = 2^30, shift = 1).
- The fast path against ``transpose_conv_ref`` bit for bit, including negative pads,
  output padding and int32 wrap-around.
Every comparison requires 0 mismatching elements.

tests/oracle/tflite_builder.py has no TRANSPOSE_CONV entry; ``_build`` below adds the
options table name for the duration of one build instead of editing the builder.
"""
from __future__ import annotations

import numpy as np
import pytest

from maceq.errors import MaceqError
from maceq.runtime.fixedpoint import INT32_MAX
from maceq.runtime.kernels.transpose_conv import (
    Padding,
    onnx_conv_transpose_args,
    tflite_transpose_conv_multiplier,
    tflite_transpose_conv_pads,
    transpose_conv,
    transpose_conv_ref,
)
from maceq.tests.oracle import tflite_builder
from maceq.tests.oracle.tflite_builder import TensorSpec, fused_activation_range, run_ref

ACTS = ["NONE", "RELU", "RELU6"]


def _build(op, inputs, outputs, options):
    """build_single_op_model with TRANSPOSE_CONV's options table registered for this call only."""
    table = tflite_builder._OPTIONS_TABLE
    added = op not in table
    if added:
        table[op] = {"TRANSPOSE_CONV": "TransposeConvOptions"}[op]
    try:
        return tflite_builder.build_single_op_model(op, inputs, outputs, options=options)
    finally:
        if added:
            del table[op]


def _f32(v) -> float:
    return float(np.float32(v))


def _tflite_transpose_conv(x, w, bias, *, s_in, x_zp, s_w, w_zp, s_out, out_zp, out_hw, strides, padding, act):
    n, o = x.shape[0], w.shape[0]
    inputs = [TensorSpec((4,), None, None, "int32", np.array((n, *out_hw, o), np.int32)),
              TensorSpec(w.shape, s_w, w_zp, data=w), TensorSpec(x.shape, s_in, x_zp)]
    if bias is not None:
        inputs.append(TensorSpec((o,), _f32(np.float32(s_in) * np.float32(s_w)), 0, "int32", bias))
    model = _build("TRANSPOSE_CONV", inputs, [TensorSpec((n, *out_hw, o), s_out, out_zp)],
                   {"padding": padding, "stride_h": strides[0], "stride_w": strides[1],
                    "fused_activation_function": act})
    (out,) = run_ref(model, [x])
    return out


def _config(rng, i):
    n = int(rng.integers(1, 3))
    h, w = int(rng.integers(1, 7)), int(rng.integers(1, 7))
    c, o = int(rng.integers(1, 6)), int(rng.integers(1, 6))
    kh, kw = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    strides = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
    padding = "SAME" if i % 2 else "VALID"
    out_hw = []
    for size, k, s in ((h, kh, strides[0]), (w, kw, strides[1])):
        # every output size TFLite accepts for this input size (Prepare recomputes the input size)
        lo, hi = ((size - 1) * s + 1, size * s) if padding == "SAME" else ((size - 1) * s + k, (size - 1) * s + k + s - 1)
        out_hw.append(int(rng.integers(max(lo, 1), hi + 1)))
    return n, h, w, c, o, kh, kw, strides, padding, tuple(out_hw)


def test_transpose_conv_matches_tflite():
    rng = np.random.default_rng(500)
    total = inside = 0
    for i in range(160):
        n, h, w, c, o, kh, kw, strides, padding, out_hw = _config(rng, i)
        x_zp, w_zp, out_zp = (int(v) for v in rng.integers(0, 256, 3))
        spread = int(rng.choice([3, 20, 255]))
        x = np.clip(x_zp + rng.integers(-spread, spread + 1, (n, h, w, c)), 0, 255).astype(np.uint8)
        wt = np.clip(w_zp + rng.integers(-spread, spread + 1, (o, kh, kw, c)), 0, 255).astype(np.uint8)
        taps = max(1, -(-kh // strides[0]) * -(-kw // strides[1]) * c)
        acc_std = np.sqrt(taps) * (np.std(x.astype(float) - x_zp) + 0.5) * (np.std(wt.astype(float) - w_zp) + 0.5)
        m = 40.0 / acc_std * float(np.exp(rng.uniform(-0.7, 0.7)))
        if i % 4 == 3:
            m = float(np.clip(m * 8, 1.01, 16.0))  # multipliers > 1: TFLite's left shift
        s_in = _f32(np.exp(rng.uniform(-6, -2)))
        s_w = _f32(np.exp(rng.uniform(-7, -3)))
        s_out = _f32(s_in * s_w / m)
        bias = rng.integers(-int(2 * acc_std) - 1, int(2 * acc_std) + 2, o).astype(np.int32) if i % 3 else None
        act = ACTS[i % 3]
        want = _tflite_transpose_conv(x, wt, bias, s_in=s_in, x_zp=x_zp, s_w=s_w, w_zp=w_zp, s_out=s_out,
                                      out_zp=out_zp, out_hw=out_hw, strides=strides, padding=padding, act=act)
        q, shift = tflite_transpose_conv_multiplier(s_in, s_w, s_out)
        lo, hi = fused_activation_range(act, s_out, out_zp)
        pads = tflite_transpose_conv_pads(*out_hw, kh, kw, strides=strides, padding=Padding(padding), in_hw=(h, w))
        kw_args = dict(x_zp=x_zp, w_zp=w_zp, out_zp=out_zp, multiplier=q, shift=shift, strides=strides,
                       out_hw=out_hw, pads=pads, act_min=lo, act_max=hi)
        got = transpose_conv(x, wt, bias, **kw_args)
        ref = transpose_conv_ref(x, wt, bias, **kw_args)
        assert got.shape == want.shape
        assert int(np.sum(got != want)) == 0, (i, padding, strides, out_hw, q, shift)
        assert np.array_equal(ref, got)
        total += got.size
        inside += int(np.sum((got > lo) & (got < hi)))
    assert total > 5000
    assert inside > total // 3  # mostly unclamped: the rounding is what is compared


def test_multiplier_uses_float32_scale_product():
    """The scales of test_conv_oracle's pin: double product 50.4999998 -> 50, float32 product 50.5000007 -> 51."""
    s_in, s_w, s_out = 0.00372136989608407, 0.0012209524866193533, 4.498629550653277e-06
    assert tflite_transpose_conv_multiplier(s_in, s_w, s_out) == (1084479252, 1)
    x = np.array([0, 50, 150, 250], np.uint8).reshape(1, 1, 4, 1)
    wt = np.full((1, 1, 1, 1), 130, np.uint8)  # w - w_zp = 1: acc = x
    for bias in (None, np.zeros(1, np.int32)):
        want = _tflite_transpose_conv(x, wt, bias, s_in=s_in, x_zp=0, s_w=s_w, w_zp=129, s_out=s_out, out_zp=0,
                                      out_hw=(1, 4), strides=(1, 1), padding="VALID", act="NONE")
        assert want.ravel().tolist() == [0, 51, 152, 253]
        got = transpose_conv(x, wt, bias, x_zp=0, w_zp=129, out_zp=0, multiplier=1084479252, shift=1,
                             out_hw=(1, 4))
        assert np.array_equal(got, want)


def test_prepare_rejects_inconsistent_output_size():
    with pytest.raises(MaceqError, match="needs input size"):
        tflite_transpose_conv_pads(9, 9, 3, 3, strides=(2, 2), padding=Padding.VALID, in_hw=(5, 5))


# ----------------------------------------------------------------------------- ONNX mapping


def _ort_conv_transpose(x_nchw, w_onnx, attrs):
    import onnx
    from onnx import TensorProto, helper
    import onnxruntime as ort

    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], **attrs)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_nchw.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[onnx.numpy_helper.from_array(w_onnx.astype(np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x_nchw.astype(np.float32)})[0]


def test_onnx_conv_transpose_mapping_matches_onnxruntime():
    """Values in {-1, 0, 1}: float32 sums are exact and q = 2^30, shift = 1 is the identity requantization."""
    rng = np.random.default_rng(501)
    for i in range(60):
        h, w = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        c, o = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        kh, kw = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        strides = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
        opad = (int(rng.integers(0, strides[0])), int(rng.integers(0, strides[1])))
        attrs = {"strides": list(strides), "kernel_shape": [kh, kw]}
        kind = i % 4
        pads = (0, 0, 0, 0)
        out_shape = None
        auto_pad = "NOTSET"
        if kind == 0:
            pads = tuple(int(v) for v in rng.integers(0, 3, 4))
            attrs["pads"] = list(pads)
            attrs["output_padding"] = list(opad)
        elif kind == 1:
            full = [strides[j] * ((h, w)[j] - 1) + opad[j] + (kh, kw)[j] for j in range(2)]
            # onnxruntime 1.2x rejects an output_shape larger than the full output
            out_shape = (int(rng.integers(max(1, full[0] - 3), full[0] + 1)),
                         int(rng.integers(max(1, full[1] - 3), full[1] + 1)))
            attrs["output_shape"] = list(out_shape)
            attrs["output_padding"] = list(opad)
        else:
            auto_pad = "SAME_UPPER" if kind == 2 else "SAME_LOWER"
            attrs["auto_pad"] = auto_pad
            attrs["output_padding"] = list(opad)
        full_h = strides[0] * (h - 1) + opad[0] + kh - pads[0] - pads[2]
        full_w = strides[1] * (w - 1) + opad[1] + kw - pads[1] - pads[3]
        if kind == 0 and min(full_h, full_w) < 1:
            continue
        xd = rng.integers(-1, 2, (1, c, h, w))
        wd = rng.integers(-1, 2, (c, o, kh, kw))
        want = _ort_conv_transpose(xd, wd, attrs)  # NCHW float, exact small integers
        args = onnx_conv_transpose_args(wd, in_hw=(h, w), strides=strides, pads=pads,
                                        output_padding=opad,
                                        output_shape=out_shape, auto_pad=auto_pad)
        x_u8 = (xd.transpose(0, 2, 3, 1) + 128).astype(np.uint8)
        w_u8 = (args.w + 128).astype(np.uint8)
        got = transpose_conv(x_u8, w_u8, None, x_zp=128, w_zp=128, out_zp=128, multiplier=1 << 30, shift=1,
                             strides=args.strides, out_hw=args.out_hw, pads=args.pads)
        assert got.shape == want.transpose(0, 2, 3, 1).shape, (i, attrs)
        assert np.array_equal(got.astype(np.int64) - 128, want.transpose(0, 2, 3, 1).astype(np.int64)), (i, attrs)


def test_onnx_mapping_rejects_groups_and_dilation():
    wd = np.zeros((2, 1, 3, 3))
    with pytest.raises(MaceqError, match="group=2"):
        onnx_conv_transpose_args(wd, in_hw=(4, 4), group=2, node="deconv7")
    with pytest.raises(MaceqError, match="dilations"):
        onnx_conv_transpose_args(wd, in_hw=(4, 4), dilations=(2, 2))


# ----------------------------------------------------------------------------- fast == ref


def test_fast_equals_reference_edge_geometry_and_wrap():
    rng = np.random.default_rng(502)
    for i in range(60):
        n, h, w = int(rng.integers(1, 3)), int(rng.integers(1, 6)), int(rng.integers(1, 6))
        c, o = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        kh, kw = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        strides = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
        pads = (int(rng.integers(-3, 4)), int(rng.integers(-3, 4)))  # negative: output starts early
        out_hw = (int(rng.integers(1, 3 * h + 6)), int(rng.integers(1, 3 * w + 6)))  # crop or extend
        x = rng.integers(0, 256, (n, h, w, c), dtype=np.uint8)
        wt = rng.integers(0, 256, (o, kh, kw, c), dtype=np.uint8)
        zps = [int(v) for v in rng.integers(0, 256, 3)]
        if i % 3 == 0:  # int32 wrap: a bias at the top of int32 plus positive sums
            bias = np.full(o, INT32_MAX - int(rng.integers(0, 50000)), np.int32)
        else:
            bias = rng.integers(-100000, 100000, o).astype(np.int32)
        q, shift = int(rng.integers(1 << 30, 1 << 31)), int(rng.integers(-12, 3))
        kw_args = dict(x_zp=zps[0], w_zp=zps[1], out_zp=zps[2], multiplier=q, shift=shift, strides=strides,
                       out_hw=out_hw, pads=pads, act_min=int(rng.integers(0, 40)), act_max=int(rng.integers(200, 256)))
        assert np.array_equal(transpose_conv(x, wt, bias, **kw_args), transpose_conv_ref(x, wt, bias, **kw_args)), i
