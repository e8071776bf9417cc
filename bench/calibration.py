"""Calibration benchmark: time and peak memory of maceq against onnxruntime's calibrators.

    python bench/calibration.py [--repeat 3] [--counts 64] [--suite speed|parallel]
                                [--model ../shared/data/models/mobilenet_v2.onnx]
                                [--images ../shared/data/photos/calib] [--json out.json]

Each measurement runs in a fresh Python process. Its peak RSS is the kernel's own high-water mark
for that process (``os.wait4``'s ``ru_maxrss``), and, where the configuration starts worker
processes, the sum over the process tree polled with psutil every 20 ms. The kernel counts the
parent's resident pages at the fork into a child's high-water mark, so this parent stays small:
it imports neither maceq nor onnx, and a child prepares the model and the image folders. Its time is the span the
process measures itself: after imports, with the model on disk, to a range per tensor (session
set-up, worker start-up, decoding, inference, statistics and the ranges all inside). The whole
process's wall time, imports included, is reported too. With ``--repeat R`` every configuration
runs R times, round-robin, and the medians are reported.

Suites:

``speed`` (the default; 64 images): the comparison the calibration targets name, on the same
images and the same float graph (maceq's optimised graph: BatchNorm folded, activations fused,
written to ONNX once):

* ``maceq percentile`` / ``maceq min_max``: maceq's calibration in one process
  (``collect_parallel`` with 1 worker, then ``compute_range``): what ``quantize`` runs;
* ``maceq quantize (whole command)``: ``quantize --no-report -q`` on the original model and the
  same images, everything included (graph import, calibration, build for the cpu, writing);
* ``onnxruntime quantize_static Percentile`` / ``MinMax``: ``quantize_static`` as a user calls
  it, with a CalibrationDataReader over the same batches of 8 (its defaults: one
  ``collect_data`` call over all batches, so every fetched output of every image is held;
  Percentile symmetric on 2048 ``|x|`` bins, percentile 99.99 as maceq's; QDQ output written);
* ``onnxruntime Percentile`` / ``MinMax`` (calibrator only): ``create_calibrator`` with
  ``collect_data`` once per 32 images (its API merges histograms and ranges across calls, which
  bounds its memory) and ``compute_data``: calibration alone, the like-for-like cell.

Printed: a table (seconds, images/s, peak RSS per configuration and image count), then the
ratios: onnxruntime's time over maceq's (target: maceq at least 4x faster than quantize_static
Percentile), maceq's peak RSS (target <= 400 MB) and, given several ``--counts``, maceq's peak
at the largest count over the smallest (flat: <= 1.10).

``parallel``: the table of docs/parallel.md (32, 128 and 512 images, photos repeated through
symlinks): maceq with 1 and 2 workers, onnxruntime's calibrators on every tensor they select
and restricted to maceq's 65 tensors (``[maceq's]``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
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
RSS_TARGET_MB = 400
SPEEDUP_TARGET = 4.0
SUITES = {
    "speed": [
        ("maceq", "percentile", 1), ("maceq", "min_max", 1), ("maceq-cli", "percentile", 1),
        ("onnxruntime-static", "Percentile", 1), ("onnxruntime-static", "MinMax", 1),
        ("onnxruntime", "Percentile", 1), ("onnxruntime", "MinMax", 1),
    ],
    "parallel": [
        ("maceq", "min_max", 1), ("maceq", "min_max", 2),
        ("maceq", "percentile", 1), ("maceq", "percentile", 2),
        ("onnxruntime", "MinMax", 1), ("onnxruntime", "Percentile", 1),
        ("onnxruntime-same", "MinMax", 1), ("onnxruntime-same", "Percentile", 1),
    ],
}
DEFAULT_COUNTS = {"speed": "64", "parallel": "32,128,512"}


# ------------------------------------------------------------------------------------------------
# The child: one configuration, timed
# ------------------------------------------------------------------------------------------------

def _prepare(args) -> None:
    """In a child: maceq's optimised graph, the names of the tensors maceq observes, and one image
    folder per count, written under ``args.result`` (a folder)."""
    from maceq.datasets.preprocess import PRESETS
    from maceq.quant.prepare import prepare_graph, tensors_to_calibrate

    out = Path(args.result)
    opt, _, _ = prepare_graph(args.source, input_shape=None, preprocess=PRESETS["imagenet"])
    (out / "optimised.onnx").write_bytes(opt.to_onnx().SerializeToString())
    (out / "names.json").write_text(json.dumps(tensors_to_calibrate(opt)))
    (out / "input.txt").write_text(opt.inputs[0].name)
    for n in (int(c) for c in args.method.split(",")):
        make_folder(Path(args.folder), n, out / f"images{n}")


def _child(args) -> None:
    if args.tool == "prepare":
        _prepare(args)
        return
    from maceq.datasets.images import ImageFolder
    from maceq.datasets.preprocess import PRESETS

    data = ImageFolder(args.folder, PRESETS["imagenet"], labels=None)
    if args.tool == "maceq":
        seconds, n_tensors = _child_maceq(args, data)
    elif args.tool == "maceq-cli":
        seconds, n_tensors = _child_maceq_cli(args, data)
    elif args.tool == "onnxruntime-static":
        seconds, n_tensors = _child_quantize_static(args, data)
    else:
        seconds, n_tensors = _child_calibrator(args, data)
    with open(args.result, "w") as f:
        json.dump({"seconds": seconds, "images": len(data.files) - data.skipped, "tensors": n_tensors}, f)


def _child_maceq(args, data) -> tuple[float, int]:
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
    return time.perf_counter() - t0, len(ranges)


def _child_maceq_cli(args, data) -> tuple[float, int]:
    import contextlib

    from maceq.app.cli import quantize_main

    with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        argv = [args.source, "--calib-dir", args.folder, "--preset", "imagenet", "--no-report", "-q",
                "--range-method", args.method, "-o", tmp]
        t0 = time.perf_counter()
        rc = quantize_main(argv)
        seconds = time.perf_counter() - t0
        if rc:
            raise SystemExit(f"quantize failed ({rc})")
        ranges = next(Path(tmp).rglob("*_ranges.txt"))
        n_tensors = sum(1 for line in ranges.read_text().splitlines() if line.strip())
    return seconds, n_tensors


class _Reader:
    """A CalibrationDataReader over the same batches of 8 that maceq reads."""

    def __init__(self, batches, input_name: str):
        self.batches, self.input_name = batches, input_name

    def get_next(self):
        b = next(self.batches, None)
        return None if b is None else {self.input_name: b.data}


def _child_quantize_static(args, data) -> tuple[float, int]:
    import contextlib
    import logging

    import onnx
    from onnxruntime.quantization import CalibrationMethod, quantize_static

    logging.disable(logging.WARNING)  # its "consider pre-processing" advice
    method = CalibrationMethod[args.method]
    extra = {"CalibPercentile": PERCENTILE} if method is CalibrationMethod.Percentile else {}
    with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        out = str(Path(tmp) / "quantized.onnx")
        t0 = time.perf_counter()
        quantize_static(args.model, out, _Reader(data.iter_batches(BATCH), args.input), calibrate_method=method,
                        extra_options=extra)
        seconds = time.perf_counter() - t0
        n_tensors = sum(1 for n in onnx.load(out).graph.node if n.op_type == "QuantizeLinear")
    return seconds, n_tensors


def _child_calibrator(args, data) -> tuple[float, int]:
    import contextlib

    from onnxruntime.quantization.calibrate import CalibrationMethod, create_calibrator

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
            cal.collect_data(_Reader(iter(part), args.input))
            del part
        ranges = cal.compute_data()
    return time.perf_counter() - t0, len(ranges.data)


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
# The parent: folders, processes, memory, the table
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
    """Run ``cmd``; its result file, plus ``peak_rss`` (the kernel's high-water mark of the
    process, from wait4), ``tree_rss`` (the polled peak of the summed process tree) and ``wall``."""
    import psutil

    t0 = time.perf_counter()
    p = subprocess.Popen(cmd)
    proc = psutil.Process(p.pid)
    tree = 0
    while True:
        pid, status, usage = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        tree = max(tree, _tree_rss(proc))
        time.sleep(0.02)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"benchmark child failed ({p.returncode}): {' '.join(cmd)}")
    out = json.loads(result.read_text())
    out.update(peak_rss=usage.ru_maxrss * 1024, tree_rss=max(tree, usage.ru_maxrss * 1024),
               wall=time.perf_counter() - t0)
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
    p.add_argument("--suite", choices=sorted(SUITES), default="speed")
    p.add_argument("--counts", help="image counts, comma-separated (default: 64; parallel suite: 32,128,512)")
    p.add_argument("--repeat", type=int, default=3, help="runs per configuration and count (medians reported)")
    p.add_argument("--only", help="run only the configurations whose label contains this text (e.g. maceq)")
    p.add_argument("--json", help="also write every measurement to this JSON file")
    # child mode (internal)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for a in ("--tool", "--method", "--folder", "--names", "--input", "--result", "--source"):
        p.add_argument(a, help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args)
        return 0
    counts = [int(c) for c in (args.counts or DEFAULT_COUNTS[args.suite]).split(",")]
    rows = _run_all(args, counts)
    print_table(rows, counts)
    if args.suite == "speed":
        print_speed_ratios(rows, counts)
    else:
        print_parallel_ratios(rows, counts)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def _run_all(args, counts: list[int]) -> list[dict]:
    rows = []
    script = os.fspath(Path(__file__).resolve())
    with tempfile.TemporaryDirectory(prefix="maceq-bench-") as tmp:
        tmp = Path(tmp)
        subprocess.run([sys.executable, script, "--child", "--tool", "prepare", "--source", str(args.model),
                        "--folder", str(args.images), "--method", ",".join(map(str, counts)), "--result", str(tmp)],
                       check=True)
        model, names, input_name = tmp / "optimised.onnx", tmp / "names.json", (tmp / "input.txt").read_text()
        print(f"model {args.model} (maceq's optimised graph), images from {args.images}, batch {BATCH}, "
              f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; one fresh process per run, "
              f"{args.repeat} run(s) each", flush=True)
        for n in counts:
            folder = tmp / f"images{n}"
            for rep in range(args.repeat):
                for tool, method, workers in SUITES[args.suite]:
                    if args.only and args.only not in _label({"tool": tool, "method": method, "workers": workers}):
                        continue
                    result = tmp / "result.json"
                    cmd = [sys.executable, script, "--child", "--tool", tool,
                           "--method", method, "--workers", str(workers), "--folder", str(folder),
                           "--model", str(model), "--source", str(args.model), "--names", str(names),
                           "--input", input_name, "--result", str(result)]
                    r = measure(cmd, result)
                    r.update(tool=tool, method=method, workers=workers, count=n, run=rep)
                    rows.append(r)
                    print(f"  {n:4d} images  run {rep + 1}  {_label(r):<42} {r['seconds']:7.2f} s  "
                          f"peak RSS {_mb(_peak(r)):6.0f} MB  ({r['tensors']} tensors)", flush=True)
    return rows


def _label(r: dict) -> str:
    kind = {"maceq": f"maceq {r['method']}", "maceq-cli": "maceq quantize (whole command)",
            "onnxruntime-static": f"onnxruntime quantize_static {r['method']}",
            "onnxruntime": f"onnxruntime {r['method']}", "onnxruntime-same": f"onnxruntime {r['method']} [maceq's]"}
    label = kind[r["tool"]]
    return label + (f" x{r['workers']}" if r["tool"] == "maceq" and r["workers"] > 1 else "")


def _peak(r: dict) -> int:
    """A single process's kernel high-water mark; the polled tree sum where workers ran."""
    return r["tree_rss"] if r["workers"] > 1 else r["peak_rss"]


