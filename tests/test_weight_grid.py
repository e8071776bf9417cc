"""The weight-grid check: a layer whose output is a small difference of large terms (a bias and a
weight cancelling a large, near-constant input channel) is named at quantize time, with its figure
per device and the --fp32 flag; ordinary layers are not."""
from __future__ import annotations

import math
import warnings

import numpy as np
import onnxruntime as ort
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from maceq.app.cli import quantize_main
from maceq.app.pipeline import calibrate
from maceq.app.weight_grid import COLLAPSE_DB, WeightGridWarning, collapse_warnings, device_grid, weight_grid_losses
from maceq.datasets.images import ImageFolder
from maceq.datasets.preprocess import Preprocess
from maceq.quant.config import QuantConfig
from maceq.reports.verdict import _advice
from maceq.runtime.devices import Device

W_BIG = -5.57  # the weight that cancels the near-constant channel (as in U^2-Net-p's Conv_787)
LEVEL = 2000.0  # the near-constant channel's value
W2 = np.array([W_BIG, 0.3, 9.0])


def _cancelling_model(path):
    """x [1,3,16,16] -> c1 (Conv 1x1 + Relu): A = relu(LEVEL + 0.5 r), B = relu(g), C = relu(b)
    -> c2 (Conv 1x1, no activation): y = W_BIG A + 0.3 B + 9 C - W_BIG LEVEL, near -2.8 r + 0.3 g + 9 b."""
    w1 = np.zeros((3, 3, 1, 1), np.float32)
    w1[0, 0], w1[1, 1], w1[2, 2] = 0.5, 1.0, 1.0
    b1 = np.array([LEVEL, 0.0, 0.0], np.float32)
    w2 = W2.astype(np.float32).reshape(1, 3, 1, 1)
    b2 = np.array([-W_BIG * LEVEL], np.float32)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["h"], name="c1"),
             helper.make_node("Relu", ["h"], ["a"], name="r1"),
             helper.make_node("Conv", ["a", "w2", "b2"], ["y"], name="c2")]
    g = helper.make_graph(nodes, "cancel", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 16, 16])],
                          [numpy_helper.from_array(v, k) for k, v in
                           {"w1": w1, "b1": b1, "w2": w2, "b2": b2}.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    path.write_bytes(m.SerializeToString())
    return path


PRE = Preprocess(resize=(16, 16))


@pytest.fixture(scope="module")
def cal(tmp_path_factory, shared_data):
    model = _cancelling_model(tmp_path_factory.mktemp("grid") / "cancel.onnx")
    return calibrate(model, shared_data / "photos" / "calib", preprocess=PRE, config=QuantConfig(max_images=4),
                     progress=False, devices=("cpu", "gpu", "dsp"))


def test_the_cancelling_layer_is_below_zero_db_on_every_device_and_the_plain_one_is_not(cal):
    losses = weight_grid_losses(cal, ("cpu", "gpu", "dsp"))
    by = {(r.origin, r.device.value): r.sqnr_db for r in losses}
    assert {o for o, _ in by} == {"c1", "c2"}
    assert by[("c2", "gpu")] < -10.0
    for d in ("cpu", "gpu", "dsp"):
        assert by[("c2", d)] < COLLAPSE_DB
        assert by[("c1", d)] > 30.0
    assert losses[0].origin == "c2"  # worst first


def test_the_gpu_figure_equals_a_hand_computation_on_the_per_channel_int8_grid(cal, shared_data):
    """y - yq = (w - wq) . [A, B, C] with wq on the symmetric grid scale = max|w| / 127 (one output channel)."""
    x = np.concatenate([b.data for b in ImageFolder(shared_data / "photos" / "calib", PRE, labels=None,
                                                    limit=4).iter_batches(4)]).astype(np.float64)
    chans = np.stack([np.maximum(LEVEL + 0.5 * x[:, 0], 0), np.maximum(x[:, 1], 0), np.maximum(x[:, 2], 0)])
    scale = float(np.float32(9.0) / np.float32(127))
    wq = np.rint(W2.astype(np.float32) / np.float32(scale)) * scale
    y = np.tensordot(W2, chans, axes=1) - W_BIG * LEVEL
    e = np.tensordot(wq - W2, chans, axes=1)
    want = 10 * math.log10(np.sum(y * y) / np.sum(e * e))
    got = {r.device.value: r.sqnr_db for r in weight_grid_losses(cal, ("gpu",)) if r.origin == "c2"}["gpu"]
    assert got == pytest.approx(want, abs=0.01)  # every image counted (the model fixes its batch at 1)


def test_device_grid_is_what_the_builder_writes():
    w = np.random.default_rng(3).normal(size=(4, 3, 3, 3)).astype(np.float32)
    cpu = device_grid(w, Device.CPU)
    assert len(np.unique(np.round(cpu / (cpu.max() - cpu.min()) * 1e6))) <= 255  # one per-tensor grid
    assert np.abs(cpu - w).max() <= (w.max() - w.min()) / 255 / 2 * 1.01
    gpu = device_grid(w, Device.GPU)
    for o in range(4):  # per output channel: max |w| maps to code 127
        s = np.float32(np.abs(w[o]).max()) / np.float32(127)
        np.testing.assert_allclose(gpu[o] / s, np.rint(gpu[o] / s), atol=1e-4)
        assert np.abs(gpu[o]).max() == pytest.approx(np.abs(w[o]).max(), rel=1e-6)
    gemm = np.random.default_rng(4).normal(size=(5, 2)).astype(np.float32)  # MatMul: [K, N], N outputs
    g1 = device_grid(gemm, Device.GPU, out_axis=1)
    np.testing.assert_allclose(np.abs(g1).max(axis=0), np.abs(gemm).max(axis=0), rtol=1e-6)


def test_adaround_s_grid_values_are_what_is_measured(cal):
    """Where AdaRound ran, its weights are measured: here its 'choice' is the float weights themselves (no error)."""
    from dataclasses import replace
    w = np.asarray(cal.graph.const(next(n for n in cal.graph.nodes if n.name == "c2").inputs[1]))
    chosen = replace(cal, device_weights={"cpu": {"c2": w.copy()}})
    by = {(r.origin, r.device.value): r.sqnr_db for r in weight_grid_losses(chosen, ("cpu", "dsp"))}
    assert by[("c2", "cpu")] == math.inf and by[("c2", "dsp")] < COLLAPSE_DB


def test_fp32_layers_are_not_measured(cal):
    losses = weight_grid_losses(cal, ("cpu",), fp32={"c2"})
    assert [r.origin for r in losses] == ["c1"]
    assert collapse_warnings(losses) == []


def test_the_warning_names_the_layer_every_device_and_the_flag(cal):
    lines = collapse_warnings(weight_grid_losses(cal, ("cpu", "gpu")))
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith("layer 'c2' (Conv): rounding its weights")
    assert " dB on cpu, " in line and " dB on gpu " in line and line.endswith("--fp32 c2")


@pytest.mark.e2e
def test_quantize_warns_records_and_the_flag_silences_it(tmp_path, shared_data):
    model = _cancelling_model(tmp_path / "cancel.onnx")
    calib = str(shared_data / "photos" / "calib")
    common = [str(model), "--calib-dir", calib, "--resize", "16,16", "--max-images", "4", "--no-report",
              "--device", "cpu,gpu"]
    with pytest.warns(WeightGridWarning) as got:
        assert quantize_main(common + ["-o", str(tmp_path / "q")]) == 0
    lines = [str(w.message) for w in got if w.category is WeightGridWarning]
    assert len(lines) == 1 and lines[0].startswith("layer 'c2' (Conv): rounding its weights")
    assert lines[0].endswith("--fp32 c2")
    meta = yaml.safe_load((tmp_path / "q" / "cpu" / "cancel.yml").read_text())["maceq"]["weight_grid"]
    assert [c["layer"] for c in meta["collapsed"]] == ["c2"] and meta["collapsed"][0]["sqnr_db"] < 0
    assert meta["layers_measured"] == 2
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert quantize_main(common + ["-o", str(tmp_path / "f"), "--fp32", "c2"]) == 0
    assert not [w for w in got if w.category is WeightGridWarning]
    meta = yaml.safe_load((tmp_path / "f" / "gpu" / "cancel.yml").read_text())["maceq"]["weight_grid"]
    assert meta["collapsed"] == [] and meta["layers_measured"] == 1
    # the float model really is what the check says: c2 keeps a small value, -2.8 r + 0.3 g + 9 b
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    y = sess.run(None, {"x": np.full((1, 3, 16, 16), 0.5, np.float32)})[0]
    np.testing.assert_allclose(y, W_BIG * 0.25 + 0.15 + 4.5, atol=2e-3)


def test_the_verdict_advises_the_flag_first():
    report = {"recovery": [], "model": {"range_method": "percentile"},
              "weight_grid": {"cpu": {"collapsed": [{"layer": "c2", "sqnr_db": -15.44}]}},
              "float_share": {}, "summary": {"devices": {"cpu": {"top1_agreement": None}}}}
    tips = _advice(report, "cpu", [])
    assert tips[0] == ("keep in float32 what the 8-bit weight grid cannot compute: --fp32 c2 (its weights' "
                       "rounding alone leaves -15.4 dB)")
