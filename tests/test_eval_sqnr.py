"""`evaluate` reports the output SQNR of the int8 model against the float model over all images."""
import math
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import maceq
from maceq.app.pipeline import quantize
from maceq.datasets.images import ImageFolder
from maceq.datasets.labels import FASHION_MNIST_CLASSES
from maceq.datasets.preprocess import PRESETS
from maceq.quant.config import QuantConfig
from maceq.reports.evaluate import evaluate
from maceq.runtime import load

pytestmark = pytest.mark.e2e


def test_output_sqnr_equals_the_logits_of_both_models(tmp_path):
    assets = Path(maceq.__file__).parent / "datasets" / "default"
    onnx_path = assets / "fmnist_mobilenet.onnx"
    res = quantize(onnx_path, assets / "calib", output_dir=tmp_path / "q", preprocess=PRESETS["fmnist"],
                   config=QuantConfig(max_images=32), progress=False)
    model = load(res.files.yml)
    data = ImageFolder(assets / "test", PRESETS["fmnist"], classes=FASHION_MNIST_CLASSES)
    data.files, data.labels = data.files[:12], data.labels[:12]
    ev = evaluate(model, onnx_path, data, batch_size=5, progress=False)
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    sig = noise = 0.0
    for batch in data.iter_batches(12):
        for x in batch.data:
            f = sess.run(None, {sess.get_inputs()[0].name: x[None]})[0].astype(np.float64).ravel()
            q = model.run({model.input_names[0]: x[None]})[model.output_names[0]].astype(np.float64).ravel()
            sig += float(np.sum(f * f))
            noise += float(np.sum((f - q) ** 2))
    assert noise > 0 and ev.sqnr_db == pytest.approx(10 * math.log10(sig / noise), abs=1e-6)
    assert any(line.startswith("  output SQNR float vs int8:") for line in ev.lines())
