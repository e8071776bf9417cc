"""uint8 ResizeBilinear / ResizeNearestNeighbor: TFLite's reference kernels and MACE's CPU ResizeBilinear.

NHWC uint8 in and out; the codes are interpolated directly (the output keeps the input's
scale and zero point in both runtimes). ``f32(e)`` below is one float32 operation, rounded
to nearest even; numpy float32 ufuncs are exactly that (one rounding per operation, no
fused multiply-add), which the fast paths rely on.

TFLite RESIZE_BILINEAR, uint8, BUILTIN_REF (LiteRT tflite/kernels/resize_bilinear.cc ->
``reference_ops::ResizeBilinear<uint8_t>``, the float template in
internal/reference/resize_bilinear.h; ``ResizeBilinearInteger`` is only for int8/int16)::

    scale = f32(float(in) / out)            align_corners and out > 1: f32(float(in - 1) / (out - 1))
    v     = f32(float(i) * scale)           half_pixel_centers: f32(f32(f32(float(i) + 0.5) * scale) - 0.5)
    i0    = max(int(floor(v)), 0) ;  i1 = min(int(ceil(v)), in - 1) ;  d = f32(v - float(i0))
    out   = uint8_trunc( f32(f32(f32(f32(t00 + t10) + t01) + t11) + 0.5) )
    t00 = f32(f32(x[y0, x0] * f32(1 - dy)) * f32(1 - dx))    t10 = f32(f32(x[y1, x0] * dy) * f32(1 - dx))
    t01 = f32(f32(x[y0, x1] * f32(1 - dy)) * dx)             t11 = f32(f32(x[y1, x1] * dy) * dx)

(``rounding_offset = 0.5`` because uint8 is an integer type; then ``static_cast<uint8_t>``
truncates.) With half-pixel centers ``v`` can be negative: ``i0 = 0`` but ``d = v`` stays
negative, so the weights extrapolate (``1 - d > 1``) between two equal rows.

TFLite RESIZE_NEAREST_NEIGHBOR (internal/reference/resize_nearest_neighbor.h
``GetNearestNeighbor``)::

    scale = align_corners and out > 1 ? f32(float(in - 1) / (out - 1)) : f32(float(in) / out)
    t     = f32(f32(float(i) + offset) * scale)        offset = 0.5 with half_pixel_centers, else 0
    j     = min(align_corners ? int(round_half_away(t)) : int(floor(t)), in - 1)
    j     = max(j, 0) with half_pixel_centers

MACE ResizeBilinear, CPU uint8 (XiaoMi/mace mace/ops/resize_bilinear.cc, the
``ResizeBilinearOp<CPU, uint8_t>`` specialisation; NHWC)::

    out size = size arg, or with the ONNX scale arg: int(f32(scale_arg * in)); scale = f32(1 / scale_arg)
    else     scale = CalculateResizeScale (mace/ops/common/utils.h, the same formula as TFLite's)
    if out size == in size: copy the input
    v     = f32(float(i) * scale)       HALF_PIXEL: f32(f32(f32(float(i) + 0.5) * scale) - 0.5)
                                        PYTORCH_HALF_PIXEL: the same when out > 1, else 0
    lower = max(int(floor(v)), 0) ;  upper = min(int(ceil(v)), in - 1) ;  lerp = f32(v - floor(v))
    top    = f32(float(tl) + f32(float(tr - tl) * xlerp))        (ComputeLerp<uint8_t>)
    bottom = f32(float(bl) + f32(float(br - bl) * xlerp))
    out    = Saturate(roundf(f32(top + f32(f32(bottom - top) * ylerp))))

Where MACE differs from TFLite: (1) two nested lerps rounded with ``roundf`` (half away)
instead of four weighted products plus 0.5 truncated, so the float errors differ and
near-half results can round differently (measured on random data: 1 in 22,784 to 183 in
149,896 codes, depending on the sizes); (2) the
lerp is ``v - floor(v)``, never negative, where TFLite extrapolates with ``v - i0``; (3) a
same-size resize is a copy, even when MACE's ONNX scale arg is not 1 (scale 1.1 on 5 pixels
gives int(5.5) = 5 pixels: copied); with sizes, TFLite's same-size resize reproduces the
input as well (scale 1, exact coordinates); (4) MACE's ONNX path (scale args) uses
``f32(1 / scale)`` where TFLite uses ``in / out``, and MACE accepts align_corners together with
a half-pixel mode (TFLite's Prepare rejects the pair) -- a pair that can put the source
coordinate past the input (4 -> 2 pixels: v = 1.5 * 3 - 0.5 = 4), where MACE reads out of
bounds and the kernel here raises MaceqError; (5) older MACE versions (before the 2021
coordinate_transformation_mode arg) have only the asymmetric coordinates and compute
``lower = int(v)``, ``upper = min(lower + 1, in - 1)``, ``lerp = v - lower``, which for
``v >= 0`` is the same arithmetic. MACE registers no uint8 ResizeNearestNeighbor on the CPU.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from maceq.errors import MaceqError
from maceq.mace.enums import ResizeCoordinateMode
from maceq.runtime.fixedpoint import round_half_away

__all__ = [
    "ResizeCoordinateMode",
    "ResizeKind",
    "TfliteResizeFlags",
    "MaceResizeFlags",
    "ResizeMapping",
    "resize_scale",
    "resize_bilinear",
    "resize_bilinear_ref",
    "resize_nearest",
    "resize_nearest_ref",
    "nearest_indices",
    "resize_bilinear_mace",
    "resize_bilinear_mace_ref",
    "mace_resize_out_hw",
    "onnx_resize_mapping",
]

_F32 = np.float32


class ResizeKind(enum.Enum):
    BILINEAR = "linear"
    NEAREST = "nearest"


@dataclass(frozen=True)
class TfliteResizeFlags:
    """The options of TFLite's RESIZE_BILINEAR / RESIZE_NEAREST_NEIGHBOR (and of resize_bilinear/resize_nearest)."""

    align_corners: bool
    half_pixel_centers: bool


