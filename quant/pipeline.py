"""The `quantize` job: ONNX + image folder -> MACE uint8 model files.

    load + import -> optimise -> calibrate (onnxruntime on the optimised graph)
    -> ranges -> cpu quantization parameters -> MACE NetDef -> .pb/.data/.yml/ranges
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from maceq.calibrate.methods import compute_range
from maceq.calibrate.parallel import collect_parallel
from maceq.datasets.images import ImageFolder
from maceq.datasets.preprocess import Preprocess
from maceq.errors import MaceqError
from maceq.quant.build import build_mace_model, check_supported, select_nodes
from maceq.quant.safe_forms import find_defects, in_memory_model, make_safe
from maceq.quant.config import QuantConfig
from maceq.quant.ir import Graph
from maceq.quant.mace.format import write_model
from maceq.quant.onnx_import import fix_input_shapes, import_onnx, load_onnx
from maceq.quant.passes import optimize

VIEW_OPS = ("Flatten", "Reshape", "Squeeze")


@dataclass
class QuantizeResult:
    files: object  # maceq.quant.mace.format.ModelFiles
    graph: Graph
    placement: dict  # IR node name -> "uint8" | "float32"
    n_calib_images: int
    n_skipped: int
    model_name: str
    fp32: frozenset = frozenset()  # nodes kept in float32 by request
    per_device: dict = field(default_factory=dict)  # device -> ModelFiles
    recovery: dict = field(default_factory=dict)  # device -> accuracy-recovery steps applied
    device_forms: dict = field(default_factory=dict)  # device -> {"safe_forms": [...], ...} (see _device_forms)


def tensors_to_calibrate(graph: Graph) -> list[str]:
    """Every tensor that gets a scale: the inputs and each non-view node's output."""
    names = [vi.name for vi in graph.inputs]
    for n in graph.nodes:
        if n.op_type not in VIEW_OPS:
            names.extend(n.outputs)
    return names


def _sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _is_dynamic(dims) -> bool:
    return any(not (isinstance(d, int) and d > 0) for d in dims[1:])


def prepare_graph(onnx_path: str | os.PathLike, *, input_shape: list[int] | None,
                  preprocess: Preprocess | None = None):
    """Import and optimise; dynamic spatial input dims come from ``input_shape``, else from the
    preprocessing's fixed output size (e.g. ``--resize 640,640``)."""
    model = load_onnx(onnx_path)
    graph = import_onnx(model, source=os.fspath(onnx_path))
    if (input_shape is None and preprocess is not None and len(graph.inputs) == 1
            and _is_dynamic(graph.inputs[0].shape) and preprocess.output_shape() is not None):
        input_shape = [1, *preprocess.output_shape()]
    in_shapes = fix_input_shapes(graph, input_shape)
    opt = optimize(graph, in_shapes)
    shapes = opt.infer_shapes(in_shapes)
    return opt, in_shapes, shapes


@dataclass
class Calibration:
    """Everything the writer needs, computed once: the optimised graph, its shapes and the ranges."""

    onnx_path: Path
    graph: Graph
    in_shapes: dict
    shapes: dict
    ranges: dict
    n_images: int
    n_skipped: int
    preprocess: Preprocess
    config: QuantConfig
    calib_dir: Path | None = None
    #: accuracy-recovery steps applied to the graph (each {"step", "detail", ...}), for the report
    recovery: list = field(default_factory=list)
    #: per device: corrected float biases by node name (empirical bias correction), and its record
    device_biases: dict = field(default_factory=dict)
    device_recovery: dict = field(default_factory=dict)

    def graph_for(self, device: str, fp32: set[str] | frozenset = frozenset()) -> Graph:
        """The graph the ``device`` model is written from: the bias-corrected biases applied to the
        layers that stay quantized (an fp32 layer keeps its float bias)."""
        biases = {n: b for n, b in (self.device_biases.get(device) or {}).items() if n not in fp32}
        if not biases:
            return self.graph
        from maceq.quant.bias_correction import with_biases

        return with_biases(self.graph, biases)


