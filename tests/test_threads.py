"""The cpu simulation's threads (runtime/threads.py) and its BLAS binding (runtime/kernels/blas.py).

- A whole quantized MobileNetV2 (pointwise, im2col and depthwise convolutions, Eltwise, the input
  Quantize) computes every tensor bit for bit the same with 1, 2 and 3 threads, and the same as
  the numpy paths (MACEQ_NO_JIT=1), which tests/test_fast_paths.py checks against the ``*_ref``
  kernels.
- The compiled code's GEMM through numpy's CBLAS equals numpy's matmul on exact integer matrices.
- MACEQ_NUM_THREADS is validated, and a run leaves BLAS's thread count as it found it.
- A run without intermediates drops each tensor after its last reader.
"""
from __future__ import annotations

import subprocess
import sys
import time
import weakref

import numpy as np
import pytest
from numba import njit, prange

from maceq.app.pipeline import quantize
from maceq.datasets.images import ImageFolder
from maceq.datasets.preprocess import PRESETS
from maceq.errors import MaceqError
from maceq.quant.config import QuantConfig
from maceq.runtime import threads
from maceq.runtime.kernels import blas, jit
from maceq.runtime.model import load


@pytest.fixture(scope="module", autouse=True)
def _compiled_loops():
    """This module tests the compiled loops' threads: they run here even where the session sets MACEQ_NO_JIT."""
    with pytest.MonkeyPatch.context() as m:
        m.delenv("MACEQ_NO_JIT", raising=False)
        yield


