"""``auto_pad`` and ``ceil_mode`` made explicit: once the input shape is fixed, every Conv,
ConvTranspose, MaxPool and AveragePool carries its padding as ``pads`` (top, left, bottom, right),
so the passes, the writer and the runtime read one form.

ONNX's rule for Conv and the pools (operator text, onnxruntime): with SAME_UPPER / SAME_LOWER the
output is ``ceil(in / stride)`` and ``total = max(0, (out - 1) * stride + (k - 1) * dilation + 1 - in)``;
SAME_UPPER puts ``total // 2`` first and the odd row last, SAME_LOWER the odd row first. VALID is
zero padding. ConvTranspose follows runtime/kernels/transpose_conv.py's ``onnx_conv_transpose_args``
(target ``in * stride``), whose halves were tested against onnxruntime.
"""
from __future__ import annotations

from maceq.errors import MaceqError
from maceq.quant.ir import Graph, Node
from maceq.runtime.kernels.transpose_conv import onnx_conv_transpose_args

_OPS = ("Conv", "ConvTranspose", "MaxPool", "AveragePool")


def _same_pads(in_hw, kernel, strides, dilations, *, upper: bool) -> list[int]:
    """ONNX SAME_UPPER/SAME_LOWER as explicit [top, left, bottom, right]."""
    begin, end = [], []
    for size, k, s, d in zip(in_hw, kernel, strides, dilations):
        out = -(-size // s)
        total = max(0, (out - 1) * s + (k - 1) * d + 1 - size)
        first = total // 2 if upper else total - total // 2
        begin.append(first)
        end.append(total - first)
    return begin + end


def _kernel(g: Graph, node: Node) -> tuple[int, int] | None:
    """The node's 2-D window: the pools' ``kernel_shape``, a convolution's constant weights."""
    if node.op_type in ("MaxPool", "AveragePool"):
        ks = node.attr("kernel_shape")
        return tuple(int(k) for k in ks) if ks is not None and len(ks) == 2 else None
    if len(node.inputs) > 1 and g.is_const(node.inputs[1]) and g.const(node.inputs[1]).ndim == 4:
        return tuple(int(k) for k in g.const(node.inputs[1]).shape[2:])
    return None


def _transpose_pads(g: Graph, node: Node, in_hw, auto: str) -> list[int]:
    """ConvTranspose's SAME padding as explicit pads (begin from the runtime's rule, the rest at the end)."""
    w = g.const(node.inputs[1])
    args = onnx_conv_transpose_args(w, in_hw=in_hw, strides=node.attr("strides", [1, 1]),
                                    output_padding=node.attr("output_padding", [0, 0]),
                                    dilations=node.attr("dilations", [1, 1]), group=node.attr("group", 1),
                                    auto_pad=auto, node=node.name)
    s = [int(v) for v in node.attr("strides", [1, 1])]
    opad = [int(v) for v in node.attr("output_padding", [0, 0])]
    full = [s[i] * (int(in_hw[i]) - 1) + opad[i] + int(w.shape[2 + i]) for i in range(2)]
    totals = [full[i] - args.out_hw[i] for i in range(2)]
    return [args.pads[0], args.pads[1], totals[0] - args.pads[0], totals[1] - args.pads[1]]


def _ceil_pads(node: Node, in_hw, kernel) -> list[int]:
    """``ceil_mode`` = 1 as more padding at the end: onnxruntime's output size ``ceil((in + pads - k) / s)
    + 1``, less one where the last window would start past the input and the leading pad (pool_attributes.h).
    The end pad is never read by a max (the pads are -inf) nor counted by an average that excludes pads."""
    pads = [int(v) for v in node.attr("pads", [0, 0, 0, 0])]
    strides = [int(v) for v in node.attr("strides", [1, 1])]
    dilations = [int(v) for v in node.attr("dilations", [1, 1])]
    out = list(pads)
    for i, (size, k, s, d) in enumerate(zip(in_hw, kernel, strides, dilations)):
        span = (k - 1) * d + 1
        n_out = -(-(size + pads[i] + pads[i + 2] - span) // s) + 1
        if (n_out - 1) * s >= size + pads[i]:
            n_out -= 1
        out[i + 2] += max(0, (n_out - 1) * s + span - (size + pads[i] + pads[i + 2]))
    if out != pads and node.op_type == "AveragePool" and int(node.attr("count_include_pad", 0)):
        raise MaceqError(f"node '{node.name}' (AveragePool): ceil_mode=1 with count_include_pad=1 is not supported")
    return out


def explicit_pads(g: Graph, shapes: dict) -> int:
    """Rewrite ``auto_pad`` and ``ceil_mode`` into ``pads`` on every 2-D Conv/ConvTranspose/MaxPool/
    AveragePool; returns how many nodes changed. A node whose window or input shape is unknown
    raises MaceqError naming it."""
    changed = 0
    for node in g.nodes:
        auto = str(node.attr("auto_pad", "NOTSET") or "NOTSET")
        ceil = node.op_type in ("MaxPool", "AveragePool") and int(node.attr("ceil_mode", 0) or 0) == 1
        if node.op_type not in _OPS or (auto == "NOTSET" and not ceil):
            continue
        if auto not in ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"):
            raise MaceqError(f"node '{node.name}' ({node.op_type}): unknown auto_pad '{auto}'")
        in_shape, kernel = shapes.get(node.inputs[0]), _kernel(g, node)
        if in_shape is None or len(in_shape) != 4 or kernel is None:
            what = f"auto_pad={auto}" if auto != "NOTSET" else "ceil_mode=1"
            raise MaceqError(f"node '{node.name}' ({node.op_type}): {what} needs a 2-D window and a "
                             f"static input shape (fix it with --input-shape)")
        pads = _pads_for(g, node, auto, in_shape[2:], kernel)
        if pads is None:
            continue
        node.attrs["pads"] = pads
        node.attrs.pop("auto_pad", None)
        node.attrs.pop("ceil_mode", None)
        changed += 1
    return changed


def _pads_for(g: Graph, node: Node, auto: str, in_hw, kernel) -> list[int] | None:
    """The explicit pads of one node (None: a ConvTranspose whose ``output_shape`` decides them)."""
    if auto == "NOTSET":
        return _ceil_pads(node, in_hw, kernel)
    if auto == "VALID":
        return [0, 0, 0, 0] if not int(node.attr("ceil_mode", 0) or 0) else _ceil_pads(node, in_hw, kernel)
    if node.op_type == "ConvTranspose":
        return None if node.attr("output_shape") is not None else _transpose_pads(g, node, in_hw, auto)
    strides = [int(v) for v in node.attr("strides", [1, 1])]
    dilations = [int(v) for v in node.attr("dilations", [1, 1])]
    return _same_pads(in_hw, kernel, strides, dilations, upper=auto == "SAME_UPPER")
