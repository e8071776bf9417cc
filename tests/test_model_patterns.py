"""Graph patterns of real detectors, face and OCR networks, built small: each quantizes for every
device and the simulation computes what the float model computes (within quantization error)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

from maceq.app.pipeline import quantize
from maceq.datasets.preprocess import Preprocess
from maceq.runtime import load

pytestmark = pytest.mark.e2e
DEVICES = ("cpu", "gpu", "dsp")


def _save(path, nodes, inits, *, size: int, batch="N"):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, size, size])],
                          [helper.make_empty_tensor_value_info("y")],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), path)
    return path


def _images(tmp_path, size: int, n: int = 6):
    rng = np.random.default_rng(0)
    d = tmp_path / "imgs"
    d.mkdir(exist_ok=True)
    for k in range(n):
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(d / f"{k}.png")
    return d


def _check_all_devices(tmp_path, path, size: int, *, tol: float, devices=DEVICES):
    """Quantize for ``devices`` and compare each simulation with onnxruntime on a held-out input:
    the same shape, and at most ``tol`` of the output's largest magnitude apart."""
    imgs = _images(tmp_path, size)
    pre = Preprocess(resize=(size, size), scale=1 / 255)
    res = quantize(path, imgs, output_dir=tmp_path / "out", preprocess=pre, progress=False, devices=devices)
    x = np.random.default_rng(1).uniform(0, 1, (1, 3, size, size)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    for d in devices:
        got = load(res.per_device[d].yml).run({"x": x}, device=d)["y"]
        assert got.shape == want.shape, d
        assert float(np.abs(got - want).max()) <= tol * float(np.abs(want).max()), d
    return res


def test_detection_head_of_transposed_and_reshaped_outputs_concatenated(tmp_path):
    rng = np.random.default_rng(2)
    inits = {"w1": rng.normal(0, .4, (4, 3, 3, 3)).astype(np.float32),
             "w2": rng.normal(0, .4, (4, 3, 1, 1)).astype(np.float32), "s": np.array([0, -1, 4], np.int64)}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], name="c1"),
             helper.make_node("Conv", ["x", "w2"], ["c2"], name="c2"),
             helper.make_node("Transpose", ["c1"], ["t1"], perm=[0, 2, 3, 1], name="t1"),
             helper.make_node("Transpose", ["c2"], ["t2"], perm=[0, 2, 3, 1], name="t2"),
             helper.make_node("Reshape", ["t1", "s"], ["r1"], name="r1"),
             helper.make_node("Reshape", ["t2", "s"], ["r2"], name="r2"),
             helper.make_node("Concat", ["r1", "r2"], ["y"], axis=1, name="cat")]
    _check_all_devices(tmp_path, _save(tmp_path / "head.onnx", nodes, inits, size=8), 8, tol=0.05)


def test_maxpool_same_upper_keeps_its_padding(tmp_path):
    """7x7, window 2, stride 2, SAME_UPPER: one padding row and column after the input. MACE's Hexagon
    converter would run it SAME_CAFFE (the pad before the input): the dsp model gets an explicit Pad."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="c"),
             helper.make_node("MaxPool", ["c"], ["y"], kernel_shape=[2, 2], strides=[2, 2], auto_pad="SAME_UPPER",
                              name="mp")]
    path = _save(tmp_path / "mp.onnx", nodes, {"w": rng.normal(0, .4, (4, 3, 3, 3)).astype(np.float32)}, size=7)
    res = _check_all_devices(tmp_path, path, 7, tol=0.05)
    sub = next(iter(load(res.per_device["cpu"].yml).deployment["models"].values()))["subgraphs"][0]
    assert sub["output_shapes"] == ["1,4,4,4"]  # the .yml declares the 4x4 output the graph computes
    assert res.device_forms["cpu"] == {} and res.device_forms["gpu"] == {}
    (form,) = res.device_forms["dsp"]["safe_forms"]
    assert "SAME_CAFFE" in form["reason"] and "1 row(s) and 1 column(s) before the input" in form["reason"]
    dsp = load(res.per_device["dsp"].yml)
    assert [op.type for op in dsp.ops] == ["Quantize", "Conv2D", "Pad", "Pooling", "Dequantize"]
    assert dsp.deviations("dsp") == {} and all(where == "dsp" for where, _ in dsp.placement("dsp").values())


def test_an_average_pool_the_dsp_pads_differently_is_kept_and_reported(tmp_path):
    """No safe form for an average pooling (an explicit pad would enter its divisor): the dsp model
    keeps the op, its .yml lists the deviation, and the simulation predicts the shifted windows."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="c"),
             helper.make_node("AveragePool", ["c"], ["y"], kernel_shape=[2, 2], strides=[2, 2],
                              auto_pad="SAME_UPPER", name="ap")]
    path = _save(tmp_path / "ap.onnx", nodes, {"w": rng.normal(0, .4, (4, 3, 3, 3)).astype(np.float32)}, size=7)
    res = _check_all_devices(tmp_path, path, 7, tol=0.05, devices=("cpu", "gpu"))
    res = quantize(path, tmp_path / "imgs", output_dir=tmp_path / "dsp", preprocess=Preprocess(resize=(7, 7), scale=1 / 255),
                   progress=False, devices=("dsp",))
    (why,) = res.device_forms["dsp"]["deviations"].values()
    assert "SAME_CAFFE" in why
    dsp = load(res.per_device["dsp"].yml)
    assert dsp.maceq_meta["deviations"] and list(dsp.deviations("dsp").values()) == [why]


