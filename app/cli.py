"""Command-line entry points: ``quantize`` and ``maceq run|eval|inspect``.

Bad input prints one line, ``error: ...``, and exits with status 2; no traceback. An unexpected exception (a
defect of maceq) prints one line too and exits with 70; ``MACEQ_DEBUG=1`` lets its traceback through.
"""
from __future__ import annotations

import argparse
import difflib
import io
import json
import os
import re
import sys
import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from maceq.app.mixed import auto_mixed_precision, holdout_split, step_line
from maceq.app.pipeline import calibrate, quantize, recover_per_device
from maceq.app.weight_grid import check_weight_grid
from maceq.calibrate.methods import RangeMethod
from maceq.calibrate.parallel import Executor, check_workers
from maceq.calibrate.runner import load_onnx
from maceq.datasets.images import ImageFolder, load_image
from maceq.datasets.preprocess import PRESETS, Preprocess, preprocess_from_args
from maceq.errors import MaceqError
from maceq.mace.enums import DataType
from maceq.mace.format import check_model_name
from maceq.quant.config import QuantConfig, load_config
from maceq.reports.budget import run_check
from maceq.reports.cost import float_share
from maceq.reports.evaluate import device_path_lines, evaluate, evaluate_many, evaluate_segmentation
from maceq.reports.report import make_report
from maceq.reports.verdict import verdict_lines
from maceq.runtime.devices import Device
from maceq.runtime.model import load
from maceq.yamlio import atomic_write, read_yaml

DEFAULT_MODEL_NAME = "fmnist_mobilenet"


def default_assets() -> Path:
    """Folder of the embedded default model and its sample images."""
    return Path(str(resources.files("maceq.datasets") / "default"))


