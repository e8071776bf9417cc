"""Compiled (numba) loops for the fast paths: one pass where numpy needs several.

The gpu and dsp devices have two (the last two items below); the rest are the cpu's.

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
- ``pointwise_conv`` / ``im2col_conv`` (Conv2D, group 1, G path): per block of output rows,
  the centered input rows x - zp (or their im2col rows; taps in the padding are 0, as padding
  with zp gives), G = A @ W by numpy's own BLAS called from the compiled code
  (runtime/kernels/blas.py; exact in any summation order, argument 3), then ``requant_store``'s
  steps on G. The blocks run on numba's threads (``prange``); every output element belongs to
  one block, so the result does not depend on the number of threads.
- ``depthwise_fixed``: G of a depthwise convolution with channel multiplier 1, accumulated tap
  by tap in float32 while X*L1 < 2^24, else float64 (every partial sum is then an integer of
  magnitude <= X*L1, exact in any order, argument 3), from a ring of centered, zero-padded
  input rows (each centred once per block); then the requantization per output row. Blocks of
  output rows run on numba's threads.
- ``quantize_neon`` / ``find_range`` / ``lut_pairs`` / ``lut_pairs_range``: the input Quantize's float32
  steps and MACE's FindMinMax loop, and the Eltwise table look-ups (the gpu's and nnlib's adds too, the
  latter with the min and max of a second table), one pass each. Float32 operations
  are not contracted into FMAs without fast-math (tests/test_quantize_kernel.py has crafted
  points where an FMA would differ and requires 0 mismatches on this path).
- ``gpu_depthwise`` / ``gpu_requant`` / ``gpu_pointwise``: the gpu's depthwise convolution (multiplier 1)
  where every tap sum is an exact float32 integer and the bias keeps it below 2^24 (runtime/kernels/gpu.py
  ``sum_path``), with its requantization; that requantization alone on a GEMM's sums; and the pointwise
  convolution, GEMM and requantization per block of rows (float32 sums, or float32 chunks summed in float64). The numpy
  path's float32 steps per element (tests/test_gpu_opencl.py compares them with the numpy path, the
  scalar reference and crafted points where an FMA would differ).
- ``im2col_rows``: the im2col rows of an integer input (conv.py ``im2col_rows``), a plain copy per output row on
  numba's threads, for the convolutions that run on them (every device's, past 1x1); ``pad4``: the uint8 Pad's
  fill and copy in one pass on numba's threads; ``nchw_to_nhwc``: a float input's NCHW -> NHWC copy (one output
  row per iteration), for the graph inputs and the report's float taps; ``hw_sums``: Reduce MEAN's uint32 sums over
  H and W (a global average pool), one pass; ``fc_sums``: a uint8 FullyConnected's G in int32 (the
  offset weights read once per batch, channels on numba's threads): the cpu's, and the gpu's and nnlib's SuperFC
  sums for 1-3 rows, where a 4-row integer tile would compute rows of zeros.
- ``d32_requant`` / ``hvx_quantize`` / ``dsp_dw_sums`` / ``dsp_junk_sums``: nnlib's d32 requantization, HVX
  quantizer, depthwise sums and the sums at the depthwise kernel's discarded columns, integer steps only;
  ``dsp_pointwise_sums``: the supernode's pointwise sums by float32 GEMMs whose partial sums are exact
  integers (tests/test_dsp_fills.py).

``available()`` says whether numba imported; the plans fall back to their numpy paths
otherwise, or when ``MACEQ_NO_JIT=1`` is set (tests run both and compare each with
the ``*_ref`` kernels). ``gemm_available()`` also requires the BLAS binding; without it the
convolutions keep the numpy GEMM and the compiled requantization.

Loop-writing rules that keep LLVM's vectorizer working (each measured 3-5x): no branch on a
runtime flag inside an inner loop (flags pick one of several loops up front), index only with
counters that start at 0 (an index like ``base + i`` may be negative, so numba adds a
wraparound select per element: slice first, then index the slice), and keep every float
operand of an expression in one type.
"""
from __future__ import annotations

import os

import numpy as np

from maceq.runtime import threads
from maceq.runtime.kernels import blas, simd

try:  # numba is a declared dependency; the numpy paths stay as the fallback
    from numba import njit, prange
except ImportError:  # pragma: no cover - exercised only without numba
    njit = None

__all__ = ["available", "gemm_available", "requant_store", "depthwise_fixed", "pointwise_conv", "im2col_conv",
           "lut_pairs", "find_range", "quantize_neon", "d32_requant", "gpu_depthwise", "gpu_requant",
           "hvx_quantize", "dsp_dw_sums", "dsp_dw_codes", "dsp_junk_sums", "dsp_pointwise_sums", "gpu_pointwise",
           "lut_pairs_range", "im2col_rows", "pad4", "nchw_to_nhwc", "hw_sums", "fc_sums", "DepthwiseCall"]


def available() -> bool:
    """True when the compiled loops can run (numba present and MACEQ_NO_JIT unset): the environment read once per
    model run (threads.run_memo), on every call outside one."""
    memo = threads.run_memo()
    if memo is None:
        return njit is not None and os.environ.get("MACEQ_NO_JIT", "") in ("", "0")
    hit = memo.get("jit")
    if hit is None:
        hit = memo["jit"] = njit is not None and os.environ.get("MACEQ_NO_JIT", "") in ("", "0")
    return hit


def load_target() -> None:
    """Load numba's CPU target (its typing and lowering registries, which import numba's numpy support and, for
    its BLAS check, scipy) without compiling or loading any kernel: about half a second of a process's first
    kernel call. The local workers' forkserver calls it, so that each worker forked from it starts with the target
    loaded. No thread pool starts here (loading a parallel kernel would start GNU OpenMP's, which does not survive
    a fork)."""
    if njit is not None:
        from numba.core.registry import cpu_target

        cpu_target.target_context.refresh()


