"""The accuracy-drop report: report.json (the data) and report.html (one self-contained page).

:func:`build_report` assembles the report dict from measured pieces (the loaded int8 models, one
per device, their :class:`~maceq.reports.evaluate.EvalResult` and
:class:`~maceq.reports.analysis.LayerError` lists, the float graph and a few images), and
:func:`write_report` writes ``report.json`` and ``report.html`` atomically (temporary file +
``os.replace``). :func:`render_html` is a pure function of the dict: the page shows exactly the
data of the JSON, and its figures are drawn from it (matplotlib, SVG, embedded as ``data:``
images). :func:`make_report` measures and builds in one call (the ``maceq report`` command).
The schema is docs/report-schema.md and reports/report.schema.json.

Definitions (also printed in the page):

- Layer metrics: the engine's pooled statistics (reports/analysis.py) of the ``accumulated``
  comparison (the whole int8 model against float) when measured, else the ``isolated`` one;
  ``metrics_mode`` says which. ``max_abs_err`` is the engine's ``max_abs``.
- Worst first: ascending ``sqnr_db``, then ascending ``cosine``, then execution order; layers
  without metrics (float32) come last in execution order.
- Model size: ``float_weight_bytes`` is the bytes of the constant tensors of the optimised float
  graph (the one that was quantized: BN folded) at their ONNX element types; a device's
  ``int8_weight_bytes`` is the bytes of the int8 model's constant tensors (uint8 weights, int32
  biases, float32 constants of float layers) and ``data_file_bytes`` the size of its .data file.
- Peak activation memory: the model runs once (batch 1, the first image) in the device
  simulation; every non-constant tensor (the float input included) is live from the op that
  makes it to the last op that reads it (graph outputs to the end); the peak is the largest sum
  of the live tensors' bytes (their real dtypes: uint8 = 1 byte, float32 = 4) over the op
  schedule, with no buffer reuse or in-place ops assumed. ``float32_peak_bytes`` is the same
  schedule with 4 bytes per element (the float model's activations); ``largest_tensor_bytes``
  is the single largest tensor.
- Histograms: calibration histograms are not stored, so the values are the float tensors of the
  first ``hist_images`` evaluation images (onnxruntime on the float graph). The clipping range is
  the device's representable range of the layer's output, ``scale * ([0, 255] - zero_point)``;
  values outside it saturate.
"""
from __future__ import annotations

import base64
import contextlib
import copy
import io
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from maceq.calibrate.methods import RangeMethod
from maceq.calibrate.parallel import TaskPool, check_workers
from maceq.errors import MaceqError
from maceq.mace.cost import op_macs
from maceq.quant.config import LayerOverride, QuantConfig
from maceq.reports.analysis import analyze_layers, float_reference
from maceq.reports.budget import Budget, evaluate_budget, load_budget
from maceq.reports.cost import float_share
from maceq.reports.evaluate import eval_job, evaluate_many
from maceq.reports.verdict import READING, verdict
from maceq.runtime.devices import Device
from maceq.runtime.model import Model, load
from maceq.yamlio import atomic_write

SCHEMA_VERSION = 1
HERE = Path(__file__).resolve().parent
TEMPLATE_DIR = HERE / "templates"
SCHEMA_PATH = HERE / "report.schema.json"
DT_FLOAT, DT_UINT8 = 1, 2
BOUNDARY_OPS = ("Quantize", "Dequantize")
#: Data-URI media types the page may embed (the page's Content-Security-Policy allows data: images only).
SVG_MIME = "image/svg+xml"


def json_float(v: float | None):
    """JSON has no infinities or NaN: +-inf become 'inf' / '-inf', NaN becomes null."""
    if v is None:
        return None
    v = float(v)
    if math.isfinite(v):
        return v
    return None if math.isnan(v) else ("inf" if v > 0 else "-inf")


