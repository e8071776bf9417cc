"""Range search from the histograms: ``mse`` and ``kl`` (calibrate/methods.py).

Oracles, all independent of the code under test:
* mse: the true quantization error of the real samples through ``quant.scheme.adjust_range``
  and ``clip(round(x / s) + zp, 0, 255)``, brute-forced over a fine grid of clips; and a dense
  midpoint-rule integration of the same quantizer over each histogram bin for the model itself.
* kl: a direct, per-candidate implementation of the algorithm of NVIDIA TensorRT's
  pytorch-quantization (tools/pytorch-quantization/pytorch_quantization/calib/histogram.py,
  ``_compute_amax_entropy``): upstream's level assignment by ``np.digitize`` over
  ``np.linspace``, explicit P and Q arrays, ``scipy.stats.entropy``, last argmin.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.stats

from maceq.calibrate.methods import (
    RangeMethod,
    abs_histogram,
    compute_range,
    compute_ranges,
    expected_mse,
    kl_threshold_index,
    parse_method,
    resolve_method,
    uint8_grid,
)
from maceq.calibrate.stats import StatsCollector, TensorStats
from maceq.errors import MaceqError
from maceq.quant.scheme import adjust_range


def stats_of(x, name="t", num_bins=2048) -> TensorStats:
    return TensorStats(name, num_bins=num_bins).update(np.asarray(x, dtype=np.float32))


def quiet(fn, *a, **kw):
    """Call fn with every warning (divide by zero, invalid value, ...) turned into an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*a, **kw)


# -- the uint8 grid ---------------------------------------------------------------------------
def test_uint8_grid_equals_adjust_range():
    rng = np.random.default_rng(5)
    pairs = [(-2.5, 252.5), (-1.5, 253.5), (-3.5, 251.5),  # zero exactly k + 1/2: half to even
             (-1e-7, 4.0), (-4.0, 5e-7), (-1e-6, 1e-6), (-2e-6, 3e-6), (0.0, 0.0), (0.0, 3.0),
             (-3.0, 0.0), (1.0, 2.0), (-2.0, -1.0), (-0.0, 0.0), (-7.25, 1e-300)]
    pairs += [tuple(sorted(p)) for p in rng.normal(0, 3, (300, 2))]
    pairs += [(-a, b) for a, b in rng.uniform(0, 1, (100, 2)) ** 8]
    lo = np.array([p[0] for p in pairs])
    hi = np.array([p[1] for p in pairs])
    scale, zp = uint8_grid(lo, hi)
    for k, (a, b) in enumerate(pairs):
        ref = adjust_range(a, b, non_zero=False)
        assert (scale[k], int(zp[k])) == (ref.scale, ref.zero_point), (a, b)
    assert [int(z) for z in zp[:3]] == [2, 2, 4]


# -- mse: the model -----------------------------------------------------------------------------
def integrate_bins(st: TensorStats, lo: float, hi: float, points: int = 4000) -> float:
    """Mean squared error of the real quantizer with each bin's count spread evenly over the bin
    (clamped to [min, max]): midpoint rule with ``points`` nodes per bin."""
    p = adjust_range(lo, hi, non_zero=False)
    edges = st.edges()
    left = np.maximum(edges[:-1], st.min)
    right = np.minimum(edges[1:], st.max)
    total = 0.0
    t = (np.arange(points) + 0.5) / points
    for k in np.flatnonzero(st.counts):
        if right[k] == left[k]:
            x = np.array([left[k]])
        else:
            x = left[k] + (right[k] - left[k]) * t
        q = np.clip(np.round(x / p.scale) + p.zero_point, 0, 255)
        total += st.counts[k] * np.mean((x - p.scale * (q - p.zero_point)) ** 2)
    return total / st.count


@pytest.mark.parametrize("case", ["normal", "relu", "negative", "far"])
def test_expected_mse_equals_dense_integration(case):
    rng = np.random.default_rng(3)
    x = {"normal": rng.normal(0.3, 1, 5000), "relu": np.maximum(rng.normal(0, 1, 5000), 0),
         "negative": -0.5 - rng.exponential(1, 5000), "far": 1000 + rng.uniform(0, 0.01, 5000)}[case]
    st = stats_of(x, num_bins=64)
    mn, mx = st.min, st.max
    ranges = [(mn, mx), (0.5 * mn, 0.5 * mx), (0.9 * mn, 0.3 * mx), (mn, 0.05 * mx),
              (0.02 * mn, mx), ((mn + mx) / 2, mx)]
    for lo, hi in ranges:
        got = quiet(expected_mse, st, lo, hi)
        ref = integrate_bins(st, lo, hi)
        assert got == pytest.approx(ref, rel=2e-5), (lo, hi)


