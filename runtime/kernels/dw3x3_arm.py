"""MACE's aarch64 uint8 3x3 depthwise fast path: its eligibility rule and its border outputs.

MACE's uint8 DepthwiseConv2d (mace/ops/depthwise_conv2d.cc, dilation 1) calls the
vendored ``tflite::optimized_ops::DepthwiseConv`` (TFLite r1.10,
``kernels/internal/optimized/depthwiseconv_uint8.h``). On aarch64 that function
first asks ``Fast3x3FilterKernelSupported`` and, when it holds, runs
``DepthwiseConv3x3Filter`` (``depthwiseconv_uint8_3x3_filter.h``). The arithmetic
per output is the gemmlowp one of :func:`maceq.runtime.kernels.conv.depthwise_conv2d`
(int16 lanes ``(x - x_zp) * (w - w_zp)`` summed in int32, ``SQRDMULH``, the
rounding fix-up and ``SRSHL``, ``+ out_zp``, clamp), so every interior output
equals the reference kernel. What differs is *which taps* the border outputs read.

With kernel padding 1 (MACE passes ``padding_values >> 1``: top/left only),
``DepthwiseConvHandlePadding`` computes the outer ring of outputs with four edge
kernels (``DepthwiseConvPartial``): ``kCorner`` reads a 2x2 input window,
``kHorizontal`` 2 rows x 3 columns, ``kVertical`` 3 rows x 2 columns, ``kCenter``
one pixel (1x1 input). Each gets an input pointer and a filter pointer; the taps
it reads are fixed by its shape. The pointers for the bottom row start at input
row ``H - 2`` and for the right column at input column ``W - 2``: the start of
the last window only when that window hangs one position past the input (stride
1, or stride 2 on an odd size). For stride 2 on an even size the real last
window starts at ``H - 3`` / ``W - 3``: the device then reads a window shifted by
one and leaves out one filter row or column (docs/semantics.md,
"DepthwiseConv2d: the 3x3 fast path").

This module gives, for one image:

- :func:`fast3x3_supported`: ``Fast3x3FilterKernelSupported`` transcribed;
- :func:`border_calls`: ``DepthwiseConvHandlePadding`` transcribed on flat
  offsets, as the list of edge-kernel calls it makes (the reference);
- :func:`border_taps`: the same outputs from a closed-form rule per output
  row/column (the fast path's table);
- :class:`Fast3x3Edges`: applies the border to an output computed by the
  ordinary kernel, from :func:`border_taps` (one gather per image).

tests/test_dw3x3_arm.py proves :func:`border_taps` equal to :func:`border_calls`
on every shape it accepts, and the whole against MACE's outputs in
../shared/data/mace_arm.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from maceq.errors import MaceqError, UndefinedOnDevice
from maceq.runtime.fixedpoint import multiply_by_quantized_multiplier, wrap_int32

__all__ = ["Fast3x3Shape", "fast3x3_supported", "border_calls", "border_taps", "border_defect",
           "Fast3x3Edges", "depthwise3x3_edges_ref"]

#: Edge kernels of DepthwiseConvHandlePadding: (rows, columns) of the input window each reads.
EDGE_WINDOW = {"center": (1, 1), "corner": (2, 2), "horizontal": (2, 3), "vertical": (3, 2)}


@dataclass(frozen=True)
class Fast3x3Shape:
    """One image's geometry as the fast path sees it (pad = ``padding_values >> 1``)."""

    h: int
    w: int
    c: int
    stride: int
    pad: int
    oh: int
    ow: int


