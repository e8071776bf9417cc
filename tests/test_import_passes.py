"""ONNX import and graph passes: the optimised graph computes what the original computes."""
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from maceq.errors import MaceqError
from maceq.quant.ir import ACT_ATTR
from maceq.calibrate.runner import load_onnx, make_session, redeclare_input
from maceq.quant.onnx_import import fix_input_shapes, import_onnx
from maceq.quant.passes import optimize

MODELS = Path(__file__).resolve().parents[2] / "shared" / "data" / "models"


def _run(model: onnx.ModelProto, x):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


@pytest.mark.parametrize("name,n_conv,n_fused", [("fmnist_mobilenet", 20, 14), ("mobilenet_v2", 52, 35),
                                                  ("efficientnet_lite0", 49, 33)])
def test_shared_models_optimise_exactly(name, n_conv, n_fused):
    model = load_onnx(MODELS / f"{name}.onnx")
    g = import_onnx(model, source=name)
    shapes = fix_input_shapes(g, None)
    opt = optimize(g, shapes)
    ops = [n.op_type for n in opt.nodes]
    assert ops.count("Conv") == n_conv
    assert sum(1 for n in opt.nodes if n.attrs.get(ACT_ATTR) is not None) == n_fused
    assert "Clip" not in ops and "Constant" not in ops and "Shape" not in ops
    x = np.random.default_rng(0).standard_normal((2, *shapes["input"][1:])).astype(np.float32)
    np.testing.assert_array_equal(_run(opt.to_onnx(), x), _run(model, x))


def test_efficientnet_shape_subgraph_keeps_batch_dynamic():
    g = import_onnx(load_onnx(MODELS / "efficientnet_lite0.onnx"))
    opt = optimize(g, fix_input_shapes(g, None))
    reshape = [n for n in opt.nodes if n.op_type == "Reshape"]
    assert len(reshape) == 1
    assert opt.const(reshape[0].inputs[1]).tolist() == [0, -1]


