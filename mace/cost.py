"""What a MACE model costs per run, counted on its NetDef: multiply-accumulates of the ops that do
them, and the activation bytes each op writes. Estimates of device time go through these counts
(no phone measures them here).

Weight layouts, as maceq writes them (docs/mace-format.md): uint8 Conv2D OHWI, DepthwiseConv2d
``[KH, KW, C, M]``, FullyConnected ``[O, ...]``; float Conv2D and Deconv2D OIHW, DepthwiseConv2d
``[M, C, KH, KW]``, MatMul's constant operand ``[N, K]``.
"""
from __future__ import annotations

import numpy as np

from maceq.mace.enums import DataType

#: MACE op types that multiply and accumulate
MAC_OPS = ("Conv2D", "DepthwiseConv2d", "Deconv2D", "FullyConnected", "MatMul")


def _arg(op, name: str, default=None):
    for a in op.arg:
        if a.name == name:
            return list(a.ints) if a.ints else a.i
    return default


def is_float(op) -> bool:
    """Whether the op computes in float (its ``T`` is DT_FLOAT; Quantize/Dequantize are boundaries)."""
    return op.type not in ("Quantize", "Dequantize") and _arg(op, "T", int(DataType.DT_UINT8)) == DataType.DT_FLOAT


def op_macs(op, arrays: dict) -> int:
    """Multiply-accumulates of one op per run (0 for ops that do none, or whose weights are not constant)."""
    if op.type not in MAC_OPS or not op.output_shape or len(op.input) < 2:
        return 0
    w = arrays.get(op.input[1])
    if w is None:
        return 0
    out = int(np.prod([int(d) for d in op.output_shape[0].dims]))
    shape = tuple(int(d) for d in np.shape(w))
    if op.type == "DepthwiseConv2d":
        per_out = int(np.prod(shape[2:] if is_float(op) else shape[:2]))
    elif op.type == "Deconv2D":
        strides = _arg(op, "strides", [1, 1]) or [1, 1]
        per_out = max(1, int(np.prod(shape[1:])) // int(np.prod(strides)))
    elif op.type == "MatMul":
        per_out = shape[-1]
    else:
        per_out = int(np.prod(shape[1:]))
    return out * per_out


def op_elements(op) -> int:
    """Activation values the op writes per run (the product of its output shapes)."""
    return sum(int(np.prod([int(d) for d in s.dims])) for s in op.output_shape)


def net_macs(ops, arrays: dict) -> int:
    """Multiply-accumulates per run of every op in ``ops``."""
    return sum(op_macs(op, arrays) for op in ops)
