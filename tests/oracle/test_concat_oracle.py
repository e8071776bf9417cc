"""Oracle tests for MACE's uint8 Concat (runtime/kernels/concat.py).

MACE (mace/ops/concat.cc) requantizes an input whose (scale, zp) differs from the output's as
``roundf(x * s + (-zp_in * s + zp_out))`` with ``s = in_scale / out_scale``, all in float32.
TFLite's CONCATENATION reference (ConcatenationWithScaling) computes
``round(x * s' + (-zp_in * s')) + zp_out`` with ``s' = in_scale * (1 / out_scale)``. They are
the same computation when
- every float32 operation is exact: out_scale a power of two and in_scale = m * 2^-j with a
  short m, so s = s' and all products and sums are exact; and
- ``zp_out == 0``: otherwise MACE rounds ``v + zp_out`` and TFLite rounds ``v`` and then adds
  zp_out, which differ at negative exact halves (round(-0.5) + 3 = 2, round(2.5) = 3).
Under those conditions the kernel must equal TFLite on every element (ties included). For
arbitrary scales the oracle is ``_mace_scalar`` below, a numpy-float32-scalar transcription
of the C++ loop, written apart from the kernel's table; its TFLite-equivalence is checked too.
"""
from __future__ import annotations

import numpy as np
import pytest

from maceq.runtime.kernels.concat import concat, concat_ref
from maceq.runtime.qtypes import QInfo
from maceq.tests.oracle.tflite_builder import TensorSpec, build_single_op_model, run_ref

F32 = np.float32


def _mace_scalar(inputs, axis, qinfos, out_scale, out_zp) -> np.ndarray:
    """concat.cc's inner/outer loop, element by element, float32 scalar arithmetic."""
    inner = int(np.prod(inputs[0].shape[:axis]))
    out = []
    for row in range(inner):
        for x, (s_in, z_in) in zip(inputs, qinfos):
            flat = x.reshape(inner, -1)[row]
            if z_in == out_zp and F32(s_in) == F32(out_scale):
                out.extend(int(v) for v in flat)
                continue
            scale = F32(s_in) / F32(out_scale)
            offset = F32(-z_in) * scale + F32(out_zp)
            for v in flat:
                f = F32(v) * scale + offset          # float32 * float32 + float32
                r = np.trunc(np.float64(f) + (0.5 if f >= 0 else -0.5))  # roundf, exact in float64
                out.append(int(min(255.0, max(0.0, r))))
    shape = list(inputs[0].shape)
    shape[axis] = sum(x.shape[axis] for x in inputs)
    return np.array(out, dtype=np.uint8).reshape(shape)


def _tflite_concat(inputs, axis, qinfos, out_scale, out_zp) -> np.ndarray:
    shape = list(inputs[0].shape)
    shape[axis] = sum(x.shape[axis] for x in inputs)
    model = build_single_op_model(
        "CONCATENATION", [TensorSpec(x.shape, s, z) for x, (s, z) in zip(inputs, qinfos)],
        [TensorSpec(tuple(shape), out_scale, out_zp)],
        options={"axis": axis, "fused_activation_function": "NONE"})
    (out,) = run_ref(model, list(inputs))
    return out


def _inputs(rng, k: int, axis: int, base=(2, 3, 4, 5)):
    xs = []
    for _ in range(k):
        shape = list(base)
        shape[axis] = int(rng.integers(1, 5))
        xs.append(rng.integers(0, 256, shape, dtype=np.uint8))
    return xs


def _random_case(rng, *, exact: bool):
    """(inputs, axis, qinfos, out_scale, out_zp); ``exact``: dyadic scales and out_zp = 0."""
    axis = int(rng.integers(0, 4))
    k = int(rng.integers(1, 5))
    xs = _inputs(rng, k, axis)
    if exact:
        out_scale, out_zp = 2.0 ** -int(rng.integers(3, 9)), 0
    else:
        out_scale, out_zp = float(F32(rng.uniform(0.01, 0.1))), int(rng.integers(0, 256))
    qinfos = []
    for _ in range(k):
        if rng.random() < 0.2:
            qinfos.append((out_scale, out_zp))  # copied unchanged
        elif exact:  # m / 2^j with m < 2^9: exact products; odd m and 2^j > out_scale make halves
            qinfos.append((int(rng.integers(1, 512)) * 2.0 ** -int(rng.integers(6, 12)), int(rng.integers(0, 256))))
        else:
            qinfos.append((float(F32(out_scale * rng.uniform(0.3, 3.0))), int(rng.integers(0, 256))))
    return xs, axis, qinfos, out_scale, out_zp


