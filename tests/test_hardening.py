"""Hardening: determinism, interruption safety, numerical edge cases, safety.

docs/edge-cases.md lists each behaviour and the test here that proves it. The oracles are
independent of the code under test: the bytes of a first run (determinism), onnxruntime run one
image at a time with numpy min/max (range order independence, single-image calibration), the
files' own sha256 checksums and the bytes of two complete reference runs (interruption), and
transcriptions of MACE's C++ (mace/core/quantize.h AdjustRange/FindMinMax, NEON FCVTZS) written
out by hand in the tests.
"""
from __future__ import annotations

import ast
import hashlib
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
import zlib
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

from maceq.calibrate.methods import RangeMethod, compute_range
from maceq.calibrate.runner import collect
from maceq.datasets.images import ImageFolder, load_image
from maceq.datasets.preprocess import Preprocess, preprocess_from_args
from maceq.errors import MaceqError
from maceq.quant.config import QuantConfig
from maceq.mace.format import check_model_name, read_model, read_ranges, write_model
from maceq.app.pipeline import quantize
from maceq.quant.prepare import prepare_graph, tensors_to_calibrate
from maceq.runtime.kernels import quantize as k_quant
from maceq.runtime.model import load

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "datasets" / "default"
DEMO = ASSETS / "fmnist_mobilenet.onnx"
CALIB = ASSETS / "calib"
NAME = "m"  # model name of the interruption runs
FILES = (f"{NAME}.pb", f"{NAME}.data", f"{NAME}_ranges.txt", f"{NAME}.yml")
GRAY = Preprocess.from_dict({"color": "gray", "scale": 1 / 255})


def _env() -> dict:
    env = dict(os.environ)
    env.pop("MACEQ_KILL_POINT", None)
    env["OMP_NUM_THREADS"] = "1"  # two runs share 2 cores
    return env


def _cli(args: list[str]) -> subprocess.Popen:
    code = "import sys; from maceq.app.cli import quantize_main; sys.exit(quantize_main(sys.argv[1:]))"
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env())


def _finish(p: subprocess.Popen, timeout: float = 120) -> str:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, f"quantize failed ({p.returncode}):\n{out}\n{err}"
    return out


# ------------------------------------------------------------------------------------------------
# 3. Determinism
# ------------------------------------------------------------------------------------------------

def test_rerun_gives_bit_identical_outputs(tmp_path):
    """Two runs of the demo (`quantize -o DIR --max-images 16`, which also evaluates and writes
    report.json; evaluated on 20 of its test images, two per class, to keep the test short), into
    two folders at once: every output file is byte-identical, the .yml's checksums are those of
    the .pb/.data, and no output mentions the folder it was written to. The files carry no
    timestamp at all (so none can leak into a checksummed file)."""
    evals = tmp_path / "eval"
    for cls in sorted((ASSETS / "test").iterdir()):
        (evals / cls.name).mkdir(parents=True)
        for f in sorted(cls.iterdir())[:2]:
            shutil.copy(f, evals / cls.name / f.name)
    a, b = tmp_path / "a", tmp_path / "b"
    runs = [_cli(["-o", str(d), "--max-images", "16", "--eval-dir", str(evals), "-q"]) for d in (a, b)]
    for p in runs:
        _finish(p, timeout=300)
    names = ["fmnist_mobilenet.pb", "fmnist_mobilenet.data", "fmnist_mobilenet_ranges.txt", "fmnist_mobilenet.yml",
             "report.json", "report.html"]
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n
    doc = yaml.safe_load((a / "fmnist_mobilenet.yml").read_text())
    entry = doc["models"]["fmnist_mobilenet"]
    assert entry["model_sha256_checksum"] == hashlib.sha256((a / "fmnist_mobilenet.pb").read_bytes()).hexdigest()
    assert entry["weight_sha256_checksum"] == hashlib.sha256((a / "fmnist_mobilenet.data").read_bytes()).hexdigest()
    for n in names:
        assert str(a).encode() not in (a / n).read_bytes(), n
    assert sorted(p.name for p in a.iterdir()) == sorted(names)  # nothing else, no staging folder left


