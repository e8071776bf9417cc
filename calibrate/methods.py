"""Range methods: from collected statistics to a float range (lo, hi) per tensor.

``min_max``: the exact running ``(min, max)``.

``percentile`` (default p = 99.99) follows the asymmetric convention of
onnxruntime's percentile calibrator (onnxruntime/python/tools/quantization/
calibrate.py, ``HistogramCollector.compute_percentile`` with
``symmetric=False``): a signed-value histogram, each tail cut at
``(100 - p) / 2`` percent, i.e. ``lo`` is the ``(100 - p)/200`` quantile and
``hi`` the ``1 - (100 - p)/200`` quantile, then clamped to the exact
``[min, max]``. With ``symmetric=True`` it follows that calibrator's symmetric
branch instead: the p/100 quantile ``a`` of ``|x|`` (no per-tail halving),
capped at ``max(|min|, |max|)``, and the range ``(-a, a)``.

Quantiles from the histogram (:func:`quantile`): with the values of each bin
taken as spread uniformly over ``[left, left + width)``, the q quantile is the
point where the cumulative count reaches ``t = q * count``: the first bin
``k`` whose cumulative count ``C_k >= t`` (skipping empty bins), at
``left_k + width * (t - C_{k-1}) / c_k``; then clamped to ``[min, max]``.
onnxruntime returns the bin's edge instead; interpolating keeps the error
within one bin width of the sample quantile. ``|x|`` quantiles fold the
signed histogram at 0 (bin ``[-(j+1)w, -jw)`` joins ``[jw, (j+1)w)``; a value
of exactly ``-(j+1)w`` is thereby counted one bin low).

``mse``: the ``(lo, hi)`` inside ``[min, max]`` whose cpu uint8 grid (quant/scheme.py
adjust_range, transcribed in :func:`uint8_grid`) has the least expected squared error
(clipping plus rounding) over the histogram, each bin's values spread uniformly
(:func:`expected_mse`); searched coarse to fine over the histogram's bin edges
(:func:`_mse_range`).

``kl``: TensorRT's entropy calibration (NVIDIA pytorch-quantization
``_compute_amax_entropy``) on the ``|x|`` histogram (:func:`abs_histogram`,
:func:`kl_threshold_index`): threshold ``t``, range ``(max(min, -t), min(max, t))``.

``consumer``: chosen by the error the tensor's consumers compute from it, which needs the graph
and images (app/consumer_ranges.py); from the statistics alone it is ``mse``.

Both are pure functions of the histogram, so of the merged statistics: independent
of image order and sharding. docs/calibration.md gives the exact rules and sources.

Nothing here forces ``lo <= 0 <= hi``: that belongs to the quantization
scheme.

Per-tensor overrides (:func:`resolve_method`): a list of
``(glob, method, params)``; the glob is matched against the whole tensor name
with :func:`fnmatch.fnmatchcase` (case-sensitive; ``*`` also matches ``/``).
The **last** matching entry wins, as in .gitignore; its ``params`` replace the
defaults' params entirely. No match: the default method and params.
"""
from __future__ import annotations

import fnmatch
import math
from enum import Enum
from typing import Any, Mapping, Sequence

import numpy as np

from maceq.calibrate.stats import StatsCollector, TensorStats
from maceq.errors import MaceqError

__all__ = [
    "RangeMethod",
    "DEFAULT_PERCENTILE",
    "compute_range",
    "compute_ranges",
    "quantile",
    "abs_quantile",
    "abs_histogram",
    "kl_threshold_index",
    "uint8_grid",
    "expected_mse",
    "parse_method",
    "resolve_method",
]

DEFAULT_PERCENTILE = 99.99
# Element count of the search temporaries processed at once: 125 kB of float64 stays below
# glibc's mmap threshold (128 kB), so the arrays reuse heap pages instead of faulting in fresh
# ones on every call (which cost more than the arithmetic: 3-4x the run time here).
_CHUNK_ELEMS = 16000


