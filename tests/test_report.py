"""The accuracy-drop report (reports/report.py) built from a real quantized model.

The Fashion-MNIST model is quantized for cpu and dsp (with one layer kept in float32 and one
node renamed ``<script>alert(1)</script>``), evaluated and analysed by the real engines, and the
report's values are checked against independent computations: the engine's LayerError records,
EvalResult, the model files, onnxruntime run here on the float graph, and a brute-force
liveness count of activation memory from the ops' declared output shapes.
"""
from __future__ import annotations

import base64
import functools
import json
import os
import pickle
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from maceq.datasets.images import ImageFolder
from maceq.datasets.labels import FASHION_MNIST_CLASSES
from maceq.datasets.preprocess import PRESETS
from maceq.errors import MaceqError
from maceq.quant.config import QuantConfig
from maceq.app.pipeline import quantize
from maceq.reports.analysis import analyze_layers
from maceq.reports.budget import budget_from_dict
from maceq.reports.evaluate import evaluate, evaluate_many
from maceq.reports.report import (SCHEMA_PATH, build_report, evenly_spaced, make_report, render_html,
                                  report_json_text, write_report)
from maceq.runtime import load

EVIL = "<script>alert(1)</script>"
RENAMED = "/6/conv/conv.2/Conv"   # a projection conv (no fused activation): keeps its node name
FP32 = "/1/Add"                   # kept in float32 by request
EVAL_IMAGES, ANALYSIS_IMAGES = 60, 6


@dataclass
class Real:
    root: Path
    onnx_path: Path
    res: object
    models: dict
    data: ImageFolder
    evals: dict
    layers: dict
    report: dict
    files: object


@functools.lru_cache(maxsize=2)
def real_report(root: Path, shared: Path) -> Real:
    """Quantize, evaluate, analyse and report once per test session: test_budget and
    test_report_browser use it too. pytest's importlib mode loads this file under another module
    name than their import, so the in-memory cache is not shared: the result is also pickled in
    ``root`` (the session's temporary folder)."""
    cached = root / "real.pickle"
    if cached.is_file():
        return pickle.loads(cached.read_bytes())
    real = _build_real(root, shared)
    cached.write_bytes(pickle.dumps(real))
    return real


def _build_real(root: Path, shared: Path) -> Real:
    root.mkdir(parents=True, exist_ok=True)
    m = onnx.load(str(shared / "models" / "fmnist_mobilenet.onnx"))
    node = next(n for n in m.graph.node if n.name == RENAMED)
    node.name = EVIL
    onnx_path = root / "fmnist_evil.onnx"
    onnx.save(m, str(onnx_path))
    res = quantize(onnx_path, shared / "fashion_mnist" / "calib", output_dir=root / "q", preprocess=PRESETS["fmnist"],
                   config=QuantConfig(max_images=100, fp32_layers=(FP32,)), devices=("cpu", "dsp"), progress=False)
    models = {d: load(f.yml) for d, f in res.per_device.items()}
    full = ImageFolder(shared / "fashion_mnist" / "test", PRESETS["fmnist"], classes=FASHION_MNIST_CLASSES)
    data = evenly_spaced(full, EVAL_IMAGES)
    small = evenly_spaced(full, ANALYSIS_IMAGES)
    evals = {d: evaluate(mod, onnx_path, data, device=d, progress=False) for d, mod in models.items()}
    layers = {d: analyze_layers(mod, res.graph, small, device=d, progress=False) for d, mod in models.items()}
    budget = budget_from_dict({"global": {"min_top1_agreement": 0.9}, "layers": {"*": {"min_sqnr_db": 10}}},
                              source="inline")
    report = build_report(models, float_model=res.graph, evals=evals, layers=layers, images=data, budget=budget,
                          analysis_images=ANALYSIS_IMAGES)
    files = write_report(report, root / "out")
    return Real(root, onnx_path, res, models, data, evals, layers, report, files)


@pytest.fixture(scope="module")
def real(tmp_path_factory, shared_data) -> Real:
    return real_report(tmp_path_factory.getbasetemp() / "maceq-report", shared_data)


def dev_rows(report, device):
    return [r for r in report["layers"] if r["device"] == device]


# ------------------------------------------------------------------------------------------------
# JSON
# ------------------------------------------------------------------------------------------------

