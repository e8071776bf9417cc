"""uint8 data-movement kernels: Transpose, Pad, Split, StridedSlice (TFLite reference semantics).

No arithmetic: every output code is an input code or the pad code, and the quantization
(scale, zero point) passes through unchanged (TFLite requires equal input/output
quantization for these ops; PAD pads with the output zero point's code unless a constant
is given). What has to be right is the index mapping, transcribed from TFLite:

- TRANSPOSE (internal/reference/transpose.h): ``out[o] = x[i]`` with ``i[perm[j]] = o[j]``,
  i.e. output dimension j is input dimension ``perm[j]``.
- PAD / PADV2 (internal/reference/pad.h): ``paddings[d] = (before, after) >= 0``; output
  positions inside ``[before, before + size)`` copy the input, all others get ``pad_code``
  (PAD: the output zero point; PADV2: the constant's code).
- SPLIT / SPLIT_V (internal/reference/... ``Split``): consecutive pieces along ``axis`` of
  the given sizes (SPLIT: ``num_splits`` equal pieces; SPLIT_V: ``size_splits``, one entry
  may be -1 for "the rest").
- STRIDED_SLICE (internal/strided_slice_logic.h ``StartForAxis`` / ``StopForAxis``, the
  versions with direction-dependent clamping, which the wheel runs -- tested)::

      start = begin_mask ? (stride > 0 ? first : last) : begin (+ size if negative)
      start = clamp(start, 0, size) if stride > 0 else clamp(start, -1, size - 1)
      stop  = shrink ? start + 1 : end ;  end_mask overrides: (stride > 0 ? size : -1)
      stop  = stop (+ size if negative), clamped like start
      indices: start, start + stride, ... while (stride > 0 ? i < stop : i > stop)

  and a shrunk axis is dropped from the output shape.

ONNX Slice maps onto :func:`strided_slice` through :func:`onnx_slice_args` (ONNX clamps
``starts`` to ``[0, dim]`` / ``[0, dim - 1]`` and ``ends`` to ``[0, dim]`` / ``[-1, dim - 1]``
for positive / negative steps, the same rule with arbitrary-precision sentinels).

Each op has a readable ``*_ref`` (an explicit loop over output elements) and a fast numpy
path; tests/oracle/test_layout_oracle.py checks both against TFLite BUILTIN_REF.
"""
from __future__ import annotations

import numpy as np

from maceq.errors import MaceqError
from maceq.runtime.kernels import jit

__all__ = [
    "transpose",
    "transpose_ref",
    "pad",
    "pad_ref",
    "split",
    "split_ref",
    "split_sizes",
    "strided_slice",
    "strided_slice_ref",
    "strided_slice_indices",
    "onnx_slice_args",
]


_INT32_MAX = (1 << 31) - 1
_INT64_MAX = (1 << 63) - 1


def _as_u8(x, name: str) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype != np.uint8:
        raise MaceqError(f"{name}: uint8 input required, got {x.dtype}")
    return x


def _axis(axis: int, ndim: int, name: str) -> int:
    a = int(axis)
    r = a + ndim if a < 0 else a
    if not 0 <= r < ndim:
        raise MaceqError(f"{name}: axis {a} out of range for a {ndim}-D input")
    return r


# ----------------------------------------------------------------------------- transpose


def _perm(perm, ndim: int) -> tuple[int, ...]:
    p = tuple(int(v) + ndim if int(v) < 0 else int(v) for v in perm)
    if sorted(p) != list(range(ndim)):
        raise MaceqError(f"transpose: perm {tuple(perm)} is not a permutation of {ndim} axes")
    return p


def transpose_ref(x, perm) -> np.ndarray:
    """Contract: TFLite TRANSPOSE: ``out[o] = x[i]`` with ``i[perm[j]] = o[j]``; one element at a time."""
    x = _as_u8(x, "transpose")
    p = _perm(perm, x.ndim)
    out = np.empty(tuple(x.shape[a] for a in p), np.uint8)
    for o in np.ndindex(*out.shape):
        i = [0] * x.ndim
        for j, a in enumerate(p):
            i[a] = o[j]
        out[o] = x[tuple(i)]
    return out


def transpose(x, perm) -> np.ndarray:
    """Contract: equal to :func:`transpose_ref` (numpy's transpose has the same convention), contiguous."""
    x = _as_u8(x, "transpose")
    return np.ascontiguousarray(np.transpose(x, _perm(perm, x.ndim)))


# ----------------------------------------------------------------------------- pad


def _pads(pads, ndim: int) -> tuple[tuple[int, int], ...]:
    p = tuple((int(b), int(a)) for b, a in pads)
    if len(p) != ndim:
        raise MaceqError(f"pad: need {ndim} (before, after) pairs, got {len(p)}")
    if any(b < 0 or a < 0 for b, a in p):
        raise MaceqError(f"pad: negative paddings {p} are not supported (TFLite PAD requires >= 0)")
    return p


def _code(pad_code) -> int:
    c = int(pad_code)
    if not 0 <= c <= 255:
        raise MaceqError(f"pad: pad code {c} outside [0, 255]")
    return c