def _per_image_minmax(onnx_model: onnx.ModelProto, names: list[str], files: list[Path], pre: Preprocess):
    """Oracle: onnxruntime on one image at a time, numpy min/max over all images (no maceq stats)."""
    from maceq.calibrate.runner import expose_outputs

    in_name = onnx_model.graph.input[0].name
    sess = ort.InferenceSession(expose_outputs(onnx_model, names).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    fetch = [n for n in names if n != in_name]
    lo = {n: np.inf for n in names}
    hi = {n: -np.inf for n in names}
    for f in files:
        x = load_image(f, pre)
        for n, v in zip([in_name] + fetch, [x] + sess.run(fetch, {in_name: x})):
            lo[n], hi[n] = min(lo[n], float(v.min())), max(hi[n], float(v.max()))
    return {n: (lo[n], hi[n]) for n in names}


def test_min_max_ranges_do_not_depend_on_image_order():
    """The demo's optimised graph, calibrated on its 50 images in three orders and batchings
    (sorted by 8, reversed by 5, shuffled by 1): identical statistics (counts, min/max and
    histogram bins), hence identical min_max and percentile ranges, and the min_max ranges equal
    the per-image onnxruntime min/max."""
    pre = preprocess_from_args("fmnist")
    g, _, _ = prepare_graph(DEMO, input_shape=None, preprocess=pre)
    names = tensors_to_calibrate(g)
    model = g.to_onnx()
    in_name = g.inputs[0].name
    files = list(ImageFolder(CALIB, pre, labels=None).files)
    orders = [(files, 8), (files[::-1], 5), (list(np.random.default_rng(7).permutation(np.array(files, object))), 1)]
    results = []
    for order, bs in orders:
        data = ImageFolder(CALIB, pre, labels=None)
        data.files = list(order)
        results.append(collect(model, names, data.iter_batches(bs), input_name=in_name, progress=False))
    for other in results[1:]:
        for n in names:
            assert other[n] == results[0][n], n
    oracle = _per_image_minmax(model, names, files, pre)
    for st in results:
        for n in names:
            assert compute_range(st[n], RangeMethod.MIN_MAX) == oracle[n], n
            assert compute_range(st[n], RangeMethod.PERCENTILE) == compute_range(results[0][n], RangeMethod.PERCENTILE)


# ------------------------------------------------------------------------------------------------
# 4. Interruption safety
# ------------------------------------------------------------------------------------------------

#: The child: the real `quantize` CLI, with os.replace and the writer's directory fsync wrapped so
#: that they announce themselves on stderr; at the announcement named by MACEQ_KILL_POINT the
#: child stops (sleeps) and the parent SIGKILLs it, exactly at that moment of the write.
KILL_CHILD = textwrap.dedent("""
    import os, sys, time
    import maceq.mace.format as fmt
    point = os.environ.get("MACEQ_KILL_POINT", "")
    def announce(tag):
        sys.stderr.write("@@ " + tag + "\\n"); sys.stderr.flush()
        if tag == point:
            time.sleep(120)
    real_replace, real_fsync_dir = os.replace, fmt._fsync_dir
    def replace(src, dst, *a, **k):
        announce("replace:" + os.path.basename(str(dst)))
        return real_replace(src, dst, *a, **k)
    def fsync_dir(folder):
        real_fsync_dir(folder)
        announce("fsync:" + ("staging" if os.path.basename(str(folder)).startswith(".") else "out"))
    os.replace = replace
    fmt._fsync_dir = fsync_dir
    from maceq.app.cli import quantize_main
    sys.exit(quantize_main(sys.argv[1:]))
""")

#: Every moment of the write: all staged (nothing touched yet); old .yml and .pb removed; new .data
#: in; new .pb in; new range file in; complete but the staging folder not yet removed.
WRITE_POINTS = ["fsync:staging", f"replace:{NAME}.data", f"replace:{NAME}.pb", f"replace:{NAME}_ranges.txt",
                f"replace:{NAME}.yml", "fsync:out"]


def _quantize_args(out: Path, n_images: int) -> list[str]:
    return [str(DEMO), "--calib-dir", str(CALIB), "--preset", "fmnist", "--max-images", str(n_images),
            "-o", str(out), "--name", NAME, "-q"]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {n: (folder / n).read_bytes() for n in FILES if (folder / n).is_file()}


def _kill_run(out: Path, *, point: str | None = None, after_s: float | None = None) -> str:
    """Start the new run into ``out`` and SIGKILL it at ``point`` (an announcement) or after ``after_s``."""
    env = _env()
    env["MACEQ_KILL_POINT"] = point or ""
    p = subprocess.Popen([sys.executable, "-c", KILL_CHILD, *_quantize_args(out, 16)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, env=env)
    try:
        if point is not None:
            seen = []
            for line in p.stderr:
                seen.append(line.strip())
                if line.strip() == f"@@ {point}":
                    break
            else:
                pytest.fail(f"the run ended before {point!r}; it announced {seen}")
        else:
            time.sleep(after_s)
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.wait(timeout=60)
        p.stderr.close()
    return "killed" if p.returncode == -signal.SIGKILL else f"finished ({p.returncode})"


def _check_consistent(out: Path, versions: dict[str, dict[str, bytes]]) -> str:
    """The invariant after a kill: a .yml is present only beside the complete set of one run (its
    checksums verify); without it, a .pb and a .data that are both present come from one run.
    Returns which state was found."""
    got = _snapshot(out)

    def version_of(name):
        return {label for label, files in versions.items() if files.get(name) == got[name]}

    for n in got:
        assert version_of(n), f"{n} is from neither run"
    if f"{NAME}.yml" in got:
        common = set.intersection(*(version_of(n) for n in got))
        assert len(got) == 4 and common, f"a .yml beside files of another run: {sorted(got)}"
        m = read_model(out / f"{NAME}.yml")
        assert m.checksums_verified
        return f"complete {sorted(common)[0]}"
    if f"{NAME}.pb" in got and f"{NAME}.data" in got:
        common = version_of(f"{NAME}.pb") & version_of(f"{NAME}.data")
        assert common, "a .pb beside the .data of another run"
        read_model(out / f"{NAME}.pb")  # loads: the pair belongs together
        return f"no model (pair of {sorted(common)[0]})"
    with pytest.raises(MaceqError):
        read_model(out / f"{NAME}.yml")
    return "no model"


def test_sigkill_at_any_moment_leaves_the_old_set_or_no_model_and_a_rerun_succeeds(tmp_path):
    """`quantize` is killed (SIGKILL) over a folder that holds a previous complete model, at each
    moment of the write (6 points) and at two moments of a normal run's duration, and once over an
    empty folder: every time the folder holds the previous complete set, or no .yml, and never a
    .pb beside another run's .data; a .yml present always verifies. A later run then succeeds and
    its files are those of an uninterrupted run, with no staging folder left over."""
    ref_old, ref_new = tmp_path / "ref_old", tmp_path / "ref_new"
    t0 = time.monotonic()
    _finish(_cli(_quantize_args(ref_old, 4)))
    normal_s = time.monotonic() - t0
    _finish(_cli(_quantize_args(ref_new, 16)))
    versions = {"old": _snapshot(ref_old), "new": _snapshot(ref_new)}
    assert len(versions["old"]) == len(versions["new"]) == 4
    for n in FILES:  # each file tells the two runs apart, so a mixed set cannot hide
        assert versions["old"][n] != versions["new"][n], n

    expect = {"fsync:staging": "complete old", f"replace:{NAME}.data": "no model",
              f"replace:{NAME}.pb": "no model", f"replace:{NAME}_ranges.txt": "no model (pair of new)",
              f"replace:{NAME}.yml": "no model (pair of new)", "fsync:out": "complete new"}
    work = tmp_path / "work"
    for frac in (0.3, 0.7):  # during start-up / calibration
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(ref_old, work)
        _kill_run(work, after_s=frac * normal_s)
        _check_consistent(work, versions)  # whatever the moment, the invariant holds
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert _kill_run(fresh, point=f"replace:{NAME}.pb") == "killed"
    assert _check_consistent(fresh, {"new": versions["new"]}) == "no model"
    # The write points, the one between the renames last: its debris is what the final run meets.
    for point in sorted(WRITE_POINTS, key=lambda p: p == f"replace:{NAME}_ranges.txt"):
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(ref_old, work)
        assert _kill_run(work, point=point) == "killed"
        assert _check_consistent(work, versions) == expect[point], point
        if point == "fsync:staging":
            assert _snapshot(work) == versions["old"]  # untouched, byte for byte

    # A later run over that debris (new .pb/.data, the old range file, no .yml, the killed
    # writer's staging folder) succeeds and cleans up.
    assert any(p.name.startswith(f".{NAME}.staging-") for p in work.iterdir())
    _finish(_cli(_quantize_args(work, 16)))
    assert _snapshot(work) == versions["new"]
    assert sorted(p.name for p in work.iterdir()) == sorted(FILES)
    m = load(work / f"{NAME}.yml")
    x = load_image(next(iter(ImageFolder(CALIB, preprocess_from_args("fmnist"), labels=None).files)),
                   preprocess_from_args("fmnist"))
    assert np.isfinite(m.run({m.input_names[0]: x})[m.output_names[0]]).all()


# ------------------------------------------------------------------------------------------------
# 5. Numerical edge cases
# ------------------------------------------------------------------------------------------------

def _tiny_model(path: Path, *, w2=None, b2=None) -> Path:
    """x[N,1,8,8] -> conv1 3x3 (4 ch) -> relu1 -> conv2 3x3 (4 ch) -> relu2 -> gap -> flat -> fc (3) -> y."""
    rng = np.random.default_rng(0)
    w1 = rng.normal(size=(4, 1, 3, 3)).astype(np.float32)
    b1 = rng.normal(size=4).astype(np.float32)
    w2 = (rng.normal(size=(4, 4, 3, 3)) * 0.3).astype(np.float32) if w2 is None else np.asarray(w2, np.float32)
    b2 = rng.normal(size=4).astype(np.float32) if b2 is None else np.asarray(b2, np.float32)
    wf, bf = rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=3).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
             helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
             helper.make_node("GlobalAveragePool", ["r2"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "wf", "bf"], ["y"], transB=1, name="fc")]
    inits = [numpy_helper.from_array(v, k) for k, v in dict(w1=w1, b1=b1, w2=w2, b2=b2, wf=wf, bf=bf).items()]
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], inits)
    _save(graph, path)
    return path


