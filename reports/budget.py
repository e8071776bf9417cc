"""Accuracy budgets for ``maceq check report.json --budget budget.yml [--junit results.xml]``.

A budget file (YAML, read with ``yaml.safe_load``; every key is validated and an unknown key is
an error that names it)::

    global:                       # whole-model metrics, checked per device
      min_top1_agreement: 0.97    # fraction in [0, 1]: float top-1 == int8 top-1
      min_top5_containment: 0.99  # fraction in [0, 1]: float top-1 in int8 top-5
      max_accuracy_drop: 0.5      # percentage points: 100 * (float accuracy - int8 accuracy)
    layers:                       # per-layer metrics by glob on the layer name
      "*": {min_sqnr_db: 25, min_cosine: 0.99}
      "features.0.*": {min_sqnr_db: 20}
      "/10/Gemm": {max_abs_err: 0.5}
    devices:                      # the same two sections, for one device only
      dsp:
        global: {min_top1_agreement: 0.95}
        layers: {"*": {min_sqnr_db: 20}}

Layer names are the source-graph node names the report gives (``layers[].name``, the names
``--fp32`` takes); globs are :func:`fnmatch.fnmatchcase` patterns (``*`` also matches ``/``).

Resolution, for one layer ``L`` of device ``d`` and one metric ``m``: of the rules whose glob
matches ``L`` (generic ones, and those under ``devices: {d: ...}``) and that set ``m``, the one
with the largest key ``(specificity, device_specific, position)`` wins, where specificity is the
number of characters of the glob other than ``* ? [ ]`` (the rule of the config file's
per-layer overrides), ``device_specific`` makes a device rule beat a generic one of equal
specificity, and position (order in the file, generic rules first) breaks remaining ties in
favour of the later rule. Each metric is resolved on its own, so ``"features.0.*":
{min_sqnr_db: 20}`` relaxes the SQNR floor of those layers and keeps ``"*"``'s cosine floor.
A value of ``null`` sets "no limit" (it wins like a number, and removes the limit).
Global metrics: the device's value when ``devices: {d: {global: ...}}`` sets the key, else the
top-level ``global`` value.

A metric the budget limits but the report does not have (no labels, so no accuracy) is a
violation ("not measured"): a gate must not pass on what it did not see (a uint8 layer the
analysis did not measure fails its limits too). Layers kept in float32 have no error metrics;
they are not checked (JUnit: skipped). Exit codes of :func:`run_check`:
0 within budget, 1 over budget, 2 bad input (one line, ``error: ...``).
"""
from __future__ import annotations

import fnmatch
import json
import math
import os
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Any, Mapping

from maceq.errors import MaceqError, one_line
from maceq.runtime.devices import Device
from maceq.yamlio import atomic_write, read_text, read_yaml

#: Global budget keys -> (direction, the report's metric under summary.devices.<device>).
GLOBAL_KEYS: dict[str, tuple[str, str]] = {
    "min_top1_agreement": ("min", "top1_agreement"),
    "min_top5_containment": ("min", "top5_containment"),
    "max_accuracy_drop": ("max", "accuracy_drop_points"),
}
#: Per-layer budget keys -> (direction, the report's metric under layers[]).
LAYER_KEYS: dict[str, tuple[str, str]] = {
    "min_sqnr_db": ("min", "sqnr_db"),
    "min_cosine": ("min", "cosine"),
    "max_abs_err": ("max", "max_abs_err"),
}
TOP_KEYS = ("global", "layers", "devices")
DEVICE_KEYS = ("global", "layers")
#: Allowed value range per key (inclusive); None = unbounded on that side.
_BOUNDS = {"min_top1_agreement": (0.0, 1.0), "min_top5_containment": (0.0, 1.0), "max_accuracy_drop": (None, None),
           "min_sqnr_db": (None, None), "min_cosine": (-1.0, 1.0), "max_abs_err": (0.0, None)}
GLOB_CHARS = "*?[]"


@dataclass(frozen=True)
class LayerRule:
    """One ``glob: {metric: limit}`` entry; ``device`` is None for a generic rule."""

    pattern: str
    device: str | None
    position: int
    limits: tuple[tuple[str, float | None], ...]  # (budget key, limit or None = no limit)

    @property
    def specificity(self) -> int:
        return sum(c not in GLOB_CHARS for c in self.pattern)

    def key(self) -> tuple[int, int, int]:
        return (self.specificity, self.device is not None, self.position)

    def where(self) -> str:
        return f'"{self.pattern}"' + (f" on {self.device}" if self.device else "")


