#!/usr/bin/env python3
"""Run one hexagon_nn graph on XiaoMi/nnlib's real HVX kernels under QEMU and read the outputs.

Needs the harness built by ``tools/nnlib/setup.sh`` (default
``/tmp/nnlib-build/v60/nnlib_harness``; override with ``$NNLIB_HARNESS`` or ``harness=``) and
``qemu-hexagon-static`` (``$NNLIB_QEMU``).

As a module (tools/ is not a package)::

    sys.path.insert(0, "tools/nnlib"); import run as N
    y, y_min, y_max, res = N.quantized_add(a, b, a_min=.., a_max=.., b_min=.., b_max=..,
                                           out_min=.., out_max=..)
    y, y_min, y_max, res = N.supernode(x, w_hwio, bias_i32, x_min=.., ..., strides=(1, 1), padding="SAME")
    ok, res = N.supernode(..., prepare_only=True)      # does nnlib accept this configuration?

    g = N.Graph()                               # or build any graph by hand
    x = g.feed(x_u8)                            # an execute-time input (port of the INPUT node)
    mn, mx = g.scalar(-1.0), g.scalar(1.0)      # float32 const nodes
    n = g.node("QuantizedRelu_8", [x, mn, mx], [(1, x_u8.shape), (4, (1, 1, 1, 1)), (4, (1, 1, 1, 1))])
    g.output((n, 0), x_u8.nbytes); ...
    res = N.run_graph(g)                        # res.outputs: list of bytes; res.nodes: after prepare

As a script: ``python3 tools/nnlib/run.py`` runs the demo: QuantizedAdd_8p8to8 (flat and d32),
Supernode_8x8p32to8 and DepthwiseSupernode_8x8p32to8 on random inputs, compared with maceq's
``dsp`` simulation (``maceq.runtime.kernels.dsp``); prints mismatch counts.

Graph conventions follow MACE's hexagon_converter.py / hexagon_dsp_wrapper.cc: op names from
nnlib's ops.def, padding enum NN_PAD_NA=0, SAME=1, VALID=2, MIRROR_REFLECT=3,
MIRROR_SYMMETRIC=4, SAME_CAFFE=5; min/max as float32 scalar consts (shape 1x1x1x1); strides as an
int32 const of shape [1, sh, sw, 1] without data; Supernode filter HWIO [KH, KW, C, O];
depthwise filter [KH, KW, C, 1]; bias int32 [O] with float range consts.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

DEFAULT_HARNESS = "/tmp/nnlib-build/v60/nnlib_harness"
PADDING = {"NA": 0, "SAME": 1, "VALID": 2, "MIRROR_REFLECT": 3, "MIRROR_SYMMETRIC": 4, "SAME_CAFFE": 5}


class NnlibError(RuntimeError):
    pass


def _shape4(shape) -> tuple[int, int, int, int]:
    shape = tuple(int(s) for s in shape)
    if len(shape) > 4:
        raise NnlibError(f"rank {len(shape)} > 4: {shape}")
    return (1,) * (4 - len(shape)) + shape


@dataclass
class Graph:
    """A hexagon_nn graph under construction; writes the harness spec and .bin files."""

    lines: list = field(default_factory=list)
    files: dict = field(default_factory=dict)  # name -> bytes
    next_id: int = 0x1000
    input_id: int | None = None
    n_feeds: int = 0
    op_nodes: list = field(default_factory=list)  # (id, op, [(elsize, shape4)...])

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _file(self, data: bytes) -> str:
        name = f"t{len(self.files)}.bin"
        self.files[name] = data
        return name

    def const(self, arr, shape=None) -> int:
        """A const node holding ``arr``'s raw bytes (shape padded to 4-D from the left)."""
        arr = np.ascontiguousarray(arr)
        b, h, w, d = _shape4(arr.shape if shape is None else shape)
        nid = self._id()
        self.lines.append(f"const {nid} {b} {h} {w} {d} {self._file(arr.tobytes())}")
        return nid

    def empty_const(self, shape) -> int:
        """A const node with a shape and no data (MACE's strides argument)."""
        b, h, w, d = _shape4(shape)
        nid = self._id()
        self.lines.append(f"const {nid} {b} {h} {w} {d} -")
        return nid

    def scalar(self, v: float) -> int:
        return self.const(np.array([v], dtype=np.float32), (1, 1, 1, 1))

    def feed(self, arr) -> tuple[int, int]:
        """An execute-time input; returns its reference (INPUT node id, port)."""
        arr = np.ascontiguousarray(arr)
        if self.input_id is None:
            self.input_id = self._id()
            self.lines.append(f"input {self.input_id}")
        b, h, w, d = _shape4(arr.shape)
        self.lines.append(f"feed {arr.itemsize} {b} {h} {w} {d} {self._file(arr.tobytes())}")
        self.n_feeds += 1
        return (self.input_id, self.n_feeds - 1)

    def node(self, op: str, inputs, outputs, padding="NA") -> int:
        """Append an op node. inputs: node ids (port 0) or (id, port); outputs: (elsize, shape)."""
        nid = self._id()
        refs = [f"{i}:0" if isinstance(i, int) else f"{i[0]}:{i[1]}" for i in inputs]
        outs = [(int(es), _shape4(sh)) for es, sh in outputs]
        pad = padding if isinstance(padding, int) else PADDING[str(padding).upper()]
        self.lines.append(f"node {nid} {op} {pad} {len(refs)} {' '.join(refs)} {len(outs)} "
                          + " ".join(f"{es}:{b}:{h}:{w}:{d}" for es, (b, h, w, d) in outs))
        self.op_nodes.append((nid, op, outs))
        return nid

    def output(self, ref, maxbytes: int) -> int:
        """Make ``ref`` (id or (id, port)) a graph output; returns its output index."""
        r = f"{ref}:0" if isinstance(ref, int) else f"{ref[0]}:{ref[1]}"
        self.lines.append(f"output {r} {int(maxbytes)}")
        return sum(1 for ln in self.lines if ln.startswith("output ")) - 1

    def output_all(self) -> dict:
        """Make every output port of every op node a graph output -> {(id, port): output index}."""
        idx = {}
        for nid, _, outs in self.op_nodes:
            for p, (es, sh) in enumerate(outs):
                idx[(nid, p)] = self.output((nid, p), es * math.prod(sh))
        return idx

    def option(self, name: str, value: int):
        """hexagon_nn_set_graph_option, e.g. ``test_no_d32conv`` = 1 keeps flat ops flat."""
        self.lines.insert(0, f"option {name} {int(value)}")

    def spec(self) -> str:
        return "# maceq tools/nnlib harness spec\n" + "\n".join(self.lines) + "\n"


@dataclass
class Result:
    prepared: bool
    executed: bool
    nodes: list  # [(node_id, op_name)] after prepare (nnlib's rewritten graph)
    outputs: list  # raw bytes per graph output
    shapes: list  # (b, h, w, d) per graph output
    time_prepare_s: float | None
    time_execute_s: float | None
    wall_s: float
    log: str
    stdout: str
    returncode: int

    def array(self, i: int, dtype) -> np.ndarray:
        a = np.frombuffer(self.outputs[i], dtype=dtype)
        b, h, w, d = self.shapes[i]
        return a.reshape(b, h, w, d) if a.size == b * h * w * d else a

    def scalar(self, i: int) -> float:
        return float(np.frombuffer(self.outputs[i], dtype=np.float32)[0])

    def ops(self) -> list:
        return [op for _, op in self.nodes]


def find_harness(harness=None) -> str:
    h = harness or os.environ.get("NNLIB_HARNESS") or DEFAULT_HARNESS
    if not Path(h).is_file():
        raise NnlibError(f"harness {h} not found: run tools/nnlib/setup.sh first (or set NNLIB_HARNESS)")
    return h


def find_qemu(qemu=None) -> str:
    q = qemu or os.environ.get("NNLIB_QEMU") or "qemu-hexagon-static"
    p = shutil.which(q)
    if not p:
        raise NnlibError(f"{q} not found: apt-get install qemu-user-static (or set NNLIB_QEMU)")
    return p