def as_float(v) -> float | None:
    """Inverse of :func:`json_float` (for values read back from a report dict)."""
    if v is None:
        return None
    return float(v)


# ------------------------------------------------------------------------------------------------
# Pieces of the report
# ------------------------------------------------------------------------------------------------

def evenly_spaced(data, n: int | None):
    """A copy of an ImageFolder keeping ``n`` files evenly spaced over its sorted list (all when
    ``n`` is None or >= its size): class-sorted folders then give every class a share."""
    if n is None or n >= len(data.files):
        return data
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise MaceqError(f"image count must be a positive int, got {n!r}")
    idx = np.linspace(0, len(data.files) - 1, n).round().astype(np.int64)
    sub = copy.copy(data)
    sub.files = [data.files[i] for i in idx]
    if data.labels is not None:
        sub.labels = data.labels[idx]
    return sub


def range_config(meta: Mapping):
    """The QuantConfig the model was calibrated with (range method, percentile, per-layer
    overrides), rebuilt from its recorded metadata: ``config.method_for(tensor)`` then gives
    each tensor's range method by the quantizer's own rule."""

    kw = {}
    if meta.get("range_method"):
        kw["range_method"] = RangeMethod(meta["range_method"])
    if meta.get("percentile") is not None:
        kw["percentile"] = float(meta["percentile"])
    layers = []
    for pattern, ov in (meta.get("layer_overrides") or {}).items():
        layers.append(LayerOverride(pattern, RangeMethod(ov["range_method"]) if ov.get("range_method") else None,
                                    float(ov["percentile"]) if ov.get("percentile") is not None else None))
    return QuantConfig(layers=tuple(layers), **kw)


def op_placement(model, device: str) -> dict[str, tuple[str, str]]:
    """Op name -> (where it runs, why it fell back). The cpu device runs every op on the cpu
    (runtime.model._placement_of), so no probe run is made there; other devices ask
    :meth:`Model.placement`."""
    if device == "cpu":
        return {op.name: ("cpu", "") for op in model.ops}
    return model.placement(device)


def activation_memory(model, device: str, x: np.ndarray) -> dict:
    """Peak activation memory of one inference of ``x`` (batch 1) on ``device`` (see the module
    docstring for the definition)."""
    run = model.run({model.input_names[0]: x[:1]}, device=device, intermediates=True)
    ops = model.ops
    last = len(ops) - 1
    birth: dict[str, int] = {n: -1 for n in model.input_names}
    death: dict[str, int] = {}
    for i, op in enumerate(ops):
        for t in op.outputs:
            birth[t] = i
        for t in op.inputs:
            if t in birth:
                death[t] = i
    for t in model.output_names:
        death[t] = last
    size = {t: int(run.tensors[t].values.nbytes) for t in birth if t in run.tensors}
    elems = {t: int(run.tensors[t].values.size) for t in size}
    # Sweep: +bytes at birth (an input is live from step 0), -bytes after its last step.
    delta = np.zeros(len(ops) + 1, np.int64)
    delta32 = np.zeros(len(ops) + 1, np.int64)
    for t in size:
        b, d = max(birth[t], 0), max(death.get(t, birth[t]), birth[t], 0)
        delta[b] += size[t]
        delta[d + 1] -= size[t]
        delta32[b] += 4 * elems[t]
        delta32[d + 1] -= 4 * elems[t]
    live = np.cumsum(delta)[:len(ops)]
    live32 = np.cumsum(delta32)[:len(ops)]
    at = int(np.argmax(live))
    big = max(size, key=lambda t: (size[t], t))
    return {"peak_bytes": int(live[at]), "peak_at_op": ops[at].name, "float32_peak_bytes": int(live32.max()),
            "largest_tensor": model.tensor_map.get(big, big), "largest_tensor_bytes": size[big],
            "tensors": len(size)}


