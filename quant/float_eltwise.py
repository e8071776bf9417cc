"""Float emitters for element-wise ops: binary Eltwise (with constant and broadcast operands) and activations."""
from __future__ import annotations

import math

import numpy as np

from maceq.mace import add_arg
from maceq.mace.enums import DataType, EltwiseType
from maceq.quant.float_core import TO_NHWC, Emitter, stored_shape

#: ONNX binary op -> MACE Eltwise type
ELTWISE = {"Add": EltwiseType.SUM, "Sub": EltwiseType.SUB, "Mul": EltwiseType.PROD, "Div": EltwiseType.DIV,
           "Min": EltwiseType.MIN, "Max": EltwiseType.MAX}


# -- binary -----------------------------------------------------------------------------------------
def _const_operand(em: Emitter, c: np.ndarray, out_rank: int) -> np.ndarray:
    """A constant operand broadcast-aligned to the output rank, in the stored (NHWC) order."""
    c = np.asarray(c, np.float32)
    if c.ndim > out_rank:
        raise em.err(f"constant of rank {c.ndim} broadcast to rank {out_rank}")
    if out_rank == 4:
        c = c.reshape((1,) * (4 - c.ndim) + c.shape).transpose(TO_NHWC)
    return c


def _eltwise_op(em: Emitter, kind: EltwiseType, inputs, dst: str, phys_out):
    """An Eltwise op of ``kind`` (the node's main op when it writes the node's output)."""
    op = em.add_op("Eltwise", inputs, [dst], [phys_out], tag=None if dst == em.outs[0] else "elt")
    add_arg(op, "type", kind)
    return op


def _with_constant(em: Emitter, kind, a: int, b: int, src_a, src_b, dst: str, out_shape):
    """Eltwise of an activation and a constant operand (a scalar becomes ``scalar_input``)."""
    out_rank = len(out_shape)
    ca = em.is_const(a) and src_a is None
    ci, xi = (a, b) if ca else (b, a)
    xs = em.shape(xi)
    if len(xs) != out_rank:
        raise em.err(f"activation of rank {len(xs)} broadcast to rank {out_rank} by a constant")
    c = _const_operand(em, em.g.const(em.n.inputs[ci]), out_rank)
    x = (src_a if xi == a else src_b) or em.src(xi)
    if c.size == 1:
        op = _eltwise_op(em, kind, [x], dst, stored_shape(out_shape))
        add_arg(op, "scalar_input", float(c.ravel()[0]))
        add_arg(op, "scalar_input_index", 0 if ca else 1)
        return
    cname = em.add_const(f"operand{ci}", c)
    _eltwise_op(em, kind, [cname, x] if ca else [x, cname], dst, stored_shape(out_shape))


def binary(em: Emitter, kind, a: int, b: int, src_a: str | None, src_b: str | None, dst: str, out_shape):
    """Eltwise ``type`` = kind on IR inputs a, b (``src_*`` overrides their MACE names)."""
    out_rank = len(out_shape)
    ca, cb = em.is_const(a) and src_a is None, em.is_const(b) and src_b is None
    if ca and cb:
        raise em.err("both operands are constants (fold them first)")
    if ca or cb:
        _with_constant(em, kind, a, b, src_a, src_b, dst, out_shape)
        return
    sa, sb = (em.shape(a) if src_a is None else None), (em.shape(b) if src_b is None else None)
    ra = len(sa) if sa is not None else out_rank
    rb = len(sb) if sb is not None else out_rank
    if ra != rb and 4 in (ra, rb):
        small = sa if ra < rb else sb
        if small is None or int(np.prod(small)) != 1:
            raise em.err("a lower-rank activation broadcast against a 4-D one is not supported")
    _eltwise_op(em, kind, [src_a or em.src(a), src_b or em.src(b)], dst, stored_shape(out_shape))