def default_output_root() -> Path:
    """Where outputs go without -o: $MACEQ_HOME, else $XDG_CACHE_HOME/maceq, else ~/.cache/maceq.

    Nothing is written to the working directory unless the user asks with -o.
    """
    if os.environ.get("MACEQ_HOME"):
        return Path(os.environ["MACEQ_HOME"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "maceq"


def _csv_numbers(text: str, kind=float, *, what: str):
    try:
        return [kind(v) for v in str(text).split(",") if v.strip() != ""]
    except ValueError:
        raise MaceqError(f"{what}: expected comma-separated numbers, got '{text}'") from None


def _add_preprocess_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("preprocessing (defaults: what the model was calibrated with, or the preset)")
    g.add_argument("--preset", help=f"preprocessing preset: {', '.join(PRESETS)}")
    g.add_argument("--preprocess", metavar="YAML", help="YAML file with preprocessing keys")
    g.add_argument("--resize-short", type=int, help="resize the short side to N pixels (bilinear)")
    g.add_argument("--resize", help="resize to H,W")
    g.add_argument("--crop", help="center crop H,W")
    g.add_argument("--mean", help="per-channel mean, e.g. 0.485,0.456,0.406")
    g.add_argument("--std", help="per-channel std")
    g.add_argument("--scale", type=float, help="multiply raw 0..255 values by this first (default 1/255)")
    g.add_argument("--offset", type=float, help="add this last")
    g.add_argument("--color", choices=["rgb", "bgr", "gray"], help="channel order")
    g.add_argument("--layout", choices=["nchw", "nhwc"], help="tensor layout")


def _preprocess_from(args, recorded: dict | None):
    if args.preset:
        base = preprocess_from_args(args.preset)
    elif recorded:
        base = Preprocess.from_dict(recorded)
    else:
        base = None
    if args.preprocess:
        d = read_yaml(args.preprocess, what="preprocessing file") or {}
        if not isinstance(d, dict) or not all(isinstance(k, str) for k in d):
            raise MaceqError(f"{args.preprocess}: must be a mapping of preprocessing keys")
        preset = d.pop("preset", None)
        if preset is not None and base is None:
            base = preprocess_from_args(preset)
        base = (base or Preprocess()).with_overrides(**d)
    over = {"resize_short": args.resize_short, "resize": args.resize, "center_crop": args.crop,
            "mean": args.mean, "std": args.std, "scale": args.scale, "offset": args.offset,
            "color": args.color, "layout": args.layout}
    over = {k: v for k, v in over.items() if v is not None}
    return (base or Preprocess()).with_overrides(**over) if over else (base or Preprocess())


def _format_warning(message, category, filename, lineno, line=None):
    return f"warning: {message}\n"


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: what is wrong, the closest known options, and where to look."""

    def error(self, message):
        hint = ""
        bad = re.search(r"unrecognized arguments: (\S+)", message)
        if bad:
            close = difflib.get_close_matches(bad.group(1).split("=")[0], _option_strings(self), n=2)
            hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        self.exit(2, f"error: {self.prog}: {message}{hint}; see {self.prog} --help\n")


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string of ``parser`` and of its subcommands."""
    out = []
    for action in parser._actions:
        out += list(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out += _option_strings(sub)
    return out


def _run_cli(fn, argv):
    warnings.formatwarning = _format_warning
    try:
        return fn(argv)
    except MaceqError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `maceq inspect ... | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except Exception as e:  # noqa: BLE001 - a defect of maceq: one line, not a traceback (MACEQ_DEBUG=1 shows it)
        if os.environ.get("MACEQ_DEBUG"):
            raise
        first = " ".join(str(e).split())[:300]
        print(f"error: internal error ({type(e).__name__}: {first}); please report it with the command and model "
              f"(MACEQ_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 70


# -- quantize ------------------------------------------------------------------------
@dataclass(frozen=True)
class _QuantizeOptions:
    """What ``quantize`` derives from its arguments before any long work starts."""

    config: QuantConfig
    pre: Preprocess
    input_shape: list[int] | None
    name: str
    out: Path
    devices: tuple[str, ...]
    extra_meta: dict


def _quantize(argv) -> int:
    """``quantize``: check the arguments, quantize, print a summary, evaluate; the exit status."""
    args = _quantize_parser().parse_args(argv)
    opts = _quantize_options(args)
    if args.accuracy_budget is not None:
        return _auto_mixed(args, opts.out, opts.pre, opts.config, opts.input_shape, opts.name, opts.extra_meta,
                           opts.devices)
    res = _run_quantize(args, opts)
    _print_quantize_summary(args.model, res)
    return _evaluate_quantized(args, opts, res)


def _quantize_parser() -> argparse.ArgumentParser:
    """The argument parser of ``quantize``."""
    p = _Parser(prog="quantize", description="Quantize an ONNX model to a uint8 MACE model and "
                                "simulate it bit-exactly. With no model, quantizes the embedded Fashion-MNIST demo.")
    p.add_argument("model", nargs="?", help="float ONNX model (default: the embedded demo model)")
    p.add_argument("--calib-dir", help="folder of calibration images (searched recursively)")
    p.add_argument("-o", "--output", help="output folder (default: ~/.cache/maceq/<model name>)")
    p.add_argument("--config", help="YAML quantization config (range methods, per-layer overrides, ...)")
    p.add_argument("--range-method", choices=[m.value for m in RangeMethod], help="activation range method")
    p.add_argument("--percentile", type=float, help="percentile for --range-method percentile (default 99.99)")
    _add_recovery_args(p)
    p.add_argument("--batch-size", type=int, help="calibration batch size (default 8)")
    p.add_argument("--max-images", type=int, help="use at most N calibration images")
    _add_parallel_args(p)
    p.add_argument("--input-shape", help="fix the input shape, e.g. 1,3,224,224 (also re-declares a fixed export size)")
    p.add_argument("--eval-dir", help="after quantizing, evaluate float vs int8 on this image folder")
    p.add_argument("--labels", help="labels CSV (file,label) for --eval-dir")
    p.add_argument("--name", help="model name for the output files (default: the ONNX file's stem)")
    p.add_argument("--device", default="cpu",
                   help="target device(s), comma-separated: cpu, gpu, dsp (one model per device)")
    p.add_argument("--fp32", action="append", default=[], metavar="NAME",
                   help="keep this layer in float32 (node or output name, glob allowed; repeatable)")
    p.add_argument("--no-report", dest="report", action="store_false",
                   help="do not write report.html/report.json beside the model (written whenever images are "
                        "evaluated: --eval-dir, the demo, or --accuracy-budget)")
    p.add_argument("--budget", help="after quantizing, check the report against this budget YAML (needs --eval-dir)")
    _add_mixed_precision_args(p)
    p.add_argument("--strict", action="store_true",
                   help="fail instead of running ops without a uint8 kernel in float32 (float fallback)")
    p.add_argument("--safe-forms", action=argparse.BooleanOptionalAction, default=None,
                   help="rewrite ops that the device computes differently from the model into an equivalent form "
                        "it computes right (default on; --no-safe-forms keeps the original form, and the "
                        "simulation then predicts the device's deviating result)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    _add_preprocess_args(p)
    return p


def _add_recovery_args(p: argparse.ArgumentParser) -> None:
    """The accuracy-recovery switches of ``quantize``: --recipe, --cle, bias correction."""
    r = p.add_argument_group("accuracy recovery (docs/recovery.md)")
    r.add_argument("--recipe", help="named set of the switches below: default, accurate (quant/recipes.py); "
                   "explicit flags and config keys win over it")
    r.add_argument("--cle", action=argparse.BooleanOptionalAction, default=None,
                   help="cross-layer equalization of the float graph before calibration")
    r.add_argument("--high-bias-absorption", action=argparse.BooleanOptionalAction, default=None,
                   help="with --cle: move high biases into the next layer")
    r.add_argument("--bias-correction", action=argparse.BooleanOptionalAction, default=None,
                   help="empirical bias correction per device, on calibration images")
    r.add_argument("--bias-correction-images", type=int, metavar="N",
                   help="calibration images the bias correction measures on (default 32)")
    r.add_argument("--adaround", action=argparse.BooleanOptionalAction, default=None,
                   help="adaptive weight rounding per device, on calibration images (docs/adaround.md)")
    r.add_argument("--adaround-images", type=int, metavar="N",
                   help="calibration images AdaRound collects layer inputs from (default 64)")
    r.add_argument("--adaround-iters", type=int, metavar="N", help="AdaRound's optimisation steps per layer "
                   "(default 500)")


def _add_eval_workers(p: argparse.ArgumentParser) -> None:
    """--workers/--executor/--ray-address of ``maceq eval`` and ``maceq report``."""
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="evaluate on N workers at once (local processes or Ray tasks), each taking shards of "
                        "whole batches as it frees up; the numbers do not depend on N (default 1: in this process)")
    p.add_argument("--executor", choices=["local", "ray"], default="local", help="where the shards run")
    p.add_argument("--ray-address", metavar="ADDR", help="Ray cluster for --executor ray")


def _eval_workers(args) -> dict:
    """The evaluation's parallel options, checked before any work."""
    if args.ray_address is not None and args.executor != "ray":
        raise MaceqError("--ray-address needs --executor ray")
    return {"workers": check_workers(args.workers), "executor": args.executor, "ray_address": args.ray_address}


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    """The parallelism options of ``quantize``: --workers, --executor, --ray-address."""
    par = p.add_argument_group("parallelism (docs/parallel.md)")
    par.add_argument("--workers", type=int, metavar="N",
                     help="calibrate on N shards at once (local processes or Ray tasks); also the number of "
                          "mixed-precision candidates measured at once (default 1: in this process)")
    par.add_argument("--executor", choices=["local", "ray"],
                     help="where the shards and candidate evaluations run (default local; ray needs "
                          "pip install 'maceq[ray]')")
    par.add_argument("--ray-address", metavar="ADDR",
                     help="Ray cluster for --executor ray, e.g. head:6379 or ray://head:10001 "
                          "(default: RAY_ADDRESS, else a local Ray instance)")


def _add_mixed_precision_args(p: argparse.ArgumentParser) -> None:
    """The automatic mixed precision options of ``quantize``: --accuracy-budget and its limits."""
    g = p.add_argument_group("automatic mixed precision")
    g.add_argument("--accuracy-budget", type=float, metavar="POINTS",
                   help="largest allowed drop of top-1 agreement (or accuracy, with labels) in points; layers are "
                        "moved to float32, most sensitive first, until it holds")
    g.add_argument("--min-sqnr", type=float, metavar="DB", help="per-layer floor: layers under it go to float32 first")
    g.add_argument("--max-fp32-layers", type=int, metavar="N",
                   help="cap on the ops (source-graph nodes) the search may keep in float32")
    g.add_argument("--rank-by", choices=["sqnr", "metric"],
                   help="what a candidate's measured gain is: logits SQNR in dB (default) or metric points")
    g.add_argument("--shortlist", type=int, metavar="N",
                   help="candidates (tensors and ops, by isolated SQNR) measured each round (default 12)")
    g.add_argument("--search-images", type=int, metavar="N",
                   help="images each candidate is measured on (default 32; the final model is evaluated on all)")


def _quantize_options(args) -> _QuantizeOptions:
    """Check the arguments and derive the options (the demo fills in its own model and folders); MaceqError if bad."""
    extra_meta = _apply_demo_defaults(args) if args.model is None else {}
    if not args.calib_dir:
        raise MaceqError("--calib-dir is required when a model is given")
    config = _quantize_config(args)
    pre = _preprocess_from(args, config.preprocess)
    input_shape = _csv_numbers(args.input_shape, int, what="--input-shape") if args.input_shape else None
    if not (args.preset or args.preprocess or config.preprocess):
        pre = _fit_to_model(pre, args.model, input_shape, quiet=args.quiet)
    if input_shape is not None and not args.quiet:
        _say_redeclared(args.model, input_shape)
    name = args.name or Path(args.model).stem
    check_model_name(name)
    out = Path(args.output) if args.output else default_output_root() / name
    devices = tuple(Device.parse(d.strip()).value for d in args.device.split(",") if d.strip())
    if not devices or len(set(devices)) != len(devices):
        raise MaceqError(f"--device: give each device once, got '{args.device}'")
    if args.budget and not args.eval_dir:
        raise MaceqError("--budget needs --eval-dir (the images the report measures)")
    if args.budget and not Path(args.budget).is_file():
        raise MaceqError(f"{args.budget}: no such budget file")
    if args.accuracy_budget is None:
        for flag, value in (("--min-sqnr", args.min_sqnr), ("--max-fp32-layers", args.max_fp32_layers),
                            ("--rank-by", args.rank_by), ("--shortlist", args.shortlist),
                            ("--search-images", args.search_images)):
            if value is not None:
                raise MaceqError(f"{flag} needs --accuracy-budget")
    return _QuantizeOptions(config, pre, input_shape, name, out, devices, extra_meta)


def _fit_to_model(pre: Preprocess, model: str, input_shape, *, quiet: bool) -> Preprocess:
    """Without a preset: the size, channels and layout the model's input demands, said aloud."""
    if input_shape is not None:
        dims = list(input_shape)
    else:
        graph = load_onnx(model).graph
        inits = {t.name for t in graph.initializer}
        inp = next((i for i in graph.input if i.name not in inits), None)
        if inp is None:
            return pre
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in inp.type.tensor_type.shape.dim]
    fitted, changes = pre.fitted_to(dims)
    if changes and not quiet:
        print(f"preprocessing from the model's input {'x'.join(map(str, dims))}: {', '.join(changes)} "
              f"(no --preset given)")
    return fitted


def _say_redeclared(model: str, input_shape: list[int]) -> None:
    """Say so when ``--input-shape`` changes a size the model's input fixes (the import checks that no
    op pins that size)."""
    graph = load_onnx(model).graph
    inits = {t.name for t in graph.initializer}
    inp = next((i for i in graph.input if i.name not in inits), None)
    dims = [d.dim_value if d.HasField("dim_value") else 0 for d in inp.type.tensor_type.shape.dim] if inp else []
    if len(dims) == len(input_shape) and any(0 < d != w for d, w in zip(dims[1:], input_shape[1:])):
        print(f"input '{inp.name}' was exported at {'x'.join(map(str, dims))}; quantizing at "
              f"{'x'.join(map(str, input_shape))} (--input-shape; no op may fix the exported size)")


def _apply_demo_defaults(args) -> dict:
    """Point ``args`` at the embedded demo model, its images and preset; the demo's extra metadata."""
    assets = default_assets()
    args.model = str(assets / f"{DEFAULT_MODEL_NAME}.onnx")
    args.calib_dir = args.calib_dir or str(assets / "calib")
    args.eval_dir = args.eval_dir or str(assets / "test")
    if not args.preset and not args.preprocess:
        args.preset = "fmnist"
    return {"classes": list(FMNIST_CLASSES)}


def _quantize_config(args) -> QuantConfig:
    """The config file (or the defaults) with the command-line flags and the recipe applied; MaceqError if bad."""
    config = load_config(args.config) if args.config else QuantConfig()
    if args.workers is not None and args.workers < 1:
        raise MaceqError("--workers must be >= 1")
    config = config.with_cli(workers=args.workers, executor=Executor.parse(args.executor) if args.executor else None,
                             ray_address=args.ray_address)
    if config.ray_address is not None and config.executor is not Executor.RAY:
        raise MaceqError("--ray-address (config ray_address) needs --executor ray")
    config = config.with_cli(range_method=RangeMethod(args.range_method) if args.range_method else None,
                             percentile=args.percentile, batch_size=args.batch_size, max_images=args.max_images)
    if args.bias_correction_images is not None and args.bias_correction_images < 1:
        raise MaceqError("--bias-correction-images must be >= 1")
    for flag, value in (("--adaround-images", args.adaround_images), ("--adaround-iters", args.adaround_iters)):
        if value is not None and value < 1:
            raise MaceqError(f"{flag} must be >= 1")
    config = config.with_cli(cle=args.cle, high_bias_absorption=args.high_bias_absorption,
                             bias_correction=args.bias_correction,
                             bias_correction_images=args.bias_correction_images, safe_forms=args.safe_forms,
                             adaround=args.adaround, adaround_images=args.adaround_images,
                             adaround_iters=args.adaround_iters)
    config = config.with_recipe(args.recipe)
    if args.fp32:
        config = config.with_cli(fp32_layers=tuple(config.fp32_layers) + tuple(args.fp32))
    return config


def _run_quantize(args, opts: _QuantizeOptions):
    """Calibrate, quantize and write one model per device; warnings shown unless --quiet."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore" if args.quiet else "default")
        return quantize(args.model, args.calib_dir, output_dir=opts.out, preprocess=opts.pre, config=opts.config,
                        input_shape=opts.input_shape, model_name=opts.name, progress=not args.quiet,
                        extra_meta=opts.extra_meta, strict=args.strict, devices=opts.devices)


def _print_quantize_summary(model: str, res) -> None:
    """Print the written files, the recovery steps, the rewritten ops and the layers left in float32."""
    print(f"quantized {model} for {', '.join(res.per_device)} on {res.n_calib_images} calibration images"
          + (f" ({res.n_skipped} unreadable, skipped)" if res.n_skipped else ""))
    for device, f in res.per_device.items():
        if len(res.per_device) > 1:
            print(f"  [{device}]")
        for label, path in (("graph", f.pb), ("weights", f.data), ("deployment", f.yml), ("ranges", f.ranges)):
            print(f"  {label:<10} {path}")
    for device, steps in res.recovery.items():
        for step in steps:
            per_device = step["step"] in ("bias correction", "adaround")
            print(f"  {step['step']}" + (f" [{device}]" if per_device else "")
                  + f": {step['detail']}")
    _print_device_forms(res)
    for line in res.graph.rewrites:
        print(f"rewritten: {line}")
    kept = set(res.fp32)
    if kept:
        print(f"{len(kept)} layers kept in float32 by request: " + ", ".join(sorted(kept)[:8])
              + (" ..." if len(kept) > 8 else ""))
    fallback = [n for n, where in res.placement.items() if where != "uint8" and n not in kept]
    if fallback:
        print(f"{len(fallback)} of {len(res.placement)} nodes run in float32 (no uint8 kernel): "
              + ", ".join(fallback[:8]) + (" ..." if len(fallback) > 8 else ""))
    for device, f in res.per_device.items():
        share = float_share(load(f.yml), device)
        print(f"  [{device}] {share.describe()}")
        if share.warning:
            print(f"  {share.warning}")


def _evaluate_quantized(args, opts: _QuantizeOptions, res) -> int:
    """With --eval-dir: evaluate each device's model, then write the report and check the budget; the exit status."""
    if not args.eval_dir:
        return 0
    data = ImageFolder(args.eval_dir, opts.pre, labels=args.labels or "auto", classes=opts.extra_meta.get("classes"))
    print(f"evaluation on {args.eval_dir}:")
    evals = evaluate_many({device: load(f.yml) for device, f in res.per_device.items()}, args.model, data,
                          progress=not args.quiet)
    for result in evals.values():
        for line in result.lines():
            print(line)
    if args.report or args.budget:
        return _write_report(res.per_device, data, opts.out, res.graph, evals, args)
    return 0


def _print_device_forms(res) -> None:
    """Say which ops were rewritten for their device (and what it costs), or which were kept deviating."""
    for device, info in res.device_forms.items():
        forms, deviating = info.get("safe_forms") or [], info.get("deviations") or {}
        if forms:
            print(f"  [{device}] {len(forms)} op(s) rewritten into a form the device computes right: "
                  + ", ".join(f["op"] for f in forms[:4]) + (" ..." if len(forms) > 4 else ""))
            print(f"    why: {forms[0]['reason']}")
            print(f"    cost: {info['safe_form_cost']}")
        if deviating:
            print(f"  [{device}] warning: {len(deviating)} op(s) kept in a form the device computes differently "
                  f"from the model (--no-safe-forms); the simulation predicts the device: "
                  + ", ".join(list(deviating)[:4]) + (" ..." if len(deviating) > 4 else ""))


def _write_report(per_device, data, out, graph, evals, args, mixed=None) -> int:

    report, files = make_report(per_device, data, output_dir=out, float_model=graph, evals=evals, mixed=mixed,
                                budget=args.budget, progress=not args.quiet)
    print("\n".join(verdict_lines(report)))
    print(f"report: {files.html}\n        {files.json}")
    if args.budget:
        return run_check(files.json, args.budget)
    return 0


def _search_args(args) -> dict:
    """The search's own options, where given (auto_mixed_precision's defaults otherwise)."""
    given = {"rank_by": args.rank_by, "shortlist": args.shortlist, "search_images": args.search_images}
    for key in ("shortlist", "search_images"):
        if given[key] is not None and given[key] < 1:
            raise MaceqError(f"--{key.replace('_', '-')} must be >= 1")
    return {k: v for k, v in given.items() if v is not None}


def _db(value) -> str:
    """A recorded SQNR: a number of dB, or the text JSON keeps for an infinite one."""
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _auto_mixed(args, out, pre, config, input_shape, name, extra_meta, devices) -> int:
    """quantize --accuracy-budget: calibrate once, then search fp32 exemptions per device."""

    if args.accuracy_budget < 0:
        raise MaceqError("--accuracy-budget must be >= 0")
    search = _search_args(args)
    cal = calibrate(args.model, args.calib_dir, preprocess=pre, config=config, input_shape=input_shape,
                    progress=not args.quiet, strict=args.strict)
    recover_per_device(cal, devices, progress=not args.quiet)
    check_weight_grid(cal, devices)  # warns; the search may exempt what it names
    if args.eval_dir:
        data = ImageFolder(args.eval_dir, pre, labels=args.labels or "auto", classes=extra_meta.get("classes"))
    else:
        data = holdout_split(args.calib_dir, pre, used=cal.n_images + cal.n_skipped)
    status = 0
    results = {}
    for device in devices:
        r = auto_mixed_precision(cal, output_dir=out if len(devices) == 1 else out / device, eval_data=data,
                                 budget_points=args.accuracy_budget, min_sqnr=args.min_sqnr,
                                 max_fp32_layers=args.max_fp32_layers, device=device, model_name=name,
                                 extra_meta=extra_meta, progress=not args.quiet, executor=config.executor.value,
                                 workers=config.workers, ray_address=config.ray_address, **search)
        print(f"[{device}] automatic mixed precision, budget {args.accuracy_budget:g} points, measured on "
              f"{r.search_images} image(s), ranked by {r.rank_by}:")
        for s in r.trail:
            print(f"  {step_line(s)}")
        if r.final_all:
            b, f = r.baseline_all, r.final_all
            print(f"  all {f['images']} images: {f['metric']} {b['value']:.2f}% -> {f['value']:.2f}% "
                  f"(drop {f['drop_points']:.2f} points), logits SQNR {_db(b['sqnr_db'])} -> {_db(f['sqnr_db'])} dB")
        print(f"  model: {r.files.yml}")
        if not r.ok:
            print(f"error: {r.message}", file=sys.stderr)
            status = 3
        results[device] = r
    if args.report or args.budget:
        per_device = {d: r.files for d, r in results.items()}
        rc = _write_report(per_device, data, out, cal.graph, None, args,
                           mixed={d: r.to_dict() for d, r in results.items()})
        status = status or rc
    return status


FMNIST_CLASSES = ("T-shirt_top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                  "Ankle_boot")


def quantize_main(argv=None) -> int:
    return _run_cli(_quantize, argv)


# -- maceq run / eval / inspect ------------------------------------------------------------
def _load_input(path: str, model, pre):
    if path.lower().endswith(".npy"):
        try:
            x = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise MaceqError(f"{path}: not a readable .npy file ({e})") from None
        want = model.input_shape(model.input_names[0])
        if x.ndim == len(want) - 1:
            x = x[None]
        return x.astype(np.float32)
    return load_image(path, pre)


def _npy_bytes(outs: dict) -> bytes:
    """One output as .npy, several as .npz, in memory (then written atomically)."""
    buf = io.BytesIO()
    if len(outs) == 1:
        np.save(buf, next(iter(outs.values())))
    else:
        np.savez(buf, **outs)
    return buf.getvalue()


def _cmd_run(args) -> int:
    model = load(args.qmodel)
    pre = _preprocess_from(args, model.maceq_meta.get("preprocess"))
    x = _load_input(args.input, model, pre)
    outs = model.run({model.input_names[0]: x}, device=args.device or model.maceq_meta.get("device", "cpu"),
                     backend=args.backend)
    out_path = Path(args.output) if args.output else None
    if out_path is not None:
        atomic_write(out_path, _npy_bytes(outs))
        print(f"wrote {out_path}")
    classes = model.maceq_meta.get("classes")
    for name, y in outs.items():
        flat = y.reshape(y.shape[0], -1)
        if y.ndim == 2 and flat.shape[1] > 1:
            order = np.argsort(-flat[0], kind="stable")[:5]
            print(f"{name}: top-5 classes")
            for k in order:
                label = f" ({classes[k]})" if classes and k < len(classes) else ""
                print(f"  {int(k):>5}{label}  {float(flat[0, k]):.4f}")
        else:
            print(f"{name}: shape {tuple(y.shape)}, min {float(y.min()):.4f}, max {float(y.max()):.4f}")
    return 0


def _cmd_eval(args) -> int:
    """Float vs int8 on an image folder: print the metrics (and write them as JSON)."""
    parallel = _eval_workers(args)
    model = load(args.qmodel)
    meta = model.maceq_meta
    pre = _preprocess_from(args, meta.get("preprocess"))
    float_model = args.float_model or meta.get("source_model")
    if not float_model:
        raise MaceqError(f"{args.qmodel}: no source model recorded; pass --float-model")
    args.device = args.device or meta.get("device", "cpu")
    if args.task == "segmentation":
        data = ImageFolder(args.images, pre, labels=None)
        result = evaluate_segmentation(model, float_model, data, device=args.device, threshold=args.threshold,
                                       progress=not args.quiet)
    else:
        data = ImageFolder(args.images, pre, labels=args.labels or "auto", classes=meta.get("classes"))
        result = evaluate(model, float_model, data, device=args.device, progress=not args.quiet, **parallel)
    for line in result.lines():
        print(line)
    if args.json:
        text = json.dumps(result.to_dict(), indent=2, sort_keys=True)
        atomic_write(Path(args.json), (text + "\n").encode("utf-8"))
        print(f"wrote {args.json}")
    return 0


def _cmd_inspect(args) -> int:
    """Print the model's tensors, its float share on the device and every op with its quantization."""
    model = load(args.qmodel)
    net = model.net_def
    device = args.device or model.maceq_meta.get("device", "cpu")
    place = model.placement(device)
    sizes = {t.name: int(model.consts[t.name].nbytes) for t in net.tensors}
    print(f"model {args.qmodel}: {len(net.op)} ops, {len(net.tensors)} constant tensors, "
          f"{sum(sizes.values())} bytes of weights")
    print("inputs:  " + ", ".join(f"{i.name} {list(i.dims)} scale={i.scale:.6g} zp={i.zero_point}"
                                   for i in net.input_info))
    print("outputs: " + ", ".join(f"{o.name} {list(o.dims)} scale={o.scale:.6g} zp={o.zero_point}"
                                   for o in net.output_info))
    share = float_share(model, device)
    print(f"on {device}: {share.describe()}")
    if share.warning:
        print(share.warning)
    for line in device_path_lines(model.deviations(device), list(model.maceq_meta.get("safe_forms") or [])):
        print(line.strip())
    print(f"{'#':>3}  {'op type':<16} {'prec':<5} {'runs on':<7} {'name':<44} {'output shape':<18} {'scale':>11} "
          f"{'zp':>4}  weights")
    for k, op in enumerate(model.ops):
        q = op.out_qinfo[0] if op.out_qinfo else None
        w = [f"{i}({sizes[i]}B, s={model.const_qinfo[i].scale:.3g}, zp={model.const_qinfo[i].zero_point})"
             for i in op.inputs if i in sizes]
        shape = "x".join(map(str, op.output_shapes[0])) if op.output_shapes else "?"
        prec = "fp32" if op.arg("T") == DataType.DT_FLOAT else "uint8"
        where, why = place[op.name]
        print(f"{k:>3}  {op.type:<16} {prec:<5} {where:<7} {op.name[:44]:<44} {shape:<18} "
              f"{(f'{q.scale:.5g}' if q else '-'):>11} {(q.zero_point if q else '-'):>4}  {' '.join(w)}"
              + (f"  [fallback: {why}]" if why else ""))
    return 0


def _cmd_check(args) -> int:
    return run_check(args.report, args.budget, args.junit)


def _cmd_report(args) -> int:
    """Measure the quantized model(s) and write report.html and report.json."""
    parallel = _eval_workers(args)
    models = [load(p) for p in args.qmodel]
    meta = models[0].maceq_meta
    data = ImageFolder(args.images, _preprocess_from(args, meta.get("preprocess")), labels=args.labels or "auto",
                       classes=meta.get("classes"))
    out = Path(args.output) if args.output else Path(args.qmodel[0]).resolve().parent
    report, files = make_report(models, data, output_dir=out, float_model=args.float_model,
                                analysis_images=args.analysis_images, budget=args.budget, progress=not args.quiet,
                                **parallel)
    print("\n".join(verdict_lines(report)))
    print(f"wrote {files.html}\nwrote {files.json}")
    return 0


def _maceq(argv) -> int:
    p = _Parser(prog="maceq", description="Run, evaluate and inspect quantized MACE models.")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run one input through the int8 model")
    r.add_argument("qmodel", help="the model's deployment .yml or .pb")
    r.add_argument("--input", required=True, help="an image or a .npy array")
    r.add_argument("--device", default=None, help="device to simulate (default: the one the model was quantized for)")
    r.add_argument("-o", "--output", help="write the dequantized outputs to this .npy (.npz for several)")
    r.add_argument("--backend", choices=["numpy", "opencl"], default="numpy",
                   help="numpy: the bit-exact simulation (default); opencl: run the gpu device's OpenCL kernels "
                        "(pip install 'maceq[opencl]')")
    _add_preprocess_args(r)
    e = sub.add_parser("eval", help="float vs int8 agreement and accuracy on an image folder")
    e.add_argument("qmodel")
    e.add_argument("--images", required=True, help="image folder (class subfolders give labels)")
    e.add_argument("--labels", help="labels CSV (file,label)")
    e.add_argument("--device", default=None, help="device to simulate (default: the one the model was quantized for)")
    e.add_argument("--float-model", help="float ONNX model (default: the one recorded at quantization)")
    e.add_argument("--json", help="also write the metrics to this JSON file")
    e.add_argument("--task", choices=["classification", "segmentation"], default="classification",
                   help="classification: top-1/top-5 agreement and accuracy; segmentation: output SQNR and "
                        "IoU of thresholded masks")
    e.add_argument("--threshold", type=float, default=0.3,
                   help="mask threshold for --task segmentation (default 0.3, PaddleOCR DB's)")
    e.add_argument("-q", "--quiet", action="store_true")
    _add_eval_workers(e)
    _add_preprocess_args(e)
    ck = sub.add_parser("check", help="gate CI on a report.json and a budget (exit 0 within, 1 over, 2 bad input)")
    ck.add_argument("report", help="report.json")
    ck.add_argument("--budget", required=True, help="budget YAML")
    ck.add_argument("--junit", help="also write JUnit XML (one testcase per layer)")
    rp = sub.add_parser("report", help="write report.html and report.json for quantized model(s)")
    rp.add_argument("qmodel", nargs="+", help="the deployment .yml (or .pb) of each device's model")
    rp.add_argument("--images", required=True, help="evaluation images")
    rp.add_argument("--labels", help="labels CSV (file,label)")
    rp.add_argument("-o", "--output", help="output folder (default: beside the first model)")
    rp.add_argument("--float-model", help="float ONNX model (default: the one recorded at quantization)")
    rp.add_argument("--analysis-images", type=int, default=32, help="images for the per-layer analysis (default 32)")
    rp.add_argument("--budget", help="budget YAML: adds a budget section")
    rp.add_argument("-q", "--quiet", action="store_true")
    _add_eval_workers(rp)
    _add_preprocess_args(rp)
    i = sub.add_parser("inspect", help="print the quantized graph: ops, tensors, scales, sizes")
    i.add_argument("qmodel")
    i.add_argument("--device", default=None, help="show op placement on this device (default: the model's)")
    args = p.parse_args(argv)
    return {"run": _cmd_run, "eval": _cmd_eval, "inspect": _cmd_inspect, "check": _cmd_check,
            "report": _cmd_report}[args.cmd](args)


def maceq_main(argv=None) -> int:
    return _run_cli(_maceq, argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(maceq_main())
