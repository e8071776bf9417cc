"""uint8 resize kernels (runtime/kernels/resize.py) against independent oracles.

- ``resize_bilinear`` / ``resize_nearest`` (TFLite semantics) against TFLite BUILTIN_REF
  RESIZE_BILINEAR / RESIZE_NEAREST_NEIGHBOR: up- and down-scaling, non-integer ratios,
  align_corners, half_pixel_centers, 1-pixel inputs and outputs.
- ``resize_bilinear_mace`` against ``_mace_scalar`` below: a plain-Python transcription of
  MACE's mace/ops/resize_bilinear.cc (ComputeInterpolationWeights, ResizeImageNHWC,
  ComputeLerp<uint8_t>, Saturate), with float32 rounding done by ``struct`` on Python
  floats -- independent of numpy's float32 code in the kernel.
- ``onnx_resize_mapping`` against onnxruntime's float Resize on the same uint8 values:
  nearest must pick exactly ORT's pixels; linear must stay within one code of ORT (the
  device's float32 arithmetic is not ORT's); unsupported combinations raise.
- Every fast path equals its ``*_ref`` bit for bit.
Oracle comparisons require 0 mismatching elements.
"""
from __future__ import annotations

import math
import struct

import numpy as np
import pytest

from maceq.errors import MaceqError
from maceq.mace.enums import ResizeCoordinateMode
from maceq.runtime.kernels.resize import (
    ResizeKind,
    mace_resize_out_hw,
    onnx_resize_mapping,
    resize_bilinear,
    resize_bilinear_mace,
    resize_bilinear_mace_ref,
    resize_bilinear_ref,
    resize_nearest,
    resize_nearest_ref,
)
from maceq.tests.oracle.tflite_builder import TensorSpec, build_single_op_model, run_ref


def _tflite_resize(op, x, out_hw, align_corners, half_pixel_centers):
    model = build_single_op_model(
        op, [TensorSpec(x.shape, 0.1, 3), TensorSpec((2,), None, None, "int32", np.array(out_hw, np.int32))],
        [TensorSpec((x.shape[0], *out_hw, x.shape[3]), 0.1, 3)],
        options={"align_corners": align_corners, "half_pixel_centers": half_pixel_centers})
    (out,) = run_ref(model, [x])
    return out


def _sizes(rng):
    h, w = int(rng.integers(1, 11)), int(rng.integers(1, 11))
    kind = int(rng.integers(4))
    if kind == 0:  # integer upscale
        f = int(rng.integers(2, 4))
        return (h, w), (h * f, w * f)
    if kind == 1:  # integer downscale
        f = int(rng.integers(2, 4))
        return (h * f, w * f), (h, w)
    return (h, w), (int(rng.integers(1, 21)), int(rng.integers(1, 21)))  # any ratio, 1-pixel ends


def _data(rng, shape, i):
    if i % 3 == 0:  # 0/255 edges: the largest interpolation steps
        return rng.choice(np.array([0, 255], np.uint8), shape)
    return rng.integers(0, 256, shape, dtype=np.uint8)


# ----------------------------------------------------------------------------- TFLite


TFLITE_CASES = [
    # op, fast, ref, flag pairs (align_corners, half_pixel_centers), seed; TFLite's bilinear Prepare
    # rejects align_corners with half_pixel_centers, its nearest accepts the pair
    ("RESIZE_BILINEAR", resize_bilinear, resize_bilinear_ref, [(False, False), (True, False), (False, True)], 900),
    ("RESIZE_NEAREST_NEIGHBOR", resize_nearest, resize_nearest_ref,
     [(False, False), (True, False), (False, True), (True, True)], 901),
]


@pytest.mark.parametrize("op, fast, ref, flags, seed", TFLITE_CASES, ids=[c[0] for c in TFLITE_CASES])
def test_resize_matches_tflite(op, fast, ref, flags, seed):
    rng = np.random.default_rng(seed)
    bad = total = 0
    for i in range(240):
        in_hw, out_hw = _sizes(rng)
        ac, hp = flags[i % len(flags)]
        x = _data(rng, (int(rng.integers(1, 3)), *in_hw, int(rng.integers(1, 5))), i)
        want = _tflite_resize(op, x, out_hw, ac, hp)
        got = fast(x, out_hw=out_hw, align_corners=ac, half_pixel_centers=hp)
        assert got.shape == want.shape
        bad += int(np.sum(got != want))
        total += got.size
        if i % 4 == 0:
            assert np.array_equal(ref(x, out_hw=out_hw, align_corners=ac, half_pixel_centers=hp), got)
    assert bad == 0
    assert total > 40000


