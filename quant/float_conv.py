"""Float emitters for convolutions, pooling and matrix products (NCHW kernels, MACE's float weight layouts)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from maceq.mace import add_arg
from maceq.mace.enums import PoolingType
from maceq.quant.float_core import FLT_MAX, Emitter, stored_shape


@dataclass(frozen=True)
class Window:
    """The window arguments of MACE's Conv2D / DepthwiseConv2d / Deconv2D."""

    strides: list[int]
    kernels: list[int]
    padding_values: list[int]
    dilations: list[int]


# -- geometry ---------------------------------------------------------------------------------------
def spatial_pads(em: Emitter, in_hw, kernel, strides, dilations) -> list[int]:
    """ONNX [top, left, bottom, right] from ``pads`` / ``auto_pad``."""
    auto = em.attr("auto_pad", "NOTSET") or "NOTSET"
    if auto == "NOTSET":
        p = [int(v) for v in (em.attr("pads") or [0, 0, 0, 0])]
        if len(p) != 4:
            raise em.err(f"pads {p}: only 2-D spatial padding is supported")
        return p
    if auto == "VALID":
        return [0, 0, 0, 0]
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        tot = [max(0, (-(-i // s) - 1) * s + (k - 1) * d + 1 - i)
               for i, k, s, d in zip(in_hw, kernel, strides, dilations)]
        first = [t // 2 if auto == "SAME_UPPER" else t - t // 2 for t in tot]
        return [first[0], first[1], tot[0] - first[0], tot[1] - first[1]]
    raise em.err(f"auto_pad={auto} is not supported")


def mace_pads_ok(p) -> bool:
    """Whether MACE's ``padding_values`` (total, leading = total >> 1) express ONNX pads [t, l, b, r]."""
    t, l, b, r = p
    return t == (t + b) >> 1 and l == (l + r) >> 1


def pad_nchw(em: Emitter, src: str, nchw_shape, p, value: float) -> tuple[str, list[int]]:
    """An explicit constant Pad of an NCHW tensor by ONNX pads [t, l, b, r]; returns (name, shape)."""
    t, l, b, r = p
    out = [nchw_shape[0], nchw_shape[1], nchw_shape[2] + t + b, nchw_shape[3] + l + r]
    dst = em.tmp("pad")
    op = em.add_op("Pad", [src], [dst], [out], tag="pad")
    add_arg(op, "pad_type", 0)
    add_arg(op, "paddings", [0, 0, 0, 0, t, b, l, r])
    add_arg(op, "constant_value", float(value))
    return dst, out


# -- convolutions -----------------------------------------------------------------------------------
def window_op(em: Emitter, op_type: str, inputs, out: str, out_shape, win: Window, group: int, *,
              fuse_act: bool, tag: str | None = None):
    """A Conv2D / DepthwiseConv2d / Deconv2D op with its window arguments (and the fused ReLU when asked)."""
    op = em.add_op(op_type, inputs, [out], [out_shape], tag=tag)
    add_arg(op, "strides", win.strides)
    add_arg(op, "kernels", win.kernels)
    add_arg(op, "padding_values", win.padding_values)
    add_arg(op, "group", group)
    add_arg(op, "dilations", win.dilations)
    if fuse_act:
        em.act_args(op)
    return op


def _weights(em: Emitter, src: str, filt, bias, suffix: str = "") -> list[str]:
    """[input, filter const, bias const (when there is a bias)]."""
    names = [src, em.add_const("filter" + suffix, filt)]
    if bias is not None:
        names.append(em.add_const("bias" + suffix, bias))
    return names


def conv(em: Emitter):
    """Conv: Conv2D, DepthwiseConv2d, or Split / a Conv2D per group / Concat for grouped convolution."""
    x_shape = em.shape(0)
    w = em.const(1, "weight").astype(np.float32)
    if w.ndim != 4 or len(x_shape) != 4:
        raise em.err("only 2-D convolution (4-D input and weight) is supported")
    n, c, h, wd = x_shape
    o, cg, kh, kw = w.shape
    group = int(em.attr("group", 1))
    strides = [int(v) for v in em.attr("strides", [1, 1])]
    dil = [int(v) for v in em.attr("dilations", [1, 1])]
    if c != cg * group:
        raise em.err(f"weight {w.shape} with group {group} does not fit {c} input channels")
    bias = em.const(2, "bias").astype(np.float32) if em.has(2) else None
    pads = spatial_pads(em, (h, wd), (kh, kw), strides, dil)
    out_nchw = em.oshape()
    x = em.nchw_in(0)
    xs = [n, c, h, wd]
    if not mace_pads_ok(pads):
        x, xs = pad_nchw(em, x, xs, pads, 0.0)
        pads = [0, 0, 0, 0]
    dst, trailing = em.result(fusable=True)
    y = em.tmp("nchw")
    win = Window(strides, [kh, kw], [pads[0] + pads[2], pads[1] + pads[3]], dil)
    if group > 1 and group == c and cg == 1:
        filt = w.reshape(c, o // c, kh, kw).transpose(1, 0, 2, 3)  # [M, C, KH, KW]
        window_op(em, "DepthwiseConv2d", _weights(em, x, filt, bias), y, out_nchw, win, c, fuse_act=not trailing)
    elif group == 1:
        window_op(em, "Conv2D", _weights(em, x, w, bias), y, out_nchw, win, 1, fuse_act=not trailing)
    else:
        _grouped_conv(em, x, xs, w, bias, y, out_nchw, win, fuse_act=not trailing)
    em.nhwc_out(y, out_nchw, dst)
    em.finish(dst, trailing, stored_shape(out_nchw))


def _grouped_conv(em: Emitter, x: str, xs, w, bias, y: str, out_nchw, win: Window, *, fuse_act: bool):
    """Grouped convolution as Split on C, one Conv2D per group, Concat on C (all NCHW)."""
    group = int(em.attr("group", 1))
    og, cg = w.shape[0] // group, w.shape[1]
    parts = [em.tmp(f"g{k}") for k in range(group)]
    sp = em.add_op("Split", [x], parts, [[xs[0], cg, xs[2], xs[3]]] * group, tag="split")
    add_arg(sp, "axis", 1)
    outs = []
    for k in range(group):
        yk = em.tmp(f"gy{k}")
        part_bias = bias[k * og:(k + 1) * og] if bias is not None else None
        window_op(em, "Conv2D", _weights(em, parts[k], w[k * og:(k + 1) * og], part_bias, f"_g{k}"), yk,
                  [out_nchw[0], og, out_nchw[2], out_nchw[3]], win, 1, fuse_act=fuse_act, tag=f"conv_g{k}")
        outs.append(yk)
    cat = em.add_op("Concat", outs, [y], [out_nchw], tag="concat")
    add_arg(cat, "axis", 1)


def _check_conv_transpose(em: Emitter, x_shape, w):
    """Refuse the ConvTranspose forms MACE's Deconv2D cannot express."""
    if w.ndim != 4 or len(x_shape) != 4:
        raise em.err("only 2-D transposed convolution is supported")
    if int(em.attr("group", 1)) != 1:
        raise em.err("group > 1 is not supported (MACE Deconv2D has no groups)")
    if any(int(d) != 1 for d in em.attr("dilations", [1, 1])):
        raise em.err("dilations != 1 are not supported (MACE's converter rejects them)")
    if (em.attr("auto_pad", "NOTSET") or "NOTSET") != "NOTSET" or em.attr("output_shape") is not None:
        raise em.err("auto_pad / output_shape are not supported; use explicit pads")


def conv_transpose(em: Emitter):
    """ConvTranspose: Deconv2D, then a crop when the pads or output_padding need one."""
    x_shape = em.shape(0)
    w = em.const(1, "weight").astype(np.float32)
    _check_conv_transpose(em, x_shape, w)
    n, _, h, wd = x_shape
    _, co, kh, kw = w.shape
    strides = [int(v) for v in em.attr("strides", [1, 1])]
    t, l, b, r = [int(v) for v in (em.attr("pads") or [0, 0, 0, 0])]
    oph, opw = [int(v) for v in (em.attr("output_padding") or [0, 0])]
    out_nchw = em.oshape()
    full = [n, co, (h - 1) * strides[0] + kh, (wd - 1) * strides[1] + kw]
    bias = em.const(2, "bias").astype(np.float32) if em.has(2) else None
    direct = oph == 0 and opw == 0 and mace_pads_ok([t, l, b, r])
    if not direct and (t + out_nchw[2] > full[2] or l + out_nchw[3] > full[3]):
        raise em.err("output_padding beyond the transposed convolution's extent is not supported")
    x = em.nchw_in(0)
    dst, trailing = em.result(fusable=True)
    y = em.tmp("nchw")
    dec_out = y if direct else em.tmp("full")
    win = Window(strides, [kh, kw], [t + b, l + r] if direct else [0, 0], [1, 1])
    window_op(em, "Deconv2D", _weights(em, x, w.transpose(1, 0, 2, 3), bias), dec_out,
              out_nchw if direct else full, win, 1, fuse_act=not trailing)
    if not direct:  # crop rows t.., columns l.. of the full output
        em.strided_slice(dec_out, y, full, [0, 0, t, l], [0, 0, t + out_nchw[2], l + out_nchw[3]],
                         mask=0b0011, out_shape=out_nchw)
    em.nhwc_out(y, out_nchw, dst)
    em.finish(dst, trailing, stored_shape(out_nchw))


# -- pooling ----------------------------------------------------------------------------------------
def _pool_window(em: Emitter, x_shape, max_pool: bool):
    """(kernel, strides, dilations, ONNX pads, ceil_mode) of a pooling node, refusing what MACE cannot run."""
    k = [int(v) for v in em.attr("kernel_shape", [])]
    if len(x_shape) != 4 or len(k) != 2:
        raise em.err("only 2-D pooling is supported")
    if int(em.attr("storage_order", 0)):
        raise em.err("storage_order = 1 is not supported")
    strides = [int(v) for v in em.attr("strides", [1, 1])]
    dil = [int(v) for v in em.attr("dilations", [1, 1])]
    pads = spatial_pads(em, x_shape[2:], k, strides, dil)
    ceil = bool(em.attr("ceil_mode", 0))
    if not max_pool and int(em.attr("count_include_pad", 0)) and any(pads):
        raise em.err("count_include_pad = 1 with padding is not supported (MACE excludes padding)")
    return k, strides, dil, pads, ceil


def _check_pool_size(em: Emitter, xs, pv, k, strides, dil, ceil: bool, out_nchw):
    """MACE's output size (CalcNCHWOutputSize, FLOOR/CEIL) must equal ONNX's."""
    for ax in (0, 1):
        span = xs[2 + ax] + pv[ax] - (k[ax] - 1) * dil[ax] - 1
        size = (-(-span // strides[ax]) if ceil else span // strides[ax]) + 1
        if size != out_nchw[2 + ax]:
            raise em.err(f"MACE's pooling output size {size} differs from ONNX's {out_nchw[2 + ax]}")


def _pool(em: Emitter, max_pool: bool):
    """MaxPool / AveragePool as a Pooling op (a max pool's odd pads as an explicit -FLT_MAX Pad)."""
    x_shape = em.shape(0)
    k, strides, dil, pads, ceil = _pool_window(em, x_shape, max_pool)
    out_nchw = em.oshape()
    x = em.nchw_in(0)
    xs = list(x_shape)
    if not mace_pads_ok(pads):
        if not max_pool:
            raise em.err(f"pads {pads} cannot be expressed as MACE padding_values (top must be total // 2)")
        x, xs = pad_nchw(em, x, xs, pads, -FLT_MAX)
        pads = [0, 0, 0, 0]
    pv = [pads[0] + pads[2], pads[1] + pads[3]]
    _check_pool_size(em, xs, pv, k, strides, dil, ceil, out_nchw)
    y = em.tmp("nchw")
    op = em.add_op("Pooling", [x], [y], [out_nchw])
    add_arg(op, "strides", strides)
    add_arg(op, "kernels", k)
    add_arg(op, "padding_values", pv)
    add_arg(op, "pooling_type", PoolingType.MAX if max_pool else PoolingType.AVG)
    add_arg(op, "round_mode", 1 if ceil else 0)
    add_arg(op, "dilations", dil)
    dst, trailing = em.result(fusable=False)
    em.nhwc_out(y, out_nchw, dst)
    em.finish(dst, trailing, stored_shape(out_nchw))


def max_pool(em: Emitter):
    """MaxPool."""
    _pool(em, True)


def average_pool(em: Emitter):
    """AveragePool."""
    _pool(em, False)


# -- matrix products --------------------------------------------------------------------------------
def _gemm_bias(em: Emitter, nout: int):
    """Gemm's C times beta as a per-output float64 vector, or None."""
    if not em.has(2):
        return None
    c = em.const(2, "bias C").astype(np.float64) * float(em.attr("beta", 1.0))
    if c.size == 1:
        return np.full(nout, c.ravel()[0])
    if c.shape in ((nout,), (1, nout)):
        return c.reshape(nout)
    raise em.err(f"bias of shape {c.shape} (only a per-output vector is supported)")


def _matmul_op(em: Emitter, inputs, dst: str, transpose_b: int):
    """A MatMul op writing ``dst`` in the node's output shape."""
    op = em.add_op("MatMul", inputs, [dst], [em.oshape()])
    add_arg(op, "transpose_a", 0)
    add_arg(op, "transpose_b", transpose_b)


def gemm(em: Emitter):
    """Gemm: MatMul with the weight [N, K] and transpose_b = 1, alpha and beta folded."""
    if int(em.attr("transA", 0)):
        raise em.err("transA = 1 is not supported")
    a_shape = em.shape(0)
    if len(a_shape) != 2:
        raise em.err(f"input of rank {len(a_shape)}")
    b = em.const(1, "weight B").astype(np.float64)
    wmat = b if int(em.attr("transB", 0)) else b.T          # [N, K]
    wmat = wmat * float(em.attr("alpha", 1.0))
    bias = _gemm_bias(em, wmat.shape[0])
    dst, trailing = em.result(fusable=False)
    ins = [em.src(0), em.add_const("weight", wmat.astype(np.float32))]
    if bias is not None:
        ins.append(em.add_const("bias", bias.astype(np.float32)))
    _matmul_op(em, ins, dst, 1)
    em.finish(dst, trailing, em.oshape())


def _batched_matmul(em: Emitter, dst: str):
    """Two 4-D activations (attention's q @ k^T and p @ v): they are stored NHWC and MACE's MatMul
    multiplies the last two dims of the memory order, so both go to NCHW and the product comes back."""
    sa, sb = em.shape(0), em.shape(1)
    if len(sb) != 4 or list(sa[:2]) != list(sb[:2]):
        raise em.err(f"operands {list(sa)} and {list(sb)} (MACE's batched MatMul needs equal batch dims)")
    tmp = em.tmp("nchw")
    _matmul_op(em, [em.nchw_in(0), em.nchw_in(1)], tmp, 0)
    em.nhwc_out(tmp, em.oshape(), dst)


def matmul(em: Emitter):
    """MatMul of ranks 2-3, or of two 4-D activations: a constant right operand becomes a [N, K]
    weight with transpose_b = 1."""
    if em.is_const(0):
        raise em.err("a constant left operand is not supported")
    ra = len(em.shape(0))
    if ra < 2 or (ra == 4 and em.is_const(1)):
        raise em.err(f"left operand of rank {ra} (ranks 2 and 3, or two 4-D activations, are supported)")
    dst, trailing = em.result(fusable=False)
    if ra == 4:
        _batched_matmul(em, dst)
        em.finish(dst, trailing, stored_shape(em.oshape()))
        return
    if em.is_const(1):
        b = em.const(1, "B").astype(np.float32)
        if b.ndim != 2:
            raise em.err("a constant right operand must be 2-D")
        _matmul_op(em, [em.src(0), em.add_const("weight", b.T)], dst, 1)
    else:
        rb = len(em.shape(1))
        if rb == 4 or rb < 2:
            raise em.err(f"right operand of rank {rb} (ranks 2 and 3 are supported)")
        _matmul_op(em, [em.src(0), em.src(1)], dst, 0)
    em.finish(dst, trailing, em.oshape())
