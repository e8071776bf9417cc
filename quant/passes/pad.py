"""Fold a constant-zero spatial Pad into the following Conv's pads."""
from __future__ import annotations

import numpy as np

from maceq.quant.ir import Graph


def _pad_amounts(g: Graph, node):
    if len(node.inputs) > 1 and node.inputs[1]:
        if not g.is_const(node.inputs[1]):
            return None
        pads = [int(p) for p in g.const(node.inputs[1]).ravel()]
    else:
        pads = [int(p) for p in node.attr("pads", [])]
    value = 0.0
    if len(node.inputs) > 2 and node.inputs[2]:
        if not g.is_const(node.inputs[2]):
            return None
        value = float(np.asarray(g.const(node.inputs[2])).ravel()[0]) if g.const(node.inputs[2]).size else 0.0
    elif "value" in node.attrs:
        value = float(node.attr("value"))
    if node.attr("mode", "constant") != "constant" or value != 0.0 or len(pads) != 8:
        return None
    if len(node.inputs) > 3 and node.inputs[3]:
        return None  # explicit axes: leave alone
    if any(pads[i] for i in (0, 1, 4, 5)):
        return None  # padding on N or C
    return pads[2], pads[3], pads[6], pads[7]  # top, left, bottom, right


def fold_pad(g: Graph) -> int:
    folded = 0
    for pad in list(g.nodes):
        if pad.op_type != "Pad":
            continue
        amounts = _pad_amounts(g, pad)
        cons = g.consumers().get(pad.outputs[0], [])
        if amounts is None or len(cons) != 1 or cons[0].op_type != "Conv" or pad.outputs[0] in g.outputs:
            continue
        conv = cons[0]
        if conv.attr("auto_pad", "NOTSET") not in ("NOTSET", ""):
            continue
        t, l, b, r = amounts
        p = list(conv.attr("pads", [0, 0, 0, 0]))
        conv.attrs["pads"] = [p[0] + t, p[1] + l, p[2] + b, p[3] + r]
        conv.inputs[0] = pad.inputs[0]
        g.nodes.remove(pad)
        folded += 1
    return folded
