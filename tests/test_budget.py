"""Budgets and `maceq check` (reports/budget.py): the loader, glob resolution, exit codes, JUnit XML.

The check runs on the real report of tests/test_report.py (Fashion-MNIST, cpu + dsp); the limits
are derived from the engine's own LayerError values, so "one layer over budget" is known
independently of the checker.
"""
from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ET

import pytest

from maceq.errors import MaceqError
from maceq.reports.budget import Budget, budget_from_dict, check, junit_xml, load_budget, run_check

from maceq.tests.test_report import EVIL, real_report

EXAMPLE = """\
global: {min_top1_agreement: 0.97, max_accuracy_drop: 0.5}
layers:
  "*": {min_sqnr_db: 25, min_cosine: 0.99}
  "features.0.*": {min_sqnr_db: 20}
devices:
  dsp: {layers: {"*": {min_sqnr_db: 20}}}
"""


@pytest.fixture(scope="module")
def real(tmp_path_factory, shared_data):
    return real_report(tmp_path_factory.getbasetemp() / "maceq-report", shared_data)


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def run(report, budget, junit=None):
    out, err = io.StringIO(), io.StringIO()
    rc = run_check(report, budget, junit, out=out, err=err)
    return rc, out.getvalue().splitlines(), err.getvalue().splitlines()


# ------------------------------------------------------------------------------------------------
# Loader
# ------------------------------------------------------------------------------------------------

def test_example_budget_loads(tmp_path):
    b = load_budget(write(tmp_path, "b.yml", EXAMPLE))
    assert isinstance(b, Budget) and b.source.endswith("b.yml")
    assert b.global_for("cpu") == {"min_top1_agreement": (0.97, "global"), "max_accuracy_drop": (0.5, "global")}
    # per-metric: features.0.* relaxes the SQNR floor, "*"'s cosine floor still holds
    got = b.layer_limits("features.0.conv", "cpu")
    assert {k: (v, r.pattern) for k, (v, r) in got.items()} == {"min_sqnr_db": (20.0, "features.0.*"),
                                                                "min_cosine": (0.99, "*")}
    # device-specific "*" beats generic "*" at equal specificity; the longer generic glob beats both
    got = b.layer_limits("features.1.conv", "dsp")
    assert (got["min_sqnr_db"][0], got["min_sqnr_db"][1].device) == (20.0, "dsp")
    assert b.layer_limits("features.1.conv", "cpu")["min_sqnr_db"][0] == 25.0
    got = b.layer_limits("features.0.conv", "dsp")
    assert (got["min_sqnr_db"][0], got["min_sqnr_db"][1].pattern, got["min_sqnr_db"][1].device) == (
        20.0, "features.0.*", None)


def test_specificity_ties_and_null():
    b = budget_from_dict({
        "layers": {"conv*": {"min_sqnr_db": 10}, "*1": {"min_sqnr_db": 11}, "conv?": {"max_abs_err": 1.0},
                   "conv1": {"min_cosine": None}, "*": {"min_cosine": 0.9}},
        "devices": {"gpu": {"layers": {"conv*": {"min_sqnr_db": 30}, "*": {"min_cosine": None}},
                            "global": {"min_top1_agreement": 0.5}}},
        "global": {"min_top1_agreement": 0.9, "min_top5_containment": None}})
    # "conv*" (4 literal chars) beats "*1" (1); on gpu the device's "conv*" beats the generic one
    assert b.layer_limits("conv1", "cpu")["min_sqnr_db"][0] == 10.0
    assert b.layer_limits("conv1", "gpu")["min_sqnr_db"][0] == 30.0
    assert b.layer_limits("xx1", "cpu")["min_sqnr_db"][0] == 11.0
    # null removes a limit: conv1 has no cosine floor, conv2 keeps "*"'s; on gpu "*" null removes it
    assert "min_cosine" not in b.layer_limits("conv1", "cpu")
    assert b.layer_limits("conv2", "cpu")["min_cosine"][0] == 0.9
    assert "min_cosine" not in b.layer_limits("conv2", "gpu")
    assert "max_abs_err" not in b.layer_limits("conv10", "cpu")  # ? is one character
    assert b.global_for("cpu") == {"min_top1_agreement": (0.9, "global")}
    assert b.global_for("gpu") == {"min_top1_agreement": (0.5, "global on gpu")}
    # an exact tie: the later entry wins
    b = budget_from_dict({"layers": {"a*": {"min_sqnr_db": 1}, "*a": {"min_sqnr_db": 2}}})
    assert b.layer_limits("aa", "cpu")["min_sqnr_db"][0] == 2.0


