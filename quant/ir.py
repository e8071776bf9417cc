"""maceq's float graph IR: ONNX-vocabulary nodes over named tensors.

The IR keeps ONNX op types and attribute names (so any IR graph can be written
back to ONNX and run in onnxruntime for calibration), plus a few maceq-only
attributes that passes add (``maceq_act``: a fused activation clamp).

Tensors are identified by name; names are unique in a graph, exactly as in
ONNX. Reports and the quantizer match tensors by these names (identity), never
by suffix.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from maceq.errors import MaceqError

#: maceq-only attribute: (lo, hi) clamp of a fused activation, floats, hi may be inf.
ACT_ATTR = "maceq_act"


def _schema_attr_type(op_type: str, key: str, opset: int):
    """The AttributeProto type the ONNX schema of ``op_type`` (default domain, ``opset``) gives
    attribute ``key``, or None when there is no schema or no such attribute."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except Exception:  # SchemaError: unknown op or not in this opset
        return None
    attr = schema.attributes.get(key)
    return None if attr is None else attr.type


def onnx_attribute(op_type: str, key: str, value, *, opset: int, where: str = "") -> onnx.AttributeProto:
    """Encode one IR attribute value back to an ``onnx.AttributeProto``.

    The importer (quant/onnx_import.py) decodes attributes to plain values, so the ONNX type is
    not carried along; ``helper.make_attribute`` guesses it from the value, which fails or
    guesses wrong in three cases handled here:

    * a numpy array is always a TENSOR attribute (the importer decodes only TENSOR attributes to
      arrays): encoded with ``numpy_helper.from_array``, which also takes 0-d and bool arrays and
      keeps a 1-element array a tensor (``make_attribute`` would make it FLOATS);
    * an empty list gets the type the op's schema declares (INTS when there is none);
    * an ``AttributeProto`` is copied under the new key.

    Anything ``make_attribute`` still rejects raises MaceqError naming ``where`` and the key.
    """
    try:
        if isinstance(value, onnx.AttributeProto):
            out = onnx.AttributeProto()
            out.CopyFrom(value)
            out.name = key
            return out
        if isinstance(value, np.ndarray):
            return helper.make_attribute(key, numpy_helper.from_array(value))
        if isinstance(value, (list, tuple)) and len(value) == 0:
            attr_type = _schema_attr_type(op_type, key, opset)
            if attr_type is None or attr_type not in _LIST_TYPES:
                attr_type = onnx.AttributeProto.INTS
            return helper.make_attribute(key, [], attr_type=attr_type)
        return helper.make_attribute(key, value)
    except MaceqError:
        raise
    except Exception as e:  # onnx raises TypeError/ValueError on values it cannot encode
        lines = str(e).splitlines()
        raise MaceqError(f"{where or op_type}: attribute {key!r} cannot be encoded for ONNX "
                         f"({lines[0] if lines else type(e).__name__})") from None


_LIST_TYPES = {onnx.AttributeProto.INTS, onnx.AttributeProto.FLOATS, onnx.AttributeProto.STRINGS,
               onnx.AttributeProto.TENSORS, onnx.AttributeProto.GRAPHS, onnx.AttributeProto.SPARSE_TENSORS,
               onnx.AttributeProto.TYPE_PROTOS}


def make_onnx_node(op_type: str, inputs, outputs, *, name: str = "", attrs: dict | None = None,
                   opset: int) -> onnx.NodeProto:
    """An ``onnx.NodeProto`` from IR parts; maceq-only attributes (``maceq_*``) are left out and
    the others are encoded by :func:`onnx_attribute`."""
    node = helper.make_node(op_type, list(inputs), list(outputs), name=name or None)
    where = f"node '{name}' ({op_type})" if name else op_type
    for key, value in (attrs or {}).items():
        if key.startswith("maceq_"):
            continue
        node.attribute.append(onnx_attribute(op_type, key, value, opset=opset, where=where))
    return node


