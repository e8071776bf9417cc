"""MACE CPU uint8 Reduce(MEAN).

Upstream source: XiaoMi/mace ``mace/ops/reduce.cc``: ``ReduceOp<CPU, T>::Simplify`` and the
``ReduceOp<DeviceType::CPU, uint8_t>::Reduce{1,2,3,4}Dims`` specialisations.

Semantics:
- Axes are taken as given for uint8 (the NCHW remapping of ``has_data_format`` is skipped for
  DT_UINT8), so they index the NHWC tensor directly. Negative axes count from the end; no
  axes means all axes.
- ``Simplify`` merges runs of adjacent reduced / kept dimensions into at most 4 groups
  ("data_reshape"); size-1 dimensions join the group before them. More than 4 groups is
  "not implemented in mace", and so is an input whose every dimension is 1 (the group list
  stays empty).
- Each output is ``(uint32 sum + n / 2) / n`` in integer arithmetic, n = the number of
  reduced elements: the mean of the codes, rounded half up. No requantization: the output
  takes the input's scale and zero point (``output->SetScale(input->scale())``), whatever the
  model stored for it.
"""
from __future__ import annotations

import numpy as np

from maceq.errors import MaceqError
from maceq.runtime.kernels import jit


def _resolve_axes(ndim: int, axes) -> list[bool]:
    bitmap = [False] * ndim
    if axes is None or len(tuple(axes)) == 0:
        return [True] * ndim
    for a in axes:
        a = int(a)
        if not (-ndim < a < ndim):  # MACE's Validate: axis > -rank && axis < rank
            raise MaceqError(f"Reduce: axis {a} out of range for rank {ndim}")
        bitmap[a if a >= 0 else a + ndim] = True
    return bitmap


def _out_shape(shape, bitmap, keepdims: bool) -> tuple[int, ...]:
    out = []
    for d, r in zip(shape, bitmap):
        if not r:
            out.append(d)
        elif keepdims:
            out.append(1)
    return tuple(out)


def _simplify(shape, bitmap) -> tuple[bool, list[int]]:
    """``Simplify``: (reduce_first_axis, data_reshape) exactly as reduce.cc builds them."""
    bitmap = list(bitmap)
    dim_index = 0
    while dim_index < len(shape) and shape[dim_index] == 1:
        dim_index += 1
    if dim_index >= len(shape):
        return True, []
    reduce_first = bitmap[dim_index]
    data_reshape = [shape[dim_index]]
    for k in range(dim_index + 1, len(shape)):
        n = shape[k]
        if n == 1:
            bitmap[k] = bitmap[k - 1]
        if bitmap[k - 1] != bitmap[k]:
            data_reshape.append(n)
        else:
            data_reshape[-1] *= n
    return reduce_first, data_reshape


def _mean_u32(total: int, n: int) -> int:
    # uint32 sum: at most n * 255; MACE wraps at 2^32, reached only past 16.8M elements.
    total &= 0xFFFFFFFF
    return (total + n // 2) // n


def reduce_mean_ref(x, *, axes=(1, 2), keepdims: bool = True) -> np.ndarray:
    """Transcription of MACE's uint8 Reduce{1,2,3,4}Dims MEAN loops over ``data_reshape``."""
    x = np.asarray(x)
    if x.dtype != np.uint8:
        raise MaceqError(f"Reduce: expected uint8 input, got {x.dtype}")
    bitmap = _resolve_axes(x.ndim, axes)
    out_shape = _out_shape(x.shape, bitmap, keepdims)
    first, r = _simplify(x.shape, bitmap)
    if not 1 <= len(r) <= 4:
        raise MaceqError(f"Reduce: shape {x.shape} with axes {axes} gives {len(r)} merged groups; "
                         "MACE implements 1 to 4 ('not implemented in mace')")
    a = [int(v) for v in x.ravel()]
    out: list[int]
    if len(r) == 1:
        out = [_mean_u32(sum(a), r[0])] if first else list(a)
    elif len(r) == 2:
        if first:  # shape (r0, r1), reduce r0
            out = [_mean_u32(sum(a[j * r[1] + i] for j in range(r[0])), r[0]) for i in range(r[1])]
        else:      # reduce r1
            out = [_mean_u32(sum(a[i * r[1] + j] for j in range(r[1])), r[1]) for i in range(r[0])]
    elif len(r) == 3:
        if first:  # reduce r0 and r2, keep r1
            out = [_mean_u32(sum(a[(k * r[1] + i) * r[2] + j] for j in range(r[2]) for k in range(r[0])),
                             r[0] * r[2]) for i in range(r[1])]
        else:      # reduce r1, keep r0 and r2
            out = [_mean_u32(sum(a[(i * r[1] + k) * r[2] + j] for k in range(r[1])), r[1])
                   for i in range(r[0]) for j in range(r[2])]
    else:
        if first:  # reduce r0 and r2, keep r1 and r3
            out = [_mean_u32(sum(a[((t * r[1] + i) * r[2] + k) * r[3] + j]
                                 for k in range(r[2]) for t in range(r[0])), r[0] * r[2])
                   for i in range(r[1]) for j in range(r[3])]
        else:      # reduce r1 and r3, keep r0 and r2
            out = [_mean_u32(sum(a[((i * r[1] + k) * r[2] + j) * r[3] + t]
                                 for k in range(r[1]) for t in range(r[3])), r[1] * r[3])
                   for i in range(r[0]) for j in range(r[2])]
    return np.array(out, dtype=np.uint8).reshape(out_shape)


def reduce_mean(x, *, axes=(1, 2), keepdims: bool = True) -> np.ndarray:
    """MACE uint8 Reduce MEAN (round-half-up integer mean of the codes); vectorised.

    Contract: ``x`` uint8 of any rank; returns uint8 with the reduced axes removed (or kept as
    size 1 with ``keepdims``). The result is in the input's quantization (scale, zero point).
    Bit-exact with :func:`reduce_mean_ref` (a test proves it).
    """
    x = np.asarray(x)
    if x.dtype != np.uint8:
        raise MaceqError(f"Reduce: expected uint8 input, got {x.dtype}")
    bitmap = _resolve_axes(x.ndim, axes)
    first, r = _simplify(x.shape, bitmap)
    if not 1 <= len(r) <= 4:
        raise MaceqError(f"Reduce: shape {x.shape} with axes {axes} gives {len(r)} merged groups; "
                         "MACE implements 1 to 4 ('not implemented in mace')")
    red = tuple(i for i, b in enumerate(bitmap) if b)
    n = 1
    for i in red:
        n *= x.shape[i]
    if red == (1, 2) and x.ndim == 4 and x.size and jit.available():  # the global average pool: one compiled pass
        total = jit.hw_sums(x).astype(np.int64).reshape(_out_shape(x.shape, bitmap, keepdims))
    else:  # int64 sum: at most n * 255, exact; & 0xFFFFFFFF models the uint32 accumulator.
        total = x.sum(axis=red, dtype=np.int64, keepdims=keepdims) & 0xFFFFFFFF
    return ((total + n // 2) // n).astype(np.uint8)
