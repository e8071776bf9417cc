"""Accuracy-recovery benchmark: one row per technique, per model and device, beside onnxruntime's quantizer.

    python bench/accuracy.py [--models mobilenet_v2,efficientnet_lite0,fmnist] [--devices cpu,dsp,gpu]
                             [--rows 0,4,ort] [--calib-images 64] [--json out.json]

maceq rows (0-4): each adds one technique to the row above (the last replaces mse ranges by consumer-chosen ones
and adds AdaRound and bias correction); the last one is ``--recipe accurate``.
Calibration runs once per row and model; the devices share it (bias correction is per device).

onnxruntime rows (5-8): ``onnxruntime.quantization.quantize_static`` on the same calibration images, read
through maceq's ``ImageFolder`` and preprocessing (so the inputs are identical), after ``quant_pre_process``;
QDQ format, uint8 activations, weights uint8 per tensor or int8 per channel, MinMax or Percentile 99.99
calibration. The quantized ONNX runs in onnxruntime's CPU execution provider (which fuses the QDQ pairs
into its integer kernels); it has no maceq device, so its cells sit in the ``onnxruntime`` column.

Every cell compares the int8 logits with the float model's (the source ONNX in onnxruntime) on the same
preprocessed images, with no fp32 exemption:

- top-1 agreement of int8 with float, in %, as ``maceq eval`` counts it;
- logits SQNR over all images, 10 log10(sum f^2 / sum (f - q)^2), in dB;
- the Fashion-MNIST model also: the accuracy drop in points on its 1000 labelled test images.

MobileNetV2 and EfficientNet-Lite0 are measured on ../shared/data/photos/eval (91 photos). maceq's int8
side runs image by image through the fixed-point runtime (``Model.run``), as ``maceq eval`` does.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory

import numpy as np

from maceq.app.pipeline import calibrate, recover_per_device, write_quantized
from maceq.calibrate.methods import RangeMethod
from maceq.calibrate.runner import BatchedSession, make_session
from maceq.datasets.images import ImageFolder
from maceq.datasets.labels import FASHION_MNIST_CLASSES
from maceq.datasets.preprocess import Preprocess, preprocess_from_args
from maceq.errors import MaceqError
from maceq.quant.config import QuantConfig
from maceq.quant.recipes import recipe_settings
from maceq.reports.evaluate import sqnr_db
from maceq.runtime import Model, load

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent.parent / "shared" / "data"
DEVICES = ("cpu", "dsp", "gpu")
ORT_COLUMN = "onnxruntime"
EVAL_BATCH = 16
#: error scales of the "scaled agreement" table (1 would be the cell itself)
ERROR_SCALES = (0.7, 0.5, 0.35, 0.25)


@dataclass(frozen=True)
class Case:
    onnx: Path
    preset: str
    calib: Path
    eval: Path
    labelled: bool  # True: also report the accuracy drop on the labels


CASES = {
    "mobilenet_v2": Case(SHARED / "models" / "mobilenet_v2.onnx", "imagenet", SHARED / "photos" / "calib",
                         SHARED / "photos" / "eval", False),
    "efficientnet_lite0": Case(SHARED / "models" / "efficientnet_lite0.onnx", "tf", SHARED / "photos" / "calib",
                               SHARED / "photos" / "eval", False),
    "fmnist": Case(SHARED / "models" / "fmnist_mobilenet.onnx", "fmnist", SHARED / "fashion_mnist" / "calib",
                   SHARED / "fashion_mnist" / "test", True),
}


@dataclass(frozen=True)
class Row:
    label: str
    maceq: dict | None = None  # QuantConfig fields of a maceq row
    ort: dict | None = None    # per_channel, weight_type, method of an onnxruntime row

    def config(self) -> dict:
        d = self.maceq if self.maceq is not None else self.ort
        return {k: getattr(v, "value", v) for k, v in d.items()}


_MSE = {"range_method": RangeMethod.MSE}
ROWS = [
    Row("baseline (percentile 99.99)", maceq={}),
    Row("+ mse ranges", maceq=_MSE),
    Row("+ cross-layer equalization", maceq={**_MSE, "cle": True}),
    Row("+ high-bias absorption", maceq={**_MSE, "cle": True, "high_bias_absorption": True}),
    Row("+ consumer ranges, AdaRound, bias correction (= accurate)", maceq=recipe_settings("accurate")),
    Row("onnxruntime quantize_static per-tensor",
        ort={"per_channel": False, "weight_type": "uint8", "method": "minmax"}),
    Row("onnxruntime quantize_static per-channel",
        ort={"per_channel": True, "weight_type": "int8", "method": "minmax"}),
    Row("onnxruntime quantize_static per-tensor, percentile 99.99",
        ort={"per_channel": False, "weight_type": "uint8", "method": "percentile"}),
    Row("onnxruntime quantize_static per-channel, percentile 99.99",
        ort={"per_channel": True, "weight_type": "int8", "method": "percentile"}),
]


@dataclass
class EvalSet:
    """The preprocessed eval images, their labels and the float model's logits, read once per model."""

    x: np.ndarray
    labels: np.ndarray | None
    f: np.ndarray  # float logits, [images, classes]
    skipped: int = 0
    float_accuracy: float | None = None