def onnx_nodes(n: "Node", *, opset: int) -> list[onnx.NodeProto]:
    """The ONNX node(s) of one IR node: a node with a fused activation (``maceq_act``) becomes the op
    followed by a Relu (or a Clip with constant bounds) whose output carries the node's output name."""
    act = n.attrs.get(ACT_ATTR)
    if act is None:
        return [make_onnx_node(n.op_type, n.inputs, n.outputs, name=n.name, attrs=n.attrs, opset=opset)]
    pre = n.outputs[0] + "__maceq_preact"
    out = [make_onnx_node(n.op_type, n.inputs, [pre], name=n.name + "__maceq_op", attrs=n.attrs, opset=opset)]
    lo, hi = act
    if np.isinf(hi) and lo == 0.0:
        return out + [helper.make_node("Relu", [pre], [n.outputs[0]], name=n.name)]
    lo_name, hi_name = n.outputs[0] + "__maceq_lo", n.outputs[0] + "__maceq_hi"
    out.append(helper.make_node("Constant", [], [lo_name], name=lo_name,
                                value=numpy_helper.from_array(np.array(lo, np.float32))))
    out.append(helper.make_node("Constant", [], [hi_name], name=hi_name,
                                value=numpy_helper.from_array(np.array(hi, np.float32))))
    return out + [helper.make_node("Clip", [pre, lo_name, hi_name], [n.outputs[0]], name=n.name)]


def sum_squares_per_sample(src: str, dst: str, *, opset: int) -> list[onnx.NodeProto]:
    """ONNX nodes writing ``dst`` = the sum of squares of each sample of ``src`` (shape [N]): a
    per-sample sum keeps its batch dimension, so a session fed in chunks joins it like any output."""
    flat = dst + "__flat"
    nodes = [helper.make_node("Flatten", [src], [flat], axis=1)]
    if opset >= 18:  # axes became an input
        axes = dst + "__axes"
        nodes.append(helper.make_node("Constant", [], [axes], value=numpy_helper.from_array(np.array([1], np.int64))))
        return nodes + [helper.make_node("ReduceSumSquare", [flat, axes], [dst], keepdims=0)]
    return nodes + [helper.make_node("ReduceSumSquare", [flat], [dst], axes=[1], keepdims=0)]


@dataclass
class Node:
    name: str
    op_type: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict = field(default_factory=dict)

    def attr(self, key, default=None):
        return self.attrs.get(key, default)


@dataclass
class ValueInfo:
    name: str
    shape: list  # ints, or str for symbolic dims
    elem_type: int = onnx.TensorProto.FLOAT


