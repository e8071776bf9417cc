"""Run a gpu-quantized model on a real OpenCL driver and count, per tensor, where it differs from the simulation.

    python bench/opencl_vendor.py MODEL.yml INPUT.npy [INPUT.npy ...] [--platform NVIDIA] [--json out.json]
    python bench/opencl_vendor.py MODEL.yml --images DIR --count 4 --preset imagenet --save-inputs DIR
    python bench/opencl_vendor.py MODEL.yml INPUT.npy ... --sim-only --save-sim sim.npz
    python bench/opencl_vendor.py --list

MODEL.yml is a model quantized with ``quantize --device gpu``. Each INPUT.npy holds one float32
input image as the model takes it (NCHW for MobileNetV2; a missing batch axis is added); for a
model with several inputs write ``NAME=FILE.npy``. ``--images`` preprocesses the first
``--count`` images of a folder instead (``--save-inputs`` writes them as .npy, so that another
machine without the images can run the same inputs).

For each input the model runs twice, with ``intermediates=True``: on the numpy simulation
(``backend="numpy"``) and on the gpu device's OpenCL C kernels (``backend="opencl"``,
runtime/opencl/) on the chosen OpenCL device. Every intermediate tensor is compared element
by element: integer codes by value, half/float tensors by their bits (any NaN equals any NaN).
The table lists each tensor with its op type, what ran it (``cl`` when the op called the
OpenCL backend, ``sim`` when the op has no OpenCL kernel), elements, mismatching elements and
the largest absolute difference; ``--all`` prints every tensor, otherwise only the ones that
differ. The last line is the summary. ``--reference SIM.npz`` (written by ``--save-sim`` on
another machine) compares both runs with that machine's simulation too, to tell a numpy
difference between machines from a kernel difference.

Device choice: ``--platform SUBSTR`` picks the first platform whose name or vendor contains
SUBSTR (case-insensitive), ``--cl-device SUBSTR`` a device of it by name; without either, the
backend's own default (first device of the first platform). The chosen backend is installed
as the model runtime's shared OpenCL backend (``maceq.runtime.model._BACKENDS["opencl"]``) so
that ``Model.run(..., backend="opencl")`` uses it; nothing in maceq is changed. ``--list``
prints every platform and device with its version strings and float capabilities;
``--dump-programs DIR`` builds each .cl file as the backend does (common.cl prepended,
OpenCLBackend.BUILD_OPTIONS) and writes the driver's program binaries (PTX on NVIDIA) and
build logs there, with a count of each float32 PTX instruction form in them (``fma.rn.f32`` is a fused
multiply-add; ``mul.f32``/``add.f32`` without ``.rn`` may still be fused by ptxas, ``.rn`` ones
may not).

Exit status: 0 when every compared tensor is equal, 1 when some element differs, 2 on an error
(one line on stderr).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from maceq.errors import MaceqError

_CL_FILES = ("conv.cl", "eltwise.cl", "pool.cl", "quantize.cl", "float_ops.cl")
_FP_FLAGS = ("DENORM", "INF_NAN", "ROUND_TO_NEAREST", "ROUND_TO_ZERO", "ROUND_TO_INF", "FMA",
             "SOFT_FLOAT", "CORRECTLY_ROUNDED_DIVIDE_SQRT")


class _Fail(Exception):
    """A user-facing error: printed as one line, exit status 2."""


# ---------------------------------------------------------------------------- OpenCL platforms


def _cl():
    try:
        import pyopencl as cl
    except ImportError as e:
        raise _Fail(f"pyopencl is not installed ({e}); pip install pyopencl==2026.1.4") from None
    return cl


def _fp_config(cl, dev, param) -> list[str]:
    try:
        bits = dev.get_info(param)
    except (cl.Error, AttributeError):
        return ["n/a"]
    return [f for f in _FP_FLAGS if bits & getattr(cl.device_fp_config, f, 0)]


def _device_info(cl, dev) -> dict:
    info = {"name": dev.name, "vendor": dev.vendor, "version": dev.version,
            "driver_version": dev.driver_version,
            "opencl_c_version": dev.get_info(cl.device_info.OPENCL_C_VERSION),
            "single_fp_config": _fp_config(cl, dev, cl.device_info.SINGLE_FP_CONFIG),
            "half_fp_config": _fp_config(cl, dev, getattr(cl.device_info, "HALF_FP_CONFIG", -1)),
            "cl_khr_fp16": "cl_khr_fp16" in dev.extensions,
            "cl_khr_fp64": "cl_khr_fp64" in dev.extensions}
    return info


def platform_info() -> list[dict]:
    """Every OpenCL platform with its devices (what clGetPlatformInfo/clGetDeviceInfo report)."""
    cl = _cl()
    try:
        platforms = cl.get_platforms()
    except (cl.Error, RuntimeError) as e:
        raise _Fail(f"no OpenCL platform: {e}") from None
    out = []
    for p in platforms:
        entry = {"name": p.name, "vendor": p.vendor, "version": p.version, "devices": []}
        try:
            entry["devices"] = [_device_info(cl, d) for d in p.get_devices()]
        except cl.Error as e:
            entry["error"] = str(e)
        out.append(entry)
    return out


def _print_platforms(plats: list[dict]) -> None:
    for i, p in enumerate(plats):
        print(f"platform {i}: {p['name']} | vendor {p['vendor']} | {p['version']}")
        if "error" in p:
            print(f"  devices: {p['error']}")
        for d in p["devices"]:
            print(f"  device: {d['name']} | {d['version']} | driver {d['driver_version']} | {d['opencl_c_version']}")
            print(f"    single fp: {' '.join(d['single_fp_config'])}; half fp: {' '.join(d['half_fp_config'])}; "
                  f"cl_khr_fp16 {d['cl_khr_fp16']}, cl_khr_fp64 {d['cl_khr_fp64']}")


def make_backend(platform: str | None, device: str | None):
    """An OpenCLBackend on the chosen platform/device; returns (backend, pyopencl device or None)."""
    from maceq.runtime.opencl import OpenCLBackend

    if platform is None:
        be = OpenCLBackend(device=device)
        be.device_name  # creates the context; MaceqError when there is no device
        return be, None
    cl = _cl()
    try:
        platforms = cl.get_platforms()
    except (cl.Error, RuntimeError) as e:
        raise _Fail(f"no OpenCL platform: {e}") from None
    want = platform.lower()
    plats = [p for p in platforms if want in p.name.lower() or want in p.vendor.lower()]
    if not plats:
        raise _Fail(f"no OpenCL platform matching {platform!r} (have {[p.name for p in platforms]})")
    devs = [d for d in plats[0].get_devices() if device is None or device.lower() in d.name.lower()]
    if not devs:
        raise _Fail(f"platform {plats[0].name!r} has no device" + (f" matching {device!r}" if device else ""))
    dev = devs[0]
    be = OpenCLBackend(device=dev.name)  # the backend filters by device name over all platforms ...
    got = be.device_name
    if got != f"{dev.platform.name}: {dev.name}":  # ... so check that it found this one
        raise _Fail(f"device name {dev.name!r} also matches {got!r} first; pass a distinct --cl-device")
    return be, dev


class CountingBackend:
    """Forwards to an OpenCLBackend, recording which methods each op called and their time."""

    def __init__(self, inner):
        self.inner = inner
        self.current_op: int | None = None
        self.calls: dict[int, list[str]] = defaultdict(list)
        self.seconds: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr) or name.startswith("_"):
            return attr

        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.count[name] += 1
                if self.current_op is not None:
                    self.calls[self.current_op].append(name)
        return call


def dump_programs(dev, out_dir: Path) -> dict:
    """Build each .cl file as the backend does and write the driver's binaries and build logs."""
    from maceq.runtime.opencl import OpenCLBackend, kernel_source

    cl = _cl()
    ctx = cl.Context([dev])
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {}
    for fname in _CL_FILES:
        src = kernel_source("common.cl") + "\n" + kernel_source(fname)
        prg = cl.Program(ctx, src).build(options=list(OpenCLBackend.BUILD_OPTIONS))
        binary = bytes(prg.get_info(cl.program_info.BINARIES)[0])
        log = prg.get_build_info(dev, cl.program_build_info.LOG)
        stem = fname[:-3]
        text = binary.decode("latin-1")
        is_ptx = ".version" in text[:4000] and ".target" in text[:4000]
        # NVIDIA's PTX ends in NUL bytes, which ptxas rejects ("Unexpected EOF")
        (out_dir / (stem + (".ptx" if is_ptx else ".bin"))).write_bytes(binary.rstrip(b"\0") if is_ptx else binary)
        (out_dir / (stem + ".log")).write_text(log or "", encoding="utf-8")
        ops = Counter(re.findall(r"\b(?:fma|mad|mul|add|sub|div|rcp|neg|abs|min|max)(?:\.[a-z0-9]+)*\.f32\b", text)
                      if is_ptx else [])
        summary[fname] = {"bytes": len(binary), "ptx": is_ptx, "f32_instructions": dict(sorted(ops.items())),
                          "build_log": (log or "").strip()[:2000]}
    return summary


