"""Hexagon DSP (XiaoMi/nnlib) uint8 kernels, vectorised: the ``dsp`` device.

Every kernel equals its scalar transcription in ``nnlib_ref.py`` bit for bit (tests/test_dsp_nnlib.py);
the scalar parameter steps (range adjustment, reciprocals, retry loops) are shared with it, the
per-element arithmetic is re-done here in numpy (int64 for the integer steps, float32 where the
C uses ``float``, float32/float64 BLAS for exact integer GEMMs: every partial sum is an integer the
type holds exactly). Where numba is present, the depthwise sums, the pointwise sums and the d32
requantization run as compiled loops (runtime/kernels/jit.py), each tested equal to the numpy steps
(tests/test_dsp_fills.py). What a run derives from the model's constant filters (layouts, offset
filters, byte sums) is computed once per live filter array (runtime/kernels/derived.py).

Data: NHWC uint8 tensors; each tensor carries a float range ``[min, max]`` as nnlib does
(level = (max-min)/255, zero = the code of 0.0). Layouts:

- Supernode filter: nnlib HWDB = ``[KH, KW, C, O]`` (``ohwi_to_hwio`` converts MACE's OHWI).
- DepthwiseSupernode filter: ``[KH, KW, C, 1]`` (MACE's depthwise layout with multiplier 1).
- SuperFC weight: ``[K, O]`` (``fc_weight_to_dsp`` converts MACE's ``[O, K]`` / ``[O,H,W,C]``).
- Bias: int32 over 2^32 levels of ``[bias_min, bias_max]``, as MACE's
  ``quantize_bias_for_hexagon`` writes it (``mace_quantize_bias``).

Geometry: nnlib ops take a padding *mode* (SAME, VALID, SAME_CAFFE); explicit pads
``(top, left, bottom, right)`` are accepted when one mode reproduces them
(``padding_for_pads``), else rejected. ``supports_conv`` reports what nnlib rejects.

Fused ReLU / ReLUX: nnlib's Supernode has no activation input; MACE fuses the activation into
the conv and passes the activation's output range, so the clamp comes from the range alone.
``relu="relu"`` / ``("relux", m)`` is a convenience that narrows ``[out_min, out_max]`` to
``[max(min,0), ...]`` / ``[..., min(max,m)]`` before calling the op.
"""
from __future__ import annotations

import dataclasses
import functools
from enum import Enum

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from maceq.errors import MaceqError
from maceq.mace.enums import Padding as MacePadding
from maceq.runtime.kernels import intgemm, jit
from maceq.runtime.kernels import nnlib_ref as r
from maceq.runtime.kernels.conv import im2col_rows
from maceq.runtime.kernels.derived import ShapedCall, derived
from maceq.runtime.kernels.nnlib_ref import INF, Padding

__all__ = [
    "Padding", "SupernodeVariant", "SuperFCVariant", "ohwi_to_hwio", "fc_weight_to_dsp", "padding_for_pads",
    "nnlib_padding", "mace_padding_mode", "supports_conv",
    "quantize_adjust_range",
    "supernode", "depthwise_supernode", "superfc", "supernode_call", "depthwise_supernode_call",
    "quantized_add", "quantized_sub", "quantized_concat",
    "quantized_maxpool", "quantized_avgpool", "quantized_mean", "quantize", "quantize_input", "dequantize",
]


class SupernodeVariant(Enum):
    """Which Supernode arithmetic: the flat C reference, or the d32 requantization model."""

    REF = "ref"  # op_supernode.c supernode_execute_ref (16-bit reciprocal 0xff0000/maxrange)
    D32 = "d32"  # d32 family: 31-bit recip_val, shift, rounding >> 31 (model; conv core unread)


class SuperFCVariant(Enum):
    """Which SuperFC_8x8p32to8 execution: the HVX one the op runs, or the flat C reference."""

    HVX = "hvx"  # superfc_execute_hvx (nnlib_ref.superfc_hvx_ref; K >= 32 and a multiple of 16)
    REF = "ref"  # SuperFC_8x8p32to8_ref (nnlib_ref.superfc_ref)


# ----------------------------------------------------------------------------------------------
# Vectorised C conversions (int64 / float32 arrays)
# ----------------------------------------------------------------------------------------------

def _wrap32(a):
    return ((np.asarray(a, dtype=np.int64) + (1 << 31)) & 0xFFFFFFFF) - (1 << 31)


def _i2f(a) -> np.ndarray:
    """(float)int32 -> float32, nearest-even (exact via float64 for |a| < 2^53)."""
    return np.asarray(a, dtype=np.int64).astype(np.float64).astype(np.float32)


def _trunc_i32(f: np.ndarray) -> np.ndarray:
    """(int)float on Hexagon: truncate, saturate to int32."""
    if np.isnan(f).any():
        raise MaceqError("nnlib: float-to-int conversion of NaN")
    t = np.trunc(f.astype(np.float64))
    return np.clip(t, r.INT32_MIN, r.INT32_MAX).astype(np.int64)


def _fast_round(f: np.ndarray) -> np.ndarray:
    """fast_roundf on Hexagon (convert_sf2w): nearest-even, saturate to int32."""
    if np.isnan(f).any():
        raise MaceqError("nnlib: float-to-int conversion of NaN")
    return np.clip(np.rint(f.astype(np.float64)), r.INT32_MIN, r.INT32_MAX).astype(np.int64)


def _minout(bias, bias_min, bias_max, sc: "r.D32Scaling", out_min: float, n: int) -> np.ndarray:
    """fill_bias_buf's ``minout = f32(f32(b*ratio) + (-out_min/prod))`` for ``n`` words (``b = 0``
    past the bias): float32 array operations, each the correctly rounded binary32 operation the
    scalar steps of nnlib_ref compute (a binary32 sum or product is exact in binary64 before its
    one rounding)."""
    bias_level = r.fdiv(r.fsub(r.f32(bias_max), r.f32(bias_min)), 4294967296.0)
    ratio = np.float32(r.fdiv(bias_level, sc.prod_level_size))
    offset = np.float32(r.fdiv(-out_min, sc.prod_level_size))
    b = np.zeros(n, dtype=np.int64)
    k = min(len(bias), n)
    b[:k] = np.asarray(bias, dtype=np.int64).reshape(-1)[:k]
    with np.errstate(over="ignore", invalid="ignore"):
        return _i2f(b) * ratio + offset


def fill_bias_buf(bias, bias_min, bias_max, sc: "r.D32Scaling", out_min: float, gemsumb) -> np.ndarray:
    """``nnlib_ref.fill_bias_buf``, vectorised: ``fast_i64_roundf(minout - (float)(int32)(gemsumb*in_offset))``."""
    g = np.asarray(gemsumb, dtype=np.int64)
    with np.errstate(over="ignore", invalid="ignore"):
        d = _minout(bias, bias_min, bias_max, sc, out_min, g.size) - _i2f(_wrap32(g * sc.in_offset))
    if np.isnan(d).any():
        raise MaceqError("nnlib: float-to-int conversion of NaN")
    final = np.rint(d.astype(np.float64))
    if not np.all((final >= r.INT32_MIN) & (final <= r.INT32_MAX)):
        raise MaceqError("nnlib supernode: bias word out of int32 range ('Final too big, will cause overflow')")
    return final.astype(np.int64)


def _fill_bias_buf_cached(bias, bias_min, bias_max, sc: "r.D32Scaling", out_min: float, gemsumb) -> np.ndarray:
    """:func:`fill_bias_buf`, kept per value of its arguments (a node brings the same ones on every run; read-only)."""
    return _fill_bias_buf_of(np.asarray(bias, dtype=np.int64).tobytes(), bias_min, bias_max, sc, out_min,
                             np.asarray(gemsumb, dtype=np.int64).tobytes())


@functools.lru_cache(maxsize=256)
def _fill_bias_buf_of(bias: bytes, bias_min, bias_max, sc: "r.D32Scaling", out_min: float, gemsumb: bytes):
    out = fill_bias_buf(np.frombuffer(bias, np.int64), bias_min, bias_max, sc, out_min,
                        np.frombuffer(gemsumb, np.int64))
    out.flags.writeable = False
    return out


def superfc_fill_bias_buf(bias, bias_min, bias_max, sc: "r.D32Scaling", out_min: float, gemsumb) -> np.ndarray:
    """``nnlib_ref.superfc_fill_bias_buf``, vectorised: ``gemsumb*in_offset + fast_roundf(minout)`` in int32."""
    g = np.asarray(gemsumb, dtype=np.int64)
    return _wrap32(g * sc.in_offset + _fast_round(_minout(bias, bias_min, bias_max, sc, out_min, g.size)))


def padded_gemsumb(w, filt_offset: int, dpad: int) -> np.ndarray:
    """``nnlib_ref._padded_gemsumb``, vectorised: per filter the sum of its bytes, depth padded to
    ``dpad`` and filters to a multiple of 32, all padding ``filt_offset`` (read-only; one per live filter array and
    arguments)."""
    w = np.asarray(w)
    return derived(w, ("gemsumb", int(filt_offset), int(dpad)), lambda v: _padded_gemsumb(v, filt_offset, dpad))


def _padded_gemsumb(w, filt_offset: int, dpad: int) -> np.ndarray:
    kh, kw, c, o = w.shape
    sums = w.astype(np.int64).sum(axis=(0, 1, 2)) + kh * kw * (dpad - c) * filt_offset
    pad = np.full(((o + 31) & ~31) - o, kh * kw * dpad * filt_offset, dtype=np.int64)
    return np.concatenate([sums, pad])


def dwise_gemsumb(w, filt_offset: int) -> np.ndarray:
    """``nnlib_ref.dwise_gemsumb``, vectorised: per channel the tap sum less ``KH*KW*filt_offset``;
    the channels padded to 32 sum ``filt_offset`` over the real taps (read-only; one per live filter array and
    offset)."""
    w = np.asarray(w)
    return derived(w, ("dwise_gemsumb", int(filt_offset)), lambda v: _dwise_gemsumb(v, filt_offset))


