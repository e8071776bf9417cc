"""Empirical bias correction (app/bias_correction.py), recipes and the recovery switches.

Oracles:
- the mean pre-activation output ``sum W*m + b`` from ``tap_means`` against onnxruntime running the
  very convolution (padding, strides, dilations, groups) and averaging its output;
- the weights quantized by the scheme against the codes and quantization the writer stored in the
  model file (read back by the MACE reader);
- the corrected model the writer produces against the op-by-op simulation the correction ran (the
  same bits), and the per-channel mean error of the corrected layers against the uncorrected model's.
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from maceq.app import bias_correction as bc
from maceq.app.cli import quantize_main
from maceq.app.pipeline import calibrate, correct_bias, write_quantized
from maceq.calibrate.runner import make_session
from maceq.datasets.images import ImageFolder
from maceq.datasets.preprocess import PRESETS
from maceq.errors import MaceqError
from maceq.quant.config import QuantConfig, config_from_dict
from maceq.runtime import load
from maceq.runtime.devices import Device


def _conv_model(w, b, *, strides, pads, dilations, group, x_shape):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], strides=list(strides), pads=list(pads),
                            dilations=list(dilations), group=group)
    g = helper.make_graph([node], "c", [x], [y], [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("strides, pads, dilations, group, cin, cout, k", [
    ((1, 1), (1, 1, 1, 1), (1, 1), 1, 3, 5, 3),
    ((2, 2), (0, 1, 2, 1), (1, 1), 1, 4, 2, 3),
    ((1, 2), (2, 2, 2, 2), (2, 1), 1, 2, 3, 3),
    ((2, 2), (1, 1, 1, 1), (1, 1), 6, 6, 6, 3),  # depthwise
    ((1, 1), (0, 0, 0, 0), (1, 1), 2, 4, 6, 1),  # grouped 1x1
])
def test_tap_means_give_the_mean_conv_output(strides, pads, dilations, group, cin, cout, k):
    rng = np.random.default_rng(cin * 10 + cout)
    x = rng.normal(0.5, 1.0, (3, cin, 9, 8)).astype(np.float32)
    w = rng.normal(0, 1, (cout, cin // group, k, k)).astype(np.float32)
    b = rng.normal(0, 1, cout).astype(np.float32)
    sess = make_session(_conv_model(w, b, strides=strides, pads=pads, dilations=dilations, group=group,
                                     x_shape=x.shape), optimize=False)
    y = sess.run(None, {"x": x})[0].astype(np.float64)
    want = y.mean(axis=(0, 2, 3))
    lay = bc._Layer("n", "conv", "x", "y", w.astype(np.float64), b.astype(np.float64), group, strides, dilations,
                    (pads[0], pads[1], pads[2], pads[3]))
    m = bc.tap_means(x, lay, k, k) / (x.shape[0] * bc._positions(x.shape, lay, k, k))
    got = bc._mean_output(lay.w, m, lay) + lay.b
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_tap_means_gemm():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(7, 10))
    w = rng.normal(size=(4, 10))
    lay = bc._Layer("n", "gemm", "x", "y", w, np.zeros(4))
    assert np.allclose(bc._mean_output(w, bc.tap_means(x, lay, 1, 1) / 7, lay), (x @ w.T).mean(axis=0))


@pytest.fixture(scope="module")
def fmnist_cal(shared_data):
    onnx_path = shared_data / "models" / "fmnist_mobilenet.onnx"
    cal = calibrate(onnx_path, shared_data / "fashion_mnist" / "calib", preprocess=PRESETS["fmnist"],
                    config=QuantConfig(max_images=48, bias_correction_images=24), progress=False)
    return cal


@pytest.mark.parametrize("device", ["cpu", "gpu", "dsp"])
def test_dequantized_weights_are_what_the_writer_stores(fmnist_cal, tmp_path, device):
    from maceq.quant.build import check_supported

    res = write_quantized(fmnist_cal, output_dir=tmp_path, devices=(device,))
    model = load(res.files.yml)
    layers = bc._layers(fmnist_cal.graph, check_supported(fmnist_cal.graph, device=Device.CPU, shapes=fmnist_cal.shapes))
    node_of = {op.name: op for op in model.ops}
    checked = 0
    for lay in layers:
        op = next((o for o in model.ops if model.tensor_map.get(o.outputs[0], o.outputs[0]) == lay.out), None)
        assert op is not None, lay.node
        codes = model.consts[op.inputs[1]].astype(np.float64)
        q = model.const_qinfo[op.inputs[1]]
        w_q = bc.dequantized_weights(lay, device, fmnist_cal.shapes[lay.x][1])
        if device == "gpu":  # int8 symmetric, per output channel: the scales tensor beside the weights
            scales = model.consts[op.inputs[3]].astype(np.float64)
            per = w_q.reshape(w_q.shape[0], -1)
            # every channel's weights are integer multiples of its scale, within [-127, 127]
            k = per / scales[:, None]
            assert np.allclose(k, np.round(k), atol=1e-6) and np.abs(k).max() <= 127.0001
            assert sorted(np.round(k).ravel().tolist()) == sorted(codes.ravel().tolist())
        else:
            deq = (codes - q.zero_point) * q.scale
            assert np.allclose(np.sort(deq.ravel()), np.sort(w_q.ravel()), rtol=0, atol=1e-12)
        checked += 1
    assert checked == len(layers) >= 10 and node_of


@pytest.mark.parametrize("device", ["cpu", "dsp"])
def test_correction_is_what_the_written_model_computes(fmnist_cal, shared_data, tmp_path, device):
    """The model written from the corrected biases computes exactly what the correction simulated,
    and its corrected layers' outputs carry a smaller mean error per channel than before."""
    data = ImageFolder(shared_data / "fashion_mnist" / "calib", PRESETS["fmnist"], labels=None, limit=24)
    res0 = write_quantized(fmnist_cal, output_dir=tmp_path / "before", devices=(device,))
    fit = bc.correct_biases(fmnist_cal, device=device, data=data)
    assert fit.images == 24 and len(fit.biases) >= 10
    cal = fmnist_cal
    cal.device_biases[device] = fit.biases
    try:
        res1 = write_quantized(cal, output_dir=tmp_path / "after", devices=(device,))
    finally:
        cal.device_biases.clear()
    m0, m1 = load(res0.files.yml), load(res1.files.yml)
    x = np.concatenate([b.data for b in data.iter_batches(8)])
    out1 = m1.run({m1.input_names[0]: x}, device=device)
    name = m1.output_names[0]
    assert np.array_equal(out1[name], fit.outputs[name])
    # mean error per channel of every corrected layer without activation, before vs after
    g = cal.graph.to_onnx()
    lin = [n for n in cal.graph.nodes if n.name in fit.biases and n.attrs.get("maceq_act") is None]
    assert lin
    for n in lin:
        g.graph.output.append(onnx.helper.make_empty_tensor_value_info(n.outputs[0]))
    sess = make_session(g, optimize=False)
    fl = dict(zip([n.outputs[0] for n in lin], sess.run([n.outputs[0] for n in lin],
                                                         {cal.graph.inputs[0].name: x})))

    def mean_err(model):
        t = model.run({model.input_names[0]: x}, device=device, intermediates=True).tensors
        tm = model.tensor_map
        errs = []
        for n in lin:
            q = next(v for k, v in t.items() if tm.get(k, k) == n.outputs[0])
            v = np.asarray(q.dequantize(), np.float64)
            v = (v.transpose(0, 3, 1, 2) if v.ndim == 4 else v).reshape(fl[n.outputs[0]].shape)
            d = (v - fl[n.outputs[0]]).reshape(v.shape[0], v.shape[1], -1).mean(axis=(0, 2))
            errs.append(np.abs(d).mean())
        return np.array(errs)

    before, after = mean_err(m0), mean_err(m1)
    assert after.sum() < 0.25 * before.sum(), (before, after)


