"""Automatic mixed precision: keep the fewest layers in float32 that bring int8 within a budget.

The search (:func:`auto_mixed_precision`), from one calibration:

1. Write the all-int8 model and measure each quantized layer's *isolated* error on the
   evaluation images (:func:`maceq.reports.analysis.analyze_layers`, mode ``isolated``: only
   that layer quantized). A layer's sensitivity is its isolated SQNR in dB; lower is worse.
2. Order the candidate layers (source-graph nodes of uint8 ops): first those whose isolated
   SQNR is below ``min_sqnr`` (a floor: they are exempted whatever the metric says), then the
   rest; each group by ascending SQNR, ties broken by node name (so the order, and the whole
   search, is deterministic for a given input).
3. Measure the metric of the all-int8 model. Then, while the floor is not cleared or the drop
   exceeds the budget, exempt the next layer (``write_quantized(cal, fp32_nodes=...)``
   rebuilds the model from the same ranges, no image is run again) and measure again.
4. Stop when the floor is cleared and the drop is within the budget (``ok``), or when
   ``max_fp32_layers`` exemptions or the candidates are exhausted first (``ok`` is False and
   ``message`` says why; the CLI exits non-zero).

The metric (:func:`maceq.reports.evaluate.evaluate`, float = the source ONNX in onnxruntime):
with labels, the accuracy drop ``100 * (float_acc - int8_acc)`` points; without, the top-1
disagreement ``100 * (1 - agreement)`` points (agreement with float is 100% at best). The
budget holds when ``drop <= budget_points``.

Parallel candidate evaluations (``executor="ray"``, or ``"local"`` with ``workers > 1``): the
model measured after ``k`` exemptions keeps exactly the first ``k`` ranked candidates in float32,
so every model the search may need is known once the ranking is. The search therefore measures
them speculatively in waves of ``workers`` (``k+1 .. k+workers``, up to the cap) as Ray tasks or
local processes (:class:`maceq.calibrate.parallel.TaskPool`), then walks the results with the
same stopping rule as the sequential search; results past the stop are discarded (at most
``workers - 1`` wasted evaluations). Each task writes its model into a temporary folder of its
own, loads it and evaluates it exactly as step 3 does, so the trail, the chosen layers and the
written model equal the sequential search's (tests/test_parallel.py). The baseline and the
isolated analysis run in this process, once.

Every step is recorded (:class:`Step`): the layer exempted, its sensitivity, the metric, and
the bytes of the written ``.data`` file, so the trade-off (metric vs fp32 layers vs size) can go
into report.json.
"""
from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from maceq.calibrate.parallel import Executor, TaskPool, check_workers
from maceq.datasets.images import ImageFolder
from maceq.errors import MaceqError
from maceq.quant.export import write_quantized
from maceq.reports.analysis import analyze_layers
from maceq.reports.evaluate import evaluate
from maceq.runtime.model import load
from maceq.runtime.devices import Device

#: Slack when comparing a drop with the budget (both are in points; drops are multiples of 100/N).
BUDGET_EPS = 1e-9


@dataclass(frozen=True)
class Candidate:
    """A layer the search may keep in float32: its source node and isolated sensitivity."""

    node: str
    op_type: str
    sqnr_db: float          # isolated SQNR (dB); lower = more damaging
    below_floor: bool       # isolated SQNR under min_sqnr

    def to_dict(self) -> dict:
        return {"node": self.node, "op_type": self.op_type, "sqnr_db": _json_float(self.sqnr_db),
                "below_floor": self.below_floor}


@dataclass(frozen=True)
class Step:
    """One measured model of the search: step 0 is all int8; step k exempts one more layer."""

    step: int
    exempted: str | None        # the node added to the fp32 set at this step (None at step 0)
    sensitivity_db: float | None  # its isolated SQNR
    reason: str                 # "baseline" | "below_min_sqnr" | "budget"
    fp32_nodes: tuple[str, ...]  # all nodes in float32 (auto and manual), sorted
    n_fp32: int                 # len(fp32_nodes): the config's fp32_layers count too
    metric: str                 # "top1_agreement" | "accuracy"
    value: float                # the metric in percent (int8)
    float_value: float          # the float reference in percent (100 for agreement)
    drop_points: float
    data_bytes: int             # size of the written .data file
    within_budget: bool

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["fp32_nodes"] = list(self.fp32_nodes)
        d["sensitivity_db"] = None if self.sensitivity_db is None else _json_float(self.sensitivity_db)
        return d


