"""Automatic mixed precision (app/mixed.py) on real models and photos.

Checks the search's contract against independent measurements: the candidates (a tensor's set is its
producer and every consumer), the written model's ops (fp32 layers really are float32 MACE ops), an
independent evaluate() of the final model on the search images and on all images, the greedy rule
(the largest measured gain each round), the stopping rule (budget or cap), the floor, and a rerun.
"""
from __future__ import annotations

import itertools
import json
import os

import pytest

from maceq.app.mixed import auto_mixed_precision, holdout_split
from maceq.app.pipeline import calibrate
from maceq.datasets.images import ImageFolder
from maceq.datasets.preprocess import PRESETS
from maceq.errors import MaceqError
from maceq.quant.config import QuantConfig
from maceq.reports.evaluate import evaluate
from maceq.runtime import load

DT_FLOAT, DT_UINT8 = 1, 2


@pytest.fixture(scope="module")
def mnv2_cal(shared_data):
    return calibrate(shared_data / "models" / "mobilenet_v2.onnx", shared_data / "photos" / "calib",
                     preprocess=PRESETS["imagenet"], config=QuantConfig(max_images=16), progress=False)


def eval_photos(shared_data, n):
    return ImageFolder(shared_data / "photos" / "eval", PRESETS["imagenet"], labels=None, limit=n)


def check_search(r, *, budget, cap, device, rank_by="sqnr"):
    """The invariants every search result satisfies, checked on the trail and the written files."""
    chosen = list(r.fp32_nodes)
    g = r.result.graph
    prod, cons = g.producers(), g.consumers()
    # candidates: a tensor's set is its producer and every consumer; an op's is the op alone; no set twice
    for c in r.candidates:
        if c.kind == "tensor":
            want = ({prod[c.name].name} if c.name in prod else set()) | {n.name for n in cons.get(c.name, [])}
            assert set(c.nodes) >= want - set(r.trail[0].fp32_nodes)
        else:
            assert c.nodes == (c.name,)
    assert len({c.nodes for c in r.candidates}) == len(r.candidates)
    # trail: step 0 all int8; each step adds its candidate's nodes; the fp32 set is the union so far
    assert [s.step for s in r.trail] == list(range(len(r.trail)))
    assert r.trail[0].candidate is None and r.trail[0].reason == "baseline" and r.trail[0].n_fp32 == 0
    added = [n for s in r.trail[1:] for n in s.nodes]
    assert added == chosen and len(set(chosen)) == len(chosen)
    assert all(s.fp32_nodes == tuple(sorted(added[:k])) and s.n_fp32 == k
               for s, k in zip(r.trail, [0, *itertools.accumulate(len(s.nodes) for s in r.trail[1:])]))
    assert cap is None or len(chosen) <= cap
    assert all(s.drop_points == pytest.approx(s.float_value - s.value) for s in r.trail)
    assert all(s.within_budget == (s.drop_points <= budget + 1e-9) for s in r.trail)
    # greedy steps: the chosen candidate has the largest measured gain of its round, measured against the step before
    for prev, s in zip(r.trail, r.trail[1:]):
        if s.reason != "budget":
            continue
        key = "gain_db" if rank_by == "sqnr" else "gain_points"
        gains = [m[key] for m in s.measured]
        assert s.gain == pytest.approx(max(gains)) and s.measured[0]["name"] == s.candidate
        own = s.sqnr_db - prev.sqnr_db if rank_by == "sqnr" else s.value - prev.value
        assert s.gain == pytest.approx(own) and s.gain > 0
        # the search goes on only while over budget: on the search images, or on all of them
        assert not prev.within_budget or r.final_all is not None
        if len(gains) > 1:
            assert s.runner_up["name"] == s.measured[1]["name"] and s.runner_up["gain"] <= s.gain
        assert s.boundaries >= 1 and s.est_cost_pct > 0
    if r.ok:
        assert r.trail[-1].within_budget and r.message == ""
    else:
        assert r.message
    assert os.path.getsize(r.files.data) == r.trail[-1].data_bytes
    # the written model: chosen ops are float32 MACE ops
    model = load(r.files.yml)
    t_of = {op.name: op.arg("T") for op in model.ops}
    for n in chosen:
        t = t_of.get(n, t_of.get("mace_output_node_" + n))
        assert t in (None, DT_FLOAT)
    assert any(t_of.get(n) == DT_FLOAT for n in chosen) or not chosen
    assert model.maceq_meta["fp32_layers"] == sorted(chosen) and model.maceq_meta["device"] == device
    rec = model.maceq_meta["auto_mixed_precision"]
    assert rec["ok"] == r.ok and rec["fp32_nodes"] == chosen and rec["value"] == r.trail[-1].value
    json.dumps(r.to_dict(), allow_nan=False)
    assert r.tradeoff == [{"n_fp32": s.n_fp32, "fp32_nodes": list(s.fp32_nodes), "metric": s.metric,
                           "value": s.value, "drop_points": s.drop_points, "data_bytes": s.data_bytes,
                           "within_budget": s.within_budget} for s in r.trail]
    return model