def _onnx_const_bytes(m) -> int:
    from onnx import helper

    total = 0
    for t in m.graph.initializer:
        n = int(np.prod(t.dims, dtype=np.int64)) if len(t.dims) else 1
        total += n * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    return int(total)


def _stats_dict(s) -> dict:
    return {"sqnr_db": json_float(s.sqnr_db), "cosine": json_float(s.cosine), "rel_l2": json_float(s.rel_l2),
            "max_abs_err": json_float(s.max_abs), "elements": int(s.elements)}


def _worst_key(row: dict):
    if not row["measured"]:
        return (1, 0.0, 0.0, row["index"])
    return (0, as_float(row["sqnr_db"]), as_float(row["cosine"]), row["index"])


def layer_rows(model, device: str, layers: Sequence | None, producers: Mapping[str, str],
               placement: Mapping[str, tuple[str, str]]) -> list[dict]:
    """One row per layer of ``model`` on ``device``, worst first: the quantized layers the engine
    measured (``layers``: LayerError list) and the float32 layers (requested or fallback)."""
    meta = model.maceq_meta
    cfg = range_config(meta)
    tmap = model.tensor_map
    requested = set(meta.get("fp32_layers") or ())
    fallback = set(meta.get("float_fallback") or ())
    by_op = {L.op: L for L in (layers or ())}
    outs = set(model.output_names)
    outs |= {op.inputs[0] for op in model.ops if op.type == "Dequantize" and op.outputs and op.outputs[0] in outs}
    macs = {op.name: op_macs(op, model.consts) for op in model.net_def.op}
    rows = []
    for idx, op in enumerate(model.ops):
        if op.type in BOUNDARY_OPS or not op.outputs:
            continue
        tensor = tmap.get(op.outputs[0], op.outputs[0])
        L = by_op.get(op.name)
        t = op.arg("T")
        if L is None and tensor not in producers:
            continue  # no source-graph tensor (the engine's rule, analysis.quantized_layers)
        node = L.node if L is not None else producers.get(tensor)
        name = node or op.name
        q = op.out_qinfo[0] if op.out_qinfo else None
        where, why = placement.get(op.name, (device, ""))
        if t == DT_FLOAT:
            precision = "fp32"
            reason = "requested" if name in requested else ("float fallback" if name in fallback else "float")
        else:
            precision, reason = "uint8", ""
        method, pct = cfg.method_for(tensor)
        row = {
            "name": name, "op": op.type, "mace_op": op.name, "tensor": tensor, "device": device,
            "index": idx, "placement": where, "fallback_reason": why, "precision": precision,
            "fp32_reason": reason,
            "scale": None if q is None or t == DT_FLOAT else float(q.scale),
            "zero_point": None if q is None or t == DT_FLOAT else int(q.zero_point),
            "range_min": None if q is None or t == DT_FLOAT else float(q.minval),
            "range_max": None if q is None or t == DT_FLOAT else float(q.maxval),
            "range_method": method.value,
            "percentile": pct if method.value == "percentile" else None,
            "measured": False, "metrics_mode": None,
            "sqnr_db": None, "cosine": None, "rel_l2": None, "max_abs_err": None, "elements": None,
            "accumulated": None, "isolated": None,
            "is_output": op.outputs[0] in outs, "macs": macs.get(op.name, 0),
        }
        if L is not None:
            acc = None if L.accumulated is None else _stats_dict(L.accumulated)
            iso = None if L.isolated is None else _stats_dict(L.isolated)
            primary, mode = (acc, "accumulated") if acc is not None else (iso, "isolated")
            if primary is not None:
                row.update({k: primary[k] for k in ("sqnr_db", "cosine", "rel_l2", "max_abs_err", "elements")})
                row.update(measured=True, metrics_mode=mode)
            row.update(accumulated=acc, isolated=iso)
        rows.append(row)
    rows.sort(key=_worst_key)
    return rows


