"""glibc's heap thresholds for the simulation's runs (runtime/heap.py).

Each check runs in a fresh interpreter, since the settings are the process's: three 12 MB arrays
allocated, touched and freed in a loop fault on every round with glibc's own settings and on none
after the first once :func:`maceq.runtime.heap.steady` has run (or a model run has, which calls it).
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's"),
]

_ROUNDS = """
import resource, sys
import numpy as np
{setup}
faults = []
for _ in range(6):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    bufs = [np.ones(12 << 20, np.uint8) for _ in range(3)]
    del bufs
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(*faults)
"""


def _faults(setup: str, **env) -> list[int]:
    out = subprocess.run([sys.executable, "-c", _ROUNDS.format(setup=setup)], capture_output=True, text=True,
                         env={**os.environ, **env}, check=True).stdout
    return [int(v) for v in out.split()]


def test_steady_heap_reuses_freed_buffers():
    faults = _faults("from maceq.runtime import heap\nassert heap.steady() is True")
    assert faults[0] > 1000  # the first round maps the 36 MB
    assert max(faults[1:]) < 50, faults


def test_glibc_defaults_fault_every_round():
    """The pattern the settings are for: with glibc's own thresholds every round maps memory again."""
    faults = _faults("")
    assert min(faults[1:]) > 1000, faults


def test_a_model_section_sets_the_heap_and_opt_out_leaves_it():
    on = _faults("from maceq.runtime import threads\nwith threads.section(1): pass")
    assert max(on[1:]) < 50, on
    off = _faults("from maceq.runtime import heap, threads\nwith threads.section(1): pass\nassert not heap.steady()",
                  MACEQ_NO_MALLOPT="1")
    assert min(off[1:]) > 1000, off