def test_resize_bilinear_rounding_is_observable():
    """The data above decides the rounding: +0.5-and-truncate is not plain truncation, and the
    tested outputs include exact .5 results (0/255 inputs on a 2x half-pixel upsample)."""
    x = np.array([0, 255], np.uint8).reshape(1, 1, 2, 1)
    want = _tflite_resize("RESIZE_BILINEAR", x, (1, 4), False, True)
    # source columns -0.25, 0.25, 0.75, 1.25: 0, 63.75, 191.25, 255 -> +0.5, truncated
    assert want.ravel().tolist() == [0, 64, 191, 255]
    assert np.array_equal(resize_bilinear(x, out_hw=(1, 4), half_pixel_centers=True), want)
    y = np.array([0, 1], np.uint8).reshape(1, 1, 2, 1)  # 0.5 exactly at the middle of 3 outputs
    want = _tflite_resize("RESIZE_BILINEAR", y, (1, 3), True, False)
    assert want.ravel().tolist() == [0, 1, 1]
    assert np.array_equal(resize_bilinear(y, out_hw=(1, 3), align_corners=True), want)


def test_bilinear_rejects_align_corners_with_half_pixel():
    with pytest.raises(MaceqError, match="cannot both"):
        resize_bilinear(np.zeros((1, 2, 2, 1), np.uint8), out_hw=(4, 4), align_corners=True, half_pixel_centers=True)


# ----------------------------------------------------------------------------- MACE


def _f32(v: float) -> float:
    """Round a Python float to the nearest float32 (ties to even), as a C float store does."""
    return struct.unpack("f", struct.pack("f", v))[0]


def _roundf(v: float) -> float:
    """C roundf on a float32 value: half away from zero (exact in double for |v| < 2^29)."""
    return math.copysign(math.floor(abs(v) + 0.5), v)


def _mace_scalar(x, *, out_hw=None, scale_hw=None, align_corners=False, mode=0):
    """MACE ResizeBilinearOp<CPU, uint8_t>::Run, transcribed statement by statement on Python ints/floats.

    Every float operation of the C++ is one _f32(...) around the exact double result (for
    +, -, *, / of float32 operands the double result rounds to the same float32).
    """
    batch, in_h, in_w, channels = x.shape
    data = x.tolist()
    height_scale_, width_scale_ = scale_hw if scale_hw is not None else (0.0, 0.0)
    height_scale_, width_scale_ = _f32(height_scale_), _f32(width_scale_)
    if height_scale_ > 0:  # for ONNX
        out_h = int(_f32(height_scale_ * in_h))
        out_w = int(_f32(width_scale_ * in_w))
    else:
        out_h, out_w = out_hw
    assert out_h > 0 and out_w > 0
    if out_h == in_h and out_w == in_w:
        return x.copy()

    def calculate_resize_scale(in_size, out_size):  # mace/ops/common/utils.h
        if align_corners and out_size > 1:
            return _f32(float(in_size - 1) / float(out_size - 1))
        return _f32(float(in_size) / float(out_size))

    height_scale = _f32(1.0 / height_scale_) if height_scale_ > 0 else calculate_resize_scale(in_h, out_h)
    width_scale = _f32(1.0 / width_scale_) if width_scale_ > 0 else calculate_resize_scale(in_w, out_w)

    def compute_interpolation_weights(out_size, in_size, scale):
        interp = [None] * out_size
        for i in range(out_size - 1, -1, -1):
            v = _f32(float(i) * scale)
            if mode == 1:  # HALF_PIXEL
                v = _f32(_f32(_f32(float(i) + 0.5) * scale) - 0.5)
            elif mode == 2:  # PYTORCH_HALF_PIXEL
                v = _f32(_f32(_f32(float(i) + 0.5) * scale) - 0.5) if out_size > 1 else 0.0
            in_f = float(math.floor(v))
            lower = max(int(in_f), 0)
            upper = min(int(math.ceil(v)), in_size - 1)
            interp[i] = (lower, upper, _f32(v - in_f))
        return interp

    ys = compute_interpolation_weights(out_h, in_h, height_scale)
    xs = compute_interpolation_weights(out_w, in_w, width_scale)

    def compute_lerp(tl, tr, bl, br, x_lerp, y_lerp):
        top = _f32(float(tl) + _f32(float(tr - tl) * x_lerp))
        bottom = _f32(float(bl) + _f32(float(br - bl) * x_lerp))
        value = _roundf(_f32(top + _f32(_f32(bottom - top) * y_lerp)))
        rounded = int(value)  # Saturate<uint8_t>
        return 0 if rounded <= 0 else 255 if rounded >= 255 else rounded

    out = np.zeros((batch, out_h, out_w, channels), np.uint8)
    for b in range(batch):
        for y in range(out_h):
            ylo, yup, ylerp = ys[y]
            for xx in range(out_w):
                xlo, xup, xlerp = xs[xx]
                for c in range(channels):
                    out[b, y, xx, c] = compute_lerp(data[b][ylo][xlo][c], data[b][ylo][xup][c],
                                                    data[b][yup][xlo][c], data[b][yup][xup][c], xlerp, ylerp)
    return out


