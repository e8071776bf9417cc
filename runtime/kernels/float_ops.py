"""MACE CPU float32 kernels, on the tensors exactly as MACE's float kernels index them.

Every function here takes and returns float32 numpy arrays. The 4-D kernels of the
"fixed data format" ops (conv, depthwise conv, deconv, pooling, batch norm, resize,
PReLU, 4-D softmax) are written for **NCHW** memory, as MACE's float CPU kernels are
(``mace/ops/ref/conv_2d.cc``, ``ref/depthwise_conv_2d.cc``, ``ref/deconv_2d.cc``,
``pooling.cc``, ``resize_bilinear.cc``, ``resize_nearest_neighbor.cc``,
``activation.cc`` PReLU, ``softmax.cc``). The data-movement kernels (transpose, reshape,
concat, split, strided slice, pad) and the element-wise ones work on the raw array.
Choosing which layout an op sees is the op layer's job (``maceq.runtime.ops_float``).

Evaluation order (float32 throughout, fixed and documented; MACE's NEON kernels
accumulate in their own orders, so results agree with MACE to float32 rounding, not
bit for bit):

- Conv2D: ``acc = W[O, C*KH*KW] @ cols[C*KH*KW, OH*OW]`` as one float32 GEMM (BLAS
  sgemm, summation order left to BLAS), padded taps are zeros; then ``acc + bias``
  (one float32 add); then the activation. MACE: conv, then ``BiasAdd``, then
  ``Activation`` (``mace/ops/conv_2d.cc``).
- DepthwiseConv2d: ``acc = 0; for kh: for kw: acc += x * w`` (float32, taps in the order
  of ``ref/depthwise_conv_2d.cc``), then bias, then activation.
- Deconv2D: the full ``(H-1)*s + KH`` output is accumulated tap by tap
  (``full[.., kh + s*i, kw + s*j] += sum_ic x*w``, the channel sum a float32 GEMM), then
  cropped at ``pad_total // 2`` (``ref/deconv_2d.cc``), then bias, then activation.
- Pooling: max starts at the lowest float and skips out-of-bounds taps; average sums the
  in-bounds taps in (kh, kw) order and divides by their count (``pooling.cc``).
- Everything else is a single numpy float32 expression, written out at each function.
"""
from __future__ import annotations

import math
from enum import Enum

import numpy as np

from maceq.errors import MaceqError

F32 = np.float32
FLT_MAX = float(np.finfo(np.float32).max)
FLT_MIN = float(np.finfo(np.float32).tiny)


class ActKind(Enum):
    """MACE ``ActivationType`` (mace/ops/common/activation_type.h), by its ``activation`` arg string."""

    NOOP = "NOOP"
    RELU = "RELU"
    RELUX = "RELUX"
    PRELU = "PRELU"
    TANH = "TANH"
    SIGMOID = "SIGMOID"
    LEAKYRELU = "LEAKYRELU"
    ELU = "ELU"
    HARDSIGMOID = "HARDSIGMOID"


class EltKind(Enum):
    """MACE ``EltwiseType`` (mace/ops/common/eltwise_type.h; base_converter.py)."""

    SUM = 0
    SUB = 1
    PROD = 2
    DIV = 3
    MIN = 4
    MAX = 5
    NEG = 6
    ABS = 7
    SQR_DIFF = 8
    POW = 9
    FLOOR_DIV = 11
    CLIP = 12


class ReduceKind(Enum):
    """MACE ``ReduceType`` (mace/ops/common/reduce_type.h)."""

    MEAN = 0
    MIN = 1
    MAX = 2
    PROD = 3
    SUM = 4


def f32(x) -> np.ndarray:
    return np.asarray(x, dtype=F32)


# ------------------------------------------------------------------------------------------
# Activations (mace/ops/ref/activation.cc, mace/ops/activation.cc)
# ------------------------------------------------------------------------------------------

