"""Scalar transcription of XiaoMi/nnlib (Hexagon DSP) arithmetic: the oracle for ``dsp.py``.

Every function here follows one C function of XiaoMi/nnlib step by step, in plain Python
ints and explicit binary32 rounding (``f32``) wherever the C computes in ``float``. Nothing is
vectorised; the loops are the C loops. ``runtime/kernels/dsp.py`` holds the fast numpy
kernels, which the tests prove equal to these on every element.

Upstream files (XiaoMi/nnlib as stored in the code index; the newest stored version of each):

- ``hexagon/include/quantize.h``: ``quantize_uint8``, ``quantize_uint``,
  ``get_qu8_level_size_zero``, ``quantize_adjust_range``, ``roundf_i32``, ``roundf_u32``,
  ``flt_div_255``, ``flt_getexp``/``flt_getfrac``/``flt_ldexp``, ``check_range_is_sane``.
- ``hexagon/src/quantize.c``: ``adjust_minmax_for_zero``,
  ``adjust_minmax_for_zero_with_constraints``, ``quantize_adjust_range_and_check``.
- ``hexagon/include/nn_graph_padding.h``: ``nn_pad_compute_outsize_padding``.
- ``hexagon/include/nn_asm_ops.h``: ``fast_roundf`` (``Q6_R_convert_sf2w_R`` on Hexagon).
- ``hexagon/ops/src/op_supernode.c``: ``supernode_execute_ref`` / ``supernode_check_ref``
  (``Supernode_8x8p32to8``, flat layout, int32 bias).
- ``hexagon/ops/src/op_dwise_snode_8bit.c`` (and the newer depthwise file that holds
  ``nn_ops_for_DepthwiseSupernode_8x8p32to8_d32``): ``setup_initial_output_range``,
  ``fill_info_minmax_basics``, ``fill_bias_buf``, ``dwise_sumb``, ``dwise_rearrange_weights``,
  ``dwise_supernode_recalculate_strategy``, ``supernode_execute_workitem_check_for_retry``,
  ``round_up_quarter_octave``; ``hexagon/src/dwconv2dbbb_c.c`` (C reference of the HVX
  depthwise kernel: ``sum <<= recip_shift; (sum*recip + 2^30) >> 31``).
  The flat ``DepthwiseSupernode_8x8p32to8`` is ``dwise_unsup_nond32`` (rejected), so the d32
  op is the only depthwise nnlib runs.
- ``hexagon/ops/src/op_fully_connected.c`` (the file that defines ``SuperFC_8x8p32to8``):
  ``superfc_execute_ref``.
- The QuantizedAdd file (``qadd_888_check``, ``addsub_flat_direct_execute``,
  ``set_addsub_scaling_for_output_range``, ``check_addsub_need_rerun``, ``add_core_hvx``,
  ``add_core_hvx_underrange``): the same-shape QuantizedAdd_8p8to8 datapath. HVX intrinsic
  semantics from the Hexagon V6x HVX manual as implemented by QEMU
  (``target/hexagon/mmvec/macros.h``: ``fVROUND`` adds ``1 << (shamt-1)`` only when shamt > 0).
- ``hexagon/ops/src/op_concat.c`` (``concat_execute``, ``concat_execute_slice_ref`` and the
  unity-gain copy shortcut of ``concat_execute_slice_asm``), ``op_maxpool.c``,
  ``op_avgpool.c`` (``*_execute_slice_ref``).
- The quantize file (``op_quantize.c``): ``quantize_execute_ref``,
  ``find_scaling_for_hvx_quant`` + ``requantize_words`` (QuantizeINPUT_f_to_8's fixed-point
  quantizer), ``hvx_do_dequantize`` (DequantizeOUTPUT_8tof).
- XiaoMi/mace ``tools/python/quantize/quantize_util.py`` ``adjust_range_for_hexagon`` and
  ``quantize_bias_for_hexagon``; ``tools/python/transform/hexagon_converter.py`` (which
  nnlib op each MACE op becomes, and which ranges it passes).

Conventions. ``f32(v)``: round to binary32, nearest-even (a single float op on binary32
operands computed in double and rounded once is exact: double has more than 2*24+2 bits).
Hexagon is assumed to evaluate ``float`` expressions in binary32 (FLT_EVAL_METHOD 0) without
contracting ``a*b+c`` into an fma except where the source uses the fma intrinsic
(``flt_div_255``). C ``(int)f`` is ``convert_sf2w_chop`` (truncate, saturate); C ``roundf`` rounds
half away; ``fast_roundf`` is ``convert_sf2w`` (nearest-even, saturate). int32 overflow wraps.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from enum import IntEnum
from fractions import Fraction

import numpy as np

from maceq.errors import MaceqError

INF = float("inf")
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


# ----------------------------------------------------------------------------------------------
# binary32 helpers
# ----------------------------------------------------------------------------------------------

def f32(v) -> float:
    """Round a Python float/int to the nearest binary32 (ties to even); overflow gives +-inf."""
    with np.errstate(over="ignore"):
        return float(np.float32(v))


def fadd(a: float, b: float) -> float:
    return f32(a + b)


def fsub(a: float, b: float) -> float:
    return f32(a - b)


def fmul(a: float, b: float) -> float:
    return f32(a * b)


def fdiv(a: float, b: float) -> float:
    if b == 0.0:
        if a == 0.0 or math.isnan(a):
            return math.nan
        return math.copysign(INF, a) * math.copysign(1.0, b)
    return f32(a / b)


def i2f(n: int) -> float:
    """C ``(float)int``: nearest-even conversion of an integer."""
    return f32(float(n)) if abs(n) < (1 << 53) else f32_from_fraction(Fraction(n))


def fminf(a: float, b: float) -> float:
    if math.isnan(a):
        return b
    if math.isnan(b):
        return a
    return a if a < b else b


def fmaxf(a: float, b: float) -> float:
    if math.isnan(a):
        return b
    if math.isnan(b):
        return a
    return a if a > b else b


def f32_from_fraction(q: Fraction) -> float:
    """The binary32 nearest to the exact rational q (ties to even), with subnormals and overflow."""
    if q == 0:
        return 0.0
    sign = -1.0 if q < 0 else 1.0
    q = abs(q)
    e = q.numerator.bit_length() - q.denominator.bit_length()
    if Fraction(2) ** e > q:
        e -= 1
    e = max(e, -126)  # subnormals share the 2^-149 grid
    scaled = q * Fraction(2) ** (23 - e)
    n = scaled.numerator // scaled.denominator
    rem = scaled - n
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n % 2 == 1):
        n += 1
    val = Fraction(n) * Fraction(2) ** (e - 23)
    if val > Fraction(int("1" * 24, 2)) * Fraction(2) ** (127 - 23):
        return sign * INF
    return sign * float(val)


def fmaf(a: float, b: float, c: float) -> float:
    """Fused a*b + c, rounded once to binary32 (Hexagon ``sfmpyacc``)."""
    return f32_from_fraction(Fraction(a) * Fraction(b) + Fraction(c))


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def bits_f32(u: int) -> float:
    return struct.unpack("<f", struct.pack("<I", u & 0xFFFFFFFF))[0]


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
    return fmaf(x, _DIV255_K1, fmul(_DIV255_K2, x))


def c_trunc_i32(x: float) -> int:
    """C ``(int)x`` on Hexagon (``convert_sf2w_chop``): truncate toward zero, saturate."""
    if math.isnan(x):
        raise MaceqError("nnlib: float-to-int conversion of NaN")
    if x >= 2147483648.0:
        return INT32_MAX
    if x <= -2147483648.0:
        return INT32_MIN
    return int(x)


def c_roundf(x: float) -> float:
    """libm ``roundf``: nearest integer, ties away from zero (returned as a float)."""
    if math.isnan(x) or math.isinf(x):
        return x
    t = math.trunc(x)
    if abs(x - t) >= 0.5:
        t += 1 if x > 0 else -1
    return float(t)


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


def mace_adjust_range_for_hexagon(in_min: float, in_max: float) -> tuple[float, int, float, float]:
    """MACE quantize_util.py ``adjust_range_for_hexagon`` (Python float64) -> (scale, zero, min, max).

    MACE's converter applies this to weights and to every activation range it hands nnlib.
    """
    out_max = max(0.0, float(in_max))
    out_min = min(0.0, float(in_min))
    scale = (out_max - out_min) / 255.0
    eps = 1e-6
    if out_min < -eps and out_max > eps:
        zero = -out_min / scale
        zero_int = int(round(zero))
        ceil = int(math.ceil(zero))
        keep_max = (ceil - zero) / out_max < (zero + 1 - ceil) / -out_min
        if zero_int <= 0 or (zero_int < 254 and keep_max):
            zero_int = ceil
            scale = out_max / (255.0 - zero_int)
        else:
            scale = -out_min / zero_int
    elif out_min > -eps:
        zero_int = 0
    else:
        zero_int = 255
    return scale, zero_int, -zero_int * scale, (255 - zero_int) * scale


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

    # BEGIN CONV2D: raw sums (no bias); taps outside the input are skipped
    tmp = np.zeros((n, oh, ow, o), dtype=np.int64)
    maxsum = minsum = 0
    for b in range(n):
        for oy in range(oh):
            iy0 = oy * sh - adj_y
            for ox in range(ow):
                ix0 = ox * sw - adj_x
                for oz in range(o):
                    s = 0
                    for fy in range(kh):
                        iy = iy0 + fy
                        if iy < 0 or iy >= h:
                            continue
                        for fx in range(kw):
                            ix = ix0 + fx
                            if ix < 0 or ix >= wd:
                                continue
                            for fz in range(c):
                                s = wrap32(s + (int(x[b, iy, ix, fz]) - input_offset)
                                           * (int(w[fy, fx, fz, oz]) - filt_offset))
                    maxsum = max(maxsum, s)
                    minsum = min(minsum, s)
                    tmp[b, oy, ox, oz] = s

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


def supernode_ref_range(maxsum: int, minsum: int, out_level: float, out_min: float,
                        out_max: float) -> tuple[float, float]:
    """supernode_check_ref + the retry recursion of supernode_execute_ref -> (final_min, final_max).

    The recursion re-runs the whole node; only the range carries over and the raw sums do
    not depend on it, so the loop below keeps the range state alone. Not given (+-inf):
    ``maxval = 1/128``, ``minval = -maxval``. After a pass with ``minval_offset = -min/out_level``:
    if max is free and ``f32(maxsum+offset)*out_level > max-min``, double max until it fits;
    else if min is free and ``f32(minsum+offset)*out_level < 0``, double min (re-offsetting).
    """
    maxval, minval = f32(out_max), f32(out_min)
    max_pre = min_pre = True
    if maxval == INF:
        max_pre, maxval = False, 1.0 / 128.0
    if minval == -INF:
        min_pre, minval = False, -maxval
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


# ----------------------------------------------------------------------------------------------
# d32 supernode family (DepthwiseSupernode_8x8p32to8_d32; Supernode d32 requantization model)
# ----------------------------------------------------------------------------------------------

@dataclass
class D32RangeState:
    """The ``supernode_info_new`` fields that carry the output range between retries."""

    out_min: float
    out_max: float
    spec_min: float
    spec_max: float
    flags: int  # bit 0: min given, bit 1: max given
    firstguess: bool


def setup_initial_output_range(spec_min: float, spec_max: float,
                               min_default: float = -0.125, max_default: float = 0.125) -> D32RangeState:
    """``setup_initial_output_range``: clamp to min <= 0 <= max, max >= min + 2^-7, fix the zero."""
    spec_min = fminf(f32(spec_min), 0.0)
    spec_max = fmaxf(fmaxf(f32(spec_max), 0.0), fadd(spec_min, 2.0 ** -7))
    mnp = spec_min != -INF
    mxp = spec_max != INF
    st = D32RangeState(spec_min if mnp else f32(min_default), spec_max if mxp else f32(max_default),
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

    ``final_scaling = max_k*prod/out_level`` with ``prod = in_level*filt_level``; on a first
    guess above 1.75 the range is re-centred; ``recip_shamt = 0`` if scaling <= 1 else its
    frexp exponent; ``recip_val = roundf_u32(scaling * 2^(31-shamt))`` capped at 0x7FFFFFFF.
    ``recip_shamt_must_be_zero`` is 0 for the depthwise node (the only d32 node modelled).
    """
    in_min, in_max = f32(in_min), f32(in_max)
    if not (math.isfinite(in_min) and math.isfinite(in_max)):
        raise MaceqError("nnlib supernode: input range not finite")
    in_max = fmaxf(in_max, fadd(in_min, f32(0.00001)))
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


