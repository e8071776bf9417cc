"""MACE CPU uint8 max / average pooling on NHWC tensors.

Upstream source: XiaoMi/mace ``mace/ops/pooling.cc``, class ``PoolingOp<DeviceType::CPU, uint8_t>``
(the NEON and scalar loops compute the same values). Output shape arithmetic:
``mace/ops/common/conv_pool_2d_util.cc`` (``CalcOutputSize``).

Semantics, per output position (b, h, w) and channel c:
- The window is clipped to the input: ``ih`` in [max(0, h*sh - top), min(H, h*sh - top + kh)),
  likewise for ``iw``. Padding never contributes a value.
- Max: ``out = 0`` then ``out = max(out, x)`` over the clipped window (``std::fill_n(.., 0)``
  followed by ``vmaxq_u8``). Since uint8 >= 0 this is the window max; an empty window gives 0.
- Average: the window sum is accumulated in a **uint16** buffer (``vaddw_u8`` / ``+=`` on
  ``uint16_t``), so it wraps modulo 65536 once a window holds more than 257 elements of 255;
  then ``out = (sum + block_size / 2) / block_size`` in integer arithmetic, where
  ``block_size`` is the number of in-bounds elements (padding is excluded from the count).
  Rounding is half up. An empty window fails ``MACE_CHECK(block_size > 0)``.
- The output keeps the input's scale and zero point (``output->SetScale(input->scale())``).
- MACE splits the total padding as top = total / 2 (integer), bottom = the rest. Pass the
  split explicitly in ``pads = (top, left, bottom, right)``; the output size is
  ``(H + top + bottom - kh) // sh + 1``. A CEIL ``round_mode`` output size is reproduced by
  adding the extra rows/columns to ``bottom``/``right``: they fall outside the input, so they
  are clipped like any other padding.
- Dilation must be 1 (``MACE_CHECK(dilations == 1)`` in the uint8 op).
"""
from __future__ import annotations

import numpy as np

from maceq.errors import MaceqError


def _check(x: np.ndarray, kernel, strides, pads) -> tuple[int, int, int, int, int, int, int, int, int, int]:
    if x.dtype != np.uint8 or x.ndim != 4:
        raise MaceqError(f"pooling: expected a uint8 NHWC tensor, got {x.dtype} of shape {x.shape}")
    kh, kw = (int(k) for k in kernel)
    sh, sw = (int(s) for s in strides)
    top, left, bottom, right = (int(p) for p in pads)
    if min(kh, kw, sh, sw) < 1 or min(top, left, bottom, right) < 0:
        raise MaceqError(f"pooling: bad kernel {kernel}, strides {strides} or pads {pads}")
    _, h, w, _ = x.shape
    oh = (h + top + bottom - kh) // sh + 1
    ow = (w + left + right - kw) // sw + 1
    if oh < 1 or ow < 1:
        raise MaceqError(f"pooling: kernel {kernel} larger than padded input {x.shape}")
    return kh, kw, sh, sw, top, left, h, w, oh, ow


def _window(o: int, stride: int, pad: int, k: int, size: int) -> tuple[int, int]:
    base = o * stride - pad
    return max(0, base), min(size, base + k)


# ----------------------------------------------------------------------------------------------
# Readable references (loops as in pooling.cc)
# ----------------------------------------------------------------------------------------------

def _windows_ref(x: np.ndarray, kernel, strides, pads):
    """(output array, iterator of (b, i, j, h0, h1, w0, w1)): every output and its clipped window."""
    kh, kw, sh, sw, top, left, h, w, oh, ow = _check(x, kernel, strides, pads)
    n, _, _, c = x.shape
    out = np.zeros((n, oh, ow, c), dtype=np.uint8)

    def it():
        for b in range(n):
            for i in range(oh):
                h0, h1 = _window(i, sh, top, kh, h)
                for j in range(ow):
                    w0, w1 = _window(j, sw, left, kw, w)
                    yield b, i, j, h0, h1, w0, w1

    return out, it()


def max_pool_ref(x, *, kernel, strides, pads) -> np.ndarray:
    """Scalar reference of the uint8 MaxPooling loop."""
    x = np.asarray(x)
    out, windows = _windows_ref(x, kernel, strides, pads)
    c = x.shape[3]
    for b, i, j, h0, h1, w0, w1 in windows:
        acc = [0] * c  # std::fill_n(out_ptr, channels, 0)
        for ih in range(h0, h1):
            for iw in range(w0, w1):
                for ch in range(c):
                    acc[ch] = max(acc[ch], int(x[b, ih, iw, ch]))
        out[b, i, j, :] = acc
    return out