def _tiny(nodes, inits, opset=17, in_shape=(1, 3, 8, 8)):
    g = helper.make_graph(nodes, "t", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, list(in_shape))],
                          [helper.make_empty_tensor_value_info("y")],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def test_batchnorm_pad_dropout_fold():
    rng = np.random.default_rng(1)
    inits = {"w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32),
             "g": rng.uniform(0.5, 2, 4).astype(np.float32), "be": rng.standard_normal(4).astype(np.float32),
             "m": rng.standard_normal(4).astype(np.float32), "v": rng.uniform(0.5, 2, 4).astype(np.float32),
             "pads": np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64)}
    nodes = [helper.make_node("Pad", ["x", "pads"], ["p"]),
             helper.make_node("Conv", ["p", "w", "b"], ["c"]),
             helper.make_node("BatchNormalization", ["c", "g", "be", "m", "v"], ["bn"], epsilon=1e-3),
             helper.make_node("Dropout", ["bn"], ["d"]),
             helper.make_node("Relu", ["d"], ["y"])]
    model = _tiny(nodes, inits)
    g = import_onnx(model)
    opt = optimize(g, fix_input_shapes(g, None))
    assert [n.op_type for n in opt.nodes] == ["Conv"]
    assert opt.nodes[0].attrs["pads"] == [1, 1, 1, 1] and opt.nodes[0].attrs[ACT_ATTR] == (0.0, float("inf"))
    x = rng.standard_normal((1, 3, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(_run(opt.to_onnx(), x), _run(model, x), rtol=1e-5, atol=1e-5)


def test_bad_models_fail_clearly(tmp_path):
    cyc = _tiny([helper.make_node("Relu", ["z"], ["y"], name="r1"), helper.make_node("Relu", ["y"], ["z"], name="r2")], {})
    with pytest.raises(MaceqError, match="cycle|produced by no"):
        import_onnx(cyc)
    dangling = _tiny([helper.make_node("Add", ["x", "nope"], ["y"], name="add0")], {})
    with pytest.raises(MaceqError, match="add0.*nope"):
        import_onnx(dangling)
    assert [n.op_type for n in import_onnx(_tiny([helper.make_node("Relu", ["x"], ["y"])], {}, opset=9)).nodes] == \
        ["Relu"]  # upgraded to opset 13 first
    with pytest.raises(MaceqError, match="opset 30 is outside the supported range 11..21"):
        import_onnx(_tiny([helper.make_node("Relu", ["x"], ["y"])], {}, opset=30))
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(MaceqError, match="bad.onnx"):
        load_onnx(bad)
    dyn = _tiny([helper.make_node("Relu", ["x"], ["y"])], {}, in_shape=("N", 3, "H", "W"))
    with pytest.raises(MaceqError, match="--input-shape"):
        fix_input_shapes(import_onnx(dyn), None)
    assert fix_input_shapes(import_onnx(dyn), [1, 3, 16, 16]) == {"x": [1, 3, 16, 16]}
    fixed = _tiny([helper.make_node("Relu", ["x"], ["y"])], {}, in_shape=(10, 3, 32, 32))
    assert fix_input_shapes(import_onnx(fixed), [1, 3, 32, 32]) == {"x": [1, 3, 32, 32]}  # the batch may change


def _conv_then(nodes, inits, in_shape=(10, 3, 32, 32)):
    """A fixed-size model: a 3x3 conv (4 channels) into ``nodes``."""
    w = np.random.default_rng(5).standard_normal((4, 3, 3, 3)).astype(np.float32)
    return _tiny([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv")] + nodes,
                 {"w": w, **inits}, in_shape=in_shape)


def test_input_shape_redeclares_a_size_no_op_pins():
    """A model exported at a fixed 32x32 whose ops take any size runs at the --input-shape size, in
    the import and in onnxruntime (the float reference eval uses); one whose op pins the size is refused."""
    free = _conv_then([helper.make_node("Relu", ["c"], ["r"]),
                       helper.make_node("Resize", ["r", "", "sc"], ["u"], mode="nearest"),
                       helper.make_node("Reshape", ["u", "flat"], ["y"], name="flatten")],
                      {"sc": np.array([1, 1, 2, 2], np.float32), "flat": np.array([1, -1], np.int64)})
    g = import_onnx(free)
    assert fix_input_shapes(g, [1, 3, 48, 64]) == {"x": [1, 3, 48, 64]}
    assert g.inputs[0].shape == [1, 3, 48, 64]
    assert g.infer_shapes({"x": [1, 3, 48, 64]})["y"] == (1, 4 * 96 * 128)
    x = np.random.default_rng(6).standard_normal((1, 3, 48, 64)).astype(np.float32)
    redeclared = redeclare_input(free, [1, 3, 48, 64])
    np.testing.assert_allclose(_run(redeclared, x), _run(g.to_onnx(), x), rtol=1e-5, atol=1e-5)
    assert _run(redeclared, x).shape == (1, 4 * 96 * 128)
    assert make_session(free, input_shape=[1, 3, 48, 64]).get_inputs()[0].shape == [1, 3, 48, 64]
    assert redeclare_input(free, [10, 3, 32, 32]) is free  # nothing to change
    pinned = {
        "to_fixed": ([helper.make_node("Reshape", ["c", "shape"], ["y"], name="to_fixed")],
                     {"shape": np.array([10, 4, 32 * 32], np.int64)}),
        "sized": ([helper.make_node("Resize", ["c", "", "", "sizes"], ["y"], name="sized", mode="nearest")],
                  {"sizes": np.array([10, 4, 64, 64], np.int64)}),
        "crop": ([helper.make_node("Slice", ["c", "st", "en", "ax"], ["y"], name="crop")],
                 {"st": np.array([0], np.int64), "en": np.array([32], np.int64), "ax": np.array([3], np.int64)}),
    }
    for name, (nodes, inits) in pinned.items():
        with pytest.raises(MaceqError, match=rf"--input-shape 10,3,32,48: node '{name}' \(\w+\) fixes its output"):
            fix_input_shapes(import_onnx(_conv_then(nodes, inits)), [10, 3, 32, 48])
    flat = _conv_then([helper.make_node("Flatten", ["c"], ["f"]),
                       helper.make_node("Gemm", ["f", "fc"], ["y"])], {"fc": np.ones((4 * 32 * 32, 2), np.float32)})
    with pytest.raises(MaceqError, match="was exported at 10x3x32x32 and the graph does not take the new size"):
        fix_input_shapes(import_onnx(flat), [1, 3, 64, 64])


def test_constant_arithmetic_and_lone_batchnorm_become_depthwise_convs():
    rng = np.random.default_rng(2)
    inits = {"w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
             "s": rng.uniform(0.5, 2, (4, 1, 1)).astype(np.float32),
             "c": np.array(3.0, np.float32), "six": np.array(6.0, np.float32),
             "g": rng.uniform(0.5, 2, 4).astype(np.float32), "be": rng.standard_normal(4).astype(np.float32),
             "m": rng.standard_normal(4).astype(np.float32), "v": rng.uniform(0.5, 2, 4).astype(np.float32),
             "zero": np.array(0.0, np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c0"], pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["c0", "s"], ["m0"]),            # folds into the conv weights
             helper.make_node("Relu", ["m0"], ["r0"]),
             helper.make_node("BatchNormalization", ["r0", "g", "be", "m", "v"], ["bn"]),  # lone BN
             helper.make_node("Add", ["bn", "c"], ["a0"]),            # HardSwish: x * clip(x + 3, 0, 6) / 6
             helper.make_node("Clip", ["a0", "zero", "six"], ["cl"]),
             helper.make_node("Mul", ["bn", "cl"], ["hs"]),
             helper.make_node("Div", ["hs", "six"], ["y"])]
    model = _tiny(nodes, inits, in_shape=("N", 3, 8, 8))
    g = import_onnx(model)
    opt = optimize(g, fix_input_shapes(g, None))
    assert [n.op_type for n in opt.nodes] == ["Conv", "Conv", "Conv", "Mul", "Conv"]
    assert [n.attrs.get("group", 1) for n in opt.nodes if n.op_type == "Conv"] == [1, 4, 4, 4]
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(_run(opt.to_onnx(), x), _run(model, x), rtol=1e-5, atol=1e-5)


def test_yolo_style_anchor_shapes_fold_once_the_input_shape_is_fixed():
    """Shape of a Range (no batch in it) stays a number; the batch an Expand reads becomes the fixed one."""
    i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
    nodes = [helper.make_node("Shape", ["x"], ["sx"]), helper.make_node("Gather", ["sx", "i2"], ["h"], axis=0),
             helper.make_node("Gather", ["sx", "i0"], ["n"], axis=0),
             helper.make_node("Cast", ["h"], ["hf"], to=onnx.TensorProto.FLOAT),
             helper.make_node("Range", ["zero", "hf", "one"], ["r"]),
             helper.make_node("Shape", ["r"], ["sr"]), helper.make_node("Unsqueeze", ["n", "ax0"], ["n1"]),
             helper.make_node("Concat", ["n1", "sr"], ["target"], axis=0),
             helper.make_node("Expand", ["r", "target"], ["grid"]),
             helper.make_node("ReduceMean", ["x"], ["m"], axes=[1, 3], keepdims=0),
             helper.make_node("Add", ["m", "grid"], ["y"], name="add")]
    inits = {"i2": np.array(2, np.int64), "i0": np.array(0, np.int64), "ax0": i64(0), "zero": np.array(0, np.float32),
             "one": np.array(1, np.float32)}
    model = _tiny(nodes, inits, opset=13, in_shape=("N", 3, 8, 8))
    opt = optimize(import_onnx(model), {"x": [1, 3, 8, 8]})
    assert [n.op_type for n in opt.nodes] == ["ReduceMean", "Add"]
    x = np.random.default_rng(5).normal(size=(1, 3, 8, 8)).astype(np.float32)
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]  # noqa: E731
    np.testing.assert_allclose(run(opt.to_onnx()), run(model), atol=1e-6)
