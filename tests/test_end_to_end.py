"""End to end: the CLIs on the embedded demo and the shared models, and MACE's own reference model."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
import yaml

from maceq.datasets.images import ImageFolder
from maceq.datasets.labels import FASHION_MNIST_CLASSES
from maceq.datasets.preprocess import PRESETS
from maceq.app.cli import maceq_main, quantize_main
from maceq.quant.config import QuantConfig
from maceq.app.pipeline import quantize
from maceq.reports.evaluate import evaluate
from maceq.runtime import load


def _fmnist_test(shared_data):
    return ImageFolder(shared_data / "fashion_mnist" / "test", PRESETS["fmnist"], classes=FASHION_MNIST_CLASSES)


def test_reference_model_from_maces_converter_runs(shared_data):
    """MACE's own uint8 model loads and runs; its 3x3 stride-2 depthwise ops take the device's deviating path.

    The agreement with float that eval reports is the device's: on the 100 images whose stock-MACE
    outputs are stored (mace_arm/models/fmnist_q8_mace_converter), it equals the agreement of
    MACE's own logits with onnxruntime's.
    """
    model = load(shared_data / "mace_reference" / "fmnist_q8.pb")
    res = evaluate(model, shared_data / "models" / "fmnist_mobilenet.onnx", _fmnist_test(shared_data),
                   progress=False)
    assert res.images == 1000
    assert abs(res.float_accuracy - res.int8_accuracy) <= 0.03
    dw = [op.name for op in model.ops if op.type == "DepthwiseConv2d" and op.arg("strides") == [2, 2]]
    assert dw and sorted(res.deviations) == sorted(dw)
    assert any("deviating" in line or "something other than the model means" in line for line in res.lines())

    golden = shared_data / "mace_arm" / "models" / "fmnist_q8_mace_converter"
    x, mace = np.load(golden / "inputs.npy"), np.load(golden / "mace_outputs.npy")
    sess = ort.InferenceSession(str(shared_data / "models" / "fmnist_mobilenet.onnx"),
                                providers=["CPUExecutionProvider"])
    f_top = sess.run(None, {sess.get_inputs()[0].name: x})[0].reshape(len(x), -1).argmax(1)
    sim_top = np.array([model.run({"input": x[i:i + 1]}, device="cpu")[model.output_names[0]].argmax()
                        for i in range(len(x))])
    assert int((sim_top == f_top).sum()) == int((mace.reshape(len(x), -1).argmax(1) == f_top).sum())


@pytest.fixture(scope="module")
def fmnist_q(tmp_path_factory, shared_data):
    out = tmp_path_factory.mktemp("fmnist")
    res = quantize(shared_data / "models" / "fmnist_mobilenet.onnx", shared_data / "fashion_mnist" / "calib",
                   output_dir=out, preprocess=PRESETS["fmnist"], config=QuantConfig(), progress=False,
                   extra_meta={"classes": list(FASHION_MNIST_CLASSES)})
    return res


def test_fmnist_within_one_point_on_1000_test_images(fmnist_q, shared_data):
    model = load(fmnist_q.files.yml)
    res = evaluate(model, shared_data / "models" / "fmnist_mobilenet.onnx", _fmnist_test(shared_data),
                   progress=False)
    assert res.images == 1000
    assert res.float_accuracy == pytest.approx(0.925, abs=0.002)  # the float model, independently known
    assert res.float_accuracy - res.int8_accuracy <= 0.01
    assert res.top1_agreement >= 0.97


def test_written_files_follow_mace_conventions(fmnist_q):
    files = fmnist_q.files
    doc = yaml.safe_load(files.yml.read_text())
    entry = doc["models"]["fmnist_mobilenet"]
    assert entry["quantize"] == 1 and entry["platform"] == "onnx" and entry["runtime"] == "cpu"
    assert entry["subgraphs"][0]["input_shapes"] == ["1,1,28,28"]
    assert doc["maceq"]["preprocess"]["color"] == "gray"
    lines = files.ranges.read_text().splitlines()
    assert all("@@" in line for line in lines) and lines[0].startswith("input@@")
    model = load(files.pb)
    types = sorted({op.type for op in model.ops})
    # Pad: the safe form of the stride-2 depthwise ops on even inputs (uint8, MACE's CPU registers it)
    assert types == ["Conv2D", "DepthwiseConv2d", "Dequantize", "Eltwise", "FullyConnected", "Pad", "Quantize",
                     "Reduce"]
    assert all(op.arg("T") == 2 for op in model.ops if op.type == "Pad")
    args = {a.name: a.i for a in model.net_def.arg}
    assert args["quantize_flag"] == 1
    for op in model.ops:
        if op.type not in ("Dequantize",):
            assert len(op.out_qinfo) == 1 and op.out_qinfo[0].scale > 0
    # Weights stay in [1, 255] (gemmlowp's non-zero LHS).
    for t in model.net_def.tensors:
        if t.data_type == 2:
            assert model.consts[t.name].min() >= 1


def test_intermediates_carry_raw_codes(fmnist_q, shared_data):
    model = load(fmnist_q.files.yml)
    x = next(_fmnist_test(shared_data).iter_batches(1)).data
    res = model.run({"input": x}, intermediates=True)
    t = res.tensors["/0/0.2/Clip_output_0"]
    assert t.values.dtype == np.uint8 and t.values.shape == (1, 28, 28, 16)
    stored = next(op for op in model.ops if op.outputs[0] == "/0/0.2/Clip_output_0").out_qinfo[0]
    assert t.qinfo.zero_point == 0 == stored.zero_point  # a ReLU6 output range starts at 0
    assert np.float32(t.qinfo.scale) == np.float32(stored.scale) <= np.float32(6 / 255)
    # The Dequantize output equals scale * (code - zp) of the last quantized tensor.
    last = res.tensors["mace_output_node_logits"]
    np.testing.assert_array_equal(res.outputs["logits"].reshape(-1),
                                  (np.float32(last.qinfo.scale) * (last.values.astype(np.int32) - last.qinfo.zero_point)
                                   ).astype(np.float32).reshape(-1))


def test_cli_demo_eval_run_inspect(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MACEQ_HOME", str(tmp_path / "home"))
    assert quantize_main(["-q"]) == 0
    out = capsys.readouterr().out
    assert "int8 accuracy" in out and "top-1 agreement" in out
    assert list(tmp_path.iterdir()) == [tmp_path / "home"]  # nothing written to the working directory
    yml = tmp_path / "home" / "fmnist_mobilenet" / "fmnist_mobilenet.yml"
    assert yml.is_file()
    from maceq.app.cli import default_assets
    img = sorted((default_assets() / "test" / "Trouser").iterdir())[0]
    assert maceq_main(["run", str(yml), "--input", str(img), "-o", str(tmp_path / "y.npy")]) == 0
    out = capsys.readouterr().out
    assert "top-5" in out and "(Trouser)" in out.splitlines()[2]
    y = np.load(tmp_path / "y.npy")
    assert y.shape == (1, 10) and int(np.argmax(y)) == 1
    assert maceq_main(["eval", str(yml), "--images", str(default_assets() / "test"), "-q",
                       "--json", str(tmp_path / "e.json")]) == 0
    rep = json.loads((tmp_path / "e.json").read_text())
    assert rep["images"] == 100 and rep["int8_accuracy"] is not None
    assert maceq_main(["inspect", str(yml)]) == 0
    out = capsys.readouterr().out
    assert "DepthwiseConv2d" in out and "FullyConnected" in out


def test_cli_bad_input_is_one_line_exit_2(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    model = tmp_path / "m.onnx"
    model.write_bytes(b"junk")
    cases = [
        ["quantize", str(model), "--calib-dir", str(empty)],
        ["quantize", str(tmp_path / "missing.onnx"), "--calib-dir", str(empty)],
        ["maceq", "inspect", str(tmp_path / "nothing.yml")],
    ]
    for argv in cases:
        fn = quantize_main if argv[0] == "quantize" else maceq_main
        assert fn(argv[1:]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    assert sorted(tmp_path.iterdir()) == sorted([empty, model])  # no half-written output


def test_console_scripts_installed():
    r = subprocess.run([sys.executable, "-m", "maceq.app.cli", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "inspect" in r.stdout


def test_mobilenet_v2_quantizes_and_evaluates(tmp_path, shared_data):
    """The issue's acceptance run, on a subset of the calibration photos to keep CI short."""
    res = quantize(shared_data / "models" / "mobilenet_v2.onnx", shared_data / "photos" / "calib",
                   output_dir=tmp_path, preprocess=PRESETS["imagenet"], config=QuantConfig(max_images=24),
                   progress=False)
    for p in (res.files.pb, res.files.data, res.files.yml, res.files.ranges):
        assert p.is_file() and p.stat().st_size > 0
    model = load(res.files.yml)
    data = ImageFolder(shared_data / "photos" / "eval", PRESETS["imagenet"], labels=None, limit=12)
    ev = evaluate(model, shared_data / "models" / "mobilenet_v2.onnx", data, progress=False)
    assert ev.images == 12
    assert ev.float_top1_in_int8_top5 >= 0.5  # per-tensor weights lose some top-1 agreement here
    # float reference independent of maceq: the int8 logits are close to onnxruntime's float logits
    sess = ort.InferenceSession(str(shared_data / "models" / "mobilenet_v2.onnx"))
    x = next(data.iter_batches(1)).data
    f = sess.run(None, {"input": x})[0]
    q = model.run({"input": x})["logits"]
    assert np.corrcoef(f.ravel(), q.ravel())[0, 1] > 0.8


