"""Quantization metadata shared by the MACE reader, the runtime and the reports."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class QInfo:
    """One tensor's affine quantization: real = scale * (q - zero_point).

    ``scale``, ``minval`` and ``maxval`` are the float32 values that the MACE
    model stores (QuantizeActivationInfo / ConstTensor), widened to Python
    floats without rounding, so ``np.float32(scale)`` gives back the stored bits.
    """

    scale: float
    zero_point: int
    minval: float = 0.0
    maxval: float = 0.0

    @property
    def scale_f32(self) -> np.float32:
        return np.float32(self.scale)


@functools.lru_cache(maxsize=4096)
def shared_qinfo(scale: float, zero_point: int) -> QInfo:
    """The one QInfo object for these values (a QInfo never changes): the tensors an op makes on every run carry the
    same object, which the next op's prepared form is found by (runtime/model.py ``Plan.prepared`` compares the
    inputs' QInfo objects first)."""
    return QInfo(scale, zero_point)


@dataclass
class QTensor:
    """A tensor as the device holds it: raw integer codes (NHWC for 4-D) and their quantization."""

    values: np.ndarray
    qinfo: QInfo | None  # None for float tensors

    def dequantize(self) -> np.ndarray:
        if self.qinfo is None:
            return self.values.astype(np.float32)
        return (np.float32(self.qinfo.scale) * (self.values.astype(np.int32) - self.qinfo.zero_point)).astype(np.float32)

