"""Per-layer error engine (reports/analysis.py) against direct numpy computations on real images.

The oracles are independent of the engine: onnxruntime sessions built here, the int8 model's own
``Model.run`` / public ``Model.run_op``, a plain-numpy round-half-away-from-zero quantizer for the
isolated inputs, and the metric formulas written out in numpy.
"""
from __future__ import annotations

import json
import math

import numpy as np
import onnxruntime as ort
import pytest

from maceq.app.pipeline import calibrate, write_quantized
from maceq.datasets.images import ImageFolder
from maceq.datasets.preprocess import PRESETS
from maceq.errors import MaceqError
from maceq.quant.config import QuantConfig
from maceq.reports.analysis import OpRunner, RunningError, analyze_layers, quantize_input
from maceq.runtime import load
from maceq.runtime.model import QTensor

MID_LAYERS = ("/features/features.13/conv/conv.2/Conv", "/features/features.13/Add", "/classifier/classifier.1/Gemm")


def oracle_stats(f: np.ndarray, q: np.ndarray) -> dict:
    f, q = f.astype(np.float64).ravel(), q.astype(np.float64).ravel()
    e = f - q
    return {"sqnr_db": 10 * np.log10(np.sum(f * f) / np.sum(e * e)),
            "cosine": np.sum(f * q) / np.sqrt(np.sum(f * f) * np.sum(q * q)),
            "rel_l2": np.linalg.norm(e) / np.linalg.norm(f), "max_abs": np.max(np.abs(e)), "elements": f.size}


def assert_stats(got, want, rel=1e-9):
    for k, v in want.items():
        assert getattr(got, k) == pytest.approx(v, rel=rel, abs=1e-12), k


def nchw(q: np.ndarray, like: np.ndarray) -> np.ndarray:
    return (q.transpose(0, 3, 1, 2) if q.ndim == 4 and like.ndim == 4 else q).reshape(like.shape)