def test_efficientnet_lite0_from_the_cli(tmp_path, shared_data, capsys):
    """EfficientNet-Lite0 (Shape->Gather->Unsqueeze->Concat->Reshape head) quantizes, runs and evaluates."""
    out = tmp_path / "eff"
    assert quantize_main([str(shared_data / "models" / "efficientnet_lite0.onnx"), "--calib-dir",
                          str(shared_data / "photos" / "calib"), "--preset", "tf", "--max-images", "16",
                          "-o", str(out), "-q"]) == 0
    printed = capsys.readouterr().out  # every op has a MACE uint8 kernel
    assert "nodes run in float32" not in printed and " 0 of " in printed and "compute ops in float32 (0.0% of" in printed
    model = load(out / "efficientnet_lite0.yml")
    assert {op.type for op in model.ops} == {"Quantize", "Conv2D", "DepthwiseConv2d", "Eltwise", "Reduce",
                                             "FullyConnected", "Dequantize"}
    assert maceq_main(["eval", str(out / "efficientnet_lite0.yml"), "--images", str(shared_data / "photos" / "eval"),
                       "-q", "--json", str(tmp_path / "e.json")]) == 0
    rep = json.loads((tmp_path / "e.json").read_text())
    assert rep["images"] == 91 and rep["float_top1_in_int8_top5"] >= 0.8


