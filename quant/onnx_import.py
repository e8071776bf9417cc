"""ONNX -> maceq IR.

Weights come from initializers and from Constant nodes (the PaddleOCR exports
have no initializer at all). Attributes are decoded to plain Python values.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import defs, helper, numpy_helper, version_converter

from maceq.errors import MaceqError, one_line
from maceq.quant.ir import Graph, Node, ValueInfo

MIN_OPSET, MAX_OPSET = 11, 21
#: the opset an older model is converted to
UPGRADE_OPSET = 13


def _first_line(e: BaseException) -> str:
    lines = str(e).splitlines()
    return lines[0] if lines else type(e).__name__


def _to_array(t: onnx.TensorProto, what: str) -> np.ndarray:
    """numpy_helper.to_array, with a one-line MaceqError for a tensor that does not decode
    (undefined or unknown data type, raw data that does not fill ``dims``, ...)."""
    try:
        return numpy_helper.to_array(t)
    except Exception as e:  # onnx raises TypeError, ValueError, KeyError, ... on such tensors
        raise MaceqError(f"{what}: tensor does not decode ({_first_line(e)})") from None


def _attr_value(a: onnx.AttributeProto, where: str):
    try:
        v = helper.get_attribute_value(a)
    except Exception as e:  # an attribute of undefined/unknown type
        raise MaceqError(f"{where}: attribute {a.name!r} does not decode ({_first_line(e)})") from None
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, onnx.TensorProto):
        return _to_array(v, f"{where}: attribute {a.name!r}")
    if isinstance(v, list):
        return [x.decode() if isinstance(x, bytes) else x for x in v]
    return v


def _constant_value(node: onnx.NodeProto, source: str) -> np.ndarray:
    for a in node.attribute:
        if a.name == "value":
            return _to_array(a.t, f"{source}: Constant node {node.name!r}")
        if a.name == "value_float":
            return np.array(a.f, np.float32)
        if a.name == "value_floats":
            return np.array(list(a.floats), np.float32)
        if a.name == "value_int":
            return np.array(a.i, np.int64)
        if a.name == "value_ints":
            return np.array(list(a.ints), np.int64)
    raise MaceqError(f"Constant node {node.name!r} has no supported value attribute")


def _check_arity(n: onnx.NodeProto, name: str, opset: int, source: str) -> None:
    """The node's input/output counts against its ONNX schema at ``opset`` (an op without a schema
    is left to the support check). The passes index ``node.inputs`` as the schema allows, so a
    node with too few inputs, or an empty name in a required slot, is rejected here."""
    try:
        schema = defs.get_schema(n.op_type, opset, "")
    except Exception:  # SchemaError: unknown op or not in this opset
        return
    where = f"{source}: node {name!r} ({n.op_type})"
    if not schema.min_input <= len(n.input) <= schema.max_input:
        raise MaceqError(f"{where} has {len(n.input)} inputs; opset {opset} allows "
                         f"{schema.min_input}..{schema.max_input}")
    if not schema.min_output <= len(n.output) <= schema.max_output:
        raise MaceqError(f"{where} has {len(n.output)} outputs; opset {opset} allows "
                         f"{schema.min_output}..{schema.max_output}")
    single = defs.OpSchema.FormalParameterOption.Single
    for k, formal in enumerate(schema.inputs[: len(n.input)]):
        if formal.option == single and not n.input[k]:
            raise MaceqError(f"{where}: required input {k} ({formal.name}) is empty")


def import_onnx(model: onnx.ModelProto, *, source: str = "model") -> Graph:
    """Convert an ONNX ModelProto to the IR; opset 7..10 is upgraded to 13 first, above 21 is an error.

    Nodes are checked against their ONNX schema's input/output counts (see ``_check_arity``).
    A MaceqError from here is one line (line breaks in names are escaped).
    """
    try:
        return _import_onnx(model, source)
    except MaceqError as e:
        raise MaceqError(one_line(str(e))) from None


def _upgrade(model: onnx.ModelProto, opset: int, source: str) -> tuple[onnx.ModelProto, int]:
    """An older model (opset 7..10) brought to opset 13 by onnx's version converter (Upsample, the
    attribute forms of Slice and friends become their current forms); MaceqError when it cannot."""
    try:
        return version_converter.convert_version(model, UPGRADE_OPSET), UPGRADE_OPSET
    except Exception as e:  # noqa: BLE001 - the converter raises its own and C++ errors
        raise MaceqError(f"{source}: opset {opset} is older than {MIN_OPSET} and onnx's version converter cannot "
                         f"bring it to {UPGRADE_OPSET} ({one_line(str(e).strip()) or type(e).__name__})") from None


def _import_onnx(model: onnx.ModelProto, source: str) -> Graph:
    opset = None
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            opset = imp.version
    if opset is None:
        raise MaceqError(f"{source}: no default-domain opset import")
    if opset < MIN_OPSET:
        model, opset = _upgrade(model, opset, source)
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise MaceqError(f"{source}: opset {opset} is outside the supported range {MIN_OPSET}..{MAX_OPSET}")
    g = model.graph
    inits = {t.name: _to_array(t, f"{source}: initializer {t.name!r}") for t in g.initializer}
    nodes: list[Node] = []
    used_names: set[str] = set()
    for i, n in enumerate(g.node):
        if n.domain not in ("", "ai.onnx"):
            raise MaceqError(f"{source}: node '{n.name or n.op_type}' uses custom domain '{n.domain}' op '{n.op_type}'")
        if n.op_type == "Constant":
            if len(n.output) != 1:
                raise MaceqError(f"{source}: Constant node {n.name!r} has {len(n.output)} outputs, needs 1")
            inits[n.output[0]] = _constant_value(n, source)
            continue
        name = n.name or f"{n.op_type}_{i}"
        if name in used_names:
            name = f"{name}_{i}"
        used_names.add(name)
        _check_arity(n, name, opset, source)
        attrs = {a.name: _attr_value(a, f"{source}: node {name!r}") for a in n.attribute}
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
    try:
        return _fix_input_shapes(graph, input_shape)
    except MaceqError as e:
        raise MaceqError(one_line(str(e))) from None


def _fix_input_shapes(graph: Graph, input_shape: list[int] | None) -> dict[str, list[int]]:
    shapes = {}
    for k, vi in enumerate(graph.inputs):
        if input_shape is not None and k == 0:
            if len(input_shape) != len(vi.shape):
                raise MaceqError(f"--input-shape {','.join(map(str, input_shape))} has rank {len(input_shape)}, "
                                 f"input '{vi.name}' has rank {len(vi.shape)}")
            if any(j > 0 and isinstance(d, int) and d > 0 and d != w
                   for j, (d, w) in enumerate(zip(vi.shape, input_shape))):
                _redeclare(graph, vi, list(input_shape))
            shapes[vi.name] = list(input_shape)
            continue
        if not vi.shape:
            raise MaceqError(f"input {vi.name!r} is a scalar (rank 0); maceq needs a batched tensor input")
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


# ops whose constant inputs or attributes can pin a tensor's size (a Reshape to fixed dims, a
# Resize to fixed sizes, a Slice cropping at a fixed end, a ConvTranspose's output_shape)
_SIZE_PINNING = frozenset({"Reshape", "Resize", "Upsample", "Slice", "Expand", "Tile", "ConvTranspose"})


def _redeclare(graph: Graph, vi: ValueInfo, shape: list[int]) -> None:
    """Re-declare input ``vi`` at ``shape`` where the graph was exported for another size.

    Allowed only where no op pins a size: shapes are inferred at the exported size and at the new
    one, and a size-pinning op whose input changes while its output does not (a Reshape to fixed
    dims, a Resize to fixed sizes, a Slice cropping at a fixed end) is refused by name, since it
    would compute something else at the new size."""
    where = f"--input-shape {','.join(map(str, shape))}"
    exported = [d if isinstance(d, int) and d > 0 else (1 if j == 0 else None) for j, d in enumerate(vi.shape)]
    if None in exported:
        raise MaceqError(f"{where}: input '{vi.name}' mixes fixed and dynamic dimensions {vi.shape}")
    old = graph.infer_shapes({vi.name: exported})
    try:
        new = graph.infer_shapes({vi.name: shape})
    except MaceqError as e:
        raise MaceqError(f"{where}: input '{vi.name}' was exported at {'x'.join(map(str, exported))} and the "
                         f"graph does not take the new size ({e})") from None
    for n in graph.nodes:
        if n.op_type not in _SIZE_PINNING or not n.outputs or not n.inputs:
            continue
        src, out = n.inputs[0], n.outputs[0]
        if old.get(src) != new.get(src) and old.get(out) is not None and old.get(out) == new.get(out):
            raise MaceqError(f"{where}: node '{n.name}' ({n.op_type}) fixes its output at "
                             f"{'x'.join(map(str, old[out]))} for the exported input size "
                             f"{'x'.join(map(str, exported))}; re-export the model at the size you need")
    vi.shape = list(shape)
