"""Automatic mixed precision (app/mixed.py) on real models and photos.

Checks the search's contract against independent measurements: the written model's ops (fp32
layers really are float32 MACE ops), an independent evaluate() of the final model, the .data file
sizes, the ranking rule, the stopping rule (budget or cap), the floor, and a rerun.
"""
from __future__ import annotations

import json
import os

import pytest

from maceq.datasets.images import ImageFolder
from maceq.datasets.preprocess import PRESETS
from maceq.errors import MaceqError
from maceq.quant.config import QuantConfig
from maceq.app.mixed import auto_mixed_precision, holdout_split
from maceq.app.pipeline import calibrate
from maceq.reports.evaluate import evaluate
from maceq.runtime import load

DT_FLOAT, DT_UINT8 = 1, 2


@pytest.fixture(scope="module")
def mnv2_cal(shared_data):
    return calibrate(shared_data / "models" / "mobilenet_v2.onnx", shared_data / "photos" / "calib",
                     preprocess=PRESETS["imagenet"], config=QuantConfig(max_images=16), progress=False)


def eval_photos(shared_data, n):
    return ImageFolder(shared_data / "photos" / "eval", PRESETS["imagenet"], labels=None, limit=n)


def check_search(r, *, budget, cap, device):
    """The invariants every search result satisfies, checked on the trail and the written files."""
    chosen = list(r.fp32_nodes)
    # ranking: ascending isolated SQNR (floor first), ties by name; the search follows it in order
    keys = [(not c.below_floor, c.sqnr_db, c.node) for c in r.candidates]
    assert keys == sorted(keys)
    assert chosen == [c.node for c in r.candidates[:len(chosen)]]
    iso = {L.node: L.isolated.sqnr_db for L in r.layers}
    assert all(c.sqnr_db == iso[c.node] for c in r.candidates)
    # trail: one measured model per step, each adding the next layer
    assert [s.step for s in r.trail] == list(range(len(chosen) + 1))
    assert r.trail[0].exempted is None and r.trail[0].reason == "baseline" and r.trail[0].n_fp32 == 0
    assert [s.exempted for s in r.trail[1:]] == chosen
    assert [s.n_fp32 for s in r.trail] == list(range(len(chosen) + 1))
    assert all(s.drop_points == pytest.approx(s.float_value - s.value) for s in r.trail)
    assert all(s.within_budget == (s.drop_points <= budget + 1e-9) for s in r.trail)
    # stopping rule: keep going while over budget; stop at the budget or at the cap
    n_floor = sum(c.below_floor for c in r.candidates)
    assert all(not s.within_budget or i < n_floor for i, s in enumerate(r.trail[:-1]))
    if r.ok:
        assert r.trail[-1].within_budget and len(chosen) >= n_floor and r.message == ""
    else:
        assert len(chosen) == cap and f"--max-fp32-layers {cap} reached" in r.message
    # float32 weights take 4 bytes where uint8 take 1: the .data file grows with each exempted conv/FC
    sizes = [s.data_bytes for s in r.trail]
    g = r.result.graph
    weighted = {n.name for n in g.nodes if any(i and g.is_const(i) for i in n.inputs)}
    assert all(b > a if s.exempted in weighted else b == a for a, b, s in zip(sizes, sizes[1:], r.trail[1:]))
    assert os.path.getsize(r.files.data) == sizes[-1]
    # the written model: chosen layers are float32 MACE ops, the other candidates stay uint8
    model = load(r.files.yml)
    t_of = {op.name: op.arg("T") for op in model.ops}
    assert all(t_of[n] == DT_FLOAT for n in chosen)
    assert all(t_of.get(c.node, t_of.get("mace_output_node_" + c.node)) == DT_UINT8
               for c in r.candidates[len(chosen):])
    assert model.maceq_meta["fp32_layers"] == sorted(chosen) and model.maceq_meta["device"] == device
    rec = model.maceq_meta["auto_mixed_precision"]
    assert rec["ok"] == r.ok and rec["fp32_nodes"] == chosen and rec["value"] == r.trail[-1].value
    json.dumps(r.to_dict(), allow_nan=False)
    assert r.tradeoff == [{"n_fp32": s.n_fp32, "fp32_nodes": list(s.fp32_nodes), "metric": s.metric,
                           "value": s.value, "drop_points": s.drop_points, "data_bytes": s.data_bytes,
                           "within_budget": s.within_budget} for s in r.trail]
    return model


def test_mobilenet_v2_cpu_budget_or_cap(mnv2_cal, shared_data, tmp_path):
    data = eval_photos(shared_data, 16)
    r = auto_mixed_precision(mnv2_cal, output_dir=tmp_path, eval_data=data, budget_points=10.0, max_fp32_layers=5,
                             device="cpu", progress=False)
    model = check_search(r, budget=10.0, cap=5, device="cpu")
    assert r.trail[0].metric == "top1_agreement" and r.trail[0].float_value == 100.0
    # an independent evaluation of the final written model gives the last step's metric
    ev = evaluate(model, mnv2_cal.onnx_path, data, device="cpu", progress=False)
    assert 100.0 * ev.top1_agreement == r.trail[-1].value
    assert not list(tmp_path.glob(".maceq-search-*"))  # the scratch models are removed
    # a rerun on the same images with a cap of 2 takes the same first decisions, with the same metrics
    again = auto_mixed_precision(mnv2_cal, output_dir=tmp_path / "again", eval_data=data, budget_points=10.0,
                                 max_fp32_layers=2, device="cpu", progress=False)
    assert [c.to_dict() for c in again.candidates] == [c.to_dict() for c in r.candidates]
    if len(r.fp32_nodes) >= 2:
        assert again.fp32_nodes == r.fp32_nodes[:2] and again.trail == r.trail[:3]