def pad_ref(x, pads, *, pad_code: int) -> np.ndarray:
    """Contract: TFLite PAD/PADV2 (uint8): inside the copied box the input code, elsewhere ``pad_code``."""
    x = _as_u8(x, "pad")
    p = _pads(pads, x.ndim)
    code = _code(pad_code)
    out = np.empty(tuple(d + b + a for d, (b, a) in zip(x.shape, p)), np.uint8)
    for o in np.ndindex(*out.shape):
        i = tuple(v - b for v, (b, _) in zip(o, p))
        inside = all(0 <= v < d for v, d in zip(i, x.shape))
        out[o] = x[i] if inside else code
    return out


def nchw_to_nhwc(x) -> np.ndarray:
    """Contract: ``np.ascontiguousarray(x.transpose(0, 2, 3, 1))`` for a 4-D ``x`` (any dtype): a graph input or
    float tap in the device's layout. One compiled pass on numba's threads (jit.nchw_to_nhwc) where the compiled
    loops run; numpy's strided copy of a 3-channel image took 4-9x as long."""
    x = np.asarray(x)
    if x.ndim != 4:
        raise MaceqError(f"nchw_to_nhwc: expected a 4-D array, got shape {x.shape}")
    if jit.available() and x.dtype.kind in "fiu":
        return jit.nchw_to_nhwc(x)
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1))


def pad(x, pads, *, pad_code: int) -> np.ndarray:
    """Contract: equal to :func:`pad_ref`; ``pads`` = one (before, after) pair per dimension. A 4-D input is padded
    by one compiled pass on numba's threads (jit.pad4) where the compiled loops run."""
    x = _as_u8(x, "pad")
    p = _pads(pads, x.ndim)
    if x.ndim == 4 and jit.available():
        return jit.pad4(x, [b for b, _ in p], [a for _, a in p], _code(pad_code))
    out = np.full(tuple(d + b + a for d, (b, a) in zip(x.shape, p)), _code(pad_code), np.uint8)
    out[tuple(slice(b, b + d) for d, (b, _) in zip(x.shape, p))] = x
    return out


# ----------------------------------------------------------------------------- split


def split_sizes(dim: int, sizes) -> tuple[int, ...]:
    """Contract: the piece sizes of SPLIT_V: non-negative, at most one -1 (the remainder), summing to ``dim``."""
    s = [int(v) for v in sizes]
    if not s:
        raise MaceqError("split: no sizes")
    if s.count(-1) > 1 or any(v < -1 for v in s):
        raise MaceqError(f"split: bad sizes {tuple(s)}")
    if -1 in s:
        rest = dim - sum(v for v in s if v >= 0)
        if rest < 0:
            raise MaceqError(f"split: sizes {tuple(s)} exceed the dimension {dim}")
        s[s.index(-1)] = rest
    if sum(s) != dim:
        raise MaceqError(f"split: sizes {tuple(s)} do not sum to the dimension {dim}")
    return tuple(s)


def split_ref(x, *, axis: int, sizes) -> list[np.ndarray]:
    """Contract: TFLite SPLIT_V (SPLIT with equal sizes): consecutive pieces along ``axis``, element by element."""
    x = _as_u8(x, "split")
    ax = _axis(axis, x.ndim, "split")
    out, start = [], 0
    for size in split_sizes(x.shape[ax], sizes):
        shape = tuple(size if d == ax else n for d, n in enumerate(x.shape))
        piece = np.empty(shape, np.uint8)
        for o in np.ndindex(*shape):
            piece[o] = x[tuple(v + start if d == ax else v for d, v in enumerate(o))]
        out.append(piece)
        start += size
    return out


def split(x, *, axis: int, sizes) -> list[np.ndarray]:
    """Contract: equal to :func:`split_ref`; contiguous copies of numpy slices."""
    x = _as_u8(x, "split")
    ax = _axis(axis, x.ndim, "split")
    bounds = np.cumsum((0,) + split_sizes(x.shape[ax], sizes))
    return [np.ascontiguousarray(np.take(x, np.arange(lo, hi), axis=ax)) for lo, hi in zip(bounds[:-1], bounds[1:])]


# ----------------------------------------------------------------------------- strided slice


def _clamp(v: int, lo: int, hi: int) -> int:
    return hi if v > hi else lo if v < lo else v


def strided_slice_indices(size: int, begin: int, end: int, stride: int, *, begin_mask: bool = False,
                          end_mask: bool = False, shrink: bool = False) -> list[int]:
    """Contract: the input indices one axis of TFLite STRIDED_SLICE visits (StartForAxis/StopForAxis/LoopCondition)."""
    if stride == 0:
        raise MaceqError("strided_slice: stride 0")
    if begin_mask:
        start = 0 if stride > 0 else size - 1
    else:
        start = begin + size if begin < 0 else begin
        start = _clamp(start, 0, size) if stride > 0 else _clamp(start, -1, size - 1)
    stop = start + 1 if shrink else end
    if end_mask:
        stop = size if stride > 0 else -1
    else:
        stop = stop + size if stop < 0 else stop
        stop = _clamp(stop, 0, size) if stride > 0 else _clamp(stop, -1, size - 1)
    idx, i = [], start
    while (i < stop) if stride > 0 else (i > stop):
        idx.append(i)
        i += stride
    if shrink and len(idx) != 1:
        raise MaceqError(f"strided_slice: shrunk axis selects {len(idx)} elements, not 1")
    return idx


