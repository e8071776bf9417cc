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
    "parse_method",
    "resolve_method",
]

DEFAULT_PERCENTILE = 99.99


class RangeMethod(Enum):
    MIN_MAX = "min_max"
    PERCENTILE = "percentile"


_PARAMS: dict[RangeMethod, frozenset[str]] = {
    RangeMethod.MIN_MAX: frozenset(),
    RangeMethod.PERCENTILE: frozenset({"percentile", "symmetric"}),
}


def parse_method(value: RangeMethod | str) -> RangeMethod:
    """A RangeMethod from itself or its value ("min_max", "percentile"; "-" accepted for "_")."""
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


def abs_quantile(stats: TensorStats, q: float) -> float:
    """The q-quantile of ``|x|``, from the histogram folded at 0 (module docstring)."""
    _need_data(stats)
    if not (0.0 <= q <= 1.0):
        raise MaceqError(f"tensor '{stats.name}': quantile {q} outside [0, 1]")
    n = stats.num_bins
    k = np.arange(stats.base, stats.base + n, dtype=np.int64)
    j = np.where(k >= 0, k, -k - 1)  # |x| bin of absolute bin k
    j0 = int(j.min())  # the folded window has at most num_bins bins from j0 on
    folded = np.zeros(int(j.max()) - j0 + 1, dtype=np.int64)
    np.add.at(folded, j - j0, stats.counts)
    amax = max(abs(stats.min), abs(stats.max))
    v = _interp_quantile(folded, math.ldexp(float(j0), stats.exp), stats.bin_width, stats.count, q)
    amin = 0.0 if stats.min <= 0.0 <= stats.max else min(abs(stats.min), abs(stats.max))
    return min(max(v, amin), amax)


def compute_range(
    stats: TensorStats,
    method: RangeMethod | str = RangeMethod.MIN_MAX,
    *,
    percentile: float = DEFAULT_PERCENTILE,
    symmetric: bool = False,
) -> tuple[float, float]:
    """(lo, hi) for one tensor by ``method`` (module docstring); lo <= hi, 0 not forced in."""
    method = parse_method(method)
    _need_data(stats)
    if method is RangeMethod.MIN_MAX:
        return (float(stats.min), float(stats.max))
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
