"""MACE CPU float32 kernels, on the tensors exactly as MACE's float kernels index them.

Every function here takes and returns float32 numpy arrays. The 4-D kernels of the
"fixed data format" ops (conv, depthwise conv, deconv, pooling, batch norm, resize,
PReLU, 4-D softmax) are written for **NCHW** memory, as MACE's float CPU kernels are
(``mace/ops/ref/conv_2d.cc``, ``ref/depthwise_conv_2d.cc``, ``ref/deconv_2d.cc``,
``pooling.cc``, ``resize_bilinear.cc``, ``resize_nearest_neighbor.cc``,
``activation.cc`` PReLU, ``softmax.cc``). The data-movement kernels (transpose, reshape,
concat, split, strided slice, pad) and the element-wise ones work on the raw array.
Choosing which layout an op sees is the op layer's job (``maceq.runtime.ops_float``).

Two sets of arithmetic. The ``*_neon`` functions at the end of this module follow MACE's
NEON CPU kernels order for order, fused multiply-adds included (docs/float-neon.md); the
op layer uses them on the cpu device. The plain functions below fix one simple float32
order (used on the other devices, and by the cpu device where a ``*_neon`` kernel falls
back to them, e.g. Winograd); they agree with MACE to float32 rounding, not bit for bit:

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
from maceq.mace.enums import EltwiseType, ReduceType, ResizeCoordinateMode
from maceq.runtime.kernels import jit as k_jit
from maceq.runtime.kernels.cfloat import expf, fma32, fmaf, fmaf_exact, hadd4, hsum4_seq, logf, tanhf

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


def f32(x) -> np.ndarray:
    return np.asarray(x, dtype=F32)


# ------------------------------------------------------------------------------------------
# Activations (mace/ops/ref/activation.cc, mace/ops/activation.cc)
# ------------------------------------------------------------------------------------------

def activation(x: np.ndarray, kind: ActKind, *, limit: float = 0.0, coefficient: float = 0.0,
               hs_alpha: float = 0.0, hs_beta: float = 0.0, prelu_alpha: np.ndarray | None = None,
               channel_axis: int = 1, exact_libm: bool = False) -> np.ndarray:
    """MACE's activation on float32 ``x``.

    RELU ``max(0, x)``; RELUX ``max(0, min(limit, x))``; LEAKYRELU
    ``max(x, 0) + min(x, 0) * coefficient``; TANH ``tanh(x)``; SIGMOID ``1 / (1 + exp(-x))``;
    HARDSIGMOID ``max(0, min(1, alpha * x + beta))``; ELU ``x < 0 ? coefficient * (exp(x) - 1) : x``;
    PRELU ``x < 0 ? x * alpha[c] : x`` with ``c`` the index along ``channel_axis`` (MACE's
    ``PReLUActivation`` indexes ``dim(1)`` of an NCHW tensor). Each step is one float32 op; these
    are also the orders of MACE's NEON code (``arm/base/activation.cc``: ``vmlaq_f32`` unfused).
    ``exact_libm``: ``exp``/``tanh`` correctly rounded (:mod:`cfloat`, the cpu device) instead of
    numpy's float32 approximations.
    """
    x = f32(x)
    if exact_libm and kind in (ActKind.TANH, ActKind.SIGMOID, ActKind.ELU):
        return _activation_libm(x, kind, coefficient)
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


def _activation_libm(x: np.ndarray, kind: ActKind, coefficient: float) -> np.ndarray:
    """TANH ``tanhf(x)``, SIGMOID ``1 / (1 + expf(-x))``, ELU ``(expf(x) - 1) * coef`` with correctly
    rounded ``expf``/``tanhf`` (``arm/base/activation.cc`` ``ActivateTanh/Sigmoid/Elu``)."""

    if kind is ActKind.TANH:
        return tanhf(x)
    if kind is ActKind.SIGMOID:
        return F32(1) / (F32(1) + expf(-x))
    with np.errstate(over="ignore", invalid="ignore"):
        return np.where(x < 0, (expf(x) - F32(1)) * F32(coefficient), x).astype(F32)


# ------------------------------------------------------------------------------------------
# Eltwise (mace/ops/eltwise.cc, float EltwiseOp)
# ------------------------------------------------------------------------------------------

def eltwise(a: np.ndarray, b: np.ndarray | None, kind: EltwiseType, *, coeff=(), swapped: bool = False) -> np.ndarray:
    """``a (op) b`` with numpy broadcasting of the two arrays as given (MACE's tail broadcast).

    ``swapped`` computes ``b (op) a`` for the non-commutative types (MACE's
    ``scalar_input_index == 0``). SUM with two ``coeff`` values is ``a*c0 + b*c1``; CLIP is
    ``fmax(coeff[0], fmin(coeff[1], a))``; NEG/ABS use ``a`` only. One float32 op per step.
    """
    a = f32(a)
    if kind in (EltwiseType.NEG, EltwiseType.ABS, EltwiseType.CLIP):
        if kind is EltwiseType.NEG:
            return -a
        if kind is EltwiseType.ABS:
            return np.abs(a)
        if len(coeff) != 2 or not coeff[0] < coeff[1]:
            raise MaceqError(f"Eltwise CLIP: coeff {list(coeff)} must be [min, max] with min < max")
        return np.fmax(F32(coeff[0]), np.fmin(F32(coeff[1]), a))
    b = f32(b)
    x, y = (b, a) if swapped else (a, b)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if kind is EltwiseType.SUM:
            if len(coeff) == 2:
                return a * F32(coeff[0]) + b * F32(coeff[1])
            return x + y
        if kind is EltwiseType.SUB:
            return x - y
        if kind is EltwiseType.PROD:
            return x * y
        if kind is EltwiseType.DIV:
            return x / y
        if kind is EltwiseType.FLOOR_DIV:
            return np.floor(x / y)
        if kind is EltwiseType.MIN:
            return np.minimum(x, y)
        if kind is EltwiseType.MAX:
            return np.maximum(x, y)
        if kind is EltwiseType.SQR_DIFF:
            d = x - y
            return d * d
        if kind is EltwiseType.POW:
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


def reduce(x: np.ndarray, kind: ReduceType, axes, *, keepdims: bool) -> np.ndarray:
    """Reduce over ``axes`` (all when empty). MEAN is the float32 sum divided by the count."""
    x = f32(x)
    axes = tuple(range(x.ndim)) if not axes else tuple(int(a) % x.ndim for a in axes)
    if kind is ReduceType.MEAN:
        count = F32(np.prod([x.shape[a] for a in axes]))
        return (x.sum(axis=axes, keepdims=keepdims, dtype=F32) / count).astype(F32)
    fn = {ReduceType.MIN: np.min, ReduceType.MAX: np.max, ReduceType.PROD: np.prod,
          ReduceType.SUM: np.sum}[kind]
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

def resize_scale(in_size: int, out_size: int, align_corners: bool) -> float:
    """CalculateResizeScale (mace/ops/common/utils.cc): (in-1)/(out-1) with align_corners and out > 1, else in/out."""
    if align_corners and out_size > 1:
        return float(F32(in_size - 1) / F32(out_size - 1))
    return float(F32(in_size) / F32(out_size))


def bilinear_weights(in_size: int, out_size: int, *, align_corners: bool, mode: ResizeCoordinateMode):
    """(lower, upper, lerp) per output index, float32.

    Asymmetric / align_corners (``ComputeInterpolationWeights``): ``in = i * scale``,
    ``lower = (int) in``, ``upper = min(lower + 1, in_size - 1)``, ``lerp = in - lower``.
    Half pixel (TF ``half_pixel_centers``; PYTORCH_HALF_PIXEL is the same when ``out > 1``, else
    ``in = 0``): ``in = (i + 0.5) * scale - 0.5``, ``lower = max(floor(in), 0)``,
    ``upper = min(ceil(in), in_size - 1)``, ``lerp = in - floor(in)``.
    """
    scale = F32(resize_scale(in_size, out_size, align_corners))
    i = np.arange(out_size, dtype=F32)
    half = mode is ResizeCoordinateMode.HALF_PIXEL or (mode is ResizeCoordinateMode.PYTORCH_HALF_PIXEL and out_size > 1)
    if mode is ResizeCoordinateMode.PYTORCH_HALF_PIXEL and out_size == 1:
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


def resize_bilinear(x: np.ndarray, out_hw, *, align_corners: bool, mode: ResizeCoordinateMode = ResizeCoordinateMode.NONE) -> np.ndarray:
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


# ==========================================================================================
# The cpu device: MACE's NEON float kernels (aarch64, gcc -ffp-contract=off), order for order
# ==========================================================================================
#
# The functions above fix one plain float32 evaluation order. MACE's CPU runtime (built with
# NEON) accumulates in its own orders, with fused multiply-adds where its NEON code uses
# ``vfmaq_*``/``fmla`` (one rounding per step) and rounded products plus rounded adds where it
# uses ``vmlaq_*`` or plain C (``-ffp-contract=off`` keeps ``a + b * c`` unfused). The
# ``*_neon`` functions below reproduce those orders; docs/float-neon.md lists each kernel, its
# MACE source and how it was checked. ``*_neon_ref`` functions are readable scalar
# transcriptions of the C++ used to test the vectorised versions.

def neon_valid_region(out_hw, pad_total, strides) -> tuple[int, int, int, int]:
    """``Conv2dBase::CalOutputBoundaryWithoutUsingInputPad``: (h_start, h_stop, w_start, w_stop).

    Per axis, with ``first = total >> 1`` and ``last = total - first``: start is 0 without
    leading padding, else ``(first - 1) / stride + 1``; stop is the size without trailing
    padding, else ``size - ((last - 1) / stride + 1)`` (C integer division, operands >= 0).
    Every output in [start, stop) reads its whole window from inside the input.
    """
    bounds = []
    for size, total, stride in zip(out_hw, pad_total, strides):
        first = int(total) >> 1
        last = int(total) - first
        bounds.append(0 if first == 0 else (first - 1) // stride + 1)
        bounds.append(size if last == 0 else size - ((last - 1) // stride + 1))
    return bounds[0], bounds[1], bounds[2], bounds[3]


def depthwise3x3_neon_mask(out_hw, pad_total, stride: int) -> np.ndarray:
    """bool [OH, OW]: the outputs ``DepthwiseConv2dK3x3S{1,2}<float>`` computes with NEON FMAs.

    Rows valid_h_start <= h < valid_h_stop (stride 1: whole row pairs only, a leftover row goes
    to the scalar bottom loop), columns from valid_w_start in whole blocks of 4 below
    valid_w_stop. Everything else runs ``DepthwiseConv2d3x3Pixel``.
    """
    oh, ow = out_hw
    h0, h1, w0, w1 = neon_valid_region(out_hw, pad_total, (stride, stride))
    rows = max(0, h1 - h0)
    if stride == 1:
        rows -= rows % 2
    cols = max(0, w1 - w0)
    cols -= cols % 4
    mask = np.zeros((oh, ow), bool)
    mask[h0:h0 + rows, w0:w0 + cols] = True
    return mask


def _dw_geometry(x_shape, k: int, stride: int, pad_total):
    top, left = int(pad_total[0]) >> 1, int(pad_total[1]) >> 1
    oh = _conv_out(x_shape[2], k, stride, 1, pad_total[0])
    ow = _conv_out(x_shape[3], k, stride, 1, pad_total[1])
    return top, left, oh, ow


def depthwise3x3_neon_ref(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, *, stride: int,
                          pad_total) -> np.ndarray:
    """Scalar transcription of MACE's float NEON 3x3 depthwise + ``AddBiasNCHW`` (tests only: slow).

    ``x`` NCHW, ``w`` ``[M, C, 3, 3]``, output channel ``c*M + m``. NEON pixels: the output starts
    at 0.0 and takes 9 fused multiply-adds in (kh, kw) order (``vfmaq_laneq_f32``). Scalar pixels
    (``DepthwiseConv2d3x3Pixel``): ``sum = 0.0f; sum += in * filter`` over the taps inside the input,
    same order, each a rounded product and a rounded add. Then ``out + bias[c]``. The fused steps
    use the exact rational ``fmaf`` of ``nnlib_ref`` (independent of :func:`cfloat.fmaf`).
    """
    x, w = f32(x), f32(w)
    n, c, h, wd = x.shape
    mult = w.shape[0]
    top, left, oh, ow = _dw_geometry(x.shape, 3, stride, pad_total)
    neon = depthwise3x3_neon_mask((oh, ow), pad_total, stride)
    out = np.zeros((n, c * mult, oh, ow), F32)
    for b in range(n):
        for ch in range(c):
            for m in range(mult):
                for oy in range(oh):
                    for ox in range(ow):
                        acc = F32(0.0)
                        for kh in range(3):
                            for kw in range(3):
                                iy, ix = oy * stride - top + kh, ox * stride - left + kw
                                if not (0 <= iy < h and 0 <= ix < wd):
                                    continue  # NEON outputs never get here
                                xv, wv = x[b, ch, iy, ix], w[m, ch, kh, kw]
                                if neon[oy, ox]:
                                    acc = F32(fmaf_exact(float(xv), float(wv), float(acc)))
                                else:
                                    acc = F32(acc + F32(xv * wv))
                        if bias is not None:
                            acc = F32(acc + F32(bias[ch * mult + m]))
                        out[b, ch * mult + m, oy, ox] = acc
    return out


def _inside(size: int, out_size: int, stride: int, dil: int, pad: int, k: int) -> np.ndarray:
    """bool [k, out_size]: whether tap ``k`` of output ``o`` reads inside ``[0, size)``."""
    pos = np.arange(out_size)[None, :] * stride - pad + np.arange(k)[:, None] * dil
    return (pos >= 0) & (pos < size)


def _depthwise_plain(x: np.ndarray, w: np.ndarray, strides, dilations, top: int, left: int, oh: int, ow: int):
    """[N, C, M, OH, OW]: ``sum = 0; sum += in * filter`` over the in-input taps, (kh, kw) order, unfused.

    ``ref::DepthwiseConv2d<float>`` and ``DepthwiseConv2d3x3Pixel``: out-of-input taps are skipped.
    """
    n, c, h, wd = x.shape
    mult, _, kh, kw = w.shape
    bottom = max(0, (oh - 1) * strides[0] + (kh - 1) * dilations[0] + 1 - top - h)
    right = max(0, (ow - 1) * strides[1] + (kw - 1) * dilations[1] + 1 - left - wd)
    xp = _pad_nchw(x, top, left, bottom, right, 0.0)
    in_h = _inside(h, oh, strides[0], dilations[0], top, kh)
    in_w = _inside(wd, ow, strides[1], dilations[1], left, kw)
    wt = w.transpose(1, 0, 2, 3)
    acc = np.zeros((n, c, mult, oh, ow), F32)
    for i, j, v in _taps(xp, kh, kw, strides, dilations, oh, ow):
        term = v[:, :, None] * wt[None, :, :, i, j, None, None]
        acc = np.where(in_h[i][:, None] & in_w[j][None, :], acc + term, acc)
    return acc


def depthwise_conv2d_neon(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, *, strides, pads,
                          dilations) -> np.ndarray:
    """MACE's float DepthwiseConv2d on the NEON build (``mace/ops/depthwise_conv2d.cc``), bit for bit.

    3x3 with strides (1, 1) or (2, 2) and dilation 1: ``DepthwiseConv2dK3x3S1/S2`` (interior outputs
    of :func:`depthwise3x3_neon_mask` as a 9-step FMA chain from 0.0, the rest unfused over the
    in-input taps); any other shape: ``ref::DepthwiseConv2d`` (unfused everywhere). Then the bias in
    a separate pass (``AddBiasNCHW``: one rounded add). ``pads`` = (top, left, bottom, right) with top
    = total // 2 as MACE pads. The activation is the caller's separate pass.
    """
    x, w = f32(x), f32(w)
    n, c = x.shape[:2]
    mult, cw, kh, kw = w.shape
    if cw != c:
        raise MaceqError(f"DepthwiseConv2d: filter has {cw} channels, input has {c}")
    top, left, bottom, right = pads
    oh = _conv_out(x.shape[2], kh, strides[0], dilations[0], top + bottom)
    ow = _conv_out(x.shape[3], kw, strides[1], dilations[1], left + right)
    acc = _depthwise_plain(x, w, strides, dilations, top, left, oh, ow)
    fast = (kh, kw) == (3, 3) and tuple(dilations) == (1, 1) and tuple(strides) in ((1, 1), (2, 2))
    if fast:
        s = int(strides[0])
        mask = depthwise3x3_neon_mask((oh, ow), (top + bottom, left + right), s)
        rows, cols = np.nonzero(mask.any(axis=1))[0], np.nonzero(mask.any(axis=0))[0]
        if rows.size and cols.size:
            r0, r1, c0, c1 = rows[0], rows[-1] + 1, cols[0], cols[-1] + 1
            acc[..., r0:r1, c0:c1] = _depthwise3x3_fused(x, w, s, top, left, (r0, r1, c0, c1))
    out = acc.reshape(n, c * mult, oh, ow)
    if bias is not None:
        out = out + f32(bias).reshape(1, c * mult, 1, 1)
    return np.ascontiguousarray(out, dtype=F32)


def _depthwise3x3_fused(x: np.ndarray, w: np.ndarray, stride: int, top: int, left: int, box) -> np.ndarray:
    """[N, C, M, rows, cols] of the NEON block: ``acc = 0; acc = fmaf(in, filter, acc)`` in (kh, kw) order.

    ``box`` = (r0, r1, c0, c1) output rows/columns whose windows lie inside the input.
    """
    r0, r1, c0, c1 = (int(v) for v in box)
    wt = w.transpose(1, 0, 2, 3)
    acc = np.zeros((x.shape[0], x.shape[1], w.shape[0], r1 - r0, c1 - c0), F32)
    for kh in range(3):
        for kw in range(3):
            y0, x0 = r0 * stride - top + kh, c0 * stride - left + kw
            v = x[:, :, y0: y0 + stride * (r1 - r0 - 1) + 1: stride, x0: x0 + stride * (c1 - c0 - 1) + 1: stride]
            acc = fmaf(v[:, :, None], wt[None, :, :, kh, kw, None, None], acc)
    return acc


class ConvKernel(Enum):
    """Which NEON delegator MACE's float Conv2D picks (``Conv2dOp<RT_CPU, float>::Run``), and how it sums."""

    K1X1 = "Conv2dK1x1 (Gemm)"
    K3X3S1 = "Conv2dK3x3S1"
    K3X3S2 = "Conv2dK3x3S2"
    WINOGRAD = "Conv2dK3x3Winograd"
    K5X5S1 = "Conv2dK5x5S1"
    K7X7 = "Conv2dK7x7S1/S2/S3"
    K1X7_7X1 = "Conv2dK1x7S1/K7x1S1"
    K1X15_15X1 = "Conv2dK1x15S1/K15x1S1"
    GENERAL = "Conv2dGeneral"

    @property
    def fused(self) -> bool:
        """vfmaq_laneq_f32 / fmla (one rounding per step) on aarch64; the others are vmlaq or plain C."""
        return self in (ConvKernel.K1X1, ConvKernel.K3X3S1, ConvKernel.K3X3S2, ConvKernel.K7X7,
                        ConvKernel.K1X7_7X1)


def conv2d_neon_kernel(kernel_hw, strides, dilations, in_channels: int, out_channels: int) -> ConvKernel:
    """MACE's float Conv2D delegator choice on a NEON build (``mace/ops/conv_2d.cc``)."""
    k, s = tuple(int(v) for v in kernel_hw), tuple(int(v) for v in strides)
    if tuple(int(v) for v in dilations) != (1, 1):
        return ConvKernel.GENERAL
    if k == (1, 1) and s == (1, 1):
        return ConvKernel.K1X1
    if k == (3, 3) and s == (1, 1):
        return ConvKernel.WINOGRAD if in_channels >= 8 and out_channels >= 8 else ConvKernel.K3X3S1
    if k == (3, 3) and s == (2, 2):
        return ConvKernel.K3X3S2
    if k == (5, 5) and s == (1, 1):
        return ConvKernel.K5X5S1
    if k == (7, 7) and s in ((1, 1), (2, 2), (3, 3)):
        return ConvKernel.K7X7
    if k in ((1, 7), (7, 1)) and s == (1, 1):
        return ConvKernel.K1X7_7X1
    if k in ((1, 15), (15, 1)) and s == (1, 1):
        return ConvKernel.K1X15_15X1
    return ConvKernel.GENERAL


def conv2d_chain_ref(x: np.ndarray, w: np.ndarray, *, strides, pads, dilations, fused: bool) -> np.ndarray:
    """Scalar reference of the direct/GEMM NEON Conv2D sum (tests only): per output, from 0.0, over
    (c, kh, kw) in that order, ``acc = fmaf(in, w, acc)`` (fused) or ``acc + in * w`` (unfused); the
    input is zero-padded as MACE's ``PadInput`` pads it. No bias."""
    x, w = f32(x), f32(w)
    n, c = x.shape[:2]
    o, _, kh, kw = w.shape
    xp, oh, ow = _padded_geometry(x, kh, kw, strides, pads, dilations)
    out = np.zeros((n, o, oh, ow), F32)
    for b, m, y, xx in np.ndindex(n, o, oh, ow):
        acc = F32(0.0)
        for ci, i, j in np.ndindex(c, kh, kw):
            xv = xp[b, ci, y * strides[0] + i * dilations[0], xx * strides[1] + j * dilations[1]]
            if fused:
                acc = F32(fmaf_exact(float(xv), float(w[m, ci, i, j]), float(acc)))
            else:
                acc = F32(acc + F32(xv * w[m, ci, i, j]))
        out[b, m, y, xx] = acc
    return out


def conv2d_chain(x: np.ndarray, w: np.ndarray, *, strides, pads, dilations, fused: bool) -> np.ndarray:
    """Vectorised :func:`conv2d_chain_ref`: one pass over the output per (c, kh, kw) tap, in order.

    Compiled (:func:`_conv_chain_compiled`, exact ``llvm.fma``) when the compiled loops are on,
    else numpy (:func:`cfloat.fmaf`); both give the same bits.
    """
    x, w = f32(x), f32(w)
    n, c = x.shape[:2]
    o, _, kh, kw = w.shape
    xp, oh, ow = _padded_geometry(x, kh, kw, strides, pads, dilations)
    acc = np.zeros((n, o, oh, ow), F32)
    if k_jit.available() and _conv_chain_compiled is not None:
        _conv_chain_compiled(np.ascontiguousarray(xp), np.ascontiguousarray(w), int(strides[0]), int(strides[1]),
                             int(dilations[0]), int(dilations[1]), bool(fused), acc)
        return acc
    for ci in range(c):
        for i, j, v in _taps(xp[:, ci:ci + 1], kh, kw, strides, dilations, oh, ow):
            wv = w[None, :, ci, i, j, None, None]
            acc = fmaf(v, wv, acc) if fused else acc + v * wv
    return acc


def _make_conv_chain_compiled():
    try:
        from numba import njit, prange
    except ImportError:  # pragma: no cover - exercised only without numba
        return None

    @njit(cache=True, nogil=True, boundscheck=False, error_model="numpy", parallel=True)
    def chain(xp, w, sh, sw, dh, dw, fused, acc):
        """acc[b, m] (zeros) += taps in (c, kh, kw) order; one (b, m) plane per thread: the order per
        output element, hence the result, does not depend on the thread count."""
        n, o, oh, ow = acc.shape
        c, kh, kw = w.shape[1], w.shape[2], w.shape[3]
        for t in prange(n * o):
            b, m = t // o, t % o
            plane = acc[b, m]
            for ci in range(c):
                img = xp[b, ci]
                for i in range(kh):
                    for j in range(kw):
                        wv = w[m, ci, i, j]
                        for y in range(oh):
                            row = img[y * sh + i * dh]
                            out = plane[y]
                            if fused:
                                for xx in range(ow):
                                    out[xx] = fma32(row[xx * sw + j * dw], wv, out[xx])
                            else:
                                for xx in range(ow):
                                    out[xx] = out[xx] + row[xx * sw + j * dw] * wv

    return chain


_conv_chain_compiled = _make_conv_chain_compiled()


def conv2d_neon(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, *, strides, pads,
                dilations) -> np.ndarray:
    """MACE's float Conv2D on the NEON build, then the bias pass (one rounded add per output).

    Every delegator but Winograd sums each output from 0.0 over (c, kh, kw) in that order on a
    zero-padded input (:func:`conv2d_chain`); :class:`ConvKernel` says fused or not. Winograd
    (3x3, stride 1, >= 8 input and output channels) is not modelled: it keeps :func:`conv2d`.
    """
    x, w = f32(x), f32(w)
    if w.shape[1] != x.shape[1]:
        raise MaceqError(f"Conv2D: filter has {w.shape[1]} input channels, input has {x.shape[1]}")
    kernel = conv2d_neon_kernel(w.shape[2:], strides, dilations, x.shape[1], w.shape[0])
    if kernel is ConvKernel.WINOGRAD:
        return conv2d(x, w, bias, strides=strides, pads=pads, dilations=dilations)
    out = conv2d_chain(x, w, strides=strides, pads=pads, dilations=dilations, fused=kernel.fused)
    if bias is not None:
        out = out + f32(bias).reshape(1, -1, 1, 1)
    return out.astype(F32, copy=False)


def gemm_neon(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``Gemm<float>`` on aarch64 (``arm/fp32/gemm.cc`` ``ComputeBlock``): ``a [..., M, K] @ b [..., K, N]``
    with each output an FMA chain (``fmla``) over k = 0..K-1 from 0.0; the whole depth is one block and
    its zero padding to a multiple of 4 adds nothing. Batch dims broadcast."""
    a, b = f32(a), f32(b)
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = np.broadcast_to(a, batch + a.shape[-2:])
    b = np.broadcast_to(b, batch + b.shape[-2:])
    out = np.empty(batch + (a.shape[-2], b.shape[-1]), F32)
    for idx in np.ndindex(*batch):  # one 1x1 "convolution": channels = depth, width = columns
        x = np.ascontiguousarray(b[idx])[None, :, None, :]
        w = np.ascontiguousarray(a[idx])[:, :, None, None]
        out[idx] = conv2d_chain(x, w, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1), fused=True)[0, :, 0, :]
    return out


def gemv_neon(lhs: np.ndarray, rhs: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """``Gemv<float>::Compute`` on aarch64 (``arm/fp32/gemv.cc``): ``out[..., h] = lhs[..., h, :] . rhs[..., :]``.

    Per row: eight float32 lanes, lane j summing the products of columns k = j (mod 8) of the
    whole blocks of 8 (``vmlaq_f32``: rounded product, rounded add) from 0.0; then lanes 0-3 plus
    lanes 4-7; ``s = bias[h]`` (or 0); ``s += vaddvq_f32(...)`` = ``(v0 + v1) + (v2 + v3)``; then the
    K mod 8 leftover columns in order, ``s += lhs * rhs`` unfused.
    """
    lhs, rhs = f32(lhs), f32(rhs)[..., None, :]
    k = lhs.shape[-1]
    blocks = k // 8
    shape = np.broadcast_shapes(lhs.shape[:-1], rhs.shape[:-1])
    s = np.zeros(shape, F32) if bias is None else np.broadcast_to(f32(bias), shape).astype(F32)
    if blocks:
        lanes = np.zeros(shape + (8,), F32)
        for blk in range(blocks):
            lanes = lanes + lhs[..., 8 * blk: 8 * blk + 8] * rhs[..., 8 * blk: 8 * blk + 8]
        s = s + hadd4(lanes[..., :4] + lanes[..., 4:])
    for col in range(8 * blocks, k):
        s = s + lhs[..., col] * rhs[..., col]
    return s


def matmul_neon(a: np.ndarray, b: np.ndarray, bias: np.ndarray | None, *, transpose_a: bool,
                transpose_b: bool) -> np.ndarray:
    """MACE's float MatMul on the NEON build (``MatMulOp<RT_CPU, float>::Run``).

    ``rows == 1`` with ``transpose_b``: Gemv of B's rows against A's row (bias inside the Gemv);
    else ``cols == 1`` without ``transpose_a``: Gemv of A's rows against B's column; else the Gemm
    (:func:`gemm_neon`) followed by ``c += bias[col]``.
    """
    a, b = f32(a), f32(b)
    if a.ndim < 2 or b.ndim < 2:
        raise MaceqError("MatMul: both operands need rank >= 2")
    if a.ndim != b.ndim and 2 not in (a.ndim, b.ndim):
        raise MaceqError(f"MatMul: ranks {a.ndim} and {b.ndim} (one of them must be 2)")
    at = np.swapaxes(a, -1, -2) if transpose_a else a          # [..., rows, depth]
    bt = b if transpose_b else np.swapaxes(b, -1, -2)          # [..., cols, depth]
    if at.shape[-1] != bt.shape[-1]:
        raise MaceqError(f"MatMul: depths {at.shape[-1]} and {bt.shape[-1]} differ")
    rows, cols = at.shape[-2], bt.shape[-2]
    if rows == 1 and transpose_b:
        return gemv_neon(bt, at[..., 0, :], bias)[..., None, :]
    if cols == 1 and not transpose_a:
        return gemv_neon(at, bt[..., 0, :], bias)[..., :, None]
    out = gemm_neon(at, np.swapaxes(bt, -1, -2))
    if bias is not None:
        out = out + f32(bias).reshape(-1)
    return out.astype(F32, copy=False)


def fully_connected_neon(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """MACE's float FullyConnected (``fully_connected.cc``): :func:`gemv_neon` of the flattened weight
    ``[O, K]`` against each flattened input row, the bias inside the Gemv. Returns ``[N, O]``."""
    x, w = f32(x), f32(w)
    return gemv_neon(w.reshape(w.shape[0], -1)[None], x.reshape(x.shape[0], -1), bias)


def _seq_sum(x: np.ndarray, axis: int = 0) -> np.ndarray:
    """``float s = 0; for (...) s += x[i];`` along ``axis`` in index order (float32, no pairwise summation)."""
    x = np.moveaxis(f32(x), axis, 0)
    padded = np.concatenate([np.zeros((1,) + x.shape[1:], F32), x], axis=0)
    return np.add.accumulate(padded, axis=0, dtype=F32)[-1]


def mace_reduce_groups(shape, axes) -> tuple[list[int], bool]:
    """``ReduceOp::Simplify``: the merged dims (``data_reshape_``) and whether the first one is reduced.

    Leading size-1 dims are dropped, a size-1 dim joins the group before it, and neighbouring
    dims that are both reduced (or both kept) merge into one.
    """
    bitmap = [i in axes for i in range(len(shape))]
    d = 0
    while d < len(shape) and shape[d] == 1:
        d += 1
    if d >= len(shape):
        return [1], True
    groups, first = [int(shape[d])], bitmap[d]
    for i in range(d + 1, len(shape)):
        if shape[i] == 1:
            bitmap[i] = bitmap[i - 1]
        if bitmap[i - 1] != bitmap[i]:
            groups.append(int(shape[i]))
        else:
            groups[-1] *= int(shape[i])
    return groups, first


def reduce_neon(x: np.ndarray, kind: ReduceType, axes, *, keepdims: bool) -> np.ndarray:
    """MACE's float Reduce (``ReduceOp<RT_CPU, float>``, ``Reduce1Dims`` .. ``Reduce4Dims``), bit for bit.

    The dims merge into at most 4 alternating reduced/kept groups (:func:`mace_reduce_groups`).
    SUM/MEAN/PROD run sequentially from 0 (from 1 for PROD) over the reduced elements: in memory
    order, except that with two reduced groups and the first one reduced ([R0, K, R2(, K)]) the
    loop runs over R2 outside and R0 inside. MEAN divides the sum by the element count once.
    MIN/MAX do not depend on the order.
    """
    x = f32(x)
    axes = tuple(range(x.ndim)) if not axes else tuple(sorted({int(a) % x.ndim for a in axes}))
    want = np.sum(np.zeros(x.shape, F32), axis=axes, keepdims=keepdims).shape
    if kind in (ReduceType.MIN, ReduceType.MAX):
        return reduce(x, kind, axes, keepdims=keepdims)
    groups, first = mace_reduce_groups(x.shape, axes)
    if len(groups) > 4:
        raise MaceqError(f"Reduce: {len(groups)} merged dims (MACE handles at most 4)")
    flags = [(k % 2 == 0) == first for k in range(len(groups))]
    g = x.reshape(groups)
    red = [k for k in range(len(groups)) if flags[k]]
    kept = [k for k in range(len(groups)) if not flags[k]]
    if first and len(red) == 2:
        red = red[::-1]  # Reduce3Dims / Reduce4Dims: the later reduced group is the outer loop
    count = int(np.prod([groups[k] for k in red])) if red else 1
    flat = g.transpose(red + kept).reshape((count, -1))
    if kind is ReduceType.PROD:
        padded = np.concatenate([np.ones((1, flat.shape[1]), F32), flat], axis=0)
        out = np.multiply.accumulate(padded, axis=0, dtype=F32)[-1]
    else:
        out = _seq_sum(flat, 0)
        if kind is ReduceType.MEAN:
            out = out / F32(count)
    return out.reshape(want).astype(F32, copy=False)



def _lane_sum4(x: np.ndarray) -> np.ndarray:
    """MACE's NEON sum over the last axis: four float32 lanes over the whole blocks of 4 (the lanes start
    from the first block, ``vaddq_f32``), ``0 + (((l0 + l1) + l2) + l3)``, then the leftovers in order."""
    size = x.shape[-1]
    blocks = size // 4
    res = np.zeros(x.shape[:-1], F32)
    if blocks:
        lanes = x[..., 0:4]
        for blk in range(1, blocks):
            lanes = lanes + x[..., 4 * blk: 4 * blk + 4]
        res = res + hsum4_seq(lanes)
    for i in range(4 * blocks, size):
        res = res + x[..., i]
    return res

def global_avg_pool_neon(x: np.ndarray) -> np.ndarray:
    """``PoolingOp<RT_CPU, float>::AvgPooling`` when the window is the whole NCHW plane (1x1 output).

    Per channel: four float32 lanes start from the first 4 values and add each further whole block
    of 4 (``vaddq_f32``); ``res = 0 + (((l0 + l1) + l2) + l3)``; the leftover values are added in
    order; then ``res / (H*W)``. Fewer than 4 values: a plain sequential sum.
    """
    x = f32(x)
    n, c, h, w = x.shape
    return (_lane_sum4(x.reshape(n, c, h * w)) / F32(h * w)).reshape(n, c, 1, 1)


def softmax_neon(x: np.ndarray, axis: int, *, use_log: bool = False, nchw: bool) -> np.ndarray:
    """MACE's float Softmax (``SoftmaxOp<RT_CPU, float>``), with correctly rounded ``expf``/``logf``.

    ``nchw`` (4-D over dim 1, ``RunForNCHW``): ``e = exp(x - max)``, the sum over the classes in
    class order from 0, ``e / sum`` (``log`` of it for ``use_log``). Otherwise (``RunForNHWC``, the
    last axis): ``e = exp(x - max)``; the sum in four lanes over the whole blocks of 4 (lanes start
    from the first block), ``0 + (((l0 + l1) + l2) + l3)``, then the leftover classes in order;
    ``div = 1 / sum`` and ``e * div`` for the classes in whole blocks of 4, ``e / sum`` for the
    rest; ``use_log``: ``log(e / sum)`` for all.
    """
    x = np.moveaxis(f32(x), axis, -1)
    e = expf(x - x.max(axis=-1, keepdims=True))
    classes = e.shape[-1]
    if nchw:
        out = e / _seq_sum(e, -1)[..., None]
        return np.moveaxis(logf(out) if use_log else out, -1, axis)
    blocks = classes // 4
    total = _lane_sum4(e)[..., None]
    if use_log:
        out = logf(e / total)
    else:
        div = F32(1) / total
        out = np.concatenate([e[..., :4 * blocks] * div, e[..., 4 * blocks:] / total], axis=-1)
    return np.moveaxis(out, -1, axis)