@dataclass
class Graph:
    nodes: list[Node]
    initializers: dict[str, np.ndarray]
    inputs: list[ValueInfo]
    outputs: list[str]
    opset: int = 17
    name: str = "graph"
    #: what the passes rewrote into other ops (one line each), for the user to read
    rewrites: list[str] = field(default_factory=list)

    # -- structure -----------------------------------------------------
    def producers(self) -> dict[str, Node]:
        return {o: n for n in self.nodes for o in n.outputs}

    def consumers(self) -> dict[str, list[Node]]:
        out: dict[str, list[Node]] = {}
        for n in self.nodes:
            for i in n.inputs:
                if i:
                    out.setdefault(i, []).append(n)
        return out

    def is_const(self, name: str) -> bool:
        return name in self.initializers

    def const(self, name: str) -> np.ndarray:
        return self.initializers[name]

    def copy(self) -> "Graph":
        return copy.deepcopy(self)

    def toposort(self) -> None:
        """Sort nodes topologically (stable); a cycle or a dangling input is an error."""
        available = {vi.name for vi in self.inputs} | set(self.initializers) | {""}
        producers = self.producers()
        for n in self.nodes:
            for i in n.inputs:
                if i not in available and i not in producers:
                    raise MaceqError(f"node '{n.name}' ({n.op_type}): input '{i}' is produced by no node, "
                                     "initializer or graph input")
        order: list[Node] = []
        done = set(available)
        pending = list(self.nodes)
        while pending:
            rest = []
            for n in pending:
                if all(i in done for i in n.inputs):
                    order.append(n)
                    done.update(n.outputs)
                else:
                    rest.append(n)
            if len(rest) == len(pending):
                raise MaceqError(f"graph has a cycle through node '{rest[0].name}' ({rest[0].op_type})")
            pending = rest
        self.nodes = order
        for o in self.outputs:
            if o not in done:
                raise MaceqError(f"graph output '{o}' is produced by no node")

    def remove_unused(self) -> None:
        """Drop nodes and initializers that no graph output depends on."""
        needed = set(self.outputs)
        keep = []
        for n in reversed(self.nodes):
            if any(o in needed for o in n.outputs):
                keep.append(n)
                needed.update(i for i in n.inputs if i)
        self.nodes = list(reversed(keep))
        self.initializers = {k: v for k, v in self.initializers.items() if k in needed}

    def replace_input(self, old: str, new: str) -> None:
        for n in self.nodes:
            n.inputs = [new if i == old else i for i in n.inputs]
        self.outputs = [new if o == old else o for o in self.outputs]

    def bypass(self, node: Node) -> None:
        """Remove a single-input pass-through node, rewiring its consumers to its input.

        When the node's output is a graph output, the producer of its input is
        renamed instead, so graph output names never change.
        """
        src, dst = node.inputs[0], node.outputs[0]
        self.nodes.remove(node)
        if dst in self.outputs and src not in self.outputs and src not in {v.name for v in self.inputs}:
            prod = self.producers().get(src)
            if prod is not None and len(self.consumers().get(src, [])) == 0:
                prod.outputs = [dst if o == src else o for o in prod.outputs]
                return
        self.replace_input(dst, src)

    # -- ONNX round trip -------------------------------------------------
    def to_onnx(self, *, extra_outputs: Iterable[str] = (), fixed_shapes: dict[str, list[int]] | None = None
                ) -> onnx.ModelProto:
        """Write the graph as an ONNX model that onnxruntime runs.

        A node with a fused activation (``maceq_act``) becomes the op followed by
        a Clip/Relu whose output carries the node's output name, so the tensor
        that gets a scale is observed after its clamp.
        """
        onodes = [o for n in self.nodes for o in onnx_nodes(n, opset=self.opset)]
        inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in self.initializers.items()]
        ins = []
        for vi in self.inputs:
            shape = (fixed_shapes or {}).get(vi.name, vi.shape)
            ins.append(helper.make_tensor_value_info(vi.name, vi.elem_type, shape))
        outs = []
        seen = set()
        for o in list(self.outputs) + list(extra_outputs):
            if o in seen:
                continue
            seen.add(o)
            outs.append(helper.make_empty_tensor_value_info(o))
        g = helper.make_graph(onodes, self.name, ins, outs, inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", self.opset)], producer_name="maceq")
        m.ir_version = min(m.ir_version, 8)
        return m

    def infer_shapes(self, input_shapes: dict[str, list[int]]) -> dict[str, tuple[int, ...]]:
        """Static shapes of every tensor for the given input shapes (onnx shape inference)."""
        model = self.to_onnx(fixed_shapes=input_shapes)
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        except Exception as e:  # onnx raises several types here
            raise MaceqError(f"shape inference failed: {str(e).splitlines()[0]}") from None
        shapes: dict[str, tuple[int, ...]] = {}
        for vi in list(inferred.graph.value_info) + list(inferred.graph.output) + list(inferred.graph.input):
            dims = vi.type.tensor_type.shape.dim
            if all(d.HasField("dim_value") for d in dims) and vi.type.tensor_type.HasField("shape"):
                shapes[vi.name] = tuple(int(d.dim_value) for d in dims)
        for k, v in self.initializers.items():
            shapes[k] = tuple(np.shape(v))
        return shapes
