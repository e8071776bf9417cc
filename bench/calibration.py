"""Calibration benchmark: throughput and peak memory of maceq against onnxruntime's calibrators.

    python bench/calibration.py [--model ../shared/data/models/mobilenet_v2.onnx]
                                [--images ../shared/data/photos/calib] [--counts 32,128,512]

For each image count (the photos are repeated, through symlinks in a scratch folder, when there
are fewer) and each configuration, one fresh Python process calibrates MobileNetV2 and reports
its wall time; this process polls the resident memory of that process and all its descendants
(psutil, every 20 ms) and keeps the peak of the sum. The configurations:

* maceq ``min_max`` and ``percentile``, with 1 worker (in-process ``collect``) and 2 workers
  (``collect_parallel``, local processes);
* onnxruntime's ``MinMax`` and ``Percentile`` calibrators
  (``onnxruntime.quantization.calibrate.create_calibrator``, its defaults: Percentile is
  symmetric, on a 2048-bin ``|x|`` histogram; percentile 99.99 as maceq's), observing the
  tensors onnxruntime selects (the float inputs and outputs of every node: on MobileNetV2 171,
  of which 70 are scalar Constant outputs and 35 the pre-activation Conv outputs of fused
  Conv+Clip pairs), and again restricted to the 65 tensors maceq observes (``[maceq's]``: the
  same calibrator classes with their tensor selection intersected with maceq's).

Every configuration calibrates the same float graph: maceq's optimised graph (BatchNorm folded,
activations fused), written to an ONNX file once; maceq observes the tensors that get a scale,
onnxruntime the float inputs and outputs of every node. Both decode and preprocess the same
images (ImageFolder, imagenet preset, batches of 8): onnxruntime through a
CalibrationDataReader. The timed span starts after imports, with the ONNX file on disk, and ends
with a range per tensor: session set-up, worker start-up, decoding, inference, statistics and
the range computation are all inside it. onnxruntime's calibrators keep every output of one
``collect_data`` call in memory (28 MB per MobileNetV2 image for the histogram calibrators), so
``collect_data`` is called once per 32 images, which its API allows (histograms and ranges are
merged across calls), and which keeps its memory bounded too.

Printed: a table of images/s and peak RSS per configuration and image count, then the ratios
the targets name: maceq's peak RSS at the largest count over the smallest (target <= 1.10), and
maceq percentile's throughput over onnxruntime Percentile's (target >= 3).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent.parent / "shared" / "data"
BATCH = 8
ORT_CHUNK = 32
PERCENTILE = 99.99
CONFIGS = [
    ("maceq", "min_max", 1), ("maceq", "min_max", 2),
    ("maceq", "percentile", 1), ("maceq", "percentile", 2),
    ("onnxruntime", "MinMax", 1), ("onnxruntime", "Percentile", 1),
    ("onnxruntime-same", "MinMax", 1), ("onnxruntime-same", "Percentile", 1),
]


# ------------------------------------------------------------------------------------------------
# The child: one configuration, timed
# ------------------------------------------------------------------------------------------------

def _child(args) -> None:
    from maceq.datasets.images import ImageFolder
    from maceq.datasets.preprocess import PRESETS

    data = ImageFolder(args.folder, PRESETS["imagenet"], labels=None)
    if args.tool == "maceq":
        import onnx

        from maceq.calibrate.methods import RangeMethod, compute_range
        from maceq.calibrate.parallel import collect_parallel

        with open(args.names) as f:
            names = json.load(f)
        t0 = time.perf_counter()
        stats = collect_parallel(onnx.load(args.model), names, data, workers=args.workers, batch_size=BATCH,
                                 input_name=args.input, progress=False)
        method = RangeMethod(args.method)
        ranges = {n: compute_range(stats[n], method, percentile=PERCENTILE) for n in names}
        seconds = time.perf_counter() - t0
        n_tensors = len(ranges)
    else:
        import contextlib

        from onnxruntime.quantization.calibrate import CalibrationDataReader, CalibrationMethod, create_calibrator

        class Reader(CalibrationDataReader):
            def __init__(self, batches):
                self.batches = batches

            def get_next(self):
                b = next(self.batches, None)
                return None if b is None else {args.input: b.data}

        method = CalibrationMethod[args.method]
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
            augmented = str(Path(tmp) / "augmented.onnx")
            if args.tool == "onnxruntime":
                extra = {"percentile": PERCENTILE} if method is CalibrationMethod.Percentile else {}
                cal = create_calibrator(args.model, augmented_model_path=augmented, calibrate_method=method,
                                        extra_options=extra)
            else:  # the same calibrator, restricted to the tensors maceq observes
                cal = _same_tensors_calibrator(args, method, augmented)
            cal.set_execution_providers(["CPUExecutionProvider"])
            batches = data.iter_batches(BATCH)
            chunk = ORT_CHUNK // BATCH
            while True:  # collect_data once per ORT_CHUNK images
                part = [b for _, b in zip(range(chunk), batches)]
                if not part:
                    break
                cal.collect_data(Reader(iter(part)))
                del part
            ranges = cal.compute_data()
        seconds = time.perf_counter() - t0
        n_tensors = len(ranges.data)
    with open(args.result, "w") as f:
        json.dump({"seconds": seconds, "images": len(data.files) - data.skipped, "tensors": n_tensors}, f)


def _same_tensors_calibrator(args, method, augmented: str):
    """onnxruntime's calibrator with create_calibrator's settings for ``method``, observing only
    maceq's tensors (its tensor selection intersected with them)."""
    from onnxruntime.quantization.calibrate import CalibrationMethod, MinMaxCalibrater, PercentileCalibrater

    with open(args.names) as f:
        wanted = set(json.load(f))
    base = MinMaxCalibrater if method is CalibrationMethod.MinMax else PercentileCalibrater

    class Same(base):
        def select_tensors_to_calibrate(self, model):
            tensors, value_infos = super().select_tensors_to_calibrate(model)
            return tensors & wanted, value_infos

    if method is CalibrationMethod.MinMax:
        cal = Same(args.model, None, augmented, symmetric=False)
    else:  # create_calibrator's Percentile defaults: symmetric, 2048 bins
        cal = Same(args.model, None, augmented, symmetric=True, num_bins=2048, percentile=PERCENTILE)
    cal.augment_graph()
    cal.create_inference_session()
    return cal