def test_mobilenet_v2_dsp_budget_or_cap(mnv2_cal, shared_data, tmp_path):
    data = eval_photos(shared_data, 8)
    r = auto_mixed_precision(mnv2_cal, output_dir=tmp_path, eval_data=data, budget_points=10.0, max_fp32_layers=2,
                             device="dsp", progress=False)
    model = check_search(r, budget=10.0, cap=2, device="dsp")
    ev = evaluate(model, mnv2_cal.onnx_path, data, device="dsp", progress=False)
    assert 100.0 * ev.top1_agreement == r.trail[-1].value


@pytest.fixture(scope="module")
def fmnist(shared_data):
    from maceq.datasets.labels import FASHION_MNIST_CLASSES

    cal = calibrate(shared_data / "models" / "fmnist_mobilenet.onnx", shared_data / "fashion_mnist" / "calib",
                    preprocess=PRESETS["fmnist"], config=QuantConfig(max_images=100), progress=False)
    data = ImageFolder(shared_data / "fashion_mnist" / "test", PRESETS["fmnist"], classes=FASHION_MNIST_CLASSES)
    step = 50  # every 50th file: all ten classes
    data.files, data.labels = data.files[::step], data.labels[::step]
    return cal, data


def test_floor_first_cap_and_rerun(fmnist, tmp_path):
    cal, data = fmnist
    plain = auto_mixed_precision(cal, output_dir=tmp_path / "plain", eval_data=data, budget_points=100.0,
                                 device="cpu", progress=False)
    assert plain.ok and plain.fp32_nodes == () and len(plain.trail) == 1  # within 100 points at once
    assert plain.trail[0].metric == "accuracy"  # the eval folder has labels
    # a floor between the 3rd and 4th most damaging layers: those three are exempted first, and no more
    ranked = plain.candidates
    floor_db = (ranked[2].sqnr_db + ranked[3].sqnr_db) / 2
    runs = [auto_mixed_precision(cal, output_dir=tmp_path / f"floor{k}", eval_data=data, budget_points=100.0,
                                 min_sqnr=floor_db, device="cpu", progress=False) for k in range(2)]
    r = runs[0]
    assert r.ok and list(r.fp32_nodes) == [c.node for c in ranked[:3]]
    assert [c.below_floor for c in r.candidates] == [True] * 3 + [False] * (len(ranked) - 3)
    assert all(s.reason == "below_min_sqnr" for s in r.trail[1:])
    check_search(r, budget=100.0, cap=None, device="cpu")
    # a rerun on the same input takes the same decisions and writes the same model
    assert runs[1].to_dict() == r.to_dict()
    assert (tmp_path / "floor0" / "fmnist_mobilenet.data").read_bytes() == \
        (tmp_path / "floor1" / "fmnist_mobilenet.data").read_bytes()
    capped = auto_mixed_precision(cal, output_dir=tmp_path / "capped", eval_data=data, budget_points=100.0,
                                  min_sqnr=floor_db, max_fp32_layers=1, device="cpu", progress=False)
    assert not capped.ok and capped.fp32_nodes == (ranked[0].node,)
    assert capped.message == f"--max-fp32-layers 1 reached with 2 layer(s) below --min-sqnr {floor_db:g} dB still int8"
    check_search(capped, budget=100.0, cap=1, device="cpu")


def test_holdout_split_and_bad_arguments(fmnist, shared_data, tmp_path):
    cal, data = fmnist
    calib = shared_data / "photos" / "calib"
    every = ImageFolder(calib, PRESETS["imagenet"], labels=None).files
    held = holdout_split(calib, PRESETS["imagenet"], used=16, limit=5, labels=None)
    assert held.files == every[16:21] and len(set(held.files) & set(every[:16])) == 0
    with pytest.raises(MaceqError, match="none is left"):
        holdout_split(calib, PRESETS["imagenet"], used=len(every), labels=None)
    with pytest.raises(MaceqError, match="--accuracy-budget"):
        auto_mixed_precision(cal, output_dir=tmp_path, eval_data=data, budget_points=-1, progress=False)
    with pytest.raises(MaceqError, match="--max-fp32-layers"):
        auto_mixed_precision(cal, output_dir=tmp_path, eval_data=data, budget_points=1, max_fp32_layers=-2,
                             progress=False)
    with pytest.raises(MaceqError, match="unknown device 'npu'"):
        auto_mixed_precision(cal, output_dir=tmp_path, eval_data=data, budget_points=1, device="npu", progress=False)