def fill_bias_buf(bias, bias_min: float, bias_max: float, sc: D32Scaling, out_min: float, gemsumb) -> list[int]:
    """``fill_bias_buf`` (bias32): ``-gemsumb*in_offset + fast_roundf((b*ratio) + (-out_min/prod))``."""
    bias_level = fdiv(fsub(f32(bias_max), f32(bias_min)), 4294967296.0)
    ratio = fdiv(bias_level, sc.prod_level_size)
    min_out_prod_offset = fdiv(-out_min, sc.prod_level_size)
    out = []
    for i, g in enumerate(gemsumb):
        biasval = int(bias[i]) if i < len(bias) else 0
        minout = fadd(fmul(i2f(biasval), ratio), min_out_prod_offset)
        out.append(wrap32(-g * sc.in_offset + fast_roundf(minout)))
    return out


def d32_requant(s: int, recip_val: int, recip_shamt: int) -> tuple[int, int]:
    """dwconv2dbbb_c.c: ``s <<= shamt; l = (s*recip + 0x40000000) >> 31`` -> (clamped u8, (int)l)."""
    s = wrap32(s << recip_shamt)
    lsum = (s * recip_val + 0x40000000) >> 31
    return sat(lsum, 0, 255), wrap32(lsum)


def d32_check_for_retry(st: D32RangeState, sc: D32Scaling, minval: int, maxval: int) -> bool:
    """``supernode_execute_workitem_check_for_retry`` (output units); mutates ``st``; True = retry."""
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