def test_matches_tflite_when_float_steps_are_exact_and_out_zp_is_zero():
    rng = np.random.default_rng(201)
    total = mismatches = 0
    for _ in range(40):
        xs, axis, qinfos, out_scale, out_zp = _random_case(rng, exact=True)
        got = concat(xs, axis=axis, in_qinfos=qinfos, out_scale=out_scale, out_zp=out_zp)
        want = _tflite_concat(xs, axis, qinfos, out_scale, out_zp)
        total += got.size
        mismatches += int((got != want).sum())
    assert mismatches == 0
    assert total > 5000


def test_mace_and_tflite_differ_at_negative_halves_when_out_zp_is_nonzero():
    """Documents why the TFLite comparison needs zp_out = 0: MACE rounds after adding zp_out."""
    x = np.array([[0, 1, 2, 3]], dtype=np.uint8)
    qin, out_scale, out_zp = [(0.5, 3)], 1.0, 3
    # v = (x - 3) * 0.5 = -1.5, -1, -0.5, 0; MACE: roundf(v + 3) = 2, 2, 3, 3; TFLite: round(v) + 3
    assert concat([x], axis=1, in_qinfos=qin, out_scale=out_scale, out_zp=out_zp).tolist() == [[2, 2, 3, 3]]
    assert _tflite_concat([x], 1, qin, out_scale, out_zp).tolist() == [[1, 2, 2, 3]]


def test_transcription_matches_tflite_in_the_exact_regime():
    rng = np.random.default_rng(202)
    for _ in range(10):
        xs = _inputs(rng, 3, 3)
        qinfos = [(int(rng.integers(1, 512)) * 2.0 ** -9, int(rng.integers(0, 256))) for _ in range(3)]
        assert np.array_equal(_mace_scalar(xs, 3, qinfos, 2.0 ** -5, 0), _tflite_concat(xs, 3, qinfos, 2.0 ** -5, 0))


def test_kernel_matches_scalar_transcription_for_arbitrary_scales():
    rng = np.random.default_rng(203)
    total = mismatches = 0
    for _ in range(40):
        xs, axis, qinfos, out_scale, out_zp = _random_case(rng, exact=False)
        got = concat(xs, axis=axis, in_qinfos=qinfos, out_scale=out_scale, out_zp=out_zp)
        want = _mace_scalar(xs, axis, qinfos, out_scale, out_zp)
        total += got.size
        mismatches += int((got != want).sum())
    # every code through a few requantizations, including saturation at both ends
    codes = np.arange(256, dtype=np.uint8).reshape(1, 1, 1, 256)
    for s_in, z_in, s_out, z_out in [(0.1, 128, 0.03, 10), (0.02, 0, 0.5, 250), (0.0625, 7, 0.125, 0),
                                     (0.3, 255, 0.29999998, 255)]:
        got = concat([codes], axis=3, in_qinfos=[(s_in, z_in)], out_scale=s_out, out_zp=z_out)
        want = _mace_scalar([codes], 3, [(s_in, z_in)], s_out, z_out)
        total += got.size
        mismatches += int((got != want).sum())
    assert total > 5000
    assert mismatches == 0


def test_fast_equals_reference_and_accepts_qinfo():
    rng = np.random.default_rng(204)
    for _ in range(15):
        axis = int(rng.integers(-4, 4))
        xs = _inputs(rng, 3, axis % 4)
        qinfos = [QInfo(float(F32(rng.uniform(0.01, 0.2))), int(rng.integers(0, 256))) for _ in range(3)]
        kw = dict(axis=axis, in_qinfos=qinfos, out_scale=float(F32(0.07)), out_zp=int(rng.integers(0, 256)))
        assert np.array_equal(concat(xs, **kw), concat_ref(xs, **kw))


@pytest.mark.parametrize("bad", ["rank", "shape", "count"])
def test_bad_inputs_raise(bad):
    from maceq.errors import MaceqError
    a = np.zeros((1, 2, 2, 3), dtype=np.uint8)
    b = {"rank": np.zeros((2, 2, 3), dtype=np.uint8), "shape": np.zeros((1, 3, 2, 3), dtype=np.uint8),
         "count": a}[bad]
    q = [(0.1, 0)] * (1 if bad == "count" else 2)
    with pytest.raises(MaceqError):
        concat([a, b], axis=3, in_qinfos=q, out_scale=0.1, out_zp=0)
