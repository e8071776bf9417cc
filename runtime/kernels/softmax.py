"""MACE CPU uint8 Softmax (output scale 1/255, zero point 0).

Upstream sources: XiaoMi/mace ``mace/ops/softmax.cc`` (``SoftmaxOp<DeviceType::CPU, uint8_t>``;
its NEON blocks are ``#if 0``, so ARM runs the scalar code below) and gemmlowp
``fixedpoint/fixedpoint.h`` (``exp_on_negative_values``, ``one_over_one_plus_x_for_x_in_0_1``,
``Rescale``, ``SaturatingRoundingMultiplyByPOT``, ``RoundingHalfSum``).

The input is [N, C] or NHWC (softmax over the last axis, rows = N*H*W). MACE sets the output's
quantization to scale ``1.f / 255`` and zero point 0 whatever the model says. Per row, with
``max`` the row's largest code and ``delta = x - max`` (an int in [-255, 0]):

Depth < 32 (float path)::

    e[d] = expf(f32(float(delta) * f32(in_scale)))      # std::exp on a float: expf
    sum  = f32 sum of e[d] in index order; sum = max(sum, FLT_MIN)
    out  = (uint8) trunc(double(f32(e[d] / sum)) * 255)   # the *255 is exact in double

Depth >= 32 (gemmlowp fixed point, 6 integer bits for the scaled input, 12 for the sum)::

    scale_q = int32(min(double(in_scale) * 2^25, 2^31 - 1))      # truncation
    limit   = -((2^31 - 1) / scale_q)                             # C division
    for delta >= limit: sum += Rescale<12>(exp_on_negative_values<6>(scale_q * delta))
    lz = clz(sum); tail = 12 - lz
    recip = fp.one_over_one_plus_x_for_x_in_0_1((sum << lz) - 2^31)
    out = clamp(RoundingDivideByPOT(srdhm(recip, exp<6>(scale_q * delta)), tail + 23), 0, 255)

The fixed path produces p * 256 (TFLite's output convention) although the output tensor
claims scale 1/255: MACE's own inconsistency, reproduced. Two cases MACE leaves undefined:
elements with ``delta < limit`` (only when in_scale > ~0.25) are never written by MACE
(stale memory); here they are 0, TFLite's value and exp's limit. A row whose exponential sum
reaches 512 (clz <= 3) makes MACE call RoundingDivideByPOT with an exponent above 31
(undefined shift); :func:`softmax` raises MaceqError for it.

``expf`` is the C library's (glibc here). MACE on Android calls bionic's; glibc >= 2.27 and
bionic since Android 9 both use ARM's optimized-routines expf, but an older bionic (FreeBSD
msun) could differ in the last ulp. See docs/semantics.md.
"""
from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np

from maceq.errors import MaceqError
from maceq.runtime import fixedpoint as fp
from maceq.runtime.fixedpoint import (
    rounding_divide_by_pot,
    saturating_rounding_doubling_high_mul,
    wrap_int32,
)

_F32 = np.float32
OUT_SCALE = float(np.float32(1.0) / np.float32(255))  # 1.f / 255
OUT_ZP = 0
FLOAT_PATH_MAX_DEPTH = 31  # depth < 32 uses float32
INPUT_DELTA_INT_BITS = 6   # kInputDeltaIntBits in softmax.cc
SUM_EXP_INT_BITS = 12      # kSumExpIntBits in softmax.cc

_libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
_expf = _libm.expf
_expf.restype = ctypes.c_float
_expf.argtypes = [ctypes.c_float]


def expf(v) -> np.float32:
    """The C library's float ``expf`` on one float32 value."""
    return _F32(_expf(float(_F32(v))))


# ----------------------------------------------------------------------------------------------
# The op
# ----------------------------------------------------------------------------------------------

def _rows(x) -> tuple[np.ndarray, tuple[int, ...]]:
    x = np.asarray(x)
    if x.dtype != np.uint8:
        raise MaceqError(f"Softmax: expected uint8 input, got {x.dtype}")
    if x.ndim not in (2, 4):
        raise MaceqError(f"Softmax: MACE supports rank 2 or 4, got shape {x.shape}")
    return x.reshape(-1, x.shape[-1]), x.shape