def test_cli_report_and_check(tmp_path, capsys, monkeypatch):
    """quantize writes the report beside the model; maceq check gates on a budget; maceq report rewrites it."""
    monkeypatch.setenv("MACEQ_HOME", str(tmp_path / "home"))
    out = tmp_path / "demo"
    assert quantize_main(["-q", "-o", str(out)]) == 0
    rep = json.loads((out / "report.json").read_text())
    assert (out / "report.html").read_text().lstrip().lower().startswith("<!doctype html")
    assert rep["devices"] == ["cpu"]
    sqnrs = sorted(L["sqnr_db"] for L in rep["layers"] if L["device"] == "cpu" and isinstance(L.get("sqnr_db"), float))
    assert len(sqnrs) > 10
    lo, hi = sqnrs[0], sqnrs[1]
    tight = tmp_path / "tight.yml"
    tight.write_text(f"layers:\n  '*': {{min_sqnr_db: {(lo + hi) / 2}}}\n")
    assert maceq_main(["check", str(out / "report.json"), "--budget", str(tight)]) == 1
    assert len([x for x in capsys.readouterr().out.splitlines() if "sqnr_db" in x]) == 1
    loose = tmp_path / "loose.yml"
    loose.write_text(f"layers:\n  '*': {{min_sqnr_db: {lo - 1}}}\n")
    assert maceq_main(["check", str(out / "report.json"), "--budget", str(loose)]) == 0
    bad = tmp_path / "bad.yml"
    bad.write_text("layers:\n  '*': {min_snr: 3}\n")
    assert maceq_main(["check", str(out / "report.json"), "--budget", str(bad)]) == 2
    from maceq.app.cli import default_assets
    assert maceq_main(["report", str(out / "fmnist_mobilenet.yml"), "--images", str(default_assets() / "test"),
                       "-o", str(tmp_path / "again"), "-q", "--analysis-images", "8"]) == 0
    assert (tmp_path / "again" / "report.json").is_file()