def run_graph(g: Graph, *, prepare_only=False, harness=None, qemu=None, debug=0, iters=1, workdir=None,
              keep=False, timeout=600, qemu_args=()) -> Result:
    """Write the spec, run the harness under QEMU (``-cpu v67``), read result.txt and outputs."""
    h, q = find_harness(harness), find_qemu(qemu)
    tmp = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="nnlib-run-"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        for name, data in g.files.items():
            (tmp / name).write_bytes(data)
        (tmp / "spec.txt").write_text(g.spec())
        out = tmp / "out"
        out.mkdir(exist_ok=True)
        cmd = [q, "-cpu", "v67", *qemu_args, h, "-v", str(debug), "--iters", str(iters)]
        if prepare_only:
            cmd.append("--prepare-only")
        cmd += [str(tmp / "spec.txt"), str(out)]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - t0
        if p.returncode not in (0, 2, 3):
            raise NnlibError(f"harness failed (rc {p.returncode}): {p.stderr.strip()[-2000:]}")
        res = Result(False, False, [], [], [], None, None, wall, "", p.stdout + p.stderr, p.returncode)
        rpath = out / "result.txt"
        if rpath.is_file():
            for ln in rpath.read_text().splitlines():
                f = ln.split()
                if f[0] == "prepare":
                    res.prepared = f[1] == "ok"
                elif f[0] == "execute":
                    res.executed = f[1] == "ok"
                elif f[0] == "node":
                    res.nodes.append((int(f[1]), f[2]))
                elif f[0] == "output":
                    i = int(f[1])
                    res.shapes.append(tuple(int(v) for v in f[2:6]))
                    res.outputs.append((out / f"out{i}.bin").read_bytes())
                elif f[0] == "time_prepare_s":
                    res.time_prepare_s = float(f[1])
                elif f[0] == "time_execute_s":
                    res.time_execute_s = float(f[1])
        if (out / "log.txt").is_file():
            res.log = (out / "log.txt").read_text(errors="replace")
        return res
    finally:
        if not keep and not workdir:
            shutil.rmtree(tmp, ignore_errors=True)


def _check(res: Result, what: str, prepare_only: bool):
    if not res.prepared:
        raise NnlibError(f"nnlib rejected {what} at prepare: {res.log.strip()[-1500:] or res.stdout[-1500:]}")
    if not prepare_only and not res.executed:
        raise NnlibError(f"nnlib failed to execute {what}: {res.log.strip()[-1500:] or res.stdout[-1500:]}")


_F = (4, (1, 1, 1, 1))


# ----------------------------------------------------------------------------------------------
# Single-op helpers (MACE's input order for each op)
# ----------------------------------------------------------------------------------------------

def _addsub(op, a, b, *, a_min, a_max, b_min, b_max, out_min, out_max, d32, prepare_only, options=None, **kw):
    a, b = np.asarray(a, np.uint8), np.asarray(b, np.uint8)
    g = Graph()
    for k, v in (options or {}).items():
        g.option(k, v)
    ia, ib = g.feed(a), g.feed(b)
    if d32:
        ia = g.node("Convert_from_d32", [g.node("Convert_to_d32", [ia], [(1, a.shape)])], [(1, a.shape)])
        ib = g.node("Convert_from_d32", [g.node("Convert_to_d32", [ib], [(1, b.shape)])], [(1, b.shape)])
    oshape = np.broadcast_shapes(a.shape, b.shape)
    n = g.node(op, [ia, ib, g.scalar(a_min), g.scalar(a_max), g.scalar(b_min), g.scalar(b_max),
                    g.scalar(out_min), g.scalar(out_max)],
               [(1, oshape), _F, _F])
    g.output((n, 0), math.prod(oshape))
    g.output((n, 1), 4)
    g.output((n, 2), 4)
    res = run_graph(g, prepare_only=prepare_only, **kw)
    if prepare_only:
        return res.prepared, res
    _check(res, op, False)
    return res.array(0, np.uint8), res.scalar(1), res.scalar(2), res


def quantized_add(a, b, *, a_min, a_max, b_min, b_max, out_min=-math.inf, out_max=math.inf, d32=False,
                  prepare_only=False, **kw):
    """QuantizedAdd_8p8to8 as MACE emits it (a, b, a_min, a_max, b_min, b_max, out_min, out_max).

    d32=False: both inputs straight from INPUT with equal shapes: nnlib keeps the flat op
    (op_add.c, add_core_hvx). d32=True: each input passes Convert_to_d32 -> Convert_from_d32
    first, as when the producers are d32 ops (e.g. Supernodes): prepare then turns the add into
    QuantizedAdd_8p8to8_d32 (op_add_d32.c, core_add_d32_general_hvx). Returns
    (y, y_min, y_max, Result), or (accepted, Result) with prepare_only.
    """
    return _addsub("QuantizedAdd_8p8to8", a, b, a_min=a_min, a_max=a_max, b_min=b_min, b_max=b_max,
                   out_min=out_min, out_max=out_max, d32=d32, prepare_only=prepare_only, **kw)


def quantized_sub(a, b, *, a_min, a_max, b_min, b_max, out_min=-math.inf, out_max=math.inf,
                  prepare_only=False, **kw):
    """QuantizedSub_8p8to8 (a - b); nnlib always runs it as QuantizedSub_8p8to8_d32."""
    return _addsub("QuantizedSub_8p8to8", a, b, a_min=a_min, a_max=a_max, b_min=b_min, b_max=b_max,
                   out_min=out_min, out_max=out_max, d32=False, prepare_only=prepare_only, **kw)


def _conv_out_hw(h, w, kh, kw, sh, sw, padding):
    p = PADDING[padding] if isinstance(padding, str) else int(padding)
    if p == PADDING["VALID"]:
        return (h - kh + sh) // sh, (w - kw + sw) // sw
    return (h + sh - 1) // sh, (w + sw - 1) // sw  # SAME, SAME_CAFFE


def _supernode(op, x, w, bias, *, x_min, x_max, w_min, w_max, bias_min, bias_max, out_min, out_max, strides,
               padding, out_depth, prepare_only, options=None, **kw):
    x = np.asarray(x, np.uint8)
    w = np.asarray(w, np.uint8)
    bias = np.asarray(bias, np.int32).reshape(-1)
    n, h, wd, _ = x.shape
    kh, kw_ = w.shape[:2]
    sh, sw = (int(s) for s in strides)
    oh, ow = _conv_out_hw(h, wd, kh, kw_, sh, sw, padding)
    g = Graph()
    for k, v in (options or {}).items():
        g.option(k, v)
    ix = g.feed(x)
    # MACE order: input, filter, in min/max, filter min/max, strides, bias, bias min/max, out min/max
    node = g.node(op, [ix, g.const(w), g.scalar(x_min), g.scalar(x_max), g.scalar(w_min), g.scalar(w_max),
                       g.empty_const((1, sh, sw, 1)), g.const(bias, (1, 1, 1, bias.size)),
                       g.scalar(bias_min), g.scalar(bias_max), g.scalar(out_min), g.scalar(out_max)],
                  [(1, (n, oh, ow, out_depth)), _F, _F], padding=padding)
    g.output((node, 0), n * oh * ow * out_depth)
    g.output((node, 1), 4)
    g.output((node, 2), 4)
    res = run_graph(g, prepare_only=prepare_only, **kw)
    if prepare_only:
        return res.prepared, res
    _check(res, op, False)
    return res.array(0, np.uint8), res.scalar(1), res.scalar(2), res


def supernode(x, w, bias, *, x_min, x_max, w_min, w_max, bias_min, bias_max, out_min=-math.inf,
              out_max=math.inf, strides, padding, op="Supernode_8x8p32to8", prepare_only=False, **kw):
    """Supernode_8x8p32to8 (MACE Conv2D): w HWIO [KH, KW, C, O], bias int32 [O].

    What runs: prepare rewrites it to Supernode_8x8p32to8_d32 (input depth > 4) or
    InputSupernode_8x8p32to8_outd32 (depth <= 4). ``op="Supernode_8x8p32to8_ref"`` runs the
    flat C reference (supernode_execute_ref); ``options={"test_no_d32conv": 1}`` keeps the flat
    op (supernode_execute_hvx).
    """
    return _supernode(op, x, w, bias, x_min=x_min, x_max=x_max, w_min=w_min, w_max=w_max,
                      bias_min=bias_min, bias_max=bias_max, out_min=out_min, out_max=out_max, strides=strides,
                      padding=padding, out_depth=np.asarray(w).shape[3], prepare_only=prepare_only, **kw)


