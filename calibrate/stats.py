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

``min`` and ``max`` are the exact smallest and largest values; a zero is kept as ``+0.0``
(which zero a reduction returns depends on its order), so they too are identical for any
sharding. NaN or Inf in an update raises MaceqError naming the tensor.

Two paths, one result
---------------------
float32 data (every activation onnxruntime returns) is folded in by one compiled loop
(numba, no fast-math; :func:`update_path` says which path an array takes). It reads each value
once, in blocks of ``_BLOCK``: it keeps the running min and max of the values' sortable integer
keys (the float32 bits with the magnitude bits flipped for negative values: integer order is
float order with ``-0.0 < +0.0``, every NaN or Inf lies outside the keys of the finite values,
and integer min/max vectorise), computes each bin index ``floor(float64(x) * 2**-e) - base``
(the product is exact for every float32 and every ``e`` the grid rule gives, so this is the
same integer as the numpy path's), and counts it on the current grid into four interleaved
sub-histograms (runs of one value, like a ReLU's zeros, then do not serialise on one counter).
The counts are added when the update's min and max lie inside the running range: the grid is
then unchanged, so they are the counts the grid rule asks for. Otherwise (the range widens,
or the tensor was empty) the grid is re-computed from the new range and a second loop counts
the values on it. Other dtypes, and every array when numba is missing or ``MACEQ_NO_JIT=1``,
take :meth:`TensorStats.update_numpy`, the readable reference (min and max by numpy, then bin
indices in chunks); tests/test_calibrate.py requires both to agree bit for bit on adversarial
data.
"""
from __future__ import annotations

import math
import struct
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

from maceq.errors import MaceqError
from maceq.runtime.kernels.jit import available as jit_available

try:  # numba is a declared dependency; the numpy path stays as the fallback
    from numba import njit
except ImportError:  # pragma: no cover - exercised only without numba
    njit = None

__all__ = ["DEFAULT_BINS", "MIN_EXP", "TensorStats", "StatsCollector", "update_path"]

DEFAULT_BINS = 2048
MIN_EXP = -160
_INDEX_BITS = 52
_CHUNK = 1 << 20  # elements binned at a time: bounds the float64/int64 temporaries
_BLOCK = 1024  # elements of one block of the compiled loop (its bin indices stay in L1)
_RANGE, _COUNT, _BOTH = 1, 2, 3  # what one call of the compiled loop does (bit 0: min/max, bit 1: count)
_KEY_MASK = 0x7FFFFFFF
_F32, _I32 = struct.Struct("<f"), struct.Struct("<i")


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


def update_path(x: np.ndarray) -> str:
    """``"compiled"`` when :meth:`TensorStats.update` folds ``x`` in by the compiled loop, else
    ``"numpy"`` (the reference path; see the module docstring)."""
    a = np.asarray(x)
    return "compiled" if a.dtype == np.float32 and njit is not None and jit_available() else "numpy"


def _key(value: float, *, up: bool) -> int:
    """The sortable int32 key (module docstring) of the float32 nearest ``value`` on the side
    ``up`` (the smallest float32 >= value) or not (the largest <= value): a float32 ``x`` has
    ``x >= value`` iff its key >= ``_key(value, up=True)``, and ``x <= value`` iff its key <=
    ``_key(value, up=False)``. Values beyond float32's range give the keys of the infinities."""
    if value == 0:  # both zeros are >= 0 and <= 0
        return -1 if up else 0
    try:
        b = _I32.unpack(_F32.pack(value))[0]  # rounded to nearest
    except OverflowError:
        b = _I32.unpack(_F32.pack(math.copysign(math.inf, value)))[0]
    key = b ^ _KEY_MASK if b < 0 else b
    nearest = _F32.unpack(_I32.pack(b))[0]
    # consecutive keys are consecutive float32 values (the rounded value keeps value's sign, so
    # the step from a zero goes to the smallest subnormal of that sign)
    if up and nearest < value:
        key += 1
    elif not up and nearest > value:
        key -= 1
    return key


def _unkey(key: int) -> float:
    """The float32 value (as a Python float) whose sortable key is ``key``."""
    return _F32.unpack(_I32.pack(key ^ _KEY_MASK if key < 0 else key))[0]


if njit is not None:
    _jit = njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")

    @_jit
    def _fold(v, bits, scale, fbase, mode, key_lo, key_hi, counts):
        """One pass over the float32 values ``v`` (``bits``: the same memory as int32), block by block.

        mode bit 0: the min and max of the values' sortable keys. Bit 1: each value's bin
        ``floor(float64(x) * scale) - fbase`` on the grid ``scale = 2**-e``, ``fbase = base``,
        counted in four sub-histograms with one slot below and one above the ``n`` bins (NaN
        counts below, values outside the window in those slots). The counts are added to
        ``counts`` when mode is count only, or when the keys lie in ``[key_lo, key_hi]``.
        Returns (min key, max key, values outside the window, whether the counts were added).
        """
        n = counts.shape[0]
        m = v.shape[0]
        fn = np.float64(n)
        sub = np.zeros((4, n + 2), np.int64)
        idx = np.empty(_BLOCK, np.uint64)  # unsigned: no negative-index wraparound in the scatter
        kmin, kmax = np.int32(2147483647), np.int32(-2147483648)
        mask = np.int32(_KEY_MASK)
        for start in range(0, m, _BLOCK):
            stop = min(m, start + _BLOCK)
            size = stop - start
            if mode & 1:
                bb = bits[start:stop]
                for i in range(size):
                    b = bb[i]
                    k = b ^ ((b >> np.int32(31)) & mask)
                    kmin = min(kmin, k)
                    kmax = max(kmax, k)
            if mode & 2:
                blk = v[start:stop]
                for i in range(size):
                    d = np.floor(np.float64(blk[i]) * scale) - fbase
                    d = d if d > -1.0 else -1.0  # below the window, or NaN
                    d = d if d < fn else fn
                    idx[i] = np.uint64(np.int64(d) + 1)
                q = size // 4
                for i in range(q):
                    sub[0, idx[4 * i]] += 1
                    sub[1, idx[4 * i + 1]] += 1
                    sub[2, idx[4 * i + 2]] += 1
                    sub[3, idx[4 * i + 3]] += 1
                for i in range(4 * q, size):
                    sub[0, idx[i]] += 1
        outside = 0
        for j in range(4):
            outside += sub[j, 0] + sub[j, n + 1]
        add = mode == 2 or (mode == 3 and kmin >= key_lo and kmax <= key_hi)
        if add:
            for k in range(n):
                counts[k] += sub[0, k + 1] + sub[1, k + 1] + sub[2, k + 1] + sub[3, k + 1]
        return kmin, kmax, outside, add


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
        new_min = min(self.min, lo) + 0.0  # + 0.0: a zero is kept as +0.0 (module docstring)
        new_max = max(self.max, hi) + 0.0
        exp = grid_exponent(new_min, new_max, self.num_bins)
        base = math.floor(math.ldexp(new_min, -exp))
        if exp != self.exp or base != self.base:
            self.counts = self._regridded(exp, base)
        self.min, self.max, self.exp, self.base = new_min, new_max, exp, base

    # -- updates -----------------------------------------------------------------
    def update(self, x: np.ndarray) -> "TensorStats":
        """Add all values of ``x`` (any shape, real dtype); returns self. float32 data takes the
        compiled loop, anything else :meth:`update_numpy` (module docstring: same result)."""
        a = np.asarray(x)
        if update_path(a) == "compiled":
            return self._update_compiled(a)
        return self.update_numpy(a)

    def _check(self, a: np.ndarray) -> bool:
        """False for an empty array; MaceqError for one that is not real-valued."""
        if a.dtype.kind not in "fiub":
            raise MaceqError(f"tensor '{self.name}': cannot collect statistics of dtype {a.dtype}")
        return a.size > 0

    def _nonfinite(self, a: np.ndarray) -> MaceqError:
        n_nan = int(np.isnan(a).sum()) if a.dtype.kind == "f" else 0
        n_inf = int(np.isinf(a).sum()) if a.dtype.kind == "f" else 0
        return MaceqError(f"tensor '{self.name}': {n_nan} NaN and {n_inf} Inf value(s) in calibration data")

    def _update_compiled(self, a: np.ndarray) -> "TensorStats":
        """float32 data by the compiled loop: one pass while the range holds, two when it widens."""
        if not self._check(a):
            return self
        flat = np.ascontiguousarray(a).reshape(-1)
        if flat.flags.writeable:  # one compiled specialisation: onnxruntime's views are read-only
            flat = flat.view()
            flat.flags.writeable = False
        bits = flat.view(np.int32)
        if self.exp is None:
            kmin, kmax, _, _ = _fold(flat, bits, 1.0, 0.0, _RANGE, 0, 0, self.counts[:0])
        else:
            kmin, kmax, _, added = _fold(flat, bits, math.ldexp(1.0, -self.exp), float(self.base), _BOTH,
                                         _key(self.min, up=True), _key(self.max, up=False), self.counts)
            if added:
                self.count += int(flat.size)
                return self
        lo, hi = _unkey(int(kmin)), _unkey(int(kmax))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise self._nonfinite(a)
        self._widen(lo, hi)
        _, _, outside, _ = _fold(flat, bits, math.ldexp(1.0, -self.exp), float(self.base), _COUNT, 0, 0,
                                 self.counts)
        assert outside == 0, "a value outside the grid's window"
        self.count += int(flat.size)
        return self

    def update_numpy(self, x: np.ndarray) -> "TensorStats":
        """The reference path of :meth:`update` (any real dtype): numpy's min and max, then the
        bin indices in chunks."""
        a = np.asarray(x)
        if not self._check(a):
            return self
        lo = float(a.min())
        hi = float(a.max())
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise self._nonfinite(a)
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
        out.count, out.min, out.max, out.exp, out.base, out.counts = count, lo + 0.0, hi + 0.0, exp, base, counts
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