# ---------------------------------------------------------------------------- inputs and runs


def _load_inputs(model, specs: list[str]) -> list[tuple[str, dict[str, np.ndarray]]]:
    """[(label, {input name: array})], one entry per INPUT.npy (or per NAME=FILE group)."""
    names = model.input_names
    out = []
    for spec in specs:
        name, _, path = spec.rpartition("=") if "=" in spec else (names[0], "", spec)
        if name not in names:
            raise _Fail(f"{spec}: model has no input {name!r} (inputs: {', '.join(names)})")
        try:
            x = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise _Fail(f"{path}: cannot read .npy ({e})") from None
        x = np.asarray(x, dtype=np.float32)
        if x.ndim == len(model.input_shape(name)) - 1:
            x = x[None]
        if out and name not in out[-1][1]:
            out[-1][1][name] = x  # NAME=FILE groups: inputs of one run, in order
        else:
            out.append((Path(path).stem, {name: x}))
    for label, feed in out:
        missing = [n for n in names if n not in feed]
        if missing:
            raise _Fail(f"{label}: missing model input(s) {', '.join(missing)}")
    return out


def _images(model, folder: str, count: int, preset: str, save_dir: str | None):
    from maceq.datasets.images import ImageFolder
    from maceq.datasets.preprocess import PRESETS

    if preset not in PRESETS:
        raise _Fail(f"unknown preset {preset!r} (have {', '.join(sorted(PRESETS))})")
    if len(model.input_names) != 1:
        raise _Fail("--images needs a model with one input; pass NAME=FILE.npy inputs instead")
    out = []
    for batch in ImageFolder(folder, PRESETS[preset], labels=None, limit=count).iter_batches(1):
        label = Path(batch.paths[0]).stem
        out.append((label, {model.input_names[0]: batch.data}))
        if save_dir:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            np.save(Path(save_dir) / f"{label}.npy", batch.data)
    return out


