"""Scale-out benchmark: ``maceq eval`` over 1..N workers, on local processes and on a local Ray cluster.

    python bench/scaling.py [--devices cpu,dsp] [--workers 1,2] [--executors local,ray] [--images 91]
                            [--model ../shared/data/models/mobilenet_v2.onnx] [--eval ../shared/data/photos/eval]
                            [--json out.json]

MobileNetV2 is quantized once per device (default settings, 32 calibration photos). Each device's model is then
evaluated on the same images with ``reports.evaluate.evaluate(..., workers=N, executor=E)``: images sharded in
whole batches, counts merged exactly. Per cell: the wall time (from the call to the merged result, worker or Ray
start-up included), images per second, the speed-up over one worker of the same executor and the efficiency
(speed-up / workers; 1.0 is linear scaling). Every cell's metrics must equal the one-worker run's; a difference is
an error. The same images through onnxruntime's float model alone, timed in the same run, give the ratio a user
feels: how much longer the int8 evaluation takes than running the float model.

Every cell runs the simulation on one thread per worker: the one-worker cell in this process (``threads.limit(1)``,
as each worker process does), so that the speed-up measures the cores the workers add, not the threads the
one-process run would take by itself (``--threads default`` keeps runtime/threads.py's choice there).

``--images N`` repeats the eval photos (symbolic links in a temporary folder) up to N images. Given two counts
(``--images 1456,2912``), every cell runs on both, and the table also splits each worker count's time into what the
images cost and what the evaluation costs whatever their number (``T(n) = fixed + n * per_image``, solved from the
two counts): the speed-up of the per-image part is how the work itself scales with workers, the fixed part is the
pool's start (processes, imports, each worker's first shard: models prepared, kernels loaded) and the merge. The
Ray cells run on one local cluster with as many CPUs as the most workers, started before the cells (its own start
is timed apart, in the ``ray start`` line); its worker processes are Ray's and live from cell to cell. Before the
cells of each worker count, an untimed evaluation of one batch per worker starts what lives on from call to call
(the local forkserver, Ray's worker processes with the simulation imported), so that every cell pays the same
start; the warm-up line prints what that first call took. On a machine with C CPUs, scaling past C workers cannot
be linear: the table prints the CPU count.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

from maceq.app.pipeline import quantize
from maceq.calibrate.parallel import Executor
from maceq.calibrate.runner import BatchedSession, make_session
from maceq.datasets.images import ImageFolder, iter_image_files
from maceq.datasets.preprocess import preprocess_from_args
from maceq.errors import MaceqError
from maceq.quant.config import QuantConfig
from maceq.reports.evaluate import evaluate
from maceq.runtime import threads
from maceq.runtime.devices import Device
from maceq.runtime.model import load

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent.parent / "shared" / "data"


def repeated_folder(src: Path, n: int, dst: Path) -> Path:
    """``dst`` holding links to the images of ``src``, repeated in order up to ``n`` images."""
    files = iter_image_files(src)
    if not files:
        raise MaceqError(f"{src}: no images")
    dst.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        f = files[i % len(files)]
        os.symlink(f.resolve(), dst / f"{i:06d}{f.suffix.lower()}")
    return dst


def float_seconds(model_path: str, data: ImageFolder, batch_size: int = 16) -> float:
    """onnxruntime's float model over every image, in batches, decoding included (as the evaluation reads them)."""
    sess = make_session(model_path)
    name = sess.get_inputs()[0].name
    runner = BatchedSession(sess, name)
    t0 = time.perf_counter()
    for batch in data.iter_batches(batch_size):
        runner.run(None, {name: batch.data})
    return time.perf_counter() - t0