def _dwise_gemsumb(w, filt_offset: int) -> np.ndarray:
    kh, kw, c, _ = w.shape
    sums = w[:, :, :, 0].astype(np.int64).sum(axis=(0, 1)) - filt_offset * kh * kw
    pad = np.zeros(((c + 31) & ~31) - c, dtype=np.int64)  # filt_offset*KH*KW - KH*KW*filt_offset
    return np.concatenate([sums, pad])


def superfc_gemsumb(w, filt_offset: int) -> np.ndarray:
    """``nnlib_ref.superfc_gemsumb``, vectorised: ``K*filt_offset - sum(w)`` per filter, 0 past them (read-only; one
    per live weight array and offset)."""
    w = np.asarray(w)
    return derived(w, ("superfc_gemsumb", int(filt_offset)), lambda v: _superfc_gemsumb(v, filt_offset))


def _superfc_gemsumb(w, filt_offset: int) -> np.ndarray:
    k, o = w.shape
    sums = k * filt_offset - w.astype(np.int64).sum(axis=0)
    return np.concatenate([sums, np.zeros(((o + 31) & ~31) - o, dtype=np.int64)])


def _roundf_i32(f: np.ndarray) -> np.ndarray:
    """roundf_i32: (int)(f + copysignf(0.5f, f)) with a float32 add."""
    f = np.asarray(f, dtype=np.float32)
    return _trunc_i32(f + np.copysign(np.float32(0.5), f))


# ----------------------------------------------------------------------------------------------
# Layouts, geometry, support
# ----------------------------------------------------------------------------------------------

def ohwi_to_hwio(w) -> np.ndarray:
    """MACE Conv2D filter [O, KH, KW, C] -> nnlib Supernode filter [KH, KW, C, O] (read-only; one per live
    filter array)."""
    return derived(np.asarray(w), "hwio", lambda v: np.transpose(v, (1, 2, 3, 0)).copy())


def fc_weight_to_dsp(w) -> np.ndarray:
    """MACE FullyConnected weight [O, K] or [O, H, W, C] (NHWC flatten) -> SuperFC [K, O] (read-only; one per live
    weight array)."""
    return derived(np.asarray(w), "fc", lambda v: v.reshape(v.shape[0], -1).T.copy())


def padding_for_pads(*, in_hw, kernel, strides, pads) -> Padding:
    """The nnlib padding mode that reproduces explicit pads (top, left, bottom, right), or MaceqError.

    A mode matches when it gives the same output size as ``(in + before + after - k)//s + 1``
    and the same ``before`` pad on both axes (``after`` only has to cover the last window).
    VALID, then SAME_CAFFE (MACE's choice for Caffe/ONNX models), then SAME are tried.
    """
    top, left, bottom, right = (int(p) for p in pads)
    for mode in (Padding.VALID, Padding.SAME_CAFFE, Padding.SAME):
        ok = True
        for size, k, s, before, after in ((in_hw[0], kernel[0], strides[0], top, bottom),
                                           (in_hw[1], kernel[1], strides[1], left, right)):
            want = (size + before + after - k) // s + 1
            out, b, _ = r.pad_outsize_before_after(size, k, s, mode)
            if out != want or (b != before and out > 0):
                ok = False
        if ok:
            return mode
    raise MaceqError(f"nnlib: pads {tuple(pads)} for input {tuple(in_hw)}, kernel {tuple(kernel)}, strides "
                     f"{tuple(strides)} match no padding mode (SAME, VALID, SAME_CAFFE)")


#: MACE's ``padding`` argument -> nnlib padding, as MACE's Hexagon converter maps it (4 is the converter's NA)
_NNLIB_PADDING = {MacePadding.VALID: Padding.VALID, MacePadding.SAME: Padding.SAME, 4: Padding.NA}


def nnlib_padding(padding_arg: int) -> Padding:
    """The nnlib padding of a MACE ``padding`` argument (TensorFlow models), or MaceqError."""
    if int(padding_arg) not in _NNLIB_PADDING:
        raise MaceqError(f"MACE's Hexagon converter: padding mode {padding_arg} has no nnlib padding")
    return _NNLIB_PADDING[int(padding_arg)]