if njit is not None:
    _jit = njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
    # The convolutions run their blocks on numba's thread pool (runtime/threads.py sets its size).
    # BLAS is single-threaded meanwhile (blas.single_threaded): two thread pools spinning on the
    # same cores were measured 20x slower on a busy machine.
    _pjit = njit(cache=True, nogil=True, boundscheck=False, error_model="numpy", parallel=True)

    @njit(cache=True, nogil=True, boundscheck=False, error_model="numpy", fastmath={"contract"})
    def _requant_rows(g, scale, offset, y_theta, step, lo, hi, mode, out):
        """out[r, c] = clamp(floor(y)), y = g[r, c]*scale[c] + offset[c] (mode bit 0) or g[r, c],
        less step[c] where y < y_theta[c] (y_theta is -inf where no channel needs it; mode bit 1
        is then clear and the compare is skipped), floor only when mode bit 2 (lo < 0): for
        lo >= 0 the store truncates the clamped value, which is the floor of y. The multiply-add may compile to one
        FMA ("contract", 8% faster): conv.py's argument 3 holds for one correctly rounded operation as for two."""
        rows, n = g.shape
        affine, correct, floor = (mode & 1) != 0, (mode & 2) != 0, (mode & 4) != 0
        for r in range(rows):
            gr, o = g[r], out[r]
            if affine and correct and not floor:  # the common case: uint8 outputs
                for c in range(n):
                    y = np.float64(gr[c]) * scale[c] + offset[c]
                    y = y - step[c] if y < y_theta[c] else y
                    o[c] = np.int32(min(max(y, lo), hi))
            elif affine and not correct and not floor:
                for c in range(n):
                    y = np.float64(gr[c]) * scale[c] + offset[c]
                    o[c] = np.int32(min(max(y, lo), hi))
            else:
                for c in range(n):
                    y = np.float64(gr[c])
                    if affine:
                        y = y * scale[c] + offset[c]
                    if correct:
                        if y < y_theta[c]:
                            y = y - step[c]
                    if floor:
                        y = np.floor(y)
                    o[c] = np.int32(min(max(y, lo), hi))

    @_jit
    def _dw_centre_row(x, n, iy, left, z, dst):
        """dst [WP, C] = padded input row iy of image n, centred (x - z) and zero where it is padding."""
        h, w, c = x.shape[1], x.shape[2], x.shape[3]
        if iy < 0 or iy >= h:
            dst[:, :] = 0
            return
        xr = x[n, iy]
        for j in range(dst.shape[0]):
            ix, d = j - left, dst[j]
            if ix < 0 or ix >= w:
                for ch in range(c):
                    d[ch] = 0
            else:
                src = xr[ix]
                for ch in range(c):
                    d[ch] = d.dtype.type(src[ch]) - z

    @_jit
    def _dw_ring_sums(ring, first, span, wk, sw, dh, dw, acc):
        """acc [OW, C] = the taps' sum of one output row, whose padded input rows first, first + dh, ... sit in
        ``ring`` at their index modulo ``span``; a 3x3 kernel's nine taps in one pass per output column."""
        kh, kw, c = wk.shape
        ow = acc.shape[0]
        if kh == 3 and kw == 3:
            r0, r1, r2 = ring[first % span], ring[(first + dh) % span], ring[(first + 2 * dh) % span]
            # float32: blocks of 8 channels with their weights in registers (runtime/kernels/simd.py)
            done = simd.dw3x3_blocks(r0.reshape(-1), r1.reshape(-1), r2.reshape(-1), sw, dw, wk.reshape(-1),
                                     acc.reshape(-1))
            if done == c:
                return
            w00, w01, w02, w10, w11, w12 = wk[0, 0], wk[0, 1], wk[0, 2], wk[1, 0], wk[1, 1], wk[1, 2]
            w20, w21, w22 = wk[2, 0], wk[2, 1], wk[2, 2]
            for ox in range(ow):
                j, a = ox * sw, acc[ox]
                a00, a01, a02 = r0[j], r0[j + dw], r0[j + 2 * dw]
                a10, a11, a12 = r1[j], r1[j + dw], r1[j + 2 * dw]
                a20, a21, a22 = r2[j], r2[j + dw], r2[j + 2 * dw]
                for ch in range(done, c):
                    a[ch] = (a00[ch] * w00[ch] + a01[ch] * w01[ch] + a02[ch] * w02[ch]
                             + a10[ch] * w10[ch] + a11[ch] * w11[ch] + a12[ch] * w12[ch]
                             + a20[ch] * w20[ch] + a21[ch] * w21[ch] + a22[ch] * w22[ch])
            return
        for ox in range(ow):
            a = acc[ox]
            for ch in range(c):
                a[ch] = 0
            for ky in range(kh):
                row = ring[(first + ky * dh) % span]
                for kx in range(kw):
                    src, wr = row[ox * sw + kx * dw], wk[ky, kx]
                    for ch in range(c):
                        a[ch] += src[ch] * wr[ch]

    @_pjit
    def _depthwise_rows(x, zp, wk, sh, sw, dh, dw, top, left, oh, ow, rows, scale, offset, y_theta, step, lo, hi,
                        mode, out):
        """Depthwise convolution, channel multiplier 1, of x [N, H, W, C] (integer codes, zero point zp,
        padding top/left and whatever the output size implies) with the offset filter ``wk`` [KH, KW, C];
        requantized like _requant_rows with the per-channel vectors [C] into ``out`` [N, OH, OW, C].

        One iteration (one thread) takes ``rows`` output rows of one image, in order. The padded input rows they
        read are centred once each into a ring of (KH - 1)*dh + 1 rows (an output row reads padded rows
        oy*sh + ky*dh; the next one's first row is past this one's first), which stays in L2 where a block's
        whole input did not; then the row's sums (_dw_ring_sums) and its requantization."""
        n_img, c = x.shape[0], x.shape[3]
        kh, kw = wk.shape[0], wk.shape[1]
        span = (kh - 1) * dh + 1
        wp = (ow - 1) * sw + (kw - 1) * dw + 1  # padded columns any tap reads
        per_img = (oh + rows - 1) // rows
        z = wk.dtype.type(zp)
        for it in prange(n_img * per_img):
            n, oy0 = it // per_img, (it % per_img) * rows
            ring = np.empty((span, wp, c), wk.dtype)
            acc = np.empty((ow, c), wk.dtype)
            have = oy0 * sh  # the next padded row to centre
            for oy in range(oy0, min(oh, oy0 + rows)):
                first = oy * sh
                have = max(have, first)
                while have <= first + (kh - 1) * dh:
                    _dw_centre_row(x, n, have - top, left, z, ring[have % span])
                    have += 1
                _dw_ring_sums(ring, first, span, wk, sw, dh, dw, acc)
                _requant_rows(acc, scale, offset, y_theta, step, lo, hi, mode, out[n, oy])

    @_pjit
    def _im2col_rows(x, fill, kh, kw, sh, sw, dh, dw, top, left, oh, ow, out):
        """out[(n*OH + oy)*OW + ox, (i*KW + j)*C + c] = x[n, oy*sh + i*dh - top, ox*sw + j*dw - left, c], ``fill``
        where that lies outside x; one output row of one image per iteration, a copy (no arithmetic)."""
        for it in prange(x.shape[0] * oh):
            _window_rows(x, x.dtype.type(0), fill, kh, kw, sh, sw, dh, dw, top, left, oh, ow, it, 1,
                         out[it * ow:(it + 1) * ow])

    @_pjit
    def _pad4(x, fill, bn, bh, bw, bc, out):
        """out = x placed at (bn, bh, bw, bc) in ``out`` (4-D), ``fill`` elsewhere: one output row (n, y) per
        iteration; without channel padding a row's inside is one run of W*C values."""
        n_in, h, w, c = x.shape
        n_out, h_out, w_out, c_out = out.shape
        for it in prange(n_out * h_out):
            n, y = it // h_out - bn, it % h_out - bh
            dst = out[it // h_out, it % h_out].reshape(-1)
            if n < 0 or n >= n_in or y < 0 or y >= h:
                dst[:] = fill
                continue
            src = x[n, y].reshape(-1)
            lead, inner = bw * c_out, w * c_out
            for q in range(lead):
                dst[q] = fill
            if c_out == c:
                inside = dst[lead:]
                for q in range(inner):
                    inside[q] = src[q]
            else:
                for px in range(w):
                    cell = dst[lead + px * c_out:]
                    xs = src[px * c:]
                    for q in range(c_out):
                        cell[q] = fill
                    for q in range(c):
                        cell[bc + q] = xs[q]
            for q in range(lead + inner, w_out * c_out):
                dst[q] = fill

    @_pjit
    def _nchw_to_nhwc(x, out):
        """out[n, y, q, c] = x[n, c, y, q]: one output row (n, y) per iteration, filled plane by plane."""
        n, c, h, w = x.shape
        for it in prange(n * h):
            b, y = it // h, it % h
            dst = out[b, y].reshape(-1)
            for ch in range(c):
                src, d = x[b, ch, y], dst[ch:]
                for q in range(w):
                    d[q * c] = src[q]

    @_jit
    def _hw_sums(x, out):
        """out[n, c] = the uint32 sum over (h, w) of the uint8 x[n, h, w, c], wrapping modulo 2^32 as a uint32
        accumulator does."""
        n, h, w, c = x.shape
        for b in range(n):
            o = out[b]
            for ch in range(c):
                o[ch] = 0
            for y in range(h):
                for q in range(w):
                    src = x[b, y, q]
                    for ch in range(c):
                        o[ch] += np.uint32(src[ch])

    @_pjit
    def _fc_sums(x, zx, w, wz, out):
        """out[r, c] = sum_j (x[r, j] - zx) * (w[c, j] - wz[c]) in int32, as sum_j xc[r, j] * w[c, j] less
        wz[c] * sum_j xc[r, j] (xc = x - zx): the caller checks |xc|, |w|, |wz|, |w - wz| <= 255 and
        K * 255 * 255 < 2^31, so neither part nor the result leaves int32. The rows are centred once as int16, then
        blocks of 64 output channels run on numba's threads, each channel's weights read once for every row."""
        n, k = x.shape
        o = w.shape[0]
        xc = np.empty((n, k), np.int16)
        xs = np.empty(n, np.int32)
        z = np.int16(zx)
        for r in range(n):
            xr, cr = x[r], xc[r]
            t = np.int32(0)
            for j in range(k):
                cr[j] = np.int16(xr[j]) - z
                t += np.int32(cr[j])
            xs[r] = t
        for t in prange((o + 63) // 64):
            for c in range(t * 64, min(o, t * 64 + 64)):
                wr = w[c]
                for r in range(n):
                    cr = xc[r]
                    acc = np.int32(0)
                    for j in range(k):
                        acc += np.int32(cr[j]) * np.int32(wr[j])
                    out[r, c] = acc - np.int32(wz[c]) * xs[r]

    @_jit
    def _gemm(addr, bits64, m, n, k, a, b, c):
        """c[:m] = a[:m] @ b by the CBLAS GEMM at addr (rows of a and c contiguous)."""
        if bits64:
            blas.call_gemm64(addr, m, n, k, a, a.shape[1], b, n, c, n)
        else:
            blas.call_gemm32(addr, m, n, k, a, a.shape[1], b, n, c, n)

    @_pjit
    def _pointwise(x, zp, w, addr, bits64, block, scale, offset, y_theta, step, lo, hi, mode, out):
        """1x1 stride-1 convolution of x [rows, C] with w [C, O] (offset filter, float32/float64):
        per block of rows (one per thread at a time) the centered rows x - zp, their GEMM G, and G
        requantized into out [rows, O] (argument 3 then 4-5 of conv.py's "Fast paths")."""
        rows, c = x.shape
        o = w.shape[1]
        z = w.dtype.type(zp)
        for b in prange((rows + block - 1) // block):
            r0 = b * block
            m = min(block, rows - r0)
            a = np.empty((m, c), w.dtype)
            for r in range(m):
                ar, xr = a[r], x[r0 + r]
                for j in range(c):
                    ar[j] = w.dtype.type(xr[j]) - z
            g = np.empty((m, o), w.dtype)
            _gemm(addr, bits64, m, o, c, a, w, g)
            _requant_rows(g, scale, offset, y_theta, step, lo, hi, mode, out[r0:r0 + m])

    @_jit
    def _window_rows(x, z, pad, kh, kw, sh, sw, dh, dw, top, left, oh, ow, r0, rows, a):
        """a [rows*OW, KH*KW*C] = the im2col rows of x - z (in a's type) for the output rows r0 .. r0 + rows - 1
        (over images and OH): window order KH, KW, C, ``pad`` where a tap lies in the padding. A window row wholly
        inside x with dilation 1 is one run of KW*C consecutive values in both. Slices indexed from 0 keep numba's
        negative-index checks out of the copies."""
        n_img, h, wd, c = x.shape
        xf, af = x.reshape(-1), a.reshape(-1)
        run = kw * c
        for rr in range(rows):
            n, oy = (r0 + rr) // oh, (r0 + rr) % oh
            for ox in range(ow):
                ix0 = ox * sw - left
                whole = dw == 1 and ix0 >= 0 and ix0 + kw <= wd
                for i in range(kh):
                    iy = oy * sh + i * dh - top
                    dst = af[((rr * ow + ox) * kh + i) * run:]
                    if iy < 0 or iy >= h:
                        for q in range(run):
                            dst[q] = pad
                    elif whole:
                        src = xf[((n * h + iy) * wd + ix0) * c:]
                        for q in range(run):
                            dst[q] = a.dtype.type(src[q]) - z
                    else:
                        for j in range(kw):
                            ix = ix0 + j * dw
                            tap = dst[j * c:]
                            if ix < 0 or ix >= wd:
                                for ch in range(c):
                                    tap[ch] = pad
                            else:
                                src = xf[((n * h + iy) * wd + ix) * c:]
                                for ch in range(c):
                                    tap[ch] = a.dtype.type(src[ch]) - z

    @_pjit
    def _im2col(x, zp, kh, kw, sh, sw, dh, dw, top, left, oh, ow, w, addr, bits64, rows_per, scale, offset,
                y_theta, step, lo, hi, mode, out):
        """Convolution (group 1) of x [N, H, W, C] (integer codes, zero point zp, padding top/left) with
        w [KH*KW*C, O]: per block of ``rows_per`` output rows the im2col rows of x - zp (the filter's OHWI
        row order), their GEMM and the requantization into out [N*OH*OW, O]."""
        k, o = w.shape
        z = w.dtype.type(zp)
        total = x.shape[0] * oh
        for b in prange((total + rows_per - 1) // rows_per):
            r0 = b * rows_per
            rows = min(rows_per, total - r0)
            m = rows * ow
            a = np.empty((m, k), w.dtype)
            _window_rows(x, z, z - z, kh, kw, sh, sw, dh, dw, top, left, oh, ow, r0, rows, a)
            g = np.empty((m, o), w.dtype)
            _gemm(addr, bits64, m, o, k, a, w, g)
            _requant_rows(g, scale, offset, y_theta, step, lo, hi, mode, out[r0 * ow:r0 * ow + m])

    _CHUNK = 1 << 14  # elements per iteration of the elementwise loops below

    @_pjit
    def _lut_pairs(a, b, body, body_table, tail_table, out):
        """out[i] = body_table[a[i]*256 + b[i]] for i < body, else tail_table[...] (flat uint8 arrays). Each chunk
        is two loops over slices indexed from 0 (an index numba knows is not negative takes no wraparound check:
        2.5x faster than one loop choosing the table per element)."""
        n = a.shape[0]
        for k in prange((n + _CHUNK - 1) // _CHUNK):
            i0, i1 = k * _CHUNK, min(n, (k + 1) * _CHUNK)
            b1 = max(i0, min(i1, body))
            for table, j0, j1 in ((body_table, i0, b1), (tail_table, b1, i1)):
                aa, bb, oo = a[j0:j1], b[j0:j1], out[j0:j1]
                for i in range(j1 - j0):
                    oo[i] = table[(np.int32(aa[i]) << 8) | np.int32(bb[i])]

    @_pjit
    def _lut_pairs_range(a, b, table, vtable, out, vmin, vmax):
        """out[i] = table[a[i]*256 + b[i]]; vmin[k], vmax[k]: min and max of vtable at the pairs of chunk k."""
        n = a.shape[0]
        for k in prange((n + _CHUNK - 1) // _CHUNK):
            lo, hi = vmin[k], vmax[k]
            i0, i1 = k * _CHUNK, min(n, (k + 1) * _CHUNK)
            aa, bb, oo = a[i0:i1], b[i0:i1], out[i0:i1]
            for i in range(i1 - i0):
                j = (np.int32(aa[i]) << 8) | np.int32(bb[i])
                oo[i] = table[j]
                v = vtable[j]
                lo = min(lo, v)
                hi = max(hi, v)
            vmin[k], vmax[k] = lo, hi

    @_jit
    def _find_range(v):
        """MACE's FindMinMax loop: min/max from (FLT_MAX, -FLT_MAX), a NaN never replaces the running value."""
        mn, mx = np.float32(3.4028234663852886e38), np.float32(-3.4028234663852886e38)
        for i in range(v.shape[0]):
            x = v[i]
            if x < mn:
                mn = x
            if mx < x:
                mx = x
        return mn, mx

    @_pjit
    def _quantize_neon(v, recip, vzero, zp_f, body_end, out):
        """MACE's NEON uint8 quantize (runtime/kernels/quantize.py, quantize_neon), every step in float32:
        body t = (v*recip) + vzero, two roundings, truncated; tail t = zp + (recip*v), rounded half away
        from zero; both saturated to [0, 255], NaN -> 0. Per chunk the body's part and the tail's part are two
        loops without a branch (the body's vectorizes)."""
        n = v.shape[0]
        lo, hi = np.float32(0), np.float32(255)
        for k in prange((n + _CHUNK - 1) // _CHUNK):
            i0, i1 = k * _CHUNK, min(n, (k + 1) * _CHUNK)
            b1 = max(i0, min(i1, body_end))
            vb, ob = v[i0:b1], out[i0:b1]
            for i in range(b1 - i0):
                d = np.trunc((vb[i] * recip) + vzero)
                r = min(max(d, lo), hi)
                ob[i] = np.int32(0 if d != d else r)
            for i in range(b1, i1):
                prod = recip * v[i]
                t = np.float64(zp_f + prod)
                d = np.floor(np.abs(t) + 0.5)
                d = -d if t < 0 else d
                out[i] = 0 if d != d else np.int32(min(max(d, 0.0), 255.0))

    @_pjit
    def _gpu_depthwise(x, x_zp, w, bias, scale, zp, sh, sw, dh, dw, top, left, out):
        """The gpu's depthwise convolution (multiplier 1) and requantization for one output row per task:
        acc = sum over the taps inside the uint8 input x of (x - x_zp) * w in float32 (exact: integers below 2^24,
        runtime/kernels/gpu.py; a tap outside adds 0, as the kernel's skipped tap), then
        sat_rte(f32(f32(acc + bias) * scale) + zp), every step one float32 rounding, NaN -> 0."""
        n, oh, ow, c = out.shape
        h, wd = x.shape[1], x.shape[2]
        kh, kw = w.shape[0], w.shape[1]
        z = np.float32(x_zp)
        for r in prange(n * oh):
            b, y = r // oh, r % oh
            acc = np.empty(c, np.float32)
            for ox in range(ow):
                acc[:] = np.float32(0)
                for i in range(kh):
                    iy = y * sh + i * dh - top
                    if iy < 0 or iy >= h:
                        continue
                    row = x[b, iy]
                    for j in range(kw):
                        ix = ox * sw + j * dw - left
                        if ix < 0 or ix >= wd:
                            continue
                        px, wt = row[ix], w[i, j]
                        for k in range(c):
                            acc[k] += (np.float32(px[k]) - z) * wt[k]
                dst = out[b, y, ox]
                for k in range(c):
                    dst[k] = _gpu_code(acc[k], bias[k], scale[k], zp)

    @_jit
    def _gpu_code(acc, bias, scale, zp):
        """sat_rte(f32(f32(acc + bias) * scale) + zp) on float32 scalars (acc + bias exact), NaN -> 0."""
        v = np.rint((acc + bias) * scale + zp)  # float32 throughout: two roundings, no FMA without fast-math
        if v != v:
            return np.uint8(0)
        return np.uint8(min(max(v, np.float32(0)), np.float32(255)))

    @_pjit
    def _gpu_requant_rows(acc, bias, scale, zp, out):
        for r in prange(acc.shape[0]):
            for k in range(acc.shape[1]):
                out[r, k] = _gpu_code(acc[r, k], bias[k], scale[k], zp)

    @_jit
    def _centred_chunk_gemm(x, z, r0, m, k0, kc, w, addr, bits64, g):
        """g[:m] = (x[r0:r0+m, k0:k0+kc] - z) @ w[k0:k0+kc] in float32, by the CBLAS sgemm at addr."""
        a = np.empty((m, kc), np.float32)
        for r in range(m):
            ar, xr = a[r], x[r0 + r, k0:k0 + kc]
            for j in range(kc):
                ar[j] = np.float32(xr[j]) - z
        _gemm(addr, bits64, m, w.shape[1], kc, a, w[k0:k0 + kc], g)

    @_pjit
    def _gpu_pointwise(x, x_zp, wt, bias32, bias64, scale, zp, addr, bits64, block, chunk, wide, out):
        """The gpu's pointwise convolution of uint8 x [rows, C] with the float32 filter wt [C, O] (|w| <= 128),
        requantized into out [rows, O]: per block of rows, the centred rows (x - x_zp, exact) and their GEMM by
        the CBLAS sgemm at addr in chunks of at most ``chunk`` channels (every partial sum an integer below
        2^23). Not ``wide`` (one chunk, sums and bias below 2^24): the float32 codes of ``_gpu_code``. ``wide``:
        the chunks summed in float64 (exact integers), plus the bias (below 2^31: no wrap), rounded once to
        float32 as float_rte rounds the int32, then the same float32 steps."""
        rows, c = x.shape
        o = wt.shape[1]
        z = np.float32(x_zp)
        zero = np.float32(0)
        for b in prange((rows + block - 1) // block):
            r0 = b * block
            m = min(block, rows - r0)
            g = np.empty((m, o), np.float32)
            acc = np.zeros((m, o) if wide else (1, 1), np.float64)
            for k0 in range(0, c, chunk):
                _centred_chunk_gemm(x, z, r0, m, k0, min(chunk, c - k0), wt, addr, bits64, g)
                if wide:
                    for r in range(m):
                        ar64, gr = acc[r], g[r]
                        for j in range(o):
                            ar64[j] += np.float64(gr[j])
            for r in range(m):
                dst = out[r0 + r]
                if wide:
                    ar64 = acc[r]
                    for j in range(o):
                        dst[j] = _gpu_code(np.float32(ar64[j] + bias64[j]), zero, scale[j], zp)
                else:
                    gr = g[r]
                    for j in range(o):
                        dst[j] = _gpu_code(gr[j], bias32[j], scale[j], zp)

    @_pjit
    def _hvx_quantize(bits, common_exp, min_offset, scale16, out):
        """nnlib's HVX float -> uint8 quantizer on float32 bit patterns (runtime/kernels/dsp.py,
        _hvx_quantize_numpy): the same int64 steps per element."""
        n = bits.shape[0]
        for k in prange((n + _CHUNK - 1) // _CHUNK):
            for i in range(k * _CHUNK, min(n, (k + 1) * _CHUNK)):
                b = np.int64(bits[i])
                amount = min(common_exp - ((b >> 23) & 0xFF), 31)
                sh = ((amount & 0x3F) ^ 0x20) - 0x20  # vlsr: 6-bit signed amount, negative shifts left
                mant = (b & 0x7FFFFF) | 0x800000
                if sh >= 0:
                    mant = mant >> sh
                else:
                    mant = (mant << min(-sh, 32)) & 0xFFFFFFFF
                if b >= 0x80000000:
                    mant = -mant
                word = (_wrap32(mant + min_offset) * scale16) >> 16
                out[i] = min(max(word, 0), 0xFFFF) >> 8

    @_jit
    def _wrap32(v):
        return ((v + 2147483648) & 0xFFFFFFFF) - 2147483648

    @_jit
    def _d32_requant(s, word, recip_val, shamt, out):
        """nnlib's d32 requantization (runtime/kernels/dsp.py, _d32_requant) of s [rows, C] + word [C], the same
        steps in one pass: v = wrap32(wrap32(s + word) << shamt); lsum = (v * recip_val + 2^30) >> 31;
        out = clamp(lsum, 0, 255); returns (min, max) of wrap32(lsum) from (2^24, -2^24).

        In int32 lanes where the steps allow, so that AVX2 does them 8 at a time (int64 ones run one at a time
        there: 0.92 ns an element against 0.34): wrap32(s + word) is the int32 sum of the two wrapped to int32
        (mod 2^32); v * recip_val is int32 times int32 into int64 (|product| < 2^62: recip_val <= 2^31 - 1),
        and (product + 2^30) >> 31 lies in [-2^31, 2^31), so its int32 is the low 32 bits of the logical shift."""
        vmin, vmax = np.int32(1 << 24), np.int32(-(1 << 24))
        r64 = np.int64(np.int32(recip_val))
        sh = np.int32(shamt)
        for r in range(s.shape[0]):
            sr, o = s[r], out[r]
            for i in range(s.shape[1]):
                t = np.int32(np.int64(np.int32(sr[i])) + np.int64(np.int32(word[i])))
                v = np.int32(np.int64(t) << sh)
                lsum = np.int32(np.uint64(np.int64(v) * r64 + np.int64(0x40000000)) >> np.uint64(31))
                vmin = min(vmin, lsum)
                vmax = max(vmax, lsum)
                o[i] = min(max(lsum, np.int32(0)), np.int32(255))
        return np.int64(vmin), np.int64(vmax)

    @_jit
    def _dw_row_sums(x, wz, io, n, oy, sh, sw, bh, bw, acc):
        """nnlib's depthwise sums of output row oy of image n: acc[ox, c] = sum over the taps inside x of
        (x - io) * wz[i, j, c], in int32 (the callers check KH*KW*255*255 < 2^31, so no partial sum wraps)."""
        h, wd, c = x.shape[1], x.shape[2], x.shape[3]
        kh, kw = wz.shape[0], wz.shape[1]
        for ox in range(acc.shape[0]):
            a = acc[ox]
            a[:] = 0
            for i in range(kh):
                iy = oy * sh + i - bh
                if iy < 0 or iy >= h:
                    continue
                for j in range(kw):
                    ix = ox * sw + j - bw
                    if ix < 0 or ix >= wd:
                        continue
                    src, wr = x[n, iy, ix], wz[i, j]
                    for k in range(c):
                        a[k] += (np.int32(src[k]) - io) * wr[k]

    @_pjit
    def _dsp_dw_sums(x, wz, io, sh, sw, bh, bw, out):
        """nnlib's depthwise sums (_dw_row_sums) into out [N, OH, OW, C]. One output row per task."""
        n_img, oh, ow, c = out.shape
        for t in prange(n_img * oh):
            n, oy = t // oh, t % oh
            acc = np.empty((ow, c), np.int32)
            _dw_row_sums(x, wz, io, n, oy, sh, sw, bh, bw, acc)
            out[n, oy] = acc

    @_pjit
    def _dsp_dw_codes(x, wz, io, sh, sw, bh, bw, word, recip_val, shamt, out, lims):
        """nnlib's depthwise codes: the d32 requantization (_d32_requant) of the sums (_dw_row_sums) plus word [C],
        one output row per task, no sums kept; lims[t] the row's (min, max) raw values."""
        n_img, oh, ow, c = out.shape
        for t in prange(n_img * oh):
            n, oy = t // oh, t % oh
            acc = np.empty((ow, c), np.int32)
            _dw_row_sums(x, wz, io, n, oy, sh, sw, bh, bw, acc)
            lo, hi = _d32_requant(acc, word, recip_val, shamt, out[n, oy])
            lims[t, 0] = lo
            lims[t, 1] = hi

    @_pjit
    def _dsp_pointwise_sums(x, io, wz, addr, bits64, block, chunk, out):
        """out [rows, O] int64 = sum_k (x[r, k] - io) * wz[k, o] for uint8 x [rows, C] and float32 wz [C, O]
        (|x - io|, |wz| <= 255): per block of rows (one per thread at a time) and chunk of at most ``chunk``
        channels, the centred rows in float32 and their GEMM by the CBLAS sgemm at addr, whose partial sums are
        integers below chunk*255*255 <= 2^24 (exact in any order), added into the int64 sums."""
        rows, c = x.shape
        o = wz.shape[1]
        z = np.float32(io)
        for b in prange((rows + block - 1) // block):
            r0 = b * block
            m = min(block, rows - r0)
            g = np.empty((m, o), np.float32)
            dst = out[r0:r0 + m]
            for k0 in range(0, c, chunk):
                _centred_chunk_gemm(x, z, r0, m, k0, min(chunk, c - k0), wz, addr, bits64, g)
                for r in range(m):
                    gr, d = g[r], dst[r]
                    if k0 == 0:
                        for j in range(o):
                            d[j] = np.int64(gr[j])
                    else:
                        for j in range(o):
                            d[j] += np.int64(gr[j])

    @_pjit
    def _dsp_junk_sums(xflat, p, wz, s1, s0):
        """s1[m, c] = sum_t xflat[p[m, t, c]] * wz[t, c] and s0[m, c] = sum_t wz[t, c] over the taps t with
        p[m, t, c] >= 0 (-1: a tap that reads no input), in int32: the caller checks T*255*255 < 2^31 (|x|, |wz| <=
        255), so no sum wraps. Channels innermost: a tap's reads are mostly consecutive bytes."""
        for m in prange(p.shape[0]):
            a1 = np.zeros(p.shape[2], np.int32)
            a0 = np.zeros(p.shape[2], np.int32)
            for t in range(p.shape[1]):
                pt, wt = p[m, t], wz[t]
                for c in range(p.shape[2]):
                    j = pt[c]
                    if j >= 0:
                        a1[c] += np.int32(xflat[j]) * wt[c]
                        a0[c] += wt[c]
            s1[m] = a1
            s0[m] = a0


def im2col_rows(x: np.ndarray, fill, kernel, strides, dilations, before, out_hw) -> np.ndarray:
    """conv.im2col_rows's rows of the integer ``x`` [N, H, W, C] (same arguments), copied on numba's threads."""
    (kh, kw), (sh, sw), (dh, dw), (top, left), (oh, ow) = kernel, strides, dilations, before, out_hw
    x = np.ascontiguousarray(x)
    out = np.empty((x.shape[0] * oh * ow, kh * kw * x.shape[3]), x.dtype)
    _im2col_rows(x, x.dtype.type(fill), kh, kw, sh, sw, dh, dw, top, left, oh, ow, out)
    return out


def pad4(x: np.ndarray, before, after, fill) -> np.ndarray:
    """The 4-D ``x`` padded by ``before`` / ``after`` (4 each) with ``fill``, as one pass on numba's threads."""
    out = np.empty(tuple(d + lo + hi for d, lo, hi in zip(x.shape, before, after)), x.dtype)
    if out.size:
        _pad4(np.ascontiguousarray(x), x.dtype.type(fill), *(int(v) for v in before), out)
    return out


def nchw_to_nhwc(x: np.ndarray) -> np.ndarray:
    """The 4-D ``x`` [N, C, H, W] as a C-contiguous [N, H, W, C] copy, one pass on numba's threads."""
    out = np.empty((x.shape[0], x.shape[2], x.shape[3], x.shape[1]), x.dtype)
    if out.size:
        _nchw_to_nhwc(np.ascontiguousarray(x), out)
    return out


def hw_sums(x: np.ndarray) -> np.ndarray:
    """uint32 [N, C]: the sums over H and W of the uint8 ``x`` [N, H, W, C], modulo 2^32, in one pass."""
    out = np.empty((x.shape[0], x.shape[3]), np.uint32)
    _hw_sums(np.ascontiguousarray(x), out)
    return out


def fc_sums(x: np.ndarray, x_zp: int, w: np.ndarray, w_zp=None) -> np.ndarray:
    """int32 [N, O]: G = (x - x_zp) @ (w - w_zp)^T for uint8 x [N, K] and integer weights w [O, K] (uint8, int8 or
    int16) less their per-channel zero points ``w_zp`` (None: 0), exact in int32 while |w|, |w_zp|, |w - w_zp| <= 255
    and K * 255 * 255 < 2^31 (the caller checks). uint8 weights are read as they are stored: half the bytes of an
    offset int16 copy, which a classifier's 1.3 MB of weights mostly fetch from memory."""
    wz = np.zeros(w.shape[0], np.int32) if w_zp is None else np.ascontiguousarray(w_zp, dtype=np.int32)
    out = np.empty((x.shape[0], w.shape[0]), np.int32)
    with threads.blas_held():
        _fc_sums(np.ascontiguousarray(x), int(x_zp), np.ascontiguousarray(w), wz, out)
    return out


def lut_pairs(a: np.ndarray, b: np.ndarray, body: int, body_table: np.ndarray, tail_table: np.ndarray) -> np.ndarray:
    """Codes of the uint8 pairs (a, b) (same shape) from two 65536-entry tables: body_table below
    flat index ``body``, tail_table from there (runtime/kernels/eltwise.py)."""
    out = np.empty(a.shape, np.uint8)
    _lut_pairs(np.ascontiguousarray(a).reshape(-1), np.ascontiguousarray(b).reshape(-1), int(body), body_table,
               tail_table, out.reshape(-1))
    return out


def gpu_depthwise(x: np.ndarray, x_zp: int, w: np.ndarray, bias: np.ndarray, scale: np.ndarray, zp, strides,
                  dilations, pads, out_hw) -> np.ndarray:
    """The gpu depthwise convolution's codes from the uint8 input ``x`` [N, H, W, C] (zero point ``x_zp``, pads
    (top, left, ...)), float32 taps ``w`` [KH, KW, C] and float32 ``bias`` and ``scale`` [C]
    (runtime/kernels/gpu.py decides when it applies)."""
    out = np.empty((x.shape[0], out_hw[0], out_hw[1], x.shape[3]), np.uint8)
    _gpu_depthwise(np.ascontiguousarray(x), int(x_zp), np.ascontiguousarray(w), bias, scale, np.float32(zp),
                   int(strides[0]), int(strides[1]), int(dilations[0]), int(dilations[1]), int(pads[0]), int(pads[1]),
                   out)
    return out


def gpu_requant(acc: np.ndarray, bias: np.ndarray, scale: np.ndarray, zp) -> np.ndarray:
    """The gpu requantization's codes of float32 sums ``acc`` [..., O] (exact integers, and below 2^24 with the
    float32 ``bias`` [O]) with float32 ``scale`` [O]."""
    flat = np.ascontiguousarray(acc).reshape(-1, acc.shape[-1])
    out = np.empty(flat.shape, np.uint8)
    _gpu_requant_rows(flat, bias, scale, np.float32(zp), out)
    return out.reshape(acc.shape)


def gpu_pointwise(x: np.ndarray, x_zp: int, wt: np.ndarray, bias: np.ndarray, scale: np.ndarray, zp, *,
                  chunk: int, wide: bool) -> np.ndarray:
    """The gpu pointwise convolution's codes [rows, O] of uint8 ``x`` [rows, C] with the float32 filter ``wt``
    [C, O] (C-contiguous), int32 ``bias`` and float32 ``scale`` [O]; ``wide``: the float64 sum path, else one
    float32 GEMM of at most ``chunk`` channels whose sums with the bias stay below 2^24 (runtime/kernels/gpu.py
    ``sum_path`` decides)."""
    gm = blas.gemm()
    rows, c = x.shape
    o = wt.shape[1]
    out = np.empty((rows, o), np.uint8)
    with threads.blas_held():
        _gpu_pointwise(np.ascontiguousarray(x), int(x_zp), wt, bias.astype(np.float32), bias.astype(np.float64),
                       scale, np.float32(zp), gm.sgemm, gm.int_bits == 64, _block_rows(rows, min(c, chunk), o, 4),
                       int(chunk), bool(wide), out)
    return out


def hvx_quantize(xf: np.ndarray, common_exp: int, min_offset: int, scale16: int) -> np.ndarray:
    """nnlib's HVX quantizer of a float32 array (any shape) with its parameters (``HvxQuantParms``)."""
    bits = np.ascontiguousarray(xf, dtype=np.float32).reshape(-1).view(np.uint32)
    out = np.empty(bits.shape[0], np.uint8)
    _hvx_quantize(bits, np.int64(common_exp), np.int64(min_offset), np.int64(scale16), out)
    return out.reshape(np.shape(xf))


def d32_requant(s: np.ndarray, recip_val: int, shamt: int, word: np.ndarray | None = None
                ) -> tuple[np.ndarray, int, int]:
    """nnlib's d32 requantization of int64 sums ``s`` (any shape) plus ``word`` (int64 [C], added along the last
    axis; none: 0): (uint8 codes, min raw, max raw)."""
    shape = np.shape(s)
    c = shape[-1] if word is not None else max(1, int(np.prod(shape)))
    flat = np.ascontiguousarray(s, dtype=np.int64).reshape(-1, c)
    word = np.zeros(c, np.int64) if word is None else np.ascontiguousarray(word, dtype=np.int64)
    out = np.empty(flat.shape, np.uint8)
    vmin, vmax = _d32_requant(flat, word, np.int64(recip_val), np.int64(shamt), out)
    return out.reshape(shape), int(vmin), int(vmax)


def dsp_dw_sums(x: np.ndarray, wz: np.ndarray, in_offset: int, strides, before, out_hw) -> np.ndarray:
    """int64 [N, OH, OW, C] depthwise sums of (x - in_offset) * wz over the taps inside the uint8 input
    ``x`` [N, H, W, C]; ``wz`` int32 [KH, KW, C] with KH*KW*255*255 < 2^31 (runtime/kernels/dsp.py)."""
    out = np.empty((x.shape[0], out_hw[0], out_hw[1], x.shape[3]), np.int64)
    _dsp_dw_sums(np.ascontiguousarray(x), np.ascontiguousarray(wz, dtype=np.int32), np.int32(in_offset),
                 int(strides[0]), int(strides[1]), int(before[0]), int(before[1]), out)
    return out


def dsp_dw_codes(x: np.ndarray, wz: np.ndarray, in_offset: int, strides, before, out_hw, word: np.ndarray,
                 recip_val: int, shamt: int) -> tuple[np.ndarray, int, int]:
    """nnlib's d32 requantization of :func:`dsp_dw_sums`'s sums plus ``word`` [C] in the same pass, no sums kept:
    (uint8 [N, OH, OW, C], min raw, max raw), the min / max starting from (2^24, -2^24) as :func:`d32_requant`'s."""
    out = np.empty((x.shape[0], out_hw[0], out_hw[1], x.shape[3]), np.uint8)
    lims = np.empty((max(1, x.shape[0] * out_hw[0]), 2), np.int64)
    lims[:, 0], lims[:, 1] = 1 << 24, -(1 << 24)
    _dsp_dw_codes(np.ascontiguousarray(x), np.ascontiguousarray(wz, dtype=np.int32), np.int32(in_offset),
                  int(strides[0]), int(strides[1]), int(before[0]), int(before[1]),
                  np.ascontiguousarray(word, dtype=np.int64), np.int64(recip_val), np.int64(shamt), out, lims)
    return out, int(lims[:, 0].min()), int(lims[:, 1].max())


def dsp_pointwise_sums(x: np.ndarray, in_offset: int, wz: np.ndarray, chunk: int) -> np.ndarray:
    """int64 [rows, O] sums of (x - in_offset) * wz for uint8 x [rows, C] and the float32 offset filter wz
    [C, O] (C-contiguous, |wz| <= 255), in float32 GEMMs of at most ``chunk`` channels (chunk*255*255 <= 2^24)
    on numba's threads (runtime/kernels/dsp.py)."""
    gm = blas.gemm()
    rows, c = x.shape
    o = wz.shape[1]
    out = np.empty((rows, o), np.int64)
    with threads.blas_held():
        _dsp_pointwise_sums(np.ascontiguousarray(x), np.float32(in_offset), wz, gm.sgemm, gm.int_bits == 64,
                            _block_rows(rows, min(c, chunk), o, 4), int(chunk), out)
    return out


def dsp_junk_sums(xflat: np.ndarray, p: np.ndarray, wz: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sum of xflat[p] * wz, sum of wz) over the taps where p >= 0: int64 [M, C] each, from the int32 index ``p``
    [M, T, C] (-1 where a tap reads no input) and ``wz`` [T, C] (runtime/kernels/dsp.py, the depthwise kernel's
    discarded columns)."""
    m, c = p.shape[0], p.shape[2]
    s1, s0 = np.empty((m, c), np.int64), np.empty((m, c), np.int64)
    _dsp_junk_sums(xflat, p, np.ascontiguousarray(wz), s1, s0)
    return s1, s0


def lut_pairs_range(a: np.ndarray, b: np.ndarray, table: np.ndarray, vtable: np.ndarray) -> tuple[np.ndarray, int, int]:
    """(codes, min, max): the codes of the uint8 pairs (a, b) (same shape, non-empty) from the 65536-entry
    ``table`` and the min and max of the int32 ``vtable`` over the same pairs (runtime/kernels/dsp.py)."""
    fa, fb = np.ascontiguousarray(a).reshape(-1), np.ascontiguousarray(b).reshape(-1)
    chunks = (fa.shape[0] + _CHUNK - 1) // _CHUNK
    vmin = np.full(chunks, np.iinfo(np.int32).max, np.int32)
    vmax = np.full(chunks, np.iinfo(np.int32).min, np.int32)
    out = np.empty(fa.shape[0], np.uint8)
    _lut_pairs_range(fa, fb, table, vtable, out, vmin, vmax)
    return out.reshape(np.shape(a)), int(vmin.min()), int(vmax.max())


_F32_MAX = np.float32(np.finfo(np.float32).max)


def find_range(v: np.ndarray) -> tuple[float, float]:
    """(min, max) of a flat float32 array by MACE's FindMinMax loop (see quantize.find_range): the loop runs from
    (FLT_MAX, -FLT_MAX) and keeps the first of equal values, so it gives min(FLT_MAX, min v) and
    max(-FLT_MAX, max v) wherever v has no NaN and neither is a zero (whose sign is the first zero's); numpy's
    vectorized min and max give those (half the loop's time), the loop itself gives the rest."""
    mn, mx = v.min(), v.max()
    if mn != mn or mx != mx or mn == 0 or mx == 0:  # a NaN, or a zero whose sign the order decides
        mn, mx = _find_range(v)
    return float(min(mn, _F32_MAX)), float(max(mx, -_F32_MAX))


def quantize_neon(v: np.ndarray, recip: np.float32, vzero: np.float32, zp_f: np.float32, body_end: int) -> np.ndarray:
    """MACE's NEON quantize of a flat float32 array (see quantize.quantize_neon)."""
    out = np.empty(v.shape[0], np.uint8)
    _quantize_neon(v, np.float32(recip), np.float32(vzero), np.float32(zp_f), int(body_end), out)
    return out


_BLOCK_BYTES = 1 << 18  # bytes of one block's A and G together: a block stays in L2


def _block_rows(rows: int, k: int, o: int, itemsize: int) -> int:
    """Rows per GEMM block: within _BLOCK_BYTES, at least 16, and small enough that every thread
    gets a block."""
    fit = max(16, _BLOCK_BYTES // (itemsize * (k + o)))
    share = -(-rows // max(1, _num_threads()))
    return max(1, min(fit, max(16, share)))


def _num_threads() -> int:
    """numba's thread count for the calling thread (the section's, kept in its run memo)."""
    memo = threads.run_memo()
    if memo is not None:
        return memo["threads"]
    import numba

    return numba.get_num_threads()


def gemm_available() -> bool:
    """True when the convolutions can run whole in compiled code (compiled loops and a BLAS binding)."""
    return available() and blas.gemm() is not None


def pointwise_conv(x: np.ndarray, x_zp: int, w: np.ndarray, rq, out: np.ndarray) -> None:
    """1x1 stride-1 unpadded convolution, group 1: x [rows, C] integer, w [C, O] offset filter
    (float32/float64, C-contiguous), requantized by ``rq`` (conv.py's _ExactRequant) into out [rows, O]."""
    gm = blas.gemm()
    rows, c = x.shape
    o = w.shape[1]
    with threads.blas_held():
        _pointwise(x, int(x_zp), w, gm.sgemm if w.dtype == np.float32 else gm.dgemm, gm.int_bits == 64,
                   _block_rows(rows, c, o, w.itemsize), rq.scale, rq.offset, rq.y_theta, rq.step, float(rq.lo),
                   float(rq.hi), _mode(affine=True, correct=rq.correct, lo=rq.lo), out)


def im2col_conv(x: np.ndarray, x_zp: int, w: np.ndarray, g, rq, out: np.ndarray) -> None:
    """Convolution, group 1, of x [N, H, W, C] (geometry ``g``) with w [KH*KW*C, O] (offset filter in
    window order, float32/float64), requantized by ``rq`` into out [N, OH, OW, O]."""
    gm = blas.gemm()
    k, o = w.shape
    with threads.blas_held():
        _im2col(x, int(x_zp), g.kh, g.kw, g.sh, g.sw, g.dh, g.dw, g.top, g.left, g.oh, g.ow, w,
                gm.sgemm if w.dtype == np.float32 else gm.dgemm, gm.int_bits == 64,
                max(1, _block_rows(g.n * g.oh * g.ow, k, o, w.itemsize) // g.ow), rq.scale, rq.offset, rq.y_theta,
                rq.step, float(rq.lo), float(rq.hi), _mode(affine=True, correct=rq.correct, lo=rq.lo),
                out.reshape(-1, o))


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


def depthwise_fixed(x: np.ndarray, x_zp: int, wk: np.ndarray, g, rq, out: np.ndarray) -> None:
    """Depthwise convolution (channel multiplier 1) of the integer input ``x`` [N, H, W, C] (zero point
    ``x_zp``, geometry ``g``) with the offset filter ``wk`` [KH, KW, C] (float32 or float64: the accumulator
    type), requantized by ``rq`` (its per-channel vectors) into ``out`` [N, OH, OW, C]."""
    DepthwiseCall(x_zp, wk, g, rq)(x, out)


class DepthwiseCall:
    """:func:`depthwise_fixed` for one geometry with its arguments converted once (conv.py keeps one per input
    shape and thread count: the rows per block depend on both)."""

    def __init__(self, x_zp: int, wk: np.ndarray, g, rq):
        per_thread = -(-(g.n * g.oh) // (4 * max(1, _num_threads())))  # about 4 blocks per thread
        rows = max(1, min(g.oh, per_thread, 16))
        self.head = (int(x_zp), np.ascontiguousarray(wk), g.sh, g.sw, g.dh, g.dw, g.top, g.left, g.oh, g.ow, rows)
        self.tail = (rq.scale, rq.offset, rq.y_theta, rq.step, float(rq.lo), float(rq.hi),
                     _mode(affine=True, correct=rq.correct, lo=rq.lo))

    def __call__(self, x: np.ndarray, out: np.ndarray) -> None:
        _depthwise_rows(x, *self.head, *self.tail, out)