def test_resize_bilinear_mace_matches_scalar_transcription():
    rng = np.random.default_rng(902)
    bad = total = refused = 0
    for i in range(150):
        in_hw, out_hw = _sizes(rng)
        mode = ResizeCoordinateMode(i % 3)
        ac = bool(i % 7 == 3)
        scale_hw = None
        if i % 5 == 4:  # MACE's ONNX path: scale args, 1 / scale inside
            scale_hw = tuple(float(np.float32(v)) for v in rng.choice([0.5, 0.75, 1.5, 2.0, 2.5, 3.0, 1.3], 2))
        x = _data(rng, (int(rng.integers(1, 3)), *in_hw, int(rng.integers(1, 4))), i)
        kw = dict(out_hw=None if scale_hw else out_hw, scale_hw=scale_hw, align_corners=ac, coordinate_mode=mode)
        try:
            mace_resize_out_hw(in_hw, out_hw=kw["out_hw"], scale_hw=scale_hw)
        except MaceqError:
            continue  # a scale arg that makes an empty output (MACE_CHECK fails)
        try:
            got = resize_bilinear_mace(x, **kw)
        except MaceqError as e:
            # align_corners with a half-pixel mode can put the source coordinate past the input:
            # MACE then reads out of bounds; the kernel refuses, and the transcription indexes out of range
            assert "out of bounds" in str(e) and ac and mode is not ResizeCoordinateMode.NONE
            with pytest.raises(IndexError):
                _mace_scalar(x, out_hw=out_hw, scale_hw=scale_hw, align_corners=ac, mode=int(mode))
            refused += 1
            continue
        want = _mace_scalar(x, out_hw=out_hw, scale_hw=scale_hw, align_corners=ac, mode=int(mode))
        assert got.shape == want.shape
        bad += int(np.sum(got != want))
        total += got.size
        assert np.array_equal(resize_bilinear_mace_ref(x, **kw), got)
    assert bad == 0
    assert total > 30000
    assert refused < 10


def test_mace_same_size_is_a_copy_even_with_a_scale_arg():
    x = np.arange(5 * 4, dtype=np.uint8).reshape(1, 5, 4, 1)
    assert mace_resize_out_hw((5, 4), scale_hw=(1.1, 1.2)) == (5, 4)
    assert np.array_equal(resize_bilinear_mace(x, scale_hw=(1.1, 1.2)), x)
    assert np.array_equal(_mace_scalar(x, scale_hw=(1.1, 1.2)), x)


