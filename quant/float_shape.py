"""Float emitters for data movement: Concat, Transpose, Pad, Split, Slice and the reshape family."""
from __future__ import annotations

import numpy as np

from maceq.mace import add_arg
from maceq.mace.enums import DataType
from maceq.quant.float_core import A2P, P2A, TO_NCHW, TO_NHWC, Emitter, ivals, stored_shape


def concat(em: Emitter):
    """Concat on the stored axis (constant operands become const tensors in the stored order)."""
    out_shape = em.oshape()
    r = len(out_shape)
    axis = int(em.attr("axis")) % r
    ins = []
    for i in range(len(em.n.inputs)):
        if em.is_const(i):
            c = np.asarray(em.g.const(em.n.inputs[i]), np.float32)
            ins.append(em.add_const(f"input{i}", c.transpose(TO_NHWC) if r == 4 else c))
        else:
            ins.append(em.src(i))
    dst, trailing = em.result(fusable=False)
    op = em.add_op("Concat", ins, [dst], [stored_shape(out_shape)])
    add_arg(op, "axis", A2P[axis] if r == 4 else axis)
    em.finish(dst, trailing, stored_shape(out_shape))


def transpose(em: Emitter):
    """Transpose of ranks 2-4, its permutation mapped onto the stored order."""
    x_shape = em.shape(0)
    r = len(x_shape)
    perm = [int(p) for p in (em.attr("perm") or list(range(r))[::-1])]
    if r == 4:
        dims = [A2P[perm[P2A[i]]] for i in range(4)]
    elif r in (2, 3):
        dims = perm
    else:
        raise em.err(f"rank {r} (MACE's Transpose takes ranks 2-4)")
    dst, trailing = em.result(fusable=False)
    em.transpose(em.src(0), stored_shape(x_shape), dims, dst=dst, tag="transpose")
    em.ops[-1].name = em.name
    em.finish(dst, trailing, stored_shape(em.oshape()))


def _pad_amounts(em: Emitter) -> tuple[list[int], float]:
    """(ONNX pads, constant value) from the attributes or inputs."""
    pads = em.attr("pads")
    if pads is None:
        pads = ivals(em.const(1, "pads"))
    value = float(em.attr("value", 0.0))
    if em.has(2):
        value = float(em.const(2, "constant_value").ravel()[0])
    return pads, value


def pad(em: Emitter):
    """Pad (constant or reflect) of a 4-D tensor, ``paddings`` in the stored order."""
    mode = em.attr("mode", "constant") or "constant"
    if mode not in ("constant", "reflect"):
        raise em.err(f"mode '{mode}' is not supported")
    if em.has(3):
        raise em.err("the axes input is not supported")
    pads, value = _pad_amounts(em)
    if len(em.shape(0)) != 4:
        raise em.err("MACE's Pad needs a 4-D input")
    pads = [int(p) for p in pads]
    if min(pads) < 0:
        raise em.err("negative pads (cropping) are not supported")
    paddings = []
    for p in range(4):
        a = P2A[p]
        paddings += [pads[a], pads[a + 4]]
    dst, trailing = em.result(fusable=False)
    op = em.add_op("Pad", [em.src(0)], [dst], [stored_shape(em.oshape())])
    add_arg(op, "pad_type", 0 if mode == "constant" else 1)
    add_arg(op, "paddings", paddings)
    add_arg(op, "constant_value", value)
    em.finish(dst, trailing, stored_shape(em.oshape()))


def _split_sizes(em: Emitter, x_shape, axis: int) -> list[int]:
    """The size of each Split output along ``axis`` (attribute, input, or the output shapes)."""
    sizes = em.attr("split")
    if sizes is None and em.has(1):
        sizes = ivals(em.const(1, "split"))
    k = len(em.n.outputs)
    if sizes is None:
        sizes = [int(em.oshape(j)[axis]) for j in range(k)]
    sizes = [int(s) for s in sizes]
    if len(sizes) != k or sum(sizes) != x_shape[axis]:
        raise em.err(f"split sizes {sizes} do not fit {x_shape[axis]} / {k} outputs")
    return sizes