def fast3x3_supported(*, in_h: int, in_w: int, in_c: int, kh: int, kw: int, depth_multiplier: int,
                      stride_h: int, stride_w: int, pad_h: int, pad_w: int, dilated: bool,
                      out_h: int, out_w: int, right_shift: int) -> bool:
    """``Fast3x3FilterKernelSupported`` (TFLite r1.10): True when the 3x3 fast path runs.

    ``pad_h``/``pad_w`` are the kernel's paddings (``padding_values >> 1``); bottom/right padding is
    never looked at. ``right_shift`` is MACE's (``-exponent`` of the output multiplier): the path
    needs ``right_shift > 0``, i.e. a real multiplier below 0.5.
    """
    ok = (kh == 3 and kw == 3 and depth_multiplier == 1 and stride_w in (1, 2) and stride_h in (1, 2)
          and stride_w == stride_h and pad_w in (0, 1) and pad_h in (0, 1) and pad_w == pad_h
          and in_c % 8 == 0 and right_shift > 0 and not dilated)
    if not ok:
        return False
    in_x_end = (out_w - 1) * stride_w - pad_w + kw
    in_y_end = (out_h - 1) * stride_h - pad_h + kh
    if pad_w == 0 and pad_h == 0:
        return in_x_end <= in_w and in_y_end <= in_h
    if not (in_x_end <= in_w + 1 and in_y_end <= in_h + 1):
        return False
    if in_w == 1 or in_h == 1:
        return in_w == in_h
    return True


# ----------------------------------------------------------------------------
# Reference: DepthwiseConvHandlePadding on flat offsets


@dataclass(frozen=True)
class EdgeCall:
    """One DepthwiseConvPartial call: its kind and its input/filter/output offsets in pixels.

    Offsets count pixels (a pixel is ``depth`` bytes): input ``row * W + col``, filter
    ``row * 3 + col``, output ``row * OW + col``.
    """

    kind: str
    input_px: int
    filter_px: int
    output_px: int


def _loop(calls: list, kind: str, inp: int, filt: int, out: int, n: int, d_in: int, d_out: int) -> tuple[int, int]:
    """``for (i = 1; i < n + 1; i++) { Partial<kind>(inp, filt, out); inp += d_in; out += d_out; }``."""
    for _ in range(n):
        calls.append(EdgeCall(kind, inp, filt, out))
        inp += d_in
        out += d_out
    return inp, out


def border_calls(s: Fast3x3Shape) -> list[EdgeCall]:
    """The edge-kernel calls of ``DepthwiseConvHandlePadding`` (pad 1), in the order the C code makes them.

    A transcription of the pointer arithmetic, in pixels: ``input_depth``, ``output_depth`` and a
    filter column are one pixel; ``input_row_size`` is ``W``, ``output_row_size`` is ``OW`` and
    ``filter_row_size`` is 3. (The C code steps rows with ``stride_width``; the path requires equal
    strides.)
    """
    if s.pad != 1:
        return []
    if s.w == 1 and s.h == 1:
        return [EdgeCall("center", 0, 3 + 1, 0)]
    sw, row, orow, inner_w, inner_h = s.stride, s.w, s.ow, max(s.ow - 2, 0), max(s.oh - 2, 0)
    calls = [EdgeCall("corner", 0, 3 + 1, 0)]  # top row
    inp, out = _loop(calls, "horizontal", sw - 1, 3, 1, inner_w, sw, 1)
    calls.append(EdgeCall("corner", inp, 3, out))
    _loop(calls, "vertical", (sw - 1) * row, 1, orow, inner_h, sw * row, orow)  # left side
    _loop(calls, "vertical", (s.w - 2) + (sw - 1) * row, 0, orow + s.ow - 1, inner_h, sw * row, orow)  # right
    bottom_in, bottom_out = (s.h - 2) * row, (s.oh - 1) * orow  # bottom row
    calls.append(EdgeCall("corner", bottom_in, 1, bottom_out))
    inp, out = _loop(calls, "horizontal", bottom_in + (0 if sw == 1 else 1), 0, bottom_out + 1, inner_w, sw, 1)
    calls.append(EdgeCall("corner", inp, 0, out))
    return calls


def _call_taps(s: Fast3x3Shape, call: EdgeCall) -> list[tuple[int, int, int, int]]:
    """The (input row, input col, filter row, filter col) taps one edge call reads; checks bounds."""
    rows, cols = EDGE_WINDOW[call.kind]
    r0, c0 = divmod(call.input_px, s.w)
    f0, g0 = divmod(call.filter_px, 3)
    taps = []
    for i in range(rows):
        for j in range(cols):
            r, c, fr, fc = r0 + i, c0 + j, f0 + i, g0 + j
            if not (0 <= r < s.h and 0 <= c < s.w) or fr > 2 or fc > 2:
                raise MaceqError(f"3x3 fast path: edge kernel reads outside the input/filter for {s}")
            taps.append((r, c, fr, fc))
    return taps


