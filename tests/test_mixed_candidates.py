"""The mixed-precision search's parts on their own (app/mixed.py): candidate construction on a small
graph, and the measured greedy loop driven by a fake measure function."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from maceq.app.mixed import (
    CONVERT_COST,
    FLOAT_MAC_COST,
    Candidate,
    Measured,
    _Trail,
    build_candidates,
    extra_cost_pct,
    greedy,
    step_line,
    tensor_nodes,
)
from maceq.quant.ir import Graph, Node, ValueInfo


def small_graph() -> Graph:
    """x -> conv0 -> a -> dw -> b -> proj -> c -> add(c, a) -> d -> gap -> e -> flat -> f -> fc -> y."""
    w = {k: np.ones((1, 1, 1, 1), np.float32) for k in ("w0", "w1", "w2", "w3")}
    nodes = [Node("conv0", "Conv", ["x", "w0"], ["a"]), Node("dw", "Conv", ["a", "w1"], ["b"]),
             Node("proj", "Conv", ["b", "w2"], ["c"]), Node("add", "Add", ["c", "a"], ["d"]),
             Node("gap", "GlobalAveragePool", ["d"], ["e"]), Node("flat", "Flatten", ["e"], ["f"]),
             Node("fc", "Gemm", ["f", "w3"], ["y"])]
    return Graph(nodes, w, [ValueInfo("x", [1, 1, 4, 4])], ["y"])


PLACED = {n: "uint8" for n in ("conv0", "dw", "proj", "add", "gap", "fc")}  # flat: a view folded into fc
ISO = {"conv0": 30.0, "dw": 25.0, "proj": 12.0, "add": 28.0, "gap": 40.0, "fc": 35.0}


def layers(iso=ISO):
    return [SimpleNamespace(node=n, isolated=SimpleNamespace(sqnr_db=s)) for n, s in iso.items()]


def by_name(cands):
    return {(c.kind, c.name): c for c in cands}


def test_tensor_candidate_is_its_producer_and_every_consumer():
    g = small_graph()
    got = by_name(build_candidates(g, PLACED, layers()))
    assert got["tensor", "a"].nodes == ("add", "conv0", "dw")        # producer + both consumers
    assert got["tensor", "b"].nodes == ("dw", "proj")
    assert got["tensor", "c"].nodes == ("add", "proj")
    assert got["tensor", "e"].nodes == ("fc", "flat", "gap")          # through the view to its consumer
    assert tensor_nodes(g, "f", g.producers(), g.consumers()) == {"flat", "fc"}
    # every tensor candidate holds exactly the producer and the consumers of its tensor
    prod, cons = g.producers(), g.consumers()
    for c in got.values():
        if c.kind == "tensor" and c.name not in ("e",):
            expect = {prod[c.name].name} if c.name in prod else set()
            expect |= {n.name for n in cons.get(c.name, [])}
            assert set(c.nodes) == expect
    # op candidates are the op alone; the graph input's tensor {conv0} and the output's {fc} equal op candidates
    assert got["op", "proj"].nodes == ("proj",)
    assert ("tensor", "x") not in got and ("tensor", "y") not in got
    assert ("op", "conv0") in got and ("op", "fc") in got


def test_proxy_order_dedup_and_covered_sets_are_skipped():
    g = small_graph()
    cands = build_candidates(g, PLACED, layers())
    assert len({c.nodes for c in cands}) == len(cands)
    keys = [(c.proxy_db, len(c.nodes), c.kind != "op", c.name) for c in cands]
    assert keys == sorted(keys)
    # proxy: the lowest isolated SQNR of the candidate's ops; the op comes before the tensors at the same proxy
    assert [(c.kind, c.name, c.proxy_db) for c in cands[:3]] == [("op", "proj", 12.0), ("tensor", "b", 12.0),
                                                                  ("tensor", "c", 12.0)]
    assert by_name(cands)["tensor", "e"].proxy_db == 35.0  # flat has no analysis of its own
    # nodes already float32 leave the sets; a set entirely float32 is no candidate
    excl = build_candidates(g, PLACED, layers(), exclude={"dw", "proj"})
    names = by_name(excl)
    assert ("tensor", "b") not in names and ("op", "proj") not in names and ("op", "dw") not in names
    assert names["tensor", "a"].nodes == ("add", "conv0")
    assert all(not set(c.nodes) & {"dw", "proj"} for c in excl)
    # an op that already falls back to float32 is no op candidate; the floor marks ops only
    fallback = build_candidates(g, {**PLACED, "gap": "float32"}, layers(), min_sqnr=26.0)
    assert ("op", "gap") not in by_name(fallback)
    assert {(c.kind, c.name) for c in fallback if c.below_floor} == {("op", "proj"), ("op", "dw")}


def fake_measure(contrib: dict, *, pair_bonus=None, base_db=10.0, calls=None):
    """Logits SQNR = base + each float node's contribution (+ a bonus when a whole pair is float);
    agreement = 60 + 2 points per dB, capped at 100."""
    def measure_many(sets):
        if calls is not None:
            calls.append([tuple(s) for s in sets])
        out = []
        for s in sets:
            db = base_db + sum(contrib.get(n, 0.0) for n in set(s))
            for pair, bonus in (pair_bonus or {}).items():
                if set(pair) <= set(s):
                    db += bonus
            out.append(Measured(tuple(sorted(s)), "top1_agreement", min(100.0, 60.0 + 2 * (db - base_db)), 100.0,
                                db))
        return out
    return measure_many


def cand(kind, name, *nodes):
    return Candidate(kind, name, tuple(sorted(nodes)), 0.0)


START = Measured((), "top1_agreement", 60.0, 100.0, 10.0)


def test_greedy_takes_the_largest_measured_gain_and_remeasures():
    cands = [cand("op", "proj", "proj"), cand("tensor", "b", "dw", "proj"), cand("op", "fc", "fc"),
             cand("op", "gap", "gap")]
    calls = []
    # proj alone gains 1 dB, but with its input tensor (dw and proj together) 8 dB: the tensor wins round 1
    m = fake_measure({"proj": 1.0, "fc": 3.0, "gap": 2.0}, pair_bonus={("dw", "proj"): 7.0}, calls=calls)
    r = greedy(cands, m, start=START, budget=20.0, cap=None)
    assert r.ok and r.message == ""
    assert [x.candidate.name for x in r.rounds] == ["b", "fc"]
    assert r.chosen == ("dw", "proj", "fc")
    # round 1 measures every candidate; round 2 re-measures the rest (proj is covered by b) on top of {dw, proj}
    assert calls[0] == [("proj",), ("dw", "proj"), ("fc",), ("gap",)]
    assert calls[1] == [("dw", "proj", "fc"), ("dw", "proj", "gap")]
    first = r.rounds[0]
    assert [round(g, 9) for g, _, _ in first.scored] == [8.0, 3.0, 2.0, 1.0]
    assert first.measured.sqnr_db == 18.0 and r.rounds[1].measured.sqnr_db == 21.0
    # the budget stops it: 60 + 2 * 11 = 82% after round 2, drop 18 <= 20; a tighter budget goes on
    assert r.rounds[-1].measured.drop_points == pytest.approx(18.0)
    more = greedy(cands, m, start=START, budget=15.0, cap=None)
    assert [x.candidate.name for x in more.rounds] == ["b", "fc", "gap"] and more.ok


def test_greedy_stops_at_the_cap_counting_ops():
    cands = [cand("tensor", "b", "dw", "proj"), cand("op", "fc", "fc"), cand("op", "gap", "gap")]
    m = fake_measure({"fc": 3.0, "gap": 2.0}, pair_bonus={("dw", "proj"): 8.0})
    r = greedy(cands, m, start=START, budget=0.0, cap=3)
    assert [x.candidate.name for x in r.rounds] == ["b", "fc"] and len(r.chosen) == 3
    assert not r.ok and r.message.startswith("--max-fp32-layers 3 reached with drop")
    # a cap of 1 leaves the two-op tensor out of every round: it is never measured
    calls = []
    r1 = greedy(cands, fake_measure({"fc": 3.0, "gap": 2.0}, calls=calls), start=START, budget=0.0, cap=1)
    assert r1.chosen == ("fc",) and all(("dw", "proj") not in c for c in calls)
    # within budget at once: nothing measured
    calls = []
    r0 = greedy(cands, fake_measure({}, calls=calls), start=Measured((), "top1_agreement", 99.0, 100.0, 30.0),
                budget=1.0, cap=None)
    assert r0.ok and r0.rounds == [] and calls == []


def test_greedy_stops_when_nothing_gains_and_ties_are_by_name():
    cands = [cand("op", "zeta", "zeta"), cand("op", "alpha", "alpha"), cand("tensor", "t", "x", "y")]
    r = greedy(cands, fake_measure({"zeta": 0.0, "alpha": 0.0}), start=START, budget=1.0, cap=None)
    assert not r.ok and r.rounds == [] and r.message.startswith("no shortlisted candidate improves the logits SQNR")
    # equal gains: the name decides, whatever the input order
    m = fake_measure({"zeta": 2.0, "alpha": 2.0})
    for order in (cands, cands[::-1]):
        r = greedy(order, m, start=START, budget=0.0, cap=1)
        assert r.chosen == ("alpha",)
    # every candidate taken and still over budget
    r = greedy(cands[:2], m, start=START, budget=0.0, cap=None)
    assert r.chosen == ("alpha", "zeta") and "every shortlisted candidate is float32" in r.message


def test_greedy_goes_on_when_the_budget_holds_only_on_the_search_images():
    cands = [cand("op", "fc", "fc"), cand("op", "gap", "gap"), cand("op", "proj", "proj")]
    def m(sets):  # the search images: 96% (within a budget of 5) whatever is in float32; the SQNR ranks them
        gain = {"fc": 3.0, "gap": 2.0, "proj": 1.0}
        return [Measured(tuple(s), "top1_agreement", 96.0, 100.0, 10.0 + sum(gain[n] for n in s)) for s in sets]
    start = Measured((), "top1_agreement", 96.0, 100.0, 10.0)
    checked = []

    def confirm(nodes):  # every eval image: 90% with nothing in float32, +3 points per float32 op
        checked.append(tuple(nodes))
        return Measured(tuple(nodes), "top1_agreement", 90.0 + 3 * len(nodes), 100.0, 15.0)
    r = greedy(cands, m, start=start, budget=5.0, cap=None, confirm=confirm, confirm_images=91)
    # 90 -> 93 -> 96: two rounds, each by the largest gain on the search images, each checked on every image
    assert r.ok and r.chosen == ("fc", "gap") and checked == [(), ("fc",), ("fc", "gap")]
    capped = greedy(cands, m, start=start, budget=5.0, cap=1, confirm=confirm, confirm_images=91)
    assert not capped.ok and capped.chosen == ("fc",)
    assert capped.message == "--max-fp32-layers 1 reached with drop 7.00 points on all 91 images > budget 5"
    # without the check, the search images decide alone
    assert greedy(cands, m, start=start, budget=5.0, cap=None).chosen == ()


def test_rank_by_metric_and_rank_by_sqnr_can_differ():
    # "a" raises the SQNR more, "b" the agreement more (a measure where the two disagree)
    def measure_many(sets):
        table = {("a",): (62.0, 14.0), ("b",): (66.0, 11.0)}
        return [Measured(tuple(s), "top1_agreement", *table[tuple(s)][:1], 100.0, table[tuple(s)][1]) for s in sets]
    cands = [cand("op", "a", "a"), cand("op", "b", "b")]
    assert greedy(cands, measure_many, start=START, budget=0.0, cap=1, rank_by="sqnr").chosen == ("a",)
    assert greedy(cands, measure_many, start=START, budget=0.0, cap=1, rank_by="metric").chosen == ("b",)


def test_trail_records_the_round_and_the_cost():
    base = Measured((), "top1_agreement", 60.0, 100.0, 10.0, 1000, 0, 0, 0, 0, 10_000)
    one = Measured(("dw", "proj"), "top1_agreement", 70.0, 100.0, 15.0, 1300, 2, 500, 2, 1000, 10_000)
    assert extra_cost_pct(one, base) == pytest.approx(100.0 * ((FLOAT_MAC_COST - 1) * 1000 + CONVERT_COST * 500)
                                                      / 10_000)
    t = _Trail("cpu", 5.0, progress=False)
    t.add(base)
    c, runner = cand("tensor", "b", "dw", "proj"), cand("op", "proj", "proj")
    t.add(one, c, "budget", [(5.0, c, one), (1.0, runner, base)])
    s = t.steps[-1].to_dict()
    assert (s["kind"], s["candidate"], s["nodes"], s["gain"]) == ("tensor", "b", ["dw", "proj"], 5.0)
    assert s["runner_up"]["name"] == "proj" and s["runner_up"]["gain"] == 1.0
    assert [x["name"] for x in s["measured"]] == ["b", "proj"] and s["measured"][0]["gain_points"] == 10.0
    assert s["boundaries"] == 2 and s["est_cost_pct"] == pytest.approx(30.0) and not s["within_budget"]
    line = step_line(t.steps[-1])
    assert "+tensor b (2 op(s))" in line and "2 boundaries" in line and "est. +30.0%" in line