def depthwise_supernode(x, w, bias, *, x_min, x_max, w_min, w_max, bias_min, bias_max, out_min=-math.inf,
                        out_max=math.inf, strides, padding, prepare_only=False, **kw):
    """DepthwiseSupernode_8x8p32to8 (MACE DepthwiseConv2d): w [KH, KW, C, 1], bias int32 [C]."""
    w = np.asarray(w)
    return _supernode("DepthwiseSupernode_8x8p32to8", x, w, bias, x_min=x_min, x_max=x_max, w_min=w_min,
                      w_max=w_max, bias_min=bias_min, bias_max=bias_max, out_min=out_min, out_max=out_max,
                      strides=strides, padding=padding, out_depth=w.shape[2] * w.shape[3],
                      prepare_only=prepare_only, **kw)


# ----------------------------------------------------------------------------------------------
# Demo: compare with maceq's dsp simulation
# ----------------------------------------------------------------------------------------------

@dataclass
class Cmp:
    name: str
    n: int = 0
    nbad: int = 0
    maxabs: int = 0
    dvals: tuple = ()
    range_ok: bool = True
    note: str = ""

    def line(self) -> str:
        s = f"{self.name}: "
        if self.note:
            return s + self.note
        s += f"{self.nbad}/{self.n} differ"
        if self.nbad:
            s += f" (max |d| {self.maxabs}, d in {list(self.dvals)[:6]})"
        return s + ("" if self.range_ok else " RANGE DIFFERS")


def compare(name, got, want) -> Cmp:
    """got/want: (y, y_min, y_max) or an Exception (op rejected / failed)."""
    c = Cmp(name)
    if isinstance(got, Exception) or isinstance(want, Exception):
        if isinstance(got, Exception) and isinstance(want, Exception):
            c.note = "both reject"
        else:
            c.note = ("nnlib fails, maceq runs" if isinstance(got, Exception) else "maceq raises, nnlib runs")
            c.nbad, c.range_ok = 1, False
            bad = got if isinstance(got, Exception) else want
            c.note += f": {str(bad).splitlines()[0][:160] if str(bad) else type(bad).__name__}"
        return c
    y, ymin, ymax = got
    s, smin, smax = want
    c.n = int(s.size)
    if y.shape != s.shape:
        c.note, c.nbad, c.range_ok = f"shape nnlib {y.shape} vs maceq {s.shape}", c.n, False
        return c
    d = y.astype(np.int64) - s.astype(np.int64)
    c.nbad = int(np.count_nonzero(d))
    if c.nbad:
        c.maxabs = int(np.abs(d).max())
        c.dvals = tuple(sorted(set(d[d != 0].tolist())))
    c.range_ok = bool(np.float32(ymin) == np.float32(smin) and np.float32(ymax) == np.float32(smax))
    if not c.range_ok:
        c.name += f" [range nnlib {np.float32(ymin)!r},{np.float32(ymax)!r} maceq {np.float32(smin)!r},{np.float32(smax)!r}]"
    return c


def _try(f):
    try:
        return f()
    except Exception as e:  # noqa: BLE001 - both sides' rejections are compared
        return e


def _rand_range(rng, lo=-4.0, hi=4.0):
    """A random [min, max] with min <= 0 <= max (sometimes one-sided)."""
    a, b = sorted(rng.uniform(lo, hi, 2).tolist())
    kind = rng.integers(0, 4)
    if kind == 0:
        a = 0.0
    if a > 0:
        a = -0.1 * a
    if b <= 0:
        b = 0.1 * abs(b) + 0.01
    return float(a), float(b)


def patch_maceq(K):
    """No-op kept for ``--patch-maceq``: the two deviations it used to monkeypatch are fixed in maceq.

    1. ``nnlib_ref.addsub_execute`` now pads a self-found QuantizedAdd/Sub range with
       ``0.15f * out_range`` (op_add.c ``check_addsub_need_rerun``).
    2. ``dsp.supernode(variant=D32)`` starts an open output range at the node's own defaults
       (``nnlib_ref.D32Node``: Supernode_8x8p32to8_d32 (0, 0.5), InputSupernode (-1/128, 1/128)).
    Returns a function that undoes nothing.
    """
    return lambda: None


def demo(seed=0, n_add=12, n_conv=12, n_dw=8, harness=None, verbose=True, save_dir=None, patch=False):
    """Random-configuration comparison; returns {op group: [Cmp...]}.

    save_dir: configurations with differences are saved there as .npz (inputs, args, both results).
    """
    try:
        from maceq.quant import converter as QC
        from maceq.runtime.kernels import dsp as K
    except ImportError as e:
        raise NnlibError(f"maceq not importable ({e}): pip install -e the repo first") from None

    undo = patch_maceq(K) if patch else None
    try:
        return _demo(K, seed, n_add, n_conv, n_dw, harness, verbose, save_dir)
    finally:
        if undo:
            undo()


class _Recorder:
    """Collects the comparisons of the demo by group; saves differing cases when asked."""

    def __init__(self, verbose, save_dir):
        self.groups: dict = {}
        self.verbose, self.save_dir = verbose, save_dir

    def add(self, group, c, res=None, case=None):
        self.groups.setdefault(group, []).append(c)
        if self.save_dir and case is not None and (c.nbad or not c.range_ok):
            Path(self.save_dir).mkdir(parents=True, exist_ok=True)
            fn = Path(self.save_dir) / f"{group.split()[0]}_{len(self.groups[group]) - 1}.npz"
            arrays, meta = {}, {}
            for k, v in case.items():
                if isinstance(v, np.ndarray):
                    arrays[k] = v
                elif isinstance(v, tuple) and len(v) == 3 and isinstance(v[0], np.ndarray):
                    arrays[k] = v[0]
                    meta[k + "_range"] = [float(v[1]), float(v[2])]
                else:
                    meta[k] = v if not isinstance(v, Exception) else f"{type(v).__name__}: {v}"
            # plain arrays + a JSON string: np.load(fn, allow_pickle=False) reads it
            np.savez(fn, meta=np.array(json.dumps(meta, default=str)), **arrays)
            c.name += f" (saved {fn})"
        if self.verbose:
            t = f" ({res.wall_s:.2f}s)" if res is not None else ""
            print(f"[{group}] {c.line()}{t}", flush=True)

    @staticmethod
    def ops_of(res):
        return "/".join(o for o in res.ops() if o not in ("INPUT", "OUTPUT")) if res else "-"


def _demo_addsub(K, rng, n_add, kw, rec):
    # ---- QuantizedAdd_8p8to8 (flat and d32), QuantizedSub_8p8to8 ------------------------------
    out_kinds = ["sum", "inf", "narrow", "wide", "underrange", "sum", "fixed-pos"]
    for i in range(n_add):
        shape = (1, int(rng.integers(1, 9)), int(rng.integers(1, 13)), int(rng.choice([1, 3, 19, 32, 40, 64, 100])))
        a = rng.integers(0, 256, shape, dtype=np.uint8)
        b = rng.integers(0, 256, shape, dtype=np.uint8)
        (amin, amax), (bmin, bmax) = _rand_range(rng), _rand_range(rng)
        kind = out_kinds[i % len(out_kinds)]
        omin, omax = {"sum": (amin + bmin, amax + bmax), "inf": (-math.inf, math.inf),
                      "narrow": (0.25 * (amin + bmin), 0.25 * (amax + bmax)),
                      "wide": (4 * (amin + bmin) - 1, 4 * (amax + bmax)),
                      "underrange": ((amin + bmin) / 300 - 1e-4, (amax + bmax) / 300),
                      "fixed-pos": (0.0, amax + bmax)}[kind]
        want = _try(lambda: K.quantized_add(a, b, a_min=amin, a_max=amax, b_min=bmin, b_max=bmax,
                                            out_min=omin, out_max=omax))
        for d32 in (False, True):
            r = _try(lambda: quantized_add(a, b, a_min=amin, a_max=amax, b_min=bmin, b_max=bmax, out_min=omin,
                                           out_max=omax, d32=d32, **kw))
            res = None if isinstance(r, Exception) else r[3]
            got = r if isinstance(r, Exception) else r[:3]
            rec.add("QuantizedAdd_8p8to8" + ("_d32" if d32 else ""),
                compare(f"{shape} out={kind} [{rec.ops_of(res)}]", got, want), res,
                dict(a=a, b=b, args=dict(a_min=amin, a_max=amax, b_min=bmin, b_max=bmax, out_min=omin,
                                         out_max=omax), nnlib=got, maceq=want))
        if i % 3 == 0:
            want = _try(lambda: K.quantized_sub(a, b, a_min=amin, a_max=amax, b_min=bmin, b_max=bmax,
                                                out_min=omin if kind != "sum" else amin - bmax,
                                                out_max=omax if kind != "sum" else amax - bmin))
            r = _try(lambda: quantized_sub(a, b, a_min=amin, a_max=amax, b_min=bmin, b_max=bmax,
                                           out_min=omin if kind != "sum" else amin - bmax,
                                           out_max=omax if kind != "sum" else amax - bmin, **kw))
            res = None if isinstance(r, Exception) else r[3]
            rec.add("QuantizedSub_8p8to8", compare(f"{shape} out={kind} [{rec.ops_of(res)}]",
                                               r if isinstance(r, Exception) else r[:3], want), res)