def _slice_plan(x, begin, end, strides, begin_mask, end_mask, shrink_axis_mask):
    b, e, s = (tuple(int(v) for v in a) for a in (begin, end, strides))
    if not (len(b) == len(e) == len(s) == x.ndim):
        raise MaceqError(f"strided_slice: begin/end/strides must have {x.ndim} entries, got {len(b)}, {len(e)}, {len(s)}")
    axes = [strided_slice_indices(x.shape[d], b[d], e[d], s[d], begin_mask=bool(begin_mask >> d & 1),
                                  end_mask=bool(end_mask >> d & 1), shrink=bool(shrink_axis_mask >> d & 1))
            for d in range(x.ndim)]
    out_shape = tuple(len(ix) for d, ix in enumerate(axes) if not shrink_axis_mask >> d & 1)
    return axes, out_shape


def strided_slice_ref(x, *, begin, end, strides, begin_mask: int = 0, end_mask: int = 0,
                      shrink_axis_mask: int = 0) -> np.ndarray:
    """Contract: TFLite STRIDED_SLICE (no ellipsis / new-axis masks), element by element; bit d of a mask is axis d."""
    x = _as_u8(x, "strided_slice")
    axes, out_shape = _slice_plan(x, begin, end, strides, begin_mask, end_mask, shrink_axis_mask)
    full = np.empty(tuple(len(ix) for ix in axes), np.uint8)
    for o in np.ndindex(*full.shape):
        full[o] = x[tuple(axes[d][v] for d, v in enumerate(o))]
    return full.reshape(out_shape)


def strided_slice(x, *, begin, end, strides, begin_mask: int = 0, end_mask: int = 0,
                  shrink_axis_mask: int = 0) -> np.ndarray:
    """Contract: equal to :func:`strided_slice_ref`; one ``np.ix_`` gather."""
    x = _as_u8(x, "strided_slice")
    axes, out_shape = _slice_plan(x, begin, end, strides, begin_mask, end_mask, shrink_axis_mask)
    if any(len(ix) == 0 for ix in axes):
        return np.empty(out_shape, np.uint8)
    return np.ascontiguousarray(x[np.ix_(*[np.asarray(ix, np.int64) for ix in axes])]).reshape(out_shape)


def onnx_slice_args(shape, *, starts, ends, axes=None, steps=None, node: str = "Slice") -> dict:
    """Contract: ONNX Slice (opset 10+) -> keyword arguments of :func:`strided_slice` (full-rank begin/end/strides).

    ONNX (operators.md, Slice): negative starts/ends add the dimension, then starts clamp to
    ``[0, dim]`` (step > 0) or ``[0, dim - 1]`` (step < 0) and ends to ``[0, dim]`` or
    ``[-1, dim - 1]``; huge sentinels (INT64_MAX) therefore mean "to the end". The clamped
    values are passed without masks; an end of -1 after clamping (negative step to the
    front) becomes ``end_mask``, because STRIDED_SLICE would read -1 as "size - 1". Axes not
    named take the whole dimension. One onnxruntime rule goes beyond the ONNX text and is
    followed (tested against onnxruntime 1.32; slice_helper.h ``PrepareForComputeHelper``):
    an end of exactly INT32_MAX or INT64_MAX means numpy's ``None``, i.e. -1 (to the front)
    for a negative step, where the text would clamp it to ``dim - 1`` (an empty slice).
    """
    shape = tuple(int(d) for d in shape)
    nd = len(shape)
    starts = [int(v) for v in starts]
    ends = [int(v) for v in ends]
    axes = list(range(len(starts))) if axes is None else [_axis(a, nd, node) for a in axes]
    steps = [1] * len(starts) if steps is None else [int(v) for v in steps]
    if not (len(starts) == len(ends) == len(axes) == len(steps)) or len(set(axes)) != len(axes):
        raise MaceqError(f"{node}: starts/ends/axes/steps must have equal lengths and distinct axes")
    begin, end, stride = [0] * nd, list(shape), [1] * nd
    end_mask = 0
    for st, en, ax, sp in zip(starts, ends, axes, steps):
        if sp == 0:
            raise MaceqError(f"{node}: Slice step 0")
        dim = shape[ax]
        if en in (_INT32_MAX, _INT64_MAX):
            en = dim if sp > 0 else -dim - 1  # onnxruntime: "None", the end in the step direction
        st = st + dim if st < 0 else st
        en = en + dim if en < 0 else en
        if sp > 0:
            st, en = _clamp(st, 0, dim), _clamp(en, 0, dim)
        else:
            st, en = _clamp(st, 0, dim - 1), _clamp(en, -1, dim - 1)
            if en == -1:
                end_mask |= 1 << ax
        begin[ax], end[ax], stride[ax] = st, en, sp
    return {"begin": begin, "end": end, "strides": stride, "end_mask": end_mask}