def activation_histograms(ref, rows_by_device: Mapping[str, list[dict]], x: np.ndarray, *, worst_k: int,
                          bins: int) -> list[dict]:
    """Histograms of the float values of each device's ``worst_k`` measured layers on the images
    ``x`` (onnxruntime on the float graph ``ref``), with the device's clipping range."""
    picks = []
    for device, rows in rows_by_device.items():
        picks += [r for r in rows if r["measured"] and r["scale"] is not None][:worst_k]
    if not picks:
        return []
    tensors = list(dict.fromkeys(r["tensor"] for r in picks))
    ref.open(tensors)
    vals = ref.run(x, tensors)
    out = []
    for r in picks:
        v = np.asarray(vals[r["tensor"]], np.float64).ravel()
        s, zp = r["scale"], r["zero_point"]
        lo, hi = float(np.float32(s) * (0 - zp)), float(np.float32(s) * (255 - zp))
        a, b = min(float(v.min()), lo), max(float(v.max()), hi)
        if a == b:
            a, b = a - 0.5, b + 0.5
        counts, edges = np.histogram(v, bins=bins, range=(a, b))
        out.append({"device": r["device"], "name": r["name"], "tensor": r["tensor"], "images": int(len(x)),
                    "values": int(v.size), "min": float(v.min()), "max": float(v.max()),
                    "clip_min": lo, "clip_max": hi, "range_min": r["range_min"], "range_max": r["range_max"],
                    "clipped_below": float(np.mean(v < lo)), "clipped_above": float(np.mean(v > hi)),
                    "edges": [float(e) for e in edges], "counts": [int(c) for c in counts]})
    return out


def _mixed_section(model, mixed) -> dict:
    meta = model.maceq_meta
    auto = None
    if mixed is not None:
        d = mixed.to_dict() if hasattr(mixed, "to_dict") else dict(mixed)
        auto = {k: v for k, v in d.items() if k != "layers"}
    elif meta.get("auto_mixed_precision"):
        auto = {"record": meta["auto_mixed_precision"]}
    return {"fp32_layers": list(meta.get("fp32_layers") or []),
            "float_fallback": list(meta.get("float_fallback") or []), "auto": auto}


def _eval_summary(ev) -> dict:
    if ev is None:
        return {"images": None, "skipped": None, "top1_agreement": None, "top5_containment": None,
                "float_accuracy": None, "int8_accuracy": None, "accuracy_drop_points": None, "output_sqnr_db": None}
    drop = None
    if ev.float_accuracy is not None and ev.int8_accuracy is not None:
        drop = 100.0 * (ev.float_accuracy - ev.int8_accuracy)
    return {"images": ev.images, "skipped": ev.skipped, "top1_agreement": ev.top1_agreement,
            "top5_containment": ev.float_top1_in_int8_top5, "float_accuracy": ev.float_accuracy,
            "int8_accuracy": ev.int8_accuracy, "accuracy_drop_points": drop,
            "output_sqnr_db": json_float(getattr(ev, "sqnr_db", None))}


def _device_summary(m, device: str, ev, rows: list[dict], x) -> dict:
    """One device's summary: the evaluation's figures, sizes, peak activation memory, layer counts."""
    data_path = getattr(getattr(m.loaded, "files", None), "data", None)
    s = _eval_summary(ev)
    s.update({
        "int8_weight_bytes": int(sum(a.nbytes for a in m.consts.values())),
        "data_file_bytes": os.path.getsize(data_path) if data_path and os.path.exists(data_path) else None,
        "peak_activation": activation_memory(m, device, x) if x is not None else None,
        "layers_uint8": sum(1 for r in rows if r["precision"] == "uint8"),
        "layers_fp32": sum(1 for r in rows if r["precision"] == "fp32"),
        "layers_measured": sum(1 for r in rows if r["measured"]),
        "worst_layer": next((r["name"] for r in rows if r["measured"]), None),
    })
    return s