@dataclass(frozen=True)
class Budget:
    """A validated budget file (see the module docstring)."""

    source: str
    global_limits: tuple[tuple[str, float | None], ...] = ()
    device_global: tuple[tuple[str, tuple[tuple[str, float | None], ...]], ...] = ()  # (device, limits)
    layer_rules: tuple[LayerRule, ...] = ()

    def global_for(self, device: str) -> dict[str, tuple[float | None, str]]:
        """Budget key -> (limit, where it comes from) for the whole-model metrics of ``device``."""
        out = {k: (v, "global") for k, v in self.global_limits}
        for d, limits in self.device_global:
            if d == device:
                out.update({k: (v, f"global on {d}") for k, v in limits})
        return {k: v for k, v in out.items() if v[0] is not None}

    def layer_limits(self, name: str, device: str) -> dict[str, tuple[float, LayerRule]]:
        """Budget key -> (limit, winning rule) for one layer (per-metric most specific glob)."""
        best: dict[str, tuple[tuple, float | None, LayerRule]] = {}
        for rule in self.layer_rules:
            if rule.device not in (None, device) or not fnmatch.fnmatchcase(name, rule.pattern):
                continue
            k = rule.key()
            for metric, limit in rule.limits:
                if metric not in best or k > best[metric][0]:
                    best[metric] = (k, limit, rule)
        return {m: (limit, rule) for m, (_, limit, rule) in best.items() if limit is not None}


@dataclass(frozen=True)
class Violation:
    """One metric over its budget: ``layer`` is None for a whole-model metric."""

    device: str
    layer: str | None
    key: str                 # budget key, e.g. min_sqnr_db
    metric: str              # report metric, e.g. sqnr_db
    value: float | None      # None: not measured
    limit: float
    rule: str                # where the limit comes from: 'global', '"*" on dsp', ...

    def line(self) -> str:
        what = "not measured" if self.value is None else f"{_fmt(self.value)}"
        op = ">=" if GLOBAL_KEYS.get(self.key, LAYER_KEYS.get(self.key))[0] == "min" else "<="
        return (f"{self.device} {self.layer if self.layer is not None else '[global]'}: {self.metric} {what}, "
                f"budget {self.key} {_fmt(self.limit)} (needs {op} {_fmt(self.limit)}; rule {self.rule})")

    def to_dict(self) -> dict:
        return {"device": self.device, "layer": self.layer, "key": self.key, "metric": self.metric,
                "value": _json_num(self.value), "limit": self.limit, "rule": self.rule, "message": self.line()}


def _fmt(v: float) -> str:
    return f"{v:.6g}"


def _json_num(v):
    if v is None or math.isfinite(v):
        return v
    return "inf" if v > 0 else ("-inf" if v < 0 else None)


# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------

