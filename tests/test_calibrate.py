"""Streaming statistics, range methods and the onnxruntime calibration runner.

Oracles: numpy min/max/percentile over the concatenated data; an exact bin
index computed with Python Fractions; a direct onnxruntime run of the model
with the tensors added as outputs by this test.
"""
from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from maceq.calibrate.methods import (
    RangeMethod,
    abs_quantile,
    compute_range,
    compute_ranges,
    quantile,
    resolve_method,
)
from maceq.calibrate.runner import collect, expose_outputs, make_session
from maceq.calibrate.stats import DEFAULT_BINS, StatsCollector, TensorStats
from maceq.datasets.images import ImageFolder
from maceq.datasets.preprocess import PRESETS
from maceq.errors import MaceqError

DATA = Path("/work/shared/data")
FMNIST_MODEL = DATA / "models" / "fmnist_mobilenet.onnx"


def shards(seed: int = 0) -> list[np.ndarray]:
    """Batches whose ranges grow, shrink and shift, with exact edge values and subnormals."""
    rng = np.random.default_rng(seed)
    out = [
        np.zeros(7, np.float32),
        rng.normal(0.0, 0.01, 500).astype(np.float32),
        np.array([2.0**-149, -(2.0**-149), 2.0**-130, -0.0, 1.0, -1.0, 0.5, -0.25], np.float32),
        rng.normal(3.0, 1.0, (4, 50, 3)).astype(np.float32),
        np.maximum(rng.normal(0, 6, 900), 0).astype(np.float32),  # relu-like, many zeros
        rng.uniform(-40, -10, 300).astype(np.float32),
        rng.normal(0, 1, 2000).astype(np.float32),
    ]
    return out


def exact_bin(x: float, exp: int) -> int:
    return math.floor(Fraction(x) / Fraction(2) ** exp)


# -- TensorStats ------------------------------------------------------------------
def test_min_max_count_exact_and_histogram_matches_exact_binning():
    parts = shards()
    st = TensorStats("t")
    for p in parts:
        st.update(p)
    allv = np.concatenate([p.ravel() for p in parts])
    assert st.count == allv.size
    assert st.min == float(allv.min()) and st.max == float(allv.max())
    # the grid: smallest e that fits the window (module docstring rule)
    e, n = st.exp, st.num_bins
    assert exact_bin(st.max, e) - exact_bin(st.min, e) <= n - 1
    assert exact_bin(st.max, e - 1) - exact_bin(st.min, e - 1) > n - 1
    assert st.base == exact_bin(st.min, e)
    want = np.zeros(n, np.int64)
    for v in allv.tolist():
        want[exact_bin(v, e) - st.base] += 1
    assert int((st.counts != want).sum()) == 0


def test_update_order_and_sharded_merges_are_identical():
    parts = shards(1)
    one = TensorStats("t").update(np.concatenate([p.ravel() for p in parts]))
    rng = np.random.default_rng(5)
    for trial in range(6):
        order = rng.permutation(len(parts))
        seq = TensorStats("t")
        for i in order:
            seq.update(parts[i])
        assert seq == one
        # random sharding into 3 workers, merged in a random order
        owners = rng.integers(0, 3, len(parts))
        workers = [TensorStats("t") for _ in range(3)]
        for i in order:
            workers[owners[i]].update(parts[i])
        w = [workers[j] for j in rng.permutation(3)]
        merged = w[0].merge(w[1]).merge(w[2])
        assert merged == one and merged.to_dict() == one.to_dict()
        assert w[2].merge(w[0].merge(w[1])) == one
    a = TensorStats("t").update(parts[3])
    b = TensorStats("t").update(parts[5])
    ab = a.merge(b)
    cat = np.concatenate([parts[3].ravel(), parts[5].ravel()])
    assert (ab.min, ab.max, ab.count) == (float(cat.min()), float(cat.max()), cat.size)
    assert ab == TensorStats("t").update(cat)
    assert a.merge(TensorStats("t")) == a and TensorStats("t").merge(a) == a


def test_float32_fast_path_equals_float64_path():
    parts = shards(2)
    for p in parts:
        s32 = TensorStats("t").update(p)
        s64 = TensorStats("t").update(p.astype(np.float64))  # same values, float64 route
        assert s32 == s64
    big = (np.random.default_rng(0).normal(0, 5000, 10000)).astype(np.float32)  # e > 0
    assert TensorStats("t").update(big).exp > 0
    assert TensorStats("t").update(big) == TensorStats("t").update(big.astype(np.float64))


def test_memory_is_constant_in_the_number_of_batches():
    rng = np.random.default_rng(3)
    st = TensorStats("t")
    sizes = set()
    for i in range(300):
        st.update(rng.normal(0, 1 + i, 256).astype(np.float32))
        sizes.add((st.counts.shape, st.counts.nbytes))
    assert sizes == {((DEFAULT_BINS,), DEFAULT_BINS * 8)}
    assert int(st.counts.sum()) == st.count == 300 * 256
    assert len(json.dumps(st.to_dict())) < 40_000