def _device_paths(model, device: str) -> dict:
    """Ops computed differently from the model's meaning on ``device``, and the safe forms written instead."""
    meta = model.maceq_meta
    return {"deviations": [{"op": op, "reason": why} for op, why in model.deviations(device).items()],
            "safe_forms": [{"op": f["op"], "reason": f["reason"]} for f in meta.get("safe_forms") or []],
            "safe_form_cost": meta.get("safe_form_cost")}


def _first_images(images, n: int) -> np.ndarray:
    got = []
    for batch in images.iter_batches(min(n, 8)):
        got.append(batch.data)
        if sum(len(g) for g in got) >= n:
            break
    return np.concatenate(got)[:n]


def build_report(models: Mapping[str, Any], *, float_model, evals: Mapping[str, Any] | None = None,
                 layers: Mapping[str, Sequence] | None = None, images=None, mixed: Mapping[str, Any] | None = None,
                 recovery: Iterable[Mapping] = (), budget=None, model_name: str | None = None,
                 analysis_images: int | None = None, worst_k: int = 3, hist_images: int = 2,
                 hist_bins: int = 60) -> dict:
    """The report dict (report.json's content) from measured pieces.

    ``models``: device -> loaded int8 :class:`~maceq.runtime.model.Model` (one per device).
    ``float_model``: the optimised float graph (``Calibration.graph`` / ``QuantizeResult.graph``),
    its ONNX, or the source ONNX path (re-optimised as the quantizer does).
    ``evals``: device -> EvalResult; ``layers``: device -> list of LayerError (a device missing
    from either shows "not measured"). ``images``: the evaluation ImageFolder (the first
    ``hist_images`` images give the histograms and the activation-memory run).
    ``mixed``: device -> MixedResult of an automatic mixed-precision search (or its to_dict()).
    ``recovery``: accuracy-recovery steps applied, each a mapping with at least ``step`` and
    ``detail``. ``budget``: a :class:`maceq.reports.budget.Budget` to check the report against.
    ``analysis_images``: how many images the layer analysis ran on (recorded in the report).
    """
    if not models:
        raise MaceqError("report: no model given")
    devices = list(models)
    evals, layers, mixed = dict(evals or {}), dict(layers or {}), dict(mixed or {})
    first = models[devices[0]]
    meta = first.maceq_meta
    ref = float_reference(float_model, first)
    x = _first_images(images, hist_images) if images is not None else None
    rows_by_device, summary, placement = {}, {}, {}
    for device in devices:
        m = models[device]
        if m.maceq_meta.get("device", device) != device:
            raise MaceqError(f"report: the model given for device '{device}' was quantized for "
                             f"'{m.maceq_meta.get('device')}'")
        place = op_placement(m, device)
        rows = layer_rows(m, device, layers.get(device), ref.producers, place)
        rows_by_device[device] = rows
        falls = [{"op": op.name, "type": op.type, "reason": place[op.name][1]}
                 for op in m.ops if place[op.name][0] != device]
        placement[device] = {"ops": len(m.ops), "on_device": len(m.ops) - len(falls), "on_cpu_fallback": len(falls),
                             "boundary_transfers": m.boundary_transfers(place), "fallbacks": falls}
        summary[device] = _device_summary(m, device, evals.get(device), rows, x)
    hists = activation_histograms(ref, rows_by_device, x, worst_k=worst_k, bins=hist_bins) if x is not None else []
    source = meta.get("source_model")
    report = {
        "schema_version": SCHEMA_VERSION,
        "generator": "maceq",
        "model": {
            "name": model_name or (Path(source).stem if source else None),
            "source": source, "source_sha256": meta.get("source_sha256"),
            "source_bytes": os.path.getsize(source) if source and os.path.exists(source) else None,
            "input_shape": meta.get("input_shape"), "range_method": meta.get("range_method"),
            "percentile": meta.get("percentile"), "calibration_images": meta.get("calibration_images"),
        },
        "devices": devices,
        "data": {
            "images": str(images.root) if images is not None else None,
            "labels": bool(images is not None and images.labels is not None),
            "analysis_images": analysis_images,
            "histogram_images": int(len(x)) if x is not None else 0,
        },
        "summary": {"float_weight_bytes": _onnx_const_bytes(ref.model), "devices": summary},
        "layers": [r for d in devices for r in rows_by_device[d]],
        "histograms": hists,
        "mixed_precision": {d: _mixed_section(models[d], mixed.get(d)) for d in devices},
        "recovery": [dict(r) for r in recovery] + list(meta.get("recovery") or []),
        "placement": placement,
        "device_paths": {d: _device_paths(models[d], d) for d in devices},
        "float_share": {d: _float_share_dict(models[d], d) for d in devices},
        "weight_grid": {d: models[d].maceq_meta.get("weight_grid") for d in devices},
        "budget": None,
    }
    report["verdict"] = verdict(report)
    if budget is not None:
        attach_budget(report, budget)
    return report


