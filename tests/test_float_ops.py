"""MACE float ops: emit_float_node -> MACE NetDef -> maceq runtime, against onnxruntime on single-op models.

Oracle: onnxruntime (CPU, float32) on the same ONNX node. Acceptance: |maceq - ort| <= 1e-5 * max(1, |ort|)
element-wise, the project's bound for fp32 layers. The emitted ops are also checked against the layouts
and argument names of MACE's own float model (../shared/data/mace_reference/fmnist_fp32.pb), which
the runtime must run to onnxruntime's accuracy.
"""
from __future__ import annotations

import ast
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

import maceq.runtime.ops_float  # noqa: F401  (registers the float kernels)
from maceq.errors import MaceqError
from maceq.mace import add_arg, mace_pb2, read_model, write_model
from maceq.mace.cpu_ops import unsupported_ops
from maceq.quant.float_emit import (
    FLOAT_EMITTABLE,
    FloatEmission,
    cancel_inverse_transposes,
    emit_float_node,
    stored_shape,
)
from maceq.quant.ir import ACT_ATTR, Graph
from maceq.quant.onnx_import import import_onnx
from maceq.runtime import load
from maceq.runtime.model import Model

TOL = 1e-5
RNG = np.random.default_rng(20240611)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got.astype(np.float64) - want) / np.maximum(1.0, np.abs(want)))) if want.size else 0.0


