"""Reading the user's YAML files (``yaml.safe_load`` only) and writing files atomically; every failure
a one-line MaceqError.

PyYAML's pure-Python ``safe_load`` is used on purpose: the C loader (CSafeLoader) crashes the
process on very deep nesting (docs/fuzzing.md), while the Python composer raises RecursionError,
which is turned into an error here.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from maceq.errors import MaceqError, one_line

__all__ = ["read_text", "read_yaml", "parse_yaml", "one_line", "atomic_write"]



def parse_yaml(text: str, *, source: str) -> Any:
    """The document in ``text``; MaceqError naming ``source`` (and the line) when it is not YAML."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1})" if mark is not None else ""
        raise MaceqError(f"{source}: not valid YAML{at}") from None
    except RecursionError:  # PyYAML's composer recurses once per nesting level
        raise MaceqError(f"{source}: YAML nested too deeply") from None


def read_text(path: str | os.PathLike, *, what: str = "file") -> str:
    """A UTF-8 text file's contents; MaceqError names the file when it is missing, unreadable or not UTF-8."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MaceqError(f"{path}: cannot read the {what} (no such {what})") from None
    except UnicodeDecodeError:
        raise MaceqError(f"{path}: the {what} is not UTF-8 text") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise MaceqError(f"{path}: cannot read the {what} ({getattr(e, 'strerror', None) or e})") from None


def read_yaml(path: str | os.PathLike, *, what: str = "file") -> Any:
    """Read and parse a UTF-8 YAML file (:func:`read_text`, :func:`parse_yaml`)."""
    return parse_yaml(read_text(path, what=what), source=str(path))


def atomic_write(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path`` (flushed to disk), then rename it into place.

    A reader sees the old file or the whole new one, never part of it; the folder is created when
    missing; the file gets the usual permissions (``0o666`` less the umask). OSError becomes a
    MaceqError naming the file.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise MaceqError(f"{path}: cannot write: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes 0600
        os.replace(tmp, path)
    except OSError as e:
        raise MaceqError(f"{path}: cannot write: {e.strerror or e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
