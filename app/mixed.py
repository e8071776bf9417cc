"""Automatic mixed precision: keep the fewest ops in float32 that bring int8 within a budget.

The search (:func:`auto_mixed_precision`), from one calibration (docs/mixed-precision.md):

1. **Candidates.** Two kinds, each a set of source-graph node names for
   ``write_quantized(cal, fp32_nodes=...)`` (:func:`build_candidates`):

   - a *tensor* candidate keeps one quantized activation tensor in float: its producer and every
     consumer run in float32 (a consumer that only relabels the tensor, a Flatten/Reshape/Squeeze,
     passes through to its own consumers), so the tensor is never quantized;
   - an *op* candidate keeps one quantized op in float32, alone (its input and output tensors stay
     quantized where other uint8 ops read or write them).

   Candidates whose set is already float32 (the config's ``fp32_layers``, earlier choices) are
   skipped; of candidates with the same set, one is kept (the op before the tensor).
2. **Shortlist (cheap proxy).** The all-int8 model's *isolated* per-layer analysis on the search
   images (:func:`maceq.reports.analysis.analyze_layers`: only that layer quantized, its input
   quantized as the model quantizes it) gives each uint8 op an SQNR in dB. A candidate's proxy is
   the lowest isolated SQNR among its ops; the ``shortlist`` lowest proxies (ties: fewer nodes,
   op before tensor, then the name) are the only candidates measured.
3. **Measured greedy** (:func:`greedy`). Each round, every shortlisted candidate that is not yet
   covered and fits the cap is *measured on the end metric*: the model rebuilt with the chosen set
   plus that candidate in float32, evaluated on the search images
   (:func:`maceq.reports.evaluate.evaluate`). Its gain over the current model is the rise of the
   logits SQNR in dB (``rank_by="sqnr"``, the default: smooth on few images) or of top-1
   agreement / accuracy in points (``rank_by="metric"``). The largest gain is added (ties by name,
   then kind); the remaining candidates are re-measured on top of the new set next round.
4. **Stop** when the drop is within the budget (``ok``); or when no candidate fits
   ``max_fp32_layers``, none is left, or none gains (``ok`` False, ``message`` says why).

``max_fp32_layers`` counts the *ops* (source-graph nodes) the search keeps in float32, not the
candidates: a tensor candidate of one depthwise conv and one projection conv counts 2. Nodes the
config keeps in float32 are not counted. ``min_sqnr``, a per-op floor: ops whose isolated SQNR is
below it are kept in float32 first (one measured step each, most damaging first), before the
greedy search.

The metric: with labels, the accuracy drop ``100 * (float_acc - int8_acc)`` points; without,
``100 * (1 - agreement)`` points. The budget holds when ``drop <= budget_points``. When the search
images are fewer than ``eval_data``'s, a set within the budget on the search images is evaluated
on all of them; where the budget does not hold there, the search goes on (its gains still measured
on the search images). The all-int8 and the final model's figures on all images are kept
(``baseline_all``, ``final_all``), and ``ok`` needs the budget to hold there as well.

Each step records the boundaries (inner Quantize/Dequantize ops) and float work of its model
(:func:`maceq.reports.cost.float_share`) and an estimate of its extra device time
(:func:`extra_cost_pct`).

Parallel measurements (``executor="ray"``, or ``"local"`` with ``workers > 1``): each round's
candidate models are measured at once on a :class:`maceq.calibrate.parallel.TaskPool`, each in a
temporary folder of its own, by the same function the sequential search calls in this process;
the greedy decision is taken here on the results in candidate order, so the trail equals the
sequential search's (tests/test_parallel.py).
"""
from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from maceq.calibrate.parallel import Executor, TaskPool, check_workers
from maceq.datasets.images import ImageFolder
from maceq.errors import MaceqError
from maceq.quant.build import VIEW_OPS
from maceq.quant.export import write_quantized
from maceq.reports.analysis import analyze_layers
from maceq.reports.cost import float_share
from maceq.reports.evaluate import evaluate
from maceq.runtime.devices import Device
from maceq.runtime.model import load