def eltwise(em: Emitter):
    """Add, Sub, Mul, Div, Max, Min (a variadic Max/Min as a chain of binary ops)."""
    kind = ELTWISE[em.n.op_type]
    k = len(em.n.inputs)
    if k < 2:
        raise em.err("needs at least two inputs")
    out_shape = em.oshape()
    dst, trailing = em.result(fusable=False)
    if k == 2:
        binary(em, kind, 0, 1, None, None, dst, out_shape)
    else:
        if any(em.is_const(i) for i in range(k)):
            raise em.err("constant operands in a variadic Max/Min are not supported")
        acc = em.src(0)
        for i in range(1, k):
            nxt = dst if i == k - 1 else em.tmp(f"chain{i}")
            binary(em, kind, 0, i, acc, None, nxt, out_shape)
            acc = nxt
    em.finish(dst, trailing, stored_shape(out_shape))


# -- activations ------------------------------------------------------------------------------------
def _activation(em: Emitter, kind: str, **args):
    """An Activation op of ``kind`` with float arguments ``args``."""
    shp = stored_shape(em.oshape())
    dst, trailing = em.result(fusable=False)
    op = em.add_op("Activation", [em.src(0)], [dst], [shp])
    add_arg(op, "activation", kind)
    for k, v in args.items():
        add_arg(op, k, float(v))
    em.finish(dst, trailing, shp)


def relu(em: Emitter):
    """Relu."""
    _activation(em, "RELU")


def sigmoid(em: Emitter):
    """Sigmoid."""
    _activation(em, "SIGMOID")


def tanh(em: Emitter):
    """Tanh."""
    _activation(em, "TANH")


def _leaky_relu(em: Emitter, alpha: float):
    """LEAKYRELU; MACE master reads activation_coefficient, older releases leakyrelu_coefficient: both are written."""
    _activation(em, "LEAKYRELU", activation_coefficient=alpha, leakyrelu_coefficient=alpha)


def leaky_relu(em: Emitter):
    """LeakyRelu."""
    _leaky_relu(em, float(em.attr("alpha", 0.01)))


def hard_sigmoid(em: Emitter):
    """HardSigmoid."""
    _activation(em, "HARDSIGMOID", hardsigmoid_alpha=float(em.attr("alpha", 0.2)),
                hardsigmoid_beta=float(em.attr("beta", 0.5)))


def hard_swish(em: Emitter):
    """HardSwish as x * HardSigmoid(x) with alpha = 1/6, beta = 0.5 (the ONNX definition; MACE has none)."""
    shp = stored_shape(em.oshape())
    hs = em.tmp("hardsigmoid")
    op = em.add_op("Activation", [em.src(0)], [hs], [shp], tag="hardsigmoid")
    add_arg(op, "activation", "HARDSIGMOID")
    add_arg(op, "hardsigmoid_alpha", float(np.float32(1.0 / 6.0)))
    add_arg(op, "hardsigmoid_beta", 0.5)
    dst, trailing = em.result(fusable=False)
    prod = em.add_op("Eltwise", [em.src(0), hs], [dst], [shp])
    add_arg(prod, "type", EltwiseType.PROD)
    em.finish(dst, trailing, shp)


def clip(em: Emitter):
    """Clip (bounds from attributes before opset 11, from inputs after)."""
    lo, hi = -math.inf, math.inf
    if "min" in em.n.attrs or "max" in em.n.attrs:
        lo, hi = float(em.attr("min", -math.inf)), float(em.attr("max", math.inf))
    if em.has(1):
        lo = float(em.const(1, "min").ravel()[0])
    if em.has(2):
        hi = float(em.const(2, "max").ravel()[0])
    shp = stored_shape(em.oshape())
    dst, trailing = em.result(fusable=False)
    em.clamp_op(em.src(0), dst, shp, lo, hi, tag=None)
    em.finish(dst, trailing, shp)


