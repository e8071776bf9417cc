"""Write the quantized model for each device from one calibration: the builder's NetDef, the
safe forms of the ops a device computes wrongly, and the MACE files (written to temporary names and
renamed). Cheap: no image is run again."""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from maceq.datasets.preprocess import Preprocess
from maceq.errors import MaceqError, UndefinedOnDevice
from maceq.mace.cpu_ops import unsupported_ops
from maceq.mace.format import write_model
from maceq.quant.build import build_mace_model, check_supported, select_nodes
from maceq.quant.config import QuantConfig
from maceq.quant.ir import Graph
from maceq.quant.safe_forms import find_defects, in_memory_model, make_safe
from maceq.runtime.devices import Device, device_spec


@dataclass
class QuantizeResult:
    files: object  # maceq.mace.format.ModelFiles
    graph: Graph
    placement: dict  # IR node name -> "uint8" | "float32"
    n_calib_images: int
    n_skipped: int
    model_name: str
    fp32: frozenset = frozenset()  # nodes kept in float32 by request
    per_device: dict = field(default_factory=dict)  # device -> ModelFiles
    recovery: dict = field(default_factory=dict)  # device -> accuracy-recovery steps applied
    device_forms: dict = field(default_factory=dict)  # device -> {"safe_forms": [...], ...} (see _device_forms)


def _sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def with_biases(g: Graph, biases: dict[str, np.ndarray]) -> Graph:
    """A copy of ``g`` whose listed Conv/Gemm nodes carry the given float biases (beta folded in)."""
    g2 = g.copy()
    for n in g2.nodes:
        if n.name not in biases:
            continue
        b = np.asarray(biases[n.name], dtype=np.float32)
        if n.op_type == "Gemm" and float(n.attr("beta", 1.0)) != 1.0:
            n.attrs["beta"] = 1.0
        name = n.inputs[2] if len(n.inputs) > 2 and n.inputs[2] else n.name + "_bias"
        if name in g2.initializers and sum(name in m.inputs for m in g2.nodes) > 1:
            name = n.name + "_bias_corrected"  # shared bias tensor: give this node its own
        while len(n.inputs) < 3:
            n.inputs.append("")
        n.inputs[2] = name
        g2.initializers[name] = b
    return g2


def with_weights(g: Graph, weights: dict[str, np.ndarray]) -> Graph:
    """A copy of ``g`` whose listed Conv/Gemm/MatMul nodes carry the given float weights, in the node's own
    weight layout (a Gemm's alpha folded in: its alpha becomes 1); a shared weight tensor gets its own copy."""
    g2 = g.copy()
    for n in g2.nodes:
        if n.name not in weights:
            continue
        if n.op_type == "Gemm" and float(n.attr("alpha", 1.0)) != 1.0:
            n.attrs["alpha"] = 1.0
        name = n.inputs[1]
        if sum(name in m.inputs for m in g2.nodes) > 1:
            name = n.name + "_weight_rounded"
            n.inputs[1] = name
        g2.initializers[name] = np.asarray(weights[n.name], dtype=np.float32)
    return g2


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
    #: per device: float weights on the grid values AdaRound chose, by node name (app/adaround.py)
    device_weights: dict = field(default_factory=dict)

    def weights_for(self, device: str, fp32: set[str] | frozenset = frozenset()) -> Graph:
        """The graph with ``device``'s adaptively rounded weights on the layers that stay quantized."""
        weights = {n: w for n, w in (self.device_weights.get(device) or {}).items() if n not in fp32}
        return with_weights(self.graph, weights) if weights else self.graph

    def graph_for(self, device: str, fp32: set[str] | frozenset = frozenset()) -> Graph:
        """The graph the ``device`` model is written from: the adaptively rounded weights and the
        bias-corrected biases applied to the layers that stay quantized (an fp32 layer keeps its float
        weights and bias)."""
        g = self.weights_for(device, fp32)
        biases = {n: b for n, b in (self.device_biases.get(device) or {}).items() if n not in fp32}
        if not biases:
            return g
        return with_biases(g, biases)


