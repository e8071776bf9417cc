"""The quantization config file (``--config FILE``): a frozen dataclass loaded with yaml.safe_load.

Example::

    range_method: percentile      # min_max | percentile | mse | kl
    percentile: 99.99
    batch_size: 8
    max_images: 500
    preprocess: {preset: imagenet}   # or any Preprocess keys
    layers:                       # per-tensor overrides by name glob; the most specific glob wins
      "/features/0/*": {range_method: min_max}
      "logits": {range_method: percentile, percentile: 99.9}
    fp32_layers: ["/features/0/*"]   # keep these layers in float32 (mixed precision)

Every key is validated; an unknown key is an error that names it.
"""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field, replace
from typing import Any

import yaml

from maceq.calibrate.methods import RangeMethod
from maceq.errors import MaceqError

TOP_KEYS = {"range_method", "percentile", "batch_size", "max_images", "preprocess", "layers", "fp32_layers"}
LAYER_KEYS = {"range_method", "percentile"}


@dataclass(frozen=True)
class LayerOverride:
    pattern: str
    range_method: RangeMethod | None = None
    percentile: float | None = None


@dataclass(frozen=True)
class QuantConfig:
    range_method: RangeMethod = RangeMethod.PERCENTILE
    percentile: float = 99.99
    batch_size: int = 8
    max_images: int | None = None
    preprocess: dict | None = None
    layers: tuple[LayerOverride, ...] = field(default_factory=tuple)
    #: Globs of layers kept in float32 (mixed precision); matched against node names, the names of
    #: nodes fused into them, and their output tensor names.
    fp32_layers: tuple[str, ...] = field(default_factory=tuple)

    def with_cli(self, **kw: Any) -> "QuantConfig":
        """Apply command-line values that were given (None means 'not given')."""
        return replace(self, **{k: v for k, v in kw.items() if v is not None})

    def method_for(self, tensor: str) -> tuple[RangeMethod, float]:
        """Range method and percentile for one tensor: the most specific matching glob wins.

        Specificity is the number of non-wildcard characters in the pattern; ties go
        to the later entry in the file.
        """
        best, best_key = None, None
        for k, ov in enumerate(self.layers):
            if fnmatch.fnmatchcase(tensor, ov.pattern):
                key = (sum(c not in "*?[]" for c in ov.pattern), k)
                if best_key is None or key > best_key:
                    best, best_key = ov, key
        method = best.range_method if best and best.range_method else self.range_method
        pct = best.percentile if best and best.percentile is not None else self.percentile
        return method, pct


def _method(value, where: str) -> RangeMethod:
    try:
        return RangeMethod(str(value))
    except ValueError:
        raise MaceqError(f"{where}: unknown range_method '{value}' "
                         f"(choose from {', '.join(m.value for m in RangeMethod)})") from None


def _percentile(value, where: str) -> float:
    try:
        p = float(value)
    except (TypeError, ValueError):
        raise MaceqError(f"{where}: percentile must be a number, got {value!r}") from None
    if not 50.0 < p <= 100.0:
        raise MaceqError(f"{where}: percentile must be in (50, 100], got {p}")
    return p


def _positive_int(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MaceqError(f"{where}: must be a positive integer, got {value!r}")
    return value


def config_from_dict(d: Any, *, source: str = "config") -> QuantConfig:
    if d is None:
        return QuantConfig()
    if not isinstance(d, dict):
        raise MaceqError(f"{source}: the top level must be a mapping")
    for k in d:
        if k not in TOP_KEYS:
            raise MaceqError(f"{source}: unknown key '{k}' (allowed: {', '.join(sorted(TOP_KEYS))})")
    kw: dict[str, Any] = {}
    if "range_method" in d:
        kw["range_method"] = _method(d["range_method"], f"{source}: range_method")
    if "percentile" in d:
        kw["percentile"] = _percentile(d["percentile"], f"{source}: percentile")
    if "batch_size" in d:
        kw["batch_size"] = _positive_int(d["batch_size"], f"{source}: batch_size")
    if "max_images" in d and d["max_images"] is not None:
        kw["max_images"] = _positive_int(d["max_images"], f"{source}: max_images")
    if "preprocess" in d:
        if not isinstance(d["preprocess"], dict):
            raise MaceqError(f"{source}: preprocess must be a mapping")
        kw["preprocess"] = dict(d["preprocess"])
    if "fp32_layers" in d:
        v = d["fp32_layers"] or []
        if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
            raise MaceqError(f"{source}: fp32_layers must be a list of layer-name globs")
        kw["fp32_layers"] = tuple(v)
    layers = []
    for pattern, spec in (d.get("layers") or {}).items():
        where = f"{source}: layers['{pattern}']"
        if not isinstance(spec, dict):
            raise MaceqError(f"{where} must be a mapping")
        for k in spec:
            if k not in LAYER_KEYS:
                raise MaceqError(f"{where}: unknown key '{k}' (allowed: {', '.join(sorted(LAYER_KEYS))})")
        layers.append(LayerOverride(str(pattern),
                                    _method(spec["range_method"], where) if "range_method" in spec else None,
                                    _percentile(spec["percentile"], where) if "percentile" in spec else None))
    kw["layers"] = tuple(layers)
    return QuantConfig(**kw)


def load_config(path: str | os.PathLike) -> QuantConfig:
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise MaceqError(f"{path}: no such config file") from None
    except yaml.YAMLError as e:
        raise MaceqError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    return config_from_dict(data, source=path)
