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


# -- the compiled update and its numpy reference -------------------------------------
F32 = np.float32
FMAX = float(np.finfo(np.float32).max)
TINY = 2.0**-149


def _edges(e: int, ks) -> np.ndarray:
    """float32 values k * 2**e: exactly on bin edges of the grid of exponent e."""
    return np.ldexp(np.asarray(ks, np.float64), e).astype(F32)


def adversarial() -> dict[str, list[np.ndarray]]:
    """Named sequences of float32 batches for the compiled-vs-reference comparison."""
    rng = np.random.default_rng(21)
    ks = np.arange(-1024, 1024)
    on_edges = _edges(-10, ks)  # [-1, 1) on 2048 bins: e = -10, every value on an edge
    return {
        "subnormals": [np.array([TINY, -TINY, 3 * TINY, 2.0**-130, -(2.0**-127), 2.0**-126, 0.0], F32),
                       np.array([5 * TINY, -TINY, -2 * TINY], F32)],
        "subnormals_then_normal": [np.array([TINY, 2 * TINY], F32), rng.normal(0, 1e-3, 5000).astype(F32),
                                   np.array([-TINY], F32)],
        "huge_range": [np.array([-FMAX, FMAX, 0.0, 1e-38, -1e-45], F32), rng.normal(0, 1e30, 3000).astype(F32)],
        "huge_one_sided": [np.array([FMAX, FMAX / 3], F32), np.array([1e38, 2e38, 3e38], F32),
                           np.array([1.0, 2.0**-140], F32)],
        "negative_zero": [np.array([-0.0], F32), np.array([0.0, -0.0], F32), np.array([-0.0, 1.0, -0.0], F32),
                          np.array([-1.0, -0.0], F32), np.array([-0.0] * 5, F32)],
        "bin_edges": [on_edges, np.nextafter(on_edges, F32(np.inf)), np.nextafter(on_edges, F32(-np.inf)),
                      _edges(-9, np.arange(-2048, 2048, 3)),  # the range doubles: e = -9, old edges stay edges
                      on_edges],
        "growing": [F32(2.0**i) * rng.uniform(-1, 1, 300).astype(F32) for i in range(-20, 30, 3)]
                   + [np.array([1e10 * (1 + 2.0**-20)], F32), np.array([-1e10], F32)],
        "slowly_growing": [rng.normal(0, 1, 100).astype(F32) * F32(1 + i / 50) for i in range(40)],
        "shifting": [rng.uniform(-40, -10, 300).astype(F32), rng.uniform(10, 40, 300).astype(F32),
                     rng.uniform(1000, 1001, 300).astype(F32), rng.uniform(-1001, -1000, 300).astype(F32)],
        "constant": [np.full(100, 3.5, F32), np.full(7, 3.5, F32), np.full(3, -3.5, F32)],
        "block_sizes": [rng.normal(size=n).astype(F32) for n in (1, 3, 4, 5, 1023, 1024, 1025, 2049, 4099)],
        "relu_runs": [np.maximum(rng.normal(size=(2, 8, 17, 17)), 0).astype(F32) for _ in range(3)],
        "non_contiguous": [rng.normal(size=(64, 33)).astype(F32).T, rng.normal(size=(10, 12)).astype(F32)[::2, 1::3],
                           np.zeros((0, 3), F32)],
    }


def _same(a: TensorStats, b: TensorStats) -> bool:
    """Equal in every field, the signs of min and max included."""
    return (a.to_dict() == b.to_dict() and json.dumps(a.to_dict()) == json.dumps(b.to_dict())
            and a.exp == b.exp and a.base == b.base)


def _spy_fold(monkeypatch) -> list[int]:
    """Record the mode of every call of the compiled loop."""
    import maceq.calibrate.stats as stats_mod

    calls: list[int] = []
    real = stats_mod._fold

    def spy(v, bits, scale, fbase, mode, key_lo, key_hi, counts):
        calls.append(mode)
        return real(v, bits, scale, fbase, mode, key_lo, key_hi, counts)

    monkeypatch.setattr(stats_mod, "_fold", spy)
    return calls