def _diff(a: np.ndarray, b: np.ndarray) -> tuple[int, float]:
    """(mismatching elements, max |a - b|): bits for floating tensors (NaN == NaN), values otherwise."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise _Fail(f"shape/dtype differ: {a.shape} {a.dtype} vs {b.shape} {b.dtype}")
    if a.dtype.kind == "f":
        same = (a.view(f"u{a.itemsize}") == b.view(f"u{b.itemsize}")) | (np.isnan(a) & np.isnan(b))
        fa, fb = a.astype(np.float64), b.astype(np.float64)
        with np.errstate(invalid="ignore"):
            d = np.abs(fa - fb)[~same]
        d = d[np.isfinite(d)]
        return int(np.count_nonzero(~same)), float(d.max()) if d.size else (0.0 if same.all() else float("inf"))
    diff = ~(a == b)
    if not diff.any():
        return 0, 0.0
    return int(np.count_nonzero(diff)), float(np.max(np.abs(a.astype(np.int64) - b.astype(np.int64))))


class Tally:
    """Per-tensor totals over the inputs: elements, mismatches, max abs diff."""

    def __init__(self):
        self.rows: dict[str, dict] = {}

    def add(self, name: str, a: np.ndarray, b: np.ndarray, **meta) -> None:
        n, d = _diff(a, b)
        row = self.rows.setdefault(name, {"tensor": name, **meta, "dtype": str(a.dtype), "shape": list(a.shape),
                                          "elements": 0, "mismatches": 0, "max_abs_diff": 0.0})
        row["elements"] += int(a.size)
        row["mismatches"] += n
        row["max_abs_diff"] = max(row["max_abs_diff"], d)

    def summary(self) -> dict:
        rows = list(self.rows.values())
        return {"tensors": len(rows), "tensors_differing": sum(r["mismatches"] > 0 for r in rows),
                "elements": sum(r["elements"] for r in rows), "mismatches": sum(r["mismatches"] for r in rows),
                "max_abs_diff": max((r["max_abs_diff"] for r in rows), default=0.0)}


def _read_reference(path: str) -> tuple[list[str], dict]:
    try:
        z = np.load(path, allow_pickle=False)
        meta = json.loads(str(z["__meta__"]))
    except (OSError, ValueError, KeyError) as e:
        raise _Fail(f"{path}: not a --save-sim file ({e})") from None
    ref = {(i, t): z[f"x{i}_t{k}"] for i in range(len(meta["inputs"])) for k, t in enumerate(meta["tensors"][i])}
    return meta["inputs"], ref


def _save_reference(path: str, labels: list[str], runs: list[dict]) -> None:
    arrays, tensors = {}, []
    for i, tens in enumerate(runs):
        tensors.append(list(tens))
        for k, v in enumerate(tens.values()):
            arrays[f"x{i}_t{k}"] = v
    arrays["__meta__"] = np.array(json.dumps({"inputs": labels, "tensors": tensors}))
    np.savez_compressed(path, **arrays)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="quantized gpu model: its .yml (or .pb)")
    ap.add_argument("inputs", nargs="*", help="input .npy files (NAME=FILE.npy for several model inputs)")
    ap.add_argument("--images", metavar="DIR", help="preprocess images from this folder instead of .npy inputs")
    ap.add_argument("--count", type=int, default=4, help="with --images: how many (default 4)")
    ap.add_argument("--preset", default="imagenet", help="with --images: preprocessing preset (default imagenet)")
    ap.add_argument("--save-inputs", metavar="DIR", help="with --images: write each preprocessed input as DIR/<stem>.npy")
    ap.add_argument("--platform", metavar="SUBSTR", help="OpenCL platform whose name or vendor contains SUBSTR")
    ap.add_argument("--cl-device", metavar="SUBSTR", help="OpenCL device whose name contains SUBSTR")
    ap.add_argument("--list", action="store_true", help="print the OpenCL platforms and devices, then exit")
    ap.add_argument("--sim-only", action="store_true", help="run the numpy simulation only (with --save-sim)")
    ap.add_argument("--save-sim", metavar="NPZ", help="write the simulation's tensors of every input")
    ap.add_argument("--reference", metavar="NPZ", help="also compare with a --save-sim file from another machine")
    ap.add_argument("--dump-programs", metavar="DIR", help="write the driver's program binaries and build logs")
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON")
    ap.add_argument("--all", action="store_true", help="print every tensor, not only the differing ones")
    return ap


def _setup_device(args, result: dict):
    """Create the chosen OpenCL backend, record what it is, and install it as the model runtime's backend."""
    from maceq.runtime import model as model_mod

    result["platforms"] = platform_info()
    be, dev = make_backend(args.platform, args.cl_device)
    result["device"] = be.device_name
    if dev is None:
        cl = _cl()
        dev = next(d for p in cl.get_platforms() for d in p.get_devices()
                   if f"{p.name}: {d.name}" == be.device_name)
    result["device_info"] = {"platform": dev.platform.name, "platform_version": dev.platform.version,
                             **_device_info(_cl(), dev)}
    print(f"OpenCL device: {be.device_name} | {dev.version} | driver {dev.driver_version} | "
          f"platform {dev.platform.version}")
    if args.dump_programs:
        result["programs"] = dump_programs(dev, Path(args.dump_programs))
        for f, s in result["programs"].items():
            print(f"  {f}: {s['bytes']} bytes{' PTX' if s['ptx'] else ''}, f32 ops {s['f32_instructions']}")
    counting = CountingBackend(be)
    model_mod._BACKENDS["opencl"] = counting
    return counting