def _save(graph, path: Path) -> None:
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    onnx.save(m, path)


def _images(folder: Path, arrays) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for k, a in enumerate(arrays):
        Image.fromarray(np.asarray(a, np.uint8)).save(folder / f"{k:02d}.png")
    return folder


def _random_images(folder: Path, n: int = 4, *, low: int = 0) -> Path:
    rng = np.random.default_rng(1)
    return _images(folder, [rng.integers(low, 256, (8, 8)) for _ in range(n)])


def _quantize(onnx_path: Path, calib: Path, out: Path, **config):
    cfg = QuantConfig(range_method=RangeMethod.MIN_MAX, **config)
    return quantize(onnx_path, calib, output_dir=out, preprocess=GRAY, config=cfg, progress=False)


def _ort(onnx_path: Path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def test_constant_zero_input_is_quantized_as_mace_does_and_fails_at_the_first_requantizing_op(shared_data):
    """MACE's input Quantize op (find_range_every_time) on a constant-zero input: FindMinMax gives
    [0, 0]; AdjustRange<uint8_t> gives scale (0 - 0) / 255 = 0 and, since out_min > -kEps, zero
    point quantized_min = 0; recip = 1/0 = inf, 0 * inf = NaN, FCVTZS(NaN) = 0: every code is 0,
    with no floating-point warning. An all-NaN input ends the same way (FindMinMax leaves
    (FLT_MAX, -FLT_MAX), both clamped to 0). A constant 0.5 is fine: range [0, 0.5], codes 255
    (trunc(0.5 * f32(1/f32(0.5/255)) + 0.5)). On MACE's own Fashion-MNIST model the zero input
    then stops at the first Conv2D (MACE aborts in GetBiasData/GetOutputMultiplierAndShift):
    maceq raises a MaceqError that says so; the constant 0.5 input runs."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x in (np.zeros((1, 28, 28, 1), np.float32), np.full(17, np.nan, np.float32)):
            codes, scale, zp = k_quant.quantize(x)
            assert (scale, zp) == (0.0, 0) and codes.dtype == np.uint8 and not codes.any()
            assert np.array_equal(k_quant.quantize_neon_ref(x, scale=scale, zero_point=zp), codes)
        codes, scale, zp = k_quant.quantize(np.full(33, 0.5, np.float32))
    f32 = np.float32
    s = f32(f32(0.5) / f32(255))
    body = int(f32(f32(f32(0.5) * f32(f32(1) / s)) + f32(0.5)))  # NEON body: vmla then truncation
    assert (scale, zp) == (float(s), 0) and body == 255 and (codes == body).all()

    model = load(shared_data / "mace_reference" / "fmnist_q8.yml")
    name = model.input_names[0]
    shape = (1,) + tuple(model.input_shape(name)[1:])
    with pytest.raises(MaceqError, match=r"input scale x weight scale is 0 .*constant-zero input.*MACE_CHECK"):
        model.run({name: np.zeros(shape, np.float32)})
    y = model.run({name: np.full(shape, 0.5, np.float32)})
    assert all(np.isfinite(v).all() for v in y.values())


def test_constant_nonzero_activation_is_quantized_normally(tmp_path):
    """Calibration images that are all one grey level: the input tensor is constant 128/255 on
    every image. Its range [c, c] is widened to include 0 ([0, c], as MACE's adjust_range does),
    so it quantizes like any other; the int8 model follows the float one (onnxruntime) to a few
    output steps."""
    onnx_path = _tiny_model(tmp_path / "m.onnx")
    calib = _images(tmp_path / "calib", [np.full((8, 8), 128)] * 3)
    res = _quantize(onnx_path, calib, tmp_path / "out")
    lo, hi = read_ranges(res.files.ranges)["x"]
    assert lo == hi == np.float32(128 / 255)
    x = load_image(calib / "00.png", GRAY)
    m = load(res.files.yml)
    got, want = m.run({"x": x})["y"], _ort(onnx_path, x)
    out_scale = m.net_def.output_info[0].scale
    assert np.abs(got - want).max() <= 4 * out_scale


def test_nan_or_inf_in_a_calibration_activation_names_the_tensor_and_the_image(tmp_path):
    """A model whose first op is Div(x, x): a black pixel gives 0/0 = NaN. Calibrating on four
    images of which only 02.png has one: MaceqError naming the tensor 'd' and that file. Fed as
    plain arrays instead of images, the error names the sample index."""
    nodes = [helper.make_node("Div", ["x", "x"], ["d"], name="div"),
             helper.make_node("Relu", ["d"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "nan", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1, 8, 8])])
    _save(graph, tmp_path / "nan.onnx")
    rng = np.random.default_rng(3)
    imgs = [rng.integers(1, 256, (8, 8)) for _ in range(4)]
    imgs[2][5, 6] = 0
    calib = _images(tmp_path / "calib", imgs)
    with pytest.raises(MaceqError) as info:
        _quantize(tmp_path / "nan.onnx", calib, tmp_path / "out", batch_size=3)
    msg = str(info.value)
    assert "tensor 'd'" in msg and "1 NaN and 0 Inf" in msg and f"image {calib / '02.png'}" in msg, msg
    assert len(msg.splitlines()) == 1

    model = onnx.load(tmp_path / "nan.onnx")
    batches = [np.stack([load_image(calib / f"{k:02d}.png", GRAY)[0] for k in ks]) for ks in ([0, 1], [2, 3])]
    with pytest.raises(MaceqError, match=r"tensor 'd': 1 NaN and 0 Inf value\(s\) .* on sample 2 "
                                         r"\(calibration batch 1\)"):
        collect(model, ["d"], batches, progress=False)


def _written_scales(files, op_name: str):
    m = read_model(files.yml)
    op = next(o for o in m.net_def.op if o.name == op_name)
    scale = {t.name: t.scale for t in m.net_def.tensors}
    for o in m.net_def.op:
        for name, qi in zip(o.output, o.quantize_info):
            scale[name] = qi.scale
    for i in m.net_def.input_info:
        scale.setdefault(i.name, i.scale)
    return scale[op.input[0]], scale[op.input[1]], op.quantize_info[0].scale


def test_multiplier_outside_0_1_is_written_then_refused_as_mace_aborts(tmp_path):
    """A 1x1 Conv with weight 1000 and bias -999 before a ReLU: the output lives in [0, 1] while
    input scale x weight scale is 1/255 x 1000/255, so s_in*s_w/s_out is about 3.9. MACE's converter
    writes such a model; its runtime aborts in GetOutputMultiplierAndShift (MACE_CHECK(real > 0 &&
    real < 1)). maceq writes it too, and running it raises a MaceqError quoting MACE's check and the
    float32 multiplier computed here from the stored scales."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv"),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    inits = [numpy_helper.from_array(np.full((1, 1, 1, 1), 1000, np.float32), "w"),
             numpy_helper.from_array(np.array([-999], np.float32), "b")]
    graph = helper.make_graph(nodes, "bigm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1, 8, 8])], inits)
    _save(graph, tmp_path / "bigm.onnx")
    imgs = [np.full((8, 8), 255) if k == 0 else np.random.default_rng(k).integers(0, 256, (8, 8)) for k in range(3)]
    res = _quantize(tmp_path / "bigm.onnx", _images(tmp_path / "calib", imgs), tmp_path / "out")
    m = load(res.files.yml)
    conv = next(o for o in m.net_def.op if o.type == "Conv2D")
    s_in, s_w, s_out = _written_scales(res.files, conv.name)
    f32 = np.float32
    real = f32(f32(f32(s_in) * f32(s_w)) / f32(s_out))
    assert real >= 1
    with pytest.raises(MaceqError, match=re.escape(f"MACE requires 0 < s_in*s_w/s_out < 1 (mace/core/quantize.h; "
                                                   f"the device aborts), got {float(real)!r}")):
        m.run({"x": load_image(tmp_path / "calib" / "00.png", GRAY)})


def test_tensor_that_is_zero_on_every_calibration_image_is_refused_by_name(tmp_path):
    """A ReLU that never fires on the calibration set (bias -1000): its output's range is [0, 0],
    for which MACE's adjust_range gives scale 0 (its runtime then aborts). quantize refuses with a
    MaceqError naming the tensor; so it does for an input that is 0 on every (black) image."""
    onnx_path = _tiny_model(tmp_path / "dead.onnx", b2=np.full(4, -1000.0))
    with pytest.raises(MaceqError) as info:
        _quantize(onnx_path, _random_images(tmp_path / "calib"), tmp_path / "out")
    assert re.search(r"tensor 'r2'.* 0 on every calibration image", str(info.value)), str(info.value)
    black = _images(tmp_path / "black", [np.zeros((8, 8))] * 2)
    with pytest.raises(MaceqError) as info:
        _quantize(_tiny_model(tmp_path / "m.onnx"), black, tmp_path / "out2")
    assert re.search(r"tensor 'x'.* 0 on every calibration image", str(info.value)), str(info.value)


def test_all_zero_weights_are_refused_by_layer_name(tmp_path):
    """conv2's weights are all 0 (bias non-zero): MACE's converter gives them scale 0 and its runtime
    aborts; quantize refuses with a MaceqError naming the layer."""
    onnx_path = _tiny_model(tmp_path / "zw.onnx", w2=np.zeros((4, 4, 3, 3)))
    with pytest.raises(MaceqError) as info:
        _quantize(onnx_path, _random_images(tmp_path / "calib"), tmp_path / "out")
    assert re.search(r"node 'conv2' \(Conv, fused as 'relu2'\): all weights are 0.*--fp32 conv2", str(info.value)), \
        str(info.value)


def test_all_zero_weights_run_in_float32_when_asked(tmp_path):
    """The way out the refusal points to: --fp32 conv2 keeps the zero-weight layer in float32; the
    model is written, and its output matches onnxruntime (conv2 computes its bias exactly)."""
    onnx_path = _tiny_model(tmp_path / "zw.onnx", w2=np.zeros((4, 4, 3, 3)), b2=[0.5, -0.25, 1.0, 0.75])
    calib = _random_images(tmp_path / "calib")
    res = _quantize(onnx_path, calib, tmp_path / "out", fp32_layers=("conv2",))
    assert res.placement["relu2"] == "float32"  # conv2 with its ReLU fused, named after the ReLU
    m = load(res.files.yml)
    x = load_image(calib / "01.png", GRAY)
    got, want = m.run({"x": x})["y"], _ort(onnx_path, x)
    assert np.abs(got - want).max() <= 4 * m.net_def.output_info[0].scale


def test_single_image_calibration(tmp_path):
    """A calibration set of one image (the folder argument may be the file itself): quantize works,
    the min_max range file holds exactly the per-tensor min/max of onnxruntime on that image, and
    the model runs it; the default percentile method works on one image too."""
    pre = preprocess_from_args("fmnist")
    one = next(iter(ImageFolder(CALIB, pre, labels=None).files))
    res = quantize(DEMO, one, output_dir=tmp_path / "mm", preprocess=pre,
                   config=QuantConfig(range_method=RangeMethod.MIN_MAX), progress=False)
    assert res.n_calib_images == 1
    ranges = read_ranges(res.files.ranges)
    oracle = _per_image_minmax(res.graph.to_onnx(), list(ranges), [one], pre)
    assert ranges == oracle
    res_p = quantize(DEMO, one, output_dir=tmp_path / "pct", preprocess=pre, progress=False)
    for r in (res, res_p):
        m = load(r.files.yml)
        assert np.isfinite(m.run({m.input_names[0]: load_image(one, pre)})[m.output_names[0]]).all()


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares width x height (8-bit grey) and holds one tiny IDAT: PIL reads the size
    from the header without decoding."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")
    ihdr = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 0, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def test_decompression_bombs_are_refused_with_a_clear_error(tmp_path):
    """Images declaring more pixels than MAX_IMAGE_PIXELS (89,478,485): one above PIL's own error
    threshold (30000 x 30000) and one between PIL's warning and error thresholds (10000 x 10000)
    raise a one-line MaceqError naming the file, before any decoding, from load_image and from
    ImageFolder.iter_batches (which does not skip them as unreadable)."""
    for w, h in ((30000, 30000), (10000, 10000)):
        d = tmp_path / f"{w}"
        d.mkdir()
        (d / "bomb.png").write_bytes(_png_header(w, h))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # and no PIL DecompressionBombWarning either
            with pytest.raises(MaceqError, match=r"bomb\.png: refused, .*89,478,485.*decompression-bomb"):
                load_image(d / "bomb.png", GRAY)
            with pytest.raises(MaceqError, match=r"bomb\.png: refused"):
                list(ImageFolder(d, GRAY, labels=None).iter_batches(1))


RSS_CHILD = textwrap.dedent("""
    import resource, sys
    from maceq.datasets.images import ImageFolder
    from maceq.datasets.preprocess import Preprocess
    folder = ImageFolder(sys.argv[1], Preprocess.from_dict({"resize": [224, 224]}), labels=None)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    n = sum(len(b.paths) for b in folder.iter_batches(3))
    print(n, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
""")


def test_very_large_images_are_streamed_in_bounded_memory(tmp_path):
    """Three 8000 x 6000 JPEGs (48 Mpixel; a full RGB decode is 137 MiB each) in one batch of 3:
    the process's peak memory grows by less than 64 MiB (libjpeg's DCT scaling decodes each at 1/4,
    one at a time). The batch equals, to within 1% of full scale, a full decode followed by the
    same resize, so it is the same picture."""
    g = Image.linear_gradient("L").resize((8000, 6000))
    img = Image.merge("RGB", (g, g.transpose(Image.Transpose.ROTATE_180), Image.new("L", g.size, 90)))
    d = tmp_path / "big"
    d.mkdir()
    img.save(d / "0.jpg", quality=85)
    for k in (1, 2):
        os.link(d / "0.jpg", d / f"{k}.jpg")
    out = subprocess.run([sys.executable, "-c", RSS_CHILD, str(d)], capture_output=True, text=True, env=_env(),
                         timeout=120)
    assert out.returncode == 0, out.stderr
    n, grew_kib = map(int, out.stdout.split())
    assert n == 3 and grew_kib < 64 * 1024, grew_kib
    pre = Preprocess.from_dict({"resize": [224, 224]})
    streamed = next(ImageFolder(d, pre, labels=None).iter_batches(1)).data[0]
    with Image.open(d / "0.jpg") as full:
        full.load()
        reference = pre.apply(full)
    assert np.abs(streamed - reference).mean() < 0.01


def _constant_of_shape_model(path: Path, value: np.ndarray) -> Path:
    nodes = [helper.make_node("ConstantOfShape", ["s"], ["c"], value=numpy_helper.from_array(value))]
    if value.dtype == bool:
        nodes.append(helper.make_node("Cast", ["c"], ["c_f"], to=TensorProto.FLOAT))
    nodes.append(helper.make_node("Add", ["x", nodes[-1].output[0]], ["y"]))
    graph = helper.make_graph(nodes, "cos", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
                              [numpy_helper.from_array(np.array([1, 2], np.int64), "s")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(m, path)
    return path


def test_fuzz_crashes_k3_to_k6_are_fixed(tmp_path):
    """Tensor attributes survive the IR (docs/fuzzing.md K3-K6): ConstantOfShape over a constant
    shape, with a float [1] value (valid ONNX, once refused) or a bool value then Cast (K4), folds
    to a constant and the optimised graph gives onnxruntime's output on the original model; a 0-d
    value (K3, which onnxruntime refuses) folds like the 1-element one. Conv strides=[] (K5) and a
    BatchNormalization with 3 parameters after a 2-channel Conv (K6) give one-line MaceqErrors."""
    x = np.array([[1.0, -3.0]], np.float32)
    for k, value in enumerate((np.array([2.5], np.float32), np.array([True]), np.array(2.5, np.float32))):
        path = _constant_of_shape_model(tmp_path / f"c{k}.onnx", value)
        g, _, _ = prepare_graph(path, input_shape=None)
        assert [n.op_type for n in g.nodes] == ["Add"]
        got = ort.InferenceSession(g.to_onnx().SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": x})[0]
        ref = path if value.ndim else _constant_of_shape_model(tmp_path / "ref.onnx", value.reshape(1))
        want = ort.InferenceSession(str(ref), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        assert np.array_equal(got, want)
    regress = REPO / "bench" / "fuzz_corpus" / "regress"
    for name, pattern in (("K5", r"Attribute strides has incorrect size"),
                          ("K6", r"node 'BatchNormalization_1' \(BatchNormalization\): scale has shape \[3\], "
                                 r"but 'Conv_0' \(Conv\) has 2 output channels")):
        with pytest.raises(MaceqError, match=pattern) as info:
            prepare_graph(regress / f"{name}.onnx_bytes", input_shape=None)
        assert len(str(info.value).splitlines()) == 1


# ------------------------------------------------------------------------------------------------
# 6. Safety
# ------------------------------------------------------------------------------------------------

_UNSAFE_CALLS = {("yaml", "load"), ("yaml", "unsafe_load"), ("yaml", "full_load"), ("yaml", "load_all"),
                 ("yaml", "unsafe_load_all"), ("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"),
                 ("marshal", "load"), ("marshal", "loads"), ("shelve", "open"), ("torch", "load"),
                 ("dill", "load"), ("joblib", "load")}


def _package_sources():
    for p in sorted(REPO.rglob("*.py")):
        rel = p.relative_to(REPO)
        if rel.parts[0] in ("tests", "bench", "build") or any(s.startswith(".") for s in rel.parts) \
                or "egg-info" in str(rel) or rel.name.endswith("_pb2.py"):
            continue
        yield rel, ast.parse(p.read_text(encoding="utf-8"), filename=str(rel))


def _unsafe(rel, tree) -> list[str]:
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                if (f.value.id, f.attr) in _UNSAFE_CALLS:
                    bad.append(f"{rel}:{node.lineno} {f.value.id}.{f.attr}")
                if f.value.id in ("np", "numpy") and f.attr == "load":
                    kw = {k.arg: k.value for k in node.keywords}
                    if not (isinstance(kw.get("allow_pickle"), ast.Constant) and kw["allow_pickle"].value is False):
                        bad.append(f"{rel}:{node.lineno} np.load without allow_pickle=False")
            if isinstance(f, ast.Name) and f.id in ("eval", "exec"):
                bad.append(f"{rel}:{node.lineno} {f.id}")
            for k in node.keywords:
                if k.arg == "Loader" and not (isinstance(k.value, ast.Attribute) and k.value.attr == "SafeLoader"):
                    bad.append(f"{rel}:{node.lineno} Loader={ast.unparse(k.value)}")
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            bad += [f"{rel}:{node.lineno} import {m}" for m in mods
                    if m.split(".")[0] in ("pickle", "cPickle", "dill", "shelve", "marshal", "joblib")]
    return bad


def test_sources_only_safe_load_yaml_and_never_unpickle():
    """Static scan of maceq's package code (not tests/ or bench/): no yaml.load/unsafe_load/full_load,
    no yaml Loader other than SafeLoader, no pickle/marshal/shelve/torch loads, no eval/exec, and
    every np.load passes allow_pickle=False. The scan flags each of those in a control snippet."""
    control = ast.parse("import pickle\nyaml.load(t, Loader=yaml.FullLoader)\nnp.load(p)\n"
                        "np.load(p, allow_pickle=True)\neval(s)\nyaml.safe_load(t)\nnp.load(p, allow_pickle=False)\n")
    assert [b.split(" ", 1)[1] for b in _unsafe("c", control)] == [
        "import pickle", "yaml.load", "Loader=yaml.FullLoader", "np.load without allow_pickle=False",
        "np.load without allow_pickle=False", "eval"]
    sources = list(_package_sources())
    assert len(sources) > 40
    assert [b for rel, tree in sources for b in _unsafe(rel, tree)] == []


_EVIL = "!!python/object/apply:os.system ['touch {marker}']"


def test_yaml_files_with_python_tags_are_refused_and_run_nothing(tmp_path, shared_data):
    """A config, budget, preprocessing and deployment .yml that try to run a command through a
    python/object tag: each loader raises a one-line MaceqError and the command never runs."""
    from maceq.quant.config import load_config
    from maceq.reports.budget import load_budget
    from maceq.yamlio import read_yaml

    marker = tmp_path / "pwned"
    evil = _EVIL.format(marker=marker)
    cases = {"config.yml": (load_config, f"range_method: {evil}\n"),
             "budget.yml": (load_budget, f"defaults: {evil}\n"),
             "pre.yml": (lambda p: read_yaml(p, what="preprocessing file"), f"resize: {evil}\n")}
    ref = shared_data / "mace_reference"
    for n in ("fmnist_q8.pb", "fmnist_q8.data"):
        shutil.copy(ref / n, tmp_path / n)
    cases["fmnist_q8.yml"] = (read_model, f"models:\n  fmnist_q8: {evil}\n")
    for name, (loader, text) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(MaceqError) as info:
            loader(tmp_path / name)
        assert len(str(info.value).splitlines()) == 1, name
    assert not marker.exists()


class _Boom:
    def __reduce__(self):
        return (os.system, (f"touch {_Boom.marker}",))


def test_a_pickled_npy_input_is_refused_and_runs_nothing(tmp_path, shared_data):
    """`maceq run --input evil.npy` with an object array whose pickle would run a command: exit 2
    with a one-line error, and nothing ran (np.load with allow_pickle=False)."""
    from maceq.app.cli import maceq_main

    _Boom.marker = tmp_path / "pwned"
    arr = np.empty(1, dtype=object)
    arr[0] = _Boom()
    with open(tmp_path / "evil.npy", "wb") as f:
        np.save(f, arr, allow_pickle=True)
    assert pickle.dumps(arr)  # the payload is a real pickle
    assert maceq_main(["run", str(shared_data / "mace_reference" / "fmnist_q8.yml"),
                       "--input", str(tmp_path / "evil.npy")]) == 2
    assert not _Boom.marker.exists()


@pytest.mark.parametrize("name", ["../x", "..", ".", "", "/tmp/x", "a/b", "a\\b", ".hidden", "a\nb", "a\0b",
                                  "x" * 201, "\udcff"])
def test_model_names_that_would_leave_the_output_folder_are_refused(tmp_path, shared_data, name):
    """write_model refuses any model name that is not a plain file stem (path separators, '..',
    hidden, control characters, over 200 bytes), before writing anything: the output folder and
    its parent stay as they were."""
    ref = read_model(shared_data / "mace_reference" / "fmnist_q8.yml")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(MaceqError, match="must be a plain file stem") as info:
        write_model(out, name, ref.multi_net_def, ref.arrays)
    assert len(str(info.value).splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and not list(out.iterdir())
    assert check_model_name("fmnist_q8.v2-final") == "fmnist_q8.v2-final"


def test_cli_name_with_a_path_is_refused_inside_the_output_folder(tmp_path):
    """`quantize --name ../escaped -o OUT`: exit 2, one error line, nothing written beside OUT."""
    p = _cli([str(DEMO), "--calib-dir", str(CALIB), "--preset", "fmnist", "--max-images", "2", "-o",
              str(tmp_path / "out"), "--name", "../escaped", "-q"])
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2 and err.startswith("error: model name '../escaped'") and len(err.splitlines()) == 1
    assert not (tmp_path / "escaped.pb").exists() and not (tmp_path / "escaped.yml").exists()


def test_cli_name_is_checked_before_any_folder_is_made(tmp_path):
    """Without -o the output folder is $MACEQ_HOME/<name>: `--name ../escaped` must fail before
    making $MACEQ_HOME/../escaped (and before the calibration)."""
    env = _env()
    env["MACEQ_HOME"] = str(tmp_path / "home")
    p = subprocess.run([sys.executable, "-c", "import sys; from maceq.app.cli import quantize_main; "
                        "sys.exit(quantize_main(sys.argv[1:]))", str(DEMO), "--calib-dir", str(CALIB),
                        "--preset", "fmnist", "--max-images", "2", "--name", "../escaped", "-q"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and "model name '../escaped'" in p.stderr
    assert not (tmp_path / "escaped").exists()


def test_deployment_paths_resolve_beside_the_yml_not_the_working_directory(tmp_path, shared_data, monkeypatch):
    """The .pb/.data/range file that a deployment .yml names are found relative to the .yml (MACE's
    convention), whatever the current folder."""
    ref = read_model(shared_data / "mace_reference" / "fmnist_q8.yml")
    files = write_model(tmp_path, "m", ref.multi_net_def, ref.arrays,
                        ranges={"input": (-1.0, 2.0)})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    back = read_model(Path(os.path.relpath(files.yml, elsewhere)))
    assert back.checksums_verified and back.files.pb.resolve() == files.pb.resolve()
    assert read_ranges(back.files.ranges) == {"input": (-1.0, 2.0)}