@pytest.mark.parametrize("batch", [1, "N"])
def test_a_model_with_a_fixed_batch_of_one_quantizes_with_the_default_batch_size(tmp_path, batch):
    """The batch is fixed by the input (1), or by a Reshape to [1, -1] behind a free input ("N")."""
    rng = np.random.default_rng(4)
    inits = {"w": rng.normal(0, .4, (4, 3, 3, 3)).astype(np.float32), "s": np.array([1, -1], np.int64),
             "fc": rng.normal(0, .3, (4 * 8 * 8, 5)).astype(np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="c"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Reshape", ["r", "s"], ["f"], name="flat"),
             helper.make_node("MatMul", ["f", "fc"], ["y"], name="fc")]
    _check_all_devices(tmp_path, _save(tmp_path / "b1.onnx", nodes, inits, size=8, batch=batch), 8, tol=0.2)


def test_float_share_counts_the_float_macs_boundaries_and_dsp_fallback(tmp_path):
    """A 3x3 conv (3 -> 4 channels) in uint8, a 1x1 conv (4 -> 4) kept in float32, on 8x8 inputs."""
    from maceq.quant.config import QuantConfig
    from maceq.reports.cost import float_share

    rng = np.random.default_rng(5)
    inits = {"w1": rng.normal(0, .4, (4, 3, 3, 3)).astype(np.float32), "w2": rng.normal(0, .4, (4, 4, 1, 1)).astype(np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], name="c1"),
             helper.make_node("Conv", ["c1", "w2"], ["c2"], name="c2"),
             helper.make_node("Relu", ["c2"], ["y"], name="relu")]
    path = _save(tmp_path / "fs.onnx", nodes, inits, size=8)
    res = quantize(path, _images(tmp_path, 8), output_dir=tmp_path / "out", preprocess=Preprocess(resize=(8, 8), scale=1 / 255),
                   progress=False, devices=("cpu", "dsp"), config=QuantConfig(fp32_layers=("c2",)))
    cpu = float_share(load(res.per_device["cpu"].yml), "cpu")
    assert (cpu.macs, cpu.float_macs) == (8 * 8 * 4 * 27 + 8 * 8 * 4 * 4, 8 * 8 * 4 * 4)
    assert cpu.boundaries == 1 and cpu.transfers == 0  # one Dequantize before the float conv
    # values written: the input's Quantize 3x8x8, then 4x8x8 each by c1, the Dequantize, and in float the
    # NHWC->NCHW Transpose, c2 (MACE's float conv is NCHW) and the Transpose back
    assert (cpu.values, cpu.float_values) == (192 + 5 * 256, 4 * 256)
    assert "1 float<->uint8 boundaries" in cpu.describe() and "69.6% of the activation values written" in cpu.describe()
    # 13% of the MACs, 70% of the values: the elementwise-work share warns
    assert cpu.warning.startswith("warning: 70% of the activation values are computed or converted (3 float ops, "
                                  "1 boundaries) in float32 on cpu")
    dsp = float_share(load(res.per_device["dsp"].yml), "dsp")
    # nnlib has no float ops: every one runs on the cpu fallback, after one dsp -> cpu transfer
    assert dsp.float_macs == cpu.float_macs and dsp.fallback_ops == dsp.float_ops == cpu.float_ops
    assert dsp.transfers == 1 and "3 ops on the cpu fallback with 1 dsp<->cpu transfers per run" in dsp.describe()


