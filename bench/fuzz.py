"""Fuzz maceq's input loaders with atheris: every input either loads or raises a one-line MaceqError.

    python bench/fuzz.py [--seconds 60] [--target NAME ...] [--workdir DIR] [--jobs 1]
    python bench/fuzz.py --list
    python bench/fuzz.py --replay NAME FILE...      # run inputs through one harness, no atheris

Each target is a harness ``fn(data: bytes)`` that turns the bytes into one kind of input file, loads
it through maceq's public loader, and raises :class:`Crash` when the loader breaks the contract:

- it may return normally, or raise :class:`maceq.errors.MaceqError` whose ``str()`` is one
  non-empty line (``len(msg.splitlines()) == 1``);
- any other exception, a multi-line or empty message, a hang (libFuzzer ``-timeout``; the
  no-atheris runner uses SIGALRM) or a huge allocation (libFuzzer ``-rss_limit_mb`` /
  ``-malloc_limit_mb``; the runner caps the address space) is a crash.

Targets (docs/fuzzing.md has the crash log):

============== ======================================================================================
mace_pb        mutated ``fmnist_q8.pb`` + the real ``.data`` -> ``quant.mace.format.read_model(pb)``
mace_data      the real ``.pb`` + mutated ``.data`` -> ``read_model(pb)``
mace_yml       mutated deployment ``.yml`` beside the real ``.pb``/``.data`` -> ``read_model(yml)``
mace_ranges    mutated range file -> ``quant.mace.format.read_ranges``
onnx_bytes     mutated serialized ``fmnist_mobilenet.onnx`` -> ``quant.prepare.prepare_graph``
onnx_struct    protobuf edits of ``fmnist_mobilenet.onnx`` / ``ppocr_mobile_v2_cls.onnx`` chosen by
               the bytes (dropped inputs and nodes, wrong attrs, bad shapes and dtypes, bad
               initializers, opsets) -> ``prepare_graph`` with and without ``input_shape``
config         mutated quantization config YAML -> ``quant.config.load_config``
budget         mutated budget YAML -> ``reports.budget.load_budget``
preprocess     mutated preprocessing YAML -> ``datasets.preprocess.Preprocess.from_dict`` on the
               parsed mapping, and the CLI's ``--preprocess FILE`` loader (``app.cli``)
============== ======================================================================================

Seeds: ``bench/fuzz_corpus/<target>/`` (small, committed) plus seeds generated at start from
``../shared/data`` (the MACE reference model and the ONNX models; not committed, they are large).
The working corpus and crash artifacts go to ``--workdir`` (default ``$TMPDIR/maceq-fuzz``).
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import hashlib
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
CORPUS = REPO / "bench" / "fuzz_corpus"
MACE_REF = SHARED / "mace_reference"
MODELS = SHARED / "models"

#: One input may take this long before it counts as a hang (seconds).
TIMEOUT_S = 10
#: Extra address space one input may map (bytes) in the no-atheris runner; libFuzzer's RSS cap in MB.
ALLOC_LIMIT = 3 << 30
RSS_LIMIT_MB = 4096


class Crash(Exception):
    """The loader broke the contract (see the module docstring)."""


# ------------------------------------------------------------------------------------------------
# The contract
# ------------------------------------------------------------------------------------------------

def _contract(fn, *args, **kw):
    """Run one loader call: a normal return or a one-line MaceqError pass; anything else is Crash."""
    from maceq.errors import MaceqError

    try:
        return fn(*args, **kw)
    except MaceqError as e:
        msg = str(e)
        if len(msg.splitlines()) != 1 or not msg.strip():
            raise Crash(f"MaceqError message is not one line: {msg!r}") from e
        return None
    except Crash:
        raise
    except RecursionError as e:
        raise Crash(f"RecursionError: {e}") from e
    except Exception as e:  # noqa: BLE001 - every other exception is the finding
        raise Crash(f"{type(e).__name__}: {str(e)[:300]!r}") from e


class _Scratch:
    """One private temp folder per process, reused by every input (files are overwritten)."""

    _dir: Path | None = None

    @classmethod
    def dir(cls) -> Path:
        if cls._dir is None:
            cls._dir = Path(tempfile.mkdtemp(prefix="maceq-fuzz-"))
            atexit.register(shutil.rmtree, cls._dir, True)
        return cls._dir

    @classmethod
    def fresh(cls, name: str) -> Path:
        d = cls.dir() / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        return d


def _read(path: Path) -> bytes:
    return path.read_bytes()


# ------------------------------------------------------------------------------------------------
# MACE reader
# ------------------------------------------------------------------------------------------------

def _mace_files() -> tuple[bytes, bytes, bytes, bytes]:
    return (_read(MACE_REF / "fmnist_q8.pb"), _read(MACE_REF / "fmnist_q8.data"),
            _read(MACE_REF / "fmnist_q8.yml"), _read(MACE_REF / "fmnist_ranges.txt"))


def _maceq_style_yml(pb: bytes, data: bytes) -> bytes:
    """The shared yml rewritten the way maceq's writer names files: .pb/.data paths + sha256."""
    text = _read(MACE_REF / "fmnist_q8.yml").decode()
    text = text.replace("model_file_path: ../models/fmnist_mobilenet.onnx", "model_file_path: fmnist_q8.pb\n"
                        "    weight_file_path: fmnist_q8.data\n"
                        f"    weight_sha256_checksum: {hashlib.sha256(data).hexdigest()}")
    text = text.replace("model_sha256_checksum: bb6d3e4a48dd84abca1ef70f6cb19228e0f5687069f2fc1cfbcf19b7884e8ca4",
                        f"model_sha256_checksum: {hashlib.sha256(pb).hexdigest()}")
    return text.encode()