# -- mse: against the brute-force optimum on the samples ----------------------------------------
def true_mse(x: np.ndarray, weights: np.ndarray, pairs) -> np.ndarray:
    """Weighted mean of (x - dequant(quant(x)))**2 through the real scheme, per (lo, hi)."""
    params = [adjust_range(lo, hi, non_zero=False) for lo, hi in pairs]
    s = np.array([p.scale for p in params])[:, None]
    z = np.array([p.zero_point for p in params], dtype=np.float64)[:, None]
    out = np.empty(len(pairs))
    for r in range(0, len(pairs), 32):
        sr, zr = s[r:r + 32], z[r:r + 32]
        q = np.clip(np.round(x[None, :] / sr) + zr, 0, 255)
        out[r:r + 32] = ((x[None, :] - sr * (q - zr)) ** 2 * weights).sum(axis=1) / weights.sum()
    return out


def brute_force_mse(x: np.ndarray, weights: np.ndarray) -> float:
    """The least true MSE over clips inside [min, max]: a global grid of 48 (x 48) clips, then a
    grid 10x finer around the best (41 points a side in 1-D, 21 x 21 in 2-D)."""
    mn, mx = float(x.min()), float(x.max())
    if mn < 0 < mx:
        steps = np.arange(1, 49) / 48
        pairs = [(a, b) for a in mn * steps for b in mx * steps]
        err = true_mse(x, weights, pairs)
        a, b = pairs[int(np.argmin(err))]
        fine = np.linspace(-1, 1, 21)
        los = np.clip(a - mn / 48 * fine, mn, -1e-12)
        his = np.clip(b + mx / 48 * fine, 1e-12, mx)
        return min(err.min(), true_mse(x, weights, [(p, q) for p in los for q in his]).min())
    if mn >= 0:
        grid = np.linspace(mn if mn > 0 else mx / 4000, mx, 4000)
        make = lambda v: [(mn, h) for h in v]  # noqa: E731
    else:
        grid = np.linspace(mn, mx if mx < 0 else mn / 4000, 4000)
        make = lambda v: [(l, mx) for l in v]  # noqa: E731
    err = true_mse(x, weights, make(grid))
    v = grid[int(np.argmin(err))]
    fine = np.clip(v + (grid[1] - grid[0]) * np.linspace(-1, 1, 41), grid[0], grid[-1])
    return min(err.min(), true_mse(x, weights, make(fine)).min())


def mse_cases():
    rng = np.random.default_rng(1)
    n = 20_000
    one = lambda v: (v, np.ones(v.size))  # noqa: E731
    bulk = rng.laplace(size=n).astype(np.float32)
    outliers = np.array([45, -60, 80, -95, 120, 70], np.float32)
    return {
        "gaussian": one(rng.normal(0, 1, n)),
        "asymmetric": one(rng.normal(2, 1, n)),
        "laplace": one(rng.laplace(0, 1, n)),
        # the laplace bulk repeated 25 times (500k values) plus 6 far outliers: clipping pays
        "laplace_outliers": (np.concatenate([bulk, outliers]),
                             np.concatenate([np.full(n, 25.0), np.ones(outliers.size)])),
        "relu": one(np.maximum(rng.normal(0, 1, n), 0)),
        "constant_ish": one(3 + 0.001 * rng.normal(0, 1, n)),
        "negative": one(-0.5 - np.abs(rng.normal(0, 1, n))),
    }


CASES = mse_cases()


@pytest.mark.parametrize("case", list(CASES))
def test_mse_range_is_near_the_brute_force_optimum(case):
    x, w = CASES[case]
    x = x.astype(np.float32).astype(np.float64)
    st = TensorStats(case)
    for reps in np.unique(w):  # the stats see every repeated value
        st.update(np.tile(x[w == reps].astype(np.float32), int(reps)))
    lo, hi = quiet(compute_range, st, "mse")
    assert st.min <= lo <= hi <= st.max
    best = brute_force_mse(x, w)
    got, minmax = true_mse(x, w, [(lo, hi), (st.min, st.max)])
    assert got <= best * 1.01, (case, lo, hi, got, best)
    if case == "laplace_outliers":
        assert minmax >= 1.8 * got, (minmax, got)  # min_max spends the grid on 6 values
    if case == "constant_ish":
        assert minmax >= 10 * got, (minmax, got)  # the top grid point lands on the cluster
    # the model's value is the histogram's view of the same error
    assert expected_mse(st, lo, hi) == pytest.approx(got, rel=0.3)