def fixed_point_params(in_scale: float) -> tuple[int, int]:
    """(scale_q, input_delta_limit) of the depth >= 32 path."""
    scale_q = int(min(float(np.float32(in_scale)) * (1 << (31 - INPUT_DELTA_INT_BITS)), (1 << 31) - 1.0))
    if scale_q <= 0:
        raise MaceqError(f"Softmax: input scale {in_scale!r} too small (scale_q = 0)")
    limit = -(((1 << 31) - 1) // scale_q)  # positive operands: floor == C truncation
    return scale_q, limit


def _check_sum(sum_q, row) -> None:
    if not (0 < sum_q < (1 << 28)):
        raise MaceqError(f"Softmax: row {row} has a sum of exponentials >= 512 (raw {sum_q}); MACE's "
                         "RoundingDivideByPOT exponent exceeds 31 there (undefined behaviour)")


def softmax_ref(x, *, in_scale: float) -> np.ndarray:
    """Readable per-row, per-element reference of softmax.cc's uint8 paths."""
    rows, shape = _rows(x)
    depth = rows.shape[1]
    out = np.zeros(rows.shape, dtype=np.uint8)
    s_in = _F32(in_scale)
    if depth <= FLOAT_PATH_MAX_DEPTH:
        for b, row in enumerate(rows):
            mx = int(row.max())
            cache = []
            total = _F32(0.0)
            for v in row:
                e = expf(_F32(_F32(int(v) - mx) * s_in))
                total = _F32(total + e)
                cache.append(e)
            total = max(total, _F32(np.finfo(np.float32).tiny))
            for d, e in enumerate(cache):
                out[b, d] = int(float(_F32(e / total)) * 255)  # double product exact, trunc
        return out.reshape(shape)
    scale_q, limit = fixed_point_params(in_scale)
    for b, row in enumerate(rows):
        mx = int(row.max())
        sum_q = 0
        for v in row:
            delta = int(v) - mx
            if delta >= limit:
                e = int(fp.exp_on_negative_values(scale_q * delta, INPUT_DELTA_INT_BITS))
                sum_q = int(wrap_int32(sum_q + int(fp.saturating_rounding_multiply_by_pot(e, -SUM_EXP_INT_BITS))))
        _check_sum(sum_q, b)
        lz = 32 - sum_q.bit_length()
        tail = SUM_EXP_INT_BITS - lz
        recip = int(fp.one_over_one_plus_x_for_x_in_0_1((sum_q << lz) - (1 << 31)))
        for d, v in enumerate(row):
            delta = int(v) - mx
            if delta >= limit:
                e = int(fp.exp_on_negative_values(scale_q * delta, INPUT_DELTA_INT_BITS))
                o = rounding_divide_by_pot(saturating_rounding_doubling_high_mul(recip, e), tail + 31 - 8)
                out[b, d] = max(min(int(o), 255), 0)
            # else: MACE leaves the element unwritten; 0 here (see module docstring)
    return out.reshape(shape)


def softmax(x, *, in_scale: float) -> np.ndarray:
    """MACE uint8 Softmax over the last axis; bit-exact with :func:`softmax_ref`.

    Contract: ``x`` uint8 [N, C] or NHWC; ``in_scale`` the float32 input scale stored in the
    model (the zero point cancels in ``x - max``). Returns uint8 codes of scale
    :data:`OUT_SCALE` (1/255) and zero point 0. Per-delta values (expf, the fixed-point exp)
    come from 256-entry tables, since ``delta`` takes only the values -255..0.
    """
    rows, shape = _rows(x)
    depth = rows.shape[1]
    delta = rows.astype(np.int64) - rows.max(axis=1, keepdims=True).astype(np.int64)
    all_deltas = np.arange(-255, 1, dtype=np.int64)
    if depth <= FLOAT_PATH_MAX_DEPTH:
        s_in = _F32(in_scale)
        lut = np.array([expf(_F32(_F32(d) * s_in)) for d in all_deltas], dtype=np.float32)
        e = lut[delta + 255]
        total = np.zeros(rows.shape[0], dtype=np.float32)
        for d in range(depth):  # float32 sum in index order, as the C++ loop
            total = (total + e[:, d]).astype(np.float32)
        total = np.maximum(total, np.finfo(np.float32).tiny)
        p = (e / total[:, None]).astype(np.float32)
        return np.trunc(p.astype(np.float64) * 255).astype(np.uint8).reshape(shape)
    scale_q, limit = fixed_point_params(in_scale)
    valid_deltas = all_deltas >= limit
    exp_lut = np.where(valid_deltas, fp.exp_on_negative_values(np.where(valid_deltas, scale_q * all_deltas, 0),
                                                            INPUT_DELTA_INT_BITS), 0)
    term_lut = fp.saturating_rounding_multiply_by_pot(exp_lut, -SUM_EXP_INT_BITS)  # Rescale<12>
    valid = delta >= limit
    e = exp_lut[delta + 255]
    # Sum of int32 adds that wrap: the total modulo 2^32 (each term < 2^19, so only past 4096).
    sum_q = wrap_int32(np.where(valid, term_lut[delta + 255], 0).sum(axis=1))
    bad = np.nonzero((sum_q <= 0) | (sum_q >= (1 << 28)))[0]
    if bad.size:
        _check_sum(int(sum_q[bad[0]]), int(bad[0]))
    lz = fp.count_leading_zeros32(sum_q)
    tail = SUM_EXP_INT_BITS - lz
    recip = fp.one_over_one_plus_x_for_x_in_0_1((sum_q << lz) - (1 << 31))
    o = rounding_divide_by_pot(saturating_rounding_doubling_high_mul(recip[:, None], e), (tail + 31 - 8)[:, None])
    o = np.where(valid, np.clip(o, 0, 255), 0)
    return o.astype(np.uint8).reshape(shape)
