"""Parallel calibration (calibrate/parallel.py) and the parallel mixed-precision search.

The oracles are independent of calibrate/stats.py: onnxruntime run directly on all images in one
batch (exact min/max/count with numpy), and a plain-numpy histogram on the grid that the stats
docstring defines (the smallest e >= -160 whose 2**e grid puts [min, max] in 2048 bins, with
|x| < 2**(e+52); counts = bincount(floor(x / 2**e) - floor(min / 2**e))). The parallel results
must equal them exactly, for several shardings and merge orders, on local processes and on a
local Ray cluster. The parallel mixed-precision search must equal the sequential one.
"""
from __future__ import annotations

import math
import random
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import maceq
from maceq.app.pipeline import calibrate
from maceq.calibrate.methods import RangeMethod, compute_range
from maceq.calibrate.parallel import Executor, collect_parallel, shard_ranges
from maceq.calibrate.runner import collect
from maceq.calibrate.stats import StatsCollector
from maceq.datasets.images import ImageFolder, UnreadableImageWarning, load_image
from maceq.datasets.labels import FASHION_MNIST_CLASSES
from maceq.datasets.preprocess import PRESETS
from maceq.errors import MaceqError
from maceq.quant.prepare import prepare_graph, tensors_to_calibrate

NUM_BINS = 2048


# ------------------------------------------------------------------------------------------------
# Independent oracles
# ------------------------------------------------------------------------------------------------

def run_all(model: onnx.ModelProto, names, input_name, x):
    """Every named tensor on the whole batch ``x``, onnxruntime straight (no maceq code)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    for n in names:
        if n != input_name and n not in have:
            m.graph.output.append(onnx.helper.make_empty_tensor_value_info(n))
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    fetch = [n for n in names if n != input_name]
    out = dict(zip(fetch, sess.run(fetch, {input_name: x})))
    if input_name in names:
        out[input_name] = x
    return out


def oracle_histogram(x: np.ndarray):
    """(e, base, counts) of the stats docstring's grid, by brute force over e."""
    v = x.astype(np.float64).ravel()
    lo, hi = float(v.min()), float(v.max())
    amax = max(abs(lo), abs(hi))
    e = -160
    while not (math.floor(hi / 2.0 ** e) - math.floor(lo / 2.0 ** e) <= NUM_BINS - 1 and amax < 2.0 ** (e + 52)):
        e += 1
    base = math.floor(lo / 2.0 ** e)
    k = np.floor(np.ldexp(v, -e)).astype(np.int64) - base
    return e, base, np.bincount(k, minlength=NUM_BINS)


def check_against_oracle(stats: StatsCollector, acts: dict, *, histograms: bool) -> None:
    assert sorted(stats) == sorted(acts)
    for name, a in acts.items():
        st = stats[name]
        assert (st.count, st.min, st.max) == (a.size, float(a.min()), float(a.max())), name
        if histograms:
            e, base, counts = oracle_histogram(a)
            assert (st.exp, st.base) == (e, base), name
            assert np.array_equal(st.counts, counts), name


def same(a: StatsCollector, b: StatsCollector) -> bool:
    return a.to_dict() == b.to_dict()


# ------------------------------------------------------------------------------------------------
# Fixtures: Fashion-MNIST (60 photos of all classes + 2 unreadable files), MobileNetV2 (12 photos)
# ------------------------------------------------------------------------------------------------

class Setup:
    def __init__(self, onnx_path, folder, preset, limit=None):
        opt, _, _ = prepare_graph(onnx_path, input_shape=None, preprocess=PRESETS[preset])
        self.model = opt.to_onnx()
        self.names = tensors_to_calibrate(opt)
        self.input = opt.inputs[0].name
        self.folder, self.preset, self.limit = folder, preset, limit

    def data(self) -> ImageFolder:
        return ImageFolder(self.folder, PRESETS[self.preset], labels=None, limit=self.limit)

    def run(self, workers, executor="local", *, batch_size=8):
        """collect_parallel's statistics, skipped paths and warnings."""
        data = self.data()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UnreadableImageWarning)
            st = collect_parallel(self.model, self.names, data, workers=workers, executor=executor,
                                  batch_size=batch_size, input_name=self.input, progress=False)
        msgs = [str(w.message) for w in caught if issubclass(w.category, UnreadableImageWarning)]
        return st, data.skipped_paths, msgs

    def oracle(self):
        data = self.data()
        good = [f for f in data.files if "bad" not in f.name]
        x = np.concatenate([load_image(f, PRESETS[self.preset]) for f in good])
        return run_all(self.model, self.names, self.input, x)


