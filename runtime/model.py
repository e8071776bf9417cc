"""Load a MACE model and run it in the fixed-point simulation of a device.

The evaluator is a short loop over topologically sorted ops. A :class:`Plan` holds each op
prepared for one device (a :class:`PreparedOp`: kernel, frozen params, weight-derived plan,
placement, float storage), once per input quantization; ``run`` feeds the inputs, runs the
prepared ops in order and reads the outputs. With ``intermediates=True`` every tensor's raw
values come back with its scale and zero point.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from maceq.errors import MaceqError
from maceq.mace.enums import DataFormat
from maceq.mace.format import read_model
from maceq.runtime import ops as _ops  # noqa: F401  (registers the kernels)
from maceq.runtime import ops_dsp as _ops_dsp  # noqa: F401
from maceq.runtime import ops_float as _ops_float  # noqa: F401
from maceq.runtime import ops_gpu as _ops_gpu  # noqa: F401
from maceq.runtime import ops_shape as _ops_shape  # noqa: F401
from maceq.runtime import threads as _threads
from maceq.runtime.devices import Device, DeviceSpec, device_spec
from maceq.runtime.graph import RtOp, parse_ops
from maceq.runtime.kernel import Kernel, PrepareContext, PreparedOp
from maceq.runtime.kernels.layout import nchw_to_nhwc
from maceq.runtime.qtypes import QInfo, QTensor
from maceq.runtime.registry import lookup, op_dtype, prepare_op

__all__ = ["Model", "Plan", "PrepareContext", "PreparedOp", "QTensor", "RunResult", "load"]

#: ``Model.run``'s backends: the numpy simulation, or the gpu device's OpenCL kernels through pyopencl
BACKENDS = ("numpy", "opencl")
#: A plan holds at most this many PreparedOps (it starts over when full).
MAX_PREPARED = 4096


@dataclass
class RunResult:
    outputs: dict[str, np.ndarray]
    tensors: dict[str, QTensor] = field(default_factory=dict)


class Plan:
    """A model's ops prepared for one device and backend: a PreparedOp per op and input quantization.

    Quantization flows with the data (the cpu's input Quantize finds its range on every input,
    some nnlib ops find their output range from it), so an op is prepared when an input
    quantization first reaches it; later runs that bring the same quantization reuse it.
    """

    def __init__(self, model: "Model", ctx: PrepareContext):
        self.model, self.ctx = model, ctx
        self._prepared: list[dict[tuple, PreparedOp]] = [{} for _ in model.ops]
        self._last: list[tuple | None] = [None] * len(model.ops)  # per op: (its last inputs' QInfos, PreparedOp)
        self._count = 0
        self._consts: dict[str, QTensor] = {}  # the constants as QTensors, made again when one is replaced

    def inputs(self, idx: int, values: dict[str, QTensor]) -> list[QTensor]:
        """Op ``idx``'s input tensors: from ``values``, else the model's constants."""
        m = self.model
        op = m.ops[idx]
        ins = []
        for name in op.inputs:
            t = values.get(name)
            if t is None:
                v, q, t = m.consts.get(name), m.const_qinfo.get(name), self._consts.get(name)
                if v is None:
                    raise MaceqError(f"op '{op.name}': input '{name}' is not available")
                if t is None or t.values is not v or t.qinfo is not q:
                    t = self._consts[name] = QTensor(v, q)
            ins.append(t)
        return ins

    def prepared(self, idx: int, ins: list[QTensor]) -> PreparedOp:
        """Op ``idx`` prepared for the quantization of ``ins``: the last one while the inputs bring the same QInfo
        objects (a run's tensors carry their op's one output QInfo), else looked up by their values."""
        last = self._last[idx]
        if last is not None and len(last[0]) == len(ins) and all(t.qinfo is q for t, q in zip(ins, last[0])):
            return last[1]
        in_q = tuple(t.qinfo for t in ins)
        hit = self._prepared[idx].get(in_q)
        if hit is not None:
            self._last[idx] = (in_q, hit)
            return hit
        if self._count >= MAX_PREPARED:
            self._prepared, self._count, self._last = [{} for _ in self._prepared], 0, [None] * len(self._prepared)
        hit = self._prepared[idx][in_q] = self.model.prepare(self.model.ops[idx], in_q, self.ctx)
        self._count += 1
        self._last[idx] = (in_q, hit)
        return hit

    def step(self, idx: int, values: dict[str, QTensor]) -> tuple[PreparedOp, list[QTensor]]:
        """Op ``idx`` prepared for its inputs in ``values``, and those inputs."""
        ins = self.inputs(idx, values)
        return self.prepared(idx, ins), ins

    def forget(self, idx: int) -> None:
        """Drop op ``idx``'s PreparedOps (its constants changed)."""
        self._count -= len(self._prepared[idx])
        self._prepared[idx], self._last[idx] = {}, None