def _float_share_dict(model, device: str) -> dict:
    fs = float_share(model, device)
    return {"mac_share": fs.float_mac_share, "value_share": fs.float_value_share, "float_ops": fs.float_ops,
            "ops": fs.ops, "boundaries": fs.boundaries, "transfers": fs.transfers, "line": fs.describe()}


def attach_budget(report: dict, budget) -> dict:
    """Check ``report`` against ``budget`` and record the outcome in ``report['budget']``."""
    results = evaluate_budget(report, budget)
    violations = [v.to_dict() for _, v in results if v is not None]
    report["budget"] = {"source": budget.source, "ok": not violations, "checks": len(results),
                        "violations": violations}
    report["verdict"] = verdict(report)
    return report


# ------------------------------------------------------------------------------------------------
# Figures and HTML
# ------------------------------------------------------------------------------------------------

def _svg_uri(fig) -> str:
    import matplotlib

    buf = io.BytesIO()
    with matplotlib.rc_context({"svg.hashsalt": "maceq", "svg.fonttype": "none"}):
        fig.savefig(buf, format="svg", metadata={"Date": None}, bbox_inches="tight")
    return f"data:{SVG_MIME};base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def depth_figure(rows: list[dict], device: str) -> str | None:
    """SQNR (dB) against depth (execution order) for one device's measured layers."""
    from matplotlib.figure import Figure

    pts = sorted((r["index"], r) for r in rows if r["measured"])
    if not pts:
        return None
    fig = Figure(figsize=(5.4, 2.9))
    ax = fig.subplots()
    xs = list(range(len(pts)))
    for mode, style in (("accumulated", "o-"), ("isolated", "s--")):
        ys = [as_float(r[mode]["sqnr_db"]) if r[mode] else None for _, r in pts]
        if any(y is not None for y in ys):
            ax.plot([x for x, y in zip(xs, ys) if y is not None and math.isfinite(y)],
                    [y for y in ys if y is not None and math.isfinite(y)], style, ms=3, lw=1.2, label=mode)
    ax.set_xlabel("layer depth (execution order of quantized layers)")
    ax.set_ylabel("SQNR (dB)")
    ax.set_title(f"error vs depth: {device}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _svg_uri(fig)


def tradeoff_figure(auto: Mapping | None, device: str) -> str | None:
    """The mixed-precision trade-off: the search's metric against fp32 layers and against weight bytes."""
    from matplotlib.figure import Figure

    points = (auto or {}).get("tradeoff") or []
    if not points:
        return None
    fig = Figure(figsize=(7.6, 2.8))
    ax1, ax2 = fig.subplots(1, 2)
    n = [p["n_fp32"] for p in points]
    v = [p["value"] for p in points]
    size = [p["data_bytes"] / 1e6 for p in points]
    metric = points[0]["metric"].replace("_", " ")
    ax1.plot(n, v, "o-", ms=4)
    ax1.set_xlabel("layers in float32")
    ax2.plot(size, v, "o-", ms=4, color="C1")
    ax2.set_xlabel("weights (.data, MB)")
    for ax in (ax1, ax2):
        ax.set_ylabel(f"{metric} (%)")
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"mixed-precision trade-off: {device}", fontsize=9)
    return _svg_uri(fig)