# ------------------------------------------------------------------------------------------------
# The parent: folders, processes, memory polling, the table
# ------------------------------------------------------------------------------------------------

def _tree_rss(proc) -> int:
    import psutil

    total = 0
    try:
        procs = [proc] + proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def measure(cmd: list[str], result: Path) -> dict:
    import psutil

    p = subprocess.Popen(cmd)
    proc = psutil.Process(p.pid)
    peak = 0
    while p.poll() is None:
        peak = max(peak, _tree_rss(proc))
        time.sleep(0.02)
    if p.returncode != 0:
        raise SystemExit(f"benchmark child failed ({p.returncode}): {' '.join(cmd)}")
    out = json.loads(result.read_text())
    out["peak_rss"] = peak
    return out


def make_folder(src: Path, n: int, dest: Path) -> Path:
    """``n`` images: the sorted photos of ``src`` repeated, as symlinks ``0000_<name>`` ..."""
    from maceq.datasets.images import iter_image_files

    photos = iter_image_files(src)
    dest.mkdir(parents=True)
    for i in range(n):
        p = photos[i % len(photos)]
        os.symlink(p.resolve(), dest / f"{i:04d}_{p.name}")
    return dest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(SHARED / "models" / "mobilenet_v2.onnx"))
    p.add_argument("--images", default=str(SHARED / "photos" / "calib"))
    p.add_argument("--counts", default="32,128,512", help="image counts, comma-separated")
    p.add_argument("--json", help="also write the measurements to this JSON file")
    # child mode (internal)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for a in ("--tool", "--method", "--folder", "--names", "--input", "--result"):
        p.add_argument(a, help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args)
        return 0

    from maceq.datasets.preprocess import PRESETS
    from maceq.quant.prepare import prepare_graph, tensors_to_calibrate

    counts = [int(c) for c in args.counts.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="maceq-bench-") as tmp:
        tmp = Path(tmp)
        opt, _, _ = prepare_graph(args.model, input_shape=None, preprocess=PRESETS["imagenet"])
        model = tmp / "optimised.onnx"
        model.write_bytes(opt.to_onnx().SerializeToString())
        names = tmp / "names.json"
        names.write_text(json.dumps(tensors_to_calibrate(opt)))
        cpus = os.cpu_count()
        print(f"model {args.model} (maceq's optimised graph), images from {args.images}, batch {BATCH}, "
              f"{cpus} CPUs; one fresh process per cell", flush=True)
        for n in counts:
            folder = make_folder(Path(args.images), n, tmp / f"images{n}")
            for tool, method, workers in CONFIGS:
                result = tmp / "result.json"
                cmd = [sys.executable, os.fspath(Path(__file__).resolve()), "--child", "--tool", tool,
                       "--method", method, "--workers", str(workers), "--folder", str(folder), "--model", str(model),
                       "--names", str(names), "--input", opt.inputs[0].name, "--result", str(result)]
                r = measure(cmd, result)
                r.update(tool=tool, method=method, workers=workers, count=n)
                rows.append(r)
                print(f"  {n:4d} images  {_label(r):<28} {r['images'] / r['seconds']:7.2f} img/s  "
                      f"peak RSS {r['peak_rss'] / 2**20:7.0f} MiB  ({r['tensors']} tensors)", flush=True)
    print_table(rows, counts)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def _label(r: dict) -> str:
    if r["tool"] == "maceq":
        return f"maceq {r['method']} x{r['workers']}"
    if r["tool"] == "onnxruntime-same":
        return f"onnxruntime {r['method']} [maceq's]"
    return f"onnxruntime {r['method']}"