#: Slack when comparing a drop with the budget (both are in points; drops are multiples of 100/N).
BUDGET_EPS = 1e-9
#: Device-time model: a float32 MAC costs this many int8 MACs (int8 kernels do about twice the MACs per
#: cycle of float32 ones on ARM NEON), and each value a Quantize/Dequantize converts costs this many.
FLOAT_MAC_COST = 2.0
CONVERT_COST = 4.0
RANK_BY = ("sqnr", "metric")
DEFAULT_SHORTLIST = 12
DEFAULT_SEARCH_IMAGES = 32


def extra_cost_pct(m: "Measured", base: "Measured") -> float:
    """Estimated device time ``m`` adds over ``base``, in % of the all-int8 model's time.

    Time is counted in int8-MAC equivalents: ``int8 MACs + FLOAT_MAC_COST * float MACs +
    CONVERT_COST * values converted at the Quantize/Dequantize boundaries``."""
    def units(x: Measured) -> float:
        return (x.macs - x.float_macs) + FLOAT_MAC_COST * x.float_macs + CONVERT_COST * x.boundary_values
    return 100.0 * (units(m) - units(base)) / max(units(base), 1.0)


@dataclass(frozen=True)
class Candidate:
    """A unit the search may keep in float32: an op alone, or a tensor (its producer and consumers)."""

    kind: str                  # "tensor" | "op"
    name: str                  # the tensor's or the node's name
    nodes: tuple[str, ...]     # the source-graph nodes it keeps in float32, sorted
    proxy_db: float            # lowest isolated SQNR (dB) of its ops; the shortlist's order
    below_floor: bool = False  # an op whose isolated SQNR is under min_sqnr

    def to_dict(self) -> dict:
        return {"kind": self.kind, "name": self.name, "nodes": list(self.nodes),
                "proxy_db": _json_float(self.proxy_db), "below_floor": self.below_floor}


@dataclass(frozen=True)
class Measured:
    """One model measured on the search images: its fp32 set, metric, logits SQNR, size and float cost."""

    fp32_nodes: tuple[str, ...]
    metric: str                 # "top1_agreement" | "accuracy"
    value: float                # in percent
    float_value: float          # the float reference in percent (100 for agreement)
    sqnr_db: float              # logits SQNR over the images
    data_bytes: int = 0
    boundaries: int = 0         # inner Quantize/Dequantize ops
    boundary_values: int = 0    # values they convert per run
    float_ops: int = 0
    float_macs: int = 0
    macs: int = 0

    @property
    def drop_points(self) -> float:
        return self.float_value - self.value


def gain(m: Measured, cur: Measured, rank_by: str) -> float:
    """How much ``m`` improves on ``cur``: logits SQNR in dB (``sqnr``) or metric points (``metric``)."""
    return m.sqnr_db - cur.sqnr_db if rank_by == "sqnr" else m.value - cur.value


@dataclass(frozen=True)
class Step:
    """One measured model of the search: step 0 is all int8; each later step adds one candidate."""

    step: int
    kind: str | None            # "tensor" | "op" (None at step 0)
    candidate: str | None       # the candidate's name
    nodes: tuple[str, ...]      # the nodes this step added to the fp32 set
    reason: str                 # "baseline" | "below_min_sqnr" | "budget"
    fp32_nodes: tuple[str, ...]  # all nodes in float32 (auto and manual), sorted
    n_fp32: int                 # len(fp32_nodes)
    metric: str
    value: float
    float_value: float
    drop_points: float
    sqnr_db: float
    gain: float | None          # the chosen candidate's measured gain (rank_by's unit)
    runner_up: dict | None      # the next best candidate of the round and its gain
    measured: tuple             # every candidate measured in the round: {kind, name, n_nodes, gain_db, gain_points}
    boundaries: int
    boundary_values: int
    float_ops: int
    float_macs: int
    est_cost_pct: float         # estimated extra device time over the all-int8 model (extra_cost_pct)
    data_bytes: int
    within_budget: bool

    @property
    def exempted(self) -> str | None:
        return self.candidate

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(exempted=self.candidate, nodes=list(self.nodes), fp32_nodes=list(self.fp32_nodes),
                 measured=[dict(x) for x in self.measured], sqnr_db=_json_float(self.sqnr_db))
        return d


