"""Float emitters for Resize / Upsample: the ONNX sampling rule matched to one of MACE's index or coordinate rules."""
from __future__ import annotations

import numpy as np

from maceq.mace import add_arg
from maceq.mace.enums import DataType, ResizeCoordinateMode
from maceq.quant.float_core import Emitter, stored_shape
from maceq.runtime.kernels import float_ops as K  # MACE's resize index / weight formulas


def _resize_scales(em: Emitter, in_hw, out_hw) -> tuple[float, float]:
    """The per-axis scales onnxruntime uses (given scales, or out/in from sizes)."""
    scales = None
    if em.n.op_type == "Upsample":
        scales = em.attr("scales")
        if scales is None:
            scales = [float(v) for v in em.const(1, "scales").ravel()]
    else:
        if em.g.opset < 11:
            scales = [float(v) for v in em.const(1, "scales").ravel()]
        elif em.has(2) and em.const(2, "scales").size:
            scales = [float(v) for v in em.const(2, "scales").ravel()]
    if scales is not None:
        if len(scales) != 4 or scales[0] != 1.0 or scales[1] != 1.0:
            raise em.err(f"scales {scales}: only H and W may be resized")
        return float(np.float32(scales[2])), float(np.float32(scales[3]))
    return tuple(float(np.float32(o) / np.float32(i)) for i, o in zip(in_hw, out_hw))


def _onnx_coords(em: Emitter, ct: str, in_size: int, out_size: int, scale: float) -> np.ndarray:
    """x_original per output index, float32, as onnxruntime's upsamplebase.h computes it."""
    x = np.arange(out_size, dtype=np.float32)
    s = np.float32(scale)
    if ct == "half_pixel":
        return (x + np.float32(0.5)) / s - np.float32(0.5)
    if ct == "pytorch_half_pixel":
        return (x + np.float32(0.5)) / s - np.float32(0.5) if out_size > 1 else np.zeros(out_size, np.float32)
    if ct == "align_corners":
        if out_size == 1:
            return np.zeros(1, np.float32)
        return x * np.float32(in_size - 1) / np.float32(out_size - 1)
    if ct == "asymmetric":
        return x / s
    if ct == "tf_half_pixel_for_nn":
        return (x + np.float32(0.5)) / s
    raise em.err(f"coordinate_transformation_mode '{ct}' is not supported")


def _onnx_nearest(em: Emitter, ct: str, nm: str, in_size: int, out_size: int, scale: float) -> np.ndarray:
    """Input index per output index, as onnxruntime's nearest resize picks it (then clamped)."""
    x = _onnx_coords(em, ct, in_size, out_size, scale)
    tr = np.trunc(x)
    tie = x == tr + np.float32(0.5)  # static_cast<int64_t>(x) + 0.5f == x
    away = np.where(np.abs(x - tr) >= np.float32(0.5), tr + np.sign(x), tr)  # std::round, exactly
    if nm == "round_prefer_floor":
        idx = np.where(tie, tr, away)
    elif nm == "round_prefer_ceil":
        idx = np.where(tie, np.ceil(x), away)
    elif nm == "floor":
        idx = np.floor(x)
    elif nm == "ceil":
        idx = np.ceil(x)
    elif nm == "simple":  # Upsample: ceil when downsampling, truncation otherwise
        idx = np.ceil(x) if scale < 1 else np.trunc(x)
    else:
        raise em.err(f"nearest_mode '{nm}' is not supported")
    return np.clip(idx.astype(np.int64), 0, in_size - 1)


def _check_resize(em: Emitter, x_shape, out_nchw) -> str:
    """Refuse the Resize forms MACE cannot run; return the coordinate transformation mode."""
    if len(x_shape) != 4 or out_nchw[:2] != x_shape[:2]:
        raise em.err("only 4-D inputs resized over H and W are supported")
    for key, ok in (("antialias", 0), ("exclude_outside", 0)):
        if int(em.attr(key, ok)) != ok:
            raise em.err(f"{key} = {em.attr(key)} is not supported")
    if em.attr("axes") is not None or (em.attr("keep_aspect_ratio_policy", "stretch") or "stretch") != "stretch":
        raise em.err("axes / keep_aspect_ratio_policy are not supported")
    upsample = em.n.op_type == "Upsample"
    ct = "asymmetric" if upsample else (em.attr("coordinate_transformation_mode", "half_pixel") or "half_pixel")
    if ct == "tf_crop_and_resize":
        raise em.err("tf_crop_and_resize is not supported")
    return ct