@dataclass
class MixedResult:
    """The outcome: ``ok`` (budget and floor met), the fp32 nodes chosen, the trail, the files."""

    ok: bool
    fp32_nodes: tuple[str, ...]      # the nodes the search exempted, in exemption order
    trail: list[Step]
    candidates: list[Candidate]      # the ranking the search followed
    files: object                    # ModelFiles of the final model (written to output_dir)
    result: object                   # its QuantizeResult
    device: str
    budget_points: float
    min_sqnr: float | None
    max_fp32_layers: int | None
    message: str = ""
    layers: list = field(default_factory=list)  # LayerError of the all-int8 model (isolated)

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
                "max_fp32_layers": self.max_fp32_layers, "fp32_nodes": list(self.fp32_nodes),
                "trail": [s.to_dict() for s in self.trail], "tradeoff": self.tradeoff,
                "candidates": [c.to_dict() for c in self.candidates],
                "layers": [L.to_dict() for L in self.layers]}


def _json_float(v: float):
    return v if math.isfinite(v) else ("inf" if v > 0 else "-inf")


def rank_candidates(layers, *, min_sqnr: float | None, exclude=frozenset()) -> list[Candidate]:
    """Search order from an isolated analysis: below-floor layers first, then the rest, each by
    ascending isolated SQNR with the node name as tie-break. One entry per node (its worst op)."""
    worst: dict[str, Candidate] = {}
    for L in layers:
        if L.node is None or L.node in exclude or L.isolated is None:
            continue
        s = float(L.isolated.sqnr_db)
        c = Candidate(L.node, L.op_type, s, min_sqnr is not None and s < min_sqnr)
        if L.node not in worst or s < worst[L.node].sqnr_db:
            worst[L.node] = c
    return sorted(worst.values(), key=lambda c: (not c.below_floor, c.sqnr_db, c.node))


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


def _measure(cal, fp32: list[str], *, out_dir: Path, device: str, data: ImageFolder, batch_size: int,
             model_name: str | None, extra_meta: dict | None):
    """Write the model with ``fp32`` kept in float32, load it and evaluate it."""

    res = write_quantized(cal, output_dir=out_dir, devices=(device,), fp32_nodes=set(fp32), model_name=model_name,
                          extra_meta=extra_meta)
    model = load(res.files.yml)
    ev = evaluate(model, cal.onnx_path, data, device=device, batch_size=batch_size, progress=False)
    if ev.float_accuracy is not None:
        metric, value, ref = "accuracy", 100.0 * ev.int8_accuracy, 100.0 * ev.float_accuracy
    else:
        metric, value, ref = "top1_agreement", 100.0 * ev.top1_agreement, 100.0
    return res, model, metric, value, ref, os.path.getsize(res.files.data)


@dataclass(frozen=True)
class _EvalJob:
    """What each parallel candidate evaluation needs, shipped once per worker."""

    cal: object
    data: ImageFolder
    device: str
    batch_size: int
    model_name: str | None
    extra_meta: dict | None