def test_the_compiled_path_runs_for_float32_and_the_reference_otherwise(monkeypatch):
    from maceq.calibrate import stats as stats_mod

    x = np.random.default_rng(0).normal(size=1000).astype(F32)
    monkeypatch.delenv("MACEQ_NO_JIT", raising=False)
    assert stats_mod.update_path(x) == "compiled", "numba is a dependency: float32 must take the compiled loop"
    assert stats_mod.update_path(x.astype(np.float64)) == "numpy"
    assert stats_mod.update_path(np.arange(5)) == "numpy"
    calls = _spy_fold(monkeypatch)
    compiled = TensorStats("t").update(x)
    assert calls == [stats_mod._RANGE, stats_mod._COUNT]  # empty: the range, then the counts on its grid
    compiled.update(x[:10])  # inside the range: one pass, counts added
    assert calls[2:] == [stats_mod._BOTH]
    compiled.update(x * 3)  # wider: the speculative pass, then a recount on the new grid
    assert calls[3:] == [stats_mod._BOTH, stats_mod._COUNT]
    n = len(calls)
    reference = TensorStats("t").update_numpy(x).update_numpy(x[:10]).update_numpy(x * 3)
    assert len(calls) == n and _same(compiled, reference)
    monkeypatch.setenv("MACEQ_NO_JIT", "1")
    assert stats_mod.update_path(x) == "numpy"
    assert _same(TensorStats("t").update(x).update(x[:10]).update(x * 3), reference) and len(calls) == n


@pytest.mark.parametrize("num_bins", [2, 3, 17, DEFAULT_BINS])
@pytest.mark.parametrize("name", list(adversarial()))
def test_compiled_update_equals_the_reference_bit_for_bit(name, num_bins, monkeypatch):
    monkeypatch.delenv("MACEQ_NO_JIT", raising=False)
    parts = adversarial()[name]
    assert all(p.dtype == F32 for p in parts)
    compiled, reference = TensorStats(name, num_bins=num_bins), TensorStats(name, num_bins=num_bins)
    for p in parts:
        compiled.update(p)
        reference.update_numpy(p)
        assert _same(compiled, reference), (name, p[:4])
    allv = np.concatenate([p.ravel() for p in parts]).astype(np.float64)
    assert compiled.count == allv.size and compiled.min == allv.min() and compiled.max == allv.max()
    assert math.copysign(1, compiled.min) == 1 or compiled.min != 0  # a zero min is +0.0
    if num_bins in (17, DEFAULT_BINS) and allv.size < 20_000:  # the exact rule, by Fractions
        want = np.zeros(num_bins, np.int64)
        for v in allv.tolist():
            want[exact_bin(v, compiled.exp) - compiled.base] += 1
        assert np.array_equal(compiled.counts, want)
    # any sharding, compiled per shard and merged in any order, gives the reference's whole
    rng = np.random.default_rng(len(name) + num_bins)
    for _ in range(3):
        owners = rng.integers(0, 3, len(parts))
        shards_ = [TensorStats(name, num_bins=num_bins) for _ in range(3)]
        for i in rng.permutation(len(parts)):
            shards_[owners[i]].update(parts[i])
        order = rng.permutation(3)
        merged = shards_[order[0]].merge(shards_[order[1]]).merge(shards_[order[2]])
        assert _same(merged, reference)


def test_compiled_update_after_float64_data_keeps_the_exact_range(monkeypatch):
    """A running min/max that float32 cannot hold (fed float64 first): the float32 batch that
    follows must widen it exactly when its values lie outside, however close."""
    monkeypatch.delenv("MACEQ_NO_JIT", raising=False)
    for lo, hi in ((0.1, 0.7), (-0.1, -0.05), (1e-300, 1e300), (-1e300, 3.0)):
        start = np.array([lo, hi])
        for batch in (np.array([0.1, 0.7], F32), np.array([-0.1, -0.05], F32), np.array([1.0], F32),
                      np.nextafter(np.array([0.1, 0.7], F32), F32(0))):
            a = TensorStats("t").update(start).update(batch)
            b = TensorStats("t").update_numpy(start).update_numpy(batch)
            assert _same(a, b), (lo, hi, batch)


