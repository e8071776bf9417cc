"""Models that fix their batch size: calibration and evaluation feed batches that fit, whatever
``--batch-size`` says, and give what a run image by image gives."""
from __future__ import annotations

import numpy as np
import pytest
from maceq.calibrate.runner import BatchedSession, collect, fixed_batch, make_session
from maceq.errors import MaceqError
from onnx import TensorProto, helper, numpy_helper


def _fixed_batch_model(batch: int):
    """Relu, then a Reshape to [batch, -1]: it only runs on batches of exactly ``batch``."""
    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Reshape", ["r", "s"], ["y"], name="flat")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 6])],
        [numpy_helper.from_array(np.array([batch, -1], np.int64), "s")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("batch,n", [(1, 5), (2, 5), (3, 3), (4, 2)])
def test_run_batched_equals_one_sample_at_a_time(batch, n):
    sess = make_session(_fixed_batch_model(batch))
    assert fixed_batch(sess) == batch
    x = np.random.default_rng(batch).normal(size=(n, 2, 3)).astype(np.float32)
    y, = BatchedSession(sess).run(["y"], {"x": x})
    np.testing.assert_array_equal(y, np.maximum(x, 0).reshape(n, 6))


def test_calibration_of_a_fixed_batch_model_sees_every_image_once():
    model = _fixed_batch_model(2)
    x = np.random.default_rng(7).normal(size=(7, 2, 3)).astype(np.float32)
    stats = collect(model, ["r", "y"], [x[:5], x[5:]], progress=False)  # batches of 5 and 2 for a batch-2 model
    r = np.maximum(x, 0)
    assert stats["r"].min == float(r.min()) and stats["r"].max == float(r.max())
    assert stats["y"].count == r.size  # the filler sample of the last chunk is not counted


def test_onnxruntime_errors_come_whole_on_one_line():
    sess = make_session(_fixed_batch_model(1))
    with pytest.raises(MaceqError) as e:
        BatchedSession(sess).run(["y"], {"x": np.zeros((3, 1, 3), np.float32)}, what="calibration batch 0")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("onnxruntime failed on calibration batch 0: ")
    assert "index: 1 Got: 1 Expected: 2 Please fix" in msg and msg.endswith("Please fix either the inputs/outputs or the model.")


def test_a_graph_that_fixes_the_batch_behind_a_free_input_runs_one_sample_at_a_time():
    model = _fixed_batch_model(1)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"  # the export says any batch ...
    sess = make_session(model)
    assert fixed_batch(sess) is None
    runner = BatchedSession(sess)
    x = np.random.default_rng(9).normal(size=(4, 2, 3)).astype(np.float32)
    y, = runner.run(["y"], {"x": x})  # ... the Reshape to [1, -1] says one
    assert runner.rows == 1
    np.testing.assert_array_equal(y, np.maximum(x, 0).reshape(4, 6))


def _fixed_batch_conv(path):
    """x [1,3,16,16] (batch fixed at 1) -> Conv 3x3 + Relu -> Conv 1x1."""
    r = np.random.default_rng(0)
    inits = {"w1": (r.normal(size=(8, 3, 3, 3)) * 0.3).astype(np.float32), "b1": np.full(8, 0.1, np.float32),
             "w2": (r.normal(size=(4, 8, 1, 1)) * 0.3).astype(np.float32), "b2": np.zeros(4, np.float32)}
    g = helper.make_graph(
        [helper.make_node("Conv", ["x", "w1", "b1"], ["h"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["h"], ["a"]),
         helper.make_node("Conv", ["a", "w2", "b2"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    path.write_bytes(m.SerializeToString())
    return path


@pytest.mark.e2e
def test_the_recipe_s_per_device_steps_take_a_model_that_fixes_its_batch(tmp_path, shared_data):
    """AdaRound's and bias correction's float passes feed the calibration batches (8 images) in chunks the model
    takes, as calibration does."""
    from maceq.app.pipeline import quantize
    from maceq.datasets.preprocess import Preprocess
    from maceq.quant.config import QuantConfig
    from maceq.runtime.model import load

    res = quantize(_fixed_batch_conv(tmp_path / "fb.onnx"), shared_data / "photos" / "calib",
                   output_dir=tmp_path / "q", preprocess=Preprocess(resize=(16, 16)),
                   config=QuantConfig(max_images=16, adaround_images=16, bias_correction_images=16,
                                      adaround=True, bias_correction=True), progress=False)
    steps = {s["step"]: s for s in load(res.files.yml).maceq_meta["recovery"]}
    assert steps["adaround"]["images"] == 16 and steps["bias correction"]["images"] == 16
