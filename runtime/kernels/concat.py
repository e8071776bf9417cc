"""MACE CPU uint8 Concat, with the requantization of inputs whose quantization differs.

Upstream source: XiaoMi/mace ``mace/ops/concat.cc``, class ``ConcatOp<DeviceType::CPU, uint8_t>``.

For each input i (in float32, one rounding per operation, as the C++ ``float`` locals):
- if ``in_zp == out_zp`` and ``in_scale == out_scale`` (float32 equality): codes are copied;
- else ``scale = f32(in_scale / out_scale)``,
  ``offset = f32(f32(float(-in_zp) * scale) + float(out_zp))`` and each code becomes
  ``Saturate<uint8_t>(roundf(f32(f32(x * scale) + offset)))``: ``roundf`` rounds half away
  from zero, ``Saturate`` clamps to [0, 255].
The axis indexes the tensor as stored (NHWC for 4-D activations).

Assumption (see docs/semantics.md): ``x * scale + offset`` and
``-in_zp * scale + out_zp`` are compiled as a separate multiply and add, not a fused
multiply-add (clang before 14 and GCC with ``-ffp-contract=off`` do so; the NEON Quantize
evidence in docs/oracle-notes shows MACE's ARM build did not fuse ``vmlaq_f32``).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from maceq.errors import MaceqError

_F32 = np.float32


def _qpair(q) -> tuple[float, int]:
    """Accept a QInfo-like object (``.scale``, ``.zero_point``) or a ``(scale, zero_point)`` pair."""
    if hasattr(q, "scale") and hasattr(q, "zero_point"):
        return float(q.scale), int(q.zero_point)
    scale, zp = q
    return float(scale), int(zp)


def _check(inputs, axis: int, in_qinfos) -> tuple[list[np.ndarray], int, list[tuple[float, int]]]:
    arrs = [np.asarray(a) for a in inputs]
    if not arrs:
        raise MaceqError("Concat: no inputs")
    if len(in_qinfos) != len(arrs):
        raise MaceqError(f"Concat: {len(arrs)} inputs but {len(in_qinfos)} quantize infos")
    rank = arrs[0].ndim
    ax = axis + rank if axis < 0 else axis
    if not 0 <= ax < rank:
        raise MaceqError(f"Concat: axis {axis} out of range for rank {rank}")
    for a in arrs:
        if a.dtype != np.uint8:
            raise MaceqError(f"Concat: expected uint8 inputs, got {a.dtype}")
        if a.ndim != rank or any(a.shape[j] != arrs[0].shape[j] for j in range(rank) if j != ax):
            raise MaceqError(f"Concat: shapes {[x.shape for x in arrs]} differ outside axis {ax}")
    return arrs, ax, [_qpair(q) for q in in_qinfos]


def _same(in_scale: float, in_zp: int, out_scale: float, out_zp: int) -> bool:
    return in_zp == out_zp and _F32(in_scale) == _F32(out_scale)


def requantize_code_ref(x: int, *, in_scale: float, in_zp: int, out_scale: float, out_zp: int) -> int:
    """One code through concat.cc's requantization (scalar, float32 steps)."""
    if _same(in_scale, in_zp, out_scale, out_zp):
        return int(x)
    scale = _F32(_F32(in_scale) / _F32(out_scale))
    offset = _F32(_F32(_F32(-in_zp) * scale) + _F32(out_zp))
    out = float(_F32(_F32(_F32(x) * scale) + offset))
    r = int(np.copysign(np.floor(abs(out) + 0.5), out))  # roundf, exact in float64
    return min(255, max(0, r))  # Saturate<uint8_t>


def concat_ref(inputs: Sequence, *, axis: int, in_qinfos: Sequence, out_scale: float, out_zp: int) -> np.ndarray:
    """Readable reference: the inner/outer loop of concat.cc, one code at a time."""
    arrs, ax, qs = _check(inputs, axis, in_qinfos)
    inner = int(np.prod(arrs[0].shape[:ax], dtype=np.int64))
    flats = [a.reshape(inner, -1) for a in arrs]
    out_rows = []
    for row in range(inner):
        vals: list[int] = []
        for f, (s, z) in zip(flats, qs):
            vals.extend(requantize_code_ref(int(v), in_scale=s, in_zp=z, out_scale=out_scale, out_zp=out_zp)
                        for v in f[row])
        out_rows.append(vals)
    shape = list(arrs[0].shape)
    shape[ax] = sum(a.shape[ax] for a in arrs)
    return np.array(out_rows, dtype=np.uint8).reshape(shape)


def requantize_lut(*, in_scale: float, in_zp: int, out_scale: float, out_zp: int) -> np.ndarray:
    """The 256-entry table code -> requantized code, computed with the same float32 steps."""
    if _same(in_scale, in_zp, out_scale, out_zp):
        return np.arange(256, dtype=np.uint8)
    scale = _F32(_F32(in_scale) / _F32(out_scale))
    offset = _F32(_F32(_F32(-in_zp) * scale) + _F32(out_zp))
    codes = np.arange(256, dtype=np.float32)
    out = ((codes * scale).astype(np.float32) + offset).astype(np.float32).astype(np.float64)
    r = np.copysign(np.floor(np.abs(out) + 0.5), out)
    return np.clip(r, 0, 255).astype(np.uint8)


def concat(inputs: Sequence, *, axis: int, in_qinfos: Sequence, out_scale: float, out_zp: int) -> np.ndarray:
    """MACE uint8 Concat along ``axis``; inputs whose (scale, zp) differ are requantized.

    Contract: ``inputs`` are uint8 arrays of equal rank and equal shape outside ``axis``;
    ``in_qinfos[i]`` is a QInfo or a (scale, zero_point) pair holding the float32 scale stored
    in the model. Bit-exact with :func:`concat_ref` (the requantization is a 256-entry table).
    """
    arrs, ax, qs = _check(inputs, axis, in_qinfos)
    parts = [requantize_lut(in_scale=s, in_zp=z, out_scale=out_scale, out_zp=out_zp)[a] for a, (s, z) in zip(arrs, qs)]
    return np.concatenate(parts, axis=ax)