def _read_pb_and_data(tag: str, pb: bytes, weights: bytes) -> None:
    from maceq.mace.format import read_model

    d = _Scratch.fresh(tag)
    (d / "m.pb").write_bytes(pb)
    (d / "m.data").write_bytes(weights)
    _contract(read_model, d / "m.pb")


def fuzz_mace_pb(data: bytes) -> None:
    _read_pb_and_data("mace_pb", data, _mace_files_cached()[1])


def fuzz_mace_data(data: bytes) -> None:
    _read_pb_and_data("mace_data", _mace_files_cached()[0], data)


def fuzz_mace_yml(data: bytes) -> None:
    from maceq.mace.format import read_model

    pb, weights, _, ranges = _mace_files_cached()
    d = _Scratch.fresh("mace_yml")
    (d / "fmnist_q8.pb").write_bytes(pb)
    (d / "fmnist_q8.data").write_bytes(weights)
    (d / "fmnist_ranges.txt").write_bytes(ranges)
    (d / "fmnist_q8.yml").write_bytes(data)
    _contract(read_model, d / "fmnist_q8.yml")


def fuzz_mace_ranges(data: bytes) -> None:
    from maceq.mace.format import read_ranges

    p = _Scratch.dir() / "ranges.txt"
    p.write_bytes(data)
    _contract(read_ranges, p)


_MACE_CACHE: tuple | None = None


def _mace_files_cached():
    global _MACE_CACHE
    if _MACE_CACHE is None:
        _MACE_CACHE = _mace_files()
    return _MACE_CACHE


# ------------------------------------------------------------------------------------------------
# ONNX importer (+ optimisation passes)
# ------------------------------------------------------------------------------------------------

def _prepare(path: Path, input_shape=None) -> None:
    from maceq.quant.prepare import prepare_graph

    prepare_graph(path, input_shape=input_shape)


def fuzz_onnx_bytes(data: bytes) -> None:
    p = _Scratch.dir() / "model.onnx"
    p.write_bytes(data)
    _contract(_prepare, p)


class Recipe:
    """Reads decisions from fuzz bytes (atheris' FuzzedDataProvider, without atheris)."""

    def __init__(self, data: bytes):
        self.data, self.i = data, 0

    def u8(self) -> int:
        if self.i >= len(self.data):
            return 0
        self.i += 1
        return self.data[self.i - 1]

    def u32(self) -> int:
        return self.u8() | self.u8() << 8 | self.u8() << 16 | self.u8() << 24

    def below(self, n: int) -> int:
        return 0 if n <= 0 else (self.u8() << 8 | self.u8()) % n

    def pick(self, seq):
        return seq[self.below(len(seq))]

    def left(self) -> bool:
        return self.i < len(self.data)


