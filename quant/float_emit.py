"""IR node -> MACE float ops (``T = DT_FLOAT``) that run inside an otherwise uint8 MACE model.

Layout contract (docs/float-ops.md, with the MACE sources):

- In a uint8 model MACE's NetDefAdapter runs every CPU op with ``data_format`` AUTO as NHWC
  (``mace/core/net_def_adapter.cc`` ``GetDefaultDataFormat``: quantized model -> NHWC), but MACE's
  float CPU kernels index 4-D tensors as NCHW (``mace/ops/ref/conv_2d.cc``,
  ``ref/depthwise_conv_2d.cc``, ``ref/deconv_2d.cc``, ``pooling.cc``, ``resize_*.cc``, PReLU in
  ``activation.cc``, 4-D ``softmax.cc``; ``eltwise.cc`` per-channel broadcasting with
  ``has_data_format``). A float Conv2D with AUTO data format inside a uint8 model would therefore
  read NHWC memory as NCHW.
- So every op emitted here has ``data_format`` = NONE (0): the adapter leaves it alone
  (``op_registration_info.cc`` default selector returns the op's own format; NONE never triggers
  a transpose) and the kernel reads the tensor as stored. 4-D activations between ops are stored
  NHWC, as the uint8 ops store them. Each op whose float kernel is NCHW-only is wrapped in explicit
  ``Transpose`` ops (dims [0, 3, 1, 2] before, [0, 2, 3, 1] after); the other ops (Eltwise, Concat,
  Reduce, Pad, Split, StridedSlice, Transpose, Reshape, Activation except PReLU) get their axis /
  padding / broadcast arguments in the stored NHWC order, without ``has_data_format``.
- Tensors that are not 4-D are stored in ONNX order. ``output_shape`` is always the stored shape.
- Weights use MACE's float layouts: Conv2D OIHW, DepthwiseConv2d ``[M, C, KH, KW]``, Deconv2D
  OIHW (ONNX ``[Cin, Cout, KH, KW]`` transposed 1,0,2,3), MatMul weight ``[N, K]`` with
  ``transpose_b`` = 1, BatchNorm folded ``scale``/``offset`` — as MACE's converter writes them in
  ``../shared/data/mace_reference/fmnist_fp32.pb``.

Consecutive float ops leave back-to-back inverse Transposes; :func:`cancel_inverse_transposes`
removes them from a finished op list.

:data:`EMITTERS` maps each ONNX op type to its emit function; the functions live by op family in
``float_conv`` (convolutions, pooling, matrix products), ``float_eltwise`` (element-wise ops and
activations), ``float_norm`` (reductions, BatchNorm, softmax), ``float_shape`` (data movement) and
``float_resize``, over the per-node :class:`~maceq.quant.float_core.Emitter` of ``float_core``.
"""
from __future__ import annotations

from typing import Sequence

from maceq.errors import MaceqError
from maceq.quant import float_conv, float_eltwise, float_norm, float_resize, float_shape
from maceq.quant.float_core import Emitter, FloatEmission, stored_shape
from maceq.quant.ir import Graph, Node

#: ONNX op type -> the function that emits its MACE float ops
EMITTERS = {
    "Conv": float_conv.conv, "ConvTranspose": float_conv.conv_transpose,
    "Gemm": float_conv.gemm, "MatMul": float_conv.matmul,
    "MaxPool": float_conv.max_pool, "AveragePool": float_conv.average_pool,
    "Add": float_eltwise.eltwise, "Sub": float_eltwise.eltwise, "Mul": float_eltwise.eltwise,
    "Div": float_eltwise.eltwise, "Max": float_eltwise.eltwise, "Min": float_eltwise.eltwise,
    "Neg": float_eltwise.unary, "Abs": float_eltwise.unary, "Pow": float_eltwise.power,
    "Sqrt": float_eltwise.power, "Reciprocal": float_eltwise.power,
    "Relu": float_eltwise.relu, "Sigmoid": float_eltwise.sigmoid, "Tanh": float_eltwise.tanh,
    "LeakyRelu": float_eltwise.leaky_relu, "PRelu": float_eltwise.prelu, "Clip": float_eltwise.clip,
    "HardSigmoid": float_eltwise.hard_sigmoid, "HardSwish": float_eltwise.hard_swish,
    "BatchNormalization": float_norm.batch_norm,
    "GlobalAveragePool": float_norm.global_pool, "GlobalMaxPool": float_norm.global_pool,
    "ReduceMean": float_norm.reduce, "ReduceMax": float_norm.reduce, "ReduceMin": float_norm.reduce,
    "ReduceSum": float_norm.reduce, "ReduceProd": float_norm.reduce,
    "Softmax": float_norm.softmax, "LogSoftmax": float_norm.log_softmax,
    "Concat": float_shape.concat, "Transpose": float_shape.transpose, "Pad": float_shape.pad,
    "Split": float_shape.split, "Slice": float_shape.slice_,
    "Flatten": float_shape.reshape, "Reshape": float_shape.reshape, "Squeeze": float_shape.reshape,
    "Unsqueeze": float_shape.reshape,
    "Resize": float_resize.resize, "Upsample": float_resize.resize,
}
FLOAT_EMITTABLE = frozenset(EMITTERS)