def prelu(em: Emitter):
    """PRelu: a scalar slope as LEAKYRELU, a per-channel slope as PRELU (NCHW). MACE's PRELU reads its
    input as [N, C, H*W] (activation.cc): a 2-D input [N, C] runs it as [N, C, 1, 1], through Reshapes."""
    slope = em.const(1, "slope").astype(np.float32)
    x_shape = em.shape(0)
    if slope.size == 1:
        _leaky_relu(em, float(slope.ravel()[0]))
        return
    full = slope.reshape((1,) * (len(x_shape) - slope.ndim) + slope.shape) if slope.ndim <= len(x_shape) else None
    if len(x_shape) not in (2, 4) or full is None or full.shape != (1, x_shape[1]) + (1,) * (len(x_shape) - 2):
        raise em.err(f"slope of shape {slope.shape}: only a scalar or a per-channel slope on a 2-D or 4-D "
                     "input is supported")
    if len(x_shape) == 2:
        _prelu_2d(em, full.reshape(-1))
        return
    out_nchw = em.oshape()
    x = em.nchw_in(0)
    dst, trailing = em.result(fusable=False)
    y = em.tmp("nchw")
    op = em.add_op("Activation", [x, em.add_const("alpha", full.reshape(-1))], [y], [out_nchw])
    add_arg(op, "activation", "PRELU")
    em.nhwc_out(y, out_nchw, dst)
    em.finish(dst, trailing, stored_shape(out_nchw))


def _prelu_2d(em: Emitter, alpha: np.ndarray):
    """PRELU on [N, C]: Reshape to [N, C, 1, 1] (0 keeps the batch), PRELU, Reshape back."""
    n, c = em.shape(0)
    dst, trailing = em.result(fusable=False)
    up, act = em.tmp("4d"), em.tmp("prelu")
    _reshape(em, em.src(0), up, [0, c, 1, 1], [n, c, 1, 1])
    op = em.add_op("Activation", [up, em.add_const("alpha", alpha)], [act], [[n, c, 1, 1]])
    add_arg(op, "activation", "PRELU")
    _reshape(em, act, dst, [0, c], [n, c])
    em.finish(dst, trailing, [n, c])


def _reshape(em: Emitter, src: str, dst: str, dims: list[int], shape: list[int]):
    """A MACE Reshape of ``src`` to ``dims`` (0 copies the input's dim)."""
    op = em.add_op("Reshape", [src, em.add_const("shape", np.array(dims), DataType.DT_INT32)], [dst], [shape])
    add_arg(op, "dim", dims)


def unary(em: Emitter):
    """Neg, Abs: MACE's Eltwise NEG / ABS on the one input (a sign change: exact)."""
    kind = {"Neg": EltwiseType.NEG, "Abs": EltwiseType.ABS}[em.n.op_type]
    shp = stored_shape(em.oshape())
    dst, trailing = em.result(fusable=False)
    op = em.add_op("Eltwise", [em.src(0)], [dst], [shp])
    add_arg(op, "type", kind)
    em.finish(dst, trailing, shp)


def power(em: Emitter):
    """Pow by a constant scalar; Sqrt and Reciprocal as Pow by 0.5 and -1, as MACE's converter writes
    them (onnx_converter.py). Exponent 2 is x * x (``powf(x, 2)`` is x*x rounded once: exact); any
    other runs MACE's Eltwise POW, libm's ``powf``, which is within an ulp of onnxruntime's result
    but not always equal (docs/float-ops.md)."""
    if em.n.op_type in ("Sqrt", "Reciprocal"):
        e = 0.5 if em.n.op_type == "Sqrt" else -1.0
    else:
        c = em.const(1, "exponent").ravel() if em.is_const(1) else None
        if c is None or c.size != 1:
            raise em.err("only a constant scalar exponent has a MACE form (Eltwise POW)")
        e = float(c[0])
    shp = stored_shape(em.oshape())
    dst, trailing = em.result(fusable=False)
    if e == 2.0:
        op = em.add_op("Eltwise", [em.src(0), em.src(0)], [dst], [shp])
        add_arg(op, "type", EltwiseType.PROD)
    else:
        op = em.add_op("Eltwise", [em.src(0)], [dst], [shp])
        add_arg(op, "type", EltwiseType.POW)
        add_arg(op, "scalar_input", e)
        add_arg(op, "scalar_input_index", 1)
    em.finish(dst, trailing, shp)
