"""Fuse Relu and constant-bound Clip into the producing Conv/Gemm.

The fused node takes the activation node's name and output tensor (as MACE's
converter names it), and records the clamp in the ``maceq_act`` attribute.
"""
from __future__ import annotations

import math

import numpy as np

from maceq.quant.ir import ACT_ATTR, Graph, Node


def clip_bounds(g: Graph, node: Node):
    """(lo, hi) of a Relu or Clip with constant bounds, else None."""
    if node.op_type == "Relu":
        return 0.0, math.inf
    if node.op_type != "Clip":
        return None
    lo, hi = -math.inf, math.inf
    if "min" in node.attrs or "max" in node.attrs:  # opset < 11
        lo, hi = float(node.attr("min", -math.inf)), float(node.attr("max", math.inf))
    for idx in (1, 2):
        if len(node.inputs) > idx and node.inputs[idx]:
            if not g.is_const(node.inputs[idx]):
                return None
            v = float(np.asarray(g.const(node.inputs[idx])).ravel()[0])
            if idx == 1:
                lo = v
            else:
                hi = v
    return lo, hi


def fuse_activations(g: Graph) -> int:
    fused = 0
    for act in list(g.nodes):
        bounds = clip_bounds(g, act)
        if bounds is None:
            continue
        producers, consumers = g.producers(), g.consumers()
        prod = producers.get(act.inputs[0])
        if (prod is None or prod.op_type not in ("Conv", "Gemm") or prod.attrs.get(ACT_ATTR) is not None
                or len(consumers.get(act.inputs[0], [])) != 1 or act.inputs[0] in g.outputs):
            continue
        prod.attrs[ACT_ATTR] = (float(bounds[0]), float(bounds[1]))
        prod.attrs["maceq_names"] = list(prod.attrs.get("maceq_names", [])) + [prod.name]
        prod.outputs = [act.outputs[0]]
        prod.name = act.name
        g.nodes.remove(act)
        fused += 1
    return fused