def histogram_figure(h: dict) -> str:
    """Histogram of a layer's float values (log counts) with the clipping range marked."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.6, 2.8))
    ax = fig.subplots()
    edges = np.asarray(h["edges"])
    ax.stairs(np.asarray(h["counts"]), edges, fill=True, alpha=0.8)
    ax.axvline(h["clip_min"], color="C3", lw=1.2, ls="--", label="clipping range")
    ax.axvline(h["clip_max"], color="C3", lw=1.2, ls="--")
    ax.set_yscale("log")
    ax.set_xlabel("float value")
    ax.set_ylabel("count")
    ax.set_title(f"{h['device']}: {h['name'][-48:]}", fontsize=8)
    ax.legend(fontsize=7)
    return _svg_uri(fig)


def _fmt(v, digits: int = 4) -> str:
    """Numbers for the page: 'inf' strings pass through, None is an em dash."""
    if v is None:
        return "\u2014"
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:.{digits}g}"


def _pct(v) -> str:
    return "\u2014" if v is None else f"{100.0 * v:.2f}%"


def render_html(report: Mapping) -> str:
    """report.html's text: a pure function of the report dict (Jinja2, autoescape on)."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["num"] = _fmt
    env.filters["pct"] = _pct
    figs = {d: depth_figure([r for r in report["layers"] if r["device"] == d], d) for d in report["devices"]}
    hist_figs = [histogram_figure(h) for h in report["histograms"]]
    trade_figs = {d: tradeoff_figure(report["mixed_precision"][d].get("auto"), d) for d in report["devices"]}
    return env.get_template("report.html.j2").render(r=report, depth_figs=figs, hist_figs=hist_figs,
                                                     trade_figs=trade_figs, reading=READING)


@dataclass(frozen=True)
class ReportFiles:
    json: Path
    html: Path


def report_json_text(report: Mapping) -> str:
    return json.dumps(report, indent=1, allow_nan=False) + "\n"


def write_report(report: Mapping, output_dir: str | os.PathLike, *, stem: str = "report") -> ReportFiles:
    """Write ``<stem>.json`` and ``<stem>.html`` into ``output_dir`` (each atomically)."""
    out = Path(output_dir)
    text = report_json_text(report)  # before any file is touched: a non-JSON value fails here
    html = render_html(report)
    j, h = out / f"{stem}.json", out / f"{stem}.html"
    atomic_write(j, text.encode("utf-8"))
    atomic_write(h, html.encode("utf-8"))
    return ReportFiles(j, h)


def _phase(progress: bool, text: str) -> None:
    """One line on stderr as a long report phase starts (the bars within show only on a terminal)."""
    if progress:
        print(f"report {text}", file=sys.stderr, flush=True)


def _layers_task(job, item: tuple, report) -> list:
    """One device's per-layer analysis in a worker (``item``: (device, float model path, images))."""
    device, float_model, sub = item
    return analyze_layers(Model(dict(job.loaded)[device]), float_model, sub, device=device, progress=False)


