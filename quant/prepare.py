"""The float graph the quantizer works on: the ONNX model imported, its input shape fixed and
optimised (BN fold, activation fusion, Pad fold, constant fold), and the tensors that get a scale."""
from __future__ import annotations

import os

from maceq.calibrate.runner import load_onnx
from maceq.datasets.preprocess import Preprocess
from maceq.quant.build import VIEW_OPS
from maceq.quant.ir import Graph
from maceq.quant.onnx_import import fix_input_shapes, import_onnx
from maceq.quant.passes import optimize


def tensors_to_calibrate(graph: Graph) -> list[str]:
    """Every tensor that gets a scale: the inputs and each non-view node's output."""
    names = [vi.name for vi in graph.inputs]
    for n in graph.nodes:
        if n.op_type not in VIEW_OPS:
            names.extend(n.outputs)
    return names


def _is_dynamic(dims) -> bool:
    return any(not (isinstance(d, int) and d > 0) for d in dims[1:])


def prepare_graph(onnx_path: str | os.PathLike, *, input_shape: list[int] | None,
                  preprocess: Preprocess | None = None):
    """Import and optimise; dynamic spatial input dims come from ``input_shape``, else from the
    preprocessing's fixed output size (e.g. ``--resize 640,640``)."""
    model = load_onnx(onnx_path)
    graph = import_onnx(model, source=os.fspath(onnx_path))
    if (input_shape is None and preprocess is not None and len(graph.inputs) == 1
            and _is_dynamic(graph.inputs[0].shape) and preprocess.output_shape() is not None):
        input_shape = [1, *preprocess.output_shape()]
    in_shapes = fix_input_shapes(graph, input_shape)
    opt = optimize(graph, in_shapes)
    shapes = opt.infer_shapes(in_shapes)
    return opt, in_shapes, shapes
