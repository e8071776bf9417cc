"""Scalar transcription of XiaoMi/nnlib (Hexagon DSP) arithmetic: the oracle for ``dsp.py``.

Every function here follows one C function of XiaoMi/nnlib step by step, in plain Python
ints and explicit binary32 rounding (``f32``) wherever the C computes in ``float``. Nothing is
vectorised; the loops are the C loops. ``runtime/kernels/dsp.py`` holds the fast numpy
kernels, which the tests prove equal to these on every element.

Upstream: XiaoMi/nnlib at df7ad3c (``hexagon/``), checked against its v60 HVX build run under
QEMU (``tools/nnlib/``; docs/semantics.md, dsp section, has the per-op evidence):

- ``include/quantize.h``, ``src/quantize.c``: ranges and rounding (``quantize_uint8``,
  ``get_qu8_level_size_zero``, ``quantize_adjust_range``, ``roundf_i32``, ``flt_div_255``,
  ``adjust_minmax_for_zero[_with_constraints]``, ``QuantizeMultiplierSmallerThanOne``).
- ``include/nn_graph_padding.h`` (output size, padding), ``include/nn_asm_ops.h``
  (``fast_roundf``, ``fast_i64_roundf``), ``src/prepare.c`` (which op each MACE op becomes).
- Supernode: ``ops/src/op_supernode.c`` (``supernode_execute_ref``, the flat
  ``supernode_execute_hvx``), ``op_supernode_new.c`` (Supernode_8x8p32to8_d32 and
  InputSupernode_8x8p32to8_outd32), ``include/supernode_utils.h``
  (``setup_initial_output_range``, ``fill_info_minmax_basics``, ``fill_bias_buf``, retries),
  ``src/supernode_procweights.c`` (weight repacking).
- Depthwise: ``op_dwise_snode_8bit.c`` (DepthwiseSupernode_8x8p32to8_d32),
  ``src/dwconv2dbbb_c.c`` and the C models in ``asm_src/dwconv2dbbb_*_h.S``.
- SuperFC: ``op_fully_connected.c`` (``superfc_execute_ref``), ``op_superfc_d32.c``
  (``superfc_execute_hvx``).
- Add / Sub: ``op_add.c`` (``qadd_888_check``, ``addsub_flat_direct_execute``,
  ``add_core_hvx[_underrange]``), ``op_add_d32.c`` (the d32 check, broadcasting, the
  ``mode_broadcast_1111`` scaled copy), ``src/shape_util.c``
  (``check_compatible_elementwise_d32``), ``src/tensor_copy_scaled.c``.
- Concat and pools: ``op_concat.c``, ``op_concat_d32.c``, ``op_maxpool.c``,
  ``op_maxpool_d32.c``, ``op_avgpool.c``, ``op_avgpool_d32.c``, ``nn_integral_buffer.h``,
  ``integral_buffer.c``; Mean: ``op_reducing_mean.c``, ``include/nn_reduce_utils.h``.
- Quantize: ``op_quantize.c`` (``quantize_execute_ref``, ``find_scaling_for_hvx_quant``,
  ``hvx_do_dequantize``), ``asm_src/autoquantize_h.S`` (``quantize_floats_to_8b_asm``).
- HVX instruction semantics as QEMU implements them (``target/hexagon/mmvec/``).
- XiaoMi/mace ``tools/python/quantize/quantize_util.py`` (``adjust_range_for_hexagon``,
  ``quantize_bias_for_hexagon``) and ``tools/python/transform/hexagon_converter.py`` (op
  mapping, ranges passed, padding mode).

Conventions. ``f32(v)``: round to binary32, nearest-even (a single float op on binary32
operands computed in double and rounded once is exact: double has more than 2*24+2 bits).
Hexagon is assumed to evaluate ``float`` expressions in binary32 (FLT_EVAL_METHOD 0) without
contracting ``a*b+c`` into an fma except where the source uses the fma intrinsic
(``flt_div_255``). C ``(int)f`` is ``convert_sf2w_chop`` (truncate, saturate); C ``roundf`` rounds
half away; ``fast_roundf`` is ``convert_sf2w`` (nearest-even, saturate). int32 overflow wraps.
"""
from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from maceq.errors import MaceqError
from maceq.runtime.kernels.cfloat import (
    INF,
    bits_f32,
    c_roundf,
    f32,
    f32_bits,
    fadd,
    fdiv,
    fmaf_exact,
    fmaxf,
    fminf,
    fmul,
    fsub,
    i2f,
)

INT32_MIN = -(1 << 31)
INT32_MAX = (1 << 31) - 1


class Padding(IntEnum):
    """nnlib ``padding_type`` (MACE ``HexagonPadding``): the only geometry nnlib ops take."""

    NA = 0
    SAME = 1
    VALID = 2
    SAME_CAFFE = 5


# ----------------------------------------------------------------------------------------------
# Integer helpers
# ----------------------------------------------------------------------------------------------

def wrap32(v: int) -> int:
    """v mod 2^32 as int32 (what Hexagon's 32-bit ALU does on overflow)."""
    return ((v - INT32_MIN) & 0xFFFFFFFF) + INT32_MIN


def wrap16(v: int) -> int:
    return ((v + 0x8000) & 0xFFFF) - 0x8000


def sat(v: int, lo: int, hi: int) -> int:
    return lo if v < lo else hi if v > hi else v


def saturate_u8(v: int) -> int:
    """quantize.h ``saturate_u8`` (Q6_R_satub_R)."""
    return sat(v, 0, 255)


def saturate_i16(v: int) -> int:
    """quantize.h ``saturate_i16`` (Q6_R_sath_R)."""
    return sat(v, -32768, 32767)


def s8(v: int) -> int:
    """Low byte of v as a signed byte (an HVX ``Rt.b[i]`` operand)."""
    v &= 0xFF
    return v - 256 if v >= 128 else v


def flt_getexp(x: float) -> int:
    """quantize.h: biased exponent field - 126 (frexp's exponent for normal x)."""
    return ((f32_bits(x) >> 23) & 0xFF) - 126


def flt_getfrac(x: float) -> float:
    """quantize.h: x with its exponent forced to 126 (frexp's mantissa, sign kept)."""
    return bits_f32((f32_bits(x) & 0x807FFFFF) | (126 << 23))


def flt_power2(e: int) -> float:
    return bits_f32(saturate_u8(e + 127) << 23)


def flt_ldexp(x: float, e: int) -> float:
    return fmul(x, flt_power2(e))


_DIV255_K1 = float.fromhex("0x8.08081p-11")
_DIV255_K2 = -float.fromhex("0xF.EFEFFp-36")


def flt_div_255(x: float) -> float:
    """quantize.h ``flt_div_255`` on Hexagon: ``sfmpyacc(f32(K2*x), x, K1)`` = fma(x, K1, f32(K2*x))."""
    return _flt_div_255(struct.pack("<d", x))  # keyed by the bits: -0.0 and 0.0 stay apart


@functools.lru_cache(maxsize=4096)
def _flt_div_255(bits: bytes) -> float:
    """The exact fused step (rational arithmetic, slow) once per value: a run meets the same ranges again."""
    x = struct.unpack("<d", bits)[0]
    return fmaf_exact(x, _DIV255_K1, fmul(_DIV255_K2, x))


def c_trunc_i32(x: float) -> int:
    """C ``(int)x`` on Hexagon (``convert_sf2w_chop``): truncate toward zero, saturate."""
    if math.isnan(x):
        raise MaceqError("nnlib: float-to-int conversion of NaN")
    if x >= 2147483648.0:
        return INT32_MAX
    if x <= -2147483648.0:
        return INT32_MIN
    return int(x)


def roundf_i32(x: float) -> int:
    """quantize.h ``roundf_i32``: ``(int)(x + copysignf(0.5f, x))`` (the add rounds in binary32)."""
    return c_trunc_i32(fadd(x, math.copysign(0.5, x)))


def roundf_u32(x: float) -> int:
    """quantize.h ``roundf_u32`` on Hexagon: ``convert_sf2uw_chop(x + 0.5f)``, clamped to uint32."""
    v = fadd(x, 0.5)
    if math.isnan(v):
        raise MaceqError("nnlib: float-to-uint conversion of NaN")
    if v <= 0.0:
        return 0
    if v >= 4294967296.0:
        return 0xFFFFFFFF
    return int(v)


def fast_roundf(x: float) -> int:
    """nn_asm_ops.h ``fast_roundf`` on Hexagon: ``Q6_R_convert_sf2w_R`` (nearest-even, saturating)."""
    if math.isnan(x):
        raise MaceqError("nnlib: float-to-int conversion of NaN")
    if x >= 2147483647.5:
        return INT32_MAX
    if x <= -2147483648.5:
        return INT32_MIN
    return sat(round(x), INT32_MIN, INT32_MAX)  # Python round() on a float is nearest-even


# ----------------------------------------------------------------------------------------------
# quantize.h / quantize.c range helpers
# ----------------------------------------------------------------------------------------------

_F1E18 = f32(1e-18)


def quantize_uint8(val: float, minval: float, maxval: float) -> int:
    """quantize.h ``quantize_uint8``: roundf((val-min)*(255/max(1e-18, max-min))), saturated."""
    rng = fmaxf(_F1E18, fsub(maxval, minval))
    resize_amt = fdiv(255.0, rng)
    value_f = fmul(fsub(val, minval), resize_amt)
    return saturate_u8(c_trunc_i32(c_roundf(value_f)))


def quantize_uint(val: float, minval: float, maxval: float) -> int:
    """quantize.h ``quantize_uint``: like quantize_uint8 but only clamped below at 0."""
    rng = fmaxf(_F1E18, fsub(maxval, minval))
    value_i = c_trunc_i32(c_roundf(fmul(fsub(val, minval), fdiv(255.0, rng))))
    return 0 if value_i < 0 else value_i


def get_qu8_level_size_zero(minval: float, maxval: float) -> tuple[int, float]:
    """quantize.h ``get_qu8_level_size_zero`` -> (zero code, level size).

    ``level = flt_div_255(max - min)``; ``zero = saturate_u8(roundf_i32(-min / level))``.
    """
    level = flt_div_255(fsub(maxval, minval))
    if level == 0.0:
        raise MaceqError(f"nnlib: empty range [{minval}, {maxval}]")
    return saturate_u8(roundf_i32(fdiv(-minval, level))), level


_ZF_LO = f32(6.1035156e-05)
_ZF_HI = f32(0.999938965)


@dataclass(frozen=True)
class AdjustedRange:
    """quantize_adjust_range's outputs."""

    minval: float
    maxval: float
    stepsize: float
    recip_stepsize: float


def quantize_adjust_range(in_min: float, in_max: float) -> AdjustedRange:
    """quantize.h ``quantize_adjust_range``: include 0, then move one end so zero is an integer.

    In binary32: ``min = fminf(0, in_min)``, ``max = fmaxf(0, in_max)``,
    ``range = fmaxf(1e-18, max - min)``, ``recip = 255/range``. If ``min < 0``:
    ``z = -min*recip``, ``zi = floorf(z)``, ``zf = z - zi``; unless zf is within 2^-14 of an
    integer, either max grows (``range = -255*min/zi``, ``max = min + range``) when
    ``zi > 0 && (zi > 253 || (zf-1)*min >= zf*max)``, or min shrinks
    (``min = max*(zi+1)/(zi-254)``, ``range = max - min``); then ``recip = 255/range``.
    ``stepsize = flt_div_255(range)``.
    """
    minval = fminf(0.0, f32(in_min))
    maxval = fmaxf(0.0, f32(in_max))
    rng = fmaxf(_F1E18, fsub(maxval, minval))
    recip = fdiv(255.0, rng)
    if minval < 0.0:
        z = fmul(-minval, recip)
        zi = float(math.floor(z))
        zf = fsub(z, zi)
        if _ZF_LO < zf < _ZF_HI:
            if zi > 0.0 and (zi > 253.0 or fmul(fsub(zf, 1.0), minval) >= fmul(zf, maxval)):
                rng = fdiv(fmul(-255.0, minval), zi)
                maxval = fadd(minval, rng)
            else:
                minval = fdiv(fmul(maxval, fadd(zi, 1.0)), fsub(zi, 254.0))
                rng = fsub(maxval, minval)
            recip = fdiv(255.0, rng)
    return AdjustedRange(minval, maxval, flt_div_255(rng), recip)


def check_range_is_sane(min_in: float, max_in: float) -> bool:
    """quantize.h ``check_range_is_sane`` (True when sane)."""
    return not (not math.isfinite(min_in) or not math.isfinite(max_in) or min_in > 0.0
                or max_in < 0.0 or fsub(max_in, min_in) < f32(1e-8))


def adjust_minmax_for_zero(mn: float, mx: float) -> tuple[float, float, int]:
    """quantize.c ``adjust_minmax_for_zero`` -> (min, max, code); code -1 when max - min < 1e-6."""
    mn, mx = f32(mn), f32(mx)
    dif = fsub(mx, mn)
    if not dif >= f32(1e-6):
        return mn, mx, -1
    if mn == 0.0:
        return mn, mx, 0
    z = fdiv(fmul(-255.0, mn), dif)
    zi = float(math.floor(z))
    zf = fsub(z, zi)
    if zf <= _ZF_LO or zf >= _ZF_HI:
        return mn, mx, 0
    if zi > 0.0 and (zi > 253.0 or fmul(fsub(zf, 1.0), mn) >= fmul(zf, mx)):
        return mn, fsub(mn, fdiv(fmul(255.0, mn), zi)), 2
    return fdiv(fmul(mx, fadd(zi, 1.0)), fsub(zi, 254.0)), mx, 1


def adjust_minmax_for_zero_with_constraints(mn: float, mx: float, constraint: int) -> tuple[float, float, int]:
    """quantize.c ``adjust_minmax_for_zero_with_constraints`` -> (min, max, code).

    constraint bit 0: min is fixed, bit 1: max is fixed. Both fixed: both ends move by the
    same amount ``(z - zirnd)*dif/255`` unless z <= 63.75 (min moves) or z >= 192.25 (max
    moves). Code -1 when max <= min, 0 when nothing moved.
    """
    mn, mx = f32(mn), f32(mx)
    dif = fsub(mx, mn)
    if not dif > 0.0:
        return mn, mx, -1
    if mn == 0.0:
        return mn, mx, 0
    z = fdiv(fmul(-255.0, mn), dif)
    zi = float(math.floor(z))
    zf = fsub(z, zi)
    if zf <= _ZF_LO or zf >= _ZF_HI:
        return mn, mx, 0
    mnk = fmul(fsub(zf, 1.0), mn)
    mxk = fmul(zf, mx)
    zirnd = fadd(zi, 1.0) if zf >= 0.5 else zi
    c = constraint & 3
    if c == 0:
        target = "max_out" if (zi >= 1.0 and (zi >= 254.0 or mnk >= mxk)) else "min_out"
    elif c == 1:
        target = "max_out" if (zi >= 1.0 and (z >= 192.25 or fmul(mnk, 8.0) > mxk)) else "min_nearest"
    elif c == 2:
        target = "max_nearest" if (z >= 63.75 and (zi >= 254.0 or mnk > fmul(mxk, 8.0))) else "min_out"
    else:
        if z <= 63.75:
            target = "min_nearest"
        elif z >= 192.25:
            target = "max_nearest"
        else:
            adj = fmul(fmul(fsub(z, zirnd), dif), f32(1.0 / 255.0))
            return fadd(mn, adj), fadd(mx, adj), 3
    if target == "max_nearest":
        zi = zirnd
        target = "max_out"
    if target == "max_out":
        return mn, fsub(mn, fdiv(fmul(255.0, mn), zi)), 2
    if target == "min_out":
        zirnd = fadd(zi, 1.0)
    return fdiv(fmul(mx, zirnd), fsub(zirnd, 255.0)), mx, 1