def check_degenerate(graph: Graph, ranges: dict, placement: dict) -> None:
    """Refuse, naming the tensor or layer, what MACE's uint8 kernels cannot run (docs/edge-cases.md):
    all-zero constant weights of a uint8 Conv/ConvTranspose/Gemm/MatMul, and a tensor of a uint8 node
    that is 0 on every calibration image. MACE's converter gives both scale 0 and its runtime aborts in
    GetOutputMultiplierAndShift (mace/core/quantize.h)."""
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
                    extra_meta: dict | None = None, strict: bool = False,
                    devices: "tuple[Device | str, ...]" = (Device.CPU,),
                    fp32_nodes: set[str] | None = None, device_meta: dict | None = None) -> QuantizeResult:
    """Write one MACE model per device from a calibration (cheap: no image is run again).

    ``fp32_nodes``: node names kept in float32, in addition to the config's ``fp32_layers``.
    ``device_meta``: per device name, extra keys for that device's ``.yml`` ``maceq:`` record.
    One device writes into ``output_dir``; several write one model each into ``output_dir/<device>/``.
    """
    devs = tuple(Device.parse(d) for d in devices)
    if not devs or len(set(devs)) != len(devs):
        raise MaceqError(f"--device: give each device once, got {','.join(d.value for d in devs) or 'none'}")
    opt, config = cal.graph, cal.config
    name = model_name or cal.onnx_path.stem
    fp32 = select_nodes(opt, config.fp32_layers) | set(fp32_nodes or ())
    placements = {d: check_supported(opt, device=d, strict=strict, shapes=cal.shapes, fp32=fp32) for d in devs}
    for placement in placements.values():
        check_degenerate(opt, cal.ranges, placement)
    source = _source_meta(cal)
    subgraph = _subgraph(cal)
    result = QuantizeResult(None, opt, placements[devs[0]], cal.n_images, cal.n_skipped, name, frozenset(fp32))
    for device in devs:
        built = build_mace_model(cal.graph_for(device.value, fp32), cal.ranges, cal.shapes, model_name=name,
                                 strict=strict, fp32=fp32, device=device)
        check_output_shapes(built, device, cal.graph, cal.shapes)
        check_mace_loads(built)
        forms_meta = result.device_forms[device.value] = _device_forms(built, device, safe=config.safe_forms)
        recovery = list(cal.recovery) + list(cal.device_recovery.get(device.value, []))
        fallback = sorted(n for n, where in placements[device].items() if where != "uint8" and n not in fp32)
        out_dir = _output_dir(output_dir, device, several=len(devs) > 1)
        result.per_device[device.value] = write_model(
            out_dir, name, built.multi_net_def, built.arrays,
            deployment={"platform": "onnx", "runtime": device_spec(device).mace_runtime, "subgraphs": [subgraph]},
            ranges=built.ranges,
            maceq={**source, "float_fallback": fallback, "fp32_layers": sorted(fp32), **(extra_meta or {}),
                   "device": device.value, "tensor_map": built.tensor_map, "recovery": recovery, **forms_meta,
                   **(device_meta or {}).get(device.value, {})})
        result.recovery[device.value] = recovery
    result.files = result.per_device[devs[0].value]
    return result


def _source_meta(cal: Calibration) -> dict:
    """The .yml's record of the source model, the preprocessing and the calibration settings."""
    config = cal.config
    return {
        "source_model": str(cal.onnx_path.resolve()),
        "source_sha256": _sha256(cal.onnx_path),
        "preprocess": cal.preprocess.to_dict(),
        "range_method": config.range_method.value,
        "percentile": config.percentile,
        "layer_overrides": {ov.pattern: {k: (v.value if hasattr(v, "value") else v)
                                         for k, v in (("range_method", ov.range_method),
                                                      ("percentile", ov.percentile)) if v is not None}
                            for ov in config.layers},
        "calibration_images": cal.n_images,
        "input_shape": list(cal.in_shapes[cal.graph.inputs[0].name]),
    }