@dataclass
class MixedResult:
    """The outcome: ``ok`` (budget and floor met), the fp32 nodes chosen, the trail, the files."""

    ok: bool
    fp32_nodes: tuple[str, ...]      # the nodes the search keeps in float32, in the order they were added
    trail: list[Step]
    candidates: list[Candidate]      # the shortlist the greedy search measured (floor candidates first)
    files: object                    # ModelFiles of the final model (written to output_dir)
    result: object                   # its QuantizeResult
    device: str
    budget_points: float
    min_sqnr: float | None
    max_fp32_layers: int | None
    message: str = ""
    layers: list = field(default_factory=list)  # LayerError of the all-int8 model (isolated)
    rank_by: str = "sqnr"
    search_images: int = 0
    baseline_all: dict | None = None  # all-int8 and final model on every eval image (when the search used fewer)
    final_all: dict | None = None

    @property
    def tradeoff(self) -> list[dict]:
        """Metric vs number of fp32 layers vs .data bytes, one point per measured step."""
        return [{"n_fp32": s.n_fp32, "fp32_nodes": list(s.fp32_nodes), "metric": s.metric, "value": s.value,
                 "drop_points": s.drop_points, "data_bytes": s.data_bytes, "within_budget": s.within_budget}
                for s in self.trail]

    def to_dict(self) -> dict:
        """JSON-serialisable record for report.json."""
        return {"ok": self.ok, "message": self.message, "device": self.device,
                "budget_points": self.budget_points, "min_sqnr": self.min_sqnr,
                "max_fp32_layers": self.max_fp32_layers, "rank_by": self.rank_by,
                "search_images": self.search_images, "fp32_nodes": list(self.fp32_nodes),
                "trail": [s.to_dict() for s in self.trail], "tradeoff": self.tradeoff,
                "baseline_all": self.baseline_all, "final_all": self.final_all,
                "candidates": [c.to_dict() for c in self.candidates],
                "layers": [L.to_dict() for L in self.layers]}


def _json_float(v: float):
    return v if math.isfinite(v) else ("inf" if v > 0 else "-inf")


# -- candidates -----------------------------------------------------------------------------------

def tensor_nodes(graph, tensor: str, producers: dict, consumers: dict) -> set[str]:
    """The nodes that must run in float32 for ``tensor`` never to be quantized: its producer and
    every consumer, through view ops (Flatten/Reshape/Squeeze relabel the tensor) to theirs."""
    nodes = {producers[tensor].name} if tensor in producers else set()
    todo = [tensor]
    while todo:
        for c in consumers.get(todo.pop(), []):
            if c.name not in nodes:
                nodes.add(c.name)
                if c.op_type in VIEW_OPS:
                    todo.extend(c.outputs)
    return nodes


def build_candidates(graph, placement: dict, layers, *, exclude=frozenset(),
                     min_sqnr: float | None = None) -> list[Candidate]:
    """Every op and tensor candidate of ``graph`` (module docstring), ordered by proxy.

    ``placement``: node -> "uint8" | "float32" of the all-int8 model (views folded into a
    FullyConnected have none). ``layers``: its isolated analysis (``LayerError``); ops without one
    get a proxy of +inf. ``exclude``: nodes already float32, removed from every set."""
    iso: dict[str, float] = {}
    for L in layers:
        if L.node is not None and L.isolated is not None:
            iso[L.node] = min(iso.get(L.node, math.inf), float(L.isolated.sqnr_db))
    uint8 = {n for n, where in placement.items() if where == "uint8"}

    def make(kind, name, nodes):
        nodes = set(nodes) - set(exclude)
        if not nodes & uint8:
            return None
        proxy = min((iso.get(n, math.inf) for n in nodes), default=math.inf)
        floor = kind == "op" and min_sqnr is not None and proxy < min_sqnr
        return Candidate(kind, name, tuple(sorted(nodes)), proxy, floor)

    found = [make("op", n.name, [n.name]) for n in graph.nodes]
    producers, consumers = graph.producers(), graph.consumers()
    tensors = [i.name for i in graph.inputs] + [o for n in graph.nodes for o in n.outputs]
    found += [make("tensor", t, tensor_nodes(graph, t, producers, consumers)) for t in dict.fromkeys(tensors)
              if not graph.is_const(t)]
    order = sorted((c for c in found if c is not None),
                   key=lambda c: (c.proxy_db, len(c.nodes), c.kind != "op", c.name))
    seen, out = set(), []
    for c in order:
        if c.nodes not in seen:
            seen.add(c.nodes)
            out.append(c)
    return out


