"""Speed benchmark: maceq's cpu simulation against onnxruntime float, measured in the same run.

    python bench/speed.py [--model ../shared/data/models/mobilenet_v2.onnx] [--images DIR] [--repeat 5]
                          [--devices cpu,gpu,dsp] [--busy N]

Prints, for MobileNetV2 at batch 1 and batch 8, the median (and minimum) latency of
onnxruntime's float model and of maceq's fixed-point cpu simulation, and their ratio; the same at
batch 1 for the gpu and dsp simulations; and the calibration throughput in images per second.
The two engines run in the same process, in alternating blocks (:func:`paired_times`), so that a
host whose speed drifts during the measurement weighs on both alike; the ratio printed first is the median over
adjacent pairs of blocks (:func:`paired_ratio`).
Targets: the cpu simulation within 1.5x of onnxruntime's float time at batch 1 and 1.2x at batch 8,
the gpu and dsp simulations within 3x.

``--busy N`` starts N busy-loop processes beside the measurement (a busy laptop or CI runner) and
adds a table of each device's simulation at batch 1 with its default thread count (which leaves out the
CPUs other processes keep busy), with one thread, and with every CPU forced: median, min, max and
the largest swing (max / min) of the repeats.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnxruntime as ort

from maceq.app.pipeline import quantize
from maceq.calibrate.runner import collect
from maceq.datasets.images import ImageFolder
from maceq.datasets.preprocess import preprocess_from_args
from maceq.quant.config import QuantConfig
from maceq.quant.prepare import prepare_graph, tensors_to_calibrate
from maceq.runtime.devices import Device
from maceq.runtime.model import load

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent.parent / "shared" / "data"


def run_times(fn, repeat: int, *, warm: int = 1, settle_s: float = 0.0) -> list[float]:
    """``repeat`` timed runs of ``fn`` after ``warm`` untimed ones, and more untimed ones until ``settle_s`` seconds
    have passed."""
    t_end = time.perf_counter() + settle_s
    n = 0
    while n < warm or time.perf_counter() < t_end:
        fn()
        n += 1
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


#: Seconds of untimed runs that open each block of paired_times. Each engine leaves its thread pool spinning after
#: its last run, onnxruntime for about 90 ms: measured on the 2-vCPU host, the simulation's first five MobileNetV2
#: runs after onnxruntime's block took 21-24 ms against its steady 11 ms, and onnxruntime's first after the
#: simulation's about twice its own.
BLOCK_SETTLE_S = 0.25


#: Timed runs of each engine per block of paired_times.
BLOCK_RUNS = 5


def paired_times(f_ort, f_sim, repeat: int) -> list[tuple[list[float], list[float]]]:
    """``repeat`` timed runs of each engine, in alternating blocks of BLOCK_RUNS (onnxruntime first, then the
    simulation; the next pair the simulation first), each block opened by BLOCK_SETTLE_S seconds of untimed runs so
    that neither engine is timed while the other's threads still spin. Returns the (onnxruntime, simulation) times of
    each pair of adjacent blocks: a host whose speed drifts weighs on both engines of a pair alike."""
    pairs = []
    for b in range(max(1, -(-repeat // BLOCK_RUNS))):
        n = min(BLOCK_RUNS, repeat - b * BLOCK_RUNS) if repeat > b * BLOCK_RUNS else BLOCK_RUNS
        first, second = (f_ort, f_sim) if b % 2 == 0 else (f_sim, f_ort)
        t_first, t_second = (run_times(f, n, settle_s=BLOCK_SETTLE_S) for f in (first, second))
        pairs.append((t_first, t_second) if b % 2 == 0 else (t_second, t_first))
    return pairs


def paired_ratio(pairs) -> float:
    """The median over the pairs of blocks of (the simulation's median / onnxruntime's median) in that pair."""
    return statistics.median(statistics.median(s) / statistics.median(o) for o, s in pairs)


def _spin() -> None:
    while True:
        pass


@contextmanager
def busy_neighbours(n: int):
    """``n`` processes that keep one CPU each busy until the block ends."""
    procs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(n)]
    for pr in procs:
        pr.start()
    time.sleep(0.5)
    try:
        yield
    finally:
        for pr in procs:
            pr.terminate()
            pr.join()


def threads_table(model, name: str, repeat: int, device: str) -> None:
    """Batch-1 simulation times on ``device`` with the default thread count, one thread and every CPU forced."""
    from maceq.runtime import threads

    x = np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)
    cpus = len(os.sched_getaffinity(0))
    for label, n in (("default", None), ("1", 1), (f"{cpus} (forced)", cpus)):
        threads.limit(n)
        chosen = threads.current()
        ts = run_times(lambda: model.run({name: x}, device=device), repeat)
        print(f"{device:>6} {label + f' (ran {chosen})':>22} {1000 * statistics.median(ts):>7.1f}ms "
              f"{1000 * min(ts):>7.1f}ms {1000 * max(ts):>7.1f}ms {max(ts) / min(ts):>7.1f}x")
    threads.limit(None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(SHARED / "models" / "mobilenet_v2.onnx"))
    p.add_argument("--images", default=str(SHARED / "photos" / "calib"))
    p.add_argument("--calib-images", type=int, default=32)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--busy", type=int, default=0, help="busy-loop processes beside the thread-count table")
    p.add_argument("--devices", default="cpu,gpu,dsp", help="devices to time (cpu at batch 1 and 8, others at 1)")
    args = p.parse_args(argv)
    devices = [Device.parse(d.strip()).value for d in args.devices.split(",")]
    pre = preprocess_from_args("imagenet")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        res = quantize(args.model, args.images, output_dir=tmp, preprocess=pre,
                       config=QuantConfig(max_images=args.calib_images), progress=False, devices=tuple(devices))
        t_quant = time.perf_counter() - t0
        models = {Device.parse(d).value: load(files.yml) for d, files in res.per_device.items()}
    # Calibration throughput: decode + preprocess + onnxruntime + streaming statistics.
    opt, _, _ = prepare_graph(args.model, input_shape=None)
    data = ImageFolder(args.images, pre, labels=None, limit=args.calib_images)
    calib_model = opt.to_onnx()
    names = tensors_to_calibrate(opt)
    t0 = time.perf_counter()
    collect(calib_model, names, data.iter_batches(8), input_name="input", total=len(data), progress=False)
    t_cal = time.perf_counter() - t0
    so = ort.SessionOptions()
    sess = ort.InferenceSession(args.model, so, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    print(f"model {args.model}")
    print(f"quantize end to end ({res.n_calib_images} images): {t_quant:.2f} s")
    print(f"calibration: {len(data)} images, {len(names)} tensors observed: {t_cal:.2f} s = "
          f"{len(data) / t_cal:.1f} images/s")
    rng = np.random.default_rng(0)
    from maceq.runtime import threads
    from maceq.runtime.kernels import jit

    path = ("compiled, BLAS called from the compiled blocks" if jit.gemm_available()
            else "compiled requantization, numpy GEMM" if jit.available() else "numpy only (MACEQ_NO_JIT)")
    print(f"threads: maceq {threads.current()} now (MACEQ_NUM_THREADS, else the CPUs other processes leave free; "
          f"kernels: {path}), onnxruntime its default")
    print(f"median (min) of the repeats, timed in alternating blocks of {BLOCK_RUNS}; ratio: the median over adjacent "
          "pairs of blocks of their medians' ratio (the steadier figure on a shared machine), then the ratio of the "
          "pooled medians (of the minimums)")
    print(f"{'device':>6} {'batch':>5} {'onnxruntime fp32':>24} {'maceq simulation':>24} {'ratio':>10} "
          f"{'pooled':>15}")
    for device, model in models.items():
        for batch in ((1, 8) if device == "cpu" else (1,)):
            x = rng.standard_normal((batch, 3, 224, 224)).astype(np.float32)
            pairs = paired_times(lambda: sess.run(None, {name: x}), lambda: model.run({name: x}, device=device),
                                 args.repeat)
            t_ort, t_sim = [t for o, _ in pairs for t in o], [t for _, s in pairs for t in s]
            med_o, med_s = statistics.median(t_ort), statistics.median(t_sim)
            min_o, min_s = min(t_ort), min(t_sim)
            print(f"{device:>6} {batch:>5} {1000 * med_o:>9.1f} ({1000 * min_o:>6.1f}) ms "
                  f"{1000 * med_s:>10.1f} ({1000 * min_s:>6.1f}) ms {paired_ratio(pairs):>9.2f}x "
                  f"{med_s / med_o:>6.2f}x ({min_s / min_o:.2f}x)")
    if args.busy:
        print(f"with {args.busy} busy-loop neighbour(s), batch 1, {args.repeat} repeats:")
        print(f"{'device':>6} {'threads':>22} {'median':>9} {'min':>9} {'max':>9} {'max/min':>8}")
        with busy_neighbours(args.busy):
            for device, model in models.items():
                threads_table(model, name, args.repeat, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
