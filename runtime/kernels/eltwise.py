"""MACE CPU uint8 Eltwise SUM / SUB as the ARM NEON build computes it.

Upstream sources (XiaoMi/mace): ``mace/ops/arm/q8/eltwise.cc`` (the NEON delegator, which the
uint8 ``EltwiseOp`` in ``mace/ops/eltwise.cc`` calls when MACE_ENABLE_NEON is set), gemmlowp
``fixedpoint/fixedpoint.h`` and ``fixedpoint_neon.h``, and ``QuantizeMultiplier`` in
``mace/core/quantize.h``.

Parameters (double precision, from the float32 scales stored in the model)::

    left_shift = 20
    doubled  = 2 * max(s_a, s_b)                     # float32 doubling, exact
    M_a, e_a = QuantizeMultiplier(s_a / doubled)     # one of them is exactly (2^30, 0)
    M_b, e_b = QuantizeMultiplier(s_b / doubled)     # e_a, e_b <= 0
    M_o, e_o = QuantizeMultiplier(doubled / (2^20 * s_out))

The flat element range is split like the C++ loops: indices below ``8 * (size // 8)`` go
through the NEON body, the last ``size % 8`` through the scalar tail. With
``srdhm = SaturatingRoundingDoublingHighMul`` (= VQRDMULH: floor(a*b/2^31 + 1/2)) and
``rdbp = RoundingDivideByPOT`` (ties away from zero; gemmlowp's NEON version, VQADD fix-up
then VRSHL, gives the same values as the scalar one):

NEON body (per element)::

    x = (a - zp_a) << 20;  y = (b - zp_b) << 20
    x = srdhm(x, M_a) >> -e_a        # VSHL by a negative count: arithmetic shift, floor
    y = srdhm(y, M_b) >> -e_b
    r = rdbp(srdhm(x +- y, M_o), -e_o)
    r16 = int16(r)                   # VMOVN: keeps the low 16 bits (wraps)
    out = sat_u8(int16(r16 + zp_out))  # VADDQ_S16 wraps, VQMOVUN saturates to [0, 255]

Scalar tail (identical to TFLite's ADD/SUB reference arithmetic)::

    x = rdbp(srdhm(x, M_a), -e_a);  y = rdbp(srdhm(y, M_b), -e_b)
    out = clamp(rdbp(srdhm(x +- y, M_o), -e_o) + zp_out, 0, 255)

The body's only departures from the tail are the truncating (floor) rescale of the input
with the smaller scale (the larger-scale input has M = 2^30, e = 0, where the step is
exact) and the 16-bit wrap, which only matters when |r| >= 2^15 (output scale far below
the input scales). Overflow bounds: |a - zp| <= 255, so |x| <= 255 * 2^20 < 2^28;
srdhm with M < 2^31 keeps |x| < 2^28; |x +- y| < 2^29; all int32-safe.

Broadcasting: MACE's uint8 Eltwise requires ``input0->size() == input1->size()``
(``MACE_CHECK`` in mace/ops/eltwise.cc) and pairs elements by flat index. Here ``b`` may be
any shape numpy-broadcastable to ``a``'s shape (e.g. a per-channel ``[C]`` vector); it is
materialised to ``a``'s shape first, which is what MACE computes once such a tensor is
expanded to the full shape. The output has ``a``'s shape.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from maceq.errors import MaceqError
from maceq.runtime import fixedpoint as fp
from maceq.runtime.fixedpoint import (
    quantize_multiplier,
    rounding_divide_by_pot,
    saturating_rounding_doubling_high_mul,
)
from maceq.runtime.kernels import jit

LEFT_SHIFT = 20
NEON_BLOCK = 8  # uint8x8 lanes per NEON iteration


@dataclass(frozen=True)
class EltwiseParams:
    """Fixed-point parameters of one quantized Eltwise (TFLite convention: shift <= 0 is right)."""

    a_multiplier: int
    a_shift: int
    b_multiplier: int
    b_shift: int
    out_multiplier: int
    out_shift: int
    a_zp: int
    b_zp: int
    out_zp: int


def eltwise_params(*, a_scale: float, a_zp: int, b_scale: float, b_zp: int,
                   out_scale: float, out_zp: int) -> EltwiseParams:
    """The multipliers of mace/ops/arm/q8/eltwise.cc, computed in double from float32 scales."""
    sa, sb, so = (float(np.float32(s)) for s in (a_scale, b_scale, out_scale))
    if min(sa, sb, so) <= 0:
        raise MaceqError(f"Eltwise: scales must be positive, got {sa!r}, {sb!r}, {so!r}")
    doubled = 2.0 * max(sa, sb)  # 2 * std::max(float, float): exact doubling, widened to double
    # (1 << 20) * output->scale() is an int * float product: float32, exact (power of two).
    out_denominator = float(np.float32(np.float32(1 << LEFT_SHIFT) * np.float32(so)))
    ma, ea = quantize_multiplier(sa / doubled)
    mb, eb = quantize_multiplier(sb / doubled)
    mo, eo = quantize_multiplier(doubled / out_denominator)
    if ma == 0 or mb == 0:
        raise MaceqError(f"Eltwise: input scale ratio {min(sa, sb) / max(sa, sb)!r} below 2^-32; "
                         "MACE's shift by >= 32 is not modelled")
    if mo == 0 or eo > 0:
        raise MaceqError(f"Eltwise: output multiplier {doubled / out_denominator!r} outside [2^-32, 1); "
                         "MACE's RoundingDivideByPOT needs a right shift")
    return EltwiseParams(ma, ea, mb, eb, mo, eo, int(a_zp), int(b_zp), int(out_zp))


def _prepare(a, b):
    a = np.asarray(a)
    b = np.asarray(b)
    if a.dtype != np.uint8 or b.dtype != np.uint8:
        raise MaceqError(f"Eltwise: expected uint8 inputs, got {a.dtype} and {b.dtype}")
    if b.shape == a.shape:
        return a, b
    try:
        b_full = np.broadcast_to(b, a.shape)
    except ValueError:
        raise MaceqError(f"Eltwise: input shape {b.shape} does not broadcast to {a.shape}") from None
    return a, b_full


def eltwise_add_ref(a, b, *, a_scale: float, a_zp: int, b_scale: float, b_zp: int,
                    out_scale: float, out_zp: int, subtract: bool = False,
                    act_min: int = 0, act_max: int = 255) -> np.ndarray:
    """Readable per-element reference of the NEON body + scalar tail (see module docstring)."""
    a, b_full = _prepare(a, b)
    p = eltwise_params(a_scale=a_scale, a_zp=a_zp, b_scale=b_scale, b_zp=b_zp,
                       out_scale=out_scale, out_zp=out_zp)
    fa = [int(v) for v in a.ravel()]
    fb = [int(v) for v in b_full.ravel()]
    body_end = (len(fa) // NEON_BLOCK) * NEON_BLOCK
    srdhm, rdbp = saturating_rounding_doubling_high_mul, rounding_divide_by_pot
    out = []
    for i, (va, vb) in enumerate(zip(fa, fb)):
        x = (va - p.a_zp) * (1 << LEFT_SHIFT)
        y = (vb - p.b_zp) * (1 << LEFT_SHIFT)
        if i < body_end:
            x = srdhm(x, p.a_multiplier) >> -p.a_shift  # vshlq_s32 by a negative count
            y = srdhm(y, p.b_multiplier) >> -p.b_shift
            r = x - y if subtract else x + y
            r = rdbp(srdhm(r, p.out_multiplier), -p.out_shift)
            v = fp.wrap_int16(fp.wrap_int16(r) + p.out_zp)           # vmovn_s32, vaddq_s16
            v = min(255, max(0, v))                      # vqmovun_s16
        else:
            x = rdbp(srdhm(x, p.a_multiplier), -p.a_shift)
            y = rdbp(srdhm(y, p.b_multiplier), -p.b_shift)
            r = x - y if subtract else x + y
            v = rdbp(srdhm(r, p.out_multiplier), -p.out_shift) + p.out_zp
            v = min(255, max(0, v))                      # Saturate<uint8_t>
        out.append(min(act_max, max(act_min, v)))
    return np.array(out, dtype=np.uint8).reshape(a.shape)


def _codes(a: np.ndarray, b: np.ndarray, body: int, p: EltwiseParams, subtract: bool,
           act_min: int, act_max: int) -> np.ndarray:
    """Output codes of flat uint8 ``a``, ``b``: elements below ``body`` by the NEON rule, the rest by
    the scalar tail's (module docstring); vectorised in int64, bit-exact with the ref."""
    srdhm, rdbp = saturating_rounding_doubling_high_mul, rounding_divide_by_pot
    x = (a.astype(np.int64) - p.a_zp) << LEFT_SHIFT
    y = (b.astype(np.int64) - p.b_zp) << LEFT_SHIFT
    # Body: arithmetic shift right (floor); tail: rounding divide (ties away from zero).
    xm = srdhm(x, p.a_multiplier)
    ym = srdhm(y, p.b_multiplier)
    xs = np.concatenate([xm[:body] >> -p.a_shift, rdbp(xm[body:], -p.a_shift)])
    ys = np.concatenate([ym[:body] >> -p.b_shift, rdbp(ym[body:], -p.b_shift)])
    r = xs - ys if subtract else xs + ys
    r = rdbp(srdhm(r, p.out_multiplier), -p.out_shift)
    v = r + p.out_zp  # tail: int32 add, then Saturate
    # body: VMOVN keeps the low 16 bits, VADDQ_S16 adds the zero point modulo 2^16
    v[:body] = (((((r[:body] + 0x8000) & 0xFFFF) - 0x8000 + p.out_zp) + 0x8000) & 0xFFFF) - 0x8000
    v = np.clip(np.clip(v, 0, 255), act_min, act_max)
    return v.astype(np.uint8)