def test_a_built_model_whose_shapes_depart_from_onnx_is_refused_naming_the_node(tmp_path):
    """The writer's last check: a pooling that lost its padding computes 3x3 where ONNX says 4x4."""
    from maceq.errors import MaceqError
    from maceq.mace.format import add_arg
    from maceq.quant.build import build_mace_model
    from maceq.quant.export import check_output_shapes
    from maceq.quant.prepare import prepare_graph, tensors_to_calibrate
    from maceq.runtime.devices import Device

    rng = np.random.default_rng(6)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="c"),
             helper.make_node("MaxPool", ["c"], ["y"], kernel_shape=[2, 2], strides=[2, 2], auto_pad="SAME_UPPER",
                              name="mp")]
    path = _save(tmp_path / "mp.onnx", nodes, {"w": rng.normal(0, .4, (4, 3, 3, 3)).astype(np.float32)}, size=7)
    g, _, shapes = prepare_graph(path, input_shape=[1, 3, 7, 7])
    ranges = {t: (-1.0, 1.0) for t in tensors_to_calibrate(g)}
    built = build_mace_model(g, ranges, shapes, model_name="mp", device=Device.CPU)
    check_output_shapes(built, Device.CPU, g, shapes)  # as built: 4x4, as ONNX says
    pool = next(op for op in built.multi_net_def.net_def[0].op if op.type == "Pooling")
    del pool.arg[[a.name for a in pool.arg].index("padding_values")]
    add_arg(pool, "padding_values", [0, 0])
    with pytest.raises(MaceqError, match=r"node 'mp' \(MaxPool\): the written cpu model would compute 'y' with "
                                         r"shape \(1, 3, 3, 4\), ONNX shape inference gives \(1, 4, 4, 4\)"):
        check_output_shapes(built, Device.CPU, g, shapes)


def test_an_op_stock_mace_has_no_kernel_for_is_refused_before_writing(tmp_path):
    """MACE's CPU runtime registers Reshape for float only: a uint8 Reshape would not load."""
    from maceq.errors import MaceqError
    from maceq.mace.cpu_ops import CPU_FLOAT_OPS, CPU_UINT8_OPS
    from maceq.mace.enums import DataType
    from maceq.quant.build import build_mace_model
    from maceq.quant.export import check_mace_loads
    from maceq.quant.prepare import prepare_graph, tensors_to_calibrate

    assert "Reshape" in CPU_FLOAT_OPS and "Reshape" not in CPU_UINT8_OPS and "Conv2D" in CPU_UINT8_OPS
    rng = np.random.default_rng(7)
    inits = {"w": rng.normal(0, .4, (4, 3, 3, 3)).astype(np.float32), "s": np.array([0, -1, 4], np.int64)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="c"),
             helper.make_node("Transpose", ["c"], ["t"], perm=[0, 2, 3, 1], name="t"),
             helper.make_node("Reshape", ["t", "s"], ["y"], name="r")]
    g, _, shapes = prepare_graph(_save(tmp_path / "r.onnx", nodes, inits, size=8), input_shape=[1, 3, 8, 8])
    built = build_mace_model(g, {t: (-1.0, 1.0) for t in tensors_to_calibrate(g)}, shapes, model_name="r")
    check_mace_loads(built)  # as built: the Reshape is a float op
    reshape = next(op for op in built.multi_net_def.net_def[0].op if op.type == "Reshape")
    next(a for a in reshape.arg if a.name == "T").i = DataType.DT_UINT8
    with pytest.raises(MaceqError, match=r"a Reshape op with T=DT_UINT8, which stock MACE's CPU runtime has no "
                                         r"kernel for; no model was written"):
        check_mace_loads(built)


def test_prelu_per_channel_and_after_a_fully_connected_layer_on_every_device(tmp_path):
    rng = np.random.default_rng(8)
    inits = {"w": rng.normal(0, .4, (4, 3, 3, 3)).astype(np.float32),
             "slope": np.array([.1, .2, .3, .4], np.float32).reshape(4, 1, 1),
             "fc": rng.normal(0, .3, (4 * 8 * 8, 6)).astype(np.float32), "slope2": np.full(6, .25, np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="c"),
             helper.make_node("PRelu", ["c", "slope"], ["p"], name="prelu4d"),
             helper.make_node("Flatten", ["p"], ["f"], axis=1, name="flat"),
             helper.make_node("MatMul", ["f", "fc"], ["m"], name="fc"),
             helper.make_node("PRelu", ["m", "slope2"], ["y"], name="prelu2d")]
    res = _check_all_devices(tmp_path, _save(tmp_path / "prelu.onnx", nodes, inits, size=8), 8, tol=0.05)
    ops = [op.type for op in load(res.per_device["gpu"].yml).ops]
    assert ops.count("Activation") == 2 and ops[-3:] == ["Reshape", "Activation", "Reshape"]