def _equalize(opt: Graph, config: QuantConfig, *, data: ImageFolder, in_name: str, progress: bool):
    """Cross-layer equalization (+ high-bias absorption) of the optimised graph, in place, with the
    per-channel pre-activation statistics of the calibration images (quant/passes/equalize.py)."""
    from maceq.quant.passes.equalize import collect_channel_stats, equalize

    stats = collect_channel_stats(opt, data.iter_batches(config.batch_size), input_name=in_name)
    # ReLU6 links: a channel moves only if its pre-activation stays below the clip on every calibration
    # image (headroom 1: exact on the calibration set; docs/recovery.md, "ReLU6").
    rep = equalize(opt, relu6="calibrated", headroom=1.0, channel_stats=stats,
                   absorb_bias=config.high_bias_absorption)
    use_b = [r.grid_use_before for r in rep.layers]
    use_a = [r.grid_use_after for r in rep.layers]
    absorbed = sum(ln.absorbed_channels for ln in rep.links)
    detail = (f"{len(rep.links)} layer pairs equalized in {rep.sweeps} sweeps; mean per-channel use of the "
              f"per-tensor weight grid {100 * sum(use_b) / max(len(use_b), 1):.1f}% -> "
              f"{100 * sum(use_a) / max(len(use_a), 1):.1f}%")
    detail += (f"; high-bias absorption moved {absorbed} channel biases" if config.high_bias_absorption
               else "; no high-bias absorption")
    return opt, {"step": "cross-layer equalization", "detail": detail, "links": len(rep.links),
                 "high_bias_absorption": bool(config.high_bias_absorption), "absorbed_channels": absorbed}


def calibrate(onnx_path: str | os.PathLike, calib_dir: str | os.PathLike, *, preprocess: Preprocess,
              config: QuantConfig = QuantConfig(), input_shape: list[int] | None = None, progress: bool = True,
              strict: bool = False) -> Calibration:
    """Import, optimise and calibrate: activation ranges for every tensor that gets a scale."""
    onnx_path = Path(onnx_path)
    opt, in_shapes, shapes = prepare_graph(onnx_path, input_shape=input_shape, preprocess=preprocess)
    fp32 = select_nodes(opt, config.fp32_layers)
    unmatched = [p for p in config.fp32_layers if not select_nodes(opt, [p])]
    if unmatched:
        raise MaceqError(f"fp32 layer pattern '{unmatched[0]}' matches no node of {onnx_path}")
    check_supported(opt, strict=strict, shapes=shapes, fp32=fp32)  # fail before the (long) calibration
    if len(opt.inputs) != 1:
        raise MaceqError(f"{onnx_path}: {len(opt.inputs)} inputs; image calibration supports one-input models")
    in_name = opt.inputs[0].name
    want = in_shapes[in_name]
    data = ImageFolder(calib_dir, preprocess, labels=None, limit=config.max_images)
    got = preprocess.output_shape()
    if got is not None and len(want) == 4 and tuple(got) != tuple(want[1:]):
        raise MaceqError(f"preprocessing gives inputs of shape {tuple(got)}, model input '{in_name}' needs "
                         f"{tuple(want[1:])}: adjust --preset/--resize/--crop or --input-shape")
    recovery: list = []
    if config.cle:
        opt, step = _equalize(opt, config, data=data, in_name=in_name, progress=progress)
        recovery.append(step)
    names = tensors_to_calibrate(opt)
    # one process (workers 1, local: calibrate.runner.collect here) or shards on processes / Ray tasks;
    # bit-identical statistics either way (docs/parallel.md). Sets data.skipped like iter_batches.
    stats = collect_parallel(opt.to_onnx(), names, data, workers=config.workers, executor=config.executor,
                             ray_address=config.ray_address, batch_size=config.batch_size, input_name=in_name,
                             progress=progress)
    ranges = {}
    for t in names:
        method, pct = config.method_for(t)
        ranges[t] = compute_range(stats[t], method, percentile=pct)
    return Calibration(onnx_path, opt, in_shapes, shapes, ranges, len(data) - data.skipped, data.skipped,
                       preprocess, config, calib_dir=Path(calib_dir), recovery=recovery)