class RangeMethod(Enum):
    MIN_MAX = "min_max"
    PERCENTILE = "percentile"
    MSE = "mse"
    KL = "kl"
    #: chosen by the consumers' output error (app/consumer_ranges.py); from statistics alone: mse
    CONSUMER = "consumer"


_PARAMS: dict[RangeMethod, frozenset[str]] = {
    RangeMethod.MIN_MAX: frozenset(),
    RangeMethod.PERCENTILE: frozenset({"percentile", "symmetric"}),
    RangeMethod.MSE: frozenset(),
    RangeMethod.KL: frozenset({"num_quantized_bins"}),
    RangeMethod.CONSUMER: frozenset(),
}


def parse_method(value: RangeMethod | str) -> RangeMethod:
    """A RangeMethod from itself or its value ("min_max", "percentile", "mse", "kl"; "-" accepted for "_")."""
    if isinstance(value, RangeMethod):
        return value
    if isinstance(value, str):
        try:
            return RangeMethod(value.strip().lower().replace("-", "_"))
        except ValueError:
            pass
    known = ", ".join(m.value for m in RangeMethod)
    raise MaceqError(f"unknown range method {value!r} (known: {known})")


def _need_data(stats: TensorStats) -> None:
    if stats.empty:
        raise MaceqError(f"tensor '{stats.name}': no calibration data collected")


def _interp_quantile(counts: np.ndarray, left0: float, width: float, total: int, q: float) -> float:
    """Quantile q of a histogram whose bin i is [left0 + i*width, left0 + (i+1)*width)."""
    cum = np.cumsum(counts)
    t = q * total
    k = int(np.searchsorted(cum, t, side="left"))
    k = min(k, counts.size - 1)
    while counts[k] == 0 and k < counts.size - 1:  # t == C_{k-1}: take the next occupied bin
        k += 1
    before = int(cum[k - 1]) if k > 0 else 0
    frac = (t - before) / int(counts[k]) if counts[k] else 0.0
    frac = min(max(frac, 0.0), 1.0)
    return left0 + (k + frac) * width


def quantile(stats: TensorStats, q: float) -> float:
    """The q-quantile (0 <= q <= 1) of the values, from the histogram (module docstring)."""
    _need_data(stats)
    if not (0.0 <= q <= 1.0):
        raise MaceqError(f"tensor '{stats.name}': quantile {q} outside [0, 1]")
    left0 = math.ldexp(float(stats.base), stats.exp)
    v = _interp_quantile(stats.counts, left0, stats.bin_width, stats.count, q)
    return min(max(v, stats.min), stats.max)


def _fold_abs(stats: TensorStats) -> tuple[np.ndarray, int]:
    """The ``|x|`` histogram (module docstring): counts of ``|x|`` bins ``j0, j0+1, ...`` (width ``2**e``)."""
    n = stats.num_bins
    k = np.arange(stats.base, stats.base + n, dtype=np.int64)
    j = np.where(k >= 0, k, -k - 1)  # |x| bin of absolute bin k
    j0 = int(j.min())  # the folded window has at most num_bins bins from j0 on
    folded = np.zeros(int(j.max()) - j0 + 1, dtype=np.int64)
    np.add.at(folded, j - j0, stats.counts)
    return folded, j0


def abs_quantile(stats: TensorStats, q: float) -> float:
    """The q-quantile of ``|x|``, from the histogram folded at 0 (module docstring)."""
    _need_data(stats)
    if not (0.0 <= q <= 1.0):
        raise MaceqError(f"tensor '{stats.name}': quantile {q} outside [0, 1]")
    folded, j0 = _fold_abs(stats)
    amax = max(abs(stats.min), abs(stats.max))
    v = _interp_quantile(folded, math.ldexp(float(j0), stats.exp), stats.bin_width, stats.count, q)
    amin = 0.0 if stats.min <= 0.0 <= stats.max else min(abs(stats.min), abs(stats.max))
    return min(max(v, amin), amax)


