"""uint8 Transpose / Pad / Split / StridedSlice (runtime/kernels/layout.py) against TFLite BUILTIN_REF.

Oracles: TFLite TRANSPOSE, PAD, PADV2, SPLIT, SPLIT_V and STRIDED_SLICE on single-op models
over random shapes (rank 1-4), permutations, paddings, split sizes, begin/end/stride values
(negative, out of range, negative strides) and begin/end/shrink masks; ONNX Slice through
``onnx_slice_args`` against onnxruntime's uint8 Slice. Every ``*_ref`` equals its fast path.
All comparisons require 0 mismatching elements.

tests/oracle/tflite_builder.py has no PADV2 / SPLIT / SPLIT_V / STRIDED_SLICE entries;
``_build`` registers their options tables for the duration of one build instead of editing
the builder.
"""
from __future__ import annotations

import numpy as np
import pytest

from maceq.errors import MaceqError
from maceq.runtime.kernels.layout import (
    onnx_slice_args,
    pad,
    pad_ref,
    split,
    split_ref,
    strided_slice,
    strided_slice_ref,
    transpose,
    transpose_ref,
)
from maceq.tests.oracle import tflite_builder
from maceq.tests.oracle.tflite_builder import TensorSpec, run_ref

_EXTRA_OPTIONS = {"PADV2": "PadV2Options", "SPLIT": "SplitOptions", "SPLIT_V": "SplitVOptions",
                  "STRIDED_SLICE": "StridedSliceOptions"}
S, Z = 0.05, 7  # every tensor's quantization (these ops require input == output quantization)


def _build(op, inputs, outputs, options=None):
    """build_single_op_model with the options table of ``op`` registered for this call only."""
    table = tflite_builder._OPTIONS_TABLE
    added = op not in table
    if added:
        table[op] = _EXTRA_OPTIONS[op]
    try:
        return tflite_builder.build_single_op_model(op, inputs, outputs, options=options)
    finally:
        if added:
            del table[op]


def _i32(values, shape=None):
    a = np.array(values, np.int32)
    return TensorSpec(a.shape if shape is None else shape, None, None, "int32", a.reshape(a.shape if shape is None else shape))


def _rand_shape(rng, lo=1, hi=5, max_rank=4):
    return tuple(int(v) for v in rng.integers(lo, hi + 1, int(rng.integers(1, max_rank + 1))))


def test_transpose_matches_tflite():
    rng = np.random.default_rng(700)
    for i in range(60):
        shape = _rand_shape(rng)
        perm = [int(v) for v in rng.permutation(len(shape))]
        x = rng.integers(0, 256, shape, dtype=np.uint8)
        out_shape = tuple(shape[p] for p in perm)
        model = _build("TRANSPOSE", [TensorSpec(shape, S, Z), _i32(perm)], [TensorSpec(out_shape, S, Z)])
        (want,) = run_ref(model, [x])
        got = transpose(x, perm)
        assert np.array_equal(got, want), (shape, perm)
        assert np.array_equal(transpose_ref(x, perm), got)


def test_pad_matches_tflite_pad_and_padv2():
    rng = np.random.default_rng(701)
    for i in range(60):
        shape = _rand_shape(rng)
        pads = [(int(rng.integers(0, 3)), int(rng.integers(0, 3))) for _ in shape]
        x = rng.integers(0, 256, shape, dtype=np.uint8)
        out_shape = tuple(d + b + a for d, (b, a) in zip(shape, pads))
        if i % 2 == 0:  # PAD: the pad value is the output zero point's code
            model = _build("PAD", [TensorSpec(shape, S, Z), _i32(pads, (len(shape), 2))], [TensorSpec(out_shape, S, Z)])
            code = Z
        else:  # PADV2: an explicit constant (a uint8 scalar in the same quantization)
            code = int(rng.integers(0, 256))
            model = _build("PADV2", [TensorSpec(shape, S, Z), _i32(pads, (len(shape), 2)),
                                     TensorSpec((1,), S, Z, data=np.array([code], np.uint8))],
                           [TensorSpec(out_shape, S, Z)])
        (want,) = run_ref(model, [x])
        got = pad(x, pads, pad_code=code)
        assert np.array_equal(got, want), (shape, pads, code)
        assert np.array_equal(pad_ref(x, pads, pad_code=code), got)


