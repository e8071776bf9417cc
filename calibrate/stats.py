"""Streaming, mergeable per-tensor statistics in constant memory.

:class:`TensorStats` keeps the exact count, min and max of everything it has
seen, and a histogram of ``num_bins`` int64 counts on a power-of-two grid.

The histogram rule
------------------
Bins live on the grid of width ``2**e`` anchored at 0: absolute bin ``k``
holds the values ``x`` with ``k * 2**e <= x < (k + 1) * 2**e``, i.e.
``k = floor(x / 2**e)``. The stored window is bins ``base .. base+num_bins-1``.

* ``e`` is a function of the running ``(min, max)`` only: the smallest integer
  ``e >= MIN_EXP`` such that
  ``floor(max / 2**e) - floor(min / 2**e) <= num_bins - 1`` (all data fits the
  window) and ``max(|min|, |max|) < 2**(e + 52)`` (bin indices are exact
  integers in float64 and int64).
* ``base = floor(min / 2**e)``.
* When new data widens ``(min, max)``, ``e`` can only grow (both conditions are
  monotone in the range), and the old counts move to the coarser grid by
  ``k -> k >> (e_new - e_old)`` (an arithmetic shift is ``floor(k / 2**d)``, and
  ``floor(floor(x / 2**a) / 2**d) == floor(x / 2**(a + d))``). ``base`` moves
  with ``min``.

So at any moment the histogram equals the one computed in a single pass over
all the data seen, on the grid that the global ``(min, max)`` fixes: updates
in any order, and any sharding followed by :meth:`TensorStats.merge` in any
order, give identical counts, ``e`` and ``base``. Bin indices are computed as
``floor(ldexp(float64(x), -e))``, exact for float32 data (and for float64 data
in the normal range); ``e >= MIN_EXP = -160`` keeps subnormal float32 values
exact too. At least half the bins are in use once the data spans more than a
couple of bins (the smallest ``e`` is taken), so the resolution is within a
factor two of ``(max - min) / num_bins``.

NaN or Inf in an update raises MaceqError naming the tensor.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

from maceq.errors import MaceqError

__all__ = ["DEFAULT_BINS", "MIN_EXP", "TensorStats", "StatsCollector"]

DEFAULT_BINS = 2048
MIN_EXP = -160
_INDEX_BITS = 52
_CHUNK = 1 << 20  # elements binned at a time: bounds the float64/int64 temporaries


def grid_exponent(lo: float, hi: float, num_bins: int) -> int:
    """The ``e`` of the module docstring for a running range ``[lo, hi]``."""
    amax = max(abs(lo), abs(hi))
    e = MIN_EXP
    if amax > 0:
        # amax = m * 2**k with 0.5 <= m < 1, so amax < 2**(e + 52) iff e >= k - 52.
        e = max(e, math.frexp(amax)[1] - _INDEX_BITS)
    span = hi - lo
    if span > 0:
        # Any valid e has 2**e > span / num_bins >= 2**(k - 1), so e >= k; start one below.
        e = max(e, math.frexp(span / num_bins)[1] - 1)
    while math.floor(math.ldexp(hi, -e)) - math.floor(math.ldexp(lo, -e)) > num_bins - 1:
        e += 1
    return e


class TensorStats:
    """Count, exact min/max and a mergeable histogram of one tensor's values."""

    __slots__ = ("name", "num_bins", "count", "min", "max", "exp", "base", "counts")

    def __init__(self, name: str = "", *, num_bins: int = DEFAULT_BINS) -> None:
        if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 2:
            raise MaceqError(f"tensor '{name}': num_bins must be an int >= 2, got {num_bins!r}")
        self.name = name
        self.num_bins = num_bins
        self.count = 0
        self.min = math.inf
        self.max = -math.inf
        self.exp: int | None = None
        self.base = 0
        self.counts = np.zeros(num_bins, dtype=np.int64)

    # -- grid --------------------------------------------------------------------
    @property
    def empty(self) -> bool:
        return self.count == 0

    @property
    def bin_width(self) -> float:
        """``2**e`` (0.0 while empty)."""
        return 0.0 if self.exp is None else math.ldexp(1.0, self.exp)

    def edges(self) -> np.ndarray:
        """The num_bins + 1 bin edges ``(base + i) * 2**e`` (exact in float64)."""
        if self.exp is None:
            raise MaceqError(f"tensor '{self.name}': no data collected")
        return np.ldexp(np.arange(self.base, self.base + self.num_bins + 1, dtype=np.float64), self.exp)

    def _regridded(self, exp: int, base: int) -> np.ndarray:
        """This histogram's counts on the coarser-or-equal grid (exp, base)."""
        out = np.zeros(self.num_bins, dtype=np.int64)
        if self.exp is None:
            return out
        shift = exp - self.exp
        assert shift >= 0
        nz = np.flatnonzero(self.counts)
        # Arithmetic shift = floor(k / 2**shift). |k| < 2**52, so a shift of 63
        # already gives the limit (0 or -1); larger shifts are undefined in C.
        k = (nz.astype(np.int64) + self.base) >> min(shift, 63)
        idx = k - base
        assert idx.size == 0 or (idx.min() >= 0 and idx.max() < self.num_bins)
        np.add.at(out, idx, self.counts[nz])
        return out

    def _widen(self, lo: float, hi: float) -> None:
        new_min = min(self.min, lo)
        new_max = max(self.max, hi)
        exp = grid_exponent(new_min, new_max, self.num_bins)
        base = math.floor(math.ldexp(new_min, -exp))
        if exp != self.exp or base != self.base:
            self.counts = self._regridded(exp, base)
        self.min, self.max, self.exp, self.base = new_min, new_max, exp, base

    # -- updates -----------------------------------------------------------------
    def update(self, x: np.ndarray) -> "TensorStats":
        """Add all values of ``x`` (any shape, real dtype); returns self."""
        a = np.asarray(x)
        if a.dtype.kind not in "fiub":
            raise MaceqError(f"tensor '{self.name}': cannot collect statistics of dtype {a.dtype}")
        if a.size == 0:
            return self
        lo = float(a.min())
        hi = float(a.max())
        if not (math.isfinite(lo) and math.isfinite(hi)):
            n_nan = int(np.isnan(a).sum()) if a.dtype.kind == "f" else 0
            n_inf = int(np.isinf(a).sum()) if a.dtype.kind == "f" else 0
            raise MaceqError(
                f"tensor '{self.name}': {n_nan} NaN and {n_inf} Inf value(s) in calibration data"
            )
        self._widen(lo, hi)
        flat = a.reshape(-1)
        # float32 data with -126 <= e <= 0: x * 2**-e is exact in float32 (a
        # power-of-two scale-up of a float32 cannot round: no overflow since
        # |x| * 2**-e < 2**52, and a subnormal x stays a multiple of 2**-149),
        # so floor() of it is the exact bin. Otherwise go through float64,
        # exact for every float32 (|e| <= 160 keeps results normal).
        fast = a.dtype == np.float32 and -126 <= self.exp <= 0
        scale32 = np.float32(math.ldexp(1.0, -self.exp)) if fast else None
        for start in range(0, flat.size, _CHUNK):
            chunk = flat[start:start + _CHUNK]
            if fast:
                y = chunk * scale32
            else:
                y = np.ldexp(chunk.astype(np.float64), -self.exp)
            np.floor(y, out=y)
            k = y.astype(np.int64)
            k -= self.base
            self.counts += np.bincount(k, minlength=self.num_bins)
        self.count += int(a.size)
        return self

    def copy(self) -> "TensorStats":
        out = TensorStats(self.name, num_bins=self.num_bins)
        out.count, out.min, out.max, out.exp, out.base = self.count, self.min, self.max, self.exp, self.base
        out.counts = self.counts.copy()
        return out

    def merge(self, other: "TensorStats") -> "TensorStats":
        """A new TensorStats equal to one fed with both inputs' data (see the module docstring)."""
        if not isinstance(other, TensorStats):
            raise TypeError("can only merge TensorStats")
        if other.num_bins != self.num_bins:
            raise MaceqError(
                f"tensor '{self.name}': cannot merge histograms of {self.num_bins} and {other.num_bins} bins"
            )
        if other.empty:
            return self.copy()
        if self.empty:
            out = other.copy()
            out.name = self.name or other.name
            return out
        out = self.copy()
        out._widen(other.min, other.max)
        out.counts += other._regridded(out.exp, out.base)
        out.count += other.count
        return out

    # -- (de)serialisation ---------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (counts as a list of ints); ``from_dict`` inverts it exactly."""
        empty = self.empty
        return {
            "name": self.name,
            "num_bins": self.num_bins,
            "count": self.count,
            "min": None if empty else self.min,
            "max": None if empty else self.max,
            "exp": self.exp,
            "base": self.base,
            "counts": [int(c) for c in self.counts],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TensorStats":
        keys = {"name", "num_bins", "count", "min", "max", "exp", "base", "counts"}
        for key in d:
            if key not in keys:
                raise MaceqError(f"tensor stats: unknown key '{key}'")
        for key in keys:
            if key not in d:
                raise MaceqError(f"tensor stats: missing key '{key}'")
        name = str(d["name"])
        out = cls(name, num_bins=d["num_bins"])
        counts = np.asarray(d["counts"], dtype=np.int64)
        if counts.shape != (out.num_bins,) or (counts < 0).any():
            raise MaceqError(f"tensor stats '{name}': key 'counts' must hold {out.num_bins} non-negative ints")
        count = int(d["count"])
        if count != int(counts.sum()):
            raise MaceqError(f"tensor stats '{name}': key 'count' {count} != sum of counts {int(counts.sum())}")
        if count == 0:
            return out
        lo, hi, exp, base = float(d["min"]), float(d["max"]), int(d["exp"]), int(d["base"])
        if not (lo <= hi) or exp != grid_exponent(lo, hi, out.num_bins) or base != math.floor(math.ldexp(lo, -exp)):
            raise MaceqError(f"tensor stats '{name}': keys 'min', 'max', 'exp', 'base' disagree with the grid rule")
        out.count, out.min, out.max, out.exp, out.base, out.counts = count, lo, hi, exp, base, counts
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorStats):
            return NotImplemented
        return (
            self.num_bins == other.num_bins and self.count == other.count
            and (self.empty or (self.min == other.min and self.max == other.max
                                and self.exp == other.exp and self.base == other.base))
            and np.array_equal(self.counts, other.counts)
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"TensorStats({self.name!r}, count={self.count}, min={self.min}, max={self.max}, "
                f"bin_width={self.bin_width})")