def _measure_task(job: _EvalJob, fp32: tuple[str, ...], report=None) -> tuple:
    """:func:`_measure` in a worker process or Ray task, in a temporary folder of its own:
    ``(sorted fp32 nodes, metric, value, float value, .data bytes)``."""
    tmp = Path(tempfile.mkdtemp(prefix="maceq-search-"))
    try:
        res, _, metric, value, ref, nbytes = _measure(
            job.cal, list(fp32), out_dir=tmp, device=job.device, data=job.data, batch_size=job.batch_size,
            model_name=job.model_name, extra_meta=job.extra_meta)
        return tuple(sorted(res.fp32)), metric, value, ref, nbytes
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def auto_mixed_precision(cal, *, output_dir: str | os.PathLike, eval_data: ImageFolder, budget_points: float,
                         min_sqnr: float | None = None, max_fp32_layers: int | None = None, device: str = "cpu",
                         model_name: str | None = None, extra_meta: dict | None = None, batch_size: int = 8,
                         progress: bool = True, executor: str = "local", workers: int = 1,
                         ray_address: str | None = None) -> MixedResult:
    """Greedy search for the fp32 layers that bring ``device``'s int8 model within ``budget_points``.

    ``cal``: a :class:`maceq.app.pipeline.Calibration`. ``eval_data``: the images the metric
    and the sensitivities are measured on (an eval folder, or :func:`holdout_split` of the
    calibration folder). The final model is written to ``output_dir``; the intermediate models
    of the search go to a scratch folder inside it, removed at the end. See the module docstring.

    ``executor`` ("local" | "ray"), ``workers``, ``ray_address``: where the candidate models are
    measured; "local" with ``workers == 1`` (the default) measures them one after another in this
    process, anything else in parallel waves (module docstring), with identical results.
    """

    device = Device.parse(device).value
    budget = float(budget_points)
    if not math.isfinite(budget) or budget < 0:
        raise MaceqError(f"--accuracy-budget must be a number of points >= 0, got {budget_points!r}")
    if max_fp32_layers is not None and (isinstance(max_fp32_layers, bool) or not isinstance(max_fp32_layers, int)
                                        or max_fp32_layers < 0):
        raise MaceqError(f"--max-fp32-layers must be an int >= 0, got {max_fp32_layers!r}")
    if min_sqnr is not None and not math.isfinite(float(min_sqnr)):
        raise MaceqError(f"--min-sqnr must be a number of dB, got {min_sqnr!r}")
    executor = Executor.parse(executor)
    workers = check_workers(workers)
    parallel = executor is Executor.RAY or workers > 1
    out = Path(output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MaceqError(f"{out}: cannot create the output folder ({e.strerror})") from None
    scratch = Path(tempfile.mkdtemp(prefix=".maceq-search-", dir=out))
    try:
        pool = None
        if parallel:
            pool = TaskPool(_EvalJob(cal, eval_data, device, batch_size, model_name, extra_meta),
                            executor=executor, workers=workers, ray_address=ray_address)
        try:
            return _search(cal, out=out, scratch=scratch, data=eval_data, budget=budget, min_sqnr=min_sqnr,
                           cap=max_fp32_layers, device=device, model_name=model_name, extra_meta=extra_meta,
                           batch_size=batch_size, progress=progress, analyze=analyze_layers, pool=pool)
        finally:
            if pool is not None:
                pool.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _search(cal, *, out, scratch, data, budget, min_sqnr, cap, device, model_name, extra_meta, batch_size,
            progress, analyze, pool=None) -> MixedResult:
    def say(line: str) -> None:
        if progress:
            print(line, file=sys.stderr)

    chosen: list[str] = []
    trail: list[Step] = []

    def record(step, exempted, sens, reason, measured):
        fp32_sorted, metric, value, ref, nbytes = measured
        drop = ref - value
        s = Step(step, exempted, sens, reason, fp32_sorted, len(fp32_sorted), metric, value, ref, drop,
                 nbytes, drop <= budget + BUDGET_EPS)
        trail.append(s)
        say(f"mixed precision [{device}] step {step}: {len(fp32_sorted)} fp32 layer(s)"
            + (f", +{exempted} ({sens:.2f} dB)" if exempted else "")
            + f": {metric} {value:.2f}% (drop {drop:.2f} points, budget {budget:g})")

    def measure_here(step):
        res, model, metric, value, ref, nbytes = _measure(
            cal, chosen, out_dir=scratch / f"step{step}", device=device, data=data, batch_size=batch_size,
            model_name=model_name, extra_meta=extra_meta)
        return res, model, (tuple(sorted(res.fp32)), metric, value, ref, nbytes)

    res0, model0, m0 = measure_here(0)
    record(0, None, None, "baseline", m0)
    layers = analyze(model0, cal.graph, data, device=device, modes=("isolated",), progress=progress)
    cands = rank_candidates(layers, min_sqnr=min_sqnr, exclude=res0.fp32)
    limit = len(cands) if cap is None else min(cap, len(cands))
    ahead: dict[int, tuple] = {}  # parallel: exemption count -> measurement of the first n candidates

    def measurement(n: int) -> tuple:
        """The model with ``chosen == [c.node for c in cands[:n]]`` measured (here, or in a wave)."""
        if pool is None:
            return measure_here(n)[2]
        if n not in ahead:
            wave = range(n, min(n + pool.workers, limit + 1))
            got = pool.map(_measure_task, [tuple(c.node for c in cands[:m]) for m in wave])
            ahead.update(zip(wave, got))
        return ahead.pop(n)

    message = ""
    k = 0
    while True:
        last = trail[-1]
        floor_left = [c for c in cands[k:] if c.below_floor]
        if last.within_budget and not floor_left:
            ok = True
            break
        if cap is not None and len(chosen) >= cap:
            ok = False
            why = (f"{len(floor_left)} layer(s) below --min-sqnr {min_sqnr:g} dB still int8" if floor_left
                   else f"drop {last.drop_points:.2f} points > budget {budget:g}")
            message = f"--max-fp32-layers {cap} reached with {why}"
            break
        if k >= len(cands):
            ok = False
            message = f"every candidate layer is float32 and the drop is {last.drop_points:.2f} points > budget {budget:g}"
            break
        c = cands[k]
        k += 1
        chosen.append(c.node)
        record(len(trail), c.node, c.sqnr_db, "below_min_sqnr" if c.below_floor else "budget", measurement(k))

    last = trail[-1]
    record = {"ok": ok, "budget_points": budget, "min_sqnr": min_sqnr, "max_fp32_layers": cap,
              "fp32_nodes": list(chosen), "metric": last.metric, "value": last.value, "drop_points": last.drop_points,
              "eval_images": len(data.files)}
    final = write_quantized(cal, output_dir=out, devices=(device,), fp32_nodes=set(chosen), model_name=model_name,
                            extra_meta={**(extra_meta or {}), "auto_mixed_precision": record})
    if not ok:
        say(f"mixed precision [{device}]: {message}")
    return MixedResult(ok, tuple(chosen), trail, cands, final.files, final, device, budget, min_sqnr, cap,
                       message, layers)
