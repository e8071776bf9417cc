"""Integer Conv2D, DepthwiseConv2d and FullyConnected kernels (MACE ARM CPU uint8 semantics).

Activations are NHWC. Every kernel comes twice with the same signature: a
readable reference ``*_ref`` (explicit loops, plain ints, for small shapes) and
a fast vectorised path; tests/oracle/test_conv_oracle.py proves them equal bit
for bit and checks both against TFLite BUILTIN_REF or scalar transcriptions of
MACE's C++, tests/test_fast_paths.py adds adversarial cases. The fast path of
each kernel is a reusable plan (``conv2d_plan`` and friends, see "Fast paths"
below) with its own exactness arguments; outside their bounds it falls back to
the generic int64 paths (``_conv2d_generic``, ``_depthwise_conv2d_generic``).

Accumulation, for every output element (TFLite reference/conv.h style)::

    acc = sum_k (x_k - x_zp) * (w_k - w_zp) + bias        in int32

Overflow bound: for uint8 (or int8) data and a zero point of the same type,
|x - x_zp| <= 255 and |w - w_zp| <= 255, so each product is below 2^16 in
magnitude and a sum of K products stays inside int32 while K < 2^15 (32768;
a 3x3 kernel over 3640 input channels). Past that, and for extreme biases, the
C kernels wrap modulo 2^32; both paths here wrap the same way
(:func:`maceq.runtime.fixedpoint.wrap_int32`). The generic paths sum on float64
BLAS, which is exact while |sum| < 2^53, i.e. for K < 2^37: every partial sum
is an integer of at most 53 bits whatever order BLAS adds in.

Padded positions: the input is padded with ``x_zp`` (MACE's Im2col fills with
the input zero point; TFLite skips out-of-image taps), so padding contributes 0.

Requantization (see docs/dev/semantics-cpu-conv.md):
- fixed point (Conv2D; DepthwiseConv2d with dilation 1; TFLite): gemmlowp
  ``MultiplyByQuantizedMultiplier(acc, q, shift) + out_zp``, then clamp;
- float (MACE q8 Gemv for FullyConnected; MACE DepthwiseConv2dGeneral for
  dilated depthwise): see :class:`FloatRequant`.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from numpy.lib.stride_tricks import as_strided, sliding_window_view

from maceq.errors import MaceqError
from maceq.runtime.fixedpoint import (
    INT32_MAX,
    INT32_MIN,
    multiply_by_quantized_multiplier,
    requant_floor_terms,
    round_half_away,
    wrap_int32,
)
from maceq.runtime.kernels import intgemm, jit
from maceq.runtime.kernels.cfloat import fmaf as _fmaf  # float32 FMA, shared with the float kernels

__all__ = [
    "im2col_rows",
    "im2col_rows_ref",
    "FloatRequant",
    "conv_output_size",
    "mace_pads",
    "tflite_same_pads",
    "requantize_fixed",
    "requantize_float",
    "Conv2dPlan",
    "DepthwiseConv2dPlan",
    "FullyConnectedPlan",
    "FullyConnectedFixedPlan",
    "conv2d",
    "conv2d_plan",
    "conv2d_ref",
    "depthwise_conv2d",
    "depthwise_conv2d_plan",
    "depthwise_conv2d_ref",
    "fully_connected",
    "fully_connected_plan",
    "fully_connected_ref",
    "fully_connected_fixed",
    "fully_connected_fixed_plan",
    "fully_connected_fixed_ref",
]

# Bytes of float64 im2col patches a fast conv builds at once.
_IM2COL_BUDGET = 64 << 20


class FloatRequant(enum.Enum):
    """How a float32 multiplier M turns an int32 accumulator into an output code.

    ``float(acc)`` is the int32 -> float32 conversion (nearest-even, so
    |acc| > 2^24 can lose bits); ``*``/``+`` are float32 operations; ``roundf``
    rounds half away from zero; ``Saturate`` casts to int and clamps to [0, 255].
    """

    #: ``Saturate(roundf(float(acc) * M + float(zp)))``, multiply and add rounded
    #: separately. MACE q8 Gemv (mace/ops/arm/q8/gemv.cc) as measured on MACE's
    #: aarch64 build (docs/oracle-notes.md).
    ADD_ZP_THEN_ROUND = "add_zp_then_round"
    #: ``Saturate(roundf(fmaf(float(acc), M, float(zp))))``: the same expression
    #: if the compiler contracts it into one fused multiply-add.
    FMA_ZP_THEN_ROUND = "fma_zp_then_round"
    #: ``clamp(int32(roundf(float(acc) * M)) + zp, 0, 255)``. MACE
    #: DepthwiseConv2dGeneral (mace/ops/depthwise_conv2d.cc), used for dilation > 1.
    ROUND_THEN_ADD_ZP = "round_then_add_zp"


# ----------------------------------------------------------------------------
# shapes and padding


def conv_output_size(in_size: int, k: int, *, stride: int, dilation: int,
                     pad_before: int, pad_after: int) -> int:
    """Output length of a conv/pool window: floor((in + pads - dilated_k) / stride) + 1.

    MACE CalcOutputSize with RoundType::FLOOR (mace/ops/common/conv_pool_2d_util.cc);
    TFLite gives the same for its SAME/VALID pads.
    """
    eff = dilation * (k - 1) + 1
    span = in_size + pad_before + pad_after - eff
    if stride < 1 or dilation < 1 or k < 1:
        raise MaceqError(f"conv: bad kernel/stride/dilation {k}/{stride}/{dilation}")
    if span < 0:
        raise MaceqError(
            f"conv: window {eff} larger than padded input {in_size + pad_before + pad_after}")
    return span // stride + 1


def im2col_rows(x: np.ndarray, fill, *, kernel, strides, dilations, before, out_hw) -> np.ndarray:
    """[N*OH*OW, KH*KW*C] rows of ``x`` [N, H, W, C] (its dtype): each output position's taps in the filter's
    (KH, KW, C) order, ``fill`` where a tap lies outside x. ``before``: (top, left) padding (negative: cropped);
    output position (oy, ox) reads x[oy*sh + i*dh - top, ox*sw + j*dw - left]. With the compiled loops an integer
    x is copied by jit.im2col_rows (equal to :func:`im2col_rows_ref`: tests/test_fast_paths.py), else by the
    reference."""
    if jit.available() and np.issubdtype(x.dtype, np.integer) and x.ndim == 4 and x.size:
        return jit.im2col_rows(x, fill, kernel, strides, dilations, before, out_hw)
    return im2col_rows_ref(x, fill, kernel=kernel, strides=strides, dilations=dilations, before=before,
                           out_hw=out_hw)


def im2col_rows_ref(x: np.ndarray, fill, *, kernel, strides, dilations, before, out_hw) -> np.ndarray:
    """:func:`im2col_rows` by numpy: x padded with ``fill`` once, then a strided window view copied."""
    n, h, w, c = x.shape
    (kh, kw), (sh, sw), (dh, dw), (top, left), (oh, ow) = kernel, strides, dilations, before, out_hw
    span_h, span_w = (kh - 1) * dh + 1, (kw - 1) * dw + 1
    need_h, need_w = (oh - 1) * sh + span_h, (ow - 1) * sw + span_w
    xp = np.full((n, need_h, need_w, c), fill, x.dtype)
    ys, ye = max(0, top), min(need_h, h + top)
    xs, xe = max(0, left), min(need_w, w + left)
    if ye > ys and xe > xs:
        xp[:, ys:ye, xs:xe] = x[:, ys - top:ye - top, xs - left:xe - left]
    win = sliding_window_view(xp, (span_h, span_w), axis=(1, 2))[:, ::sh, ::sw][:, :oh, :ow, :, ::dh, ::dw]
    return np.ascontiguousarray(win.transpose(0, 1, 2, 4, 5, 3)).reshape(-1, kh * kw * c)


def mace_pads(total_h: int, total_w: int) -> tuple[int, int, int, int]:
    """(top, left, bottom, right) from MACE's ``padding_values`` totals: top/left get ``total >> 1``."""
    return total_h >> 1, total_w >> 1, total_h - (total_h >> 1), total_w - (total_w >> 1)


