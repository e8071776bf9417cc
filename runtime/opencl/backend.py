"""Run the gpu device's OpenCL kernels (runtime/opencl/*.cl) through pyopencl.

:class:`OpenCLBackend` has one method per op, with the signature of the numpy simulation
in :mod:`maceq.runtime.kernels.gpu` (without the ``gpu_`` prefix): ``conv2d``,
``depthwise_conv2d``, ``fully_connected``, ``eltwise_add``, ``max_pool``, ``avg_pool``,
``global_avg_pool``, ``concat``, ``quantize``, ``dequantize``, ``dequantize_half``,
``quantize_half``, ``exp_f32``, ``half_softmax``, ``half_activation``, ``half_mul``,
``half_resize_bilinear``, ``float_softmax``, ``float_activation``, ``float_mul``,
``float_resize_bilinear``. Each returns what the simulation returns, bit for bit
(tests/test_gpu_opencl.py runs both on PoCL).

Launch rules: 1-D NDRange, one work item per output element (per row for softmax), a
fixed local size of :attr:`OpenCLBackend.LOCAL_SIZE` and the global size padded up to a
multiple of it (each kernel returns when ``gid >= total``). PoCL compiles machine code
per (kernel, local size) on the first launch; a fixed local size keeps that to once per
kernel. Programs are built lazily, once per .cl file, from the sources shipped in this
package (``importlib.resources``) with ``common.cl`` prepended and the build option
``-cl-fp32-correctly-rounded-divide-sqrt``.

The context is created on first use, on the first device of the first OpenCL platform
(or the first whose device name contains ``device``). ``POCL_CACHE_DIR`` is taken from
the environment; when unset, a fresh temporary folder is used. No pyopencl, no platform
or no device raises :class:`MaceqError`.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from importlib import resources

import numpy as np

from maceq.errors import MaceqError
from maceq.runtime.kernels import gpu as _sim
from maceq.runtime.kernels.concat import _qpair

__all__ = ["OpenCLBackend", "kernel_source"]

_COMMON = "common.cl"
_KERNEL_FILES = {
    "conv2d_u8": "conv.cl",
    "eltwise_u8": "eltwise.cl",
    "requant_u8": "eltwise.cl",
    "pool_u8": "pool.cl",
    "quantize_f32": "quantize.cl",
    "dequantize_u8": "quantize.cl",
    "dequantize_half": "quantize.cl",
    "quantize_half": "quantize.cl",
    "exp_f32_buf": "float_ops.cl",
    "softmax_half": "float_ops.cl",
    "activation_half": "float_ops.cl",
    "mul_half": "float_ops.cl",
    "resize_bilinear_half": "float_ops.cl",
}

_i32 = np.int32
_f32 = np.float32


def kernel_source(filename: str) -> str:
    """The text of one shipped .cl file (``common.cl`` + the kernel file is what gets built)."""
    try:
        return resources.files("maceq.runtime.opencl").joinpath(filename).read_text(encoding="utf-8")
    except (FileNotFoundError, OSError) as e:
        raise MaceqError(f"OpenCL kernel source {filename} not found in maceq.runtime.opencl: {e}") from None


class OpenCLBackend:
    """The gpu device's int8 kernels on an OpenCL device (PoCL's CPU device in the tests)."""

    LOCAL_SIZE = 64
    BUILD_OPTIONS = ("-cl-fp32-correctly-rounded-divide-sqrt",)

    def __init__(self, *, device: str | None = None):
        self._device_filter = device
        self._cl = None
        self._ctx = None
        self._queue = None
        self._device = None
        self._programs: dict = {}
        self._kernels: dict = {}

    # ------------------------------------------------------------------ setup

    def _init(self):
        if self._ctx is not None:
            return
        os.environ.setdefault("POCL_CACHE_DIR", tempfile.mkdtemp(prefix="maceq-pocl-"))
        try:
            import pyopencl as cl
        except ImportError as e:
            raise MaceqError(f"gpu device: pyopencl is not installed ({e}); "
                             "pip install 'maceq[opencl]' (pyopencl + pocl-binary-distribution)") from None
        try:
            platforms = cl.get_platforms()
        except (cl.Error, RuntimeError) as e:
            raise MaceqError(f"gpu device: no OpenCL platform ({e}); "
                             "install pocl-binary-distribution or a vendor OpenCL driver") from None
        devices = []
        for p in platforms:
            try:
                devices += p.get_devices()
            except cl.Error:
                continue
        if self._device_filter is not None:
            devices = [d for d in devices if self._device_filter.lower() in d.name.lower()]
        if not devices:
            want = f" matching {self._device_filter!r}" if self._device_filter else ""
            raise MaceqError(f"gpu device: no OpenCL device{want} on platforms "
                             f"{[p.name for p in platforms]}")
        self._cl = cl
        self._device = devices[0]
        self._ctx = cl.Context([self._device])
        self._queue = cl.CommandQueue(self._ctx)

    @property
    def device_name(self) -> str:
        """``platform: device`` of the device in use (creates the context)."""
        self._init()
        return f"{self._device.platform.name}: {self._device.name}"

    def _kernel(self, name: str):
        k = self._kernels.get(name)
        if k is not None:
            return k
        self._init()
        fname = _KERNEL_FILES[name]
        prg = self._programs.get(fname)
        if prg is None:
            src = kernel_source(_COMMON) + "\n" + kernel_source(fname)
            try:
                prg = self._cl.Program(self._ctx, src).build(options=list(self.BUILD_OPTIONS))
            except self._cl.Error as e:
                raise MaceqError(f"gpu device: building {fname} failed: {e}") from None
            self._programs[fname] = prg
        k = self._cl.Kernel(prg, name)
        self._kernels[name] = k
        return k

    def _buf_in(self, a: np.ndarray):
        mf = self._cl.mem_flags
        return self._cl.Buffer(self._ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(a))

    def _buf_out(self, nbytes: int):
        return self._cl.Buffer(self._ctx, self._cl.mem_flags.READ_WRITE, max(int(nbytes), 1))

    def _launch(self, name: str, total: int, *args) -> None:
        ls = self.LOCAL_SIZE
        g = -(-total // ls) * ls
        self._kernel(name)(self._queue, (g,), (ls,), *args, _i32(total))

    def _read(self, buf, shape, dtype) -> np.ndarray:
        out = np.empty(shape, dtype=dtype)
        self._cl.enqueue_copy(self._queue, out, buf)
        return out

    def _run(self, name: str, inputs: Sequence[np.ndarray], out_shape, out_dtype, *scalars,
             rows: int | None = None) -> np.ndarray:
        """Upload ``inputs``, launch ``name`` over ``rows`` (default: every output element), read back."""
        out_shape = tuple(int(s) for s in out_shape)
        total = int(np.prod(out_shape)) if rows is None else int(rows)
        if total == 0 or int(np.prod(out_shape)) == 0:
            return np.zeros(out_shape, dtype=out_dtype)
        self._init()
        bufs = [self._buf_in(a) for a in inputs]
        ob = self._buf_out(int(np.prod(out_shape)) * np.dtype(out_dtype).itemsize)
        self._launch(name, total, *bufs, ob, *scalars)
        return self._read(ob, out_shape, out_dtype)

    # ------------------------------------------------------------------ int8 kernels

    def _conv(self, op, x, w, bias, x_zp, out_zp, scale_c, strides, pads, dilations, depthwise):
        a = _sim.conv_args(op, x, w, bias, x_zp=x_zp, out_zp=out_zp, scale_c=scale_c, strides=strides,
                           pads=pads, dilations=dilations, depthwise=depthwise)
        n, h, wd, _ = a.x.shape
        (sh, sw), (dh, dw), (t, l, _, _) = a.strides, a.dilations, a.pads
        if depthwise:  # [KH, KW, C, M] -> [C*M, KH, KW, 1]: output channel c*M + m is group c
            wk, groups = a.w.transpose(2, 3, 0, 1).reshape(a.o, a.kh, a.kw, 1), a.c
        else:
            wk, groups = a.w, 1
        return self._run("conv2d_u8", [a.x, wk, a.bias.astype(np.int32), a.scale], (n, a.oh, a.ow, a.o), np.uint8,
                         *map(_i32, (h, wd, a.c, a.o, groups, a.kh, a.kw, a.oh, a.ow, sh, sw, t, l, dh, dw,
                                     a.x_zp, a.out_zp)))

    def conv2d(self, x, w, bias=None, *, x_zp: int, out_zp: int, scale_c, strides=(1, 1),
               pads=(0, 0, 0, 0), dilations=(1, 1)) -> np.ndarray:
        """Kernel ``conv2d_u8``; see :func:`maceq.runtime.kernels.gpu.gpu_conv2d`."""
        return self._conv("conv2d", x, w, bias, x_zp, out_zp, scale_c, strides, pads, dilations, False)

    def depthwise_conv2d(self, x, w, bias=None, *, x_zp: int, out_zp: int, scale_c, strides=(1, 1),
                         pads=(0, 0, 0, 0), dilations=(1, 1)) -> np.ndarray:
        """Kernel ``conv2d_u8`` with groups = C; see :func:`maceq.runtime.kernels.gpu.gpu_depthwise_conv2d`."""
        return self._conv("depthwise_conv2d", x, w, bias, x_zp, out_zp, scale_c, strides, pads, dilations, True)

    def fully_connected(self, x, w, bias=None, *, x_zp: int, out_zp: int, scale_c) -> np.ndarray:
        """Kernel ``conv2d_u8`` as a 1x1 Conv2D on a 1x1 image; see ``gpu_fully_connected``."""
        op = "fully_connected"
        x = _sim._u8(op, x, 2)
        w = _sim._i8(op, w, 2)
        if x.shape[1] != w.shape[1]:
            raise MaceqError(f"{op}: input depth {x.shape[1]} != weight depth {w.shape[1]}")
        n, k = x.shape
        o = w.shape[0]
        y = self._conv(op, x.reshape(n, 1, 1, k), w.reshape(o, 1, 1, k), bias, x_zp, out_zp, scale_c,
                       (1, 1), (0, 0, 0, 0), (1, 1), False)
        return y.reshape(n, o)

    # ------------------------------------------------------------------ uint8 <-> float32 ops

    def eltwise_add(self, a, b, *, a_scale: float, a_zp: int, b_scale: float, b_zp: int,
                    out_scale: float, out_zp: int, subtract: bool = False) -> np.ndarray:
        """Kernel ``eltwise_u8`` (inputs broadcast on the host); see ``gpu_eltwise_add``."""
        op = "eltwise_add"
        a, b = _sim._u8(op, a), _sim._u8(op, b)
        try:
            a, b = np.broadcast_arrays(a, b)
        except ValueError:
            raise MaceqError(f"{op}: shapes {a.shape} and {b.shape} do not broadcast") from None
        return self._run("eltwise_u8", [a, b], a.shape, np.uint8,
                         _sim._scale(op, "a_scale", a_scale), _i32(_sim._zp(op, "a_zp", a_zp)),
                         _sim._scale(op, "b_scale", b_scale), _i32(_sim._zp(op, "b_zp", b_zp)),
                         _sim.gpu_inverse_scale(out_scale), _i32(_sim._zp(op, "out_zp", out_zp)),
                         _i32(1 if subtract else 0))

    def _requant(self, x, in_scale, in_zp, out_scale, out_zp) -> np.ndarray:
        return self._run("requant_u8", [x], x.shape, np.uint8, _f32(in_scale), _i32(in_zp),
                         _sim.gpu_inverse_scale(out_scale), _i32(out_zp))

    def concat(self, inputs: Sequence, *, axis: int, in_qinfos: Sequence, out_scale: float,
               out_zp: int) -> np.ndarray:
        """Kernel ``requant_u8`` on inputs whose quantization differs, then a host concatenation."""
        op = "concat"
        arrs = [_sim._u8(op, a) for a in inputs]
        if not arrs:
            raise MaceqError(f"{op}: no inputs")
        if len(in_qinfos) != len(arrs):
            raise MaceqError(f"{op}: {len(arrs)} inputs but {len(in_qinfos)} quantize infos")
        so, zo = _sim._scale(op, "out_scale", out_scale), _sim._zp(op, "out_zp", out_zp)
        parts = []
        for a, q in zip(arrs, in_qinfos):
            si, zi = _qpair(q)
            si, zi = _sim._scale(op, "input scale", si), _sim._zp(op, "input zero point", zi)
            parts.append(a if (si == so and zi == zo) else self._requant(a, si, zi, so, zo))
        try:
            return np.concatenate(parts, axis=axis)
        except (ValueError, np.exceptions.AxisError) as e:
            raise MaceqError(f"{op}: {e}") from None

    def quantize(self, x, *, scale: float, zero_point: int) -> np.ndarray:
        """Kernel ``quantize_f32``; see ``gpu_quantize``."""
        x = np.asarray(x, dtype=_f32)
        return self._run("quantize_f32", [x], x.shape, np.uint8,
                         _sim.gpu_inverse_scale(scale), _i32(_sim._zp("quantize", "zero_point", zero_point)))

    def dequantize(self, q, *, scale: float, zero_point: int) -> np.ndarray:
        """Kernel ``dequantize_u8``; see ``gpu_dequantize``."""
        op = "dequantize"
        q = _sim._u8(op, q)
        return self._run("dequantize_u8", [q], q.shape, _f32, _sim._scale(op, "scale", scale),
                         _i32(_sim._zp(op, "zero_point", zero_point)))

    # ------------------------------------------------------------------ pooling

    def _pool(self, op, x, kernel, strides, pads, average: bool):
        x = _sim._u8(op, x, 4)
        kh, kw, sh, sw, (t, l, _, _), oh, ow = _sim._pool_geometry(op, x, kernel, strides, pads)
        n, h, w, c = x.shape
        return self._run("pool_u8", [x], (n, oh, ow, c), np.uint8,
                         *map(_i32, (h, w, c, kh, kw, oh, ow, sh, sw, t, l, average)))

    def max_pool(self, x, *, kernel, strides, pads=(0, 0, 0, 0)) -> np.ndarray:
        """Kernel ``pool_u8`` (max); see ``gpu_max_pool``."""
        return self._pool("max_pool", x, kernel, strides, pads, False)

    def avg_pool(self, x, *, kernel, strides, pads=(0, 0, 0, 0)) -> np.ndarray:
        """Kernel ``pool_u8`` (average); see ``gpu_avg_pool``."""
        return self._pool("avg_pool", x, kernel, strides, pads, True)

    def global_avg_pool(self, x) -> np.ndarray:
        """Kernel ``pool_u8`` (average) over the whole image; see ``gpu_global_avg_pool``."""
        x = _sim._u8("global_avg_pool", x, 4)
        return self.avg_pool(x, kernel=(x.shape[1], x.shape[2]), strides=(1, 1))

    # ------------------------------------------------------------------ float path (half storage)

    def dequantize_half(self, q, *, scale: float, zero_point: int) -> np.ndarray:
        """Kernel ``dequantize_half`` -> float16 array; see ``gpu_dequantize_half``."""
        op = "dequantize_half"
        q = _sim._u8(op, q)
        return self._run("dequantize_half", [q], q.shape, np.float16, _sim._scale(op, "scale", scale),
                         _i32(_sim._zp(op, "zero_point", zero_point)))

    def quantize_half(self, h, *, scale: float, zero_point: int) -> np.ndarray:
        """Kernel ``quantize_half`` (float16 in); see ``gpu_quantize_half``."""
        op = "quantize_half"
        h = self._f16(op, h)
        return self._run("quantize_half", [h], h.shape, np.uint8, _sim.gpu_inverse_scale(scale),
                         _i32(_sim._zp(op, "zero_point", zero_point)))

    @staticmethod
    def _f16(op: str, h) -> np.ndarray:
        h = np.asarray(h)
        if h.dtype != np.float16:
            raise MaceqError(f"{op}: expected float16 (half storage), got {h.dtype}")
        return h

    def exp_f32(self, x) -> np.ndarray:
        """Kernel ``exp_f32_buf``: the kernels' shared ``exp_f32`` on float32 values; see ``gpu_exp_f32``."""
        x = np.asarray(x, dtype=_f32)
        return self._run("exp_f32_buf", [x], x.shape, _f32)

    def half_softmax(self, h) -> np.ndarray:
        """Kernel ``softmax_half`` over the last axis; see ``gpu_half_softmax``."""
        h = self._f16("half_softmax", h)
        if h.ndim < 1 or h.shape[-1] == 0:
            raise MaceqError(f"half_softmax: empty last axis, shape {h.shape}")
        depth = h.shape[-1]
        return self._run("softmax_half", [h], h.shape, np.float16, _i32(depth), rows=h.size // depth)

    def half_activation(self, h, *, kind, alpha=None, beta=None) -> np.ndarray:
        """Kernel ``activation_half``; see ``gpu_half_activation``."""
        kind, a, b = _sim._act_args(kind, alpha, beta)
        h = self._f16("half_activation", h)
        return self._run("activation_half", [h], h.shape, np.float16, _i32(kind.code), a, b)

    def half_mul(self, ha, hb) -> np.ndarray:
        """Kernel ``mul_half`` (inputs broadcast on the host); see ``gpu_half_mul``."""
        a, b = self._f16("half_mul", ha), self._f16("half_mul", hb)
        try:
            a, b = np.broadcast_arrays(a, b)
        except ValueError:
            raise MaceqError(f"half_mul: shapes {a.shape} and {b.shape} do not broadcast") from None
        return self._run("mul_half", [a, b], a.shape, np.float16)

    def half_resize_bilinear(self, h, *, out_hw, align_corners: bool = False,
                             half_pixel_centers: bool = False) -> np.ndarray:
        """Kernel ``resize_bilinear_half``; see ``gpu_half_resize_bilinear``."""
        op = "half_resize_bilinear"
        h = self._f16(op, h)
        if h.ndim != 4:
            raise MaceqError(f"{op}: input must be NHWC, got shape {h.shape}")
        oh, ow = _sim._pair(op, "out_hw", out_hw)
        if align_corners and half_pixel_centers:
            raise MaceqError(f"{op}: align_corners and half_pixel_centers cannot both be set")
        n, ih, iw, c = h.shape
        hs = _sim.resize_scale(ih, oh, align_corners=align_corners)
        ws = _sim.resize_scale(iw, ow, align_corners=align_corners)
        return self._run("resize_bilinear_half", [h], (n, oh, ow, c), np.float16,
                         *map(_i32, (ih, iw, c, oh, ow)), hs, ws, _i32(1 if half_pixel_centers else 0))

    def float_softmax(self, x, *, in_scale: float, in_zp: int, out_scale: float, out_zp: int) -> np.ndarray:
        """dequantize_half -> softmax_half -> quantize_half; see ``gpu_float_softmax``."""
        h = self.dequantize_half(x, scale=in_scale, zero_point=in_zp)
        return self.quantize_half(self.half_softmax(h), scale=out_scale, zero_point=out_zp)

    def float_activation(self, x, *, kind, alpha=None, beta=None, in_scale: float, in_zp: int,
                         out_scale: float, out_zp: int) -> np.ndarray:
        """dequantize_half -> activation_half -> quantize_half; see ``gpu_float_activation``."""
        h = self.dequantize_half(x, scale=in_scale, zero_point=in_zp)
        y = self.half_activation(h, kind=kind, alpha=alpha, beta=beta)
        return self.quantize_half(y, scale=out_scale, zero_point=out_zp)

    def float_mul(self, a, b, *, a_scale: float, a_zp: int, b_scale: float, b_zp: int,
                  out_scale: float, out_zp: int) -> np.ndarray:
        """dequantize_half (both) -> mul_half -> quantize_half; see ``gpu_float_mul``."""
        ha = self.dequantize_half(a, scale=a_scale, zero_point=a_zp)
        hb = self.dequantize_half(b, scale=b_scale, zero_point=b_zp)
        return self.quantize_half(self.half_mul(ha, hb), scale=out_scale, zero_point=out_zp)

    def float_resize_bilinear(self, x, *, out_hw, align_corners: bool = False, half_pixel_centers: bool = False,
                              in_scale: float, in_zp: int, out_scale: float, out_zp: int) -> np.ndarray:
        """dequantize_half -> resize_bilinear_half -> quantize_half; see ``gpu_float_resize_bilinear``."""
        h = self.dequantize_half(_sim._u8("float_resize_bilinear", x, 4), scale=in_scale, zero_point=in_zp)
        y = self.half_resize_bilinear(h, out_hw=out_hw, align_corners=align_corners,
                                      half_pixel_centers=half_pixel_centers)
        return self.quantize_half(y, scale=out_scale, zero_point=out_zp)