class _Hooked:
    """A plan whose ``before_op(index, op, inputs)`` sees each op's inputs before it runs; when the
    hook returns True (it replaced the op's constants), the op is read and prepared again."""

    def __init__(self, plan: Plan, before_op):
        self.plan, self.before_op = plan, before_op

    def step(self, idx: int, values: dict[str, QTensor]) -> tuple[PreparedOp, list[QTensor]]:
        ins = self.plan.inputs(idx, values)
        if self.before_op(idx, self.plan.model.ops[idx], ins):
            self.plan.model.forget(idx)
            ins = self.plan.inputs(idx, values)
        return self.plan.prepared(idx, ins), ins


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
        #: (device, backend) -> Plan
        self._prepared: dict[tuple[Device, str], Plan] = {}
        #: (device, op type, dtype) -> kernel instance
        self._kernels: dict[tuple, Kernel] = {}
        self._drops = self._last_uses()

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

    def _kernel(self, op: RtOp, device: Device) -> Kernel:
        key = (device, op.type, op_dtype(op))
        k = self._kernels.get(key)
        if k is None:
            k = self._kernels[key] = lookup(op.type, device, dtype=key[2], op_name=op.name)()
        return k

    def context(self, device: "Device | str" = Device.CPU, backend: str = "numpy") -> PrepareContext:
        """What the model's kernels are prepared with on ``device`` (``backend``: "numpy" or "opencl")."""
        return PrepareContext(device_spec(device), self.consts, self.const_qinfo, _backend(backend))

    def prepare(self, op: RtOp, in_q: tuple, ctx: PrepareContext) -> PreparedOp:
        """``op`` prepared for inputs quantized as ``in_q`` (errors name the op)."""
        try:
            return prepare_op(self._kernel(op, ctx.spec.device), op, in_q, ctx)
        except MaceqError as e:
            msg = str(e)
            if not msg.startswith(f"op '{op.name}'"):
                msg = f"op '{op.name}' ({op.type}): {msg}"
            raise MaceqError(msg) from None

    def forget(self, idx: int) -> None:
        """Drop op ``idx``'s PreparedOps on every device (its constants in ``consts``/``const_qinfo`` changed)."""
        for plan in self._prepared.values():
            plan.forget(idx)

    def placement(self, device: "Device | str") -> dict[str, tuple[str, str]]:
        """Op name -> (where it runs, why it fell back), from one run on a probe input.

        On dsp, ops nnlib lacks or rejects run the cpu profile's kernels; the report counts the
        boundary transfers between the two.
        """
        return {p.op.name: (p.placement.device.value, p.placement.reason)
                for p in self.probe_ops(device_spec(device))}

    def probe_inputs(self) -> dict[str, np.ndarray]:
        """A deterministic probe input of batch 1 per graph input: a ramp over [-1, 1] (a constant
        input would give some kernels an empty range)."""
        probe = {}
        for n in self.input_names:
            shape = (1,) + tuple(self.input_shape(n)[1:])
            probe[n] = np.linspace(-1.0, 1.0, int(np.prod(shape)), dtype=np.float32).reshape(shape)
        return probe

    def probe_ops(self, profile: DeviceSpec) -> list[PreparedOp]:
        """Every op as one run on the probe input (:meth:`probe_inputs`) prepared it."""
        with _threads.section():
            plan = self._plan(profile.device, "numpy")
            return self._evaluate(plan, self._feed(self.probe_inputs()))

    def deviations(self, device: "Device | str") -> dict[str, str]:
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
        for p in self.probe_ops(device_spec(device)):
            why = p.kernel.deviation(p.params, [shapes.get(i) for i in p.op.inputs])
            if why:
                out[p.op.name] = why
        return out

    @property
    def tensor_map(self) -> dict[str, str]:
        """MACE tensor name -> the source-graph tensor it holds (recorded by the writer; identity elsewhere)."""
        return dict(self.maceq_meta.get("tensor_map") or {})

    def run_op(self, op: RtOp, inputs: list, *, device: "Device | str" = Device.CPU) -> list:
        """Run one op on given QTensors (constants are looked up): the isolated-layer analysis uses this."""
        ins = [t if t is not None else QTensor(self.consts[name], self.const_qinfo.get(name))
               for name, t in zip(op.inputs, list(inputs) + [None] * (len(op.inputs) - len(inputs)))]
        return self.prepare(op, tuple(t.qinfo for t in ins), self.context(device)).run(ins)

    def boundary_transfers(self, placement: dict[str, tuple[str, str]]) -> int:
        """Tensors that cross from one processor to the other (each consumer edge counted once)."""
        where_made = {o: placement[op.name][0] for op in self.ops for o in op.outputs}
        return sum(1 for op in self.ops for i in op.inputs
                   if i in where_made and where_made[i] != placement[op.name][0])

    def run(self, inputs: dict[str, np.ndarray], *, device: "Device | str" = Device.CPU, intermediates: bool = False,
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
        with self.section(device, threads):
            plan = self._plan(device, backend)
            values = self._feed(inputs)
            self._evaluate(plan, values, before_op, keep=intermediates)
        outputs = self._outputs(values)
        return RunResult(outputs, values) if intermediates else outputs

    @staticmethod
    def section(device: "Device | str", threads: int | None = None):
        """The thread section of one run on ``device`` (runtime/threads.py): the gpu and dsp kernels'
        numpy GEMMs keep BLAS on one thread for the whole run."""
        return _threads.section(threads, hold_blas=Device.parse(device) is not Device.CPU)

    def _last_uses(self) -> list[tuple[str, ...]]:
        """Per op, the tensors no later op reads and that are not graph outputs: what a run may drop after it."""
        last: dict[str, int] = {name: -1 for name in self.input_names}
        for idx, op in enumerate(self.ops):
            for name in op.inputs + op.outputs:
                if name not in self.consts:
                    last[name] = idx
        drops: list[list[str]] = [[] for _ in self.ops]
        for name, idx in last.items():
            if idx >= 0 and name not in self.output_info:
                drops[idx].append(name)
        return [tuple(d) for d in drops]

    def _evaluate(self, plan: Plan, values: dict[str, QTensor], before_op=None, *, keep: bool = True
                  ) -> list[PreparedOp]:
        """Run the ops in order on ``values`` (the fed inputs; each op's outputs are added); the PreparedOps run.
        ``keep=False``: each tensor is dropped after its last reader (a run then holds the live tensors only, and
        their memory is reused while it is still in cache)."""
        steps = plan if before_op is None else _Hooked(plan, before_op)
        ran = []
        for idx, op in enumerate(self.ops):
            prepared, ins = steps.step(idx, values)
            values.update(zip(op.outputs, prepared.run_stored(ins)))
            ran.append(prepared)
            if not keep:
                del ins
                for name in self._drops[idx]:
                    values.pop(name, None)
        return ran

    def _plan(self, device: str | Device, backend: str) -> Plan:
        """The plan for ``device`` and ``backend``, checked against what the model was quantized for."""
        profile = device_spec(device)
        if backend not in BACKENDS:
            raise MaceqError(f"unknown backend '{backend}' (choose numpy or opencl)")
        if backend == "opencl" and profile.device is not Device.GPU:
            raise MaceqError("--backend opencl runs the gpu device's kernels: use it with --device gpu")
        built_for = self.maceq_meta.get("device")
        if built_for and built_for != profile.device.value:
            raise MaceqError(f"this model was quantized for the {built_for} device; run it with --device {built_for} "
                             f"(or quantize again with --device {profile.device.value})")
        plan = self._prepared.get((profile.device, backend))
        if plan is None:
            plan = self._prepared[(profile.device, backend)] = Plan(self, self.context(profile.device, backend))
        return plan

    def _feed(self, inputs: dict[str, np.ndarray]) -> dict[str, QTensor]:
        """The graph inputs as float QTensors in the device layout (4-D NCHW inputs become NHWC)."""
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
                x = nchw_to_nhwc(x)
            values[name] = QTensor(x, None)
        for name in inputs:
            if name not in self.input_info:
                raise MaceqError(f"unknown input '{name}' (model inputs: {', '.join(self.input_names)})")
        return values

    def _outputs(self, values: dict[str, QTensor]) -> dict[str, np.ndarray]:
        """The graph outputs as float32 arrays in the caller's layout (4-D NHWC outputs become NCHW)."""
        outputs = {}
        for name in self.output_names:
            t = values[name]
            y = t.values.astype(np.float32) if t.qinfo is None else t.dequantize()
            info = self.output_info[name]
            if len(info.dims) == 4:
                if y.ndim == 4 and info.data_format == DataFormat.NHWC:
                    y = y.transpose(0, 3, 1, 2)  # device NHWC -> caller NCHW
            else:
                y = y.reshape((y.shape[0],) + tuple(int(d) for d in info.dims[1:]))
            outputs[name] = np.ascontiguousarray(y, dtype=np.float32)
        return outputs


_BACKENDS: dict = {}


def _backend(name: str):
    """The gpu kernels' backend: None for the numpy simulation, else the shared OpenCL backend
    (created on first use: context and programs are built once)."""
    if name not in BACKENDS:
        raise MaceqError(f"unknown backend '{name}' (choose numpy or opencl)")
    if name == "numpy":
        return None
    if name not in _BACKENDS:
        from maceq.runtime.opencl.backend import OpenCLBackend

        _BACKENDS[name] = OpenCLBackend()
    return _BACKENDS[name]


def load(path: str | os.PathLike) -> Model:
    """Load a MACE model from its deployment .yml or its .pb (the .data beside it)."""
    return Model(read_model(path))
