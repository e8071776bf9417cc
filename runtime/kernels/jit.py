"""Compiled (numba) loops for the cpu fast paths: one pass where numpy needs several.

These loops run the *same* float operations, in the same order per element, as the
numpy fast paths of :mod:`maceq.runtime.kernels.conv` ("Fast paths", arguments 1-6
there), so the exactness arguments carry over unchanged:

- ``requant_store``: argument 3 then 4 and 5 for a block of G (or argument 4 and 5 for a
  block of y from the folded GEMM): ``y = G*scale + offset`` in float64, the correction
  ``y -= step`` where ``y < y_theta``, ``floor`` (only needed when ``lo < 0``), the clamp,
  and the store, which truncates toward zero (== floor on the clamped value).
  Numba compiles without fast-math, so no operation is reassociated; whether LLVM
  contracts ``G*scale + offset`` into an FMA does not matter: under bound B both the
  product and the sum are exact, so the fused result is the same exact value, and
  without bound B the fused operation is still correctly rounded, hence monotone in G,
  which is all the saturation argument uses.
- ``depthwise_accumulate``: G of a depthwise convolution with channel multiplier 1,
  accumulated tap by tap in the dtype of the centered input (float32 while X*L1 < 2^24,
  else float64; every partial sum is then an integer of magnitude <= X*L1, exact in
  any order, argument 3). Taps that fall into the zero padding are skipped, which adds
  exactly the zero they would contribute. Then ``requant_store`` per output row.

``available()`` says whether numba imported; the plans fall back to their numpy paths
otherwise, or when ``MACEQ_NO_JIT=1`` is set (tests run both and compare each with
the ``*_ref`` kernels).
"""
from __future__ import annotations

import math
import os

import numpy as np

try:  # numba is a declared dependency; the numpy paths stay as the fallback
    from numba import njit
except ImportError:  # pragma: no cover - exercised only without numba
    njit = None

__all__ = ["available", "requant_store", "depthwise_fixed"]


def available() -> bool:
    """True when the compiled loops can run (numba present and MACEQ_NO_JIT unset)."""
    return njit is not None and os.environ.get("MACEQ_NO_JIT", "") in ("", "0")


if njit is not None:
    # Single-threaded on purpose: numba's thread pool next to OpenBLAS's threads oversubscribes
    # the cores, and on a busy machine that was measured 20x slower (bench/speed.py).
    _jit = njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")

    @_jit
    def _requant_row(g, scale, offset, y_theta, step, lo, hi, mode, out):
        """One row: mode bit 0 = apply y = g*scale + offset, bit 1 = correction, bit 2 = floor."""
        n = g.shape[0]
        affine, correct, floor = (mode & 1) != 0, (mode & 2) != 0, (mode & 4) != 0
        for c in range(n):
            y = np.float64(g[c])
            if affine:
                y = y * scale[c] + offset[c]
            if correct:
                if y < y_theta[c]:
                    y = y - step[c]
            if floor:
                y = math.floor(y)
            y = min(max(y, lo), hi)
            out[c] = np.int32(y)

    @_jit
    def _requant_rows(g, scale, offset, y_theta, step, lo, hi, mode, out):
        for r in range(g.shape[0]):
            _requant_row(g[r], scale, offset, y_theta, step, lo, hi, mode, out[r])

    @_jit
    def _depthwise(xc, w, sh, sw, dh, dw, top, left, oh, ow, scale, offset, y_theta, step, lo, hi, mode, out):
        """xc: centered input [N, H, W, C]; w: offset filter [KH, KW, C] in xc's dtype; out [N, OH, OW, C]."""
        n_img, h, wd, c = xc.shape
        kh, kw = w.shape[0], w.shape[1]
        for r in range(n_img * oh):
            n, oy = r // oh, r % oh
            acc = np.zeros((ow, c), xc.dtype)
            for ky in range(kh):
                iy = oy * sh - top + ky * dh
                if iy < 0 or iy >= h:
                    continue  # a padding row: adds 0
                xrow = xc[n, iy]
                for kx in range(kw):
                    d = left - kx * dw  # ix = ox*sw - d
                    ox0 = max(0, -((-d) // sw))  # first ox with ix >= 0
                    ox1 = min(ow, (wd - 1 + d) // sw + 1)  # one past the last ox with ix < W
                    wk = w[ky, kx]
                    for ox in range(ox0, ox1):
                        a = acc[ox]
                        xr = xrow[ox * sw - d]
                        for ch in range(c):
                            a[ch] += xr[ch] * wk[ch]
            orow = out[n, oy]
            for ox in range(ow):
                _requant_row(acc[ox], scale, offset, y_theta, step, lo, hi, mode, orow[ox])


def _mode(*, affine: bool, correct: bool, lo: int) -> int:
    return (1 if affine else 0) | (2 if correct else 0) | (4 if lo < 0 else 0)


def requant_store(g: np.ndarray, rq, dst: np.ndarray, *, affine: bool, channels: slice = slice(None)) -> None:
    """dst[r, c] = clamp(floor(y)) with y = g*scale + offset (``affine``) or y = g, per channel c.

    ``g``: [rows, channels] float32/float64 block; ``rq``: the plan's _ExactRequant, whose per-channel
    float64 ``scale, offset, y_theta, step`` are taken at ``channels``; ``dst``: [rows, channels]
    integer view that receives the codes.
    """
    _requant_rows(g, rq.scale[channels], rq.offset[channels], rq.y_theta[channels], rq.step[channels],
                  float(rq.lo), float(rq.hi), _mode(affine=affine, correct=rq.correct, lo=rq.lo), dst)


def depthwise_fixed(xc: np.ndarray, w: np.ndarray, g, rq, out: np.ndarray) -> None:
    """Depthwise convolution (channel multiplier 1) of the centered input ``xc`` [N, H, W, C] with
    the offset filter ``w`` [KH, KW, C] (both float32, or both float64), geometry ``g`` (strides,
    dilations, pads, output size), requantized by ``rq`` into ``out`` [N, OH, OW, C]."""
    _depthwise(xc, w, g.sh, g.sw, g.dh, g.dw, g.top, g.left, g.oh, g.ow, rq.scale, rq.offset, rq.y_theta,
               rq.step, float(rq.lo), float(rq.hi), _mode(affine=True, correct=rq.correct, lo=rq.lo), out)