def _demo_supernode(K, rng, n_conv, kw, rec):
    from maceq.quant import converter as QC

    # ---- Supernode_8x8p32to8 -----------------------------------------------------------------
    fixed_conv = [((1, 8, 8, 32), 3, 32, 1, "SAME", "fixed"), ((1, 8, 8, 16), 1, 32, 1, "VALID", "fixed"),
                  ((1, 9, 9, 32), 3, 64, 2, "SAME", "fixed"), ((1, 7, 10, 24), 3, 40, 1, "VALID", "inf"),
                  ((1, 8, 8, 3), 3, 32, 2, "SAME", "fixed"), ((1, 6, 6, 64), 5, 32, 1, "SAME", "relu")]
    conv_cases = list(fixed_conv)
    while len(conv_cases) < n_conv:
        k = int(rng.choice([1, 3, 5]))
        conv_cases.append(((1, int(rng.integers(k, 12)), int(rng.integers(k, 12)), int(rng.choice([3, 8, 16, 32, 48, 64]))),
                           k, int(rng.choice([8, 32, 40, 64])), int(rng.choice([1, 2])),
                           str(rng.choice(["SAME", "VALID"])), str(rng.choice(["fixed", "fixed", "relu", "inf"]))))
    for shape, k, o, st, pad, kind in conv_cases[:max(n_conv, 0)]:
        x = rng.integers(0, 256, shape, dtype=np.uint8)
        w = rng.integers(0, 256, (k, k, shape[3], o), dtype=np.uint8)
        xmin, xmax = _rand_range(rng, -2, 2)
        wmin, wmax = _rand_range(rng, -1, 1)
        bias, bmin, bmax = QC.mace_quantize_bias(rng.normal(0, 2, o))
        scale = math.sqrt(k * k * shape[3]) * max(abs(xmin), xmax) * max(abs(wmin), wmax) * 0.3
        omin, omax = {"fixed": (-scale, scale), "relu": (0.0, scale), "inf": (-math.inf, math.inf)}[kind]
        args = dict(x_min=xmin, x_max=xmax, w_min=wmin, w_max=wmax, bias_min=bmin, bias_max=bmax, out_min=omin,
                    out_max=omax, strides=(st, st), padding=pad)
        tag = f"{shape} k{k} o{o} s{st} {pad} out={kind}"
        for group, nn_kw, mq_kw in (
                ("Supernode_8x8p32to8 vs maceq d32", {}, dict(variant=K.SupernodeVariant.D32)),
                ("Supernode_8x8p32to8_ref vs maceq ref+quirk", {"op": "Supernode_8x8p32to8_ref"},
                 dict(variant=K.SupernodeVariant.REF, ref_pad_quirk=True))):
            var = mq_kw["variant"]
            r = _try(lambda: supernode(x, w, bias, **args, **nn_kw, **kw))
            want = _try(lambda: K.supernode(x, w, bias, **args, **mq_kw))
            res = None if isinstance(r, Exception) else r[3]
            rec.add(group, compare(f"{tag} [{rec.ops_of(res)}]", r if isinstance(r, Exception) else r[:3], want), res,
                dict(x=x, w=w, bias=bias, args=args, variant=var.value, nnlib=r if isinstance(r, Exception) else r[:3],
                     maceq=want))


def _demo_depthwise(K, rng, n_dw, kw, rec):
    from maceq.quant import converter as QC

    # ---- DepthwiseSupernode_8x8p32to8 --------------------------------------------------------
    dw_cases = [((1, 8, 8, 32), 3, 1, "SAME", "fixed"), ((1, 9, 9, 64), 3, 2, "SAME", "fixed"),
                ((1, 8, 8, 32), 5, 1, "VALID", "inf")]
    while len(dw_cases) < n_dw:
        k = int(rng.choice([3, 5, 7]))
        dw_cases.append(((1, int(rng.integers(k, 14)), int(rng.integers(k, 14)), int(rng.choice([8, 32, 40, 64, 96]))),
                         k, int(rng.choice([1, 2])), str(rng.choice(["SAME", "VALID"])),
                         str(rng.choice(["fixed", "fixed", "relu", "inf"]))))
    for shape, k, st, pad, kind in dw_cases[:max(n_dw, 0)]:
        c = shape[3]
        x = rng.integers(0, 256, shape, dtype=np.uint8)
        w = rng.integers(0, 256, (k, k, c, 1), dtype=np.uint8)
        xmin, xmax = _rand_range(rng, -2, 2)
        wmin, wmax = _rand_range(rng, -1, 1)
        bias, bmin, bmax = QC.mace_quantize_bias(rng.normal(0, 1, c))
        scale = k * max(abs(xmin), xmax) * max(abs(wmin), wmax) * 0.5
        omin, omax = {"fixed": (-scale, scale), "relu": (0.0, scale), "inf": (-math.inf, math.inf)}[kind]
        args = dict(x_min=xmin, x_max=xmax, w_min=wmin, w_max=wmax, bias_min=bmin, bias_max=bmax, out_min=omin,
                    out_max=omax, strides=(st, st), padding=pad)
        r = _try(lambda: depthwise_supernode(x, w, bias, **args, **kw))
        want = _try(lambda: K.depthwise_supernode(x, w, bias, **args))
        res = None if isinstance(r, Exception) else r[3]
        rec.add("DepthwiseSupernode_8x8p32to8", compare(f"{shape} k{k} s{st} {pad} out={kind} [{rec.ops_of(res)}]",
                                                    r if isinstance(r, Exception) else r[:3], want), res,
            dict(x=x, w=w, bias=bias, args=args, nnlib=r if isinstance(r, Exception) else r[:3], maceq=want))


def _demo(K, seed, n_add, n_conv, n_dw, harness, verbose, save_dir):
    rng = np.random.default_rng(seed)
    kw = dict(harness=harness)
    rec = _Recorder(verbose, save_dir)
    _demo_addsub(K, rng, n_add, kw, rec)
    _demo_supernode(K, rng, n_conv, kw, rec)
    _demo_depthwise(K, rng, n_dw, kw, rec)
    return rec.groups


def acceptance(harness=None, verbose=True, seed=0):
    """Which conv configurations nnlib accepts (prepare + execute succeed) vs maceq's supports_conv.

    Returns [(config, nnlib_ok, maceq_ok, detail)].
    """
    from maceq.runtime.kernels import dsp as K

    rng = np.random.default_rng(seed)
    cases = []  # (depthwise, kernel, stride, depth multiplier, padding)
    for k in [(1, 1), (2, 2), (3, 3), (1, 3), (3, 1), (5, 5), (7, 7), (9, 9), (3, 7), (7, 3)]:
        for st in (1, 2, 3):
            cases.append((True, k, (st, st), 1, "SAME"))
    cases += [(True, (3, 3), (1, 1), 2, "SAME"), (True, (3, 3), (1, 1), 1, "VALID"), (True, (3, 3), (1, 1), 1, "NA")]
    for k in [(1, 1), (3, 3), (5, 5), (7, 7), (11, 11), (1, 7), (7, 1)]:
        for st in (1, 2, 3, 4):
            cases.append((False, k, (st, st), 1, "SAME"))
    cases += [(False, (3, 3), (1, 1), 1, "VALID"), (False, (3, 3), (1, 1), 1, "NA")]
    out = []
    for dw, k, st, m, pad in cases:
        c = 32
        x = rng.integers(0, 256, (1, 16, 16, c), dtype=np.uint8)
        args = dict(x_min=-1.0, x_max=1.0, w_min=-1.0, w_max=1.0, bias_min=0.0, bias_max=0.0, out_min=-8.0,
                    out_max=8.0, strides=st, padding=pad)
        if dw:
            w = rng.integers(0, 256, (*k, c, m), dtype=np.uint8)
            r = _try(lambda: depthwise_supernode(x, w, np.zeros(c * m, np.int32), harness=harness, **args))
        else:
            w = rng.integers(0, 256, (*k, c, 32), dtype=np.uint8)
            r = _try(lambda: supernode(x, w, np.zeros(32, np.int32), harness=harness, **args))
        ok_n = not isinstance(r, Exception)
        ran = "/".join(o for o in r[3].ops() if o not in ("INPUT", "OUTPUT")) if ok_n else ""
        ok_m, why = K.supports_conv(strides=st, dilations=(1, 1), pads=pad, kernel=k, depthwise=dw,
                                    depth_multiplier=m)
        detail = "" if ok_n else str(r).replace("\n", " ")[-160:]
        name = f"{'Depthwise' if dw else ''}Supernode k{k[0]}x{k[1]} s{st[0]} m{m} {pad}"
        out.append((name, ok_n, ok_m, detail if not ok_n else f"nnlib ran {ran}; maceq: {why or 'ok'}"))
        if verbose:
            flag = "agree" if ok_n == ok_m else "DISAGREE"
            print(f"[accept] {name}: nnlib {'ok [' + ran + ']' if ok_n else 'rejects'}, maceq "
                  f"{'ok' if ok_m else 'rejects'} -> {flag}{(': ' + (detail or why)) if (not ok_n or not ok_m) else ''}",
                  flush=True)
    return out