def activation(x: np.ndarray, kind: ActKind, *, limit: float = 0.0, coefficient: float = 0.0,
               hs_alpha: float = 0.0, hs_beta: float = 0.0, prelu_alpha: np.ndarray | None = None,
               channel_axis: int = 1) -> np.ndarray:
    """MACE's activation on float32 ``x``.

    RELU ``max(0, x)``; RELUX ``max(0, min(limit, x))``; LEAKYRELU
    ``max(x, 0) + min(x, 0) * coefficient``; TANH ``tanh(x)``; SIGMOID ``1 / (1 + exp(-x))``;
    HARDSIGMOID ``max(0, min(1, alpha * x + beta))``; ELU ``x < 0 ? coefficient * (exp(x) - 1) : x``;
    PRELU ``x < 0 ? x * alpha[c] : x`` with ``c`` the index along ``channel_axis`` (MACE's
    ``PReLUActivation`` indexes ``dim(1)`` of an NCHW tensor). Each step is one float32 op.
    """
    x = f32(x)
    if kind is ActKind.NOOP:
        return x.copy()
    if kind is ActKind.RELU:
        return np.maximum(F32(0), x)
    if kind is ActKind.RELUX:
        return np.maximum(F32(0), np.minimum(F32(limit), x))
    if kind is ActKind.LEAKYRELU:
        return np.maximum(x, F32(0)) + np.minimum(x, F32(0)) * F32(coefficient)
    if kind is ActKind.TANH:
        return np.tanh(x)
    if kind is ActKind.SIGMOID:
        with np.errstate(over="ignore"):
            return F32(1) / (F32(1) + np.exp(-x))
    if kind is ActKind.HARDSIGMOID:
        return np.maximum(F32(0), np.minimum(F32(1), F32(hs_alpha) * x + F32(hs_beta)))
    if kind is ActKind.ELU:
        with np.errstate(over="ignore"):
            return np.where(x < 0, F32(coefficient) * (np.exp(x) - F32(1)), x).astype(F32)
    if kind is ActKind.PRELU:
        if prelu_alpha is None:
            raise MaceqError("activation PRELU needs an alpha tensor")
        a = f32(prelu_alpha).reshape(-1)
        shape = [1] * x.ndim
        shape[channel_axis] = a.size
        if x.shape[channel_axis] != a.size:
            raise MaceqError(f"activation PRELU: alpha has {a.size} values, the channel axis {x.shape[channel_axis]}")
        return np.where(x < 0, x * a.reshape(shape), x).astype(F32)
    raise MaceqError(f"activation {kind} is not implemented")


# ------------------------------------------------------------------------------------------
# Eltwise (mace/ops/eltwise.cc, float EltwiseOp)
# ------------------------------------------------------------------------------------------

def eltwise(a: np.ndarray, b: np.ndarray | None, kind: EltKind, *, coeff=(), swapped: bool = False) -> np.ndarray:
    """``a (op) b`` with numpy broadcasting of the two arrays as given (MACE's tail broadcast).

    ``swapped`` computes ``b (op) a`` for the non-commutative types (MACE's
    ``scalar_input_index == 0``). SUM with two ``coeff`` values is ``a*c0 + b*c1``; CLIP is
    ``fmax(coeff[0], fmin(coeff[1], a))``; NEG/ABS use ``a`` only. One float32 op per step.
    """
    a = f32(a)
    if kind in (EltKind.NEG, EltKind.ABS, EltKind.CLIP):
        if kind is EltKind.NEG:
            return -a
        if kind is EltKind.ABS:
            return np.abs(a)
        if len(coeff) != 2 or not coeff[0] < coeff[1]:
            raise MaceqError(f"Eltwise CLIP: coeff {list(coeff)} must be [min, max] with min < max")
        return np.fmax(F32(coeff[0]), np.fmin(F32(coeff[1]), a))
    b = f32(b)
    x, y = (b, a) if swapped else (a, b)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if kind is EltKind.SUM:
            if len(coeff) == 2:
                return a * F32(coeff[0]) + b * F32(coeff[1])
            return x + y
        if kind is EltKind.SUB:
            return x - y
        if kind is EltKind.PROD:
            return x * y
        if kind is EltKind.DIV:
            return x / y
        if kind is EltKind.FLOOR_DIV:
            return np.floor(x / y)
        if kind is EltKind.MIN:
            return np.minimum(x, y)
        if kind is EltKind.MAX:
            return np.maximum(x, y)
        if kind is EltKind.SQR_DIFF:
            d = x - y
            return d * d
        if kind is EltKind.POW:
            return np.power(x, y)
    raise MaceqError(f"Eltwise type {kind} is not implemented")


# ------------------------------------------------------------------------------------------
# Convolutions (NCHW)
# ------------------------------------------------------------------------------------------

