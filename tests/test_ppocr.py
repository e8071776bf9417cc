"""Real third-party graphs: PaddleOCR's text detector and orientation classifier (every weight a Constant node)."""
from __future__ import annotations

import numpy as np
import pytest

from maceq.datasets.images import ImageFolder
from maceq.datasets.preprocess import PRESETS
from maceq.errors import MaceqError
from maceq.app.pipeline import quantize
from maceq.reports.evaluate import evaluate, evaluate_segmentation
from maceq.runtime import load


@pytest.fixture(scope="module")
def det(tmp_path_factory, shared_data):
    out = tmp_path_factory.mktemp("det")
    return quantize(shared_data / "models" / "ppocrv4_det.onnx", shared_data / "text", output_dir=out,
                    preprocess=PRESETS["ppocr_det"], progress=False)


def test_detector_quantizes_with_float_fallback(det):
    model = load(det.files.yml)
    float_ops = {op.type for op in model.ops if op.arg("T") == 1}
    # MACE's CPU has no uint8 Activation / Eltwise PROD / ResizeNearestNeighbor / Deconv2D: they fall back.
    assert {"Activation", "Eltwise", "ResizeNearestNeighbor", "Deconv2D"} <= float_ops
    uint8_ops = {op.type for op in model.ops if op.arg("T") == 2}
    assert {"Conv2D", "DepthwiseConv2d", "Reduce", "Concat"} <= uint8_ops
    assert det.placement["p2o.Resize.0"] == "float32"
    assert sum(1 for where in det.placement.values() if where == "uint8") > 100
    assert model.maceq_meta["float_fallback"] == sorted(n for n, w in det.placement.items() if w != "uint8")


def test_detector_mask_iou_on_scene_text(det, shared_data):
    model = load(det.files.yml)
    data = ImageFolder(shared_data / "text", PRESETS["ppocr_det"], labels=None)
    res = evaluate_segmentation(model, shared_data / "models" / "ppocrv4_det.onnx", data, threshold=0.3,
                                progress=False)
    assert res.images == 6
    assert res.mean_iou >= 0.88 and res.global_iou >= 0.85  # measured 0.90 / 0.89 with percentile ranges
    assert res.sqnr_db > 8.0


def test_strict_refuses_fallback(tmp_path, shared_data):
    with pytest.raises(MaceqError, match=r"no uint8 kernel.*--strict"):
        quantize(shared_data / "models" / "ppocrv4_det.onnx", shared_data / "text", output_dir=tmp_path,
                 preprocess=PRESETS["ppocr_det"], progress=False, strict=True)
    assert list(tmp_path.iterdir()) == []


def test_classifier_quantizes_and_runs(tmp_path, shared_data):
    res = quantize(shared_data / "models" / "ppocr_mobile_v2_cls.onnx", shared_data / "text", output_dir=tmp_path,
                   preprocess=PRESETS["ppocr_cls"], progress=False)
    model = load(res.files.yml)
    # 35 unfused BatchNormalization nodes are folded or turned into depthwise convs: none is left in float.
    assert not any(op.type == "BatchNorm" for op in model.ops)
    data = ImageFolder(shared_data / "text", PRESETS["ppocr_cls"], labels=None)
    ev = evaluate(model, shared_data / "models" / "ppocr_mobile_v2_cls.onnx", data, progress=False)
    assert ev.images == 6 and ev.float_top1_in_int8_top5 == 1.0
    x = next(data.iter_batches(1)).data
    y = model.run({"x": x})["save_infer_model/scale_0.tmp_1"]
    assert y.shape == (1, 2) and abs(float(y.sum()) - 1.0) < 0.02  # softmax probabilities
