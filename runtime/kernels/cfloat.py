"""C float32 arithmetic step by step, on numpy arrays: the operations compiled C/NEON code performs.

numpy's own float32 ``+ - * /`` on two float32 arrays are IEEE-754 binary32 operations with one
rounding each (round to nearest even), exactly what an ARM core computes for ``a + b`` in C or for
``vaddq_f32``/``vmulq_f32``. What numpy lacks is what this module adds:

- :func:`fmaf`: a fused multiply-add, ``round32(a*b + c)`` with a single rounding, as C ``fmaf``,
  the AArch64 ``fmla``/``fmadd`` instructions and the ``vfmaq_f32``/``vfmaq_laneq_f32`` intrinsics
  compute it. ``vmlaq_f32``/``vmlaq_lane_f32`` are NOT fused on AArch64 with gcc: ``arm_neon.h``
  defines them as ``a + b * c``, which ``-ffp-contract=off`` keeps as a rounded multiply and a
  rounded add (:func:`mul_add`).
- :func:`hadd4`: ``vaddvq_f32`` on AArch64, the across-vector add ``(v0 + v1) + (v2 + v3)``
  (two ``faddp``), and :func:`hsum4_seq`, the scalar ``v[0] + v[1] + v[2] + v[3]``.
- :func:`expf`, :func:`tanhf`, :func:`logf`: the correctly rounded float32 results (computed in
  float64 and rounded once). numpy's float32 ``exp``/``tanh``/``log`` are SIMD approximations that
  differ from the correctly rounded value in about 40 % / 35 % / 25 % of the arguments; the libm
  of a device (glibc's ``expf`` in particular) is correctly rounded in all but a small fraction of
  cases. See docs/float-neon.md for the measured agreement.

The scalar binary32 steps on Python floats (``f32``, ``fadd`` ... ``fmaf_exact``, ``f32_bits``) are the
references of the scalar kernel transcriptions (nnlib_ref.py, the ``*_ref`` float kernels).
"""
from __future__ import annotations

import math
import struct
from fractions import Fraction

import numpy as np

try:  # numba is a dependency; without it (or with MACEQ_NO_JIT=1) the numpy paths run
    from llvmlite import ir as _llvm_ir
    from numba import types as _nb_types
    from numba.extending import intrinsic as _nb_intrinsic
except ImportError:  # pragma: no cover - exercised only without numba
    _nb_intrinsic = None

F32 = np.float32
INF = float("inf")


def fmaf(a, b, c) -> np.ndarray:
    """float32 fused multiply-add ``round32(a*b + c)`` with one rounding, vectorised and broadcasting.

    ``a``, ``b``, ``c`` are float32 (arrays or scalars). a*b of two float32 values is exact in
    float64 (48 significant bits). The float64 sum s = p + c rounds; TwoSum gives its exact error
    t. Rounding s "to odd" (move to the odd neighbour when t != 0 and s is even) and then to
    float32 yields the correctly rounded result, since 53 >= 24 + 2 (Boldo & Melquiond, "Emulation
    of FMA and correctly rounded sums"). Infinities and NaNs propagate as in IEEE fma.
    """
    cc = np.asarray(c, dtype=F32).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.asarray(a, dtype=F32).astype(np.float64) * np.asarray(b, dtype=F32).astype(np.float64)
        s = p + cc
        bb = s - p
        t = (p - (s - bb)) + (cc - bb)
        even = (np.asarray(s).view(np.int64) & 1) == 0
        bump = (t != 0) & even & np.isfinite(s)
        if np.any(bump):
            s = np.where(bump, np.nextafter(s, np.where(t > 0, np.inf, -np.inf)), s)
        return np.asarray(s).astype(F32)


def roundf(d: np.ndarray) -> np.ndarray:
    """C ``roundf`` on float32 values widened to float64, as float64 (exact: |d| + 0.5 needs at most 25 bits)."""
    return np.copysign(np.floor(np.abs(d) + 0.5), d)