# -- kl: TensorRT entropy calibration on the |x| histogram ----------------------------------
def abs_histogram(stats: TensorStats, *, max_bins: int | None = None) -> tuple[np.ndarray, float]:
    """The ``|x|`` histogram from 0: ``(counts, width)``, bin ``j`` = ``[j*width, (j+1)*width)``.

    The signed histogram folded at 0 (:func:`_fold_abs`), padded with empty bins down to
    ``|x|`` bin 0, coarsened by ``j -> j >> d`` (the smallest ``d >= 0`` that leaves at most
    ``max_bins`` bins, default ``stats.num_bins``; exact, as in stats.py's regridding:
    ``width = 2**(e + d)``) and cut after the last non-empty bin, so ``counts[-1] > 0``.
    """
    _need_data(stats)
    max_bins = stats.num_bins if max_bins is None else int(max_bins)
    folded, j0 = _fold_abs(stats)
    nz = np.flatnonzero(folded)
    j = nz.astype(np.int64) + j0
    j1 = int(j[-1])
    d = 0
    while (j1 >> d) >= max_bins:  # j1 < 2**53 (stats.py), so d <= 53
        d += 1
    out = np.zeros((j1 >> d) + 1, dtype=np.int64)
    np.add.at(out, j >> d, folded[nz])
    return out, math.ldexp(1.0, stats.exp + d)


def kl_threshold_index(counts: np.ndarray, *, num_quantized_bins: int) -> int:
    """The window ``i`` (threshold = right edge of bin ``i - 1``) of least KL divergence.

    ``counts``: a histogram of ``|x|`` from 0 (``counts[j]`` = values in ``[j*w, (j+1)*w)``)
    whose last bin is non-empty. The rule is NVIDIA's TensorRT pytorch-quantization
    ``_compute_amax_entropy`` (tools/pytorch-quantization/pytorch_quantization/calib/
    histogram.py; Migacz, "8-bit inference with TensorRT", GTC 2017) with ``nbins =
    start_bin = num_quantized_bins`` and ``stride = 1``:

    * ``h = counts`` with ``h[0] := h[1]`` (pytorch-quantization's rule: the spike of exact zeros
      of a ReLU output carries no quantization error), ``N = sum(h)``.
    * For each ``i`` in ``[f + nq, n]``, ``f`` the first non-empty bin of ``h``, ``n = len(h)``
      (none: returns ``n``, no clipping): ``P = h[:i]`` with the outliers ``sum(h[i:])`` added
      to ``P[i-1]``; bin ``j < i`` goes to level ``floor(j * nq / i)`` (what ``np.digitize(j,
      np.linspace(0, i, nq + 1)) - 1`` gives upstream, exactly when ``nq`` is a power of two);
      ``Q[j]`` = the level's total over its number of non-empty bins where ``h[j] > 0``, else 0;
      ``KL = sum p log(p / q)`` with ``p``, ``q`` the normalised ``P``, ``Q``
      (scipy.stats.entropy, natural log). ``q = 0 < p`` (the outliers landing on an empty
      ``h[i-1]``) gives ``+inf``; no smoothing is needed, as ``Q > 0`` wherever ``P > 0``
      otherwise.
    * The least KL wins; among equal ones the largest ``i`` (upstream's ``last_argmin``).

    Upstream starts at ``start_bin = nq`` (its data reaches 0); starting ``nq`` bins after the
    first occupied bin is the same there, and for data away from 0 it skips the windows holding
    fewer than ``nq`` occupied-range bins: with no data in them upstream's KL is NaN (0/0), and
    with one occupied bin (the last) it is exactly 0, which would clip everything to that bin.

    Vectorised with prefix sums (exact integer level sums; float64 logs):
    ``KL_i = (sum_j P log P - sum_b B_b log(B_b / z_b) - O log Q[i-1]) / N + log(C_i / N)``,
    ``B_b`` / ``z_b`` the level's count / non-empty bins, ``O = N - C_i`` the outliers,
    ``C_i = sum(h[:i])``.
    """
    h, nq = _kl_checked_histogram(counts, num_quantized_bins)
    n = h.size
    start = int(np.flatnonzero(h)[0]) + nq  # h[-1] > 0
    if start > n:
        return n
    i = np.arange(start, n + 1, dtype=np.int64)  # candidate windows
    kl = _kl_divergences(h, i, nq)
    best = kl.size - 1 - int(np.argmin(kl[::-1]))  # last argmin; i = n (no outliers) is always finite
    return int(i[best])


