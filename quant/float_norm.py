"""Float emitters for reductions and normalizations: Reduce, global pooling, BatchNorm, Softmax / LogSoftmax."""
from __future__ import annotations

import numpy as np

from maceq.mace import add_arg
from maceq.mace.enums import ReduceType
from maceq.quant.float_core import A2P, P2A, Emitter, ivals, stored_shape

#: ONNX op -> MACE Reduce type
REDUCE = {"ReduceMean": ReduceType.MEAN, "ReduceMin": ReduceType.MIN, "ReduceMax": ReduceType.MAX,
          "ReduceProd": ReduceType.PROD, "ReduceSum": ReduceType.SUM,
          "GlobalAveragePool": ReduceType.MEAN, "GlobalMaxPool": ReduceType.MAX}


def batch_norm(em: Emitter):
    """BatchNormalization as MACE's BatchNorm with the folded scale and offset (NCHW)."""
    if int(em.attr("training_mode", 0)):
        raise em.err("training_mode = 1 is not supported")
    x_shape = em.shape(0)
    if len(x_shape) != 4:
        raise em.err("MACE's BatchNorm needs a 4-D input")
    gamma, beta, mean, var = (em.const(i, what).astype(np.float64)
                              for i, what in ((1, "scale"), (2, "B"), (3, "mean"), (4, "var")))
    eps = float(em.attr("epsilon", 1e-5))
    # onnx_converter.py convert_fused_batchnorm: in float64, stored as float32
    scale = (1.0 / np.sqrt(var + eps)) * gamma
    offset = (-mean * scale) + beta
    out_nchw = em.oshape()
    x = em.nchw_in(0)
    dst, trailing = em.result(fusable=True)
    y = em.tmp("nchw")
    op = em.add_op("BatchNorm", [x, em.add_const("scale", scale), em.add_const("offset", offset)],
                   [y], [out_nchw])
    if not trailing:
        em.act_args(op)
    em.nhwc_out(y, out_nchw, dst)
    em.finish(dst, trailing, stored_shape(out_nchw))


# -- reductions -------------------------------------------------------------------------------------
def _reduce(em: Emitter, axes, keepdims: bool):
    """A Reduce op over ONNX ``axes`` (all when empty), its kept axes put back in ONNX order when needed."""
    x_shape = em.shape(0)
    r = len(x_shape)
    axes = sorted({int(a) % r for a in axes}) if axes else list(range(r))
    out_shape = em.oshape()
    if not keepdims and len(axes) == r:
        raise em.err("reducing every axis without keepdims (a rank-0 output) is not supported")
    phys = sorted(A2P[a] for a in axes) if r == 4 else axes
    dst, trailing = em.result(fusable=False)
    remaining = [p for p in range(r) if p not in phys]
    order = [P2A[p] for p in remaining] if r == 4 else remaining
    needs_perm = r == 4 and not keepdims and order != sorted(order)
    red_out = em.tmp("reduced") if needs_perm else dst
    red_shape = stored_shape(out_shape) if not needs_perm else [x_shape[a] for a in order]
    op = em.add_op("Reduce", [em.src(0)], [red_out], [red_shape], tag="reduce" if needs_perm else None)
    add_arg(op, "reduce_type", REDUCE[em.n.op_type])
    add_arg(op, "axis", phys)
    add_arg(op, "keepdims", 1 if keepdims else 0)
    if needs_perm:  # the kept axes come out in NHWC order; the tensor (rank < 4) must be in ONNX order
        perm = sorted(range(len(order)), key=lambda i: order[i])
        em.transpose(red_out, red_shape, perm, dst=dst, tag="onnx_order")
    em.finish(dst, trailing, stored_shape(out_shape))


def global_pool(em: Emitter):
    """GlobalAveragePool / GlobalMaxPool as a Reduce over the spatial axes, keeping them."""
    r = len(em.shape(0))
    if r < 3:
        raise em.err("needs a rank >= 3 input")
    _reduce(em, list(range(2, r)), True)


def reduce(em: Emitter):
    """ReduceMean / Max / Min / Sum / Prod (axes from the attribute or the axes input)."""
    axes = em.attr("axes")
    if axes is None and em.has(1):
        axes = ivals(em.const(1, "axes"))
    if not axes and int(em.attr("noop_with_empty_axes", 0)):
        raise em.err("noop_with_empty_axes = 1 is not supported")
    _reduce(em, axes or [], bool(int(em.attr("keepdims", 1))))


# -- softmax ----------------------------------------------------------------------------------------
def _softmax_op(em: Emitter, src: str, out: str, out_shape, mace_axis: int, use_log: bool):
    """A Softmax op (``use_log`` for LogSoftmax) over ``mace_axis`` of the stored tensor."""
    op = em.add_op("Softmax", [src], [out], [out_shape])
    if use_log:
        add_arg(op, "use_log", 1)
    add_arg(op, "axis", mace_axis)


def _softmax_4d(em: Emitter, axis: int, shp, dst: str, use_log: bool):
    """4-D softmax: MACE's kernel runs over dim 1 of the stored tensor; other axes are transposed there."""
    p = A2P[axis]
    if p == 1:
        _softmax_op(em, em.src(0), dst, shp, 1, use_log)
        return
    perm = [0, p] + [d for d in (1, 2, 3) if d != p]
    t, ts = em.transpose(em.src(0), shp, perm, tag="to_axis1")
    y = em.tmp("softmax")
    _softmax_op(em, t, y, ts, 1, use_log)
    inv = [perm.index(d) for d in range(4)]
    em.transpose(y, ts, inv, dst=dst, tag="from_axis1")


def _softmax(em: Emitter, use_log: bool):
    """Softmax / LogSoftmax over one axis (opset < 13: the flattened trailing axes, when they are one)."""
    x_shape = em.shape(0)
    r = len(x_shape)
    axis = int(em.attr("axis", -1 if em.g.opset >= 13 else 1)) % r
    if em.g.opset < 13 and axis != r - 1 and int(np.prod(x_shape[axis + 1:])) != 1:
        raise em.err("opset < 13 softmax over several flattened axes is not supported")
    shp = stored_shape(x_shape)
    dst, trailing = em.result(fusable=False)
    if r in (2, 3):
        if axis != r - 1:
            raise em.err(f"softmax over axis {axis} of a rank-{r} tensor (MACE: last axis only)")
        _softmax_op(em, em.src(0), dst, shp, r - 1, use_log)
    elif r == 4:
        _softmax_4d(em, axis, shp, dst, use_log)
    else:
        raise em.err(f"softmax on a rank-{r} tensor is not supported")
    em.finish(dst, trailing, shp)


def softmax(em: Emitter):
    """Softmax."""
    _softmax(em, False)


def log_softmax(em: Emitter):
    """LogSoftmax."""
    _softmax(em, True)