def round_up_quarter_octave(x: float) -> float:
    """op_dwise_snode_8bit.c ``round_up_quarter_octave``: a power of 2^(1/4) y with 1.189 < y/x <= 1.414."""
    xk = fmul(x, f32(1.18920708))
    mant = abs(flt_getfrac(xk))
    if mant >= f32(0.7071067691):
        mant = 1.0 if mant >= f32(0.8408964276) else f32(0.8408964276)
    else:
        mant = f32(0.7071067691) if mant >= f32(0.594603539) else f32(0.594603539)
    return math.copysign(flt_ldexp(mant, flt_getexp(xk)), x)


# ----------------------------------------------------------------------------------------------
# Padding (nn_graph_padding.h)
# ----------------------------------------------------------------------------------------------

def pad_outsize_before_after(in_size: int, filt: int, stride: int, padding: Padding) -> tuple[int, int, int]:
    """``nn_pad_compute_outsize_padding`` -> (out_size, pad_before, pad_after); out_size 0 = impossible.

    VALID: ``(in - filt)/stride + 1`` (0 if filt > in). SAME/SAME_CAFFE: ``ceil(in/stride)``;
    NA: ``in/stride``. Total padding ``(out-1)*stride - (in-filt)`` when > 0; before = total/2
    (SAME, NA) or (total+1)/2 (SAME_CAFFE).
    """
    delt = in_size - filt
    if padding == Padding.VALID:
        return (delt // stride + 1 if delt >= 0 else 0), 0, 0
    if padding not in (Padding.NA, Padding.SAME, Padding.SAME_CAFFE):
        return 0, 0, 0
    n = in_size + (stride - 1 if padding != Padding.NA else 0)
    if n < stride:
        return 0, 0, 0
    out = n // stride
    pad_n = (out - 1) * stride - delt
    if pad_n <= 0:
        return out, 0, 0
    before = (pad_n + (1 if padding == Padding.SAME_CAFFE else 0)) >> 1
    return out, before, pad_n - before


def as_padding(padding) -> Padding:
    if isinstance(padding, Padding):
        return padding
    if isinstance(padding, str) and padding.upper() in Padding.__members__:
        return Padding[padding.upper()]
    if isinstance(padding, (int, np.integer)) and int(padding) in {p.value for p in Padding}:
        return Padding(int(padding))
    raise MaceqError(f"nnlib: unknown padding {padding!r} (SAME, VALID, SAME_CAFFE, NA or explicit pads)")


def _geometry(in_hw, k_hw, strides, padding: Padding, *, op: str) -> tuple[int, int, int, int]:
    """(out_h, out_w, before_h, before_w); raises for NA and impossible sizes."""
    if padding == Padding.NA:
        raise MaceqError(f"nnlib {op}: padding NA is rejected ('This op might pad')")
    oh, bh, _ = pad_outsize_before_after(in_hw[0], k_hw[0], strides[0], padding)
    ow, bw, _ = pad_outsize_before_after(in_hw[1], k_hw[1], strides[1], padding)
    if oh < 1 or ow < 1:
        raise MaceqError(f"nnlib {op}: window {tuple(k_hw)} does not fit input {tuple(in_hw)} with {padding.name}")
    return oh, ow, bh, bw


# ----------------------------------------------------------------------------------------------
# Supernode_8x8p32to8 (op_supernode.c, supernode_execute_ref)
# ----------------------------------------------------------------------------------------------

def supernode_ref(x, w, bias, *, x_min, x_max, w_min, w_max, bias_min, bias_max, out_min, out_max,
                  strides, padding, ref_pad_quirk: bool = False):
    """Scalar transcription of ``supernode_execute_ref`` for Supernode_8x8p32to8 -> (y, y_min, y_max).

    x: uint8 [N,H,W,C]; w: uint8 [KH,KW,C,O] (nnlib HWDB); bias: int32 [O] whose range is
    ``[bias_min, bias_max]`` over 2^32 levels (MACE's ``quantize_bias_for_hexagon``).
    ``out_min = -inf`` / ``out_max = +inf`` mean "not given" (supernode_check_ref starts at
    max 1/128, min -max and grows them by retrying). ``ref_pad_quirk=True`` reproduces the
    reference's literal ``nn_pad_compute_before(out_width, ...)`` (padding computed from the
    output size); the default uses the input size, as nnlib's other ops and the TF rule do.
    """
    x = np.asarray(x)
    w = np.asarray(w)
    n, h, wd, c = x.shape
    kh, kw, kc, o = w.shape
    if kc != c:
        raise MaceqError(f"nnlib Supernode: filter depth {kc} != input depth {c}")
    sh, sw = strides
    padding = as_padding(padding)
    oh, ow, adj_y, adj_x = _geometry((h, wd), (kh, kw), (sh, sw), padding, op="Supernode")
    if ref_pad_quirk:
        adj_y = pad_outsize_before_after(oh, kh, sh, padding)[1]
        adj_x = pad_outsize_before_after(ow, kw, sw, padding)[1]

    input_offset, filt_offset, out_level, bias_mpy = supernode_ref_params(x_min, x_max, w_min, w_max,
                                                                          bias_min, bias_max)
    biasbuf = [fast_roundf(fmul(i2f(int(bias[i])), bias_mpy)) for i in range(o)]

    tmp = supernode_ref_sums(x, w, input_offset, filt_offset, (sh, sw), (adj_y, adj_x), (oh, ow))
    maxsum = max([0] + [int(v) for v in tmp.ravel()])
    minsum = min([0] + [int(v) for v in tmp.ravel()])
    final_min, final_max = supernode_ref_range(maxsum, minsum, out_level, out_min, out_max)
    minval_offset, recip = supernode_ref_requant_params(final_min, final_max, out_level)
    y = np.zeros((n, oh, ow, o), dtype=np.uint8)
    for b in range(n):
        for oy in range(oh):
            for ox in range(ow):
                for oz in range(o):
                    # sum = biasbuf[i] + tmp_out[..] + minval_offset: int add, then float add, (int)
                    s = c_trunc_i32(fadd(i2f(wrap32(biasbuf[oz] + int(tmp[b, oy, ox, oz]))), minval_offset))
                    # out_i = (sum * fixed_recip_level_size + (1<<15)) in uint32, stored to int32, >> 16
                    out_i = wrap32(((s & 0xFFFFFFFF) * recip + (1 << 15)) & 0xFFFFFFFF) >> 16
                    y[b, oy, ox, oz] = saturate_u8(out_i)
    return y, final_min, final_max


def supernode_ref_sums(x, w, input_offset: int, filt_offset: int, strides, before, out_hw) -> np.ndarray:
    """BEGIN CONV2D of supernode_execute_ref: int32 sums ``(x - in_off)*(w - filt_off)`` (no bias);
    taps outside the input are skipped. -> int64 [N, OH, OW, O]."""
    n, h, wd, c = x.shape
    kh, kw, _, o = w.shape
    tmp = np.zeros((n, *out_hw, o), dtype=np.int64)
    for b, oy, ox, oz in np.ndindex(*tmp.shape):
        s = 0
        for fy in range(kh):
            iy = oy * strides[0] - before[0] + fy
            for fx in range(kw):
                ix = ox * strides[1] - before[1] + fx
                if not (0 <= iy < h and 0 <= ix < wd):
                    continue
                for fz in range(c):
                    s = wrap32(s + (int(x[b, iy, ix, fz]) - input_offset) * (int(w[fy, fx, fz, oz]) - filt_offset))
        tmp[b, oy, ox, oz] = s
    return tmp


def supernode_ref_params(x_min, x_max, w_min, w_max, bias_min, bias_max) -> tuple[int, int, float, float]:
    """supernode_execute_ref's scalars -> (input_offset, filt_offset, out_level_size, bias_mpy_amt).

    ``level = (max - min)/255`` (a plain division here, not flt_div_255), bias level
    ``(bias_max - bias_min)/2^32`` (Supernode_8x8p32to8), ``out_level = in_level*filt_level``,
    ``bias_mpy = bias_level/out_level``; offsets by ``quantize_uint8(0, min, max)``.
    """
    in_level = fdiv(fsub(f32(x_max), f32(x_min)), 255.0)
    filt_level = fdiv(fsub(f32(w_max), f32(w_min)), 255.0)
    bias_level = fdiv(fsub(f32(bias_max), f32(bias_min)), 4294967296.0)  # bias_divisor 0x1.0p32
    out_level = fmul(in_level, filt_level)
    return (quantize_uint8(0.0, f32(x_min), f32(x_max)), quantize_uint8(0.0, f32(w_min), f32(w_max)),
            out_level, fdiv(bias_level, out_level))



def _ref_open_range(out_min, out_max) -> tuple[float, float, bool, bool]:
    """supernode_check_ref's start: (min, max, min given, max given); an open max starts at 1/128 and
    an open min at -max."""
    maxval, minval = f32(out_max), f32(out_min)
    max_pre = min_pre = True
    if maxval == INF:
        max_pre, maxval = False, 1.0 / 128.0
    if minval == -INF:
        min_pre, minval = False, -maxval
    return minval, maxval, min_pre, max_pre

def supernode_ref_range(maxsum: int, minsum: int, out_level: float, out_min: float,
                        out_max: float) -> tuple[float, float]:
    """supernode_check_ref + the retry recursion of supernode_execute_ref -> (final_min, final_max).

    The recursion re-runs the whole node; only the range carries over and the raw sums do
    not depend on it, so the loop below keeps the range state alone. Not given (+-inf):
    ``maxval = 1/128``, ``minval = -maxval``. After a pass with ``minval_offset = -min/out_level``:
    if max is free and ``f32(maxsum+offset)*out_level > max-min``, double max until it fits;
    else if min is free and ``f32(minsum+offset)*out_level < 0``, double min (re-offsetting).
    """
    minval, maxval, min_pre, max_pre = _ref_open_range(out_min, out_max)
    while True:
        final_max, final_min = maxval, minval
        minval_offset = fdiv(-final_min, out_level)
        msum = c_trunc_i32(fadd(i2f(maxsum), minval_offset))  # maxsum += minval_offset
        nsum = c_trunc_i32(fadd(i2f(minsum), minval_offset))
        if not max_pre and fmul(i2f(msum), out_level) > fsub(final_max, final_min):
            while fsub(maxval, minval) < fmul(i2f(msum), out_level):
                maxval = fmul(maxval, 2.0)
            continue
        if not min_pre and fmul(i2f(nsum), out_level) < 0.0:
            while fmul(i2f(nsum), out_level) < 0.0:
                minval = fmul(minval, 2.0)
                nsum = c_trunc_i32(fsub(i2f(nsum), minval_offset))
                minval_offset = fdiv(-minval, out_level)
                nsum = c_trunc_i32(fadd(i2f(nsum), minval_offset))
            continue
        return final_min, final_max


def supernode_ref_requant_params(final_min: float, final_max: float, out_level: float) -> tuple[float, int]:
    """(minval_offset, fixed_recip_level_size) of supernode_execute_ref (USE_16BITS_RECIP).

    ``minval_offset = -min/out_level``; ``maxrange = (int)((max-min)/out_level + 0.5f)``;
    ``recip = 0x00ff0000 / maxrange`` (C int division).
    """
    minval_offset = fdiv(-final_min, out_level)
    maxrange = c_trunc_i32(fadd(fdiv(fsub(final_max, final_min), out_level), 0.5))
    if maxrange <= 0:
        raise MaceqError(f"nnlib Supernode: output range [{final_min}, {final_max}] gives maxrange {maxrange}")
    return minval_offset, 0x00FF0000 // maxrange


def supernode_flat_range(maxsum: int, out_level: float, bias_max: float, out_min, out_max) -> tuple[float, float]:
    """supernode_execute_hvx's output range (op_supernode.c) -> (min, max).

    Start as supernode_check_ref (open max 1/128, open min -max). A pass with ``bias_adder =
    ceil((bias_max - min)/out_level)`` re-runs when max is free and ``f32((maxsum + bias_adder) *
    out_level) > max - min``: max doubles until it covers that (an open min follows as -max).
    ``maxsum``: the largest conv sum without bias, from 0. The min is never checked.
    """
    minval, maxval, min_pre, max_pre = _ref_open_range(out_min, out_max)
    while True:
        bias_adder = c_trunc_i32(math.ceil(fdiv(fsub(f32(bias_max), minval), out_level)))
        need = fmul(i2f(wrap32(maxsum + bias_adder)), out_level)
        if max_pre or not need > fsub(maxval, minval):
            return minval, maxval
        while fsub(maxval, minval) < need:
            maxval = fmul(maxval, 2.0)
            if not min_pre:
                minval = -maxval


def supernode_flat_biasbuf_recip(bias, bias_mpy: float, out_min: float, out_max: float,
                                 out_level: float) -> tuple[list[int], int]:
    """supernode_execute_hvx: ``biasbuf = (int)f32(f32(b*mpy + (-min/out_level)) + 0.5f)`` and
    ``recip = 0x00ff0000 / round((max-min)/out_level)`` (libm round of the float quotient)."""
    minval_offset = fdiv(-out_min, out_level)
    biasbuf = [c_trunc_i32(fadd(fadd(fmul(i2f(int(b)), bias_mpy), minval_offset), 0.5)) for b in bias]
    maxsum = c_trunc_i32(c_roundf(fdiv(fsub(out_max, out_min), out_level)))
    if maxsum <= 0:
        raise MaceqError(f"nnlib Supernode: output range [{out_min}, {out_max}] gives maxsum {maxsum}")
    return biasbuf, 0x00FF0000 // maxsum


def supernode_flat_ref(x, w, bias, *, x_min, x_max, w_min, w_max, bias_min, bias_max, out_min, out_max,
                       strides, padding):
    """The flat Supernode_8x8p32to8 (op_supernode.c ``supernode_execute_hvx``) -> (y, y_min, y_max).

    What stays flat after prepare (input depth <= 4 with an odd stride width > 1). Output height
    <= 3: ``supernode_execute_ref`` (``supernode_ref(ref_pad_quirk=True)``), after the batch check
    below. Else the im2col / HVX
    GEMM path: same sums and pad quirk as the reference; ``y = sat_u8((int32)((uint32)(sum +
    biasbuf)*recip + 0x8000) >> 16)`` with ``supernode_flat_biasbuf_recip`` and the range of
    ``supernode_flat_range``. Batch > 1 with ``KH*KW*C`` not a multiple of 16 (or SAME_CAFFE)
    fails ("Batch size > 1 not supported with odd in depth").
    """
    x = np.asarray(x)
    w = np.asarray(w)
    n, h, wd, c = x.shape
    kh, kw, _, o = w.shape
    padding = as_padding(padding)
    args = dict(x_min=x_min, x_max=x_max, w_min=w_min, w_max=w_max, bias_min=bias_min, bias_max=bias_max,
                out_min=out_min, out_max=out_max, strides=strides, padding=padding)
    oh, ow, _, _ = _geometry((h, wd), (kh, kw), strides, padding, op="Supernode")
    if n > 1 and ((kh * kw * c) % 16 or padding == Padding.SAME_CAFFE):
        raise MaceqError("nnlib Supernode_8x8p32to8: batch > 1 with filter size not a multiple of 16 "
                         "('Batch size > 1 not supported with odd in depth for now')")
    if oh <= 3:
        return supernode_ref(x, w, bias, ref_pad_quirk=True, **args)
    before = (pad_outsize_before_after(oh, kh, strides[0], padding)[1],
              pad_outsize_before_after(ow, kw, strides[1], padding)[1])
    in_off, filt_off, out_level, bias_mpy = supernode_ref_params(x_min, x_max, w_min, w_max, bias_min, bias_max)
    tmp = supernode_ref_sums(x, w, in_off, filt_off, strides, before, (oh, ow))
    final_min, final_max = supernode_flat_range(max([0] + [int(v) for v in tmp.ravel()]), out_level,
                                                bias_max, out_min, out_max)
    biasbuf, recip = supernode_flat_biasbuf_recip(bias, bias_mpy, final_min, final_max, out_level)
    y = np.zeros(tmp.shape, dtype=np.uint8)
    for idx in np.ndindex(*tmp.shape):
        s = wrap32(int(tmp[idx]) + biasbuf[idx[3]])
        y[idx] = saturate_u8(wrap32(((s & 0xFFFFFFFF) * recip + (1 << 15)) & 0xFFFFFFFF) >> 16)
    return y, final_min, final_max


# ----------------------------------------------------------------------------------------------
# d32 conv nodes: Supernode_8x8p32to8_d32, InputSupernode_8x8p32to8_outd32,
# DepthwiseSupernode_8x8p32to8_d32 (op_supernode_new.c, op_dwise_snode_8bit.c, supernode_utils.h)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class D32Node:
    """What differs between the d32 conv nodes in the range / retry machinery they share.

    ``min_default`` / ``max_default``: where ``setup_initial_output_range`` starts an open end
    (supernode_check: 0.0, 0.5; shortin_supernode_check: -1/128, 1/128; dwise_supernode_check:
    -0.125, 0.125). ``passes``: executions before giving up (supernode_execute_hvx recurses
    while ``recursion_depth < 3``; shortin_supernode_execute_call loops while ``count < 3``;
    dwise_supernode_execute fails at ``++loopcount > 4``). ``keep_last_pass``: when the last
    pass still asks for a retry, supernode_execute_hvx only logs ("Extreme recursion") and
    returns that pass's outputs with the range the retry check has already moved; the
    other two fail.
    """

    name: str
    min_default: float
    max_default: float
    passes: int
    keep_last_pass: bool


SUPERNODE_D32 = D32Node("Supernode_8x8p32to8_d32", 0.0, 0.5, 3, True)
INPUT_SUPERNODE = D32Node("InputSupernode_8x8p32to8_outd32", -1.0 / 128, 1.0 / 128, 3, False)
DEPTHWISE_D32 = D32Node("DepthwiseSupernode_8x8p32to8_d32", -0.125, 0.125, 5, False)


def supernode_node(in_depth: int, stride_w: int) -> D32Node | None:
    """The node prepare.c makes of Supernode_8x8p32to8; None: the flat op stays.

    ``depth32_replacement_op``: InputSupernode for filter depth <= 4 and stride width <= 4,
    else Supernode_8x8p32to8_d32; ``do_convert_to_short_conv`` leaves the flat node in place
    for odd stride widths > 1 ("Odd strides greater than 1 are unsupported for now").
    """
    if in_depth <= 4 and stride_w <= 4:
        return None if stride_w > 1 and stride_w % 2 == 1 else INPUT_SUPERNODE
    return SUPERNODE_D32


@dataclass
class D32RangeState:
    """The ``supernode_info_new`` fields that carry the output range between retries."""

    out_min: float
    out_max: float
    spec_min: float
    spec_max: float
    flags: int  # bit 0: min given, bit 1: max given
    firstguess: bool


def setup_initial_output_range(spec_min: float, spec_max: float, node: D32Node) -> D32RangeState:
    """supernode_utils.h ``setup_initial_output_range``: open ends start at the node's defaults.

    The C rejects ``min > 0``, ``max < 0`` and ``min >= max`` ("supernode: invalid input
    min/max"): supernode_check and shortin_supernode_check then fail at prepare;
    dwise_supernode_check ignores the error and runs from a zeroed range state (not modelled:
    raised here too). Then, unless min is 0, ``adjust_minmax_for_zero_with_constraints``.
    """
    spec_min, spec_max = f32(spec_min), f32(spec_max)
    if spec_min > 0.0 or spec_max < 0.0 or spec_min >= spec_max:
        raise MaceqError(f"nnlib {node.name}: invalid output range [{spec_min}, {spec_max}] "
                         "('supernode: invalid input min/max')")
    mnp = spec_min != -INF
    mxp = spec_max != INF
    st = D32RangeState(spec_min if mnp else f32(node.min_default), spec_max if mxp else f32(node.max_default),
                       spec_min, spec_max, 2 * int(mxp) + int(mnp), not (mnp and mxp))
    if st.out_min < 0.0:
        st.out_min, st.out_max, _ = adjust_minmax_for_zero_with_constraints(st.out_min, st.out_max, st.flags)
    return st


@dataclass(frozen=True)
class D32Scaling:
    """``fill_info_minmax_basics`` results used by the kernel."""

    in_offset: int
    prod_level_size: float
    output_level_size: float
    recip_val: int
    recip_shamt: int


def fill_info_minmax_basics(st: D32RangeState, in_min: float, in_max: float, weights_level_size: float,
                            max_k: float = 1.0) -> D32Scaling:
    """``fill_info_minmax_basics`` (may move a first-guess output range; mutates ``st``).

    ``in_max = fmaxf(in_max, in_min + 1e-18f)``; ``final_scaling = max_k*prod/out_level`` with
    ``prod = in_level*filt_level``; on a first guess above 1.75 the range is re-centred;
    ``recip_shamt = 0`` if scaling <= 1 else its frexp exponent; ``recip_val =
    roundf_u32(scaling * 2^(31-shamt))`` capped at 0x7FFFFFFF. ``recip_shamt_must_be_zero`` is
    0 in all three nodes (shortin's ``= 1`` is commented out), ``max_k`` 1 (no ChannelScale).
    """
    in_min = f32(in_min)
    in_max = fmaxf(f32(in_max), fadd(in_min, f32(1e-18)))
    if not (math.isfinite(in_min) and math.isfinite(in_max)):
        raise MaceqError("nnlib supernode: input range not finite")
    in_offset, in_level = get_qu8_level_size_zero(in_min, in_max)
    prod = fmul(in_level, weights_level_size)
    _, out_level = get_qu8_level_size_zero(st.out_min, st.out_max)
    final_scaling = fdiv(fmul(max_k, prod), out_level)
    if st.firstguess:
        max_scale = 1.75
        if final_scaling > max_scale:
            out_level = fdiv(fmul(max_k, prod), max_scale)
            need_adjust = False
            if st.flags == 1:
                st.out_max = fadd(st.out_min, fmul(255.0, out_level))
                need_adjust = st.out_min < 0.0
            elif st.flags == 2:
                st.out_min = fsub(st.out_max, fmul(255.0, out_level))
                need_adjust = True
            else:
                st.out_min = fmul(-63.0, out_level)
                st.out_max = fmul(192.0, out_level)
            final_scaling = max_scale
            if need_adjust:
                st.out_min, st.out_max, _ = adjust_minmax_for_zero_with_constraints(st.out_min, st.out_max, st.flags)
                out_level = flt_div_255(fsub(st.out_max, st.out_min))
                final_scaling = fdiv(fmul(max_k, prod), out_level)
        st.firstguess = False
    recip_shamt = 0 if final_scaling <= 1.0 else flt_getexp(final_scaling)
    recip_val = min(roundf_u32(flt_ldexp(final_scaling, 31 - recip_shamt)), 0x7FFFFFFF)
    return D32Scaling(in_offset, prod, out_level, recip_val, recip_shamt)


def fast_i64_roundf(x: float) -> int:
    """nn_asm_ops.h ``fast_i64_roundf`` on Hexagon: ``Q6_P_convert_sf2d_R`` (nearest-even, saturating)."""
    if math.isnan(x):
        raise MaceqError("nnlib: float-to-int conversion of NaN")
    return sat(round(x), -(1 << 63), (1 << 63) - 1) if math.isfinite(x) else (
        (1 << 63) - 1 if x > 0 else -(1 << 63))


def fill_bias_buf(bias, bias_min: float, bias_max: float, sc: D32Scaling, out_min: float, gemsumb) -> list[int]:
    """supernode_utils.h ``fill_bias_buf`` (bias32, extra 0), one word per ``out_depth_valid`` channel.

    ``minout = f32(f32(b*ratio) + (-out_min/prod))`` (``b = 0`` past the bias tensor), then
    ``fast_i64_roundf(minout - (float)(int32)(gemsumb*in_offset))``: the subtraction is a
    binary32 operation, so the word can be one off the exact ``round(minout) - gemsumb*in_offset``
    when the product is large or the difference lands near .5. ``gemsumb`` is the node's own
    (``supernode_d32_gemsumb``, ``shortin_gemsumb``, ``dwise_gemsumb``). Raises where the C
    fails ("Final too big, will cause overflow").
    """
    bias_level = fdiv(fsub(f32(bias_max), f32(bias_min)), 4294967296.0)
    ratio = fdiv(bias_level, sc.prod_level_size)
    min_out_prod_offset = fdiv(-out_min, sc.prod_level_size)
    out = []
    for i, g in enumerate(gemsumb):
        biasval = int(bias[i]) if i < len(bias) else 0
        minout = fadd(fmul(i2f(biasval), ratio), min_out_prod_offset)
        final = fast_i64_roundf(fsub(minout, i2f(wrap32(g * sc.in_offset))))
        if not INT32_MIN <= final <= INT32_MAX:
            raise MaceqError("nnlib supernode: bias word out of int32 range ('Final too big, will cause overflow')")
        out.append(final)
    return out


def d32_requant(s: int, recip_val: int, recip_shamt: int) -> tuple[int, int]:
    """dwconv2dbbb_c.c: ``s <<= shamt; l = (s*recip + 0x40000000) >> 31`` -> (clamped u8, (int)l)."""
    s = wrap32(s << recip_shamt)
    lsum = (s * recip_val + 0x40000000) >> 31
    return sat(lsum, 0, 255), wrap32(lsum)


def d32_check_for_retry(st: D32RangeState, sc: D32Scaling, minval: int, maxval: int) -> bool:
    """``supernode_execute_workitem_check_for_retry`` (output units); mutates ``st``; True = retry.

    shortin_supernode_execute_everything has the same check inline.
    """
    if st.flags == 3:
        return False
    recalc = False
    if (st.flags & 2) == 0 and maxval > 255:
        extreme = fadd(fmul(sc.output_level_size, fadd(i2f(maxval), 0.5)), st.out_min)
        st.out_max = round_up_quarter_octave(fmaxf(extreme, 2.0 ** -4))
        recalc = True
    if (st.flags & 1) == 0 and minval < 0:
        extreme = fadd(fmul(sc.output_level_size, fsub(i2f(minval), 0.5)), st.out_min)
        st.out_min = round_up_quarter_octave(fminf(extreme, -(2.0 ** -8)))
        recalc = True
    if recalc:
        if st.flags & 1:
            st.out_min = st.spec_min
        if st.flags & 2:
            st.out_max = st.spec_max
        st.out_min, st.out_max, _ = adjust_minmax_for_zero_with_constraints(st.out_min, st.out_max, st.flags)
    return recalc


def d32_execute(*, node: D32Node, out_min, out_max, x_min, x_max, weights_level: float, bias, bias_min, bias_max,
                gemsumb, kernel, fill=None):
    """The d32 execute loop: (fill_info_minmax_basics, fill_bias_buf, execute, check for retry).

    ``kernel(sc, biasbuf) -> (y, vmin, vmax)`` computes the outputs and the min / max of the
    unclamped requantized values over everything the HVX kernel computes (real outputs and
    the discarded ones). ``node`` sets the open-range start and the pass limit. ``fill``: a
    function equal to :func:`fill_bias_buf` (the default), e.g. its vectorised form.
    """
    fill = fill or fill_bias_buf
    st = setup_initial_output_range(out_min, out_max, node)
    for _ in range(node.passes):
        sc = fill_info_minmax_basics(st, x_min, x_max, weights_level)
        biasbuf = fill(bias, bias_min, bias_max, sc, st.out_min, gemsumb)
        y, vmin, vmax = kernel(sc, biasbuf)
        if not d32_check_for_retry(st, sc, vmin, vmax):
            return y, st.out_min, st.out_max
    if node.keep_last_pass:
        return y, st.out_min, st.out_max
    raise MaceqError(f"nnlib {node.name}: can't find an output range in {node.passes} passes")


def _d32_scalar_kernel(shape, acc, extra=()):
    """A ``d32_execute`` kernel from ``acc(b, y, x, channel, bias, in_offset) -> int32 sum``.

    ``y[idx] = acc(*idx)`` requantized over ``shape``; the min / max (from
    supernode_execute_strategy's 1<<24 / -(1<<24)) also covers ``extra``: (b, y, x, channel)
    outputs the kernel computes and then discards (columns outside the output, padded channels).
    """

    def kernel(sc: D32Scaling, biasbuf):
        y = np.zeros(shape, dtype=np.uint8)
        vmin, vmax = 1 << 24, -(1 << 24)
        for idx in np.ndindex(*shape):
            q, raw = d32_requant(acc(*idx, biasbuf[idx[3]], sc.in_offset), sc.recip_val, sc.recip_shamt)
            vmin, vmax = min(vmin, raw), max(vmax, raw)
            y[idx] = q
        for idx in extra:
            _, raw = d32_requant(acc(*idx, biasbuf[idx[3]], sc.in_offset), sc.recip_val, sc.recip_shamt)
            vmin, vmax = min(vmin, raw), max(vmax, raw)
        return y, vmin, vmax

    return kernel


def _round32(n: int) -> int:
    return (n + 31) & ~31


def _padded_gemsumb(w, filt_offset: int, dpad: int) -> list[int]:
    """Per filter, the sum of its bytes with depth padded to ``dpad`` and the filters to a multiple
    of 32, all padding ``filt_offset``."""
    kh, kw, c, o = w.shape
    out = []
    for oz in range(_round32(o)):
        s = kh * kw * (dpad - c) * filt_offset if oz < o else kh * kw * dpad * filt_offset
        if oz < o:
            for v in w[:, :, :, oz].ravel():
                s += int(v)
        out.append(s)
    return out


def supernode_d32_gemsumb(w, filt_offset: int) -> list[int]:
    """repack_filter_for_d32 (supernode_procweights.c, v60 unsigned weights): per filter, the
    sum of its repacked bytes: depth padded to a multiple of 32 and filters to a multiple of 32,
    all padding ``filt_offset``."""
    return _padded_gemsumb(w, filt_offset, _round32(w.shape[2]))


def shortin_gemsumb(w, filt_offset: int) -> list[int]:
    """shortin_rearrange_weights_Ndto4 + shortin_filt_sumb: depth padded to 4 and filters to a
    multiple of 32 with ``filt_offset``; the plain byte sum per filter."""
    return _padded_gemsumb(w, filt_offset, (w.shape[2] + 3) & ~3)


def dwise_gemsumb(w, filt_offset: int) -> list[int]:
    """``dwise_sumb``: per channel ``sum(w over the 4-padded taps, pads 0) - KH*KW*filt_offset``,
    over the channels padded to 32 (``dwise_rearrange_weights`` fills them with filt_offset: 0)."""
    kh, kw, c, _ = w.shape
    kw4 = (kw + 3) & ~3
    out = []
    for ch in range(_round32(c)):
        s = -filt_offset * kh * kw
        for fy in range(kh):
            for fx in range(kw4):
                s += (int(w[fy, fx, ch, 0]) if ch < c else filt_offset) if fx < kw else 0
        out.append(s)
    return out


D32_LEFT_PAD = 4  # Convert_to_d32's and Supernode_8x8p32to8_d32's output left padding (columns)


def d32_input_read(x, in_offset: int, b: int, row: int, col: int, ch: int) -> int:
    """One byte of a d32 tensor as a depthwise kernel reads it: layout of nnlib's Convert_to_d32.

    Per row, depth slices of 32 lanes, each ``4 + W + ((-W) & 3)`` columns (``col`` counts
    from the first left-padding column). A read past a slice's last column continues in the
    next slice, past the last slice in the next row's first slice. Padding rows and columns hold
    ``in_offset`` (the node zaps what it reads); depth-padding lanes hold what hvx_to_d32_core
    copies there: the flat bytes following the pixel's channels (``in_offset`` past the end).
    """
    n, h, w, c = x.shape
    wt = D32_LEFT_PAD + w + ((-w) & 3)
    nd32 = (c + 31) // 32
    d, z = divmod(ch, 32)
    while col >= wt:
        col -= wt
        d += 1
        if d == nd32:
            d, row = 0, row + 1
    ix = col - D32_LEFT_PAD
    if not (0 <= row < h and 0 <= ix < w):
        return in_offset
    ch = 32 * d + z
    if ch < c:
        return int(x[b, row, ix, ch])
    p = ((b * h + row) * w + ix) * c + ch
    return int(x.reshape(-1)[p]) if p < x.size else in_offset


def dwise_computed_cols(kernel, stride_w: int, out_w: int, before_w: int) -> range:
    """Output columns the depthwise HVX kernel computes (all folded into its min / max).

    The 3x3 kernels (dwconv2dbbb_s1_3x3_asm / _s2_3x3_asm, ``opt_3x3``) run over the whole
    padded output row, from ``out_left_pad = (in_left_pad - pad_before)/stride`` columns left of
    column 0 to the width rounded to 4. The MxN kernels compute ``out_width`` rounded to 4 but
    repeat a group's first sum in its extra lanes (the ``cnt`` logic of their C models), so
    only real columns reach the min / max.
    """
    if tuple(kernel) != (3, 3):
        return range(0, out_w)
    olp = (D32_LEFT_PAD - before_w) // stride_w
    return range(-olp, out_w + ((-(out_w + olp)) & 3))


def depthwise_supernode_ref(x, w, bias, *, x_min, x_max, w_min, w_max, bias_min, bias_max, out_min, out_max,
                            strides, padding):
    """DepthwiseSupernode_8x8p32to8_d32 (d32 op; the flat one is rejected) -> (y, y_min, y_max).

    x: uint8 [N,H,W,C]; w: uint8 [KH,KW,C,1]. Transcribes dwise_supernode_check (weights
    padded to 4 taps with 0 and to 32 channels with filt_offset, ``dwise_gemsumb``), the
    recalculate / execute / retry loop (``d32_execute``) and the kernels' C models (in
    dwconv2dbbb_*_h.S): ``sum = bias + sum(in*w) - sum(in*filt_offset)`` over the input as the
    kernel reads it (``d32_input_read``), at every computed column (``dwise_computed_cols``)
    and padded channel, then ``d32_requant``.
    """
    x = np.asarray(x)
    w = np.asarray(w)
    n, h, wd, c = x.shape
    kh, kw, kc, m = w.shape
    ok, why = dwise_supported(kernel=(kh, kw), strides=strides, depth_multiplier=m, channels=kc, in_channels=c)
    if not ok:
        raise MaceqError(f"nnlib DepthwiseSupernode: {why}")
    sh, sw = strides
    padding = as_padding(padding)
    oh, ow, bh, bw = _geometry((h, wd), (kh, kw), (sh, sw), padding, op="DepthwiseSupernode")
    filt_offset = quantize_uint8(0.0, f32(w_min), f32(w_max))

    def acc(b: int, oy: int, ox: int, ch: int, s: int, in_offset: int) -> int:
        zum = 0
        for fy in range(kh):
            for fx in range(kw):
                v = d32_input_read(x, in_offset, b, oy * sh - bh + fy, D32_LEFT_PAD - bw + ox * sw + fx, ch)
                s = wrap32(s + v * (int(w[fy, fx, ch, 0]) if ch < c else filt_offset))
                zum = wrap32(zum + v * filt_offset)
        return wrap32(s - zum)

    cols = dwise_computed_cols((kh, kw), sw, ow, bw)
    extra = [(b, oy, ox, ch) for b in range(n) for oy in range(oh) for ox in cols for ch in range(c)
             if not 0 <= ox < ow]
    extra += [(0, 0, 0, ch) for ch in range(c, _round32(c))]
    return d32_execute(node=DEPTHWISE_D32, out_min=out_min, out_max=out_max, x_min=x_min, x_max=x_max,
                       weights_level=fdiv(fsub(f32(w_max), f32(w_min)), fmul(255.0, 1.0)),
                       bias=bias, bias_min=bias_min, bias_max=bias_max, gemsumb=dwise_gemsumb(w, filt_offset),
                       kernel=_d32_scalar_kernel((n, oh, ow, c), acc, extra))


def supernode_d32_ref(x, w, bias, *, x_min, x_max, w_min, w_max, bias_min, bias_max, out_min, out_max,
                      strides, padding):
    """Supernode_8x8p32to8 as nnlib runs it after prepare (``supernode_node``) -> (y, y_min, y_max).

    Supernode_8x8p32to8_d32 and InputSupernode_8x8p32to8_outd32: weights repacked with depth
    padded to 32 (InputSupernode: 4) and filters to 32, padding ``filt_offset`` (from
    ``get_qu8_level_size_zero``, as is the weights' level size), their byte sums as gemsumb;
    the v60 conv computes ``bias + sum(in*w) - (filt_offset*sum(in) - K*filt_offset*in_offset)``
    (gvconv2dbbb_v60_asm with gvsuma_asm, K counting the padded depth); InputSupernode's
    kernels also compute the columns up to the width rounded to 4. The flat op that stays for
    small depths with odd strides > 1 is ``supernode_flat_ref``.
    """
    x = np.asarray(x)
    w = np.asarray(w)
    n, h, wd, c = x.shape
    kh, kw, kc, o = w.shape
    if kc != c:
        raise MaceqError(f"nnlib Supernode: filter depth {kc} != input depth {c}")
    node = supernode_node(c, strides[1])
    if node is None:
        return supernode_flat_ref(x, w, bias, x_min=x_min, x_max=x_max, w_min=w_min, w_max=w_max, bias_min=bias_min,
                                  bias_max=bias_max, out_min=out_min, out_max=out_max, strides=strides, padding=padding)
    sh, sw = strides
    oh, ow, bh, bw = _geometry((h, wd), (kh, kw), (sh, sw), as_padding(padding), op="Supernode")
    filt_offset, filt_level = get_qu8_level_size_zero(f32(w_min), f32(w_max))
    dpad = (c + 3) & ~3 if node is INPUT_SUPERNODE else _round32(c)

    def acc(b: int, oy: int, ox: int, oz: int, s: int, in_offset: int) -> int:
        zum = 0
        for fy in range(kh):
            iy = oy * sh - bh + fy
            for fx in range(kw):
                ix = ox * sw - bw + fx
                inside = 0 <= iy < h and 0 <= ix < wd
                for fz in range(dpad):
                    v = int(x[b, iy, ix, fz]) if inside and fz < c else in_offset
                    s = wrap32(s + v * (int(w[fy, fx, fz, oz]) if fz < c and oz < o else filt_offset))
                    zum = wrap32(zum + v)
        return wrap32(s - wrap32(filt_offset * zum - kh * kw * dpad * filt_offset * in_offset))

    extra = [(0, 0, 0, oz) for oz in range(o, _round32(o))]
    if node is INPUT_SUPERNODE:
        extra += [(b, oy, ox, oz) for b in range(n) for oy in range(oh) for ox in range(ow, (ow + 3) & ~3)
                  for oz in range(o)]
    gemsumb = (shortin_gemsumb if node is INPUT_SUPERNODE else supernode_d32_gemsumb)(w, filt_offset)
    return d32_execute(node=node, out_min=out_min, out_max=out_max, x_min=x_min, x_max=x_max,
                       weights_level=filt_level, bias=bias, bias_min=bias_min, bias_max=bias_max, gemsumb=gemsumb,
                       kernel=_d32_scalar_kernel((n, oh, ow, o), acc, extra))


supernode_d32_model_ref = supernode_d32_ref  # the name before the d32 conv was transcribed


def dwise_supported(*, kernel, strides, depth_multiplier: int = 1, channels=None, in_channels=None) -> tuple[bool, str]:
    """What DepthwiseSupernode_8x8p32to8_d32 accepts (dwise_supernode_check/recalculate_strategy)."""
    kh, kw = kernel
    if channels is not None and in_channels is not None and channels != in_channels:
        return False, f"filter depth {channels} != input depth {in_channels}"
    if depth_multiplier != 1:
        return False, f"depth multiplier {depth_multiplier}: output depth order is non-standard ('needs shuffling')"
    if kw > 7:
        return False, f"filter width {kw} > 7"
    if kh < 2:
        return False, f"filter height {kh} < 2 ('Only currently support filter height >= 2')"
    if kh > 14:
        return False, f"filter height {kh} > MAX_FILT_HEIGHT 14"
    if kw not in (3, 5, 7):
        return False, f"filter width {kw}: no dwconv2dbbb kernel (3, 5 or 7 only)"
    if strides[1] not in (1, 2):
        return False, f"horizontal stride {strides[1]}: only 1 or 2"
    return True, ""


# ----------------------------------------------------------------------------------------------
# SuperFC_8x8p32to8_ref (superfc_execute_ref) and SuperFC_8x8p32to8 (superfc_execute_hvx)
# ----------------------------------------------------------------------------------------------

def superfc_ref(x, w, bias, *, x_min, x_max, w_min, w_max, bias_min, bias_max, out_min, out_max):
    """Scalar transcription of ``superfc_execute_ref`` -> (y uint8 [N,O], y_min, y_max).

    x: uint8 [N,K]; w: uint8 [K,O] (nnlib DB order); bias int32 [O] over 2^32 levels.
    Offsets and level sizes from ``get_qu8_level_size_zero``; ``sum = fast_roundf(b*mpy) +
    sum((x-xo)(w-wo))``. Output range: the given one, or from min/max sums where -inf/+inf,
    then ``adjust_minmax_for_zero_with_constraints``; ``y = sat_u8(((s + outadd)*scalef31 +
    2^30) >> 31)`` with ``scalef31 = fast_roundf(out_level/outq_level * 2^31)``.
    """
    x = np.asarray(x)
    w = np.asarray(w)
    nb, k = x.shape
    kw_, o = w.shape
    if kw_ != k:
        raise MaceqError(f"nnlib SuperFC: weight depth {kw_} != input depth {k}")
    in_off, filt_off, out_level, bias_mpy = superfc_ref_params(x_min, x_max, w_min, w_max, bias_min, bias_max)
    biasbuf = [fast_roundf(fmul(i2f(int(bias[i]) - 0), bias_mpy)) for i in range(o)]
    tmp = [[0] * o for _ in range(nb)]
    minsum = maxsum = 0
    for b in range(nb):
        for oz in range(o):
            s = biasbuf[oz]
            for z in range(k):
                s = wrap32(s + (int(x[b, z]) - in_off) * (int(w[z, oz]) - filt_off))
            minsum, maxsum = min(minsum, s), max(maxsum, s)
            tmp[b][oz] = s
    fmin_, fmax_, outadd, scalef31 = superfc_ref_output(minsum, maxsum, out_level, out_min, out_max)
    y = np.zeros((nb, o), dtype=np.uint8)
    for b in range(nb):
        for oz in range(o):
            val = wrap32(tmp[b][oz] + outadd)
            y[b, oz] = saturate_u8(wrap32((val * scalef31 + (1 << 30)) >> 31))
    return y, fmin_, fmax_


def superfc_ref_params(x_min, x_max, w_min, w_max, bias_min, bias_max) -> tuple[int, int, float, float]:
    """superfc_execute_ref's scalars -> (in_offset, filt_offset, out_level_size, bias_mpy_amt).

    Offsets and levels from ``get_qu8_level_size_zero`` (flt_div_255); bias level
    ``(bias_max - bias_min) * (float)(1/2^32)``.
    """
    in_off, in_level = get_qu8_level_size_zero(f32(x_min), f32(x_max))
    filt_off, filt_level = get_qu8_level_size_zero(f32(w_min), f32(w_max))
    bias_level = fmul(fsub(f32(bias_max), f32(bias_min)), f32(1.0 / 4294967296.0))
    out_level = fmul(in_level, filt_level)
    return in_off, filt_off, out_level, fdiv(bias_level, out_level)


def superfc_ref_output(minsum: int, maxsum: int, out_level: float, out_min, out_max) -> tuple[float, float, int, int]:
    """superfc_execute_ref's output range and requantization -> (min, max, outadd, scalef31)."""
    fmin_, fmax_ = f32(out_min), f32(out_max)
    constraint = 3
    if fmin_ == -INF:
        fmin_ = fmul(i2f(minsum), out_level)
        constraint &= ~1
    if fmax_ == INF:
        fmax_ = fmaxf(fadd(fmin_, f32(1e-5)), fmul(i2f(maxsum), out_level))
        constraint &= ~2
    fmin_, fmax_, _ = adjust_minmax_for_zero_with_constraints(fmin_, fmax_, constraint)
    outq_level = flt_div_255(fsub(fmax_, fmin_))
    outscale = fdiv(out_level, outq_level)
    outadd = fast_roundf(fdiv(-fmin_, out_level))
    scalef31 = fast_roundf(fmul(outscale, 2147483648.0))
    return fmin_, fmax_, outadd, scalef31


SUPERFC = D32Node("SuperFC_8x8p32to8", 0.0, 0.5, 5, True)  # superfc_check: defaults 0, 0.5; 5 passes


def superfc_supported(k: int) -> tuple[bool, str]:
    """superfc_recalculate_strategy's checks on the input depth K (errors at execute)."""
    if k < 32:
        return False, f"input depth {k} < 32 ('in_depth must be at least 32')"
    if k % 16:
        return False, f"input depth {k} not a multiple of 16 ('not supported')"
    return True, ""


def superfc_gemsumb(w, filt_offset: int) -> list[int]:
    """``superfc_rearrange_and_sum_for_d32``: ``filt_offset*K_pad - sum(w over K_pad)`` per filter
    (padding filt_offset), i.e. ``K*filt_offset - sum(w)``; 0 for the filters padded to 32."""
    k, o = w.shape
    out = []
    for oz in range((o + 31) & ~31):
        s = 0
        if oz < o:
            s = k * filt_offset
            for z in range(k):
                s -= int(w[z, oz])
        out.append(s)
    return out


def superfc_fill_info(st: D32RangeState, x_min, x_max, filt_level: float) -> D32Scaling:
    """op_superfc_d32.c ``fill_info_minmax_basics``: no first-guess re-centring, no in_max nudge.

    Rejects ``in_min > 0``, ``in_max < 0``, ``in_min >= in_max``; ``scaling = prod/out_level``,
    ``shamt``/``recip`` as in the d32 nodes.
    """
    in_min, in_max = f32(x_min), f32(x_max)
    if in_min > 0.0 or in_max < 0.0 or in_min >= in_max:
        raise MaceqError(f"nnlib SuperFC: invalid input range [{in_min}, {in_max}]")
    in_offset, in_level = get_qu8_level_size_zero(in_min, in_max)
    prod = fmul(in_level, filt_level)
    _, out_level = get_qu8_level_size_zero(st.out_min, st.out_max)
    scaling = fdiv(prod, out_level)
    shamt = 0 if scaling <= 1.0 else flt_getexp(scaling)
    recip = min(roundf_u32(flt_ldexp(scaling, 31 - shamt)), 0x7FFFFFFF)
    return D32Scaling(in_offset, prod, out_level, recip, shamt)


def superfc_fill_bias_buf(bias, bias_min, bias_max, sc: D32Scaling, out_min: float, gemsumb) -> list[int]:
    """op_superfc_d32.c ``fill_bias_buf``: ``gemsumb*in_offset + fast_roundf(minout)`` in int32
    (``minout`` as in the d32 nodes); one word per filter padded to 32."""
    bias_level = fdiv(fsub(f32(bias_max), f32(bias_min)), 4294967296.0)
    ratio = fdiv(bias_level, sc.prod_level_size)
    min_out_prod_offset = fdiv(-out_min, sc.prod_level_size)
    out = []
    for i, g in enumerate(gemsumb):
        biasval = int(bias[i]) if i < len(bias) else 0
        out.append(wrap32(g * sc.in_offset + fast_roundf(fadd(fmul(i2f(biasval), ratio), min_out_prod_offset))))
    return out


def superfc_check_for_retry(st: D32RangeState, sc: D32Scaling, minval: int, maxval: int) -> bool:
    """``superfc_execute_workitem_check_for_retry``: the d32 rule, but the moved range is
    zero-adjusted (``adjust_minmax_for_zero``) only when both ends are free."""
    if st.flags == 3:
        return False
    recalc = False
    if (st.flags & 2) == 0 and maxval > 255:
        st.out_max = round_up_quarter_octave(
            fmaxf(fadd(fmul(sc.output_level_size, fadd(i2f(maxval), 0.5)), st.out_min), 2.0 ** -4))
        recalc = True
    if (st.flags & 1) == 0 and minval < 0:
        st.out_min = round_up_quarter_octave(
            fminf(fadd(fmul(sc.output_level_size, fsub(i2f(minval), 0.5)), st.out_min), -(2.0 ** -8)))
        recalc = True
    if recalc and st.flags == 0:
        st.out_min, st.out_max, _ = adjust_minmax_for_zero(st.out_min, st.out_max)
    return recalc


def superfc_execute(*, out_min, out_max, x_min, x_max, filt_level, bias, bias_min, bias_max, gemsumb, kernel,
                    fill=None):
    """superfc_execute_hvx: (fill_info, fill_bias_buf, execute, check for retry) up to 5 passes;
    after the fifth the outputs stand with the moved range ("Extreme recursion" is only logged).
    ``kernel(sc, biasbuf) -> (y, vmin, vmax)``; ``fill``: equal to :func:`superfc_fill_bias_buf`
    (the default)."""
    fill = fill or superfc_fill_bias_buf
    st = setup_initial_output_range(out_min, out_max, SUPERFC)
    for _ in range(SUPERFC.passes):
        sc = superfc_fill_info(st, x_min, x_max, filt_level)
        biasbuf = fill(bias, bias_min, bias_max, sc, st.out_min, gemsumb)
        y, vmin, vmax = kernel(sc, biasbuf)
        if not superfc_check_for_retry(st, sc, vmin, vmax):
            break
    return y, st.out_min, st.out_max


def superfc_hvx_ref(x, w, bias, *, x_min, x_max, w_min, w_max, bias_min, bias_max, out_min, out_max):
    """SuperFC_8x8p32to8 (``superfc_execute_hvx``, what MACE's FullyConnected runs) -> (y [N,O], min, max).

    ``fullconnlayerbatch_asm``: ``sum = bias + sum(x*w) - filt_offset*sum(x)`` (fcsuma_asm) per
    output, padded filters (all ``filt_offset``) included in the min / max; ``d32_requant``.
    """
    x = np.asarray(x)
    w = np.asarray(w)
    nb, k = x.shape
    if w.shape[0] != k:
        raise MaceqError(f"nnlib SuperFC: weight depth {w.shape[0]} != input depth {k}")
    ok, why = superfc_supported(k)
    if not ok:
        raise MaceqError(f"nnlib SuperFC: {why}")
    o = w.shape[1]
    fo, filt_level = get_qu8_level_size_zero(f32(w_min), f32(w_max))

    def acc(b: int, oz: int, s: int) -> int:
        xs = 0
        for z in range(k):
            s = wrap32(s + int(x[b, z]) * (int(w[z, oz]) if oz < o else fo))
            xs += int(x[b, z])
        return wrap32(s - fo * xs)

    def kernel(sc: D32Scaling, biasbuf):
        y = np.zeros((nb, o), dtype=np.uint8)
        vmin = vmax = 0  # superfc_execute_strategy
        for b in range(nb):
            for oz in range(len(biasbuf)):
                q, raw = d32_requant(acc(b, oz, biasbuf[oz]), sc.recip_val, sc.recip_shamt)
                vmin, vmax = min(vmin, raw), max(vmax, raw)
                if oz < o:
                    y[b, oz] = q
        return y, vmin, vmax

    return superfc_execute(out_min=out_min, out_max=out_max, x_min=x_min, x_max=x_max, filt_level=filt_level,
                           bias=bias, bias_min=bias_min, bias_max=bias_max, gemsumb=superfc_gemsumb(w, fo),
                           kernel=kernel)


# ----------------------------------------------------------------------------------------------
# QuantizedAdd_8p8to8 / QuantizedSub (same-shape datapath: addsub_flat_direct_execute)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AddSubScaling:
    """``struct addsub_scaling_parms`` as set by ``set_addsub_scaling_for_output_range``."""

    a_scale: int
    b_scale: int
    final_rsh: int
    offset: int
    intermed_zero: int
    underrange: bool
    netscale: float


def set_addsub_scaling(out_min: float, out_max: float, ab_zero, ab_step, *, subtract: bool,
                       fixed_range: bool) -> AddSubScaling:
    """``set_addsub_scaling_for_output_range``; raises where the C returns -1 ("scaling failed")."""
    out_scl = fdiv(255.0, fsub(out_max, out_min))
    out_z = fmul(-out_min, out_scl)
    a_scale_f = fmul(out_scl, ab_step[0])
    b_scale_f = fmul(out_scl, ab_step[1])
    scaleval = fadd(a_scale_f, b_scale_f)
    if subtract:
        scaleval = fmaxf(a_scale_f, b_scale_f)
        b_scale_f = -b_scale_f
    scexp = flt_getexp(fmul(scaleval, f32(16384.0 / 16380.0)))
    if scexp > 6 and (not fixed_range or scexp > 12):
        raise MaceqError(f"nnlib QuantizedAdd: output range [{out_min}, {out_max}] too small for the inputs "
                         "(scaling failed)")
    rsh = min(6 - scexp, 7)
    preshift = 1 - rsh if (fixed_range and rsh <= 0) else 0
    underrange = preshift != 0
    rsh_scl = flt_ldexp(1.0, rsh)
    a_scale = roundf_i32(fmul(a_scale_f, fmul(rsh_scl, 256.0)))
    b_scale = roundf_i32(fmul(b_scale_f, fmul(rsh_scl, 256.0)))
    rsh_scl2 = 2.0 if underrange else rsh_scl
    intzero = (ab_zero[0] * a_scale + ab_zero[1] * b_scale) >> (8 - preshift)
    offset = roundf_i32(fmul(out_z, rsh_scl2)) - intzero
    return AddSubScaling(wrap16(a_scale), wrap16(b_scale), rsh, offset if underrange else saturate_i16(offset),
                         wrap16(intzero), underrange, fdiv(1.0, fmul(out_scl, rsh_scl)))


def addsub_first_stage(a: int, b: int, sp: AddSubScaling) -> int:
    """``first_stage``: vmpa with the hi (bits 14:7) and lo (bits 6:0) scale bytes, >>7, vavg.

    ``hi = a*s8(A>>7) + b*s8(B>>7)`` and ``lo = a*(A&0x7f) + b*(B&0x7f)`` are 16-bit lanes
    (wrapping); ``(hi + (lo_u16 >> 7)) >> 1`` equals floor((a*A + b*B)/256) when no lane wraps.
    """
    scales_lo = (sp.a_scale & 0x7F) | ((sp.b_scale & 0x7F) << 8)
    scales_hi = ((sp.a_scale >> 7) & 0xFF) | ((sp.b_scale << 1) & 0xFF00)
    hisop = wrap16(a * s8(scales_hi) + b * s8(scales_hi >> 8))
    losop = wrap16(a * s8(scales_lo) + b * s8(scales_lo >> 8)) & 0xFFFF
    return (hisop + (losop >> 7)) >> 1


def addsub_second_stage(v: int, sp: AddSubScaling) -> int:
    """``second_stage``: 16-bit saturating add of offset, then vasr(...):rnd:sat to u8."""
    p = saturate_i16(v + wrap16(sp.offset))
    rsh = sp.final_rsh
    rnd = (1 << (rsh - 1)) if rsh > 0 else 0
    return saturate_u8((p + rnd) >> rsh)


def addsub_underrange(a: int, b: int, sp: AddSubScaling) -> int:
    """``add_core_hvx_underrange``: 32-bit products >> (7+rsh), +offset (sat32), sat16, (x+1)>>1 sat u8."""
    initial_rsh = 8 + sp.final_rsh - 1
    t = sat(a * sp.a_scale + b * sp.b_scale, INT32_MIN, INT32_MAX) >> initial_rsh
    p = saturate_i16(sat(t + sp.offset, INT32_MIN, INT32_MAX))
    return saturate_u8((p + 1) >> 1)


@dataclass
class AddSubRange:
    """The output-range state of ``struct qadd_888_info`` / ``struct elementwise_d32_info``."""

    info_min: float
    info_max: float
    spec_min: float  # the given ends (-inf / inf: open)
    spec_max: float
    flags: int  # min_max_precalc: bit 0 min given, bit 1 max given


def addsub_check(out_min, out_max, *, d32: bool) -> AddSubRange:
    """qadd_888_check (op_add.c) or the d32 check (op_add_d32.c) -> the initial range state.

    Open ends start at 0.0 / 0.5. The d32 check clamps given ends (``fmaxf(0, max)``,
    ``fminf(0, min)``) and, with both given, first ``max = fmaxf(min + 1e-6f, max)``; both
    checks then ``adjust_minmax_for_zero_with_constraints(.., 3)`` when both ends are given.
    """
    out_min, out_max = f32(out_min), f32(out_max)
    flags = int(out_min != -INF) + 2 * int(out_max != INF)
    spec_min, spec_max = out_min, out_max
    if d32:
        spec_min = fminf(0.0, out_min) if flags & 1 else out_min
        spec_max = fmaxf(0.0, out_max) if flags & 2 else out_max
    info_min = spec_min if flags & 1 else 0.0
    info_max = spec_max if flags & 2 else 0.5
    if flags == 3:
        if d32:
            info_max = fmaxf(fadd(info_min, f32(1e-6)), info_max)
        info_min, info_max, _ = adjust_minmax_for_zero_with_constraints(info_min, info_max, 3)
    return AddSubRange(info_min, info_max, spec_min, spec_max, flags)


def addsub_first_range(rs: AddSubRange, a_rng, b_rng, *, subtract: bool) -> None:
    """The first run with an open end (``addsub_flat_direct_execute`` / ``addsub_setup_scaling``):
    1/8 of the theoretical output range, the given end kept; mutates ``rs``."""
    (a_min, a_max), (b_min, b_max) = (tuple(f32(v) for v in r_) for r_ in (a_rng, b_rng))
    if not subtract:
        out_max_all, out_min_all = fadd(a_max, b_max), fadd(a_min, b_min)
    else:
        out_max_all, out_min_all = fsub(a_max, b_min), fsub(a_min, b_max)
    out_max_all = fmaxf(out_max_all, fadd(out_min_all, f32(0.001)))
    ored_min, ored_max = fmul(0.125, out_min_all), fmul(0.125, out_max_all)
    if rs.flags == 1:
        rs.info_min = rs.spec_min
        rs.info_max = max(0.0, fadd(rs.info_min, fsub(ored_max, ored_min)))
    elif rs.flags == 2:
        rs.info_max = rs.spec_max
        rs.info_min = fminf(0.0, fsub(rs.info_max, fsub(ored_max, ored_min)))
    else:
        rs.info_min, rs.info_max = ored_min, ored_max
    rs.info_min, rs.info_max, _ = adjust_minmax_for_zero_with_constraints(rs.info_min, rs.info_max, rs.flags)


def addsub_need_rerun(rs: AddSubRange, sp: AddSubScaling, lo: int, hi: int) -> bool:
    """``check_addsub_need_rerun``: the found range, padded by ``fmaxf(0.15f*range, 1e-4)``,
    replaces an exceeded open end; given ends restored, zero-adjusted; mutates ``rs``."""
    actual_min = fmul(i2f(lo - sp.intermed_zero), sp.netscale)
    actual_max = fmul(i2f(hi - sp.intermed_zero), sp.netscale)
    out_range = fsub(actual_max, actual_min)
    out_range = fadd(out_range, fmaxf(fmul(f32(0.15), out_range), f32(1e-4)))  # 0.15f * out_range
    padded_min = min(0.0, fsub(actual_max, out_range))
    padded_max = max(0.0, fadd(actual_min, out_range))
    nmin, nmax, adj = rs.info_min, rs.info_max, False
    if not rs.flags & 1 and actual_min < nmin:
        nmin, adj = padded_min, True
    if not rs.flags & 2 and actual_max > nmax:
        nmax, adj = padded_max, True
    if not adj:
        return False
    rs.info_min = rs.spec_min if rs.flags & 1 else nmin
    rs.info_max = rs.spec_max if rs.flags & 2 else nmax
    if rs.info_min < 0.0:
        rs.info_min, rs.info_max, _ = adjust_minmax_for_zero_with_constraints(rs.info_min, rs.info_max, rs.flags)
    return True


def addsub_execute(*, a_min, a_max, b_min, b_max, out_min, out_max, subtract: bool, core, d32: bool = False):
    """QuantizedAdd/Sub's range logic around the datapath -> (y, out_min, out_max).

    ``d32=False``: qadd_888_check + ``addsub_flat_direct_execute`` (op_add.c, same shapes,
    flat producers); ``d32=True``: QuantizedAdd/Sub_8p8to8_d32 (op_add_d32.c). They differ in
    ``addsub_check`` and in when the min / max is tracked: the flat op only when max is open
    (its C tests ``!max_precalc || !max_precalc``), the d32 op when either end is open.
    ``core(sp, track) -> (y, lo, hi)`` runs the datapath (``lo``/``hi``: min / max of the
    step-(2) values, starting from ``intermed_zero``). Models one execution after prepare
    (nnlib keeps a self-found range across runs).
    """
    rs = addsub_check(out_min, out_max, d32=d32)
    za, sa = get_qu8_level_size_zero(f32(a_min), f32(a_max))
    zb, sb = get_qu8_level_size_zero(f32(b_min), f32(b_max))
    if rs.flags != 3:
        addsub_first_range(rs, (a_min, a_max), (b_min, b_max), subtract=subtract)
    sp = set_addsub_scaling(rs.info_min, rs.info_max, (za, zb), (sa, sb), subtract=subtract, fixed_range=rs.flags == 3)
    need_minmax = rs.flags != 3 if d32 else not rs.flags & 2
    y, lo, hi = core(sp, need_minmax)
    if need_minmax and addsub_need_rerun(rs, sp, lo, hi):
        sp = set_addsub_scaling(rs.info_min, rs.info_max, (za, zb), (sa, sb), subtract=subtract, fixed_range=False)
        y, _, _ = core(sp, False)
    return y, rs.info_min, rs.info_max


def addsub_broadcast_plan(a_shape, b_shape) -> tuple[tuple[int, ...], bool, bool]:
    """``check_compatible_elementwise_d32(.., compat_ALL | compat_AtoB)`` -> (out shape, swap, all_ones).

    Per dimension: equal, or B's is 1 (B broadcasts onto A), or A's is 1 (A onto B, then X and
    Y swap: subtraction becomes ``op_subtract_rev``); both directions in one op fail.
    ``all_ones``: every dimension is broadcast or 1 on both sides (``compat_broadcast_ALL``).
    Broadcasting adds always run as the d32 op (prepare.c converts them whatever the producers).
    Shapes of fewer than 4 dimensions are padded with leading 1s (the out shape is 4-D).
    """
    if len(a_shape) > 4 or len(b_shape) > 4:
        raise MaceqError(f"nnlib QuantizedAdd_8p8to8_d32: more than 4 dimensions: {tuple(a_shape)}, {tuple(b_shape)}")
    a_shape, b_shape = (1,) * (4 - len(a_shape)) + tuple(a_shape), (1,) * (4 - len(b_shape)) + tuple(b_shape)
    btoa_ok = atob_ok = True
    swap, bcast = False, 0
    for i, (da, db) in enumerate(zip(a_shape, b_shape)):
        if da == db:
            bcast |= (1 << i) if db == 1 else 0
        elif db == 1 and btoa_ok:
            bcast, atob_ok = bcast | (1 << i), False
        elif da == 1 and atob_ok:
            bcast, swap, btoa_ok = bcast | (1 << i), True, False
        else:
            raise MaceqError(f"nnlib QuantizedAdd_8p8to8_d32: incompatible {'BHWD'[i]}: dims {da} vs {db} "
                             "('unsupported broadcast mode')")
    return tuple(max(int(da), int(db)) for da, db in zip(a_shape, b_shape)), swap, bcast == 15


def scaled_copy_u8(x: int, scale: int, offset: int) -> int:
    """``tensor_copy_scaled_d32`` / scalemem_d32 on one byte: a copy when ``offset == 0`` and
    ``scale >= 32704``, else ``saturate_u8((x*scale + offset*256 + 2^14) >> 15)`` (``scale = 0``
    is the fill ``(offset + 64) >> 7``)."""
    if offset == 0 and scale >= 32704:
        return x
    return saturate_u8((x * scale + offset * 256 + (1 << 14)) >> 15)


def addsub_1111_scaling(a_rng, b_rng, b_code: int, oper: str) -> tuple[int, int, float, float]:
    """``addsub_setup_scaling``'s mode_broadcast_1111 (one B value, both output ends open) ->
    (scale, offset, out_min, out_max) for ``scaled_copy_u8`` over A. ``oper``: "add", "sub" or
    "sub_rev" (A - B with X, Y swapped, i.e. B - A). The range moves by the B value when
    the new zero code ``za - b_val/astep`` is within [-0.25, 255.25]; else min (max) is pinned
    at 0 and the codes are squeezed."""
    za, astep = get_qu8_level_size_zero(f32(a_rng[0]), f32(a_rng[1]))
    zb, bstep = get_qu8_level_size_zero(f32(b_rng[0]), f32(b_rng[1]))
    b_val = fmul(i2f(b_code - zb), bstep)
    if oper != "add":
        b_val = -b_val
    new_zero = fsub(i2f(za), fdiv(b_val, astep))
    scale, offs = 32768, 0
    arange = fsub(f32(a_rng[1]), f32(a_rng[0]))
    if -0.25 <= new_zero <= 255.25:
        out_min = fmul(i2f(-roundf_i32(new_zero)), astep)
        out_max = fadd(out_min, arange)
    else:
        out_min, out_max = (0.0, fadd(f32(a_rng[1]), b_val)) if b_val > 0 else (fadd(f32(a_rng[0]), b_val), 0.0)
        scale = roundf_i32(fdiv(fmul(32768.0, arange), fsub(out_max, out_min)))
        if b_val > 0:
            scale = saturate_i16(scale)
            offs = 128 * 255 - ((255 * scale) >> 8)
    if oper == "sub_rev":
        scale, offs, out_min, out_max = -scale, 255 * 128 - offs, -out_max, -out_min
    if -128 <= scale <= 128 and (offs + 64) >> 7 == (scale * 255 + offs * 256 + 16384) >> 15:
        scale = 0
    return saturate_i16(scale), wrap16(offs), out_min, out_max


def _addsub_scalar_core(flat_a, flat_b, shape):
    def core(sp: AddSubScaling, track: bool):
        y = np.zeros(flat_a.shape, dtype=np.uint8)
        lo = hi = sp.intermed_zero
        for i in range(flat_a.size):
            av, bv = int(flat_a[i]), int(flat_b[i])
            if sp.underrange:
                y[i] = addsub_underrange(av, bv, sp)
            else:
                v = addsub_first_stage(av, bv, sp)
                lo, hi = min(lo, v), max(hi, v)
                y[i] = addsub_second_stage(v, sp)
        return y.reshape(shape), lo, hi

    return core


def quantized_addsub_ref(a, b, *, a_min, a_max, b_min, b_max, out_min=-INF, out_max=INF, subtract: bool = False):
    """QuantizedAdd_8p8to8 / QuantizedSub_8p8to8 (``subtract=True``) -> (y, y_min, y_max).

    An add of same-shape inputs: ``addsub_flat_direct_execute`` (op_add.c; what prepare keeps
    when no producer is a d32 op; the d32 op computes the same unless one output end alone is
    given, ``addsub_execute``). A sub (always the d32 op: ``operator = op_subtract``, negative b
    scale, the same datapath) or different shapes (``addsub_broadcast_plan``): the d32 op, on the
    broadcast inputs (the B11D and mixed kernels compute the same floor((a*A + b*B)/256)), or,
    when every dimension is broadcast or 1 and both output ends are open, the scaled copy of
    ``addsub_1111_scaling``.
    """
    a = np.asarray(a)
    b = np.asarray(b)
    args = dict(out_min=out_min, out_max=out_max, subtract=subtract)
    if a.shape == b.shape and not subtract:
        return addsub_execute(a_min=a_min, a_max=a_max, b_min=b_min, b_max=b_max,
                              core=_addsub_scalar_core(a.ravel(), b.ravel(), a.shape), **args)
    shape4, swap, all_ones = addsub_broadcast_plan(a.shape, b.shape)
    shape = np.broadcast_shapes(a.shape, b.shape)
    if all_ones and f32(out_min) == -INF and f32(out_max) == INF:
        big, rngs = (b, ((b_min, b_max), (a_min, a_max))) if swap else (a, ((a_min, a_max), (b_min, b_max)))
        single = int((a if swap else b).ravel()[0])
        oper = ("sub_rev" if swap else "sub") if subtract else "add"
        scale, offs, mn, mx = addsub_1111_scaling(rngs[0], rngs[1], single, oper)
        y = np.array([scaled_copy_u8(int(v), scale, offs) for v in big.ravel()], dtype=np.uint8)
        return y.reshape(shape), mn, mx
    fa, fb = np.broadcast_to(a, shape).ravel(), np.broadcast_to(b, shape).ravel()
    return addsub_execute(a_min=a_min, a_max=a_max, b_min=b_min, b_max=b_max, core=_addsub_scalar_core(fa, fb, shape),
                          d32=True, **args)


# ----------------------------------------------------------------------------------------------
# QuantizedConcat_8, QuantizedMaxPool_8, QuantizedAvgPool_8
# ----------------------------------------------------------------------------------------------

def _concat_range(in_ranges) -> tuple[float, float]:
    """The union of the inputs' float32 ranges (fminf/fmaxf over every input), as both concats find it."""
    out_min = f32(in_ranges[0][0])
    out_max = f32(in_ranges[0][1])
    for mn, mx in in_ranges:
        out_min = fminf(out_min, f32(mn))
        out_max = fmaxf(out_max, f32(mx))
    return out_min, out_max


def concat_params(in_ranges) -> tuple[float, float, list[tuple[int, int]]]:
    """``concat_execute``'s output range and each input's (offset, gain) -> (min, max, [(offset, gain)])."""
    out_min, out_max = _concat_range(in_ranges)
    if out_min > 0.0:
        out_min = 0.0
    out_level_recip = fdiv(255.0, fsub(out_max, out_min))
    params = []
    for mn, mx in in_ranges:
        in_min, in_max = f32(mn), f32(mx)
        if in_min > 0.0:
            in_min = 0.0
        in_level = flt_div_255(fsub(in_max, in_min))
        offset = max(0, roundf_i32(fdiv(fsub(in_min, out_min), in_level)))
        params.append((offset, roundf_i32(fmul(fmul(out_level_recip, in_level), 32768.0))))
    return out_min, out_max, params


def concat_ref(inputs, *, axis: int, in_ranges):
    """QuantizedConcat_8 (``concat_execute`` + per-element slice) -> (y, y_min, y_max).

    Only depth (axis 3) is accepted. Output range: ``min = min(mins)`` (then min(.,0)),
    ``max = max(maxes)``, not zero-adjusted. Per input: ``in_min = min(in_min, 0)``,
    ``in_level = flt_div_255(in_max-in_min)``, ``offset = max(0, roundf_i32((in_min-out_min)/in_level))``,
    ``gain = roundf_i32(255/(out_max-out_min)*in_level*32768)`` capped at 32767;
    ``y = clamp(((x+offset)*gain + 2^14) >> 15)``. The device path copies instead when
    ``offset == 0 && gain >= 0x7fc0`` (``concat_execute_slice_asm``), modelled here.
    """
    if axis % 4 != 3:
        raise MaceqError(f"nnlib QuantizedConcat: axis {axis} rejected ('only depth')")
    inputs = [np.asarray(t) for t in inputs]
    n, h, w = inputs[0].shape[:3]
    for t in inputs:
        if t.shape[:3] != (n, h, w):
            raise MaceqError("nnlib QuantizedConcat: batch/height/width mismatch")
    out_min, out_max, params = concat_params(in_ranges)
    parts = []
    for t, (offset, gain) in zip(inputs, params):
        gains = min(gain, 32767)
        part = np.zeros(t.shape, dtype=np.uint8)
        flat, pflat = t.reshape(-1), part.reshape(-1)
        for i in range(flat.size):
            if offset == 0 and gain >= 0x7FC0:
                pflat[i] = flat[i]
            else:
                pflat[i] = saturate_u8(((int(flat[i]) + offset) * gains + (1 << 14)) >> 15)
        parts.append(part)
    return np.concatenate(parts, axis=3), out_min, out_max


def concat_runs_d32(out_shape) -> bool:
    """prepare.c ``do_convert_concat_depth32``: QuantizedConcat_8 becomes QuantizedConcat_8_d32
    unless the output is 1x1 in height and width ("Don't try and convert 1x1xD tensors")."""
    return not (out_shape[1] == 1 and out_shape[2] == 1)


def concat_d32_params(in_ranges) -> tuple[float, float, list[tuple[int, int]]]:
    """op_concat_d32.c ``concat_execute`` / ``concat_copy_inputs`` -> (min, max, [(offset, gain)]).

    ``min = min(mins)``, ``max = max(maxes)``; ``min > 0`` becomes 0, ``min < 0`` is
    zero-adjusted (``adjust_minmax_for_zero``, kept when it moved an end). ``recip =
    255/(max-min)``; per input (its own min not clamped): ``level = (in_max-in_min)/255``,
    ``offset = (int)((in_min-min)*recip*128)``, ``gain = (int)(recip*level*32768)``, 32767 when
    outside 0..32767 (all truncations).
    """
    out_min, out_max = _concat_range(in_ranges)
    if out_min > 0.0:
        out_min = 0.0
    elif out_min < 0.0:
        amin, amax, code = adjust_minmax_for_zero(out_min, out_max)
        if code > 0:
            out_min, out_max = amin, amax
    recip = fdiv(255.0, fsub(out_max, out_min))
    params = []
    for mn, mx in in_ranges:
        level = fdiv(fsub(f32(mx), f32(mn)), 255.0)
        offset = c_trunc_i32(fmul(fmul(fsub(f32(mn), out_min), recip), 128.0))
        gain = c_trunc_i32(fmul(fmul(recip, level), 32768.0))
        params.append((offset, gain if 0 <= gain <= 32767 else 32767))
    return out_min, out_max, params


def concat_d32_ref(inputs, *, axis: int, in_ranges):
    """QuantizedConcat_8_d32 -> (y, y_min, y_max): any axis (``find_concat_shape``).

    Per element (``scaled_copy_d32_reference``; scalemem_d32.S and the intrinsic version state
    the same C model): a copy when ``offset == 0 && gain >= 32704``, else
    ``saturate_u8((x*gain + offset*256 + 2^14) >> 15)``; parameters from ``concat_d32_params``.
    """
    inputs = [np.asarray(t) for t in inputs]
    axis %= 4
    for t in inputs:
        if t.ndim != 4 or any(t.shape[d] != inputs[0].shape[d] for d in range(4) if d != axis):
            raise MaceqError(f"nnlib QuantizedConcat_8_d32: shapes {[t.shape for t in inputs]} differ off axis "
                             f"{axis}")
    out_min, out_max, params = concat_d32_params(in_ranges)
    parts = []
    for t, (offset, gain) in zip(inputs, params):
        part = np.zeros(t.shape, dtype=np.uint8)
        flat, pflat = t.reshape(-1), part.reshape(-1)
        for i in range(flat.size):
            if offset == 0 and gain >= 32704:
                pflat[i] = flat[i]
            else:
                pflat[i] = saturate_u8((int(flat[i]) * gain + offset * 256 + (1 << 14)) >> 15)
        parts.append(part)
    return np.concatenate(parts, axis=axis), out_min, out_max


def quantized_concat_ref(inputs, *, axis: int, in_ranges):
    """QuantizedConcat_8 as nnlib runs it after prepare: ``concat_d32_ref`` unless the output is
    1x1 in height and width, then the flat ``concat_ref`` (depth only)."""
    axis %= 4
    shape = list(np.shape(inputs[0]))
    shape[axis] = sum(int(np.shape(t)[axis]) for t in inputs)
    if concat_runs_d32(shape):
        return concat_d32_ref(inputs, axis=axis, in_ranges=in_ranges)
    return concat_ref(inputs, axis=axis, in_ranges=in_ranges)


def maxpool_d32_check_width(in_w: int, k_w: int, s_w: int, padding) -> None:
    """maxpool_d32_execute's width-padding check (op_maxpool_d32.c): unless the output is one
    column wide, ``in_left_pad < required_w_before || in_left_pad + in_right_pad <
    required_w_after`` fails ("insufficient width padding"). Every d32 producer maceq emits
    (Convert_to_d32, the supernodes, the pools) pads 4 columns left and ``(-W) & 3`` right."""
    ow, before, after = pad_outsize_before_after(in_w, k_w, s_w, as_padding(padding))
    if ow > 1 and (before > D32_LEFT_PAD or D32_LEFT_PAD + (-in_w & 3) < after):
        raise MaceqError(f"nnlib QuantizedMaxPool_8_d32: insufficient width padding (window {k_w}, stride {s_w}, "
                         f"width {in_w}: {before} left / {after} right needed)")


def maxpool_ref(x, *, x_min, x_max, kernel, strides, padding):
    """QuantizedMaxPool_8 (``maxpool_execute_slice_ref``): max over the clipped window, from 0.
    The op runs as QuantizedMaxPool_8_d32, whose width-padding check applies
    (``maxpool_d32_check_width``)."""
    x = np.asarray(x)
    n, h, w, c = x.shape
    padding = as_padding(padding)
    oh, ow, adj_y, adj_x = _geometry((h, w), kernel, strides, padding, op="QuantizedMaxPool")
    maxpool_d32_check_width(w, kernel[1], strides[1], padding)
    y = np.zeros((n, oh, ow, c), dtype=np.uint8)
    for b in range(n):
        for oy in range(oh):
            y0 = oy * strides[0] - adj_y
            ys, ye = max(y0, 0), min(y0 + kernel[0], h)
            for ox in range(ow):
                x0 = ox * strides[1] - adj_x
                xs, xe = max(x0, 0), min(x0 + kernel[1], w)
                for z in range(c):
                    m = 0
                    for iy in range(ys, ye):
                        for ix in range(xs, xe):
                            m = max(m, int(x[b, iy, ix, z]))
                    y[b, oy, ox, z] = m
    return y, f32(x_min), f32(x_max)


def avgpool_ref(x, *, x_min, x_max, kernel, strides, padding):
    """QuantizedAvgPool_8 (``avgpool_execute_slice_ref``): ``(sum*sath(0x8000/n) + 0x4000) >> 15``."""
    x = np.asarray(x)
    n, h, w, c = x.shape
    padding = as_padding(padding)
    oh, ow, adj_y, adj_x = _geometry((h, w), kernel, strides, padding, op="QuantizedAvgPool")
    y = np.zeros((n, oh, ow, c), dtype=np.uint8)
    for b in range(n):
        for oy in range(oh):
            y0 = oy * strides[0] - adj_y
            ys, ye = max(y0, 0), min(y0 + kernel[0], h)
            for ox in range(ow):
                x0 = ox * strides[1] - adj_x
                xs, xe = max(x0, 0), min(x0 + kernel[1], w)
                count = (ye - ys) * (xe - xs)
                if count <= 0:
                    raise MaceqError("nnlib QuantizedAvgPool: empty window (division by zero in the C)")
                count = saturate_i16(0x8000 // count)
                for z in range(c):
                    s = 0
                    for iy in range(ys, ye):
                        for ix in range(xs, xe):
                            s += int(x[b, iy, ix, z])
                    y[b, oy, ox, z] = ((s * count + 0x4000) >> 15) & 0xFF  # uint8 store
    return y, f32(x_min), f32(x_max)


# ----------------------------------------------------------------------------------------------
# QuantizedAvgPool_8_d32 (op_avgpool_d32.c, nn_integral_buffer.h, integral_buffer.c): what
# nnlib's prepare makes of every QuantizedAvgPool_8
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class IntegralPlan:
    """``struct integral_buffer_plan`` (the fields the arithmetic uses), from ``integral_buffer_plan``."""

    in_h: int  # input size, possibly trimmed
    in_w: int
    out_h: int
    out_w: int
    win_h: int
    win_w: int
    stride_h: int
    stride_w: int
    pad_t: int
    pad_b: int
    pad_l: int
    pad_r: int
    infeas_h: int
    infeas_w: int
    scales_h: tuple  # edgepad scales, int16 with 15 fractional bits
    scales_w: tuple
    recip_mant: int
    recip_shift: int


def _lut_reciprocal_i32(n: int) -> int:
    """hvx_constants.c ``lut_reciprocal_i32[n-1]``: 1/n with 31 fractional bits (0x7FFFFFFF for 1)."""
    if not 1 <= n <= 128:
        raise MaceqError(f"nnlib avgpool: window edge {n} beyond lut_reciprocal_i32 (128 entries)")
    return 0x7FFFFFFF if n == 1 else (2 * (1 << 31) + n) // (2 * n)


def integ_buf_padding_scales(n: int, winsize: int, infeas: int) -> tuple:
    """``integ_buf_find_padding_scales``: ``-p/(w-p)`` (15 fractional bits), p = max(pi, infeas+1)."""
    out = []
    for pi in range(1, n + 1):
        p = max(pi, infeas + 1)
        wmp = winsize - p
        out.append(-0x8000 if wmp <= p else -(((_lut_reciprocal_i32(wmp) * p) & 0xFFFFFFFF) + 0x8000 >> 16))
    return tuple(out)


def _plan_axis(n_in: int, win: int, stride: int, padding: Padding):
    """One axis of ``setup_integral_buffer_plan`` -> (in, out, win, stride, before, after, infeas)."""
    out, before, after = pad_outsize_before_after(n_in, win, stride, padding)
    if out < 1:
        raise MaceqError("nnlib QuantizedAvgPool_8_d32: input too small for filter")
    if after == 0 and stride > 1:
        n_in = min(n_in, win + (out - 1) * stride)
    if out == 1:
        return n_in, 1, n_in, 1, 0, 0, 0
    infeas = 0
    if win - 1 - n_in > 0:
        infeas = win - 1 - n_in
        shrink = win - max(before, after) - n_in
        if shrink > 0:
            win, infeas, before, after = win - 2 * shrink, infeas - 2 * shrink, before - shrink, after - shrink
    return n_in, out, win, stride, before, after, infeas


def integral_buffer_plan(in_hw, kernel, strides, padding) -> IntegralPlan:
    """``setup_integral_buffer_plan``: output size and pads, then the simplifications (trim unused
    input with stride > 1 and no trailing pad; an output dimension of 1 takes the whole (trimmed)
    input as its window, no pads, stride 1; windows more than twice the input shrink with their
    pads), the edge-padding scales and ``rsh = ceil(log2(wh*ww)) + 1``,
    ``mant = ((16384 << rsh)/(wh*ww) + 1) >> 1``."""
    padding = as_padding(padding)
    if padding == Padding.NA:
        raise MaceqError("nnlib QuantizedAvgPool_8_d32: padding NA is rejected ('This op might pad')")
    ih, oh, wh, sh, pt, pb, infh = _plan_axis(int(in_hw[0]), int(kernel[0]), int(strides[0]), padding)
    iw, ow, ww, sw, pl, pr, infw = _plan_axis(int(in_hw[1]), int(kernel[1]), int(strides[1]), padding)
    winsize = wh * ww
    rsh = (winsize - 1 if winsize < 4 else (winsize - 1).bit_length()) + 1  # ceiling_log2 + 1
    mant = (((16384 << rsh) & 0xFFFFFFFF) // winsize + 1) >> 1
    return IntegralPlan(ih, iw, oh, ow, wh, ww, sh, sw, pt, pb, pl, pr, infh, infw,
                        integ_buf_padding_scales(max(pt, pb), wh, infh) if max(pt, pb) else (),
                        integ_buf_padding_scales(max(pl, pr), ww, infw) if max(pl, pr) else (), mant, rsh)


def mul_frac_i32xi16(val: int, scl15: int) -> int:
    """``Q6_Vw_vmpyo_VwVh_s1_rnd_sat`` / ``mul_frac_i32xi16``: ``(val*scl + 0x4000) >> 15``, saturated."""
    return sat((val * scl15 * 2 + 0x8000) >> 16, INT32_MIN, INT32_MAX)


def avgpool_integral_image(img, plan: IntegralPlan) -> dict:
    """The padded integral buffer of one 2-D channel (``avgpool_producer_load_rows_hvx`` and
    ``producer_add_bottom_padding_hvx``) -> {(row, col): int32}, rows -pad_t..H+pad_b, cols
    -pad_l..W+pad_r. Core: ``256 * sum(x[:r, :c])``; then per loaded row the left pads
    (``mul_frac(I[w-p], scale)``, 0 when infeasible) and right pads (``I[W] - mul_frac(I[W] -
    I[W - min(W, w-p)], scale)``), the top rows (``mul_frac(I[wh-p], scale)``, over the padded
    width) and the bottom rows (``I[H] - mul_frac(I[H] - I[ref], scale)``, ref from
    ``H - min(wh-1, H)``, advancing past the infeasible rows).
    """
    h, w = plan.in_h, plan.in_w
    ii = {}
    for r in range(h + 1):
        for c in range(w + 1):
            ii[r, c] = 0 if r == 0 or c == 0 else wrap32(ii[r - 1, c] + 256 * sum(int(v) for v in img[r - 1, :c]))
        for p in range(1, plan.pad_l + 1):
            scale = plan.scales_w[p - 1]
            ii[r, -p] = 0 if r == 0 or p <= plan.infeas_w else mul_frac_i32xi16(ii[r, plan.win_w - p], scale)
        for p in range(1, plan.pad_r + 1):
            delt = wrap32(ii[r, w] - ii[r, w - min(w, plan.win_w - p)])
            ii[r, w + p] = 0 if r == 0 else wrap32(ii[r, w] - mul_frac_i32xi16(delt, plan.scales_w[p - 1]))
    cols = range(-plan.pad_l, w + plan.pad_r + 1)
    ref_row = plan.win_h - plan.infeas_h - 1
    for p in range(1, plan.pad_t + 1):
        for c in cols:
            ii[-p, c] = 0 if p <= plan.infeas_h else mul_frac_i32xi16(ii[ref_row, c], plan.scales_h[p - 1])
        ref_row -= 0 if p <= plan.infeas_h else 1
    ref_row = h - min(plan.win_h - 1, h)
    for k in range(plan.pad_b):
        for c in cols:
            ii[h + 1 + k, c] = wrap32(ii[h, c] - mul_frac_i32xi16(wrap32(ii[h, c] - ii[ref_row, c]), plan.scales_h[k]))
        ref_row += 1 if k + 1 > plan.infeas_h else 0
    return ii


def avgpool_integral_output(ii: dict, plan: IntegralPlan, oy: int, ox: int) -> int:
    """``consumer_run_row_hvx``: window sum from four corners, ``sat16((sum + rnd) >> rsh)``,
    ``sat16((v*mant*2 + 0x8000) >> 16)``, ``sat_u8((v + 32) >> 6)``."""
    t, l = oy * plan.stride_h - plan.pad_t, ox * plan.stride_w - plan.pad_l
    b, r = t + plan.win_h, l + plan.win_w
    area = wrap32(wrap32(ii[b, r] - ii[t, r]) - wrap32(ii[b, l] - ii[t, l]))
    rsh = plan.recip_shift
    v = saturate_i16((area + ((1 << rsh) >> 1)) >> rsh)
    v = saturate_i16((v * plan.recip_mant * 2 + 0x8000) >> 16)
    return saturate_u8((v + 32) >> 6)


def _avg_rnd(a: int, b: int) -> int:
    """``vavg(.ub, .ub):rnd``."""
    return (a + b + 1) >> 1


def avgpool_3x3_zapped(img, plan: IntegralPlan) -> dict:
    """avgpool_process_slice_special's zapping before the 3x3 asm -> {(row, col): u8} over the
    padded extent: a top pad row is ``vavg_rnd(row 0, row 1)``, a bottom one ``vavg_rnd(row H-2,
    row H-1)`` (row_zap_2rows), then on every row including those a left pad column is
    ``vavg_rnd(col 0, col 1)`` and a right one ``vavg_rnd(col W-1, col W-2)`` (avgpool_zap_lr)."""
    h, w = plan.in_h, plan.in_w
    px = {(r, c): int(img[r, c]) for r in range(h) for c in range(w)}
    rows = list(range(h))
    if plan.pad_t:
        for c in range(w):
            px[-1, c] = _avg_rnd(px[0, c], px[1, c])
        rows.insert(0, -1)
    if plan.pad_b:
        for c in range(w):
            px[h, c] = _avg_rnd(px[h - 2, c], px[h - 1, c])
        rows.append(h)
    for r in rows:
        if plan.pad_l or plan.pad_r:
            px[r, -1] = _avg_rnd(px[r, 0], px[r, 1])
            px[r, w] = _avg_rnd(px[r, w - 1], px[r, w - 2])
    return px


def avgpool_3x3_output(px: dict, plan: IntegralPlan, oy: int, ox: int) -> int:
    """avgpool_slice_hvx_3x3_stride1: the 9-pixel sum ``s`` (16 bit), ``(s*3641*2 + 0x8000) >> 16``
    (vmpy by 0x0e39 :<<1:rnd:sat), low byte."""
    s = sum(px[oy - plan.pad_t + i, ox - plan.pad_l + j] for i in range(3) for j in range(3))
    return ((s * 3641 * 2 + 0x8000) >> 16) & 0xFF


def avgpool_2x2_output(img, plan: IntegralPlan, oy: int, ox: int) -> int:
    """avgpool_2x2_inner_func (window 2x2, stride_w 2): edge rows / columns replicate the
    nearest input row / column (left: vdelta copy, right: copied column, top/bottom: the row
    pointers are clamped); ``sat_u8((sum4 + 2) >> 2)``."""
    h, w = plan.in_h, plan.in_w
    r0 = oy * plan.stride_h - plan.pad_t
    c0 = ox * 2 - plan.pad_l
    rows = [min(max(r, 0), h - 1) for r in (r0, r0 + 1)]
    cols = [min(max(c, 0), w - 1) for c in (c0, c0 + 1)]
    return saturate_u8((sum(int(img[r, c]) for r in rows for c in cols) + 2) >> 2)


def avgpool_reduce_1x1_params(lo: int, hi: int, pad_sum, plan: IntegralPlan, x_min, x_max):
    """avgpool_reduce_to_1x1's ranging -> (out_min, out_max, offs, fac, rsh).

    ``rdiff = (max-min)/(255*winsize)``, ``in_zero = -min/rdiff``; ``lo``/``hi``: the extremes of
    the channels' int32 window sums. ``pad_sum`` (None when C % 32 == 0): the sum of a depth-
    padding lane. The C means to replace those by ``roundf_i32(in_zero)``, but its mask
    (``Q6_V_vand_QR(q, 1)``, ``Q6_V_vandor_VQR(.., 1 or 2)``) sets only byte 0 of each word, so only
    the low byte is replaced: ``(pad_sum & ~0xff) | (roundf_i32(in_zero) & 0xff)`` joins the extremes.
    ``gmin = fminf(0, lo - in_zero)*rdiff``, ``gmax = fmaxf(fmaxf(0, hi - in_zero)*rdiff,
    gmin + 0.001)``, both widened by ``255.1*rdiff/range`` when the range is below
    ``255.1*rdiff``; ``quantize_adjust_range``; ``scale = rdiff*recip``, ``rsh = min(31, max(0,
    -getexp(scale)))``, ``fac = sat16(roundf_i32(ldexp(scale, rsh+15)))``, ``offs =
    roundf_i32(2*(outz/actual_scale - in_zero))`` (``outz = -min*recip`` when min < 0).
    """
    winsize = i2f(plan.win_h * plan.win_w)
    rdiff = fdiv(fsub(f32(x_max), f32(x_min)), fmul(255.0, winsize))
    in_zero = fdiv(-f32(x_min), rdiff)
    if pad_sum is not None:
        vpad = wrap32((pad_sum & ~0xFF) | (roundf_i32(in_zero) & 0xFF))
        lo, hi = min(lo, vpad), max(hi, vpad)
    gmin = fmul(fminf(0.0, fsub(i2f(lo), in_zero)), rdiff)
    gmax = fmaxf(fmul(fmaxf(0.0, fsub(i2f(hi), in_zero)), rdiff), fadd(gmin, f32(0.001)))
    out_range = fsub(gmax, gmin)
    if fmul(f32(255.1), rdiff) >= out_range:
        expfac = fdiv(fmul(f32(255.1), rdiff), out_range)
        gmin, gmax = fmul(gmin, expfac), fmul(gmax, expfac)
    ar = quantize_adjust_range(gmin, gmax)
    scale = fmul(rdiff, ar.recip_stepsize)
    rsh = min(31, max(0, -flt_getexp(scale)))
    fac = saturate_i16(roundf_i32(flt_ldexp(scale, rsh + 15)))
    outz = 0.0
    if ar.minval < 0.0:
        outz = fdiv(fmul(-ar.minval, ar.recip_stepsize), flt_ldexp(i2f(fac), -(rsh + 15)))
    return ar.minval, ar.maxval, roundf_i32(fmul(2.0, fsub(outz, in_zero))), fac, rsh


def avgpool_pad_lane_sum(c: int, plan: IntegralPlan, x_min, x_max, pad_lane_code=None):
    """The sum of one depth-padding lane over the pooled input (None when C % 32 == 0). The
    lanes hold what the producer left there: by default the input's zero code (a d32 conv writes
    its bias-only value, the zero code, into padded channels); ``pad_lane_code`` overrides it."""
    if c % 32 == 0:
        return None
    code = get_qu8_level_size_zero(f32(x_min), f32(x_max))[0] if pad_lane_code is None else int(pad_lane_code)
    return code * plan.in_h * plan.in_w


def avgpool_reduce_1x1_ref(x, plan: IntegralPlan, x_min: float, x_max: float, pad_lane_code=None):
    """avgpool_reduce_to_1x1_worker_thread / _post_worker_thread (output 1x1) -> (y, min, max).

    Per (batch, channel) the int32 sum ``S`` over the (trimmed) input; the output range comes
    from the data (``avgpool_reduce_1x1_params``, padding lanes from ``avgpool_pad_lane_sum``);
    ``y = sat_u8(sat16((((2S + offs)*fac*2 + 0x8000) >> 16 >> rsh) + 1) >> 1)`` (vmpyo:<<1:rnd:sat,
    vasr, vasr:rnd:sat, vpack:sat).
    """
    n, _, _, c = x.shape
    sums = [[sum(int(v) for v in x[b, :plan.in_h, :plan.in_w, ch].ravel()) for ch in range(c)] for b in range(n)]
    flat = [s for row in sums for s in row]
    pad = avgpool_pad_lane_sum(c, plan, x_min, x_max, pad_lane_code)
    mn, mx, offs, fac, rsh = avgpool_reduce_1x1_params(min(flat), max(flat), pad, plan, x_min, x_max)
    y = np.zeros((n, 1, 1, c), dtype=np.uint8)
    for b in range(n):
        for ch in range(c):
            d = wrap32(2 * sums[b][ch] + offs)
            v = sat((d * fac * 2 + 0x8000) >> 16, INT32_MIN, INT32_MAX) >> rsh
            y[b, 0, 0, ch] = saturate_u8(saturate_i16((v + 1) >> 1))
    return y, mn, mx


def avgpool_d32_path(plan: IntegralPlan) -> str:
    """Which avgpool_execute path (``use_hvx``): "reduce_1x1", "3x3" (avgpool_slice_hvx_3x3_stride1,
    input at least 2x2; the zap-padding checks hold for Convert_to_d32 / supernode layouts),
    "2x2" (stride_w 2) or "integral"."""
    if plan.out_h == 1 and plan.out_w == 1:
        return "reduce_1x1"
    if (plan.win_h, plan.win_w, plan.stride_h, plan.stride_w) == (3, 3, 1, 1) and plan.in_w > 1 and plan.in_h > 1:
        return "3x3"
    if (plan.win_h, plan.win_w, plan.stride_w) == (2, 2, 2):
        return "2x2"
    return "integral"


def avgpool_d32_ref(x, *, x_min, x_max, kernel, strides, padding, pad_lane_code=None):
    """QuantizedAvgPool_8_d32 (what every QuantizedAvgPool_8 runs as) -> (y, y_min, y_max).

    ``integral_buffer_plan``, then the path of ``avgpool_d32_path``; the output range is the
    input's except for a 1x1 output (``avgpool_reduce_1x1_ref``; ``pad_lane_code``: see
    ``avgpool_pad_lane_sum``).
    """
    x = np.asarray(x)
    n, h, w, c = x.shape
    plan = integral_buffer_plan((h, w), kernel, strides, padding)
    path = avgpool_d32_path(plan)
    if path == "reduce_1x1":
        return avgpool_reduce_1x1_ref(x, plan, x_min, x_max, pad_lane_code)
    y = np.zeros((n, plan.out_h, plan.out_w, c), dtype=np.uint8)
    for b in range(n):
        for ch in range(c):
            img = x[b, :, :, ch]
            if path == "3x3":
                px = avgpool_3x3_zapped(img, plan)
                out = lambda oy, ox: avgpool_3x3_output(px, plan, oy, ox)  # noqa: E731
            elif path == "2x2":
                out = lambda oy, ox: avgpool_2x2_output(img, plan, oy, ox)  # noqa: E731
            else:
                ii = avgpool_integral_image(img, plan)
                out = lambda oy, ox: avgpool_integral_output(ii, plan, oy, ox)  # noqa: E731
            for oy in range(plan.out_h):
                for ox in range(plan.out_w):
                    y[b, oy, ox, ch] = out(oy, ox)
    return y, f32(x_min), f32(x_max)


# ----------------------------------------------------------------------------------------------
# QuantizedMean_8 (op_reducing_mean.c): MACE's Reduce (mean)
# ----------------------------------------------------------------------------------------------

def quantize_multiplier_smaller_than_one(m: float) -> tuple[int, int]:
    """quantize.h ``QuantizeMultiplierSmallerThanOne`` -> (multiplier Q31, right shift); (0, 0) where
    the C fails ("Unable to determine quantized multiplier", the op carries on with them)."""
    if not 0.0 < m < 1.0:
        return 0, 0
    q_fixed = math.floor(fmul(flt_getfrac(m), 2147483648.0))
    shift = -flt_getexp(m)
    if q_fixed == 1 << 31:
        q_fixed, shift = q_fixed // 2, shift - 1
    return (0, 0) if shift < 0 else (q_fixed, shift)


def mean_params(x_min, x_max, out_min, out_max, divisor: int) -> tuple[int, int, int, int, float, float]:
    """reducing_mean_execute + set_output_scaling_for_mean's scalars ->
    (in_offset, out_offset, multiplier, shift, out_min, out_max).

    The input range is zero-adjusted (``adjust_minmax_for_zero``); the output range is the given
    one (MACE passes it), else the adjusted input range; ``multiplier, shift =
    QuantizeMultiplierSmallerThanOne(fminf(0.99999, in_step/(out_step*divisor)))``.
    """
    mn, mx, _ = adjust_minmax_for_zero(f32(x_min), f32(x_max))
    omin = mn if out_min is None else f32(out_min)
    omax = mx if out_max is None else f32(out_max)
    in_offset, in_step = get_qu8_level_size_zero(mn, mx)
    out_offset, out_step = get_qu8_level_size_zero(omin, omax)
    mult, shift = quantize_multiplier_smaller_than_one(fminf(f32(0.99999), fdiv(in_step, fmul(out_step, i2f(divisor)))))
    return in_offset, out_offset, mult, shift, omin, omax


def mean_requant(total: int, divisor: int, p) -> int:
    """set_output_scaling_for_mean on one int32 sum: ``sat(sum - in_offset*divisor)``, the Q31
    rounding doubling multiply (``q6op_Vw_vmpy_VwVw_s1_rnd_sat``), ``RoundingDivideByPOT`` (rounds
    half up), ``+ out_offset`` (sat), low 16 bits (``vpacke``), ``sat_u8``."""
    in_offset, out_offset, mult, shift = p[:4]
    v = sat(total - wrap32(in_offset * divisor), INT32_MIN, INT32_MAX)
    v = sat((v * mult + (1 << 30)) >> 31, INT32_MIN, INT32_MAX)
    v = sat(v + (((1 << shift) >> 1) if shift <= 31 else 0), INT32_MIN, INT32_MAX) >> min(shift, 31)
    v = sat(v + out_offset, INT32_MIN, INT32_MAX)
    return saturate_u8(wrap16(v))


def quantized_mean_ref(x, *, x_min, x_max, axes, out_min=None, out_max=None):
    """QuantizedMean_8 (keep dims) -> (y, y_min, y_max): int32 sums over ``axes`` then ``mean_requant``."""
    x = np.asarray(x)
    axes = tuple(sorted({int(a) % x.ndim for a in axes}))
    divisor = int(np.prod([x.shape[a] for a in axes])) if axes else 1
    p = mean_params(x_min, x_max, out_min, out_max, divisor)
    shape = tuple(1 if d in axes else n for d, n in enumerate(x.shape))
    y = np.zeros(shape, dtype=np.uint8)
    for idx in np.ndindex(*shape):
        sl = tuple(slice(None) if d in axes else idx[d] for d in range(x.ndim))
        y[idx] = mean_requant(sum(int(v) for v in x[sl].ravel()), divisor, p)
    return y, p[4], p[5]


# ----------------------------------------------------------------------------------------------
# Quantize / QuantizeINPUT_f_to_8 / DequantizeOUTPUT_8tof
# ----------------------------------------------------------------------------------------------

def quantize_ref(x, *, min, max):  # noqa: A002 - nnlib's names
    """nnlib ``Quantize`` (``quantize_execute_ref``) -> (q, out_min, out_max).

    ``quantize_adjust_range_and_check`` (sane: finite, min <= 0 <= max, max-min >= 1e-8),
    then ``q = saturate_u8(roundf_i32((x - min')*recip))``.
    """
    mn, mx = f32(min), f32(max)
    if not check_range_is_sane(mn, mx):
        raise MaceqError(f"nnlib Quantize: invalid range for quantize: {mn} ... {mx}")
    ar = quantize_adjust_range(mn, mx)
    flat = np.asarray(x, dtype=np.float32).ravel()
    q = np.zeros(flat.shape, dtype=np.uint8)
    for i in range(flat.size):
        q[i] = saturate_u8(roundf_i32(fmul(fsub(float(flat[i]), ar.minval), ar.recip_stepsize)))
    return q.reshape(np.shape(x)), ar.minval, ar.maxval


@dataclass(frozen=True)
class HvxQuantParms:
    """``struct hvx_quant_parms`` (``find_scaling_for_hvx_quant``)."""

    scaling: int
    min_offset: int
    common_exp: int
    minval: float
    maxval: float


def find_scaling_for_hvx_quant(neg_min: float, max_: float) -> HvxQuantParms:
    """``find_scaling_for_hvx_quant({-min, max})``: adjust_minmax_for_zero, then the integer parms."""
    if not (math.isfinite(neg_min) and math.isfinite(max_)):
        raise MaceqError("nnlib QuantizeINPUT: inf or NaN input to quantization")
    minv = -f32(neg_min)
    maxv = fmaxf(fadd(minv, _F1E18), f32(max_))
    if minv < 0.0:
        minv, maxv, _ = adjust_minmax_for_zero(minv, maxv)
    range_f = fsub(maxv, minv)
    rbits = f32_bits(fmul(range_f, f32(1.003921569)))
    rangeexp = (rbits >> 23) & 0xFF
    common_exp = rangeexp + 4
    mbits = f32_bits(minv)
    minval_exp = (mbits >> 23) & 0xFF
    min_offset = (mbits & 0x7FFFFF) | (1 << 23)
    d = (common_exp - minval_exp) & 0xFFFFFFFF  # uint32 subtraction in the C
    min_offset = 0 if d >= 24 else min_offset >> d
    rangemant = ((rbits & 0x7FFFFF) | (1 << 23)) >> (common_exp - rangeexp)
    scaling = 0xFFFFFFFF // rangemant
    min_offset += rangemant >> 9
    return HvxQuantParms(scaling, min_offset, common_exp, minv, maxv)


def hvx_vlsr_word(u: int, amount: int) -> int:
    """HVX ``vlsr(Vu.w, Vv.w)`` on one lane: the amount's low 6 bits, sign-extended (-32..31);
    a negative amount shifts left within the 32-bit lane (found under QEMU: ``run.py``'s
    Quantize comparison with values up to 2^126 times the range)."""
    s = ((amount & 0x3F) ^ 0x20) - 0x20
    if s >= 0:
        return (u & 0xFFFFFFFF) >> s
    return (u << -s) & 0xFFFFFFFF


def hvx_quantize_word(x: float, p: HvxQuantParms) -> int:
    """``quantize_floats_to_8b_asm`` (autoquantize_h.S) on one value.

    ``m = vlsr(mant24(x), min(common_exp - exp(x), 31))`` (``hvx_vlsr_word``: a value above the
    range shifts left), negated for negative x, ``+ min_offset`` (int32); then ``vmpye`` by the
    16-bit ``scaling``: ``(m*scaling) >> 16``, ``vpack :sat`` to uint16, ``vpacko``: the high byte.
    In range this is the top byte of ``(m + min_offset)*scaling``; outside it saturates to 0 / 255.
    """
    bits = f32_bits(x)
    mant = hvx_vlsr_word((bits & 0x7FFFFF) | 0x800000, min(p.common_exp - ((bits >> 23) & 0xFF), 31))
    if bits >= 0x80000000:
        mant = -mant
    word = (wrap32(mant + p.min_offset) * (p.scaling & 0xFFFF)) >> 16
    return sat(word, 0, 0xFFFF) >> 8


def quantize_hvx_ref(x, *, min, max):  # noqa: A002 - nnlib's names
    """nnlib ``Quantize`` (``quantize_execute_opt``) -> (q, out_min, out_max).

    ``find_scaling_for_hvx_quant({-min, max})`` (raises on inf / NaN), then
    ``hvx_quantize_word`` per element; the output range is the adjusted one. (``Quantize_ref``,
    ``quantize_execute_ref``, is ``quantize_ref``.)
    """
    p = find_scaling_for_hvx_quant(-f32(min), f32(max))
    flat = np.asarray(x, dtype=np.float32).ravel()
    q = np.array([hvx_quantize_word(float(v), p) for v in flat], dtype=np.uint8)
    return q.reshape(np.shape(x)), p.minval, p.maxval


def quantize_input_ref(x):
    """QuantizeINPUT_f_to_8 (``autoquantize_work``) -> (q, out_min, out_max).

    Range ``[min(0, x), max(0, x)]`` of the whole tensor, ``find_scaling_for_hvx_quant``, then
    ``hvx_quantize_word`` per element (HVX fixed point; the asm ``quantize_floats_to_8b_asm``
    is assumed to compute ``requantize_words``, which the d32 C path uses).
    """
    flat = np.asarray(x, dtype=np.float32).ravel()
    lo = hi = 0.0
    for v in flat:
        v = float(v)
        if math.isnan(v) or math.isinf(v):
            raise MaceqError("nnlib QuantizeINPUT: inf or NaN input to quantization")
        lo, hi = min(lo, v), max(hi, v)
    p = find_scaling_for_hvx_quant(-lo if lo < 0 else 0.0, hi)
    q = np.array([hvx_quantize_word(float(v), p) for v in flat], dtype=np.uint8)
    return q.reshape(np.shape(x)), p.minval, p.maxval


def dequantize_step_zero(min_: float, max_: float) -> tuple[float, int]:
    """(stepsize, qzero) of ``dequantize_execute`` / ``output_dequantize_execute_opt``."""
    mn, mx = f32(min_), f32(max_)
    step = flt_div_255(fmaxf(_F1E18, fsub(mx, mn)))
    if step < 0.0 or step >= 2.0 ** 121:
        raise MaceqError(f"nnlib Dequantize: infeasible quantization step {step}")
    if step < 2.0 ** -126:
        return step, 0
    return step, saturate_u8(roundf_i32(fdiv(-mn, step)))


def hvx_dequantize_value(d: int, qstep: float) -> float:
    """``hvx_dequantize_64xh`` for one lane ``d = q - qzero``: |d|*mantissa, normalised, +0x80 >> 8."""
    if d == 0:
        return 0.0
    ub = f32_bits(qstep)
    scale = (ub & 0x7FFFFF) | 0x800000
    base_exp = ((ub >> 23) & 0xFF) + 8
    prod = abs(d) * scale  # < 2^32
    clz = 32 - prod.bit_length()
    prod = (prod << clz) & 0xFFFFFFFF
    mant = (prod + 0x80) & 0xFFFFFFFF
    overflow = mant < 0x80000000
    mant >>= 8
    exp = base_exp - clz + (1 if overflow else 0)
    bits = ((1 << 31) if d < 0 else 0) | ((exp & 0xFF) << 23) | (mant & 0x7FFFFF)
    return bits_f32(bits)


def dequantize_ref(q, *, min, max):  # noqa: A002
    """DequantizeOUTPUT_8tof -> float32 array: ``(q - qzero)*stepsize`` with HVX mantissa rounding."""
    step, qzero = dequantize_step_zero(min, max)
    flat = np.asarray(q, dtype=np.uint8).ravel()
    out = np.zeros(flat.shape, dtype=np.float32)
    if step >= 2.0 ** -126:
        for i in range(flat.size):
            out[i] = hvx_dequantize_value(int(flat[i]) - qzero, step)
    return out.reshape(np.shape(q))
