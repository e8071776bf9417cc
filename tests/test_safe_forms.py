"""Safe forms: ops the device computes wrongly are written as an explicit uint8 Pad + unpadded op."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import yaml

from maceq.app.cli import quantize_main
from maceq.runtime import devices, load
from maceq.runtime.graph import RtOp
from maceq.runtime.kernel import Placement, PreparedOp
from maceq.runtime.ops import Pad
from maceq.runtime.qtypes import QInfo

SWEEP = "mace_arm/dw3x3_sweep/h08_s2_p1111_c08"


def _quantize(shared_data, out, *extra):
    src = shared_data / SWEEP / "model.onnx"
    argv = [str(src), "--calib-dir", str(shared_data / "photos" / "calib"), "--max-images", "16",
            "--resize", "8,8", "--input-shape", "1,3,8,8", "-o", str(out), "-q", "--no-report", *extra]
    assert quantize_main(argv) == 0
    return load(out / "model.yml")


@pytest.mark.e2e
def test_default_writes_a_pad_and_an_unpadded_depthwise_that_compute_the_model(shared_data, tmp_path, monkeypatch,
                                                                              capsys):
    safe = _quantize(shared_data, tmp_path / "safe")
    printed = capsys.readouterr().out
    assert "1 op(s) rewritten into a form the device computes right" in printed
    assert "+1 Pad op(s) (4 -> 5 ops)" in printed
    types = [op.type for op in safe.ops]
    assert types == ["Quantize", "Conv2D", "Pad", "DepthwiseConv2d", "Dequantize"]
    pad, dw = safe.ops[2], safe.ops[3]
    assert pad.arg("paddings") == [0, 0, 1, 1, 1, 1, 0, 0] and pad.arg("pad_type") == 0
    assert dw.arg("padding_values") == [0, 0] and dw.inputs[0] == pad.outputs[0]
    assert pad.output_shapes[0] == (1, 10, 10, 8)
    meta = yaml.safe_load((tmp_path / "safe" / "model.yml").read_text())["maceq"]
    assert [f["op"] for f in meta["safe_forms"]] == [dw.name] and "deviations" not in meta
    assert safe.deviations("cpu") == {}

    kept = _quantize(shared_data, tmp_path / "kept", "--no-safe-forms")
    assert "kept in a form the device computes differently" in capsys.readouterr().out
    assert [op.type for op in kept.ops] == ["Quantize", "Conv2D", "DepthwiseConv2d", "Dequantize"]
    assert "last output row and the last output column" in kept.deviations("cpu")[kept.ops[2].name]
    meta = yaml.safe_load((tmp_path / "kept" / "model.yml").read_text())["maceq"]
    assert list(meta["deviations"]) == [kept.ops[2].name]

    x = np.load(shared_data / SWEEP / "inputs.npy")
    mace = np.load(shared_data / SWEEP / "mace_outputs.npy")  # stock MACE on the original form
    y_safe = safe.run({"input": x}, device="cpu")["output"]
    y_kept = kept.run({"input": x}, device="cpu")["output"]
    assert np.array_equal(y_kept, mace)  # the same ranges as the golden model: the simulation is the device
    edge = np.zeros(y_kept.shape, bool)
    edge[:, :, -1, :] = edge[:, :, :, -1] = True
    assert np.array_equal(y_safe[~edge], y_kept[~edge]) and not np.array_equal(y_safe[edge], y_kept[edge])
    # the model's meaning: the original form without the fast path's border
    cpu = dataclasses.replace(devices.CPU, depthwise_3x3_fast_path=False)
    monkeypatch.setitem(devices.SPECS, devices.Device.CPU, cpu)
    kept._prepared.clear()
    kept._kernels.clear()
    assert np.array_equal(kept.run({"input": x}, device="cpu")["output"], y_safe)


@pytest.mark.unit
def test_uint8_pad_fills_with_the_quantized_constant():
    x = np.arange(2 * 2 * 3, dtype=np.uint8).reshape(1, 2, 2, 3) + 100
    q = QInfo(0.1, 3)

    def run(value, pads):
        op = RtOp("p", "Pad", ("x",), ("y",), {"paddings": pads, "pad_type": 0, "constant_value": value}, (), ())
        k = Pad()
        prepared = PreparedOp(op, k, k.prepare(op, (q,), None), None, Placement(devices.Device.CPU))
        (y,) = prepared.run([type("T", (), {"values": x, "qinfo": q})()])
        return y

    y = run(0.0, [0, 0, 1, 2, 0, 1, 0, 0])
    assert y.values.shape == (1, 5, 3, 3) and y.qinfo == q
    assert np.array_equal(y.values[:, 1:3, 0:2], x)
    assert (y.values[:, 0] == 3).all() and (y.values[:, 3:] == 3).all() and (y.values[:, :, 2] == 3).all()
    assert (run(1.0, [0, 0, 1, 0, 0, 0, 0, 0]).values[:, 0] == 13).all()  # roundf(1.0 / 0.1 + 3)
    assert (run(100.0, [0, 0, 1, 0, 0, 0, 0, 0]).values[:, 0] == 255).all()  # saturates
    assert (run(-0.05, [0, 0, 1, 0, 0, 0, 0, 0]).values[:, 0] == 3).all()  # f32(-0.5 + 3) = 2.5 rounds away: 3