def _analyze(models: dict, float_model, sub, *, progress: bool, pool) -> dict:
    """Each device's per-layer analysis on ``sub``: in this process, or one task per device on ``pool`` (a
    device's analysis runs whole in one process either way, so it is the same for any number of workers)."""
    if pool is None:
        layers = {}
        for k, (d, m) in enumerate(models.items(), 1):
            _phase(progress, f"[{k}/{len(models)}] {d}: per-layer analysis on {len(sub.files)} images")
            layers[d] = analyze_layers(m, float_model, sub, device=d, progress=progress)
        return layers
    _phase(progress, f"per-layer analysis of {', '.join(models)} on {len(sub.files)} images, one worker each")
    items = [(Device.parse(d).value, os.fspath(float_model), sub) for d in models]
    return dict(zip(models, pool.map(_layers_task, items)))


def make_report(qmodels: Mapping[str, Any] | Sequence, images, *, output_dir: str | os.PathLike,
                float_model=None, analysis_images: int | None = 32, mixed: Mapping[str, Any] | None = None,
                recovery: Iterable[Mapping] = (), budget=None, evals: Mapping[str, Any] | None = None,
                progress: bool = True, batch_size: int = 16, workers: int = 1, executor: str = "local",
                ray_address: str | None = None) -> tuple[dict, ReportFiles]:
    """Measure and write a report (``maceq report``, and ``quantize`` when it evaluates images).

    ``qmodels``: device -> a loaded Model, its ModelFiles (``QuantizeResult.per_device``) or a
    path to its .yml/.pb; or a list of those, each for the device its metadata names (default
    cpu). ``images``: an ImageFolder
    (labels from class folders or a CSV give the accuracy). ``float_model``: the optimised graph
    (``QuantizeResult.graph``) or an ONNX path; default: the source model the quantizer recorded.
    ``analysis_images``: the layer analysis runs on this many evenly spaced images (None: all).
    ``evals``: EvalResults already measured (not run again). ``budget``: a Budget or a path.
    ``workers``/``executor``/``ray_address``: the evaluation's shards (:func:`evaluate_many`: every device in one pass).
    """

    def _load(m):
        if isinstance(m, (str, os.PathLike)):
            return load(m)
        return load(m.yml) if hasattr(m, "yml") else m  # ModelFiles, or a loaded Model

    if isinstance(qmodels, Mapping):
        models = {d: _load(m) for d, m in qmodels.items()}
    else:
        loaded = [_load(m) for m in qmodels]
        models = {m.maceq_meta.get("device", "cpu"): m for m in loaded}
        if len(models) != len(loaded):
            raise MaceqError("report: give one model per device (two models were quantized for the same device)")
    meta = next(iter(models.values())).maceq_meta
    float_model = float_model if float_model is not None else meta.get("source_model")
    if float_model is None:
        raise MaceqError("report: no float model recorded in the quantized model; pass --float-model")
    source = meta.get("source_model") or float_model
    if not isinstance(source, (str, os.PathLike)):
        raise MaceqError("report: the quantized model records no source ONNX to evaluate against")
    if budget is not None and not isinstance(budget, Budget):
        budget = load_budget(budget)
    evals = dict(evals or {})
    sub = evenly_spaced(images, analysis_images)
    todo = {d: m for d, m in models.items() if d not in evals}
    with contextlib.ExitStack() as stack:
        pool = None
        if check_workers(workers) > 1 and isinstance(float_model, (str, os.PathLike)):  # one pool for both phases
            pool = stack.enter_context(TaskPool(eval_job(models, source, batch_size), executor=executor,
                                                workers=workers, ray_address=ray_address, progress_queue=True))
        if todo:  # every device in one pass: each image read and run through the float model once
            _phase(progress, f"evaluating {', '.join(todo)} on {len(images)} images")
            evals.update(evaluate_many(todo, source, images, batch_size=batch_size, progress=progress,
                                       workers=workers, executor=executor, ray_address=ray_address, pool=pool))
        layers = _analyze(models, float_model, sub, progress=progress, pool=pool)
    report = build_report(models, float_model=float_model, evals=evals, layers=layers, images=images,
                          mixed=mixed, recovery=recovery, budget=budget, analysis_images=len(sub.files))
    return report, write_report(report, output_dir)
