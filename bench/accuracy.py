"""Accuracy-recovery benchmark: one row per technique added, per model and device.

    python bench/accuracy.py [--models mobilenet_v2,efficientnet_lite0,fmnist] [--devices cpu,dsp]
                             [--calib-images 64] [--json out.json]

Each row adds one technique to the row above (the last row is ``--recipe accurate``); each
cell is measured as ``maceq eval`` measures it, with no fp32 exemption:

- MobileNetV2 and EfficientNet-Lite0: top-1 agreement of the int8 model with the float model
  on ../shared/data/photos/eval (91 photos); the issue's target is >= 95% on cpu;
- the Fashion-MNIST model: accuracy drop in points on its 1000 test images; target <= 0.3.

Calibration runs once per row and model; the devices share it (bias correction is per device).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory

from maceq.calibrate.methods import RangeMethod
from maceq.datasets.images import ImageFolder
from maceq.datasets.labels import FASHION_MNIST_CLASSES
from maceq.datasets.preprocess import preprocess_from_args
from maceq.quant.config import QuantConfig
from maceq.app.pipeline import calibrate, correct_bias, write_quantized
from maceq.reports.evaluate import evaluate
from maceq.runtime import load

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent.parent / "shared" / "data"


@dataclass(frozen=True)
class Case:
    onnx: Path
    preset: str
    calib: Path
    eval: Path
    labelled: bool  # True: report the accuracy drop; False: top-1 agreement with float


CASES = {
    "mobilenet_v2": Case(SHARED / "models" / "mobilenet_v2.onnx", "imagenet", SHARED / "photos" / "calib",
                         SHARED / "photos" / "eval", False),
    "efficientnet_lite0": Case(SHARED / "models" / "efficientnet_lite0.onnx", "tf", SHARED / "photos" / "calib",
                               SHARED / "photos" / "eval", False),
    "fmnist": Case(SHARED / "models" / "fmnist_mobilenet.onnx", "fmnist", SHARED / "fashion_mnist" / "calib",
                   SHARED / "fashion_mnist" / "test", True),
}

#: (row label, QuantConfig fields); each row adds one technique to the one above.
ROWS = [
    ("baseline (percentile 99.99)", {}),
    ("+ mse ranges", {"range_method": RangeMethod.MSE}),
    ("+ cross-layer equalization", {"range_method": RangeMethod.MSE, "cle": True}),
    ("+ high-bias absorption", {"range_method": RangeMethod.MSE, "cle": True, "high_bias_absorption": True}),
    ("+ bias correction (= accurate)", {"range_method": RangeMethod.MSE, "cle": True, "high_bias_absorption": True,
                                         "bias_correction": True}),
]


def measure(name: str, case: Case, devices: list[str], calib_images: int, rows) -> list[dict]:
    pre = preprocess_from_args(case.preset)
    classes = list(FASHION_MNIST_CLASSES) if case.labelled else None
    data = ImageFolder(case.eval, pre, labels="auto" if case.labelled else None, classes=classes)
    out = []
    with TemporaryDirectory(prefix="maceq-bench-acc-") as tmp:
        for label, fields in rows:
            t0 = time.perf_counter()
            cfg = QuantConfig(max_images=calib_images, **fields)
            cal = calibrate(case.onnx, case.calib, preprocess=pre, config=cfg, progress=False)
            if cfg.bias_correction:
                correct_bias(cal, tuple(devices), progress=False)
            row = {"model": name, "row": label, "config": {k: getattr(v, "value", v) for k, v in fields.items()}}
            for device in devices:
                res = write_quantized(cal, output_dir=Path(tmp) / device, devices=(device,))
                r = evaluate(load(res.files.yml), case.onnx, data, device=device, progress=False)
                if case.labelled:
                    row[device] = round(100 * (r.float_accuracy - r.int8_accuracy), 2)
                else:
                    row[device] = round(100 * r.top1_agreement, 1)
            row["seconds"] = round(time.perf_counter() - t0, 1)
            out.append(row)
            cells = "  ".join(f"{d} {row[d]:6.2f}" for d in devices)
            print(f"{name:<19} {label:<32} {cells}   ({row['seconds']:.0f} s)", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    p.add_argument("--devices", default="cpu,dsp", help="comma-separated devices (default cpu,dsp)")
    p.add_argument("--calib-images", type=int, default=64, help="calibration images per model (default 64)")
    p.add_argument("--json", help="also write the table as JSON here")
    args = p.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in CASES]
    if unknown:
        print(f"error: unknown model '{unknown[0]}' (known: {', '.join(CASES)})", file=sys.stderr)
        return 2
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    print("cells: top-1 agreement with float in % (photos/eval); fmnist: accuracy drop in points (test set)")
    table = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m in models:
            table += measure(m, CASES[m], devices, args.calib_images, ROWS)
    print()
    print("| model | technique | " + " | ".join(devices) + " |")
    print("|---|---|" + "---|" * len(devices))
    for row in table:
        print(f"| {row['model']} | {row['row']} | " + " | ".join(f"{row[d]}" for d in devices) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
