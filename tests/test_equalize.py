"""Cross-layer equalization + high-bias absorption (quant/passes/equalize.py) on MobileNetV2.

Oracles: onnxruntime on the optimised float graph before the pass (the float function), weight
ranges recomputed here from the stored initializers (Nagel's fixed point; AIMET's closed form
cbrt(r1 r2 r3) for an isolated depthwise-separable triplet), per-channel statistics of the new
graph collected again on the images (the ReLU6 rule), interval bounds recomputed here from the
weights, and each quantized layer alone against onnxruntime (reports.analysis, isolated mode).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from maceq.calibrate.methods import compute_range
from maceq.calibrate.runner import collect, make_session
from maceq.datasets.images import ImageFolder
from maceq.datasets.preprocess import PRESETS
from maceq.errors import MaceqError
from maceq.quant.config import QuantConfig
from maceq.quant.ir import ACT_ATTR, Graph, Node, ValueInfo
from maceq.quant.passes.equalize import collect_channel_stats, equalize
from maceq.app.pipeline import Calibration, write_quantized
from maceq.quant.prepare import prepare_graph, tensors_to_calibrate
from maceq.reports.analysis import analyze_layers
from maceq.runtime import load

PRE = PRESETS["imagenet"]
N_CALIB = 32   # calibration images for the statistics (of 148)
N_EVAL = 8     # held-out images


def _images(shared_data, folder, n):
    return [b.data for b in ImageFolder(shared_data / "photos" / folder, PRE, labels=None, limit=n).iter_batches(8)]


@pytest.fixture(scope="module")
def mnv2(shared_data):
    path = shared_data / "models" / "mobilenet_v2.onnx"
    g, in_shapes, _ = prepare_graph(path, input_shape=None, preprocess=PRE)
    calib = _images(shared_data, "calib", N_CALIB)
    stats = collect_channel_stats(g, calib)
    return {"path": path, "graph": g, "in_shapes": in_shapes, "stats": stats, "calib": calib,
            "eval": _images(shared_data, "eval", N_EVAL)}


def _outputs(g: Graph, batches) -> np.ndarray:
    sess = make_session(g.to_onnx().SerializeToString())
    return np.concatenate([sess.run(None, {g.inputs[0].name: x})[0] for x in batches])


def _max_rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """Worst over images of max |a - b| / max |a| (the logits of one image)."""
    return float(np.max(np.abs(a - b).max(axis=1) / np.abs(a).max(axis=1)))


def _w(g: Graph, node: Node) -> np.ndarray:
    return np.asarray(g.const(node.inputs[1]), dtype=np.float64)


def _out_ranges(g: Graph, node: Node) -> np.ndarray:
    """max |w| per output channel."""
    w = _w(g, node)
    if node.op_type == "Gemm" and not node.attr("transB", 0):
        w = w.T
    return np.abs(w).reshape(w.shape[0], -1).max(axis=1)


def _in_ranges(g: Graph, node: Node) -> np.ndarray:
    """max |w| per input channel (a depthwise kernel's input channel i is its output channel i)."""
    w = _w(g, node)
    if node.op_type == "Gemm":
        w = w if node.attr("transB", 0) else w.T
        return np.abs(w).max(axis=0)
    if int(node.attr("group", 1)) > 1:
        return np.abs(w).reshape(w.shape[0], -1).max(axis=1)
    return np.abs(np.moveaxis(w, 1, 0)).reshape(w.shape[1], -1).max(axis=1)


def _node(g: Graph, name: str) -> Node:
    return next(n for n in g.nodes if n.name == name)


def _bounded_nodes(g: Graph) -> list[str]:
    return [n.name for n in g.nodes if n.attrs.get(ACT_ATTR) == (0.0, 6.0)]


# -- the float function -----------------------------------------------------------------------


def _interval_hi(g: Graph, node: Node) -> np.ndarray:
    """Upper bound of a Conv's pre-activation over every input in [0, 6] (its input is a ReLU6
    output): b + 6 * sum of the positive weights of each output channel; +inf for other inputs."""
    src = next((n for n in g.nodes if node.inputs[0] in n.outputs), None)
    w, b = _w(g, node), np.asarray(g.const(node.inputs[2]), np.float64)
    if src is None or src.attrs.get(ACT_ATTR) != (0.0, 6.0):
        return np.full(w.shape[0], np.inf)
    return b + 6.0 * np.maximum(w, 0.0).reshape(w.shape[0], -1).sum(axis=1)


def _equalized(mnv2, relu6: str, absorb: bool):
    g = mnv2["graph"].copy()
    rep = equalize(g, relu6=relu6, channel_stats=mnv2["stats"], headroom=2.0, absorb_bias=absorb)
    return g, rep


@pytest.fixture(scope="module")
def exact(mnv2):
    """relu6='exact' + HBA: every move proven for every input (interval bounds)."""
    return _equalized(mnv2, "exact", True)


@pytest.fixture(scope="module")
def exact_cle(mnv2):
    """relu6='exact', CLE alone: P's pre-activation channel i becomes x_i / S_i."""
    return _equalized(mnv2, "exact", False)


@pytest.fixture(scope="module")
def calibrated(mnv2):
    """relu6='calibrated', headroom 2, CLE alone."""
    return _equalized(mnv2, "calibrated", False)


@pytest.mark.parametrize("which", ["exact", "calibrated", "calibrated+hba"])
def test_float_function_is_kept_on_calibration_and_held_out_images(mnv2, exact, calibrated, which):
    g, rep = {"exact": exact, "calibrated": calibrated}.get(which) or _equalized(mnv2, "calibrated", True)
    assert len(rep.links) == 37 and rep.converged
    assert _bounded_nodes(g) == _bounded_nodes(mnv2["graph"])  # every ReLU6 clamp is still there
    for batches in (mnv2["calib"], mnv2["eval"]):
        ref, got = _outputs(mnv2["graph"], batches), _outputs(g, batches)
        assert _max_rel_err(ref, got) < 1e-4
        assert np.array_equal(ref.argmax(axis=1), got.argmax(axis=1))
    # ... while the weights did change (calibrated: the depthwise layers' per-tensor ranges shrank)
    changed = sum(not np.allclose(_w(g, _node(g, n.name)), _w(mnv2["graph"], n)) for n in mnv2["graph"].nodes
                  if n.op_type == "Conv")
    assert changed >= 30
    dw = [n for n in mnv2["graph"].nodes if int(n.attr("group", 1)) > 1]
    shrunk = sum(_out_ranges(g, _node(g, n.name)).max() < 0.8 * _out_ranges(mnv2["graph"], n).max() for n in dw)
    assert shrunk >= (0 if which == "exact" else 12)


def test_exact_mode_needs_no_data_efficientnet(shared_data):
    """EfficientNet-Lite0, whose ReLU6 channels mostly clip: relu6='exact' without any statistics
    moves only interval-proven channels and keeps the function on held-out images."""
    pre = PRESETS["tf"]
    g0, _, _ = prepare_graph(shared_data / "models" / "efficientnet_lite0.onnx", input_shape=None, preprocess=pre)
    g = g0.copy()
    rep = equalize(g, relu6="exact", absorb_bias=False)
    assert len(rep.links) == 35 and sum(ln.proven_channels for ln in rep.links) > 1000
    assert sum(not np.allclose(_w(g, _node(g, n.name)), _w(g0, n)) for n in g0.nodes if n.op_type == "Conv") >= 20
    images = [b.data for b in ImageFolder(shared_data / "photos" / "eval", pre, labels=None, limit=8).iter_batches(8)]
    assert _max_rel_err(_outputs(g0, images), _outputs(g, images)) < 1e-4


def test_relu6_rule_moves_only_channels_below_the_clip(mnv2, exact_cle, calibrated):
    """Statistics collected again on the new graphs. A channel of a ReLU6 link either kept its
    pre-activation (scale 1), or is proven below 6 for every input by the interval bound
    (recomputed here) and stays below 6, or (calibrated) stays at or below 6 / headroom."""
    old = mnv2["stats"]
    g0 = mnv2["graph"]
    for which, (g, rep) in (("exact", exact_cle), ("calibrated", calibrated)):
        new = collect_channel_stats(g, mnv2["calib"])
        moved = proven_moved = 0
        for ln in rep.links:
            node = _node(g, ln.producer)
            if node.attrs.get(ACT_ATTR) != (0.0, 6.0):
                continue
            t = node.outputs[0]
            u = _interval_hi(g0, _node(g0, ln.producer))
            assert ln.proven_channels == int(np.count_nonzero(u < 6.0))
            same = (np.isclose(new[t].hi, old[t].hi, rtol=1e-5, atol=1e-6)
                    & np.isclose(new[t].lo, old[t].lo, rtol=1e-5, atol=1e-6))
            proven = (u < 6.0) & (new[t].hi <= 6.0 * (1 + 1e-5))
            data = 2.0 * new[t].hi <= 6.0 * (1 + 1e-5) if which == "calibrated" else np.zeros_like(same)
            assert np.all(same | proven | data), (which, ln.producer)
            moved += int(np.count_nonzero(~same))
            proven_moved += int(np.count_nonzero(~same & (u < 6.0)))
        if which == "exact":
            assert moved == proven_moved > 100
        else:
            assert moved > 5000


def test_replace_mode_is_exact_for_the_relu_graph_and_reaches_nagels_fixed_point(mnv2):
    """relu6='replace': every ReLU6 of a link becomes ReLU; the equalized graph computes what the
    ReLU graph computes (positive homogeneity), and each link's ranges meet (r1_i == r2_i)."""
    g0 = mnv2["graph"]
    g = g0.copy()
    rep = equalize(g, relu6="replace", channel_stats=None, absorb_bias=False, tolerance=1e-10, iterations=400)
    assert rep.converged and sorted(rep.relu6_replaced) == sorted(_bounded_nodes(g0))
    relu = g0.copy()
    for n in relu.nodes:
        if n.attrs.get(ACT_ATTR) == (0.0, 6.0):
            n.attrs[ACT_ATTR] = (0.0, math.inf)
    for batches in (mnv2["calib"][:1], mnv2["eval"]):
        assert _max_rel_err(_outputs(relu, batches), _outputs(g, batches)) < 1e-4
    for ln in rep.links:
        r1, r2 = _out_ranges(g, _node(g, ln.producer)), _in_ranges(g, _node(g, ln.consumer))
        np.testing.assert_allclose(r1, r2, rtol=1e-5)
    # AIMET's closed form for an isolated depthwise-separable triplet: all three ranges become
    # cbrt(r1 r2 r3) of the original weights (ScaleFactorCalculator::ForDepthWiseSeparableLayer).
    producers = [ln.producer for ln in rep.links]
    consumers = [ln.consumer for ln in rep.links]
    triplets = [(a, b, c) for a, b, c in zip(producers, consumers, consumers[1:])
                if b in producers and producers.index(b) == producers.index(a) + 1
                and a not in consumers and c not in producers]
    assert len(triplets) >= 10
    for a, b, c in triplets:
        before = (_out_ranges(g0, _node(g0, a)) * _out_ranges(g0, _node(g0, b)) * _in_ranges(g0, _node(g0, c)))
        want = np.cbrt(before)
        for name, f in ((a, _out_ranges), (b, _out_ranges), (c, _in_ranges)):
            np.testing.assert_allclose(f(g, _node(g, name)), want, rtol=1e-5)


# -- high-bias absorption ---------------------------------------------------------------------


def test_hba_absorbs_only_into_unpadded_layers(mnv2, exact, exact_cle):
    g, rep = exact
    absorbed = [ln for ln in rep.links if ln.absorbed_channels]
    assert sum(ln.absorbed_channels for ln in absorbed) > 300
    for ln in absorbed:
        cons = _node(g, ln.consumer)
        assert not any(cons.attr("pads", [])), ln.consumer
    for ln in rep.links:
        if any(_node(g, ln.consumer).attr("pads", [])):
            assert ln.absorbed_channels == 0 and ln.absorb_note == "consumer zero-pads its input"
    # the biases really moved: compare with CLE alone (exactness: the float-function test above)
    plain = exact_cle[0]
    for ln in absorbed:
        b_hba = g.const(_node(g, ln.producer).inputs[2])
        b_cle = plain.const(_node(plain, ln.producer).inputs[2])
        assert np.count_nonzero(~np.isclose(b_hba, b_cle)) == ln.absorbed_channels


def test_hba_into_a_padded_layer_is_inexact_at_the_borders(mnv2):
    """Negative control: absorbing into the zero-padded depthwise layers changes the output."""
    g = mnv2["graph"].copy()
    rep = equalize(g, relu6="calibrated", channel_stats=mnv2["stats"], absorb_padded=True)
    assert any(ln.absorbed_channels for ln in rep.links if any(_node(g, ln.consumer).attr("pads", [])))
    assert _max_rel_err(_outputs(mnv2["graph"], mnv2["eval"][:1]), _outputs(g, mnv2["eval"][:1])) > 1e-3


# -- structure on a small graph ------------------------------------------------------------------


def _tiny(act1=(0.0, math.inf), second_consumer=False) -> Graph:
    rng = np.random.default_rng(0)
    inits = {"w1": rng.normal(size=(4, 3, 1, 1)).astype(np.float32) * np.array([1, 10, 0.1, 3], np.float32)[:, None, None, None],
             "b1": rng.normal(size=4).astype(np.float32),
             "w2": rng.normal(size=(5, 4, 1, 1)).astype(np.float32), "b2": rng.normal(size=5).astype(np.float32),
             "wg": rng.normal(size=(2, 5)).astype(np.float32), "bg": rng.normal(size=2).astype(np.float32),
             "shape": np.array([0, -1], np.int64)}
    nodes = [Node("c1", "Conv", ["x", "w1", "b1"], ["t1"], {"group": 1, ACT_ATTR: act1}),
             Node("c2", "Conv", ["t1", "w2", "b2"], ["t2"], {"group": 1, ACT_ATTR: (0.0, 6.0)}),
             Node("gap", "GlobalAveragePool", ["t2"], ["t3"]),
             Node("rs", "Reshape", ["t3", "shape"], ["t4"]),
             Node("fc", "Gemm", ["t4", "wg", "bg"], ["y"], {"transB": 1})]
    outs = ["y"]
    if second_consumer:
        nodes.append(Node("side", "Relu", ["t1"], ["z"]))
        outs.append("z")
    return Graph(nodes, inits, [ValueInfo("x", ["N", 3, 4, 4])], outs)


def test_links_and_skips_on_a_small_graph():
    g = _tiny()
    rep = equalize(g, relu6="replace")
    assert [(ln.producer, ln.consumer, ln.activation) for ln in rep.links] == [
        ("c1", "c2", "relu"), ("c2", "fc", "relu")]  # through GlobalAveragePool -> Reshape
    assert rep.skipped == (("fc", "'y' is a graph output"),)
    g = _tiny(second_consumer=True)
    w = {k: v.copy() for k, v in g.initializers.items()}
    rep = equalize(g, relu6="exact")  # c2 reads a ReLU output: no finite interval bound
    assert [(ln.producer, ln.fixed_channels, ln.proven_channels) for ln in rep.links] == [("c2", 5, 0)]
    assert rep.skipped == (("c1", "'t1' has 2 consumers"), ("fc", "'y' is a graph output"))
    assert all(np.array_equal(g.initializers[k], v) for k, v in w.items())
    rep = equalize(g, relu6="calibrated")
    assert ("c2", "bounded ReLU (0, 6) without channel_stats: interval bounds only") in rep.skipped
    rep = equalize(_tiny(act1=(-1.0, 1.0)))
    assert ("c1", "activation clip(-1.0, 1.0) is not a (bounded) ReLU") in rep.skipped


def test_small_graph_float_function_and_fixed_point():
    x = np.random.default_rng(1).normal(size=(6, 3, 4, 4)).astype(np.float32)
    g0 = _tiny()
    relu = _tiny(); relu.nodes[1].attrs[ACT_ATTR] = (0.0, math.inf)
    g = _tiny()
    rep = equalize(g, relu6="replace", tolerance=1e-12, iterations=500)
    assert rep.converged
    np.testing.assert_allclose(_outputs(g, [x]), _outputs(relu, [x]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_out_ranges(g, g.nodes[0]), _in_ranges(g, g.nodes[1]), rtol=1e-6)
    np.testing.assert_allclose(_out_ranges(g, g.nodes[1]), _in_ranges(g, g.nodes[4]), rtol=1e-6)
    assert not np.allclose(_w(g, g.nodes[0]), _w(g0, g0.nodes[0]))


@pytest.mark.parametrize("kw,msg", [({"relu6": "relu"}, "relu6 must be one of exact, calibrated, replace"),
                                    ({"headroom": 0.5}, "headroom must be a finite number >= 1"),
                                    ({"iterations": 0}, "iterations must be a positive int")])
def test_bad_options(kw, msg):
    with pytest.raises(MaceqError, match=msg):
        equalize(_tiny(), **kw)


# -- quantized ------------------------------------------------------------------------------------


def _isolated_sqnr(mnv2, g: Graph, tmp_path, shared_data) -> dict[str, list[float]]:
    """Calibrate as pipeline.calibrate does (on the N_CALIB images), write the cpu model, and
    measure each layer alone against onnxruntime (reports.analysis, isolated mode)."""
    config = QuantConfig()
    names = tensors_to_calibrate(g)
    data = ImageFolder(shared_data / "photos" / "calib", PRE, labels=None, limit=N_CALIB)
    stats = collect(g.to_onnx(), names, data.iter_batches(8), input_name=g.inputs[0].name, progress=False)
    ranges = {t: compute_range(stats[t], config.method_for(t)[0], percentile=config.method_for(t)[1]) for t in names}
    cal = Calibration(mnv2["path"], g, mnv2["in_shapes"], g.infer_shapes(mnv2["in_shapes"]), ranges, N_CALIB, 0,
                      PRE, config)
    model = load(write_quantized(cal, output_dir=tmp_path).files.yml)
    layers = analyze_layers(model, g, ImageFolder(shared_data / "photos" / "eval", PRE, labels=None, limit=1),
                            modes=("isolated",), progress=False)
    out: dict[str, list[float]] = {}
    for L in layers:
        out.setdefault(L.op_type, []).append(L.isolated.sqnr_db)
    return out


def test_quantized_cpu_layers_gain_from_equalization(mnv2, calibrated, tmp_path, shared_data):
    """Per-tensor uint8 weights (cpu): each Conv2D / DepthwiseConv2d layer, quantized alone, is
    closer to float after CLE (calibrated mode). The end-to-end agreement on 91 images is in
    docs/recovery.md; on a few images it is too noisy to assert without bias correction."""
    base = _isolated_sqnr(mnv2, mnv2["graph"], tmp_path / "base", shared_data)
    cle = _isolated_sqnr(mnv2, calibrated[0], tmp_path / "cle", shared_data)
    assert len(base["DepthwiseConv2d"]) == len(cle["DepthwiseConv2d"]) == 17
    assert np.mean(cle["DepthwiseConv2d"]) > np.mean(base["DepthwiseConv2d"]) + 2.0
    conv = base["Conv2D"] + base["DepthwiseConv2d"], cle["Conv2D"] + cle["DepthwiseConv2d"]
    assert np.mean(conv[1]) > np.mean(conv[0]) + 1.5


@pytest.mark.unit
def test_channel_statistics_of_a_model_that_fixes_its_batch_at_one():
    """A batch of 4 through a graph whose input is fixed at batch 1 (U^2-Net-p's export) runs
    sample by sample: the statistics equal those of the same four samples fed one at a time."""
    from onnx import TensorProto, helper, numpy_helper

    from maceq.quant.onnx_import import import_onnx

    rng = np.random.default_rng(7)
    w = rng.normal(0, 1, (3, 2, 1, 1)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], name="c")], "fixed1",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
                              [helper.make_empty_tensor_value_info("y")], [numpy_helper.from_array(w, "w")])
    g = import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    x = rng.normal(0, 1, (4, 2, 4, 4)).astype(np.float32)
    whole = collect_channel_stats(g, [x])["y"]
    one_by_one = collect_channel_stats(g, [x[k:k + 1] for k in range(4)])["y"]
    y = np.einsum("oc,nchw->nohw", w[:, :, 0, 0], x)
    np.testing.assert_allclose(whole.lo, y.min(axis=(0, 2, 3)), rtol=1e-5)
    np.testing.assert_array_equal(whole.lo, one_by_one.lo)
    np.testing.assert_array_equal(whole.hi, one_by_one.hi)
