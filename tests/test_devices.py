"""Per-device models: cpu and gpu quantize differently, run differently, and the gpu's OpenCL kernels agree
with its numpy simulation over whole inferences."""
from __future__ import annotations

import numpy as np
import pytest

from maceq.datasets.images import ImageFolder
from maceq.datasets.preprocess import PRESETS
from maceq.errors import MaceqError
from maceq.quant.config import QuantConfig
from maceq.app.pipeline import quantize
from maceq.runtime import load


@pytest.fixture(scope="module")
def fmnist_devices(tmp_path_factory, shared_data):
    out = tmp_path_factory.mktemp("devs")
    res = quantize(shared_data / "models" / "fmnist_mobilenet.onnx", shared_data / "fashion_mnist" / "calib",
                   output_dir=out, preprocess=PRESETS["fmnist"], progress=False, devices=("cpu", "gpu", "dsp"))
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
    runs = {d: m.run({"input": x}, device=d, intermediates=True) for d, m in fmnist_devices.items()}
    t = "/1/conv/conv.2/Conv_output_0"
    for a, b in (("cpu", "gpu"), ("cpu", "dsp"), ("gpu", "dsp")):
        assert runs[a].tensors[t].values.shape == runs[b].tensors[t].values.shape
        assert np.count_nonzero(runs[a].tensors[t].values != runs[b].tensors[t].values) > 0, (a, b)
    # all three stay close to the float model: the same top-1 on this image
    assert len({int(np.argmax(r.outputs["logits"])) for r in runs.values()}) == 1


def test_a_model_pickles_after_runs_on_every_device(fmnist_devices, shared_data):
    """A model whose plans hold calls prepared by its runs (the gpu's convolutions, nnlib's nodes) pickles, its copy
    carries those caches empty, and the copy's runs give the same outputs as the original's."""
    import pickle

    from maceq.runtime.kernel import CallCache

    x = _images(shared_data, 2)
    for device, model in fmnist_devices.items():
        want = model.run({"input": x}, device=device)["logits"]
        caches = [p.plan for plan in model._prepared.values() for ops in plan._prepared for p in ops.values()
                  if isinstance(getattr(p.plan, "calls", p.plan), CallCache)]
        assert (len(caches) > 0) == (device != "cpu") and all(len(getattr(c, "calls", c)) for c in caches)
        copy = pickle.loads(pickle.dumps(model))
        copied = [p.plan for plan in copy._prepared.values() for ops in plan._prepared for p in ops.values()
                  if isinstance(getattr(p.plan, "calls", p.plan), CallCache)]
        assert len(copied) == len(caches) and not any(len(getattr(c, "calls", c)) for c in copied)
        assert np.array_equal(copy.run({"input": x}, device=device)["logits"], want)


class _Lookups(dict):
    """An op's PreparedOps by input quantization, counting the look-ups into ``seen``."""

    def __init__(self, d, seen):
        super().__init__(d)
        self.seen = seen

    def get(self, *args):
        self.seen.append(args[0])
        return super().get(*args)


def test_plan_reuses_an_op_while_its_inputs_bring_the_same_quantization(fmnist_devices, shared_data, monkeypatch):
    """An op is prepared once per input quantization: a second run of the same images prepares nothing (each op
    takes the last PreparedOp, its inputs carrying the same QInfo objects); images with another range (the cpu's
    input Quantize and some nnlib ops find theirs on every input) prepare the ops whose inputs' quantization changed,
    and every run equals a fresh copy's."""
    import pickle

    from maceq.runtime.model import Model

    x = _images(shared_data, 2)
    y = x * 0.25  # another input range
    for device, model in fmnist_devices.items():
        fresh = pickle.loads(pickle.dumps(model))
        want = {k: fresh.run({"input": v}, device=device)["logits"] for k, v in (("x", x), ("y", y))}
        model.run({"input": x}, device=device)
        made = []
        real = Model.prepare
        monkeypatch.setattr(Model, "prepare", lambda self, *a: made.append(a[0].name) or real(self, *a))
        assert np.array_equal(model.run({"input": x}, device=device)["logits"], want["x"])
        assert made == [], (device, made)
        plan = model._plan(device, "numpy")
        kept, looked = plan._prepared, []
        plan._prepared = [_Lookups(d, looked) for d in kept]
        assert np.array_equal(model.run({"input": x}, device=device)["logits"], want["x"])
        plan._prepared = kept
        # the same images again: the ranges found in the run are the same QInfo objects (qtypes.shared_qinfo), so no
        # op looks its quantization up
        assert looked == [], (device, looked)
        assert np.array_equal(model.run({"input": y}, device=device)["logits"], want["y"])
        # the cpu finds its input's range, nnlib some ops' output ranges; the gpu's quantization is fixed
        assert (len(made) > 0) == (device != "gpu"), (device, made)
        n = len(made)
        assert np.array_equal(model.run({"input": x}, device=device)["logits"], want["x"])
        assert len(made) == n  # back to the first range: prepared before, looked up by value
        monkeypatch.undo()


def test_dsp_ranges_and_placement(fmnist_devices):
    dsp = fmnist_devices["dsp"]
    w = dsp.const_qinfo["onnx::Conv_212"]
    assert w.minval < 0 < w.maxval  # nnlib consumes float ranges
    place = dsp.placement("dsp")
    assert all(where == "dsp" for where, _ in place.values())
    assert dsp.boundary_transfers(place) == 0


