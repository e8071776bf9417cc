"""Per-channel arithmetic with constants becomes convolution, which the device runs in uint8.

MACE's CPU runtime has uint8 kernels for DepthwiseConv2d but not for an
Eltwise with a constant operand, nor for BatchNorm; MACE's own converter turns a
lone BatchNorm into a depthwise convolution (TRANSFORM_SINGLE_BN_TO_DEPTHWISE_CONV).
These passes do the same for:

- ``Div(x, c)``            -> ``Mul(x, 1/c)`` (c constant);
- ``Mul(x, c)``            -> 1x1 depthwise Conv, weight c, bias 0;
- ``Add(x, c)``, ``Sub(x, c)`` -> bias folded into a producing Conv/Gemm when it has
  no other consumer, else a 1x1 depthwise Conv, weight 1, bias +-c;
- a BatchNormalization with no foldable producer -> 1x1 depthwise Conv, weight
  gamma/sqrt(var+eps), bias beta - mean*weight.

c must be a scalar or a per-channel vector broadcasting over an NCHW tensor
([C,1,1], [1,C,1,1], [C] is not per-channel in ONNX broadcasting and is left alone).
"""
from __future__ import annotations

import numpy as np

from maceq.quant.ir import ACT_ATTR, Graph, Node


def _per_channel(g: Graph, name: str, shapes, x: str):
    """The constant as a float64 [C] vector when it broadcasts per channel over NCHW x, else None."""
    if not g.is_const(name) or x not in shapes or len(shapes[x]) != 4:
        return None
    c = np.asarray(g.const(name))
    if not np.issubdtype(c.dtype, np.floating):
        return None
    ch = shapes[x][1]
    if c.size == 1:
        return np.full(ch, float(c.ravel()[0]))
    if c.ndim >= 3 and c.shape[-2:] == (1, 1) and c.size == ch and c.shape[-3] == ch:
        return c.astype(np.float64).reshape(ch)
    return None


def _depthwise(g: Graph, node: Node, x: str, weight: np.ndarray, bias: np.ndarray) -> None:
    ch = weight.size
    wname, bname = node.name + "__dw_weight", node.name + "__dw_bias"
    g.initializers[wname] = weight.astype(np.float32).reshape(ch, 1, 1, 1)
    g.initializers[bname] = bias.astype(np.float32)
    node.op_type = "Conv"
    node.inputs = [x, wname, bname]
    node.attrs = {"group": int(ch), "kernel_shape": [1, 1], "pads": [0, 0, 0, 0], "strides": [1, 1]}


def _split_operands(g: Graph, node: Node):
    a, b = node.inputs[0], node.inputs[1]
    if g.is_const(a) and not g.is_const(b) and node.op_type in ("Mul", "Add"):
        return b, a
    return a, b


def arith_to_conv(g: Graph, shapes) -> int:
    """Rewrite constant per-channel arithmetic as 1x1 depthwise convolutions; returns the count."""
    changed = 0
    for node in list(g.nodes):
        if node.op_type == "Div" and g.is_const(node.inputs[1]) and not g.is_const(node.inputs[0]):
            c = np.asarray(g.const(node.inputs[1]))
            if np.issubdtype(c.dtype, np.floating) and np.all(c != 0):
                name = node.name + "__reciprocal"
                g.initializers[name] = (1.0 / c.astype(np.float64)).astype(c.dtype)
                node.op_type, node.inputs = "Mul", [node.inputs[0], name]
        if node.op_type not in ("Mul", "Add", "Sub"):
            continue
        x, c_name = _split_operands(g, node)
        if g.is_const(x):
            continue
        vec = _per_channel(g, c_name, shapes, x)
        if vec is None:
            continue
        prod = g.producers().get(x)
        foldable = (prod is not None and prod.op_type == "Conv" and prod.attrs.get(ACT_ATTR) is None
                    and len(g.consumers().get(x, [])) == 1 and x not in g.outputs and g.is_const(prod.inputs[1]))
        if node.op_type == "Mul":
            if foldable:
                _fold_scale(g, prod, vec, node)
            else:
                _depthwise(g, node, x, vec, np.zeros_like(vec))
        else:
            sign = -1.0 if node.op_type == "Sub" else 1.0
            if foldable:
                _fold_bias(g, prod, sign * vec, node)
            else:
                _depthwise(g, node, x, np.ones_like(vec), sign * vec)
        changed += 1
    return changed


def _old_bias(g: Graph, prod: Node) -> np.ndarray:
    n_out = g.const(prod.inputs[1]).shape[0]
    return (g.const(prod.inputs[2]).astype(np.float64) if len(prod.inputs) > 2 and prod.inputs[2]
            else np.zeros(n_out))


def _fold_bias(g: Graph, prod: Node, add: np.ndarray, node: Node) -> None:
    bname = node.name + "__bias"
    g.initializers[bname] = (_old_bias(g, prod) + add).astype(np.float32)
    prod.inputs = prod.inputs[:2] + [bname]
    prod.outputs = [node.outputs[0]]
    g.nodes.remove(node)


def _fold_scale(g: Graph, prod: Node, scale: np.ndarray, node: Node) -> None:
    w = g.const(prod.inputs[1]).astype(np.float64)
    wname, bname = node.name + "__weight", node.name + "__bias"
    g.initializers[wname] = (w * scale.reshape(-1, *([1] * (w.ndim - 1)))).astype(np.float32)
    g.initializers[bname] = (_old_bias(g, prod) * scale).astype(np.float32)
    prod.inputs = [prod.inputs[0], wname, bname]
    prod.outputs = [node.outputs[0]]
    g.nodes.remove(node)


def batchnorm_to_conv(g: Graph, shapes) -> int:
    """A BatchNormalization left after folding becomes a 1x1 depthwise Conv."""
    changed = 0
    for bn in list(g.nodes):
        if bn.op_type != "BatchNormalization" or not all(g.is_const(i) for i in bn.inputs[1:5]):
            continue
        if len(shapes.get(bn.inputs[0], ())) != 4:
            continue
        gamma, beta, mean, var = (g.const(i).astype(np.float64) for i in bn.inputs[1:5])
        s = gamma / np.sqrt(var + float(bn.attr("epsilon", 1e-5)))
        _depthwise(g, bn, bn.inputs[0], s, beta - mean * s)
        bn.outputs = bn.outputs[:1]
        changed += 1
    return changed