def split(em: Emitter):
    """Split: MACE's Split for equal parts, else one StridedSlice per output."""
    x_shape = em.shape(0)
    r = len(x_shape)
    axis = int(em.attr("axis", 0)) % r
    sizes = _split_sizes(em, x_shape, axis)
    if em.act is not None:
        raise em.err("a fused activation on Split is not supported")
    pa = A2P[axis] if r == 4 else axis
    out_shapes = [stored_shape(em.oshape(j)) for j in range(len(sizes))]
    if len(sizes) >= 2 and len(set(sizes)) == 1:
        op = em.add_op("Split", [em.src(0)], list(em.outs), out_shapes)
        add_arg(op, "axis", pa)
        return
    start = 0
    mask = ((1 << r) - 1) & ~(1 << pa)  # full range on every other dimension
    for j, s in enumerate(sizes):
        begin, end = [0] * r, [0] * r
        begin[pa], end[pa] = start, start + s
        op = em.strided_slice(em.src(0), em.outs[j], stored_shape(x_shape), begin, end, mask=mask,
                              out_shape=out_shapes[j], tag=f"part{j}")
        if j == 0:
            op.name = em.name
        start += s


def _slice_params(em: Emitter, r: int):
    """(starts, ends, axes, steps) of a Slice, from attributes (opset < 10) or inputs."""
    if em.g.opset < 10:
        starts, ends = em.attr("starts"), em.attr("ends")
        axes, steps = em.attr("axes"), None
    else:
        starts, ends = ivals(em.const(1, "starts")), ivals(em.const(2, "ends"))
        axes = ivals(em.const(3, "axes")) if em.has(3) else None
        steps = ivals(em.const(4, "steps")) if em.has(4) else None
    axes = [int(a) % r for a in (axes if axes is not None else range(len(starts)))]
    steps = [int(s) for s in (steps if steps is not None else [1] * len(axes))]
    if any(s <= 0 for s in steps):
        raise em.err("only positive steps are supported")
    return starts, ends, axes, steps


def slice_(em: Emitter):
    """Slice with positive steps as a StridedSlice on the stored order (untouched dims masked)."""
    x_shape = em.shape(0)
    r = len(x_shape)
    starts, ends, axes, steps = _slice_params(em, r)
    begin, end, stride = [0] * r, [0] * r, [1] * r
    mask = (1 << r) - 1
    for a, s0, e0, st in zip(axes, starts, ends, steps):
        dim = x_shape[a]
        s0, e0 = int(s0), int(e0)
        s0 = min(max(s0 + dim if s0 < 0 else s0, 0), dim)
        e0 = min(max(e0 + dim if e0 < 0 else e0, 0), dim)
        p = A2P[a] if r == 4 else a
        begin[p], end[p], stride[p] = s0, e0, st
        mask &= ~(1 << p)
    if any(d == 0 for d in em.oshape()):
        raise em.err("an empty slice is not supported")
    dst, trailing = em.result(fusable=False)
    em.strided_slice(em.src(0), dst, stored_shape(x_shape), begin, end, mask=mask,
                     out_shape=stored_shape(em.oshape()), strides=stride, tag=None)
    em.finish(dst, trailing, stored_shape(em.oshape()))


def _order_matters(shape4) -> bool:
    """NHWC and NCHW memory orders differ only when C > 1 and H*W > 1."""
    return shape4[1] > 1 and shape4[2] * shape4[3] > 1


def reshape(em: Emitter):
    """Flatten / Reshape / Squeeze / Unsqueeze: a Reshape in ONNX memory order (transposed when it differs)."""
    in_shape, out_shape = em.shape(0), em.oshape()
    dst, trailing = em.result(fusable=False)
    cur, cur_shape = em.src(0), stored_shape(in_shape)
    if len(in_shape) == 4 and _order_matters(in_shape):
        cur, cur_shape = em.transpose(cur, cur_shape, TO_NCHW, tag="to_nchw")
    post = len(out_shape) == 4 and _order_matters(out_shape)
    target = list(out_shape) if post else stored_shape(out_shape)
    if target and cur_shape and target[0] == cur_shape[0]:
        target[0] = 0  # MACE Reshape: 0 copies the input's dim (keeps the batch dynamic)
    red = em.tmp("onnx_order") if post else dst
    shape_name = em.add_const("shape", np.array(target), DataType.DT_INT32)
    op = em.add_op("Reshape", [cur, shape_name], [red], [list(out_shape) if post else stored_shape(out_shape)])
    add_arg(op, "dim", target)
    if post:
        em.transpose(red, out_shape, TO_NHWC, dst=dst, tag="to_nhwc")
    em.finish(dst, trailing, stored_shape(out_shape))