def _mb(nbytes: float) -> float:
    return nbytes / 1e6


def _medians(rows: list[dict]) -> dict[tuple[str, int], dict]:
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((_label(r), r["count"]), []).append(r)
    return {key: {"seconds": statistics.median(g["seconds"] for g in rs), "wall": statistics.median(g["wall"] for g in rs),
                  "peak": statistics.median(_peak(g) for g in rs), "images": rs[0]["images"],
                  "seconds_all": [g["seconds"] for g in rs]} for key, rs in groups.items()}


def print_table(rows: list[dict], counts: list[int]) -> None:
    cell = _medians(rows)
    labels = list(dict.fromkeys(_label(r) for r in rows))
    print()
    print(f"{'configuration (medians)':<42}" + "".join(f"{f'{n}: s':>9}{'img/s':>7}{'MB':>6}{'proc s':>8}"
                                                       for n in counts))
    for lab in labels:
        line = f"{lab:<42}"
        for n in counts:
            c = cell[(lab, n)]
            line += f"{c['seconds']:9.2f}{c['images'] / c['seconds']:7.1f}{_mb(c['peak']):6.0f}{c['wall']:8.1f}"
        print(line)
    print("(s: the timed span; MB: peak RSS in 10^6 bytes; proc s: the whole process, imports included)")