@pytest.mark.parametrize("text, names", [
    ("globl: {}", "'globl'"),
    ("global: {min_top1: 0.9}", "'min_top1'"),
    ('layers: {"*": {min_sqnr: 20}}', "'min_sqnr'"),
    ("devices: {npu: {}}", "'npu'"),
    ("devices: {dsp: {layer: {}}}", "'layer'"),
    ('devices: {dsp: {layers: {"*": {min_cos: 1}}}}', "'min_cos'"),
    ("global: {min_top1_agreement: 97}", "min_top1_agreement must be a finite number in [0, 1]"),
    ("global: {min_top1_agreement: yes}", "min_top1_agreement must be a number"),
    ('layers: {"*": {min_cosine: "high"}}', "min_cosine must be a number"),
    ('layers: {"*": {max_abs_err: -1}}', "max_abs_err must be a finite number in [0, inf]"),
    ('layers: {"*": 5}', "must be a mapping"),
    ("layers: [a, b]", "must be a mapping"),
    ("- 1\n- 2", "must be a mapping"),
    ("", "the budget is empty"),
    ("global: {min_top1_agreement: [", "not valid YAML"),
])
def test_bad_budget_names_the_key(tmp_path, text, names):
    p = write(tmp_path, "b.yml", text)
    with pytest.raises(MaceqError) as e:
        load_budget(p)
    msg = str(e.value)
    assert names in msg and str(p) in msg and "\n" not in msg


# ------------------------------------------------------------------------------------------------
# check on the real report
# ------------------------------------------------------------------------------------------------

def two_lowest(real, device):
    s = sorted((L.accumulated.sqnr_db, L.node) for L in real.layers[device])
    return s[0], s[1]


def test_one_layer_over_budget_then_relaxed(real, tmp_path):
    (s1, worst), (s2, _) = two_lowest(real, "dsp")
    assert worst == EVIL and s1 < s2
    mid = (s1 + s2) / 2
    b = write(tmp_path, "b.yml", f"global: {{min_top1_agreement: 0.9}}\n"
                                  f'devices: {{dsp: {{layers: {{"*": {{min_sqnr_db: {mid!r}}}}}}}}}\n')
    rc, out, err = run(real.files.json, b)
    assert rc == 1 and err == []
    assert len(out) == 2 and out[1].startswith("over budget: 1 of ")
    line = out[0]
    assert line.startswith(f"dsp {EVIL}: sqnr_db {s1:.6g}, budget min_sqnr_db {mid:.6g}")
    assert '"*" on dsp' in line
    vs = check(real.report, load_budget(b))
    assert [(v.device, v.layer, v.key, v.value, v.limit) for v in vs] == [("dsp", EVIL, "min_sqnr_db", s1, mid)]
    # a glob for that layer (more specific than "*") relaxes it: within budget
    relaxed = write(tmp_path, "r.yml", b.read_text() + f'layers: {{"<script>*": {{min_sqnr_db: {s1 - 1!r}}}}}\n')
    rc, out, err = run(real.files.json, relaxed)
    assert (rc, err) == (0, []) and out[-1].startswith("within budget: ")
    n_checks = int(out[-1].split()[2])
    # 2 devices x global top-1, 24 measured dsp layers x min_sqnr_db, and the generic "<script>*"
    # glob on the cpu device's one matching layer
    assert n_checks == 2 + 24 + 1


def test_global_metrics(real, tmp_path):
    ev = real.evals["cpu"]
    over = ev.top1_agreement + 0.01 if ev.top1_agreement < 1 else None
    text = "global: {max_accuracy_drop: 0.0}\n" + (f"devices: {{cpu: {{global: {{min_top1_agreement: {over}}}}}}}\n"
                                                     if over else "")
    b = write(tmp_path, "g.yml", text)
    vs = check(real.report, load_budget(b))
    drops = {d: 100 * (e.float_accuracy - e.int8_accuracy) for d, e in real.evals.items()}
    want = [(d, None, "max_accuracy_drop") for d in ("cpu", "dsp") if drops[d] > 0.0]
    if over:
        want.insert(0, ("cpu", None, "min_top1_agreement"))
    assert sorted((v.device, v.layer, v.key) for v in vs) == sorted(want)
    # without labels the accuracy is not measured: a budget on it fails (a gate must see what it checks)
    rep = json.loads(real.files.json.read_text())
    for s in rep["summary"]["devices"].values():
        s.update(float_accuracy=None, int8_accuracy=None, accuracy_drop_points=None)
    vs = check(rep, budget_from_dict({"global": {"max_accuracy_drop": 5}}))
    assert [(v.device, v.value) for v in vs] == [("cpu", None), ("dsp", None)]
    assert "accuracy_drop_points not measured" in vs[0].line()


