"""The command line refuses bad options in one line, before any work, and points at the fix."""
from __future__ import annotations

import pytest

from maceq.app.cli import maceq_main, quantize_main
from maceq.datasets.preprocess import PRESETS



def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_an_unknown_device_is_refused_before_calibration(tmp_path, capsys, shared_data):
    out = tmp_path / "out"
    rc = quantize_main([str(shared_data / "models" / "mobilenet_v2.onnx"), "--calib-dir", str(tmp_path),
                        "--device", "cpu,npu", "-o", str(out)])
    assert rc == 2 and "unknown device 'npu' (choose from cpu, gpu, dsp)" in _one_line_error(capsys)
    assert not out.exists()


def test_a_budget_without_eval_images_is_refused_before_calibration(tmp_path, capsys, shared_data):
    budget = tmp_path / "b.yml"
    budget.write_text("max_top1_drop: 1\n")
    rc = quantize_main([str(shared_data / "models" / "mobilenet_v2.onnx"), "--calib-dir", str(tmp_path),
                        "--budget", str(budget), "-o", str(tmp_path / "out")])
    assert rc == 2 and "--budget needs --eval-dir" in _one_line_error(capsys)


def test_an_option_typo_gets_one_line_with_the_closest_options(capsys):
    with pytest.raises(SystemExit) as e:
        quantize_main(["--calib-dri", "x"])
    err = _one_line_error(capsys)
    assert e.value.code == 2 and "--calib-dri" in err and "did you mean --calib-dir" in err
    assert err.endswith("see quantize --help")


def test_the_help_lists_every_preset(capsys):
    with pytest.raises(SystemExit):
        quantize_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"preprocessing preset: {', '.join(PRESETS)}" in text


@pytest.mark.parametrize("cmd", ["inspect", "eval"])
def test_an_onnx_model_given_to_maceq_asks_for_the_quantized_yml(cmd, capsys, shared_data):
    argv = [cmd, str(shared_data / "models" / "mobilenet_v2.onnx")] + (["--images", "x"] if cmd == "eval" else [])
    assert maceq_main(argv) == 2
    assert "an ONNX model; give the quantized model's .yml" in _one_line_error(capsys)


def test_top5_containment_is_printed_only_for_more_than_five_classes():
    from maceq.reports.evaluate import EvalResult

    few = EvalResult("cpu", 10, 0, 0.9, 1.0, classes=4).lines()
    many = EvalResult("cpu", 10, 0, 0.9, 0.95, classes=10).lines()
    assert not any("top-5" in line for line in few) and "top-1 agreement float vs int8:   90.00%" in few[1]
    assert "  float top-1 in int8 top-5:       95.00%" in many


def test_preprocessing_is_completed_from_the_model_input():
    from maceq.datasets.preprocess import ColorOrder, Layout, Preprocess
    from maceq.errors import MaceqError

    pre, changes = Preprocess().fitted_to(["N", 1, 28, 28])
    assert pre.color is ColorOrder.GRAY and pre.resize == (28, 28) and changes == ["grayscale", "resize to 28x28"]
    pre, changes = Preprocess(resize_short=256).fitted_to([1, 224, 224, 3])
    assert pre.layout is Layout.NHWC and pre.center_crop == (224, 224) and pre.output_shape() == (224, 224, 3)
    pre, changes = Preprocess(resize=(64, 64)).fitted_to([1, 3, 64, 64])
    assert changes == [] and pre == Preprocess(resize=(64, 64))
    with pytest.raises(MaceqError, match=r"the model input's size is free \(Nx3xHxW\).*give --resize H,W"):
        Preprocess().fitted_to(["N", 3, "H", "W"])


def test_quantize_without_a_preset_says_what_it_took_from_the_model(tmp_path, capsys, shared_data):
    rc = quantize_main([str(shared_data / "models" / "fmnist_mobilenet.onnx"), "--calib-dir",
                        str(shared_data / "fashion_mnist" / "test" / "Bag"), "--max-images", "4", "--no-report",
                        "-o", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0 and "preprocessing from the model's input Nx1x28x28: grayscale, resize to 28x28 (no --preset given)" in out


def _hostile(tmp_path):
    """Files a user might hand the CLIs by mistake, or on purpose."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    (tmp_path / "garbage.onnx").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "empty.onnx").write_bytes(b"")
    (tmp_path / "garbage.yml").write_text("models: [1, 2\n")
    (tmp_path / "list.yml").write_text("- a\n- b\n")
    (tmp_path / "garbage.pb").write_bytes(b"\x08\x96\x01" * 50)
    (tmp_path / "report.json").write_text("{not json")
    (tmp_path / "noimgs").mkdir()
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.jpg").write_text("not an image")
    w = numpy_helper.from_array(np.ones((2, 3, 1, 1), np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="c"), helper.make_node("Erf", ["c"], ["y"], name="erf")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
                          [helper.make_empty_tensor_value_info("y")], [w])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), tmp_path / "erf.onnx")
    return tmp_path


HOSTILE = [
    ("quantize", ["{t}/garbage.onnx", "--calib-dir", "{t}/txt"], "not a readable ONNX model"),
    ("quantize", ["{t}/empty.onnx", "--calib-dir", "{t}/txt"], "empty.onnx"),
    ("quantize", ["{t}", "--calib-dir", "{t}/txt"], "is a folder"),
    ("quantize", ["{t}/erf.onnx", "--calib-dir", "{t}/txt"], "unsupported op type 'Erf'"),
    ("quantize", ["{t}/erf.onnx", "--calib-dir", "{t}/noimgs", "--fp32", "nothing*"], "matches no node"),
    ("maceq", ["run", "{t}/garbage.yml", "--input", "{t}/txt/a.jpg"], "garbage.yml"),
    ("maceq", ["run", "{t}/list.yml", "--input", "{t}/txt/a.jpg"], "list.yml"),
    ("maceq", ["inspect", "{t}/garbage.pb"], "garbage"),
    ("maceq", ["eval", "{t}/garbage.yml", "--images", "{t}/noimgs"], "garbage.yml"),
    ("maceq", ["check", "{t}/report.json", "--budget", "{t}/garbage.yml"], "report.json"),
    ("maceq", ["report", "{t}/garbage.pb", "--images", "{t}/noimgs"], "garbage"),
]


@pytest.mark.parametrize("tool,argv,needle", HOSTILE, ids=[f"{t}-{a[0].split('/')[-1]}-{i}" for i, (t, a, _) in
                                                           enumerate(HOSTILE)])
def test_hostile_inputs_get_one_line_and_no_traceback(tool, argv, needle, tmp_path, capsys):
    t = _hostile(tmp_path)
    main = quantize_main if tool == "quantize" else maceq_main
    rc = main([a.format(t=t) for a in argv] + (["-o", str(t / "out")] if tool == "quantize" else []))
    err = _one_line_error(capsys)
    assert rc == 2 and needle in err and "Traceback" not in err
    assert not (t / "out").exists()


def test_an_unexpected_exception_is_one_line_and_exit_70(monkeypatch, capsys):
    """A defect inside maceq still never prints a traceback; MACEQ_DEBUG=1 lets it through."""
    from maceq.app import cli

    def broken(argv):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.delenv("MACEQ_DEBUG", raising=False)
    assert cli._run_cli(broken, []) == 70
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: internal error (RuntimeError: boom second line); please report it with the command and "
                   "model (MACEQ_DEBUG=1 shows the traceback)"]
    monkeypatch.setenv("MACEQ_DEBUG", "1")
    with pytest.raises(RuntimeError, match="boom"):
        cli._run_cli(broken, [])