def _subgraph(cal: Calibration) -> dict:
    """The deployment file's subgraph: input/output tensors, shapes, data formats and the input range."""
    opt = cal.graph
    in_name = opt.inputs[0].name
    want = cal.in_shapes[in_name]
    out_shape = {o: list(cal.shapes[o]) for o in opt.outputs}
    lo, hi = cal.ranges[in_name]
    return {
        "input_tensors": [in_name], "input_shapes": [",".join(map(str, want))],
        "input_data_formats": ["NCHW" if len(want) == 4 else "NONE"],
        "input_ranges": [f"{lo!r},{hi!r}"],
        "output_tensors": list(opt.outputs),
        "output_shapes": [",".join(map(str, out_shape[o])) for o in opt.outputs],
        "output_data_formats": ["NCHW" if len(out_shape[o]) == 4 else "NONE" for o in opt.outputs],
    }


def _output_dir(output_dir, device: Device, *, several: bool) -> Path:
    """``output_dir`` (one device) or ``output_dir/<device>`` (several), created."""
    out_dir = Path(output_dir) / device.value if several else Path(output_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MaceqError(f"{out_dir}: cannot create the output folder ({e.strerror})") from None
    return out_dir


def check_mace_loads(built) -> None:
    """Refuse, naming the op, a built model with an op stock MACE's CPU runtime has no kernel for
    (mace/cpu_ops.py): MACE would refuse to load it."""
    bad = unsupported_ops(built.multi_net_def.net_def[0])
    if bad:
        name, op_type, dtype = bad[0]
        node = built.op_sources.get(name, name)
        raise MaceqError(f"node '{node}': the writer made a {op_type} op with T={dtype}, which stock MACE's CPU "
                         f"runtime has no kernel for; no model was written")


def check_output_shapes(built, device: Device, graph: Graph, shapes: dict) -> None:
    """Refuse, naming the node, a built model whose simulation computes a tensor of another size than
    ONNX shape inference gives the source graph's (a lost padding, a wrong window): such a model must
    never be written. Checked on one probe run (batch 1); a 4-D tensor may be NCHW or NHWC, other
    ranks compare their element counts. A model the device refuses to run is left to the writer."""
    model = in_memory_model(built.multi_net_def, built.arrays, device)
    try:
        ran = model.run(model.probe_inputs(), device=device, intermediates=True)
    except UndefinedOnDevice as e:
        raise MaceqError(f"the {device.value} device cannot run this model: {e}; no model was written") from None
    except MaceqError:
        return
    producer = {o: n for n in graph.nodes for o in n.outputs}
    for name, t in ran.tensors.items():
        ir = built.tensor_map.get(name, name)
        if ir not in producer or ir not in shapes:
            continue
        want, got = (1,) + tuple(shapes[ir][1:]), tuple(t.values.shape)
        same = int(np.prod(got)) == int(np.prod(want)) and (
            len(got) != 4 or len(want) != 4 or got in (want, (want[0], want[2], want[3], want[1])))
        if not same:
            node = producer[ir]
            origin = (node.attrs.get("maceq_names") or [node.name])[0]
            raise MaceqError(f"node '{origin}' ({node.op_type}): the written {device.value} model would compute "
                             f"'{ir}' with shape {got}, ONNX shape inference gives {want}; no model was written")


def _device_forms(built, device: Device, *, safe: bool) -> dict:
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
    forms, cost, kept = make_safe(built, device, defects)
    out = {}
    if forms:
        out = {"safe_forms": [{"op": f.op, "reason": f.reason, "pad_op": f.pad_op} for f in forms],
               "safe_form_cost": cost.describe()}
    if kept:
        out["deviations"] = kept  # no safe form covers these: the device computes them differently
    return out