def _onnx_model(nodes, inputs: dict, inits: dict, outputs, opset: int):
    g = helper.make_graph(
        nodes, "t",
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)) for k, v in inputs.items()],
        [helper.make_empty_tensor_value_info(o) for o in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _ir(model: onnx.ModelProto, opset: int) -> Graph:
    if opset >= 11:
        return import_onnx(model)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.opset_import[0].version = 11  # import_onnx checks the opset only; the node keeps its attributes
    g = import_onnx(m)
    g.opset = opset
    return g


def build_net(graph: Graph, shapes: dict, emissions: list[FloatEmission], ops=None):
    net = mace_pb2.NetDef()
    arrays = {}
    for em in emissions:
        for t, arr in em.tensors:
            net.tensors.add().CopyFrom(t)
            arrays[t.name] = arr
    net.op.extend(ops if ops is not None else [op for em in emissions for op in em.ops])
    for vi in graph.inputs:
        info = net.input_info.add()
        info.name = vi.name
        info.dims.extend(stored_shape(shapes[vi.name]))
        info.data_type = mace_pb2.DT_FLOAT
        info.data_format = 1 if len(shapes[vi.name]) == 4 else 0
    for out in graph.outputs:
        info = net.output_info.add()
        info.name = out
        info.dims.extend(stored_shape(shapes[out]))
        info.data_type = mace_pb2.DT_FLOAT
        info.data_format = 1 if len(shapes[out]) == 4 else 0
    net.data_type = mace_pb2.DT_FLOAT
    return net, arrays


def emit_graph(graph: Graph, shapes: dict) -> list[FloatEmission]:
    ems = []
    for node in graph.nodes:
        ems.append(emit_float_node(node, graph=graph, shapes=shapes, inputs=list(node.inputs),
                                   output=node.outputs[0] if len(node.outputs) == 1 else list(node.outputs),
                                   op_name=node.name))
    return ems


def run_case(nodes, inputs: dict, inits: dict | None = None, *, opset: int = 17, act=None, outputs=None):
    """Emit every node, run the MACE net in maceq and the ONNX model in onnxruntime; return (rel err, ems)."""
    inits = inits or {}
    if not isinstance(nodes, list):
        nodes = [nodes]
    outputs = outputs or list(nodes[-1].output)
    model = _onnx_model(nodes, inputs, inits, outputs, opset)
    g = _ir(model, opset)
    if act is not None:
        g.nodes[0].attrs[ACT_ATTR] = act
        model = g.to_onnx()
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(outputs, {k: v for k, v in inputs.items()})
    shapes = g.infer_shapes({k: list(v.shape) for k, v in inputs.items()})
    ems = emit_graph(g, shapes)
    net, arrays = build_net(g, shapes, ems)
    assert unsupported_ops(net) == []  # every emitted op has a kernel in stock MACE's CPU runtime
    got = Model(SimpleNamespace(net_def=net, arrays=arrays, deployment=None)).run(dict(inputs))
    err = max(rel_err(got[o], w) for o, w in zip(outputs, want))
    return err, ems


def randn(*shape, s=1.0):
    return (RNG.normal(0, s, shape)).astype(np.float32)


def node(op, ins, outs=("y",), **attrs):
    return helper.make_node(op, list(ins), list(outs), name=f"{op.lower()}_node", **attrs)


def check(case_id: str, *args, **kwargs):
    err, ems = run_case(*args, **kwargs)
    assert err <= TOL, f"{case_id}: max relative error {err:.3g}"
    return ems


def op_types(ems) -> list[str]:
    return [op.type for em in ems for op in em.ops]


def args_of(op) -> dict:
    out = {}
    for a in op.arg:
        if a.HasField("s"):
            out[a.name] = a.s.decode()
        elif a.HasField("f"):
            out[a.name] = a.f
        elif a.HasField("i"):
            out[a.name] = a.i
        else:
            out[a.name] = list(a.ints) or list(a.floats)
    return out


# ------------------------------------------------------------------------------------------------
# Convolutions
# ------------------------------------------------------------------------------------------------

CONV_CASES = {
    "3x3_pad1": dict(w=(8, 4, 3, 3), attrs=dict(pads=[1, 1, 1, 1])),
    "1x1_nobias": dict(w=(6, 4, 1, 1), attrs={}, bias=False),
    "stride2_same_upper": dict(w=(8, 4, 3, 3), attrs=dict(strides=[2, 2], pads=[0, 0, 1, 1])),
    "pads_top_heavy": dict(w=(8, 4, 3, 3), attrs=dict(pads=[1, 1, 0, 0])),  # needs an explicit Pad op
    "dilation2": dict(w=(5, 4, 3, 3), attrs=dict(dilations=[2, 2], pads=[2, 2, 2, 2])),
    "auto_pad_same": dict(w=(8, 4, 3, 3), attrs=dict(auto_pad="SAME_UPPER", strides=[2, 2])),
    "group2": dict(w=(6, 2, 3, 3), attrs=dict(group=2, pads=[1, 1, 1, 1])),
    "depthwise": dict(w=(4, 1, 3, 3), attrs=dict(group=4, pads=[1, 1, 1, 1])),
    "depthwise_m2_s2": dict(w=(8, 1, 3, 3), attrs=dict(group=4, pads=[1, 1, 1, 1], strides=[2, 2])),
    "depthwise_dilated": dict(w=(4, 1, 3, 3), attrs=dict(group=4, pads=[2, 2, 2, 2], dilations=[2, 2])),
    "kernel_5x3": dict(w=(3, 4, 5, 3), attrs=dict(pads=[2, 1, 2, 1])),
}


@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv(case):
    c = CONV_CASES[case]
    w = randn(*c["w"], s=0.3)
    inits = {"w": w}
    ins = ["x", "w"]
    if c.get("bias", True):
        inits["b"] = randn(w.shape[0])
        ins.append("b")
    check(f"Conv/{case}", node("Conv", ins, **c["attrs"]), {"x": randn(1, 4, 9, 10)}, inits)


@pytest.mark.parametrize("act", [(0.0, math.inf), (0.0, 6.0), (-1.0, 1.0), (-math.inf, 0.5)])
def test_conv_fused_activation(act):
    inits = {"w": randn(8, 4, 3, 3, s=0.5), "b": randn(8)}
    ems = check(f"Conv/act{act}", node("Conv", ["x", "w", "b"], pads=[1, 1, 1, 1]), {"x": randn(1, 4, 7, 7)},
                inits, act=act)
    conv = next(op for em in ems for op in em.ops if op.type == "Conv2D")
    if act[0] == 0.0:
        assert args_of(conv)["activation"] == ("RELU" if math.isinf(act[1]) else "RELUX")
        assert op_types(ems)[-1] == "Transpose"
    else:
        assert "activation" not in args_of(conv) and op_types(ems)[-1] == "Eltwise"


def test_conv_emits_mace_float_conventions():
    """Conv2D: Transpose to NCHW, OIHW filter, padding_values totals, data_format NONE; depthwise [M, C, KH, KW]."""
    g_ems = check("Conv/conventions", node("Conv", ["x", "w", "b"], pads=[1, 1, 1, 1], strides=[2, 2]),
                  {"x": randn(1, 3, 8, 8)}, {"w": randn(5, 3, 3, 3), "b": randn(5)})
    ops = g_ems[0].ops
    assert [op.type for op in ops] == ["Transpose", "Conv2D", "Transpose"]
    assert args_of(ops[0])["dims"] == [0, 3, 1, 2] and args_of(ops[2])["dims"] == [0, 2, 3, 1]
    a = args_of(ops[1])
    assert (a["T"], a["framework_type"], a["data_format"]) == (1, 2, 0)
    assert a["strides"] == [2, 2] and a["kernels"] == [3, 3] and a["padding_values"] == [2, 2]
    assert a["group"] == 1 and a["dilations"] == [1, 1]
    assert list(ops[1].output_shape[0].dims) == [1, 5, 4, 4]      # stored (NCHW) shape
    assert list(ops[2].output_shape[0].dims) == [1, 4, 4, 5]      # back to NHWC
    filt = dict((t.name, (list(t.dims), t.data_type)) for t, _ in g_ems[0].tensors)
    assert filt[ops[1].input[1]] == ([5, 3, 3, 3], mace_pb2.DT_FLOAT)
    dw = check("Conv/conventions_dw", node("Conv", ["x", "w"], group=3, pads=[1, 1, 1, 1]),
               {"x": randn(1, 3, 6, 6)}, {"w": randn(6, 1, 3, 3)})
    op = dw[0].ops[1]
    assert op.type == "DepthwiseConv2d" and args_of(op)["group"] == 3
    assert [list(t.dims) for t, _ in dw[0].tensors] == [[2, 3, 3, 3]]


CONVT_CASES = {
    "k3_s2_p1_op1": dict(w=(4, 6, 3, 3), attrs=dict(strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1])),
    "k2_s2": dict(w=(4, 3, 2, 2), attrs=dict(strides=[2, 2])),
    "k4_s2_p1": dict(w=(4, 5, 4, 4), attrs=dict(strides=[2, 2], pads=[1, 1, 1, 1])),
    "k3_s1_asym": dict(w=(4, 3, 3, 3), attrs=dict(pads=[1, 0, 0, 1])),
}


@pytest.mark.parametrize("case", list(CONVT_CASES))
def test_conv_transpose(case):
    c = CONVT_CASES[case]
    w = randn(*c["w"], s=0.3)
    ems = check(f"ConvTranspose/{case}", node("ConvTranspose", ["x", "w", "b"], **c["attrs"]),
                {"x": randn(1, 4, 5, 6)}, {"w": w, "b": randn(w.shape[1])})
    assert "Deconv2D" in op_types(ems)


def test_conv_transpose_fused_relu():
    check("ConvTranspose/relu", node("ConvTranspose", ["x", "w"], strides=[2, 2]), {"x": randn(1, 2, 4, 4)},
          {"w": randn(2, 3, 2, 2)}, act=(0.0, math.inf))


# ------------------------------------------------------------------------------------------------
# Matrix products
# ------------------------------------------------------------------------------------------------

def test_gemm_variants():
    x = {"x": randn(3, 16)}
    check("Gemm/transB_bias", node("Gemm", ["x", "w", "b"], transB=1), x, {"w": randn(10, 16), "b": randn(10)})
    check("Gemm/alpha_beta", node("Gemm", ["x", "w", "b"], alpha=0.5, beta=2.0), x,
          {"w": randn(16, 7), "b": randn(1, 7)})
    check("Gemm/scalar_bias", node("Gemm", ["x", "w", "b"], transB=1), x, {"w": randn(4, 16), "b": randn(1)})
    ems = check("Gemm/relu6", node("Gemm", ["x", "w", "b"], transB=1), x, {"w": randn(5, 16), "b": randn(5)},
                act=(0.0, 6.0))
    mm = ems[0].ops[0]
    assert mm.type == "MatMul" and args_of(mm)["transpose_b"] == 1 and ems[0].ops[-1].type == "Activation"