_BASES = ("fmnist_mobilenet.onnx", "ppocr_mobile_v2_cls.onnx")
_BASE_CACHE: dict[str, bytes] = {}
_WEIRD_INTS = [0, 1, -1, 2, 3, 7, -2, 1 << 31, -(1 << 31), (1 << 31) - 1, 1 << 40, -(1 << 62), 10 ** 6]
_WEIRD_FLOATS = [0.0, -0.0, 1e-45, -1.0, 3.4e38, float("inf"), float("-inf"), float("nan"), 1e300]
_OPS = ["Conv", "Relu", "Clip", "Add", "Mul", "Gemm", "MatMul", "Reshape", "Flatten", "Transpose", "Concat",
        "GlobalAveragePool", "AveragePool", "MaxPool", "BatchNormalization", "Pad", "Softmax", "Identity",
        "Squeeze", "Unsqueeze", "Shape", "Gather", "Slice", "Resize", "Sigmoid", "HardSigmoid", "Div", "Sub",
        "ConstantOfShape", "Expand", "Tile", "NotAnOp", ""]


def _base_model(name: str) -> bytes:
    if name not in _BASE_CACHE:
        _BASE_CACHE[name] = _read(MODELS / name)
    return _BASE_CACHE[name]


def _edit_attr(r: Recipe, node) -> None:
    from onnx import AttributeProto, helper

    if not node.attribute or r.below(4) == 0:
        name = r.pick(["axis", "kernel_shape", "strides", "pads", "dilations", "group", "perm", "min", "max",
                       "alpha", "to", "mode", "auto_pad", "transB", "value", "axes", "epsilon", "keepdims"])
        node.attribute.append(helper.make_attribute(name, r.pick(_WEIRD_INTS)))
        return
    a = node.attribute[r.below(len(node.attribute))]
    kind = r.below(8)
    if kind == 0:
        node.attribute.remove(a)
    elif a.type == AttributeProto.INTS and kind < 4:
        vals = list(a.ints)
        if vals and kind == 1:
            vals[r.below(len(vals))] = r.pick(_WEIRD_INTS)
        elif kind == 2:
            vals = vals[: r.below(len(vals) + 1)]
        else:
            vals = vals + [r.pick(_WEIRD_INTS)]
        del a.ints[:]
        a.ints.extend(v if -(1 << 63) <= v < (1 << 63) else 0 for v in vals)
    elif a.type == AttributeProto.INT:
        a.i = r.pick(_WEIRD_INTS)
    elif a.type == AttributeProto.FLOAT:
        a.f = r.pick(_WEIRD_FLOATS)
    elif a.type == AttributeProto.STRING:
        a.s = bytes(r.u8() for _ in range(r.below(6)))
    elif kind == 5:  # wrong type under the same name
        node.attribute.remove(a)
        node.attribute.append(helper.make_attribute(a.name, r.pick([1.5, "x", [1, 2], [0.5]])))
    else:
        node.attribute.remove(a)
        node.attribute.append(helper.make_attribute(a.name, r.pick(_WEIRD_INTS)))


def _edit_shape(r: Recipe, vi) -> None:
    tt = vi.type.tensor_type
    dims = tt.shape.dim
    kind = r.below(6)
    if kind == 0 and len(dims):
        del dims[r.below(len(dims))]
    elif kind == 1:
        dims.add().dim_value = r.pick([1, 0, 3, 28])
    elif kind == 2 and len(dims):
        dims[r.below(len(dims))].dim_value = r.pick([0, 1, 2, 5, 1 << 20, 1 << 40])
    elif kind == 3 and len(dims):
        dims[r.below(len(dims))].dim_param = r.pick(["N", "H", "?", ""])
    elif kind == 4:
        tt.elem_type = r.pick([0, 2, 3, 6, 7, 8, 9, 10, 11, 16, 99])
    else:
        tt.ClearField("shape")


