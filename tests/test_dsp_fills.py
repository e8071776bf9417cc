"""The dsp kernels' vectorised bias words and weight sums equal nnlib_ref's scalar transcriptions
(fill_bias_buf, superfc_fill_bias_buf, the gemsumb variants), on random and adversarial inputs."""
from __future__ import annotations

import numpy as np
import pytest

from maceq.errors import MaceqError
from maceq.runtime.kernels import dsp
from maceq.runtime.kernels import nnlib_ref as r

pytestmark = pytest.mark.oracle


def _scalings(rng, n: int):
    for _ in range(n):
        prod = float(np.float32(10.0 ** rng.uniform(-7, -2)))
        yield r.D32Scaling(int(rng.integers(0, 256)), prod, float(np.float32(prod * 3)), 1 << 30, 3)


@pytest.mark.parametrize("seed", range(4))
def test_fill_bias_buf_equals_the_scalar_reference(seed):
    rng = np.random.default_rng(seed)
    for sc in _scalings(rng, 6):
        o = int(rng.integers(1, 70))
        bias = rng.integers(-(2 ** 31), 2 ** 31, size=o)
        gemsumb = list(rng.integers(-(2 ** 20), 2 ** 20, size=(o + 31) & ~31))
        bmin = -float(rng.uniform(0.01, 50.0))
        bmax = -bmin
        out_min = -float(rng.uniform(0.0, 8.0))
        try:
            want = r.fill_bias_buf(bias, bmin, bmax, sc, out_min, gemsumb)
        except MaceqError as e:
            with pytest.raises(MaceqError, match="bias word out of int32 range"):
                dsp.fill_bias_buf(bias, bmin, bmax, sc, out_min, gemsumb)
            assert "bias word out of int32 range" in str(e)
            continue
        np.testing.assert_array_equal(dsp.fill_bias_buf(bias, bmin, bmax, sc, out_min, gemsumb), want)
        want_fc = r.superfc_fill_bias_buf(bias, bmin, bmax, sc, out_min, gemsumb)
        np.testing.assert_array_equal(dsp.superfc_fill_bias_buf(bias, bmin, bmax, sc, out_min, gemsumb), want_fc)


def test_fill_bias_buf_at_the_rounding_ties():
    """minout - gemsumb*in_offset landing on .5 in binary32: nearest-even in both."""
    sc = r.D32Scaling(3, 1.0, 1.0, 1 << 30, 3)
    bias = np.zeros(32, dtype=np.int64)
    gemsumb = list(range(32))
    for out_min in (-0.5, -1.5, -2.5, -1000000.5, -8388607.5):
        want = r.fill_bias_buf(bias, -1.0, 1.0, sc, out_min, gemsumb)
        np.testing.assert_array_equal(dsp.fill_bias_buf(bias, -1.0, 1.0, sc, out_min, gemsumb), want)
    with pytest.raises(MaceqError, match="bias word out of int32 range"):
        dsp.fill_bias_buf(bias, -1.0, 1.0, sc, -3e9, gemsumb)


@pytest.mark.parametrize("shape", [(3, 3, 3, 5), (1, 1, 40, 33), (3, 3, 64, 32), (5, 5, 7, 1)])
def test_weight_sums_equal_the_scalar_reference(shape):
    rng = np.random.default_rng(sum(shape))
    w = rng.integers(0, 256, size=shape, dtype=np.uint8)
    for fo in (0, 1, 128, 255):
        np.testing.assert_array_equal(dsp.padded_gemsumb(w, fo, (shape[2] + 31) & ~31), r.supernode_d32_gemsumb(w, fo))
        np.testing.assert_array_equal(dsp.padded_gemsumb(w, fo, (shape[2] + 3) & ~3), r.shortin_gemsumb(w, fo))
        dw = w[:, :, :, :1]
        np.testing.assert_array_equal(dsp.dwise_gemsumb(dw, fo), r.dwise_gemsumb(dw, fo))
        fc = w.reshape(-1, shape[3])
        np.testing.assert_array_equal(dsp.superfc_gemsumb(fc, fo), r.superfc_gemsumb(fc, fo))