def test_flatten_gemm_chain():
    nodes = [node("Flatten", ["x"], ["f"]), helper.make_node("Gemm", ["f", "w", "b"], ["y"], transB=1, name="fc")]
    check("Flatten+Gemm", nodes, {"x": randn(2, 3, 4, 5)}, {"w": randn(7, 60), "b": randn(7)})


def test_matmul_variants():
    check("MatMul/2d_const", node("MatMul", ["x", "w"]), {"x": randn(4, 8)}, {"w": randn(8, 5)})
    check("MatMul/3d_const", node("MatMul", ["x", "w"]), {"x": randn(2, 4, 8)}, {"w": randn(8, 3)})
    check("MatMul/two_acts", node("MatMul", ["a", "b"]), {"a": randn(4, 8), "b": randn(8, 6)})


# ------------------------------------------------------------------------------------------------
# Element-wise
# ------------------------------------------------------------------------------------------------

X4 = (2, 3, 5, 6)


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Max", "Min"])
def test_binary_two_activations(op):
    b = randn(*X4)
    if op == "Div":
        b = np.where(np.abs(b) < 0.2, 0.7, b).astype(np.float32)
    check(f"{op}/same_shape", node(op, ["a", "b"]), {"a": randn(*X4), "b": b})


@pytest.mark.parametrize("op", ["Add", "Mul", "Sub", "Div"])
def test_binary_squeeze_excite_broadcast(op):
    s = (np.abs(randn(2, 3, 1, 1)) + 0.5).astype(np.float32)
    check(f"{op}/se_broadcast", node(op, ["x", "s"]), {"x": randn(*X4), "s": s})
    check(f"{op}/se_broadcast_rev", node(op, ["s", "x"]), {"x": (np.abs(randn(*X4)) + 0.5).astype(np.float32), "s": s})


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Max", "Min"])
def test_binary_with_constant(op):
    c = (np.abs(randn(3, 1, 1)) + 0.5).astype(np.float32)
    check(f"{op}/const_channel", node(op, ["x", "c"]), {"x": randn(*X4)}, {"c": c})
    check(f"{op}/const_left", node(op, ["c", "x"]), {"x": (np.abs(randn(*X4)) + 0.5).astype(np.float32)}, {"c": c})
    ems = check(f"{op}/scalar", node(op, ["x", "c"]), {"x": randn(*X4)}, {"c": np.array(1.7, np.float32)})
    assert args_of(ems[0].ops[0])["scalar_input_index"] == 1
    ems = check(f"{op}/scalar_left", node(op, ["c", "x"]), {"x": (np.abs(randn(*X4)) + 0.5).astype(np.float32)},
                {"c": np.array([2.5], np.float32)})
    assert args_of(ems[0].ops[0])["scalar_input_index"] == 0
    check(f"{op}/const_full", node(op, ["x", "c"]), {"x": randn(*X4)},
          {"c": (np.abs(randn(1, 3, 5, 6)) + 0.5).astype(np.float32)})
    check(f"{op}/2d_const", node(op, ["x", "c"]), {"x": randn(4, 7)}, {"c": (np.abs(randn(7)) + 0.5).astype(np.float32)})


def test_variadic_max_min():
    check("Max/3_inputs", node("Max", ["a", "b", "c"]), {"a": randn(*X4), "b": randn(*X4), "c": randn(*X4)})
    check("Min/3_inputs", node("Min", ["a", "b", "c"]), {"a": randn(*X4), "b": randn(*X4), "c": randn(*X4)})


ACT_CASES = {
    "Relu": dict(op="Relu"),
    "Sigmoid": dict(op="Sigmoid"),
    "Tanh": dict(op="Tanh"),
    "LeakyRelu": dict(op="LeakyRelu", attrs=dict(alpha=0.1)),
    "LeakyRelu_default": dict(op="LeakyRelu"),
    "HardSigmoid": dict(op="HardSigmoid"),
    "HardSigmoid_custom": dict(op="HardSigmoid", attrs=dict(alpha=0.3, beta=0.4)),
    "HardSwish": dict(op="HardSwish"),
}


@pytest.mark.parametrize("case", list(ACT_CASES))
@pytest.mark.parametrize("shape", [X4, (3, 11)])
def test_unary_activation(case, shape):
    c = ACT_CASES[case]
    check(f"{case}/{len(shape)}d", node(c["op"], ["x"], **c.get("attrs", {})), {"x": randn(*shape, s=3.0)})


@pytest.mark.parametrize("bounds", [(0.0, 6.0), (0.0, None), (-1.0, 1.0), (-0.5, None), (None, 2.0)])
def test_clip(bounds):
    lo, hi = bounds
    inits, ins = {}, ["x"]
    ins.append("lo" if lo is not None else "")
    if lo is not None:
        inits["lo"] = np.array(lo, np.float32)
    if hi is not None:
        ins.append("hi")
        inits["hi"] = np.array(hi, np.float32)
    ems = check(f"Clip/{bounds}", node("Clip", ins), {"x": randn(*X4, s=4.0)}, inits)
    assert ems[0].ops[0].type == ("Activation" if lo == 0.0 else "Eltwise")


def test_prelu():
    ems = check("PRelu/per_channel", node("PRelu", ["x", "s"]), {"x": randn(*X4)}, {"s": randn(3, 1, 1)})
    assert op_types(ems) == ["Transpose", "Activation", "Transpose"]
    check("PRelu/scalar", node("PRelu", ["x", "s"]), {"x": randn(*X4)}, {"s": np.array([0.2], np.float32)})
    ems = check("PRelu/2d", node("PRelu", ["x", "s"]), {"x": randn(3, 11)}, {"s": randn(11)})
    assert op_types(ems) == ["Reshape", "Activation", "Reshape"]


