"""The MACE writer path against MACE's own converter output (../shared/data/mace_reference)."""
import numpy as np

from maceq.quant.build import build_mace_model
from maceq.mace.format import pack_tensors, read_ranges
from maceq.quant.prepare import prepare_graph
from maceq.quant.scheme import adjust_range, quantize_weights


def test_same_ranges_give_macesconverter_bytes(shared_data):
    """Fed the ranges MACE's converter used, maceq writes the same .pb and .data, byte for byte."""
    ref = shared_data / "mace_reference"
    opt, _, shapes = prepare_graph(shared_data / "models" / "fmnist_mobilenet.onnx", input_shape=None)
    built = build_mace_model(opt, read_ranges(ref / "fmnist_ranges.txt"), shapes, model_name="fmnist_q8")
    data = pack_tensors(built.multi_net_def.net_def[0], built.arrays)
    assert data == (ref / "fmnist_q8.data").read_bytes()
    assert built.multi_net_def.SerializeToString(deterministic=True) == (ref / "fmnist_q8.pb").read_bytes()


def test_adjust_range_examples():
    # ReLU6 output: [0, 6] -> scale 6/255, zero point 0 (reference quantize_info 0.0235294122 / 0).
    p = adjust_range(0.0, 6.0, non_zero=False)
    assert (np.float32(p.scale), p.zero_point) == (np.float32(0.0235294122), 0)
    # All-negative range: zero point 255.
    assert adjust_range(-2.0, -1.0, non_zero=False).zero_point == 255
    # Weights: no code 0 after the non-zero adjustment.
    w = np.linspace(-1.3, 0.7, 101)
    q, p = quantize_weights(w)
    assert q.min() >= 1 and q.max() == 255
    # The zero point is rounded up (ceil), which shifts the grid by under one step: error < one step.
    assert np.abs(p.scale * (q.astype(int) - p.zero_point) - w).max() < p.scale
