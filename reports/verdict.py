"""The report's verdict: is the int8 model fit to ship on each device, which layers cost the most,
and which switch would recover them.

The verdict is read off the report's own measurements; nothing is run again:

* against the budget when one is attached (``maceq check``'s rules: any violation on a device makes
  it unfit), otherwise against :data:`DEFAULTS`: top-1 agreement with the float model, the accuracy
  drop where labels exist, and, without an evaluation, the SQNR of the model's output;
* the costliest layers are the quantized ones whose own error is largest: lowest *isolated* SQNR
  (the layer run on float inputs), the accumulated SQNR where no isolated figure was measured;
* advice names switches the report shows were not used (the accuracy recipe, the range method,
  per-channel weights on the gpu) and the layers an fp32 exemption would target, with their float
  MACs, the cost in device time they would add, and the gains an automatic search measured.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from maceq.reports.cost import FLOAT_SHARE_WARNING

__all__ = ["DEFAULTS", "READING", "Thresholds", "costliest", "verdict", "verdict_lines"]


@dataclass(frozen=True)
class Thresholds:
    """Fit to ship at or past ``*_fit``; worth a review at or past ``*_review``; unfit beyond."""

    agreement_fit: float = 0.95       # top-1 agreement with the float model
    agreement_review: float = 0.85
    drop_fit: float = 1.0             # accuracy drop, points
    drop_review: float = 3.0
    sqnr_fit: float = 20.0            # output SQNR, dB, where no evaluation ran
    sqnr_review: float = 12.0


DEFAULTS = Thresholds()

#: what the figures mean in practice (shown beside the verdict)
READING = (
    ("SQNR", "signal-to-quantization-noise ratio, 10 log10(sum f^2 / sum (f - q)^2) of the float output f "
             "and the int8 output q: 30 dB means the noise carries 1/1000 of the signal's power and is rarely "
             "visible; 20 dB (1%) changes the top class only on borderline inputs; 10 dB (10%) visibly "
             "degrades masks and boxes; below 5 dB the output is mostly noise"),
    ("top-1 agreement", "the share of images whose int8 top class equals the float model's: 95% means one "
                        "image in twenty is answered differently (mostly images the float model itself "
                        "is unsure of); 85% means one in seven"),
    ("accuracy drop", "float accuracy minus int8 accuracy on labelled images, in points: within 1 point is "
                      "the usual bar for shipping a quantized classifier"),
)

_STATUS = ("fit to ship", "review", "not fit")


def _grade(value: float | None, fit: float, review: float, *, higher_is_better: bool = True) -> int | None:
    if value is None:
        return None
    if not higher_is_better:
        value, fit, review = -value, -fit, -review
    return 0 if value >= fit else (1 if value >= review else 2)


def _output_sqnr(report: Mapping, device: str) -> float | None:
    """The evaluation's output SQNR, else the layer analysis's worst model-output layer."""
    ev = report["summary"]["devices"][device].get("output_sqnr_db")
    if isinstance(ev, (int, float)):
        return float(ev)
    outs = [r["sqnr_db"] for r in report["layers"] if r["device"] == device and r.get("is_output")
            and isinstance(r["sqnr_db"], (int, float))]
    return min(outs) if outs else None


def _against_defaults(report: Mapping, device: str, t: Thresholds) -> tuple[int | None, list[str]]:
    s = report["summary"]["devices"][device]
    checks = []
    if s.get("top1_agreement") is not None:
        a = s["top1_agreement"]
        checks.append((_grade(a, t.agreement_fit, t.agreement_review),
                       f"top-1 agreement {100 * a:.1f}% (fit >= {100 * t.agreement_fit:.0f}%, "
                       f"review >= {100 * t.agreement_review:.0f}%)"))
    if s.get("accuracy_drop_points") is not None:
        d = s["accuracy_drop_points"]
        checks.append((_grade(d, t.drop_fit, t.drop_review, higher_is_better=False),
                       f"accuracy drop {d:.2f} points (fit <= {t.drop_fit:g}, review <= {t.drop_review:g})"))
    if not checks:
        q = _output_sqnr(report, device)
        if q is not None:
            checks.append((_grade(q, t.sqnr_fit, t.sqnr_review),
                           f"output SQNR {q:.1f} dB (fit >= {t.sqnr_fit:g} dB, review >= {t.sqnr_review:g} dB)"))
    if not checks:
        return None, ["nothing measured: evaluate on images (--eval-dir) to get a verdict"]
    return max(g for g, _ in checks), [why for _, why in checks]


def _against_budget(report: Mapping, device: str) -> tuple[int, list[str]]:
    mine = [v for v in report["budget"]["violations"] if v["device"] == device]
    if mine:
        return 2, [v["message"] for v in mine]
    return 0, [f"every check of {report['budget']['source']} holds"]


def costliest(report: Mapping, device: str, k: int = 3) -> list[dict]:
    """The ``k`` quantized layers with the largest error of their own (lowest isolated SQNR)."""
    def own(r):
        iso = (r.get("isolated") or {}).get("sqnr_db")
        return iso if iso is not None else r["sqnr_db"]
    rows = [r for r in report["layers"] if r["device"] == device and r["precision"] == "uint8"
            and r["measured"] and own(r) is not None]
    rows.sort(key=lambda r: (own(r), r["index"]))
    return [{"name": r["name"], "op": r["op"], "tensor": r["tensor"], "own_sqnr_db": own(r),
             "sqnr_db": r["sqnr_db"], "float_macs": r.get("macs"), "range_method": r["range_method"]}
            for r in rows[:k]]


def _measured_gains(report: Mapping, device: str) -> list[str]:
    auto = ((report.get("mixed_precision") or {}).get(device) or {}).get("auto") or {}
    trail = auto.get("trail") or []
    out = []
    for prev, step in zip(trail, trail[1:]):
        if step.get("exempted"):
            db = step.get("sqnr_db"), prev.get("sqnr_db")
            sqnr = (f", {db[0] - db[1]:+.2f} dB logits SQNR" if all(isinstance(x, (int, float)) for x in db)
                    else "")
            out.append(f"{step.get('kind') or 'layer'} {step['exempted']} in float32: "
                       f"{step['value'] - prev['value']:+.1f} points ({step['metric']}){sqnr}, measured")
    return out


def _advice(report: Mapping, device: str, worst: list[dict]) -> list[str]:
    steps = {str(r.get("step", "")) for r in report.get("recovery") or []}
    method = report["model"].get("range_method")
    tips = []
    collapsed = (((report.get("weight_grid") or {}).get(device)) or {}).get("collapsed") or []
    if collapsed:
        tips.append("keep in float32 what the 8-bit weight grid cannot compute: " + "; ".join(
            f"--fp32 {c['layer']} (its weights' rounding alone leaves {c['sqnr_db']:.1f} dB)" for c in collapsed))
    if not steps & {"cross-layer equalization", "bias correction"}:
        tips.append("--recipe accurate: cross-layer equalization, consumer-chosen ranges, AdaRound and bias correction, the "
                    "combination bench/accuracy.py measured best")
    elif method == "percentile" and any(w["range_method"] == "percentile" for w in worst):
        tips.append("--range-method mse: the costliest tensors use percentile clipping")
    gains = _measured_gains(report, device)
    if gains:
        tips.append("fp32 exemptions the automatic search measured: " + "; ".join(gains))
    elif worst:
        cost = ", ".join(f"{w['name']} ({w['float_macs']:,} MACs)" if w.get("float_macs") else w["name"]
                         for w in worst)
        tips.append(f"fp32 candidates: {cost}; each exemption adds a Dequantize and a Quantize (two "
                    f"boundary passes over its tensors) and its MACs run in float; --accuracy-budget N "
                    f"measures each candidate's gain")
    share = ((report.get("float_share") or {}).get(device) or {}).get("value_share")
    if share is not None and share > FLOAT_SHARE_WARNING:
        tips.append(f"{100 * share:.0f}% of the activation values are computed or converted in float32: "
                    f"expect the int8 model to be slow on this device")
    agree = report["summary"]["devices"][device].get("top1_agreement")
    gpu = report["summary"]["devices"].get("gpu", {}).get("top1_agreement")
    if device != "gpu" and agree is not None and gpu is not None and gpu - agree >= 0.03:
        tips.append(f"the gpu's per-channel int8 weights reach {100 * gpu:.1f}% agreement here: the per-tensor "
                    f"weights of {device} limit it")
    return tips


def verdict(report: Mapping, thresholds: Thresholds = DEFAULTS) -> dict:
    """device -> {"status", "against", "reasons", "costliest", "advice"} from a built report."""
    out = {}
    for device in report["devices"]:
        if report.get("budget") is not None:
            grade, reasons = _against_budget(report, device)
            against = f"budget {report['budget']['source']}"
        else:
            grade, reasons = _against_defaults(report, device, thresholds)
            against = "maceq's defaults"
        worst = costliest(report, device)
        out[device] = {"status": "not measured" if grade is None else _STATUS[grade], "against": against,
                       "reasons": reasons, "costliest": worst,
                       "advice": _advice(report, device, worst) if grade else []}
    return out


def verdict_lines(report: Mapping) -> list[str]:
    """The verdict as the command line prints it: per device, the status, why, and the first advice."""
    lines = []
    for device, v in (report.get("verdict") or {}).items():
        lines.append(f"verdict [{device}]: {v['status']} ({v['against']}): {'; '.join(v['reasons'])}")
        if v["status"] in ("review", "not fit"):
            if v["costliest"]:
                lines.append("  costliest layers: " + ", ".join(
                    f"{c['name']} ({c['own_sqnr_db']:.1f} dB)" if isinstance(c["own_sqnr_db"], float)
                    else c["name"] for c in v["costliest"]))
            lines += [f"  try: {tip}" for tip in v["advice"][:2]]
    return lines