@pytest.mark.parametrize("op", ["Neg", "Abs"])
def test_neg_and_abs_are_exact(op):
    x = randn(*X4, s=3.0)
    ems = check(f"{op}/4d", node(op, ["x"]), {"x": x})
    assert op_types(ems) == ["Eltwise"]
    err, _ = run_case(node(op, ["x"]), {"x": x})
    assert err == 0.0  # a sign change rounds nothing


def test_pow_by_two_is_x_times_x_and_other_powers_are_maces_pow():
    x = randn(*X4, s=3.0)
    ems = check("Pow/square", node("Pow", ["x", "e"]), {"x": x}, {"e": np.array(2.0, np.float32)})
    assert op_types(ems) == ["Eltwise"] and run_case(node("Pow", ["x", "e"]), {"x": x},
                                                      {"e": np.array(2.0, np.float32)})[0] == 0.0
    pos = np.abs(randn(*X4, s=3.0)) + np.float32(0.1)
    for op, ins, inits in (("Sqrt", ["x"], {}), ("Reciprocal", ["x"], {}),
                           ("Pow", ["x", "e"], {"e": np.array(1.5, np.float32)})):
        ems = check(f"{op}/pow", node(op, ins), {"x": pos}, inits)  # within the float tolerance of onnxruntime
        (el,) = ems[0].ops
        assert el.type == "Eltwise" and [a.i for a in el.arg if a.name == "type"] == [9]  # POW
    with pytest.raises(MaceqError, match=r"only a constant scalar exponent has a MACE form"):
        run_case(node("Pow", ["x", "e"]), {"x": pos}, {"e": np.array([1.0, 2.0, 3.0], np.float32).reshape(3, 1, 1)})


def test_batchnorm():
    c = 3
    inits = {"g": randn(c), "b": randn(c), "m": randn(c), "v": (np.abs(randn(c)) + 0.1).astype(np.float32)}
    ems = check("BatchNormalization/plain", node("BatchNormalization", ["x", "g", "b", "m", "v"], epsilon=1e-3),
                {"x": randn(*X4)}, inits)
    assert op_types(ems) == ["Transpose", "BatchNorm", "Transpose"]
    check("BatchNormalization/relu", node("BatchNormalization", ["x", "g", "b", "m", "v"]), {"x": randn(*X4)},
          inits, act=(0.0, math.inf))


# ------------------------------------------------------------------------------------------------
# Pooling and reductions
# ------------------------------------------------------------------------------------------------

POOL_CASES = {
    "max_k3_s2_p1": ("MaxPool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    "max_k2_s2": ("MaxPool", dict(kernel_shape=[2, 2], strides=[2, 2])),
    "max_ceil": ("MaxPool", dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)),
    "max_pads_bottom": ("MaxPool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[0, 0, 1, 1])),
    "max_pads_top": ("MaxPool", dict(kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 0, 0])),
    "max_dilated": ("MaxPool", dict(kernel_shape=[2, 2], dilations=[2, 2])),
    "avg_k3_s1_p1": ("AveragePool", dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])),
    "avg_k2_s2": ("AveragePool", dict(kernel_shape=[2, 2], strides=[2, 2])),
    "avg_ceil": ("AveragePool", dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)),
    "avg_include_pad_nopad": ("AveragePool", dict(kernel_shape=[3, 3], count_include_pad=1)),
}


@pytest.mark.parametrize("case", list(POOL_CASES))
def test_pooling(case):
    op, attrs = POOL_CASES[case]
    ems = check(f"{op}/{case}", node(op, ["x"], **attrs), {"x": randn(2, 3, 9, 11)})
    assert "Pooling" in op_types(ems)


@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
def test_global_pool(op):
    ems = check(op, node(op, ["x"]), {"x": randn(2, 5, 6, 7)})
    red = ems[0].ops[0]
    assert red.type == "Reduce" and args_of(red)["axis"] == [1, 2] and args_of(red)["keepdims"] == 1


@pytest.mark.parametrize("axes,keepdims", [([2, 3], 1), ([2, 3], 0), ([1], 0), ([3], 0), ([1, 2], 1), ([0, 3], 0),
                                           (None, 1)])
def test_reduce_mean(axes, keepdims):
    attrs = dict(keepdims=keepdims)
    if axes is not None:
        attrs["axes"] = axes
    check(f"ReduceMean/{axes}/{keepdims}", node("ReduceMean", ["x"], **attrs), {"x": randn(2, 3, 4, 5)}, opset=17)


def test_reduce_other_kinds_and_axes_input():
    check("ReduceMin/[2]", node("ReduceMin", ["x"], axes=[2], keepdims=0), {"x": randn(2, 3, 4, 5)})
    check("ReduceProd/[1,3]", node("ReduceProd", ["x"], axes=[1, 3], keepdims=1), {"x": randn(2, 3, 4, 5, s=0.8)})
    check("ReduceMean/opset18_axes_input", node("ReduceMean", ["x", "ax"], keepdims=0), {"x": randn(2, 3, 4, 5)},
          {"ax": np.array([1, 3], np.int64)}, opset=18)
    check("ReduceMax/[1]", node("ReduceMax", ["x"], axes=[1], keepdims=1), {"x": randn(2, 3, 4, 5)})
    check("ReduceSum/3d", node("ReduceSum", ["x", "ax"], keepdims=0), {"x": randn(2, 6, 5)},
          {"ax": np.array([1], np.int64)})


# ------------------------------------------------------------------------------------------------
# Concat, Softmax, Resize
# ------------------------------------------------------------------------------------------------

