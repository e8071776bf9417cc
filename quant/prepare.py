"""The float graph the quantizer works on: the ONNX model imported, its input shape fixed and
optimised (BN fold, activation fusion, Pad fold, constant fold), and the tensors that get a scale."""
from __future__ import annotations

import os

from maceq.calibrate.runner import load_onnx
from maceq.datasets.preprocess import Preprocess
from maceq.quant.ir import Graph
from maceq.quant.onnx_import import fix_input_shapes, import_onnx
from maceq.quant.passes import optimize


def tensors_to_calibrate(graph: Graph) -> list[str]:
    """Every tensor that may get a scale: the inputs and every node's output.

    The outputs of views (Reshape, Flatten, Squeeze) are calibrated too: they hold their input's
    values, so their ranges are their inputs' (what MACE's converter carries through), and a uint8
    op that reads one (a detection head's Concat of reshaped outputs) finds its range."""
    return [vi.name for vi in graph.inputs] + [o for n in graph.nodes for o in n.outputs if o]


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