def correct_bias(cal: Calibration, devices: tuple[str, ...], *, progress: bool = True,
                 fp32_nodes: set[str] | frozenset = frozenset()) -> None:
    """Empirical bias correction (quant/bias_correction.py) of ``cal`` for each device, in place:
    fills ``cal.device_biases`` and ``cal.device_recovery``. Needs ``cal.calib_dir``."""
    from maceq.quant.bias_correction import correct_biases
    from maceq.runtime.profiles import Device

    if cal.calib_dir is None:
        raise MaceqError("bias correction needs the calibration images (Calibration.calib_dir)")
    n = cal.config.bias_correction_images
    for device in devices:
        device = Device.parse(device).value
        data = ImageFolder(cal.calib_dir, cal.preprocess, labels=None, limit=n)
        bc = correct_biases(cal, device=device, data=data, fp32_nodes=frozenset(fp32_nodes),
                            batch_size=cal.config.batch_size, progress=progress)
        cal.device_biases[device] = bc.biases
        d = bc.to_dict()
        cal.device_recovery[device] = [{
            "step": "bias correction",
            "detail": f"{d['layers']} layers corrected on {d['images']} calibration images (mean |shift| "
                      f"{d['mean_abs_shift']:.3g}, largest layer mean {d['max_layer_shift']:.3g})",
            **d}]


def quantize(onnx_path: str | os.PathLike, calib_dir: str | os.PathLike, *, output_dir: str | os.PathLike,
             preprocess: Preprocess, config: QuantConfig = QuantConfig(), input_shape: list[int] | None = None,
             model_name: str | None = None, progress: bool = True, extra_meta: dict | None = None,
             strict: bool = False, devices: tuple[str, ...] = ("cpu",)) -> QuantizeResult:
    """Quantize ``onnx_path`` for each device, calibrating once on the images in ``calib_dir``.

    One device writes into ``output_dir``; several write one model each into ``output_dir/<device>/``.
    ``result.files`` is the first device's; ``result.per_device`` has them all.
    """
    cal = calibrate(onnx_path, calib_dir, preprocess=preprocess, config=config, input_shape=input_shape,
                    progress=progress, strict=strict)
    if config.bias_correction:
        correct_bias(cal, devices, progress=progress)
    return write_quantized(cal, output_dir=output_dir, model_name=model_name, extra_meta=extra_meta, strict=strict,
                           devices=devices)


def check_degenerate(graph: Graph, ranges: dict, placement: dict) -> None:
    """Refuse, naming the tensor or layer, what MACE's uint8 kernels cannot run (docs/edge-cases.md):
    all-zero constant weights of a uint8 Conv/ConvTranspose/Gemm/MatMul, and a tensor of a uint8 node
    that is 0 on every calibration image. MACE's converter gives both scale 0 and its runtime aborts in
    GetOutputMultiplierAndShift (mace/core/quantize.h)."""
    import numpy as np

    for n in graph.nodes:
        if placement.get(n.name) != "uint8":
            continue
        origin = (n.attrs.get("maceq_names") or [n.name])[0]
        where = f"node '{origin}' ({n.op_type}" + (f", fused as '{n.name}')" if origin != n.name else ")")
        if (n.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul") and len(n.inputs) > 1
                and graph.is_const(n.inputs[1]) and not np.any(graph.const(n.inputs[1]))):
            raise MaceqError(f"{where}: all weights are 0; MACE's uint8 kernels cannot use the weight scale 0 "
                             f"this gives (the device aborts): keep it in float32 (--fp32 {origin}) or remove it")
        for t in [i for i in n.inputs if i and not graph.is_const(i)] + list(n.outputs):
            if t in ranges and max(float(ranges[t][1]), 0.0) == min(float(ranges[t][0]), 0.0):
                raise MaceqError(f"tensor '{t}' (at {where}) is 0 on every calibration image: the range [0, 0] "
                                 f"gives scale 0, which MACE's uint8 kernels cannot use (the device aborts): "
                                 f"calibrate on images where it varies, or keep the layers around it in "
                                 f"float32 (--fp32)")


