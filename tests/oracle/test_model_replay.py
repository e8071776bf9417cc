"""Replay every layer of a quantized MobileNetV2 through an independent oracle.

The runtime's own intermediate inputs are fed, layer by layer, to:
- TFLite's reference CONV_2D / DEPTHWISE_CONV_2D (BUILTIN_REF), for the gemmlowp ops. TFLite computes its
  multiplier in double from the scales, MACE in float32, so the oracle model is given the scales
  (1, M, 1) where M is MACE's float32 multiplier: double(1)*double(M)/double(1) == M exactly, and both sides
  then run the same QuantizeMultiplier. The bias is the int32 bias MACE adds after its load-time rescale.
- the scalar reference transcriptions of MACE's kernels, for the ops where MACE is not gemmlowp
  (FullyConnected's float gemv, NEON Eltwise, Reduce mean, input Quantize).
Every element must match.
"""
from __future__ import annotations

import numpy as np
import pytest

from maceq.datasets.images import ImageFolder
from maceq.datasets.preprocess import PRESETS
from maceq.quant.config import QuantConfig
from maceq.app.pipeline import quantize
from maceq.runtime import fixedpoint as fp
from maceq.runtime import load
from maceq.runtime.kernels import conv as k_conv
from maceq.runtime.kernels import eltwise as k_elt
from maceq.runtime.kernels import quantize as k_quant
from maceq.runtime.kernels import reduce as k_reduce
from maceq.tests.oracle.tflite_builder import TensorSpec, build_single_op_model, run_ref


@pytest.fixture(scope="module")
def mbv2_run(tmp_path_factory, shared_data):
    out = tmp_path_factory.mktemp("mbv2")
    res = quantize(shared_data / "models" / "mobilenet_v2.onnx", shared_data / "photos" / "calib",
                   output_dir=out, preprocess=PRESETS["imagenet"], config=QuantConfig(max_images=16),
                   progress=False)
    model = load(res.files.yml)
    x = next(ImageFolder(shared_data / "photos" / "eval", PRESETS["imagenet"], labels=None).iter_batches(1)).data
    return model, x, model.run({"input": x}, intermediates=True)


def _padded(x, pads, zp):
    t, l, b, r = pads
    return np.pad(x, ((0, 0), (t, b), (l, r), (0, 0)), constant_values=zp)


def _tflite_conv(op, model, x_t, depthwise: bool):
    w = model.consts[op.inputs[1]]
    wq = model.const_qinfo[op.inputs[1]]
    out_q = op.out_qinfo[0]
    bq = model.const_qinfo[op.inputs[2]]
    bias = fp.mace_rescale_bias(model.consts[op.inputs[2]], x_t.qinfo.scale, wq.scale, bq.scale)
    m = float(fp.mace_float_multiplier(x_t.qinfo.scale, wq.scale, out_q.scale))
    ph, pw = op.arg("padding_values")
    pads = (ph >> 1, pw >> 1, ph - (ph >> 1), pw - (pw >> 1))
    x = _padded(x_t.values, pads, x_t.qinfo.zero_point)
    if depthwise:
        kh, kw, c, mult = w.shape
        w_tfl = w.reshape(1, kh, kw, c * mult)
        name, opts = "DEPTHWISE_CONV_2D", {"depth_multiplier": mult}
    else:
        w_tfl = w
        name, opts = "CONV_2D", {}
    sh, sw = op.arg("strides")
    dh, dw = op.arg("dilations", [1, 1])
    opts.update(padding="VALID", stride_h=sh, stride_w=sw, dilation_h_factor=dh, dilation_w_factor=dw,
                fused_activation_function="NONE")
    out_shape = tuple(model_out_shape(x.shape, w_tfl.shape, (sh, sw), (dh, dw)))
    tfl = build_single_op_model(name, [
        TensorSpec(x.shape, 1.0, x_t.qinfo.zero_point),
        TensorSpec(w_tfl.shape, m, wq.zero_point, data=w_tfl),
        TensorSpec(bias.shape, m, 0, dtype="int32", data=bias),
    ], [TensorSpec(out_shape, 1.0, out_q.zero_point)], options=opts)
    return run_ref(tfl, [x])[0]


def model_out_shape(x_shape, w_shape, strides, dilations):
    n, h, w, _ = x_shape
    kh, kw = w_shape[1], w_shape[2]
    eh, ew = (kh - 1) * dilations[0] + 1, (kw - 1) * dilations[1] + 1
    return n, (h - eh) // strides[0] + 1, (w - ew) // strides[1] + 1, w_shape[0] if w_shape[0] != 1 else w_shape[3]


def test_every_layer_matches_its_oracle(mbv2_run):
    model, x, res = mbv2_run
    t = res.tensors
    checked = {}
    for op in model.ops:
        got = t[op.outputs[0]]
        ins = [t[i] if i in t else None for i in op.inputs]
        if op.type in ("Conv2D", "DepthwiseConv2d"):
            want = _tflite_conv(op, model, ins[0], op.type == "DepthwiseConv2d")
        elif op.type == "FullyConnected":
            wq = model.const_qinfo[op.inputs[1]]
            w = model.consts[op.inputs[1]]
            m = fp.mace_float_multiplier(ins[0].qinfo.scale, wq.scale, op.out_qinfo[0].scale)
            want = k_conv.fully_connected_ref(ins[0].values.reshape(1, -1), w.reshape(w.shape[0], -1),
                                              model.consts[op.inputs[2]], x_zp=ins[0].qinfo.zero_point,
                                              w_zp=wq.zero_point, out_zp=op.out_qinfo[0].zero_point,
                                              multiplier=m).reshape(got.values.shape)
        elif op.type == "Eltwise":
            a, b = ins
            o = op.out_qinfo[0]
            want = k_elt.eltwise_add_ref(a.values, b.values, a_scale=a.qinfo.scale, a_zp=a.qinfo.zero_point,
                                         b_scale=b.qinfo.scale, b_zp=b.qinfo.zero_point, out_scale=o.scale,
                                         out_zp=o.zero_point)
        elif op.type == "Reduce":
            want = k_reduce.reduce_mean_ref(ins[0].values, axes=tuple(op.arg("axis")), keepdims=True)
        elif op.type == "Quantize":
            xin = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
            scale, zp = k_quant.adjust_range(*k_quant.find_range(xin), non_zero=False)
            assert (np.float32(scale), zp) == (np.float32(got.qinfo.scale), got.qinfo.zero_point)
            want = k_quant.quantize_neon_ref(xin, scale=scale, zero_point=zp)
        elif op.type == "Pad":  # a safe form's explicit padding: the real value 0 is the input's zero point
            top, bottom, left, right = op.arg("paddings")[2:6]
            want = np.pad(ins[0].values, [(0, 0), (top, bottom), (left, right), (0, 0)],
                          constant_values=ins[0].qinfo.zero_point)
        elif op.type == "Dequantize":
            continue
        else:
            pytest.fail(f"no oracle for op type {op.type}")
        want = np.asarray(want).reshape(got.values.shape)
        mismatches = int(np.count_nonzero(want.astype(np.int32) != got.values.astype(np.int32)))
        assert mismatches == 0, f"{op.type} '{op.name}': {mismatches} of {want.size} elements differ"
        checked[op.type] = checked.get(op.type, 0) + 1
    assert checked == {"Quantize": 1, "Conv2D": 35, "DepthwiseConv2d": 17, "Eltwise": 10, "Reduce": 1,
                       "FullyConnected": 1, "Pad": 4}