class _Comparison:
    """Runs each input on the simulation (and OpenCL) and tallies the differences tensor by tensor."""

    def __init__(self, model, counting, reference):
        self.model, self.counting = model, counting
        self.producer = {o: (i, op) for i, op in enumerate(model.ops) for o in op.outputs}
        self.ref_labels, self.ref = _read_reference(reference) if reference else ([], {})
        self.reference = reference
        self.vs_cl, self.vs_ref_sim, self.vs_ref_cl = Tally(), Tally(), Tally()
        self.times = {"sim_s": [], "opencl_s": []}
        self.sims = []

    def _hook(self, idx, op, ins):
        self.counting.current_op = idx
        return False

    def _meta(self, name):
        idx, op = self.producer.get(name, (None, None))
        ran = ("cl" if self.counting.calls.get(idx) else "sim") if (op and self.counting) else "-"
        return {"op": op.name if op else "(input)", "op_type": op.type if op else "input", "ran_on": ran}

    def _ref_tensor(self, label, name):
        if label not in self.ref_labels:
            raise _Fail(f"{self.reference}: has no input {label!r} (has {self.ref_labels})")
        r = self.ref.get((self.ref_labels.index(label), name))
        if r is None:
            raise _Fail(f"{self.reference}: input {label!r} has no tensor {name!r}")
        return r

    def run(self, label, feed) -> None:
        t0 = time.perf_counter()
        sim = self.model.run(feed, device="gpu", intermediates=True)
        self.times["sim_s"].append(time.perf_counter() - t0)
        self.sims.append({n: t.values for n, t in sim.tensors.items()})
        ocl = None
        if self.counting is not None:
            self.counting.calls.clear()
            t0 = time.perf_counter()
            ocl = self.model.run(feed, device="gpu", intermediates=True, backend="opencl", before_op=self._hook)
            self.times["opencl_s"].append(time.perf_counter() - t0)
            self.counting.current_op = None
        for name, t in sim.tensors.items():
            meta = self._meta(name)
            if ocl is not None:
                self.vs_cl.add(name, ocl.tensors[name].values, t.values, **meta)
            if self.reference:
                r = self._ref_tensor(label, name)
                self.vs_ref_sim.add(name, t.values, r, **meta)
                if ocl is not None:
                    self.vs_ref_cl.add(name, ocl.tensors[name].values, r, **meta)
        line = f"input {label}: sim {self.times['sim_s'][-1]:.2f} s"
        if ocl is not None:
            mism = sum(_diff(ocl.tensors[n].values, v)[0] for n, v in self.sims[-1].items())
            line += f", opencl {self.times['opencl_s'][-1]:.2f} s, differing elements {mism}"
        print(line, flush=True)