def _mapping(value, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise MaceqError(f"{where} must be a mapping, got {type(value).__name__}")
    return value


def _check_keys(d: dict, allowed, where: str) -> None:
    for k in d:
        if k not in allowed:
            raise MaceqError(f"{where}: unknown key '{k}' (allowed: {', '.join(allowed)})")


def _limit(value, key: str, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MaceqError(f"{where}: {key} must be a number or null, got {value!r}")
    lo, hi = _BOUNDS[key]
    try:
        v = float(value)
    except OverflowError:  # an integer beyond float range (YAML reads any digit string as int)
        v = math.inf
    if not math.isfinite(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"[{'-inf' if lo is None else f'{lo:g}'}, {'inf' if hi is None else f'{hi:g}'}]"
        raise MaceqError(f"{where}: {key} must be a finite number in {rng}, got {value!r}")
    return v


def _limits(d, allowed: Mapping, where: str) -> tuple[tuple[str, float | None], ...]:
    d = _mapping(d, where)
    _check_keys(d, tuple(allowed), where)
    return tuple((k, _limit(v, k, f"{where}")) for k, v in d.items())


def _layer_rules(d, device: str | None, where: str, start: int) -> list[LayerRule]:
    rules = []
    for k, (pattern, limits) in enumerate(_mapping(d, where).items()):
        if not isinstance(pattern, str) or not pattern:
            raise MaceqError(f"{where}: layer glob must be a non-empty string, got {pattern!r}")
        rules.append(LayerRule(pattern, device, start + k, _limits(limits, LAYER_KEYS, f'{where}."{pattern}"')))
    return rules



def budget_from_dict(d: Any, *, source: str = "budget") -> Budget:
    """Validate a parsed budget document (see the module docstring); MaceqError is one line."""
    try:
        return _budget_from_dict(d, source=source)
    except MaceqError as e:
        raise MaceqError(one_line(str(e))) from None


def _budget_from_dict(d: Any, *, source: str) -> Budget:
    if d is None:
        raise MaceqError(f"{source}: the budget is empty")
    d = _mapping(d, f"{source}: the top level")
    _check_keys(d, TOP_KEYS, source)
    glob = _limits(d.get("global"), GLOBAL_KEYS, f"{source}: global")
    rules = _layer_rules(d.get("layers"), None, f"{source}: layers", 0)
    dev_global = []
    for name, sub in _mapping(d.get("devices"), f"{source}: devices").items():
        try:
            dev = Device.parse(name).value
        except MaceqError as e:
            raise MaceqError(f"{source}: devices: {e}") from None
        where = f"{source}: devices.{name}"
        sub = _mapping(sub, where)
        _check_keys(sub, DEVICE_KEYS, where)
        dev_global.append((dev, _limits(sub.get("global"), GLOBAL_KEYS, f"{where}.global")))
        rules += _layer_rules(sub.get("layers"), dev, f"{where}.layers", len(rules))
    return Budget(source, glob, tuple(dev_global), tuple(rules))


def load_budget(path: str | os.PathLike) -> Budget:
    """Read and validate a budget YAML file; MaceqError names the file and the key at fault."""
    return budget_from_dict(read_yaml(path, what="budget file"), source=str(path))


# ------------------------------------------------------------------------------------------------
# Checking
# ------------------------------------------------------------------------------------------------

def metric_value(v) -> float | None:
    """A report metric as a float: 'inf'/'-inf' strings become infinities, null stays None."""
    if v is None:
        return None
    if isinstance(v, str):
        if v in ("inf", "-inf"):
            return float(v)
        raise MaceqError(f"report: metric value {v!r} is not a number")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise MaceqError(f"report: metric value {v!r} is not a number")
    return float(v)


def _passes(direction: str, value: float | None, limit: float) -> bool:
    if value is None or math.isnan(value):
        return False
    return value >= limit if direction == "min" else value <= limit


def _report_parts(report: Mapping) -> tuple[list[str], Mapping, list]:
    """The devices, per-device summaries and layers of a report dict; MaceqError if malformed."""
    if not isinstance(report, Mapping):
        raise MaceqError("report: the top level must be an object")
    for k in ("devices", "summary", "layers"):
        if k not in report:
            raise MaceqError(f"report: missing key '{k}' (not a maceq report.json?)")
    devices = report["devices"]
    per = report["summary"].get("devices") if isinstance(report["summary"], Mapping) else None
    if not isinstance(devices, list) or not isinstance(per, Mapping) or not isinstance(report["layers"], list):
        raise MaceqError("report: 'devices' must be a list, 'summary.devices' an object and 'layers' a list")
    for d in devices:
        if d not in per:
            raise MaceqError(f"report: summary.devices has no entry for device '{d}'")
    for k, L in enumerate(report["layers"]):
        if not isinstance(L, Mapping) or not isinstance(L.get("name"), str) or L.get("device") not in devices:
            raise MaceqError(f"report: layers[{k}] needs a string 'name' and a 'device' of the report")
    return devices, per, report["layers"]


def check(report: Mapping, budget: Budget) -> list[Violation]:
    """Every metric of ``report`` (a report.json dict) over ``budget``, in report order:
    per device, the global metrics, then the layers as listed."""
    return [v for _, v in evaluate_budget(report, budget) if v is not None]


def evaluate_budget(report: Mapping, budget: Budget) -> list[tuple[tuple[str, str | None, str], Violation | None]]:
    """All checks made: ((device, layer or None, budget key), violation or None when it passes)."""
    devices, per, layers = _report_parts(report)
    out = []
    for device in devices:
        summary = per[device]
        for key, (limit, where) in budget.global_for(device).items():
            direction, metric = GLOBAL_KEYS[key]
            value = metric_value(summary.get(metric))
            ok = _passes(direction, value, limit)
            out.append(((device, None, key), None if ok else Violation(device, None, key, metric, value, limit, where)))
        for L in layers:
            if L["device"] != device or L.get("precision") == "fp32":
                continue  # float32 layers are not quantized: no error metrics to check
            for key, (limit, rule) in budget.layer_limits(L["name"], device).items():
                direction, metric = LAYER_KEYS[key]
                value = metric_value(L.get(metric))
                ok = _passes(direction, value, limit)
                out.append(((device, L["name"], key),
                            None if ok else Violation(device, L["name"], key, metric, value, limit, rule.where())))
    return out


# ------------------------------------------------------------------------------------------------
# JUnit XML and the command
# ------------------------------------------------------------------------------------------------

def junit_xml(report: Mapping, budget: Budget) -> bytes:
    """JUnit XML: per device one testcase for the global metrics and one per layer (classname
    ``maceq.<device>``); a failure carries the violation lines; float32 layers are skipped."""
    devices, _, layers = _report_parts(report)
    results = evaluate_budget(report, budget)
    by_case: dict[tuple[str, str | None], list] = {}
    for (device, layer, _), v in results:
        by_case.setdefault((device, layer), []).append(v)
    suites = ET.Element("testsuites", name="maceq check")
    total = fails = skips = 0
    for device in devices:
        cases = [(None, True)] + [(L["name"], L.get("precision") != "fp32") for L in layers if L["device"] == device]
        suite = ET.SubElement(suites, "testsuite", name=f"maceq.{device}")
        n = nf = ns = 0
        for name, quantized in cases:
            tc = ET.SubElement(suite, "testcase", classname=f"maceq.{device}",
                               name="global metrics" if name is None else name)
            n += 1
            if not quantized:
                ET.SubElement(tc, "skipped", message="float32 layer: not quantized, no error metrics")
                ns += 1
                continue
            vs = [v for v in by_case.get((device, name), []) if v is not None]
            if vs:
                f = ET.SubElement(tc, "failure", type="budget", message=vs[0].line())
                f.text = "\n".join(v.line() for v in vs)
                nf += 1
        suite.set("tests", str(n))
        suite.set("failures", str(nf))
        suite.set("errors", "0")
        suite.set("skipped", str(ns))
        total, fails, skips = total + n, fails + nf, skips + ns
    suites.set("tests", str(total))
    suites.set("failures", str(fails))
    suites.set("errors", "0")
    suites.set("skipped", str(skips))
    ET.indent(suites)
    return ET.tostring(suites, encoding="utf-8", xml_declaration=True) + b"\n"


def load_report(path: str | os.PathLike) -> dict:
    """Read a report.json; MaceqError (one line) when unreadable or not a maceq report."""
    text = read_text(path, what="report")
    try:
        report = json.loads(text)
    except json.JSONDecodeError as e:
        raise MaceqError(f"{path}: not valid JSON (line {e.lineno})") from None
    try:
        _report_parts(report)
    except MaceqError as e:
        raise MaceqError(f"{path}: {e}") from None
    return report


def run_check(report_path: str | os.PathLike, budget_path: str | os.PathLike,
              junit_path: str | os.PathLike | None = None, *, out=None, err=None) -> int:
    """``maceq check``: print one line per violation; return 0 (within budget), 1 (over budget)
    or 2 (bad input: an unreadable file, an unknown key; one ``error:`` line on stderr)."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        report = load_report(report_path)
        budget = load_budget(budget_path)
        results = evaluate_budget(report, budget)
        if junit_path is not None:
            atomic_write(junit_path, junit_xml(report, budget))
    except MaceqError as e:
        print(f"error: {e}", file=err)
        return 2
    violations = [v for _, v in results if v is not None]
    for v in violations:
        print(v.line(), file=out)
    if violations:
        print(f"over budget: {len(violations)} of {len(results)} checks failed", file=out)
        return 1
    print(f"within budget: {len(results)} checks passed", file=out)
    return 0
