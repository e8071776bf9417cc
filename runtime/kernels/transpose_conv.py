"""uint8 TransposeConv (deconvolution): TFLite's TRANSPOSE_CONV reference arithmetic.

Transcribed from TFLite ``kernels/internal/reference/transpose_conv.h`` (uint8
``TransposeConv`` with the int32 ``scratch_buffer``) and ``kernels/transpose_conv.cc``
(Prepare/Eval). Activations are NHWC, the filter is TFLite's ``[O, KH, KW, I]``.

Scatter formulation (reference_ops::TransposeConv)::

    scratch = 0                                              int32, output-shaped
    for every input pixel (b, iy, ix), input channel ic, tap (fy, fx), output channel oc:
        oy = iy * stride_h - pad_top + fy ;  ox = ix * stride_w - pad_left + fx
        if 0 <= oy < out_h and 0 <= ox < out_w:
            scratch[b, oy, ox, oc] += (x - x_zp) * (w[oc, fy, fx, ic] - w_zp)
    acc = scratch + bias[oc]                                 int32
    y = clamp(MultiplyByQuantizedMultiplier(acc, q, shift) + out_zp, act_min, act_max)

Overflow bound: |x - x_zp| <= 255 and |w - w_zp| <= 255, so each product is below 2^16;
an output element receives at most ceil(KH / s_h) * ceil(KW / s_w) * I products, so the
int32 scratch is exact while that count stays below 2^15. Past it the C code wraps modulo
2^32 (signed overflow, which every target wraps); both paths here reproduce the wrap with
:func:`~maceq.runtime.fixedpoint.wrap_int32` (wrapping addition is associative, so the
order of the scatter does not matter). The fast path sums on float64 BLAS, exact while
every partial sum is below 2^53: KH * KW * I < 2^37, checked.

Padding (transpose_conv.cc ``Eval``): ``ComputePaddingHeightWidth`` is called with the
*output* size as the "input" size: for SAME, ``n = ceil(out / s)``; for VALID,
``n = (out - k + s) // s``; ``total = max((n - 1) * s + k - out, 0)`` and the reference
kernel uses only ``pad = total // 2`` (the offset half is for the optimized kernel). Prepare
also checks that n equals the input's size. :func:`tflite_transpose_conv_pads` computes it.

Multiplier (oracle-measured, tests/oracle/test_transpose_conv_oracle.py): uint8 goes
through ``PopulateConvolutionQuantizationParams`` -> ``GetQuantizedConvolutionMultipler``
(kernel_util.cc), ``double(float32(s_in * s_w)) / double(s_out)`` -- the scale product is
a float32 multiply, as for CONV_2D -- then ``QuantizeMultiplier``. The kernels here take
the resulting ``(multiplier, shift)``; :func:`tflite_transpose_conv_multiplier` derives it.

ONNX ConvTranspose maps onto these arguments without flipping the kernel: ONNX's
``y[oc, i*s + k*d - pad_begin] += x[ic, i] * W[ic, oc, k]`` is the scatter above with
``w = W.transpose(1, 2, 3, 0)`` (see :func:`onnx_conv_transpose_args`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from maceq.errors import MaceqError
from maceq.runtime.fixedpoint import (
    INT32_MAX,
    INT32_MIN,
    multiply_by_quantized_multiplier,
    quantize_multiplier,
    wrap_int32,
)

__all__ = [
    "Padding",
    "ConvTransposeArgs",
    "tflite_transpose_conv_pads",
    "tflite_transpose_conv_multiplier",
    "onnx_conv_transpose_args",
    "transpose_conv",
    "transpose_conv_ref",
]

_F64_EXACT_TERMS = 1 << 37  # K * 2^16 < 2^53: float64 GEMM sums of K products are exact


class Padding(enum.Enum):
    """TFLite's TransposeConvOptions.padding."""

    SAME = "SAME"
    VALID = "VALID"


@dataclass(frozen=True)
class ConvTransposeArgs:
    """What :func:`transpose_conv` needs from an ONNX ConvTranspose node.

    ``w``: the filter in TFLite layout ``[O, KH, KW, I]``; ``out_hw``: output height and width;
    ``pads``: ``(top, left)``, the rows/columns cropped from the start of the full
    (uncropped) deconvolution output; ``strides``: ``(s_h, s_w)``.
    """

    w: np.ndarray
    out_hw: tuple[int, int]
    pads: tuple[int, int]
    strides: tuple[int, int]