def _nearest(em: Emitter, ct: str, in_hw, out_hw, scales, out_nchw) -> str:
    """ResizeNearestNeighbor with the align_corners rule that picks onnxruntime's indices; returns its output."""
    upsample = em.n.op_type == "Upsample"
    nm = "simple" if upsample else (em.attr("nearest_mode", "round_prefer_floor") or "round_prefer_floor")
    want = [_onnx_nearest(em, ct, nm, i, o, s) for i, o, s in zip(in_hw, out_hw, scales)]
    choice = None
    for align in (False, True):
        got = [K.nearest_index(i, o, align_corners=align) for i, o in zip(in_hw, out_hw)]
        if all(np.array_equal(a, b) for a, b in zip(got, want)):
            choice = align
            break
    if choice is None:
        raise em.err(f"nearest resize ({ct}, {nm}) {in_hw} -> {out_hw} matches neither of MACE's index "
                     "rules (floor(i*in/out) or roundf(i*(in-1)/(out-1)))")
    x = em.nchw_in(0)
    y = em.tmp("nchw")
    size = em.add_const("size", np.array(out_hw), DataType.DT_INT32)
    op = em.add_op("ResizeNearestNeighbor", [x, size], [y], [out_nchw])
    add_arg(op, "size", list(out_hw))
    add_arg(op, "align_corners", int(choice))
    return y


def _bilinear_rule(em: Emitter, ct: str, in_hw, out_hw, scales):
    """(align_corners, ResizeCoordinateMode) whose source coordinates equal onnxruntime's, or None."""
    want = [np.clip(_onnx_coords(em, ct, i, o, s), 0, i - 1) for i, o, s in zip(in_hw, out_hw, scales)]
    for align, cmode in ((False, ResizeCoordinateMode.NONE), (True, ResizeCoordinateMode.NONE), (False, ResizeCoordinateMode.HALF_PIXEL)):
        ok = True
        for (i, o), w in zip(zip(in_hw, out_hw), want):
            lower, upper, lerp = K.bilinear_weights(i, o, align_corners=align, mode=cmode)
            eff = np.where(upper == lower, lower, lower + lerp)
            ok &= bool(np.allclose(eff, w, rtol=0, atol=1e-5))
        if ok:
            return align, cmode
    return None


def _bilinear(em: Emitter, ct: str, in_hw, out_hw, scales, out_nchw) -> str:
    """ResizeBilinear with the coordinate rule that matches onnxruntime's; returns its output."""
    choice = _bilinear_rule(em, ct, in_hw, out_hw, scales)
    if choice is None:
        raise em.err(f"linear resize ({ct}) {in_hw} -> {out_hw} with scales {scales} matches none of "
                     "MACE's coordinate rules")
    x = em.nchw_in(0)
    y = em.tmp("nchw")
    op = em.add_op("ResizeBilinear", [x], [y], [out_nchw])
    add_arg(op, "size", list(out_hw))
    add_arg(op, "align_corners", int(choice[0]))
    if choice[1] is not ResizeCoordinateMode.NONE:
        add_arg(op, "coordinate_transformation_mode", ResizeCoordinateMode(choice[1].value))
    return y


def resize(em: Emitter):
    """Resize / Upsample over H and W, nearest or (bi)linear (NCHW)."""
    x_shape, out_nchw = em.shape(0), em.oshape()
    ct = _check_resize(em, x_shape, out_nchw)
    mode = em.attr("mode", "nearest") or "nearest"
    in_hw, out_hw = x_shape[2:], out_nchw[2:]
    scales = _resize_scales(em, in_hw, out_hw)
    if mode == "nearest":
        y = _nearest(em, ct, in_hw, out_hw, scales, out_nchw)
    elif mode in ("linear", "bilinear"):
        y = _bilinear(em, ct, in_hw, out_hw, scales, out_nchw)
    else:
        raise em.err(f"mode '{mode}' is not supported")
    dst, trailing = em.result(fusable=False)
    em.nhwc_out(y, out_nchw, dst)
    em.finish(dst, trailing, stored_shape(out_nchw))