def d32_execute(*, out_min, out_max, x_min, x_max, weights_level: float, bias, bias_min, bias_max, gemsumb,
                kernel):
    """The d32 supernode execute loop: (recalculate strategy, execute, check for retry) <= 5 times.

    ``kernel(sc, biasbuf) -> (y, vmin, vmax)`` computes the outputs and the min / max of the
    unclamped requantized values. Returns ``(y, out_min, out_max)``; raises after 5 passes
    ("can't find range for depthwise").
    """
    st = setup_initial_output_range(out_min, out_max)
    for _ in range(5):
        sc = fill_info_minmax_basics(st, x_min, x_max, weights_level)
        biasbuf = fill_bias_buf(bias, bias_min, bias_max, sc, st.out_min, gemsumb)
        y, vmin, vmax = kernel(sc, biasbuf)
        if not d32_check_for_retry(st, sc, vmin, vmax):
            return y, st.out_min, st.out_max
    raise MaceqError("nnlib supernode (d32): can't find an output range in 5 passes")


def _d32_scalar_kernel(shape, acc):
    """A ``d32_execute`` kernel from ``acc(b, y, x, channel, bias, in_offset) -> int32 sum``."""

    def kernel(sc: D32Scaling, biasbuf):
        y = np.zeros(shape, dtype=np.uint8)
        vmin, vmax = 1 << 24, -(1 << 24)  # supernode_execute_strategy's initial min / max
        for idx in np.ndindex(*shape):
            q, raw = d32_requant(acc(*idx, biasbuf[idx[3]], sc.in_offset), sc.recip_val, sc.recip_shamt)
            vmin, vmax = min(vmin, raw), max(vmax, raw)
            y[idx] = q
        return y, vmin, vmax

    return kernel