def print_speed_ratios(rows: list[dict], counts: list[int]) -> None:
    cell = _medians(rows)
    print()
    for n in counts:
        print(f"{n} images:" + (f" time of onnxruntime / time of maceq (target for quantize_static Percentile: "
                                f">= {SPEEDUP_TARGET:g}), and peak RSS" if any(k[0].startswith("onnxruntime")
                                                                              for k in cell) else ""))
        for ours, theirs in (("percentile", "Percentile"), ("min_max", "MinMax")):
            m = cell.get((f"maceq {ours}", n))
            if m is None:
                continue
            for kind in ("quantize_static ", ""):
                t = cell.get((f"onnxruntime {kind}{theirs}", n))
                if t is None:
                    continue
                ratio = t["seconds"] / m["seconds"]
                flag = ("  ok" if ratio >= SPEEDUP_TARGET else "  MISSED") if kind and ours == "percentile" else ""
                print(f"  maceq {ours:<10} vs onnxruntime {kind}{theirs:<11} time {ratio:6.2f}x{flag:<8} "
                      f"peak RSS {_mb(m['peak']):5.0f} MB vs {_mb(t['peak']):6.0f} MB ({t['peak'] / m['peak']:.1f}x)")
        for lab in ("maceq percentile", "maceq min_max"):
            if (lab, n) in cell:
                peak = _mb(cell[(lab, n)]["peak"])
                print(f"  {lab} peak RSS {peak:.0f} MB (target <= {RSS_TARGET_MB}):"
                      f" {'ok' if peak <= RSS_TARGET_MB else 'MISSED'}")
    if len(counts) > 1:
        lo, hi = counts[0], counts[-1]
        print(f"peak RSS, {hi} images / {lo} images (flat: <= 1.10):")
        for lab in dict.fromkeys(_label(r) for r in rows):
            peaks = "  ".join(f"{_mb(cell[(lab, n)]['peak']):.0f}" for n in counts)
            ratio = cell[(lab, hi)]["peak"] / cell[(lab, lo)]["peak"]
            flag = ("  ok" if ratio <= 1.10 else "  MISSED") if lab.startswith("maceq") else ""
            print(f"  {lab:<42} {ratio:6.3f}{flag:<8} (MB at {', '.join(map(str, counts))}: {peaks})")