def load_eval(case: Case, pre: Preprocess) -> EvalSet:
    classes = list(FASHION_MNIST_CLASSES) if case.labelled else None
    data = ImageFolder(case.eval, pre, labels="auto" if case.labelled else None, classes=classes)
    sess = make_session(case.onnx)
    in_name = sess.get_inputs()[0].name
    runner = BatchedSession(sess, in_name)
    xs, labels, fs = [], [], []
    for batch in data.iter_batches(EVAL_BATCH):
        xs.append(batch.data.copy())
        fs.append(runner.run(None, {in_name: batch.data})[0].reshape(len(batch.data), -1))
        if batch.labels is not None:
            labels.append(batch.labels)
    f = np.concatenate(fs).astype(np.float64)
    lab = np.concatenate(labels) if case.labelled else None
    acc = None if lab is None else float(np.mean(f.argmax(1) == lab))
    return EvalSet(np.concatenate(xs), lab, f, data.skipped, acc)


def scores(ev: EvalSet, q: np.ndarray) -> dict:
    """Top-1 agreement (%), logits SQNR (dB) and, with labels, the accuracy drop (points) of logits ``q``."""
    q = np.asarray(q, dtype=np.float64).reshape(ev.f.shape)
    agree = ev.f.argmax(1) == q.argmax(1)  # first maximum on both sides, as maceq eval counts it
    out = {"agreement": round(100 * float(agree.mean()), 2),
           "sqnr_db": round(sqnr_db(float(np.sum(ev.f ** 2)), float(np.sum((ev.f - q) ** 2))), 2)}
    if ev.labels is not None:
        out["drop"] = round(100 * (ev.float_accuracy - float(np.mean(q.argmax(1) == ev.labels))), 2)
    # The agreement the same error would give at a higher SQNR: f + a (q - f) is a model whose error has the
    # direction of this one's, scaled by a (SQNR + 20 log10(1/a) dB). It tells how far an SQNR is from a target.
    top = ev.f.argmax(1)
    out["scaled_agreement"] = {str(a): round(100 * float(np.mean(top == (ev.f + a * (q - ev.f)).argmax(1))), 2)
                               for a in ERROR_SCALES}
    return out


def maceq_logits(model: Model, ev: EvalSet, device: str) -> np.ndarray:
    """The int8 logits of every eval image, one image per run (the input range is per tensor)."""
    in_name, out_name = model.input_names[0], model.output_names[0]
    return np.stack([model.run({in_name: ev.x[k:k + 1]}, device=device)[out_name].reshape(-1)
                     for k in range(len(ev.x))])


def run_maceq_row(case: Case, pre: Preprocess, ev: EvalSet, row: Row, devices: list[str], calib_images: int,
                  tmp: Path) -> dict:
    cfg = QuantConfig(max_images=calib_images, **row.maceq)
    t0 = time.perf_counter()
    cal = calibrate(case.onnx, case.calib, preprocess=pre, config=cfg, progress=False, devices=tuple(devices))
    recover_per_device(cal, tuple(devices), progress=False)  # AdaRound, bias correction: as the config says
    cells = {"calibration_s": round(time.perf_counter() - t0, 1)}
    print(f"    calibrated on {cal.n_images} images in {cells['calibration_s']:.0f} s", flush=True)
    for device in devices:
        t1 = time.perf_counter()
        res = write_quantized(cal, output_dir=tmp / device, devices=(device,))
        cell = scores(ev, maceq_logits(load(res.files.yml), ev, device))
        cell["seconds"] = round(time.perf_counter() - t1, 1)
        cells[device] = cell
        print(f"    {device:<4} {fmt_cell(cell)}  ({cell['seconds']:.0f} s)", flush=True)
    return cells