@dataclass(frozen=True)
class MaceResizeFlags:
    """The args of :func:`resize_bilinear_mace`: ``scale_hw`` is MACE's ONNX scale arg, or None (use sizes)."""

    align_corners: bool
    coordinate_mode: ResizeCoordinateMode
    scale_hw: tuple[float, float] | None


@dataclass(frozen=True)
class ResizeMapping:
    """How an ONNX Resize runs here: ``tflite`` / ``mace`` are None where that kernel cannot express it."""

    kind: ResizeKind
    tflite: TfliteResizeFlags | None
    mace: MaceResizeFlags | None


# ----------------------------------------------------------------------------- shared pieces


def _check_x(x, name: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 4 or x.dtype != np.uint8:
        raise MaceqError(f"{name}: input must be uint8 NHWC (4-D), got {x.dtype} {x.shape}")
    if x.shape[1] < 1 or x.shape[2] < 1:
        raise MaceqError(f"{name}: empty spatial input {x.shape}")
    return x


def _check_out(out_hw, name: str) -> tuple[int, int]:
    oh, ow = (int(v) for v in out_hw)
    if oh < 1 or ow < 1:
        raise MaceqError(f"{name}: output size must be positive, got {out_hw}")
    if max(oh, ow) >= 1 << 24:
        raise MaceqError(f"{name}: output size {out_hw} too large (float32 index arithmetic)")
    return oh, ow


def resize_scale(in_size: int, out_size: int, *, align_corners: bool) -> np.float32:
    """Contract: the float32 ratio input/output that TFLite and MACE both use.

    TFLite ``static_cast<float>(in) / out`` (bilinear) and ``in / static_cast<float>(out)``
    (nearest) are the same float32 division; with ``align_corners`` and ``out > 1`` the
    sizes are ``in - 1`` and ``out - 1``. MACE's ``CalculateResizeScale`` (mace/ops/common/
    utils.h) is the same expression. Sizes below 2^24 convert to float32 exactly.
    """
    if align_corners and out_size > 1:
        return _F32(_F32(in_size - 1) / _F32(out_size - 1))
    return _F32(_F32(in_size) / _F32(out_size))


def _tflite_bilinear_axis(out_size: int, in_size: int, scale: np.float32, half_pixel: bool):
    """TFLite ComputeInterpolationValues for every output index: (i0, i1, d) arrays."""
    i = np.arange(out_size, dtype=np.float32)  # float(i): exact below 2^24
    if half_pixel:
        v = (i + _F32(0.5)) * scale - _F32(0.5)  # three float32 operations, each rounded
    else:
        v = i * scale
    i0 = np.maximum(np.floor(v).astype(np.int64), 0)
    i1 = np.minimum(np.ceil(v).astype(np.int64), in_size - 1)
    d = v - i0.astype(np.float32)  # input_y - y0 with the clamped y0 (float32, exact: Sterbenz)
    return i0, i1, d


def _trunc_u8(s: np.ndarray, name: str) -> np.ndarray:
    """static_cast<uint8_t>(float): truncation toward zero; outside (-1, 256) it is undefined in C."""
    if s.size and (float(s.min()) <= -1.0 or float(s.max()) >= 256.0):
        raise MaceqError(f"{name}: interpolated value outside the uint8 range")
    return np.trunc(s).astype(np.uint8)


# ----------------------------------------------------------------------------- TFLite bilinear


def resize_bilinear_ref(x, *, out_hw, align_corners: bool = False, half_pixel_centers: bool = False) -> np.ndarray:
    """Contract: TFLite reference_ops::ResizeBilinear<uint8_t> (float32 template, +0.5, truncation).

    The loops of resize_bilinear.h, one output pixel at a time (batch and channels as
    float32 vectors); every ``f32`` step of the module docstring is one numpy float32 op.
    """
    x = _check_x(x, "resize_bilinear")
    oh, ow = _check_out(out_hw, "resize_bilinear")
    if align_corners and half_pixel_centers:
        raise MaceqError("resize_bilinear: align_corners and half_pixel_centers cannot both be set (TFLite Prepare)")
    n, h, w, c = x.shape
    hs = resize_scale(h, oh, align_corners=align_corners)
    ws = resize_scale(w, ow, align_corners=align_corners)
    one, half = _F32(1), _F32(0.5)
    out = np.empty((n, oh, ow, c), np.uint8)
    for y in range(oh):
        in_y = _F32(_F32(_F32(y) + half) * hs) - half if half_pixel_centers else _F32(_F32(y) * hs)
        y0 = max(int(math.floor(in_y)), 0)
        y1 = min(int(math.ceil(in_y)), h - 1)
        dy = _F32(in_y - _F32(y0))
        for xx in range(ow):
            in_x = _F32(_F32(_F32(xx) + half) * ws) - half if half_pixel_centers else _F32(_F32(xx) * ws)
            x0 = max(int(math.floor(in_x)), 0)
            x1 = min(int(math.ceil(in_x)), w - 1)
            dx = _F32(in_x - _F32(x0))
            v00, v10 = x[:, y0, x0, :].astype(np.float32), x[:, y1, x0, :].astype(np.float32)
            v01, v11 = x[:, y0, x1, :].astype(np.float32), x[:, y1, x1, :].astype(np.float32)
            s = v00 * (one - dy) * (one - dx) + v10 * dy * (one - dx) + v01 * (one - dy) * dx + v11 * dy * dx
            out[:, y, xx, :] = _trunc_u8(s + half, "resize_bilinear")
    return out


def resize_bilinear(x, *, out_hw, align_corners: bool = False, half_pixel_centers: bool = False) -> np.ndarray:
    """Contract: equal to :func:`resize_bilinear_ref` bit for bit; whole-tensor float32 broadcasting.

    Per-axis (i0, i1, d) tables, then the same float32 operations in the same order over the
    (N, OH, OW, C) grid.
    """
    x = _check_x(x, "resize_bilinear")
    oh, ow = _check_out(out_hw, "resize_bilinear")
    if align_corners and half_pixel_centers:
        raise MaceqError("resize_bilinear: align_corners and half_pixel_centers cannot both be set (TFLite Prepare)")
    _, h, w, _ = x.shape
    y0, y1, dy = _tflite_bilinear_axis(oh, h, resize_scale(h, oh, align_corners=align_corners), half_pixel_centers)
    x0, x1, dx = _tflite_bilinear_axis(ow, w, resize_scale(w, ow, align_corners=align_corners), half_pixel_centers)
    one = _F32(1)
    wy0, wy1 = (one - dy)[:, None, None], dy[:, None, None]  # (OH, 1, 1)
    wx0, wx1 = (one - dx)[:, None], dx[:, None]              # (OW, 1)
    rows0, rows1 = x[:, y0], x[:, y1]
    v00 = rows0[:, :, x0].astype(np.float32)
    v10 = rows1[:, :, x0].astype(np.float32)
    v01 = rows0[:, :, x1].astype(np.float32)
    v11 = rows1[:, :, x1].astype(np.float32)
    s = v00 * wy0 * wx0
    s += v10 * wy1 * wx0
    s += v01 * wy0 * wx1
    s += v11 * wy1 * wx1
    s += _F32(0.5)
    return _trunc_u8(s, "resize_bilinear")


# ----------------------------------------------------------------------------- TFLite nearest


def nearest_indices(out_size: int, in_size: int, *, align_corners: bool, half_pixel_centers: bool) -> np.ndarray:
    """Contract: TFLite GetNearestNeighbor for every output index, as an int64 array (vectorised)."""
    scale = resize_scale(in_size, out_size, align_corners=align_corners)
    offset = _F32(0.5) if half_pixel_centers else _F32(0.0)
    t = (np.arange(out_size, dtype=np.float32) + offset) * scale  # two float32 ops
    j = round_half_away(t) if align_corners else np.floor(t).astype(np.int64)
    j = np.minimum(np.asarray(j, dtype=np.int64), in_size - 1)
    if half_pixel_centers:
        j = np.maximum(j, 0)
    return j


def resize_nearest_ref(x, *, out_hw, align_corners: bool = False, half_pixel_centers: bool = False) -> np.ndarray:
    """Contract: TFLite reference_ops::ResizeNearestNeighbor (uint8), one output pixel at a time."""
    x = _check_x(x, "resize_nearest")
    oh, ow = _check_out(out_hw, "resize_nearest")
    n, h, w, c = x.shape

    def nearest(value: int, in_size: int, out_size: int) -> int:
        scale = resize_scale(in_size, out_size, align_corners=align_corners)
        offset = _F32(0.5) if half_pixel_centers else _F32(0.0)
        t = _F32(_F32(_F32(value) + offset) * scale)
        j = int(round_half_away(t)) if align_corners else int(math.floor(t))
        j = min(j, in_size - 1)
        return max(0, j) if half_pixel_centers else j

    out = np.empty((n, oh, ow, c), np.uint8)
    for y in range(oh):
        in_y = nearest(y, h, oh)
        for xx in range(ow):
            out[:, y, xx, :] = x[:, in_y, nearest(xx, w, ow), :]  # memcpy of the depth vector
    return out


def resize_nearest(x, *, out_hw, align_corners: bool = False, half_pixel_centers: bool = False) -> np.ndarray:
    """Contract: equal to :func:`resize_nearest_ref`; a gather with :func:`nearest_indices`."""
    x = _check_x(x, "resize_nearest")
    oh, ow = _check_out(out_hw, "resize_nearest")
    ys = nearest_indices(oh, x.shape[1], align_corners=align_corners, half_pixel_centers=half_pixel_centers)
    xs = nearest_indices(ow, x.shape[2], align_corners=align_corners, half_pixel_centers=half_pixel_centers)
    return np.ascontiguousarray(x[:, ys][:, :, xs])


# ----------------------------------------------------------------------------- MACE bilinear


def mace_resize_out_hw(in_hw, *, out_hw=None, scale_hw=None) -> tuple[int, int]:
    """Contract: MACE's output size: ``int(f32(scale_arg * in))`` with the ONNX scale args, else ``out_hw``."""
    if scale_hw is not None:
        sizes = []
        for s, n in zip(scale_hw, in_hw):
            if not _F32(s) > 0:
                raise MaceqError(f"resize_bilinear_mace: scale args must be positive, got {scale_hw}")
            sizes.append(int(_F32(_F32(s) * _F32(n))))  # static_cast<index_t>(height_scale_ * in_height)
        return _check_out(sizes, "resize_bilinear_mace")
    if out_hw is None:
        raise MaceqError("resize_bilinear_mace: needs out_hw or scale_hw")
    return _check_out(out_hw, "resize_bilinear_mace")


def _mace_scale(in_size: int, out_size: int, scale_arg, align_corners: bool) -> np.float32:
    if scale_arg is not None:
        return _F32(_F32(1) / _F32(scale_arg))  # "ONNX's scale is the opposite of ours"
    return resize_scale(in_size, out_size, align_corners=align_corners)


def _mace_axis(out_size: int, in_size: int, scale: np.float32, mode: ResizeCoordinateMode):
    """MACE ComputeInterpolationWeights: (lower, upper, lerp) arrays."""
    i = np.arange(out_size, dtype=np.float32)
    if mode is ResizeCoordinateMode.HALF_PIXEL or (mode is ResizeCoordinateMode.PYTORCH_HALF_PIXEL and out_size > 1):
        v = (i + _F32(0.5)) * scale - _F32(0.5)
    elif mode is ResizeCoordinateMode.PYTORCH_HALF_PIXEL:
        v = np.zeros(out_size, np.float32)
    else:
        v = i * scale
    f = np.floor(v)
    lower = np.maximum(f.astype(np.int64), 0)
    upper = np.minimum(np.ceil(v).astype(np.int64), in_size - 1)
    if lower.size and int(lower.max()) > in_size - 1:
        raise MaceqError("resize_bilinear_mace: source coordinate past the input (MACE would read out of bounds)")
    return lower, upper, v - f


def _mace_setup(x, out_hw, scale_hw, align_corners, coordinate_mode):
    x = _check_x(x, "resize_bilinear_mace")
    mode = ResizeCoordinateMode(coordinate_mode)
    oh, ow = mace_resize_out_hw(x.shape[1:3], out_hw=out_hw, scale_hw=scale_hw)
    sh, sw = (None, None) if scale_hw is None else scale_hw
    hs = _mace_scale(x.shape[1], oh, sh, align_corners)
    ws = _mace_scale(x.shape[2], ow, sw, align_corners)
    return x, mode, oh, ow, hs, ws


def _mace_saturate_roundf(v: np.ndarray) -> np.ndarray:
    """Saturate<uint8_t>(roundf(v)): round half away from zero, then int and clamp to [0, 255]."""
    return np.clip(round_half_away(v), 0, 255).astype(np.uint8)


def resize_bilinear_mace_ref(x, *, out_hw=None, scale_hw=None, align_corners: bool = False,
                             coordinate_mode: ResizeCoordinateMode = ResizeCoordinateMode.NONE) -> np.ndarray:
    """Contract: MACE ResizeBilinearOp<CPU, uint8_t> (ResizeImageNHWC + ComputeLerp<uint8_t>), pixel by pixel.

    ``scale_hw``: MACE's ``height_scale`` / ``width_scale`` args (ONNX scales; they take
    precedence over ``out_hw``, as in MACE). See the module docstring for the arithmetic.
    """
    x, mode, oh, ow, hs, ws = _mace_setup(x, out_hw, scale_hw, align_corners, coordinate_mode)
    n, h, w, c = x.shape
    if (oh, ow) == (h, w):
        return x.copy()  # std::copy: same size is a copy whatever the mode
    ys = _mace_axis(oh, h, hs, mode)
    xs = _mace_axis(ow, w, ws, mode)
    out = np.empty((n, oh, ow, c), np.uint8)
    for y in range(oh):
        lo_y, up_y, ylerp = int(ys[0][y]), int(ys[1][y]), ys[2][y]
        for xx in range(ow):
            lo_x, up_x, xlerp = int(xs[0][xx]), int(xs[1][xx]), xs[2][xx]
            tl = x[:, lo_y, lo_x, :].astype(np.int32)
            tr = x[:, lo_y, up_x, :].astype(np.int32)
            bl = x[:, up_y, lo_x, :].astype(np.int32)
            br = x[:, up_y, up_x, :].astype(np.int32)
            top = tl.astype(np.float32) + (tr - tl).astype(np.float32) * xlerp
            bottom = bl.astype(np.float32) + (br - bl).astype(np.float32) * xlerp
            out[:, y, xx, :] = _mace_saturate_roundf(top + (bottom - top) * ylerp)
    return out


def resize_bilinear_mace(x, *, out_hw=None, scale_hw=None, align_corners: bool = False,
                         coordinate_mode: ResizeCoordinateMode = ResizeCoordinateMode.NONE) -> np.ndarray:
    """Contract: equal to :func:`resize_bilinear_mace_ref` bit for bit; whole-tensor float32 broadcasting."""
    x, mode, oh, ow, hs, ws = _mace_setup(x, out_hw, scale_hw, align_corners, coordinate_mode)
    _, h, w, _ = x.shape
    if (oh, ow) == (h, w):
        return x.copy()
    lo_y, up_y, ylerp = _mace_axis(oh, h, hs, mode)
    lo_x, up_x, xlerp = _mace_axis(ow, w, ws, mode)
    rows_lo, rows_up = x[:, lo_y], x[:, up_y]
    tl = rows_lo[:, :, lo_x].astype(np.float32)
    tr = rows_lo[:, :, up_x].astype(np.float32)
    bl = rows_up[:, :, lo_x].astype(np.float32)
    br = rows_up[:, :, up_x].astype(np.float32)
    xl = xlerp[:, None]
    top = tl + (tr - tl) * xl        # tr - tl: an exact small integer in float32
    bottom = bl + (br - bl) * xl
    return _mace_saturate_roundf(top + (bottom - top) * ylerp[:, None, None])


# ----------------------------------------------------------------------------- ONNX mapping

_ONNX_MODES = {"nearest": ResizeKind.NEAREST, "linear": ResizeKind.BILINEAR, "bilinear": ResizeKind.BILINEAR}
_ONNX_MACE_MODES = {"asymmetric": ResizeCoordinateMode.NONE, "align_corners": ResizeCoordinateMode.NONE,
                    "half_pixel": ResizeCoordinateMode.HALF_PIXEL, "pytorch_half_pixel": ResizeCoordinateMode.PYTORCH_HALF_PIXEL}


def _onnx_coordinate(i: int, in_size: int, out_size: int, scale: Fraction, ctm: str) -> Fraction:
    """ONNX Resize's x_original for output index i, exact (operators.md, Resize-11/13/18/19)."""
    if ctm == "half_pixel":
        return (i + Fraction(1, 2)) / scale - Fraction(1, 2)
    if ctm == "pytorch_half_pixel":
        return (i + Fraction(1, 2)) / scale - Fraction(1, 2) if out_size > 1 else Fraction(0)
    if ctm == "align_corners":
        return Fraction(0) if out_size == 1 else Fraction(i * (in_size - 1), out_size - 1)
    if ctm == "asymmetric":
        return i / scale
    if ctm == "tf_half_pixel_for_nn":
        return (i + Fraction(1, 2)) / scale
    raise MaceqError(f"unsupported coordinate_transformation_mode {ctm!r}")


def _onnx_nearest_index(v: Fraction, in_size: int, nearest_mode: str) -> int:
    fl = math.floor(v)
    frac = v - fl
    if nearest_mode == "floor":
        j = fl
    elif nearest_mode == "ceil":
        j = math.ceil(v)
    elif nearest_mode == "round_prefer_floor":
        j = fl if frac <= Fraction(1, 2) else fl + 1
    elif nearest_mode == "round_prefer_ceil":
        j = fl if frac < Fraction(1, 2) else fl + 1
    else:
        raise MaceqError(f"unsupported nearest_mode {nearest_mode!r}")
    return min(max(j, 0), in_size - 1)


def onnx_resize_mapping(*, mode: str, coordinate_transformation_mode: str = "half_pixel",
                        nearest_mode: str = "round_prefer_floor", in_hw, out_hw, scales_hw=None,
                        node: str = "Resize") -> ResizeMapping:
    """Contract: which flags of these kernels compute an ONNX Resize over H and W; MaceqError if none does.

    ``scales_hw``: the float32 ``scales`` input for H and W when the node has one (ONNX then
    maps coordinates with that scale, onnxruntime too), else None (``sizes``: scale = out/in).

    - nearest: every candidate TFLite flag pair is run through :func:`nearest_indices` (the
      device's float32 arithmetic) and compared with ONNX's exact (rational) source index
      for every output row and column, including the nearest_mode tie rule and the clamp to
      [0, in - 1]; the first pair that agrees everywhere is returned. So ties are settled for
      the actual sizes (e.g. half_pixel + round_prefer_floor maps to half_pixel_centers for a
      2x upsample, which has no ties, but not for a 2x downsample, which is all ties).
      MACE has no uint8 CPU ResizeNearestNeighbor: ``mace`` is None.
    - linear (bilinear): equal coordinate formulas in exact arithmetic. asymmetric ->
      (False, False); align_corners -> (True, False); half_pixel -> (False, True);
      pytorch_half_pixel -> (False, True) if both output sizes exceed 1, (False, False) if
      both are 1 (source coordinate 0), else not TFLite. The TFLite kernels use in/out, so
      asymmetric/half-pixel need scales equal to out/in exactly (or no scales). MACE:
      NONE / NONE + align_corners / HALF_PIXEL / PYTORCH_HALF_PIXEL, with MACE's scale args
      when the scales are not out/in (MACE then divides by them, like ONNX), provided MACE's
      own output size ``int(f32(scale * in))`` equals ``out_hw``. (The float32 arithmetic of
      either kernel is the device's, not onnxruntime's, and differs from it in the last bits.)
    - cubic, tf_crop_and_resize, tf_half_pixel_for_nn with linear, antialias, and
      everything else neither kernel expresses: MaceqError naming ``node``.
    """
    kind = _ONNX_MODES.get(str(mode))
    if kind is None:
        raise MaceqError(f"{node}: Resize mode {mode!r} is not supported (only nearest and linear)")
    ctm = str(coordinate_transformation_mode)
    in_hw = tuple(int(v) for v in in_hw)
    out_hw = tuple(int(v) for v in out_hw)
    if min(in_hw) < 1 or min(out_hw) < 1:
        raise MaceqError(f"{node}: Resize needs positive sizes, got {in_hw} -> {out_hw}")
    scales = _onnx_scales(in_hw, out_hw, scales_hw, node)
    if kind is ResizeKind.NEAREST:
        return ResizeMapping(kind, _tflite_nearest_flags(in_hw, out_hw, scales, ctm, nearest_mode, node), None)
    exact_ratio = all(s == Fraction(o, i) for s, o, i in zip(scales, out_hw, in_hw))
    tfl = _tflite_bilinear_flags(ctm, out_hw, exact_ratio)
    mace = _mace_bilinear_flags(ctm, in_hw, out_hw, scales, exact_ratio)
    if tfl is None and mace is None:
        raise MaceqError(f"{node}: linear Resize with coordinate_transformation_mode={ctm!r}, "
                         f"{in_hw} -> {out_hw}, scales {scales_hw} has no TFLite or MACE bilinear equivalent")
    return ResizeMapping(kind, tfl, mace)


def _onnx_scales(in_hw: tuple[int, int], out_hw: tuple[int, int], scales_hw, node: str) -> tuple[Fraction, ...]:
    """The exact H and W scales ONNX maps with: the float32 ``scales_hw`` if given, else out/in."""
    if scales_hw is not None:
        scales = tuple(Fraction(float(_F32(s))) for s in scales_hw)
        if min(scales) <= 0:
            raise MaceqError(f"{node}: Resize scales must be positive, got {scales_hw}")
        return scales
    return tuple(Fraction(o, i) for o, i in zip(out_hw, in_hw))


def _tflite_nearest_flags(in_hw: tuple[int, int], out_hw: tuple[int, int], scales: tuple[Fraction, ...], ctm: str,
                          nearest_mode: str, node: str) -> TfliteResizeFlags:
    """The first TFLite flag pair whose nearest source indices equal ONNX's for every row and column."""
    try:
        want = [[_onnx_nearest_index(_onnx_coordinate(i, n, o, s, ctm), n, nearest_mode) for i in range(o)]
                for n, o, s in zip(in_hw, out_hw, scales)]
    except MaceqError as e:
        raise MaceqError(f"{node}: {e}") from None
    for ac, hp in ((False, False), (False, True), (True, False), (True, True)):
        got = [nearest_indices(o, n, align_corners=ac, half_pixel_centers=hp).tolist()
               for n, o in zip(in_hw, out_hw)]
        if got == want:
            return TfliteResizeFlags(ac, hp)
    raise MaceqError(f"{node}: nearest Resize with coordinate_transformation_mode={ctm!r}, "
                     f"nearest_mode={nearest_mode!r}, {in_hw} -> {out_hw} picks source pixels that no "
                     f"TFLite RESIZE_NEAREST_NEIGHBOR flags reproduce")


def _tflite_bilinear_flags(ctm: str, out_hw: tuple[int, int], exact_ratio: bool) -> TfliteResizeFlags | None:
    """The TFLite RESIZE_BILINEAR flags with ONNX's coordinate formula, or None if no pair has it."""
    if ctm == "align_corners":
        return TfliteResizeFlags(True, False)
    if ctm in ("asymmetric", "half_pixel", "pytorch_half_pixel") and exact_ratio:
        if ctm == "asymmetric":
            return TfliteResizeFlags(False, False)
        if ctm == "half_pixel" or min(out_hw) > 1:
            return TfliteResizeFlags(False, True)
        if max(out_hw) == 1:
            return TfliteResizeFlags(False, False)
    return None


def _mace_bilinear_flags(ctm: str, in_hw: tuple[int, int], out_hw: tuple[int, int], scales: tuple[Fraction, ...],
                         exact_ratio: bool) -> MaceResizeFlags | None:
    """MACE's bilinear args for ONNX's coordinate mode and scales; None if MACE lacks the mode or the output size."""
    if ctm not in _ONNX_MACE_MODES:
        return None
    scale_arg = None
    if ctm != "align_corners" and not exact_ratio:
        scale_arg = tuple(float(_F32(float(s))) for s in scales)
        if mace_resize_out_hw(in_hw, scale_hw=scale_arg) != out_hw:
            return None
    return MaceResizeFlags(ctm == "align_corners", _ONNX_MACE_MODES[ctm], scale_arg)
