"""Fixed-point runtime: ``load(path)`` a MACE model, then ``model.run(inputs, device="cpu")``."""
from __future__ import annotations


def load(path):
    """Load a MACE model from its deployment .yml or its .pb (see :class:`maceq.runtime.model.Model`)."""
    from maceq.runtime.model import load as _load

    return _load(path)


__all__ = ["load"]
