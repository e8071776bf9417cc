"""The local workers' start: a forkserver that imports the simulation once and forks each worker from that clean
process. This module imports nothing but the standard library, so that a command can start the server before it
imports anything heavy itself (app/launch.py).

Why a forkserver: ``fork`` from the caller would copy onnxruntime's and numba's thread pools, which do not survive
it; ``spawn`` makes every worker import numpy, onnxruntime and the simulation itself, all at once (0.9 s a worker
here, more on a 16-core machine where 8 of them imported together: ``maceq eval`` on 8 workers went from 10.5 to
7.3 s with the forkserver). Where the platform has no forkserver, ``spawn``.
"""
from __future__ import annotations

import multiprocessing

#: What the server imports once, so that each worker forked from it starts with them loaded: the main module too (as
#: ``spawn`` imports it in each worker: tasks may be defined there; the console scripts' is app/launch.py, which is
#: light), and last numba's CPU target (calibrate/worker_preload.py).
PRELOAD = ("__main__", "numpy", "onnxruntime", "maceq.runtime.model", "maceq.calibrate.runner",
           "maceq.calibrate.worker_preload")


def context():
    """The multiprocessing context local workers start from: ``forkserver`` with :data:`PRELOAD`, else ``spawn``."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        return ctx
    return multiprocessing.get_context("spawn")


def start() -> None:
    """Start the server now, without waiting for it (it imports :data:`PRELOAD` while the caller goes on; the first
    worker's request waits for that). The pools made later in this process use this server."""
    if context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()