@pytest.fixture(scope="module")
def fmnist(shared_data, tmp_path_factory):
    src = sorted((shared_data / "fashion_mnist" / "calib").rglob("*.png"))[::8][:60]
    folder = tmp_path_factory.mktemp("fmnist60")
    for i, f in enumerate(src):
        shutil.copyfile(f, folder / f"{i:03d}.png")
    for name in ("013_bad.png", "047_bad.png"):  # sorted right after 013.png and 047.png
        (folder / name).write_bytes(b"this is not an image")
    s = Setup(shared_data / "models" / "fmnist_mobilenet.onnx", folder, "fmnist")
    s.acts = s.oracle()
    return s


@pytest.fixture(scope="module")
def mnv2(shared_data):
    return Setup(shared_data / "models" / "mobilenet_v2.onnx", shared_data / "photos" / "calib", "imagenet",
                 limit=12)


# ------------------------------------------------------------------------------------------------
# (a) min_max bit-identical; (b) histograms and range methods identical, any sharding
# ------------------------------------------------------------------------------------------------

def test_shard_rule():
    # 62 files in batches of 8 -> 8 batches; 3 shards take batches [0,2), [2,5), [5,8)
    assert shard_ranges(62, batch_size=8, shards=3) == [(0, 16), (16, 40), (40, 62)]
    assert shard_ranges(62, batch_size=8, shards=2) == [(0, 32), (32, 62)]
    assert shard_ranges(5, batch_size=8, shards=4) == [(0, 5)]  # never more shards than batches
    assert shard_ranges(12, batch_size=4, shards=3) == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(MaceqError, match="positive int"):
        shard_ranges(10, batch_size=4, shards=0)