# -- kl: against the algorithm of TensorRT's pytorch-quantization ----------------------------------
def kl_oracle(counts: np.ndarray, nq: int) -> int:
    """Window of least KL by the rule of pytorch-quantization ``_compute_amax_entropy`` with
    ``1 << (num_bits - 1 + unsigned) == nq``, ``stride = 1`` and ``start_bin`` = nq bins after
    the first occupied bin (= nq for data reaching 0, upstream's default); written out per
    candidate: bins[0] := bins[1]; P = bins[:i] plus the outliers in its last bin; each bin of
    the window on level ``digitize(j, linspace(0, i, nq + 1)) - 1``, empty bins on none;
    Q = the level's count over its non-empty bins; scipy.stats.entropy(P, Q); last argmin."""
    bins = np.array(counts, dtype=np.int64)
    bins[0] = bins[1]
    n = bins.size
    start_bin = int(np.flatnonzero(bins)[0]) + nq
    if start_bin > n:
        return n
    windows = range(start_bin, n + 1)
    P = np.zeros((len(windows), n))  # one row per candidate, zero-padded (rel_entr(0, 0) = 0)
    Q = np.zeros((len(windows), n))
    for row, i in enumerate(windows):
        level = np.digitize(np.arange(i), np.linspace(0, i, num=nq + 1)) - 1
        level[bins[:i] == 0] = -1
        used = level >= 0
        total = np.bincount(level[used], weights=bins[:i][used], minlength=nq)
        members = np.bincount(level[used], minlength=nq)
        Q[row, :i][used] = total[level[used]] / members[level[used]]
        P[row, :i] = bins[:i]
        P[row, i - 1] += bins[i:].sum()
    kls = scipy.stats.entropy(P, Q, axis=1)
    assert not np.isnan(kls).any()
    return start_bin + kls.size - 1 - int(np.argmin(kls[::-1]))


def kl_cases():
    rng = np.random.default_rng(7)
    n = 50_000
    return {
        "gaussian": rng.normal(0, 1, n),
        "laplace": rng.laplace(0, 1, n),
        "student_t3": rng.standard_t(3, n),
        "relu": np.maximum(rng.normal(0.2, 1, n), 0),
        "negative": -0.25 - rng.exponential(1, n),
        "uniform": rng.uniform(-1, 3, n),
        # away from 0: the windows start nq bins after the first occupied one
        "sigmoid_like": rng.uniform(0.5, 1.0, n),
        "constant_ish": 3 + 0.001 * rng.normal(0, 1, n),
        # gaps: empty bins inside the windows, outliers landing on empty bins (+inf candidates)
        "clusters": np.concatenate([np.zeros(5000), rng.normal(1, 0.05, n), rng.normal(4, 0.02, 300),
                                    [9.0, 9.5, -7.0]]),
    }


KL_CASES = kl_cases()


@pytest.mark.parametrize("case", list(KL_CASES))
def test_kl_threshold_matches_tensorrt_rule(case):
    x = KL_CASES[case]
    st = stats_of(x)
    counts, width = abs_histogram(st)
    signed = st.min < 0 < st.max
    for nq in ((128, 64, 4) if signed else (256, 128)):
        i = quiet(kl_threshold_index, counts, num_quantized_bins=nq)
        assert i == kl_oracle(counts, nq), (case, nq)
    nq = 128 if signed else 256  # the default
    t = kl_oracle(counts, nq) * width
    assert quiet(compute_range, st, "kl") == (max(st.min, -t), min(st.max, t))
    assert compute_range(st, "kl", num_quantized_bins=64) == \
        (max(st.min, -kl_oracle(counts, 64) * width), min(st.max, kl_oracle(counts, 64) * width))


def test_abs_histogram_is_the_histogram_of_abs_x():
    rng = np.random.default_rng(2)
    for x in (rng.normal(0.5, 2, 30_000), -rng.exponential(1, 30_000), 1000 + rng.uniform(0, 0.01, 30_000),
              np.concatenate([rng.normal(0, 1, 3000), [0.0, 0.0]])):
        x = x.astype(np.float32)
        st = stats_of(x)
        counts, width = abs_histogram(st)
        ref, _ = np.histogram(np.abs(x.astype(np.float64)), bins=np.arange(counts.size + 1) * width)
        # the fold counts a negative value lying exactly on a bin edge one bin low (module docstring)
        on_edge = (x < 0) & (np.mod(-x.astype(np.float64), width) == 0)
        assert counts.size <= st.num_bins and counts[-1] > 0 and counts.sum() == x.size
        assert np.abs(counts - ref).sum() <= 2 * on_edge.sum()