# -- the greedy loop ------------------------------------------------------------------------------

@dataclass
class Round:
    """One greedy decision: the candidate taken, its measurement, and every candidate's (gain, cand, m)."""

    candidate: Candidate
    measured: Measured
    scored: list
    reason: str = "budget"


@dataclass
class GreedyResult:
    rounds: list[Round]
    chosen: tuple[str, ...]   # the nodes added, in order
    ok: bool
    message: str


def within_budget(m: Measured, budget: float) -> bool:
    return m.drop_points <= budget + BUDGET_EPS


def greedy(cands: Sequence[Candidate], measure_many: Callable[[list[tuple[str, ...]]], list[Measured]], *,
           start: Measured, budget: float, cap: int | None, rank_by: str = "sqnr",
           chosen: Sequence[str] = (), confirm: Callable[[tuple[str, ...]], Measured] | None = None,
           confirm_images: int = 0) -> GreedyResult:
    """The measured greedy search (module docstring, step 3 and 4).

    ``measure_many(sets)``: one :class:`Measured` per node set (each the whole set of nodes the
    search keeps in float32: ``chosen`` plus the candidate's), in order. ``start``: the model
    with ``chosen`` in float32. ``cap``: the most nodes the search may keep in float32 (``chosen``
    included). ``confirm(nodes)``: the model measured on every eval image (``confirm_images``) when
    the search measures on fewer; a set within the budget on the search images must hold there
    too, or the search goes on."""
    taken, cur, rounds = list(dict.fromkeys(chosen)), start, []
    left = list(cands)
    while True:
        why = f"drop {cur.drop_points:.2f} points > budget {budget:g}"
        if within_budget(cur, budget):
            full = None if confirm is None else confirm(tuple(taken))
            if full is None or within_budget(full, budget):
                return GreedyResult(rounds, tuple(taken), True, "")
            why = f"drop {full.drop_points:.2f} points on all {confirm_images} images > budget {budget:g}"
        left = [c for c in left if not set(c.nodes) <= set(taken)]
        fits = [c for c in left if cap is None or len(set(taken) | set(c.nodes)) <= cap]
        if not left:
            return GreedyResult(rounds, tuple(taken), False, f"every shortlisted candidate is float32 and the {why}")
        if not fits:
            return GreedyResult(rounds, tuple(taken), False, f"--max-fp32-layers {cap} reached with {why}")
        sets = [tuple(taken) + tuple(n for n in c.nodes if n not in taken) for c in fits]
        got = measure_many(sets)
        scored = sorted(((gain(m, cur, rank_by), c, m) for c, m in zip(fits, got)),
                        key=lambda t: (-t[0], t[1].name, t[1].kind))
        best, c, m = scored[0]
        if not best > 0:
            what = "logits SQNR" if rank_by == "sqnr" else "metric"
            return GreedyResult(rounds, tuple(taken), False,
                                f"no shortlisted candidate improves the {what} ({len(fits)} measured) with {why}")
        taken += [n for n in c.nodes if n not in taken]
        rounds.append(Round(c, m, scored))
        cur = m


# -- measuring ------------------------------------------------------------------------------------

def holdout_split(calib_dir: str | os.PathLike, preprocess, *, used: int, limit: int | None = None,
                  labels="auto") -> ImageFolder:
    """The images of ``calib_dir`` after the first ``used`` (those calibration read), at most ``limit``.

    Calibration reads the first ``max_images`` files in sorted order, so the rest were never
    seen by it. MaceqError when nothing is left.
    """
    data = ImageFolder(calib_dir, preprocess, labels=labels)
    files = data.files[used:]
    if limit is not None:
        files = files[:limit]
    if not files:
        raise MaceqError(f"{calib_dir}: calibration used all {len(data.files)} images, none is left to measure "
                         "the accuracy budget on: pass --eval-dir, or a --max-images below the image count")
    keep = slice(used, used + len(files))
    data.files = files
    if data.labels is not None:
        data.labels = data.labels[keep]
    return data


