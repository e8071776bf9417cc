"""Kernel registry keyed by (op_type, dtype, device), and where each op runs.

A device's kernel table is the default table (device None) plus that device's
explicit overrides. Registering the same key twice raises. ``dtype`` is the
op's data type in the MACE model (its ``T`` argument): a uint8 op and a float
op of the same type are different kernels.

An op runs on its device when the device overrides its kernel (and the
override does not reject the op) or, on the gpu, when it is a float op (the
fp16_fp32 float path); otherwise the default kernel runs it on the cpu.
"""
from __future__ import annotations

from maceq.errors import MaceqError
from maceq.runtime.graph import RtOp
from maceq.runtime.kernel import DType, Kernel, Placement, PrepareContext, PreparedOp
from maceq.runtime.devices import Device, FloatStorage

_REGISTRY: dict[tuple[str, DType, Device | None], type] = {}


def register(op_type: str, *, device: Device | None = None, dtype: DType = DType.UINT8):
    """Class decorator: register a kernel class for ``op_type`` (default table when device is None)."""

    def deco(cls):
        key = (op_type, dtype, device)
        if key in _REGISTRY:
            raise ValueError(f"kernel for {op_type!r} ({dtype.value}) on {device.value if device else 'default'} "
                             f"registered twice ({_REGISTRY[key].__name__} and {cls.__name__})")
        _REGISTRY[key] = cls
        cls.op_type = op_type
        cls.dtype = dtype
        return cls

    return deco


def kernel_table(device: Device) -> dict[tuple[str, DType], type]:
    """The default table with ``device``'s overrides applied, keyed by (op_type, dtype)."""
    table = {(op, dt): cls for (op, dt, dev), cls in _REGISTRY.items() if dev is None}
    table.update({(op, dt): cls for (op, dt, dev), cls in _REGISTRY.items() if dev is device})
    return table


def lookup(op_type: str, device: Device, *, dtype: DType = DType.UINT8, op_name: str = "") -> type:
    table = kernel_table(device)
    if (op_type, dtype) not in table:
        raise MaceqError(f"op '{op_name}': no {device.value} kernel for {dtype.value} op type '{op_type}'")
    return table[(op_type, dtype)]


def op_dtype(op: RtOp) -> DType:
    """The dtype an op's kernel is registered for: its ``T``; Quantize/Dequantize's T is the quantized side."""
    if op.type in ("Quantize", "Dequantize"):
        return DType.UINT8
    return DType.from_mace(op.arg("T"))


def table_placement(op_type: str, dtype: DType, device: Device) -> Placement:
    """Where the kernel table runs an op: on the device (its own kernel, or the gpu's float path), else the cpu."""
    if device is Device.CPU or (op_type, dtype, device) in _REGISTRY or (dtype is DType.FLOAT and device is Device.GPU):
        return Placement(device)
    return Placement(Device.CPU, f"no {device.value} kernel for {op_type}")


def prepare_op(kernel: Kernel, op: RtOp, in_q: tuple, ctx: PrepareContext) -> PreparedOp:
    """``op`` prepared for ``ctx.spec``'s device with ``kernel`` (from its table), or with the default
    kernel on the cpu where ``kernel`` rejects it."""
    where = table_placement(op.type, kernel.dtype, ctx.spec.device)
    why = kernel.rejects(op, in_q, ctx)
    if why:
        kernel, where = _REGISTRY[(op.type, kernel.dtype, None)](), Placement(Device.CPU, why)
    params = kernel.prepare(op, in_q, ctx)
    storage = ctx.spec.float_storage if kernel.dtype is DType.FLOAT else FloatStorage.FLOAT32
    return PreparedOp(op, kernel, params, kernel.plan(op, params, ctx), where, storage)