def test_concat():
    check("Concat/axis1", node("Concat", ["a", "b"], axis=1), {"a": randn(2, 3, 4, 5), "b": randn(2, 2, 4, 5)})
    check("Concat/axis2", node("Concat", ["a", "b"], axis=2), {"a": randn(1, 3, 4, 5), "b": randn(1, 3, 2, 5)})
    check("Concat/axis-1", node("Concat", ["a", "b"], axis=-1), {"a": randn(1, 3, 4, 5), "b": randn(1, 3, 4, 2)})
    check("Concat/const", node("Concat", ["a", "c"], axis=1), {"a": randn(1, 3, 4, 5)}, {"c": randn(1, 2, 4, 5)})
    check("Concat/2d", node("Concat", ["a", "b", "c"], axis=1), {"a": randn(2, 3), "b": randn(2, 4), "c": randn(2, 1)})


SOFTMAX_CASES = {
    "2d": ((3, 10), dict(axis=1), 13),
    "2d_opset11": ((3, 10), dict(axis=1), 11),
    "3d_last": ((2, 3, 7), dict(axis=-1), 13),
    "4d_channel": ((2, 5, 3, 4), dict(axis=1), 13),
    "4d_h": ((2, 5, 3, 4), dict(axis=2), 13),
    "4d_w": ((2, 5, 3, 4), dict(axis=-1), 13),
    "4d_channel_1x1_opset11": ((2, 5, 1, 1), dict(axis=1), 11),
}


@pytest.mark.parametrize("case", list(SOFTMAX_CASES))
def test_softmax(case):
    shape, attrs, opset = SOFTMAX_CASES[case]
    check(f"Softmax/{case}", node("Softmax", ["x"], **attrs), {"x": randn(*shape, s=3.0)}, opset=opset)


def test_log_softmax():
    check("LogSoftmax/2d", node("LogSoftmax", ["x"], axis=1), {"x": randn(3, 10)})


def _resize(mode, ct, *, scales=None, sizes=None, nearest_mode=None, x=(1, 2, 5, 6), opset=13, expect=None):
    inits = {"roi": np.zeros(0, np.float32)}
    ins = ["x", "roi"]
    if scales is not None:
        inits["scales"] = np.array(scales, np.float32)
        ins.append("scales")
    else:
        inits["scales"] = np.zeros(0, np.float32)
        inits["sizes"] = np.array(sizes, np.int64)
        ins += ["scales", "sizes"]
    attrs = dict(mode=mode, coordinate_transformation_mode=ct)
    if nearest_mode:
        attrs["nearest_mode"] = nearest_mode
    case = f"Resize/{mode}/{ct}/{nearest_mode}/{scales or sizes}"
    ems = check(case, node("Resize", ins, **attrs), {"x": randn(*x)}, inits, opset=opset)
    if expect is not None:
        op = next(op for em in ems for op in em.ops if op.type.startswith("Resize"))
        a = args_of(op)
        assert op.type == expect[0] and a.get("align_corners") == expect[1], (op.type, a)
        assert a.get("coordinate_transformation_mode", 0) == expect[2]


def test_resize_nearest():
    _resize("nearest", "asymmetric", scales=[1, 1, 2, 2], nearest_mode="floor",
            expect=("ResizeNearestNeighbor", 0, 0))
    _resize("nearest", "half_pixel", scales=[1, 1, 2, 2], expect=("ResizeNearestNeighbor", 0, 0))
    _resize("nearest", "asymmetric", sizes=[1, 2, 8, 9], nearest_mode="floor")
    _resize("nearest", "align_corners", sizes=[1, 2, 9, 11], nearest_mode="round_prefer_ceil",
            expect=("ResizeNearestNeighbor", 1, 0))
    _resize("nearest", "asymmetric", scales=[1, 1, 0.5, 0.5], nearest_mode="floor", x=(1, 2, 8, 10))


def test_resize_linear():
    _resize("linear", "half_pixel", scales=[1, 1, 2, 2], expect=("ResizeBilinear", 0, 1))
    _resize("linear", "pytorch_half_pixel", sizes=[1, 2, 9, 13], expect=("ResizeBilinear", 0, 1))
    _resize("linear", "align_corners", sizes=[1, 2, 9, 11], expect=("ResizeBilinear", 1, 0))
    _resize("linear", "asymmetric", scales=[1, 1, 2, 3], expect=("ResizeBilinear", 0, 0))
    _resize("linear", "half_pixel", scales=[1, 1, 0.5, 0.5], x=(1, 2, 8, 10))


def test_resize_unmatched_rule_is_refused():
    g, shapes = _ir_and_shapes(node("Resize", ["x", "roi", "scales"], mode="nearest",
                                    coordinate_transformation_mode="asymmetric", nearest_mode="round_prefer_ceil"),
                               {"x": randn(1, 2, 5, 5)},
                               {"roi": np.zeros(0, np.float32), "scales": np.array([1, 1, 2, 2], np.float32)})
    with pytest.raises(MaceqError, match="resize_node.*neither"):
        emit_graph(g, shapes)


def test_upsample_opset9():
    check("Upsample/nearest", node("Upsample", ["x", "s"], mode="nearest"), {"x": randn(1, 3, 4, 5)},
          {"s": np.array([1, 1, 2, 2], np.float32)}, opset=9)
    check("Upsample/linear", node("Upsample", ["x", "s"], mode="linear"), {"x": randn(1, 3, 4, 5)},
          {"s": np.array([1, 1, 2, 2], np.float32)}, opset=9)


# ------------------------------------------------------------------------------------------------
# Data movement and reshapes
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("perm", [[0, 2, 3, 1], [0, 1, 3, 2], [0, 3, 1, 2], [3, 2, 1, 0]])
def test_transpose_4d(perm):
    check(f"Transpose/{perm}", node("Transpose", ["x"], perm=perm), {"x": randn(2, 3, 4, 5)})


def test_transpose_low_rank():
    check("Transpose/3d", node("Transpose", ["x"], perm=[0, 2, 1]), {"x": randn(2, 3, 4)})
    check("Transpose/2d", node("Transpose", ["x"]), {"x": randn(3, 4)})