@dataclass(frozen=True)
class _EvalJob:
    """What each candidate measurement needs, shipped once per worker."""

    cal: object
    data: ImageFolder
    device: str
    batch_size: int
    model_name: str | None
    extra_meta: dict | None


def _measure(job: _EvalJob, fp32, out_dir: Path):
    """Write the model with ``fp32`` kept in float32 into ``out_dir``, load it, evaluate it."""
    res = write_quantized(job.cal, output_dir=out_dir, devices=(job.device,), fp32_nodes=set(fp32),
                          model_name=job.model_name, extra_meta=job.extra_meta)
    model = load(res.files.yml)
    ev = evaluate(model, job.cal.onnx_path, job.data, device=job.device, batch_size=job.batch_size, progress=False)
    fs = float_share(model, job.device)
    if ev.float_accuracy is not None:
        metric, value, ref = "accuracy", 100.0 * ev.int8_accuracy, 100.0 * ev.float_accuracy
    else:
        metric, value, ref = "top1_agreement", 100.0 * ev.top1_agreement, 100.0
    m = Measured(tuple(sorted(res.fp32)), metric, value, ref, float(ev.sqnr_db), os.path.getsize(res.files.data),
                 fs.boundaries, fs.boundary_values, fs.float_ops, fs.float_macs, fs.macs)
    return res, model, m


