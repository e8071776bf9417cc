"""Attention q/k/v splits through a rank-5 tensor become rank-4 ops that compute the same values."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

from maceq.app.pipeline import quantize
from maceq.datasets.preprocess import Preprocess
from maceq.quant.onnx_import import fix_input_shapes, import_onnx
from maceq.quant.passes import optimize, split_qkv
from maceq.runtime import load

HEADS, DEPTH, TOKENS = 2, 4, 6
CH = 3 * HEADS * DEPTH


def _const(name, value, dtype=np.int64):
    return helper.make_node("Constant", [], [name], name=name,
                            value=numpy_helper.from_array(np.asarray(value, dtype), name))


def _paddle_split(src: str, width: int = 1, axis: int = 0, opset: int = 12) -> list:
    """Slice (start i, end i + width, on ``axis``) + Squeeze axis 0 per branch, as Paddle exports it."""
    nodes = []
    for i, name in enumerate("qkv"):
        nodes += [_const(f"st{i}", [i]), _const(f"en{i}", [i + width]), _const(f"ax{i}", [axis]),
                  _const(f"sp{i}", [1]),
                  helper.make_node("Slice", [src, f"st{i}", f"en{i}", f"ax{i}", f"sp{i}"], [f"s{i}"], name=f"slice{i}")]
        if opset >= 13:
            nodes += [_const(f"sq{i}", [0]), helper.make_node("Squeeze", [f"s{i}", f"sq{i}"], [name], name=f"sq{i}")]
        else:
            nodes.append(helper.make_node("Squeeze", [f"s{i}"], [name], axes=[0], name=f"sq{i}"))
    return nodes


def _torch_split(src: str) -> list:
    """Gather axis 0 with a scalar index per branch, as PyTorch exports ``qkv[0], qkv[1], qkv[2]``."""
    nodes = []
    for i, name in enumerate("qkv"):
        nodes += [_const(f"g{i}", i), helper.make_node("Gather", [src, f"g{i}"], [name], axis=0, name=f"gather{i}")]
    return nodes


def _attention(form: str, *, perm=(2, 0, 3, 1, 4), opset: int = 12, extra_outputs=()) -> onnx.ModelProto:
    """x [B, N, C] -> fused q/k/v split (``form``: paddle or torch) -> softmax(q k^T) v -> [B, N, C/3]."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", TOKENS, CH])
    if form == "paddle":  # the target [0, N, 3, H, D] is computed from Shape(x), as Paddle exports it
        nodes = [helper.make_node("Shape", ["x"], ["xs"], name="shape"), _const("i1", [1]),
                 helper.make_node("Gather", ["xs", "i1"], ["n"], axis=0, name="n"),
                 _const("b0", [0]), _const("hd", [3, HEADS, DEPTH]),
                 helper.make_node("Concat", ["b0", "n", "hd"], ["target"], axis=0, name="target")]
    else:
        nodes = [_const("target", [-1, TOKENS, 3, HEADS, DEPTH])]
    nodes += [helper.make_node("Reshape", ["x", "target"], ["qkv5"], name="reshape5"),
              helper.make_node("Transpose", ["qkv5"], ["qkvT"], perm=list(perm), name="qkv_transpose")]
    nodes += _paddle_split("qkvT", opset=opset) if form == "paddle" else _torch_split("qkvT")
    nodes += [helper.make_node("Transpose", ["k"], ["kT"], perm=[0, 1, 3, 2], name="kT"),
              helper.make_node("MatMul", ["q", "kT"], ["att"], name="qk"),
              helper.make_node("Softmax", ["att"], ["p"], axis=3, name="softmax"),
              helper.make_node("MatMul", ["p", "v"], ["o"], name="pv"),
              helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3], name="merge"),
              _const("flat", [0, TOKENS, HEADS * DEPTH]),
              helper.make_node("Reshape", ["ot", "flat"], ["y"], name="flatten")]
    outs = [helper.make_empty_tensor_value_info(n) for n in ("y", *extra_outputs)]
    return helper.make_model(helper.make_graph(nodes, "attention", [x], outs),
                             opset_imports=[helper.make_opsetid("", opset)])


