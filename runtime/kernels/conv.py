"""Integer Conv2D, DepthwiseConv2d and FullyConnected kernels (MACE ARM CPU uint8 semantics).

Activations are NHWC. Every kernel comes twice with the same signature: a
readable reference ``*_ref`` (explicit loops, plain ints, for small shapes) and
a fast vectorised path; tests/oracle/test_conv_oracle.py proves them equal bit
for bit and checks both against TFLite BUILTIN_REF or scalar transcriptions of
MACE's C++.

Accumulation, for every output element (TFLite reference/conv.h style)::

    acc = sum_k (x_k - x_zp) * (w_k - w_zp) + bias        in int32

Overflow bound: for uint8 (or int8) data and a zero point of the same type,
|x - x_zp| <= 255 and |w - w_zp| <= 255, so each product is below 2^16 in
magnitude and a sum of K products stays inside int32 while K < 2^15 (32768;
a 3x3 kernel over 3640 input channels). Past that, and for extreme biases, the
C kernels wrap modulo 2^32; both paths here wrap the same way
(:func:`maceq.runtime.fixedpoint.wrap_int32`). The fast paths sum on float64
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
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from numpy.lib.stride_tricks import as_strided

from maceq.errors import MaceqError
from maceq.runtime.fixedpoint import (
    INT32_MAX,
    INT32_MIN,
    multiply_by_quantized_multiplier,
    round_half_away,
    wrap_int32,
)

__all__ = [
    "FloatRequant",
    "conv_output_size",
    "mace_pads",
    "tflite_same_pads",
    "requantize_fixed",
    "requantize_float",
    "conv2d",
    "conv2d_ref",
    "depthwise_conv2d",
    "depthwise_conv2d_ref",
    "fully_connected",
    "fully_connected_ref",
    "fully_connected_fixed",
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


def _fmaf(a: np.ndarray, b: np.float32, c: np.float32) -> np.ndarray:
    """float32 fused multiply-add ``round32(a*b + c)`` with one rounding, vectorised.

    a*b of two float32 values is exact in float64 (48 significant bits). The
    float64 sum s = p + c rounds; TwoSum gives its exact error t. Rounding
    s "to odd" (move to the odd neighbour when t != 0 and s is even) and then
    to float32 yields the correctly rounded result, since 53 >= 24 + 2
    (Boldo & Melquiond, "Emulation of FMA and correctly rounded sums").
    """
    p = a.astype(np.float64) * np.float64(b)
    cc = np.float64(c)
    s = p + cc
    bb = s - p
    t = (p - (s - bb)) + (cc - bb)
    even = (s.view(np.int64) & 1) == 0
    bump = (t != 0) & even
    towards = np.where(t > 0, np.inf, -np.inf)
    s = np.where(bump, np.nextafter(s, towards), s)
    return s.astype(np.float32)


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


def _dw_setup(x, w, bias, *, w_zp, multiplier, shift, float_multiplier, strides, pads, dilations,
              act_min, act_max, out_dtype):
    """Checked (x, w, geometry, output params) of a depthwise conv."""
    x = _check_x(x, "depthwise_conv2d")
    w = np.asarray(w)
    if w.ndim != 4 or not np.issubdtype(w.dtype, np.integer):
        raise MaceqError(
            f"depthwise_conv2d: filter must be an integer [KH, KW, C, M] array, got {w.dtype} {w.shape}")
    if w.shape[2] != x.shape[3]:
        raise MaceqError(
            f"depthwise_conv2d: filter {w.shape} [KH, KW, C, M] does not match {x.shape[3]} input channels")
    if float_multiplier is None:
        if multiplier is None or shift is None:
            raise MaceqError("depthwise_conv2d: give (multiplier, shift) or float_multiplier")
    elif multiplier is not None or shift is not None:
        raise MaceqError("depthwise_conv2d: give either (multiplier, shift) or float_multiplier, not both")
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
    Implementation: im2col of the offset input in float64 and one BLAS matmul
    per group (exact, see module docstring), vectorised requantization.
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
    Vectorised over pixels and channels; one int64 multiply-add per kernel tap.
    """
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


def _fc_acc(x, w, x_zp, p: _OutParams) -> np.ndarray:
    """int32 (wrapped) accumulators [N, O] via one exact float64 matmul."""
    xf = x.astype(np.float64) - float(x_zp)
    wf = w.astype(np.float64) - p.w_zp.astype(np.float64)[:, None]
    return wrap_int32(_int_acc(xf @ wf.T) + p.bias)


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
    x, w = _fc_setup(x, w, "fully_connected")
    p = _out_params(w.shape[0], "fully_connected", w_zp=w_zp, bias=bias, multiplier=None, shift=None,
                    act_min=act_min, act_max=act_max, out_dtype=np.uint8)
    acc = _fc_acc(x, w, x_zp, p)
    return requantize_float(acc, multiplier=np.float32(multiplier), out_zp=out_zp, rounding=rounding,
                            act_min=p.lo, act_max=p.hi).astype(np.uint8)


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


def fully_connected_fixed(x, w, bias=None, *, x_zp, w_zp, out_zp, multiplier, shift,
                          act_min=None, act_max=None, out_dtype=np.uint8):
    """FullyConnected with gemmlowp requantization: exactly a 1x1 :func:`conv2d` on a 1x1 image."""
    x, w = _fc_setup(x, w, "fully_connected_fixed")
    p = _out_params(w.shape[0], "fully_connected_fixed", w_zp=w_zp, bias=bias, multiplier=multiplier,
                    shift=shift, act_min=act_min, act_max=act_max, out_dtype=out_dtype)
    return requantize_fixed(_fc_acc(x, w, x_zp, p), multiplier=p.q, shift=p.shift, out_zp=out_zp,
                            act_min=p.lo, act_max=p.hi).astype(out_dtype)
