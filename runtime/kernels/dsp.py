"""Hexagon DSP (XiaoMi/nnlib) uint8 kernels, vectorised: the ``dsp`` device.

Every kernel equals its scalar transcription in ``nnlib_ref.py`` bit for bit (tests/test_dsp_nnlib.py);
the scalar parameter steps (range adjustment, reciprocals, retry loops) are shared with it, the
per-element arithmetic is re-done here in numpy (int64 for the integer steps, float32 where the
C uses ``float``, float64 BLAS for exact integer GEMMs: every partial sum stays below 2^53).

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

from enum import Enum

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from maceq.errors import MaceqError
from maceq.runtime.kernels import nnlib_ref as r
from maceq.runtime.kernels.nnlib_ref import INF, Padding

__all__ = [
    "Padding", "SupernodeVariant", "ohwi_to_hwio", "fc_weight_to_dsp", "padding_for_pads", "supports_conv",
    "quantize_adjust_range", "mace_adjust_range_for_hexagon", "mace_quantize_bias", "mace_quantize_tensor",
    "supernode", "depthwise_supernode", "superfc", "quantized_add", "quantized_sub", "quantized_concat",
    "quantized_maxpool", "quantized_avgpool", "quantize", "quantize_input", "dequantize",
]


class SupernodeVariant(Enum):
    """Which Supernode arithmetic: the flat C reference, or the d32 requantization model."""

    REF = "ref"  # op_supernode.c supernode_execute_ref (16-bit reciprocal 0xff0000/maxrange)
    D32 = "d32"  # d32 family: 31-bit recip_val, shift, rounding >> 31 (model; conv core unread)


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


def _roundf_i32(f: np.ndarray) -> np.ndarray:
    """roundf_i32: (int)(f + copysignf(0.5f, f)) with a float32 add."""
    f = np.asarray(f, dtype=np.float32)
    return _trunc_i32(f + np.copysign(np.float32(0.5), f))


# ----------------------------------------------------------------------------------------------
# Layouts, geometry, support
# ----------------------------------------------------------------------------------------------

def ohwi_to_hwio(w) -> np.ndarray:
    """MACE Conv2D filter [O, KH, KW, C] -> nnlib Supernode filter [KH, KW, C, O]."""
    return np.ascontiguousarray(np.transpose(np.asarray(w), (1, 2, 3, 0)))


def fc_weight_to_dsp(w) -> np.ndarray:
    """MACE FullyConnected weight [O, K] or [O, H, W, C] (NHWC flatten) -> SuperFC [K, O]."""
    w = np.asarray(w)
    return np.ascontiguousarray(w.reshape(w.shape[0], -1).T)


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


def mace_adjust_range_for_hexagon(min, max) -> tuple[float, float, float, int]:  # noqa: A002
    """MACE's converter rule for HEXAGON (float64) -> (adj_min, adj_max, scale, zero_point)."""
    scale, zero, mn, mx = r.mace_adjust_range_for_hexagon(min, max)
    return mn, mx, scale, zero


def mace_quantize_bias(bias) -> tuple[np.ndarray, float, float]:
    """MACE ``quantize_bias_for_hexagon``: symmetric over 2^32 levels -> (int32 codes, min, max)."""
    data = np.asarray(bias, dtype=np.float64)
    max_val = float(max(abs(data.min()), abs(data.max()))) if data.size else 0.0
    if max_val == 0.0:
        return np.zeros(data.shape, dtype=np.int32), 0.0, 0.0
    scale = (2 * max_val) / 2 ** 32
    q = np.clip(np.round(data / scale).astype(np.int64), -2 ** 31, 2 ** 31 - 1).astype(np.int32)
    return q, -max_val, max_val


def mace_quantize_tensor(data) -> tuple[np.ndarray, float, float]:
    """MACE ``quantize(data, HEXAGON, non_zero=False)`` (weights): -> (uint8 codes, min, max)."""
    data = np.asarray(data, dtype=np.float64)
    scale, zero, mn, mx = r.mace_adjust_range_for_hexagon(float(data.min()), float(data.max()))
    q = np.clip(np.round(zero + data / scale).astype(np.int64), 0, 255).astype(np.uint8)
    return q, mn, mx


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