class StatsCollector:
    """TensorStats keyed by tensor name."""

    def __init__(self, names: Iterable[str] = (), *, num_bins: int = DEFAULT_BINS) -> None:
        self.num_bins = num_bins
        self.stats: dict[str, TensorStats] = {}
        for n in names:
            self.stats[n] = TensorStats(n, num_bins=num_bins)

    def update(self, arrays: Mapping[str, np.ndarray]) -> None:
        for name, arr in arrays.items():
            st = self.stats.get(name)
            if st is None:
                st = self.stats[name] = TensorStats(name, num_bins=self.num_bins)
            st.update(arr)

    def merge(self, other: "StatsCollector") -> "StatsCollector":
        """A new collector: the union of names, shared names merged."""
        if other.num_bins != self.num_bins:
            raise MaceqError(f"cannot merge statistics of {self.num_bins} and {other.num_bins} bins")
        out = StatsCollector(num_bins=self.num_bins)
        for name in list(self.stats) + [n for n in other.stats if n not in self.stats]:
            a, b = self.stats.get(name), other.stats.get(name)
            if a is None:
                out.stats[name] = b.copy()  # type: ignore[union-attr]
            elif b is None:
                out.stats[name] = a.copy()
            else:
                out.stats[name] = a.merge(b)
        return out

    def __getitem__(self, name: str) -> TensorStats:
        try:
            return self.stats[name]
        except KeyError:
            raise MaceqError(f"no statistics for tensor '{name}'") from None

    def __contains__(self, name: object) -> bool:
        return name in self.stats

    def __iter__(self) -> Iterator[str]:
        return iter(self.stats)

    def __len__(self) -> int:
        return len(self.stats)

    def to_dict(self) -> dict[str, Any]:
        return {"num_bins": self.num_bins, "tensors": [s.to_dict() for s in self.stats.values()]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "StatsCollector":
        for key in d:
            if key not in ("num_bins", "tensors"):
                raise MaceqError(f"statistics: unknown key '{key}'")
        out = cls(num_bins=int(d.get("num_bins", DEFAULT_BINS)))
        for td in d.get("tensors", []):
            st = TensorStats.from_dict(td)
            if st.num_bins != out.num_bins:
                raise MaceqError(f"tensor stats '{st.name}': {st.num_bins} bins, collector has {out.num_bins}")
            if st.name in out.stats:
                raise MaceqError(f"statistics: tensor '{st.name}' appears twice")
            out.stats[st.name] = st
        return out
