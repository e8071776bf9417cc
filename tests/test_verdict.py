"""The report's verdict: status against the budget or the defaults, costliest layers, advice."""
import pytest

from maceq.reports.verdict import Thresholds, verdict, verdict_lines

pytestmark = pytest.mark.unit


def _row(device, name, sqnr, iso, *, index, precision="uint8", method="percentile", is_output=False, macs=0):
    return {"device": device, "name": name, "op": "Conv2D", "tensor": name + ":0", "index": index,
            "precision": precision, "measured": sqnr is not None, "sqnr_db": sqnr,
            "isolated": None if iso is None else {"sqnr_db": iso}, "range_method": method,
            "is_output": is_output, "macs": macs}


def _report(devices, summary, layers, *, recovery=(), budget=None, method="percentile", value_share=0.0):
    return {"devices": list(devices), "model": {"range_method": method},
            "summary": {"devices": {d: {"top1_agreement": None, "accuracy_drop_points": None, **summary.get(d, {})}
                                    for d in devices}},
            "layers": layers, "recovery": list(recovery), "budget": budget, "mixed_precision": {},
            "float_share": {d: {"value_share": value_share} for d in devices}}


def test_agreement_grades_and_the_costliest_layers_by_own_error():
    layers = [_row("cpu", "a", 30.0, 35.0, index=0, macs=100), _row("cpu", "b", 20.0, 22.5, index=1, macs=2000),
              _row("cpu", "c", 18.0, 40.0, index=2), _row("cpu", "d", 12.0, None, index=3),
              _row("cpu", "f", None, None, index=4, precision="fp32")]
    rep = _report(["cpu", "gpu"], {"cpu": {"top1_agreement": 0.70}, "gpu": {"top1_agreement": 0.96}}, layers)
    v = verdict(rep)
    assert v["cpu"]["status"] == "not fit" and v["gpu"]["status"] == "fit to ship"
    assert v["cpu"]["reasons"] == ["top-1 agreement 70.0% (fit >= 95%, review >= 85%)"]
    # own error: the isolated SQNR where measured (b 22.5 before a 35 and c 40), else the accumulated (d 12)
    assert [c["name"] for c in v["cpu"]["costliest"]] == ["d", "b", "a"]
    assert v["cpu"]["costliest"][1]["float_macs"] == 2000
    tips = v["cpu"]["advice"]
    assert tips[0].startswith("--recipe accurate")
    assert any("b (2,000 MACs)" in t and "--accuracy-budget" in t for t in tips)
    assert any("gpu's per-channel int8 weights reach 96.0%" in t for t in tips)
    assert v["gpu"]["advice"] == []  # fit: no advice
    lines = verdict_lines({"verdict": v})
    assert lines[0] == "verdict [cpu]: not fit (maceq's defaults): top-1 agreement 70.0% (fit >= 95%, review >= 85%)"
    assert lines[1] == "  costliest layers: d (12.0 dB), b (22.5 dB), a (35.0 dB)"


def test_drop_output_sqnr_and_nothing_measured():
    rep = _report(["cpu"], {"cpu": {"top1_agreement": 0.97, "accuracy_drop_points": 2.0}}, [],
                  recovery=[{"step": "bias correction", "detail": ""}])
    v = verdict(rep)["cpu"]
    assert v["status"] == "review"  # agreement fits, the 2-point drop is only worth a review: the worse one wins
    assert v["advice"] == []  # recipe applied, no layer measured, nothing else to say
    seg = _report(["dsp"], {}, [_row("dsp", "head", 8.0, 9.0, index=0, is_output=True),
                                _row("dsp", "mid", 4.0, 5.0, index=1)], value_share=0.5)
    v = verdict(seg)["dsp"]
    assert v["status"] == "not fit" and v["reasons"] == ["output SQNR 8.0 dB (fit >= 20 dB, review >= 12 dB)"]
    assert any("50% of the activation values" in t for t in v["advice"])
    assert verdict(seg, Thresholds(sqnr_fit=8.0))["dsp"]["status"] == "fit to ship"
    none = verdict(_report(["cpu"], {}, []))["cpu"]
    assert none["status"] == "not measured" and "--eval-dir" in none["reasons"][0]


def test_a_budget_decides_when_attached():
    budget = {"source": "b.yml", "violations": [{"device": "cpu", "message": "cpu: top-1 agreement 80% < 90%"}]}
    rep = _report(["cpu", "dsp"], {"cpu": {"top1_agreement": 0.99}, "dsp": {"top1_agreement": 0.5}}, [],
                  budget=budget, method="mse", recovery=[{"step": "cross-layer equalization", "detail": ""}])
    v = verdict(rep)
    assert v["cpu"]["status"] == "not fit" and v["cpu"]["reasons"] == ["cpu: top-1 agreement 80% < 90%"]
    assert v["dsp"]["status"] == "fit to ship" and v["dsp"]["against"] == "budget b.yml"