def test_a_tf_same_strided_conv_gets_a_safe_form_on_dsp_and_a_concat_is_left_alone(tmp_path):
    """Conv 3x3 stride 2 on 8x8 with pads (0, 0, 1, 1), TensorFlow's SAME: MACE's Hexagon converter would
    run it SAME_CAFFE (one pad before the input). The concat of its output with another branch runs as is."""
    rng = np.random.default_rng(9)
    inits = {"w": rng.normal(0, .4, (4, 3, 3, 3)).astype(np.float32), "w2": rng.normal(0, .4, (4, 3, 1, 1)).astype(np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[0, 0, 1, 1], strides=[2, 2], name="tfsame"),
             helper.make_node("Conv", ["x", "w2"], ["d"], strides=[2, 2], name="other"),
             helper.make_node("Concat", ["c", "d"], ["y"], axis=1, name="cat")]
    res = _check_all_devices(tmp_path, _save(tmp_path / "tf.onnx", nodes, inits, size=8), 8, tol=0.05)
    (form,) = res.device_forms["dsp"]["safe_forms"]
    assert form["op"] == "tfsame" and "SAME_CAFFE on input 8x8" in form["reason"]
    assert res.device_forms["cpu"] == {} and res.device_forms["gpu"] == {}
    assert load(res.per_device["dsp"].yml).deviations("dsp") == {}


def test_dilated_and_grouped_convolutions_run_on_the_float_path(tmp_path):
    """MACE's uint8 Conv2D has neither dilation nor groups (U^2-Net's dilated blocks): float Conv2D runs them."""
    rng = np.random.default_rng(10)
    inits = {"w": rng.normal(0, .4, (4, 3, 3, 3)).astype(np.float32), "wd": rng.normal(0, .3, (4, 4, 3, 3)).astype(np.float32),
             "wg": rng.normal(0, .3, (4, 2, 1, 1)).astype(np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="c"),
             helper.make_node("Conv", ["c", "wd"], ["d"], pads=[2, 2, 2, 2], dilations=[2, 2], name="dilated"),
             helper.make_node("Conv", ["d", "wg"], ["y"], group=2, name="grouped")]
    res = _check_all_devices(tmp_path, _save(tmp_path / "dg.onnx", nodes, inits, size=8), 8, tol=0.05)
    assert res.placement == {"c": "uint8", "dilated": "float32", "grouped": "float32"}


def test_an_op_form_mace_lacks_is_refused_before_calibration(tmp_path):
    """A rank-5 Transpose (attention heads of a text recognizer): the writer's refusal comes from a
    build on placeholder ranges before any image is read (the folder holds none that decode)."""
    from maceq.errors import MaceqError

    rng = np.random.default_rng(11)
    inits = {"w": rng.normal(0, .4, (4, 3, 3, 3)).astype(np.float32), "s5": np.array([1, 2, 2, 8, 8], np.int64),
             "s4": np.array([1, 4, 8, 8], np.int64)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="c"),
             helper.make_node("Reshape", ["c", "s5"], ["r5"], name="r5"),
             helper.make_node("Transpose", ["r5"], ["t5"], perm=[0, 2, 1, 3, 4], name="t5"),
             helper.make_node("Reshape", ["t5", "s4"], ["y"], name="r4")]
    path = _save(tmp_path / "t5.onnx", nodes, inits, size=8)
    bad = tmp_path / "notimages"
    bad.mkdir()
    (bad / "a.png").write_text("not an image")
    with pytest.raises(MaceqError, match=r"node 't5' \(Transpose\): rank 5"):
        quantize(path, bad, output_dir=tmp_path / "out", preprocess=Preprocess(resize=(8, 8)), progress=False,
                 devices=DEVICES)
    assert not (tmp_path / "out").exists()


def test_a_model_whose_cpu_result_is_undefined_is_not_written(tmp_path):
    """A 3x3 stride-2 depthwise from 2x2 to 1x1: TFLite's aarch64 fast path writes past its one-pixel
    output on MACE's CPU (docs/semantics.md). quantize refuses, naming the op; gpu has no such path."""
    from maceq.errors import MaceqError

    rng = np.random.default_rng(12)
    inits = {"w": rng.normal(0, .4, (8, 3, 3, 3)).astype(np.float32), "dw": rng.normal(0, .4, (8, 1, 3, 3)).astype(np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2], name="c"),
             helper.make_node("Conv", ["c", "dw"], ["y"], pads=[1, 1, 1, 1], strides=[2, 2], group=8, name="dw")]
    path = _save(tmp_path / "dw.onnx", nodes, inits, size=4)
    with pytest.raises(MaceqError, match=r"the cpu device cannot run this model: op 'mace_output_node_dw' "
                                         r"\(DepthwiseConv2d\): 3x3 fast path writes past its output \(1x1\)"):
        quantize(path, _images(tmp_path, 4), output_dir=tmp_path / "out", preprocess=Preprocess(resize=(4, 4)),
                 progress=False, devices=("cpu",))
    assert not (tmp_path / "out" / "dw.yml").exists()
    _check_all_devices(tmp_path, path, 4, tol=0.1, devices=("gpu",))