def mul_add(acc, a, b) -> np.ndarray:
    """Unfused ``acc + a*b``: a rounded float32 product, then a rounded float32 add."""
    return np.asarray(acc, dtype=F32) + np.asarray(a, dtype=F32) * np.asarray(b, dtype=F32)


def hadd4(v: np.ndarray, axis: int = -1) -> np.ndarray:
    """AArch64 ``vaddvq_f32`` over a length-4 ``axis``: ``(v0 + v1) + (v2 + v3)`` in float32."""
    v = np.moveaxis(np.asarray(v, dtype=F32), axis, -1)
    return (v[..., 0] + v[..., 1]) + (v[..., 2] + v[..., 3])


def hsum4_seq(v: np.ndarray, axis: int = -1) -> np.ndarray:
    """C ``v[0] + v[1] + v[2] + v[3]`` (left to right) over a length-4 ``axis``, float32."""
    v = np.moveaxis(np.asarray(v, dtype=F32), axis, -1)
    return ((v[..., 0] + v[..., 1]) + v[..., 2]) + v[..., 3]


def _correctly_rounded(fn, x) -> np.ndarray:
    x = np.asarray(x, dtype=F32)
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        return fn(x.astype(np.float64)).astype(F32)


def expf(x) -> np.ndarray:
    """``expf`` correctly rounded (float64 exp rounded once to float32)."""
    return _correctly_rounded(np.exp, x)


def tanhf(x) -> np.ndarray:
    """``tanhf`` correctly rounded (float64 tanh rounded once to float32)."""
    return _correctly_rounded(np.tanh, x)


def logf(x) -> np.ndarray:
    """``logf`` correctly rounded (float64 log rounded once to float32)."""
    return _correctly_rounded(np.log, x)


if _nb_intrinsic is not None:
    @_nb_intrinsic
    def fma32(typingctx, a, b, c):
        """For compiled (numba) loops: ``llvm.fma.f32``, the fused multiply-add with one rounding.

        LLVM emits the hardware instruction (``vfmadd``/``fmadd``) or calls libm's ``fmaf``; both
        are exact. tests/test_float_neon.py checks it against :func:`fmaf`.
        """
        sig = _nb_types.float32(_nb_types.float32, _nb_types.float32, _nb_types.float32)

        def codegen(context, builder, signature, args):
            vals = [context.cast(builder, v, t, _nb_types.float32) for v, t in zip(args, signature.args)]
            fn = builder.module.declare_intrinsic("llvm.fma", [_llvm_ir.FloatType()] * 3)
            return builder.call(fn, vals)

        return sig, codegen
else:  # pragma: no cover
    fma32 = None


# ----------------------------------------------------------------------------------------------
# Scalar binary32 steps on Python floats (exact rationals where a step needs them): the
# references the scalar kernel transcriptions use (nnlib_ref.py, float_ops.py *_ref)
# ----------------------------------------------------------------------------------------------

_F32 = struct.Struct("f")


def f32(v) -> float:
    """Round a Python float/int to the nearest binary32 (ties to even); overflow gives +-inf.

    A float goes through C's ``(float)`` cast in ``struct`` (nearest even; it raises where the cast
    overflows to an infinity); other values through numpy, as the float does with numpy
    (tests/test_float_neon.py compares both ways)."""
    if type(v) is float:
        try:
            return _F32.unpack(_F32.pack(v))[0]
        except OverflowError:
            return math.copysign(INF, v)
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


def fmaf_exact(a: float, b: float, c: float) -> float:
    """Fused a*b + c, rounded once to binary32 (Hexagon ``sfmpyacc``)."""
    return f32_from_fraction(Fraction(a) * Fraction(b) + Fraction(c))


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def bits_f32(u: int) -> float:
    return struct.unpack("<f", struct.pack("<I", u & 0xFFFFFFFF))[0]


def c_roundf(x: float) -> float:
    """libm ``roundf`` on one value: nearest integer, ties away from zero (returned as a float)."""
    x = float(x)  # a float32 widens exactly
    if math.isnan(x) or math.isinf(x):
        return x
    t = math.trunc(x)
    if abs(x - t) >= 0.5:
        t += 1 if x > 0 else -1
    return float(t)