def _print_block(title: str, key: str, tally, n_inputs: int, show_all: bool, result: dict) -> int:
    """Print one comparison's table and summary line; 1 when some element differs."""
    if not tally.rows:
        return 0
    result[key] = {"summary": tally.summary(), "per_tensor": list(tally.rows.values())}
    rows = [r for r in tally.rows.values() if show_all or r["mismatches"]]
    print(f"\n{title}: {len(rows)} of {len(tally.rows)} tensors listed")
    if rows:
        print(f"{'tensor':<44} {'op_type':<18} {'ran':<4} {'dtype':<8} {'elements':>10} {'mismatch':>9} {'max|d|':>9}")
    for r in rows:
        print(f"{r['tensor'][:44]:<44} {r['op_type'][:18]:<18} {r['ran_on']:<4} {r['dtype']:<8} "
              f"{r['elements']:>10} {r['mismatches']:>9} {r['max_abs_diff']:>9.4g}")
    s = tally.summary()
    print(f"SUMMARY {key}: {n_inputs} inputs, {s['tensors']} tensors, {s['elements']} elements, "
          f"{s['mismatches']} mismatching in {s['tensors_differing']} tensors, max abs diff {s['max_abs_diff']:g}")
    return 1 if s["mismatches"] else 0


def _feeds(args, model) -> list:
    if (model.maceq_meta.get("device") or "gpu") != "gpu":
        raise _Fail(f"{args.model}: quantized for {model.maceq_meta.get('device')}, not gpu (quantize --device gpu)")
    feeds = _load_inputs(model, args.inputs)
    if args.images:
        feeds += _images(model, args.images, args.count, args.preset, args.save_inputs)
    if not feeds:
        raise _Fail("no inputs: give INPUT.npy files or --images DIR")
    return feeds


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    result: dict = {}
    if args.list or args.model is None:
        result["platforms"] = platform_info()
        _print_platforms(result["platforms"])
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1), encoding="utf-8")
        return 0
    from maceq.runtime import load

    model = load(args.model)
    feeds = _feeds(args, model)
    labels = [lab for lab, _ in feeds]
    counting = None if args.sim_only else _setup_device(args, result)
    cmp = _Comparison(model, counting, args.reference)
    for label, feed in feeds:
        cmp.run(label, feed)
    if args.save_sim:
        _save_reference(args.save_sim, labels, cmp.sims)
        print(f"wrote {args.save_sim} ({len(cmp.sims)} inputs, {len(cmp.sims[0])} tensors each)")
    result.update(model=str(args.model), inputs=labels, times=cmp.times)
    if counting is not None:
        result["backend_calls"] = {k: {"calls": counting.count[k], "seconds": round(counting.seconds[k], 4)}
                                   for k in sorted(counting.count)}
    blocks = [("opencl vs simulation", "opencl_vs_sim", cmp.vs_cl)]
    if args.reference:
        blocks += [("simulation vs reference simulation", "sim_vs_reference", cmp.vs_ref_sim),
                   ("opencl vs reference simulation", "opencl_vs_reference", cmp.vs_ref_cl)]
    status = max([_print_block(t, k, tally, len(labels), args.all, result) for t, k, tally in blocks] + [0])
    if counting is not None:
        on_cl = sum(1 for r in cmp.vs_cl.rows.values() if r["ran_on"] == "cl")
        print(f"ops on OpenCL: {on_cl} tensors; backend calls: "
              + ", ".join(f"{k} {v['calls']}x {v['seconds']:.2f}s" for k, v in result["backend_calls"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1), encoding="utf-8")
    return status


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (_Fail, MaceqError, OSError) as e:
        print(f"opencl_vendor: error: {e}", file=sys.stderr)
        sys.exit(2)