def _requant_px(acc: np.ndarray, q: int, shift: int, out_zp: int) -> np.ndarray:
    r = multiply_by_quantized_multiplier(wrap_int32(acc), q, shift)
    return np.clip(np.asarray(r, dtype=np.int64) + int(out_zp), 0, 255)


def depthwise3x3_edges_ref(x, y, w, bias, *, x_zp: int, w_zp: int, out_zp: int, multiplier: int, shift: int,
                           s: Fast3x3Shape) -> np.ndarray:
    """Reference: ``y`` (one image's correct output, [OH, OW, C]) with HandlePadding's writes applied.

    ``x`` [H, W, C] uint8, ``w`` [3, 3, C] codes, ``bias`` int32 [C] (after MACE's rescale).
    Each edge call sums its taps in int64 (exact; wrapped to int32 like the C code), requantizes
    and writes its output pixel; later calls overwrite earlier ones, as in C. A write past the
    output buffer raises: the device's behaviour is undefined there.
    """
    out = np.array(y, dtype=np.uint8).reshape(-1, s.c)
    xo = np.asarray(x, dtype=np.int64) - int(x_zp)
    wo = np.asarray(w, dtype=np.int64).reshape(3, 3, s.c) - int(w_zp)
    for call in border_calls(s):
        if not 0 <= call.output_px < out.shape[0]:
            raise UndefinedOnDevice(f"3x3 fast path writes past its output ({s.oh}x{s.ow}) for input {s.h}x{s.w}, "
                                    f"stride {s.stride}: the device's result is undefined")
        acc = np.asarray(bias, dtype=np.int64).copy()
        for r, c, fr, fc in _call_taps(s, call):
            acc += xo[r, c] * wo[fr, fc]
        out[call.output_px] = _requant_px(acc, multiplier, shift, out_zp)
    return out.reshape(s.oh, s.ow, s.c)


# ----------------------------------------------------------------------------
# Fast path table: a closed-form rule per border row and column


def _row_taps(s: Fast3x3Shape, oy: int) -> list[tuple[int, int]]:
    """(input row, filter row) pairs the device uses for output row ``oy`` (border rule)."""
    if oy == s.oh - 1:  # the bottom row's pointer starts at input row H - 2 (wins over the top row when OH == 1)
        return [(s.h - 2, 0), (s.h - 1, 1)]
    if oy == 0:
        return [(0, 1), (1, 2)]
    y0 = oy * s.stride - 1
    return [(y0 + k, k) for k in range(3)]


def _col_taps(s: Fast3x3Shape, oy: int, ox: int) -> list[tuple[int, int]]:
    """(input col, filter col) pairs for output (oy, ox): corners keep their pointer, the right edge restarts."""
    if ox == 0:
        return [(0, 1), (1, 2)]
    x0 = ox * s.stride - 1
    if ox < s.ow - 1:
        return [(x0 + k, k) for k in range(3)]
    if oy in (0, s.oh - 1):  # right corners: the loop's pointer (correctly aligned), two columns only
        return [(x0, 0), (x0 + 1, 1)]
    return [(s.w - 2, 0), (s.w - 1, 1)]  # right edge: restarts at input column W - 2


def border_pixels(s: Fast3x3Shape) -> list[tuple[int, int]]:
    """The output pixels HandlePadding writes (the outer ring), row-major."""
    if s.pad != 1:
        return []
    ring = {(oy, ox) for oy in (0, s.oh - 1) for ox in range(s.ow)}
    ring |= {(oy, ox) for oy in range(s.oh) for ox in (0, s.ow - 1)}
    return sorted(ring)


