"""Imported once by the local workers' forkserver (calibrate/forkserver.py), after the simulation: loads numba's CPU
target there (:func:`maceq.runtime.kernels.jit.load_target`), which each worker's first kernel call would otherwise
load for itself (about half a second a worker)."""
from maceq.runtime.kernels import jit

jit.load_target()
