"""uint8 MEAN as TFLite's BUILTIN_REF computes it on the ai-edge-litert 2.3.0 wheel.

This is TFLite's arithmetic, not MACE's (MACE's Reduce MEAN is runtime/kernels/reduce.py:
``(sum + n / 2) / n`` on the codes, no requantization). Measured, not assumed: on the wheel
every uint8 MEAN on the reference resolver -- the 4-D keep_dims {1, 2} case included, and
with equal or different input/output scales -- is ``reference_ops::QuantizedMeanOrSum``
(LiteRT tflite/kernels/internal/reference/reduce.h, ``compute_sum = false``), reached from
reduce.cc ``EvalMean`` -> ``EvalQuantizedMean<uint8_t>``. Older published sources route
uint8 MEAN elsewhere (a 4-D {1, 2} integer kernel, a truncating division when the scales are
equal, a float path when they differ); the wheel runs none of those:
tests/oracle/test_mean_oracle.py matches it with 0 mismatches over all of these cases.

Arithmetic, per output element (n = number of reduced elements, axes deduplicated)::

    (M, e)  = QuantizeMultiplier(double(s_in) / double(s_out))        PrepareMeanOrSum
    k       = min(floor(log2(n)), 32, 31 + e)                          ">= -31" precondition
    M'      = (int64(M) << k) / n                                      C truncating division
    e'      = e - k
    sum     = sum of the n codes                                       int32 (wrapping) scratch
    shifted = int32(sum - x_zp * n)
    y       = clamp(MultiplyByQuantizedMultiplier(shifted, M', e') + out_zp, 0, 255)

Bounds: ``M < 2^31`` and ``2^k <= n`` give ``M' <= M < 2^31`` (int32) and
``M << k < 2^63``. ``e >= -31`` (QuantizeMultiplier flushes smaller exponents to (0, 0))
keeps ``k >= 0`` and ``e' >= -31``. The sum of n codes is exact in int32 while
``255 * n < 2^31`` (n < 8.4 million); past that the scratch and ``shifted`` wrap modulo
2^32, which both paths here reproduce (:func:`~maceq.runtime.fixedpoint.wrap_int32`).
``MultiplyByQuantizedMultiplier`` rounds twice (high-mul ties up, then the shift ties away
from zero), so e.g. n = 4, sum 1, equal scales gives 1 and n = 5, sum 2 with
``s_in = s_out * (1 + 2^-23)`` gives 1 (the true means are 0.25 and 0.4).
"""
from __future__ import annotations

import numpy as np

from maceq.errors import MaceqError
from maceq.runtime.fixedpoint import multiply_by_quantized_multiplier, quantize_multiplier, wrap_int32

__all__ = ["mean", "mean_ref", "tflite_mean_multiplier"]


def tflite_mean_multiplier(in_scale, out_scale, n: int) -> tuple[int, int]:
    """Contract: the (M', e') that QuantizedMeanOrSum applies to ``sum - x_zp * n`` for n reduced elements.

    ``(M, e) = QuantizeMultiplier(double(f32 s_in) / double(f32 s_out))``;
    ``k = min(floor(log2 n), 32, 31 + e)``; ``M' = (M << k) // n`` (non-negative, so C's
    truncating division is floor); ``e' = e - k``. See the module docstring for the bounds.
    """
    n = int(n)
    if n < 1:
        raise MaceqError(f"mean: reduced element count must be >= 1, got {n}")
    si, so = np.float32(in_scale), np.float32(out_scale)
    if not (si > 0 and so > 0):
        raise MaceqError(f"mean: scales must be positive, got {float(si)!r}, {float(so)!r}")
    q, e = quantize_multiplier(float(si) / float(so))
    k = min(n.bit_length() - 1, 32, 31 + e)  # 63 - CountLeadingZeros(uint64 n) = floor(log2 n)
    return (q << k) // n, e - k


def _resolve(x, axes, in_zp, out_zp) -> tuple[np.ndarray, tuple[int, ...]]:
    x = np.asarray(x)
    if x.dtype != np.uint8:
        raise MaceqError(f"mean: uint8 input required, got {x.dtype}")
    for name, v in (("in_zp", in_zp), ("out_zp", out_zp)):
        if not 0 <= int(v) <= 255:
            raise MaceqError(f"mean: {name}={v} outside [0, 255]")
    resolved: list[int] = []
    for a in axes:  # ResolveAxis: negative axes count from the end, duplicates dropped
        a = int(a)
        r = a + x.ndim if a < 0 else a
        if not 0 <= r < x.ndim:
            raise MaceqError(f"mean: axis {a} out of range for a {x.ndim}-D input")
        if r not in resolved:
            resolved.append(r)
    return x, tuple(resolved)


def _out_shape(shape, axes, keepdims: bool) -> tuple[int, ...]:
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _requantize(sums: np.ndarray, n: int, *, in_zp, in_scale, out_scale, out_zp) -> np.ndarray:
    q, e = tflite_mean_multiplier(in_scale, out_scale, n)
    shifted = wrap_int32(wrap_int32(sums) - int(in_zp) * n)  # int32 scratch, int32 cast
    r = multiply_by_quantized_multiplier(shifted, q, e)
    return np.clip(np.asarray(r) + int(out_zp), 0, 255).astype(np.uint8)


def mean_ref(x, *, axes, keepdims: bool, in_scale, in_zp: int, out_scale, out_zp: int) -> np.ndarray:
    """Contract: TFLite QuantizedMeanOrSum (uint8, mean) as written; uint8 out of TFLite's output shape.

    Walks every input element in row-major order like reference_ops::Reduce and adds its code
    into the output element it reduces to (ReducedOutputOffset), then requantizes each sum.
    ``axes`` may be empty (nothing reduced, n = 1: a pure requantization).
    """
    x, ax = _resolve(x, axes, in_zp, out_zp)
    out_shape = _out_shape(x.shape, ax, keepdims)
    kept = [i for i in range(x.ndim) if i not in ax]
    kept_shape = tuple(x.shape[i] for i in kept)
    sums = np.zeros(kept_shape, np.int64)
    for idx in np.ndindex(*x.shape):
        sums[tuple(idx[i] for i in kept)] += int(x[idx])
    n = 1
    for a in ax:
        n *= int(x.shape[a])
    if x.size == 0 or n == 0:
        raise MaceqError(f"mean: empty input shape {x.shape}")
    out = _requantize(sums, n, in_zp=in_zp, in_scale=in_scale, out_scale=out_scale, out_zp=out_zp)
    return out.reshape(out_shape)


def mean(x, *, axes, keepdims: bool, in_scale, in_zp: int, out_scale, out_zp: int) -> np.ndarray:
    """Contract: equal to :func:`mean_ref` bit for bit; the sums by numpy in int64 (exact: < 2^63)."""
    x, ax = _resolve(x, axes, in_zp, out_zp)
    if x.size == 0:
        raise MaceqError(f"mean: empty input shape {x.shape}")
    n = int(np.prod([x.shape[a] for a in ax], dtype=np.int64)) if ax else 1
    sums = x.sum(axis=ax, dtype=np.int64) if ax else x.astype(np.int64)
    out = _requantize(sums, n, in_zp=in_zp, in_scale=in_scale, out_scale=out_scale, out_zp=out_zp)
    return out.reshape(_out_shape(x.shape, ax, keepdims))