def _windows(x, in_offset: int, kernel, strides, before, out_hw) -> np.ndarray:
    """[N, OH, OW, C, KH, KW] float64 windows of ``x - in_offset``, zero outside the input.

    Outside positions hold ``in_offset`` in nnlib (zapped d32 padding) or are skipped (flat
    reference); both contribute ``(in_offset - in_offset) * w = 0``.
    """
    n, h, w, c = x.shape
    kh, kw = kernel
    sh, sw = strides
    oh, ow = out_hw
    need_h, need_w = (oh - 1) * sh + kh, (ow - 1) * sw + kw
    xp = np.zeros((n, need_h, need_w, c), dtype=np.float64)
    bh, bw = before  # xp[j] holds x[j - before]
    ys, ye = max(0, bh), min(need_h, h + bh)
    xs, xe = max(0, bw), min(need_w, w + bw)
    if ye > ys and xe > xs:
        xp[:, ys:ye, xs:xe, :] = x[:, ys - bh:ye - bh, xs - bw:xe - bw, :].astype(np.float64) - in_offset
    return sliding_window_view(xp, (kh, kw), axis=(1, 2))[:, ::sh, ::sw][:, :oh, :ow]


def _conv_sums(x, w, in_offset, w_offset, strides, before, out_hw) -> np.ndarray:
    """int64 [N,OH,OW,O]: sum((x - in_off)*(w - w_off)) over in-bounds taps, wrapped to int32.

    float64 GEMM is exact: each term < 2^16, so sums stay below 2^53 for K < 2^37.
    """
    kh, kw, _, _ = w.shape
    win = _windows(x, in_offset, (kh, kw), strides, before, out_hw)
    acc = np.einsum("nhwcij,ijco->nhwo", win, w.astype(np.float64) - w_offset, optimize=True)
    return _wrap32(acc.astype(np.int64))


def _dw_sums(x, w, in_offset, w_offset, strides, before, out_hw) -> np.ndarray:
    kh, kw = w.shape[:2]
    win = _windows(x, in_offset, (kh, kw), strides, before, out_hw)
    acc = np.einsum("nhwcij,ijc->nhwc", win, w[:, :, :, 0].astype(np.float64) - w_offset, optimize=True)
    return _wrap32(acc.astype(np.int64))


def _check_conv(x, w, *, op: str):
    x = np.asarray(x)
    w = np.asarray(w)
    if x.dtype != np.uint8 or x.ndim != 4 or w.dtype != np.uint8 or w.ndim != 4:
        raise MaceqError(f"dsp {op}: expected uint8 NHWC input and uint8 4-D filter, got {x.dtype}{x.shape} "
                         f"and {w.dtype}{w.shape}")
    return x, w


def _d32_kernel(conv_sums, gemsumb):
    """A ``d32_execute`` kernel: outputs of ``bias + sum(v*w) - sum(v*filt_offset)`` requantized.

    With ``v = in_offset`` at padding this equals ``conv_sums(in_offset) + bias +
    in_offset*gemsumb`` mod 2^32 (``gemsumb = sum(w) - K*filt_offset``; the bias buffer holds
    ``-gemsumb*in_offset``). The sums are cached per ``in_offset`` (fixed by the input range).
    """
    cache = {}

    def kernel(sc: r.D32Scaling, biasbuf):
        if sc.in_offset not in cache:
            cache[sc.in_offset] = conv_sums(sc.in_offset)
        s = cache[sc.in_offset] + np.asarray(biasbuf, dtype=np.int64) + gemsumb * sc.in_offset
        return _d32_requant(s, sc.recip_val, sc.recip_shamt)

    return kernel


def _d32_requant(s, recip_val: int, shamt: int):
    """d32 requant, vectorised: (u8 outputs, min raw, max raw) as dwconv2dbbb_c.c."""
    s = _wrap32(np.asarray(s, dtype=np.int64) << shamt)
    lsum = (s * recip_val + 0x40000000) >> 31
    raw = _wrap32(lsum)
    vmin = min(1 << 24, int(raw.min())) if raw.size else 1 << 24
    vmax = max(-(1 << 24), int(raw.max())) if raw.size else -(1 << 24)
    return np.clip(lsum, 0, 255).astype(np.uint8), vmin, vmax


# ----------------------------------------------------------------------------------------------
# Supernode / DepthwiseSupernode / SuperFC
# ----------------------------------------------------------------------------------------------

