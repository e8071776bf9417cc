"""ONNX -> maceq IR.

Weights come from initializers and from Constant nodes (the PaddleOCR exports
have no initializer at all). Attributes are decoded to plain Python values.
"""
from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import helper, numpy_helper

from maceq.errors import MaceqError
from maceq.quant.ir import Graph, Node, ValueInfo

MIN_OPSET, MAX_OPSET = 11, 21


def _attr_value(a: onnx.AttributeProto):
    v = helper.get_attribute_value(a)
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, onnx.TensorProto):
        return numpy_helper.to_array(v)
    if isinstance(v, list):
        return [x.decode() if isinstance(x, bytes) else x for x in v]
    return v


def _constant_value(node: onnx.NodeProto) -> np.ndarray:
    for a in node.attribute:
        if a.name == "value":
            return numpy_helper.to_array(a.t)
        if a.name == "value_float":
            return np.array(a.f, np.float32)
        if a.name == "value_floats":
            return np.array(list(a.floats), np.float32)
        if a.name == "value_int":
            return np.array(a.i, np.int64)
        if a.name == "value_ints":
            return np.array(list(a.ints), np.int64)
    raise MaceqError(f"Constant node '{node.name}' has no supported value attribute")


def load_onnx(path: str | os.PathLike) -> onnx.ModelProto:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise MaceqError(f"{path}: no such model file")
    try:
        model = onnx.load(path)
    except Exception as e:
        raise MaceqError(f"{path}: not a readable ONNX model ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if not model.graph.node:
        raise MaceqError(f"{path}: the ONNX graph has no nodes")
    return model


def import_onnx(model: onnx.ModelProto, *, source: str = "model") -> Graph:
    """Convert an ONNX ModelProto to the IR; opset outside [11, 21] is an error."""
    opset = None
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            opset = imp.version
    if opset is None:
        raise MaceqError(f"{source}: no default-domain opset import")
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise MaceqError(f"{source}: opset {opset} is outside the supported range {MIN_OPSET}..{MAX_OPSET}")
    g = model.graph
    inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    nodes: list[Node] = []
    used_names: set[str] = set()
    for i, n in enumerate(g.node):
        if n.domain not in ("", "ai.onnx"):
            raise MaceqError(f"{source}: node '{n.name or n.op_type}' uses custom domain '{n.domain}' op '{n.op_type}'")
        if n.op_type == "Constant":
            inits[n.output[0]] = _constant_value(n)
            continue
        name = n.name or f"{n.op_type}_{i}"
        if name in used_names:
            name = f"{name}_{i}"
        used_names.add(name)
        attrs = {a.name: _attr_value(a) for a in n.attribute}
        nodes.append(Node(name, n.op_type, list(n.input), list(n.output), attrs))
    inputs = []
    for vi in g.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim]
        inputs.append(ValueInfo(vi.name, shape, tt.elem_type))
    if not inputs:
        raise MaceqError(f"{source}: the graph has no non-constant input")
    graph = Graph(nodes, inits, inputs, [o.name for o in g.output], opset=opset, name=g.name or "graph")
    graph.toposort()
    return graph


def fix_input_shapes(graph: Graph, input_shape: list[int] | None) -> dict[str, list[int]]:
    """Concrete input shapes: dynamic batch becomes 1, other dynamic dims need ``input_shape``."""
    shapes = {}
    for k, vi in enumerate(graph.inputs):
        if input_shape is not None and k == 0:
            if len(input_shape) != len(vi.shape):
                raise MaceqError(f"--input-shape {','.join(map(str, input_shape))} has rank {len(input_shape)}, "
                                 f"input '{vi.name}' has rank {len(vi.shape)}")
            shapes[vi.name] = list(input_shape)
            continue
        dims = []
        for j, d in enumerate(vi.shape):
            if isinstance(d, int) and d > 0:
                dims.append(d)
            elif j == 0:
                dims.append(1)
            else:
                raise MaceqError(f"input '{vi.name}' has dynamic dimension {j} ('{d}'): pass --input-shape")
        shapes[vi.name] = dims
    return shapes
