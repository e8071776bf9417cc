"""Per-device models: cpu and gpu quantize differently, run differently, and the gpu's OpenCL kernels agree
with its numpy simulation over whole inferences."""
from __future__ import annotations

import numpy as np
import pytest

from maceq.datasets.images import ImageFolder
from maceq.datasets.preprocess import PRESETS
from maceq.errors import MaceqError
from maceq.quant.config import QuantConfig
from maceq.quant.pipeline import quantize
from maceq.runtime import load


@pytest.fixture(scope="module")
def fmnist_devices(tmp_path_factory, shared_data):
    out = tmp_path_factory.mktemp("devs")
    res = quantize(shared_data / "models" / "fmnist_mobilenet.onnx", shared_data / "fashion_mnist" / "calib",
                   output_dir=out, preprocess=PRESETS["fmnist"], progress=False, devices=("cpu", "gpu"))
    return {d: load(f.yml) for d, f in res.per_device.items()}


def _images(shared_data, n=4):
    return next(ImageFolder(shared_data / "fashion_mnist" / "test", PRESETS["fmnist"], labels=None).iter_batches(n)).data


def test_one_model_per_device_with_its_scheme(fmnist_devices):
    cpu, gpu = fmnist_devices["cpu"], fmnist_devices["gpu"]
    assert cpu.maceq_meta["device"] == "cpu" and gpu.maceq_meta["device"] == "gpu"
    w = "onnx::Conv_212"
    assert cpu.consts[w].dtype == np.uint8 and cpu.consts[w].min() >= 1
    assert gpu.consts[w].dtype == np.int8 and np.abs(gpu.consts[w].astype(int)).max() == 127  # symmetric
    scales = gpu.consts[w + "__scales"]
    assert scales.shape == (16,) and scales.dtype == np.float32 and len(set(scales.tolist())) > 1  # per channel
    with pytest.raises(MaceqError, match="quantized for the cpu device"):
        cpu.run({"input": np.zeros((1, 1, 28, 28), np.float32)}, device="gpu")


def test_devices_compute_different_codes(fmnist_devices, shared_data):
    x = _images(shared_data, 1)
    c = fmnist_devices["cpu"].run({"input": x}, device="cpu", intermediates=True)
    g = fmnist_devices["gpu"].run({"input": x}, device="gpu", intermediates=True)
    t = "/1/conv/conv.2/Conv_output_0"
    assert c.tensors[t].values.shape == g.tensors[t].values.shape
    assert np.count_nonzero(c.tensors[t].values != g.tensors[t].values) > 0
    # both are close to the float model: same top-1 on this image
    assert int(np.argmax(c.outputs["logits"])) == int(np.argmax(g.outputs["logits"]))


def test_gpu_opencl_backend_equals_simulation_fmnist(fmnist_devices, shared_data, tmp_path, monkeypatch):
    monkeypatch.setenv("POCL_CACHE_DIR", str(tmp_path / "pocl"))
    gpu = fmnist_devices["gpu"]
    x = _images(shared_data, 2)
    sim = gpu.run({"input": x}, device="gpu", intermediates=True)
    ocl = gpu.run({"input": x}, device="gpu", intermediates=True, backend="opencl")
    for name, t in sim.tensors.items():
        assert np.array_equal(t.values, ocl.tensors[name].values), name


def test_gpu_opencl_backend_equals_simulation_mobilenet_v2(shared_data, tmp_path, monkeypatch):
    monkeypatch.setenv("POCL_CACHE_DIR", str(tmp_path / "pocl"))
    res = quantize(shared_data / "models" / "mobilenet_v2.onnx", shared_data / "photos" / "calib",
                   output_dir=tmp_path / "m", preprocess=PRESETS["imagenet"], config=QuantConfig(max_images=8),
                   progress=False, devices=("gpu",))
    model = load(res.files.yml)
    x = next(ImageFolder(shared_data / "photos" / "eval", PRESETS["imagenet"], labels=None).iter_batches(1)).data
    sim = model.run({"input": x}, device="gpu", intermediates=True)
    ocl = model.run({"input": x}, device="gpu", intermediates=True, backend="opencl")
    mismatches = {n: int(np.count_nonzero(t.values != ocl.tensors[n].values)) for n, t in sim.tensors.items()}
    assert sum(mismatches.values()) == 0, {k: v for k, v in mismatches.items() if v}
    assert len(mismatches) > 60
