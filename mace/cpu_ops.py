"""The op types stock MACE's CPU runtime registers, per data type: what a model MACE loads may contain.

Read from XiaoMi/mace 0fc55a54 (the golden build's source): every ``MACE_REGISTER_OP(op_registry,
"<type>", <class>, RuntimeType::RT_CPU, <type>)`` under mace/ops/. An op whose (type, ``T``) is not
registered makes ``CreateMaceEngineFromProto`` fail ("MACE do not support op"), so the writer checks
every op before it writes a file (:func:`unsupported_ops`).
"""
from __future__ import annotations

from maceq.mace.enums import DataType

#: uint8 kernels (``T = DT_UINT8``; Quantize/Dequantize are registered as uint8)
CPU_UINT8_OPS = frozenset((
    "Activation", "BatchToSpaceND", "BiasAdd", "Concat", "Conv2D", "DepthToSpace", "DepthwiseConv2d",
    "Dequantize", "Eltwise", "FullyConnected", "Gather", "MatMul", "Pad", "Pooling", "Quantize", "Reduce",
    "ResizeBilinear", "Softmax", "SpaceToBatchND", "SpaceToDepth", "Squeeze", "Transpose",
))

#: float kernels (``T = DT_FLOAT``, MACE's default when ``T`` is absent)
CPU_FLOAT_OPS = frozenset((
    "Activation", "AddN", "ArgMax", "BatchNorm", "BatchToSpaceND", "BiasAdd", "Cast", "ChannelShuffle",
    "Concat", "Conv2D", "Crop", "Cumsum", "Deconv2D", "DepthToSpace", "DepthwiseConv2d", "DepthwiseDeconv2d",
    "DetectionOutput", "DynamicLSTM", "Eltwise", "ExpandDims", "ExtractImagePatches", "ExtractPooling", "Fill",
    "FullyConnected", "Gather", "GroupNorm", "IfDefined", "InstanceNorm", "KaldiBatchNorm", "LSTMNonlinear",
    "LocalResponseNorm", "LpNorm", "MVNorm", "MatMul", "NonlocalReshape", "OneHot", "PNorm", "Pad",
    "PadContext", "Pooling", "PriorBox", "Reduce", "ReplaceIndex", "Reshape", "ResizeBicubic",
    "ResizeBilinear", "ResizeNearestNeighbor", "Reverse", "ScalarMath", "Select", "Shape", "Slice", "Softmax",
    "SpaceToBatchND", "SpaceToDepth", "Splice", "Split", "SqrDiffMean", "Squeeze", "Stack", "StridedSlice",
    "Subsample", "SumGroup", "TargetRMSNorm", "Tile", "Transpose", "Unsqueeze", "Unstack", "Where",
))


def op_data_type(op) -> DataType:
    """The data type MACE registers an op under: its ``T`` argument (DT_FLOAT when absent)."""
    for a in op.arg:
        if a.name == "T":
            return DataType(a.i)
    return DataType.DT_FLOAT


def unsupported_ops(net) -> list[tuple[str, str, str]]:
    """(op name, op type, data type) of every op in ``net`` stock MACE's CPU runtime has no kernel for."""
    table = {DataType.DT_UINT8: CPU_UINT8_OPS, DataType.DT_FLOAT: CPU_FLOAT_OPS}
    out = []
    for op in net.op:
        dt = op_data_type(op)
        if op.type not in table.get(dt, frozenset()):
            out.append((op.name, op.type, dt.name))
    return out