def _kl_checked_histogram(counts, num_quantized_bins) -> tuple[np.ndarray, int]:
    """The histogram as int64 with ``h[0] := h[1]``, and ``nq``; MaceqError if either is invalid."""
    h = np.array(counts, dtype=np.int64).reshape(-1)
    nq = int(num_quantized_bins)
    n = h.size
    if n == 0 or h[-1] <= 0 or (h < 0).any():
        raise MaceqError("kl: the |x| histogram must be non-negative with a non-empty last bin")
    if nq < 2:
        raise MaceqError(f"kl: num_quantized_bins must be >= 2, got {num_quantized_bins!r}")
    if n >= 2:
        h[0] = h[1]
    return h, nq


def _kl_divergences(h: np.ndarray, i: np.ndarray, nq: int) -> np.ndarray:
    """``KL_i`` of each window ``i`` by the prefix-sum formula of :func:`kl_threshold_index` (+inf: q = 0 < p)."""
    # Integers: counts sum to the tensor's value count (< 2**53, so float64 copies are exact);
    # window * level <= n * nq, far below 2**63.
    total = int(h.sum())
    cum = np.concatenate(([0], np.cumsum(h)))  # cum[i] = sum(h[:i]), exact int64
    nzc = np.concatenate(([0], np.cumsum(h > 0)))
    hlogh = np.zeros(h.size)
    pos = h > 0
    hlogh[pos] = h[pos] * np.log(h[pos])
    sum_hlogh = np.concatenate(([0.0], np.cumsum(hlogh)))
    blog = _kl_level_logs(cum, nzc, i, nq)
    lastb = ((i - 1) * nq) // i  # level of bin i-1: [s_last, i)
    s_last = (lastb * i + (nq - 1)) // nq
    q_last = (cum[i] - cum[s_last]) / np.maximum(nzc[i] - nzc[s_last], 1)
    c_i = cum[i]
    out = total - c_i  # outliers
    h_last = h[i - 1]
    p_last = h_last + out
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = sum_hlogh[i - 1] + np.where(p_last > 0, p_last * np.log(np.maximum(p_last, 1)), 0.0)
        plogq = blog + np.where(out > 0, out * np.log(np.where(q_last > 0, q_last, 1.0)), 0.0)
        kl = (plogp - plogq) / total + np.log(c_i / total)
    kl[(c_i == 0) | ((h_last == 0) & (out > 0))] = np.inf
    return kl


def _kl_level_terms(cum: np.ndarray, nzc: np.ndarray, s0: np.ndarray, s1: np.ndarray) -> np.ndarray:
    """``B log(B / z)`` of the bins ``[s0, s1)`` (0 when none is occupied)."""
    bs = (cum[s1] - cum[s0]).astype(np.float64)
    bz = nzc[s1] - nzc[s0]
    occ = bz > 0
    return np.where(occ, bs * np.log(np.where(occ, bs, 1.0) / np.maximum(bz, 1)), 0.0)