def supernode(x, w, bias, *, x_min, x_max, w_min, w_max, bias_min, bias_max, out_min=-INF, out_max=INF,
              strides, padding, relu=None, variant: SupernodeVariant = SupernodeVariant.REF,
              ref_pad_quirk: bool = False):
    """Supernode_8x8p32to8: conv + int32 bias + clamp to the output range -> (y, y_min, y_max).

    ``out_min=-inf`` / ``out_max=+inf``: nnlib finds the range (returned). ``variant``:
    REF = op_supernode.c reference (``nnlib_ref.supernode_ref``); D32 = the d32
    requantization model (``nnlib_ref.supernode_d32_model_ref``). ``ref_pad_quirk`` (REF
    only): the reference's ``nn_pad_compute_before(out_width, ...)``.
    """
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
    if variant == SupernodeVariant.D32:
        filt_offset = r.quantize_uint8(0.0, r.f32(w_min), r.f32(w_max))
        gemsumb = w.reshape(-1, o).astype(np.int64).sum(axis=0) - kh * kw * c * filt_offset
        return r.d32_execute(
            out_min=out_min, out_max=out_max, x_min=x_min, x_max=x_max,
            weights_level=r.fdiv(r.fsub(r.f32(w_max), r.f32(w_min)), 255.0),
            bias=bias, bias_min=bias_min, bias_max=bias_max, gemsumb=list(map(int, gemsumb)),
            kernel=_d32_kernel(lambda io: _conv_sums(x, w, io, filt_offset, strides, (bh, bw), (oh, ow)), gemsumb))
    if ref_pad_quirk:
        bh = r.pad_outsize_before_after(oh, kh, strides[0], mode)[1]
        bw = r.pad_outsize_before_after(ow, kw, strides[1], mode)[1]
    in_off, filt_off, out_level, bias_mpy = r.supernode_ref_params(x_min, x_max, w_min, w_max, bias_min, bias_max)
    biasbuf = _fast_round(_i2f(bias) * np.float32(bias_mpy))
    tmp = _conv_sums(x, w, in_off, filt_off, strides, (bh, bw), (oh, ow))
    maxsum = max(0, int(tmp.max())) if tmp.size else 0
    minsum = min(0, int(tmp.min())) if tmp.size else 0
    final_min, final_max = r.supernode_ref_range(maxsum, minsum, out_level, out_min, out_max)
    minval_offset, recip = r.supernode_ref_requant_params(final_min, final_max, out_level)
    s = _trunc_i32(_i2f(_wrap32(biasbuf + tmp)) + np.float32(minval_offset))
    out_i = _wrap32(((s & 0xFFFFFFFF) * recip + (1 << 15)) & 0xFFFFFFFF) >> 16
    return np.clip(out_i, 0, 255).astype(np.uint8), final_min, final_max


def depthwise_supernode(x, w, bias, *, x_min, x_max, w_min, w_max, bias_min, bias_max, out_min=-INF,
                        out_max=INF, strides, padding, relu=None):
    """DepthwiseSupernode_8x8p32to8 (runs as the d32 op) -> (y, y_min, y_max); w is [KH, KW, C, 1]."""
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
    gemsumb = w[:, :, :, 0].reshape(-1, c).astype(np.int64).sum(axis=0) - kh * kw * filt_offset
    return r.d32_execute(out_min=out_min, out_max=out_max, x_min=x_min, x_max=x_max,
                         weights_level=r.fdiv(r.fsub(r.f32(w_max), r.f32(w_min)), r.fmul(255.0, 1.0)),
                         bias=bias, bias_min=bias_min, bias_max=bias_max, gemsumb=list(map(int, gemsumb)),
                         kernel=_d32_kernel(
                             lambda io: _dw_sums(x, w, io, filt_offset, strides, (bh, bw), (oh, ow)), gemsumb))


def superfc(x, w, bias, *, x_min, x_max, w_min, w_max, bias_min, bias_max, out_min=-INF, out_max=INF, relu=None):
    """SuperFC_8x8p32to8 (superfc_execute_ref) -> (y [N, O], y_min, y_max); x [N, K], w [K, O]."""
    x = np.asarray(x)
    w = np.asarray(w)
    if x.dtype != np.uint8 or x.ndim != 2 or w.dtype != np.uint8 or w.ndim != 2 or w.shape[0] != x.shape[1]:
        raise MaceqError(f"dsp SuperFC: expected uint8 x [N,K] and w [K,O], got {x.dtype}{x.shape}, {w.dtype}{w.shape}")
    out_min, out_max = _apply_relu(out_min, out_max, relu)
    in_off, filt_off, out_level, bias_mpy = r.superfc_ref_params(x_min, x_max, w_min, w_max, bias_min, bias_max)
    biasbuf = _fast_round(_i2f(np.asarray(bias, dtype=np.int64).reshape(-1)) * np.float32(bias_mpy))
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