def test_mobilenet_v2_cpu_budget_or_cap(mnv2_cal, shared_data, tmp_path):
    data = eval_photos(shared_data, 8)
    r = auto_mixed_precision(mnv2_cal, output_dir=tmp_path, eval_data=data, budget_points=10.0, max_fp32_layers=4,
                             device="cpu", progress=False, shortlist=4)
    model = check_search(r, budget=10.0, cap=4, device="cpu")
    assert r.trail[0].metric == "top1_agreement" and r.trail[0].float_value == 100.0
    assert r.search_images == 8 and r.final_all is None  # the search measured every image
    # an independent evaluation of the final written model gives the last step's metric and SQNR
    ev = evaluate(model, mnv2_cal.onnx_path, data, device="cpu", progress=False)
    assert 100.0 * ev.top1_agreement == r.trail[-1].value and ev.sqnr_db == r.trail[-1].sqnr_db
    assert not list(tmp_path.glob(".maceq-search-*"))  # the scratch models are removed
    # fewer search images than eval images: the final model and the all-int8 one are evaluated on all of them
    more = eval_photos(shared_data, 10)
    part = auto_mixed_precision(mnv2_cal, output_dir=tmp_path / "part", eval_data=more, budget_points=10.0,
                                max_fp32_layers=2, device="cpu", progress=False, shortlist=3, search_images=8)
    assert part.search_images == 8 and part.final_all["images"] == 10
    ev = evaluate(load(part.files.yml), mnv2_cal.onnx_path, more, device="cpu", progress=False)
    assert part.final_all["value"] == 100.0 * ev.top1_agreement and part.final_all["sqnr_db"] == ev.sqnr_db
    assert part.trail[0].to_dict() == r.trail[0].to_dict()  # the same first 8 images
    check_search(part, budget=10.0, cap=2, device="cpu")


def test_mobilenet_v2_dsp_budget_or_cap(mnv2_cal, shared_data, tmp_path):
    data = eval_photos(shared_data, 4)
    r = auto_mixed_precision(mnv2_cal, output_dir=tmp_path, eval_data=data, budget_points=10.0, max_fp32_layers=2,
                             device="dsp", progress=False, shortlist=3, rank_by="metric")
    model = check_search(r, budget=10.0, cap=2, device="dsp", rank_by="metric")
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
    # ops by isolated SQNR; a floor between the 3rd and 4th: those three go first, one step each, and no more
    worst = {}
    for L in plain.layers:
        worst[L.node] = min(worst.get(L.node, float("inf")), L.isolated.sqnr_db)
    ranked = sorted(worst, key=lambda n: (worst[n], n))
    floor_db = (worst[ranked[2]] + worst[ranked[3]]) / 2
    runs = [auto_mixed_precision(cal, output_dir=tmp_path / f"floor{k}", eval_data=data, budget_points=100.0,
                                 min_sqnr=floor_db, device="cpu", progress=False) for k in range(2)]
    r = runs[0]
    assert r.ok and list(r.fp32_nodes) == ranked[:3]
    assert [c.name for c in r.candidates if c.below_floor] == ranked[:3]
    assert all(s.reason == "below_min_sqnr" and s.kind == "op" for s in r.trail[1:])
    check_search(r, budget=100.0, cap=None, device="cpu")
    # a rerun on the same input takes the same decisions and writes the same model
    assert runs[1].to_dict() == r.to_dict()
    assert (tmp_path / "floor0" / "fmnist_mobilenet.data").read_bytes() == \
        (tmp_path / "floor1" / "fmnist_mobilenet.data").read_bytes()
    capped = auto_mixed_precision(cal, output_dir=tmp_path / "capped", eval_data=data, budget_points=100.0,
                                  min_sqnr=floor_db, max_fp32_layers=1, device="cpu", progress=False)
    assert not capped.ok and capped.fp32_nodes == (ranked[0],)
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
    for kw, flag in (({"rank_by": "dB"}, "--rank-by"), ({"shortlist": 0}, "--shortlist"),
                     ({"search_images": 0}, "--search-images")):
        with pytest.raises(MaceqError, match=flag):
            auto_mixed_precision(cal, output_dir=tmp_path, eval_data=data, budget_points=1, progress=False, **kw)
