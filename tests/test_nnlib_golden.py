"""maceq's dsp simulation vs golden data measured on XiaoMi/nnlib's HVX kernels (v60, under QEMU).

The data in tests/data/nnlib/ were made by tools/nnlib/make_golden.py (see its README.md): single
MACE ops encoded as MACE's Hexagon converter encodes them, whole models run as MACE's DSP runtime
builds the graph, and which op configurations nnlib accepts. Nothing here needs nnlib or QEMU.
The target is 0 mismatching elements and equal output ranges everywhere.
"""
from __future__ import annotations

import hashlib
import json
import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from maceq.runtime.devices import Device, device_spec
from maceq.runtime.graph import RtOp
from maceq.runtime.model import Model, PrepareContext, QTensor
from maceq.runtime.ops_dsp import qinfo_of_range, rng
from maceq.runtime.qtypes import QInfo
from maceq.runtime.registry import lookup, prepare_op

DATA = Path(__file__).resolve().parent / "data" / "nnlib"

pytestmark = pytest.mark.oracle


@lru_cache(maxsize=None)
def _npz(name: str):
    z = np.load(DATA / name, allow_pickle=False)
    return z, json.loads(str(z["meta"]))


def _sweep_cases() -> list:
    cases = []
    for path in sorted(DATA.glob("sweep_*.npz")):
        _, meta = _npz(path.name)
        cases += [pytest.param(path.name, i, id=f"{meta['family']}-{i}-{c['label']}") for i, c in
                  enumerate(meta["cases"])]
    return cases


def _models() -> list:
    return [p.name for p in sorted(DATA.glob("model_*.npz"))]


def _rtop(d: dict) -> RtOp:
    return RtOp(d["name"], d["type"], tuple(d["inputs"]), tuple(d["outputs"]), d["args"],
                tuple(QInfo(*q) for q in d["out_qinfo"]), tuple(tuple(s) for s in d["output_shapes"]))


def _fed(codes, mn, mx) -> QTensor:
    """A tensor as maceq's dsp kernels receive it from nnlib: codes and nnlib's float range."""
    return QTensor(np.asarray(codes, np.uint8), qinfo_of_range(float(mn), float(mx)))


def _maceq_op(op: RtOp, consts: dict, const_qinfo: dict, fed: dict):
    """maceq's dsp kernel for one op -> (codes, min, max, PreparedOp)."""
    ins = [fed[t] if t in fed else QTensor(consts[t], const_qinfo[t]) for t in op.inputs]
    prepared = prepare_op(lookup(op.type, Device.DSP)(), op, tuple(t.qinfo for t in ins),
                          PrepareContext(device_spec("dsp"), consts, const_qinfo))
    out = prepared.run(ins)[0]
    return (out.values, *rng(out.qinfo), prepared)


def _diff(got, want) -> tuple[int, int, bool]:
    """(differing elements, max |d|, ranges equal in float32) of (codes, min, max) pairs."""
    (g, gmn, gmx), (w, wmn, wmx) = got, want
    if g.shape != w.shape:
        return int(w.size), 255, False
    d = np.abs(g.astype(np.int64) - w.astype(np.int64))
    same = (np.float32(gmn), np.float32(gmx)) == (np.float32(wmn), np.float32(wmx))
    return int(np.count_nonzero(d)), int(d.max()) if d.size else 0, same


def _first(lines, n=12) -> str:
    return "\n".join(lines[:n] + ([f"... and {len(lines) - n} more"] if len(lines) > n else []))


def _describe(what, n_bad, max_abs, same, n, got, want) -> str:
    return (f"{what}: {n_bad}/{n} elements differ from nnlib (max |d| {max_abs}); output range maceq "
            f"({np.float32(got[1])!r}, {np.float32(got[2])!r}) vs nnlib ({np.float32(want[1])!r}, "
            f"{np.float32(want[2])!r}){'' if same else ' DIFFERS'}")


# ----------------------------------------------------------------------------------------------
# A. single-op sweeps
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,i", _sweep_cases())
def test_sweep_case(name, i):
    z, meta = _npz(name)
    case = meta["cases"][i]
    op = _rtop(case["op"])
    consts = {k: z[f"{i}.{k}"] for k in case["consts"]}
    const_qinfo = {k: QInfo(*v["qinfo"]) for k, v in case["consts"].items()}
    fed = {d["name"]: _fed(z[f"{i}.{d['name']}"], d["min"], d["max"]) for d in case["inputs"]}
    want = (z[f"{i}.y"], case["nnlib"]["min"], case["nnlib"]["max"])
    y, mn, mx, prepared = _maceq_op(op, consts, const_qinfo, fed)
    place = prepared.placement
    where = "" if place.device is Device.DSP else f" [maceq runs it on the cpu: {place.reason}]"
    bad, max_abs, same = _diff((y, mn, mx), want)
    assert bad == 0 and same, _describe(f"{case['label']} ({'/'.join(case['nnlib']['nodes'])}){where}",
                                        bad, max_abs, same, want[0].size, (y, mn, mx), want)