def test_nan_inf_and_bad_input_name_the_tensor():
    with pytest.raises(MaceqError, match=r"tensor 'conv1': 1 NaN and 0 Inf"):
        TensorStats("conv1").update(np.array([1.0, np.nan], np.float32))
    with pytest.raises(MaceqError, match=r"tensor 'relu': 0 NaN and 2 Inf"):
        TensorStats("relu").update(np.array([np.inf, -np.inf, 0], np.float32))
    with pytest.raises(MaceqError, match="tensor 'c'"):
        TensorStats("c").update(np.array(["a"]))
    with pytest.raises(MaceqError, match="bins"):
        TensorStats("a", num_bins=16).merge(TensorStats("a", num_bins=32))
    st = TensorStats("e")
    st.update(np.zeros((0, 3), np.float32))
    assert st.empty
    with pytest.raises(MaceqError, match="tensor 'e': no calibration data"):
        compute_range(st, "min_max")


def test_dict_round_trip_and_validation():
    st = TensorStats("x")
    for p in shards(4):
        st.update(p)
    d = json.loads(json.dumps(st.to_dict()))
    assert TensorStats.from_dict(d) == st
    empty = TensorStats("y", num_bins=64)
    assert TensorStats.from_dict(json.loads(json.dumps(empty.to_dict()))) == empty
    bad = dict(d, exp=d["exp"] + 1)
    with pytest.raises(MaceqError, match="grid rule"):
        TensorStats.from_dict(bad)
    with pytest.raises(MaceqError, match="'colour'"):
        TensorStats.from_dict(dict(d, colour=1))
    with pytest.raises(MaceqError, match="'count'"):
        TensorStats.from_dict(dict(d, count=d["count"] + 1))
    col = StatsCollector(["a", "b"])
    col.update({"a": shards(0)[3], "b": shards(0)[1], "c": np.ones(3, np.float32)})
    assert list(col) == ["a", "b", "c"]
    back = StatsCollector.from_dict(json.loads(json.dumps(col.to_dict())))
    assert list(back) == list(col) and all(back[n] == col[n] for n in col)


def test_collector_merge_is_union():
    p = shards(6)
    a, b = StatsCollector(), StatsCollector()
    a.update({"x": p[1], "y": p[3]})
    b.update({"y": p[5], "z": p[6]})
    m = a.merge(b)
    assert list(m) == ["x", "y", "z"]
    assert m["y"] == TensorStats("y").update(np.concatenate([p[3].ravel(), p[5].ravel()]))
    assert m["z"] == TensorStats("z").update(p[6])
    with pytest.raises(MaceqError, match="'w'"):
        m["w"]


# -- range methods ----------------------------------------------------------------
DISTS = {
    "normal": lambda r: r.normal(0, 1, 200_000),
    "shifted_exp": lambda r: r.exponential(3, 200_000) + 1,
    "relu_like": lambda r: np.maximum(r.normal(0.5, 2, 200_000), 0),
    "heavy": lambda r: r.standard_t(2, 200_000),
}


@pytest.mark.parametrize("dist", list(DISTS))
def test_percentile_within_one_bin_of_numpy(dist):
    x = DISTS[dist](np.random.default_rng(11)).astype(np.float32)
    # feed in 7 uneven batches: the grid grows while streaming
    st = TensorStats(dist)
    for chunk in np.array_split(x, [10, 1000, 5000, 40_000, 41_000, 120_000]):
        st.update(chunk)
    w = st.bin_width
    x64 = x.astype(np.float64)
    for p in (99.999, 99.99, 99.9, 99.0, 90.0):
        lo, hi = compute_range(st, RangeMethod.PERCENTILE, percentile=p)
        t = (100.0 - p) / 2.0
        ref_lo, ref_hi = np.percentile(x64, [t, 100.0 - t])
        assert abs(lo - ref_lo) <= w and abs(hi - ref_hi) <= w, (p, lo, ref_lo, hi, ref_hi, w)
        a = abs_quantile(st, p / 100.0)
        assert abs(a - np.percentile(np.abs(x64), p)) <= w
        slo, shi = compute_range(st, "percentile", percentile=p, symmetric=True)
        assert (slo, shi) == (-a, a)
    assert compute_range(st, "percentile", percentile=100.0) == (st.min, st.max)
    assert quantile(st, 0.0) == st.min and quantile(st, 1.0) == st.max
    assert compute_range(st, "min_max") == (float(x.min()), float(x.max()))


def test_percentile_does_not_force_zero_into_the_range():
    x = np.random.default_rng(0).uniform(3.0, 5.0, 50_000).astype(np.float32)
    st = TensorStats("pos").update(x)
    lo, hi = compute_range(st, "percentile", percentile=99.0)
    assert 3.0 < lo < hi < 5.0
    assert abs(lo - np.percentile(x, 0.5)) <= st.bin_width
    # far from zero: the grid sits at a large base; the |x| fold stays num_bins wide
    y = (np.float32(1000.0) + np.random.default_rng(1).uniform(0, 0.01, 20_000)).astype(np.float32)
    sy = TensorStats("far").update(y)
    assert sy.base > 2**20
    a = abs_quantile(sy, 0.99)
    assert abs(a - np.percentile(y.astype(np.float64), 99)) <= sy.bin_width
    z = -y
    sz = TensorStats("far-neg").update(z)
    assert abs(abs_quantile(sz, 0.99) - np.percentile(y.astype(np.float64), 99)) <= sz.bin_width


