"""Constant folding, including shape sub-graphs with a symbolic batch.

EfficientNet-Lite0 computes its final Reshape target as
``Shape(input) -> Gather(0) -> Unsqueeze -> Concat([N, -1])``. The batch size N
is dynamic, so the folded value keeps it as the symbol :data:`BATCH`; a Reshape
whose target starts with the symbol gets ``0`` there ("copy this dim"), which
keeps the model batch-agnostic. Everything else with constant inputs is
evaluated with onnx's reference evaluator.
"""
from __future__ import annotations

import numpy as np
from onnx import helper
from onnx.reference import ReferenceEvaluator

from maceq.errors import MaceqError
from maceq.quant.ir import Graph, Node, make_onnx_node


class _Sym:
    """The dynamic batch dimension inside a folded shape value."""

    def __repr__(self):
        return "N"


BATCH = _Sym()
SHAPE_OPS = {"Shape", "Gather", "Unsqueeze", "Squeeze", "Concat", "Slice", "Cast", "Identity"}


def _has_sym(a) -> bool:
    return isinstance(a, np.ndarray) and a.dtype == object and any(x is BATCH for x in a.ravel())


def _eval_symbolic(node: Node, vals: list[np.ndarray]):
    op = node.op_type
    if op == "Gather":
        data, idx = vals
        return np.take(data, np.asarray(idx, np.int64), axis=node.attr("axis", 0))
    if op == "Unsqueeze":
        axes = list(vals[1]) if len(vals) > 1 else node.attr("axes")
        out = vals[0]
        for ax in sorted(int(a) % (out.ndim + len(axes)) for a in axes):
            out = np.expand_dims(out, ax)
        return out
    if op == "Squeeze":
        axes = list(vals[1]) if len(vals) > 1 else node.attr("axes")
        return np.squeeze(vals[0], axis=tuple(int(a) for a in axes)) if axes is not None else np.squeeze(vals[0])
    if op == "Concat":
        return np.concatenate([np.atleast_1d(v).astype(object) for v in vals], axis=node.attr("axis", 0))
    if op == "Slice":
        data = vals[0]
        starts, ends = vals[1], vals[2]
        axes = vals[3] if len(vals) > 3 else range(len(starts))
        steps = vals[4] if len(vals) > 4 else [1] * len(starts)
        sl = [slice(None)] * data.ndim
        for s, e, a, st in zip(starts, ends, axes, steps):
            sl[int(a)] = slice(int(s), int(e), int(st))
        return data[tuple(sl)]
    if op in ("Cast", "Identity"):
        return vals[0]
    raise MaceqError(f"node '{node.name}' ({op}): cannot fold a symbolic shape through this op")


def _eval_numeric(node: Node, vals: list[np.ndarray], *, opset: int) -> list[np.ndarray]:
    """Evaluate one node on constant inputs with onnx's reference evaluator, at the graph's opset.

    The node's attributes are re-encoded by :func:`maceq.quant.ir.make_onnx_node` (a TENSOR
    attribute such as ConstantOfShape's ``value`` goes back as a tensor, whatever its rank or dtype).
    """
    ins = [f"i{k}" for k in range(len(vals))]
    outs = [f"o{k}" for k in range(len(node.outputs))]
    onode = make_onnx_node(node.op_type, ins, outs, name=node.name, attrs=node.attrs, opset=opset)
    try:
        graph = helper.make_graph([onode], "fold",
                                  [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                                   for n, v in zip(ins, vals)],
                                  [helper.make_empty_tensor_value_info(o) for o in outs])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        ev = ReferenceEvaluator(model)
        return ev.run(None, dict(zip(ins, vals)))
    except Exception as e:  # noqa: BLE001 - the evaluator raises many types on a bad node
        lines = str(e).splitlines()
        raise MaceqError(f"node '{node.name}' ({node.op_type}): constant folding failed: "
                         f"{lines[0] if lines else type(e).__name__}") from None


def fold_constants(g: Graph, input_shapes: dict[str, list[int]]) -> int:
    """Fold every node whose inputs are all known, pass after pass until nothing folds (a folded
    shape value lets shape inference reach tensors it could not before, whose Shape then folds too);
    returns the number folded."""
    # A rank-0 input has no batch dimension (fix_input_shapes rejects it; graphs built by hand may have one).
    dynamic_batch = {vi.name for vi in g.inputs
                     if vi.shape and not (isinstance(vi.shape[0], int) and vi.shape[0] > 0)}
    sym: dict[str, np.ndarray] = {}
    folded = _fold_until_done(g, input_shapes, bool(dynamic_batch), sym)
    used = [(node, i) for node in g.nodes for i in node.inputs if i in sym]
    if used:
        batch = _fixed_batch(input_shapes, dynamic_batch)
        if batch is None:
            node, i = used[0]
            raise MaceqError(f"node '{node.name}' ({node.op_type}) consumes the shape value '{i}', "
                             "which depends on the dynamic batch size")
        # An op other than Reshape reads the batch (YOLOv8's anchor Expand): use the fixed one.
        for name, val in sym.items():
            g.initializers[name] = np.array([batch if x is BATCH else x for x in val.ravel()], np.int64
                                            ).reshape(val.shape)
        sym.clear()
        folded += _fold_until_done(g, input_shapes, False, sym)
    return folded