def summary(groups) -> list:
    lines = []
    for g, cs in groups.items():
        n_el = sum(c.n for c in cs)
        bad_el = sum(c.nbad for c in cs if not c.note)
        bad_cases = [c for c in cs if c.nbad or not c.range_ok]
        lines.append(f"{g}: {len(cs)} configs, {len(bad_cases)} with differences; "
                     f"{bad_el}/{n_el} output elements differ; "
                     f"{sum(1 for c in cs if not c.range_ok and not c.note)} output ranges differ; "
                     f"{sum(1 for c in cs if c.note == 'both reject')} rejected by both")
    return lines


# ----------------------------------------------------------------------------------------------
# More single-op helpers (MACE's other dsp ops) and their comparison with maceq
# ----------------------------------------------------------------------------------------------

def _run_single(g, node, out_shape, es, prepare_only, kw, what, n_ranges=2):
    """Outputs of ``node``: port 0 (``out_shape``, element size ``es``) and ``n_ranges`` float scalars."""
    g.output((node, 0), es * math.prod(_shape4(out_shape)))
    for p in range(1, 1 + n_ranges):
        g.output((node, p), 4)
    res = run_graph(g, prepare_only=prepare_only, **kw)
    if prepare_only:
        return res.prepared, res
    _check(res, what, False)
    y = res.array(0, np.uint8 if es == 1 else np.float32).reshape(out_shape)
    return (y, *(res.scalar(p) for p in range(1, 1 + n_ranges)), res)


def quantized_concat(inputs, in_ranges, *, axis=3, op="QuantizedConcat_8", prepare_only=False, **kw):
    """QuantizedConcat_8 as MACE emits it: (dim, x0..xn-1, min0..minn-1, max0..maxn-1).

    nnlib's prepare turns it into QuantizedConcat_8_d32 (depth32_replacement_op).
    Returns (y, y_min, y_max, Result)."""
    inputs = [np.asarray(t, np.uint8) for t in inputs]
    g = Graph()
    feeds = [g.feed(t) for t in inputs]
    dim = g.const(np.array([axis], np.int32), (1, 1, 1, 1))
    oshape = (*_shape4(inputs[0].shape)[:3], sum(int(t.shape[-1]) for t in inputs))
    n = g.node(op, [dim, *feeds, *(g.scalar(mn) for mn, _ in in_ranges), *(g.scalar(mx) for _, mx in in_ranges)],
               [(1, oshape), _F, _F])
    return _run_single(g, n, oshape, 1, prepare_only, kw, op)


def quantized_pool(op, x, *, x_min, x_max, kernel, strides, padding, prepare_only=False, **kw):
    """QuantizedMaxPool_8 / QuantizedAvgPool_8: (x, min, max, window [1,kh,kw,1], strides [1,sh,sw,1]).

    Window and strides are shape-only consts, as MACE's converter writes them (add_arg_const_node
    gives them data too; nnlib reads only the shape). Prepare makes them _d32 ops."""
    x = np.asarray(x, np.uint8)
    g = Graph()
    ix = g.feed(x)
    oh, ow = _conv_out_hw(x.shape[1], x.shape[2], kernel[0], kernel[1], strides[0], strides[1], padding)
    oshape = (x.shape[0], oh, ow, x.shape[3])
    n = g.node(op, [ix, g.scalar(x_min), g.scalar(x_max), g.empty_const((1, kernel[0], kernel[1], 1)),
                    g.empty_const((1, strides[0], strides[1], 1))], [(1, oshape), _F, _F], padding=padding)
    return _run_single(g, n, oshape, 1, prepare_only, kw, op)


def superfc(x, w, bias, *, x_min, x_max, w_min, w_max, bias_min, bias_max, out_min=-math.inf, out_max=math.inf,
            op="SuperFC_8x8p32to8", prepare_only=False, **kw):
    """SuperFC_8x8p32to8 (MACE FullyConnected): x [N, K] (fed as N x 1 x 1 x K), w [K, O] (const
    1 x 1 x K x O), bias int32 [O]; inputs in MACE's order (x, w, x min/max, w min/max, bias,
    bias min/max, out min/max). ``op="SuperFC_8x8p32to8_ref"`` runs superfc_execute_ref."""
    x = np.asarray(x, np.uint8)
    w = np.asarray(w, np.uint8)
    bias = np.asarray(bias, np.int32).reshape(-1)
    nb, k = x.shape
    o = w.shape[1]
    g = Graph()
    ix = g.feed(x.reshape(nb, 1, 1, k))
    n = g.node(op, [ix, g.const(w, (1, 1, k, o)), g.scalar(x_min), g.scalar(x_max), g.scalar(w_min),
                    g.scalar(w_max), g.const(bias, (1, 1, 1, o)), g.scalar(bias_min), g.scalar(bias_max),
                    g.scalar(out_min), g.scalar(out_max)], [(1, (1, 1, nb, o)), _F, _F])
    return _run_single(g, n, (nb, o), 1, prepare_only, kw, op)


def quantize_op(xf, *, x_min=None, x_max=None, op="Quantize", prepare_only=False, **kw):
    """nnlib Quantize / Quantize_ref (x float, min, max) or AutoQuantize (x float; range from the
    data, ``autoquantize_execute_opt``: the arithmetic QuantizeINPUT_f_to_8 applies to MACE's
    graph input through hexagon_nn_execute_new). Returns (q, min, max, Result)."""
    xf = np.asarray(xf, np.float32)
    g = Graph()
    ix = g.feed(xf)
    ins = [ix] if x_min is None else [ix, g.scalar(x_min), g.scalar(x_max)]
    n = g.node(op, ins, [(1, xf.shape), _F, _F])
    return _run_single(g, n, xf.shape, 1, prepare_only, kw, op)


def dequantize_op(q, *, q_min, q_max, op="Dequantize", prepare_only=False, **kw):
    """nnlib Dequantize (q, min, max) -> float32 (``dequantize_execute``: hvx_do_dequantize, the
    arithmetic of DequantizeOUTPUT_8tof). Returns (y, Result)."""
    q = np.asarray(q, np.uint8)
    g = Graph()
    n = g.node(op, [g.feed(q), g.scalar(q_min), g.scalar(q_max)], [(4, q.shape)])
    r = _run_single(g, n, q.shape, 4, prepare_only, kw, op, n_ranges=0)
    return r


