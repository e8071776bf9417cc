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

Scalar exact references for tests: :func:`maceq.runtime.kernels.nnlib_ref.fmaf` (exact rationals).
"""
from __future__ import annotations

import numpy as np

try:  # numba is a dependency; without it (or with MACEQ_NO_JIT=1) the numpy paths run
    from llvmlite import ir as _llvm_ir
    from numba import types as _nb_types
    from numba.extending import intrinsic as _nb_intrinsic
except ImportError:  # pragma: no cover - exercised only without numba
    _nb_intrinsic = None

F32 = np.float32


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