def _fold_until_done(g: Graph, input_shapes: dict, dynamic_batch: bool, sym: dict) -> int:
    folded = 0
    while True:
        n = _fold_pass(g, input_shapes, dynamic_batch, sym)
        folded += n
        if n == 0:
            return folded


def _fixed_batch(input_shapes: dict, dynamic: set) -> int | None:
    """The batch the input shapes fix for the dynamic inputs (one value for all), or None."""
    batches = {int(input_shapes[n][0]) for n in dynamic if n in input_shapes and input_shapes[n]}
    return batches.pop() if len(batches) == 1 else None


def _fold_pass(g: Graph, input_shapes: dict, dynamic_batch: bool, sym: dict) -> int:
    """One pass over the nodes in order: fold what is known now; the shape values that hold the
    dynamic batch go to ``sym``."""
    shapes = None
    folded = 0
    for node in list(g.nodes):
        known = [i for i in node.inputs if i]
        if node.op_type == "Shape":
            if shapes is None:
                shapes = _batch_shapes(g, input_shapes, sym, dynamic_batch)
            src = node.inputs[0]
            if src not in shapes[0]:
                continue
            shape = np.array(shapes[0][src], dtype=object)
            other = shapes[1].get(src) if shapes[1] is not None else None
            for k in range(shape.size):  # the dims that follow the batch hold the symbol
                if other is not None and other[k] != shape[k]:
                    shape[k] = BATCH
            sym[node.outputs[0]] = shape
            g.nodes.remove(node)
            folded += 1
            continue
        if not all(i in g.initializers or i in sym for i in known):
            if node.op_type == "Reshape" and len(node.inputs) > 1 and node.inputs[1] in sym:
                target = sym[node.inputs[1]].copy()
                target[[x is BATCH for x in target]] = 0
                name = node.name + "__shape"
                g.initializers[name] = np.array(target.tolist(), np.int64)
                node.inputs[1] = name
            continue
        folded += _fold_node(g, node, known, sym)
    return folded


def _batch_shapes(g: Graph, input_shapes: dict, sym: dict, dynamic_batch: bool) -> tuple[dict, dict | None]:
    """Static shapes for the given input shapes and, with a dynamic batch, for one more in the batch:
    a dim that differs between the two follows the batch (a Range's length does not). Shape values
    folded so far (``sym``) stand in with the batch each inference uses."""
    batch = _fixed_batch(input_shapes, {vi.name for vi in g.inputs})

    def infer(extra: int) -> dict:
        g2 = g.copy()
        for name, val in sym.items():
            g2.initializers[name] = np.array([(batch or 1) + extra if x is BATCH else x for x in val.ravel()],
                                             np.int64).reshape(val.shape)
        return g2.infer_shapes({n: ([int(s[0]) + extra] + list(s[1:]) if s else s) for n, s in input_shapes.items()})

    shapes = infer(0)
    if not dynamic_batch:
        return shapes, None
    try:
        return shapes, infer(1)
    except MaceqError:
        return shapes, None


def _fold_node(g: Graph, node: Node, known: list[str], sym: dict) -> int:
    """Fold one node whose inputs are all known (symbolically when one holds the batch); 1 if it went."""
    vals = [g.initializers[i] if i in g.initializers else sym[i] for i in known]
    if any(_has_sym(v) for v in vals):
        if node.op_type not in SHAPE_OPS:
            return 0
        res = np.asarray(_eval_symbolic(node, vals), dtype=object)
        if _has_sym(res):
            sym[node.outputs[0]] = res
        else:
            g.initializers[node.outputs[0]] = np.array(res.tolist(), np.int64)
        g.nodes.remove(node)
        return 1
    vals = [v.astype(np.int64) if v.dtype == object else v for v in vals]
    outs = _eval_numeric(node, vals, opset=g.opset)
    for name, val in zip(node.outputs, outs):
        g.initializers[name] = np.asarray(val)
    g.nodes.remove(node)
    return 1