def test_range_keys_order_float32_values_as_the_floats_do():
    """The compiled loop decides 'inside the running range' on sortable integer keys."""
    from maceq.calibrate.stats import _key, _unkey

    def key(x) -> int:
        b = int(np.array(x, F32).view(np.int32))
        return b ^ 0x7FFFFFFF if b < 0 else b

    rng = np.random.default_rng(4)
    bounds = [0.0, -0.0, 1e-50, -1e-50, 0.1, -0.1, 1e300, -1e300, FMAX, -FMAX, 3.5e38, TINY, -TINY, 1.5 * TINY,
              1.0, 1.0 + 2.0**-30, -1.0 - 2.0**-30] + list(rng.normal(size=100) * 10.0 ** rng.integers(-45, 39, 100))
    with np.errstate(over="ignore"):
        xs = np.concatenate([np.array(bounds).astype(F32), np.array([0.0, -0.0, np.inf, -np.inf, TINY, -TINY], F32)])
    for v in bounds:
        up, down = _key(v, up=True), _key(v, up=False)
        for x in xs:
            assert (float(x) >= v) == (key(x) >= up) and (float(x) <= v) == (key(x) <= down), (float(x), v)
    for x in xs:
        assert _unkey(key(x)) == float(x) and math.copysign(1, _unkey(key(x))) == math.copysign(1, float(x))


def test_compiled_update_nan_and_inf_leave_the_statistics_unchanged(monkeypatch):
    monkeypatch.delenv("MACEQ_NO_JIT", raising=False)
    x = np.random.default_rng(1).normal(size=3000).astype(F32)
    neg_nan = -np.abs(np.array([np.nan], F32))
    for bad in (np.array([1.0, np.nan], F32), neg_nan, np.array([np.inf, -np.inf, 0], F32),
                np.concatenate([x, np.array([np.nan, np.inf], F32), x])):
        for before in (np.zeros(0, F32), x):
            a, b = TensorStats("c").update(before), TensorStats("c").update_numpy(before)
            with pytest.raises(MaceqError) as ea:
                a.update(bad)
            with pytest.raises(MaceqError) as eb:
                b.update_numpy(bad)
            assert str(ea.value) == str(eb.value) and "NaN and" in str(ea.value)
            assert _same(a, b) and _same(a, TensorStats("c").update_numpy(before))


def test_a_zero_min_or_max_is_kept_as_positive_zero():
    for x in (np.array([-0.0], F32), np.array([-0.0, 0.0], F32), np.array([-0.0], np.float64)):
        st = TensorStats("z").update(x)
        assert st.min == st.max == 0.0
        assert math.copysign(1, st.min) == math.copysign(1, st.max) == 1
    d = TensorStats("z").update(np.array([-0.0, 1.0], F32)).to_dict()
    d["min"] = -0.0
    assert math.copysign(1, TensorStats.from_dict(d).min) == 1


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


def _spy_runs(monkeypatch) -> list[int]:
    """The sample count of every onnxruntime run collect() makes."""
    from maceq.calibrate import runner as runner_mod

    sizes: list[int] = []
    real = runner_mod._infer

    def spy(runner, fetch, part, samples, what):
        assert all(v.shape[0] == samples for v in part.values())
        sizes.append(samples)
        return real(runner, fetch, part, samples, what)

    monkeypatch.setattr(runner_mod, "_infer", spy)
    return sizes


