"""A fused attention projection split into q, k and v without rank-5 tensors.

ViT/SVTR attention blocks compute ``qkv = x @ W`` with ``x: [B, N, C]`` and then

    Reshape [B, N, 3, H, D] -> Transpose perm [2, 0, 3, 1, 4] -> [3, B, H, N, D]
    -> per branch i: Slice axis 0 [i, i+1) + Squeeze axis 0   (Paddle exports)
                 or  Gather axis 0, scalar index i            (PyTorch exports)
    -> q, k, v: [B, H, N, D]

MACE has no rank-5 Transpose. :func:`split_qkv` rewrites each branch into

    Slice x on its last axis to channels [i*H*D, (i+1)*H*D) -> Reshape [B, N, H, D]
    -> Transpose [0, 2, 1, 3]

whose output keeps the branch's tensor name. Only data moves, so the result is the same, bit for
bit. The parts axis may hold any number of parts (3 for q, k, v; 2 for a fused k, v), and any
permutation that puts it first is taken (the branch Transpose is the rest of it, left out when
that keeps the order); the pattern is rewritten only when it is complete: the Reshape feeds only the Transpose, the
rank-5 tensors feed only the branches, each branch takes one distinct index on axis 0, and no
rank-5 tensor is a graph output.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from maceq.quant.ir import Graph, Node


@dataclass
class _Branch:
    index: int  # which part: 0, 1, 2 for q, k, v
    nodes: list[Node]  # the nodes replaced: a Gather, or a Slice and its Squeeze
    output: str  # the [B, H, N, D] tensor the branch produces


def _int_list(g: Graph, node: Node, pos: int, attr: str):
    """An int list from the node's input ``pos`` (a constant) or, when it has no such input, its
    attribute ``attr``; None when neither is known."""
    if len(node.inputs) > pos and node.inputs[pos]:
        name = node.inputs[pos]
        return [int(v) for v in np.asarray(g.const(name)).ravel()] if g.is_const(name) else None
    value = node.attr(attr)
    return None if value is None else [int(v) for v in np.atleast_1d(value)]


def _slice_index(g: Graph, node: Node, dim: int) -> int | None:
    """The index a Slice keeps when it takes exactly one element of axis 0, else None."""
    if g.opset < 10:
        starts, ends, axes, steps = node.attr("starts"), node.attr("ends"), node.attr("axes"), None
    else:
        starts, ends = _int_list(g, node, 1, "starts"), _int_list(g, node, 2, "ends")
        axes, steps = _int_list(g, node, 3, "axes"), _int_list(g, node, 4, "steps")
        if (len(node.inputs) > 3 and node.inputs[3] and axes is None) or \
                (len(node.inputs) > 4 and node.inputs[4] and steps is None):
            return None
    if starts is None or ends is None or len(starts) != 1 or len(ends) != 1:
        return None
    if list(axes if axes is not None else [0]) not in ([0], [-5]) or list(steps or [1]) != [1]:
        return None
    start, end = int(starts[0]), int(ends[0])
    start = min(max(start + dim if start < 0 else start, 0), dim)
    end = min(max(end + dim if end < 0 else end, 0), dim)
    return start if end - start == 1 else None


def _squeezes_axis0(g: Graph, node: Node) -> bool:
    axes = _int_list(g, node, 1, "axes")
    return node.op_type == "Squeeze" and axes is not None and axes in ([0], [-5])


def _branch(g: Graph, node: Node, src: str, consumers: dict, dim: int, protected: set) -> _Branch | None:
    """The branch starting at ``node`` (a consumer of the rank-5 tensor ``src``), or None when it is not one."""
    if not node.inputs or node.inputs[0] != src or src in node.inputs[1:]:
        return None
    if node.op_type == "Gather":
        idx = np.asarray(g.const(node.inputs[1])) if g.is_const(node.inputs[1]) else None
        if (int(node.attr("axis", 0)) % 5 != 0 or idx is None or idx.ndim != 0
                or not np.issubdtype(idx.dtype, np.integer) or not -dim <= int(idx) < dim):
            return None
        return _Branch(int(idx) % dim, [node], node.outputs[0])
    if node.op_type != "Slice":
        return None
    index = _slice_index(g, node, dim)
    sliced = node.outputs[0]
    users = consumers.get(sliced, [])
    if (index is None or sliced in protected or len(users) != 1 or users[0].inputs[0] != sliced
            or not _squeezes_axis0(g, users[0])):
        return None
    return _Branch(index, [node, users[0]], users[0].outputs[0])


def _match(g: Graph, tr: Node, shapes: dict, consumers: dict, producers: dict):
    """(reshape, branches) when ``tr`` is the Transpose of a complete pattern, else None."""
    perm = [int(p) for p in (tr.attr("perm") or [])]
    reshape = producers.get(tr.inputs[0])
    if (len(perm) != 5 or perm[0] != 2 or reshape is None or reshape.op_type != "Reshape"
            or len(reshape.inputs) < 2 or not g.is_const(reshape.inputs[1])):
        return None
    x, five, out = reshape.inputs[0], reshape.outputs[0], tr.outputs[0]
    protected = set(g.outputs)
    if five in protected or out in protected or len(consumers.get(five, [])) != 1:
        return None
    xs, fs = shapes.get(x), shapes.get(five)
    if xs is None or fs is None or len(xs) != 3 or len(fs) != 5 or tuple(fs[:2]) != tuple(xs[:2]) \
            or fs[2] * fs[3] * fs[4] != xs[2]:
        return None
    branches = [_branch(g, n, out, consumers, fs[2], protected) for n in consumers.get(out, [])]
    if not branches or any(b is None for b in branches) or len({b.index for b in branches}) != len(branches):
        return None
    return reshape, branches


def _rewrite_branch(g: Graph, reshape: Node, perm: list[int], split: tuple[int, int, int], b: _Branch) -> None:
    """Replace one branch's nodes by Slice (channels) -> Reshape [B, N, H, D] -> Transpose (left
    out when the rest of ``perm`` keeps the order); ``split`` is the rank-5 tensor's (parts, H, D).
    The last new node takes the name of the branch's last node and writes the branch's output."""
    base = b.nodes[-1].name or b.output
    _, heads, depth = split
    width = heads * depth
    start, end = b.index * width, (b.index + 1) * width
    sliced, viewed = f"{base}__qkv_slice", f"{base}__qkv_view"
    if g.opset < 10:
        slice_node = Node(sliced, "Slice", [reshape.inputs[0]], [sliced],
                          {"starts": [start], "ends": [end], "axes": [2]})
    else:
        params = {"starts": start, "ends": end, "axes": 2}
        for key, value in params.items():
            g.initializers[f"{sliced}_{key}"] = np.array([value], np.int64)
        slice_node = Node(sliced, "Slice", [reshape.inputs[0]] + [f"{sliced}_{k}" for k in params], [sliced])
    order = [p if p < 2 else p - 1 for p in perm[1:]]
    keep_order = order == [0, 1, 2, 3]
    target = np.asarray(g.const(reshape.inputs[1]), np.int64)
    g.initializers[f"{viewed}_shape"] = np.array([target[0], target[1], heads, depth], np.int64)
    view_node = Node(base if keep_order else viewed, "Reshape", [sliced, f"{viewed}_shape"],
                     [b.output if keep_order else viewed], {k: v for k, v in reshape.attrs.items() if k == "allowzero"})
    new = [slice_node, view_node]
    if not keep_order:
        new.append(Node(base, "Transpose", [viewed], [b.output], {"perm": order}))
    at = g.nodes.index(b.nodes[0])
    for n in b.nodes:
        g.nodes.remove(n)
    g.nodes[at:at] = new


def split_qkv(g: Graph, input_shapes: dict[str, list[int]]) -> list[str]:
    """Rewrite every complete q/k/v split through a rank-5 tensor (module docstring) into rank-<=4
    ops; returns the names of the rank-5 Transpose nodes rewritten away."""
    candidates = [n for n in g.nodes if n.op_type == "Transpose" and len(n.attr("perm") or []) == 5]
    if not candidates:
        return []
    shapes = g.infer_shapes(input_shapes)
    rewritten = []
    for tr in candidates:
        found = _match(g, tr, shapes, g.consumers(), g.producers())
        if found is None:
            continue
        reshape, branches = found
        perm = [int(p) for p in tr.attr("perm")]
        split = tuple(int(d) for d in shapes[reshape.outputs[0]][2:])
        for b in branches:
            _rewrite_branch(g, reshape, perm, split, b)
        g.nodes.remove(tr)
        g.nodes.remove(reshape)
        rewritten.append(tr.name)
    return rewritten