def test_mace_and_tflite_bilinear_differ_in_rounding():
    """Same coordinates (asymmetric and half-pixel, sizes given), different arithmetic: measured, not equal."""
    rng = np.random.default_rng(903)
    diff = total = 0
    for mode, hp in ((ResizeCoordinateMode.NONE, False), (ResizeCoordinateMode.HALF_PIXEL, True)):
        for in_hw, out_hw in (((7, 9), (19, 23)), ((16, 16), (5, 7)), ((3, 5), (12, 20))):
            x = rng.integers(0, 256, (2, *in_hw, 8), dtype=np.uint8)
            m = resize_bilinear_mace(x, out_hw=out_hw, coordinate_mode=mode)
            t = _tflite_resize("RESIZE_BILINEAR", x, out_hw, False, hp)
            assert int(np.abs(m.astype(int) - t.astype(int)).max()) <= 1
            diff += int(np.sum(m != t))
            total += m.size
    assert 0 < diff < total // 20


# ----------------------------------------------------------------------------- ONNX mapping


def _ort_resize(x_nhwc, out_hw, mode, ctm, nearest_mode, scales_hw=None):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    x = x_nhwc.transpose(0, 3, 1, 2).astype(np.float32)
    inits = [numpy_helper.from_array(np.zeros(0, np.float32), "roi")]
    if scales_hw is not None:
        inits.append(numpy_helper.from_array(np.array([1, 1, *scales_hw], np.float32), "scales"))
        names = ["x", "roi", "scales"]
    else:
        inits.append(numpy_helper.from_array(np.array([x.shape[0], x.shape[1], *out_hw], np.int64), "sizes"))
        names = ["x", "roi", "", "sizes"]
    node = helper.make_node("Resize", names, ["y"], mode=mode, coordinate_transformation_mode=ctm,
                            nearest_mode=nearest_mode)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0].transpose(0, 2, 3, 1)


NEAREST_CASES = [
    ("asymmetric", "floor"), ("align_corners", "round_prefer_ceil"), ("tf_half_pixel_for_nn", "floor"),
    ("half_pixel", "round_prefer_floor"), ("half_pixel", "round_prefer_ceil"), ("pytorch_half_pixel", "floor"),
    ("asymmetric", "round_prefer_floor"), ("align_corners", "round_prefer_floor"), ("half_pixel", "ceil"),
]
SIZE_PAIRS = [((4, 6), (8, 12)), ((8, 12), (4, 6)), ((5, 7), (11, 9)), ((6, 6), (4, 9)), ((3, 3), (1, 5)),
              ((9, 4), (3, 12))]


def test_onnx_nearest_mapping_reproduces_onnxruntime_or_raises():
    rng = np.random.default_rng(904)
    mapped = raised = 0
    for ctm, nm in NEAREST_CASES:
        for in_hw, out_hw in SIZE_PAIRS:
            x = rng.integers(0, 256, (1, *in_hw, 2), dtype=np.uint8)
            want = _ort_resize(x, out_hw, "nearest", ctm, nm)
            try:
                m = onnx_resize_mapping(mode="nearest", coordinate_transformation_mode=ctm, nearest_mode=nm,
                                        in_hw=in_hw, out_hw=out_hw, node="up1")
            except MaceqError as e:
                assert "up1" in str(e)
                raised += 1
                for ac in (False, True):  # the refusal is real: no flag pair reproduces onnxruntime
                    for hp in (False, True):
                        got = resize_nearest(x, out_hw=out_hw, align_corners=ac, half_pixel_centers=hp)
                        assert not np.array_equal(got, want.astype(np.uint8)), (ctm, nm, in_hw, out_hw, ac, hp)
                continue
            assert m.kind is ResizeKind.NEAREST and m.mace is None
            got = resize_nearest(x, out_hw=out_hw, align_corners=m.tflite.align_corners,
                                 half_pixel_centers=m.tflite.half_pixel_centers)
            assert np.array_equal(got, want.astype(np.uint8)), (ctm, nm, in_hw, out_hw)
            mapped += 1
    assert mapped > 30 and raised > 3