def _ort(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


def _optimised(model: onnx.ModelProto):
    g = import_onnx(model)
    shapes = fix_input_shapes(g, [1, TOKENS, CH])
    return optimize(g, shapes), shapes


@pytest.mark.unit
@pytest.mark.parametrize("form,opset", [("paddle", 12), ("paddle", 13), ("torch", 13)])
def test_both_export_forms_are_rewritten_exactly(form, opset):
    model = _attention(form, opset=opset, extra_outputs=("q", "k", "v"))
    opt, shapes = _optimised(model)
    assert not any(n.op_type == "Gather" or len(n.attr("perm") or []) == 5 for n in opt.nodes)
    inferred = opt.infer_shapes(shapes)
    assert max(len(s) for s in inferred.values()) == 4
    assert inferred["q"] == inferred["k"] == inferred["v"] == (1, HEADS, TOKENS, DEPTH)
    slices = [n for n in opt.nodes if n.op_type == "Slice"]
    assert [n.inputs[0] for n in slices] == ["x"] * 3
    assert [(int(opt.const(n.inputs[1])[0]), int(opt.const(n.inputs[2])[0])) for n in slices] == \
        [(0, 8), (8, 16), (16, 24)]
    rng = np.random.default_rng(0)
    for batch in (1, 3):  # the batch stays dynamic
        x = rng.standard_normal((batch, TOKENS, CH)).astype(np.float32)
        want, got = _ort(model, x), _ort(opt.to_onnx(extra_outputs=("q", "k", "v")), x)
        assert got[0].shape == (batch, TOKENS, HEADS * DEPTH)
        for w, g in zip(want, got):
            np.testing.assert_array_equal(g, w)
    q = x.reshape(batch, TOKENS, 3, HEADS, DEPTH)[:, :, 0].transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(got[1], q)


@pytest.mark.unit
def test_the_pass_names_what_it_rewrote_and_keeps_tensor_names():
    g = import_onnx(_attention("torch", opset=13))
    shapes = fix_input_shapes(g, [1, TOKENS, CH])
    assert split_qkv(g, shapes) == ["qkv_transpose"]
    produced = {o: n for n in g.nodes for o in n.outputs}
    assert {produced[t].op_type for t in "qkv"} == {"Transpose"}
    assert [produced[t].attr("perm") for t in "qkv"] == [[0, 2, 1, 3]] * 3
    assert "qkv5" not in produced and "qkvT" not in produced
    assert split_qkv(g, shapes) == []


@pytest.mark.unit
@pytest.mark.parametrize("perm,parts,kept", [((2, 0, 3, 4, 1), 3, [0, 2, 3, 1]), ((2, 0, 1, 3, 4), 2, None)])
def test_other_orders_and_a_fused_key_value_are_rewritten_exactly(perm, parts, kept):
    """k^T taken straight from the split ([3, B, H, D, N]), and a fused k/v in token order ([2, B, N, H, D])."""
    ch = parts * HEADS * DEPTH
    nodes = [_const("target", [0, TOKENS, parts, HEADS, DEPTH]),
             helper.make_node("Reshape", ["x", "target"], ["five"], name="reshape5"),
             helper.make_node("Transpose", ["five"], ["parts"], perm=list(perm), name="split_transpose")]
    for i in range(parts):
        nodes += [_const(f"g{i}", i), helper.make_node("Gather", ["parts", f"g{i}"], [f"p{i}"], axis=0, name=f"p{i}")]
    graph = helper.make_graph(nodes, "parts", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", TOKENS, ch])],
                              [helper.make_empty_tensor_value_info(f"p{i}") for i in range(parts)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    g = import_onnx(model)
    shapes = fix_input_shapes(g, [1, TOKENS, ch])
    opt = optimize(g, shapes)
    produced = {o: n for n in opt.nodes for o in n.outputs}
    assert [produced[f"p{i}"].op_type for i in range(parts)] == ["Reshape" if kept is None else "Transpose"] * parts
    if kept is not None:
        assert produced["p0"].attr("perm") == kept
    x = np.random.default_rng(4).standard_normal((2, TOKENS, ch)).astype(np.float32)
    for w, o in zip(_ort(model, x), _ort(opt.to_onnx(), x)):
        np.testing.assert_array_equal(o, w)


def _near_miss(kind: str) -> onnx.ModelProto:
    """The pattern with one thing off; every one is a valid model that must be left as it is."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, TOKENS, CH])
    perm = [3, 0, 2, 1, 4] if kind == "perm" else [2, 0, 3, 1, 4]
    nodes = [_const("target", [1, TOKENS, 3, HEADS, DEPTH]),
             helper.make_node("Reshape", ["x", "target"], ["qkv5"], name="reshape5"),
             helper.make_node("Transpose", ["qkv5"], ["qkvT"], perm=perm, name="qkv_transpose")]
    outs = ["q", "k", "v"]
    if kind == "width2":  # q and k taken together, then summed
        nodes += [_const("st", [0]), _const("en", [2]), _const("ax", [0]),
                  helper.make_node("Slice", ["qkvT", "st", "en", "ax"], ["qk2"], name="slice_qk"),
                  helper.make_node("ReduceSum", ["qk2"], ["q"], axes=[0], keepdims=0, name="sum_qk")]
        nodes += _paddle_split("qkvT")[-6:]  # v only
        outs = ["q", "v"]
    elif kind == "axis1":
        nodes += _paddle_split("qkvT", axis=1)[:6]
        nodes += [helper.make_node("Squeeze", ["s0"], ["q_"], axes=[1], name="sq1")]
        nodes = [n for n in nodes if n.name != "sq0"]
        outs = ["q_"]
    elif kind == "output5":  # the rank-5 tensor is itself a graph output
        nodes += _torch_split("qkvT")
        outs = ["q", "k", "v", "qkvT"]
    elif kind == "repeat":  # two branches take the same index
        nodes += _torch_split("qkvT")[:2] + [helper.make_node("Gather", ["qkvT", "g0"], ["k"], axis=0, name="again")]
        outs = ["q", "k"]
    else:  # perm: the heads axis comes first, not the q/k/v one ([H, B, 3, N, D])
        nodes += _paddle_split("qkvT")[:12]
        outs = ["q", "k"]
    graph = helper.make_graph(nodes, "near", [x], [helper.make_empty_tensor_value_info(o) for o in outs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["perm", "width2", "axis1", "output5", "repeat"])
def test_a_near_miss_is_left_alone(kind):
    model = _near_miss(kind)
    g = import_onnx(model)
    shapes = fix_input_shapes(g, None)
    before = [(n.name, n.op_type, list(n.inputs), list(n.outputs)) for n in g.nodes]
    assert split_qkv(g, shapes) == []
    assert [(n.name, n.op_type, list(n.inputs), list(n.outputs)) for n in g.nodes] == before
    opt = optimize(g, shapes)
    assert any(len(n.attr("perm") or []) == 5 for n in opt.nodes)
    x = np.random.default_rng(2).standard_normal((1, TOKENS, CH)).astype(np.float32)
    for w, o in zip(_ort(model, x), _ort(opt.to_onnx(), x)):
        np.testing.assert_array_equal(o, w)


def _image_attention(path, size: int = 8) -> None:
    """image -> 1x1 Conv to C channels -> tokens [1, HW, C] -> q/k/v split (Paddle form) ->
    softmax(q @ k^T) @ v per head (batched 4-D MatMuls) -> tokens [1, HW, C/3] -> a linear layer."""
    rng = np.random.default_rng(3)
    hw = size * size
    inits = {"w": rng.normal(0, .5, (CH, 3, 1, 1)).astype(np.float32),
             "fc": rng.normal(0, .5, (HEADS * DEPTH, 5)).astype(np.float32),
             "tok": np.array([1, CH, hw], np.int64), "target": np.array([0, hw, 3, HEADS, DEPTH], np.int64),
             "flat": np.array([0, hw, HEADS * DEPTH], np.int64)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="embed"),
             helper.make_node("Reshape", ["c", "tok"], ["t"], name="tokens"),
             helper.make_node("Transpose", ["t"], ["seq"], perm=[0, 2, 1], name="seq"),
             helper.make_node("Reshape", ["seq", "target"], ["qkv5"], name="reshape5"),
             helper.make_node("Transpose", ["qkv5"], ["qkvT"], perm=[2, 0, 3, 1, 4], name="qkv_transpose")]
    nodes += _paddle_split("qkvT", opset=13)
    nodes += [helper.make_node("Transpose", ["k"], ["kT"], perm=[0, 1, 3, 2], name="kT"),
              helper.make_node("MatMul", ["q", "kT"], ["qk"], name="qk"),
              helper.make_node("Softmax", ["qk"], ["p"], axis=-1, name="softmax"),
              helper.make_node("MatMul", ["p", "v"], ["o"], name="pv"),
              helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3], name="merge"),
              helper.make_node("Reshape", ["ot", "flat"], ["m"], name="flatten"),
              helper.make_node("MatMul", ["m", "fc"], ["y"], name="proj")]
    graph = helper.make_graph(nodes, "img_attention",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, size, size])],
                              [helper.make_empty_tensor_value_info("y")],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)


@pytest.mark.e2e
def test_a_tiny_attention_model_quantizes_and_runs_on_every_device(tmp_path):
    path = tmp_path / "att.onnx"
    _image_attention(path)
    rng = np.random.default_rng(0)
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    for k in range(6):
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(imgs / f"{k}.png")
    devices = ("cpu", "gpu", "dsp")
    res = quantize(path, imgs, output_dir=tmp_path / "out", preprocess=Preprocess(resize=(8, 8), scale=1 / 255),
                   progress=False, devices=devices)
    assert not any(n.op_type == "Transpose" and len(n.attr("perm") or []) == 5 for n in res.graph.nodes)
    assert len(res.graph.rewrites) == 1 and res.graph.rewrites[0].startswith("'qkv_transpose': attention q/k/v")
    x = np.random.default_rng(1).uniform(0, 1, (1, 3, 8, 8)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    for d in devices:
        got = load(res.per_device[d].yml).run({"x": x}, device=d)["y"]
        assert got.shape == want.shape == (1, 64, 5), d
        err = float(np.abs(got - want).max()) / float(np.abs(want).max())
        assert err <= 0.05, (d, err)
        assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.999, d
