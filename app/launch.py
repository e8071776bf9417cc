"""The console scripts' entry points (``quantize``, ``maceq``).

A command that will run local worker processes (``--workers N``, N > 1, on the local executor) starts their
forkserver first (calibrate/forkserver.py): the server then imports the simulation while this process imports the
command-line tool (about 2 s: onnx, the quantizer, the reports), where it used to start only when the first pool
did. This module imports nothing heavy itself; the rest is app/cli.py's.
"""
from __future__ import annotations

import sys
from typing import Sequence

from maceq.calibrate import forkserver


def starts_local_workers(argv: Sequence[str]) -> bool:
    """Whether ``argv`` asks for more than one worker on the local executor, read from its words alone (the command
    line is checked in full later: a wrong guess costs an idle server process, nothing else)."""
    workers, executor = 1, "local"
    for i, word in enumerate(argv):
        key, eq, value = word.partition("=")
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if key == "--workers":
            workers = int(value) if value.isdigit() else 1
        elif key == "--executor":
            executor = value
    return workers > 1 and executor == "local"


def _launch(name: str, argv: Sequence[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if starts_local_workers(argv):
        forkserver.start()
    from maceq.app import cli

    return getattr(cli, name)(argv)


def quantize_main(argv: Sequence[str] | None = None) -> int:
    return _launch("quantize_main", argv)


def maceq_main(argv: Sequence[str] | None = None) -> int:
    return _launch("maceq_main", argv)