def print_table(rows: list[dict], counts: list[int]) -> None:
    cell = {(_label(r), r["count"]): r for r in rows}
    labels = list(dict.fromkeys(_label(r) for r in rows))
    print()
    print(f"{'configuration':<28}" + "".join(f"{f'{n} img/s':>12}{f'{n} MiB':>10}" for n in counts))
    for lab in labels:
        line = f"{lab:<28}"
        for n in counts:
            r = cell[(lab, n)]
            line += f"{r['images'] / r['seconds']:12.2f}{r['peak_rss'] / 2**20:10.0f}"
        print(line)
    lo, hi = counts[0], counts[-1]
    print()
    print(f"peak RSS, {hi} images / {lo} images (target <= 1.10 for maceq):")
    for lab in labels:
        ratio = cell[(lab, hi)]["peak_rss"] / cell[(lab, lo)]["peak_rss"]
        flag = "" if not lab.startswith("maceq") else ("  ok" if ratio <= 1.10 else "  MISSED")
        print(f"  {lab:<28} {ratio:6.3f}{flag}")
    for ort_kind, what in (("", "all tensors onnxruntime selects"), (" [maceq's]", "maceq's tensors only")):
        for ours, theirs, target in (("percentile", "Percentile", 3.0), ("min_max", "MinMax", None)):
            theirs_lab = f"onnxruntime {theirs}{ort_kind}"
            if (theirs_lab, lo) not in cell:
                continue
            print(f"throughput, maceq {ours} / {theirs_lab} ({what})"
                  + (f" (target >= {target:g}):" if target else ":"))
            for n in counts:
                t = cell[(theirs_lab, n)]
                ort_rate = t["images"] / t["seconds"]
                for w in (1, 2):
                    r = cell[(f"maceq {ours} x{w}", n)]
                    ratio = r["images"] / r["seconds"] / ort_rate
                    flag = "" if target is None else ("  ok" if ratio >= target else "  MISSED")
                    print(f"  {n:4d} images, {w} worker(s): {ratio:6.2f}{flag}")

if __name__ == "__main__":
    sys.exit(main())