def plain_session(model) -> ort.InferenceSession:
    """onnxruntime without graph optimisations (the engine's float side; fusions change float bits)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def round_half_away_u8(x: np.ndarray, scale: float, zp: int) -> np.ndarray:
    """Plain oracle of the cpu input quantization: clamp(round_half_away(zp + x / s), 0, 255)."""
    v = zp + x.astype(np.float64) / np.float64(np.float32(scale))
    return np.clip(np.sign(v) * np.floor(np.abs(v) + 0.5), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def mnv2(tmp_path_factory, shared_data):
    cal = calibrate(shared_data / "models" / "mobilenet_v2.onnx", shared_data / "photos" / "calib",
                    preprocess=PRESETS["imagenet"], config=QuantConfig(max_images=16), progress=False)
    out = tmp_path_factory.mktemp("analysis")
    res = write_quantized(cal, output_dir=out, devices=("cpu", "dsp"))
    models = {d: load(f.yml) for d, f in res.per_device.items()}
    data = ImageFolder(shared_data / "photos" / "eval", PRESETS["imagenet"], labels=None, limit=2)
    x = next(data.iter_batches(2)).data
    layers = analyze_layers(models["cpu"], cal.graph, data, device="cpu", progress=False)
    return cal, res, models, data, x, layers


def test_layers_are_the_uint8_nodes_by_exact_names(mnv2):
    cal, res, models, _, _, layers = mnv2
    uint8_nodes = {n for n, where in res.placement.items() if where == "uint8"}
    assert len(layers) == len(uint8_nodes) == 64
    assert {L.node for L in layers} == uint8_nodes
    producers = {o: n.name for n in cal.graph.nodes for o in n.outputs}
    assert all(producers[L.tensor] == L.node for L in layers)
    # the FC writes MACE tensor mace_output_node_logits: matched through Model.tensor_map, not by suffix
    fc = next(L for L in layers if L.op_type == "FullyConnected")
    assert fc.tensor == "logits" and fc.op == "mace_output_node_/classifier/classifier.1/Gemm"
    assert models["cpu"].tensor_map["mace_output_node_logits"] == "logits"
    assert all(L.accumulated is not None and L.isolated is not None for L in layers)
    json.dumps([L.to_dict() for L in layers], allow_nan=False)


def test_accumulated_equals_numpy_over_two_images(mnv2):
    cal, _, models, _, x, layers = mnv2
    model = models["cpu"]
    by_node = {L.node: L for L in layers}
    nodes = ("/features/features.0/features.0.2/Clip",) + MID_LAYERS
    tensors = [by_node[n].tensor for n in nodes]
    sess = plain_session(cal.graph.to_onnx(extra_outputs=tensors))
    f_all = dict(zip(tensors, sess.run(tensors, {"input": x})))
    runs = [model.run({"input": x[k:k + 1]}, intermediates=True) for k in range(2)]
    out_of = {op.name: op.outputs[0] for op in model.ops}
    for n, t in zip(nodes, tensors):
        mace_t = out_of[by_node[n].op]
        # pooled over both images: concatenate, then the formulas
        q = np.concatenate([nchw(r.tensors[mace_t].dequantize(), f_all[t][:1]) for r in runs])
        assert_stats(by_node[n].accumulated, oracle_stats(f_all[t], q))


def test_isolated_equals_numpy_quantized_inputs(mnv2):
    cal, _, models, _, x, layers = mnv2
    model = models["cpu"]
    by_node = {L.node: L for L in layers}
    ops = {op.name: op for op in model.ops}
    made_by = {o: op for op in model.ops for o in op.outputs}
    tmap = model.tensor_map
    runner = OpRunner(model, "cpu")
    for n in MID_LAYERS:
        op = ops[by_node[n].op]
        srcs = [i for i in op.inputs if i not in model.consts]
        names = [tmap.get(i, i) for i in srcs] + [by_node[n].tensor]
        sess = plain_session(cal.graph.to_onnx(extra_outputs=names))
        fq, ff = [], []
        for k in range(2):
            vals = dict(zip(names, sess.run(names, {"input": x[k:k + 1]})))
            ins = []
            for i in srcs:
                qi = made_by[i].out_qinfo[0]  # the producer's stored (calibrated) quantization
                v = vals[tmap.get(i, i)]
                v = v.transpose(0, 2, 3, 1) if v.ndim == 4 else v
                codes = round_half_away_u8(v, qi.scale, qi.zero_point)
                # the engine quantizes with the device's Quantize kernel: the same codes here
                dev = quantize_input(runner, made_by[i], i, np.ascontiguousarray(v))
                assert np.array_equal(dev.values, codes) and dev.qinfo.zero_point == qi.zero_point
                ins.append(QTensor(codes, qi))
            y = model.run_op(op, ins, device="cpu")[0]
            f = vals[by_node[n].tensor]
            deq = np.float32(y.qinfo.scale) * (y.values.astype(np.float32) - np.float32(y.qinfo.zero_point))
            fq.append(nchw(deq, f))
            ff.append(f)
        assert_stats(by_node[n].isolated, oracle_stats(np.concatenate(ff), np.concatenate(fq)))
    # isolated is better than accumulated deep in the network (error does accumulate)
    deep = by_node["/features/features.13/conv/conv.2/Conv"]
    assert deep.isolated.sqnr_db > deep.accumulated.sqnr_db + 1.0


def test_first_conv_isolated_equals_accumulated(mnv2, shared_data):
    cal, _, models, data, _, layers = mnv2
    first = layers[0]
    assert first.node == "/features/features.0/features.0.2/Clip" and first.op_type == "Conv2D"
    assert first.isolated == first.accumulated  # its input is the graph input: same Quantize, same codes
    assert first.accumulated.sqnr_db == pytest.approx(39.06, abs=0.5)
    one = ImageFolder(shared_data / "photos" / "eval", PRESETS["imagenet"], labels=None, limit=1)
    dsp = analyze_layers(models["dsp"], cal.graph, one, device="dsp", progress=False)
    assert dsp[0].node == first.node and dsp[0].isolated == dsp[0].accumulated
    assert dsp[0].isolated.elements == first.isolated.elements // 2


def test_op_runner_equals_run_op(mnv2):
    _, _, models, _, x, _ = mnv2
    for dev in ("cpu", "dsp"):
        model = models[dev]
        run = model.run({"input": x[:1]}, device=dev, intermediates=True)
        runner = OpRunner(model, dev)
        for op in model.ops:
            ins = [None if i in model.consts else run.tensors[i] for i in op.inputs]
            want = model.run_op(op, ins, device=dev)
            for _ in range(2):  # second call: the cached params
                got = runner(op, ins)
                assert all(np.array_equal(g.values, w.values) and g.qinfo == w.qinfo for g, w in zip(got, want))


def test_source_path_gives_the_same_as_the_graph(mnv2, shared_data):
    cal, _, models, _, _, layers = mnv2
    one = ImageFolder(shared_data / "photos" / "eval", PRESETS["imagenet"], labels=None, limit=1)
    a = analyze_layers(models["cpu"], cal.graph, one, modes=("isolated",), progress=False)
    b = analyze_layers(models["cpu"], shared_data / "models" / "mobilenet_v2.onnx", one, modes=["isolated"],
                       progress=False)
    assert a == b and all(L.accumulated is None for L in a)


def test_the_figures_do_not_depend_on_the_thread_count(mnv2, shared_data):
    # the int8 values are the same for any thread count by construction; the running sums must not take a
    # summation order that depends on BLAS's threads either (a BLAS dot over two threads sums in another order)
    from threadpoolctl import threadpool_limits

    from maceq.runtime import threads

    cal, _, models, _, _, _ = mnv2
    one = ImageFolder(shared_data / "photos" / "eval", PRESETS["imagenet"], labels=None, limit=1)
    runs = []
    for n in (1, 2):
        threads.limit(n)
        try:
            with threadpool_limits(n, user_api="blas"):
                runs.append(analyze_layers(models["cpu"], cal.graph, one, device="cpu", progress=False))
        finally:
            threads.limit(None)
    assert runs[0] == runs[1]


def test_running_error_formulas_and_edge_cases():
    rng = np.random.default_rng(5)
    f, q = rng.normal(size=(3, 7)), rng.normal(size=(3, 7))
    r = RunningError()
    r.add(f[:1], q[:1])
    r.add(f[1:], q[1:])
    assert_stats(r.stats(), oracle_stats(f, q), rel=1e-12)
    exact = RunningError()
    exact.add(f, f)
    s = exact.stats()
    assert s.sqnr_db == math.inf and s.rel_l2 == 0.0 and s.max_abs == 0.0 and s.cosine == pytest.approx(1.0)
    assert s.to_dict()["sqnr_db"] == "inf"
    zero = RunningError()
    zero.add(np.zeros(4), np.zeros(4))
    assert zero.stats().cosine == 1.0 and zero.stats().sqnr_db == math.inf
    off = RunningError()
    off.add(np.zeros(4), np.ones(4))
    assert off.stats().sqnr_db == -math.inf and off.stats().rel_l2 == math.inf and off.stats().cosine == 0.0
    with pytest.raises(MaceqError, match="elements"):
        RunningError().add(np.zeros(3), np.zeros(4))


def test_running_error_of_codes_equals_the_dequantized_tensor():
    """add_tensor's compiled pass over the float values and the uint8 codes equals add() of the dequantized tensor in
    the float layout: 4-D (NCHW against NHWC), flat, exact and saturating values; float tensors, and 4-D shapes that
    do not pair, take add() itself."""
    from maceq.reports.analysis import error_sums_path, to_float_layout
    from maceq.runtime.qtypes import QInfo

    rng = np.random.default_rng(8)
    cases = [((2, 5, 7, 3), (2, 7, 3, 5)), ((1, 40), (1, 40)), ((1, 16, 1, 1), (1, 16)), ((1, 3, 4, 9), (1, 4, 9, 3))]
    for f_shape, q_shape in cases:
        q = rng.integers(0, 256, q_shape, dtype=np.uint8)
        t = QTensor(q, QInfo(float(np.float32(rng.uniform(0.01, 0.2))), int(rng.integers(0, 256))))
        f = to_float_layout(t.dequantize(), np.empty(f_shape, np.float32)).copy()
        f.reshape(-1)[::3] += rng.normal(size=f.reshape(-1)[::3].size).astype(np.float32)  # the rest exact
        want, got = RunningError(), RunningError()
        for _ in range(2):
            want.add(f, to_float_layout(t.dequantize(), f))
            got.add_tensor(f, t)
        assert error_sums_path(f, t) == "compiled"
        assert_stats(got.stats(), want.stats().__dict__, rel=1e-12)
        assert got.max_abs == want.max_abs and got.elements == want.elements == 2 * f.size
    same = RunningError()
    same.add_tensor(t.dequantize().transpose(0, 3, 1, 2).copy(), t)
    assert same.stats().sqnr_db == math.inf and same.max_abs == 0.0
    floats = QTensor(rng.normal(size=(1, 4, 5, 3)).astype(np.float32), None)
    f = rng.normal(size=(1, 3, 4, 5)).astype(np.float32)
    assert error_sums_path(f, floats) == "numpy"
    want, got = RunningError(), RunningError()
    want.add(f, to_float_layout(floats.dequantize(), f))
    got.add_tensor(f, floats)
    assert got == want
    assert error_sums_path(np.zeros((1, 3, 4, 5), np.float32), QTensor(np.zeros((1, 5, 4, 3), np.uint8),
                                                                       QInfo(0.1, 0))) == "numpy"


def test_bad_inputs(mnv2):
    cal, _, models, data, _, _ = mnv2
    with pytest.raises(MaceqError, match="unknown analysis mode 'both'"):
        analyze_layers(models["cpu"], cal.graph, data, modes=("both",), progress=False)
    import onnx

    tiny = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("Relu", ["input"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, [1, 3, 224, 224])],
        [onnx.helper.make_empty_tensor_value_info("y")]))
    with pytest.raises(MaceqError, match="no uint8 layer of the model produces a tensor of the float graph"):
        analyze_layers(models["cpu"], tiny, data, progress=False)