def _measure_task(job: _EvalJob, fp32: tuple[str, ...], report=None) -> Measured:
    """:func:`_measure` in a temporary folder of its own (here, in a worker process or a Ray task)."""
    tmp = Path(tempfile.mkdtemp(prefix="maceq-search-"))
    try:
        return _measure(job, fp32, tmp)[2]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_args(budget_points, min_sqnr, max_fp32_layers, rank_by, shortlist, search_images) -> float:
    budget = float(budget_points)
    if not math.isfinite(budget) or budget < 0:
        raise MaceqError(f"--accuracy-budget must be a number of points >= 0, got {budget_points!r}")
    for flag, v, low in (("--max-fp32-layers", max_fp32_layers, 0), ("--shortlist", shortlist, 1),
                         ("--search-images", search_images, 1)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
            raise MaceqError(f"{flag} must be an int >= {low}, got {v!r}")
    if min_sqnr is not None and not math.isfinite(float(min_sqnr)):
        raise MaceqError(f"--min-sqnr must be a number of dB, got {min_sqnr!r}")
    if rank_by not in RANK_BY:
        raise MaceqError(f"--rank-by must be one of {', '.join(RANK_BY)}, got {rank_by!r}")
    return budget


def auto_mixed_precision(cal, *, output_dir: str | os.PathLike, eval_data: ImageFolder, budget_points: float,
                         min_sqnr: float | None = None, max_fp32_layers: int | None = None, device: str = "cpu",
                         model_name: str | None = None, extra_meta: dict | None = None, batch_size: int = 8,
                         progress: bool = True, executor: str = "local", workers: int = 1,
                         ray_address: str | None = None, rank_by: str = "sqnr",
                         shortlist: int = DEFAULT_SHORTLIST,
                         search_images: int | None = DEFAULT_SEARCH_IMAGES) -> MixedResult:
    """Greedy measured search for the fp32 set that brings ``device``'s int8 model within ``budget_points``.

    ``cal``: a :class:`maceq.app.pipeline.Calibration`. ``eval_data``: the images the metric is
    measured on (an eval folder, or :func:`holdout_split` of the calibration folder); the search
    measures on its first ``search_images`` (None: all). The final model is written to
    ``output_dir``. ``executor`` ("local" | "ray"), ``workers``, ``ray_address``: where each
    round's candidates are measured ("local" with one worker: one after another in this process),
    with identical results. See the module docstring.
    """
    device = Device.parse(device).value
    budget = _check_args(budget_points, min_sqnr, max_fp32_layers, rank_by, shortlist, search_images)
    executor = Executor.parse(executor)
    workers = check_workers(workers)
    out = Path(output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MaceqError(f"{out}: cannot create the output folder ({e.strerror})") from None
    n = len(eval_data.files) if search_images is None else min(search_images, len(eval_data.files))
    job = _EvalJob(cal, eval_data.shard(0, n), device, batch_size, model_name, extra_meta)
    pool = None
    if executor is Executor.RAY or workers > 1:
        pool = TaskPool(job, executor=executor, workers=workers, ray_address=ray_address)
    try:
        return _search(job, out=out, all_data=eval_data, budget=budget, min_sqnr=min_sqnr, cap=max_fp32_layers,
                       rank_by=rank_by, shortlist=shortlist, progress=progress, pool=pool)
    finally:
        if pool is not None:
            pool.close()


class _Trail:
    """The steps of one search, printed as they are taken."""

    def __init__(self, device: str, budget: float, progress: bool):
        self.device, self.budget, self.progress = device, budget, progress
        self.steps: list[Step] = []
        self.base: Measured | None = None

    def say(self, line: str) -> None:
        if self.progress:
            print(line, file=sys.stderr)

    def add(self, m: Measured, cand: Candidate | None = None, reason: str = "baseline", scored=()) -> None:
        self.base = self.base or m
        ranked = [{"kind": c.kind, "name": c.name, "n_nodes": len(c.nodes),
                   "gain_db": m2.sqnr_db - self.last.sqnr_db, "gain_points": m2.value - self.last.value}
                  for _, c, m2 in scored] if scored else []
        s = Step(len(self.steps), cand and cand.kind, cand and cand.name, cand.nodes if cand else (), reason,
                 m.fp32_nodes, len(m.fp32_nodes), m.metric, m.value, m.float_value, m.drop_points, m.sqnr_db,
                 scored[0][0] if scored else None, ({**ranked[1], "gain": scored[1][0]} if len(ranked) > 1 else None),
                 tuple(ranked), m.boundaries, m.boundary_values, m.float_ops, m.float_macs,
                 extra_cost_pct(m, self.base), m.data_bytes, within_budget(m, self.budget))
        self.steps.append(s)
        self.say(f"mixed precision [{self.device}] {step_line(s)}")

    @property
    def last(self) -> Measured:
        s = self.steps[-1]
        return Measured(s.fp32_nodes, s.metric, s.value, s.float_value, s.sqnr_db)


def step_line(s: Step) -> str:
    """One trail step in a line: what was added, the measured gain and runner-up, the metric, the cost."""
    what = "(all int8)" if s.candidate is None else f"+{s.kind} {s.candidate} ({len(s.nodes)} op(s))"
    line = f"step {s.step}: {what}: {s.metric} {s.value:.2f}% (drop {s.drop_points:.2f} points), {s.sqnr_db:.2f} dB"
    if s.gain is not None:
        line += f", gain {s.gain:+.2f}"
    if s.runner_up:
        line += f", runner-up {s.runner_up['kind']} {s.runner_up['name']} {s.runner_up['gain']:+.2f}"
    return (line + f"; {s.n_fp32} fp32 op(s), {s.boundaries} boundaries, est. +{s.est_cost_pct:.1f}% "
            f"device time, {s.data_bytes} weight bytes")


def _search(job: _EvalJob, *, out, all_data, budget, min_sqnr, cap, rank_by, shortlist, progress,
            pool=None) -> MixedResult:
    cal, device = job.cal, job.device
    trail = _Trail(device, budget, progress)
    with tempfile.TemporaryDirectory(prefix=".maceq-search-", dir=out) as scratch:
        res0, model0, m0 = _measure(job, (), Path(scratch))
        trail.add(m0)
        layers = analyze_layers(model0, cal.graph, job.data, device=device, modes=("isolated",), progress=progress)
        del model0
    cands = build_candidates(cal.graph, res0.placement, layers, exclude=res0.fp32, min_sqnr=min_sqnr)

    def measure_many(sets):
        return pool.map(_measure_task, sets) if pool is not None else [_measure_task(job, s) for s in sets]

    measure_all = _AllImages(job, all_data, trail)
    floor = sorted((c for c in cands if c.below_floor), key=lambda c: (c.proxy_db, c.name))
    chosen, ok, message = _floor_steps(floor, measure_many, trail, cap=cap, min_sqnr=min_sqnr)
    short = [c for c in cands if not c.below_floor][:shortlist]
    if ok:
        g = greedy(short, measure_many, start=trail.last, budget=budget, cap=cap, rank_by=rank_by, chosen=chosen,
                   confirm=measure_all if measure_all.needed else None, confirm_images=len(all_data.files))
        for r in g.rounds:
            trail.add(r.measured, r.candidate, r.reason, r.scored)
        chosen, ok, message = g.chosen, g.ok, g.message
    return _finish(job, trail, out=out, measure_all=measure_all, chosen=chosen, ok=ok, message=message,
                   cands=floor + short, layers=layers, budget=budget, min_sqnr=min_sqnr, cap=cap, rank_by=rank_by)


class _AllImages:
    """The model with a set of nodes in float32, measured on every eval image (once per set)."""

    def __init__(self, job: _EvalJob, all_data: ImageFolder, trail: _Trail):
        self.n = len(all_data.files)
        self.needed = len(job.data.files) < self.n
        self.job = _EvalJob(job.cal, all_data, job.device, job.batch_size, job.model_name, job.extra_meta)
        self.trail, self.seen = trail, {}

    def __call__(self, nodes: tuple[str, ...]) -> Measured:
        key = tuple(sorted(set(nodes)))
        if key not in self.seen:
            m = self.seen[key] = _measure_task(self.job, tuple(nodes))
            self.trail.say(f"mixed precision [{self.job.device}] {len(key)} fp32 op(s), on all {self.n} images: "
                           f"{m.metric} {m.value:.2f}% (drop {m.drop_points:.2f} points), {m.sqnr_db:.2f} dB")
        return self.seen[key]


def _floor_steps(floor, measure_many, trail: _Trail, *, cap, min_sqnr) -> tuple[tuple[str, ...], bool, str]:
    """Ops below ``min_sqnr`` go to float32 first, one measured step each; False when the cap stops it."""
    chosen: list[str] = []
    for k, c in enumerate(floor):
        if cap is not None and len(chosen) + 1 > cap:
            return (tuple(chosen), False, f"--max-fp32-layers {cap} reached with {len(floor) - k} layer(s) below "
                    f"--min-sqnr {min_sqnr:g} dB still int8")
        chosen.append(c.name)
        trail.add(measure_many([tuple(chosen)])[0], c, "below_min_sqnr")
    return tuple(chosen), True, ""


def _summary(m: Measured, images: int) -> dict:
    return {"images": images, "metric": m.metric, "value": m.value, "float_value": m.float_value,
            "drop_points": m.drop_points, "sqnr_db": _json_float(m.sqnr_db)}


def _finish(job: _EvalJob, trail: _Trail, *, out, measure_all: _AllImages, chosen, ok, message, cands, layers,
            budget, min_sqnr, cap, rank_by) -> MixedResult:
    """Write the final model; evaluate it (and the all-int8 one) on every image when the search used fewer."""
    last = trail.steps[-1]
    base_all = final_all = None
    if measure_all.needed:
        n = measure_all.n
        base_all = _summary(measure_all(()), n)
        final_all = _summary(measure_all(tuple(chosen)), n)
    record = {"ok": ok, "budget_points": budget, "min_sqnr": min_sqnr, "max_fp32_layers": cap, "rank_by": rank_by,
              "fp32_nodes": list(chosen), "metric": last.metric, "value": last.value, "drop_points": last.drop_points,
              "sqnr_db": _json_float(last.sqnr_db), "search_images": len(job.data.files), "final_all": final_all}
    final = write_quantized(job.cal, output_dir=out, devices=(job.device,), fp32_nodes=set(chosen),
                            model_name=job.model_name,
                            extra_meta={**(job.extra_meta or {}), "auto_mixed_precision": record})
    if not ok:
        trail.say(f"mixed precision [{job.device}]: {message}")
    return MixedResult(ok, tuple(chosen), trail.steps, cands, final.files, final, job.device, budget, min_sqnr, cap,
                       message, layers, rank_by, len(job.data.files), base_all, final_all)
