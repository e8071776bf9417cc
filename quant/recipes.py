"""Recipes: named sets of accuracy-recovery switches (``--recipe NAME`` or ``recipe:`` in the config).

A recipe only sets keys the user did not set: the config file's own keys and the command-line
flags win over it (quant/config.py). ``--preset`` is a different thing: preprocessing.

=========  ====================================================================================
default    nothing: the converter's behaviour (percentile ranges, no recovery step)
accurate   the best combination measured (bench/accuracy.py, docs/recovery.md, docs/adaround.md):
           cross-layer equalization with high-bias absorption, ranges chosen by their consumers'
           error (mse where a tensor has other readers), AdaRound (adaptive
           weight rounding), then empirical bias correction
=========  ====================================================================================
"""
from __future__ import annotations

from types import MappingProxyType

from maceq.calibrate.methods import RangeMethod
from maceq.errors import MaceqError

__all__ = ["RECIPES", "recipe_settings"]

RECIPES = MappingProxyType({
    "default": MappingProxyType({}),
    "accurate": MappingProxyType({
        "cle": True,
        "high_bias_absorption": True,
        "range_method": RangeMethod.CONSUMER,
        "bias_correction": True,
        "adaround": True,
    }),
})


def recipe_settings(name: str) -> dict:
    """The QuantConfig fields a recipe sets; an unknown name is an error listing the known ones."""
    try:
        return dict(RECIPES[name])
    except KeyError:
        raise MaceqError(f"unknown recipe '{name}' (known: {', '.join(RECIPES)})") from None
