"""Float vs int8 evaluation of a quantized model on an image folder.

The float reference is the source ONNX model in onnxruntime; the int8 side is
the fixed-point runtime. Images run one at a time through the runtime, because
the device's input Quantize op recomputes its range from each input tensor
(``find_range_every_time``), so a batch would change the arithmetic.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import uuid
import warnings
from dataclasses import asdict, dataclass, field

import numpy as np
from tqdm import tqdm

from maceq.calibrate.parallel import TaskPool, check_workers, shard_ranges
from maceq.calibrate.runner import BatchedSession, make_session
from maceq.datasets.images import ImageFolder, UnreadableImageWarning
from maceq.errors import MaceqError
from maceq.runtime import threads
from maceq.runtime.devices import Device
from maceq.runtime.model import Model


@dataclass
class EvalResult:
    device: str
    images: int
    skipped: int
    top1_agreement: float
    float_top1_in_int8_top5: float
    float_accuracy: float | None = None
    int8_accuracy: float | None = None
    #: Ops that run on a device path computing something other than the model means (op -> why); the
    #: int8 figures are what the device computes, these included.
    deviations: dict = field(default_factory=dict)
    #: Ops the writer rewrote into a form the device computes right (from the model's .yml).
    safe_forms: list = field(default_factory=list)
    #: Scores per image (the classes); top-5 containment is shown only above 5.
    classes: int = 0
    #: SQNR of the int8 output against the float output over all images, in dB
    sqnr_db: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        out = [f"device {self.device}: {self.images} images ({self.skipped} skipped)",
               f"  top-1 agreement float vs int8:  {100 * self.top1_agreement:6.2f}%"]
        if self.classes == 0 or self.classes > 5:
            out.append(f"  float top-1 in int8 top-5:      {100 * self.float_top1_in_int8_top5:6.2f}%")
        if self.sqnr_db is not None:
            out.append(f"  output SQNR float vs int8:      {self.sqnr_db:6.2f} dB")
        if self.float_accuracy is not None:
            out += [f"  float accuracy:                 {100 * self.float_accuracy:6.2f}%",
                    f"  int8 accuracy:                  {100 * self.int8_accuracy:6.2f}%",
                    f"  accuracy drop:                  {100 * (self.float_accuracy - self.int8_accuracy):6.2f} points"]
        return out + device_path_lines(self.deviations, self.safe_forms)


def device_path_lines(deviations: dict, safe_forms: list) -> list[str]:
    """What to tell a user about ops whose device path departs from the model, and about safe forms."""
    out = []
    if deviations:
        name, why = next(iter(deviations.items()))
        out.append(f"  warning: {len(deviations)} op(s) run on a device path that computes something other than "
                   f"the model means, and the simulation computes what the device does ({name}: {why}"
                   + (", ..." if len(deviations) > 1 else "") + "); quantize again without --no-safe-forms to "
                   "get a form the device computes right")
    if safe_forms:
        out.append(f"  {len(safe_forms)} op(s) were rewritten into a form the device computes right "
                   f"(explicit Pad before the depthwise convolution)")
    return out


@dataclass
class SegEvalResult:
    """Dense-output comparison: SQNR of the int8 map against float, and IoU of the thresholded masks."""

    device: str
    images: int
    skipped: int
    threshold: float
    sqnr_db: float          # over all pixels of all images: 10 log10(sum f^2 / sum (f - q)^2)
    mean_iou: float         # per-image IoU of (f > t) and (q > t), averaged
    global_iou: float       # total intersection / total union over all images
    min_iou: float

    def to_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        return [f"device {self.device}: {self.images} images ({self.skipped} skipped), segmentation",
                f"  output SQNR float vs int8:      {self.sqnr_db:6.2f} dB",
                f"  mask IoU at threshold {self.threshold:g}:     mean {self.mean_iou:.4f}, "
                f"global {self.global_iou:.4f}, worst {self.min_iou:.4f}"]


def sqnr_db(signal_power: float, noise_power: float) -> float:
    """10 log10(signal / noise); +inf for a perfect match."""
    if noise_power == 0.0:
        return float("inf")
    if signal_power == 0.0:
        return float("-inf")
    return float(10.0 * np.log10(signal_power / noise_power))


def evaluate_segmentation(model: Model, float_model: str | os.PathLike, data: ImageFolder, *,
                          device: str = "cpu", threshold: float = 0.3, progress: bool = True) -> SegEvalResult:
    in_name, out_name = model.input_names[0], model.output_names[0]
    sess = make_session(float_model, input_shape=model.input_shape(in_name), spin=False)
    f_in = sess.get_inputs()[0].name
    runner = BatchedSession(sess, f_in)
    names = [o.name for o in sess.get_outputs()]
    f_out = names.index(out_name) if out_name in names else 0
    sig = noise = 0.0
    inter_total = union_total = 0
    ious = []
    bar = tqdm(total=len(data), desc=f"eval {device}", unit="img", disable=not progress or not sys.stderr.isatty(),
               leave=False)
    for batch in data.iter_batches(1):
        f = runner.run(None, {f_in: batch.data})[f_out].astype(np.float64)
        q = model.run({in_name: batch.data}, device=device)[out_name].astype(np.float64)
        if f.shape != q.shape:
            raise MaceqError(f"{batch.paths[0]}: float output shape {f.shape} != int8 output shape {q.shape}")
        sig += float(np.sum(f * f))
        noise += float(np.sum((f - q) ** 2))
        fm, qm = f > threshold, q > threshold
        inter, union = int(np.count_nonzero(fm & qm)), int(np.count_nonzero(fm | qm))
        inter_total += inter
        union_total += union
        ious.append(1.0 if union == 0 else inter / union)
        bar.update(1)
    bar.close()
    if not ious:
        raise MaceqError(f"{data.root}: no readable image to evaluate")
    return SegEvalResult(device, len(ious), data.skipped, threshold, sqnr_db(sig, noise), float(np.mean(ious)),
                         1.0 if union_total == 0 else inter_total / union_total, float(np.min(ious)))


@dataclass
class _Tally:
    """Counts over images (additive: shards merge by summing them)."""

    images: int = 0
    agree: int = 0
    top5: int = 0
    f_correct: int = 0
    q_correct: int = 0
    skipped: int = 0
    classes: int = 0
    #: per image: sum f^2 and sum (f - q)^2 of the output; summed with math.fsum (correctly rounded,
    #: so the SQNR does not depend on how the images were sharded)
    signal: list = field(default_factory=list)
    noise: list = field(default_factory=list)

    def add(self, other: "_Tally") -> None:
        for name in ("images", "agree", "top5", "f_correct", "q_correct", "skipped"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.classes = max(self.classes, other.classes)
        self.signal += other.signal
        self.noise += other.noise

    def sqnr_db(self) -> float:
        return sqnr_db(math.fsum(self.signal), math.fsum(self.noise))


class _FloatModel:
    """The float model's session for models of one input shape, opened once and kept for every batch.

    The session's threads sleep as soon as a batch ends (``spin=False``): spinning, they took a core from the
    simulation's next runs (``maceq eval`` of MobileNetV2 on 91 photos, cpu, 2 vCPUs: 2.9-3.1 s, 2.3-2.6 s without).
    Where the simulation runs on one thread (a worker process, of which there is one per core, or a busy
    machine: runtime/threads.py), onnxruntime's float model does too (2 workers on 2 CPUs: 1.23x over one worker
    with its default pool, 1.47x with one thread)."""

    def __init__(self, float_model, input_shape) -> None:
        sess = make_session(float_model, input_shape=input_shape,
                            intra_op_threads=1 if threads.current() == 1 else None, spin=False)
        self.input = sess.get_inputs()[0].name
        self.outputs = [o.name for o in sess.get_outputs()]
        self.runner = BatchedSession(sess, self.input)

    def logits(self, batch, outputs) -> list[np.ndarray]:
        """The float outputs named ``outputs`` (the first where a name is not the float model's) per image."""
        f_all = self.runner.run(None, {self.input: batch.data})
        return [f_all[self.outputs.index(o) if o in self.outputs else 0].reshape(len(batch.data), -1)
                for o in outputs]


def _tally(models: dict[str, Model], floats: _FloatModel, data: ImageFolder, *, batch_size: int, report) -> dict:
    """Per device (``models``: device -> its model of one float model), the top-1 agreement, top-5 containment and
    label hits of ``data``, image by image: each batch decoded and run through the float model once for them all."""
    tallies = {d: _Tally() for d in models}
    for batch in data.iter_batches(batch_size):
        f_all = floats.logits(batch, [m.output_names[0] for m in models.values()])
        for (d, model), f_logits in zip(models.items(), f_all):
            _count(tallies[d], model, d, f_logits, batch)
        if report is not None:
            report(len(batch.data))
    for t in tallies.values():
        t.skipped = data.skipped
    return tallies


def _count(t: _Tally, model: Model, device: str, f_logits: np.ndarray, batch) -> None:
    """Add one batch's images to ``t``: the model's outputs on ``device`` against the float logits."""
    in_name, out_name = model.input_names[0], model.output_names[0]
    t.classes = int(f_logits.shape[1])
    for k in range(len(batch.data)):
        q_logits = model.run({in_name: batch.data[k:k + 1]}, device=device)[out_name].reshape(-1)
        f_top = int(np.argmax(f_logits[k]))
        q_order = np.argsort(-q_logits, kind="stable")
        f64, q64 = f_logits[k].astype(np.float64), q_logits.astype(np.float64)
        t.signal.append(float(np.sum(f64 * f64)))
        t.noise.append(float(np.sum((f64 - q64) ** 2)))
        t.agree += int(q_order[0] == f_top)
        t.top5 += int(f_top in q_order[:5])
        if batch.labels is not None:
            t.f_correct += int(f_top == batch.labels[k])
            t.q_correct += int(q_order[0] == batch.labels[k])
        t.images += 1


#: Shards per worker: the images go to the pool in about this many pieces of whole batches per worker, so that a
#: worker that starts late or runs slowly takes fewer of them. A worker keeps its models and float sessions from one
#: shard to the next (:func:`_worker_models`).
SHARDS_PER_WORKER = 4


@dataclass(frozen=True)
class _EvalJob:
    """What each evaluation shard needs: each device's quantized model as read, the float model. ``token`` names the
    job, so that a worker knows its models from an earlier shard (Ray hands each task its own copy of the job)."""

    loaded: tuple  # (device, Model.loaded) pairs
    float_model: str
    batch_size: int
    token: str = field(default_factory=lambda: uuid.uuid4().hex)


def eval_job(models: dict[str, Model], float_model: str | os.PathLike, batch_size: int) -> _EvalJob:
    """The shared job of a worker pool that evaluates (and analyses) these devices' models: the models as read, the
    float model's path."""
    return _EvalJob(tuple((Device.parse(d).value, m.loaded) for d, m in models.items()), os.fspath(float_model),
                    batch_size)


#: This worker's models and float sessions for the job it last ran: (token, {device: Model}, {shape: _FloatModel}).
_WORKER_JOB: list = []


def _worker_models(job: _EvalJob, devices) -> tuple[dict[str, Model], _FloatModel]:
    """The job's models for ``devices`` and their float session, made on this worker's first shard of the job and
    kept (a model keeps its prepared plan, so later shards start at full speed); another job's are dropped."""
    if not _WORKER_JOB or _WORKER_JOB[0] != job.token:
        _WORKER_JOB[:] = [job.token, {d: Model(loaded) for d, loaded in job.loaded}, {}]
    _, models, floats = _WORKER_JOB
    chosen = {d: models[d] for d in devices}
    first = next(iter(chosen.values()))
    shape = tuple(first.input_shape(first.input_names[0]))
    if shape not in floats:
        floats[shape] = _FloatModel(job.float_model, shape)
    return chosen, floats[shape]


def _eval_shard(job: _EvalJob, item: tuple, report) -> dict:
    """One shard of whole batches for some of the job's devices (``item``: (devices, shard)), in a worker process or
    Ray task: its tally per device."""
    devices, shard = item
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnreadableImageWarning)
        try:
            models, floats = _worker_models(job, devices)
            return _tally(models, floats, shard, batch_size=job.batch_size, report=report)
        except MaceqError:
            if shard.skipped != len(shard.files):
                raise
            return {d: _Tally(skipped=shard.skipped) for d in devices}  # no readable image in this shard


