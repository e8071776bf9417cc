"""The `quantize` job: ONNX + image folder -> MACE uint8 model files.

    load + import -> optimise -> calibrate (onnxruntime on the optimised graph)
    -> ranges -> cpu quantization parameters -> MACE NetDef -> .pb/.data/.yml/ranges
"""
from __future__ import annotations

import os
from pathlib import Path

from maceq.app.adaround import adaround, check_options
from maceq.app.bias_correction import correct_biases
from maceq.app.consumer_ranges import RANGE_IMAGES, consumer_ranges
from maceq.app.weight_grid import check_weight_grid
from maceq.calibrate.methods import RangeMethod, compute_range
from maceq.calibrate.parallel import collect_parallel
from maceq.datasets.images import ImageFolder
from maceq.datasets.preprocess import Preprocess
from maceq.errors import MaceqError
from maceq.quant.build import build_mace_model, check_supported, select_nodes
from maceq.quant.config import QuantConfig
from maceq.quant.export import Calibration, QuantizeResult, check_degenerate, write_quantized
from maceq.quant.ir import Graph
from maceq.quant.passes.equalize import collect_channel_stats, equalize
from maceq.quant.prepare import prepare_graph, tensors_to_calibrate
from maceq.runtime.devices import Device

__all__ = ["Calibration", "QuantizeResult", "calibrate", "correct_bias", "quantize", "recover_per_device",
           "round_weights", "write_quantized"]


def _equalize(opt: Graph, config: QuantConfig, *, data: ImageFolder, in_name: str, progress: bool):
    """Cross-layer equalization (+ high-bias absorption) of the optimised graph, in place, with the
    per-channel pre-activation statistics of the calibration images (quant/passes/equalize.py)."""
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


def _check_buildable(opt: Graph, shapes: dict, device: Device, *, strict: bool, fp32) -> None:
    """Place every node and build the model once on wide placeholder ranges, so that what the writer
    cannot emit (an op form MACE lacks) is refused before calibration; all-zero weights are named first."""
    placement = check_supported(opt, device=device, strict=strict, shapes=shapes, fp32=fp32)
    check_degenerate(opt, {}, placement)
    wide = {t: (-1e3, 1e3) for t in tensors_to_calibrate(opt)}  # the ranges change values, not the ops
    build_mace_model(opt, wide, shapes, model_name="check", strict=strict, fp32=fp32, device=device)


def calibrate(onnx_path: str | os.PathLike, calib_dir: str | os.PathLike, *, preprocess: Preprocess,
              config: QuantConfig = QuantConfig(), input_shape: list[int] | None = None, progress: bool = True,
              strict: bool = False, devices: "tuple[Device | str, ...]" = (Device.CPU,)) -> Calibration:
    """Import, optimise and calibrate: activation ranges for every tensor that gets a scale.

    Every node is checked against each of ``devices`` before the (long) calibration starts."""
    onnx_path = Path(onnx_path)
    opt, in_shapes, shapes = prepare_graph(onnx_path, input_shape=input_shape, preprocess=preprocess)
    fp32 = select_nodes(opt, config.fp32_layers)
    unmatched = [p for p in config.fp32_layers if not select_nodes(opt, [p])]
    if unmatched:
        raise MaceqError(f"fp32 layer pattern '{unmatched[0]}' matches no node of {onnx_path}")
    for device in devices:  # fail before the (long) calibration
        _check_buildable(opt, shapes, Device.parse(device), strict=strict, fp32=fp32)
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
    by_consumers = [t for t in names if config.method_for(t)[0] is RangeMethod.CONSUMER]
    if by_consumers:
        chosen, info = consumer_ranges(opt, stats, by_consumers, calib_dir=calib_dir, preprocess=preprocess,
                                       batch_size=config.batch_size, progress=progress,
                                       images=min(RANGE_IMAGES, config.max_images or RANGE_IMAGES))
        ranges.update(chosen)
        recovery.append({"step": "consumer ranges", **info,
                         "detail": f"{info['changed']} of {info['scored']} tensors read only by weighted layers "
                                   f"took another clip range by their consumers' output error on "
                                   f"{info.get('images', 0)} calibration images"})
    return Calibration(onnx_path, opt, in_shapes, shapes, ranges, len(data) - data.skipped, data.skipped,
                       preprocess, config, calib_dir=Path(calib_dir), recovery=recovery)