def test_inf_sqnr_and_fp32_layers(real):
    rep = json.loads(real.files.json.read_text())
    row = next(r for r in rep["layers"] if r["device"] == "cpu" and r["measured"])
    row["sqnr_db"] = "inf"
    b = budget_from_dict({"layers": {"*": {"min_sqnr_db": 1000}}})
    vs = check(rep, b)
    bad = {(v.device, v.layer) for v in vs}
    assert ("cpu", row["name"]) not in bad  # +inf passes any floor
    assert ("cpu", "/1/Add") not in bad and ("dsp", "/1/Add") not in bad  # fp32: no metrics, not checked
    assert len(vs) == 2 * 24 - 1


# ------------------------------------------------------------------------------------------------
# Exit codes and JUnit
# ------------------------------------------------------------------------------------------------

def test_bad_input_exits_2_with_one_line(real, tmp_path):
    good = write(tmp_path, "ok.yml", "global: {min_top1_agreement: 0.5}\n")
    cases = [
        (tmp_path / "missing.json", good, "cannot read the report"),
        (write(tmp_path, "x.json", "{not json"), good, "not valid JSON"),
        (write(tmp_path, "y.json", '{"layers": []}'), good, "missing key 'devices'"),
        (real.files.json, tmp_path / "missing.yml", "cannot read the budget file"),
        (real.files.json, write(tmp_path, "u.yml", "global: {min_top_1: 1}\n"), "unknown key 'min_top_1'"),
    ]
    for report, budget, msg in cases:
        junit = tmp_path / "j.xml"
        rc, out, err = run(report, budget, junit)
        assert rc == 2 and out == [] and len(err) == 1, (report, budget)
        assert err[0].startswith("error: ") and msg in err[0]
        assert not junit.exists()


def test_junit_one_testcase_per_layer(real, tmp_path):
    (s1, worst), (s2, _) = two_lowest(real, "dsp")
    b = write(tmp_path, "b.yml", "global: {min_top1_agreement: 1.0}\n"
                                  f'devices: {{dsp: {{layers: {{"*": {{min_sqnr_db: {(s1 + s2) / 2!r}}}}}}}}}\n')
    junit = tmp_path / "out" / "results.xml"
    rc, out, _ = run(real.files.json, b, junit)
    root = ET.parse(junit).getroot()
    assert root.tag == "testsuites"
    suites = {s.get("name"): s for s in root}
    assert sorted(suites) == ["maceq.cpu", "maceq.dsp"]
    failures_by_case = {}
    for dev, suite in (("cpu", suites["maceq.cpu"]), ("dsp", suites["maceq.dsp"])):
        cases = list(suite)
        names = [c.get("name") for c in cases]
        layer_names = [r["name"] for r in real.report["layers"] if r["device"] == dev]
        assert names == ["global metrics"] + layer_names  # one per layer + one for the global metrics
        assert all(c.get("classname") == f"maceq.{dev}" for c in cases)
        assert int(suite.get("tests")) == len(cases) == 26
        skipped = [c.get("name") for c in cases if c.find("skipped") is not None]
        assert skipped == ["/1/Add"]
        for c in cases:
            f = c.find("failure")
            if f is not None:
                failures_by_case[(dev, c.get("name"))] = f
        assert int(suite.get("failures")) == sum(1 for k in failures_by_case if k[0] == dev)
        assert int(suite.get("skipped")) == 1
    want = {("dsp", worst)} | {(d, "global metrics") for d in ("cpu", "dsp") if real.evals[d].top1_agreement < 1.0}
    assert set(failures_by_case) == want
    assert rc == 1 and len(out) == len(want) + 1
    f = failures_by_case[("dsp", worst)]
    assert f.text == f.get("message") and f.text in out  # the failure carries the violation text
    assert f.get("message").startswith(f"dsp {EVIL}: sqnr_db")
    assert int(root.get("tests")) == 52 and int(root.get("failures")) == len(want)
    # same budget, XML as bytes: stable (atomic write replaced the file, no temp left)
    assert junit.read_bytes() == junit_xml(real.report, load_budget(b))
    assert [p.name for p in junit.parent.iterdir()] == ["results.xml"]


def test_unmeasured_uint8_layer_fails_its_limits(real):
    rep = json.loads(real.files.json.read_text())
    row = next(r for r in rep["layers"] if r["device"] == "dsp" and r["precision"] == "uint8")
    row.update(measured=False, metrics_mode=None, sqnr_db=None, cosine=None, max_abs_err=None)
    vs = check(rep, budget_from_dict({"layers": {"*": {"min_cosine": 0.5}}}))
    assert [(v.device, v.layer, v.value) for v in vs] == [("dsp", row["name"], None)]
    assert vs[0].line() == f'dsp {row["name"]}: cosine not measured, budget min_cosine 0.5 (needs >= 0.5; rule "*")'
