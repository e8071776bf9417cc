"""The aarch64 uint8 3x3 depthwise fast path (runtime/kernels/dw3x3_arm.py) against its transcription
and against stock MACE's outputs (../shared/data/mace_arm: sweep, whole models, per-tensor taps)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from maceq.errors import MaceqError
from maceq.runtime import load
from maceq.runtime.kernels import conv as k_conv
from maceq.runtime.kernels import dw3x3_arm as k
from maceq.runtime.ops import DepthwiseConv2d
from maceq.runtime.devices import device_spec

pytestmark = pytest.mark.oracle


def _shapes(max_hw=11):
    """Every (H, W, stride) with pad 1 (padding_values [2, 2]) that the fast path accepts."""
    for h in range(1, max_hw + 1):
        for w in range(1, max_hw + 1):
            for s in (1, 2):
                oh = k_conv.conv_output_size(h, 3, stride=s, dilation=1, pad_before=1, pad_after=1)
                ow = k_conv.conv_output_size(w, 3, stride=s, dilation=1, pad_before=1, pad_after=1)
                if k.fast3x3_supported(in_h=h, in_w=w, in_c=8, kh=3, kw=3, depth_multiplier=1, stride_h=s,
                                       stride_w=s, pad_h=1, pad_w=1, dilated=False, out_h=oh, out_w=ow,
                                       right_shift=1):
                    yield k.Fast3x3Shape(h, w, 8, s, 1, oh, ow)


def _last_writes(s: k.Fast3x3Shape) -> dict[int, list]:
    """Output pixel -> sorted taps of the last edge call writing it (the transcription's final state)."""
    final = {}
    for call in k.border_calls(s):
        if not 0 <= call.output_px < s.oh * s.ow:
            raise MaceqError("write past the output")
        final[call.output_px] = sorted((r * s.w + c, fr * 3 + fc) for r, c, fr, fc in k._call_taps(s, call))
    return final


def test_closed_form_border_equals_the_handle_padding_transcription():
    checked = undefined = 0
    for s in _shapes():
        try:
            final = _last_writes(s)
        except MaceqError:
            with pytest.raises(MaceqError, match="undefined"):
                k.border_taps(s)
            undefined += 1
            continue
        out_px, table = k.border_taps(s)
        got = {int(o): sorted((int(t[f]), f) for f in range(9) if t[f] >= 0) for o, t in zip(out_px, table)}
        assert got == final, s
        checked += 1
    assert checked > 150 and undefined > 0


def test_border_defect_names_exactly_the_shapes_whose_border_is_wrong():
    for s in _shapes():
        try:
            final = _last_writes(s)
        except MaceqError:
            assert k.border_defect(s) is not None
            continue
        correct = True
        for o, taps in final.items():
            oy, ox = divmod(o, s.ow)
            want = sorted((r * s.w + c, (r - oy * s.stride + 1) * 3 + (c - ox * s.stride + 1))
                          for r in range(oy * s.stride - 1, oy * s.stride + 2)
                          for c in range(ox * s.stride - 1, ox * s.stride + 2)
                          if 0 <= r < s.h and 0 <= c < s.w)
            correct &= taps == want
        assert (k.border_defect(s) is None) == correct, s
    even = k.Fast3x3Shape(112, 112, 96, 2, 1, 56, 56)
    assert "last output row and the last output column" in k.border_defect(even)
    assert k.border_defect(k.Fast3x3Shape(113, 113, 96, 2, 1, 57, 57)) is None
    assert k.border_defect(k.Fast3x3Shape(112, 113, 96, 2, 1, 56, 57)).count("row") == 1


def test_fast_edges_equal_the_reference_on_random_data():
    rng = np.random.default_rng(7)
    n = 0
    for s in _shapes(9):
        if k.border_defect(s) and s.ow < 2:
            continue
        c = 16
        s = k.Fast3x3Shape(s.h, s.w, c, s.stride, 1, s.oh, s.ow)
        x = rng.integers(0, 256, (2, s.h, s.w, c), dtype=np.uint8)
        w = rng.integers(1, 256, (3, 3, c, 1), dtype=np.uint8)
        bias = rng.integers(-3000, 3000, c).astype(np.int32)
        kw = dict(x_zp=int(rng.integers(0, 256)), w_zp=int(rng.integers(1, 256)), out_zp=int(rng.integers(0, 256)),
                  multiplier=int(rng.integers(2 ** 30, 2 ** 31)), shift=-int(rng.integers(6, 10)))
        y = k_conv.depthwise_conv2d(x, w, bias, strides=(s.stride,) * 2, pads=(1, 1, 1, 1), **kw)
        want = np.stack([k.depthwise3x3_edges_ref(x[i], y[i], w, bias, s=s, **kw) for i in range(2)])
        got = k.Fast3x3Edges(w, bias, **kw)(x, y.copy(), s)
        assert np.array_equal(got, want), s
        n += 1
    assert n > 80


def _sweep(shared_data):
    return sorted((shared_data / "mace_arm" / "dw3x3_sweep").glob("h*"))


def test_eligibility_matches_the_stock_build_on_the_sweep(shared_data):
    """Fast3x3FilterKernelSupported as maceq evaluates it for each sweep op = the exporter's record."""
    dirs = _sweep(shared_data)
    assert len(dirs) == 108
    taken = 0
    for d in dirs:
        rec = json.loads((d / "result.json").read_text())
        m = load(d / "model.yml")
        p = next(p.params for p in m.probe_ops(device_spec("cpu")) if p.op.type == "DepthwiseConv2d")
        assert -p.shift == rec["right_shift"], d.name
        s = DepthwiseConv2d.fast3x3_shape(p, (3, 3, rec["C"], 1), (1, rec["H"], rec["W"], rec["C"]))
        assert (s is not None) == rec["fast3x3_eligible"], d.name
        taken += s is not None
    # 72 configurations have C % 8 == 0; pad 0 with a window past the input is refused: (0,0,1,1) pads at
    # stride 1 (6 sizes x 2 channel counts) and at stride 2 on odd sizes (3 x 2)
    assert taken == 72 - 12 - 6


def test_every_sweep_output_of_stock_mace_is_reproduced(shared_data):
    differing_before = 0
    for d in _sweep(shared_data):
        m = load(d / "model.yml")
        x = np.load(d / "inputs.npy")
        ref = np.load(d / "mace_outputs.npy")
        y = np.asarray(m.run({"input": x}, device="cpu")["output"])
        assert y.shape == ref.shape and int((y != ref).sum()) == 0, d.name
        differing_before += json.loads((d / "result.json").read_text())["mismatch"] > 0
    assert differing_before == 6  # the stride-2, pad-1, even-size, C % 8 == 0 configurations


MODELS = ["efficientnet_lite0_cpu", "fmnist_demo", "fmnist_q8_mace_converter", "mobilenet_v2_cpu",
          "mobilenet_v2_fp32", "ppocr_cls_cpu"]


@pytest.mark.parametrize("name", MODELS)
def test_every_whole_model_output_of_stock_mace_is_reproduced(shared_data, name):
    d = shared_data / "mace_arm" / "models" / name
    m = load(next(d.glob("*.yml")))
    x = np.load(d / "inputs.npy")
    ref = np.load(d / "mace_outputs.npy")
    inp = m.net_def.input_info[0].name
    out = m.net_def.output_info[0].name
    for i in range(x.shape[0]):  # one image per call: the input Quantize takes its range per image
        y = np.asarray(m.run({inp: x[i:i + 1]}, device="cpu")[out])
        assert int((y.reshape(ref[i:i + 1].shape) != ref[i:i + 1]).sum()) == 0, (name, i)


@pytest.mark.parametrize("variant", ["cpu", "fp32"])
def test_every_uint8_tap_of_mobilenet_v2_is_reproduced(shared_data, variant):
    base = shared_data / "mace_arm"
    meta = json.loads((base / "taps" / f"mobilenet_v2_{variant}_taps.json").read_text())
    taps = np.load(base / "taps" / f"mobilenet_v2_{variant}_taps.npz")
    m = load(base / "models" / f"mobilenet_v2_{variant}" / "mobilenet_v2.yml")
    x = np.load(base / "models" / f"mobilenet_v2_{variant}" / "inputs.npy")[[0, 2]]
    uint8 = [t for t in meta["taps"] if t["dtype"] == "uint8"]
    assert len(uint8) >= 65
    for i in range(2):
        res = m.run({"input": x[i:i + 1]}, device="cpu", intermediates=True)
        for t in uint8:
            got = res.tensors[t["tensor"]]
            assert got.qinfo.zero_point == t["zero_point_per_image"][i], t["tensor"]
            assert np.array_equal(np.asarray(got.values).reshape(taps[t["tensor"]][i].shape),
                                  taps[t["tensor"]][i]), (t["tensor"], i)
