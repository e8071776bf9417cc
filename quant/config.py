"""The quantization config file (``--config FILE``): a frozen dataclass loaded with yaml.safe_load.

Example::

    range_method: percentile      # min_max | percentile | mse | kl | consumer
    percentile: 99.99
    batch_size: 8
    max_images: 500
    preprocess: {preset: imagenet}   # or any Preprocess keys
    layers:                       # per-tensor overrides by name glob; the most specific glob wins
      "/features/0/*": {range_method: min_max}
      "logits": {range_method: percentile, percentile: 99.9}
    fp32_layers: ["/features/0/*"]   # keep these layers in float32 (mixed precision)
    recipe: accurate              # a named set of the switches below (quant/recipes.py)
    cle: true                     # cross-layer equalization (docs/recovery.md)
    high_bias_absorption: true    # with cle: absorb high biases into the next layer
    bias_correction: true         # empirical bias correction per device
    bias_correction_images: 32    # calibration images it measures on
    adaround: true                # adaptive weight rounding per device (docs/adaround.md)
    adaround_images: 64           # calibration images it collects layer inputs from
    adaround_iters: 500           # optimisation steps per layer
    workers: 4                    # calibration shards and mixed-precision evaluations in parallel
    executor: local               # local (processes) | ray (pip install 'maceq[ray]'); docs/parallel.md
    # ray_address: "head:6379"    # with executor: ray (default: RAY_ADDRESS, else a local Ray)
    safe_forms: true              # rewrite ops the device computes wrongly into a form it gets right

Every key is validated; an unknown key is an error that names it. Precedence, lowest first:
the defaults, the recipe, the keys written in the file, the command-line flags.
"""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field, replace
from typing import Any

from maceq.calibrate.methods import RangeMethod, parse_method
from maceq.calibrate.parallel import Executor
from maceq.errors import MaceqError
from maceq.quant.recipes import recipe_settings
from maceq.yamlio import one_line, read_yaml

RECOVERY_KEYS = {"cle", "high_bias_absorption", "bias_correction", "bias_correction_images", "adaround",
                 "adaround_images", "adaround_iters"}
PARALLEL_KEYS = {"workers", "executor", "ray_address"}
TOP_KEYS = {"range_method", "percentile", "batch_size", "max_images", "preprocess", "layers", "fp32_layers",
            "recipe", "safe_forms"} | RECOVERY_KEYS | PARALLEL_KEYS
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
    #: The recipe applied (quant/recipes.py), if any.
    recipe: str | None = None
    #: Accuracy-recovery switches (docs/recovery.md).
    cle: bool = False
    high_bias_absorption: bool = False
    bias_correction: bool = False
    bias_correction_images: int = 32
    adaround: bool = False
    adaround_images: int = 64
    adaround_iters: int = 500
    #: Parallel calibration and mixed-precision sweeps (docs/parallel.md): ``workers`` shards or
    #: candidate evaluations at a time, on local processes or Ray tasks.
    workers: int = 1
    executor: Executor = Executor.LOCAL
    ray_address: str | None = None
    #: Rewrite ops whose device path departs from the model's meaning into an equivalent form the
    #: device computes right (quant/safe_forms.py); False keeps the original form.
    safe_forms: bool = True
    #: The keys set explicitly (config file or command line): a recipe does not override them.
    explicit: frozenset = field(default_factory=frozenset, compare=False)

    def with_cli(self, **kw: Any) -> "QuantConfig":
        """Apply command-line values that were given (None means 'not given')."""
        given = {k: v for k, v in kw.items() if v is not None}
        return replace(self, **given, explicit=self.explicit | set(given))

    def with_recipe(self, name: str | None) -> "QuantConfig":
        """Apply a recipe's switches to every key not set explicitly; None: unchanged."""
        if name is None:
            return self

        settings = {k: v for k, v in recipe_settings(name).items() if k not in self.explicit}
        return replace(self, **settings, recipe=name)

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
    if not isinstance(value, (str, RangeMethod)):
        raise MaceqError(f"{where}: range_method must be a name, got {value!r}")
    try:
        return parse_method(value)
    except MaceqError:
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
            raise MaceqError(f"{source}: unknown key '{one_line(k)}' (allowed: {', '.join(sorted(TOP_KEYS))})")
    kw: dict[str, Any] = {}
    if "range_method" in d:
        kw["range_method"] = _method(d["range_method"], f"{source}: range_method")
    if "percentile" in d:
        kw["percentile"] = _percentile(d["percentile"], f"{source}: percentile")
    if "batch_size" in d:
        kw["batch_size"] = _positive_int(d["batch_size"], f"{source}: batch_size")
    if "max_images" in d and d["max_images"] is not None:
        kw["max_images"] = _positive_int(d["max_images"], f"{source}: max_images")
    if "workers" in d:
        kw["workers"] = _positive_int(d["workers"], f"{source}: workers")
    if "executor" in d:
        try:
            kw["executor"] = Executor.parse(d["executor"])
        except MaceqError:
            raise MaceqError(f"{source}: executor must be local or ray, got {one_line(repr(d['executor']))}") from None
    if "ray_address" in d and d["ray_address"] is not None:
        if not isinstance(d["ray_address"], str) or not d["ray_address"].strip():
            raise MaceqError(f"{source}: ray_address must be a Ray address such as 'head:6379' or "
                             f"'ray://head:10001', got {one_line(repr(d['ray_address']))}")
        kw["ray_address"] = d["ray_address"].strip()
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
    if not isinstance(d.get("layers") or {}, dict):
        raise MaceqError(f"{source}: layers must be a mapping of layer-name globs to settings")
    for pattern, spec in (d.get("layers") or {}).items():
        where = f"{source}: layers['{one_line(pattern)}']"
        if not isinstance(spec, dict):
            raise MaceqError(f"{where} must be a mapping")
        for k in spec:
            if k not in LAYER_KEYS:
                raise MaceqError(f"{where}: unknown key '{one_line(k)}' (allowed: {', '.join(sorted(LAYER_KEYS))})")
        layers.append(LayerOverride(str(pattern),
                                    _method(spec["range_method"], where) if "range_method" in spec else None,
                                    _percentile(spec["percentile"], where) if "percentile" in spec else None))
    kw["layers"] = tuple(layers)
    for key in ("cle", "high_bias_absorption", "bias_correction", "adaround", "safe_forms"):
        if key in d:
            if not isinstance(d[key], bool):
                raise MaceqError(f"{source}: {key} must be true or false, got {d[key]!r}")
            kw[key] = d[key]
    if "bias_correction_images" in d:
        kw["bias_correction_images"] = _positive_int(d["bias_correction_images"], f"{source}: bias_correction_images")
    for key in ("adaround_images", "adaround_iters"):
        if key in d:
            kw[key] = _positive_int(d[key], f"{source}: {key}")
    explicit = frozenset(k for k in d if k != "recipe")
    cfg = QuantConfig(**kw, explicit=explicit)
    if "recipe" in d:
        if not isinstance(d["recipe"], str):
            raise MaceqError(f"{source}: recipe must be a name, got {d['recipe']!r}")
        cfg = cfg.with_recipe(d["recipe"])
    return cfg


def load_config(path: str | os.PathLike) -> QuantConfig:
    return config_from_dict(read_yaml(path, what="config file"), source=os.fspath(path))