def _conv_out(size: int, k: int, stride: int, dil: int, pad_total: int, *, ceil: bool = False) -> int:
    """CalcNCHWOutputSize (mace/ops/common/conv_pool_2d_util.cc): (in + pad - (k-1)*d - 1) / s + 1."""
    span = size + pad_total - (k - 1) * dil - 1
    out = (span + stride - 1) // stride + 1 if ceil else span // stride + 1
    if out < 1:
        raise MaceqError(f"window {k} (dilation {dil}) does not fit input {size} with padding {pad_total}")
    return out


def _pad_nchw(x: np.ndarray, top: int, left: int, bottom: int, right: int, value: float) -> np.ndarray:
    return np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)), constant_values=value)


def _taps(xp: np.ndarray, kh: int, kw: int, stride, dil, oh: int, ow: int):
    """Yield (i, j, view[N, C, oh, ow]) for every kernel tap of the padded input."""
    sh, sw = stride
    dh, dw = dil
    for i in range(kh):
        for j in range(kw):
            yield i, j, xp[:, :, i * dh: i * dh + sh * (oh - 1) + 1: sh, j * dw: j * dw + sw * (ow - 1) + 1: sw]


def _padded_geometry(x: np.ndarray, kh: int, kw: int, strides, pads, dilations):
    """(zero-padded x, output height, output width) for a conv with ``pads`` = (top, left, bottom, right)."""
    top, left, bottom, right = pads
    oh = _conv_out(x.shape[2], kh, strides[0], dilations[0], top + bottom)
    ow = _conv_out(x.shape[3], kw, strides[1], dilations[1], left + right)
    return _pad_nchw(x, top, left, bottom, right, 0.0), oh, ow


def conv2d(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, *, strides, pads, dilations) -> np.ndarray:
    """Float Conv2D on NCHW ``x`` with an OIHW filter; ``pads`` = (top, left, bottom, right).

    ``out[n, o] = sum_{c,kh,kw} xpad[n, c, h*s + kh*d, w*s + kw*d] * w[o, c, kh, kw]`` as one
    float32 GEMM, then ``+ bias[o]`` (float32).
    """
    x, w = f32(x), f32(w)
    n, c = x.shape[:2]
    o, ci, kh, kw = w.shape
    if ci != c:
        raise MaceqError(f"Conv2D: filter has {ci} input channels, input has {c}")
    xp, oh, ow = _padded_geometry(x, kh, kw, strides, pads, dilations)
    cols = np.empty((n, c, kh, kw, oh, ow), F32)
    for i, j, v in _taps(xp, kh, kw, strides, dilations, oh, ow):
        cols[:, :, i, j] = v
    out = np.matmul(w.reshape(o, c * kh * kw), cols.reshape(n, c * kh * kw, oh * ow)).reshape(n, o, oh, ow)
    if bias is not None:
        out = out + f32(bias).reshape(1, o, 1, 1)
    return out.astype(F32, copy=False)


def depthwise_conv2d(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, *, strides, pads,
                     dilations) -> np.ndarray:
    """Float DepthwiseConv2d on NCHW ``x``; filter ``[M, C, KH, KW]`` (MACE's float layout).

    Output channel ``c*M + m`` = ``sum_{kh,kw} xpad[n, c, ..] * w[m, c, kh, kw]``, accumulated in
    float32 tap by tap in (kh, kw) order from 0 (``ref/depthwise_conv_2d.cc``), then ``+ bias``.
    """
    x, w = f32(x), f32(w)
    n, c = x.shape[:2]
    m, cw, kh, kw = w.shape
    if cw != c:
        raise MaceqError(f"DepthwiseConv2d: filter has {cw} channels, input has {c}")
    xp, oh, ow = _padded_geometry(x, kh, kw, strides, pads, dilations)
    acc = np.zeros((n, c, m, oh, ow), F32)
    wt = w.transpose(1, 0, 2, 3)  # [C, M, KH, KW]
    for i, j, v in _taps(xp, kh, kw, strides, dilations, oh, ow):
        acc += v[:, :, None] * wt[None, :, :, i, j, None, None]
    out = acc.reshape(n, c * m, oh, ow)
    if bias is not None:
        out = out + f32(bias).reshape(1, c * m, 1, 1)
    return out.astype(F32, copy=False)