def evaluate(model: Model, float_model: str | os.PathLike, data: ImageFolder, *, device: str = "cpu",
             batch_size: int = 16, progress: bool = True, workers: int = 1, executor: str = "local",
             ray_address: str | None = None) -> EvalResult:
    """Float vs int8 top-1 agreement (and accuracy with labels) on ``data``, image by image.

    ``workers`` > 1 shards the images in whole batches over local processes or Ray tasks
    (``executor``); the counts are summed, so the result does not depend on ``workers``."""
    return evaluate_many({device: model}, float_model, data, batch_size=batch_size, progress=progress,
                         workers=workers, executor=executor, ray_address=ray_address)[device]


def evaluate_many(models: dict[str, Model], float_model: str | os.PathLike, data: ImageFolder, *,
                  batch_size: int = 16, progress: bool = True, workers: int = 1, executor: str = "local",
                  ray_address: str | None = None, pool: TaskPool | None = None) -> dict[str, EvalResult]:
    """:func:`evaluate` for several devices' models of one float model (device -> model), in one pass: each image
    is read and run through the float model once, and with ``workers`` > 1 one pool of workers evaluates every
    device's shards (each worker starts once). Each device's result equals its own :func:`evaluate`.
    ``pool``: a pool of ``workers`` workers whose job is :func:`eval_job` of these models or more (the report's,
    which then analyses the layers on the same workers); None: one made here."""
    if not models or len({Device.parse(d) for d in models}) != len(models):
        raise MaceqError(f"evaluate: give one model per device, got {', '.join(map(str, models)) or 'none'}")
    shapes = {tuple(m.input_shape(m.input_names[0])) for m in models.values()}
    if len(shapes) > 1:  # models of different input shapes: one pass each
        return {d: evaluate(m, float_model, data, device=d, batch_size=batch_size, progress=progress,
                            workers=workers, executor=executor, ray_address=ray_address) for d, m in models.items()}
    names = ", ".join(str(d) for d in models)
    bar = tqdm(total=len(data), desc=f"eval {names}", unit="img", disable=not progress or not sys.stderr.isatty(),
               leave=False)
    with bar:
        if check_workers(workers) == 1:
            tallies = _tally(dict(models), _FloatModel(float_model, next(iter(shapes))), data, batch_size=batch_size,
                             report=bar.update)
        else:
            tallies = {d: _Tally() for d in models}
            keys = dict(zip((Device.parse(d).value for d in models), models))
            items = [(tuple(keys), data.shard(a, b))
                     for a, b in shard_ranges(len(data), batch_size=batch_size, shards=workers * SHARDS_PER_WORKER)]
            with contextlib.ExitStack() as stack:
                if pool is None:
                    pool = stack.enter_context(TaskPool(eval_job(models, float_model, batch_size), executor=executor,
                                                        workers=workers, ray_address=ray_address, progress_queue=True))
                for part in pool.map(_eval_shard, items, on_progress=bar.update):
                    for d, t in part.items():
                        tallies[keys[d]].add(t)
    return {d: _result(models[d], d, tallies[d], data) for d in models}


def _result(model: Model, device: str, t: _Tally, data: ImageFolder) -> EvalResult:
    if t.images == 0:
        raise MaceqError(f"{data.root}: no readable image to evaluate")
    labels = data.labels is not None
    return EvalResult(device, t.images, t.skipped, t.agree / t.images, t.top5 / t.images,
                      t.f_correct / t.images if labels else None, t.q_correct / t.images if labels else None,
                      deviations=model.deviations(device),
                      safe_forms=list(model.maceq_meta.get("safe_forms") or []), classes=t.classes,
                      sqnr_db=t.sqnr_db())