def test_resolve_method_last_match_wins():
    ov = [
        ("*", "percentile", {"percentile": 99.9}),
        ("/head/*", RangeMethod.MIN_MAX, None),
        ("/head/logits", "percentile", {"percentile": 99.0, "symmetric": True}),
    ]
    assert resolve_method("/body/conv", "min_max", ov) == (RangeMethod.PERCENTILE, {"percentile": 99.9})
    assert resolve_method("/head/fc", "min_max", ov) == (RangeMethod.MIN_MAX, {})
    assert resolve_method("/head/logits", "min_max", ov) == (
        RangeMethod.PERCENTILE, {"percentile": 99.0, "symmetric": True})
    assert resolve_method("x", "percentile", [], default_params={"percentile": 99.5}) == (
        RangeMethod.PERCENTILE, {"percentile": 99.5})
    assert resolve_method("/HEAD/fc", "min_max", ov[1:2]) == (RangeMethod.MIN_MAX, {})  # case-sensitive
    with pytest.raises(MaceqError, match="'entropy'"):
        resolve_method("x", "entropy", [])
    with pytest.raises(MaceqError, match="'/a/\\*'.*'percentile'"):
        resolve_method("x", "min_max", [("/a/*", "min_max", {"percentile": 99})])
    col = StatsCollector()
    col.update({"/head/fc": np.arange(10, dtype=np.float32), "/body/conv": np.arange(5, dtype=np.float32)})
    r = compute_ranges(col, "min_max", [("/body/*", "percentile", {"percentile": 100})])
    assert r == {"/head/fc": (0.0, 9.0), "/body/conv": (0.0, 4.0)}


# -- runner -----------------------------------------------------------------------
def _direct_run(model: onnx.ModelProto, names: list[str], feed: dict) -> dict[str, np.ndarray]:
    """Independent reference: add outputs with onnx.helper, run onnxruntime."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    existing = {o.name for o in m.graph.output}
    for n in names:
        if n not in existing:
            m.graph.output.append(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None))
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip(names, sess.run(names, feed)))


def test_runner_matches_direct_onnxruntime_on_fmnist():
    model = onnx.load(str(FMNIST_MODEL))
    convs = [n.output[0] for n in model.graph.node if n.op_type in ("Conv", "Clip", "Add")]
    names = [convs[0], convs[1], convs[7], convs[-1], "/8/GlobalAveragePool_output_0", "logits"]
    ds = ImageFolder(DATA / "fashion_mnist" / "calib", PRESETS["fmnist"], limit=96)
    batches = list(ds.iter_batches(32))
    stats = collect(model, names + ["logits", "input"], iter(batches), total=len(ds), progress=False)
    assert list(stats) == names + ["input"]
    data = np.concatenate([b.data for b in batches])
    ref = _direct_run(model, names, {"input": data})
    for n in names:
        st = stats[n]
        assert st.count == ref[n].size, n
        assert (st.min, st.max) == (float(ref[n].min()), float(ref[n].max())), n
    assert (stats["input"].min, stats["input"].max) == (float(data.min()), float(data.max()))
    # per-batch collection equals one collection over the whole set (mergeable)
    assert stats[names[2]] == TensorStats(names[2]).update(ref[names[2]])
    # dict batches give the same
    stats2 = collect(model, names[:2], ({"input": b.data} for b in batches), progress=False)
    assert stats2[names[0]] == stats[names[0]] and stats2[names[1]] == stats[names[1]]


def test_runner_outputs_added_once_and_errors():
    model = onnx.load(str(FMNIST_MODEL))
    inner = model.graph.node[0].output[0]
    m2 = expose_outputs(model, [inner, "logits", inner])
    outs = [o.name for o in m2.graph.output]
    assert outs == ["logits", inner]
    assert [o.name for o in model.graph.output] == ["logits"]  # the original is untouched
    sess = make_session(m2.SerializeToString(), intra_op_threads=1)
    assert [o.name for o in sess.get_outputs()] == outs
    with pytest.raises(MaceqError, match="'nope'"):
        collect(model, ["nope"], [], progress=False)
    with pytest.raises(MaceqError, match="no input 'image'"):
        collect(model, [inner], [], input_name="image", progress=False)
    with pytest.raises(MaceqError, match="no calibration batches"):
        collect(model, [inner], [], progress=False)
    bad = np.full((1, 1, 28, 28), np.nan, np.float32)
    with pytest.raises(MaceqError, match=f"tensor '{inner}': .*NaN"):
        collect(model, [inner], [bad], progress=False)