def write_quantized(cal: Calibration, *, output_dir: str | os.PathLike, model_name: str | None = None,
                    extra_meta: dict | None = None, strict: bool = False, devices: tuple[str, ...] = ("cpu",),
                    fp32_nodes: set[str] | None = None) -> QuantizeResult:
    """Write one MACE model per device from a calibration (cheap: no image is run again).

    ``fp32_nodes``: node names kept in float32, in addition to the config's ``fp32_layers``.
    """
    from maceq.runtime.profiles import Device

    devices = tuple(Device.parse(d).value for d in devices)
    if not devices or len(set(devices)) != len(devices):
        raise MaceqError(f"--device: give each device once, got {','.join(devices) or 'none'}")
    onnx_path, opt, shapes, ranges, config = cal.onnx_path, cal.graph, cal.shapes, cal.ranges, cal.config
    name = model_name or onnx_path.stem
    fp32 = select_nodes(opt, config.fp32_layers) | set(fp32_nodes or ())
    placement = check_supported(opt, strict=strict, shapes=shapes, fp32=fp32)
    check_degenerate(opt, ranges, placement)
    in_name = opt.inputs[0].name
    want = cal.in_shapes[in_name]
    n_images = cal.n_images
    preprocess = cal.preprocess
    meta = {
        "source_model": str(onnx_path.resolve()),
        "source_sha256": _sha256(onnx_path),
        "preprocess": preprocess.to_dict(),
        "range_method": config.range_method.value,
        "percentile": config.percentile,
        "layer_overrides": {ov.pattern: {k: (v.value if hasattr(v, "value") else v)
                                         for k, v in (("range_method", ov.range_method),
                                                      ("percentile", ov.percentile)) if v is not None}
                            for ov in config.layers},
        "calibration_images": n_images,
        "input_shape": list(want),
        "float_fallback": sorted(n for n, where in placement.items() if where != "uint8" and n not in fp32),
        "fp32_layers": sorted(fp32),
    }
    meta.update(extra_meta or {})
    out_shape = {o: list(shapes[o]) for o in opt.outputs}
    lo, hi = ranges[in_name]
    subgraph = {
        "input_tensors": [in_name], "input_shapes": [",".join(map(str, want))],
        "input_data_formats": ["NCHW" if len(want) == 4 else "NONE"],
        "input_ranges": [f"{lo!r},{hi!r}"],
        "output_tensors": list(opt.outputs),
        "output_shapes": [",".join(map(str, out_shape[o])) for o in opt.outputs],
        "output_data_formats": ["NCHW" if len(out_shape[o]) == 4 else "NONE" for o in opt.outputs],
    }
    per_device, device_forms = {}, {}
    for device in devices:
        g_dev = cal.graph_for(device, fp32)
        built = build_mace_model(g_dev, ranges, shapes, model_name=name, strict=strict, fp32=fp32, device=device)
        forms_meta = device_forms[device] = _device_forms(built, device, safe=config.safe_forms)
        out_dir = Path(output_dir) if len(devices) == 1 else Path(output_dir) / device
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise MaceqError(f"{out_dir}: cannot create the output folder ({e.strerror})") from None
        per_device[device] = write_model(
            out_dir, name, built.multi_net_def, built.arrays,
            deployment={"platform": "onnx", "runtime": MACE_RUNTIME[device], "subgraphs": [subgraph]},
            ranges=built.ranges, maceq={**meta, "device": device, "tensor_map": built.tensor_map,
                                        "recovery": list(cal.recovery) + list(cal.device_recovery.get(device, [])),
                                        **forms_meta})
    result = QuantizeResult(per_device[devices[0]], opt, placement, n_images, cal.n_skipped, name, frozenset(fp32))
    result.per_device = per_device
    result.device_forms = device_forms
    result.recovery = {d: list(cal.recovery) + list(cal.device_recovery.get(d, [])) for d in devices}
    return result


def _device_forms(built, device: str, *, safe: bool) -> dict:
    """Rewrite the ops ``device`` computes wrongly (``safe``), or list them; the .yml's record of either.

    A model whose probe run fails (a multiplier MACE aborts on) is written as it is: the device, and
    the simulation, refuse to run it at all.
    """
    try:
        defects = find_defects(in_memory_model(built.multi_net_def, built.arrays, device), device)
    except MaceqError:
        return {}
    if not defects:
        return {}
    if not safe:
        return {"deviations": defects}
    forms, cost = make_safe(built, device, defects)
    return {"safe_forms": [{"op": f.op, "reason": f.reason, "pad_op": f.pad_op} for f in forms],
            "safe_form_cost": cost.describe()}


#: The deployment yml's ``runtime`` key for each device (MACE's names).
MACE_RUNTIME = {"cpu": "cpu", "gpu": "gpu", "dsp": "dsp"}