__all__ = ["EMITTERS", "FLOAT_EMITTABLE", "FloatEmission", "cancel_inverse_transposes", "emit_float_node",
           "stored_shape"]


def emit_float_node(node: Node, *, graph: Graph, shapes: dict, inputs: Sequence[str],
                    output: str | Sequence[str], op_name: str) -> FloatEmission:
    """MACE float ops computing ``node``.

    ``inputs`` are the MACE tensor names holding ``node.inputs`` (one per IR input; constant
    operands may be given any name, they are read from ``graph``); ``output`` is the MACE name of
    the output (a list for Split); ``op_name`` names the main op (helper ops and const tensors get
    names derived from it). ``shapes`` maps IR tensor names to static NCHW shapes. A node
    attribute ``maceq_act`` = (lo, hi) adds the clamp: as ``activation`` args on
    Conv2D/DepthwiseConv2d/Deconv2D/BatchNorm when lo == 0, else as a following op.
    Unsupported nodes and attribute combinations raise MaceqError naming the node.
    """
    if node.op_type not in FLOAT_EMITTABLE:
        raise MaceqError(f"node '{node.name}': op type '{node.op_type}' has no MACE float emitter")
    outs = [output] if isinstance(output, str) else list(output)
    if len(outs) != len(node.outputs):
        raise MaceqError(f"node '{node.name}' ({node.op_type}): {len(node.outputs)} outputs, "
                         f"{len(outs)} MACE output names given")
    if len(inputs) < len([i for i in node.inputs if i]):
        raise MaceqError(f"node '{node.name}' ({node.op_type}): {len(inputs)} MACE input names for "
                         f"{len(node.inputs)} inputs")
    em = Emitter(node, graph, shapes, list(inputs), outs, op_name)
    EMITTERS[node.op_type](em)
    return FloatEmission(em.ops, em.tensors)


def cancel_inverse_transposes(ops: list, *, keep=frozenset()) -> list:
    """Remove ``Transpose(p^-1)`` ops that read a ``Transpose(p)`` output: their readers read the first op's input.

    The first Transpose goes too when nothing else reads it. ``keep`` names tensors that must
    survive (graph outputs). Returns a new op list; the ops are modified in place.
    """
    ops = list(ops)
    changed = True
    while changed:
        changed = False
        producer = {o: op for op in ops for o in op.output}
        for second in ops:
            if second.type != "Transpose" or second.output[0] in keep:
                continue
            first = producer.get(second.input[0])
            if first is None or first.type != "Transpose":
                continue
            d1, d2 = _arg_ints(first, "dims"), _arg_ints(second, "dims")
            if len(d1) != len(d2) or [d1[d] for d in d2] != list(range(len(d1))):
                continue
            src, dst = first.input[0], second.output[0]
            ops = [op for op in ops if op is not second]
            for op in ops:
                for k, name in enumerate(op.input):
                    if name == dst:
                        op.input[k] = src
            if first.output[0] not in keep and not any(first.output[0] in op.input for op in ops):
                ops = [op for op in ops if op is not first]
            changed = True
            break
    return ops


def _arg_ints(op, name) -> list[int]:
    """The ``ints`` of ``op``'s argument ``name`` ([] when absent)."""
    for a in op.arg:
        if a.name == name:
            return [int(v) for v in a.ints]
    return []
