"""The ``gpu`` device: a numpy simulation, bit for bit, of maceq's OpenCL int8 kernels.

The kernels themselves are OpenCL C in ``runtime/opencl/*.cl``; ``runtime/opencl/backend.py``
runs them (PoCL in the tests). Every function here computes what the kernel of the same
name computes, step by step, with the same float32 operations in the same order, and
``tests/test_gpu_opencl.py`` proves it (0 differing elements). The written spec is
``docs/semantics.md``.

Notation: ``f32(e)`` is one float32 operation rounded to nearest even (numpy float32
ufuncs; the .cl files are built with ``#pragma OPENCL FP_CONTRACT OFF`` so that no
multiply and add fuse into an FMA, and with ``-cl-fp32-correctly-rounded-divide-sqrt`` so
that ``/`` is IEEE division). ``sat_rte(v)`` is OpenCL ``convert_uchar_sat_rte``: round to
nearest even, clamp to [0, 255], NaN -> 0. ``half(v)`` rounds a float32 to IEEE binary16
(nearest even, overflow to inf), OpenCL ``vstore_half_rte`` / numpy ``astype(float16)``.

Number formats: activations uint8 asymmetric per tensor (real = s * (q - zp)), NHWC;
weights int8 **symmetric per output channel** (zero point 0); bias int32 per channel with
scale ``s_in * s_w[c]``; accumulators int32 (wrapping modulo 2^32, as the kernels' ``uint``
sums). The int8 kernels (conv, depthwise, FC) requantize in float32::

    out = sat_rte(f32(f32(float_rte(acc) * scale_c) + float(out_zp)))

with ``scale_c = f32(f32(s_in * s_w[c]) / s_out)`` (:func:`gpu_requant_scales`). Ops without
an integer kernel follow MACE's fp16_fp32 GPU mode: dequantize, store half, compute in
float32, store half, quantize (see :func:`gpu_float_softmax`).

Upstream sources read (public repositories, through the code index): ARM Compute Library
``src/core/CL/cl_kernels/common/gemmlowp.cl`` (``gemmlowp_output_stage_quantize_down_float``:
``round(float(acc) * REAL_MULTIPLIER + OUTPUT_OFFSET)``, ``round`` being half away from zero);
MNN ``source/backend/opencl/execution/cl/conv_2d_int8.cl`` (``convert_int_rte`` of
``convert_float_rtp(acc) * scale``, symmetric int8, no zero points) and ``FloatToInt8.cl``;
MACE ``mace/ops/opencl/cl/{common.h,softmax.cl,resize_bilinear.cl,activation.cl}`` for the
float ops. Where those differ from the rule above, the rule above is the gpu device's
definition (from the issue); docs/semantics.md lists the differences.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from maceq.errors import MaceqError
from maceq.runtime.fixedpoint import wrap_int32
from maceq.runtime.kernels import intgemm, jit
from maceq.runtime.kernels.concat import _qpair
from maceq.runtime.kernels.conv import conv_output_size, im2col_rows
from maceq.runtime.kernels.derived import ShapedCall, derived
from maceq.runtime.kernels.resize import resize_scale

__all__ = [
    "GpuActivation",
    "ConvArgs",
    "conv_args",
    "gpu_requant_scales",
    "gpu_inverse_scale",
    "gpu_requantize_acc",
    "gpu_requantize_acc_ref",
    "gpu_conv2d",
    "gpu_conv2d_call",
    "gpu_depthwise_conv2d_call",
    "gpu_fully_connected_call",
    "gpu_conv2d_ref",
    "gpu_depthwise_conv2d",
    "gpu_depthwise_conv2d_ref",
    "gpu_fully_connected",
    "gpu_fully_connected_ref",
    "gpu_eltwise_add",
    "gpu_max_pool",
    "gpu_avg_pool",
    "gpu_global_avg_pool",
    "gpu_concat",
    "gpu_quantize",
    "gpu_dequantize",
    "gpu_exp_f32",
    "gpu_dequantize_half",
    "gpu_quantize_half",
    "gpu_half_softmax",
    "gpu_half_activation",
    "gpu_half_mul",
    "gpu_half_resize_bilinear",
    "gpu_float_softmax",
    "gpu_float_activation",
    "gpu_float_mul",
    "gpu_float_resize_bilinear",
]

_F32 = np.float32
_F16 = np.float16


class GpuActivation(enum.Enum):
    """Float-path activations; ``code`` is the ``kind`` argument of the ``activation_half`` kernel."""

    SIGMOID = 0
    HARD_SIGMOID = 1
    HARD_SWISH = 2

    @property
    def code(self) -> int:
        return int(self.value)


# ----------------------------------------------------------------------------
# argument checks


def _scale(op: str, name: str, s) -> np.float32:
    v = _F32(s)
    if not (np.isfinite(v) and v > 0):
        raise MaceqError(f"{op}: {name} must be a positive finite float32, got {s!r}")
    return v


def _zp(op: str, name: str, zp) -> int:
    z = int(zp)
    if not 0 <= z <= 255:
        raise MaceqError(f"{op}: {name} must lie in [0, 255] (uint8), got {zp!r}")
    return z


def _u8(op: str, x, ndim: int | None = None) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype != np.uint8:
        raise MaceqError(f"{op}: expected uint8 codes, got {a.dtype}")
    if ndim is not None and a.ndim != ndim:
        raise MaceqError(f"{op}: expected a {ndim}-D array, got shape {a.shape}")
    return a


def _i8(op: str, w, ndim: int) -> np.ndarray:
    a = np.asarray(w)
    if a.dtype != np.int8 or a.ndim != ndim:
        raise MaceqError(f"{op}: weights must be a {ndim}-D int8 array, got {a.dtype} {a.shape}")
    return a


def _bias(op: str, bias, n: int) -> np.ndarray:
    if bias is None:
        return np.zeros(n, dtype=np.int64)
    b = np.asarray(bias)
    if b.shape != (n,) or b.dtype != np.int32:
        raise MaceqError(f"{op}: bias must be int32 of shape ({n},), got {b.dtype} {b.shape}")
    return derived(b, "int64", lambda v: v.astype(np.int64))  # a model's bias: converted once


def _scale_c(op: str, scale_c, n: int) -> np.ndarray:
    s = np.asarray(scale_c)
    if s.dtype != np.float32 or s.shape != (n,):
        raise MaceqError(f"{op}: scale_c must be float32 of shape ({n},), got {s.dtype} {s.shape}"
                         " (use gpu_requant_scales)")
    if not derived(s, "finite, >= 0", lambda v: (bool(np.all(np.isfinite(v)) and not np.any(v < 0)),))[0]:
        raise MaceqError(f"{op}: scale_c must be finite and >= 0")
    return s


def _pair(op: str, name: str, v) -> tuple[int, int]:
    t = tuple(int(i) for i in v)
    if len(t) != 2 or min(t) < 1:
        raise MaceqError(f"{op}: {name} must be two positive ints, got {v!r}")
    return t


def _pads(op: str, pads) -> tuple[int, int, int, int]:
    p = tuple(int(i) for i in pads)
    if len(p) != 4 or min(p) < 0:
        raise MaceqError(f"{op}: pads must be (top, left, bottom, right) >= 0, got {pads!r}")
    return p


# ----------------------------------------------------------------------------
# primitives


def gpu_requant_scales(s_in: float, s_w, s_out: float) -> np.ndarray:
    """Contract: the per-channel requantization scale, computed on the host in float32.

    ``scale_c[c] = f32(f32(f32(s_in) * f32(s_w[c])) / f32(s_out))``: the product of the
    stored float32 scales first (one rounding), then the division (one rounding). This is
    the order of MACE's ``GetOutputMultiplierAndShift`` (mace/core/quantize.h), kept so the
    gpu and cpu profiles start from the same float32 ratio. The result is uploaded to the
    kernel as a float32 buffer.
    """
    si = _scale("gpu_requant_scales", "s_in", s_in)
    so = _scale("gpu_requant_scales", "s_out", s_out)
    sw = np.asarray(s_w, dtype=np.float64).astype(_F32).reshape(-1)
    if not np.all(np.isfinite(sw)) or np.any(sw <= 0):
        raise MaceqError("gpu_requant_scales: weight scales must be positive finite float32")
    return (si * sw) / so


def gpu_inverse_scale(scale) -> np.float32:
    """Contract: ``f32(1 / f32(scale))``, the host-side reciprocal every quantize step multiplies by."""
    return _F32(1.0) / _scale("gpu_inverse_scale", "scale", scale)


_IEEE = dict(over="ignore", invalid="ignore")  # inf and NaN are defined results here, as in the kernels


def _sat_rte_u8(y: np.ndarray, *, in_place: bool = False) -> np.ndarray:
    """OpenCL ``convert_uchar_sat_rte`` on float32: rint (half to even), clamp, NaN -> 0.

    ``in_place``: ``y`` (a float32 array of the caller's own) may be overwritten."""
    with np.errstate(**_IEEE):
        r = np.rint(y, out=y if in_place else None)
        np.clip(r, _F32(0), _F32(255), out=r)
    nan = np.isnan(r)
    if nan.any():
        r[nan] = 0
    return r.astype(np.uint8)


def gpu_requantize_acc(acc, scale_c, out_zp: int) -> np.ndarray:
    """Contract: ``sat_rte(f32(f32(float_rte(acc) * scale_c) + float(out_zp)))`` elementwise.

    ``acc``: int32 accumulators (last axis = output channel when ``scale_c`` is a vector).
    ``float_rte``: int32 -> float32 rounded to nearest even (OpenCL ``convert_float_rte``,
    numpy's cast); it is exact for |acc| <= 2^24 and rounds beyond, which changes codes.
    The multiply and the add are two roundings (no FMA).
    """
    a = np.asarray(acc, dtype=np.int32)
    y = a.astype(_F32) * np.asarray(scale_c, dtype=_F32)
    y = y + _F32(out_zp)
    return _sat_rte_u8(y)


def gpu_requantize_acc_ref(acc: int, scale_c: np.float32, out_zp: int) -> int:
    """One accumulator through the requantization, in numpy float32 scalars (readable reference)."""
    f = _F32(int(acc))  # int -> float32, nearest even
    y = _F32(f * _F32(scale_c))  # one float32 multiply
    y = _F32(y + _F32(out_zp))  # one float32 add
    r = float(np.rint(y))  # half to even
    return int(min(max(r, 0.0), 255.0))


def _quantize_f32(v: np.ndarray, inv_scale: np.float32, zp: int) -> np.ndarray:
    """``sat_rte(f32(f32(v * inv_scale) + float(zp)))`` (common.cl ``quant``)."""
    with np.errstate(**_IEEE):
        y = np.asarray(v, dtype=_F32) * _F32(inv_scale)
        y = y + _F32(zp)
    return _sat_rte_u8(y)


def _dequantize_f32(q: np.ndarray, scale: np.float32, zp: int) -> np.ndarray:
    """``f32(scale * float(q - zp))``; ``q - zp`` lies in [-255, 255], so the conversion is exact."""
    return _F32(scale) * (q.astype(np.int32) - np.int32(zp)).astype(_F32)


def _wrap_acc(acc_f64: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """Exact float64 sums (integers below 2^53) plus the bias, wrapped to int32 as the kernels' uint sum."""
    return wrap_int32(acc_f64.astype(np.int64) + bias).astype(np.int32)


# ----------------------------------------------------------------------------
# weights


# ----------------------------------------------------------------------------
# Conv2D / DepthwiseConv2d / FullyConnected (int8 kernels)


def _conv_geometry(op, x, kh, kw, strides, pads, dilations):
    sh, sw = _pair(op, "strides", strides)
    dh, dw = _pair(op, "dilations", dilations)
    t, l, b, r = _pads(op, pads)
    _, h, w, _ = x.shape
    try:
        oh = conv_output_size(h, kh, stride=sh, dilation=dh, pad_before=t, pad_after=b)
        ow = conv_output_size(w, kw, stride=sw, dilation=dw, pad_before=l, pad_after=r)
    except MaceqError as e:
        raise MaceqError(f"{op}: {e}") from None
    return (sh, sw), (dh, dw), (t, l, b, r), oh, ow


@dataclass(frozen=True)
class ConvArgs:
    """Checked arguments of a conv kernel (Conv2D: ``m == 0``; DepthwiseConv2d: multiplier ``m``).

    ``o`` output channels, ``c`` input channels, ``bias`` int64[o], ``scale`` float32[o].
    """

    x: np.ndarray
    w: np.ndarray
    bias: np.ndarray
    scale: np.ndarray
    x_zp: int
    out_zp: int
    kh: int
    kw: int
    c: int
    m: int
    o: int
    strides: tuple[int, int]
    dilations: tuple[int, int]
    pads: tuple[int, int, int, int]
    oh: int
    ow: int


def conv_args(op: str, x, w, bias, *, x_zp, out_zp, scale_c, strides, pads, dilations,
              depthwise: bool) -> ConvArgs:
    """Check and normalise the arguments shared by the conv simulations and the OpenCL backend."""
    x = _u8(op, x, 4)
    w = _i8(op, w, 4)
    if depthwise:
        kh, kw, c, m = w.shape
        o = c * m
    else:
        (o, kh, kw, c), m = w.shape, 0
    if x.shape[3] != c:
        raise MaceqError(f"{op}: input has {x.shape[3]} channels, filter expects {c}")
    st, dil, pd, oh, ow = _conv_geometry(op, x, kh, kw, strides, pads, dilations)
    return ConvArgs(x, w, _bias(op, bias, o), _scale_c(op, scale_c, o), _zp(op, "x_zp", x_zp),
                    _zp(op, "out_zp", out_zp), kh, kw, c, m, o, st, dil, pd, oh, ow)


#: Products (x - x_zp) * w are below 2^15 in magnitude (|x - x_zp| <= 255, |w| <= 128), so a float32 sum of up
#: to this many of them is an exact integer below 2^23 < 2^24; longer sums are taken in chunks of it.
F32_EXACT_TERMS = 256


def _centred(a: ConvArgs) -> np.ndarray:
    """The float32 input ``x - x_zp`` (exact: |x - x_zp| <= 255), zero-padded by the conv's pads."""
    t, l, b, r = a.pads
    n, h, w, c = a.x.shape
    if not any(a.pads):
        return np.subtract(a.x, _F32(a.x_zp), dtype=_F32)
    xp = np.zeros((n, h + t + b, w + l + r, c), _F32)
    np.subtract(a.x, _F32(a.x_zp), out=xp[:, t:t + h, l:l + w], dtype=_F32)
    return xp


def _taps(a: ConvArgs):
    """Yield (i, j, view): the float32 ``x - x_zp`` (exact: |x - x_zp| <= 255) under tap (i, j) for every
    output position.

    Padded positions hold 0, which is what an out-of-image tap contributes in the kernel
    (it skips them) and what MACE's im2col gives (it pads with ``x_zp``).
    """
    (sh, sw), (dh, dw) = a.strides, a.dilations
    xp = _centred(a)
    for i in range(a.kh):
        for j in range(a.kw):
            y0, x0 = i * dh, j * dw
            yield i, j, xp[:, y0:y0 + (a.oh - 1) * sh + 1:sh, x0:x0 + (a.ow - 1) * sw + 1:sw, :]


def _conv_ref(a: ConvArgs) -> np.ndarray:
    """The kernels' loops for one output element at a time, in Python ints and float32 scalars."""
    n, h, wd, _ = a.x.shape
    (sh, sw), (dh, dw), (t, l, _, _) = a.strides, a.dilations, a.pads
    out = np.zeros((n, a.oh, a.ow, a.o), dtype=np.uint8)
    for bn, y, xx, oc in np.ndindex(out.shape):
        acc = int(a.bias[oc])
        for i in range(a.kh):
            ih = y * sh - t + i * dh
            for j in range(a.kw):
                iw = xx * sw - l + j * dw
                if not (0 <= ih < h and 0 <= iw < wd):
                    continue  # an out-of-image tap contributes nothing
                if a.m:  # depthwise: oc = c * m + k reads input channel c
                    acc += (int(a.x[bn, ih, iw, oc // a.m]) - a.x_zp) * int(a.w[i, j, oc // a.m, oc % a.m])
                else:
                    acc += sum((int(xv) - a.x_zp) * int(wv) for xv, wv in zip(a.x[bn, ih, iw], a.w[oc, i, j]))
        out[bn, y, xx, oc] = gpu_requantize_acc_ref(int(wrap_int32(acc)), a.scale[oc], a.out_zp)
    return out


def _conv_call(shape: tuple, run) -> ShapedCall:
    """A gpu convolution prepared for inputs of ``shape`` (a model's op keeps one per input shape:
    runtime/ops_gpu.py)."""
    return ShapedCall(shape, run, "gpu convolution")


def gpu_conv2d(x, w, bias=None, *, x_zp: int, out_zp: int, scale_c, strides=(1, 1),
               pads=(0, 0, 0, 0), dilations=(1, 1)) -> np.ndarray:
    """Contract: kernel ``conv2d_u8`` (runtime/opencl/conv.cl).

    ``x`` uint8 NHWC, ``w`` int8 OHWI ``[O, KH, KW, C]``, ``bias`` int32 ``[O]`` or None,
    ``scale_c`` float32 ``[O]`` from :func:`gpu_requant_scales`, ``pads`` (top, left,
    bottom, right). For each output (n, oh, ow, o)::

        acc = wrap32(bias[o] + sum_{kh,kw,c in image} (x[n, ih, iw, c] - x_zp) * w[o, kh, kw, c])
        out = sat_rte(f32(f32(float_rte(acc) * scale_c[o]) + out_zp))

    with ``ih = oh*sh - top + kh*dh`` (taps outside the image are skipped: they contribute 0).
    Output size ``floor((H + top + bottom - dh*(KH-1) - 1) / sh) + 1``.

    Bound: |x - x_zp| <= 255 and |w| <= 128, so each product is below 2^15; the kernel's
    sum is a ``uint`` (defined wrap modulo 2^32), equal to the int32 sum while K < 2^16. This
    path sums exactly on float64 BLAS (exact while K < 2^38) and wraps like the kernel.
    """
    return gpu_conv2d_call(x, w, bias, x_zp=x_zp, out_zp=out_zp, scale_c=scale_c, strides=strides, pads=pads,
                           dilations=dilations)(x)


def gpu_conv2d_call(x, w, bias=None, *, x_zp: int, out_zp: int, scale_c, strides=(1, 1),
                    pads=(0, 0, 0, 0), dilations=(1, 1)) -> ShapedCall:
    """:func:`gpu_conv2d` for inputs of ``x``'s shape, prepared once (a ShapedCall); same arguments."""
    a = conv_args("gpu_conv2d", x, w, bias, x_zp=x_zp, out_zp=out_zp, scale_c=scale_c, strides=strides,
                  pads=pads, dilations=dilations, depthwise=False)
    k = a.kh * a.kw * a.c
    path = sum_path(k, a.bias, _F32 if k <= F32_EXACT_TERMS else np.float64)
    f = intgemm.packed(a.w, 0, _rows_of) if path != "wrap" else None
    shape = (a.x.shape[0], a.oh, a.ow, a.o)
    if f is not None:  # the same sums exactly in integers on the integer tiles (runtime/kernels/intgemm.py)
        tiles = intgemm.GpuPointwiseCall(a.x_zp, f, a.bias, a.scale, a.out_zp)
        return _conv_call(a.x.shape, lambda x: tiles(_im2col_rows(a, x)).reshape(shape))
    if path != "wrap" and jit.gemm_available():
        # the sums below (in any order: exact integers) and _requantize_sums' steps per block of rows, compiled;
        # other than 1x1 convs, on the im2col rows of x (tests/test_gpu_opencl.py)
        wt = _gemm_filter(a.w)
        return _conv_call(a.x.shape, lambda x: jit.gpu_pointwise(
            _im2col_rows(a, x), a.x_zp, wt, a.bias, a.scale, a.out_zp, chunk=F32_EXACT_TERMS,
            wide=path == "float64").reshape(shape))
    return _conv_call(a.x.shape, lambda x: _conv2d_taps(dataclasses.replace(a, x=x)).reshape(shape))


def _conv2d_taps(a: ConvArgs) -> np.ndarray:
    """:func:`gpu_conv2d`'s codes [N*OH*OW, O] by numpy's float GEMMs, tap by tap (exact: float32 chunks of at
    most F32_EXACT_TERMS channels, summed in float64)."""
    wf = derived(a.w, "gpu_f32", lambda v: v.astype(_F32))
    if a.kh * a.kw == 1 and a.c <= F32_EXACT_TERMS:  # one float32 GEMM, exact as it stands
        view = next(_taps(a))[2]
        acc = view.reshape(-1, a.c) @ wf[:, 0, 0, :].T
    else:
        acc = np.zeros((a.x.shape[0] * a.oh * a.ow, a.o), dtype=np.float64)
        for i, j, view in _taps(a):
            rows = view.reshape(-1, a.c)
            for k0 in range(0, a.c, F32_EXACT_TERMS):  # float32 GEMMs of exact chunks, summed exactly in float64
                k1 = min(a.c, k0 + F32_EXACT_TERMS)
                acc += rows[:, k0:k1] @ wf[:, i, j, k0:k1].T
    return _requantize_sums(acc, a, a.kh * a.kw * a.c)


def _gemm_filter(w: np.ndarray) -> np.ndarray:
    """The int8 filter [O, ...] as the float32 GEMM operand [K, O] (C-contiguous), once per filter array."""
    return derived(w, "gpu_wt", lambda v: np.ascontiguousarray(v.reshape(v.shape[0], -1).T, dtype=_F32))


def _rows_of(w: np.ndarray) -> np.ndarray:
    """The int8 filter [O, ...] as int64 rows [O, K] in its own (KH, KW, C) order."""
    return w.reshape(w.shape[0], -1).astype(np.int64)


def _im2col_rows(a: ConvArgs, x: np.ndarray) -> np.ndarray:
    """uint8 [N*OH*OW, KH*KW*C] of the input ``x`` (of a.x's shape): each output position's taps in the filter's
    (KH, KW, C) order, ``x_zp`` where a tap lies outside the image (it then adds (x_zp - x_zp) * w = 0, as the
    kernel's skipped tap does)."""
    if a.kh == a.kw == 1 and a.strides == (1, 1) and not any(a.pads):
        return x.reshape(-1, a.c)
    return im2col_rows(x, a.x_zp, kernel=(a.kh, a.kw), strides=a.strides, dilations=a.dilations,
                       before=a.pads[:2], out_hw=(a.oh, a.ow))


def sum_path(terms: int, bias: np.ndarray, acc_dtype) -> str:
    """How :func:`_requantize_sums` adds the bias to sums of ``terms`` products: "float32" (every sum below
    2^24), "float64" (below 2^31: no wrap), or "wrap" (the int32 wrap of the kernel's uint sum)."""
    largest = derived(bias, "max |bias|", lambda v: (int(np.max(np.abs(v))) if v.size else 0,))[0]
    bound = terms * 255 * 128 + largest
    if bound >= 2 ** 31:
        return "wrap"
    return "float32" if bound < 2 ** 24 and acc_dtype == _F32 else "float64"


def _requantize_sums(acc: np.ndarray, a: ConvArgs, terms: int) -> np.ndarray:
    """:func:`gpu_requantize_acc` of ``wrap32(acc + bias)``, ``acc`` exact integer sums of ``terms`` products.

    When ``terms * 255 * 128 + max|bias| < 2^31`` no int32 sum can wrap: ``acc + bias`` is then the kernel's
    accumulator, exact in float64, and its conversion to float32 rounds to nearest even as ``float_rte`` does
    on the int32, so the wrap and the int32 round trip are skipped. Below 2^24 (and ``acc`` float32) the sum is
    taken in float32, where it is exact and needs no rounding at all.
    """
    path = sum_path(terms, a.bias, acc.dtype)
    if path == "wrap":
        return gpu_requantize_acc(_wrap_acc(acc, a.bias), a.scale, a.out_zp)
    if path == "float32" and jit.available():  # the same float32 steps in one compiled pass
        return jit.gpu_requant(acc, a.bias.astype(_F32), a.scale, a.out_zp)
    with np.errstate(**_IEEE):
        if path == "float32":
            y = acc + a.bias.astype(_F32)
        else:
            y = (acc.astype(np.float64, copy=False) + a.bias).astype(_F32)
        y *= a.scale  # one float32 rounding, then the add's: no FMA
        y += _F32(a.out_zp)
    return _sat_rte_u8(y, in_place=True)


def gpu_conv2d_ref(x, w, bias=None, *, x_zp: int, out_zp: int, scale_c, strides=(1, 1),
                   pads=(0, 0, 0, 0), dilations=(1, 1)) -> np.ndarray:
    """Readable reference of :func:`gpu_conv2d`: the kernel's loops in Python ints and float32 scalars."""
    return _conv_ref(conv_args("gpu_conv2d_ref", x, w, bias, x_zp=x_zp, out_zp=out_zp, scale_c=scale_c,
                               strides=strides, pads=pads, dilations=dilations, depthwise=False))


def gpu_depthwise_conv2d(x, w, bias=None, *, x_zp: int, out_zp: int, scale_c, strides=(1, 1),
                         pads=(0, 0, 0, 0), dilations=(1, 1)) -> np.ndarray:
    """Contract: kernel ``conv2d_u8`` with groups = C (runtime/opencl/conv.cl).

    ``w`` int8 ``[KH, KW, C, M]``; output channel ``oc = c*M + m``;
    ``acc = wrap32(bias[oc] + sum_{kh,kw in image} (x[n, ih, iw, c] - x_zp) * w[kh, kw, c, m])``,
    then the requantization of :func:`gpu_conv2d` with ``scale_c[oc]``. Geometry as Conv2D.
    """
    return gpu_depthwise_conv2d_call(x, w, bias, x_zp=x_zp, out_zp=out_zp, scale_c=scale_c, strides=strides,
                                     pads=pads, dilations=dilations)(x)


def gpu_depthwise_conv2d_call(x, w, bias=None, *, x_zp: int, out_zp: int, scale_c, strides=(1, 1),
                              pads=(0, 0, 0, 0), dilations=(1, 1)) -> ShapedCall:
    """:func:`gpu_depthwise_conv2d` for inputs of ``x``'s shape, prepared once (a ShapedCall); same arguments."""
    a = conv_args("gpu_depthwise_conv2d", x, w, bias, x_zp=x_zp, out_zp=out_zp, scale_c=scale_c,
                  strides=strides, pads=pads, dilations=dilations, depthwise=True)
    exact32 = a.kh * a.kw <= F32_EXACT_TERMS  # the tap-by-tap float32 sum stays an exact integer
    if a.m == 1 and exact32 and jit.available() and sum_path(a.kh * a.kw, a.bias, _F32) == "float32":
        # the same float32 steps in one compiled pass (equal to the numpy path below: tests/test_gpu_opencl.py)
        wf = derived(a.w, "gpu_dw_f32", lambda v: v[:, :, :, 0].astype(_F32))
        bias32 = a.bias.astype(_F32)
        return _conv_call(a.x.shape, lambda x: jit.gpu_depthwise(x, a.x_zp, wf, bias32, a.scale, a.out_zp, a.strides,
                                                               a.dilations, a.pads, (a.oh, a.ow)))
    return _conv_call(a.x.shape, lambda x: _depthwise_taps(dataclasses.replace(a, x=x), exact32))


def _depthwise_taps(a: ConvArgs, exact32: bool) -> np.ndarray:
    """:func:`gpu_depthwise_conv2d`'s codes by numpy, tap by tap (float32 sums where exact, else float64)."""
    n = a.x.shape[0]
    acc = np.zeros((n, a.oh, a.ow, a.c) + ((a.m,) if a.m > 1 else ()), dtype=_F32 if exact32 else np.float64)
    wf = a.w.astype(acc.dtype)
    for i, j, view in _taps(a):
        if a.m > 1:
            acc += view[..., None] * wf[i, j]
        else:
            acc += view * wf[i, j, :, 0]
    return _requantize_sums(acc.reshape(n, a.oh, a.ow, a.o), a, a.kh * a.kw)


def gpu_depthwise_conv2d_ref(x, w, bias=None, *, x_zp: int, out_zp: int, scale_c, strides=(1, 1),
                             pads=(0, 0, 0, 0), dilations=(1, 1)) -> np.ndarray:
    """Readable reference of :func:`gpu_depthwise_conv2d` (Python ints, float32 scalars)."""
    return _conv_ref(conv_args("gpu_depthwise_conv2d_ref", x, w, bias, x_zp=x_zp, out_zp=out_zp,
                               scale_c=scale_c, strides=strides, pads=pads, dilations=dilations,
                               depthwise=True))


def _fc_check(op, x, w, bias, scale_c, x_zp, out_zp):
    x = _u8(op, x, 2)
    w = _i8(op, w, 2)
    if x.shape[1] != w.shape[1]:
        raise MaceqError(f"{op}: input depth {x.shape[1]} != weight depth {w.shape[1]}")
    o = w.shape[0]
    return x, w, _bias(op, bias, o), _scale_c(op, scale_c, o), _zp(op, "x_zp", x_zp), _zp(op, "out_zp", out_zp)


def gpu_fully_connected(x, w, bias=None, *, x_zp: int, out_zp: int, scale_c) -> np.ndarray:
    """Contract: ``x`` uint8 ``[N, K]``, ``w`` int8 ``[O, K]``; a 1x1 Conv2D on a 1x1 image.

    ``acc = wrap32(bias[o] + sum_k (x[n, k] - x_zp) * w[o, k])``, then the requantization of
    :func:`gpu_conv2d`. The backend runs it through the ``conv2d_u8`` kernel.
    """
    return gpu_fully_connected_call(x, w, bias, x_zp=x_zp, out_zp=out_zp, scale_c=scale_c)(x)


def gpu_fully_connected_call(x, w, bias=None, *, x_zp: int, out_zp: int, scale_c) -> ShapedCall:
    """:func:`gpu_fully_connected` for inputs of ``x``'s shape, prepared once (a ShapedCall); same arguments."""
    x, w, b, s, x_zp, out_zp = _fc_check("gpu_fully_connected", x, w, bias, scale_c, x_zp, out_zp)
    path = sum_path(w.shape[1], b, _F32 if w.shape[1] <= F32_EXACT_TERMS else np.float64)
    if x.shape[0] < intgemm.ROWS and w.shape[1] * 255 * 255 < 2 ** 31 and jit.available():
        # a few rows (a classifier at batch 1-3): the int32 sums with the weights read once, channels on numba's
        # threads (a 4-row tile would compute 1-3 rows of zeros); K * 255 * 128 < 2^31 keeps each exact
        return _conv_call(x.shape, lambda x: gpu_requantize_acc(wrap_int32(jit.fc_sums(x, x_zp, w) + b), s, out_zp))
    f = intgemm.packed(w, 0, _rows_of) if path != "wrap" else None
    if f is not None:  # as the 1x1 conv (gpu_conv2d)
        return _conv_call(x.shape, intgemm.GpuPointwiseCall(x_zp, f, b, s, out_zp))
    if path != "wrap" and jit.gemm_available():  # as the 1x1 conv (gpu_conv2d, _requantize_sums)
        wt = _gemm_filter(w)
        return _conv_call(x.shape, lambda x: jit.gpu_pointwise(x, x_zp, wt, b, s, out_zp, chunk=F32_EXACT_TERMS,
                                                             wide=path == "float64"))
    wf = derived(w, "gpu_f64", lambda v: v.astype(np.float64))
    return _conv_call(x.shape, lambda x: gpu_requantize_acc(_wrap_acc((x.astype(np.float64) - x_zp) @ wf.T, b), s,
                                                          out_zp))


def gpu_fully_connected_ref(x, w, bias=None, *, x_zp: int, out_zp: int, scale_c) -> np.ndarray:
    """Readable reference of :func:`gpu_fully_connected`."""
    x, w, b, s, x_zp, out_zp = _fc_check("gpu_fully_connected_ref", x, w, bias, scale_c, x_zp, out_zp)
    out = np.zeros((x.shape[0], w.shape[0]), dtype=np.uint8)
    for n in range(x.shape[0]):
        for o in range(w.shape[0]):
            acc = int(b[o]) + sum((int(xv) - x_zp) * int(wv) for xv, wv in zip(x[n], w[o]))
            out[n, o] = gpu_requantize_acc_ref(int(wrap_int32(acc)), s[o], out_zp)
    return out


# ----------------------------------------------------------------------------
# Eltwise SUM/SUB, Concat, Quantize, Dequantize (uint8 <-> float32, no half storage)


def gpu_eltwise_add(a, b, *, a_scale: float, a_zp: int, b_scale: float, b_zp: int,
                    out_scale: float, out_zp: int, subtract: bool = False) -> np.ndarray:
    """Contract: kernel ``eltwise_u8`` (runtime/opencl/eltwise.cl).

    ``fa = f32(a_scale * float(a - a_zp))``, ``fb = f32(b_scale * float(b - b_zp))``,
    ``r = f32(fa + fb)`` (SUB: ``f32(fa - fb)``), ``out = sat_rte(f32(f32(r * inv) + out_zp))``
    with ``inv = f32(1 / out_scale)`` on the host. ``a`` and ``b`` broadcast (numpy rules);
    the output has the broadcast shape.
    """
    op = "gpu_eltwise_add"
    a, b = _u8(op, a), _u8(op, b)
    try:
        a, b = np.broadcast_arrays(a, b)
    except ValueError:
        raise MaceqError(f"{op}: shapes {a.shape} and {b.shape} do not broadcast") from None
    q = (_scale(op, "a_scale", a_scale), _zp(op, "a_zp", a_zp), _scale(op, "b_scale", b_scale), _zp(op, "b_zp", b_zp),
         gpu_inverse_scale(out_scale), _zp(op, "out_zp", out_zp), bool(subtract))
    if jit.available() and a.size >= 1 << 12:  # the output is a function of (a, b): its table of every pair (cached)
        table = _eltwise_table(*q)
        return jit.lut_pairs(a, b, a.size, table, table)
    return _eltwise_codes(a, b, *q)


def _eltwise_codes(a, b, a_scale, a_zp, b_scale, b_zp, inv, out_zp, subtract) -> np.ndarray:
    """The eltwise kernel's float32 steps on uint8 ``a`` and ``b`` of one shape."""
    fa = _dequantize_f32(a, a_scale, a_zp)
    fb = _dequantize_f32(b, b_scale, b_zp)
    r = fa - fb if subtract else fa + fb
    return _quantize_f32(r, inv, out_zp)


@functools.lru_cache(maxsize=256)
def _eltwise_table(*q) -> np.ndarray:
    """:func:`_eltwise_codes` of every pair, at index a*256 + b (read-only)."""
    grid = np.arange(256, dtype=np.uint8)
    t = _eltwise_codes(np.repeat(grid, 256), np.tile(grid, 256), *q)
    t.flags.writeable = False
    return t


def _requantize_u8(x: np.ndarray, in_scale: float, in_zp: int, out_scale: float, out_zp: int) -> np.ndarray:
    """Kernel ``requant_u8``: ``sat_rte(f32(f32(f32(s_in * float(x - zp_in)) * inv_out) + zp_out))``."""
    return _quantize_f32(_dequantize_f32(x, _F32(in_scale), in_zp), gpu_inverse_scale(out_scale), out_zp)


def gpu_concat(inputs: Sequence, *, axis: int, in_qinfos: Sequence, out_scale: float, out_zp: int) -> np.ndarray:
    """Contract: inputs whose (float32 scale, zp) equal the output's are copied; the others
    go through kernel ``requant_u8``: ``sat_rte(f32(f32(f32(s_in * float(x - zp_in)) * inv_out) + zp_out))``
    with ``inv_out = f32(1 / out_scale)``. ``in_qinfos``: QInfo-like objects or (scale, zp)
    pairs. The axis indexes the stored (NHWC) layout.
    """
    op = "gpu_concat"
    arrs = [_u8(op, a) for a in inputs]
    if not arrs:
        raise MaceqError(f"{op}: no inputs")
    if len(in_qinfos) != len(arrs):
        raise MaceqError(f"{op}: {len(arrs)} inputs but {len(in_qinfos)} quantize infos")
    so, zo = _scale(op, "out_scale", out_scale), _zp(op, "out_zp", out_zp)
    parts = []
    for a, q in zip(arrs, in_qinfos):
        si, zi = _qpair(q)
        si, zi = _scale(op, "input scale", si), _zp(op, "input zero point", zi)
        parts.append(a if (si == so and zi == zo) else _requantize_u8(a, si, zi, so, zo))
    try:
        return np.concatenate(parts, axis=axis)
    except (ValueError, np.exceptions.AxisError) as e:
        raise MaceqError(f"{op}: {e}") from None


def gpu_quantize(x, *, scale: float, zero_point: int) -> np.ndarray:
    """Contract: kernel ``quantize_f32``: ``sat_rte(f32(f32(x * inv) + zp))``, ``inv = f32(1 / scale)``.

    ``x`` is converted to float32 first (nearest even). NaN gives 0, +inf 255, -inf 0.
    """
    op = "gpu_quantize"
    return _quantize_f32(np.asarray(x, dtype=_F32), gpu_inverse_scale(_scale(op, "scale", scale)),
                         _zp(op, "zero_point", zero_point))


def gpu_dequantize(q, *, scale: float, zero_point: int) -> np.ndarray:
    """Contract: kernel ``dequantize_u8``: ``f32(scale * float(q - zp))`` as a float32 array."""
    op = "gpu_dequantize"
    return _dequantize_f32(_u8(op, q), _scale(op, "scale", scale), _zp(op, "zero_point", zero_point))


# ----------------------------------------------------------------------------
# Pooling (codes; the output keeps the input's scale and zero point)


def _pool_geometry(op, x, kernel, strides, pads):
    kh, kw = _pair(op, "kernel", kernel)
    sh, sw = _pair(op, "strides", strides)
    t, l, b, r = _pads(op, pads)
    if t >= kh or b >= kh or l >= kw or r >= kw:
        raise MaceqError(f"{op}: pads {pads} must be smaller than the kernel {kernel} (no empty windows)")
    _, h, w, _ = x.shape
    if h + t + b < kh or w + l + r < kw:
        raise MaceqError(f"{op}: kernel {kernel} larger than the padded input {h + t + b}x{w + l + r}")
    return kh, kw, sh, sw, (t, l, b, r), (h + t + b - kh) // sh + 1, (w + l + r - kw) // sw + 1


def _window_sums(x: np.ndarray, kh, kw, sh, sw, pads, oh, ow, reduce) -> np.ndarray:
    t, l, b, r = pads
    xp = np.pad(x, ((0, 0), (t, b), (l, r), (0, 0)))
    acc = None
    for i in range(kh):
        for j in range(kw):
            v = xp[:, i:i + (oh - 1) * sh + 1:sh, j:j + (ow - 1) * sw + 1:sw, :]
            acc = v.copy() if acc is None else reduce(acc, v)
    return acc


def gpu_max_pool(x, *, kernel, strides, pads=(0, 0, 0, 0)) -> np.ndarray:
    """Contract: kernel ``pool_u8`` (max): ``out = max(0, max of the in-bounds codes of the window)``.

    Window rows ``[oh*sh - top, oh*sh - top + KH)`` clipped to the image (likewise columns);
    output size ``(H + top + bottom - KH) // sh + 1``. Pads must be smaller than the kernel,
    so no window is empty. Zero padding is equivalent to skipping (codes are >= 0).
    """
    op = "gpu_max_pool"
    x = _u8(op, x, 4)
    kh, kw, sh, sw, pads, oh, ow = _pool_geometry(op, x, kernel, strides, pads)
    return _window_sums(x, kh, kw, sh, sw, pads, oh, ow, np.maximum)


def gpu_avg_pool(x, *, kernel, strides, pads=(0, 0, 0, 0)) -> np.ndarray:
    """Contract: kernel ``pool_u8`` (average): ``sat_rte(f32(float_rte(sum) / float(n)))``.

    ``sum`` is the int32 sum of the in-bounds codes of the window (no wrap below 2^23 taps),
    ``n`` the number of in-bounds taps (padding is excluded from both), ``/`` the IEEE
    float32 division, then round half to even: (1 + 2) / 2 -> 2, (0 + 1) / 2 -> 0.
    """
    op = "gpu_avg_pool"
    x = _u8(op, x, 4)
    kh, kw, sh, sw, pads, oh, ow = _pool_geometry(op, x, kernel, strides, pads)
    h, w = x.shape[1], x.shape[2]
    if (kh, kw) == (h, w) and not any(pads):  # one window, the whole image: the same integer sums in one pass
        s = x.sum(axis=(1, 2), dtype=np.int64, keepdims=True)
    else:
        s = _window_sums(x.astype(np.int64), kh, kw, sh, sw, pads, oh, ow, np.add)
    t, l, _, _ = pads
    y0 = np.arange(oh) * sh - t
    x0 = np.arange(ow) * sw - l
    nh = np.minimum(y0 + kh, h) - np.maximum(y0, 0)
    nw = np.minimum(x0 + kw, w) - np.maximum(x0, 0)
    n = (nh[:, None] * nw[None, :]).astype(_F32)[None, :, :, None]
    return _sat_rte_u8(s.astype(np.int32).astype(_F32) / n)


def gpu_global_avg_pool(x) -> np.ndarray:
    """Contract: :func:`gpu_avg_pool` with the kernel H x W, stride 1, no padding -> ``[N, 1, 1, C]``."""
    x = _u8("gpu_global_avg_pool", x, 4)
    return gpu_avg_pool(x, kernel=(x.shape[1], x.shape[2]), strides=(1, 1))


# ----------------------------------------------------------------------------
# float path (MACE fp16_fp32 GPU mode): half storage between ops, float32 arithmetic

_LOG2E = _F32(1.44269504088896341)
_LN2_HI = _F32(0.693359375)  # 355/512: n * _LN2_HI is exact for |n| < 2^15
_LN2_LO = _F32(-2.12194440e-4)
_EXP_POLY = tuple(_F32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                                      4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1))
_EXP_HI = _F32(88.0)
_EXP_LO = _F32(-86.0)


def gpu_exp_f32(x) -> np.ndarray:
    """Contract: the kernels' ``exp_f32`` (runtime/opencl/common.cl), a fixed sequence of float32 ops.

    The OpenCL builtins ``exp``/``native_exp`` are implementation-defined to a few ulp, so the
    gpu device defines its own: Cephes ``expf`` (range reduction by ln 2 in two parts, a
    degree-6 polynomial, Horner order). NaN -> NaN; ``x > 88`` -> +inf; ``x < -86`` -> 0
    (results stay normal: no denormals to flush). Otherwise::

        n = rint(f32(x * LOG2E)); r = f32(x - f32(n * LN2_HI)); r = f32(r - f32(n * LN2_LO))
        z = f32(r * r); p = P0; p = f32(f32(p * r) + Pi) for P1..P5
        p = f32(f32(p * z) + r); p = f32(p + 1); y = f32(p * 2^n)   (2^n built from its bits)

    Accuracy: within 2 ulp of exp on [-86, 88] (tested).
    """
    x = np.asarray(x, dtype=_F32)
    xc = np.clip(np.where(np.isnan(x), _F32(0), x), _EXP_LO, _EXP_HI)  # the branches, then one path
    n = np.rint(xc * _LOG2E)
    r = xc - n * _LN2_HI
    r = r - n * _LN2_LO
    z = r * r
    p = np.full_like(r, _EXP_POLY[0])
    for c in _EXP_POLY[1:]:
        p = p * r + c
    p = p * z + r
    p = p + _F32(1)
    pow2 = ((n.astype(np.int32) + 127) << 23).astype(np.int32).view(_F32)
    y = p * pow2
    y = np.where(x > _EXP_HI, _F32(np.inf), y)
    y = np.where(x < _EXP_LO, _F32(0), y)
    return np.where(np.isnan(x), x, y).astype(_F32)


def gpu_dequantize_half(q, *, scale: float, zero_point: int) -> np.ndarray:
    """Contract: kernel ``dequantize_half``: ``half(f32(scale * float(q - zp)))`` as float16."""
    return _to_half(gpu_dequantize(q, scale=scale, zero_point=zero_point))


def _to_half(v: np.ndarray) -> np.ndarray:
    """Half storage: float32 -> binary16, nearest even, overflow to inf (vstore_half_rte)."""
    with np.errstate(**_IEEE):
        return np.asarray(v, dtype=_F32).astype(_F16)


def gpu_quantize_half(h, *, scale: float, zero_point: int) -> np.ndarray:
    """Contract: kernel ``quantize_half``: ``sat_rte(f32(f32(float(h) * inv) + zp))``, ``inv = f32(1 / scale)``."""
    h = np.asarray(h)
    if h.dtype != _F16:
        raise MaceqError(f"gpu_quantize_half: expected float16 (half storage), got {h.dtype}")
    return gpu_quantize(h.astype(_F32), scale=scale, zero_point=zero_point)


def _half(op: str, h) -> np.ndarray:
    h = np.asarray(h)
    if h.dtype != _F16:
        raise MaceqError(f"{op}: expected float16 (half storage), got {h.dtype}")
    return h.astype(_F32)


def gpu_half_softmax(h) -> np.ndarray:
    """Contract: kernel ``softmax_half`` over the last axis; float16 in, float16 out.

    Per row (values v_i = float(h_i), float32): ``m = max_i v_i``; ``e_i = exp_f32(f32(v_i - m))``;
    ``sum`` = float32 sum of ``e_i`` in index order (``sum = f32(sum + e_i)``, from 0);
    ``out_i = half(f32(e_i / sum))``. (MACE softmax.cl: max, then ``exp(x - max)`` summed,
    then ``exp(x - max) / sum``.)
    """
    v = _half("gpu_half_softmax", h)
    if v.ndim < 1 or v.shape[-1] == 0:
        raise MaceqError(f"gpu_half_softmax: empty last axis, shape {v.shape}")
    with np.errstate(**_IEEE):
        e = gpu_exp_f32(v - v.max(axis=-1, keepdims=True))
        s = np.zeros(v.shape[:-1], dtype=_F32)
        for i in range(v.shape[-1]):  # sequential float32 sum (np.sum is pairwise)
            s = s + e[..., i]
        return _to_half(e / s[..., None])


def _act_args(kind, alpha, beta) -> tuple[GpuActivation, np.float32, np.float32]:
    try:
        kind = GpuActivation(kind) if not isinstance(kind, GpuActivation) else kind
    except ValueError:
        raise MaceqError(f"gpu activation: unknown kind {kind!r}") from None
    if kind is GpuActivation.HARD_SIGMOID:
        return kind, _F32(0.2 if alpha is None else alpha), _F32(0.5 if beta is None else beta)
    if alpha is not None or beta is not None:
        raise MaceqError(f"gpu activation: {kind.name} takes no alpha/beta")
    return kind, _F32(0), _F32(0)


def gpu_half_activation(h, *, kind, alpha=None, beta=None) -> np.ndarray:
    """Contract: kernel ``activation_half``; float16 in, float16 out, v = float(h).

    - SIGMOID: ``half(f32(1 / f32(1 + exp_f32(-v))))`` (MACE common.h ``do_sigmoid``:
      ``native_recip(1.0f + native_exp(-in))``, here with the exact ops).
    - HARD_SIGMOID: ``half(fmin(fmax(f32(f32(alpha * v) + beta), 0), 1))``, ONNX defaults
      alpha 0.2, beta 0.5 (float32).
    - HARD_SWISH: ``t = fmin(fmax(f32(v + 3), 0), 6)``; ``half(f32(f32(v * t) / 6))``.
    ``fmin``/``fmax`` return the non-NaN operand (OpenCL; numpy ``np.fmin``/``np.fmax``).
    """
    kind, a, b = _act_args(kind, alpha, beta)
    v = _half("gpu_half_activation", h)
    with np.errstate(**_IEEE):
        if kind is GpuActivation.SIGMOID:
            y = _F32(1) / (_F32(1) + gpu_exp_f32(-v))
        elif kind is GpuActivation.HARD_SIGMOID:
            y = np.fmin(np.fmax(v * a + b, _F32(0)), _F32(1))
        else:
            t = np.fmin(np.fmax(v + _F32(3), _F32(0)), _F32(6))
            y = (v * t) / _F32(6)
    return _to_half(y)


def gpu_half_mul(ha, hb) -> np.ndarray:
    """Contract: kernel ``mul_half``: ``half(f32(float(a) * float(b)))``, numpy broadcasting.

    The product of two halves is exact in float32 (11 x 11 significand bits), so the only
    rounding is the half store (overflow past 65504 gives inf, which quantizes to 255 or 0).
    """
    a, b = _half("gpu_half_mul", ha), _half("gpu_half_mul", hb)
    try:
        a, b = np.broadcast_arrays(a, b)
    except ValueError:
        raise MaceqError(f"gpu_half_mul: shapes {a.shape} and {b.shape} do not broadcast") from None
    with np.errstate(**_IEEE):
        return _to_half(a * b)


def _bilinear_axis(out_size: int, in_size: int, *, align_corners: bool, half_pixel: bool):
    """Per output index: (lower, upper, lerp float32), as kernel ``resize_bilinear_half``."""
    scale = resize_scale(in_size, out_size, align_corners=align_corners)
    i = np.arange(out_size, dtype=_F32)
    if half_pixel:
        v = np.fmax((i + _F32(0.5)) * scale - _F32(0.5), _F32(0))
    else:
        v = i * scale
    lo = np.minimum(np.floor(v).astype(np.int64), in_size - 1)
    hi = np.minimum(lo + 1, in_size - 1)
    return lo, hi, (v - lo.astype(_F32)).astype(_F32)


def gpu_half_resize_bilinear(h, *, out_hw, align_corners: bool = False,
                             half_pixel_centers: bool = False) -> np.ndarray:
    """Contract: kernel ``resize_bilinear_half``; NHWC float16 in and out (MACE resize_bilinear.cl).

    Per axis: ``scale`` = MACE ``CalculateResizeScale`` (float32 ``in/out``, or
    ``(in-1)/(out-1)`` with align_corners and out > 1); ``v = f32(i * scale)``, or with
    half_pixel_centers ``v = fmax(f32(f32(f32(i + 0.5) * scale) - 0.5), 0)``;
    ``lo = min(floor(v), in-1)``, ``hi = min(lo + 1, in-1)``, ``lerp = f32(v - lo)``. Then with
    ``mix(a, b, t) = f32(f32(f32(b - a) * t) + a)`` (MACE's ``mad``, unfused here):
    ``top = mix(tl, tr, lx)``, ``bottom = mix(bl, br, lx)``, ``out = half(mix(top, bottom, ly))``.
    """
    op = "gpu_half_resize_bilinear"
    v = _half(op, h)
    if v.ndim != 4:
        raise MaceqError(f"{op}: input must be NHWC, got shape {v.shape}")
    oh, ow = _pair(op, "out_hw", out_hw)
    if align_corners and half_pixel_centers:
        raise MaceqError(f"{op}: align_corners and half_pixel_centers cannot both be set")
    y0, y1, ly = _bilinear_axis(oh, v.shape[1], align_corners=align_corners, half_pixel=half_pixel_centers)
    x0, x1, lx = _bilinear_axis(ow, v.shape[2], align_corners=align_corners, half_pixel=half_pixel_centers)
    lx = lx[None, None, :, None]
    ly = ly[None, :, None, None]

    def mix(a, b, t):
        return (b - a) * t + a

    with np.errstate(**_IEEE):
        top = mix(v[:, y0][:, :, x0], v[:, y0][:, :, x1], lx)
        bottom = mix(v[:, y1][:, :, x0], v[:, y1][:, :, x1], lx)
        return _to_half(mix(top, bottom, ly))


def gpu_float_softmax(x, *, in_scale: float, in_zp: int, out_scale: float, out_zp: int) -> np.ndarray:
    """Contract: uint8 Softmax on the float path (last axis).

    ``quantize_half(softmax_half(dequantize_half(x)))``: half roundings at exactly two
    places, the dequantized input (the Dequantize op's half output image) and the softmax
    output (the Softmax op's half output image); all arithmetic in between is float32.
    """
    h = gpu_dequantize_half(x, scale=in_scale, zero_point=in_zp)
    return gpu_quantize_half(gpu_half_softmax(h), scale=out_scale, zero_point=out_zp)


def gpu_float_activation(x, *, kind, alpha=None, beta=None, in_scale: float, in_zp: int,
                         out_scale: float, out_zp: int) -> np.ndarray:
    """Contract: ``quantize_half(activation_half(dequantize_half(x)))`` (half at the two op outputs)."""
    h = gpu_dequantize_half(x, scale=in_scale, zero_point=in_zp)
    y = gpu_half_activation(h, kind=kind, alpha=alpha, beta=beta)
    return gpu_quantize_half(y, scale=out_scale, zero_point=out_zp)


def gpu_float_mul(a, b, *, a_scale: float, a_zp: int, b_scale: float, b_zp: int,
                  out_scale: float, out_zp: int) -> np.ndarray:
    """Contract: Eltwise PROD: ``quantize_half(mul_half(dequantize_half(a), dequantize_half(b)))``."""
    ha = gpu_dequantize_half(a, scale=a_scale, zero_point=a_zp)
    hb = gpu_dequantize_half(b, scale=b_scale, zero_point=b_zp)
    return gpu_quantize_half(gpu_half_mul(ha, hb), scale=out_scale, zero_point=out_zp)


def gpu_float_resize_bilinear(x, *, out_hw, align_corners: bool = False, half_pixel_centers: bool = False,
                              in_scale: float, in_zp: int, out_scale: float, out_zp: int) -> np.ndarray:
    """Contract: ``quantize_half(resize_bilinear_half(dequantize_half(x)))``."""
    h = gpu_dequantize_half(_u8("gpu_float_resize_bilinear", x, 4), scale=in_scale, zero_point=in_zp)
    y = gpu_half_resize_bilinear(h, out_hw=out_hw, align_corners=align_corners,
                                 half_pixel_centers=half_pixel_centers)
    return gpu_quantize_half(y, scale=out_scale, zero_point=out_zp)