def print_parallel_ratios(rows: list[dict], counts: list[int]) -> None:
    cell = _medians(rows)
    lo, hi = counts[0], counts[-1]
    print()
    print(f"peak RSS, {hi} images / {lo} images (target <= 1.10 for maceq):")
    for lab in dict.fromkeys(_label(r) for r in rows):
        ratio = cell[(lab, hi)]["peak"] / cell[(lab, lo)]["peak"]
        flag = "" if not lab.startswith("maceq") else ("  ok" if ratio <= 1.10 else "  MISSED")
        print(f"  {lab:<42} {ratio:6.3f}{flag}")
    for ort_kind, what in (("", "all tensors onnxruntime selects"), (" [maceq's]", "maceq's tensors only")):
        for ours, theirs, target in (("percentile", "Percentile", 3.0), ("min_max", "MinMax", None)):
            theirs_lab = f"onnxruntime {theirs}{ort_kind}"
            if (theirs_lab, lo) not in cell:
                continue
            print(f"throughput, maceq {ours} / {theirs_lab} ({what})"
                  + (f" (target >= {target:g}):" if target else ":"))
            for n in counts:
                t = cell[(theirs_lab, n)]
                for w, suffix in ((1, ""), (2, " x2")):
                    r = cell.get((f"maceq {ours}{suffix}", n))
                    if r is None:
                        continue
                    ratio = t["seconds"] / r["seconds"]
                    flag = "" if target is None else ("  ok" if ratio >= target else "  MISSED")
                    print(f"  {n:4d} images, {w} worker(s): {ratio:6.2f}{flag}")


if __name__ == "__main__":
    sys.exit(main())