def test_pad():
    inits = {"p": np.array([0, 0, 1, 2, 0, 0, 2, 1], np.int64), "v": np.array(0.5, np.float32)}
    check("Pad/constant", node("Pad", ["x", "p", "v"]), {"x": randn(1, 3, 4, 5)}, inits)
    check("Pad/channels", node("Pad", ["x", "p"]), {"x": randn(1, 3, 4, 5)},
          {"p": np.array([0, 1, 0, 0, 0, 2, 0, 0], np.int64)})
    check("Pad/reflect", node("Pad", ["x", "p"], mode="reflect"), {"x": randn(1, 3, 4, 5)},
          {"p": np.array([0, 0, 1, 2, 0, 0, 2, 1], np.int64)})


def test_split():
    check("Split/equal_axis1", node("Split", ["x"], ["y0", "y1"], axis=1), {"x": randn(2, 4, 3, 5)}, opset=17,
          outputs=["y0", "y1"])
    ems = check("Split/unequal", node("Split", ["x", "s"], ["y0", "y1"], axis=1), {"x": randn(2, 6, 3, 5)},
                {"s": np.array([2, 4], np.int64)}, outputs=["y0", "y1"])
    assert op_types(ems) == ["StridedSlice", "StridedSlice"]
    check("Split/axis3_three", node("Split", ["x"], ["y0", "y1", "y2"], axis=3), {"x": randn(1, 2, 3, 6)},
          outputs=["y0", "y1", "y2"])
    check("Split/2d", node("Split", ["x", "s"], ["y0", "y1"], axis=1), {"x": randn(3, 7)},
          {"s": np.array([3, 4], np.int64)}, outputs=["y0", "y1"])


def test_slice():
    def sl(case, x, starts, ends, axes=None, steps=None):
        inits = {"st": np.array(starts, np.int64), "en": np.array(ends, np.int64)}
        ins = ["x", "st", "en"]
        if axes is not None:
            inits["ax"] = np.array(axes, np.int64)
            ins.append("ax")
        if steps is not None:
            inits["sp"] = np.array(steps, np.int64)
            ins.append("sp")
        check(f"Slice/{case}", node("Slice", ins), {"x": x}, inits)

    sl("hw", randn(1, 3, 8, 9), [1, 2], [6, -1], [2, 3])
    sl("channels", randn(2, 6, 4, 4), [1], [5], [1])
    sl("steps", randn(1, 4, 9, 9), [0, 1], [9, 100], [2, 3], [2, 3])
    sl("2d", randn(5, 8), [1, -3], [4, 1000], [0, 1])


RESHAPE_CASES = {
    "flatten_4d": ("Flatten", (2, 3, 4, 5), dict(axis=1), None),
    "flatten_axis2": ("Flatten", (2, 3, 4, 5), dict(axis=2), None),
    "flatten_1x1": ("Flatten", (2, 7, 1, 1), {}, None),
    "reshape_4d_4d": ("Reshape", (1, 4, 3, 2), {}, [1, 2, 6, 2]),
    "reshape_2d_4d": ("Reshape", (2, 12), {}, [2, 3, 2, 2]),
    "reshape_neg": ("Reshape", (2, 3, 4, 5), {}, [0, -1, 10]),
}


@pytest.mark.parametrize("case", list(RESHAPE_CASES))
def test_reshape_family(case):
    op, shape, attrs, target = RESHAPE_CASES[case]
    if target is None:
        check(f"{op}/{case}", node(op, ["x"], **attrs), {"x": randn(*shape)})
    else:
        check(f"{op}/{case}", node(op, ["x", "s"], **attrs), {"x": randn(*shape)}, {"s": np.array(target, np.int64)})


def test_squeeze_unsqueeze():
    check("Squeeze/[2,3]", node("Squeeze", ["x", "a"]), {"x": randn(2, 5, 1, 1)}, {"a": np.array([2, 3], np.int64)})
    check("Squeeze/[0]", node("Squeeze", ["x", "a"]), {"x": randn(1, 3, 4, 2)}, {"a": np.array([0], np.int64)})
    check("Unsqueeze/2d_to_4d", node("Unsqueeze", ["x", "a"]), {"x": randn(2, 5)}, {"a": np.array([2, 3], np.int64)})
    check("Unsqueeze/3d_to_4d", node("Unsqueeze", ["x", "a"]), {"x": randn(3, 4, 2)}, {"a": np.array([0], np.int64)})


# ------------------------------------------------------------------------------------------------
# Chains, transposes cancelled, errors, file round trip
# ------------------------------------------------------------------------------------------------

def _ir_and_shapes(nodes, inputs, inits, opset=17):
    nodes = nodes if isinstance(nodes, list) else [nodes]
    model = _onnx_model(nodes, inputs, inits, list(nodes[-1].output), opset)
    g = _ir(model, opset)
    return g, g.infer_shapes({k: list(v.shape) for k, v in inputs.items()})


