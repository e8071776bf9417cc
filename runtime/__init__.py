"""Fixed-point runtime: ``load(path)`` a MACE model, then ``model.run(inputs, device="cpu")``."""
from __future__ import annotations

from maceq.runtime.model import Model, load

__all__ = ["Model", "load"]