def test_onnx_nearest_mapping_with_scales():
    """With a scales input ONNX maps by x / scale, not x * in / out: 5 pixels at scale 1.3 (6 out) differ."""
    x = np.arange(5 * 5, dtype=np.uint8).reshape(1, 5, 5, 1)
    want = _ort_resize(x, (6, 6), "nearest", "asymmetric", "floor", scales_hw=(1.3, 1.3))
    assert want.shape == (1, 6, 6, 1)
    with pytest.raises(MaceqError, match="no TFLite"):
        onnx_resize_mapping(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor",
                            in_hw=(5, 5), out_hw=(6, 6), scales_hw=(1.3, 1.3))
    for ac in (False, True):
        for hp in (False, True):
            got = resize_nearest(x, out_hw=(6, 6), align_corners=ac, half_pixel_centers=hp)
            assert not np.array_equal(got, want.astype(np.uint8))
    m = onnx_resize_mapping(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor",
                            in_hw=(5, 5), out_hw=(12, 12), scales_hw=(2.5, 2.5))  # same pixels as 5 / 12
    assert (m.tflite.align_corners, m.tflite.half_pixel_centers) == (False, False)
    want = _ort_resize(x, (12, 12), "nearest", "asymmetric", "floor", scales_hw=(2.5, 2.5))
    assert np.array_equal(resize_nearest(x, out_hw=(12, 12)), want.astype(np.uint8))


LINEAR_CASES = ["asymmetric", "align_corners", "half_pixel", "pytorch_half_pixel"]


def test_onnx_linear_mapping_agrees_with_onnxruntime_within_one_code():
    rng = np.random.default_rng(905)
    checked = 0
    for ctm in LINEAR_CASES:
        for in_hw, out_hw in SIZE_PAIRS + [((1, 1), (1, 1)), ((4, 5), (1, 1))]:
            x = rng.integers(0, 256, (1, *in_hw, 3), dtype=np.uint8)
            want = _ort_resize(x, out_hw, "linear", ctm, "floor")
            m = onnx_resize_mapping(mode="linear", coordinate_transformation_mode=ctm, in_hw=in_hw, out_hw=out_hw)
            assert m.kind is ResizeKind.BILINEAR and m.mace is not None
            if m.tflite is not None:
                got = resize_bilinear(x, out_hw=out_hw, align_corners=m.tflite.align_corners,
                                      half_pixel_centers=m.tflite.half_pixel_centers)
                assert float(np.abs(got - want).max()) <= 1.0, (ctm, in_hw, out_hw)
                checked += 1
            else:
                assert ctm == "pytorch_half_pixel" and min(out_hw) == 1 < max(out_hw)
            got = resize_bilinear_mace(x, out_hw=out_hw, align_corners=m.mace.align_corners,
                                       coordinate_mode=m.mace.coordinate_mode, scale_hw=m.mace.scale_hw)
            assert float(np.abs(got - want).max()) <= 1.0, (ctm, in_hw, out_hw)
            checked += 1
    assert checked > 50


def test_onnx_linear_mapping_with_non_ratio_scales_uses_mace_scale_args():
    x = np.random.default_rng(906).integers(0, 256, (1, 5, 5, 2), dtype=np.uint8)
    for ctm in ("asymmetric", "half_pixel"):
        want = _ort_resize(x, (12, 12), "linear", ctm, "floor", scales_hw=(2.5, 2.5))
        m = onnx_resize_mapping(mode="linear", coordinate_transformation_mode=ctm, in_hw=(5, 5), out_hw=(12, 12),
                                scales_hw=(2.5, 2.5))
        assert m.tflite is None and m.mace.scale_hw == (2.5, 2.5)
        got = resize_bilinear_mace(x, scale_hw=m.mace.scale_hw, coordinate_mode=m.mace.coordinate_mode)
        assert float(np.abs(got - want).max()) <= 1.0


@pytest.mark.parametrize("kw", [
    dict(mode="cubic"),
    dict(mode="linear", coordinate_transformation_mode="tf_crop_and_resize"),
    dict(mode="linear", coordinate_transformation_mode="tf_half_pixel_for_nn"),
    dict(mode="nearest", coordinate_transformation_mode="half_pixel", nearest_mode="simple"),
])
def test_onnx_mapping_unsupported_raises(kw):
    with pytest.raises(MaceqError, match="up7"):
        onnx_resize_mapping(in_hw=(4, 4), out_hw=(8, 8), node="up7", **kw)