def mace_padding_mode(*, in_hw, out_hw, kernel, strides, padding_arg=None) -> Padding:
    """The padding mode MACE's Hexagon converter gives a conv / pooling op (add_padding_type_for_conv_pooling).

    With a ``padding`` argument (TensorFlow models) its MACE PaddingMode maps to NN_PAD_VALID /
    SAME / NA. Otherwise (explicit pads: ONNX, Caffe) only the sizes count: VALID when
    ``out == (in - k)/s + 1`` on both axes, else SAME_CAFFE when ``out == (in - 1)/s + 1``, else the
    converter fails ("Hexagon does not support padding type"). So an odd total pad placed TF-style
    (more at the end) runs as SAME_CAFFE (more at the start) on the device.
    """
    if padding_arg is not None:
        return nnlib_padding(padding_arg)
    sizes = list(zip(in_hw, out_hw, kernel, strides))
    if all(o == (i - k) // s + 1 for i, o, k, s in sizes):
        return Padding.VALID
    if all(o == (i - 1) // s + 1 for i, o, k, s in sizes):
        return Padding.SAME_CAFFE
    raise MaceqError(f"MACE's Hexagon converter: no padding type gives output {tuple(out_hw)} from input "
                     f"{tuple(in_hw)}, kernel {tuple(kernel)}, strides {tuple(strides)} ('Hexagon does not support "
                     "padding type')")


def _resolve_padding(padding, in_hw, kernel, strides) -> Padding:
    if isinstance(padding, (tuple, list)) and len(padding) == 4:
        return padding_for_pads(in_hw=in_hw, kernel=kernel, strides=strides, pads=padding)
    return r.as_padding(padding)


def supports_conv(*, strides, dilations, pads, kernel, in_hw=None, depthwise: bool = False,
                  depth_multiplier: int = 1) -> tuple[bool, str]:
    """(accepted, reason) for Supernode / DepthwiseSupernode with these settings.

    Rejected: dilation != 1 (MACE hexagon_converter: "Hexagon only support dilations[1,1]";
    nnlib's Supernode has no dilation input), explicit pads no padding mode reproduces
    (``in_hw`` needed for explicit pads), padding NA, and for the depthwise op everything
    ``nnlib_ref.dwise_supported`` lists (multiplier != 1, filter width not 3/5/7, height < 2,
    horizontal stride not 1/2).
    """
    if tuple(int(d) for d in dilations) != (1, 1):
        return False, f"dilations {tuple(dilations)}: Hexagon only supports dilations [1, 1]"
    if min(int(s) for s in strides) < 1 or min(int(k) for k in kernel) < 1:
        return False, f"bad strides {tuple(strides)} or kernel {tuple(kernel)}"
    try:
        if isinstance(pads, (tuple, list)) and len(pads) == 4:
            if in_hw is None:
                raise MaceqError("explicit pads need in_hw to be mapped to a padding mode")
            mode = padding_for_pads(in_hw=in_hw, kernel=kernel, strides=strides, pads=pads)
        else:
            mode = r.as_padding(pads)
    except MaceqError as e:
        return False, str(e)
    if mode == Padding.NA:
        return False, "padding NA is rejected by the conv/pool ops ('This op might pad')"
    if depthwise:
        return r.dwise_supported(kernel=kernel, strides=strides, depth_multiplier=depth_multiplier)
    return True, ""


# ----------------------------------------------------------------------------------------------
# Ranges
# ----------------------------------------------------------------------------------------------

def quantize_adjust_range(min, max) -> tuple[float, float, float, int]:  # noqa: A002
    """nnlib ``quantize_adjust_range`` -> (adj_min, adj_max, scale, zero_point).

    ``scale`` is nnlib's ``stepsize = flt_div_255(adj_max - adj_min)``; ``zero_point`` is
    ``get_qu8_level_size_zero``'s code of 0.0 for the adjusted range.
    """
    ar = r.quantize_adjust_range(min, max)
    zero, _ = r.get_qu8_level_size_zero(ar.minval, ar.maxval)
    return ar.minval, ar.maxval, ar.stepsize, zero


def _apply_relu(out_min, out_max, relu) -> tuple[float, float]:
    if relu is None:
        return out_min, out_max
    if relu == "relu":
        return max(float(out_min), 0.0), float(out_max)
    if isinstance(relu, tuple) and len(relu) == 2 and relu[0] == "relux":
        return max(float(out_min), 0.0), min(float(out_max), float(relu[1]))
    raise MaceqError(f"dsp: relu must be None, 'relu' or ('relux', max), got {relu!r}")


# ----------------------------------------------------------------------------------------------
# Exact integer convolution sums
# ----------------------------------------------------------------------------------------------

#: |x - in_offset| <= 255 and |w - w_offset| <= 255, so a product is at most PRODUCT_MAX < 2^16: float32 holds every
#: partial sum of up to F32_EXACT_TERMS products exactly (256 * 65025 < 2^24), and a sum of fewer than 33026
#: products never leaves int32 (the wrap is then the identity).
PRODUCT_MAX = 255 * 255
F32_EXACT_TERMS = 256


def _windows(x, in_offset: int, kernel, strides, before, out_hw) -> np.ndarray:
    """[N, OH, OW, C, KH, KW] float32 windows of ``x - in_offset`` (exact: |x - in_offset| <= 255), zero outside
    the input.

    Outside positions hold ``in_offset`` in nnlib (zapped d32 padding) or are skipped (flat
    reference); both contribute ``(in_offset - in_offset) * w = 0``.
    """
    n, h, w, c = x.shape
    kh, kw = kernel
    sh, sw = strides
    oh, ow = out_hw
    need_h, need_w = (oh - 1) * sh + kh, (ow - 1) * sw + kw
    xp = np.zeros((n, need_h, need_w, c), dtype=np.float32)
    bh, bw = before  # xp[j] holds x[j - before]
    ys, ye = max(0, bh), min(need_h, h + bh)
    xs, xe = max(0, bw), min(need_w, w + bw)
    if ye > ys and xe > xs:
        xp[:, ys:ye, xs:xe, :] = x[:, ys - bh:ye - bh, xs - bw:xe - bw, :].astype(np.float32) - np.float32(in_offset)
    return sliding_window_view(xp, (kh, kw), axis=(1, 2))[:, ::sh, ::sw][:, :oh, :ow]


def _exact_sums(acc: np.ndarray, terms: int) -> np.ndarray:
    """Exact integer sums of ``terms`` products (float arrays) as int64, wrapped to int32 as the node's
    accumulator where a sum could leave int32."""
    a = acc.astype(np.int64)
    return a if terms * PRODUCT_MAX < 2 ** 31 else _wrap32(a)


def _pointwise(x_shape, w, strides, before, out_hw) -> bool:
    """A 1x1 stride-1 convolution without padding: its im2col rows are the input's pixels."""
    return w.shape[:2] == (1, 1) and tuple(before) == (0, 0) and tuple(out_hw) == tuple(x_shape[1:3]) \
        and tuple(strides) == (1, 1)


def _packed(w, w_offset: int):
    """The [KH, KW, C, O] filter less ``w_offset`` on the integer tiles (intgemm.packed), or None."""
    o = w.shape[3]
    return intgemm.packed(w, w_offset, lambda v: v.reshape(-1, o).T.astype(np.int64) - w_offset)


def _pointwise_codes(x_shape, w, w_offset: int, strides, before, out_hw):
    """For a pointwise convolution on the integer tiles: ``codes(x, in_offset, word, recip_val, shamt)`` -> (uint8
    [N, OH, OW, O], min raw, max raw), the d32 requantization of the :func:`_conv_sums` sums of ``x`` (of shape
    ``x_shape``) plus ``word`` [O] computed block by block with no sums kept (intgemm.dsp_pointwise; equal to the two
    steps: tests/test_intgemm.py, tests/test_dsp_nnlib.py). None where the sums take another path."""
    if not (_pointwise(x_shape, w, strides, before, out_hw) and jit.gemm_available()):
        return None
    f = _packed(w, w_offset)
    if f is None:
        return None

    def codes(x, in_offset: int, word, recip_val: int, shamt: int):
        y, lo, hi = intgemm.dsp_pointwise(x.reshape(-1, w.shape[2]), in_offset, f, word, recip_val, shamt)
        return y.reshape(x.shape[0], *out_hw, w.shape[3]), lo, hi

    return codes


def _conv_sums(x, w, in_offset, w_offset, strides, before, out_hw) -> np.ndarray:
    """int64 [N,OH,OW,O]: sum((x - in_off)*(w - w_off)) over in-bounds taps, wrapped to int32.

    Float32 GEMMs over chunks of at most F32_EXACT_TERMS terms, each exact, summed exactly: compiled, on the
    im2col rows of x past 1x1 (``in_offset`` at taps outside x adds 0); else numpy's for a pointwise conv, and
    one float64 contraction otherwise, exact while sums stay below 2^53 (K < 2^37). Equal: tests/test_dsp_fills.py.
    """
    kh, kw, c, o = w.shape
    pointwise = _pointwise(x.shape, w, strides, before, out_hw)
    compiled = jit.gemm_available() and 0 <= in_offset <= 255

    def offset_filter32():  # [K, O] float32, once per filter
        return derived(w, ("wz32", w_offset), lambda v: v.reshape(-1, o).astype(np.float32) - np.float32(w_offset))

    if compiled:
        rows = x.reshape(-1, c) if pointwise else im2col_rows(x, in_offset, kernel=(kh, kw), strides=strides,
                                                              dilations=(1, 1), before=before, out_hw=out_hw)
        f = _packed(w, w_offset)
        if f is not None:  # the same sums exactly in integers on the integer tiles (runtime/kernels/intgemm.py)
            sums = intgemm.pointwise_sums(rows, in_offset, f)
        else:
            sums = jit.dsp_pointwise_sums(rows, in_offset, offset_filter32(), F32_EXACT_TERMS)
        return (sums if rows.shape[1] * PRODUCT_MAX < 2 ** 31 else _wrap32(sums)).reshape(x.shape[0], *out_hw, o)
    if pointwise:
        wz = offset_filter32()
        rows = x.reshape(-1, c).astype(np.float32) - np.float32(in_offset)
        if c <= F32_EXACT_TERMS:
            acc = rows @ wz
        else:
            acc = np.zeros((rows.shape[0], o), dtype=np.float64)
            for k0 in range(0, c, F32_EXACT_TERMS):
                acc += rows[:, k0:k0 + F32_EXACT_TERMS] @ wz[k0:k0 + F32_EXACT_TERMS]
        return _exact_sums(acc, c).reshape(*x.shape[:3], o)
    win = _windows(x, in_offset, (kh, kw), strides, before, out_hw)
    acc = np.einsum("nhwcij,ijco->nhwo", win, w.astype(np.float64) - w_offset, optimize=True)
    return _exact_sums(acc, kh * kw * c)


def _dw_sums(x, w, in_offset, w_offset, strides, before, out_hw) -> np.ndarray:
    """int64 [N,OH,OW,C]: the depthwise sum((x - in_offset)*(w - w_offset)) over in-bounds taps, wrapped to int32;
    one compiled pass in int32 where no sum can leave it (equal to :func:`_dw_sums_numpy`: tests/test_dsp_fills.py)."""
    wz = _dw_offset_filter(w, w_offset)
    if wz is not None:
        return jit.dsp_dw_sums(x, wz, in_offset, strides, before, out_hw)
    return _dw_sums_numpy(x, w, in_offset, w_offset, strides, before, out_hw)


def _dw_offset_filter(w, w_offset: int):
    """int32 [KH, KW, C] taps less ``w_offset`` where the compiled depthwise passes run (no sum can leave int32), else
    None."""
    kh, kw = w.shape[:2]
    if not (jit.available() and kh * kw * PRODUCT_MAX < 2 ** 31):
        return None
    return derived(w, ("dw_wz32", w_offset), lambda v: v[:, :, :, 0].astype(np.int32) - np.int32(w_offset))


def _dw_codes(w, w_offset: int, strides, before, out_hw):
    """``codes(x, in_offset, word, recip_val, shamt)`` -> (uint8 [N, OH, OW, C], min raw, max raw): the d32
    requantization of :func:`_dw_sums`'s sums of ``x`` plus ``word`` [C] in their compiled pass (jit.dsp_dw_codes), no
    sums kept; None where the numpy steps run."""
    wz = _dw_offset_filter(w, w_offset)
    if wz is None:
        return None
    return lambda x, io, word, recip_val, shamt: jit.dsp_dw_codes(x, wz, io, strides, before, out_hw, word,
                                                                 recip_val, shamt)


def _dw_sums_numpy(x, w, in_offset, w_offset, strides, before, out_hw) -> np.ndarray:
    """:func:`_dw_sums` tap by tap over numpy's window view, in float32 while every partial sum is exact."""
    kh, kw = w.shape[:2]
    win = _windows(x, in_offset, (kh, kw), strides, before, out_hw)
    dtype = np.float32 if kh * kw <= F32_EXACT_TERMS else np.float64  # every partial sum exact
    wz = w[:, :, :, 0].astype(dtype) - dtype(w_offset)
    acc = np.zeros(win.shape[:4], dtype=dtype)
    for i in range(kh):  # tap by tap
        for j in range(kw):
            acc += win[..., i, j] * wz[i, j]
    return _exact_sums(acc, kh * kw)


def _check_conv(x, w, *, op: str):
    x = np.asarray(x)
    w = np.asarray(w)
    if x.dtype != np.uint8 or x.ndim != 4 or w.dtype != np.uint8 or w.ndim != 4:
        raise MaceqError(f"dsp {op}: expected uint8 NHWC input and uint8 4-D filter, got {x.dtype}{x.shape} "
                         f"and {w.dtype}{w.shape}")
    return x, w


def _d32_kernel(n_out: int, gemsumb, conv_sums, junk_sums=None, codes=None):
    """``make(x)``: the ``d32_execute`` kernel of the input ``x``: ``exact + biasbuf + gemsumb*in_offset``
    requantized, mod 2^32.

    ``conv_sums(x, in_offset)``: int64 [N,OH,OW,O] ``sum((v - in_offset)*(w - filt_offset))`` with
    ``v = in_offset`` at padding; the HVX conv sums are that plus the bias word plus
    ``gemsumb*in_offset`` (each node's own gemsumb, over the channels padded to 32). The min /
    max also covers the padded channels (bias word only) and ``junk_sums(x)(in_offset)``, int64
    [M, O] sums at computed-but-discarded columns (``junk_sums`` None, or ``junk_sums(x)`` None or returning None:
    there are none). Sums are cached per ``in_offset`` for one input.
    ``codes(x, in_offset, word, recip_val, shamt)``: the requantized sums in one step (:func:`_pointwise_codes`,
    :func:`_dw_codes`), used instead of ``conv_sums``.
    ``ranged=False`` (:func:`_d32_node`, for a node whose output range is given at both ends, whose retry check
    never reads the min / max): the padded channels and discarded columns are skipped.
    """
    g = np.asarray(gemsumb, dtype=np.int64)
    words = {}  # the last bias words per in_offset, with the biasbuf they came from (a node's kept first pass)

    def make(x):
        cache = {}
        junk_of = junk_sums(x) if junk_sums is not None else None

        def kernel(sc: r.D32Scaling, biasbuf, *, ranged: bool = True):
            io = sc.in_offset
            hit = words.get(io)
            if hit is None or hit[0] is not biasbuf:
                hit = words[io] = (biasbuf, np.asarray(biasbuf, dtype=np.int64) + g * io)
            word = hit[1]
            if codes is not None:
                y, vmin, vmax = codes(x, io, word[:n_out], sc.recip_val, sc.recip_shamt)
                junk = junk_of(io) if junk_of is not None and ranged else None
            else:
                if io not in cache:
                    cache[io] = (conv_sums(x, io), junk_of(io) if junk_of is not None and ranged else None)
                sums, junk = cache[io]
                y, vmin, vmax = _d32_requant(sums, sc.recip_val, sc.recip_shamt, word[:n_out])
            if not ranged:
                return y, vmin, vmax
            for extra, add in ((word[n_out:], None), (junk, word[:n_out])):
                if extra is not None and extra.size:
                    _, lo, hi = _d32_requant(extra, sc.recip_val, sc.recip_shamt, add)
                    vmin, vmax = min(vmin, lo), max(vmax, hi)
            return y, vmin, vmax

        return kernel

    return make


def _d32_requant(s, recip_val: int, shamt: int, word=None):
    """d32 requant of ``s + word`` (``word`` along the last axis, or none): (u8 outputs, min raw, max raw) as
    dwconv2dbbb_c.c; the compiled loop when it is available (the same int64 steps in one pass, equal to
    :func:`_d32_requant_numpy`: tests/test_dsp_fills.py)."""
    if jit.available():
        return jit.d32_requant(s, recip_val, shamt, word)
    return _d32_requant_numpy(s if word is None else np.asarray(s, dtype=np.int64) + word, recip_val, shamt)


def _d32_requant_numpy(s, recip_val: int, shamt: int):
    """d32 requant, vectorised: (u8 outputs, min raw, max raw) as dwconv2dbbb_c.c."""
    s = _wrap32(_wrap32(s) << shamt)
    lsum = (s * recip_val + 0x40000000) >> 31
    raw = _wrap32(lsum)
    vmin = min(1 << 24, int(raw.min())) if raw.size else 1 << 24
    vmax = max(-(1 << 24), int(raw.max())) if raw.size else -(1 << 24)
    return np.clip(lsum, 0, 255).astype(np.uint8), vmin, vmax


def _d32_index(shape, b, rows, cols, chans) -> tuple[np.ndarray, np.ndarray]:
    """Where ``nnlib_ref.d32_input_read`` reads, on broadcast index arrays: (flat index into the NHWC
    input, 0 where it reads padding; True where it reads the input). Depends on the shape only."""
    n, h, w, c = shape
    wt = r.D32_LEFT_PAD + w + ((-w) & 3)
    nd32 = (c + 31) // 32
    b, rows, cols, chans = np.broadcast_arrays(*(np.asarray(a, dtype=np.int64) for a in (b, rows, cols, chans)))
    dd = chans // 32 + cols // wt
    row = rows + dd // nd32
    ch = 32 * (dd % nd32) + chans % 32
    ix = cols % wt - r.D32_LEFT_PAD
    inside = (row >= 0) & (row < h) & (ix >= 0) & (ix < w)
    p = ((b * h + row) * w + ix) * c + ch
    ok = inside & (p < n * h * w * c)  # ch < c: the pixel's own channel; else the bytes that follow it
    return np.where(ok, p, 0), ok


@functools.lru_cache(maxsize=256)
def _dw_junk_index(shape, kernel, strides, before, out_hw):
    """(flat index, read-the-input mask) [N, OH, J, C, KH, KW] of the taps the depthwise kernel reads at
    the computed columns outside the output (``dwise_computed_cols``), and the same as one int32 index [N, OH, J, KH,
    KW, C] with -1 where the mask is False (what the compiled sums read: 4 bytes a tap instead of 9, channels
    innermost), or None where an index passes 2^31; None when there are none. Kept per geometry: every image of a
    run reads the same places."""
    n, h, wd, c = shape
    kh, kw = kernel
    cols = [ox for ox in r.dwise_computed_cols((kh, kw), strides[1], out_hw[1], before[1]) if not 0 <= ox < out_hw[1]]
    if not cols:
        return None
    bb = np.arange(n)[:, None, None, None, None, None]
    rows = (np.arange(out_hw[0]) * strides[0] - before[0])[None, :, None, None, None, None] \
        + np.arange(kh)[None, None, None, None, :, None]
    mcols = (r.D32_LEFT_PAD - before[1] + np.asarray(cols) * strides[1])[None, None, :, None, None, None] \
        + np.arange(kw)[None, None, None, None, None, :]
    chans = np.arange(c)[None, None, None, :, None, None]
    p, ok = _d32_index(shape, bb, rows, mcols, chans)
    q = None if n * h * wd * c >= 2 ** 31 else np.ascontiguousarray(  # [N, OH, J, KH, KW, C]: channels innermost
        np.where(ok, p, -1).astype(np.int32).transpose(0, 1, 2, 4, 5, 3))
    for a in (p, ok) if q is None else (p, ok, q):
        a.flags.writeable = False
    return p, ok, q


def _dw_junk_sums(x, w, filt_offset: int, strides, before, out_hw):
    """``junk_sums`` for the depthwise kernel: ``sums(in_offset)`` -> int64 [M, C], the sums at
    ``dwise_computed_cols`` outside the output, or None where the kernel computes no such column. Everything is
    found on the first call (the kernel of a node whose output range is given never calls it).

    The kernel reads ``in_offset`` at padding, so each sum of ``(v - in_offset) * (w - filt_offset)`` is
    ``sum_inside v * wz - in_offset * sum_inside wz``, wrapped to int32 at the end."""
    kept = []

    def sums(io):
        if not kept:
            kept.append(_dw_junk_parts(x, w, filt_offset, strides, before, out_hw))
        if kept[0] is None:
            return None
        s1, s0 = kept[0]
        return _wrap32(s1 - io * s0).reshape(-1, x.shape[3])

    return sums


def _dw_junk_parts(x, w, filt_offset: int, strides, before, out_hw):
    """(sum_inside v * wz, sum_inside wz) at the discarded columns (:func:`_dw_junk_sums`), int64, or None. Both
    sums run over the KH*KW taps of products below 2^16 (|v|, |wz| <= 255): one compiled pass in int32 (equal to the
    numpy steps: tests/test_dsp_fills.py), else float32 einsums, exact for up to 256 taps."""
    kh, kw = w.shape[:2]
    index = _dw_junk_index(tuple(x.shape), (kh, kw), tuple(strides), tuple(before), tuple(out_hw))
    if index is None:
        return None
    p, ok, q = index
    c = x.shape[3]
    wz32 = _dw_offset_filter(w, filt_offset)
    if wz32 is not None and q is not None:
        return jit.dsp_junk_sums(np.ascontiguousarray(x).reshape(-1), q.reshape(-1, kh * kw, c),
                                 wz32.reshape(kh * kw, c))
    dtype = np.float32 if kh * kw <= F32_EXACT_TERMS else np.float64
    wz = w[:, :, :, 0].astype(dtype) - dtype(filt_offset)  # [KH, KW, C]
    v = np.where(ok, x.reshape(-1)[p], 0).astype(dtype)  # [N, OH, J, C, KH, KW]
    return (np.einsum("nhjcab,abc->nhjc", v, wz).astype(np.int64),
            np.einsum("nhjcab,abc->nhjc", ok.astype(dtype), wz).astype(np.int64))


# ----------------------------------------------------------------------------------------------
# Supernode / DepthwiseSupernode / SuperFC
# ----------------------------------------------------------------------------------------------

def supernode(x, w, bias, *, x_min, x_max, w_min, w_max, bias_min, bias_max, out_min=-INF, out_max=INF,
              strides, padding, relu=None, variant: SupernodeVariant = SupernodeVariant.REF,
              ref_pad_quirk: bool = False):
    """Supernode_8x8p32to8: conv + int32 bias + clamp to the output range -> (y, y_min, y_max).

    ``out_min=-inf`` / ``out_max=+inf``: nnlib finds the range (returned). ``variant``:
    REF = op_supernode.c reference (``nnlib_ref.supernode_ref``); D32 = what nnlib runs after
    prepare (``nnlib_ref.supernode_d32_ref``): Supernode_8x8p32to8_d32, InputSupernode for
    depth <= 4, or the flat op (REF with the pad quirk) for depth <= 4 and odd stride width > 1.
    ``ref_pad_quirk`` (REF only): the reference's ``nn_pad_compute_before(out_width, ...)``.
    """
    return supernode_call(x, w, bias, x_min=x_min, x_max=x_max, w_min=w_min, w_max=w_max, bias_min=bias_min,
                          bias_max=bias_max, out_min=out_min, out_max=out_max, strides=strides, padding=padding,
                          relu=relu, variant=variant, ref_pad_quirk=ref_pad_quirk)(x)


def _node_call(shape: tuple, run) -> ShapedCall:
    """An nnlib node prepared for inputs of ``shape``: ``call(x)`` -> (y, y_min, y_max) (a model's op keeps one per
    input shape and ranges: runtime/ops_dsp.py)."""
    return ShapedCall(shape, run, "dsp node")


def supernode_call(x, w, bias, *, x_min, x_max, w_min, w_max, bias_min, bias_max, out_min=-INF, out_max=INF,
              strides, padding, relu=None, variant: SupernodeVariant = SupernodeVariant.REF,
              ref_pad_quirk: bool = False) -> ShapedCall:
    """:func:`supernode` for inputs of ``x``'s shape, prepared once (a ShapedCall); same arguments."""
    x, w = _check_conv(x, w, op="Supernode")
    n, h, wd, c = x.shape
    kh, kw, kc, o = w.shape
    if kc != c:
        raise MaceqError(f"dsp Supernode: filter depth {kc} != input depth {c}")
    bias = np.asarray(bias, dtype=np.int64).reshape(-1)
    if bias.size != o:
        raise MaceqError(f"dsp Supernode: bias has {bias.size} entries for {o} filters")
    out_min, out_max = _apply_relu(out_min, out_max, relu)
    strides = (int(strides[0]), int(strides[1]))
    mode = _resolve_padding(padding, (h, wd), (kh, kw), strides)
    oh, ow, bh, bw = r._geometry((h, wd), (kh, kw), strides, mode, op="Supernode")
    kw_args = dict(x_min=x_min, x_max=x_max, w_min=w_min, w_max=w_max, bias_min=bias_min, bias_max=bias_max,
                   out_min=out_min, out_max=out_max)
    if variant == SupernodeVariant.D32:
        node = r.supernode_node(c, strides[1])
        if node is not None:
            return _node_call(x.shape, _supernode_d32(x.shape, w, bias, node, strides, (bh, bw), (oh, ow), **kw_args))
        ref_pad_quirk = True  # the flat Supernode_8x8p32to8 stays: supernode_execute_hvx
    if ref_pad_quirk:
        bh = r.pad_outsize_before_after(oh, kh, strides[0], mode)[1]
        bw = r.pad_outsize_before_after(ow, kw, strides[1], mode)[1]
    if variant == SupernodeVariant.D32:
        if n > 1 and ((kh * kw * c) % 16 or mode == Padding.SAME_CAFFE):
            raise MaceqError("dsp Supernode (flat): batch > 1 with filter size not a multiple of 16 ('Batch size > 1 "
                             "not supported with odd in depth for now')")
        if oh > 3:
            return _node_call(x.shape, lambda x: _supernode_flat(x, w, bias, strides, (bh, bw), (oh, ow), **kw_args))
    return _node_call(x.shape, lambda x: _supernode_ref(x, w, bias, strides, (bh, bw), (oh, ow), **kw_args))


def _supernode_flat(x, w, bias, strides, before, out_hw, *, x_min, x_max, w_min, w_max, bias_min, bias_max,
                    out_min, out_max):
    """supernode_execute_hvx's GEMM path (``nnlib_ref.supernode_flat_ref``), vectorised."""
    in_off, filt_off, out_level, bias_mpy = r.supernode_ref_params(x_min, x_max, w_min, w_max, bias_min, bias_max)
    tmp = _conv_sums(x, w, in_off, filt_off, strides, before, out_hw)
    maxsum = max(0, int(tmp.max())) if tmp.size else 0
    final_min, final_max = r.supernode_flat_range(maxsum, out_level, bias_max, out_min, out_max)
    biasbuf, recip = r.supernode_flat_biasbuf_recip(bias, bias_mpy, final_min, final_max, out_level)
    s = _wrap32(tmp + np.asarray(biasbuf, dtype=np.int64))
    out_i = _wrap32(((s & 0xFFFFFFFF) * recip + (1 << 15)) & 0xFFFFFFFF) >> 16
    return np.clip(out_i, 0, 255).astype(np.uint8), final_min, final_max


def _supernode_d32(x_shape, w, bias, node, strides, before, out_hw, **kw):
    """Supernode_8x8p32to8_d32 / InputSupernode_8x8p32to8_outd32 (``nnlib_ref.supernode_d32_ref``): ``run(x)`` for
    inputs of ``x_shape``."""
    o = w.shape[3]
    filt_offset, filt_level = r.get_qu8_level_size_zero(r.f32(kw["w_min"]), r.f32(kw["w_max"]))
    junk = None
    if node is r.INPUT_SUPERNODE and out_hw[1] % 4:
        ext = (out_hw[0], (out_hw[1] + 3) & ~3)  # InputSupernode computes the width rounded to 4
        junk = lambda x: lambda io: _conv_sums(x, w, io, filt_offset, strides, before, ext)[:, :, out_hw[1]:].reshape(
            -1, o)
    dpad = (w.shape[2] + 3) & ~3 if node is r.INPUT_SUPERNODE else (w.shape[2] + 31) & ~31
    gemsumb = padded_gemsumb(w, filt_offset, dpad)
    return _d32_node(
        w, _d32_kernel(o, gemsumb, lambda x, io: _conv_sums(x, w, io, filt_offset, strides, before, out_hw), junk,
                       _pointwise_codes(x_shape, w, filt_offset, strides, before, out_hw)),
        node=node, out_min=kw["out_min"], out_max=kw["out_max"], x_min=kw["x_min"], x_max=kw["x_max"],
        weights_level=filt_level, bias=bias, bias_min=kw["bias_min"], bias_max=kw["bias_max"], gemsumb=gemsumb,
        fill=_fill_bias_buf_cached)


#: first passes kept per filter: one per set of ranges a node meets (a model with stored ranges brings one)
_FIRST_PASSES_KEPT = 8


def _d32_node(w, make_kernel, **args):
    """``run(x)``: ``nnlib_ref.d32_execute`` with the kernel ``make_kernel(x)`` and its first pass's scalars kept
    per filter ``w`` and arguments: the range state, D32Scaling and bias words depend on the node's ranges, bias and
    gemsumb only, which a model's node brings unchanged on every run. The kernel runs with them; where the retry
    check asks for another pass, the reference loop runs from the start (the same first pass, then the next ones).
    Equal to the reference loop: tests/test_dsp_nnlib.py."""
    kept = derived(w, "d32_first_passes", lambda _: {})
    key = tuple(args[k] for k in ("node", "out_min", "out_max", "x_min", "x_max", "weights_level", "bias_min",
                                  "bias_max")) + (args["bias"].tobytes(), np.asarray(args["gemsumb"]).tobytes())
    first = kept.get(key)
    if first is None:
        st = r.setup_initial_output_range(args["out_min"], args["out_max"], args["node"])
        sc = r.fill_info_minmax_basics(st, args["x_min"], args["x_max"], args["weights_level"])
        first = (st, sc, args["fill"](args["bias"], args["bias_min"], args["bias_max"], sc, st.out_min,
                                      args["gemsumb"]))
        if len(kept) >= _FIRST_PASSES_KEPT:
            kept.pop(next(iter(kept)))
        kept[key] = first
    st0, sc, biasbuf = first

    def run(x):
        kernel = make_kernel(x)
        # both ends given: the retry check returns before it reads the min / max, so the kernel need not find them
        y, vmin, vmax = kernel(sc, biasbuf, ranged=st0.flags != 3)
        st = dataclasses.replace(st0)
        if not r.d32_check_for_retry(st, sc, vmin, vmax):
            return y, st.out_min, st.out_max
        return r.d32_execute(**args, kernel=kernel)

    return run


def _supernode_ref(x, w, bias, strides, before, out_hw, *, x_min, x_max, w_min, w_max, bias_min, bias_max,
                   out_min, out_max):
    """supernode_execute_ref (``nnlib_ref.supernode_ref``), vectorised."""
    in_off, filt_off, out_level, bias_mpy = r.supernode_ref_params(x_min, x_max, w_min, w_max, bias_min, bias_max)
    biasbuf = _fast_round(_i2f(bias) * np.float32(bias_mpy))
    tmp = _conv_sums(x, w, in_off, filt_off, strides, before, out_hw)
    maxsum = max(0, int(tmp.max())) if tmp.size else 0
    minsum = min(0, int(tmp.min())) if tmp.size else 0
    final_min, final_max = r.supernode_ref_range(maxsum, minsum, out_level, out_min, out_max)
    minval_offset, recip = r.supernode_ref_requant_params(final_min, final_max, out_level)
    s = _trunc_i32(_i2f(_wrap32(biasbuf + tmp)) + np.float32(minval_offset))
    out_i = _wrap32(((s & 0xFFFFFFFF) * recip + (1 << 15)) & 0xFFFFFFFF) >> 16
    return np.clip(out_i, 0, 255).astype(np.uint8), final_min, final_max


def depthwise_supernode(x, w, bias, *, x_min, x_max, w_min, w_max, bias_min, bias_max, out_min=-INF,
                        out_max=INF, strides, padding, relu=None):
    """DepthwiseSupernode_8x8p32to8 (runs as the d32 op) -> (y, y_min, y_max); w is [KH, KW, C, 1].

    ``nnlib_ref.depthwise_supernode_ref``: the min / max behind an open range also covers the
    columns the 3x3 kernels compute outside the output (``nnlib_ref.dwise_computed_cols``).
    """
    return depthwise_supernode_call(x, w, bias, x_min=x_min, x_max=x_max, w_min=w_min, w_max=w_max,
                                    bias_min=bias_min, bias_max=bias_max, out_min=out_min, out_max=out_max,
                                    strides=strides, padding=padding, relu=relu)(x)


def depthwise_supernode_call(x, w, bias, *, x_min, x_max, w_min, w_max, bias_min, bias_max, out_min=-INF,
                             out_max=INF, strides, padding, relu=None) -> ShapedCall:
    """:func:`depthwise_supernode` for inputs of ``x``'s shape, prepared once (a ShapedCall); same arguments."""
    x, w = _check_conv(x, w, op="DepthwiseSupernode")
    n, h, wd, c = x.shape
    kh, kw, kc, m = w.shape
    strides = (int(strides[0]), int(strides[1]))
    ok, why = r.dwise_supported(kernel=(kh, kw), strides=strides, depth_multiplier=m, channels=kc, in_channels=c)
    if not ok:
        raise MaceqError(f"dsp DepthwiseSupernode: {why}")
    bias = np.asarray(bias, dtype=np.int64).reshape(-1)
    out_min, out_max = _apply_relu(out_min, out_max, relu)
    mode = _resolve_padding(padding, (h, wd), (kh, kw), strides)
    oh, ow, bh, bw = r._geometry((h, wd), (kh, kw), strides, mode, op="DepthwiseSupernode")
    filt_offset = r.quantize_uint8(0.0, r.f32(w_min), r.f32(w_max))
    gemsumb = dwise_gemsumb(w, filt_offset)
    geometry = (strides, (bh, bw), (oh, ow))
    make_kernel = _d32_kernel(c, gemsumb, lambda x, io: _dw_sums(x, w, io, filt_offset, *geometry),
                              lambda x: _dw_junk_sums(x, w, filt_offset, *geometry),
                              _dw_codes(w, filt_offset, *geometry))
    return _node_call(x.shape, _d32_node(w, make_kernel, node=r.DEPTHWISE_D32, out_min=out_min, out_max=out_max,
                                       x_min=x_min, x_max=x_max, fill=_fill_bias_buf_cached,
                                       weights_level=r.fdiv(r.fsub(r.f32(w_max), r.f32(w_min)), r.fmul(255.0, 1.0)),
                                       bias=bias, bias_min=bias_min, bias_max=bias_max, gemsumb=gemsumb))


def superfc(x, w, bias, *, x_min, x_max, w_min, w_max, bias_min, bias_max, out_min=-INF, out_max=INF, relu=None,
            variant: SuperFCVariant = SuperFCVariant.HVX):
    """SuperFC_8x8p32to8 -> (y [N, O], y_min, y_max); x [N, K], w [K, O].

    ``variant`` HVX: superfc_execute_hvx, what the op runs (``nnlib_ref.superfc_hvx_ref``; K must
    be >= 32 and a multiple of 16); REF: SuperFC_8x8p32to8_ref (``nnlib_ref.superfc_ref``).
    """
    x = np.asarray(x)
    w = np.asarray(w)
    if x.dtype != np.uint8 or x.ndim != 2 or w.dtype != np.uint8 or w.ndim != 2 or w.shape[0] != x.shape[1]:
        raise MaceqError(f"dsp SuperFC: expected uint8 x [N,K] and w [K,O], got {x.dtype}{x.shape}, {w.dtype}{w.shape}")
    out_min, out_max = _apply_relu(out_min, out_max, relu)
    bias = np.asarray(bias, dtype=np.int64).reshape(-1)
    kw = dict(x_min=x_min, x_max=x_max, w_min=w_min, w_max=w_max, bias_min=bias_min, bias_max=bias_max,
              out_min=out_min, out_max=out_max)
    if variant is SuperFCVariant.REF:
        return _superfc_ref(x, w, bias, **kw)
    if variant is not SuperFCVariant.HVX:
        raise MaceqError(f"dsp SuperFC: variant must be a SuperFCVariant, got {variant!r}")
    ok, why = r.superfc_supported(x.shape[1])
    if not ok:
        raise MaceqError(f"dsp SuperFC: {why}")
    fo, filt_level = r.get_qu8_level_size_zero(r.f32(w_min), r.f32(w_max))
    g = superfc_gemsumb(w, fo)
    o = w.shape[1]
    cache = {}

    def kernel(sc: r.D32Scaling, biasbuf):
        if sc.in_offset not in cache:  # exact sum((x - in_offset)*(w - filt_offset))
            cache[sc.in_offset] = _superfc_sums(x, w, sc.in_offset, fo)
        word = np.asarray(biasbuf, dtype=np.int64) - g * sc.in_offset
        y, vmin, vmax = _d32_requant(cache[sc.in_offset], sc.recip_val, sc.recip_shamt, word[:o])
        _, lo, hi = _d32_requant(word[o:], sc.recip_val, sc.recip_shamt)
        return y, min(0, vmin, lo), max(0, vmax, hi)

    return r.superfc_execute(out_min=out_min, out_max=out_max, x_min=x_min, x_max=x_max, filt_level=filt_level,
                             bias=bias, bias_min=bias_min, bias_max=bias_max, gemsumb=g, kernel=kernel,
                             fill=superfc_fill_bias_buf)


def _superfc_sums(x, w, in_offset: int, filt_offset: int) -> np.ndarray:
    """int64 [N, O]: sum((x - in_offset) * (w - filt_offset)) for x [N, K], w [K, O]: on the integer tiles as a 1x1
    convolution's (:func:`_conv_sums`) where they run, else one float64 GEMM, exact while the sums stay below 2^53
    (K < 2^37)."""
    if x.shape[0] < intgemm.ROWS and w.shape[0] * PRODUCT_MAX < 2 ** 31 and jit.available() and 0 <= in_offset <= 255:
        # a few rows: the int32 sums with the weights read once (a 4-row tile would compute 1-3 rows of zeros)
        rows = derived(w, "rows", lambda v: np.ascontiguousarray(v.T))
        return jit.fc_sums(x, in_offset, rows, np.full(rows.shape[0], filt_offset, np.int32)).astype(np.int64)
    f = _packed(w.reshape(1, 1, *w.shape), filt_offset) if jit.gemm_available() and 0 <= in_offset <= 255 else None
    if f is not None:
        return intgemm.pointwise_sums(x, in_offset, f)
    wz = derived(w, ("wz64", filt_offset), lambda v: v.astype(np.float64) - filt_offset)
    return ((x.astype(np.float64) - in_offset) @ wz).astype(np.int64)


def _superfc_ref(x, w, bias, *, x_min, x_max, w_min, w_max, bias_min, bias_max, out_min, out_max):
    """superfc_execute_ref (``nnlib_ref.superfc_ref``), vectorised."""
    in_off, filt_off, out_level, bias_mpy = r.superfc_ref_params(x_min, x_max, w_min, w_max, bias_min, bias_max)
    biasbuf = _fast_round(_i2f(bias) * np.float32(bias_mpy))
    acc = (x.astype(np.float64) - in_off) @ (w.astype(np.float64) - filt_off)
    tmp = _wrap32(acc.astype(np.int64) + biasbuf)
    minsum = min(0, int(tmp.min())) if tmp.size else 0
    maxsum = max(0, int(tmp.max())) if tmp.size else 0
    fmin_, fmax_, outadd, scalef31 = r.superfc_ref_output(minsum, maxsum, out_level, out_min, out_max)
    val = _wrap32(tmp + outadd)
    out_i = _wrap32((val * scalef31 + (1 << 30)) >> 31)
    return np.clip(out_i, 0, 255).astype(np.uint8), fmin_, fmax_


# ----------------------------------------------------------------------------------------------
# QuantizedAdd / QuantizedSub
# ----------------------------------------------------------------------------------------------

#: From this many elements an add looks its pairs up in tables of every pair (built once per scaling).
_LUT_MIN = 1 << 12


def _addsub_core(a: np.ndarray, b: np.ndarray, sp: r.AddSubScaling, track: bool = True):
    """The HVX add datapath on uint8 arrays of one shape -> (u8, min step-2 value, max step-2 value); ``track``
    False (nnlib_ref.addsub_execute: the range logic will not read them): the min and max are not found and both
    are ``intermed_zero``. The output and step-2 value are functions of the pair (a, b): past _LUT_MIN elements,
    one compiled pass of look-ups in their tables (equal to the steps on the elements: tests/test_dsp_nnlib.py),
    in the 64 KiB table of outputs alone where the min and max are not needed."""
    if jit.available() and a.size >= _LUT_MIN:
        codes, steps = _addsub_tables(sp)
        if not track:
            return jit.lut_pairs(a, b, a.size, codes, codes), sp.intermed_zero, sp.intermed_zero
        y, lo, hi = jit.lut_pairs_range(a, b, codes, steps)
    else:
        y, v = _addsub_steps(a.astype(np.int64), b.astype(np.int64), sp)
        lo, hi = (int(v.min()), int(v.max())) if v is not None and v.size else (sp.intermed_zero, sp.intermed_zero)
    if sp.underrange:
        return y, sp.intermed_zero, sp.intermed_zero
    return y, min(sp.intermed_zero, lo), max(sp.intermed_zero, hi)


@functools.lru_cache(maxsize=256)
def _addsub_tables(sp: r.AddSubScaling) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 outputs, int32 step-2 values, 0 where underrange) of every pair, at index a*256 + b; read-only."""
    grid = np.arange(256, dtype=np.int64)
    y, v = _addsub_steps(np.repeat(grid, 256), np.tile(grid, 256), sp)
    v = np.zeros(y.size, np.int32) if v is None else v.astype(np.int32)  # |v| < 2^17
    y.flags.writeable = v.flags.writeable = False
    return y, v


def _addsub_steps(a: np.ndarray, b: np.ndarray, sp: r.AddSubScaling):
    """The HVX add datapath on int64 arrays -> (u8, the step-2 values v; None when underrange)."""
    if sp.underrange:
        t = np.clip(a * sp.a_scale + b * sp.b_scale, r.INT32_MIN, r.INT32_MAX) >> (8 + sp.final_rsh - 1)
        p = np.clip(np.clip(t + sp.offset, r.INT32_MIN, r.INT32_MAX), -32768, 32767)
        return np.clip((p + 1) >> 1, 0, 255).astype(np.uint8), None
    lo_a, lo_b = sp.a_scale & 0x7F, sp.b_scale & 0x7F
    hi_a, hi_b = r.s8(sp.a_scale >> 7), r.s8(((sp.b_scale << 1) & 0xFF00) >> 8)
    hisop = ((a * hi_a + b * hi_b + 0x8000) & 0xFFFF) - 0x8000
    losop = (a * r.s8(lo_a) + b * r.s8(lo_b)) & 0xFFFF
    v = (hisop + (losop >> 7)) >> 1
    p = np.clip(v + r.wrap16(sp.offset), -32768, 32767)
    rsh = sp.final_rsh
    rnd = (1 << (rsh - 1)) if rsh > 0 else 0
    return np.clip((p + rnd) >> rsh, 0, 255).astype(np.uint8), v


def _addsub(a, b, *, a_min, a_max, b_min, b_max, out_min, out_max, subtract: bool):
    a = np.asarray(a)
    b = np.asarray(b)
    if a.dtype != np.uint8 or b.dtype != np.uint8:
        raise MaceqError(f"dsp QuantizedAdd: expected uint8 inputs, got {a.dtype} and {b.dtype}")
    kw = dict(a_min=a_min, a_max=a_max, b_min=b_min, b_max=b_max, out_min=out_min, out_max=out_max,
              subtract=subtract)
    if a.shape == b.shape and not subtract:  # the flat add (the sub always runs as the d32 op)
        return r.addsub_execute(core=lambda sp, track: _addsub_core(a, b, sp, track), **kw)
    _, swap, all_ones = r.addsub_broadcast_plan(a.shape, b.shape)
    shape = np.broadcast_shapes(a.shape, b.shape)
    if all_ones and r.f32(out_min) == -INF and r.f32(out_max) == INF:
        big, rngs = (b, ((b_min, b_max), (a_min, a_max))) if swap else (a, ((a_min, a_max), (b_min, b_max)))
        oper = ("sub_rev" if swap else "sub") if subtract else "add"
        scale, offs, mn, mx = r.addsub_1111_scaling(rngs[0], rngs[1], int((a if swap else b).ravel()[0]), oper)
        return _scaled_copy(big.reshape(shape), scale, offs), mn, mx
    ai, bi = (np.ascontiguousarray(np.broadcast_to(t, shape)) for t in (a, b))
    return r.addsub_execute(core=lambda sp, track: _addsub_core(ai, bi, sp, track), d32=True, **kw)


def _scaled_copy(x: np.ndarray, scale: int, offset: int) -> np.ndarray:
    """``nnlib_ref.scaled_copy_u8`` on an array."""
    if offset == 0 and scale >= 32704:
        return x.copy()
    return np.clip((x.astype(np.int64) * scale + offset * 256 + (1 << 14)) >> 15, 0, 255).astype(np.uint8)


def quantized_add(a, b, *, a_min, a_max, b_min, b_max, out_min=-INF, out_max=INF):
    """QuantizedAdd_8p8to8 -> (y, y_min, y_max); infinite out range: nnlib finds it. Broadcasting
    inputs run as QuantizedAdd_8p8to8_d32 (``nnlib_ref.quantized_addsub_ref``)."""
    return _addsub(a, b, a_min=a_min, a_max=a_max, b_min=b_min, b_max=b_max, out_min=out_min,
                   out_max=out_max, subtract=False)


def quantized_sub(a, b, *, a_min, a_max, b_min, b_max, out_min=-INF, out_max=INF):
    """QuantizedSub_8p8to8 (a - b), which always runs as QuantizedSub_8p8to8_d32: the add datapath
    with a negative b scale, the d32 range logic, broadcasting as the add."""
    return _addsub(a, b, a_min=a_min, a_max=a_max, b_min=b_min, b_max=b_max, out_min=out_min,
                   out_max=out_max, subtract=True)


# ----------------------------------------------------------------------------------------------
# Concat, pooling
# ----------------------------------------------------------------------------------------------

def quantized_concat(inputs, *, axis: int, in_ranges):
    """QuantizedConcat_8 -> (y, y_min, y_max); nnlib computes the output range.

    As nnlib runs it (``nnlib_ref.quantized_concat_ref``): QuantizedConcat_8_d32 (any axis,
    zero-adjusted output range, truncated gain / offset) unless the output is 1x1 in height and
    width, then the flat op (depth only).
    """
    inputs = [np.asarray(t) for t in inputs]
    if len(inputs) != len(in_ranges) or not inputs:
        raise MaceqError("dsp QuantizedConcat: one (min, max) per input is needed")
    axis %= 4
    for t in inputs:
        if t.dtype != np.uint8 or t.ndim != 4 or any(t.shape[d] != inputs[0].shape[d] for d in range(4) if d != axis):
            raise MaceqError(f"dsp QuantizedConcat: uint8 NHWC inputs equal off axis {axis} expected")
    shape = list(inputs[0].shape)
    shape[axis] = sum(t.shape[axis] for t in inputs)
    if r.concat_runs_d32(shape):
        out_min, out_max, params = r.concat_d32_params(in_ranges)
        copy = [off == 0 and gain >= 32704 for off, gain in params]
        luts = [np.clip((np.arange(256) * gain + off * 256 + (1 << 14)) >> 15, 0, 255) for off, gain in params]
    else:
        if axis != 3:
            raise MaceqError(f"dsp QuantizedConcat: axis {axis} rejected (the flat op concatenates depth only)")
        out_min, out_max, params = r.concat_params(in_ranges)
        copy = [off == 0 and gain >= 0x7FC0 for off, gain in params]
        luts = [np.clip(((np.arange(256) + off) * min(gain, 32767) + (1 << 14)) >> 15, 0, 255) for off, gain in params]
    parts = [t if c else lut.astype(np.uint8)[t] for t, c, lut in zip(inputs, copy, luts)]
    return np.concatenate(parts, axis=axis), out_min, out_max


def _pool_windows(x, kernel, strides, padding, *, op):
    x = np.asarray(x)
    if x.dtype != np.uint8 or x.ndim != 4:
        raise MaceqError(f"dsp {op}: expected a uint8 NHWC tensor, got {x.dtype}{x.shape}")
    kernel = (int(kernel[0]), int(kernel[1]))
    strides = (int(strides[0]), int(strides[1]))
    mode = _resolve_padding(padding, x.shape[1:3], kernel, strides)
    oh, ow, bh, bw = r._geometry(x.shape[1:3], kernel, strides, mode, op=op)
    return x, kernel, strides, oh, ow, bh, bw


def _padded_windows(x, kernel, strides, oh, ow, bh, bw, dtype):
    n, h, w, c = x.shape
    need_h, need_w = (oh - 1) * strides[0] + kernel[0], (ow - 1) * strides[1] + kernel[1]
    xp = np.zeros((n, need_h, need_w, c), dtype=dtype)
    ys, ye = max(0, bh), min(need_h, h + bh)
    xs, xe = max(0, bw), min(need_w, w + bw)
    xp[:, ys:ye, xs:xe] = x[:, ys - bh:ye - bh, xs - bw:xe - bw]
    return sliding_window_view(xp, kernel, axis=(1, 2))[:, ::strides[0], ::strides[1]][:, :oh, :ow]


def quantized_maxpool(x, *, x_min, x_max, kernel, strides, padding):
    """QuantizedMaxPool_8 -> (y, x_min, x_max): max of the clipped window (from 0); range copied.
    Raises where QuantizedMaxPool_8_d32 finds too little width padding (``maxpool_d32_check_width``)."""
    x, kernel, strides, oh, ow, bh, bw = _pool_windows(x, kernel, strides, padding, op="QuantizedMaxPool")
    r.maxpool_d32_check_width(x.shape[2], kernel[1], strides[1], _resolve_padding(padding, x.shape[1:3], kernel,
                                                                                  strides))
    win = _padded_windows(x, kernel, strides, oh, ow, bh, bw, np.uint8)  # zero padding: max starts at 0
    return win.max(axis=(4, 5)), r.f32(x_min), r.f32(x_max)


def quantized_avgpool(x, *, x_min, x_max, kernel, strides, padding, pad_lane_code=None):
    """QuantizedAvgPool_8 as nnlib runs it (QuantizedAvgPool_8_d32) -> (y, y_min, y_max).

    ``nnlib_ref.avgpool_d32_ref``: the integral-buffer plan picks the path: a 1x1 output sums
    the window and finds a new output range from the data; 3x3 stride 1 averages over
    zap-padded input, ``(s*3641 + 2^14) >> 15``; 2x2 with stride_w 2 replicates edges,
    ``(s + 2) >> 2``; anything else goes through the x256 integral image with scaled edge
    padding, a shift and a 16-bit reciprocal. Otherwise the range is the input's.
    """
    x, kernel, strides, oh, ow, bh, bw = _pool_windows(x, kernel, strides, padding, op="QuantizedAvgPool")
    mode = _resolve_padding(padding, x.shape[1:3], kernel, strides)
    plan = r.integral_buffer_plan(x.shape[1:3], kernel, strides, mode)
    path = r.avgpool_d32_path(plan)
    if path == "reduce_1x1":
        return _avgpool_reduce_1x1(x, plan, x_min, x_max, pad_lane_code)
    y = {"3x3": _avgpool_3x3, "2x2": _avgpool_2x2, "integral": _avgpool_integral}[path](x.astype(np.int64), plan)
    return y, r.f32(x_min), r.f32(x_max)


def _avgpool_reduce_1x1(x, plan, x_min, x_max, pad_lane_code):
    sums = x[:, :plan.in_h, :plan.in_w, :].astype(np.int64).sum(axis=(1, 2))  # [N, C]
    pad = r.avgpool_pad_lane_sum(x.shape[3], plan, x_min, x_max, pad_lane_code)
    mn, mx, offs, fac, rsh = r.avgpool_reduce_1x1_params(int(sums.min()), int(sums.max()), pad, plan, x_min, x_max)
    d = _wrap32(2 * sums + offs)
    v = np.clip((d * fac * 2 + 0x8000) >> 16, r.INT32_MIN, r.INT32_MAX) >> rsh
    y = np.clip(np.clip((v + 1) >> 1, -32768, 32767), 0, 255).astype(np.uint8)
    return y[:, None, None, :], mn, mx


def _avgpool_3x3(x, plan):
    """avgpool_3x3_zapped + avgpool_3x3_output, vectorised."""
    n, _, _, c = x.shape
    h, w = plan.in_h, plan.in_w
    p = np.zeros((n, h + plan.pad_t + plan.pad_b, w + plan.pad_l + plan.pad_r, c), dtype=np.int64)
    t, l = plan.pad_t, plan.pad_l
    p[:, t:t + h, l:l + w] = x[:, :h, :w]
    if plan.pad_t:
        p[:, 0, l:l + w] = (x[:, 0, :w] + x[:, 1, :w] + 1) >> 1
    if plan.pad_b:
        p[:, t + h, l:l + w] = (x[:, h - 2, :w] + x[:, h - 1, :w] + 1) >> 1
    if plan.pad_l or plan.pad_r:  # on every row, zapped top / bottom rows included
        p[:, :, l - 1] = (p[:, :, l] + p[:, :, l + 1] + 1) >> 1
        p[:, :, l + w] = (p[:, :, l + w - 1] + p[:, :, l + w - 2] + 1) >> 1
    s = sliding_window_view(p, (3, 3), axis=(1, 2)).sum(axis=(4, 5))[:, :plan.out_h, :plan.out_w]
    return (((s * 3641 * 2 + 0x8000) >> 16) & 0xFF).astype(np.uint8)


def _avgpool_2x2(x, plan):
    """avgpool_2x2_output, vectorised: clamped (replicated) rows / columns, ``(sum4 + 2) >> 2``."""
    r0 = np.arange(plan.out_h) * plan.stride_h - plan.pad_t
    c0 = np.arange(plan.out_w) * 2 - plan.pad_l
    s = 0
    for dr in (0, 1):
        rows = np.clip(r0 + dr, 0, plan.in_h - 1)
        for dc in (0, 1):
            s = s + x[:, rows][:, :, np.clip(c0 + dc, 0, plan.in_w - 1)]
    return np.clip((s + 2) >> 2, 0, 255).astype(np.uint8)


def _mul_frac(v, scl: int):
    return np.clip((np.asarray(v, dtype=np.int64) * scl * 2 + 0x8000) >> 16, r.INT32_MIN, r.INT32_MAX)


def _avgpool_integral(x, plan):
    """avgpool_integral_image + avgpool_integral_output, vectorised over batch and channels."""
    n, _, _, c = x.shape
    h, w, pt, pl = plan.in_h, plan.in_w, plan.pad_t, plan.pad_l
    f = np.zeros((n, pt + h + 1 + plan.pad_b, pl + w + 1 + plan.pad_r, c), dtype=np.int64)
    core = np.cumsum(np.cumsum(x[:, :h, :w], axis=1), axis=2) * 256
    f[:, pt + 1:pt + h + 1, pl + 1:pl + w + 1] = _wrap32(core)
    rows = slice(pt + 1, pt + h + 1)
    for p in range(1, pl + 1):
        scale = plan.scales_w[p - 1]
        f[:, rows, pl - p] = 0 if p <= plan.infeas_w else _mul_frac(f[:, rows, pl + plan.win_w - p], scale)
    for p in range(1, plan.pad_r + 1):
        full = f[:, rows, pl + w]
        delt = _wrap32(full - f[:, rows, pl + w - min(w, plan.win_w - p)])
        f[:, rows, pl + w + p] = _wrap32(full - _mul_frac(delt, plan.scales_w[p - 1]))
    ref = plan.win_h - plan.infeas_h - 1
    for p in range(1, pt + 1):
        f[:, pt - p] = 0 if p <= plan.infeas_h else _mul_frac(f[:, pt + ref], plan.scales_h[p - 1])
        ref -= 0 if p <= plan.infeas_h else 1
    ref = h - min(plan.win_h - 1, h)
    for k in range(plan.pad_b):
        full = f[:, pt + h]
        f[:, pt + h + 1 + k] = _wrap32(full - _mul_frac(_wrap32(full - f[:, pt + ref]), plan.scales_h[k]))
        ref += 1 if k + 1 > plan.infeas_h else 0
    t = (np.arange(plan.out_h) * plan.stride_h)[:, None]
    lft = (np.arange(plan.out_w) * plan.stride_w)[None, :]
    b, rt = t + plan.win_h, lft + plan.win_w
    area = _wrap32(_wrap32(f[:, b, rt] - f[:, t, rt]) - _wrap32(f[:, b, lft] - f[:, t, lft]))
    rsh = plan.recip_shift
    v = np.clip((area + ((1 << rsh) >> 1)) >> rsh, -32768, 32767)
    v = np.clip((v * plan.recip_mant * 2 + 0x8000) >> 16, -32768, 32767)
    return np.clip((v + 32) >> 6, 0, 255).astype(np.uint8)


def quantized_mean(x, *, x_min, x_max, axes, out_min=None, out_max=None):
    """QuantizedMean_8 (MACE's Reduce mean, keep dims) -> (y, y_min, y_max); ``nnlib_ref.quantized_mean_ref``.

    The output range is the given one (MACE passes the op's), else the zero-adjusted input range.
    """
    x = np.asarray(x)
    if x.dtype != np.uint8:
        raise MaceqError(f"dsp QuantizedMean: expected uint8, got {x.dtype}")
    axes = tuple(sorted({int(a) % x.ndim for a in axes}))
    divisor = int(np.prod([x.shape[a] for a in axes])) if axes else 1
    in_offset, out_offset, mult, shift, omin, omax = r.mean_params(x_min, x_max, out_min, out_max, divisor)
    v = np.clip(x.astype(np.int64).sum(axis=axes, keepdims=True) - r.wrap32(in_offset * divisor),
                r.INT32_MIN, r.INT32_MAX)
    v = np.clip((v * mult + (1 << 30)) >> 31, r.INT32_MIN, r.INT32_MAX)
    v = np.clip(v + (((1 << shift) >> 1) if shift <= 31 else 0), r.INT32_MIN, r.INT32_MAX) >> min(shift, 31)
    v = np.clip(v + out_offset, r.INT32_MIN, r.INT32_MAX)
    v = ((v + 0x8000) & 0xFFFF) - 0x8000  # vpacke: the low 16 bits
    return np.clip(v, 0, 255).astype(np.uint8), omin, omax


# ----------------------------------------------------------------------------------------------
# Quantize / Dequantize
# ----------------------------------------------------------------------------------------------

def quantize(x, *, min, max):  # noqa: A002
    """nnlib ``Quantize`` (``quantize_execute_opt``) with a given range -> (q, adj_min, adj_max).

    ``nnlib_ref.quantize_hvx_ref``: ``find_scaling_for_hvx_quant({-min, max})`` and the HVX
    quantizer (values outside the range saturate). ``nnlib_ref.quantize_ref`` is Quantize_ref.
    """
    xf = np.asarray(x, dtype=np.float32)
    p = r.find_scaling_for_hvx_quant(-r.f32(min), r.f32(max))
    return _hvx_quantize(xf, p), p.minval, p.maxval


def quantize_input(x):
    """QuantizeINPUT_f_to_8: range from the data, HVX fixed-point quantizer -> (q, min, max)."""
    xf = np.asarray(x, dtype=np.float32)
    if not np.isfinite(xf).all():
        raise MaceqError("dsp QuantizeINPUT: inf or NaN input to quantization")
    lo = min(0.0, float(xf.min())) if xf.size else 0.0
    hi = max(0.0, float(xf.max())) if xf.size else 0.0
    p = r.find_scaling_for_hvx_quant(-lo if lo < 0 else 0.0, hi)
    return _hvx_quantize(xf, p), p.minval, p.maxval


def _hvx_quantize(xf: np.ndarray, p: r.HvxQuantParms) -> np.ndarray:
    """``nnlib_ref.hvx_quantize_word`` on every element (quantize_floats_to_8b_asm); the compiled loop when it is
    available (the same integer steps in one pass, equal to :func:`_hvx_quantize_numpy`: tests/test_dsp_fills.py)."""
    if jit.available():
        return jit.hvx_quantize(xf, p.common_exp, p.min_offset, p.scaling & 0xFFFF)
    return _hvx_quantize_numpy(xf, p)


def _hvx_quantize_numpy(xf: np.ndarray, p: r.HvxQuantParms) -> np.ndarray:
    """``nnlib_ref.hvx_quantize_word`` on every element, vectorised."""
    bits = xf.view(np.uint32).astype(np.int64)
    amount = np.minimum(p.common_exp - ((bits >> 23) & 0xFF), 31)
    s = ((amount & 0x3F) ^ 0x20) - 0x20  # vlsr: 6-bit signed amount, negative shifts left
    mant = (bits & 0x7FFFFF) | 0x800000
    mant = np.where(s >= 0, mant >> np.clip(s, 0, 31), (mant << np.clip(-s, 0, 32)) & 0xFFFFFFFF)
    mant = np.where(bits >= 0x80000000, -mant, mant)
    word = (_wrap32(mant + p.min_offset) * (p.scaling & 0xFFFF)) >> 16
    return (np.clip(word, 0, 0xFFFF) >> 8).astype(np.uint8)


def _dequant_lut(step: float, qzero: int) -> np.ndarray:
    """hvx_dequantize_64xh for all 256 codes (vectorised bit arithmetic)."""
    d = np.arange(256, dtype=np.int64) - qzero
    ub = r.f32_bits(step)
    scale = (ub & 0x7FFFFF) | 0x800000
    base_exp = ((ub >> 23) & 0xFF) + 8
    prod = np.abs(d) * scale
    clz = 32 - np.frexp(prod.astype(np.float64))[1].astype(np.int64)  # bit length (prod < 2^32, exact)
    norm = (prod << clz) & 0xFFFFFFFF
    mant = (norm + 0x80) & 0xFFFFFFFF
    exp = base_exp - clz + (mant < 0x80000000)
    bits = np.where(d < 0, 1 << 31, 0) | ((exp & 0xFF) << 23) | ((mant >> 8) & 0x7FFFFF)
    bits = np.where(d == 0, 0, bits)
    return bits.astype(np.uint32).view(np.float32)


def dequantize(q, *, min, max):  # noqa: A002
    """DequantizeOUTPUT_8tof -> float32: ``(q - qzero)*stepsize`` with the HVX round-half-up mantissa."""
    q = np.asarray(q)
    if q.dtype != np.uint8:
        raise MaceqError(f"dsp Dequantize: expected uint8, got {q.dtype}")
    step, qzero = r.dequantize_step_zero(min, max)
    if step < 2.0 ** -126:
        return np.zeros(q.shape, dtype=np.float32)
    return _dequant_lut(step, qzero)[q]

