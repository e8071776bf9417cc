"""The kernel contract: what a registered kernel class declares, and the op it prepares.

A kernel is one small class per (op type, dtype, device) (runtime/registry.py). ``prepare`` turns
an op and its inputs' quantization into a frozen params dataclass, ``plan`` builds what running it
needs besides (weight-derived data of the fast paths, the gpu backend), both once; the
:class:`PreparedOp` holding them is what ``run`` gets, with the input tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

import numpy as np

from maceq.errors import UndefinedOnDevice
from maceq.mace.enums import DataType
from maceq.runtime.graph import RtOp
from maceq.runtime.devices import Device, DeviceSpec, FloatStorage
from maceq.runtime.qtypes import QInfo, QTensor


class CallCache(dict):
    """A kernel plan's calls prepared per input shape (and whatever else keys them), made on a run and reused by the
    next: a cache, so a pickled model (a worker's copy, a saved result) carries it empty and makes its own again."""

    def __reduce__(self):
        return (type(self), ())


class DType(Enum):
    UINT8 = "uint8"
    FLOAT = "float"

    @classmethod
    def from_mace(cls, t: int | None) -> "DType":
        """MACE's ``T`` argument (DataType enum): 1 float, 2 uint8; absent means uint8 here."""
        return cls.FLOAT if t == DataType.DT_FLOAT else cls.UINT8


@dataclass(frozen=True)
class PrepareContext:
    """What ``prepare`` and ``plan`` read besides the op."""

    spec: DeviceSpec
    consts: dict
    const_qinfo: dict
    #: The gpu kernels' backend: an OpenCLBackend for ``backend="opencl"``; None is the numpy simulation.
    backend: object = None


@dataclass(frozen=True)
class Placement:
    """Where an op runs: on its device, or on the cpu (``reason`` says why it is not on the device)."""

    device: Device
    reason: str = ""


class Kernel:
    """One MACE op type's kernel for one dtype and device (registered with ``registry.register``).

    ``rejects(op, in_q, ctx)`` says why the device cannot run this op ("" when it can; the cpu
    profile's kernel runs it then). ``prepare(op, in_q, ctx)`` decodes the op's arguments and its
    inputs' quantization (``in_q``: one QInfo or None per input) into a frozen params dataclass;
    ``plan(op, params, ctx)`` builds what ``run`` needs besides; ``run(prepared, inputs)`` computes
    the output QTensors. ``deviation(params, in_shapes)`` says how the device's result departs from
    the op's meaning for inputs of those shapes, or None.
    """

    op_type: ClassVar[str]
    dtype: ClassVar[DType]
    #: Computes on half-stored float inputs as they are (the gpu's fp16_fp32 mode); other float
    #: kernels get them widened to float32.
    half_storage: ClassVar[bool] = False

    def rejects(self, op: RtOp, in_q: tuple[QInfo | None, ...], ctx: PrepareContext) -> str:
        return ""

    def prepare(self, op: RtOp, in_q: tuple[QInfo | None, ...], ctx: PrepareContext):
        raise NotImplementedError

    def plan(self, op: RtOp, params, ctx: PrepareContext):
        return None

    def run(self, prepared: "PreparedOp", inputs: list[QTensor]) -> list[QTensor]:
        raise NotImplementedError

    def deviation(self, params, in_shapes) -> str | None:
        return None


@dataclass(frozen=True, eq=False)
class PreparedOp:
    """One op ready to run: its kernel, frozen params and plan, where it runs and how its floats are stored."""

    op: RtOp
    kernel: Kernel
    params: object
    #: What the kernel built once besides the params (``Kernel.plan``); None when it needs nothing.
    plan: object
    placement: Placement
    #: How the graph stores the float tensors this op reads and writes (FLOAT16: the gpu's fp16_fp32 mode).
    storage: FloatStorage = FloatStorage.FLOAT32

    def run(self, inputs: list[QTensor]) -> list[QTensor]:
        """The kernel on ``inputs``."""
        return self.kernel.run(self, inputs)

    def run_stored(self, inputs: list[QTensor]) -> list[QTensor]:
        """The kernel between tensors as the graph stores them: with FLOAT16 storage, half inputs are
        widened to float32 (unless the kernel computes on them) and float outputs are stored half.
        A result the device leaves undefined is raised naming the op."""
        try:
            return self._run_stored(inputs)
        except UndefinedOnDevice as e:
            raise UndefinedOnDevice(f"op '{self.op.name}' ({self.op.type}): {e}") from None

    def _run_stored(self, inputs: list[QTensor]) -> list[QTensor]:
        if self.storage is FloatStorage.FLOAT32:
            return self.kernel.run(self, inputs)
        if not self.kernel.half_storage:
            inputs = [QTensor(t.values.astype(np.float32), t.qinfo) if t.values.dtype == np.float16 else t
                      for t in inputs]
        return [QTensor(t.values.astype(np.float16), None)
                if t.qinfo is None and np.issubdtype(t.values.dtype, np.floating) else t
                for t in self.kernel.run(self, inputs)]
