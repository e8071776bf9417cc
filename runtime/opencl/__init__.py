"""OpenCL C kernels of the ``gpu`` device (``*.cl`` in this folder) and the pyopencl backend that runs them.

The numpy simulation of the same kernels is :mod:`maceq.runtime.kernels.gpu`; the spec is
docs/semantics.md. pyopencl is imported only when a backend is first used.
"""
from maceq.runtime.opencl.backend import OpenCLBackend, kernel_source

__all__ = ["OpenCLBackend", "kernel_source"]