# ----------------------------------------------------------------------------------------------
# B. placement: what nnlib accepts (prepare + execute) vs maceq's rules
# ----------------------------------------------------------------------------------------------

def _maceq_places_on_dsp(row: dict) -> tuple[bool, str]:
    op = _rtop(row["op"])
    consts = {k: np.zeros(v["shape"], v["dtype"]) for k, v in row["consts"].items()}
    const_qinfo = {k: QInfo(*v["qinfo"]) for k, v in row["consts"].items()}
    in_q = {d["name"]: qinfo_of_range(d["min"], d["max"]) for d in row["inputs"]}
    kernel = lookup(op.type, Device.DSP)()
    try:
        prepared = prepare_op(kernel, op, tuple(in_q.get(t) or const_qinfo[t] for t in op.inputs),
                              PrepareContext(device_spec("dsp"), consts, const_qinfo))
    except Exception as e:  # noqa: BLE001 - maceq's refusal
        return False, f"raises {type(e).__name__}: {str(e).splitlines()[0]}"
    return prepared.placement.device is Device.DSP, prepared.placement.reason


def test_placement_matches_nnlib():
    """maceq must not place on the dsp what nnlib fails on, and should place there what nnlib runs
    right (within 2 LSB of the float op, with the pads of MACE's padding mode). Configurations nnlib
    runs wrongly are not judged."""
    rows = json.loads((DATA / "acceptance.json").read_text())["configs"]
    bad = []
    for row in rows:
        on_dsp, why = _maceq_places_on_dsp(row)
        if not row["nnlib_ok"] and on_dsp:
            bad.append(f"{row['label']}: nnlib fails ({row['nnlib']}) but maceq places it on the dsp")
        elif row["nnlib_right"] and not on_dsp:
            bad.append(f"{row['label']}: nnlib runs it ({row['nnlib']}) but maceq does not place it on the dsp ({why})")
    assert not bad, f"{len(bad)} of {len(rows)} configurations:\n" + _first(bad, 30)


# ----------------------------------------------------------------------------------------------
# C. whole models
# ----------------------------------------------------------------------------------------------