def test_recipe_precedence_and_errors():
    c = config_from_dict({"recipe": "accurate", "bias_correction": False})
    assert (c.cle, c.high_bias_absorption, c.bias_correction, c.range_method.value) == (True, True, False, "consumer")
    assert c.adaround and not QuantConfig().adaround
    c = QuantConfig().with_cli(cle=False).with_recipe("accurate")
    assert (c.cle, c.bias_correction) == (False, True)
    assert QuantConfig().with_recipe("default") == QuantConfig(recipe="default")
    with pytest.raises(MaceqError, match="unknown recipe 'fast'.*accurate"):
        QuantConfig().with_recipe("fast")
    with pytest.raises(MaceqError, match="bias_correction must be true or false"):
        config_from_dict({"bias_correction": "yes"})


def test_cli_recipe_records_the_steps(tmp_path, capsys):
    out = tmp_path / "acc"
    assert quantize_main(["-q", "-o", str(out), "--max-images", "32", "--recipe", "accurate",
                          "--bias-correction-images", "16"]) == 0
    text = capsys.readouterr().out
    assert "cross-layer equalization:" in text and "bias correction [cpu]:" in text and "adaround [cpu]:" in text
    rep = json.loads((out / "report.json").read_text())
    steps = [s["step"] for s in rep["recovery"]]
    assert steps == ["cross-layer equalization", "consumer ranges", "adaround", "bias correction"]
    meta = load(out / "fmnist_mobilenet.yml").maceq_meta
    assert [s["step"] for s in meta["recovery"]] == steps and meta["range_method"] == "consumer"
    # an explicit flag wins over the recipe
    out2 = tmp_path / "nobc"
    assert quantize_main(["-q", "-o", str(out2), "--max-images", "32", "--recipe", "accurate",
                          "--no-bias-correction", "--no-report"]) == 0
    assert [s["step"] for s in load(out2 / "fmnist_mobilenet.yml").maceq_meta["recovery"]] == [
        "cross-layer equalization", "consumer ranges", "adaround"]
    capsys.readouterr()
    assert quantize_main(["-q", "-o", str(tmp_path / "x"), "--recipe", "fast"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown recipe 'fast'" in err[0]


def test_correct_bias_needs_images(fmnist_cal):
    import dataclasses

    with pytest.raises(MaceqError, match="calibration images"):
        correct_bias(dataclasses.replace(fmnist_cal, calib_dir=None), ("cpu",))