def conv_then_avgpool(x, w, bias, *, x_min, x_max, w_min, w_max, bias_min, bias_max, out_min, out_max, kernel,
                      strides, padding, prepare_only=False, **kw):
    """Supernode_8x8p32to8 (1x1, stride 1, fixed output range) feeding QuantizedAvgPool_8 through its
    min / max ports, as in a MACE graph: both run as d32 ops, so the pool's input depth padding
    holds what the Supernode wrote there (its padded filters' outputs). Returns the pool's
    (y, y_min, y_max, Result)."""
    x = np.asarray(x, np.uint8)
    n, h, wd, _ = x.shape
    o = np.asarray(w).shape[3]
    g = Graph()
    conv = g.node("Supernode_8x8p32to8", [g.feed(x), g.const(np.asarray(w, np.uint8)), g.scalar(x_min), g.scalar(x_max),
                                          g.scalar(w_min), g.scalar(w_max), g.empty_const((1, 1, 1, 1)),
                                          g.const(np.asarray(bias, np.int32), (1, 1, 1, o)), g.scalar(bias_min),
                                          g.scalar(bias_max), g.scalar(out_min), g.scalar(out_max)],
                  [(1, (n, h, wd, o)), _F, _F], padding="SAME")
    oh, ow = _conv_out_hw(h, wd, kernel[0], kernel[1], strides[0], strides[1], padding)
    oshape = (n, oh, ow, o)
    pool = g.node("QuantizedAvgPool_8", [conv, (conv, 1), (conv, 2), g.empty_const((1, kernel[0], kernel[1], 1)),
                                         g.empty_const((1, strides[0], strides[1], 1))], [(1, oshape), _F, _F],
                  padding=padding)
    return _run_single(g, pool, oshape, 1, prepare_only, kw, "Supernode -> QuantizedAvgPool_8")


def demo_global_avgpool(seed=0, n=20, harness=None, verbose=True):
    """Global average pooling (1x1 output: avgpool_reduce_to_1x1, a range found from the data) after
    a d32 conv, vs maceq's dsp.supernode(D32) then dsp.quantized_avgpool -> {group: [Cmp...]}."""
    from maceq.quant import converter as QC
    from maceq.runtime.kernels import dsp as K
    rng = np.random.default_rng(seed)
    groups: dict = {}
    for _ in range(n):
        nb, h, wd, c = int(rng.choice([1, 1, 2])), int(rng.integers(1, 10)), int(rng.integers(1, 10)), int(
            rng.choice([8, 16, 32, 33, 40]))
        o = int(rng.choice([3, 8, 32, 33, 40, 64]))
        x = rng.integers(0, 256, (nb, h, wd, c), dtype=np.uint8)
        w = rng.integers(0, 256, (1, 1, c, o), dtype=np.uint8)
        (xmin, xmax), (wmin, wmax) = _mace_range(rng, -2, 2), _mace_range(rng, -1, 1)
        bias, bmin, bmax = QC.mace_quantize_bias(rng.normal(0, 1, o))
        from maceq.quant.converter import mace_adjust_range_for_hexagon as adj
        scale = math.sqrt(c) * max(abs(xmin), xmax) * max(abs(wmin), wmax) * 0.3
        omin, omax = adj(-scale * float(rng.uniform(0, 1)), scale)[:2]
        kernel, strides, pad = ((h, wd), (1, 1), "VALID") if rng.random() < 0.5 else ((h, wd), (h, wd), "SAME")
        cargs = dict(x_min=xmin, x_max=xmax, w_min=wmin, w_max=wmax, bias_min=bmin, bias_max=bmax, out_min=omin,
                     out_max=omax)
        r = _try(lambda: conv_then_avgpool(x, w, bias, **cargs, kernel=kernel, strides=strides, padding=pad,
                                           harness=harness))

        def want():
            y, mn, mx = K.supernode(x, w, bias, **cargs, strides=(1, 1), padding="SAME", variant=K.SupernodeVariant.D32)
            return K.quantized_avgpool(y, x_min=mn, x_max=mx, kernel=kernel, strides=strides, padding=pad)
        _cmp_add(groups, "Supernode -> QuantizedAvgPool_8 (global)", f"{(nb, h, wd, c)} o{o} k{kernel} {pad}", r,
                 _try(want), verbose)
    return groups


def quantized_mean(x, *, x_min, x_max, axes, out_min=None, out_max=None, prepare_only=False, **kw):
    """QuantizedMean_8 as MACE emits it for Reduce (mean, keep dims): (x, min, max, axes int32[n],
    out_min, out_max); without out_min/out_max the 4-input form. Returns (y, y_min, y_max, Result)."""
    x = np.asarray(x, np.uint8)
    g = Graph()
    ins = [g.feed(x), g.scalar(x_min), g.scalar(x_max), g.const(np.asarray(axes, np.int32), (1, 1, 1, len(axes)))]
    if out_min is not None:
        ins += [g.scalar(out_min), g.scalar(out_max)]
    oshape = tuple(1 if d in {a % 4 for a in axes} else n for d, n in enumerate(_shape4(x.shape)))
    n = g.node("QuantizedMean_8", ins, [(1, oshape), _F, _F])
    return _run_single(g, n, oshape, 1, prepare_only, kw, "QuantizedMean_8")


def demo_mean(seed=0, n=20, harness=None, verbose=True):
    """QuantizedMean_8 vs maceq's dsp.quantized_mean -> {group: [Cmp...]}."""
    from maceq.runtime.kernels import dsp as K
    rng = np.random.default_rng(seed)
    groups: dict = {}
    for _ in range(n):
        shape = (int(rng.choice([1, 2])), int(rng.integers(1, 12)), int(rng.integers(1, 12)),
                 int(rng.choice([1, 8, 33, 64])))
        axes = [[1, 2], [1, 2], [2], [1], [3], [1, 2, 3]][int(rng.integers(0, 6))]
        x = rng.integers(0, 256, shape, dtype=np.uint8)
        xmin, xmax = _mace_range(rng)
        out = [(None, None), _mace_range(rng), (0.0, float(rng.uniform(0.1, 6)))][int(rng.integers(0, 3))]
        args = dict(x_min=xmin, x_max=xmax, axes=axes, out_min=out[0], out_max=out[1])
        r = _try(lambda: quantized_mean(x, **args, harness=harness))
        _cmp_add(groups, "QuantizedMean_8", f"{shape} axes={axes} out={out}", r,
                 _try(lambda: K.quantized_mean(x, **args)), verbose)
    return groups


def _ops_of(res):
    return "/".join(o for o in res.ops() if o not in ("INPUT", "OUTPUT")) if res else "-"


def _cmp_add(groups, group, name, r, want, verbose, ranges=True):
    """Record one comparison: r is nnlib's (y, min, max, Result) or an Exception."""
    res = None if isinstance(r, Exception) else r[-1]
    got = r if isinstance(r, Exception) else (r[:3] if ranges else (r[0], 0.0, 0.0))
    if not ranges and not isinstance(want, Exception):
        want = (want[0], 0.0, 0.0)
    c = compare(f"{name} [{_ops_of(res)}]", got, want)
    groups.setdefault(group, []).append(c)
    if verbose:
        print(f"[{group}] {c.line()}" + (f" ({res.wall_s:.2f}s)" if res is not None else ""), flush=True)
    return c


def _mace_range(rng, lo=-4.0, hi=4.0):
    """A random range, half the time adjusted as MACE's converter does (integral zero)."""
    mn, mx = _rand_range(rng, lo, hi)
    if rng.random() < 0.5:
        from maceq.quant import converter as QC
        mn, mx = QC.mace_adjust_range_for_hexagon(mn, mx)[:2]
    return float(mn), float(mx)


def _out_kind(rng, scale):
    kind = str(rng.choice(["fixed", "fixed", "relu", "inf", "min-given", "max-given"]))
    return kind, {"fixed": (-scale, scale), "relu": (0.0, scale), "inf": (-math.inf, math.inf),
                  "min-given": (-scale, math.inf), "max-given": (-math.inf, scale)}[kind]


