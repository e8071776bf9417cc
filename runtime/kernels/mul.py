"""uint8 MUL with TFLite's reference semantics (kernels/mul.cc, internal/reference/mul.h).

Prepare (mul.cc)::

    real_multiplier = s_a * s_b / s_out        # a C float expression: two float32 operations,
    (q, shift) = QuantizeMultiplier(real_multiplier)   # widened to double only here

Eval, per output element (reference_ops::MulElementwise / BroadcastMul6DSlow)::

    acc = (a - zp_a) * (b - zp_b)              # |acc| <= 255 * 255 < 2^16: int32-safe
    out = clamp(zp_out + MultiplyByQuantizedMultiplier(acc, q, shift), act_min, act_max)

``MultiplyByQuantizedMultiplier`` is the double-rounding form (TFLite common.h without
TFLITE_SINGLE_ROUNDING); a multiplier >= 1 is a left shift of ``acc`` that wraps in int32 (only
for left shifts >= 16). ``act_min``/``act_max`` are the fused activation's codes
(CalculateActivationRangeQuantized); the default [0, 255] is no activation.

Broadcasting is numpy's (TFLite's 6-D broadcast is the same rule): ``b`` may be [C],
[1, 1, 1, C] or [N, 1, 1, C] against an NHWC ``a`` (squeeze-and-excite), or the other way round.
The output has the broadcast shape.

The output code depends only on the pair (a code, b code), so the fast path evaluates the
arithmetic, vectorised, once over all 65,536 pairs and gathers from that table; it equals the
per-element reference :func:`mul_ref` bit for bit (tests/oracle/test_mul_oracle.py, which also
checks both against TFLite BUILTIN_REF MUL).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from maceq.errors import MaceqError
from maceq.runtime.fixedpoint import multiply_by_quantized_multiplier, quantize_multiplier

__all__ = ["MulParams", "mul_params", "mul", "mul_ref"]

_F32 = np.float32


@dataclass(frozen=True)
class MulParams:
    """TFLite ``ArithmeticParams`` of a uint8 MUL (zero points instead of negated offsets)."""

    a_zp: int
    b_zp: int
    out_zp: int
    multiplier: int
    shift: int                 # > 0: left shift (TFLite convention)
    act_min: int
    act_max: int


def _check_scale(name: str, s) -> np.float32:
    v = _F32(s)
    if not (np.isfinite(v) and v > 0):
        raise MaceqError(f"Mul: {name} must be a positive finite float32, got {s!r}")
    return v


def _check_code(name: str, v) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or not 0 <= v <= 255:
        raise MaceqError(f"Mul: {name} must be an int in [0, 255] for uint8, got {v!r}")
    return int(v)


def mul_params(*, a_scale: float, a_zp: int, b_scale: float, b_zp: int, out_scale: float,
               out_zp: int, act_min: int = 0, act_max: int = 255) -> MulParams:
    """mul.cc Prepare for uint8: ``QuantizeMultiplier(double(f32(f32(s_a * s_b) / s_out)))``."""
    sa, sb = _check_scale("a_scale", a_scale), _check_scale("b_scale", b_scale)
    so = _check_scale("out_scale", out_scale)
    with np.errstate(under="ignore", over="ignore"):
        real = _F32(_F32(sa * sb) / so)
    if not np.isfinite(real):
        raise MaceqError(f"Mul: multiplier s_a*s_b/s_out overflows float32 "
                         f"({float(sa)!r}, {float(sb)!r}, {float(so)!r})")
    q, shift = quantize_multiplier(float(real))
    if shift > 31:
        raise MaceqError(f"Mul: multiplier {float(real)!r} needs a left shift above 31")
    lo, hi = _check_code("act_min", act_min), _check_code("act_max", act_max)
    if lo > hi:
        raise MaceqError(f"Mul: act_min {lo} > act_max {hi}")
    return MulParams(_check_code("a_zp", a_zp), _check_code("b_zp", b_zp), _check_code("out_zp", out_zp),
                     q, shift, lo, hi)


def _broadcast(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != np.uint8 or b.dtype != np.uint8:
        raise MaceqError(f"Mul: expected uint8 inputs, got {a.dtype} and {b.dtype}")
    try:
        return np.broadcast_arrays(a, b)
    except ValueError:
        raise MaceqError(f"Mul: input shapes {a.shape} and {b.shape} do not broadcast") from None


def mul_ref(a, b, *, a_scale: float, a_zp: int, b_scale: float, b_zp: int, out_scale: float,
            out_zp: int, act_min: int = 0, act_max: int = 255) -> np.ndarray:
    """Reference uint8 MUL: the MulElementwise body on each broadcast element, plain Python ints."""
    a_full, b_full = _broadcast(a, b)
    p = mul_params(a_scale=a_scale, a_zp=a_zp, b_scale=b_scale, b_zp=b_zp, out_scale=out_scale,
                   out_zp=out_zp, act_min=act_min, act_max=act_max)
    out = np.empty(a_full.shape, dtype=np.uint8)
    for idx in np.ndindex(a_full.shape):
        input1_val = int(a_full[idx]) - p.a_zp
        input2_val = int(b_full[idx]) - p.b_zp
        unclamped = p.out_zp + multiply_by_quantized_multiplier(input1_val * input2_val, p.multiplier, p.shift)
        out[idx] = min(p.act_max, max(p.act_min, unclamped))
    return out


def _mul_table_v(p: MulParams) -> np.ndarray:
    """(256, 256) uint8: out[a code, b code], the MulElementwise arithmetic vectorised."""
    codes = np.arange(256, dtype=np.int64)
    acc = (codes - p.a_zp)[:, None] * (codes - p.b_zp)[None, :]
    r = p.out_zp + multiply_by_quantized_multiplier(acc, p.multiplier, p.shift)
    return np.clip(r, p.act_min, p.act_max).astype(np.uint8)


@functools.lru_cache(maxsize=64)
def _mul_table(p: MulParams) -> np.ndarray:
    t = _mul_table_v(p)
    t.flags.writeable = False
    return t


def mul(a, b, *, a_scale: float, a_zp: int, b_scale: float, b_zp: int, out_scale: float,
        out_zp: int, act_min: int = 0, act_max: int = 255) -> np.ndarray:
    """TFLite BUILTIN_REF uint8 MUL with broadcasting; bit-exact with :func:`mul_ref`.

    Contract: ``a``, ``b`` uint8 of numpy-broadcastable shapes; scales are the float32 values
    stored in the model, zero points and ``act_min``/``act_max`` ints in [0, 255]. Returns uint8
    of the broadcast shape.
    """
    a_full, b_full = _broadcast(a, b)
    p = mul_params(a_scale=a_scale, a_zp=a_zp, b_scale=b_scale, b_zp=b_zp, out_scale=out_scale,
                   out_zp=out_zp, act_min=act_min, act_max=act_max)
    index = (a_full.astype(np.uint16) << 8) | b_full   # a code * 256 + b code
    return _mul_table(p).reshape(-1)[index]
