"""Manual FP32 exemptions: globs select layers, boundaries are inserted, fp32 layers match onnxruntime."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from maceq.datasets.images import ImageFolder
from maceq.datasets.labels import FASHION_MNIST_CLASSES
from maceq.datasets.preprocess import PRESETS
from maceq.errors import MaceqError
from maceq.quant.build import select_nodes
from maceq.quant.config import QuantConfig, config_from_dict
from maceq.app.pipeline import quantize
from maceq.quant.prepare import prepare_graph
from maceq.runtime import load


def rel_close(got, want, tol=1e-5):
    return float(np.max(np.abs(got - want) / np.maximum(1.0, np.abs(want))))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, shared_data):
    out = tmp_path_factory.mktemp("mixed")
    cfg = config_from_dict({"fp32_layers": ["/0/*", "/10/Gemm", "/3/Add"]})
    res = quantize(shared_data / "models" / "fmnist_mobilenet.onnx", shared_data / "fashion_mnist" / "calib",
                   output_dir=out, preprocess=PRESETS["fmnist"], config=cfg, progress=False)
    return res, load(res.files.yml)


def test_globs_select_fused_and_output_names(shared_data):
    opt, _, _ = prepare_graph(shared_data / "models" / "fmnist_mobilenet.onnx", input_shape=None)
    # the first conv is fused with its Clip: both names (and the output tensor) select it
    assert select_nodes(opt, ["/0/0.0/Conv"]) == select_nodes(opt, ["/0/0.2/Clip"]) == {"/0/0.2/Clip"}
    assert select_nodes(opt, ["/0/0.2/Clip_output_0"]) == {"/0/0.2/Clip"}
    assert len(select_nodes(opt, ["/1/*"])) == 4 and select_nodes(opt, ["nothing*"]) == set()  # 3 convs + Add


def test_boundaries_and_placement(mixed):
    res, model = mixed
    assert res.fp32 == {"/0/0.2/Clip", "/10/Gemm", "/3/Add"}
    assert {n for n, w in res.placement.items() if w == "float32"} >= res.fp32
    types = {op.name: (op.type, op.arg("T")) for op in model.ops}
    assert types["/0/0.2/Clip"] == ("Conv2D", 1) and types["/3/Add"] == ("Eltwise", 1)
    assert types["/10/Gemm"] == ("MatMul", 1)
    # uint8 -> fp32 Add -> uint8 needs Dequantize before and Quantize after
    assert "/3/Add_output_0__quant" in types and types["/3/Add_output_0__quant"][0] == "Quantize"
    assert sum(1 for op in model.ops if op.type == "Dequantize") >= 3
    assert model.maceq_meta["fp32_layers"] == sorted(res.fp32)


def test_fp32_layers_match_onnxruntime(mixed, shared_data):
    res, model = mixed
    x = next(ImageFolder(shared_data / "fashion_mnist" / "test", PRESETS["fmnist"], labels=None).iter_batches(2)).data
    run = model.run({"input": x}, intermediates=True)
    # first conv: fed the float input directly; compare with onnxruntime on the same input
    want = ort.InferenceSession(res.graph.to_onnx(extra_outputs=["/0/0.2/Clip_output_0"]).SerializeToString()
                                ).run(["/0/0.2/Clip_output_0"], {"input": x})[0]
    got = run.tensors["/0/0.2/Clip_output_0"].values.transpose(0, 3, 1, 2)
    assert rel_close(got, want) <= 1e-5
    # the Add: fed the device's dequantized int8 inputs, against onnxruntime's Add on those inputs
    add = next(n for n in res.graph.nodes if n.name == "/3/Add")
    a, b = (run.tensors[i + "__dequant"].values for i in add.inputs)
    add_model = helper.make_model(helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["y"])], "add",
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, list(a.shape)) for n in "ab"],
        [helper.make_empty_tensor_value_info("y")]), opset_imports=[helper.make_opsetid("", 17)])
    want = ort.InferenceSession(add_model.SerializeToString()).run(None, {"a": a, "b": b})[0]
    assert rel_close(run.tensors["/3/Add_output_0"].values, want) <= 1e-5
    # the final Gemm on the dequantized pooled features, against onnxruntime's Gemm
    gemm = next(n for n in res.graph.nodes if n.name == "/10/Gemm")
    feats = run.tensors["/8/GlobalAveragePool_output_0__dequant"].values.reshape(len(x), -1)
    w, bias = res.graph.const(gemm.inputs[1]), res.graph.const(gemm.inputs[2])
    gm = helper.make_model(helper.make_graph(
        [helper.make_node("Gemm", ["f", "w", "b"], ["y"], transB=1)], "g",
        [helper.make_tensor_value_info("f", onnx.TensorProto.FLOAT, list(feats.shape))],
        [helper.make_empty_tensor_value_info("y")],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(bias, "b")]), opset_imports=[helper.make_opsetid("", 17)])
    want = ort.InferenceSession(gm.SerializeToString()).run(None, {"f": feats})[0]
    assert rel_close(run.outputs["logits"], want) <= 1e-5


def test_mixed_model_accuracy(mixed, shared_data):
    from maceq.reports.evaluate import evaluate

    res, model = mixed
    data = ImageFolder(shared_data / "fashion_mnist" / "test", PRESETS["fmnist"], classes=FASHION_MNIST_CLASSES,
                       limit=200)
    ev = evaluate(model, shared_data / "models" / "fmnist_mobilenet.onnx", data, progress=False)
    assert ev.top1_agreement >= 0.97


def test_unmatched_pattern_is_an_error(tmp_path, shared_data):
    with pytest.raises(MaceqError, match="'/nope/\\*' matches no node"):
        quantize(shared_data / "models" / "fmnist_mobilenet.onnx", shared_data / "fashion_mnist" / "calib",
                 output_dir=tmp_path, preprocess=PRESETS["fmnist"], progress=False,
                 config=QuantConfig(fp32_layers=("/nope/*",)))
    with pytest.raises(MaceqError, match="fp32_layers must be a list"):
        config_from_dict({"fp32_layers": "x"})


def test_cli_auto_mode_flags(tmp_path, capsys, shared_data):
    from maceq.app.cli import quantize_main

    model = str(shared_data / "models" / "fmnist_mobilenet.onnx")
    calib = str(shared_data / "fashion_mnist" / "calib")
    assert quantize_main([model, "--calib-dir", calib, "--preset", "fmnist", "--min-sqnr", "20", "-o",
                          str(tmp_path / "a"), "-q"]) == 2
    assert "--min-sqnr needs --accuracy-budget" in capsys.readouterr().err
    # a zero budget with a cap of one layer cannot be met on the held-out calibration images: exit 3
    rc = quantize_main([model, "--calib-dir", calib, "--preset", "fmnist", "--max-images", "100",
                        "--accuracy-budget", "0", "--max-fp32-layers", "1", "--min-sqnr", "60", "-o",
                        str(tmp_path / "b"), "-q"])
    out, err = capsys.readouterr()
    assert "step 0: (all int8)" in out and "step 1:" in out
    assert rc == 3 and "--max-fp32-layers 1" in err
    assert (tmp_path / "b" / "fmnist_mobilenet.yml").is_file()  # the capped model is still written
    # the trade-off (metric vs fp32 layers vs weight bytes) is recorded in report.json and plotted in the page
    import json

    auto = json.loads((tmp_path / "b" / "report.json").read_text())["mixed_precision"]["cpu"]["auto"]
    assert auto["ok"] is False and [p["n_fp32"] for p in auto["tradeoff"]] == [0, 1]
    assert auto["tradeoff"][1]["data_bytes"] >= auto["tradeoff"][0]["data_bytes"]
    assert "trade-off on cpu" in (tmp_path / "b" / "report.html").read_text()