def dwise_gemsumb(w, filt_offset: int) -> list[int]:
    """``dwise_sumb``: per channel ``sum(w over the 4-padded taps, pads 0) - KH*KW*filt_offset``."""
    kh, kw, c, _ = w.shape
    kw4 = (kw + 3) & ~3
    out = []
    for ch in range(c):
        s = -filt_offset * kh * kw
        for fy in range(kh):
            for fx in range(kw4):
                s += int(w[fy, fx, ch, 0]) if fx < kw else 0
        out.append(s)
    return out


def depthwise_supernode_ref(x, w, bias, *, x_min, x_max, w_min, w_max, bias_min, bias_max, out_min, out_max,
                            strides, padding):
    """DepthwiseSupernode_8x8p32to8_d32 (d32 op; the flat one is rejected) -> (y, y_min, y_max).

    x: uint8 [N,H,W,C]; w: uint8 [KH,KW,C,1]. Transcribes dwise_supernode_check (weights
    padded to 4 taps with 0, ``gemsumb = sum(w) - KH*KW*filt_offset``), the recalculate /
    execute / retry loop (``d32_execute``), and the C reference kernel dwconv2dbbb_c.c
    (padding positions hold ``in_offset``; ``sum = bias + sum(in*w) - sum(in*filt_offset)``,
    then ``d32_requant``).
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
            iy = oy * sh - bh + fy
            for fx in range(kw):
                ix = ox * sw - bw + fx
                v = int(x[b, iy, ix, ch]) if (0 <= iy < h and 0 <= ix < wd) else in_offset  # zapped padding
                s = wrap32(s + v * int(w[fy, fx, ch, 0]))
                zum = wrap32(zum + v * filt_offset)
        return wrap32(s - zum)

    return d32_execute(out_min=out_min, out_max=out_max, x_min=x_min, x_max=x_max,
                       weights_level=fdiv(fsub(f32(w_max), f32(w_min)), fmul(255.0, 1.0)),
                       bias=bias, bias_min=bias_min, bias_max=bias_max, gemsumb=dwise_gemsumb(w, filt_offset),
                       kernel=_d32_scalar_kernel((n, oh, ow, c), acc))


def supernode_d32_model_ref(x, w, bias, *, x_min, x_max, w_min, w_max, bias_min, bias_max, out_min, out_max,
                            strides, padding):
    """Supernode with the d32 requantization (MODEL, not a transcription of the d32 conv).

    The d32 Supernode's HVX conv core was not read. This applies the d32 family's shared
    setup (setup_initial_output_range, fill_info_minmax_basics, fill_bias_buf with
    ``gemsumb = sum(w) - KH*KW*C*filt_offset``) and requantization (``d32_requant``) to the
    exact conv sum, as the depthwise d32 op does. Geometry as in the d32 ops (input size).
    """
    x = np.asarray(x)
    w = np.asarray(w)
    n, h, wd, c = x.shape
    kh, kw, kc, o = w.shape
    if kc != c:
        raise MaceqError(f"nnlib Supernode: filter depth {kc} != input depth {c}")
    sh, sw = strides
    padding = as_padding(padding)
    oh, ow, bh, bw = _geometry((h, wd), (kh, kw), (sh, sw), padding, op="Supernode")
    filt_offset = quantize_uint8(0.0, f32(w_min), f32(w_max))

    def acc(b: int, oy: int, ox: int, oz: int, s: int, in_offset: int) -> int:
        for fy in range(kh):
            iy = oy * sh - bh + fy
            for fx in range(kw):
                ix = ox * sw - bw + fx
                inside = 0 <= iy < h and 0 <= ix < wd
                for fz in range(c):
                    v = int(x[b, iy, ix, fz]) if inside else in_offset
                    s = wrap32(s + v * (int(w[fy, fx, fz, oz]) - filt_offset))
        return s

    gemsumb = [sum(int(v) for v in w[:, :, :, oz].ravel()) - kh * kw * c * filt_offset for oz in range(o)]
    return d32_execute(out_min=out_min, out_max=out_max, x_min=x_min, x_max=x_max,
                       weights_level=fdiv(fsub(f32(w_max), f32(w_min)), 255.0),
                       bias=bias, bias_min=bias_min, bias_max=bias_max, gemsumb=gemsumb,
                       kernel=_d32_scalar_kernel((n, oh, ow, o), acc))


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
# SuperFC_8x8p32to8 (superfc_execute_ref)
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


def addsub_execute(*, a_min, a_max, b_min, b_max, out_min, out_max, subtract: bool, core):
    """qadd_888_check + ``addsub_flat_direct_execute``'s range logic -> (y, out_min, out_max).

    ``core(sp, track) -> (y, lo, hi)`` runs the datapath (``lo``/``hi``: min / max of the
    step-(2) values, starting from ``intermed_zero``; only needed when ``track``). Models one
    execution after graph prepare (nnlib keeps a self-found range across runs).
    """
    out_min, out_max = f32(out_min), f32(out_max)
    # qadd_888_check
    min_pre = out_min != -INF
    max_pre = out_max != INF
    info_min = out_min if min_pre else 0.0
    info_max = out_max if max_pre else 0.5
    has_run_before = False
    if max_pre and min_pre:
        info_min, info_max, _ = adjust_minmax_for_zero_with_constraints(info_min, info_max, 3)
        has_run_before = True
    # addsub_flat_direct_execute
    za, sa = get_qu8_level_size_zero(f32(a_min), f32(a_max))
    zb, sb = get_qu8_level_size_zero(f32(b_min), f32(b_max))
    if not min_pre or not max_pre:
        if not subtract:
            out_max_all = fadd(f32(a_max), f32(b_max))
            out_min_all = fadd(f32(a_min), f32(b_min))
        else:
            out_max_all = fsub(f32(a_max), f32(b_min))
            out_min_all = fsub(f32(a_min), f32(b_max))
        out_max_all = fmaxf(out_max_all, fadd(out_min_all, f32(0.001)))
        if not has_run_before:
            ored_min = fmul(0.125, out_min_all)
            ored_max = fmul(0.125, out_max_all)
            if min_pre:
                info_min = out_min
                info_max = max(0.0, fadd(info_min, fsub(ored_max, ored_min)))
            elif max_pre:
                info_max = out_max
                info_min = fminf(0.0, fsub(info_max, fsub(ored_max, ored_min)))
            else:
                info_min, info_max = ored_min, ored_max
            info_min, info_max, _ = adjust_minmax_for_zero_with_constraints(
                info_min, info_max, int(min_pre) + 2 * int(max_pre))
    sp = set_addsub_scaling(info_min, info_max, (za, zb), (sa, sb), subtract=subtract,
                            fixed_range=min_pre and max_pre)
    need_minmax = not max_pre  # the C writes `!max_precalc || !max_precalc`
    while True:
        y, lo, hi = core(sp, need_minmax)
        if not need_minmax:
            return y, info_min, info_max
        # check_addsub_need_rerun
        actual_min = fmul(i2f(lo - sp.intermed_zero), sp.netscale)
        actual_max = fmul(i2f(hi - sp.intermed_zero), sp.netscale)
        out_range = fsub(actual_max, actual_min)
        out_range = fadd(out_range, fmaxf(fmul(0.15, out_range), f32(1e-4)))
        padded_min = min(0.0, fsub(actual_max, out_range))
        padded_max = max(0.0, fadd(actual_min, out_range))
        flags = int(min_pre) + 2 * int(max_pre)
        nmin, nmax, adj = info_min, info_max, False
        if not flags & 1 and actual_min < nmin:
            nmin, adj = padded_min, True
        if not flags & 2 and actual_max > nmax:
            nmax, adj = padded_max, True
        if not adj:
            return y, info_min, info_max
        if flags & 1:
            nmin = out_min
        if flags & 2:
            nmax = out_max
        info_min, info_max = nmin, nmax
        if info_min < 0.0:
            info_min, info_max, _ = adjust_minmax_for_zero_with_constraints(info_min, info_max, flags)
        sp = set_addsub_scaling(info_min, info_max, (za, zb), (sa, sb), subtract=subtract, fixed_range=False)
        need_minmax = False


def quantized_addsub_ref(a, b, *, a_min, a_max, b_min, b_max, out_min=-INF, out_max=INF, subtract: bool = False):
    """QuantizedAdd_8p8to8 on same-shape inputs (``addsub_flat_direct_execute``) -> (y, y_min, y_max).

    ``subtract=True`` runs the same datapath with ``operator = op_subtract`` (negative b scale),
    which is what QuantizedSub_8p8to8_d32 computes; the flat QuantizedSub_8p8to8 is rejected
    by its check ("non d32 sub not supported").
    """
    a = np.asarray(a)
    b = np.asarray(b)
    if a.shape != b.shape:
        raise MaceqError(f"nnlib QuantizedAdd: shapes {a.shape} and {b.shape} differ (broadcast runs "
                         "quant_add_spec_asm, not modelled)")
    flat_a, flat_b = a.ravel(), b.ravel()

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
        return y.reshape(a.shape), lo, hi

    return addsub_execute(a_min=a_min, a_max=a_max, b_min=b_min, b_max=b_max, out_min=out_min, out_max=out_max,
                          subtract=subtract, core=core)


# ----------------------------------------------------------------------------------------------
# QuantizedConcat_8, QuantizedMaxPool_8, QuantizedAvgPool_8
# ----------------------------------------------------------------------------------------------

def concat_params(in_ranges) -> tuple[float, float, list[tuple[int, int]]]:
    """``concat_execute``'s output range and each input's (offset, gain) -> (min, max, [(offset, gain)])."""
    out_min = f32(in_ranges[0][0])
    out_max = f32(in_ranges[0][1])
    for mn, mx in in_ranges:
        out_min = fminf(out_min, f32(mn))
        out_max = fmaxf(out_max, f32(mx))
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


def maxpool_ref(x, *, x_min, x_max, kernel, strides, padding):
    """QuantizedMaxPool_8 (``maxpool_execute_slice_ref``): max over the clipped window, from 0."""
    x = np.asarray(x)
    n, h, w, c = x.shape
    padding = as_padding(padding)
    oh, ow, adj_y, adj_x = _geometry((h, w), kernel, strides, padding, op="QuantizedMaxPool")
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


def hvx_quantize_word(x: float, p: HvxQuantParms) -> int:
    """``requantize_words`` + the two ``vpacko`` packs: the top byte of ``(mant' + min_offset)*scaling``."""
    bits = f32_bits(x)
    neg = bits >= 0x80000000
    e = (bits >> 23) & 0xFF
    mant = (bits & 0x7FFFFF) | 0x800000
    shift = min(p.common_exp - e, 31)
    if shift < 0:
        raise MaceqError("nnlib QuantizeINPUT: value outside the quantization range")
    mant >>= shift
    if neg:
        mant = -mant
    mant = wrap32(mant + p.min_offset)
    prod = (mant * p.scaling) & 0xFFFFFFFF  # vmpyi_VwRh: low 32 bits
    return prod >> 24


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