def demo_conv_sweep(seed=0, n_conv=20, n_dw=12, harness=None, verbose=True):
    """Supernode / DepthwiseSupernode on wider geometry than ``demo``: any input depth (InputSupernode,
    the flat op for odd stride widths), rectangular kernels, strides up to 4, SAME_CAFFE, batch 2,
    output ranges with one end given, bias scales up to 100x (``fill_bias_buf``'s float32 rounding)."""
    from maceq.quant import converter as QC
    from maceq.runtime.kernels import dsp as K
    rng = np.random.default_rng(seed)
    groups: dict = {}
    for i in range(n_conv):
        c = int(rng.choice([1, 2, 3, 4, 5, 8, 16, 31, 32, 33, 48, 64]))
        kh, kw = (int(v) for v in rng.choice([1, 2, 3, 5, 7], 2))
        sh, sw = (int(v) for v in rng.integers(1, 5, 2))
        pad = str(rng.choice(["SAME", "VALID", "SAME_CAFFE"]))
        n, h, wd = int(rng.choice([1, 1, 2])), int(rng.integers(max(kh, 2), 14)), int(rng.integers(max(kw, 2), 14))
        o = int(rng.choice([1, 8, 32, 33, 64]))
        x = rng.integers(0, 256, (n, h, wd, c), dtype=np.uint8)
        w = rng.integers(0, 256, (kh, kw, c, o), dtype=np.uint8)
        (xmin, xmax), (wmin, wmax) = _mace_range(rng, -2, 2), _mace_range(rng, -1, 1)
        bias, bmin, bmax = QC.mace_quantize_bias(rng.normal(0, float(10 ** rng.uniform(-1, 2)), o))
        scale = math.sqrt(kh * kw * c) * max(abs(xmin), xmax) * max(abs(wmin), wmax) * 0.3
        kind, (omin, omax) = _out_kind(rng, scale)
        args = dict(x_min=xmin, x_max=xmax, w_min=wmin, w_max=wmax, bias_min=bmin, bias_max=bmax, out_min=omin,
                    out_max=omax, strides=(sh, sw), padding=pad)
        r = _try(lambda: supernode(x, w, bias, harness=harness, **args))
        want = _try(lambda: K.supernode(x, w, bias, variant=K.SupernodeVariant.D32, **args))
        # prepare.c: InputSupernode for depth <= 4 and stride_w <= 4 (flat for odd stride_w > 1), else _d32
        node = ("Supernode_8x8p32to8_d32" if c > 4 or sw > 4 else
                "flat Supernode_8x8p32to8" if sw > 1 and sw % 2 else "InputSupernode_8x8p32to8_outd32")
        _cmp_add(groups, f"Supernode_8x8p32to8 sweep vs maceq d32 [{node}]",
                 f"{(n, h, wd, c)} k{kh}x{kw} o{o} s{sh}x{sw} {pad} out={kind}", r, want, verbose)
    for i in range(n_dw):
        c = int(rng.choice([1, 3, 4, 8, 31, 32, 33, 40, 64, 96]))
        kh, kw = int(rng.choice([2, 3, 3, 5, 7])), int(rng.choice([3, 3, 5, 7]))
        sh, sw = int(rng.integers(1, 4)), int(rng.integers(1, 3))
        pad = str(rng.choice(["SAME", "VALID", "SAME_CAFFE"]))
        n, h, wd = int(rng.choice([1, 1, 2])), int(rng.integers(kh, 15)), int(rng.integers(kw, 15))
        x = rng.integers(0, 256, (n, h, wd, c), dtype=np.uint8)
        w = rng.integers(0, 256, (kh, kw, c, 1), dtype=np.uint8)
        (xmin, xmax), (wmin, wmax) = _mace_range(rng, -2, 2), _mace_range(rng, -1, 1)
        bias, bmin, bmax = QC.mace_quantize_bias(rng.normal(0, float(10 ** rng.uniform(-1, 1.5)), c))
        kind, (omin, omax) = _out_kind(rng, kh * max(abs(xmin), xmax) * max(abs(wmin), wmax) * 0.5)
        args = dict(x_min=xmin, x_max=xmax, w_min=wmin, w_max=wmax, bias_min=bmin, bias_max=bmax, out_min=omin,
                    out_max=omax, strides=(sh, sw), padding=pad)
        r = _try(lambda: depthwise_supernode(x, w, bias, harness=harness, **args))
        want = _try(lambda: K.depthwise_supernode(x, w, bias, **args))
        _cmp_add(groups, "DepthwiseSupernode_8x8p32to8 sweep",
                 f"{(n, h, wd, c)} k{kh}x{kw} s{sh}x{sw} {pad} out={kind}", r, want, verbose)
    return groups


def demo_ops(seed=0, n=10, harness=None, verbose=True):
    """QuantizedConcat_8, QuantizedMax/AvgPool_8, SuperFC_8x8p32to8 (+ _ref), Quantize (+ _ref),
    AutoQuantize and Dequantize on random inputs vs maceq's dsp kernels -> {group: [Cmp...]}."""
    from maceq.runtime.kernels import dsp as K
    rng = np.random.default_rng(seed)
    kw = dict(harness=harness)
    groups: dict = {}
    for _ in range(n):
        _demo_concat(K, rng, groups, kw, verbose)
        _demo_pools(K, rng, groups, kw, verbose)
        _demo_superfc(K, rng, groups, kw, verbose)
        _demo_quantize(K, rng, groups, kw, verbose)
    return groups


def _demo_concat(K, rng, groups, kw, verbose):
    nb, h, w = int(rng.choice([1, 1, 2])), int(rng.integers(1, 9)), int(rng.integers(1, 9))
    depths = [int(rng.choice([1, 3, 8, 32, 33, 40, 64])) for _ in range(int(rng.integers(1, 5)))]
    parts = [rng.integers(0, 256, (nb, h, w, d), dtype=np.uint8) for d in depths]
    rngs = [_mace_range(rng) for _ in parts]
    if rng.random() < 0.3:
        rngs = [rngs[0]] * len(parts)  # unity gain: the copy path
    r = _try(lambda: quantized_concat(parts, rngs, **kw))
    want = _try(lambda: K.quantized_concat(parts, axis=3, in_ranges=rngs))
    _cmp_add(groups, "QuantizedConcat_8", f"{(nb, h, w)} depths={depths}", r, want, verbose)


def _demo_pools(K, rng, groups, kw, verbose):
    nb, h, w, c = int(rng.choice([1, 1, 2])), int(rng.integers(1, 14)), int(rng.integers(1, 14)), int(
        rng.choice([1, 3, 8, 32, 33, 64, 100]))
    kernel = (int(rng.integers(1, 5)), int(rng.integers(1, 5))) if rng.random() < 0.8 else (h, w)
    strides = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
    pad = str(rng.choice(["SAME", "VALID"]))
    x = rng.integers(0, 256, (nb, h, w, c), dtype=np.uint8)
    if c % 32:  # a 1x1 avgpool output's range sees the depth-padding lanes, which Convert_to_d32 fills with
        c = max(c, 2)  # the following bytes: give the real channels the extreme sums (demo_global_avgpool
        x = rng.integers(0, 256, (nb, h, w, c), dtype=np.uint8)  # checks the padding after a d32 conv)
        x[..., 0], x[..., -1] = 0, 255
    xmin, xmax = _mace_range(rng)
    args = dict(x_min=xmin, x_max=xmax, kernel=kernel, strides=strides, padding=pad)
    for op, fn in (("QuantizedMaxPool_8", K.quantized_maxpool), ("QuantizedAvgPool_8", K.quantized_avgpool)):
        r = _try(lambda: quantized_pool(op, x, **args, **kw))
        want = _try(lambda: fn(x, **args))
        _cmp_add(groups, op, f"{x.shape} k{kernel} s{strides} {pad}", r, want, verbose)


def _demo_superfc(K, rng, groups, kw, verbose):
    from maceq.quant import converter as QC

    nb, k, o = int(rng.integers(1, 6)), int(rng.choice([16, 32, 40, 48, 64, 96, 128, 160])), int(
        rng.choice([1, 8, 32, 33, 70]))
    x = rng.integers(0, 256, (nb, k), dtype=np.uint8)
    w = rng.integers(0, 256, (k, o), dtype=np.uint8)
    (xmin, xmax), (wmin, wmax) = _mace_range(rng, -2, 2), _mace_range(rng, -1, 1)
    bias, bmin, bmax = QC.mace_quantize_bias(rng.normal(0, float(10 ** rng.uniform(-1, 1.5)), o))
    kind, (omin, omax) = _out_kind(rng, math.sqrt(k) * max(abs(xmin), xmax) * max(abs(wmin), wmax) * 0.3)
    args = dict(x_min=xmin, x_max=xmax, w_min=wmin, w_max=wmax, bias_min=bmin, bias_max=bmax, out_min=omin,
                out_max=omax)
    name = f"n{nb} k{k} o{o} out={kind}"
    r = _try(lambda: superfc(x, w, bias, **args, **kw))
    _cmp_add(groups, "SuperFC_8x8p32to8 vs dsp.superfc", name, r, _try(lambda: K.superfc(x, w, bias, **args)),
             verbose)
    r = _try(lambda: superfc(x, w, bias, op="SuperFC_8x8p32to8_ref", **args, **kw))
    _cmp_add(groups, "SuperFC_8x8p32to8_ref vs nnlib_ref.superfc_ref", name, r,
             _try(lambda: K.r.superfc_ref(x, w, bias, **args)), verbose)


