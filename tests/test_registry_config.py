"""Kernel registry, device profiles and the YAML config loader."""
import numpy as np
import pytest

from maceq.calibrate.methods import RangeMethod
from maceq.errors import MaceqError
from maceq.quant.config import config_from_dict, load_config
from maceq.runtime import model as _model  # noqa: F401  (registers every kernel table)
from maceq.runtime import ops
from maceq.runtime.kernels.dsp import SupernodeVariant
from maceq.quant.scheme import scheme_for
from maceq.runtime.devices import CPU, SPECS, Device, Requant, device_spec
from maceq.runtime.registry import _REGISTRY, DType, kernel_table, lookup, register


def test_duplicate_registration_raises():
    with pytest.raises(ValueError, match="registered twice"):
        @register("Conv2D")
        class Again:  # noqa: F841
            pass


def test_device_table_is_default_plus_overrides():
    @register("Softmax", device=Device.DSP)
    class DspSoftmax:
        pass

    u8 = DType.UINT8
    try:
        assert kernel_table(Device.DSP)[("Softmax", u8)] is DspSoftmax
        assert kernel_table(Device.CPU)[("Softmax", u8)] is ops.Softmax
        assert kernel_table(Device.DSP)[("Conv2D", u8)] is not ops.Conv2D  # the dsp's own override
        assert kernel_table(Device.DSP)[("Pooling", u8)] is not ops.Pooling
        assert kernel_table(Device.DSP)[("Squeeze", u8)] is kernel_table(Device.CPU)[("Squeeze", u8)]  # inherited
    finally:
        del _REGISTRY[("Softmax", u8, Device.DSP)]
    with pytest.raises(MaceqError, match="op 'x'.*'Nope'"):
        lookup("Nope", Device.CPU, op_name="x")


def test_cpu_profile_rules_are_data():
    p = device_spec("cpu")
    assert p is CPU and p.fc_requant is Requant.FLOAT32_ROUNDF and p.conv_requant is Requant.GEMMLOWP
    with pytest.raises(MaceqError, match="unknown device 'npu'"):
        device_spec("npu")
    assert device_spec("gpu").conv_requant is Requant.FLOAT32_RTE and device_spec("dsp").supernode_variant is SupernodeVariant.D32


def test_config_overrides_most_specific_glob_wins(tmp_path):
    f = tmp_path / "c.yml"
    f.write_text("range_method: percentile\npercentile: 99.9\nlayers:\n"
                 "  '*': {range_method: min_max}\n"
                 "  '/features/1/*': {percentile: 99.0, range_method: percentile}\n")
    c = load_config(f)
    assert c.method_for("logits") == (RangeMethod.MIN_MAX, 99.9)
    assert c.method_for("/features/1/conv/Conv_output_0") == (RangeMethod.PERCENTILE, 99.0)
    assert config_from_dict(None).method_for("x") == (RangeMethod.PERCENTILE, 99.99)


@pytest.mark.parametrize("doc,msg", [
    ({"rangemethod": "min_max"}, "unknown key 'rangemethod'"),
    ({"range_method": "mse2"}, "unknown range_method 'mse2'"),
    ({"percentile": 20}, "percentile must be in"),
    ({"batch_size": 0}, "batch_size: must be a positive integer"),
    ({"layers": {"a*": {"clip": 1}}}, r"layers\['a\*'\]: unknown key 'clip'"),
    ([1, 2], "top level must be a mapping"),
])
def test_config_errors_name_the_key(doc, msg):
    with pytest.raises(MaceqError, match=msg):
        config_from_dict(doc, source="c.yml")


def test_config_file_errors(tmp_path):
    with pytest.raises(MaceqError, match="no such config file"):
        load_config(tmp_path / "missing.yml")
    bad = tmp_path / "bad.yml"
    bad.write_text("a: [1,\n")
    with pytest.raises(MaceqError, match="bad.yml: not valid YAML"):
        load_config(bad)


def test_every_device_has_one_spec_with_its_scheme_runtime_name_and_fallback():
    assert set(SPECS) == set(Device) and all(SPECS[d].device is d for d in Device)
    assert {d.value: SPECS[d].mace_runtime for d in Device} == {"cpu": "cpu", "gpu": "gpu", "dsp": "dsp"}
    assert [type(scheme_for(d)).__name__ for d in Device] == ["CpuScheme", "GpuScheme", "DspScheme"]
    assert SPECS[Device.DSP].fallback is Device.CPU and SPECS[Device.CPU].fallback is None
    assert SPECS[Device.CPU].uint8_resize and not SPECS[Device.GPU].uint8_resize
    # the gpu scheme: symmetric int8 per channel; cpu: uint8 per tensor in [1, 255]
    w = np.array([[[[0.5, -1.0]]], [[[0.25, 0.0]]]], np.float32)
    g = scheme_for("gpu").weights(w)
    assert g.codes.dtype == np.int8 and g.codes[:, 0, 0, 0].tolist() == [64, 127] and g.channel_scales.shape == (2,)
    c = scheme_for(Device.CPU).weights(w)
    assert c.codes.dtype == np.uint8 and c.codes.min() >= 1 and c.params.zero_point > 0