def measure(models: dict, model_path: str, data: dict, workers: list[int], executors: list[str]) -> list[dict]:
    """One row per device, executor, worker count and image count (``data``: count -> folder)."""
    rows = []
    for device, model in models.items():
        base = {}
        for ex in executors:
            for n in workers:
                # the first call's own costs, kept out of the cells (the forkserver, Ray's workers, plans)
                small = next(iter(data.values()))
                small = small.shard(0, min(len(small), 16 * n))
                t0 = time.perf_counter()
                evaluate(model, model_path, small, device=device, workers=n, executor=ex, progress=False)
                print(f"  {device:<4} {ex:<6} x{n:<3} warm-up on {len(small)} images: "
                      f"{time.perf_counter() - t0:.1f} s (not in the cells)", flush=True)
                for count, folder in data.items():
                    t0 = time.perf_counter()
                    res = evaluate(model, model_path, folder, device=device, workers=n, executor=ex, progress=False)
                    sec = time.perf_counter() - t0
                    metrics = res.to_dict()
                    key = (ex, count)
                    if key not in base:
                        base[key] = (n, sec, metrics)
                    elif metrics != base[key][2]:
                        raise MaceqError(f"{device} {ex} x{n}, {count} images: metrics differ from {base[key][0]} "
                                         "worker(s)")
                    speedup = base[key][1] / sec * base[key][0]  # over the first count, taken as linear up to it
                    rows.append({"device": device, "executor": ex, "workers": n, "images": count,
                                 "seconds": round(sec, 2), "images_per_s": round(count / sec, 2),
                                 "speedup": round(speedup, 2), "efficiency": round(speedup / n, 2),
                                 "agreement": metrics["top1_agreement"]})
                    print(f"  {device:<4} {ex:<6} x{n:<3} {count:>6} images: {sec:7.1f} s  {count / sec:6.2f} img/s  "
                          f"speed-up {speedup:5.2f}  efficiency {speedup / n:4.2f}", flush=True)
    return rows


def split_fixed(rows: list[dict]) -> list[dict]:
    """Per device, executor and worker count measured at two image counts n1 < n2: ``T(n) = fixed + n * per_image``
    solved from the two, and the per-image part's speed-up over the first worker count (taken as linear up to it)."""
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["device"], r["executor"], r["workers"]), {})[r["images"]] = r["seconds"]
    out, first = [], {}
    for (device, ex, n), times in cells.items():
        if len(times) != 2:
            continue
        (n1, t1), (n2, t2) = sorted(times.items())
        per_image = (t2 - t1) / (n2 - n1)
        base = first.setdefault((device, ex), (n, per_image))
        speedup = base[1] / per_image * base[0] if per_image > 0 else float("nan")
        out.append({"device": device, "executor": ex, "workers": n, "fixed_s": round(t1 - n1 * per_image, 2),
                    "per_image_ms": round(1e3 * per_image, 3), "per_image_speedup": round(speedup, 2),
                    "per_image_efficiency": round(speedup / n, 2)})
    return out


def _machine_task(args) -> float:
    """In a worker: wait for the others, then ``runs`` runs of one engine on one thread; the seconds they took."""
    engine, model, yml, x, runs, barrier = args
    threads.limit(1)
    if engine == "onnxruntime":
        sess = make_session(model, intra_op_threads=1)
        name = sess.get_inputs()[0].name
        step = lambda: sess.run(None, {name: x})  # noqa: E731
    else:
        sim = load(yml)
        step = lambda: sim.run({sim.input_names[0]: x}, device=engine)  # noqa: E731
    step()
    barrier.wait()
    t0 = time.perf_counter()
    for _ in range(runs):
        step()
    return time.perf_counter() - t0