def _addsub_core(a: np.ndarray, b: np.ndarray, sp: r.AddSubScaling):
    """The HVX add datapath on int64 arrays -> (u8, min step-2 value, max step-2 value)."""
    if sp.underrange:
        t = np.clip(a * sp.a_scale + b * sp.b_scale, r.INT32_MIN, r.INT32_MAX) >> (8 + sp.final_rsh - 1)
        p = np.clip(np.clip(t + sp.offset, r.INT32_MIN, r.INT32_MAX), -32768, 32767)
        return np.clip((p + 1) >> 1, 0, 255).astype(np.uint8), sp.intermed_zero, sp.intermed_zero
    lo_a, lo_b = sp.a_scale & 0x7F, sp.b_scale & 0x7F
    hi_a, hi_b = r.s8(sp.a_scale >> 7), r.s8(((sp.b_scale << 1) & 0xFF00) >> 8)
    hisop = ((a * hi_a + b * hi_b + 0x8000) & 0xFFFF) - 0x8000
    losop = (a * r.s8(lo_a) + b * r.s8(lo_b)) & 0xFFFF
    v = (hisop + (losop >> 7)) >> 1
    p = np.clip(v + r.wrap16(sp.offset), -32768, 32767)
    rsh = sp.final_rsh
    rnd = (1 << (rsh - 1)) if rsh > 0 else 0
    lo = min(sp.intermed_zero, int(v.min())) if v.size else sp.intermed_zero
    hi = max(sp.intermed_zero, int(v.max())) if v.size else sp.intermed_zero
    return np.clip((p + rnd) >> rsh, 0, 255).astype(np.uint8), lo, hi


def _addsub(a, b, *, a_min, a_max, b_min, b_max, out_min, out_max, subtract: bool):
    a = np.asarray(a)
    b = np.asarray(b)
    if a.dtype != np.uint8 or b.dtype != np.uint8:
        raise MaceqError(f"dsp QuantizedAdd: expected uint8 inputs, got {a.dtype} and {b.dtype}")
    if a.shape != b.shape:
        raise MaceqError(f"dsp QuantizedAdd: shapes {a.shape} and {b.shape} differ (broadcast runs "
                         "quant_add_spec_asm, not modelled)")
    ai, bi = a.astype(np.int64), b.astype(np.int64)
    return r.addsub_execute(a_min=a_min, a_max=a_max, b_min=b_min, b_max=b_max, out_min=out_min, out_max=out_max,
                            subtract=subtract, core=lambda sp, track: _addsub_core(ai, bi, sp))


def quantized_add(a, b, *, a_min, a_max, b_min, b_max, out_min=-INF, out_max=INF):
    """QuantizedAdd_8p8to8, same-shape inputs -> (y, y_min, y_max). Infinite out range: nnlib finds it."""
    return _addsub(a, b, a_min=a_min, a_max=a_max, b_min=b_min, b_max=b_max, out_min=out_min,
                   out_max=out_max, subtract=False)


def quantized_sub(a, b, *, a_min, a_max, b_min, b_max, out_min=-INF, out_max=INF):
    """QuantizedSub (a - b) on the add datapath with a negative b scale (the d32 op's arithmetic)."""
    return _addsub(a, b, a_min=a_min, a_max=a_max, b_min=b_min, b_max=b_max, out_min=out_min,
                   out_max=out_max, subtract=True)


# ----------------------------------------------------------------------------------------------
# Concat, pooling
# ----------------------------------------------------------------------------------------------