@functools.lru_cache(maxsize=1024)
def _cached_params(a_scale: float, a_zp: int, b_scale: float, b_zp: int, out_scale: float,
                   out_zp: int) -> EltwiseParams:
    """:func:`eltwise_params`, remembered: a model calls each Eltwise with the same scales every run."""
    return eltwise_params(a_scale=a_scale, a_zp=a_zp, b_scale=b_scale, b_zp=b_zp, out_scale=out_scale,
                          out_zp=out_zp)


# From this many elements eltwise_add looks its codes up in two 256x256 tables (one per rule),
# built once per parameter set: each output depends only on its two input codes and its rule.
_LUT_MIN = 4096


@functools.lru_cache(maxsize=256)
def _tables(p: EltwiseParams, subtract: bool, act_min: int, act_max: int) -> tuple[np.ndarray, np.ndarray]:
    """(NEON-body table, scalar-tail table), each indexed by a*256 + b."""
    codes = np.arange(256, dtype=np.uint8)
    a, b = np.repeat(codes, 256), np.tile(codes, 256)
    return (_codes(a, b, a.size, p, subtract, act_min, act_max),
            _codes(a, b, 0, p, subtract, act_min, act_max))


def eltwise_add(a, b, *, a_scale: float, a_zp: int, b_scale: float, b_zp: int,
                out_scale: float, out_zp: int, subtract: bool = False,
                act_min: int = 0, act_max: int = 255) -> np.ndarray:
    """MACE ARM NEON uint8 Eltwise SUM (or SUB: ``a - b``); vectorised, bit-exact with the ref.

    Contract: ``a`` uint8 of any shape, ``b`` uint8 broadcastable to it; scales are the float32
    values stored in the model, zero points ints. ``act_min``/``act_max`` clamp last (MACE's
    uint8 Eltwise applies none; the defaults are a no-op). Returns uint8 of ``a``'s shape.
    """
    a, b_full = _prepare(a, b)
    p = _cached_params(float(a_scale), int(a_zp), float(b_scale), int(b_zp), float(out_scale), int(out_zp))
    n = a.size
    body = (n // NEON_BLOCK) * NEON_BLOCK
    if n < _LUT_MIN:
        return _codes(a.ravel(), b_full.ravel(), body, p, subtract, act_min, act_max).reshape(a.shape)
    body_table, tail_table = _tables(p, bool(subtract), int(act_min), int(act_max))
    if jit.available():  # the same look-ups in one compiled pass
        return jit.lut_pairs(a, b_full, body, body_table, tail_table)
    idx = (a.astype(np.uint16) << 8) | b_full
    out = body_table.take(idx)
    if body < n:
        out.reshape(-1)[body:] = tail_table.take(idx.reshape(-1)[body:])
    return out