class _CalibReader:
    """onnxruntime CalibrationDataReader over maceq's calibration images (same files, same preprocessing)."""

    def __init__(self, data: ImageFolder, input_name: str, batch_size: int):
        self.data, self.input_name, self.batch_size = data, input_name, batch_size
        self.images = 0
        self._it = None

    def get_next(self):
        if self._it is None:
            self._it = self.data.iter_batches(self.batch_size)
        batch = next(self._it, None)
        if batch is None:
            return None
        self.images += len(batch.data)
        return {self.input_name: batch.data.copy()}

    def rewind(self):
        self._it = None
        self.images = 0


def ort_quantize(case: Case, pre: Preprocess, row: Row, calib_images: int, tmp: Path) -> tuple[Path, int]:
    """quant_pre_process + quantize_static of ``case.onnx`` into ``tmp``; returns the model and image count."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    prep = tmp / "preprocessed.onnx"
    if not prep.exists():
        quant_pre_process(str(case.onnx), str(prep))
    in_name = make_session(prep).get_inputs()[0].name
    data = ImageFolder(case.calib, pre, labels=None, limit=calib_images)
    reader = _CalibReader(data, in_name, QuantConfig().batch_size)
    percentile = row.ort["method"] == "percentile"
    out = tmp / f"quantized-{row.ort['weight_type']}-{row.ort['per_channel']}-{row.ort['method']}.onnx"
    with contextlib.redirect_stdout(io.StringIO()):  # the histogram calibrator prints its progress
        quantize_static(str(prep), str(out), reader, quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QUInt8,
                        weight_type=QuantType.QInt8 if row.ort["weight_type"] == "int8" else QuantType.QUInt8,
                        per_channel=row.ort["per_channel"],
                        calibrate_method=CalibrationMethod.Percentile if percentile else CalibrationMethod.MinMax,
                        extra_options={"CalibPercentile": 99.99} if percentile else None)
    return out, reader.images


def run_ort_row(case: Case, pre: Preprocess, ev: EvalSet, row: Row, calib_images: int, tmp: Path) -> dict:
    t0 = time.perf_counter()
    path, n = ort_quantize(case, pre, row, calib_images, tmp)
    cells = {"calibration_s": round(time.perf_counter() - t0, 1)}
    print(f"    quantized on {n} calibration images in {cells['calibration_s']:.0f} s", flush=True)
    t1 = time.perf_counter()
    sess = make_session(path)
    in_name = sess.get_inputs()[0].name
    runner = BatchedSession(sess, in_name)
    q = np.concatenate([runner.run(None, {in_name: ev.x[k:k + EVAL_BATCH]}, what="the onnxruntime int8 model")[0]
                        for k in range(0, len(ev.x), EVAL_BATCH)])
    cell = scores(ev, q)
    cell["seconds"] = round(time.perf_counter() - t1, 1)
    cells[ORT_COLUMN] = cell
    print(f"    {ORT_COLUMN} {fmt_cell(cell)}  ({cell['seconds']:.0f} s)", flush=True)
    return cells


def measure(name: str, case: Case, devices: list[str], calib_images: int, rows: list[tuple[int, Row]]) -> list[dict]:
    pre = preprocess_from_args(case.preset)
    ev = load_eval(case, pre)
    extra = "" if ev.float_accuracy is None else f", float accuracy {100 * ev.float_accuracy:.2f}%"
    print(f"{name}: {len(ev.x)} eval images ({ev.skipped} skipped){extra}", flush=True)
    out = []
    with TemporaryDirectory(prefix="maceq-bench-acc-") as tmp:
        for i, row in rows:
            print(f"  [{i}] {row.label}", flush=True)
            t0 = time.perf_counter()
            if row.maceq is not None:
                cells = run_maceq_row(case, pre, ev, row, devices, calib_images, Path(tmp) / f"row{i}")
            else:
                cells = run_ort_row(case, pre, ev, row, calib_images, Path(tmp))
            out.append({"model": name, "index": i, "row": row.label, "config": row.config(),
                        "float_accuracy": ev.float_accuracy, "images": len(ev.x), **cells,
                        "seconds": round(time.perf_counter() - t0, 1)})
    return out


def fmt_cell(cell: dict | None) -> str:
    if cell is None:
        return ""
    s = f"{cell['agreement']:.1f}% / {cell['sqnr_db']:.2f} dB"
    return s if "drop" not in cell else f"{cell['drop']:+.2f} pt, " + s


def print_scaled(table: list[dict], devices: list[str]) -> None:
    """Agreement of every maceq cell with its error scaled down (see ``scores``)."""
    print("\ntop-1 agreement if the same error were scaled by a (logits SQNR + 20 log10(1/a) dB):")
    print("| model | row | device | " + " | ".join(f"a = {a} (+{20 * np.log10(1 / a):.1f} dB)" for a in ERROR_SCALES)
          + " |")
    print("|---|---|---|" + "---|" * len(ERROR_SCALES))
    for r in table:
        for d in list(devices) + [ORT_COLUMN]:
            cell = r.get(d)
            if cell and "scaled_agreement" in cell:
                print(f"| {r['model']} | {r['index']} | {d} | "
                      + " | ".join(f"{cell['scaled_agreement'][str(a)]:.1f}%" for a in ERROR_SCALES) + " |")


def print_table(table: list[dict], devices: list[str]) -> None:
    cols = list(devices) + ([ORT_COLUMN] if any(ORT_COLUMN in r for r in table) else [])
    print("| model | row | " + " | ".join(cols) + " | wall s |")
    print("|---|---|" + "---|" * len(cols) + "---|")
    last = None
    for r in table:
        model = "" if r["model"] == last else r["model"]
        last = r["model"]
        print(f"| {model} | {r['index']}: {r['row']} | " + " | ".join(fmt_cell(r.get(c)) for c in cols)
              + f" | {r['seconds']:.0f} |")


def select_rows(spec: str | None) -> list[tuple[int, Row]]:
    """``--rows``: comma-separated indexes or case-insensitive parts of row labels ("ort" = onnxruntime rows)."""
    if not spec:
        return list(enumerate(ROWS))
    picked: list[int] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if part.isdigit():
            if int(part) >= len(ROWS):
                raise MaceqError(f"--rows: no row {part} (0-{len(ROWS) - 1})")
            hits = [int(part)]
        else:
            key = "onnxruntime" if part.lower() == "ort" else part.lower()
            hits = [i for i, r in enumerate(ROWS) if key in r.label.lower()]
            if not hits:
                raise MaceqError(f"--rows: no row label contains '{part}'")
        picked += [i for i in hits if i not in picked]
    return [(i, ROWS[i]) for i in sorted(picked)]


def parse_list(value: str, known, what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in known]
    if bad or not items:
        raise MaceqError(f"unknown {what} '{bad[0] if bad else value}' (known: {', '.join(known)})")
    return items


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    p.add_argument("--devices", default=",".join(DEVICES), help="comma-separated maceq devices (default cpu,dsp,gpu)")
    p.add_argument("--rows", help="comma-separated row indexes or parts of labels ('ort': the onnxruntime rows); "
                                  "rows: " + "; ".join(f"{i} {r.label}" for i, r in enumerate(ROWS)))
    p.add_argument("--calib-images", type=int, default=64, help="calibration images per model (default 64)")
    p.add_argument("--json", help="also write the table as JSON here")
    args = p.parse_args(argv)
    try:
        models = parse_list(args.models, CASES, "model")
        devices = parse_list(args.devices, DEVICES, "device")
        rows = select_rows(args.rows)
        if args.calib_images < 1:
            raise MaceqError(f"--calib-images must be positive, got {args.calib_images}")
    except MaceqError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("cells: top-1 agreement with float % / logits SQNR dB (fmnist first: accuracy drop, points)", flush=True)
    t0 = time.perf_counter()
    table = []
    logging.getLogger("onnxruntime").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m in models:
            table += measure(m, CASES[m], devices, args.calib_images, rows)
    print()
    print_table(table, devices)
    print_scaled(table, devices)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; --calib-images {args.calib_images}; {os.cpu_count()} CPUs")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