def quantized_concat(inputs, *, axis: int, in_ranges):
    """QuantizedConcat_8 along depth -> (y, y_min, y_max); nnlib computes the output range (union)."""
    if axis % 4 != 3:
        raise MaceqError(f"dsp QuantizedConcat: axis {axis} rejected (nnlib concatenates depth only)")
    inputs = [np.asarray(t) for t in inputs]
    if len(inputs) != len(in_ranges) or not inputs:
        raise MaceqError("dsp QuantizedConcat: one (min, max) per input is needed")
    for t in inputs:
        if t.dtype != np.uint8 or t.ndim != 4 or t.shape[:3] != inputs[0].shape[:3]:
            raise MaceqError("dsp QuantizedConcat: uint8 NHWC inputs with equal N, H, W expected")
    out_min, out_max, params = r.concat_params(in_ranges)
    codes = np.arange(256, dtype=np.int64)
    parts = []
    for t, (offset, gain) in zip(inputs, params):
        if offset == 0 and gain >= 0x7FC0:
            parts.append(t)
            continue
        lut = np.clip(((codes + offset) * min(gain, 32767) + (1 << 14)) >> 15, 0, 255).astype(np.uint8)
        parts.append(lut[t])
    return np.concatenate(parts, axis=3), out_min, out_max


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
    """QuantizedMaxPool_8 -> (y, x_min, x_max): max of the clipped window (from 0); range copied."""
    x, kernel, strides, oh, ow, bh, bw = _pool_windows(x, kernel, strides, padding, op="QuantizedMaxPool")
    win = _padded_windows(x, kernel, strides, oh, ow, bh, bw, np.uint8)  # zero padding: max starts at 0
    return win.max(axis=(4, 5)), r.f32(x_min), r.f32(x_max)


def quantized_avgpool(x, *, x_min, x_max, kernel, strides, padding):
    """QuantizedAvgPool_8 -> (y, x_min, x_max): ``(sum*sath(0x8000/n) + 0x4000) >> 15``, n in-bounds taps."""
    x, kernel, strides, oh, ow, bh, bw = _pool_windows(x, kernel, strides, padding, op="QuantizedAvgPool")
    n, h, w, _ = x.shape
    sums = _padded_windows(x, kernel, strides, oh, ow, bh, bw, np.int64).sum(axis=(4, 5))
    ry = np.arange(oh) * strides[0] - bh
    rx = np.arange(ow) * strides[1] - bw
    cnt_y = np.minimum(ry + kernel[0], h) - np.maximum(ry, 0)
    cnt_x = np.minimum(rx + kernel[1], w) - np.maximum(rx, 0)
    count = cnt_y[:, None] * cnt_x[None, :]
    if (count <= 0).any():
        raise MaceqError("dsp QuantizedAvgPool: empty window (division by zero in nnlib)")
    recip = np.minimum(0x8000 // count, 32767)
    y = ((sums * recip[None, :, :, None] + 0x4000) >> 15) & 0xFF
    return y.astype(np.uint8), r.f32(x_min), r.f32(x_max)


# ----------------------------------------------------------------------------------------------
# Quantize / Dequantize
# ----------------------------------------------------------------------------------------------

def quantize(x, *, min, max):  # noqa: A002
    """nnlib Quantize (reference) with a given range -> (q, adj_min, adj_max).

    ``quantize_adjust_range`` then ``saturate_u8(roundf_i32((x - adj_min) * recip))`` in float32.
    """
    mn, mx = r.f32(min), r.f32(max)
    if not r.check_range_is_sane(mn, mx):
        raise MaceqError(f"dsp Quantize: invalid range for quantize: {mn} ... {mx}")
    ar = r.quantize_adjust_range(mn, mx)
    xf = np.asarray(x, dtype=np.float32)
    q = _roundf_i32((xf - np.float32(ar.minval)) * np.float32(ar.recip_stepsize))
    return np.clip(q, 0, 255).astype(np.uint8), ar.minval, ar.maxval


def quantize_input(x):
    """QuantizeINPUT_f_to_8: range from the data, HVX fixed-point quantizer -> (q, min, max)."""
    xf = np.asarray(x, dtype=np.float32)
    if not np.isfinite(xf).all():
        raise MaceqError("dsp QuantizeINPUT: inf or NaN input to quantization")
    lo = min(0.0, float(xf.min())) if xf.size else 0.0
    hi = max(0.0, float(xf.max())) if xf.size else 0.0
    p = r.find_scaling_for_hvx_quant(-lo if lo < 0 else 0.0, hi)
    bits = xf.view(np.uint32).astype(np.int64)
    e = (bits >> 23) & 0xFF
    shift = np.minimum(p.common_exp - e, 31)
    if (shift < 0).any():
        raise MaceqError("dsp QuantizeINPUT: value outside the quantization range")
    mant = ((bits & 0x7FFFFF) | 0x800000) >> shift
    mant = np.where(bits >= 0x80000000, -mant, mant)
    mant = _wrap32(mant + p.min_offset)
    q = ((mant * p.scaling) & 0xFFFFFFFF) >> 24
    return q.astype(np.uint8), p.minval, p.maxval


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

