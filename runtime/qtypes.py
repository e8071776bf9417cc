"""Quantization metadata shared by the MACE reader, the runtime and the reports."""
from __future__ import annotations

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