@pytest.fixture(scope="module")
def mnv2(shared_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("mnv2")
    res = quantize(shared_data / "models" / "mobilenet_v2.onnx", shared_data / "photos" / "calib", output_dir=out,
                   preprocess=PRESETS["imagenet"], config=QuantConfig(max_images=8), progress=False)
    images = ImageFolder(shared_data / "photos" / "eval", PRESETS["imagenet"], labels=None, limit=3)
    return load(res.files.yml), next(images.iter_batches(3)).data


def _tensors(model, x, **kw) -> dict:
    return {name: t.values for name, t in model.run({"input": x}, intermediates=True, **kw).tensors.items()}


def test_every_tensor_is_the_same_with_any_number_of_threads(mnv2, monkeypatch):
    model, x = mnv2
    assert jit.gemm_available()
    runs = {n: _tensors(model, x, threads=n) for n in (1, 2, 3)}
    monkeypatch.setenv("MACEQ_NO_JIT", "1")  # the numpy paths: no numba, no BLAS binding
    numpy_run = _tensors(model, x)
    assert len(numpy_run) > 60  # every op output of the 66-op graph
    for n, run in runs.items():
        assert run.keys() == numpy_run.keys()
        bad = [name for name, v in numpy_run.items() if not np.array_equal(run[name], v)]
        assert not bad, (n, bad[:5])


def test_input_quantize_range_is_per_batch(mnv2):
    """MACE's input Quantize finds its range over the whole batch: the threads must not split it per image."""
    model, x = mnv2
    q_name = next(op.outputs[0] for op in model.ops if op.type == "Quantize")
    batch = model.run({"input": x}, intermediates=True, threads=3).tensors[q_name]
    lo, hi = float(x.min()), float(x.max())
    assert batch.qinfo.scale == pytest.approx((hi - min(lo, 0.0)) / 255, rel=1e-6)
    first = model.run({"input": x[:1]}, intermediates=True, threads=3).tensors[q_name]
    lo1, hi1 = float(x[:1].min()), float(x[:1].max())
    assert (lo1, hi1) != (lo, hi)  # the images differ in range, so the check above means something
    assert first.qinfo.scale == pytest.approx((hi1 - min(lo1, 0.0)) / 255, rel=1e-6)


@njit(parallel=True)
def _blocked_gemm(addr, bits64, a, b, c, blocks):
    n, k = a.shape
    step = (n + blocks - 1) // blocks
    for i in prange(blocks):
        r0 = i * step
        m = min(step, n - r0)
        if m > 0:
            if bits64:
                blas.call_gemm64(addr, m, b.shape[1], k, a[r0:], k, b, b.shape[1], c[r0:], b.shape[1])
            else:
                blas.call_gemm32(addr, m, b.shape[1], k, a[r0:], k, b, b.shape[1], c[r0:], b.shape[1])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_blas_binding_equals_numpy_matmul(dtype):
    gm = blas.gemm()
    assert gm is not None and gm.int_bits in (32, 64)
    rng = np.random.default_rng(11)
    # integer entries whose products and sums are exact in float32 (K * 127 * 127 < 2^24)
    a = rng.integers(-127, 128, (301, 37)).astype(dtype)
    b = rng.integers(-127, 128, (37, 29)).astype(dtype)
    c = np.full((301, 29), np.nan, dtype)
    with blas.single_threaded():
        _blocked_gemm(gm.sgemm if dtype == np.float32 else gm.dgemm, gm.int_bits == 64, a, b, c, 4)
    assert np.array_equal(c, (a.astype(np.int64) @ b.astype(np.int64)).astype(dtype))


def test_thread_settings(monkeypatch):
    monkeypatch.setenv("MACEQ_NUM_THREADS", "zero")
    with pytest.raises(MaceqError, match="MACEQ_NUM_THREADS"):
        threads.default_threads()
    monkeypatch.setenv("MACEQ_NUM_THREADS", "1")
    assert threads.default_threads() == 1
    with pytest.raises(MaceqError):
        threads.limit(0)
    threads.limit(1)
    try:
        assert threads.current() == 1
    finally:
        threads.limit(None)


def test_the_default_leaves_out_the_cpus_other_processes_keep_busy(monkeypatch):
    monkeypatch.delenv("MACEQ_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "default_threads", lambda: 4)
    for busy, want in ((None, 4), (0, 4), (1, 3), (3, 1), (9, 1)):
        monkeypatch.setattr(threads, "busy_cpus", lambda busy=busy: busy)
        assert threads.current() == want
    threads.limit(2)  # an explicit count is kept however busy the machine is
    try:
        assert threads.current() == 2
    finally:
        threads.limit(None)
    monkeypatch.setenv("MACEQ_NUM_THREADS", "4")  # an explicit MACEQ_NUM_THREADS too (default_threads reads it)
    monkeypatch.setattr(threads, "busy_cpus", lambda: 9)
    assert threads.current() == 4


def test_the_default_reads_the_busy_cpus_once_in_a_while(monkeypatch):
    """current() asks busy_cpus (its /proc reads) at most once per BUSY_TTL_S: each model run asks current()."""
    monkeypatch.delenv("MACEQ_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "default_threads", lambda: 4)
    asked = []
    monkeypatch.setattr(threads, "busy_cpus", lambda: asked.append(1) or 1)
    assert [threads.current() for _ in range(5)] == [3] * 5 and len(asked) == 1
    monkeypatch.setattr(threads, "BUSY_TTL_S", 0.0)
    assert [threads.current() for _ in range(3)] == [3] * 3 and len(asked) == 4


def test_busy_cpus_counts_a_busy_loop_neighbour_and_not_this_process():
    base = threads.busy_cpus()
    assert base is not None and base >= 0
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        seen = [threads.busy_cpus() for _ in range(20)]
    finally:
        spin.kill()
        spin.wait()
    # the spinning process is always running or ready to run; /proc/loadavg and this process's own thread states
    # are two reads, not one snapshot, so one of our threads waking between them can hide it from a sample (seen
    # once in a CI run: at least one sample of 20)
    assert sum(n >= 1 for n in seen) >= 18, seen


def test_a_run_restores_blas_threads(mnv2):
    """numpy's BLAS (the one the compiled kernels call) runs on one thread once a run's compiled convolutions
    start, and as before after the run."""
    from threadpoolctl import ThreadpoolController

    model, x = mnv2
    path = blas.gemm().path

    def numpy_blas_threads() -> int:
        return next(i["num_threads"] for i in ThreadpoolController().info() if i["filepath"] == path)

    before = numpy_blas_threads()
    seen = []
    model.run({"input": x[:1]}, threads=2, before_op=lambda i, op, ins: seen.append(numpy_blas_threads()) and False)
    first_conv = next(i for i, op in enumerate(model.ops) if op.type == "Conv2D")
    assert len(seen) == len(model.ops)
    # held from the first compiled convolution to the end of the run, not before it
    assert seen[:first_conv + 1] == [before] * (first_conv + 1) and set(seen[first_conv + 1:]) == {1}
    assert numpy_blas_threads() == before
    # a run on one thread holds BLAS to one thread from its start (threads.section, whatever the device:
    # the gpu and dsp kernels' numpy GEMMs too)
    seen.clear()
    model.run({"input": x[:1]}, threads=1, before_op=lambda i, op, ins: seen.append(numpy_blas_threads()) and False)
    assert seen[:first_conv + 1] == [1] * (first_conv + 1) and set(seen) == {1}
    assert numpy_blas_threads() == before


def test_gpu_and_dsp_runs_hold_blas_from_their_start():
    """The gpu and dsp kernels call numpy's BLAS on GEMMs too small to share, beside numba's threads: their runs
    hold BLAS to one thread from the start (Model.section); a cpu run holds it only from its first compiled
    convolution."""
    from threadpoolctl import ThreadpoolController

    from maceq.runtime.model import Model

    path = blas.gemm().path

    def numpy_blas_threads() -> int:
        return next(i["num_threads"] for i in ThreadpoolController().info() if i["filepath"] == path)

    before = numpy_blas_threads()
    for device in ("gpu", "dsp"):
        with Model.section(device, 2):
            assert numpy_blas_threads() == 1
        assert numpy_blas_threads() == before
    with Model.section("cpu", 2):
        assert numpy_blas_threads() == before


def test_a_run_drops_each_tensor_after_its_last_reader(mnv2, monkeypatch):
    # without intermediates a run holds the tensors still to be read only (MobileNetV2: a handful, against every
    # tensor of the graph with them), and gives the same outputs
    from maceq.runtime.kernel import PreparedOp

    model, x = mnv2
    dropped = [name for names in model._drops for name in names]
    assert len(dropped) == len(set(dropped)) and not set(dropped) & set(model.output_names)
    for idx, names in enumerate(model._drops):
        assert not any(name in op.inputs for op in model.ops[idx + 1:] for name in names)
    refs, alive = [], []
    real = PreparedOp.run_stored

    def spy(self, ins):
        out = real(self, ins)
        alive.append(sum(r() is not None for r in refs))
        refs.extend(weakref.ref(t.values) for t in out)
        return out

    monkeypatch.setattr(PreparedOp, "run_stored", spy)
    kept = model.run({"input": x}, intermediates=True)
    most_kept = max(alive)
    refs.clear()
    alive.clear()
    outputs = model.run({"input": x})
    assert most_kept == len(model.ops) - 1 and max(alive) <= 4, (most_kept, max(alive))
    assert outputs.keys() == kept.outputs.keys()
    assert all(np.array_equal(outputs[k], kept.outputs[k]) for k in outputs)


def test_a_section_reads_the_settings_once(monkeypatch):
    """Inside a section (one model run) the thread count and the environment's settings are the ones the run began
    with; outside, every call reads them again; a nested section has its own and gives the outer one back."""
    import numba

    from maceq.runtime.kernels import intgemm

    monkeypatch.delenv("MACEQ_NO_JIT", raising=False)
    monkeypatch.delenv("MACEQ_NO_INTGEMM", raising=False)
    assert threads.run_memo() is None
    have = intgemm.supported()
    with threads.section(2) as n:
        assert threads.run_memo()["threads"] == jit._num_threads() == numba.get_num_threads() == n
        assert jit.available() and intgemm.supported() == have
        monkeypatch.setenv("MACEQ_NO_JIT", "1")
        assert jit.available() and intgemm.supported() == have  # the run's own settings
        with threads.section(1):
            assert not jit.available() and intgemm.supported() == () and jit._num_threads() == 1
        assert jit.available() and jit._num_threads() == n
    assert threads.run_memo() is None
    assert not jit.available() and intgemm.supported() == ()
    monkeypatch.delenv("MACEQ_NO_JIT")
    assert jit.available() and intgemm.supported() == have