def _kl_level_logs(cum: np.ndarray, nzc: np.ndarray, i: np.ndarray, nq: int) -> np.ndarray:
    """``sum_b B_b log(B_b / z_b)`` over the ``nq`` levels of each window ``i``."""
    n = cum.size - 1  # bins
    lv = np.arange(nq + 1, dtype=np.int64)
    # A level is a run of bins [s, s + L), L <= max_len. With many windows the runs repeat, so the
    # terms of all runs are tabulated once (the same float ops as directly: the same values).
    max_len = -(-n // nq)
    table = None
    if max_len * (n + 1) <= i.size * nq:
        s0 = np.arange(n + 1, dtype=np.int64)[None, :]
        table = _kl_level_terms(cum, nzc, s0, np.minimum(s0 + np.arange(1, max_len + 1)[:, None], n)).reshape(-1)
    blog = np.empty(i.size)
    rows = max(1, _CHUNK_ELEMS // (nq + 1))  # small temporaries: no fresh pages per call
    for r in range(0, i.size, rows):
        ii = i[r:r + rows, None]
        starts = (ii * lv[None, :] + (nq - 1)) // nq  # first bin of level b: ceil(b*i/nq); [:, nq] = i
        if table is None:
            blog[r:r + rows] = _kl_level_terms(cum, nzc, starts[:, :-1], starts[:, 1:]).sum(axis=1)
        else:
            lens = starts[:, 1:] - starts[:, :-1]  # >= floor(i/nq) >= 1
            blog[r:r + rows] = table[(lens - 1) * (n + 1) + starts[:, :-1]].sum(axis=1)
    return blog


def _kl_range(stats: TensorStats, num_quantized_bins: int | None) -> tuple[float, float]:
    counts, width = abs_histogram(stats)
    if num_quantized_bins is None:
        # levels on one side of 0: 128 of a uint8 grid across 0, all 256 for one-signed data
        num_quantized_bins = 128 if stats.min < 0.0 < stats.max else 256
    elif isinstance(num_quantized_bins, bool) or not isinstance(num_quantized_bins, (int, np.integer)) \
            or num_quantized_bins < 2:
        raise MaceqError(f"tensor '{stats.name}': num_quantized_bins must be an int >= 2, "
                         f"got {num_quantized_bins!r}")
    t = kl_threshold_index(counts, num_quantized_bins=int(num_quantized_bins)) * width
    return (max(float(stats.min), -t), min(float(stats.max), t))


# -- mse: least expected error of the cpu uint8 grid -----------------------------------------
_EPS_ZERO = 1e-6  # quant/scheme.py adjust_range's eps
_TINY32 = float(np.finfo(np.float32).tiny)


def uint8_grid(lo: np.ndarray | float, hi: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
    """``(scale, zero_point)`` of the cpu scheme for ranges ``(lo, hi)``, elementwise.

    A vectorised transcription of :func:`maceq.quant.scheme.adjust_range` with
    ``non_zero=False`` (MACE tools/python/quantize/quantize_util.py adjust_range), same float64
    steps: ``out_min = min(0, lo)``, ``out_max = max(0, hi)``, ``scale = (out_max - out_min) /
    255``; ``zp = round_half_even(-out_min / scale)`` when ``out_min < -1e-6`` and ``out_max >
    1e-6``, else 0 when ``out_min > -1e-6``, else 255; a zero scale becomes float32 tiny.
    The grid is ``scale * (q - zp)``, ``q`` in 0..255.
    """
    lo = np.asarray(lo, dtype=np.float64)
    hi = np.asarray(hi, dtype=np.float64)
    out_max = np.maximum(0.0, hi)
    out_min = np.minimum(0.0, lo)
    scale = (out_max - out_min) / 255.0
    both = (out_min < -_EPS_ZERO) & (out_max > _EPS_ZERO)
    zero = -out_min / np.where(both, scale, 1.0)
    zp = np.where(both, np.rint(zero), np.where(out_min > -_EPS_ZERO, 0.0, 255.0))
    return np.where(scale == 0.0, _TINY32, scale), zp


def _bin_mse(edges: np.ndarray, cnt: np.ndarray, scale: np.ndarray, zp: np.ndarray) -> np.ndarray:
    """Sum over bins of ``cnt * E[(x - Q(x))**2]``, ``x`` uniform on the bin, per grid.

    Bin ``j`` is ``[edges[j], edges[j+1]]`` with ``cnt[j]`` values; a bin of zero width is a
    point mass. ``Q`` rounds to the nearest multiple of ``scale`` (the grid points; ties do not
    matter for a density) and clamps to ``[-zp, 255 - zp] * scale``. In grid units ``u = x /
    scale`` let ``m(u) = clip(floor(u + 1/2), -zp, 255 - zp)`` (the level ``u`` goes to) and
    ``d = u - m`` (the error). ``G(u) = (m + 4 d**3) / 12`` is an antiderivative of ``d**2``
    (continuous: a whole cell contributes 1/12; beyond the ends ``d`` keeps growing: the
    clipping error), so a bin contributes ``cnt * scale**2 * (G(u_b) - G(u_a)) / (u_b - u_a)
    = scale**3 * (cnt / width) * (G(u_b) - G(u_a))``. Rounding: ``u`` carries a relative error
    of 2**-53, so a bin loses about ``log2(255 / (u_b - u_a))`` bits; ``u_b - u_a >= 255 *
    width / (hi - lo)``, and the histogram grid makes ``width / (max - min) >= 2**-11`` unless
    the data spread is below 2**-41 of its magnitude (float32 data that is not constant spreads
    2**-24 at least).
    Shapes: edges ``(B+1,)``, grids ``(C,)``; returns ``(C,)``.
    """
    width = np.diff(edges)
    point = width == 0.0
    rate = np.where(point, 0.0, cnt / np.where(point, 1.0, width))
    u = edges[None, :] * (1.0 / scale)[:, None]
    m = np.floor(u + 0.5)
    np.clip(m, -zp[:, None], 255.0 - zp[:, None], out=m)
    d = u - m
    g = d * d
    g *= d
    g *= 4.0
    g += m  # 12 * G(u)
    err = (np.diff(g, axis=1) * rate).sum(axis=1) * (scale * scale * scale / 12.0)
    if point.any():  # values all at one edge (max on a grid edge): error d**2 each
        pj = np.flatnonzero(point)
        err += (d[:, pj] ** 2 * cnt[pj]).sum(axis=1) * (scale * scale)
    return err


def _level_bins(stats: TensorStats, level: int) -> tuple[np.ndarray, np.ndarray]:
    """The histogram merged by ``4**level`` (absolute bin ``k -> k >> 2*level``, exact), from its
    first to its last non-empty bin: ``(edges, counts)``, the outer edges clamped to the data's
    ``[min, max]`` (``min`` lies in the first bin, ``max`` in the last)."""
    sh = 2 * level
    k0 = stats.base >> sh
    idx = (np.arange(stats.base, stats.base + stats.num_bins, dtype=np.int64) >> sh) - k0
    cnt = np.bincount(idx, weights=stats.counts.astype(np.float64))
    nz = np.flatnonzero(cnt)
    first, last = int(nz[0]), int(nz[-1])
    cnt = cnt[first:last + 1]
    edges = np.ldexp(np.arange(k0 + first, k0 + last + 2, dtype=np.float64), stats.exp + sh)
    edges[0] = max(edges[0], stats.min)
    edges[-1] = min(edges[-1], stats.max)
    return edges, cnt


def expected_mse(stats: TensorStats, lo: float, hi: float) -> float:
    """The model's mean squared quantization error of the cpu uint8 grid for range ``(lo, hi)``
    (:func:`uint8_grid`), each bin's values uniform on the bin clamped to ``[min, max]``."""
    _need_data(stats)
    edges, cnt = _level_bins(stats, 0)
    scale, zp = uint8_grid(np.array([lo], dtype=np.float64), np.array([hi], dtype=np.float64))
    return float(_bin_mse(edges, cnt, scale, zp)[0]) / stats.count


_MSE_COARSE_EDGES = 64  # the coarsest level has at most about this many edges across [min, max]


def _edge_candidates(a: float, b: float, step_exp: int, lo_end: float | None, hi_end: float | None,
                     window: tuple[float, float] | None = None) -> np.ndarray:
    """Grid edges ``k * 2**step_exp`` strictly inside ``(a, b)`` (and inside ``window``), plus the
    given end points that lie in the window; sorted, unique."""
    wa, wb = (a, b) if window is None else (max(a, window[0]), min(b, window[1]))
    k0 = math.floor(math.ldexp(wa, -step_exp))
    k1 = math.ceil(math.ldexp(wb, -step_exp))
    v = np.ldexp(np.arange(k0, k1 + 1, dtype=np.float64), step_exp)
    v = v[(v > a) & (v < b) & (v >= wa) & (v <= wb)]
    ends = [x for x in (lo_end, hi_end) if x is not None and wa <= x <= wb]
    return np.unique(np.concatenate([v, np.array(ends, dtype=np.float64)]))


def _mse_range(stats: TensorStats) -> tuple[float, float]:
    """The (lo, hi) of least :func:`expected_mse`, searched coarse to fine (docs/calibration.md).

    Candidates are the histogram's bin edges (and the data's min/max) on the free ends:
    ``lo`` in ``[min, 0)`` and ``hi`` in ``(0, max]`` for data of both signs; only ``hi`` in
    ``[min, max]`` (``lo = min``) when ``min >= 0``; only ``lo`` (``hi = max``) when ``max <= 0``.
    Level ``l`` offers the edges ``k * 4**l * width``. Stage 1: every candidate of the coarsest
    level ``T`` (at most about 64 edges across ``[min, max]``), scored on the histogram merged
    to that level (cheap, approximate: an isolated value is smeared over a wide bin). Stage 2:
    the level-``T`` candidates within 2 steps of that pick, scored exactly (on the full
    histogram). Stage 3: for ``l = T-1 .. 0``, the level-``l`` candidates within 4 steps (one
    step of level ``l + 1``; 2 steps on level 0) of the current pick, every (lo, hi) pair
    scored exactly. Ties go to the first of the order hi descending, then lo ascending.
    """
    mn, mx = float(stats.min), float(stats.max)
    if mn == mx:
        return (mn, mx)
    span_bins = math.ldexp(mx - mn, -stats.exp)
    top = 0
    while span_bins / 4.0**top > _MSE_COARSE_EDGES:
        top += 1
    # the free ends and their domains; a fixed end is the data's own min or max
    free_lo = mn < 0.0
    free_hi = mx > 0.0
    if free_lo and free_hi:  # lo in [min, 0), hi in (0, max]
        lo_dom, hi_dom = (mn, 0.0), (0.0, mx)
        lo_ends, hi_ends = (mn, None), (None, mx)
    elif free_hi:  # min >= 0: lo = min (the scheme uses 0), hi in [min, max] (hi = min clips all)
        hi_dom, hi_ends = (mn, mx), ((mn if mn > 0.0 else None), mx)
    else:  # max <= 0: hi = max, lo in [min, max]
        lo_dom, lo_ends = (mn, mx), (mn, (mx if mx < 0.0 else None))
    full = _level_bins(stats, 0)

    def pick(level: int, steps: float | None, lo: float, hi: float, bins) -> tuple[float, float]:
        e = stats.exp + 2 * level
        win = None if steps is None else steps * math.ldexp(1.0, e)
        los = (_edge_candidates(*lo_dom, e, *lo_ends, window=None if win is None else (lo - win, lo + win))
               if free_lo else np.array([mn]))
        his = (_edge_candidates(*hi_dom, e, *hi_ends, window=None if win is None else (hi - win, hi + win))
               if free_hi else np.array([mx]))
        hh, ll = np.meshgrid(his[::-1], los, indexing="ij")  # hi descending, then lo ascending
        hh, ll = hh.reshape(-1), ll.reshape(-1)
        edges, cnt = bins
        scale, zp = uint8_grid(ll, hh)
        rows = max(1, _CHUNK_ELEMS // edges.size)
        err = np.concatenate([_bin_mse(edges, cnt, scale[r:r + rows], zp[r:r + rows])
                              for r in range(0, scale.size, rows)])
        k = int(np.argmin(err))  # the first of equal ones
        return float(ll[k]), float(hh[k])

    lo, hi = pick(top, None, mn, mx, _level_bins(stats, top) if top else full)
    if top:
        lo, hi = pick(top, 2, lo, hi, full)
        for level in range(top - 1, -1, -1):
            lo, hi = pick(level, 4 if level else 2, lo, hi, full)
    return (lo, hi)


def compute_range(
    stats: TensorStats,
    method: RangeMethod | str = RangeMethod.MIN_MAX,
    *,
    percentile: float = DEFAULT_PERCENTILE,
    symmetric: bool = False,
    num_quantized_bins: int | None = None,
) -> tuple[float, float]:
    """(lo, hi) for one tensor by ``method`` (module docstring); ``min <= lo <= hi <= max``
    (0 not forced in). ``percentile``/``symmetric`` apply to percentile only,
    ``num_quantized_bins`` (None: 128 for data of both signs, else 256) to kl only."""
    method = parse_method(method)
    _need_data(stats)
    if method is RangeMethod.MIN_MAX:
        return (float(stats.min), float(stats.max))
    if method in (RangeMethod.MSE, RangeMethod.CONSUMER):  # consumer: refined by app/consumer_ranges.py
        return _mse_range(stats)
    if method is RangeMethod.KL:
        return _kl_range(stats, num_quantized_bins)
    p = float(percentile)
    if not (0.0 < p <= 100.0):
        raise MaceqError(f"tensor '{stats.name}': percentile {percentile} outside (0, 100]")
    if symmetric:
        a = abs_quantile(stats, p / 100.0)
        return (-a, a)
    tail = (100.0 - p) / 200.0
    return (quantile(stats, tail), quantile(stats, 1.0 - tail))


def _check_params(method: RangeMethod, params: Mapping[str, Any], where: str) -> dict[str, Any]:
    params = dict(params or {})
    for key in params:
        if key not in _PARAMS[method]:
            allowed = ", ".join(sorted(_PARAMS[method])) or "none"
            raise MaceqError(f"{where}: unknown parameter '{key}' for method {method.value} (allowed: {allowed})")
    return params


def resolve_method(
    tensor_name: str,
    default: RangeMethod | str,
    overrides: Sequence[tuple[str, RangeMethod | str, Mapping[str, Any] | None]] = (),
    *,
    default_params: Mapping[str, Any] | None = None,
) -> tuple[RangeMethod, dict[str, Any]]:
    """The (method, params) for ``tensor_name``: the last matching override, else the default."""
    chosen = (parse_method(default), _check_params(parse_method(default), default_params or {}, "default range method"))
    for entry in overrides:
        if len(entry) != 3:
            raise MaceqError(f"range override {entry!r}: expected (glob, method, params)")
        glob, method, params = entry
        m = parse_method(method)
        p = _check_params(m, params or {}, f"range override '{glob}'")
        if fnmatch.fnmatchcase(tensor_name, glob):
            chosen = (m, p)
    return chosen


def compute_ranges(
    collector: StatsCollector,
    default: RangeMethod | str = RangeMethod.MIN_MAX,
    overrides: Sequence[tuple[str, RangeMethod | str, Mapping[str, Any] | None]] = (),
    *,
    default_params: Mapping[str, Any] | None = None,
) -> dict[str, tuple[float, float]]:
    """(lo, hi) for every tensor of the collector, each by its resolved method."""
    out: dict[str, tuple[float, float]] = {}
    for name in collector:
        method, params = resolve_method(name, default, overrides, default_params=default_params)
        out[name] = compute_range(collector[name], method, **params)
    return out
