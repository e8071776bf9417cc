"""Kernel registry keyed by (op_type, dtype, device).

A device's kernel table is the default table (device None) plus that device's
explicit overrides. Registering the same key twice raises. ``dtype`` is the
op's data type in the MACE model (its ``T`` argument): a uint8 op and a float
op of the same type are different kernels.
"""
from __future__ import annotations

from enum import Enum

from maceq.errors import MaceqError
from maceq.runtime.profiles import Device


class DType(Enum):
    UINT8 = "uint8"
    FLOAT = "float"

    @classmethod
    def from_mace(cls, t: int | None) -> "DType":
        """MACE's ``T`` argument (DataType enum): 1 float, 2 uint8; absent means uint8 here."""
        return cls.FLOAT if t == 1 else cls.UINT8


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