def test_json_file_is_strict_json_and_validates_against_the_schema(real):
    import jsonschema  # the test extra: jsonschema

    text = real.files.json.read_text()

    def no_constants(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    got = json.loads(text, parse_constant=no_constants)
    assert got == real.report
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(got)
    # the validator does bite: a layer without its SQNR, or a string where a number goes, is rejected
    bad = json.loads(text)
    del bad["layers"][0]["sqnr_db"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    bad = json.loads(text)
    bad["summary"]["devices"]["cpu"]["top1_agreement"] = "1.0"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_layers_equal_the_engine_worst_first(real):
    for device in ("cpu", "dsp"):
        engine = real.layers[device]
        rows = dev_rows(real.report, device)
        measured = [r for r in rows if r["measured"]]
        assert len(measured) == len(engine) == 24  # 25 quantized layers less the fp32 Add
        by_op = {r["mace_op"]: r for r in measured}
        for L in engine:
            r = by_op[L.op]
            assert (r["name"], r["tensor"], r["op"]) == (L.node, L.tensor, L.op_type)
            assert r["sqnr_db"] == L.accumulated.sqnr_db and r["metrics_mode"] == "accumulated"
            assert r["cosine"] == L.accumulated.cosine and r["max_abs_err"] == L.accumulated.max_abs
            assert r["isolated"]["sqnr_db"] == L.isolated.sqnr_db
        worst = min(engine, key=lambda L: L.accumulated.sqnr_db)
        assert rows[0]["mace_op"] == worst.op
        assert real.report["summary"]["devices"][device]["worst_layer"] == worst.node
        sq = [r["sqnr_db"] for r in measured]
        assert sq == sorted(sq)
        assert rows[:len(measured)] == measured  # float32 layers come last


def test_the_renamed_node_is_the_worst_layer(real):
    # the fixture renamed the layer that has the lowest SQNR on both devices: its escaped name is
    # then in the summary, the table's first row and the first histogram of each device
    for device in ("cpu", "dsp"):
        assert dev_rows(real.report, device)[0]["name"] == EVIL
    assert [h["name"] for h in real.report["histograms"] if h["name"] == EVIL] == [EVIL, EVIL]


def test_float32_layer_row_and_mixed_precision(real):
    for device in ("cpu", "dsp"):
        fp = [r for r in dev_rows(real.report, device) if not r["measured"]]
        assert [(r["name"], r["precision"], r["fp32_reason"], r["op"]) for r in fp] == [
            (FP32, "fp32", "requested", "Eltwise")]
        assert fp[0]["sqnr_db"] is None and fp[0]["scale"] is None
        mp = real.report["mixed_precision"][device]
        assert mp == {"fp32_layers": [FP32], "float_fallback": [], "auto": None}
        s = real.report["summary"]["devices"][device]
        assert (s["layers_uint8"], s["layers_fp32"], s["layers_measured"]) == (24, 1, 24)
    assert real.report["recovery"] == []


def test_scale_zero_point_and_range_method_are_the_model_s(real):
    for device, model in real.models.items():
        ops = {op.name: op for op in model.ops}
        for r in dev_rows(real.report, device):
            op = ops[r["mace_op"]]
            assert model.ops.index(op) == r["index"]
            if r["measured"]:
                q = op.out_qinfo[0]
                assert (r["scale"], r["zero_point"], r["range_min"], r["range_max"]) == (
                    q.scale, q.zero_point, q.minval, q.maxval)
            assert (r["range_method"], r["percentile"]) == ("percentile", 99.99)


def test_placement_equals_the_model_probe(real):
    dsp = real.models["dsp"]
    place = dsp.placement("dsp")
    for r in dev_rows(real.report, "dsp"):
        assert (r["placement"], r["fallback_reason"]) == place[r["mace_op"]]
    p = real.report["placement"]["dsp"]
    off = [n for n, (w, _) in place.items() if w != "dsp"]
    assert p["on_cpu_fallback"] == len(off) and p["on_device"] == len(dsp.ops) - len(off)
    assert [f["op"] for f in p["fallbacks"]] == [op.name for op in dsp.ops if op.name in off]
    assert p["boundary_transfers"] == dsp.boundary_transfers(place)
    assert all(r["placement"] == "cpu" for r in dev_rows(real.report, "cpu"))
    assert real.report["placement"]["cpu"]["on_cpu_fallback"] == 0


def test_summary_equals_evaluate(real):
    for device, ev in real.evals.items():
        s = real.report["summary"]["devices"][device]
        assert (s["images"], s["top1_agreement"], s["top5_containment"]) == (
            EVAL_IMAGES, ev.top1_agreement, ev.float_top1_in_int8_top5)
        assert (s["float_accuracy"], s["int8_accuracy"]) == (ev.float_accuracy, ev.int8_accuracy)
        assert s["accuracy_drop_points"] == pytest.approx(100 * (ev.float_accuracy - ev.int8_accuracy), abs=1e-12)
    assert real.report["data"] == {"images": str(real.data.root), "labels": True, "analysis_images": ANALYSIS_IMAGES,
                                   "histogram_images": 2}


def test_model_sizes(real):
    g = real.res.graph
    assert real.report["summary"]["float_weight_bytes"] == sum(int(a.nbytes) for a in g.initializers.values())
    for device, f in real.res.per_device.items():
        s = real.report["summary"]["devices"][device]
        assert s["data_file_bytes"] == os.path.getsize(f.data)
        # constants: uint8 weights + int32 biases (+ float32 consts of float layers); the .data holds
        # exactly those bytes plus alignment padding
        consts = real.models[device].consts
        assert s["int8_weight_bytes"] == sum(int(a.nbytes) for a in consts.values()) <= s["data_file_bytes"]
        assert s["int8_weight_bytes"] < real.report["summary"]["float_weight_bytes"] / 3


def test_peak_activation_memory_by_brute_force(real):
    """Liveness counted step by step from the ops' declared output shapes and types (not the run)."""
    for device, model in real.models.items():
        ops = model.ops
        elems, item, born, last = {}, {}, {}, {}
        for name in model.input_names:  # the float input, NCHW as fed
            elems[name], item[name], born[name] = int(np.prod(model.input_shape(name))), 4, 0
        for i, op in enumerate(ops):
            for t, shape in zip(op.outputs, op.output_shapes):
                elems[t], born[t] = int(np.prod(shape)), i
                item[t] = 4 if op.arg("T") == 1 or op.type == "Dequantize" else 1
            for t in op.inputs:
                if t in elems:
                    last[t] = i
        for t in model.output_names:
            last[t] = len(ops) - 1

        def live(size):
            return [sum(size(t) for t in elems if born[t] <= i <= last.get(t, born[t])) for i in range(len(ops))]

        live8 = live(lambda t: item[t] * elems[t])
        live32 = live(lambda t: 4 * elems[t])
        pa = real.report["summary"]["devices"][device]["peak_activation"]
        assert pa["peak_bytes"] == max(live8)
        assert pa["peak_at_op"] == ops[int(np.argmax(live8))].name
        assert pa["largest_tensor_bytes"] == max(item[t] * elems[t] for t in elems)
        assert pa["tensors"] == len(elems)
        assert pa["float32_peak_bytes"] == max(live32)  # the same schedule at 4 bytes per element
        assert pa["peak_bytes"] < pa["float32_peak_bytes"]


def test_histograms_equal_onnxruntime_values(real):
    rep = real.report
    g = real.res.graph
    x = np.concatenate([b.data for b in real.data.iter_batches(2)][:1])
    assert x.shape[0] == 2
    tensors = [h["tensor"] for h in rep["histograms"]]
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(g.to_onnx(extra_outputs=tensors).SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    vals = dict(zip(tensors, sess.run(tensors, {"input": x})))
    for device in ("cpu", "dsp"):
        want = [r["name"] for r in dev_rows(rep, device) if r["measured"]][:3]
        assert [h["name"] for h in rep["histograms"] if h["device"] == device] == want
    for h in rep["histograms"]:
        v = vals[h["tensor"]].astype(np.float64).ravel()
        row = next(r for r in rep["layers"] if r["device"] == h["device"] and r["tensor"] == h["tensor"])
        lo = float(np.float32(row["scale"]) * (0 - row["zero_point"]))
        hi = float(np.float32(row["scale"]) * (255 - row["zero_point"]))
        assert (h["clip_min"], h["clip_max"]) == (lo, hi)
        assert h["values"] == v.size == sum(h["counts"])
        counts, edges = np.histogram(v, bins=len(h["counts"]), range=(min(v.min(), lo), max(v.max(), hi)))
        assert h["counts"] == counts.tolist() and h["edges"] == edges.tolist()
        assert h["clipped_above"] == np.mean(v > hi) and h["clipped_below"] == np.mean(v < lo)


# ------------------------------------------------------------------------------------------------
# HTML
# ------------------------------------------------------------------------------------------------

class Page(HTMLParser):
    """Collects the tags, the text, the title and the <img> sources of a page."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags, self.text, self.imgs, self.title, self._in_title, self.tables = [], [], [], "", False, 0

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.tables += tag == "table"
        self._in_title = tag == "title"
        if tag == "img":
            self.imgs.append(dict(attrs)["src"])

    def handle_endtag(self, tag):
        self._in_title = False

    def handle_data(self, data):
        self.text.append(data)
        if self._in_title:
            self.title += data


def parse(html: str) -> Page:
    p = Page()
    p.feed(html)
    return p


def test_html_escapes_node_names(real):
    html = real.files.html.read_text()
    assert EVIL not in html and "<script" not in html.lower()
    assert html.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 4  # summary, 2 tables, captions
    page = parse(html)
    assert "script" not in page.tags
    assert sum(t.count(EVIL) for t in page.text) >= 4  # it reads as text


def test_html_is_self_contained_with_figures(real):
    html = real.files.html.read_text()
    page = parse(html)
    assert page.title == "maceq report: fmnist_evil"
    assert not re.search(r"(src|href)\s*=\s*\"(https?:|//|file:)", html)  # no network, no local files
    assert "default-src 'none'" in html  # the page's CSP: no script, no fetch
    # one depth plot per device + one histogram per worst layer (3 per device)
    assert len(page.imgs) == 2 + len(real.report["histograms"]) == 8
    for src in page.imgs:
        assert src.startswith("data:image/svg+xml;base64,")
        svg = ET.fromstring(base64.b64decode(src.split(",", 1)[1]))
        assert svg.tag == "{http://www.w3.org/2000/svg}svg"
        assert len(list(svg.iter("{http://www.w3.org/2000/svg}path"))) > 5
    assert page.tables >= 8  # model, summary, 2 layer tables, mixed x2, placement, budget
    text = "".join(page.text)
    for section in ("Summary", "Error vs depth", "Layers (worst first)", "Activation histograms",
                    "Mixed precision", "Recovery steps applied", "Placement", "Budget"):
        assert section in text
    assert "calibration histograms are not stored" in text.lower()
    assert "within budget" in text


def test_empty_sections_say_none_and_budget_section_is_optional(real):
    rep = dict(real.report, budget=None, histograms=[])
    page = parse(render_html(rep))
    text = " ".join(t.strip() for t in page.text if t.strip())
    assert "Budget" not in text.split("Placement")[-1]
    assert "Recovery steps applied none" in text
    assert "Automatic mixed-precision decisions: none" in text
    assert "histograms of the worst layers" in text.lower() and len(page.imgs) == 2


def test_mixed_trail_and_recovery_are_rendered(real):
    trail = [{"step": 0, "exempted": None, "sensitivity_db": None, "reason": "baseline", "fp32_nodes": [],
              "n_fp32": 0, "metric": "accuracy", "value": 90.0, "float_value": 91.0, "drop_points": 1.0,
              "data_bytes": 1000, "within_budget": False},
             {"step": 1, "exempted": EVIL, "sensitivity_db": 12.5, "reason": "budget", "fp32_nodes": [EVIL],
              "n_fp32": 1, "metric": "accuracy", "value": 91.0, "float_value": 91.0, "drop_points": 0.0,
              "data_bytes": 1300, "within_budget": True}]
    rep = json.loads(json.dumps(real.report))
    rep["mixed_precision"]["cpu"]["auto"] = {"ok": True, "message": "", "device": "cpu", "budget_points": 0.5,
                                             "min_sqnr": None, "max_fp32_layers": None, "fp32_nodes": [EVIL],
                                             "trail": trail, "tradeoff": [], "candidates": []}
    rep["recovery"] = [{"step": "bias_correction", "detail": "per-channel bias shift on 3 layers"}]
    html = render_html(rep)
    assert EVIL not in html
    text = " ".join(t.strip() for t in parse(html).text if t.strip())
    assert "Automatic search: within budget (budget 0.5 points)" in text
    assert "bias_correction per-channel bias shift on 3 layers" in text
    assert text.count("Automatic mixed-precision decisions: none") == 1  # dsp only


def test_write_report_is_atomic(real, tmp_path):
    files = write_report(real.report, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(before) == ["report.html", "report.json"]
    assert oct(files.json.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    bad = dict(real.report, summary={**real.report["summary"], "float_weight_bytes": float("nan")})
    with pytest.raises(ValueError):
        write_report(bad, tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # untouched, no temp file left
    assert report_json_text(real.report) == files.json.read_text()


def _umask() -> int:
    u = os.umask(0)
    os.umask(u)
    return u


def test_make_report_from_model_files(real, tmp_path):
    """The `maceq report QMODEL --images DIR` path: model files in, float graph from the recorded source."""
    from maceq.reports.report import make_report

    yml = real.res.per_device["cpu"].yml
    rep, files = make_report([yml], real.data, output_dir=tmp_path, analysis_images=2, progress=False)
    assert files.json.is_file() and files.html.is_file()
    ev = real.evals["cpu"]
    s = rep["summary"]["devices"]["cpu"]
    assert (s["top1_agreement"], s["float_accuracy"], s["int8_accuracy"]) == (
        ev.top1_agreement, ev.float_accuracy, ev.int8_accuracy)
    assert rep["devices"] == ["cpu"] and rep["data"]["analysis_images"] == 2
    assert rep["model"]["source"] == str(real.onnx_path.resolve())
    # the same layers (names, scales) as from the in-memory graph; metrics from 2 images differ
    key = lambda r: (r["mace_op"], r["name"], r["scale"], r["zero_point"], r["precision"])  # noqa: E731
    assert sorted(map(key, rep["layers"])) == sorted(map(key, dev_rows(real.report, "cpu")))
    assert rep["summary"]["float_weight_bytes"] == real.report["summary"]["float_weight_bytes"]


def test_verdict_follows_the_budget_and_names_the_worst_uint8_layers(real):
    """The inline budget (agreement >= 0.9, every layer >= 10 dB) decides; the costliest layers are
    the device's uint8 rows with the lowest isolated SQNR; the float share is the model's."""
    from maceq.reports.cost import float_share

    for device, m in real.models.items():
        v = real.report["verdict"][device]
        mine = [x for x in real.report["budget"]["violations"] if x["device"] == device]
        assert v["against"] == "budget inline"
        assert v["status"] == ("not fit" if mine else "fit to ship")
        iso = sorted((r["isolated"]["sqnr_db"], r["index"], r["name"]) for r in dev_rows(real.report, device)
                     if r["precision"] == "uint8" and r["isolated"] is not None)
        assert [c["name"] for c in v["costliest"]] == [n for _, _, n in iso[:3]]
        fs = float_share(m, device)
        assert real.report["float_share"][device]["line"] == fs.describe()
    assert 'id="verdict-table"' in render_html(real.report)


def test_report_on_two_workers_equals_the_one_process_report(real, tmp_path, monkeypatch):
    """make_report on two local workers: the evaluation's shards and then each device's layer analysis run on one
    pool (the analysis not in this process), and the report equals the one-process report."""
    import maceq.reports.report as report_module

    kw = dict(float_model=real.onnx_path, analysis_images=4, progress=False)
    one, _ = make_report(real.models, real.data, output_dir=tmp_path / "one", **kw)
    monkeypatch.setattr(report_module, "analyze_layers", lambda *a, **k: pytest.fail("analysed in this process"))
    two, files = make_report(real.models, real.data, output_dir=tmp_path / "two", workers=2, **kw)
    assert two == one and json.loads(files.json.read_text()) == one
    assert one["data"]["analysis_images"] == 4 and {r["device"] for r in one["layers"]} == set(real.models)


def test_evaluate_many_equals_each_device_alone(real, monkeypatch):
    """Every device in one pass, in this process (each batch read and run through the float model once for all the
    devices) and on two worker processes (one pool for all of them): each device's result equals its own
    evaluate(). The float session's threads do not spin after a run (the simulation's runs follow each one)."""
    from maceq.calibrate.runner import BatchedSession

    want = {d: r.to_dict() for d, r in real.evals.items()}
    float_runs = []
    real_run = BatchedSession.run

    def run(self, *a, **k):
        float_runs.append(self.sess.get_session_options().get_session_config_entry("session.intra_op.allow_spinning"))
        return real_run(self, *a, **k)

    monkeypatch.setattr(BatchedSession, "run", run)
    got = evaluate_many(real.models, real.onnx_path, real.data, progress=False)
    assert len(real.models) == 2 and float_runs == ["0"] * -(-len(real.data) // 16)
    assert list(got) == list(real.models) and {d: r.to_dict() for d, r in got.items()} == want
    got = evaluate_many(real.models, real.onnx_path, real.data, progress=False, workers=2)
    assert {d: r.to_dict() for d, r in got.items()} == want
    with pytest.raises(MaceqError, match="one model per device"):
        evaluate_many({"cpu": real.models["cpu"], "CPU": real.models["cpu"]}, real.onnx_path, real.data)
