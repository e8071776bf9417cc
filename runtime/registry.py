"""Kernel registry keyed by (op_type, device).

A device's kernel table is the default table (device None) plus that device's
explicit overrides. Registering the same (op_type, device) twice raises.
"""
from __future__ import annotations

from maceq.errors import MaceqError
from maceq.runtime.profiles import Device

_REGISTRY: dict[tuple[str, Device | None], type] = {}


def register(op_type: str, *, device: Device | None = None):
    """Class decorator: register a kernel class for ``op_type`` (default table when device is None)."""

    def deco(cls):
        key = (op_type, device)
        if key in _REGISTRY:
            raise ValueError(f"kernel for {op_type!r} on {device.value if device else 'default'} registered twice "
                             f"({_REGISTRY[key].__name__} and {cls.__name__})")
        _REGISTRY[key] = cls
        cls.op_type = op_type
        return cls

    return deco


def kernel_table(device: Device) -> dict[str, type]:
    """The default table with ``device``'s overrides applied."""
    table = {op: cls for (op, dev), cls in _REGISTRY.items() if dev is None}
    table.update({op: cls for (op, dev), cls in _REGISTRY.items() if dev is device})
    return table


def lookup(op_type: str, device: Device, *, op_name: str = "") -> type:
    table = kernel_table(device)
    if op_type not in table:
        raise MaceqError(f"op '{op_name}': no {device.value} kernel for op type '{op_type}'")
    return table[op_type]
