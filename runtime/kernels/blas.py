"""The GEMM of numpy's own BLAS, callable from compiled (numba) loops.

The compiled convolution kernels (runtime/kernels/jit.py) cut the output into row blocks
and give each block to one thread; a block converts its input rows, calls ``?gemm`` on
them and requantizes the result while it is still in cache. numpy does not export its
BLAS to numba, so this module looks the CBLAS symbols up in the BLAS library numpy
loaded (threadpoolctl finds it) and hands their addresses to the compiled code, which
calls them through :func:`call_gemm64`/``call_gemm32`` (an address argument keeps the compiled code
cacheable). Supported: OpenBLAS with the symbol names of numpy's wheels
(``scipy_cblas_sgemm64_``, 64-bit integers) and plain OpenBLAS (``cblas_sgemm``, integer
width from ``openblas_get_config``). Elsewhere :func:`gemm` returns None and the kernels
keep their numpy paths, which give the same results: every GEMM here multiplies integer
matrices whose sums are exact in the chosen precision (runtime/kernels/conv.py,
"Fast paths"), so the order BLAS adds them in does not matter.

While the compiled kernels run, BLAS itself is limited to one thread (see
:func:`single_threaded`): the parallelism is the row blocks'.
"""
from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager
from dataclasses import dataclass

try:
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - numba is a dependency
    intrinsic = None

__all__ = ["Gemm", "gemm", "call_gemm64", "call_gemm32", "single_threaded"]

ROW_MAJOR, NO_TRANS = 101, 111


@dataclass(frozen=True)
class Gemm:
    """Addresses of ``cblas_sgemm``/``cblas_dgemm``, their integer width (32 or 64 bits) and the library."""

    sgemm: int
    dgemm: int
    int_bits: int
    path: str


_GEMM: Gemm | None | bool = False  # False: not looked up yet
_CONTROLLER = None


def _controller():
    global _CONTROLLER
    if _CONTROLLER is None:
        from threadpoolctl import ThreadpoolController

        _CONTROLLER = ThreadpoolController()
    return _CONTROLLER


def _lookup() -> Gemm | None:
    import numpy as np  # noqa: F401  (loads numpy's BLAS)

    for info in _controller().info():
        if info.get("user_api") != "blas" or info.get("internal_api") != "openblas":
            continue
        try:
            lib = ctypes.CDLL(info["filepath"])
        except OSError:
            continue
        for prefix, suffix in (("scipy_", "64_"), ("", "64_"), ("", "")):
            try:
                s = getattr(lib, f"{prefix}cblas_sgemm{suffix}")
                d = getattr(lib, f"{prefix}cblas_dgemm{suffix}")
            except AttributeError:
                continue
            if suffix:
                bits = 64
            else:
                try:
                    cfg = getattr(lib, f"{prefix}openblas_get_config")
                except AttributeError:
                    continue
                cfg.restype = ctypes.c_char_p
                bits = 64 if b"USE64BITINT" in (cfg() or b"") else 32
            return Gemm(ctypes.cast(s, ctypes.c_void_p).value, ctypes.cast(d, ctypes.c_void_p).value, bits,
                        info["filepath"])
    return None


def gemm() -> Gemm | None:
    """numpy's CBLAS GEMMs, or None when they cannot be found (or MACEQ_NO_BLAS_BINDING=1)."""
    global _GEMM
    if os.environ.get("MACEQ_NO_BLAS_BINDING", "") not in ("", "0") or intrinsic is None:
        return None
    if _GEMM is False:
        try:
            _GEMM = _lookup()
        except Exception:  # noqa: BLE001 - any failure to introspect means: use the numpy paths
            _GEMM = None
    return _GEMM


@contextmanager
def single_threaded():
    """BLAS runs on the calling thread inside this block (the compiled kernels' threads call it)."""
    if gemm() is None:
        yield
        return
    with _controller().limit(limits=1, user_api="blas"):
        yield


def _make_call_gemm(int_bits: int):
    @intrinsic
    def call_gemm(typingctx, addr, m, n, k, a, lda, b, ldb, c, ldc):
        """C[m, n] = A[m, k] @ B[k, n] (row-major, alpha 1, beta 0) through the CBLAS ``?gemm`` at ``addr``.

        a, b, c: arrays of one float type whose rows are lda/ldb/ldc elements apart (the pointers to
        their first elements are passed); the integers are converted to the BLAS integer width.
        """
        fl = getattr(a, "dtype", None)
        if fl not in (types.float32, types.float64) or b.dtype != fl or c.dtype != fl:
            return None
        ints = (addr, m, n, k, lda, ldb, ldc)
        if not all(isinstance(t, types.Integer) for t in ints):
            return None

        def codegen(context, builder, sig, args):
            i32, it = ir.IntType(32), ir.IntType(int_bits)
            ft = context.get_value_type(fl)
            fptr = ft.as_pointer()
            fnty = ir.FunctionType(ir.VoidType(), [i32, i32, i32, it, it, it, ft, fptr, it, fptr, it, ft, fptr, it])
            addr64 = context.cast(builder, args[0], sig.args[0], types.int64)
            fn = builder.inttoptr(addr64, fnty.as_pointer())

            def data(i):
                ary = context.make_array(sig.args[i])(context, builder, args[i])
                return builder.bitcast(ary.data, fptr)

            def size(i):
                v = context.cast(builder, args[i], sig.args[i], types.int64)
                return builder.trunc(v, it) if int_bits == 32 else v

            one, zero = ir.Constant(ft, 1.0), ir.Constant(ft, 0.0)
            builder.call(fn, [ir.Constant(i32, ROW_MAJOR), ir.Constant(i32, NO_TRANS), ir.Constant(i32, NO_TRANS),
                              size(1), size(2), size(3), one, data(4), size(5), data(6), size(7), zero, data(8),
                              size(9)])
            return context.get_dummy_value()

        return types.void(addr, m, n, k, a, lda, b, ldb, c, ldc), codegen

    return call_gemm


if intrinsic is not None:
    call_gemm64 = _make_call_gemm(64)
    call_gemm32 = _make_call_gemm(32)
else:  # pragma: no cover
    call_gemm64 = call_gemm32 = None