def _edit_initializer(r: Recipe, g) -> None:
    if not len(g.initializer):
        return
    t = g.initializer[r.below(len(g.initializer))]
    kind = r.below(7)
    if kind == 0:
        g.initializer.remove(t)
    elif kind == 1 and len(t.dims):
        t.dims[r.below(len(t.dims))] = r.pick([0, 1, 2, 7, 1 << 20])
    elif kind == 2:
        t.dims.append(r.pick([1, 2, 0]))
    elif kind == 3:
        t.data_type = r.pick([0, 2, 3, 6, 7, 8, 9, 10, 11, 16, 99])
    elif kind == 4 and t.raw_data:
        t.raw_data = t.raw_data[: r.below(len(t.raw_data))]
    elif kind == 5:  # a Reshape/shape-like int64 tensor with odd values
        import numpy as np
        from onnx import numpy_helper

        vals = np.array([r.pick([0, -1, 1, 2, 28, -2, 1 << 31]) for _ in range(1 + r.below(5))], dtype=np.int64)
        new = numpy_helper.from_array(vals, t.name)
        t.CopyFrom(new)
    else:
        t.name = r.pick(["", "input", t.name + "_x", g.node[0].output[0] if len(g.node) else "y"])


def _mutate_model(r: Recipe):
    import onnx

    base = _BASES[r.below(len(_BASES))]
    m = onnx.ModelProto()
    m.ParseFromString(_base_model(base))
    g = m.graph
    for _ in range(1 + r.below(4)):
        if not r.left():
            break
        kind = r.below(12)
        if kind <= 2 and len(g.node):
            _edit_attr(r, g.node[r.below(len(g.node))])
        elif kind == 3 and len(g.node):
            n = g.node[r.below(len(g.node))]
            if len(n.input):
                if r.below(2):
                    del n.input[r.below(len(n.input))]
                else:
                    n.input[r.below(len(n.input))] = r.pick(["", "nope", "input", g.node[0].output[0]])
        elif kind == 4 and len(g.node):
            g.node.remove(g.node[r.below(len(g.node))])
        elif kind == 5 and len(g.node):
            g.node[r.below(len(g.node))].op_type = r.pick(_OPS)
        elif kind == 6 and len(g.input):
            _edit_shape(r, g.input[r.below(len(g.input))])
        elif kind == 7:
            _edit_initializer(r, g)
        elif kind == 8:
            for imp in m.opset_import:
                imp.version = r.pick([1, 7, 10, 11, 13, 17, 21, 22, 99])
        elif kind == 9 and len(g.node) > 1:
            a, b = g.node[r.below(len(g.node))], g.node[r.below(len(g.node))]
            if len(a.output) and len(b.output):
                a.output[0] = b.output[0]
        elif kind == 10 and len(g.output):
            g.output[0].name = r.pick(["", "nope", g.input[0].name if len(g.input) else "x"])
        elif kind == 11 and len(g.node):
            n = g.node[r.below(len(g.node))]
            if r.below(2):
                n.domain = r.pick(["", "ai.onnx", "com.microsoft", "x"])
            else:  # names with line breaks end up in error messages
                n.name = r.pick(["a\nb", "x\ry", "\u2028", n.name + "\x85"])
                if len(n.output) and r.below(2):
                    n.output[0] = n.output[0] + "\n"
    return m


_INPUT_SHAPES = [None, None, None, [1, 1, 28, 28], [2, 1, 28, 28], [1, 3, 48, 192], [1, 1, 1, 1], [1, 1, 0, 28],
                 [1, 1, 28], [1, 1, 7, 9], [1, 3, 1, 1]]


def fuzz_onnx_struct(data: bytes) -> None:
    r = Recipe(data)
    shape = _INPUT_SHAPES[r.below(len(_INPUT_SHAPES))]
    m = _mutate_model(r)
    p = _Scratch.dir() / "struct.onnx"
    p.write_bytes(m.SerializeToString())
    _contract(_prepare, p, shape)