# -- order and sharding -------------------------------------------------------------------------
def test_ranges_do_not_depend_on_order_or_sharding():
    rng = np.random.default_rng(11)
    shards = [rng.normal(0, 1 + k, 3000 + 500 * k).astype(np.float32) for k in range(4)]
    shards[2][:3] = (40.0, -35.0, 55.0)
    single = TensorStats("t")
    for s in shards:
        single.update(s)
    a = TensorStats("t").update(shards[3]).update(shards[1])
    b = TensorStats("t").update(shards[0]).update(shards[2])
    merged = b.merge(a)
    other = TensorStats("t").update(shards[2]).merge(TensorStats("t").update(shards[0]).update(shards[3])) \
        .merge(TensorStats("t").update(shards[1]))
    assert single == merged == other
    for method in ("mse", "kl"):
        r = compute_range(single, method)
        assert compute_range(merged, method) == r and compute_range(other, method) == r
        assert r != (single.min, single.max)  # the outliers are clipped: a real search happened


# -- edge cases ---------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["mse", "kl"])
def test_degenerate_tensors(method):
    cases = {
        "constant": (np.full(1000, 2.5), (2.5, 2.5)),
        "single": (np.array([-1.25]), (-1.25, -1.25)),
        "zeros": (np.zeros(77), (0.0, 0.0)),
        "tiny_negative": (np.full(10, -3e-30), (float(np.float32(-3e-30)),) * 2),
    }
    for name, (x, want) in cases.items():
        st = stats_of(x, name)
        got = quiet(compute_range, st, method)
        assert got == want, (name, got)
    # all negative, and one value far from the rest: defined, finite, inside [min, max]
    rng = np.random.default_rng(4)
    for x in (-2 - rng.exponential(1, 5000), np.concatenate([np.full(999, 1.0), [1.5]]),
              np.array([0.0, 1.0]), np.array([-1.0, 1.0])):
        st = stats_of(x)
        lo, hi = quiet(compute_range, st, method)
        assert np.isfinite([lo, hi]).all() and st.min <= lo <= hi <= st.max
        if st.max < 0:
            assert hi == st.max


def test_method_names_and_parameters():
    assert parse_method("mse") is RangeMethod.MSE and parse_method("KL") is RangeMethod.KL
    assert resolve_method("a/b", "mse", [("a/*", "kl", {"num_quantized_bins": 64})]) == (
        RangeMethod.KL, {"num_quantized_bins": 64})
    with pytest.raises(MaceqError, match="'percentile' for method mse"):
        resolve_method("x", "mse", [], default_params={"percentile": 99})
    with pytest.raises(MaceqError, match="allowed: num_quantized_bins"):
        resolve_method("x", "kl", [("x", "kl", {"bins": 3})])
    st = stats_of(np.random.default_rng(0).normal(0, 1, 4000))
    for bad in (1, True, 2.5, "64"):
        with pytest.raises(MaceqError, match="num_quantized_bins"):
            compute_range(st, "kl", num_quantized_bins=bad)
    # the pipeline passes its percentile to every method: ignored by mse and kl
    assert compute_range(st, RangeMethod.KL, percentile=99.0) == compute_range(st, "kl")
    col = StatsCollector()
    col.update({"conv": np.random.default_rng(1).normal(0, 1, 3000), "relu": np.arange(9.0)})
    r = compute_ranges(col, "mse", [("relu", "kl", None)])
    assert r == {"conv": compute_range(col["conv"], "mse"), "relu": compute_range(col["relu"], "kl")}


def test_config_and_cli_accept_the_new_names(capsys):
    from maceq.app.cli import quantize_main
    from maceq.quant.config import config_from_dict

    c = config_from_dict({"range_method": "mse", "layers": {"/head/*": {"range_method": "kl"}}})
    assert c.method_for("/body/x") == (RangeMethod.MSE, 99.99)
    assert c.method_for("/head/logits") == (RangeMethod.KL, 99.99)
    with pytest.raises(SystemExit):
        quantize_main(["--help"])
    assert "{min_max,percentile,mse,kl,consumer}" in capsys.readouterr().out