def machine_scaling(model_path: str, ymls: dict, x, workers: list[int], runs: int) -> list[dict]:
    """The same independent single-thread loop in N processes at once, for onnxruntime's float model and each
    device's simulation: throughput over one process's. No images, no pool, no merging: how far this machine
    scales N copies of the same work, the reference for the evaluation's scaling."""
    ctx = multiprocessing.get_context("spawn")
    rows = []
    for engine, yml in [("onnxruntime", None)] + list(ymls.items()):
        base = None
        for n in workers:
            with ctx.Manager() as mgr, ctx.Pool(n) as pool:
                barrier = mgr.Barrier(n)
                secs = pool.map(_machine_task, [(engine, model_path, yml, x, runs, barrier)] * n)
            rate = n * runs / max(secs)
            base = base or (n, rate)
            speedup = rate / base[1] * base[0]
            rows.append({"engine": engine, "workers": n, "runs_per_s": round(rate, 1), "speedup": round(speedup, 2)})
            print(f"  machine {engine:<11} x{n:<3} {rate:7.1f} runs/s  speed-up {speedup:5.2f}  "
                  f"efficiency {speedup / n:4.2f}", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(SHARED / "models" / "mobilenet_v2.onnx"))
    p.add_argument("--calib", default=str(SHARED / "photos" / "calib"))
    p.add_argument("--eval", default=str(SHARED / "photos" / "eval"))
    p.add_argument("--devices", default="cpu,dsp")
    p.add_argument("--workers", default="1,2")
    p.add_argument("--executors", default="local,ray")
    p.add_argument("--images", default=None,
                   help="repeat the eval photos up to this many images; two counts (n1,n2) split fixed and per-image "
                        "costs")
    p.add_argument("--threads", choices=("one", "default"), default="one",
                   help="threads of the one-worker cell (workers always use one each)")
    p.add_argument("--machine-runs", type=int, default=0,
                   help="also run the same single-thread loop of this many runs in N processes at once, for "
                        "onnxruntime's float model and each device's simulation (how far the machine itself scales)")
    p.add_argument("--json", help="also write the rows as JSON here")
    args = p.parse_args(argv)
    try:
        devices = [Device.parse(d.strip()).value for d in args.devices.split(",") if d.strip()]
        executors = [Executor.parse(e.strip()).value for e in args.executors.split(",") if e.strip()]
        workers = sorted({int(w) for w in args.workers.split(",") if w.strip()})
        counts = [None] if args.images is None else sorted({int(c) for c in args.images.split(",") if c.strip()})
        if not workers or workers[0] < 1 or (args.images is not None and (not counts or counts[0] < 1)) \
                or len(counts) > 2:
            raise MaceqError("--workers takes positive integers, --images one or two")
    except (MaceqError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    pre = preprocess_from_args("imagenet")
    warnings.simplefilter("ignore")
    if args.threads == "one":
        threads.limit(1)
    with tempfile.TemporaryDirectory(prefix="maceq-bench-scale-") as tmp:
        res = quantize(args.model, args.calib, output_dir=Path(tmp) / "q", preprocess=pre,
                       config=QuantConfig(max_images=32), progress=False, devices=tuple(devices))
        models = {Device.parse(d).value: load(f.yml) for d, f in res.per_device.items()}
        data = {}
        for count in counts:
            folder = Path(args.eval) if count is None else repeated_folder(Path(args.eval), count,
                                                                           Path(tmp) / f"images{count}")
            folder = ImageFolder(folder, pre, labels=None)
            data[len(folder)] = folder
        largest = data[max(data)]
        t_float = float_seconds(args.model, largest)
        print(f"{len(largest)} images, {len(os.sched_getaffinity(0))} CPUs; onnxruntime float alone: {t_float:.1f} s "
              f"({len(largest) / t_float:.1f} img/s)", flush=True)
        if "ray" in executors:
            from maceq.calibrate.parallel import init_ray

            t0 = time.perf_counter()
            init_ray(address=None, num_cpus=max(workers))
            print(f"ray start: {time.perf_counter() - t0:.1f} s (not in the cells)", flush=True)
        machine = []
        if args.machine_runs > 0:
            x = next(largest.iter_batches(1)).data
            machine = machine_scaling(args.model, {d: str(f.yml) for d, f in res.per_device.items()}, x, workers,
                                      args.machine_runs)
        rows = measure(models, args.model, data, workers, executors)
    print("\n| device | executor | workers | images | seconds | images/s | speed-up | efficiency "
          "| x onnxruntime float |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['device']} | {r['executor']} | {r['workers']} | {r['images']} | {r['seconds']:.1f} | "
              f"{r['images_per_s']:.2f} | {r['speedup']:.2f} | {r['efficiency']:.2f} | "
              f"{r['seconds'] / (t_float * r['images'] / len(largest)):.0f}x |")
    split = split_fixed(rows)
    if split:
        print("\n| device | executor | workers | fixed, s | per image, ms | per-image speed-up "
              "| per-image efficiency |")
        print("|---|---|---|---|---|---|---|")
        for r in split:
            print(f"| {r['device']} | {r['executor']} | {r['workers']} | {r['fixed_s']:.2f} | {r['per_image_ms']:.2f} "
                  f"| {r['per_image_speedup']:.2f} | {r['per_image_efficiency']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"float_seconds": t_float, "images": len(largest), "rows": rows,
                                               "split": split, "machine": machine}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