# ------------------------------------------------------------------------------------------------
# YAML loaders
# ------------------------------------------------------------------------------------------------

def fuzz_config(data: bytes) -> None:
    from maceq.quant.config import load_config

    p = _Scratch.dir() / "config.yml"
    p.write_bytes(data)
    _contract(load_config, p)


def fuzz_budget(data: bytes) -> None:
    from maceq.reports.budget import load_budget

    p = _Scratch.dir() / "budget.yml"
    p.write_bytes(data)
    _contract(load_budget, p)


def _preprocess_from_dict(data: bytes) -> None:
    import yaml

    from maceq.datasets.preprocess import Preprocess

    try:
        d = yaml.safe_load(data)
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError):
        return  # not the preprocess module's concern: the file loaders own the YAML step
    Preprocess.from_dict(d)


def _preprocess_cli(path: Path) -> None:
    from types import SimpleNamespace

    from maceq.app.cli import _preprocess_from

    args = SimpleNamespace(preset=None, preprocess=str(path), resize_short=None, resize=None, crop=None,
                           mean=None, std=None, scale=None, offset=None, color=None, layout=None)
    _preprocess_from(args, None)


def fuzz_preprocess(data: bytes) -> None:
    _contract(_preprocess_from_dict, data)
    p = _Scratch.dir() / "preprocess.yml"
    p.write_bytes(data)
    _contract(_preprocess_cli, p)


# ------------------------------------------------------------------------------------------------
# Registry and seeds
# ------------------------------------------------------------------------------------------------

TARGETS = {
    "mace_pb": fuzz_mace_pb,
    "mace_data": fuzz_mace_data,
    "mace_yml": fuzz_mace_yml,
    "mace_ranges": fuzz_mace_ranges,
    "onnx_bytes": fuzz_onnx_bytes,
    "onnx_struct": fuzz_onnx_struct,
    "config": fuzz_config,
    "budget": fuzz_budget,
    "preprocess": fuzz_preprocess,
}
#: Targets whose inputs are text (the mutator adds YAML tokens as well as bytes).
TEXT_TARGETS = {"mace_yml", "mace_ranges", "config", "budget", "preprocess"}


