"""Load a MACE model and run it in the fixed-point simulation of a device.

The evaluator is a short loop over topologically sorted ops. Each op's kernel
is prepared once per (op, input quantization) into a frozen dataclass of
integers, then run on numpy arrays. With ``intermediates=True`` every tensor's
raw integer values come back with its scale and zero point.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from maceq.errors import MaceqError
from maceq.mace.format import read_model
from maceq.runtime import ops as _ops  # noqa: F401  (registers the kernels)
from maceq.runtime import ops_dsp as _ops_dsp  # noqa: F401
from maceq.runtime import ops_float as _ops_float  # noqa: F401
from maceq.runtime import ops_gpu as _ops_gpu  # noqa: F401
from maceq.runtime import ops_shape as _ops_shape  # noqa: F401
from maceq.runtime import threads as _threads
from maceq.runtime.graph import RtOp, parse_ops
from maceq.runtime.profiles import DeviceProfile, FloatStorage, get_profile
from maceq.runtime.qtypes import QInfo, QTensor
from maceq.runtime.registry import _REGISTRY, DType, lookup


@dataclass
class RunResult:
    outputs: dict[str, np.ndarray]
    tensors: dict[str, QTensor] = field(default_factory=dict)


@dataclass(frozen=True)
class PrepareContext:
    profile: DeviceProfile
    consts: dict
    const_qinfo: dict


class Model:
    """A loaded MACE model: ``model.run({name: array}, device="cpu")``."""

    def __init__(self, loaded):
        self.loaded = loaded
        self.net_def = loaded.net_def
        self.consts: dict[str, np.ndarray] = loaded.arrays
        self.const_qinfo = {t.name: QInfo(float(t.scale), int(t.zero_point), float(t.minval), float(t.maxval))
                            for t in self.net_def.tensors}
        self.ops: list[RtOp] = parse_ops(self.net_def)
        self.input_names = [i.name for i in self.net_def.input_info]
        self.output_names = [o.name for o in self.net_def.output_info]
        self.input_info = {i.name: i for i in self.net_def.input_info}
        self.output_info = {o.name: o for o in self.net_def.output_info}
        self.deployment = loaded.deployment or {}
        self.input_formats = self._input_formats()
        self._prepared: dict = {}
        self._kernels: dict = {}

    def _input_formats(self) -> dict[str, str]:
        formats = {n: "NCHW" if len(self.input_info[n].dims) == 4 else "NONE" for n in self.input_names}
        for model in (self.deployment.get("models") or {}).values():
            for sub in model.get("subgraphs") or []:
                for name, fmt in zip(sub.get("input_tensors") or [], sub.get("input_data_formats") or []):
                    if name in formats:
                        formats[name] = str(fmt).upper()
        return formats

    @property
    def maceq_meta(self) -> dict:
        return self.deployment.get("maceq") or {}

    def input_shape(self, name: str) -> tuple[int, ...]:
        """The input's shape in the layout the caller feeds (NCHW for 4-D inputs by default)."""
        dims = tuple(int(d) for d in self.input_info[name].dims)
        if len(dims) == 4 and self.input_formats[name] == "NCHW":
            return (dims[0], dims[3], dims[1], dims[2])
        return dims

    def _kernel(self, op: RtOp, profile: DeviceProfile, backend: str = "numpy"):
        dtype = DType.from_mace(op.arg("T"))
        if op.type in ("Quantize", "Dequantize"):
            dtype = DType.UINT8  # their T is the quantized side
        key = (profile.device, op.type, dtype, backend)
        k = self._kernels.get(key)
        if k is None:
            k = self._kernels[key] = lookup(op.type, profile.device, dtype=dtype, op_name=op.name)()
            if backend != "numpy" and hasattr(k, "backend"):
                k.backend = _backend(backend)
        return k

    def _prepare(self, idx: int, op: RtOp, kernel, in_q: tuple, profile: DeviceProfile):
        key = (profile.device, idx, in_q)
        params = self._prepared.get(key)
        if params is None:
            ctx = PrepareContext(profile, self.consts, self.const_qinfo)
            try:
                params = kernel.prepare(op, in_q, ctx)
            except MaceqError as e:
                msg = str(e)
                raise MaceqError(msg if msg.startswith(f"op '{op.name}'") else f"op '{op.name}' ({op.type}): {msg}") from None
            if len(self._prepared) > 4096:
                self._prepared.clear()
            self._prepared[key] = params
        return params

    def placement(self, device: str) -> dict[str, tuple[str, str]]:
        """Op name -> (where it runs, why it fell back), from one run on a probe input.

        On dsp, ops nnlib lacks or rejects run the cpu profile's kernels; the report counts the
        boundary transfers between the two.
        """
        profile = get_profile(device)
        out = {}
        for op, kernel, params in self.probe(profile):
            out[op.name] = _placement_of(op, kernel, params, profile.device)
        return out

    def probe(self, profile: DeviceProfile) -> list[tuple]:
        """(op, kernel, params) of every op, prepared by one run on a deterministic probe input."""
        probe = {}
        for n in self.input_names:  # a deterministic ramp: a constant input gives some kernels an empty range
            shape = (1,) + tuple(self.input_shape(n)[1:])
            probe[n] = np.linspace(-1.0, 1.0, int(np.prod(shape)), dtype=np.float32).reshape(shape)
        self.run(probe, device=profile.device.value)
        return [(op, self._kernel(op, profile),
                 next((p for k, p in self._prepared.items() if k[0] is profile.device and k[1] == idx), None))
                for idx, op in enumerate(self.ops)]

    def deviations(self, device: str) -> dict[str, str]:
        """Op name -> how the device's result departs from the convolution the model means.

        Only ops whose device path computes something else are listed (today: uint8 3x3 depthwise
        convolutions that take TFLite's aarch64 fast path with a wrong border, see
        runtime/kernels/dw3x3_arm.py). The simulation computes what the device computes either way;
        this says where that differs from the model's meaning. Found from one probe run, like
        :meth:`placement`; an op whose requantization depends on the input's range is judged on it.
        """
        shapes = {i.name: tuple(int(d) for d in i.dims) for i in self.net_def.input_info}
        shapes.update({name: tuple(a.shape) for name, a in self.consts.items()})
        for op in self.ops:
            shapes.update(zip(op.outputs, op.output_shapes))
        out = {}
        for op, kernel, params in self.probe(get_profile(device)):
            note = getattr(kernel, "deviation", None)
            if note is not None and params is not None:
                why = note(params, [shapes.get(i) for i in op.inputs])
                if why:
                    out[op.name] = why
        return out

    @property
    def tensor_map(self) -> dict[str, str]:
        """MACE tensor name -> the source-graph tensor it holds (recorded by the writer; identity elsewhere)."""
        return dict(self.maceq_meta.get("tensor_map") or {})

    def run_op(self, op: RtOp, inputs: list, *, device: str = "cpu") -> list:
        """Run one op on given QTensors (constants are looked up): the isolated-layer analysis uses this."""
        profile = get_profile(device)
        kernel = self._kernel(op, profile)
        ins = [t if t is not None else QTensor(self.consts[name], self.const_qinfo.get(name))
               for name, t in zip(op.inputs, list(inputs) + [None] * (len(op.inputs) - len(inputs)))]
        ctx = PrepareContext(profile, self.consts, self.const_qinfo)
        return kernel.run(kernel.prepare(op, tuple(t.qinfo for t in ins), ctx), ins)

    def boundary_transfers(self, placement: dict[str, tuple[str, str]]) -> int:
        """Tensors that cross from one processor to the other (each consumer edge counted once)."""
        where_made = {o: placement[op.name][0] for op in self.ops for o in op.outputs}
        return sum(1 for op in self.ops for i in op.inputs
                   if i in where_made and where_made[i] != placement[op.name][0])

    def run(self, inputs: dict[str, np.ndarray], *, device: str = "cpu", intermediates: bool = False,
            backend: str = "numpy", before_op=None, threads: int | None = None):
        """Run the model on float inputs; returns {output: float32 array}, or a RunResult with intermediates.

        ``backend``: "numpy" (the bit-exact simulation, default) or "opencl" (the gpu device's real
        OpenCL kernels through pyopencl; ops without an OpenCL kernel still use the simulation).
        ``before_op(index, op, inputs)``: called with each op's input QTensors before the op runs; it
        may replace the op's constants in ``self.consts``/``self.const_qinfo`` and then returns True,
        so that the op is prepared again (the sequential bias correction uses this).
        ``threads``: how many threads the compiled kernels use (default: runtime/threads.py); the
        results do not depend on it.
        """
        with _threads.section(threads):
            return self._run(inputs, device=device, intermediates=intermediates, backend=backend,
                             before_op=before_op)

    def _run(self, inputs, *, device, intermediates, backend, before_op):
        profile = get_profile(device)
        if backend not in ("numpy", "opencl"):
            raise MaceqError(f"unknown backend '{backend}' (choose numpy or opencl)")
        if backend == "opencl" and profile.device.value != "gpu":
            raise MaceqError("--backend opencl runs the gpu device's kernels: use it with --device gpu")
        built_for = self.maceq_meta.get("device")
        if built_for and built_for != profile.device.value:
            raise MaceqError(f"this model was quantized for the {built_for} device; run it with --device {built_for} "
                             f"(or quantize again with --device {profile.device.value})")
        values: dict[str, QTensor] = {}
        for name in self.input_names:
            if name not in inputs:
                raise MaceqError(f"missing input '{name}' (model inputs: {', '.join(self.input_names)})")
            x = np.asarray(inputs[name], dtype=np.float32)
            want = self.input_shape(name)
            if x.ndim != len(want) or tuple(x.shape[1:]) != tuple(want[1:]):
                raise MaceqError(f"input '{name}' has shape {tuple(x.shape)}, the model expects "
                                 f"{('N',) + tuple(want[1:])}")
            if x.ndim == 4 and self.input_formats[name] == "NCHW":
                x = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
            values[name] = QTensor(x, None)
        for name in inputs:
            if name not in self.input_info:
                raise MaceqError(f"unknown input '{name}' (model inputs: {', '.join(self.input_names)})")
        for idx, op in enumerate(self.ops):
            kernel = self._kernel(op, profile, backend)
            ins = []
            for i in op.inputs:
                if i in values:
                    ins.append(values[i])
                elif i in self.consts:
                    ins.append(QTensor(self.consts[i], self.const_qinfo.get(i)))
                else:
                    raise MaceqError(f"op '{op.name}': input '{i}' is not available")
            if before_op is not None and before_op(idx, op, ins):
                ins = [QTensor(self.consts[i], self.const_qinfo.get(i)) if i in self.consts and i not in values
                       else t for i, t in zip(op.inputs, ins)]
                self._prepared = {k: v for k, v in self._prepared.items() if k[1] != idx}
            in_q = tuple(t.qinfo for t in ins)
            params = self._prepare(idx, op, kernel, in_q, profile)
            half = profile.float_storage is FloatStorage.FLOAT16 and kernel.dtype is DType.FLOAT
            if half and not getattr(kernel, "half_storage", False):
                # fp16_fp32 mode: float ops compute in float32 from half-stored inputs ...
                ins = [QTensor(t.values.astype(np.float32), t.qinfo) if t.values.dtype == np.float16 else t
                       for t in ins]
            outs = kernel.run(params, ins)
            if half:
                # ... and store half
                outs = [QTensor(t.values.astype(np.float16), None) if t.qinfo is None and
                        np.issubdtype(t.values.dtype, np.floating) else t for t in outs]
            for name, t in zip(op.outputs, outs):
                values[name] = t
        outputs = {}
        for name in self.output_names:
            t = values[name]
            y = t.values.astype(np.float32) if t.qinfo is None else t.dequantize()
            info = self.output_info[name]
            rank = len(info.dims)
            if rank == 4:
                if y.ndim == 4 and info.data_format == 1:
                    y = y.transpose(0, 3, 1, 2)  # device NHWC -> caller NCHW
            else:
                y = y.reshape((y.shape[0],) + tuple(int(d) for d in info.dims[1:]))
            outputs[name] = np.ascontiguousarray(y, dtype=np.float32)
        if intermediates:
            return RunResult(outputs, values)
        return outputs


_BACKENDS: dict = {}


def _placement_of(op: RtOp, kernel, params, device) -> tuple[str, str]:
    """Where an op runs on ``device``: its own kernel, or the cpu profile's (fallback) with the reason."""
    if device.value == "cpu":
        return "cpu", ""
    if getattr(params, "on_dsp", True) is False:
        return "cpu", getattr(params, "reason", "")
    if (op.type, kernel.dtype, device) in _REGISTRY or kernel.dtype.value == "float" and device.value == "gpu":
        return device.value, ""
    return "cpu", f"no {device.value} kernel for {op.type}"


def _backend(name: str):
    """The shared OpenCL backend (created on first use: context and programs are built once)."""
    if name not in _BACKENDS:
        from maceq.runtime.opencl.backend import OpenCLBackend

        _BACKENDS[name] = OpenCLBackend()
    return _BACKENDS[name]


def load(path: str | os.PathLike) -> Model:
    """Load a MACE model from its deployment .yml or its .pb (the .data beside it)."""
    return Model(read_model(path))
