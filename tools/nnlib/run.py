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
    """Monkeypatch two maceq deviations found with this tool (a hypothesis check, not a fix):

    1. ``nnlib_ref.addsub_execute`` pads a self-found QuantizedAdd/Sub range with
       ``fmul(0.15, out_range)`` (0.15 as a double); op_add.c has ``0.15f * out_range``.
    2. ``dsp.supernode(variant=D32)`` starts an open (-inf/+inf) output range from the
       depthwise defaults (-0.125, 0.125); Supernode_8x8p32to8_d32 uses (0.0, 0.5) and
       InputSupernode_8x8p32to8_outd32 (what prepare picks for filter depth <= 4 and stride
       width <= 4) uses (-1/128, 1/128) (op_supernode_new.c, ``setup_initial_output_range``).
    Not patched (see README): DepthwiseSupernode's open-range retry sees junk outputs, and
    Supernode's bias buffer is rounded to float32.
    Returns a function that undoes the patches.
    """
    from maceq.runtime.kernels import nnlib_ref as R

    fmul0, setup0, sn0 = R.fmul, R.setup_initial_output_range, K.supernode

    def fmul(a, b):
        if type(a) is float and a == 0.15:
            a = R.f32(0.15)
        return fmul0(a, b)

    def supernode(x, w, *a, **k):
        st = k.get("strides", (1, 1))
        lo, hi = (-1.0 / 128, 1.0 / 128) if np.asarray(w).shape[2] <= 4 and int(st[1]) <= 4 else (0.0, 0.5)
        R.setup_initial_output_range = lambda mn, mx, *_: setup0(mn, mx, lo, hi)
        try:
            return sn0(x, w, *a, **k)
        finally:
            R.setup_initial_output_range = setup0

    R.fmul, K.supernode = fmul, supernode

    def undo():
        R.fmul, R.setup_initial_output_range, K.supernode = fmul0, setup0, sn0

    return undo


def demo(seed=0, n_add=12, n_conv=12, n_dw=8, harness=None, verbose=True, save_dir=None, patch=False):
    """Random-configuration comparison; returns {op group: [Cmp...]}.

    save_dir: configurations with differences are saved there as .npz (inputs, args, both results).
    """
    try:
        from maceq.runtime.kernels import dsp as K
    except ImportError as e:
        raise NnlibError(f"maceq not importable ({e}): pip install -e the repo first") from None

    undo = patch_maceq(K) if patch else None
    try:
        return _demo(K, seed, n_add, n_conv, n_dw, harness, verbose, save_dir)
    finally:
        if undo:
            undo()


def _demo(K, seed, n_add, n_conv, n_dw, harness, verbose, save_dir):
    rng = np.random.default_rng(seed)
    kw = dict(harness=harness)
    groups: dict = {}

    def add(group, c, res=None, case=None):
        groups.setdefault(group, []).append(c)
        if save_dir and case is not None and (c.nbad or not c.range_ok):
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            fn = Path(save_dir) / f"{group.split()[0]}_{len(groups[group]) - 1}.npz"
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
        if verbose:
            t = f" ({res.wall_s:.2f}s)" if res is not None else ""
            print(f"[{group}] {c.line()}{t}", flush=True)

    def ops_of(res):
        return "/".join(o for o in res.ops() if o not in ("INPUT", "OUTPUT")) if res else "-"

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
            add("QuantizedAdd_8p8to8" + ("_d32" if d32 else ""),
                compare(f"{shape} out={kind} [{ops_of(res)}]", got, want), res,
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
            add("QuantizedSub_8p8to8", compare(f"{shape} out={kind} [{ops_of(res)}]",
                                               r if isinstance(r, Exception) else r[:3], want), res)

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
        bias, bmin, bmax = K.mace_quantize_bias(rng.normal(0, 2, o))
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
            add(group, compare(f"{tag} [{ops_of(res)}]", r if isinstance(r, Exception) else r[:3], want), res,
                dict(x=x, w=w, bias=bias, args=args, variant=var.value, nnlib=r if isinstance(r, Exception) else r[:3],
                     maceq=want))

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
        bias, bmin, bmax = K.mace_quantize_bias(rng.normal(0, 1, c))
        scale = k * max(abs(xmin), xmax) * max(abs(wmin), wmax) * 0.5
        omin, omax = {"fixed": (-scale, scale), "relu": (0.0, scale), "inf": (-math.inf, math.inf)}[kind]
        args = dict(x_min=xmin, x_max=xmax, w_min=wmin, w_max=wmax, bias_min=bmin, bias_max=bmax, out_min=omin,
                    out_max=omax, strides=(st, st), padding=pad)
        r = _try(lambda: depthwise_supernode(x, w, bias, **args, **kw))
        want = _try(lambda: K.depthwise_supernode(x, w, bias, **args))
        res = None if isinstance(r, Exception) else r[3]
        add("DepthwiseSupernode_8x8p32to8", compare(f"{shape} k{k} s{st} {pad} out={kind} [{ops_of(res)}]",
                                                    r if isinstance(r, Exception) else r[:3], want), res,
            dict(x=x, w=w, bias=bias, args=args, nnlib=r if isinstance(r, Exception) else r[:3], maceq=want))
    return groups


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
                    help="monkeypatch the two maceq deviations found so far (see patch_maceq) before comparing")
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
    if args.accept:
        acc = acceptance(harness=args.harness, verbose=not args.quiet)
        dis = [a for a in acc if a[1] != a[2]]
        print(f"  acceptance: {len(acc)} conv configurations, nnlib/maceq disagree on {len(dis)}")
        for name, ok_n, ok_m, d in dis:
            print(f"    {name}: nnlib {'ok' if ok_n else 'rejects'}, maceq {'ok' if ok_m else 'rejects'} ({d})")
