"""Range method ``consumer``: each tensor read only by weighted layers gets the clip range whose
consumers' outputs move least, checked against a numpy computation of that cost."""
from __future__ import annotations

import numpy as np
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from maceq.app.cli import quantize_main
from maceq.app.consumer_ranges import RANGE_IMAGES, consumer_ranges, range_candidates
from maceq.calibrate.methods import RangeMethod, compute_range
from maceq.calibrate.runner import collect
from maceq.datasets.images import ImageFolder
from maceq.datasets.preprocess import Preprocess
from maceq.quant.ir import Graph
from maceq.quant.onnx_import import import_onnx
from maceq.quant.scheme import adjust_range

PRE = Preprocess(resize=(16, 16))


def _model(w2, *, add: bool = False):
    """x [1,3,16,16] -> c1 (Conv 1x1): t = [10 r + 3 b^4 * 40, g] -> c2 (Conv 1x1, weights w2) -> y.
    Channel 0 has a long tail (the b^4 term); ``add``: t is also read by an Add (y2 = t + t)."""
    w1 = np.zeros((2, 3, 1, 1), np.float32)
    w1[0, 0], w1[1, 1] = 10.0, 1.0
    nodes = [helper.make_node("Mul", ["x", "x"], ["x2"], name="sq"), helper.make_node("Mul", ["x2", "x2"], ["x4"]),
             helper.make_node("Conv", ["x4", "wb"], ["tail"], name="ct"),
             helper.make_node("Conv", ["x", "w1"], ["t0"], name="c1"), helper.make_node("Add", ["t0", "tail"], ["t"]),
             helper.make_node("Conv", ["t", "w2"], ["y"], name="c2")]
    wb = np.zeros((2, 3, 1, 1), np.float32)
    wb[0, 2] = 120.0
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if add:
        nodes.append(helper.make_node("Add", ["t", "t"], ["y2"], name="a2"))
        outs.append(helper.make_tensor_value_info("y2", TensorProto.FLOAT, None))
    g = helper.make_graph(nodes, "cr", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])], outs,
                          [numpy_helper.from_array(v, k) for k, v in
                           {"w1": w1, "wb": wb, "w2": np.asarray(w2, np.float32).reshape(1, 2, 1, 1)}.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m


def _images(shared_data):
    return ImageFolder(shared_data / "photos" / "calib", PRE, labels=None, limit=RANGE_IMAGES)


def _numpy_costs(x, cands, w2):
    """sum (c2(Q(t)) - c2(t))^2 per candidate, Q as QuantizeLinear/DequantizeLinear on adjust_range's grid."""
    x = x.astype(np.float32)
    t = np.stack([10 * x[:, 0] + 120 * x[:, 2] ** 4, x[:, 1]], axis=1).astype(np.float32)
    y = np.tensordot(np.asarray(w2, np.float64), t.astype(np.float64), axes=([0], [1]))
    out = []
    for lo, hi in cands:
        q = adjust_range(lo, hi, non_zero=False)
        s = np.float32(q.scale)
        codes = np.clip(np.rint(t / s) + q.zero_point, 0, 255)
        tq = ((codes - q.zero_point) * s).astype(np.float64)
        yq = np.tensordot(np.asarray(w2, np.float64), tq, axes=([0], [1]))
        out.append(float(np.sum((yq - y) ** 2)))
    return np.array(out)


def _choose(shared_data, w2, *, add=False):
    m = _model(w2, add=add)
    stats = collect(m, ["t"], _images(shared_data).iter_batches(8), progress=False)
    g: Graph = import_onnx(m)
    ranges, info = consumer_ranges(g, stats, ["t"], calib_dir=shared_data / "photos" / "calib", preprocess=PRE)
    return ranges["t"], info, stats


@pytest.mark.parametrize("w2", [(1.0, 0.0), (0.0, 1.0), (0.2, 1.0)])
def test_the_chosen_range_is_the_numpy_argmin_of_the_consumers_error(shared_data, w2):
    chosen, info, stats = _choose(shared_data, w2)
    cands = range_candidates(stats["t"])
    x = np.concatenate([b.data for b in _images(shared_data).iter_batches(8)])
    costs = _numpy_costs(x, cands, w2)
    assert info == {"scored": 1, "changed": int(chosen != compute_range(stats["t"], RangeMethod.MSE)),
                    "images": RANGE_IMAGES}
    assert chosen in cands
    assert costs[cands.index(chosen)] <= costs.min() * (1 + 1e-4) + 1e-9


def test_a_consumer_that_ignores_the_long_tail_clips_it_one_that_reads_it_does_not(shared_data):
    reads, _, stats = _choose(shared_data, (1.0, 0.0))
    ignores, _, _ = _choose(shared_data, (0.0, 1.0))
    assert ignores[1] < reads[1]
    assert reads[1] >= 0.6 * float(stats["t"].max)
    assert ignores[1] == pytest.approx(min(c[1] for c in range_candidates(stats["t"])))


def test_a_tensor_also_read_by_an_add_keeps_the_mse_range(shared_data):
    chosen, info, stats = _choose(shared_data, (0.0, 1.0), add=True)
    assert info == {"scored": 0, "changed": 0}
    assert chosen == compute_range(stats["t"], RangeMethod.MSE)


def test_candidates_are_distinct_on_the_grid_and_widest_first(shared_data):
    m = _model((1.0, 0.0))
    stats = collect(m, ["t"], _images(shared_data).iter_batches(8), progress=False)["t"]
    cands = range_candidates(stats)
    assert cands[0] == (float(stats.min), float(stats.max))
    widths = [hi - lo for lo, hi in cands]
    assert widths == sorted(widths, reverse=True)
    grids = {(float(np.float32(adjust_range(lo, hi, non_zero=False).scale)),
              adjust_range(lo, hi, non_zero=False).zero_point) for lo, hi in cands}
    assert len(grids) == len(cands) >= 8


@pytest.mark.e2e
def test_quantize_records_the_step(tmp_path, shared_data):
    model = tmp_path / "cr.onnx"
    model.write_bytes(_model((0.0, 1.0)).SerializeToString())
    rc = quantize_main([str(model), "--calib-dir", str(shared_data / "photos" / "calib"), "--resize", "16,16",
                        "--range-method", "consumer", "--max-images", "8", "--no-report", "-q",
                        "-o", str(tmp_path / "q")])
    assert rc == 0
    meta = yaml.safe_load((tmp_path / "q" / "cr.yml").read_text())["maceq"]
    steps = [r for r in meta["recovery"] if r["step"] == "consumer ranges"]
    # t (read by c2) and x^4 (read by the tail conv); the stage keeps to --max-images
    assert len(steps) == 1 and steps[0]["scored"] == 2 and steps[0]["images"] == 8
    assert meta["range_method"] == "consumer"