def test_dsp_falls_back_to_cpu_where_nnlib_rejects(tmp_path, shared_data):
    """A Softmax (no nnlib op here) and a dilated conv (nnlib rejects dilation > 1) run the cpu kernels."""
    import onnx
    from onnx import helper, numpy_helper
    from PIL import Image

    from maceq.datasets.preprocess import Preprocess

    rng = np.random.default_rng(1)
    inits = {"w1": rng.normal(0, 0.3, (4, 1, 3, 3)).astype(np.float32),
             "w2": rng.normal(0, 0.3, (4, 1, 3, 3)).astype(np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Conv", ["c1", "w2"], ["c2"], pads=[2, 2, 2, 2], dilations=[2, 2], group=4,
                              name="dilated_dw"),
             helper.make_node("Softmax", ["c2"], ["y"], axis=1, name="softmax")]
    g = helper.make_graph(nodes, "fb", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 1, 12, 12])],
                          [helper.make_empty_tensor_value_info("y")],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    path = tmp_path / "fb.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), path)
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    for k in range(6):
        Image.fromarray(rng.integers(0, 256, (12, 12), dtype=np.uint8)).save(imgs / f"{k}.png")
    pre = Preprocess(color="gray", resize=(12, 12), scale=1 / 255)
    res = quantize(path, imgs, output_dir=tmp_path / "out", preprocess=pre, progress=False, devices=("dsp",))
    model = load(res.files.yml)
    place = model.placement("dsp")
    assert place["conv1"][0] == "dsp"
    assert place["dilated_dw"][0] == "cpu" and "dilation" in place["dilated_dw"][1]
    assert place["mace_output_node_softmax"][0] == "cpu"
    assert model.boundary_transfers(place) == 2  # conv1 -> dilated_dw, softmax -> Dequantize
    x = next(ImageFolder(imgs, pre, labels=None).iter_batches(1)).data
    y = model.run({"x": x}, device="dsp")["y"]
    assert y.shape == (1, 4, 12, 12) and np.allclose(y.sum(axis=1), 1.0, atol=0.03)


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


def test_gpu_float_path_stores_half_and_matches_opencl(tmp_path, monkeypatch):
    """Ops without an integer kernel run MACE's fp16_fp32 path on the gpu: float32 math, half storage,
    and the OpenCL float kernels give the same codes as the simulation."""
    import onnx
    from onnx import helper, numpy_helper
    from PIL import Image

    from maceq.datasets.preprocess import Preprocess
    from maceq.runtime.kernels import gpu as G

    monkeypatch.setenv("POCL_CACHE_DIR", str(tmp_path / "pocl"))
    rng = np.random.default_rng(4)
    inits = {"w1": rng.normal(0, 0.4, (6, 3, 3, 3)).astype(np.float32),
             "w2": rng.normal(0, 0.4, (6, 6, 1, 1)).astype(np.float32),
             "roi": np.zeros(0, np.float32), "sc": np.array([1, 1, 2, 2], np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("GlobalAveragePool", ["c1"], ["gap"], name="gap"),
             helper.make_node("Conv", ["gap", "w2"], ["se"], name="se_conv"),
             helper.make_node("HardSigmoid", ["se"], ["hs"], alpha=0.2, beta=0.5, name="hsig"),
             helper.make_node("Mul", ["c1", "hs"], ["scaled"], name="se_mul"),
             helper.make_node("Resize", ["scaled", "roi", "sc"], ["up"], mode="linear",
                              coordinate_transformation_mode="asymmetric", name="up"),
             helper.make_node("Sigmoid", ["up"], ["y"], name="sig")]
    g = helper.make_graph(nodes, "fp", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3, 8, 8])],
                          [helper.make_empty_tensor_value_info("y")],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    path = tmp_path / "fp.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), path)
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    for k in range(6):
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(imgs / f"{k}.png")
    pre = Preprocess(resize=(8, 8), scale=1 / 255)
    res = quantize(path, imgs, output_dir=tmp_path / "out", preprocess=pre, progress=False, devices=("cpu", "gpu"))
    cpu_model, gpu_model = load(res.per_device["cpu"].yml), load(res.per_device["gpu"].yml)
    # the cpu has MACE's uint8 ResizeBilinear; the gpu has no integer resize: float path
    assert any(op.type == "ResizeBilinear" and op.arg("T") == 2 for op in cpu_model.ops)
    assert any(op.type == "ResizeBilinear" and op.arg("T") == 1 for op in gpu_model.ops)
    # the writer places each device's nodes by its own spec: the .yml lists the Resize as float on gpu only
    assert "up" in gpu_model.maceq_meta["float_fallback"] and "up" not in cpu_model.maceq_meta["float_fallback"]
    x = next(ImageFolder(imgs, pre, labels=None).iter_batches(1)).data
    sim = gpu_model.run({"x": x}, device="gpu", intermediates=True)
    hs = next(op for op in gpu_model.ops if op.type == "Activation" and op.arg("activation") == "HARDSIGMOID")
    h_in = sim.tensors[hs.inputs[0]].values
    assert h_in.dtype == np.float16 and sim.tensors[hs.outputs[0]].values.dtype == np.float16
    np.testing.assert_array_equal(sim.tensors[hs.outputs[0]].values,
                                  G.gpu_half_activation(h_in, kind=G.GpuActivation.HARD_SIGMOID, alpha=0.2, beta=0.5))
    ocl = gpu_model.run({"x": x}, device="gpu", intermediates=True, backend="opencl")
    bad = {n: int(np.count_nonzero(t.values != ocl.tensors[n].values)) for n, t in sim.tensors.items()}
    assert sum(bad.values()) == 0, {k: v for k, v in bad.items() if v}