def tflite_same_pads(in_h: int, in_w: int, kh: int, kw: int, *, strides=(1, 1),
                     dilations=(1, 1)) -> tuple[int, int, int, int]:
    """(top, left, bottom, right) of TFLite SAME padding (kernels/padding.h): floor half before."""
    pads = []
    for size, k, s, d in ((in_h, kh, strides[0], dilations[0]), (in_w, kw, strides[1], dilations[1])):
        out = (size + s - 1) // s
        total = max((out - 1) * s + d * (k - 1) + 1 - size, 0)
        pads.append((total // 2, total - total // 2))
    (t, b), (l, r) = pads
    return t, l, b, r


def _check_x(x: np.ndarray, name: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 4:
        raise MaceqError(f"{name}: input must be NHWC (4-D), got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.integer):
        raise MaceqError(f"{name}: input must be an integer array, got {x.dtype}")
    return x


def _act_range(act_min, act_max, out_dtype) -> tuple[int, int]:
    info = np.iinfo(out_dtype)
    lo = info.min if act_min is None else int(act_min)
    hi = info.max if act_max is None else int(act_max)
    if not (info.min <= lo <= hi <= info.max):
        raise MaceqError(f"activation range [{lo}, {hi}] not inside {np.dtype(out_dtype).name}")
    return lo, hi


def _per_channel(v, n: int, name: str) -> np.ndarray:
    """A scalar or length-n parameter as an int64 vector of length n."""
    a = np.asarray(v, dtype=np.int64)
    if a.ndim == 0:
        return np.full(n, int(a), dtype=np.int64)
    if a.shape != (n,):
        raise MaceqError(f"{name}: expected a scalar or shape ({n},), got {a.shape}")
    return a


def _bias_vec(bias, n: int, name: str) -> np.ndarray:
    if bias is None:
        return np.zeros(n, dtype=np.int64)
    b = np.asarray(bias)
    if b.shape != (n,) or not np.issubdtype(b.dtype, np.integer):
        raise MaceqError(f"{name}: bias must be integer of shape ({n},), got {b.dtype} {b.shape}")
    b = b.astype(np.int64)
    if n and (b.min() < INT32_MIN or b.max() > INT32_MAX):
        raise MaceqError(f"{name}: bias outside int32")
    return b


# ----------------------------------------------------------------------------
# requantization


def requantize_fixed(acc, *, multiplier, shift, out_zp: int, act_min: int, act_max: int) -> np.ndarray:
    """Contract: clamp(MultiplyByQuantizedMultiplier(acc, q, shift) + out_zp, act_min, act_max); int64.

    ``acc`` is int32-valued; ``multiplier``/``shift`` are scalars or arrays
    broadcasting against the last axis (per-channel). The result of the
    multiply is within int32 and adding a zero point of at most 255 in
    magnitude cannot leave int64, so the clamp sees the exact value (TFLite
    reference/conv.h, gemmlowp OutputStageQuantizeDownInt32ByFixedPoint +
    OutputStageSaturatingCastToUint8).
    """
    r = multiply_by_quantized_multiplier(np.asarray(acc, dtype=np.int64), multiplier, shift)
    return np.clip(np.asarray(r) + int(out_zp), act_min, act_max)


def requantize_float(acc, *, multiplier: np.float32, out_zp: int,
                     rounding: FloatRequant = FloatRequant.ADD_ZP_THEN_ROUND,
                     act_min: int = 0, act_max: int = 255) -> np.ndarray:
    """Contract: MACE's float32 requantization of int32 ``acc`` (see FloatRequant); int64 in [act_min, act_max].

    ``Saturate<uint8_t>`` (mace/core/quantize.h) truncates the (already
    integral) float to int and clamps to [0, 255]; the clamp to [act_min,
    act_max] is applied on top (MACE's uint8 kernels use the full range).
    """
    m = np.float32(multiplier)
    a = np.asarray(acc, dtype=np.int64).astype(np.float32)  # int32 -> float, nearest-even
    zp = int(out_zp)
    if rounding is FloatRequant.ADD_ZP_THEN_ROUND:
        v = (a * m) + np.float32(zp)  # two float32 roundings
        r = round_half_away(np.clip(v, -2.0 ** 31, 2.0 ** 31 - 128))
    elif rounding is FloatRequant.FMA_ZP_THEN_ROUND:
        v = _fmaf(a, m, np.float32(zp))
        r = round_half_away(np.clip(v, -2.0 ** 31, 2.0 ** 31 - 128))
    elif rounding is FloatRequant.ROUND_THEN_ADD_ZP:
        v = a * m
        r = round_half_away(np.clip(v, -2.0 ** 31, 2.0 ** 31 - 128)) + zp
    else:
        raise MaceqError(f"unknown float requantization {rounding!r}")
    return np.clip(np.asarray(r, dtype=np.int64), max(act_min, 0), min(act_max, 255))


def _f32_round_fraction(v: Fraction) -> np.float32:
    """Scalar: the float32 nearest to the exact rational v (ties to even); normal range only."""
    if v == 0:
        return np.float32(0.0)
    sign = -1 if v < 0 else 1
    v = abs(v)
    e = v.numerator.bit_length() - v.denominator.bit_length()
    if Fraction(2) ** e > v:
        e -= 1
    if e < -126:
        raise MaceqError("float32 rounding: subnormal value")
    scaled = v / Fraction(2) ** (e - 23)  # in [2^23, 2^24)
    m = scaled.numerator // scaled.denominator
    rem = scaled - m
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and m % 2 == 1):
        m += 1
    return np.float32(sign * m * 2.0 ** (e - 23))


def _requantize_float_scalar(acc: int, m: np.float32, zp: int, rounding: FloatRequant,
                             act_min: int, act_max: int) -> int:
    """Scalar transcription of :func:`requantize_float` for the reference kernels."""
    a = np.float32(acc)
    if rounding is FloatRequant.ADD_ZP_THEN_ROUND:
        r = round_half_away(np.float32(np.float32(a * m) + np.float32(zp)))
    elif rounding is FloatRequant.FMA_ZP_THEN_ROUND:
        exact = Fraction(float(a)) * Fraction(float(m)) + zp
        r = round_half_away(_f32_round_fraction(exact))
    elif rounding is FloatRequant.ROUND_THEN_ADD_ZP:
        r = round_half_away(np.float32(a * m)) + zp
    else:
        raise MaceqError(f"unknown float requantization {rounding!r}")
    r = min(max(r, 0), 255)  # Saturate<uint8_t>
    return min(max(r, act_min), act_max)


# ----------------------------------------------------------------------------
# argument checking shared by the reference and fast paths


@dataclass(frozen=True)
class _Geometry:
    """Checked NHWC window geometry: input, kernel, stride, dilation, pads, output size."""

    n: int
    h: int
    w: int
    c: int
    kh: int
    kw: int
    sh: int
    sw: int
    dh: int
    dw: int
    top: int
    left: int
    bottom: int
    right: int
    oh: int
    ow: int


def _geometry(x, kh, kw, strides, pads, dilations, name) -> _Geometry:
    n, h, wd, c = x.shape
    sh, sw = (int(s) for s in strides)
    dh, dw = (int(d) for d in dilations)
    top, left, bottom, right = (int(p) for p in pads)
    if min(top, left, bottom, right) < 0:
        raise MaceqError(f"{name}: negative padding {pads}")
    oh = conv_output_size(h, kh, stride=sh, dilation=dh, pad_before=top, pad_after=bottom)
    ow = conv_output_size(wd, kw, stride=sw, dilation=dw, pad_before=left, pad_after=right)
    return _Geometry(n, h, wd, c, int(kh), int(kw), sh, sw, dh, dw, top, left, bottom, right, oh, ow)


@dataclass(frozen=True)
class _OutParams:
    """Per-output-channel weight zero points, bias, fixed-point multipliers, and the clamp range."""

    w_zp: np.ndarray
    bias: np.ndarray
    q: np.ndarray | None
    shift: np.ndarray | None
    lo: int
    hi: int


def _out_params(o: int, name: str, *, w_zp, bias, multiplier, shift, act_min, act_max,
                out_dtype) -> _OutParams:
    fixed = multiplier is not None
    lo, hi = _act_range(act_min, act_max, out_dtype)
    return _OutParams(
        w_zp=_per_channel(w_zp, o, f"{name} w_zp"),
        bias=_bias_vec(bias, o, name),
        q=_per_channel(multiplier, o, f"{name} multiplier") if fixed else None,
        shift=_per_channel(shift, o, f"{name} shift") if fixed else None,
        lo=lo, hi=hi)


def _conv_setup(x, w, group, strides, pads, dilations):
    x = _check_x(x, "conv2d")
    w = np.asarray(w)
    if w.ndim != 4 or not np.issubdtype(w.dtype, np.integer):
        raise MaceqError(f"conv2d: filter must be an integer OHWI array, got {w.dtype} {w.shape}")
    c = x.shape[3]
    o, kh, kw, cg = w.shape
    if group < 1 or c % group or o % group or cg * group != c:
        raise MaceqError(f"conv2d: input channels {c}, filter {w.shape} (OHWI) and group {group} disagree")
    return x, w, _geometry(x, kh, kw, strides, pads, dilations, "conv2d")


def _dw_filter(w) -> np.ndarray:
    w = np.asarray(w)
    if w.ndim != 4 or not np.issubdtype(w.dtype, np.integer):
        raise MaceqError(
            f"depthwise_conv2d: filter must be an integer [KH, KW, C, M] array, got {w.dtype} {w.shape}")
    return w


def _dw_channels(w: np.ndarray, x: np.ndarray) -> None:
    if w.shape[2] != x.shape[3]:
        raise MaceqError(
            f"depthwise_conv2d: filter {w.shape} [KH, KW, C, M] does not match {x.shape[3]} input channels")


def _dw_requant_args(multiplier, shift, float_multiplier) -> None:
    if float_multiplier is None:
        if multiplier is None or shift is None:
            raise MaceqError("depthwise_conv2d: give (multiplier, shift) or float_multiplier")
    elif multiplier is not None or shift is not None:
        raise MaceqError("depthwise_conv2d: give either (multiplier, shift) or float_multiplier, not both")


def _dw_setup(x, w, bias, *, w_zp, multiplier, shift, float_multiplier, strides, pads, dilations,
              act_min, act_max, out_dtype):
    """Checked (x, w, geometry, output params) of a depthwise conv."""
    x = _check_x(x, "depthwise_conv2d")
    w = _dw_filter(w)
    _dw_channels(w, x)
    _dw_requant_args(multiplier, shift, float_multiplier)
    kh, kw, c, mult = w.shape
    g = _geometry(x, kh, kw, strides, pads, dilations, "depthwise_conv2d")
    p = _out_params(c * mult, "depthwise_conv2d", w_zp=w_zp, bias=bias, multiplier=multiplier,
                    shift=shift, act_min=act_min, act_max=act_max, out_dtype=out_dtype)
    return x, w, g, p


def _fc_setup(x, w, name):
    x = np.asarray(x)
    w = np.asarray(w)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise MaceqError(f"{name}: expected x[N, K] and w[O, K], got {x.shape} and {w.shape}")
    if not (np.issubdtype(x.dtype, np.integer) and np.issubdtype(w.dtype, np.integer)):
        raise MaceqError(f"{name}: x and w must be integer arrays, got {x.dtype}, {w.dtype}")
    return x, w


def _requant_scalar_fixed(acc: int, p: _OutParams, oc: int, out_zp) -> int:
    """One output of the fixed-point rule, on Python ints (reference kernels)."""
    r = multiply_by_quantized_multiplier(acc, int(p.q[oc]), int(p.shift[oc])) + int(out_zp)
    return min(max(r, p.lo), p.hi)


# ----------------------------------------------------------------------------
# Conv2D


def conv2d_ref(x, w, bias=None, *, x_zp, w_zp, out_zp, multiplier, shift, strides=(1, 1),
               pads=(0, 0, 0, 0), dilations=(1, 1), group=1, act_min=None, act_max=None,
               out_dtype=np.uint8):
    """Reference Conv2D: loops over output pixels, channels and taps; see :func:`conv2d`."""
    x, w, g = _conv_setup(x, w, group, strides, pads, dilations)
    o = w.shape[0]
    cg, og = g.c // group, o // group
    p = _out_params(o, "conv2d", w_zp=w_zp, bias=bias, multiplier=multiplier, shift=shift,
                    act_min=act_min, act_max=act_max, out_dtype=out_dtype)
    xi = x.astype(np.int64)
    wi = w.astype(np.int64)
    out = np.empty((g.n, g.oh, g.ow, o), dtype=out_dtype)
    for bn in range(g.n):
        for y in range(g.oh):
            for xo in range(g.ow):
                for oc in range(o):
                    grp = oc // og
                    acc = 0
                    for fy in range(g.kh):
                        iy = y * g.sh - g.top + fy * g.dh
                        for fx in range(g.kw):
                            ix = xo * g.sw - g.left + fx * g.dw
                            if not (0 <= iy < g.h and 0 <= ix < g.w):
                                continue  # padding: x == x_zp contributes 0
                            xv = xi[bn, iy, ix, grp * cg:(grp + 1) * cg] - int(x_zp)
                            wv = wi[oc, fy, fx, :] - int(p.w_zp[oc])
                            acc += int(np.dot(xv, wv))
                    acc = wrap_int32(acc + int(p.bias[oc]))
                    out[bn, y, xo, oc] = _requant_scalar_fixed(acc, p, oc, out_zp)
    return out


def _padded_offset(x: np.ndarray, x_zp: int, g: _Geometry, dtype) -> np.ndarray:
    """(x - x_zp) in ``dtype`` with zero padding (== padding x with x_zp before the offset)."""
    xo = x.astype(dtype) - dtype(x_zp)
    return np.pad(xo, ((0, 0), (g.top, g.bottom), (g.left, g.right), (0, 0)))


def _windows(xp: np.ndarray, g: _Geometry) -> np.ndarray:
    """Read-only view [N, OH, OW, KH, KW, C] of the conv windows of padded NHWC ``xp``."""
    sn, sy, sx, sc = xp.strides
    return as_strided(xp, shape=(xp.shape[0], g.oh, g.ow, g.kh, g.kw, xp.shape[3]),
                      strides=(sn, sy * g.sh, sx * g.sw, sy * g.dh, sx * g.dw, sc), writeable=False)


def _int_acc(f64: np.ndarray) -> np.ndarray:
    """Exact float64 integer sums (|v| < 2^53) to int64."""
    return np.rint(f64).astype(np.int64)


def _conv2d_generic(x, w, bias=None, *, x_zp, w_zp, out_zp, multiplier, shift, strides=(1, 1),
                    pads=(0, 0, 0, 0), dilations=(1, 1), group=1, act_min=None, act_max=None,
                    out_dtype=np.uint8):
    """:func:`conv2d`'s general path (same contract): every input dtype, bias and multiplier.

    Im2col of the offset input in float64 and one BLAS matmul per group (exact,
    see module docstring), int64 accumulators wrapped like C, vectorised
    gemmlowp requantization.
    """
    x, w, g = _conv_setup(x, w, group, strides, pads, dilations)
    o = w.shape[0]
    cg, og = g.c // group, o // group
    p = _out_params(o, "conv2d", w_zp=w_zp, bias=bias, multiplier=multiplier, shift=shift,
                    act_min=act_min, act_max=act_max, out_dtype=out_dtype)
    wf = w.astype(np.float64) - p.w_zp.astype(np.float64)[:, None, None, None]
    acc = np.empty((g.n, g.oh, g.ow, o), dtype=np.int64)
    per_image = g.oh * g.ow * g.kh * g.kw * g.c * 8
    step = max(1, _IM2COL_BUDGET // max(per_image, 1))
    for b0 in range(0, g.n, step):
        xp = _padded_offset(x[b0:b0 + step], x_zp, g, np.float64)
        win = _windows(xp, g)
        nb = xp.shape[0]
        for grp in range(group):
            cols = win[..., grp * cg:(grp + 1) * cg].reshape(nb * g.oh * g.ow, g.kh * g.kw * cg)
            wg = wf[grp * og:(grp + 1) * og].reshape(og, g.kh * g.kw * cg)
            acc[b0:b0 + nb, ..., grp * og:(grp + 1) * og] = _int_acc(cols @ wg.T).reshape(nb, g.oh, g.ow, og)
    acc = wrap_int32(acc + p.bias)
    return requantize_fixed(acc, multiplier=p.q, shift=p.shift, out_zp=out_zp,
                            act_min=p.lo, act_max=p.hi).astype(out_dtype)


# ----------------------------------------------------------------------------
# DepthwiseConv2d


def depthwise_conv2d_ref(x, w, bias=None, *, x_zp, w_zp, out_zp, multiplier=None, shift=None,
                         float_multiplier=None, float_rounding=FloatRequant.ROUND_THEN_ADD_ZP,
                         strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1), act_min=None,
                         act_max=None, out_dtype=np.uint8):
    """Reference DepthwiseConv2d: loops over output pixels, channels and taps; see :func:`depthwise_conv2d`."""
    x, w, g, p = _dw_setup(x, w, bias, w_zp=w_zp, multiplier=multiplier, shift=shift,
                           float_multiplier=float_multiplier, strides=strides, pads=pads,
                           dilations=dilations, act_min=act_min, act_max=act_max, out_dtype=out_dtype)
    kh, kw, c, mult = w.shape
    o = c * mult
    out = np.empty((g.n, g.oh, g.ow, o), dtype=out_dtype)
    for bn in range(g.n):
        for y in range(g.oh):
            for xo in range(g.ow):
                for ic in range(c):
                    for m in range(mult):
                        oc = ic * mult + m  # output channel c*M + m
                        acc = 0
                        for fy in range(kh):
                            iy = y * g.sh - g.top + fy * g.dh
                            for fx in range(kw):
                                ix = xo * g.sw - g.left + fx * g.dw
                                if 0 <= iy < g.h and 0 <= ix < g.w:
                                    acc += (int(x[bn, iy, ix, ic]) - int(x_zp)) * \
                                           (int(w[fy, fx, ic, m]) - int(p.w_zp[oc]))
                        acc = wrap_int32(acc + int(p.bias[oc]))
                        if float_multiplier is None:
                            out[bn, y, xo, oc] = _requant_scalar_fixed(acc, p, oc, out_zp)
                        else:
                            out[bn, y, xo, oc] = _requantize_float_scalar(
                                acc, np.float32(float_multiplier), int(out_zp), float_rounding, p.lo, p.hi)
    return out


def _depthwise_conv2d_generic(x, w, bias=None, *, x_zp, w_zp, out_zp, multiplier=None, shift=None,
                              float_multiplier=None, float_rounding=FloatRequant.ROUND_THEN_ADD_ZP,
                              strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1), act_min=None,
                              act_max=None, out_dtype=np.uint8):
    """:func:`depthwise_conv2d`'s general path (same contract): int64 multiply-adds per kernel tap."""
    x, w, g, p = _dw_setup(x, w, bias, w_zp=w_zp, multiplier=multiplier, shift=shift,
                           float_multiplier=float_multiplier, strides=strides, pads=pads,
                           dilations=dilations, act_min=act_min, act_max=act_max, out_dtype=out_dtype)
    kh, kw, c, mult = w.shape
    o = c * mult
    xp = _padded_offset(x, x_zp, g, np.int64)
    wo = w.astype(np.int64) - p.w_zp.reshape(c, mult)  # [KH, KW, C, M]
    acc = np.zeros((g.n, g.oh, g.ow, c, mult), dtype=np.int64)
    for fy in range(kh):
        for fx in range(kw):
            y0, x0 = fy * g.dh, fx * g.dw
            tap = xp[:, y0:y0 + (g.oh - 1) * g.sh + 1:g.sh, x0:x0 + (g.ow - 1) * g.sw + 1:g.sw, :]
            acc += tap[..., None] * wo[fy, fx]  # each term < 2^16; K * 2^16 << 2^63
    acc = wrap_int32(acc.reshape(g.n, g.oh, g.ow, o) + p.bias)
    if float_multiplier is None:
        r = requantize_fixed(acc, multiplier=p.q, shift=p.shift, out_zp=out_zp, act_min=p.lo, act_max=p.hi)
    else:
        r = requantize_float(acc, multiplier=np.float32(float_multiplier), out_zp=out_zp,
                             rounding=float_rounding, act_min=p.lo, act_max=p.hi)
    return r.astype(out_dtype)


# ----------------------------------------------------------------------------
# FullyConnected


def _fc_acc_ref(x, w, x_zp, p: _OutParams, i: int, j: int) -> int:
    acc = 0
    for k in range(x.shape[1]):
        acc += (int(x[i, k]) - int(x_zp)) * (int(w[j, k]) - int(p.w_zp[j]))
    return wrap_int32(acc + int(p.bias[j]))


def fully_connected_ref(x, w, bias=None, *, x_zp, w_zp, out_zp, multiplier, act_min=0,
                        act_max=255, rounding=FloatRequant.ADD_ZP_THEN_ROUND):
    """Reference FullyConnected with MACE Gemv's float32 requantization; see :func:`fully_connected`."""
    x, w = _fc_setup(x, w, "fully_connected")
    p = _out_params(w.shape[0], "fully_connected", w_zp=w_zp, bias=bias, multiplier=None, shift=None,
                    act_min=act_min, act_max=act_max, out_dtype=np.uint8)
    m = np.float32(multiplier)
    out = np.empty((x.shape[0], w.shape[0]), dtype=np.uint8)
    for i in range(x.shape[0]):
        for j in range(w.shape[0]):
            acc = _fc_acc_ref(x, w, x_zp, p, i, j)
            out[i, j] = _requantize_float_scalar(acc, m, int(out_zp), rounding, p.lo, p.hi)
    return out


def fully_connected_fixed_ref(x, w, bias=None, *, x_zp, w_zp, out_zp, multiplier, shift,
                              act_min=None, act_max=None, out_dtype=np.uint8):
    """Reference FullyConnected with gemmlowp requantization; see :func:`fully_connected_fixed`."""
    x, w = _fc_setup(x, w, "fully_connected_fixed")
    p = _out_params(w.shape[0], "fully_connected_fixed", w_zp=w_zp, bias=bias, multiplier=multiplier,
                    shift=shift, act_min=act_min, act_max=act_max, out_dtype=out_dtype)
    out = np.empty((x.shape[0], w.shape[0]), dtype=out_dtype)
    for i in range(x.shape[0]):
        for j in range(w.shape[0]):
            out[i, j] = _requant_scalar_fixed(_fc_acc_ref(x, w, x_zp, p, i, j), p, j, out_zp)
    return out


# ----------------------------------------------------------------------------
# Fast paths: plans and exact float64 requantization
#
# ``conv2d(x, w, ...)`` is ``conv2d_plan(w, ...)(x)``: a plan holds what a kernel
# derives from its weights (offset and folded weight matrices, requantization
# terms), so the runtime (runtime/ops.py keeps one plan per op) converts no
# weights while running a model. Every fast path equals its ``*_ref`` kernel bit
# for bit (tests/test_fast_paths.py). Notation: acc = G + bias with
# G = sum_j (x_j - x_zp)(w_j - w_zp); X = max |x - x_zp| over the input dtype;
# L1 = sum_j |w_j - w_zp| per output channel, so every partial sum of G, in any
# order, is an integer of magnitude <= X*L1. The arguments:
#
# 1. One floor. With (k, c0, theta) = requant_floor_terms(q, shift, out_zp)
#    (runtime/fixedpoint.py), MultiplyByQuantizedMultiplier(acc, q, shift) + out_zp
#    == floor((acc*q + c0 - 2^31*[acc < theta]) / 2^k) for every int32 acc
#    (0 <= q <= INT32_MAX, -31 <= shift <= 0). Let y = (acc*q + c0)*2^-k and
#    off = bias*q + c0; the plans require |off| + 2^31 <= 2^53.
# 2. Folded GEMM (Conv2D with a short reduction). The plan stores, per output
#    channel, the float64 column [(w_j - w_zp)*q*2^-k ..., off*2^-k]; one BLAS
#    dgemm of the rows [(x_j - x_zp) ..., 1] against it gives y. Every product
#    and every partial sum, in whatever order BLAS adds (with or without FMA), is
#    an integer multiple of 2^-k of magnitude at most (X*L1*q + |off|)*2^-k. The
#    plan requires X*L1*q + |off| + 2^31 <= 2^53 ("bound B"): then every such value
#    is a float64, so every operation is exact (scalings by 2^-k, k <= 62, are exact).
# 3. G first (Conv2D with a long reduction, DepthwiseConv2d, FullyConnected).
#    G is computed exactly: BLAS sgemm, or float32 multiply-adds over the kernel
#    taps, while X*L1 < 2^24 (every partial sum is then a float32 integer);
#    float64 up to 2^53. Then y = G*(q*2^-k) + off*2^-k in float64, as a product
#    and a sum or as one fused multiply-add (the compiled pass). Under bound B
#    every operation is exact. Without it, they are still exact for
#    |G| <= g = floor((2^53 - 2^31 - |off|) / q), and, being correctly rounded
#    (two roundings or the FMA's one), monotone in G everywhere; the plan then requires ("saturation") that the exact
#    y at G = -g is < act_min - 1 and at G = g is >= act_max + 1. Outside [-g, g]
#    the computed y is thus already beyond the clamp on the correct side (and stays
#    there through the correction of 4, which moves y by at most 1/2), and so is the
#    true output, which is monotone in acc.
# 4. The correction. Where acc < theta, y -= 2^31*2^-k (exact where y is; bound B
#    reserves the 2^31); acc < theta <=> y < y_theta = (theta*q + c0)*2^-k, since
#    the exact y is strictly increasing in acc for q > 0 (q = 0 has no theta). It
#    only moves outputs with acc < theta, i.e. SRDHM(acc, q) < 0, whose value is
#    floor(y) <= out_zp (the numerator acc*q + 2^30 is then negative), so it is
#    skipped when out_zp <= act_min: the clamp sends both candidates to act_min
#    (every ReLU/ReLU6 output with zero point 0).
# 5. Floor and clamp. clip(y, lo, hi), then the cast to the output type truncates
#    toward zero, which is floor for y >= 0, and floor(clip(y, lo, hi)) ==
#    clip(floor(y), lo, hi) for integers lo, hi. With lo < 0 (int8) an explicit
#    floor comes first.
# 6. No int32 wrap. The plans require X*L1 + |bias| <= INT32_MAX, so acc is the
#    int32 value the C kernels compute.
# Compiled loops (runtime/kernels/jit.py, numba): where numba is available, the
# requantization of arguments 3-5 runs as one compiled pass per GEMM block (the
# same float64 operations per element, so the same proofs), the folded GEMM of
# argument 2 is then not used, and DepthwiseConv2d with multiplier 1 accumulates
# G tap by tap in a compiled loop. Conv2D with group 1 runs whole in compiled code
# where numpy's BLAS can be called from it (blocks of rows on numba's threads, the
# GEMM of each block through runtime/kernels/blas.py): the same G (exact in any
# summation order) and the same requantization. MACEQ_NO_JIT=1 selects the numpy paths.
# Outside these bounds (inputs wider than 16 bits, huge biases or shifts, left
# shifts, negative multipliers) the generic int64 paths above run instead.

_F64_INT = 1 << 53  # float64 holds every integer of magnitude <= 2^53
_F32_INT = 1 << 24  # float32 holds every integer of magnitude <= 2^24
_BLOCK_BYTES = 1 << 20  # float64 bytes of GEMM output per block, so a block stays in cache
_LOOP_MIN = 512  # per-channel vectors are tiled to at least this many elements (long numpy inner loops)
_SGEMM_MIN_K = 48  # from this reduction length, sgemm + two float64 passes beat the folded dgemm
_DW_BLOCK_BYTES = 1 << 19  # float64 bytes of depthwise output per block (plus two float32 accumulators)


def _x_bound(dtype, x_zp: int) -> int | None:
    """max |x - x_zp| over an integer dtype of at most 16 bits; None for wider types (no static bound)."""
    info = np.iinfo(dtype)
    if info.bits > 16:
        return None
    return max(int(x_zp) - int(info.min), int(info.max) - int(x_zp))


def _min(a, b):
    return b if a is None else min(a, b)


def _le(x, limit) -> bool:
    """x <= limit, where a limit of None means unbounded."""
    return limit is None or x <= limit


@dataclass(frozen=True)
class _Tiles:
    """Per-channel float64 vectors repeated ``reps`` times (see _ExactRequant.tiles)."""

    scale: np.ndarray
    offset: np.ndarray
    y_theta: np.ndarray
    step: np.ndarray


class _ExactRequant:
    """Float64 terms of ``clamp(MBQM(acc, q, shift) + out_zp, lo, hi)`` per output channel (arguments 1-6).

    ``ok``: every channel is in requant_floor_terms' domain with |off| + 2^31 <= 2^53;
    ``x_exact``/``x_wrap``: the largest X for bound B / for argument 6 (None: unbounded);
    ``saturates``: argument 3's saturation holds for every channel.
    """

    def __init__(self, p: _OutParams, out_zp: int, l1: np.ndarray):
        o = len(p.bias)
        self.lo, self.hi = lo, hi = p.lo, p.hi
        self.scale, self.offset, self.step = np.zeros(o), np.zeros(o), np.zeros(o)
        self.y_theta = np.full(o, -np.inf)
        self.ok, self.saturates = True, True
        self.x_exact = self.x_wrap = None
        self._tiles: dict = {}
        zp = int(out_zp)
        for c in range(o):
            q, sh, b, n1 = int(p.q[c]), int(p.shift[c]), int(p.bias[c]), int(l1[c])
            if not (0 <= q <= INT32_MAX and -31 <= sh <= 0):
                self.ok = False
                return
            k, c0, theta = requant_floor_terms(q, sh, zp)
            off = b * q + c0
            room = _F64_INT - (1 << 31) - abs(off)  # what bound B leaves for |G*q|
            if room < 0 or abs(c0) + (1 << 30) + q > _F64_INT:  # y_theta's numerator too
                self.ok = False
                return
            if n1:
                self.x_wrap = _min(self.x_wrap, (INT32_MAX - abs(b)) // n1)
                if q:
                    self.x_exact = _min(self.x_exact, room // (q * n1))
            if q:
                g = room // q
                if not (-g * q + off < (lo - 1) << k and g * q + off >= (hi + 1) << k):
                    self.saturates = False
            self.scale[c] = math.ldexp(q, -k)  # exact: q < 2^31 times a power of two
            self.offset[c] = math.ldexp(off, -k)  # exact: |off| < 2^53
            self.step[c] = math.ldexp(1, 31 - k)
            if theta is not None and zp > lo:
                self.y_theta[c] = math.ldexp(theta * q + c0, -k)
        self.correct = bool(np.isfinite(self.y_theta).any())

    def folded_ok(self, x: int | None) -> bool:
        """Argument 2 (bound B) and 6 hold for input bound x."""
        return self.ok and x is not None and _le(x, self.x_exact) and _le(x, self.x_wrap)

    def g_ok(self, x: int | None) -> bool:
        """Argument 3 (bound B or saturation) and 6 hold for input bound x."""
        return (self.ok and x is not None and _le(x, self.x_wrap)
                and (_le(x, self.x_exact) or self.saturates))

    def tiles(self, reps: int, sl: slice = slice(None)) -> _Tiles:
        """The vectors (channels ``sl``) repeated ``reps`` times: an op on a (rows, reps*n) view of a
        (rows*reps, n) block then runs one long inner loop per row instead of one per n elements."""
        key = (reps, sl.start, sl.stop)
        t = self._tiles.get(key)
        if t is None:
            t = self._tiles[key] = _Tiles(*(np.tile(v[sl], reps) for v in
                                            (self.scale, self.offset, self.y_theta, self.step)))
        return t

    def finish(self, y: np.ndarray, t: _Tiles, rows: np.ndarray, dst: np.ndarray) -> None:
        """y (float64, overwritten) = (acc*q + c0)*2^-k laid out like ``t``; ``rows``: the view of y's
        buffer shaped like ``dst``, which receives the clamped codes (arguments 4 and 5)."""
        if self.correct:
            y -= np.less(y, t.y_theta) * t.step
        if self.lo < 0:
            np.floor(y, out=y)
        np.clip(y, self.lo, self.hi, out=y)
        dst[...] = rows  # truncation toward zero == floor here (argument 5)

    def from_g(self, g: np.ndarray, t: _Tiles, y: np.ndarray) -> None:
        """y = G*(q*2^-k) + off*2^-k (argument 3)."""
        np.multiply(g, t.scale, out=y)
        np.add(y, t.offset, out=y)


def _centered(x: np.ndarray, x_zp: int, g: _Geometry, dtype) -> np.ndarray:
    """(x - x_zp) in ``dtype`` with zero padding (== padding x with x_zp first); exact, |x - x_zp| <= 2^16."""
    if not (g.top or g.bottom or g.left or g.right):  # C order whatever x's layout: the callers stride over it
        return np.subtract(x, x_zp, out=np.empty(x.shape, dtype), dtype=dtype)
    xp = np.empty((x.shape[0], g.h + g.top + g.bottom, g.w + g.left + g.right, g.c), dtype)
    _zero_border(xp, g.top, g.top + g.h, g.left, g.left + g.w)
    np.subtract(x, x_zp, out=xp[:, g.top:g.top + g.h, g.left:g.left + g.w, :], dtype=dtype)
    return xp


def _zero_border(a: np.ndarray, r0: int, r1: int, c0: int, c1: int) -> None:
    """Zero a [N, H, W, C] array outside rows r0:r1 and columns c0:c1 (the padding)."""
    a[:, :r0] = 0
    a[:, r1:] = 0
    a[:, r0:r1, :c0] = 0
    a[:, r0:r1, c1:] = 0


def _column_phases(x: np.ndarray, x_zp: int, g: _Geometry, dtype) -> list:
    """The centered, zero-padded input (see _centered) split by padded column modulo the stride:
    phase p holds padded columns p, p + sw, p + 2*sw, ... contiguously, so a kernel tap at padded
    column fx*dw + j*sw reads phase (fx*dw) % sw from column (fx*dw) // sw + j, a contiguous run.
    One pass over x; exact as in _centered."""
    if g.sw == 1:
        return [_centered(x, x_zp, g, dtype)]
    hp, wp = g.h + g.top + g.bottom, g.w + g.left + g.right
    phases = []
    for p in range(g.sw):
        cols = len(range(p, wp, g.sw))
        ph = np.empty((x.shape[0], hp, cols, g.c), dtype)
        j0 = max(0, -(-(g.left - p) // g.sw))  # first phase column inside the image
        j1 = min(cols, -(-(g.left + g.w - p) // g.sw))  # one past the last
        _zero_border(ph, g.top, g.top + g.h, j0, max(j0, j1))
        if j1 > j0:
            start = p + j0 * g.sw - g.left
            np.subtract(x[:, :, start:start + (j1 - j0 - 1) * g.sw + 1:g.sw], x_zp,
                        out=ph[:, g.top:g.top + g.h, j0:j1], dtype=dtype)
        phases.append(ph)
    return phases


def _reps(n: int) -> int:
    return max(1, -(-_LOOP_MIN // max(n, 1)))


class Conv2dPlan:
    """:func:`conv2d` with its weights prepared once: ``conv2d_plan(w, ...)(x) == conv2d(x, w, ...)``.

    Per input dtype it picks the folded dgemm (argument 2) for reductions shorter than
    _SGEMM_MIN_K, else G by sgemm/dgemm then the float64 requantization (argument 3),
    else the generic int64 path.
    """

    def __init__(self, w, bias=None, *, x_zp, w_zp, out_zp, multiplier, shift, strides=(1, 1),
                 pads=(0, 0, 0, 0), dilations=(1, 1), group=1, act_min=None, act_max=None,
                 out_dtype=np.uint8):
        w = np.asarray(w)
        if w.ndim != 4 or not np.issubdtype(w.dtype, np.integer):
            raise MaceqError(f"conv2d: filter must be an integer OHWI array, got {w.dtype} {w.shape}")
        o = w.shape[0]
        if group < 1 or o % group:
            raise MaceqError(f"conv2d: filter {w.shape} (OHWI) and group {group} disagree")
        self.w, self.bias = w, bias
        self.kwargs = dict(x_zp=x_zp, w_zp=w_zp, out_zp=out_zp, multiplier=multiplier, shift=shift,
                           strides=strides, pads=pads, dilations=dilations, group=group, act_min=act_min,
                           act_max=act_max, out_dtype=out_dtype)
        self.x_zp, self.group, self.out_dtype = int(x_zp), int(group), out_dtype
        p = _out_params(o, "conv2d", w_zp=w_zp, bias=bias, multiplier=multiplier, shift=shift,
                        act_min=act_min, act_max=act_max, out_dtype=out_dtype)
        self.wo = w.reshape(o, -1).astype(np.int64) - p.w_zp[:, None]  # [O, KH*KW*C/group], window order
        l1 = np.abs(self.wo).sum(axis=1)
        self.l1_max = int(l1.max()) if l1.size else 0
        self.rq = _ExactRequant(p, out_zp, l1)
        self._modes: dict = {}
        self._setups: dict = {}
        self._tile_calls: dict = {}  # (rows, instruction set, threads) -> intgemm.PointwiseCall
        self._mode(np.dtype(np.uint8))  # the runtime's activations: build those matrices now

    def _mode(self, dtype) -> tuple:
        """(kind, per-group matrices, GEMM dtype) for inputs of ``dtype``; kind None: generic path."""
        hit = self._modes.get(dtype)
        if hit is not None:
            return hit
        xb = _x_bound(dtype, self.x_zp)
        k = self.wo.shape[1]
        g_dtype = None
        if xb is not None and xb * self.l1_max < _F64_INT and self.rq.g_ok(xb):
            g_dtype = np.float32 if xb * self.l1_max < _F32_INT else np.float64
        folded = self.rq.folded_ok(xb)
        og = self.wo.shape[0] // self.group
        groups = [slice(i * og, (i + 1) * og) for i in range(self.group)]
        # With the compiled loops the affine step costs nothing extra (it is in the one requantization
        # pass), so G by sgemm/dgemm always wins over the folded float64 GEMM where it is exact.
        prefer_g = g_dtype is not None and jit.available()
        if folded and not prefer_g and (g_dtype is None or k < _SGEMM_MIN_K or g_dtype is np.float64):
            mats = []
            for sl in groups:
                m = np.empty((k + 1, og))
                m[:-1] = self.wo[sl].T * self.rq.scale[sl]  # exact: |w - w_zp|*q*2^-k (argument 2)
                m[-1] = self.rq.offset[sl]
                mats.append(m)
            hit = ("folded", mats, np.float64)
        elif g_dtype is not None:
            hit = ("g", [np.ascontiguousarray(self.wo[sl].T, dtype=g_dtype) for sl in groups], g_dtype)
        else:
            hit = (None, None, None)
        self._modes[dtype] = hit
        return hit

    def path(self, dtype=np.uint8) -> str:
        """Which path inputs of ``dtype`` take: "folded", "g32", "g64" or "generic"."""
        kind, _, dt = self._mode(np.dtype(dtype))
        return "generic" if kind is None else "folded" if kind == "folded" else "g" + str(8 * np.dtype(dt).itemsize)

    def _setup(self, x: np.ndarray) -> tuple:
        """(checked x, geometry, path kind, matrices, GEMM dtype), the checks cached per shape and dtype."""
        key = (x.shape, x.dtype) if isinstance(x, np.ndarray) else None
        hit = self._setups.get(key)
        if hit is None:
            kw = self.kwargs
            x, _, g = _conv_setup(x, self.w, self.group, kw["strides"], kw["pads"], kw["dilations"])
            hit = (g,) + self._mode(x.dtype)
            if key is not None:
                self._setups[key] = hit
        return (x,) + hit

    def _on_tiles(self, x: np.ndarray, g: _Geometry, pointwise: bool) -> np.ndarray | None:
        """G exact in integers on the AVX-512 VNNI or AVX2 tiles (im2col rows past 1x1, x_zp where a tap lies
        outside x), then the same requantization (runtime/kernels/intgemm.py); None where the tiles do not run."""
        use = intgemm.isa()
        key = (g.n * g.oh * g.ow, use, jit._num_threads())
        call = self._tile_calls.get(key)
        if call is None:
            f = intgemm.packed(self.wo, 0, lambda v: v)
            if f is None:
                return None
            call = self._tile_calls[key] = intgemm.PointwiseCall(self.x_zp, f, self.rq, key[0])
        rows = x.reshape(-1, g.c) if pointwise else im2col_rows(
            x, self.x_zp, kernel=(g.kh, g.kw), strides=(g.sh, g.sw), dilations=(g.dh, g.dw),
            before=(g.top, g.left), out_hw=(g.oh, g.ow))
        out = np.empty((g.n, g.oh, g.ow, self.w.shape[0]), self.out_dtype)
        call(rows, out.reshape(-1, out.shape[3]))
        return out

    def __call__(self, x) -> np.ndarray:
        x, g, kind, mats, dt = self._setup(x)
        if kind is None:
            return _conv2d_generic(x, self.w, self.bias, **self.kwargs)
        pointwise = g.kh == g.kw == g.sh == g.sw == 1 and not (g.top or g.left or g.bottom or g.right)
        out = self._on_tiles(x, g, pointwise) if kind == "g" and self.group == 1 and x.dtype == np.uint8 else None
        if out is not None:
            return out
        if kind == "g" and self.group == 1 and jit.gemm_available():
            # whole in compiled code, blocks of rows on numba's threads (runtime/kernels/jit.py)
            out = np.empty((g.n, g.oh, g.ow, self.w.shape[0]), self.out_dtype)
            if pointwise:
                jit.pointwise_conv(x.reshape(-1, g.c), self.x_zp, mats[0], self.rq, out.reshape(-1, out.shape[3]))
            else:
                jit.im2col_conv(x, self.x_zp, mats[0], g, self.rq, out)
            return out
        folded = kind == "folded"
        o, group = self.w.shape[0], self.group
        og, cg = o // group, g.c // group
        k = g.kh * g.kw * cg
        ka = k + 1 if folded else k  # the folded GEMM has the ones column
        out = np.empty((g.n, g.oh, g.ow, o), self.out_dtype)
        reps = _reps(og)
        rows = max(reps, _BLOCK_BYTES // (8 * max(og, ka)) // reps * reps)
        n_rows = g.n * g.oh * g.ow
        pointwise = (group == 1 and g.kh == g.kw == g.sh == g.sw == 1
                     and not (g.top or g.left or g.bottom or g.right))
        if pointwise:
            rows_t = -(-min(rows, n_rows) // reps) * reps  # whole tiles
        else:
            rb = max(1, min(g.oh, rows // g.ow))
            rows_t = -(-rb * g.ow // reps) * reps
        tiles = [self.rq.tiles(reps, slice(i * og, (i + 1) * og)) for i in range(group)]
        a = np.empty((rows_t, ka), dt)
        if folded:
            a[:, k] = 1.0
        y = np.empty((rows_t, og))
        gb = y if folded else np.empty((rows_t, og), dt)

        compiled = jit.available()

        def gemm_finish(m, grp, dst):
            """GEMM of the first m rows of ``a`` for group ``grp``, requantized into ``dst``."""
            np.matmul(a[:m], mats[grp], out=gb[:m])
            if compiled:  # the same float64 steps in one compiled pass (runtime/kernels/jit.py)
                jit.requant_store(gb[:m], self.rq, dst.reshape(m, og), affine=not folded,
                                  channels=slice(grp * og, (grp + 1) * og))
                return
            mt = -(-m // reps) * reps
            gb[m:mt] = 0  # the rows that only complete the last tile: finite, never written out
            yv = y[:mt].reshape(mt // reps, reps * og)
            if not folded:
                self.rq.from_g(gb[:mt].reshape(mt // reps, reps * og), tiles[grp], yv)
            self.rq.finish(yv, tiles[grp], y[:m].reshape(dst.shape), dst)

        if pointwise:  # 1x1 stride 1: the image rows are the GEMM rows, no im2col
            src, dst = x.reshape(-1, g.c), out.reshape(-1, o)
            for r0 in range(0, n_rows, rows_t):
                m = min(rows_t, n_rows - r0)
                if self.x_zp:
                    np.subtract(src[r0:r0 + m], self.x_zp, out=a[:m, :k], dtype=dt)
                else:
                    a[:m, :k] = src[r0:r0 + m]  # a plain converting copy is twice as fast
                gemm_finish(m, 0, dst[r0:r0 + m])
            return out
        s0, s1 = a.strides
        for n in range(g.n):
            win = _windows(_centered(x[n:n + 1], self.x_zp, g, dt), g)  # [1, OH, OW, KH, KW, C]
            for r0 in range(0, g.oh, rb):
                nr = min(rb, g.oh - r0)
                cols = as_strided(a, shape=(nr, g.ow, g.kh, g.kw, cg),
                                  strides=(g.ow * s0, s0, g.kw * cg * s1, cg * s1, s1))
                for grp in range(group):
                    np.copyto(cols, win[0, r0:r0 + nr, :, :, :, grp * cg:(grp + 1) * cg])
                    gemm_finish(nr * g.ow, grp, out[n, r0:r0 + nr, :, grp * og:(grp + 1) * og])
        return out


def conv2d_plan(w, bias=None, **kwargs) -> Conv2dPlan:
    """A reusable :func:`conv2d` for fixed weights; same keyword arguments as :func:`conv2d`."""
    return Conv2dPlan(w, bias, **kwargs)


def conv2d(x, w, bias=None, *, x_zp, w_zp, out_zp, multiplier, shift, strides=(1, 1),
           pads=(0, 0, 0, 0), dilations=(1, 1), group=1, act_min=None, act_max=None,
           out_dtype=np.uint8):
    """Integer Conv2D, NHWC input, OHWI filter (``w[O, KH, KW, C // group]``); fast path.

    ``acc = sum((x - x_zp) * (w - w_zp)) + bias`` (int32, wrapping), then
    ``clamp(MultiplyByQuantizedMultiplier(acc, multiplier, shift) + out_zp,
    act_min, act_max)``. ``multiplier``, ``shift`` and ``w_zp`` are scalars or
    per-output-channel vectors; ``pads`` is (top, left, bottom, right) filled
    with ``x_zp``; act_min/act_max default to the range of ``out_dtype``.
    MACE's uint8 Conv2D (mace/ops/conv_2d.cc: im2col + gemmlowp) is the case
    group=1, dilation 1, act range [0, 255], (multiplier, shift) from
    :func:`maceq.runtime.fixedpoint.mace_output_multiplier`.
    Implementation: :class:`Conv2dPlan` (BLAS GEMMs over cache-sized blocks with
    an exact float64 requantization, see "Fast paths" above), else the generic
    int64 path.
    """
    return Conv2dPlan(w, bias, x_zp=x_zp, w_zp=w_zp, out_zp=out_zp, multiplier=multiplier, shift=shift,
                      strides=strides, pads=pads, dilations=dilations, group=group, act_min=act_min,
                      act_max=act_max, out_dtype=out_dtype)(x)


class DepthwiseConv2dPlan:
    """:func:`depthwise_conv2d` with its weights prepared once (see :func:`depthwise_conv2d_plan`)."""

    def __init__(self, w, bias=None, *, x_zp, w_zp, out_zp, multiplier=None, shift=None,
                 float_multiplier=None, float_rounding=FloatRequant.ROUND_THEN_ADD_ZP, strides=(1, 1),
                 pads=(0, 0, 0, 0), dilations=(1, 1), act_min=None, act_max=None, out_dtype=np.uint8):
        w = _dw_filter(w)
        _dw_requant_args(multiplier, shift, float_multiplier)
        self.w, self.bias = w, bias
        self.kwargs = dict(x_zp=x_zp, w_zp=w_zp, out_zp=out_zp, multiplier=multiplier, shift=shift,
                           float_multiplier=float_multiplier, float_rounding=float_rounding, strides=strides,
                           pads=pads, dilations=dilations, act_min=act_min, act_max=act_max,
                           out_dtype=out_dtype)
        self.x_zp, self.out_dtype = int(x_zp), out_dtype
        kh, kw, c, mult = w.shape
        self.p = p = _out_params(c * mult, "depthwise_conv2d", w_zp=w_zp, bias=bias, multiplier=multiplier,
                                 shift=shift, act_min=act_min, act_max=act_max, out_dtype=out_dtype)
        self.wo = w.astype(np.int64) - p.w_zp.reshape(c, mult)  # [KH, KW, C, M]
        l1 = np.abs(self.wo).sum(axis=(0, 1)).reshape(-1)
        self.l1_max = int(l1.max()) if l1.size else 0
        self.rq = _ExactRequant(p, out_zp, l1) if float_multiplier is None else None
        self._taps: dict = {}
        self._setups: dict = {}
        self._jit_w: dict = {}
        self._jit_calls: dict = {}  # (dtype, input shape, threads) -> jit.DepthwiseCall

    def _tap_groups(self, g: _Geometry, dtype) -> list:
        """The kernel columns grouped by the input phase they read (see _column_phases):
        [(phase, n_fx, x0, x_step, weights)], fx = fx0, fx0 + step, ... reading phase columns
        x0, x0 + x_step, ... (fx*dw = phase + sw*column; within a phase both steps are uniform).
        With M == 1 the weights [KH, n_fx, C] are tiled to [KH, n_fx, OW*C], so that the einsum
        runs over each output row as one contiguous loop; else they are [KH, n_fx, C, M]."""
        key = (g.ow, g.sw, g.dw, np.dtype(dtype).str)
        groups = self._taps.get(key)
        if groups is None:
            kh, kw, c, mult = self.wo.shape
            groups = []
            for phase in range(g.sw):
                fxs = [fx for fx in range(kw) if fx * g.dw % g.sw == phase]
                if not fxs:
                    continue
                step = fxs[1] - fxs[0] if len(fxs) > 1 else 1
                x0 = fxs[0] * g.dw // g.sw
                x_step = (fxs[1] * g.dw // g.sw - x0) if len(fxs) > 1 else 0
                wt = self.wo[:, fxs[0]::step][:, :len(fxs)].astype(dtype)
                if mult == 1:
                    wt = np.ascontiguousarray(np.broadcast_to(wt[:, :, None, :, 0], (kh, len(fxs), g.ow, c)))
                    wt = wt.reshape(kh, len(fxs), g.ow * c)
                groups.append((phase, len(fxs), x0, x_step, wt))
            self._taps[key] = groups
        return groups

    def _acc_dtype(self, dtype):
        """float32/float64 accumulators for inputs of ``dtype`` (argument 3), or None: generic path."""
        xb = _x_bound(dtype, self.x_zp)
        if xb is None or xb * self.l1_max >= _F64_INT or (self.rq is not None and not self.rq.g_ok(xb)):
            return None
        return np.float32 if xb * self.l1_max < _F32_INT else np.float64

    def path(self, dtype=np.uint8) -> str:
        """Which path inputs of ``dtype`` take: "g32", "g64" or "generic"."""
        dt = self._acc_dtype(np.dtype(dtype))
        return "generic" if dt is None else "g" + str(8 * np.dtype(dt).itemsize)

    def _setup(self, x) -> tuple:
        """(checked x, geometry, accumulator dtype), the checks cached per shape and dtype."""
        key = (x.shape, x.dtype) if isinstance(x, np.ndarray) else None
        hit = self._setups.get(key)
        if hit is None:
            kw_ = self.kwargs
            x = _check_x(x, "depthwise_conv2d")
            _dw_channels(self.w, x)
            kh, kw = self.w.shape[:2]
            hit = (_geometry(x, kh, kw, kw_["strides"], kw_["pads"], kw_["dilations"], "depthwise_conv2d"),
                   self._acc_dtype(x.dtype))
            if key is not None:
                self._setups[key] = hit
        return (x,) + hit

    def __call__(self, x) -> np.ndarray:
        kw_ = self.kwargs
        x, g, dtype = self._setup(x)
        kh, kw, c, mult = self.w.shape
        if dtype is None:
            return _depthwise_conv2d_generic(x, self.w, self.bias, **kw_)
        fixed = self.rq is not None
        o = c * mult
        if fixed and mult == 1 and jit.available():  # one compiled pass per output row (runtime/kernels/jit.py)
            out = np.empty((g.n, g.oh, g.ow, o), self.out_dtype)
            key = (np.dtype(dtype).str, x.shape, jit._num_threads())
            call = self._jit_calls.get(key)
            if call is None:
                wk = self._jit_w.get(key[0])
                if wk is None:  # the offset filter [KH, KW, C] in the accumulator type
                    wk = self._jit_w[key[0]] = np.ascontiguousarray(self.wo[:, :, :, 0], dtype=dtype)
                call = self._jit_calls[key] = jit.DepthwiseCall(self.x_zp, wk, g, self.rq)
            call(x, out)
            return out
        groups = self._tap_groups(g, dtype)
        out = np.empty((g.n, g.oh, g.ow, o), self.out_dtype)
        rb = max(1, min(g.oh, _DW_BLOCK_BYTES // (8 * g.ow * o)))
        blocks = [(n, r0, min(rb, g.oh - r0)) for n in range(g.n) for r0 in range(0, g.oh, rb)]
        tiles = self.rq.tiles(g.ow) if fixed else None
        spec = "yxrk,yxk->rk" if mult == 1 else "yxrwc,yxcm->rwcm"
        acc = np.empty((rb, g.ow * c) if mult == 1 else (rb, g.ow, c, mult), dtype)
        tmp = np.empty_like(acc) if len(groups) > 1 else None
        y = np.empty((rb, g.ow * o)) if fixed else None
        for n, r0, nr in blocks:
            if r0 == 0:  # one image at a time keeps the temporaries small
                phases = _column_phases(x[n:n + 1], self.x_zp, g, dtype)
            a = acc[:nr]
            for i, (phase, n_fx, x0, x_step, wt) in enumerate(groups):
                src = phases[phase][0, r0 * g.sh:, x0:]
                s_row, s_col, s_c = src.strides
                # taps [KH, n_fx] x output rows x output columns (x channels): a strided view
                shape = (kh, n_fx, nr) + ((g.ow * c,) if mult == 1 else (g.ow, c))
                strides = (s_row * g.dh, s_col * x_step, s_row * g.sh) + ((s_c,) if mult == 1 else (s_col, s_c))
                taps = as_strided(src, shape=shape, strides=strides, writeable=False)
                # the sum over the taps: exact, every partial sum is an integer <= X*L1 (argument 3)
                np.einsum(spec, taps, wt, out=a if i == 0 else tmp[:nr])
                if i:
                    a += tmp[:nr]
            dst = out[n, r0:r0 + nr]
            if fixed:
                yb = y[:nr]
                self.rq.from_g(a.reshape(nr, g.ow * o), tiles, yb)
                self.rq.finish(yb, tiles, yb.reshape(dst.shape), dst)
            else:
                accb = wrap_int32(a.reshape(dst.shape).astype(np.int64) + self.p.bias)  # exact integers
                dst[...] = requantize_float(accb, multiplier=np.float32(kw_["float_multiplier"]),
                                            out_zp=kw_["out_zp"], rounding=kw_["float_rounding"],
                                            act_min=self.p.lo, act_max=self.p.hi)
        return out


def depthwise_conv2d_plan(w, bias=None, **kwargs) -> DepthwiseConv2dPlan:
    """A reusable :func:`depthwise_conv2d` for fixed weights; same keyword arguments."""
    return DepthwiseConv2dPlan(w, bias, **kwargs)


def depthwise_conv2d(x, w, bias=None, *, x_zp, w_zp, out_zp, multiplier=None, shift=None,
                     float_multiplier=None, float_rounding=FloatRequant.ROUND_THEN_ADD_ZP,
                     strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1), act_min=None,
                     act_max=None, out_dtype=np.uint8):
    """Integer DepthwiseConv2d, NHWC input, filter ``w[KH, KW, C, M]``, output channel c*M + m; fast path.

    Accumulation as :func:`conv2d` over the taps of one input channel.
    Requantization: with ``(multiplier, shift)``, gemmlowp fixed point as in
    :func:`conv2d` (MACE dilation 1: vendored tflite::optimized_ops::DepthwiseConv;
    TFLite reference); with ``float_multiplier`` (np.float32), the float rule
    ``float_rounding`` (MACE DepthwiseConv2dGeneral, used by
    mace/ops/depthwise_conv2d.cc when a dilation is > 1, is
    FloatRequant.ROUND_THEN_ADD_ZP with M = float32(s_in * s_w / s_out)).
    Implementation: :class:`DepthwiseConv2dPlan` (float32 multiply-adds per kernel
    tap over cache-sized row blocks, exact float64 requantization: see "Fast
    paths" above), else the generic int64 path.
    """
    return DepthwiseConv2dPlan(w, bias, x_zp=x_zp, w_zp=w_zp, out_zp=out_zp, multiplier=multiplier,
                               shift=shift, float_multiplier=float_multiplier, float_rounding=float_rounding,
                               strides=strides, pads=pads, dilations=dilations, act_min=act_min,
                               act_max=act_max, out_dtype=out_dtype)(x)


class FullyConnectedPlan:
    """:func:`fully_connected` with its offset weights converted once.

    G = x_c @ w_c^T is exact in float32 (sgemm) while X*L1 < 2^24, else in float64
    while |sum| < 2^53 (module docstring); then the int32 wrap and the float requantization.
    """

    def __init__(self, w, bias=None, *, x_zp, w_zp, out_zp, multiplier, act_min=0, act_max=255,
                 rounding=FloatRequant.ADD_ZP_THEN_ROUND):
        w = np.asarray(w)
        if w.ndim != 2 or not np.issubdtype(w.dtype, np.integer):
            raise MaceqError(f"fully_connected: w must be an integer [O, K] array, got {w.dtype} {w.shape}")
        self.w = w
        self.x_zp, self.out_zp, self.rounding = int(x_zp), int(out_zp), rounding
        self.multiplier = np.float32(multiplier)
        self.p = _out_params(w.shape[0], "fully_connected", w_zp=w_zp, bias=bias, multiplier=None, shift=None,
                             act_min=act_min, act_max=act_max, out_dtype=np.uint8)
        wo = w.astype(np.int64) - self.p.w_zp[:, None]
        self.l1_max = int(np.abs(wo).sum(axis=1).max()) if wo.size else 0
        self.wt = {np.float64: np.ascontiguousarray(wo.T, dtype=np.float64)}
        if 255 * self.l1_max < _F32_INT:
            self.wt[np.float32] = np.ascontiguousarray(wo.T, dtype=np.float32)
        # compiled int32 sums on the stored uint8 weights: w and w_zp in [0, 255] (so |w - w_zp| <= 255) and
        # K * 255 * 255 < 2^31 bound each |G| below 2^31 (jit.fc_sums)
        small = (w.dtype == np.uint8 and wo.size and 0 <= int(self.p.w_zp.min()) and int(self.p.w_zp.max()) <= 255
                 and wo.shape[1] * 255 * 255 < 2 ** 31)
        self.w8 = (np.ascontiguousarray(w), self.p.w_zp.astype(np.int32)) if small else None

    def __call__(self, x) -> np.ndarray:
        x, _ = _fc_setup(x, self.w, "fully_connected")
        if self.w8 is not None and x.dtype == np.uint8 and 0 <= self.x_zp <= 255 and jit.available():
            g = jit.fc_sums(x, self.x_zp, *self.w8).astype(np.int64)  # |x - x_zp| <= 255
        else:
            xb = _x_bound(x.dtype, self.x_zp)
            dt = np.float32 if xb is not None and xb * self.l1_max < _F32_INT and np.float32 in self.wt else np.float64
            g = _int_acc(np.subtract(x, self.x_zp, dtype=dt) @ self.wt[dt])
        acc = wrap_int32(g + self.p.bias)
        return requantize_float(acc, multiplier=self.multiplier, out_zp=self.out_zp, rounding=self.rounding,
                                act_min=self.p.lo, act_max=self.p.hi).astype(np.uint8)


def fully_connected_plan(w, bias=None, **kwargs) -> FullyConnectedPlan:
    """A reusable :func:`fully_connected` for fixed weights; same keyword arguments."""
    return FullyConnectedPlan(w, bias, **kwargs)


def fully_connected(x, w, bias=None, *, x_zp, w_zp, out_zp, multiplier, act_min=0, act_max=255,
                    rounding=FloatRequant.ADD_ZP_THEN_ROUND):
    """Integer FullyConnected ``x[N, K] @ w[O, K]^T`` with MACE Gemv's float32 requantization; uint8 out.

    mace/ops/arm/q8/gemv.cc: the int32 accumulator (computed there in uint32
    pieces, equal modulo 2^32) plus the raw int32 bias (Gemv does not rescale
    the bias), then ``rounding`` with ``multiplier`` = np.float32
    M = float32(s_w * s_in / s_out) (:func:`maceq.runtime.fixedpoint.mace_float_multiplier`;
    MACE also checks 0 < M < 1 via GetOutputMultiplierAndShift).
    The weight is MACE's [O, H, W, C] flattened to [O, K] (NHWC flatten order).
    """
    return FullyConnectedPlan(w, bias, x_zp=x_zp, w_zp=w_zp, out_zp=out_zp, multiplier=multiplier,
                              act_min=act_min, act_max=act_max, rounding=rounding)(x)


class FullyConnectedFixedPlan:
    """:func:`fully_connected_fixed` with its weights prepared once: a 1x1 :class:`Conv2dPlan`."""

    def __init__(self, w, bias=None, *, x_zp, w_zp, out_zp, multiplier, shift, act_min=None, act_max=None,
                 out_dtype=np.uint8):
        w = np.asarray(w)
        if w.ndim != 2 or not np.issubdtype(w.dtype, np.integer):
            raise MaceqError(f"fully_connected_fixed: w must be an integer [O, K] array, got {w.dtype} {w.shape}")
        self.w = w
        self.conv = Conv2dPlan(w.reshape(w.shape[0], 1, 1, w.shape[1]), bias, x_zp=x_zp, w_zp=w_zp,
                               out_zp=out_zp, multiplier=multiplier, shift=shift, act_min=act_min,
                               act_max=act_max, out_dtype=out_dtype)

    def __call__(self, x) -> np.ndarray:
        x, w = _fc_setup(x, self.w, "fully_connected_fixed")
        return self.conv(x.reshape(x.shape[0], 1, 1, x.shape[1])).reshape(x.shape[0], w.shape[0])


def fully_connected_fixed_plan(w, bias=None, **kwargs) -> FullyConnectedFixedPlan:
    """A reusable :func:`fully_connected_fixed` for fixed weights; same keyword arguments."""
    return FullyConnectedFixedPlan(w, bias, **kwargs)


def fully_connected_fixed(x, w, bias=None, *, x_zp, w_zp, out_zp, multiplier, shift,
                          act_min=None, act_max=None, out_dtype=np.uint8):
    """FullyConnected with gemmlowp requantization: exactly a 1x1 :func:`conv2d` on a 1x1 image."""
    return FullyConnectedFixedPlan(w, bias, x_zp=x_zp, w_zp=w_zp, out_zp=out_zp, multiplier=multiplier,
                                   shift=shift, act_min=act_min, act_max=act_max, out_dtype=out_dtype)(x)