@pytest.mark.unit
def test_local_workers_fork_from_a_clean_server_with_the_callers_import_path(tmp_path, monkeypatch):
    """Local workers start from the forkserver where the platform has one (each forked from that clean process, not
    from this one and not a fresh interpreter per worker), with onnxruntime already imported there; a task from a
    module that only this process's import path reaches (a script's folder) runs in them."""
    import importlib
    import multiprocessing
    import os

    from maceq.calibrate import forkserver
    from maceq.calibrate.parallel import TaskPool

    (tmp_path / "callers_tasks.py").write_text(
        "import os, sys\n\ndef facts(shared, item, report):\n"
        "    return shared, item, os.getppid(), 'onnxruntime' in sys.modules, 'numba.np.arraymath' in sys.modules\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    tasks = importlib.import_module("callers_tasks")
    has = "forkserver" in multiprocessing.get_all_start_methods()
    assert forkserver.context().get_start_method() == ("forkserver" if has else "spawn")
    with TaskPool("job", workers=2) as pool:
        got = pool.map(tasks.facts, [0, 1, 2])
    assert [g[:2] for g in got] == [("job", 0), ("job", 1), ("job", 2)] and all(g[3] for g in got)
    if has:  # a forked worker's parent is the server, a spawned one's is this process
        assert all(g[2] != os.getpid() for g in got) and len({g[2] for g in got}) == 1
        assert all(g[4] for g in got)  # numba's CPU target loaded in the server, before the fork


def test_fmnist_exact_for_1_2_3_workers_with_unreadable_files(fmnist):
    runs = {w: fmnist.run(w) for w in (1, 2, 3)}
    bad = [str(fmnist.folder / "013_bad.png"), str(fmnist.folder / "047_bad.png")]
    for w, (st, skipped, msgs) in runs.items():
        check_against_oracle(st, fmnist.acts, histograms=True)
        assert skipped == bad, w
        assert len(msgs) == 2 and all(m.startswith(p) for m, p in zip(msgs, bad)), w
    assert runs[2][2] == runs[3][2] == runs[1][2]  # the same warnings, in file order


def test_mobilenet_v2_min_max_bit_identical(mnv2):
    acts = mnv2.oracle()
    for w in (1, 2, 3):
        st, skipped, _ = mnv2.run(w, batch_size=4)
        check_against_oracle(st, acts, histograms=False)
        assert skipped == []
        for name in mnv2.names:
            assert compute_range(st[name], RangeMethod.MIN_MAX) == (float(acts[name].min()), float(acts[name].max()))


def test_any_sharding_and_merge_order_gives_the_oracle_histograms(fmnist):
    """Random (non-contiguous) partitions of the images, each collected alone, merged in random order."""
    files = [f for f in fmnist.data().files if "bad" not in f.name]
    rng = random.Random(8)
    reference = None
    for trial in range(3):
        order = files[:]
        rng.shuffle(order)
        cuts = sorted(rng.sample(range(1, len(order)), 4 + trial))
        parts = [order[a:b] for a, b in zip([0] + cuts, cuts + [len(order)])]
        partial = []
        for part in parts:
            d = fmnist.data()
            d.files = part
            partial.append(collect(fmnist.model, fmnist.names, d.iter_batches(rng.choice([1, 3, 8])),
                                   input_name=fmnist.input, progress=False))
        rng.shuffle(partial)
        merged = partial[0]
        for p in partial[1:]:
            merged = p.merge(merged) if rng.random() < 0.5 else merged.merge(p)
        merged = StatsCollector.from_dict(merged.to_dict())  # through the wire format the workers use
        check_against_oracle(merged, fmnist.acts, histograms=True)
        reference = reference or merged
        assert same(merged, reference)
    # so every range method gives the same range for any sharding
    st3 = fmnist.run(3)[0]
    for method in (RangeMethod.PERCENTILE, RangeMethod.MSE, RangeMethod.KL, RangeMethod.MIN_MAX):
        for name in fmnist.names:
            assert compute_range(st3[name], method) == compute_range(reference[name], method), (method, name)


def test_errors(fmnist, monkeypatch):
    with pytest.raises(MaceqError, match="executor must be one of local, ray"):
        Executor.parse("dask")
    with pytest.raises(MaceqError, match="workers must be a positive int"):
        collect_parallel(fmnist.model, fmnist.names, fmnist.data(), workers=0)
    with pytest.raises(MaceqError, match="is not produced by any node"):
        collect_parallel(fmnist.model, ["nope"], fmnist.data(), workers=2)
    # an error inside a worker comes back as the worker's one-line MaceqError
    with pytest.raises(MaceqError, match="^model has no input 'nope' "):
        collect_parallel(fmnist.model, fmnist.names, fmnist.data(), workers=2, input_name="nope", progress=False)
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(MaceqError, match=r"pip install 'maceq\[ray\]'"):
        collect_parallel(fmnist.model, fmnist.names, fmnist.data(), workers=2, executor="ray")


# ------------------------------------------------------------------------------------------------
# (c) Ray on a local cluster == local processes; (d) parallel mixed precision == sequential
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_equals_local(fmnist, ray_cluster):
    local = fmnist.run(2)
    on_ray = fmnist.run(2, "ray")
    check_against_oracle(on_ray[0], fmnist.acts, histograms=True)
    assert same(on_ray[0], local[0]) and on_ray[1:] == local[1:]
    with pytest.raises(MaceqError, match="^model has no input 'nope' "):
        collect_parallel(fmnist.model, fmnist.names, fmnist.data(), workers=2, executor="ray", input_name="nope",
                         progress=False)
    d = ImageFolder(fmnist.folder, PRESETS["fmnist"], labels=None)
    d.files = [f for f in d.files if "bad" in f.name]
    with pytest.raises(MaceqError, match="no readable image"), pytest.warns(UnreadableImageWarning):
        collect_parallel(fmnist.model, fmnist.names, d, workers=2, executor="ray", input_name=fmnist.input,
                         progress=False)


@pytest.mark.unit
def test_console_scripts_start_the_forkserver_before_importing_the_tool():
    """The console scripts enter through app/launch.py, which imports nothing heavy and starts the local workers'
    forkserver exactly when the command line asks for more than one local worker."""
    import subprocess

    import tomllib

    from maceq.app.launch import starts_local_workers

    scripts = tomllib.loads((Path(maceq.__file__).parent / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"quantize": "maceq.app.launch:quantize_main", "maceq": "maceq.app.launch:maceq_main"}
    code = "import sys, maceq.app.launch; print(sorted(m for m in ('numpy', 'onnx', 'onnxruntime', 'maceq.app.cli') " \
           "if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
    yes = [["eval", "m.yml", "--images", "d", "--workers", "2"], ["report", "--workers=8", "m.yml"],
           ["m.onnx", "--workers", "3", "--executor", "local"], ["--executor=local", "--workers=16"]]
    no = [["eval", "m.yml"], ["eval", "--workers", "1"], ["--workers", "4", "--executor", "ray"],
          ["--executor=ray", "--workers=4"], ["--workers"], ["--workers", "two"], ["--workers=-3"], ["eval", "2"]]
    assert [starts_local_workers(a) for a in yes] == [True] * 4
    assert [starts_local_workers(a) for a in no] == [False] * 8


def test_ray_runs_at_most_workers_tasks_at_once(ray_cluster):
    """On a cluster of more CPUs than ``workers``, the pool still runs ``workers`` tasks at a time (the evaluation
    gives it more shards than workers), and returns the results in item order."""
    import time

    from maceq.calibrate.parallel import TaskPool

    def stamp(shared, item, report):
        t0 = time.time()
        time.sleep(0.3)
        return shared, item, t0, time.time()

    with TaskPool("job", executor="ray", workers=1) as pool:
        got = pool.map(stamp, [0, 1, 2])
    assert [g[:2] for g in got] == [("job", 0), ("job", 1), ("job", 2)]
    spans = sorted(g[2:] for g in got)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # one after another, on a cluster of 2 CPUs


@pytest.fixture(scope="module")
def demo():
    from maceq.app.mixed import auto_mixed_precision

    assets = Path(maceq.__file__).parent / "datasets" / "default"
    cal = calibrate(assets / "fmnist_mobilenet.onnx", assets / "calib", preprocess=PRESETS["fmnist"], progress=False)
    data = ImageFolder(assets / "test", PRESETS["fmnist"], classes=FASHION_MNIST_CLASSES)
    data.files, data.labels = data.files[::10], data.labels[::10]  # 10 images, every class

    def run(out, **kw):
        return auto_mixed_precision(cal, output_dir=out, eval_data=data, budget_points=0.0, device="cpu",
                                    progress=False, **kw)
    run.data = data
    return cal, run


def test_mixed_precision_on_ray_equals_sequential(demo, ray_cluster, tmp_path):
    from maceq.app.mixed import _EvalJob, _measure_task, greedy
    from maceq.calibrate.parallel import TaskPool

    cal, run = demo
    # a floor above every op: the search keeps ops in float32 one measured step at a time, up to the cap
    seq = run(tmp_path / "seq", min_sqnr=1000.0, max_fp32_layers=3)
    assert [s.step for s in seq.trail] == [0, 1, 2, 3] and not seq.ok
    par = run(tmp_path / "ray", min_sqnr=1000.0, max_fp32_layers=3, executor="ray", workers=2)
    assert par.to_dict() == seq.to_dict()
    assert (tmp_path / "ray" / "fmnist_mobilenet.data").read_bytes() == \
        (tmp_path / "seq" / "fmnist_mobilenet.data").read_bytes()
    loc = run(tmp_path / "loc", min_sqnr=1000.0, max_fp32_layers=3, executor="local", workers=2)
    assert loc.to_dict() == seq.to_dict()
    # the greedy rounds: every shortlisted candidate measured at once on the pool, decided here, equal the
    # one-after-another search (a budget below 0 keeps it going until the cap or no gain)
    plain = run(tmp_path / "plain", shortlist=6)
    short = [c for c in plain.candidates if not c.below_floor]
    assert len(short) == 6 and {c.kind for c in short} == {"op", "tensor"}
    job = _EvalJob(cal, run.data, "cpu", 8, None, None)
    start = _measure_task(job, ())
    assert (start.value, start.sqnr_db, start.data_bytes) == \
        (plain.trail[0].value, plain.trail[0].sqnr_db, plain.trail[0].data_bytes)

    def here(sets):
        return [_measure_task(job, s) for s in sets]
    one = greedy(short, here, start=start, budget=-1.0, cap=4)
    for executor in ("ray", "local"):
        with TaskPool(job, executor=executor, workers=2) as pool:
            many = greedy(short, lambda sets: pool.map(_measure_task, sets), start=start, budget=-1.0, cap=4)
        assert many.chosen == one.chosen and many.message == one.message
        assert [(r.candidate, r.measured, [(g, c) for g, c, _ in r.scored]) for r in many.rounds] == \
            [(r.candidate, r.measured, [(g, c) for g, c, _ in r.scored]) for r in one.rounds]
    assert one.rounds and len(one.rounds[0].scored) == 6


@pytest.mark.parametrize("workers", [2, 3])
def test_evaluation_sharded_over_workers_equals_one_process(demo, tmp_path, workers, monkeypatch):
    """Whole batches per shard, more shards than workers (each worker takes several, keeping its models), counts
    summed: every number, labels and an unreadable file included."""
    from maceq.calibrate.parallel import TaskPool
    from maceq.quant.export import write_quantized
    from maceq.reports.evaluate import evaluate
    from maceq.runtime import load

    sizes = []
    real_map = TaskPool.map

    def counting_map(self, fn, items, **kw):
        sizes.extend(len(shard.files) for _, shard in items)
        return real_map(self, fn, items, **kw)

    monkeypatch.setattr(TaskPool, "map", counting_map)

    cal, _ = demo
    model = load(write_quantized(cal, output_dir=tmp_path / "m").files.yml)
    assets = Path(maceq.__file__).parent / "datasets" / "default"
    data = ImageFolder(assets / "test", PRESETS["fmnist"], classes=FASHION_MNIST_CLASSES)
    data.files, data.labels = data.files[::4], data.labels[::4]  # 25 images, every class
    bad = tmp_path / "zz_bad.png"
    bad.write_bytes(b"not an image")
    data.files.append(bad)
    data.labels = np.append(data.labels, data.labels[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnreadableImageWarning)
        one = evaluate(model, assets / "fmnist_mobilenet.onnx", data, batch_size=4, progress=False)
        many = evaluate(model, assets / "fmnist_mobilenet.onnx", data, batch_size=4, progress=False, workers=workers)
    assert one.images == 25 and one.skipped == 1 and one.float_accuracy is not None
    assert many.to_dict() == one.to_dict()
    assert sizes == [4, 4, 4, 4, 4, 4, 2]  # 26 files in batches of 4: 7 shards for 2 or 3 workers


def test_an_evaluation_worker_keeps_its_models_from_shard_to_shard(demo, tmp_path):
    """A worker's later shards of a job reuse the models (with their prepared plans) and the float session of its
    first; a new job's replace them. The tallies are those of one pass over the same images."""
    from maceq.quant.export import write_quantized
    from maceq.reports import evaluate as ev
    from maceq.runtime import load

    cal, _ = demo
    model = load(write_quantized(cal, output_dir=tmp_path / "m").files.yml)
    assets = Path(maceq.__file__).parent / "datasets" / "default"
    data = ImageFolder(assets / "test", PRESETS["fmnist"], classes=FASHION_MNIST_CLASSES)
    data.files, data.labels = data.files[:12], data.labels[:12]
    job = ev.eval_job({"cpu": model}, assets / "fmnist_mobilenet.onnx", 4)
    first = ev._eval_shard(job, (("cpu",), data.shard(0, 8)), None)["cpu"]
    kept = ev._WORKER_JOB[1]["cpu"], next(iter(ev._WORKER_JOB[2].values()))
    second = ev._eval_shard(job, (("cpu",), data.shard(8, 12)), None)["cpu"]
    assert (ev._WORKER_JOB[1]["cpu"], next(iter(ev._WORKER_JOB[2].values()))) == kept
    assert kept[0] is not model and kept[0]._prepared  # its own model, prepared on the first shard
    first.add(second)
    whole = ev._eval_shard(ev.eval_job({"cpu": model}, assets / "fmnist_mobilenet.onnx", 4),
                           (("cpu",), data.shard(0, 12)), None)["cpu"]
    assert ev._WORKER_JOB[1]["cpu"] is not kept[0]  # another job: models made afresh
    assert (first.images, first.agree, first.top5, first.f_correct, first.q_correct) == \
        (whole.images, whole.agree, whole.top5, whole.f_correct, whole.q_correct) and first.images == 12
    assert first.sqnr_db() == whole.sqnr_db()