def test_split_matches_tflite_split_and_split_v():
    rng = np.random.default_rng(702)
    for i in range(60):
        shape = _rand_shape(rng, 1, 6)
        axis = int(rng.integers(-len(shape), len(shape)))
        dim = shape[axis]
        x = rng.integers(0, 256, shape, dtype=np.uint8)
        if i % 2 == 0:  # SPLIT: equal pieces
            k = int(rng.choice([d for d in range(1, dim + 1) if dim % d == 0]))
            sizes = [dim // k] * k
            outs = [TensorSpec(tuple(dim // k if j == axis % len(shape) else n for j, n in enumerate(shape)), S, Z)
                    for _ in range(k)]
            model = _build("SPLIT", [_i32(axis, ()), TensorSpec(shape, S, Z)], outs, {"num_splits": k})
        else:  # SPLIT_V: arbitrary sizes, maybe one -1
            cuts = np.sort(rng.integers(0, dim + 1, int(rng.integers(0, 3))))
            sizes = [int(v) for v in np.diff(np.concatenate([[0], cuts, [dim]]))]
            ask = list(sizes)
            if i % 4 == 1:
                ask[int(rng.integers(len(ask)))] = -1
            outs = [TensorSpec(tuple(s if j == axis % len(shape) else n for j, n in enumerate(shape)), S, Z)
                    for s in sizes]
            model = _build("SPLIT_V", [TensorSpec(shape, S, Z), _i32(ask), _i32(axis, ())], outs,
                           {"num_splits": len(sizes)})
            sizes = ask
        want = run_ref(model, [x])
        got = split(x, axis=axis, sizes=sizes)
        ref = split_ref(x, axis=axis, sizes=sizes)
        assert len(got) == len(want) == len(ref)
        for g, w, r in zip(got, want, ref):
            assert g.shape == w.shape and np.array_equal(g, w), (shape, axis, sizes)
            assert np.array_equal(r, g)


def _tflite_strided_slice(x, begin, end, strides, begin_mask, end_mask, shrink, out_shape):
    n = x.ndim
    model = _build("STRIDED_SLICE", [TensorSpec(x.shape, S, Z), _i32(begin), _i32(end), _i32(strides)],
                   [TensorSpec(out_shape, S, Z)],
                   {"begin_mask": begin_mask, "end_mask": end_mask, "shrink_axis_mask": shrink,
                    "ellipsis_mask": 0, "new_axis_mask": 0})
    assert len(begin) == n
    (out,) = run_ref(model, [x])
    return out


def test_strided_slice_matches_tflite():
    rng = np.random.default_rng(703)
    checked = 0
    for i in range(200):
        shape = _rand_shape(rng, 1, 6)
        n = len(shape)
        strides = [int(rng.choice([-3, -2, -1, 1, 1, 2, 3])) for _ in shape]
        begin = [int(rng.integers(-d - 2, d + 3)) for d in shape]  # negative and out of range too
        end = [int(rng.integers(-d - 2, d + 3)) for d in shape]
        for d, (size, st) in enumerate(zip(shape, strides)):
            if rng.random() < 0.6:  # mostly non-empty: begin in range, end beyond it in the stride direction
                b = int(rng.integers(0, size))
                e = b + st * int(rng.integers(1, size + 2))
                begin[d] = b - size if rng.random() < 0.3 else b
                end[d] = e - size if (e < 0 and rng.random() < 0.5) or e >= size + 2 else e
        begin_mask = int(rng.integers(0, 1 << n)) if i % 3 == 0 else 0
        end_mask = int(rng.integers(0, 1 << n)) if i % 3 == 1 else 0
        shrink = 0
        if i % 4 == 2:  # shrink one axis at an in-range begin (TFLite needs a 1-element slice there)
            d = int(rng.integers(n))
            begin[d] = int(rng.integers(-shape[d], shape[d]))
            strides[d] = 1
            begin_mask &= ~(1 << d)
            end_mask &= ~(1 << d)
            shrink = 1 << d
        x = rng.integers(0, 256, shape, dtype=np.uint8)
        kw = dict(begin=begin, end=end, strides=strides, begin_mask=begin_mask, end_mask=end_mask,
                  shrink_axis_mask=shrink)
        got = strided_slice(x, **kw)
        # TFLite computes the output shape itself (constant begin/end/strides), empty ones included
        want = _tflite_strided_slice(x, begin, end, strides, begin_mask, end_mask, shrink, got.shape)
        assert got.shape == want.shape and np.array_equal(got, want), (shape, kw)
        assert np.array_equal(strided_slice_ref(x, **kw), got)
        checked += got.size > 0
    assert checked > 120


def _ort_slice(x, starts, ends, axes, steps):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(np.array(v, np.int64), name)
             for v, name in ((starts, "starts"), (ends, "ends"), (axes, "axes"), (steps, "steps"))]
    node = helper.make_node("Slice", ["x", "starts", "ends", "axes", "steps"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.UINT8, list(x.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, None)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def test_onnx_slice_mapping_matches_onnxruntime():
    rng = np.random.default_rng(704)
    big = (1 << 63) - 1
    for i in range(60):
        shape = _rand_shape(rng, 1, 6)
        n = len(shape)
        axes = [int(a) for a in rng.choice(n, int(rng.integers(1, n + 1)), replace=False)]
        if i % 3 == 0:
            axes = [a - n for a in axes]  # negative axes
        starts, ends, steps = [], [], []
        for a in axes:
            d = shape[a]
            step = int(rng.choice([-2, -1, 1, 2, 3]))
            st = int(rng.integers(-d - 2, d + 3))
            en = int(rng.choice([rng.integers(-d - 2, d + 3), big, -big - 1]))
            starts.append(st), ends.append(en), steps.append(step)
        x = rng.integers(0, 256, shape, dtype=np.uint8)
        want = _ort_slice(x, starts, ends, axes, steps)
        kw = onnx_slice_args(shape, starts=starts, ends=ends, axes=axes, steps=steps)
        got = strided_slice(x, **kw)
        assert got.shape == want.shape and np.array_equal(got, want), (shape, starts, ends, axes, steps)


def test_bad_arguments_raise():
    x = np.zeros((2, 3), np.uint8)
    with pytest.raises(MaceqError, match="permutation"):
        transpose(x, (0, 0))
    with pytest.raises(MaceqError, match="negative"):
        pad(x, [(0, -1), (0, 0)], pad_code=0)
    with pytest.raises(MaceqError, match="sum"):
        split(x, axis=1, sizes=[1, 1])
    with pytest.raises(MaceqError, match="stride 0"):
        strided_slice(x, begin=[0, 0], end=[2, 3], strides=[1, 0])
