"""Every op the cpu writer emits, through quantize -> MACE files -> runtime, on a small synthetic model.

The kernels themselves are checked bit for bit by tests/oracle; here the writer's op arguments and
quantize info must be read back correctly by the runtime, so the int8 model tracks the float model.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper
from PIL import Image

from maceq.app.pipeline import quantize
from maceq.calibrate.methods import RangeMethod
from maceq.datasets.images import ImageFolder
from maceq.datasets.preprocess import Preprocess
from maceq.errors import MaceqError
from maceq.quant.config import QuantConfig
from maceq.runtime import load


def _model(path, *, extra_nodes=()):
    rng = np.random.default_rng(7)

    def w(*shape, s=0.3):
        return rng.normal(0, s, shape).astype(np.float32)

    inits = {"w1": w(8, 3, 3, 3), "b1": w(8), "wa": w(6, 8, 1, 1), "ba": w(6), "wb": w(4, 8, 3, 3), "bb": w(4),
             "wd": w(10, 1, 3, 3), "bd": w(10), "fc": w(5, 10), "fcb": w(5)}
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2], name="maxpool"),
        helper.make_node("Conv", ["p1", "wa", "ba"], ["ca"], name="conva"),
        helper.make_node("Conv", ["p1", "wb", "bb"], ["cb"], pads=[1, 1, 1, 1], name="convb"),
        helper.make_node("Concat", ["ca", "cb"], ["cat"], axis=1, name="concat"),
        helper.make_node("Conv", ["cat", "wd", "bd"], ["dw"], pads=[1, 1, 1, 1], group=10, name="dwconv"),
        helper.make_node("Sub", ["dw", "cat"], ["sub"], name="sub"),
        helper.make_node("AveragePool", ["sub"], ["ap"], kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1],
                         name="avgpool"),
        helper.make_node("GlobalAveragePool", ["ap"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "fc", "fcb"], ["logits"], transB=1, name="fc"),
        helper.make_node("Softmax", ["logits"], ["prob"], axis=1, name="softmax"),
        *extra_nodes,
    ]
    out = "prob" if not extra_nodes else extra_nodes[-1].output[0]
    g = helper.make_graph(nodes, "cov", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3, 16, 16])],
                          [helper.make_empty_tensor_value_info(out)],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    d = tmp_path_factory.mktemp("imgs")
    rng = np.random.default_rng(3)
    for k in range(12):
        arr = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
        arr = (arr // 2 + np.linspace(0, 120, 16, dtype=np.uint8)[None, :, None]).astype(np.uint8)
        Image.fromarray(arr).save(d / f"img{k:02d}.png")
    return d


PRE = Preprocess(scale=1 / 255, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))


def test_all_emitted_ops_round_trip(tmp_path, images):
    model_path = _model(tmp_path / "cov.onnx")
    res = quantize(model_path, images, output_dir=tmp_path / "out", preprocess=PRE,
                   config=QuantConfig(range_method=RangeMethod.MIN_MAX),
                   progress=False)
    model = load(res.files.yml)
    types = [op.type for op in model.ops]
    assert types.count("Pooling") == 2 and "Concat" in types and "Softmax" in types and "Reduce" in types
    assert "DepthwiseConv2d" in types and types.count("Eltwise") == 1 and "FullyConnected" in types
    sess = ort.InferenceSession(str(model_path))
    worst = 0.0
    for batch in ImageFolder(images, PRE, labels=None).iter_batches(1):
        f = sess.run(None, {"x": batch.data})[0]
        q = model.run({"x": batch.data})["prob"]
        assert q.shape == f.shape == (1, 5)
        worst = max(worst, float(np.abs(q - f).max()))
    assert worst < 0.05  # probabilities, quantized at 1/255 on the device
    # the views fold into FullyConnected: the MACE graph has no Flatten
    assert "Flatten" not in types and "Reshape" not in types


def test_unsupported_op_names_the_node(tmp_path, images):
    extra = [helper.make_node("Erf", ["prob"], ["erf"], name="my_erf")]
    model_path = _model(tmp_path / "erf.onnx", extra_nodes=extra)
    with pytest.raises(MaceqError, match="my_erf.*Erf"):
        quantize(model_path, images, output_dir=tmp_path / "out", preprocess=PRE, progress=False)
    assert not (tmp_path / "out" / "erf.yml").exists()


def test_bilinear_resize_is_uint8_nearest_falls_back(tmp_path, images):
    rng = np.random.default_rng(5)
    inits = {"w1": rng.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32),
             "w2": rng.normal(0, 0.3, (4, 4, 1, 1)).astype(np.float32),
             "roi": np.zeros(0, np.float32), "sc": np.array([1, 1, 2, 2], np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Resize", ["c1", "roi", "sc"], ["up"], mode="linear",
                              coordinate_transformation_mode="half_pixel", name="up_linear"),
             helper.make_node("Conv", ["up", "w2"], ["c2"], name="conv2"),
             helper.make_node("Resize", ["c2", "roi", "sc"], ["y"], mode="nearest",
                              coordinate_transformation_mode="asymmetric", nearest_mode="floor", name="up_nearest")]
    g = helper.make_graph(nodes, "rs", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3, 16, 16])],
                          [helper.make_empty_tensor_value_info("y")],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    path = tmp_path / "rs.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), path)
    res = quantize(path, images, output_dir=tmp_path / "out", preprocess=PRE, progress=False)
    assert res.placement == {"conv1": "uint8", "up_linear": "uint8", "conv2": "uint8", "up_nearest": "float32"}
    model = load(res.files.yml)
    rb = next(op for op in model.ops if op.type == "ResizeBilinear")
    assert rb.arg("T") == 2 and rb.arg("size") == [32, 32] and rb.arg("coordinate_transformation_mode") == 1
    x = next(ImageFolder(images, PRE, labels=None).iter_batches(1)).data
    run = model.run({"x": x}, intermediates=True)
    from maceq.mace.enums import ResizeCoordinateMode
    from maceq.runtime.kernels.resize import resize_bilinear_mace
    want = resize_bilinear_mace(run.tensors["c1"].values, out_hw=(32, 32), coordinate_mode=ResizeCoordinateMode.HALF_PIXEL)
    np.testing.assert_array_equal(run.tensors["up"].values, want)
    f = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    y = run.outputs["y"]
    assert y.shape == f.shape == (1, 4, 64, 64)
    assert np.corrcoef(y.ravel(), f.ravel())[0, 1] > 0.99
    assert np.abs(y - f).mean() < 0.02 * np.abs(f).max()
