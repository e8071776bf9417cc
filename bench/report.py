"""``maceq report`` against its target: the command a user runs, timed beside onnxruntime's float model.

    python bench/report.py [--devices cpu,gpu,dsp] [--workers 1,2] [--executor local] [--images 91]
                           [--model ../shared/data/models/mobilenet_v2.onnx] [--calib ../shared/data/photos/calib]
                           [--eval ../shared/data/photos/eval] [--json out.json]

MobileNetV2 is quantized once per device (32 calibration photos, as bench/scaling.py does). Then ``maceq report``
runs once per worker count as a user runs it: a new process (imports, the float model, each device's evaluation,
the per-layer analysis of its sample, report.html and report.json), quiet, timed from its start to its exit, with
the CPU time it and its children took. The same images through onnxruntime's float model alone (decoding
included), timed in the same run, give the ratio. Every cell's report.json must equal the first cell's (the
report does not depend on the number of workers); a difference is an error.

Target: under 5 minutes for three devices on the 91 eval photos.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from maceq.app.pipeline import quantize
from maceq.calibrate.parallel import Executor
from maceq.datasets.images import ImageFolder
from maceq.datasets.preprocess import preprocess_from_args
from maceq.errors import MaceqError
from maceq.quant.config import QuantConfig
from maceq.runtime.devices import Device

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scaling import SHARED, float_seconds, repeated_folder  # noqa: E402

TARGET_S = 300.0


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _adopt_descendants() -> None:
    """Make this process the reaper of its orphaned descendants (Linux): the report's forkserver, whose children are
    the workers, outlives the report process by a moment, and only a process that waits for it counts its CPU time."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _reap(timeout_s: float = 10.0) -> None:
    """Wait (up to ``timeout_s``) for the adopted descendants, so that their CPU time is in RUSAGE_CHILDREN."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.05)


def run_report(ymls: list[str], images: Path, out: Path, workers: int, executor: str) -> dict:
    """One ``maceq report`` process: its wall and CPU seconds, and its report.json."""
    cmd = [sys.executable, "-m", "maceq.app.cli", "report", *ymls, "--images", str(images), "--preset", "imagenet",
           "-o", str(out), "-q", "--workers", str(workers), "--executor", executor]
    cpu0, t0 = _children_cpu(), time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    _reap()
    cpu = _children_cpu() - cpu0
    if done.returncode != 0:
        raise MaceqError(f"maceq report exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return {"workers": workers, "executor": executor, "seconds": wall, "cpu_seconds": cpu,
            "report": json.loads((out / "report.json").read_text())}


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(SHARED / "models" / "mobilenet_v2.onnx"))
    p.add_argument("--calib", default=str(SHARED / "photos" / "calib"))
    p.add_argument("--eval", default=str(SHARED / "photos" / "eval"))
    p.add_argument("--devices", default="cpu,gpu,dsp")
    p.add_argument("--workers", default="1", help="worker counts, one report each (e.g. 1,2)")
    p.add_argument("--executor", default="local", help="local or ray")
    p.add_argument("--images", type=int, default=None, help="repeat the eval photos up to this many images")
    p.add_argument("--json", help="also write the rows as JSON here")
    args = p.parse_args(argv)
    args.devices = [Device.parse(d.strip()).value for d in args.devices.split(",") if d.strip()]
    args.executor = Executor.parse(args.executor.strip()).value
    args.workers = [int(w) for w in args.workers.split(",") if w.strip()]
    if not args.devices or not args.workers or min(args.workers) < 1 or (args.images is not None and args.images < 1):
        raise MaceqError("--devices needs a device; --workers and --images take positive integers")
    for path in (args.model, args.calib, args.eval):
        if not Path(path).exists():
            raise MaceqError(f"{path}: not found")
    return args


def main(argv=None) -> int:
    try:
        args = _args(argv)
    except (MaceqError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    pre = preprocess_from_args("imagenet")
    warnings.simplefilter("ignore")
    _adopt_descendants()
    with tempfile.TemporaryDirectory(prefix="maceq-bench-report-") as tmp:
        res = quantize(args.model, args.calib, output_dir=Path(tmp) / "q", preprocess=pre,
                       config=QuantConfig(max_images=32), progress=False, devices=tuple(args.devices))
        files = {Device.parse(d).value: f for d, f in res.per_device.items()}
        ymls = [str(files[d].yml) for d in args.devices]
        folder = Path(args.eval) if args.images is None else repeated_folder(Path(args.eval), args.images,
                                                                            Path(tmp) / "images")
        data = ImageFolder(folder, pre, labels=None)
        t_float = float_seconds(args.model, data)
        print(f"{len(data)} images, {len(os.sched_getaffinity(0))} CPUs; onnxruntime float alone: {t_float:.1f} s",
              flush=True)
        rows = []
        for n in args.workers:
            row = run_report(ymls, folder, Path(tmp) / f"report-{n}", n, args.executor)
            if rows and row["report"] != rows[0]["report"]:
                raise MaceqError(f"report.json with {n} workers differs from the one with {rows[0]['workers']}")
            rows.append(row)
            print(f"  {n} worker(s): {row['seconds']:.1f} s wall, {row['cpu_seconds']:.1f} s CPU", flush=True)
    devices = ",".join(args.devices)
    print("\n| `maceq report` | workers | seconds | CPU seconds | x onnxruntime float | target |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        verdict = "met" if r["seconds"] < TARGET_S else "NOT met"
        print(f"| {devices}, {len(data)} images, {r['executor']} | {r['workers']} | {r['seconds']:.1f} | "
              f"{r['cpu_seconds']:.1f} | {r['seconds'] / t_float:.0f}x | < {TARGET_S:.0f} s ({verdict}) |")
    if len(rows) > 1:
        print(f"report.json equal for workers {', '.join(str(r['workers']) for r in rows)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"float_seconds": t_float, "images": len(data), "rows": [
            {k: v for k, v in r.items() if k != "report"} for r in rows]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
