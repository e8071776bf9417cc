"""auto_pad made explicit (quant/passes/autopad.py): the rewritten graph computes what onnxruntime
computes for the original, on every padding mode, odd and even sizes, both strides."""
from __future__ import annotations

import itertools

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from maceq.errors import MaceqError
from maceq.quant.onnx_import import import_onnx
from maceq.quant.passes import optimize

MODES = ("SAME_UPPER", "SAME_LOWER", "VALID")


def _model(op: str, auto: str, size: int, k: int, s: int, rng):
    attrs, ins, inits = {"auto_pad": auto, "strides": [s, s]}, ["x"], []
    if op in ("Conv", "ConvTranspose"):
        inits = [numpy_helper.from_array(rng.normal(size=(2, 2, k, k)).astype(np.float32), "w")]
        ins.append("w")
    else:
        attrs["kernel_shape"] = [k, k]
        if op == "AveragePool":
            attrs["count_include_pad"] = 0
    node = helper.make_node(op, ins, ["y"], name="n", **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, size, size])],
                          [helper.make_empty_tensor_value_info("y")], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def _run(model, x):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("op", ["Conv", "MaxPool", "AveragePool", "ConvTranspose"])
def test_explicit_pads_compute_what_auto_pad_means(op):
    rng = np.random.default_rng(0)
    checked = 0
    for auto, size, k, s in itertools.product(MODES, (7, 8, 9), (2, 3), (1, 2)):
        model = _model(op, auto, size, k, s, rng)
        x = rng.normal(size=(1, 2, size, size)).astype(np.float32)
        want = _run(model, x)
        opt = optimize(import_onnx(model), {"x": [1, 2, size, size]})
        node = opt.nodes[0]
        assert "auto_pad" not in node.attrs and len(node.attrs["pads"]) == 4
        got = _run(opt.to_onnx(), x)
        assert got.shape == want.shape, (auto, size, k, s)
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"{op} {auto} size {size} k {k} s {s}")
        checked += 1
    assert checked == 36


def test_same_upper_puts_the_odd_row_last_and_same_lower_first():
    rng = np.random.default_rng(1)
    upper = optimize(import_onnx(_model("MaxPool", "SAME_UPPER", 8, 2, 1, rng)), {"x": [1, 2, 8, 8]})
    lower = optimize(import_onnx(_model("MaxPool", "SAME_LOWER", 8, 2, 1, rng)), {"x": [1, 2, 8, 8]})
    assert upper.nodes[0].attrs["pads"] == [0, 0, 1, 1] and lower.nodes[0].attrs["pads"] == [1, 1, 0, 0]


def test_unknown_auto_pad_is_refused_naming_the_node():
    model = _model("MaxPool", "SAME_UPPER", 8, 2, 1, np.random.default_rng(2))
    model.graph.node[0].attribute[0].s = b"SAME_MIDDLE"
    with pytest.raises(MaceqError, match=r"node 'n' \(MaxPool\): unknown auto_pad 'SAME_MIDDLE'"):
        optimize(import_onnx(model), {"x": [1, 2, 8, 8]})


def test_an_opset_9_model_is_upgraded_to_13_and_computes_the_same():
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="c"),
             helper.make_node("Upsample", ["c", "sc"], ["y"], mode="nearest", name="up")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 5, 5])],
                          [helper.make_empty_tensor_value_info("y")],
                          [nh.from_array(rng.normal(size=(2, 2, 3, 3)).astype(np.float32), "w"),
                           nh.from_array(np.array([1, 1, 2, 2], np.float32), "sc")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 9)])
    x = rng.normal(size=(1, 2, 5, 5)).astype(np.float32)
    ir = import_onnx(model)
    assert [n.op_type for n in ir.nodes] == ["Conv", "Resize"]
    np.testing.assert_allclose(_run(optimize(ir, {"x": [1, 2, 5, 5]}).to_onnx(), x), _run(model, x), atol=1e-5)


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
def test_ceil_mode_becomes_end_padding_that_computes_what_onnxruntime_computes(op):
    rng = np.random.default_rng(4)
    checked = 0
    for size, k, s, p in itertools.product((5, 6, 7, 8), (2, 3), (2, 3), (0, 1)):
        attrs = dict(kernel_shape=[k, k], strides=[s, s], pads=[p, p, p, p], ceil_mode=1)
        if op == "AveragePool":
            attrs["count_include_pad"] = 0
        g = helper.make_graph([helper.make_node(op, ["x"], ["y"], name="n", **attrs)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, size, size])],
                              [helper.make_empty_tensor_value_info("y")])
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
        x = rng.normal(size=(1, 2, size, size)).astype(np.float32)
        opt = optimize(import_onnx(model), {"x": [1, 2, size, size]})
        assert "ceil_mode" not in opt.nodes[0].attrs
        got, want = _run(opt.to_onnx(), x), _run(model, x)
        assert got.shape == want.shape, (size, k, s, p)
        np.testing.assert_allclose(got, want, atol=1e-5)
        checked += 1
    assert checked == 32