def tflite_transpose_conv_pads(out_h: int, out_w: int, kh: int, kw: int, *, strides=(1, 1),
                               padding: Padding, in_hw: tuple[int, int] | None = None) -> tuple[int, int]:
    """Contract: the ``(pad_top, pad_left)`` TFLite's TRANSPOSE_CONV uses for an output of out_h x out_w.

    transpose_conv.cc ``Eval`` -> padding.h ``ComputePaddingHeightWidth(stride, dilation 1,
    out_h, out_w, kh, kw, padding)``: ``n = ceil(out / s)`` (SAME) or ``(out - k + s) // s``
    (VALID), ``total = max((n - 1) * s + k - out, 0)``, pad = ``total // 2``. With ``in_hw``,
    also TFLite Prepare's check that ``n`` equals the input size (raises MaceqError otherwise).
    """
    padding = Padding(padding)
    pads = []
    for i, (out, k, s) in enumerate(((out_h, kh, strides[0]), (out_w, kw, strides[1]))):
        if out < 1 or k < 1 or s < 1:
            raise MaceqError(f"transpose_conv: bad geometry out={out}, k={k}, stride={s}")
        n = (out + s - 1) // s if padding is Padding.SAME else (out - k + s) // s
        if in_hw is not None and n != in_hw[i]:
            raise MaceqError(f"transpose_conv: output size {out} with kernel {k}, stride {s}, "
                             f"{padding.value} needs input size {n}, got {in_hw[i]}")
        pads.append(max((n - 1) * s + k - out, 0) // 2)
    return pads[0], pads[1]


def tflite_transpose_conv_multiplier(s_in, s_w, s_out) -> tuple[int, int]:
    """Contract: TFLite's uint8 TRANSPOSE_CONV (q, shift): QuantizeMultiplier(double(f32(s_in*s_w)) / double(s_out)).

    kernel_util.cc ``GetQuantizedConvolutionMultipler`` (4-argument overload), reached from
    ``PopulateConvolutionQuantizationParams`` for uint8 per-tensor filters. Scales are the
    float32 values stored in the model.
    """
    a, b, c = np.float32(s_in), np.float32(s_w), np.float32(s_out)
    if c == 0:
        raise MaceqError("transpose_conv: output scale is zero")
    return quantize_multiplier(float(np.float32(a * b)) / float(c))


def onnx_conv_transpose_args(w_onnx, *, in_hw, strides=(1, 1), pads=(0, 0, 0, 0), output_padding=(0, 0),
                             dilations=(1, 1), group: int = 1, output_shape=None,
                             auto_pad: str = "NOTSET", node: str = "ConvTranspose") -> ConvTransposeArgs:
    """Contract: ONNX ConvTranspose attributes (2-D) -> :class:`ConvTransposeArgs` for :func:`transpose_conv`.

    ``w_onnx`` is ONNX's ``[I, O/group, KH, KW]`` filter; ``pads`` ONNX's
    ``(top, left, bottom, right)``. The full output is
    ``full = s * (in - 1) + output_padding + (k - 1) * d + 1``; explicit pads give
    ``out = full - pad_begin - pad_end``. With ``output_shape``, or auto_pad SAME_UPPER /
    SAME_LOWER (target ``in * s``), the pads follow the ONNX operator text and onnxruntime 1.32
    (tested): ``total = max(0, full - target)``; SAME_UPPER puts ``total // 2`` first, NOTSET
    and SAME_LOWER put ``total - total // 2`` first; the output size is ``output_shape`` when
    given, else ``full - total``. (Older onnxruntime, conv_transpose_attributes.h
    ``DistributePadding``, assigned the halves the other way round.) The crop at the start is
    ``pad_begin``; the end of the output is cut, or extended with zero-sum rows, by the output
    size, which the kernel's bounds check implements. TFLite's kernel has no groups and no
    dilation: ``group != 1`` or ``dilations != 1`` raise MaceqError naming ``node``.
    """
    w = np.asarray(w_onnx)
    if w.ndim != 4:
        raise MaceqError(f"{node}: ConvTranspose weights must be 4-D [I, O/group, KH, KW], got {w.shape}")
    if int(group) != 1:
        raise MaceqError(f"{node}: ConvTranspose with group={group} is not supported (TFLite TRANSPOSE_CONV has no groups)")
    if tuple(int(d) for d in dilations) != (1, 1):
        raise MaceqError(f"{node}: ConvTranspose with dilations={tuple(dilations)} is not supported")
    strides = tuple(int(s) for s in strides)
    if len(strides) != 2 or min(strides) < 1:
        raise MaceqError(f"{node}: bad strides {strides}")
    k = (int(w.shape[2]), int(w.shape[3]))
    opad = tuple(int(v) for v in output_padding)
    if len(opad) != 2 or any(o < 0 or o >= s for o, s in zip(opad, strides)):
        raise MaceqError(f"{node}: output_padding {opad} must be in [0, stride) per axis")
    full = [strides[i] * (int(in_hw[i]) - 1) + opad[i] + k[i] for i in range(2)]
    auto_pad = str(auto_pad)
    if auto_pad not in ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"):
        raise MaceqError(f"{node}: unknown auto_pad {auto_pad!r}")
    if output_shape is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        if output_shape is not None:
            target = tuple(int(v) for v in output_shape[-2:])
        else:
            target = (int(in_hw[0]) * strides[0], int(in_hw[1]) * strides[1])
        begin, out = [], []
        for i in range(2):
            total = max(0, full[i] - target[i])
            begin.append(total // 2 if auto_pad == "SAME_UPPER" else total - total // 2)
            out.append(target[i] if output_shape is not None else full[i] - total)
        out_hw = (out[0], out[1])
    else:
        p = (0, 0, 0, 0) if auto_pad == "VALID" else tuple(int(v) for v in pads)
        if len(p) != 4 or min(p) < 0:
            raise MaceqError(f"{node}: pads must be 4 non-negative values, got {p}")
        out_hw = (full[0] - p[0] - p[2], full[1] - p[1] - p[3])
        begin = [p[0], p[1]]
    if min(out_hw) < 1:
        raise MaceqError(f"{node}: ConvTranspose output size {out_hw} is empty")
    w_tfl = np.ascontiguousarray(w.transpose(1, 2, 3, 0))  # [I, O, KH, KW] -> [O, KH, KW, I]
    return ConvTransposeArgs(w=w_tfl, out_hw=out_hw, pads=(int(begin[0]), int(begin[1])), strides=strides)


@dataclass(frozen=True)
class _Geometry:
    n: int
    h: int
    w: int
    c: int
    o: int
    kh: int
    kw: int
    sh: int
    sw: int
    pad_top: int
    pad_left: int
    out_h: int
    out_w: int


def _setup(x, w, bias, *, x_zp, w_zp, out_zp, strides, out_hw, pads, act_min, act_max):
    x = np.asarray(x)
    w = np.asarray(w)
    if x.ndim != 4 or w.ndim != 4:
        raise MaceqError(f"transpose_conv: input must be NHWC and filter [O, KH, KW, I], got {x.shape}, {w.shape}")
    if x.dtype != np.uint8 or w.dtype != np.uint8:
        raise MaceqError(f"transpose_conv: uint8 input and filter required, got {x.dtype}, {w.dtype}")
    n, h, wd, c = (int(v) for v in x.shape)
    o, kh, kw, ci = (int(v) for v in w.shape)
    if ci != c:
        raise MaceqError(f"transpose_conv: filter input depth {ci} != input depth {c}")
    sh, sw = (int(s) for s in strides)
    out_h, out_w = (int(v) for v in out_hw)
    if min(sh, sw) < 1 or min(out_h, out_w) < 1:
        raise MaceqError(f"transpose_conv: bad strides {strides} or output size {out_hw}")
    for name, v in (("x_zp", x_zp), ("w_zp", w_zp), ("out_zp", out_zp)):
        if not 0 <= int(v) <= 255:
            raise MaceqError(f"transpose_conv: {name}={v} outside [0, 255]")
    if not 0 <= int(act_min) <= int(act_max) <= 255:
        raise MaceqError(f"transpose_conv: activation range [{act_min}, {act_max}] not inside [0, 255]")
    if bias is None:
        b = np.zeros(o, np.int64)
    else:
        b = np.asarray(bias)
        if b.shape != (o,) or not np.issubdtype(b.dtype, np.integer):
            raise MaceqError(f"transpose_conv: bias must be integer of shape ({o},), got {b.dtype} {b.shape}")
        b = b.astype(np.int64)
        if o and (b.min() < INT32_MIN or b.max() > INT32_MAX):
            raise MaceqError("transpose_conv: bias outside int32")
    g = _Geometry(n, h, wd, c, o, kh, kw, sh, sw, int(pads[0]), int(pads[1]), out_h, out_w)
    return x, w, b, g


def _finish(acc: np.ndarray, b: np.ndarray, *, multiplier, shift, out_zp, act_min, act_max) -> np.ndarray:
    """acc (exact int64 scratch sums) -> uint8: int32 scratch + bias (wrapping), MBQM, + zp, clamp."""
    acc32 = wrap_int32(wrap_int32(acc) + b)  # both int32 additions of the C code wrap
    r = multiply_by_quantized_multiplier(acc32, int(multiplier), int(shift))
    return np.clip(np.asarray(r) + int(out_zp), int(act_min), int(act_max)).astype(np.uint8)


def transpose_conv_ref(x, w, bias=None, *, x_zp: int, w_zp: int, out_zp: int, multiplier: int, shift: int,
                       strides=(1, 1), out_hw, pads=(0, 0), act_min: int = 0, act_max: int = 255) -> np.ndarray:
    """Contract: TFLite reference_ops::TransposeConv (uint8), the scatter loop as written; uint8 NHWC out.

    ``x`` [N, H, W, I] uint8; ``w`` [O, KH, KW, I] uint8; ``bias`` int32 [O] or None;
    ``out_hw`` the output size; ``pads`` = (pad_top, pad_left) (may be negative: the output
    then starts before the full deconvolution output). Loops over every input element and
    tap like the C code, accumulating exact Python ints per output channel vector.
    """
    x, w, b, g = _setup(x, w, bias, x_zp=x_zp, w_zp=w_zp, out_zp=out_zp, strides=strides, out_hw=out_hw,
                        pads=pads, act_min=act_min, act_max=act_max)
    xi = x.astype(np.int64) - int(x_zp)
    wi = w.astype(np.int64) - int(w_zp)
    scratch = np.zeros((g.n, g.out_h, g.out_w, g.o), np.int64)
    for b_ in range(g.n):
        for in_y in range(g.h):
            for in_x in range(g.w):
                for ic in range(g.c):
                    out_y0 = in_y * g.sh - g.pad_top
                    out_x0 = in_x * g.sw - g.pad_left
                    v = int(xi[b_, in_y, in_x, ic])
                    for fy in range(g.kh):
                        for fx in range(g.kw):
                            oy, ox = out_y0 + fy, out_x0 + fx
                            if 0 <= oy < g.out_h and 0 <= ox < g.out_w:
                                # every output channel at once: (x - x_zp) * (w[oc, fy, fx, ic] - w_zp)
                                scratch[b_, oy, ox, :] += v * wi[:, fy, fx, ic]
    return _finish(scratch, b, multiplier=multiplier, shift=shift, out_zp=out_zp, act_min=act_min, act_max=act_max)


def transpose_conv(x, w, bias=None, *, x_zp: int, w_zp: int, out_zp: int, multiplier: int, shift: int,
                   strides=(1, 1), out_hw, pads=(0, 0), act_min: int = 0, act_max: int = 255) -> np.ndarray:
    """Contract: equal to :func:`transpose_conv_ref` bit for bit; GEMM + col2im on float64 BLAS.

    One exact float64 GEMM gives every input pixel's contribution to every tap,
    ``P[b, iy, ix, fy, fx, oc] = sum_ic (x - x_zp) * (w - w_zp)``; then, per tap, a strided
    add places ``P[..., fy, fx, :]`` at full-output rows ``iy * s_h + fy`` (col2im). The
    full-output buffer is indexed ``u = oy + pad_top + off`` with ``off = max(0, -pad_top)``,
    so negative pads and outputs longer than the full deconvolution (output_padding) both
    fit; the output is the window ``[pad_top + off, pad_top + off + out_h)``. Every partial
    sum is an integer below 2^53 (KH * KW * I < 2^37 products of magnitude < 2^16), so the
    float64 sums are exact; the int32 wrap and requantization follow the reference.
    """
    x, w, b, g = _setup(x, w, bias, x_zp=x_zp, w_zp=w_zp, out_zp=out_zp, strides=strides, out_hw=out_hw,
                        pads=pads, act_min=act_min, act_max=act_max)
    if g.kh * g.kw * g.c >= _F64_EXACT_TERMS:
        raise MaceqError("transpose_conv: reduction too long for exact float64 sums")
    xc = np.subtract(x, int(x_zp), dtype=np.float64).reshape(-1, g.c)  # exact, |.| <= 255
    wc = np.subtract(w, int(w_zp), dtype=np.float64)                    # [O, KH, KW, I]
    wm = wc.transpose(3, 1, 2, 0).reshape(g.c, g.kh * g.kw * g.o)        # [I, (fy, fx, oc)]
    p = (xc @ wm).reshape(g.n, g.h, g.w, g.kh, g.kw, g.o)              # exact: |sum| < 2^16 * I
    off_y, off_x = max(0, -g.pad_top), max(0, -g.pad_left)
    full_h = max((g.h - 1) * g.sh + g.kh, g.pad_top + g.out_h) + off_y
    full_w = max((g.w - 1) * g.sw + g.kw, g.pad_left + g.out_w) + off_x
    buf = np.zeros((g.n, full_h, full_w, g.o), np.float64)
    for fy in range(g.kh):
        ys = slice(off_y + fy, off_y + fy + (g.h - 1) * g.sh + 1, g.sh)
        for fx in range(g.kw):
            xs = slice(off_x + fx, off_x + fx + (g.w - 1) * g.sw + 1, g.sw)
            buf[:, ys, xs, :] += p[:, :, :, fy, fx, :]
    y0, x0 = g.pad_top + off_y, g.pad_left + off_x
    acc = buf[:, y0:y0 + g.out_h, x0:x0 + g.out_w, :].astype(np.int64)  # exact integers
    return _finish(acc, b, multiplier=multiplier, shift=shift, out_zp=out_zp, act_min=act_min, act_max=act_max)