def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def golden_model(request, tmp_path_factory):
    """The maceq model a model_<name>.npz was made with: committed files, or quantized again
    (deterministic) and checked against the recorded sha256."""
    cache = {}

    def get(npz_name):
        if npz_name in cache:
            return cache[npz_name]
        from maceq.runtime import load

        _, meta = _npz(npz_name)
        folder = DATA / "models" / meta["model"]
        if not meta["committed"]:
            shared = request.getfixturevalue("shared_data")
            folder = tmp_path_factory.mktemp(meta["model"])
            from maceq.app.cli import quantize_main

            argv = [a.replace("../shared/data", str(shared)) for a in meta["quantize_argv"]]
            assert quantize_main([str(folder) if a == "OUT" else a for a in argv]) == 0
        got = {n: _sha(folder / n) for n in meta["sha256"]}
        # quantization is deterministic: a different model means the writer changed, and the golden data
        # must be measured again (tools/nnlib/make_golden.py) before they can speak for it
        assert got == meta["sha256"], (f"{meta['model']}: the model quantized now differs from the one the golden "
                                       f"data were made with (sha256 {got} vs {meta['sha256']}): regenerate with "
                                       "tools/nnlib/make_golden.py")
        cache[npz_name] = load(folder / meta["yml"])
        return cache[npz_name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", _models())
def test_model_outputs(name, golden_model, loops):
    """maceq's dsp simulation of each image vs nnlib's float outputs (MACE's DequantizeOUTPUT_8tof), on the
    compiled loops and on the numpy paths (a fresh Model: nothing prepared on the other path is reused)."""
    z, meta = _npz(name)
    model = Model(golden_model(name).loaded)
    lines, total, bad_total = [], 0, 0
    for k in range(len(meta["images"])):
        got = model.run({meta["input"]: z["inputs"][k:k + 1]}, device="dsp")
        for j, out in enumerate(meta["outputs"]):
            want = z[f"output.{j}"][k:k + 1]
            n_bad = int(np.count_nonzero(got[out] != want))
            total, bad_total = total + want.size, bad_total + n_bad
            if n_bad:
                lines.append(f"image {k} ({meta['images'][k]}) {out}: {n_bad}/{want.size} differ, max |d| "
                             f"{float(np.abs(got[out] - want).max()):.6g}")
    assert bad_total == 0, f"{meta['model']}: {bad_total}/{total} output values differ:\n" + _first(lines)


def _taps(z, meta, k="0") -> dict:
    return {t["tensor"]: (z[f"tap{k}.{j}"], t["min"], t["max"]) for j, t in enumerate(meta["taps"][k])}


def _alone(model, op, taps: dict, src: dict, z, meta):
    """One op of the tap image in maceq's dsp simulation on nnlib's inputs -> None (not checkable),
    "" (equal) or a line saying how it differs. The input Quantize gets the float input, the output
    Dequantize is compared with nnlib's float output."""
    t = op.outputs[0]
    x = z["inputs"][0:1]
    if x.ndim == 4 and model.input_formats[meta["input"]] == "NCHW":
        x = x.transpose(0, 2, 3, 1)
    fed = {i: _fed(*taps[i]) for i in op.inputs if i in taps} | {meta["input"]: QTensor(np.ascontiguousarray(x), None)}
    if op.type == "Dequantize":
        if t not in meta["outputs"] or op.inputs[0] not in taps:
            return None
        want = z[f"output.{meta['outputs'].index(t)}"][0].reshape(-1)
    elif src.get(t) != "nnlib" or any(i not in fed and i not in model.consts for i in op.inputs):
        return None
    try:
        out = model.run_op(op, [fed.get(i) for i in op.inputs], device="dsp")[0]
    except Exception as e:  # noqa: BLE001 - reported with the others
        return f"{op.name} ({op.type}): maceq raises {type(e).__name__}: {str(e).splitlines()[0]}"
    if op.type == "Dequantize":
        n_bad = int(np.count_nonzero(out.values.reshape(-1) != want))
        return f"{op.name} (Dequantize): {n_bad}/{want.size} floats differ from nnlib" if n_bad else ""
    got = (out.values, *rng(out.qinfo))
    bad, max_abs, same = _diff(got, taps[t])
    return _describe(f"{op.name} ({op.type})", bad, max_abs, same, taps[t][0].size, got, taps[t]) \
        if bad or not same else ""


@pytest.mark.slow
@pytest.mark.parametrize("name", _models())
def test_model_ops_alone(name, golden_model):
    """Each op of the tap image nnlib ran, alone in maceq's dsp simulation on nnlib's own inputs."""
    z, meta = _npz(name)
    model = golden_model(name)
    taps, src = _taps(z, meta), {t["tensor"]: t["source"] for t in meta["taps"]["0"]}
    results = [_alone(model, op, taps, src, z, meta) for op in model.ops]
    lines = [r for r in results if r]
    n_ops = sum(r is not None for r in results)
    assert not lines, f"{meta['model']}: {len(lines)} of {n_ops} ops differ:\n" + _first(lines)


@pytest.mark.slow
@pytest.mark.parametrize("name", _models())
def test_model_tensors(name, golden_model):
    """maceq's whole dsp simulation of the tap image vs every tensor nnlib computed (differences propagate)."""
    z, meta = _npz(name)
    model = golden_model(name)
    taps = _taps(z, meta)
    sim = model.run({meta["input"]: z["inputs"][0:1]}, device="dsp", intermediates=True)
    lines, n = [], 0
    for t in meta["taps"]["0"]:
        if t["source"] != "nnlib" or t["tensor"] not in sim.tensors:
            continue
        n += 1
        q = sim.tensors[t["tensor"]]
        got = (q.values, *rng(q.qinfo))
        bad, max_abs, same = _diff(got, taps[t["tensor"]])
        if bad or not same:
            lines.append(_describe(t["tensor"], bad, max_abs, same, q.values.size, got, taps[t["tensor"]]))
    assert not lines, f"{meta['model']}: {len(lines)} of {n} tensors differ (in graph order):\n" + _first(lines)


def test_golden_files_present():
    """The data set is complete (a partial regeneration would silently test less)."""
    prov = json.loads((DATA / "provenance.json").read_text())
    for name in prov["files"].values():
        assert (DATA / name["file"]).is_file(), name["file"]
    assert len(list(DATA.glob("sweep_*.npz"))) >= 11 and len(_models()) >= 4
    total = sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file())
    assert total < 9 * 2 ** 20 and math.isfinite(total)