def border_taps(s: Fast3x3Shape) -> tuple[np.ndarray, np.ndarray]:
    """The border as a gather table: (output pixel [N], input pixel per filter tap [N, 9], -1 = not read).

    Raises where HandlePadding would write past its output (an output one pixel wide from a
    wider input), which :func:`border_calls` shows as an out-of-range write.
    """
    if s.pad != 1:
        return np.zeros(0, np.int64), np.zeros((0, 9), np.int64)
    if s.h == 1 and s.w == 1:
        return np.zeros(1, np.int64), np.array([[-1] * 4 + [0] + [-1] * 4], np.int64)
    if s.ow < 2:
        raise UndefinedOnDevice(f"3x3 fast path writes past its output ({s.oh}x{s.ow}) for input {s.h}x{s.w}, "
                         f"stride {s.stride}: the device's result is undefined")
    pix = border_pixels(s)
    table = np.full((len(pix), 9), -1, np.int64)
    for n, (oy, ox) in enumerate(pix):
        for r, fr in _row_taps(s, oy):
            for c, fc in _col_taps(s, oy, ox):
                table[n, fr * 3 + fc] = r * s.w + c
    return np.array([oy * s.ow + ox for oy, ox in pix], np.int64), table


def border_defect(s: Fast3x3Shape) -> str | None:
    """Why the device's border differs from the convolution the model means, or None when it does not.

    The device is right when its bottom row and right column start where the real last window
    starts (``(OH-1)*stride - 1 == H - 2``, same for columns) and the output has at least two
    rows and columns (or the input is 1x1).
    """
    if s.pad != 1 or (s.h == 1 and s.w == 1):
        return None
    wrong = []
    if s.oh < 2 or (s.oh - 1) * s.stride - 1 != s.h - 2:
        wrong.append("last output row")
    if s.ow < 2 or (s.ow - 1) * s.stride - 1 != s.w - 2:
        wrong.append("last output column")
    if not wrong:
        return None
    return (f"TFLite's aarch64 3x3 depthwise fast path (pad 1, stride {s.stride}, input {s.h}x{s.w}) "
            f"computes the {' and the '.join(wrong)} from a shifted or truncated window")


class Fast3x3Edges:
    """Applies the fast path's border to outputs of the ordinary kernel (fixed weights, per-shape tables)."""

    def __init__(self, w, bias, *, x_zp: int, w_zp: int, out_zp: int, multiplier: int, shift: int):
        w = np.asarray(w)
        self.c = int(w.shape[2])
        # offset filter taps [9, C], tap index fy * 3 + fx; a 10th row of zeros for "not read"
        self.wo = np.zeros((10, self.c), np.int64)
        self.wo[:9] = w.reshape(9, self.c).astype(np.int64) - int(w_zp)
        self.bias = np.zeros(self.c, np.int64) if bias is None else np.asarray(bias, np.int64).reshape(self.c)
        self.x_zp, self.out_zp, self.q, self.shift = int(x_zp), int(out_zp), int(multiplier), int(shift)
        self._tables: dict = {}
        #: per input shape: the fast path's geometry where its border departs from the convolution, else None
        self.defects: dict = {}

    def _table(self, s: Fast3x3Shape):
        hit = self._tables.get(s)
        if hit is None:
            out_px, taps = border_taps(s)
            tap_idx = np.broadcast_to(np.arange(9), taps.shape)
            read = taps >= 0
            hit = self._tables[s] = (out_px, np.where(read, taps, s.h * s.w), np.where(read, tap_idx, 9))
        return hit

    def __call__(self, x: np.ndarray, y: np.ndarray, s: Fast3x3Shape) -> np.ndarray:
        """Overwrite the border of ``y`` [N, OH, OW, C] (in place) as the device computes it; returns y."""
        out_px, in_px, w_idx = self._table(s)
        if out_px.size == 0:
            return y
        for n in range(x.shape[0]):
            xf = np.empty((s.h * s.w + 1, self.c), np.int64)  # a last "pixel" of zeros for taps not read
            xf[:-1] = x[n].reshape(-1, self.c)
            xf[:-1] -= self.x_zp
            xf[-1] = 0
            acc = np.einsum("ntc,ntc->nc", xf[in_px], self.wo[w_idx]) + self.bias
            y[n].reshape(-1, self.c)[out_px] = _requant_px(acc, self.q, self.shift, self.out_zp)
        return y