def _chain():
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("MaxPool", ["c1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2], name="pool"),
             helper.make_node("Conv", ["p1", "w2"], ["c2"], group=6, pads=[1, 1, 1, 1], name="dw"),
             helper.make_node("HardSwish", ["c2"], ["h"], name="hswish"),
             helper.make_node("Resize", ["h", "", "sc"], ["r"], mode="nearest", name="up"),
             helper.make_node("Concat", ["r", "c1"], ["y"], axis=1, name="cat")]
    inits = {"w1": randn(6, 3, 3, 3, s=0.4), "b1": randn(6), "w2": randn(6, 1, 3, 3, s=0.4),
             "sc": np.array([1, 1, 2, 2], np.float32)}
    return nodes, {"x": randn(2, 3, 8, 8)}, inits


def test_chain_and_cancelled_transposes():
    nodes, inputs, inits = _chain()
    err, ems = run_case(nodes, inputs, inits)
    assert err <= TOL
    g, shapes = _ir_and_shapes(nodes, inputs, inits)
    ops = [op for em in emit_graph(g, shapes) for op in em.ops]
    slim = cancel_inverse_transposes(ops, keep=set(g.outputs))
    # conv1 -> pool: the pool's Transpose goes (conv1's stays for the Concat); pool -> dw: both go
    assert sum(op.type == "Transpose" for op in slim) == sum(op.type == "Transpose" for op in ops) - 3
    net, arrays = build_net(g, shapes, ems, ops=slim)
    got = Model(SimpleNamespace(net_def=net, arrays=arrays, deployment=None)).run(inputs)["y"]
    want = ort.InferenceSession(_onnx_model(nodes, inputs, inits, ["y"], 17).SerializeToString()).run(None, inputs)[0]
    assert rel_err(got, want) <= TOL


def test_write_read_round_trip(tmp_path):
    nodes, inputs, inits = _chain()
    g, shapes = _ir_and_shapes(nodes, inputs, inits)
    ems = emit_graph(g, shapes)
    net, arrays = build_net(g, shapes, ems)
    net.name = "default_graph"
    multi = mace_pb2.MultiNetDef()
    multi.net_def.append(net)
    multi.input_tensor.append("x")
    multi.output_tensor.append("y")
    files = write_model(tmp_path, "floatops", multi, arrays)
    loaded = read_model(files.yml)
    assert all(np.array_equal(loaded.arrays[k], v) for k, v in arrays.items())
    direct = Model(SimpleNamespace(net_def=net, arrays=arrays, deployment=None)).run(inputs)["y"]
    # the written yml declares the NHWC input_info as the input format
    again = load(files.pb).run({"x": inputs["x"].transpose(0, 2, 3, 1)})["y"]
    assert np.array_equal(direct, again)


@pytest.mark.parametrize("bad,match", [
    (node("ConvTranspose", ["x", "w"], group=2), "group"),
    (node("Pad", ["x", "p"], mode="edge"), "mode 'edge'"),
    (node("Resize", ["x", "roi", "scales"], mode="cubic"), "mode 'cubic'"),
    (node("Softmax", ["x"], axis=1), "flattened axes"),
])
def test_unsupported_combinations_name_the_node(bad, match):
    inits = {"w": randn(4, 2, 3, 3), "p": np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64),
             "roi": np.zeros(0, np.float32), "scales": np.array([1, 1, 2, 2], np.float32)}
    inits = {k: v for k, v in inits.items() if k in bad.input}
    opset = 11 if bad.op_type == "Softmax" else 17
    g, shapes = _ir_and_shapes(bad, {"x": randn(1, 4, 4, 4)}, inits, opset=opset)
    with pytest.raises(MaceqError, match=rf"node '{bad.name}'.*{match}"):
        emit_graph(g, shapes)


def test_unknown_op_type_is_refused():
    g, shapes = _ir_and_shapes(node("Erf", ["x"]), {"x": randn(2, 3)}, {})
    assert "Erf" not in FLOAT_EMITTABLE
    with pytest.raises(MaceqError, match="erf_node.*no MACE float emitter"):
        emit_graph(g, shapes)


# ------------------------------------------------------------------------------------------------
# Runtime on ops written the way MACE's converter writes a float model (data_format AUTO, NHWC-form args)
# ------------------------------------------------------------------------------------------------

def _mace_op(op_type, inputs, outputs, args, out_shape):
    op = mace_pb2.OperatorDef()
    op.name, op.type = f"{op_type.lower()}_op", op_type
    op.input.extend(inputs)
    op.output.extend(outputs)
    for k, v in [("T", 1), ("framework_type", 2), ("data_format", 1000)] + list(args.items()):
        add_arg(op, k, v)
    for _ in outputs:
        op.output_shape.add().dims.extend(out_shape)
    return op


def _run_converter_style(op, consts: dict, x: np.ndarray, outputs: dict):
    """Run one converter-style op on NCHW ``x`` (fed as the NHWC model input)."""
    net = mace_pb2.NetDef()
    for k, v in consts.items():
        t = net.tensors.add()
        t.name, t.data_type = k, (mace_pb2.DT_INT32 if v.dtype.kind == "i" else mace_pb2.DT_FLOAT)
        t.dims.extend(v.shape)
    info = net.input_info.add()
    info.name, info.data_type, info.data_format = "x", mace_pb2.DT_FLOAT, 1
    info.dims.extend(stored_shape(x.shape))
    for name, shape in outputs.items():
        o = net.output_info.add()
        o.name, o.data_type, o.data_format = name, mace_pb2.DT_FLOAT, 1 if len(shape) == 4 else 0
        o.dims.extend(shape)
    net.op.append(op)
    return Model(SimpleNamespace(net_def=net, arrays=consts, deployment=None)).run({"x": x})


def _ort(onnx_node, x, inits, outputs, opset=13):
    m = _onnx_model([onnx_node], {"x": x}, inits, outputs, opset)
    return ort.InferenceSession(m.SerializeToString()).run(outputs, {"x": x})