def deconv2d(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, *, strides, pad_total) -> np.ndarray:
    """Float Deconv2D (ONNX/Caffe framework) on NCHW ``x``; filter OIHW ``[Cout, Cin, KH, KW]``.

    ``full`` has size ``(H-1)*s + KH``; every input pixel adds ``x * w`` at ``s*i + kh``
    (``ref/deconv_2d.cc``). The output is ``full`` minus ``pad_total`` rows/columns, cropped
    from ``pad_total // 2`` (``CalcDeconvShape_Caffe``), then ``+ bias``.
    """
    x, w = f32(x), f32(w)
    n, ci, h, wd = x.shape
    co, cw, kh, kw = w.shape
    if cw != ci:
        raise MaceqError(f"Deconv2D: filter has {cw} input channels, input has {ci}")
    sh, sw = strides
    fh, fw = (h - 1) * sh + kh, (wd - 1) * sw + kw
    ph, pw = pad_total
    oh, ow = fh - ph, fw - pw
    if oh < 1 or ow < 1:
        raise MaceqError(f"Deconv2D: padding {pad_total} removes the whole output")
    full = np.zeros((n, co, fh, fw), F32)
    xr = x.reshape(n, ci, h * wd)
    for i in range(kh):
        for j in range(kw):
            contrib = np.matmul(w[:, :, i, j], xr).reshape(n, co, h, wd)
            full[:, :, i: i + sh * (h - 1) + 1: sh, j: j + sw * (wd - 1) + 1: sw] += contrib
    out = full[:, :, ph // 2: ph // 2 + oh, pw // 2: pw // 2 + ow]
    if bias is not None:
        out = out + f32(bias).reshape(1, co, 1, 1)
    return np.ascontiguousarray(out, dtype=F32)


# ------------------------------------------------------------------------------------------
# Pooling (mace/ops/pooling.cc, PoolingOp<CPU, float>), NCHW
# ------------------------------------------------------------------------------------------

def pooling(x: np.ndarray, *, max_pool: bool, kernel, strides, pad_total, dilations=(1, 1),
            ceil: bool = False) -> np.ndarray:
    """Float max / average pooling on NCHW ``x``.

    Top/left padding is ``pad_total // 2``; the output size follows ``round_mode``
    (FLOOR or CEIL). Out-of-bounds taps are skipped: max starts at the lowest float32,
    average divides the float32 sum of the in-bounds taps (summed in (kh, kw) order) by
    their count. A window with no in-bounds tap gives lowest (max) or 0/0 (average) as in MACE;
    maceq raises instead.
    """
    x = f32(x)
    n, c, h, wd = x.shape
    kh, kw = kernel
    ph, pw = pad_total
    oh = _conv_out(h, kh, strides[0], dilations[0], ph, ceil=ceil)
    ow = _conv_out(wd, kw, strides[1], dilations[1], pw, ceil=ceil)
    top, left = ph // 2, pw // 2
    # pad far enough for every window (CEIL may run past the nominal padding)
    bottom = max(0, (oh - 1) * strides[0] + (kh - 1) * dilations[0] + 1 - h - top)
    right = max(0, (ow - 1) * strides[1] + (kw - 1) * dilations[1] + 1 - wd - left)
    valid = _pad_nchw(np.ones((1, 1, h, wd), F32), top, left, bottom, right, 0.0)
    if max_pool:
        lowest = F32(np.finfo(np.float32).min)
        xp = _pad_nchw(x, top, left, bottom, right, float(lowest))
        out = np.full((n, c, oh, ow), lowest, F32)
        for _, _, v in _taps(xp, kh, kw, strides, dilations, oh, ow):
            out = np.maximum(out, v)
        count = np.zeros((1, 1, oh, ow), F32)
        for _, _, v in _taps(valid, kh, kw, strides, dilations, oh, ow):
            count += v
    else:
        xp = _pad_nchw(x, top, left, bottom, right, 0.0)
        out = np.zeros((n, c, oh, ow), F32)
        for _, _, v in _taps(xp, kh, kw, strides, dilations, oh, ow):
            out += v
        count = np.zeros((1, 1, oh, ow), F32)
        for _, _, v in _taps(valid, kh, kw, strides, dilations, oh, ow):
            count += v
    if np.any(count == 0):
        raise MaceqError("Pooling: a window lies entirely in the padding")
    if not max_pool:
        out = out / count
    return out.astype(F32, copy=False)


# ------------------------------------------------------------------------------------------
# Normalisation, softmax, reductions, matrix products
# ------------------------------------------------------------------------------------------

def batch_norm(x: np.ndarray, scale: np.ndarray, offset: np.ndarray, *, channel_axis: int = 1) -> np.ndarray:
    """MACE BatchNorm (folded form): ``scale[c] * x + offset[c]``, two float32 ops, ``c`` on ``channel_axis``."""
    x = f32(x)
    shape = [1] * x.ndim
    shape[channel_axis] = x.shape[channel_axis]
    return f32(scale).reshape(shape) * x + f32(offset).reshape(shape)


def softmax(x: np.ndarray, axis: int, *, use_log: bool = False) -> np.ndarray:
    """``e = exp(x - max)``; ``sum = max(sum(e), FLT_MIN)``; ``e / sum`` (then ``log``), float32 (softmax.cc)."""
    x = f32(x)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    s = np.maximum(e.sum(axis=axis, keepdims=True, dtype=F32), F32(FLT_MIN))
    out = e / s
    return np.log(out) if use_log else out


def reduce(x: np.ndarray, kind: ReduceKind, axes, *, keepdims: bool) -> np.ndarray:
    """Reduce over ``axes`` (all when empty). MEAN is the float32 sum divided by the count."""
    x = f32(x)
    axes = tuple(range(x.ndim)) if not axes else tuple(int(a) % x.ndim for a in axes)
    if kind is ReduceKind.MEAN:
        count = F32(np.prod([x.shape[a] for a in axes]))
        return (x.sum(axis=axes, keepdims=keepdims, dtype=F32) / count).astype(F32)
    fn = {ReduceKind.MIN: np.min, ReduceKind.MAX: np.max, ReduceKind.PROD: np.prod,
          ReduceKind.SUM: np.sum}[kind]
    return fn(x, axis=axes, keepdims=keepdims).astype(F32)


def matmul(a: np.ndarray, b: np.ndarray, bias: np.ndarray | None, *, transpose_a: bool,
           transpose_b: bool) -> np.ndarray:
    """MACE MatMul: batched ``op(a) @ op(b)`` (rank >= 2; one side may be rank 2) in float32, then ``+ bias[cols]``."""
    a, b = f32(a), f32(b)
    if a.ndim < 2 or b.ndim < 2:
        raise MaceqError("MatMul: both operands need rank >= 2")
    if a.ndim != b.ndim and 2 not in (a.ndim, b.ndim):
        raise MaceqError(f"MatMul: ranks {a.ndim} and {b.ndim} (one of them must be 2)")
    if transpose_a:
        a = np.swapaxes(a, -1, -2)
    if transpose_b:
        b = np.swapaxes(b, -1, -2)
    if a.shape[-1] != b.shape[-2]:
        raise MaceqError(f"MatMul: depths {a.shape[-1]} and {b.shape[-2]} differ")
    out = np.matmul(a, b)
    if bias is not None:
        out = out + f32(bias).reshape(-1)
    return out.astype(F32, copy=False)


def fully_connected(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """MACE FullyConnected: the input and the weight are flattened in memory order, ``out[n, o] = x[n] . w[o]``.

    Returns ``[N, O]`` (float32 GEMM, then ``+ bias``).
    """
    x, w = f32(x), f32(w)
    out = np.matmul(x.reshape(x.shape[0], -1), w.reshape(w.shape[0], -1).T)
    if bias is not None:
        out = out + f32(bias).reshape(1, -1)
    return out.astype(F32, copy=False)


# ------------------------------------------------------------------------------------------
# Resize (mace/ops/resize_bilinear.cc, resize_nearest_neighbor.cc), NCHW
# ------------------------------------------------------------------------------------------

class CoordMode(Enum):
    """MACE ``CoordinateTransformationMode`` (mace/ops/common/coordinate_transformation_mode.h)."""

    NONE = 0
    HALF_PIXEL = 1
    PYTORCH_HALF_PIXEL = 2


def resize_scale(in_size: int, out_size: int, align_corners: bool) -> float:
    """CalculateResizeScale (mace/ops/common/utils.cc): (in-1)/(out-1) with align_corners and out > 1, else in/out."""
    if align_corners and out_size > 1:
        return float(F32(in_size - 1) / F32(out_size - 1))
    return float(F32(in_size) / F32(out_size))


def bilinear_weights(in_size: int, out_size: int, *, align_corners: bool, mode: CoordMode):
    """(lower, upper, lerp) per output index, float32.

    Asymmetric / align_corners (``ComputeInterpolationWeights``): ``in = i * scale``,
    ``lower = (int) in``, ``upper = min(lower + 1, in_size - 1)``, ``lerp = in - lower``.
    Half pixel (TF ``half_pixel_centers``; PYTORCH_HALF_PIXEL is the same when ``out > 1``, else
    ``in = 0``): ``in = (i + 0.5) * scale - 0.5``, ``lower = max(floor(in), 0)``,
    ``upper = min(ceil(in), in_size - 1)``, ``lerp = in - floor(in)``.
    """
    scale = F32(resize_scale(in_size, out_size, align_corners))
    i = np.arange(out_size, dtype=F32)
    half = mode is CoordMode.HALF_PIXEL or (mode is CoordMode.PYTORCH_HALF_PIXEL and out_size > 1)
    if mode is CoordMode.PYTORCH_HALF_PIXEL and out_size == 1:
        pos = np.zeros(1, F32)
        half = True
    elif half:
        pos = (i + F32(0.5)) * scale - F32(0.5)
    else:
        pos = i * scale
    if half:
        fl = np.floor(pos)
        lower = np.maximum(fl, 0).astype(np.int64)
        upper = np.minimum(np.ceil(pos), in_size - 1).astype(np.int64)
        lerp = (pos - fl).astype(F32)
    else:
        lower = pos.astype(np.int64)
        upper = np.minimum(lower + 1, in_size - 1)
        lerp = (pos - lower.astype(F32)).astype(F32)
    return lower, upper, lerp


def resize_bilinear(x: np.ndarray, out_hw, *, align_corners: bool, mode: CoordMode = CoordMode.NONE) -> np.ndarray:
    """``top = tl + (tr - tl) * xl``; ``bottom = bl + (br - bl) * xl``; ``top + (bottom - top) * yl`` (float32)."""
    x = f32(x)
    n, c, h, w = x.shape
    oh, ow = out_hw
    if (oh, ow) == (h, w):
        return x.copy()
    yl, yu, yf = bilinear_weights(h, oh, align_corners=align_corners, mode=mode)
    xl, xu, xf = bilinear_weights(w, ow, align_corners=align_corners, mode=mode)
    rows_l, rows_u = x[:, :, yl, :], x[:, :, yu, :]
    tl, tr = rows_l[:, :, :, xl], rows_l[:, :, :, xu]
    bl, br = rows_u[:, :, :, xl], rows_u[:, :, :, xu]
    xf4 = xf.reshape(1, 1, 1, ow)
    top = tl + (tr - tl) * xf4
    bottom = bl + (br - bl) * xf4
    return (top + (bottom - top) * yf.reshape(1, 1, oh, 1)).astype(F32)


def nearest_index(in_size: int, out_size: int, *, align_corners: bool) -> np.ndarray:
    """``min(align_corners ? roundf(i * scale) : floorf(i * scale), in - 1)`` with float32 ``i * scale``."""
    scale = F32(resize_scale(in_size, out_size, align_corners))
    pos = np.arange(out_size, dtype=F32) * scale
    fl = np.floor(pos)
    # roundf (half away from zero; pos >= 0): the fraction pos - floor(pos) is exact in float32
    idx = fl + (pos - fl >= F32(0.5)) if align_corners else fl
    return np.minimum(idx.astype(np.int64), in_size - 1)


def resize_nearest(x: np.ndarray, out_hw, *, align_corners: bool) -> np.ndarray:
    x = f32(x)
    n, c, h, w = x.shape
    oh, ow = out_hw
    if (oh, ow) == (h, w):
        return x.copy()
    ys = nearest_index(h, oh, align_corners=align_corners)
    xs = nearest_index(w, ow, align_corners=align_corners)
    return np.ascontiguousarray(x[:, :, ys, :][:, :, :, xs])


# ------------------------------------------------------------------------------------------
# Data movement
# ------------------------------------------------------------------------------------------

def pad(x: np.ndarray, paddings, *, constant: float = 0.0, mode: int = 0) -> np.ndarray:
    """MACE Pad: ``paddings`` = [before0, after0, before1, after1, ...] on the raw array.

    ``mode`` is MACE's PadType: 0 CONSTANT, 1 REFLECT (numpy 'reflect'), 2 SYMMETRIC (numpy 'symmetric').
    """
    x = f32(x)
    p = [int(v) for v in paddings]
    if len(p) != 2 * x.ndim or min(p) < 0:
        raise MaceqError(f"Pad: paddings {p} do not fit a rank-{x.ndim} input")
    widths = [(p[2 * i], p[2 * i + 1]) for i in range(x.ndim)]
    if mode == 0:
        return np.pad(x, widths, constant_values=F32(constant))
    if mode in (1, 2):
        return np.pad(x, widths, mode="reflect" if mode == 1 else "symmetric")
    raise MaceqError(f"Pad: pad_type {mode} is not supported")


def strided_slice(x: np.ndarray, begin, end, strides, *, begin_mask: int = 0, end_mask: int = 0,
                  shrink_axis_mask: int = 0) -> np.ndarray:
    """TF StridedSlice as ``mace/ops/strided_slice.cc`` computes it (no ellipsis / new-axis masks).

    Missing trailing entries mean the whole dimension. Per dimension ``d``: a negative index adds
    ``dim``; then it is clamped to ``[0, dim]`` (positive stride) or ``[-1, dim-1]`` (negative);
    the mask bits select the full range; a shrink bit takes the single element ``begin``.
    """
    x = f32(x)
    rank = x.ndim
    b = list(begin) + [0] * (rank - len(begin))
    s = list(strides) + [1] * (rank - len(strides))
    e = list(end) + [x.shape[i] for i in range(len(end), rank)]
    index = []
    squeeze = []
    for d in range(rank):
        n = x.shape[d]
        st = int(s[d])
        if st == 0:
            raise MaceqError("StridedSlice: strides cannot be 0")
        lo, hi = (0, n) if st > 0 else (-1, n - 1)

        def fmt(v):
            v = v + n if v < 0 else v
            return min(max(v, lo), hi)

        if shrink_axis_mask >> d & 1:
            v = b[d] + n if b[d] < 0 else b[d]
            if not 0 <= v < n:
                raise MaceqError(f"StridedSlice: begin {b[d]} out of range for dimension {d} ({n})")
            index.append(slice(v, v + 1))
            squeeze.append(d)
            continue
        bb = (0 if st > 0 else n - 1) if begin_mask >> d & 1 else fmt(int(b[d]))
        ee = (n if st > 0 else -1) if end_mask >> d & 1 else fmt(int(e[d]))
        if st > 0:
            index.append(slice(bb, max(bb, ee), st))
        else:
            index.append(slice(bb, None if ee < 0 else ee, st) if bb > ee else slice(0, 0))
    out = x[tuple(index)]
    if any(v == 0 for v in out.shape):
        raise MaceqError(f"StridedSlice: empty output {out.shape}")
    return np.ascontiguousarray(np.squeeze(out, axis=tuple(squeeze)) if squeeze else out)


def reshape_target(in_shape, dims) -> tuple[int, ...]:
    """MACE Reshape's shape rule: 0 copies the input dim, one -1 is inferred, others as given."""
    out, unknown, product = [], -1, 1
    for i, d in enumerate(int(v) for v in dims):
        if d == -1:
            if unknown != -1:
                raise MaceqError("Reshape: only one dimension may be -1")
            unknown = i
            out.append(1)
            continue
        if d < 0:
            raise MaceqError(f"Reshape: negative dimension {d}")
        if d == 0:
            if i >= len(in_shape):
                raise MaceqError("Reshape: dim 0 out of the input's range")
            d = int(in_shape[i])
        out.append(d)
        product *= d
    size = int(np.prod(in_shape))
    if unknown != -1:
        if product == 0 or size % product:
            raise MaceqError(f"Reshape: cannot infer a dimension of {tuple(in_shape)} -> {list(dims)}")
        out[unknown] = size // product
    if int(np.prod(out)) != size:
        raise MaceqError(f"Reshape: {tuple(in_shape)} has {size} elements, target {out} has {math.prod(out)}")
    return tuple(out)
