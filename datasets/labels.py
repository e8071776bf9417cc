"""Ground-truth labels for an image folder: from class subfolders or from a CSV.

Folder labels (torchvision ImageFolder convention): each image's class is the
name of the first-level subfolder of the root that holds it (at any depth
below). Without an explicit class list the classes are the sorted names of the
root's non-hidden subfolders and the label is the index in that list. With an
explicit list, the index is the position in that list, and a subfolder that
holds images but is not in the list is an error.

CSV labels: rows ``file,label``. ``file`` is a path relative to the image root
(the folder given to :class:`~maceq.datasets.images.ImageFolder`, or the
folder holding it when the root is a single file), or absolute. ``label`` is a
non-negative int, or a class name. Blank rows and rows whose first cell starts
with ``#`` are skipped. The first remaining row is a header, and is skipped,
iff its label cell is not an int and its file cell names no existing file.
Names map through the explicit class list when one is given, else through the
sorted set of names in the file. Every image of the dataset needs a row; rows
for files that exist but are not part of the dataset (e.g. cut by ``limit``)
are ignored. Errors name the CSV file and line.
"""
from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from maceq.errors import MaceqError

__all__ = [
    "FASHION_MNIST_CLASSES",
    "Labels",
    "folder_classes",
    "labels_from_folders",
    "labels_from_csv",
    "resolve_labels",
]

#: The Fashion-MNIST class folders of ../shared/data/fashion_mnist in the
#: model's output order (T-shirt/top, Trouser, ..., Ankle boot); the sorted
#: folder order differs from it.
FASHION_MNIST_CLASSES: tuple[str, ...] = (
    "T-shirt_top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle_boot",
)


@dataclass(frozen=True)
class Labels:
    """One int64 label per dataset file (same order), and the class names if known."""

    values: np.ndarray
    classes: tuple[str, ...] | None = None


def _key(path: str | os.PathLike) -> str:
    return os.path.normcase(os.path.normpath(os.path.abspath(os.fspath(path))))


def folder_classes(root: str | os.PathLike) -> list[str]:
    """Sorted names of the non-hidden subfolders of ``root``."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))


def _top_folder(root: Path, file: Path) -> str | None:
    rel = os.path.relpath(file, root)
    parts = Path(rel).parts
    if len(parts) < 2 or parts[0] == os.pardir:
        return None
    return parts[0]


def labels_from_folders(
    root: str | os.PathLike,
    files: Sequence[str | os.PathLike],
    *,
    classes: Sequence[str] | None = None,
) -> Labels:
    """Labels from the first-level subfolder of each file (see module docstring)."""
    root = Path(root)
    names = tuple(classes) if classes is not None else tuple(folder_classes(root))
    if not names:
        raise MaceqError(f"{root}: no class subfolders to take labels from")
    if len(set(names)) != len(names):
        raise MaceqError(f"{root}: the class list repeats a name")
    index = {n: i for i, n in enumerate(names)}
    out = np.empty(len(files), dtype=np.int64)
    for i, f in enumerate(files):
        top = _top_folder(root, Path(f))
        if top is None:
            raise MaceqError(f"{f}: not inside a class subfolder of {root}")
        if top not in index:
            raise MaceqError(f"{root / top}: folder is not in the class list")
        out[i] = index[top]
    return Labels(out, names)


def _parse_int(cell: str) -> int | None:
    try:
        return int(cell.strip())
    except ValueError:
        return None


def labels_from_csv(
    csv_path: str | os.PathLike,
    root: str | os.PathLike,
    files: Sequence[str | os.PathLike],
    *,
    classes: Sequence[str] | None = None,
) -> Labels:
    """Labels for ``files`` from a ``file,label`` CSV (see module docstring)."""
    csv_path = Path(csv_path)
    root = Path(root)
    base = root if root.is_dir() else root.parent
    try:
        text = csv_path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise MaceqError(f"{csv_path}: cannot read label CSV ({e.__class__.__name__}: {e})") from None
    rows: list[tuple[int, str, str]] = []
    reader = csv.reader(text.splitlines())
    for row in reader:
        line = reader.line_num
        if not row or all(not c.strip() for c in row) or row[0].lstrip().startswith("#"):
            continue
        if len(row) != 2:
            raise MaceqError(f"{csv_path}:{line}: expected 2 fields (file,label), got {len(row)}")
        rows.append((line, row[0].strip(), row[1].strip()))
    if rows:
        line, fcell, lcell = rows[0]
        if _parse_int(lcell) is None and not (base / fcell).is_file():
            rows = rows[1:]  # header
    if not rows:
        raise MaceqError(f"{csv_path}: no label rows")

    names = tuple(classes) if classes is not None else None
    by_int = [r for r in rows if _parse_int(r[2]) is not None]
    if by_int and len(by_int) != len(rows):
        first_name = next(r for r in rows if _parse_int(r[2]) is None)
        raise MaceqError(
            f"{csv_path}:{first_name[0]}: label {first_name[2]!r} is a name but line "
            f"{by_int[0][0]} has an int; use one kind"
        )
    if not by_int and names is None:
        names = tuple(sorted({r[2] for r in rows}))
    index = {n: i for i, n in enumerate(names)} if names is not None else {}

    table: dict[str, tuple[int, int]] = {}
    for line, fcell, lcell in rows:
        if not fcell:
            raise MaceqError(f"{csv_path}:{line}: empty file name")
        path = Path(fcell)
        if not path.is_absolute():
            path = base / path
        if not path.is_file():
            raise MaceqError(f"{csv_path}:{line}: file {fcell!r} not found under {base}")
        value = _parse_int(lcell)
        if value is None:
            if lcell not in index:
                raise MaceqError(f"{csv_path}:{line}: label {lcell!r} is not in the class list")
            value = index[lcell]
        elif value < 0:
            raise MaceqError(f"{csv_path}:{line}: negative label {value}")
        elif names is not None and value >= len(names):
            raise MaceqError(f"{csv_path}:{line}: label {value} >= number of classes {len(names)}")
        k = _key(path)
        if k in table:
            raise MaceqError(f"{csv_path}:{line}: file {fcell!r} already labelled at line {table[k][1]}")
        table[k] = (value, line)

    out = np.empty(len(files), dtype=np.int64)
    missing = [f for f in files if _key(f) not in table]
    if missing:
        raise MaceqError(f"{csv_path}: no label for {missing[0]} ({len(missing)} image(s) unlabelled)")
    for i, f in enumerate(files):
        out[i] = table[_key(f)][0]
    return Labels(out, names)


def resolve_labels(
    root: str | os.PathLike,
    files: Sequence[str | os.PathLike],
    spec: str | os.PathLike | None,
    *,
    classes: Sequence[str] | None = None,
) -> Labels | None:
    """Labels as ImageFolder's ``labels=`` argument asks for them.

    ``None``: no labels. ``"auto"``: folder labels when the root is a folder
    with class subfolders and every file lies inside one, else None.
    ``"folders"``: folder labels, an error otherwise. Anything else: a CSV path.
    """
    if spec is None:
        return None
    root = Path(root)
    if spec == "auto":
        if not root.is_dir() or not folder_classes(root):
            return None
        if any(_top_folder(root, Path(f)) is None for f in files):
            return None
        return labels_from_folders(root, files, classes=classes)
    if spec == "folders":
        return labels_from_folders(root, files, classes=classes)
    return labels_from_csv(spec, root, files, classes=classes)