def test_converter_style_float_ops():
    x = randn(2, 4, 6, 7)
    c = 4
    cases = []
    cases.append(("Pooling", _mace_op("Pooling", ["x"], ["y"], {"strides": [2, 2], "kernels": [3, 3],
                                      "padding_values": [2, 2], "pooling_type": 2, "round_mode": 0}, [2, 3, 4, 4]),
                  {}, node("MaxPool", ["x"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]), {}))
    cases.append(("Softmax", _mace_op("Softmax", ["x"], ["y"], {"has_data_format": 1}, [2, 6, 7, 4]),
                  {}, node("Softmax", ["x"], axis=1), {}))
    cases.append(("Pad", _mace_op("Pad", ["x"], ["y"], {"paddings": [0, 0, 1, 2, 2, 1, 0, 0],
                                                         "constant_value": 0.25, "has_data_format": 1}, [2, 9, 10, 4]),
                  {}, node("Pad", ["x", "p", "v"]),
                  {"p": np.array([0, 0, 1, 2, 0, 0, 2, 1], np.int64), "v": np.array(0.25, np.float32)}))
    bias = randn(c)
    cases.append(("Eltwise per-channel", _mace_op("Eltwise", ["x", "bias"], ["y"], {"type": 0, "has_data_format": 1},
                                                  [2, 6, 7, 4]),
                  {"bias": bias}, node("Add", ["x", "b"]), {"b": bias.reshape(c, 1, 1)}))
    scale, offset = randn(c), randn(c)
    cases.append(("BatchNorm", _mace_op("BatchNorm", ["x", "scale", "offset"], ["y"], {}, [2, 6, 7, 4]),
                  {"scale": scale, "offset": offset}, node("BatchNormalization", ["x", "g", "b", "m", "v"], epsilon=0.0),
                  {"g": scale, "b": offset, "m": np.zeros(c, np.float32), "v": np.ones(c, np.float32)}))
    cases.append(("ResizeBilinear", _mace_op("ResizeBilinear", ["x"], ["y"], {"size": [12, 14], "align_corners": 0},
                                             [2, 12, 14, 4]),
                  {}, node("Resize", ["x", "", "s"], mode="linear", coordinate_transformation_mode="asymmetric"),
                  {"s": np.array([1, 1, 2, 2], np.float32)}))
    w = randn(4, 3, 3, 3)
    cases.append(("Deconv2D", _mace_op("Deconv2D", ["x", "w"], ["y"], {"strides": [2, 2], "padding_values": [2, 2]},
                                       [2, 11, 13, 3]),
                  {"w": w.transpose(1, 0, 2, 3).copy()}, node("ConvTranspose", ["x", "w"], strides=[2, 2],
                                                             pads=[1, 1, 1, 1]), {"w": w}))
    alpha = randn(c)
    cases.append(("PRELU", _mace_op("Activation", ["x", "a"], ["y"], {"activation": "PRELU"}, [2, 6, 7, 4]),
                  {"a": alpha}, node("PRelu", ["x", "s"]), {"s": alpha.reshape(c, 1, 1)}))
    cases.append(("StridedSlice", _mace_op("StridedSlice", ["x", "b", "e", "s"], ["y"], {"has_data_format": 1},
                                           [2, 4, 5, 2]),
                  {"b": np.array([0, 1, 1, 1], np.int32), "e": np.array([2, 5, 6, 3], np.int32),
                   "s": np.array([1, 1, 1, 1], np.int32)},
                  node("Slice", ["x", "st", "en", "ax"]),
                  {"st": np.array([1, 1, 1], np.int64), "en": np.array([3, 5, 6], np.int64),
                   "ax": np.array([1, 2, 3], np.int64)}))
    for name, op, consts, onnx_node, inits in cases:
        want = _ort(onnx_node, x, inits, ["y"])[0]
        got = _run_converter_style(op, consts, x, {"y": list(op.output_shape[0].dims)})["y"]
        err = rel_err(got, want)
        assert err <= TOL, (name, err)


def test_converter_style_multi_input_ops():
    x = randn(2, 4, 3, 5)
    split = _mace_op("Split", ["x"], ["y0", "y1"], {"axis": 3, "has_data_format": 1}, [2, 3, 5, 2])
    got = _run_converter_style(split, {}, x, {"y0": [2, 3, 5, 2], "y1": [2, 3, 5, 2]})
    want = _ort(node("Split", ["x"], ["y0", "y1"], axis=1), x, {}, ["y0", "y1"], opset=17)
    assert max(rel_err(got[k], w) for k, w in zip(["y0", "y1"], want)) <= TOL
    concat = _mace_op("Concat", ["x", "c"], ["y"], {"axis": 3, "has_data_format": 1}, [2, 3, 5, 6])
    cst = randn(1, 2, 3, 5)  # MACE's converter leaves a 4-D constant in NCHW
    got = _run_converter_style(concat, {"c": cst}, x[:1], {"y": [1, 3, 5, 6]})["y"]
    want = np.concatenate([x[:1], cst], axis=1)
    assert rel_err(got, want) <= TOL
    w = randn(6, 4, 3, 5)
    fc = _mace_op("FullyConnected", ["x", "w"], ["y"], {}, [2, 1, 1, 6])
    got = _run_converter_style(fc, {"w": w}, x, {"y": [2, 1, 1, 6]})["y"]
    want = (x.reshape(2, -1) @ w.reshape(6, -1).T).reshape(2, 6, 1, 1)
    assert rel_err(got, want) <= TOL


def test_every_emittable_op_is_exercised():
    """Every ONNX op type in FLOAT_EMITTABLE is the op of a case in this file (read from its source, so
    the check does not depend on which other tests ran, or in which order)."""
    tree = ast.parse(Path(__file__).read_text())
    named = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert FLOAT_EMITTABLE <= named | {"Flatten"}, sorted(FLOAT_EMITTABLE - named)


# ------------------------------------------------------------------------------------------------
# MACE's own float model
# ------------------------------------------------------------------------------------------------

def _fmnist_images(shared: Path, per_class: int = 3) -> np.ndarray:
    imgs = []
    for cls in sorted((shared / "fashion_mnist" / "test").iterdir()):
        for p in sorted(cls.glob("*.png"))[:per_class]:
            a = np.asarray(Image.open(p).convert("L"), np.float32)
            imgs.append(((a / 255.0 - 0.2860) / 0.3530)[None])
    return np.stack(imgs).astype(np.float32)


def test_mace_reference_float_model_matches_onnxruntime(shared_data):
    """fmnist_fp32.pb (MACE's converter): OIHW Conv2D, [1, C, 3, 3] depthwise, Reduce axis [1, 2],
    Reshape with an int32 shape input, MatMul with transpose_b and a bias input."""
    model = load(shared_data / "mace_reference" / "fmnist_fp32.pb")
    x = _fmnist_images(shared_data)
    got = np.concatenate([model.run({"input": x[i:i + 1]})["logits"] for i in range(len(x))])
    sess = ort.InferenceSession(str(shared_data / "models" / "fmnist_mobilenet.onnx"))
    want = sess.run(None, {"input": x})[0]
    err = rel_err(got, want)
    assert err <= TOL
    assert np.array_equal(got.argmax(1), want.argmax(1))
    batched = model.run({"input": x})["logits"]
    assert rel_err(batched, want) <= TOL