def _demo_quantize(K, rng, groups, kw, verbose):
    scale = float(10 ** rng.uniform(-3, 2))
    shape = (1, int(rng.integers(1, 9)), int(rng.integers(1, 9)), int(rng.choice([1, 3, 32, 33])))
    xf = (rng.normal(size=shape) * scale).astype(np.float32)
    if rng.random() < 0.2:
        xf = np.abs(xf)
    lo, hi = -float(rng.uniform(0.01, 3)) * scale, float(rng.uniform(0.01, 3)) * scale
    for op, fn, name in (("Quantize", K.quantize, "dsp.quantize"),
                         ("Quantize_ref", K.r.quantize_ref, "nnlib_ref.quantize_ref")):
        r = _try(lambda: quantize_op(xf, x_min=lo, x_max=hi, op=op, **kw))
        _cmp_add(groups, f"{op} vs {name}", f"{shape} scale={scale:.3g}", r,
                 _try(lambda: fn(xf, min=lo, max=hi)), verbose)
    r = _try(lambda: quantize_op(xf, op="AutoQuantize", **kw))
    _cmp_add(groups, "AutoQuantize (QuantizeINPUT_f_to_8's arithmetic) vs dsp.quantize_input",
             f"{shape} scale={scale:.3g}", r, _try(lambda: K.quantize_input(xf)), verbose)
    q = rng.integers(0, 256, shape, dtype=np.uint8)
    r = _try(lambda: dequantize_op(q, q_min=lo, q_max=hi, **kw))
    got = r if isinstance(r, Exception) else (r[0].view(np.uint32), 0.0, 0.0, r[-1])
    want = _try(lambda: (K.dequantize(q, min=lo, max=hi).view(np.uint32), 0.0, 0.0))
    _cmp_add(groups, "Dequantize (DequantizeOUTPUT_8tof's arithmetic) vs dsp.dequantize, float bits",
             f"{shape} range=({lo:.3g}, {hi:.3g})", got, want, verbose)


def _bcast_shapes(rng):
    """Two 4-D shapes one broadcasts onto the other (either direction), or both all-ones."""
    full = [int(rng.choice([1, 2])), int(rng.integers(1, 8)), int(rng.integers(1, 8)), int(rng.choice([1, 3, 16, 32, 40]))]
    small = [d if rng.random() < 0.4 else 1 for d in full]
    if rng.random() < 0.15:
        small = [1, 1, 1, 1]
    if small == full:
        small[3] = 1 if full[3] > 1 else small[3]
        full[3] = max(full[3], 2)
    return (tuple(small), tuple(full)) if rng.random() < 0.4 else (tuple(full), tuple(small))


def demo_addsub_more(seed=0, n=10, harness=None, verbose=True):
    """QuantizedAdd/Sub beyond ``demo``: broadcasting inputs (prepare makes them _d32 ops whatever the
    producers; B broadcasts onto A or A onto B; one value with both ends open is the 1111 scaled
    copy) and same-shape adds with one output end given, flat and d32 (the two range logics
    differ there) -> {group: [Cmp...]}."""
    from maceq.runtime.kernels import dsp as K
    from maceq.runtime.kernels import nnlib_ref as R
    rng = np.random.default_rng(seed)
    groups: dict = {}
    for _ in range(n):
        sa, sb = _bcast_shapes(rng)
        a, b = rng.integers(0, 256, sa, dtype=np.uint8), rng.integers(0, 256, sb, dtype=np.uint8)
        (amin, amax), (bmin, bmax) = _mace_range(rng), _mace_range(rng)
        kind, (omin, omax) = _out_kind(rng, float(rng.uniform(1, 8)))
        args = dict(a_min=amin, a_max=amax, b_min=bmin, b_max=bmax, out_min=omin, out_max=omax)
        name = f"{sa} {sb} out={kind}"
        for op, fn, nf in (("QuantizedAdd_8p8to8", K.quantized_add, quantized_add),
                           ("QuantizedSub_8p8to8", K.quantized_sub, quantized_sub)):
            _cmp_add(groups, f"{op} broadcast vs dsp", name, _try(lambda: nf(a, b, **args, harness=harness)),
                     _try(lambda: fn(a, b, **args)), verbose)
        shape = sa if np.prod(sa) >= np.prod(sb) else sb
        a, b = rng.integers(0, 256, shape, dtype=np.uint8), rng.integers(0, 256, shape, dtype=np.uint8)
        kind = str(rng.choice(["min-given", "max-given", "inf"]))
        omin, omax = {"min-given": (omin, math.inf), "max-given": (-math.inf, omax), "inf": (-math.inf, math.inf)}[
            kind] if math.isfinite(omin) and math.isfinite(omax) else (omin, omax)
        args = dict(a_min=amin, a_max=amax, b_min=bmin, b_max=bmax, out_min=omin, out_max=omax)
        name = f"{shape} out=({omin:.3g}, {omax:.3g})"
        for d32 in (False, True):
            want = _try(lambda: R.addsub_execute(core=R._addsub_scalar_core(a.ravel(), b.ravel(), a.shape), d32=d32,
                                                 subtract=False, **args))
            _cmp_add(groups, f"QuantizedAdd_8p8to8{'_d32' if d32 else ''} same shape vs addsub_execute(d32={d32})",
                     name, _try(lambda: quantized_add(a, b, **args, d32=d32, harness=harness)), want, verbose)
        _cmp_add(groups, "QuantizedSub_8p8to8 same shape (open ends) vs dsp", name,
                 _try(lambda: quantized_sub(a, b, **args, harness=harness)), _try(lambda: K.quantized_sub(a, b, **args)),
                 verbose)
    return groups


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="compare nnlib (QEMU) with maceq's dsp simulation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--harness", default=None, help=f"default $NNLIB_HARNESS or {DEFAULT_HARNESS}")
    ap.add_argument("--n-add", type=int, default=12)
    ap.add_argument("--n-conv", type=int, default=12)
    ap.add_argument("--n-dw", type=int, default=8)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--save-diffs", default=None, metavar="DIR", help="save differing configurations as .npz")
    ap.add_argument("--accept", action="store_true", help="also run the conv acceptance sweep")
    ap.add_argument("--patch-maceq", action="store_true",
                    help="no-op kept for compatibility (the two deviations it patched are fixed in maceq)")
    ap.add_argument("--more", type=int, default=0, metavar="N",
                    help="also run N configurations of each extra comparison: demo_conv_sweep (wider conv / "
                         "depthwise geometry), demo_ops (concat, pools, SuperFC, Quantize, Dequantize), "
                         "demo_global_avgpool, demo_mean, demo_addsub_more (broadcasting and half-open adds)")
    args = ap.parse_args()
    try:
        t0 = time.perf_counter()
        gr = demo(seed=args.seed, n_add=args.n_add, n_conv=args.n_conv, n_dw=args.n_dw, harness=args.harness,
                  verbose=not args.quiet, save_dir=args.save_diffs, patch=args.patch_maceq)
    except NnlibError as e:
        print(f"run.py: {e}", file=sys.stderr)
        sys.exit(2)
    print("\nsummary (seed %d, %.1fs%s):" % (args.seed, time.perf_counter() - t0,
                                          ", maceq patched" if args.patch_maceq else ""))
    for ln in summary(gr):
        print("  " + ln)
    if args.more:
        more = {}
        for f, kw in ((demo_conv_sweep, dict(n_conv=args.more, n_dw=args.more)), (demo_ops, dict(n=args.more)),
                      (demo_global_avgpool, dict(n=args.more)), (demo_mean, dict(n=args.more)),
                      (demo_addsub_more, dict(n=args.more))):
            more.update(f(seed=args.seed, harness=args.harness, verbose=not args.quiet, **kw))
        for ln in summary(more):
            print("  " + ln)
    if args.accept:
        acc = acceptance(harness=args.harness, verbose=not args.quiet)
        dis = [a for a in acc if a[1] != a[2]]
        print(f"  acceptance: {len(acc)} conv configurations, nnlib/maceq disagree on {len(dis)}")
        for name, ok_n, ok_m, d in dis:
            print(f"    {name}: nnlib {'ok' if ok_n else 'rejects'}, maceq {'ok' if ok_m else 'rejects'} ({d})")