def generated_seeds(name: str) -> list[bytes]:
    """Seeds made from the real files under ../shared/data (large ones are not committed)."""
    if name in ("mace_pb", "mace_data", "mace_yml", "mace_ranges"):
        pb, data, yml, ranges = _mace_files()
        return {"mace_pb": [pb, _read(MACE_REF / "fmnist_fp32.pb")],
                "mace_data": [data, data[: len(data) // 2]],
                "mace_yml": [yml, _maceq_style_yml(pb, data)],
                "mace_ranges": [ranges]}[name]
    if name == "onnx_bytes":
        return [_read(MODELS / "fmnist_mobilenet.onnx")]
    if name == "onnx_struct":
        rnd = random.Random(7)
        return [bytes(rnd.randrange(256) for _ in range(24)) for _ in range(16)]
    return []


def regressions(name: str) -> list[bytes]:
    """Inputs that once crashed target ``name`` (bench/fuzz_corpus/regress/<what>.<name>): the smoke
    test runs them; they are not atheris seeds (deeply nested YAML is slow to parse, ~1.5 s)."""
    return [p.read_bytes() for p in sorted((CORPUS / "regress").glob(f"*.{name}"))]


def known_reproducers() -> list[tuple[str, str, bytes]]:
    """(K label, target, input) for each reported-but-unfixed crash (bench/fuzz_corpus/known/<K>.<target>)."""
    known = CORPUS / "known"
    if not known.is_dir():  # every known crash fixed: git keeps no empty folder
        return []
    return [(p.stem, p.suffix[1:], p.read_bytes()) for p in sorted(known.iterdir())]


def seeds(name: str) -> list[bytes]:
    """Committed seeds (bench/fuzz_corpus/<name>/*) followed by the generated ones."""
    out = []
    d = CORPUS / name
    if d.is_dir():
        out += [p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()]
    return out + generated_seeds(name)


_YAML_TOKENS = [b"\n", b": ", b"- ", b"[", b"]", b"{", b"}", b"&a ", b"*a", b"!!python/object:os.system ", b"~",
                b"null", b".inf", b"-.inf", b".nan", b"1e400", b"1.0e400", b"99999999999999999999999", b"true",
                b"'", b'"', b"\t", b"\\", b"\xff", b"\x00", b"? ", b"!!binary ", b"<<: *a", b"\xe2\x80\xa8",
                b"\\n", b'"a\\nb": 1\n', b"-1", b"0", b"[[[[[[[[[[", b"{a: {a: {a: {a: ", b"---\n", b"...\n",
                b"%YAML 1.1\n", b"*", b"2001-12-14", b"0x10", b"0o7", b"1_000"]


def mutate(data: bytes, rnd: random.Random, *, text: bool) -> bytes:
    """One deterministic random mutation: byte flips, truncation, insertion, deletion, splicing,
    and for text targets YAML tokens."""
    b = bytearray(data)
    for _ in range(1 + rnd.randrange(3)):
        kind = rnd.randrange(8 if text else 6)
        pos = rnd.randrange(len(b) + 1)
        if kind == 0 and b:              # flip bits
            i = rnd.randrange(len(b))
            b[i] ^= 1 << rnd.randrange(8)
        elif kind == 1:                  # truncate
            del b[pos:]
        elif kind == 2:                  # insert random bytes
            b[pos:pos] = bytes(rnd.randrange(256) for _ in range(1 + rnd.randrange(8)))
        elif kind == 3 and b:            # delete a chunk
            del b[pos:pos + 1 + rnd.randrange(32)]
        elif kind == 4 and b:            # duplicate a chunk elsewhere
            s = rnd.randrange(len(b))
            b[pos:pos] = b[s:s + 1 + rnd.randrange(64)]
        elif kind == 5 and b:            # set a byte to an interesting value
            b[rnd.randrange(len(b))] = rnd.choice([0, 0x7F, 0x80, 0xFF, 0x01, 0x0A, 0x3A])
        else:                            # text: a YAML token, or a line swap
            if kind == 6:
                b[pos:pos] = rnd.choice(_YAML_TOKENS)
            else:
                lines = bytes(b).split(b"\n")
                if len(lines) > 1:
                    i, j = rnd.randrange(len(lines)), rnd.randrange(len(lines))
                    lines[i], lines[j] = lines[j], lines[i]
                b = bytearray(b"\n".join(lines))
    return bytes(b)


def mutations(name: str, count: int, seed: int = 0) -> list[bytes]:
    """``count`` deterministic mutations of the target's seeds (python ``random`` seeded per target)."""
    rnd = random.Random(f"{name}:{seed}")
    base = seeds(name)
    if name == "onnx_struct":  # the recipe bytes are the input: random recipes are the mutations
        return [bytes(rnd.randrange(256) for _ in range(8 + rnd.randrange(40))) for _ in range(count)]
    return [mutate(rnd.choice(base), rnd, text=name in TEXT_TARGETS) for _ in range(count)]


# ------------------------------------------------------------------------------------------------
# The no-atheris runner (CI smoke test, --replay)
# ------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def guarded(seconds: int = TIMEOUT_S, extra_bytes: int = ALLOC_LIMIT):
    """Per-input limits without libFuzzer: SIGALRM after ``seconds`` (raises Crash), and an
    address-space cap ``extra_bytes`` above the current size (a huge allocation raises
    MemoryError, which the contract reports as a crash). Main thread only."""

    def on_alarm(signum, frame):
        raise Crash(f"hang: no result after {seconds} s")

    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_as = resource.getrlimit(resource.RLIMIT_AS)
    try:
        with open("/proc/self/statm") as f:
            vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        cap = vm + extra_bytes
        if old_as[1] == resource.RLIM_INFINITY or cap < old_as[1]:
            resource.setrlimit(resource.RLIMIT_AS, (cap, old_as[1]))
    except (OSError, ValueError):
        pass
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old_handler)
        resource.setrlimit(resource.RLIMIT_AS, old_as)


def where(exc: BaseException) -> str:
    """``file:function`` of the innermost maceq frame (outside bench/) of the exception behind a Crash."""
    cause = exc.__cause__ or exc
    tb, last = cause.__traceback__, ""
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename.startswith(str(REPO)) and "/bench/" not in code.co_filename:
            last = f"{os.path.relpath(code.co_filename, REPO)}:{code.co_name}"
        tb = tb.tb_next
    return last or "?"


def signature(exc: BaseException) -> str:
    """What identifies a crash across inputs: the exception type and where it left maceq."""
    cause = exc.__cause__ or exc
    kind = "MaceqError(multi-line)" if str(exc).startswith("MaceqError message") else type(cause).__name__
    return f"{kind} at {where(exc)}"


#: Crashes found in files this fuzzer's author may not edit (reported in docs/fuzzing.md with a
#: reproducer). They are skipped by default so the fuzzers can go past them; ``--strict`` (and
#: ``MACEQ_FUZZ_STRICT=1``) counts them again. Remove an entry once its owner has fixed it:
#: tests/test_fuzz_smoke.py fails while an entry no longer reproduces.
KNOWN: dict[str, str] = {
}


def is_known(exc: BaseException) -> bool:
    return not STRICT and signature(exc) in KNOWN


STRICT = os.environ.get("MACEQ_FUZZ_STRICT") == "1"


def run_inputs(name: str, inputs, *, seconds: int = TIMEOUT_S) -> list[tuple[int, str]]:
    """Run ``inputs`` through target ``name`` under :func:`guarded`; returns (index, crash) pairs,
    each crash as ``"<message> [at <file:line>]"``."""
    fn = TARGETS[name]
    crashes = []
    for k, data in enumerate(inputs):
        try:
            with guarded(seconds):
                fn(data)
        except Crash as e:
            if not is_known(e):
                crashes.append((k, f"{e} [{signature(e)}]"))
    return crashes


# ------------------------------------------------------------------------------------------------
# atheris
# ------------------------------------------------------------------------------------------------

_KNOWN_SEEN: dict[str, int] = {}


def _atheris_child(name: str, libfuzzer_args: list[str]) -> None:
    """Runs in a fresh interpreter: instrument maceq's modules, then fuzz. (PyYAML is not
    instrumented: its recursive composer runs a deeply nested seed 100x slower instrumented,
    which libFuzzer would report as a hang.)"""
    import atheris

    with atheris.instrument_imports(include=["maceq"]):
        import maceq.datasets.preprocess  # noqa: F401
        import maceq.app.cli  # noqa: F401
        import maceq.quant.config  # noqa: F401
        import maceq.mace.format  # noqa: F401
        import maceq.app.pipeline  # noqa: F401
        import maceq.reports.budget  # noqa: F401
    fn = TARGETS[name]

    def one(data: bytes) -> None:
        try:
            fn(data)
        except Crash as e:  # a new crash propagates: libFuzzer saves the input as an artifact
            if not is_known(e):
                raise
            seen = _KNOWN_SEEN.setdefault(signature(e), 0)
            _KNOWN_SEEN[signature(e)] = seen + 1
            if seen == 0:
                print(f"known crash (skipped): {signature(e)}", file=sys.stderr, flush=True)

    atheris.Setup([sys.argv[0], *libfuzzer_args], one)
    atheris.Fuzz()


def run_atheris(name: str, seconds: int, workdir: Path) -> dict:
    """Fuzz one target for ``seconds`` in a child process; returns counts parsed from libFuzzer."""
    wd = workdir / name
    corpus = wd / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for s in seeds(name):
        (corpus / ("seed-" + hashlib.sha1(s).hexdigest())).write_bytes(s)
    max_len = max([len(s) for s in seeds(name)] + [4096])
    extra = []
    if name in TEXT_TARGETS:  # libFuzzer dictionary: the YAML tokens the no-atheris mutator inserts
        dict_path = wd / "yaml.dict"
        dict_path.write_text("".join('"' + "".join(f"\\x{c:02x}" for c in tok) + '"\n' for tok in _YAML_TOKENS))
        extra.append(f"-dict={dict_path}")
    args = [str(corpus), *extra, f"-max_total_time={seconds}", f"-timeout={TIMEOUT_S}", f"-rss_limit_mb={RSS_LIMIT_MB}",
            f"-malloc_limit_mb={RSS_LIMIT_MB}", f"-max_len={max_len}", f"-artifact_prefix={wd}/",
            "-print_final_stats=1", "-close_fd_mask=1"]
    t0 = time.time()
    proc = subprocess.run([sys.executable, __file__, "--atheris-child", name, "--", *args],
                          capture_output=True, text=True, cwd=str(REPO))
    log = proc.stdout + proc.stderr
    (wd / "fuzz.log").write_text(log)
    stats = {"target": name, "returncode": proc.returncode, "seconds": round(time.time() - t0, 1)}
    for line in log.splitlines():
        if line.startswith("stat::number_of_executed_units:"):
            stats["execs"] = int(line.split(":")[-1])
        elif line.startswith("stat::average_exec_per_sec:"):
            stats["execs_per_s"] = int(line.split(":")[-1])
        elif line.startswith("stat::new_units_added:"):
            stats["new_units"] = int(line.split(":")[-1])
    stats["artifacts"] = sorted(str(p) for p in wd.glob("crash-*")) + sorted(str(p) for p in wd.glob("timeout-*")) \
        + sorted(str(p) for p in wd.glob("oom-*"))
    return stats


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--atheris-child"]:
        name = argv[1]
        rest = argv[3:] if argv[2:3] == ["--"] else argv[2:]
        _atheris_child(name, rest)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=int, default=60, help="fuzzing time per target (default 60)")
    ap.add_argument("--target", action="append", choices=sorted(TARGETS), help="only this target (repeatable)")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "maceq-fuzz")
    ap.add_argument("--list", action="store_true", help="list the targets and exit")
    ap.add_argument("--replay", nargs="+", metavar=("NAME", "FILE"),
                    help="run files through one harness without atheris and print what breaks")
    ap.add_argument("--smoke", type=int, metavar="N",
                    help="no atheris: seeds + N deterministic mutations per target, print crashes")
    ap.add_argument("--strict", action="store_true", help="count the KNOWN (reported, unfixed) crashes too")
    ap.add_argument("--show", type=int, default=5, help="with --smoke: crashes printed per target")
    a = ap.parse_args(argv)
    global STRICT
    if a.strict:
        STRICT = True
        os.environ["MACEQ_FUZZ_STRICT"] = "1"  # the atheris child reads it
    if a.list:
        for n, fn in TARGETS.items():
            print(f"{n:12s} {fn.__name__}")
        return 0
    if a.replay:
        name, files = a.replay[0], a.replay[1:]
        crashes = run_inputs(name, [Path(f).read_bytes() for f in files])
        for k, msg in crashes:
            print(f"CRASH {files[k]}: {msg}")
        print(f"{len(files) - len(crashes)} passed, {len(crashes)} failed")
        return 1 if crashes else 0
    names = a.target or list(TARGETS)
    if a.smoke is not None:
        bad = 0
        for n in names:
            inputs = seeds(n) + regressions(n) + mutations(n, a.smoke)
            t0 = time.time()
            crashes = run_inputs(n, inputs)
            bad += len(crashes)
            print(f"{n}: {len(inputs)} inputs, {len(crashes)} crashes, {time.time() - t0:.1f} s")
            for k, msg in crashes[: a.show]:
                print(f"  input {k}: {msg}")
        return 1 if bad else 0
    results = []
    for n in names:
        st = run_atheris(n, a.seconds, a.workdir)
        results.append(st)
        print(f"{n}: {st.get('execs', '?')} execs in {st['seconds']} s ({st.get('execs_per_s', '?')}/s), "
              f"{st.get('new_units', '?')} new units, rc {st['returncode']}, artifacts: {st['artifacts'] or 'none'}",
              flush=True)
    return 1 if any(st["artifacts"] or st["returncode"] not in (0,) for st in results) else 0


if __name__ == "__main__":
    sys.exit(main())