def test_batches_run_in_parts_give_the_statistics_of_whole_batches(monkeypatch):
    model = onnx.load(str(FMNIST_MODEL))
    convs = [n.output[0] for n in model.graph.node if n.op_type in ("Conv", "Clip", "Add")]
    names = [convs[0], convs[3], convs[-1], "/8/GlobalAveragePool_output_0", "logits", "input"]
    ds = ImageFolder(DATA / "fashion_mnist" / "calib", PRESETS["fmnist"], limit=45)
    batches = list(ds.iter_batches(8))
    sizes = _spy_runs(monkeypatch)
    whole = collect(model, names, iter(batches), progress=False, fetch_bytes=1 << 40)
    assert sizes == [8] * 5 + [5]
    for budget, per_run in ((1, 1), (3 * _sample_bytes(model, names), 3)):
        sizes.clear()
        parts = collect(model, names, iter(batches), progress=False, fetch_bytes=budget, intra_op_threads=1)
        assert sizes == ([per_run] * (8 // per_run) + ([8 % per_run] if 8 % per_run else [])) * 5 + \
            [per_run] * (5 // per_run) + ([5 % per_run] if 5 % per_run else [])
        assert parts.to_dict() == whole.to_dict()


def _sample_bytes(model: onnx.ModelProto, names: list[str]) -> int:
    sess = make_session(expose_outputs(model, names).SerializeToString())
    out = {o.name: o for o in sess.get_outputs()}
    return sum(4 * math.prod(out[n].shape[1:]) for n in names if n in out)


def _tiny_model(nan: bool = False) -> onnx.ModelProto:
    """x [N, 4] -> d = x / x (NaN where x is 0) or x + 1 -> y = Relu(d); c = Relu(w): [3], no batch dimension."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("Div" if nan else "Add", ["x", "x" if nan else "one"], ["d"]),
             helper.make_node("Relu", ["d"], ["y"]), helper.make_node("Relu", ["w"], ["c"])]
    inits = [numpy_helper.from_array(np.array([-1.0, 0.5, 2.0], F32), "w"),
             numpy_helper.from_array(np.array(1.0, F32), "one")]
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4]),
                               helper.make_tensor_value_info("c", TensorProto.FLOAT, [3])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_an_output_without_batch_dimension_is_folded_once_per_batch(monkeypatch):
    """c has 3 rows like a run of 3 samples: its declared shape says it has no batch dimension."""
    model = _tiny_model()
    rng = np.random.default_rng(2)
    batches = [rng.normal(size=(n, 4)).astype(F32) for n in (5, 5, 2)]
    sizes = _spy_runs(monkeypatch)
    whole = collect(model, ["d", "c", "x"], batches, progress=False)
    three = collect(model, ["d", "c", "x"], batches, progress=False, fetch_bytes=3 * 16 + 3)
    assert sizes == [5, 5, 2] + [3, 2, 3, 2, 2]
    assert three.to_dict() == whole.to_dict()
    assert whole["c"].count == 3 * 3 and whole["d"].count == 12 * 4


def test_nan_in_a_batch_run_in_parts_is_reported_as_for_the_whole_batch():
    model = _tiny_model(nan=True)
    rng = np.random.default_rng(3)
    data = [rng.uniform(1, 2, (4, 4)).astype(F32) for _ in range(3)]
    data[1][1, 2] = data[1][3, 0] = data[1][3, 1] = 0.0  # NaN in samples 5 and 7 of d (and so of y)
    data[2][0, 0] = 0.0

    def message(batches, **kw):
        with pytest.raises(MaceqError) as info:
            collect(model, ["y", "d"], batches, progress=False, **kw)
        return str(info.value)

    plain = message(data)
    assert "tensor 'y': 3 NaN and 0 Inf" in plain and "on sample 5 (calibration batch 1)" in plain
    assert message(data, fetch_bytes=1) == plain
    from maceq.datasets.images import Batch

    items = [Batch(d, [f"img{4 * b + i}.png" for i in range(4)]) for b, d in enumerate(data)]
    named = message(items)
    assert "on image img5.png (and 1 more in calibration batch 1)" in named
    assert message(items, fetch_bytes=1) == named