def correct_bias(cal: Calibration, devices: "tuple[Device | str, ...]", *, progress: bool = True,
                 fp32_nodes: set[str] | frozenset = frozenset()) -> None:
    """Empirical bias correction (app/bias_correction.py) of ``cal`` for each device, in place:
    fills ``cal.device_biases`` and ``cal.device_recovery``. Needs ``cal.calib_dir``."""
    if cal.calib_dir is None:
        raise MaceqError("bias correction needs the calibration images (Calibration.calib_dir)")
    n = cal.config.bias_correction_images
    for device in (Device.parse(d) for d in devices):
        data = ImageFolder(cal.calib_dir, cal.preprocess, labels=None, limit=n)
        bc = correct_biases(cal, device=device, data=data, fp32_nodes=frozenset(fp32_nodes),
                            batch_size=cal.config.batch_size, progress=progress)
        cal.device_biases[device.value] = bc.biases
        d = bc.to_dict()
        _record(cal, device, {
            "step": "bias correction",
            "detail": f"{d['layers']} layers corrected on {d['images']} calibration images (mean |shift| "
                      f"{d['mean_abs_shift']:.3g}, largest layer mean {d['max_layer_shift']:.3g})",
            **d})


def _record(cal: Calibration, device: Device, step: dict) -> None:
    """Add (or replace) one per-device recovery step of ``cal``, keeping the others in order."""
    steps = [s for s in cal.device_recovery.get(device.value, []) if s["step"] != step["step"]]
    cal.device_recovery[device.value] = steps + [step]


def round_weights(cal: Calibration, devices: "tuple[Device | str, ...]", *, progress: bool = True,
                  fp32_nodes: set[str] | frozenset = frozenset()) -> None:
    """AdaRound (app/adaround.py) of ``cal``'s uint8 layers for each device, in place: fills
    ``cal.device_weights`` and ``cal.device_recovery``. Needs ``cal.calib_dir``."""
    if cal.calib_dir is None:
        raise MaceqError("adaround needs the calibration images (Calibration.calib_dir)")
    data = ImageFolder(cal.calib_dir, cal.preprocess, labels=None, limit=cal.config.adaround_images)
    fp32 = select_nodes(cal.graph, cal.config.fp32_layers) | set(fp32_nodes)
    results = adaround(cal.graph, cal.shapes, devices=devices, data=data, fp32_nodes=frozenset(fp32),
                       iters=cal.config.adaround_iters, batch_size=cal.config.batch_size, progress=progress)
    for dev, res in results.items():
        cal.device_weights[dev] = res.weights
        d = res.to_dict()
        skipped = f"; skipped: {', '.join(s['node'] for s in d['skipped'])}" if d["skipped"] else ""
        _record(cal, Device.parse(dev), {
            "step": "adaround",
            "detail": f"{d['layers']} layers rounded on {d['images']} calibration images, "
                      f"{d['changed_weights']} of {d['weights']} weights away from the nearest code (mean layer "
                      f"SQNR from the weights {d['mean_layer_sqnr_nearest_db']:.2f} -> "
                      f"{d['mean_layer_sqnr_adaround_db']:.2f} dB){skipped}",
            **d})


def recover_per_device(cal: Calibration, devices: "tuple[Device | str, ...]", *, progress: bool = True,
                       fp32_nodes: set[str] | frozenset = frozenset()) -> None:
    """The per-device recovery steps the config asks for, in order: AdaRound, then bias correction
    (which measures the model with the rounded weights)."""
    if cal.config.adaround:
        round_weights(cal, devices, progress=progress, fp32_nodes=fp32_nodes)
    if cal.config.bias_correction:
        correct_bias(cal, devices, progress=progress, fp32_nodes=fp32_nodes)


def quantize(onnx_path: str | os.PathLike, calib_dir: str | os.PathLike, *, output_dir: str | os.PathLike,
             preprocess: Preprocess, config: QuantConfig = QuantConfig(), input_shape: list[int] | None = None,
             model_name: str | None = None, progress: bool = True, extra_meta: dict | None = None,
             strict: bool = False, devices: "tuple[Device | str, ...]" = (Device.CPU,)) -> QuantizeResult:
    """Quantize ``onnx_path`` for each device, calibrating once on the images in ``calib_dir``.

    One device writes into ``output_dir``; several write one model each into ``output_dir/<device>/``.
    ``result.files`` is the first device's; ``result.per_device`` has them all.
    """
    devices = tuple(Device.parse(d) for d in devices)
    if config.adaround:
        check_options(iters=config.adaround_iters, images=config.adaround_images)
    cal = calibrate(onnx_path, calib_dir, preprocess=preprocess, config=config, input_shape=input_shape,
                    progress=progress, strict=strict, devices=devices)
    recover_per_device(cal, devices, progress=progress)
    grid = check_weight_grid(cal, devices)
    return write_quantized(cal, output_dir=output_dir, model_name=model_name, extra_meta=extra_meta, strict=strict,
                           devices=devices, device_meta=grid)