def avg_pool_ref(x, *, kernel, strides, pads) -> np.ndarray:
    """Scalar reference of the uint8 AvgPooling loop (uint16 accumulator, half-up division)."""
    x = np.asarray(x)
    out, windows = _windows_ref(x, kernel, strides, pads)
    c = x.shape[3]
    for b, i, j, h0, h1, w0, w1 in windows:
        block_size = (h1 - h0) * (w1 - w0)
        if block_size <= 0:
            raise MaceqError(f"avg pooling: output ({i}, {j}) has an empty window "
                             "(MACE_CHECK(block_size > 0))")
        acc = [0] * c  # uint16_t avg_buffer[c]
        for ih in range(h0, h1):
            for iw in range(w0, w1):
                for ch in range(c):
                    acc[ch] = (acc[ch] + int(x[b, ih, iw, ch])) & 0xFFFF
        # (uint16 + int64 / 2) / int64: non-negative, so C division == floor division
        out[b, i, j, :] = [(s + block_size // 2) // block_size for s in acc]
    return out


# ----------------------------------------------------------------------------------------------
# Vectorised fast paths (bit-exact with the references; proven by tests)
# ----------------------------------------------------------------------------------------------

def _padded(x: np.ndarray, top: int, left: int, oh: int, ow: int, kh: int, kw: int, sh: int, sw: int):
    """Zero-pad x so that every (unclipped) window lies inside; returns the padded array."""
    n, h, w, c = x.shape
    need_h = (oh - 1) * sh + kh
    need_w = (ow - 1) * sw + kw
    pb = max(0, need_h - top - h)
    pr = max(0, need_w - left - w)
    return np.pad(x, ((0, 0), (top, pb), (left, pr), (0, 0)))


def max_pool(x, *, kernel, strides, pads) -> np.ndarray:
    """MACE uint8 max pooling; see the module docstring. Padding acts as 0, the initial value."""
    x = np.asarray(x)
    kh, kw, sh, sw, top, left, h, w, oh, ow = _check(x, kernel, strides, pads)
    xp = _padded(x, top, left, oh, ow, kh, kw, sh, sw)
    out = np.zeros((x.shape[0], oh, ow, x.shape[3]), dtype=np.uint8)
    for dy in range(kh):
        for dx in range(kw):
            np.maximum(out, xp[:, dy:dy + (oh - 1) * sh + 1:sh, dx:dx + (ow - 1) * sw + 1:sw, :], out=out)
    return out


def _counts(o: int, stride: int, pad: int, k: int, size: int) -> np.ndarray:
    starts = np.arange(o) * stride - pad
    return np.minimum(size, starts + k) - np.maximum(0, starts)


def avg_pool(x, *, kernel, strides, pads) -> np.ndarray:
    """MACE uint8 average pooling; see the module docstring.

    The window sum is taken in int64 (at most kh*kw*255, far below 2^63) and reduced modulo
    65536 afterwards, which equals the C++ running uint16 sum because addition modulo 2^16
    does not depend on the order.
    """
    x = np.asarray(x)
    kh, kw, sh, sw, top, left, h, w, oh, ow = _check(x, kernel, strides, pads)
    ch = _counts(oh, sh, top, kh, h)
    cw = _counts(ow, sw, left, kw, w)
    if (ch <= 0).any() or (cw <= 0).any():
        raise MaceqError("avg pooling: an output has an empty window (MACE_CHECK(block_size > 0))")
    xp = _padded(x, top, left, oh, ow, kh, kw, sh, sw).astype(np.int64)
    acc = np.zeros((x.shape[0], oh, ow, x.shape[3]), dtype=np.int64)
    for dy in range(kh):
        for dx in range(kw):
            acc += xp[:, dy:dy + (oh - 1) * sh + 1:sh, dx:dx + (ow - 1) * sw + 1:sw, :]
    acc &= 0xFFFF
    block = (ch[:, None] * cw[None, :])[None, :, :, None]
    return ((acc + block // 2) // block).astype(np.uint8)


def global_avg_pool(x) -> np.ndarray:
    """Average pooling with the kernel covering the whole H x W extent (stride 1, no padding)."""
    x = np.asarray(x)
    return avg_pool(x, kernel=(x.shape[1], x.shape[2]), strides=(1, 1), pads=(0, 0, 0, 0))


def global_avg_pool_ref(x) -> np.ndarray:
    """Scalar reference for :func:`global_avg_pool`."""
    x = np.asarray(x)
    return avg_pool_ref(x, kernel=(x.shape[1], x.shape[2]), strides=(1, 1), pads=(0, 0, 0, 0))
