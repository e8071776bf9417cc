"""Streaming image folders: find files, decode with PIL, preprocess, batch.

Only one batch of decoded images is alive at a time (plus the one image being
decoded): :meth:`ImageFolder.iter_batches` decodes lazily and yields a fresh
array per batch.

File discovery (:func:`iter_image_files`): every regular file below ``root``
whose extension, compared case-insensitively, is one of :data:`IMAGE_EXTS`;
hidden files and folders (name starting with ``.``) are left out. The order is
the sort order of the relative path's components, so it never depends on the
file system. A root that is a file is the whole dataset (any extension).

Huge JPEGs: a JPEG of more than :data:`DRAFT_MIN_PIXELS` pixels is decoded
with PIL's ``draft`` (libjpeg DCT scaling by 1/2, 1/4 or 1/8) to no less than
4x the size the resize step asks for, which bounds memory. Smaller images, all
of ../shared/data among them, are decoded in full, so their values are exactly
those of a full decode followed by the :class:`Preprocess` steps. Other formats
(PNG, ...) are always decoded in full, one image at a time.

Decompression bombs: an image whose header declares more than
:data:`MAX_IMAGE_PIXELS` pixels is refused before it is decoded, with a
MaceqError naming the file (also in :meth:`ImageFolder.iter_batches`, where it
stops the pass instead of being skipped like an unreadable file).
"""
from __future__ import annotations

import copy
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
from PIL import Image

from maceq.datasets.labels import resolve_labels
from maceq.datasets.preprocess import Preprocess
from maceq.errors import MaceqError

__all__ = [
    "IMAGE_EXTS",
    "DRAFT_MIN_PIXELS",
    "MAX_IMAGE_PIXELS",
    "Batch",
    "ImageFolder",
    "UnreadableImageWarning",
    "iter_image_files",
    "load_image",
]

IMAGE_EXTS: frozenset[str] = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp"})
DRAFT_MIN_PIXELS = 4096 * 4096
#: The most pixels (width x height) an image may declare: PIL's own decompression-bomb warning
#: threshold (``PIL.Image.MAX_IMAGE_PIXELS`` by default, about 9459 x 9459; a full RGB decode of
#: that is 256 MiB). Larger images raise MaceqError. Set it (module attribute) to allow more.
MAX_IMAGE_PIXELS = 89_478_485


class UnreadableImageWarning(UserWarning):
    """An image file could not be decoded and was skipped."""


@dataclass(frozen=True)
class Batch:
    """``data``: float32 [B, ...]; ``paths``: the B source files; ``labels``: int64 [B] or None."""

    data: np.ndarray
    paths: list[str]
    labels: np.ndarray | None = None


def iter_image_files(root: str | os.PathLike) -> list[Path]:
    """The image files under ``root`` (or ``[root]`` for a file), in sorted order."""
    root = Path(root)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise MaceqError(f"{root}: no such file or folder")
    found: list[tuple[tuple[str, ...], Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        rel = Path(dirpath).relative_to(root).parts
        for name in filenames:
            if name.startswith(".") or os.path.splitext(name)[1].lower() not in IMAGE_EXTS:
                continue
            path = Path(dirpath, name)
            if path.is_file():
                found.append((rel + (name,), path))
    found.sort(key=lambda t: t[0])
    return [p for _, p in found]


def _draft_size(img: Image.Image, pre: Preprocess) -> tuple[int, int] | None:
    w, h = img.size
    if img.format != "JPEG" or w * h <= DRAFT_MIN_PIXELS:
        return None
    if pre.resize_short is not None:
        k = 4.0 * pre.resize_short / min(w, h)
    elif pre.resize is not None:
        k = 4.0 * max(pre.resize[0] / h, pre.resize[1] / w)
    else:
        return None
    if k >= 0.5:
        return None
    return (math.ceil(w * k), math.ceil(h * k))


def _open(path: Path) -> Image.Image:
    """``Image.open`` (header only) with the decompression-bomb guard of :data:`MAX_IMAGE_PIXELS`."""
    limit = MAX_IMAGE_PIXELS
    with warnings.catch_warnings():
        # PIL warns above its own limit and raises above twice it; maceq's limit decides instead.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            img = Image.open(path)
        except Image.DecompressionBombError as e:
            raise MaceqError(f"{path}: refused, more pixels than the limit of {limit:,} "
                             f"(decompression-bomb guard; PIL: {str(e).splitlines()[0]})") from None
    w, h = img.size
    if w * h > limit:
        img.close()
        raise MaceqError(f"{path}: refused, {w}x{h} = {w * h:,} pixels is over the limit of {limit:,} "
                         "(decompression-bomb guard: maceq.datasets.images.MAX_IMAGE_PIXELS)")
    return img


def _decode(path: Path, pre: Preprocess) -> np.ndarray:
    """Decode and preprocess one file; PIL/OS errors propagate (MaceqError for a decompression bomb)."""
    with _open(path) as img:
        size = _draft_size(img, pre)
        if size is not None:
            # mode None: keep the JPEG's colour space, PIL converts it later
            # exactly as for a full decode.
            img.draft(None, size)
        img.load()
        return pre.apply(img)


def load_image(path: str | os.PathLike, preprocess: Preprocess) -> np.ndarray:
    """One image as a model input with a batch axis of 1: [1, C, H, W] or [1, H, W, C]."""
    path = Path(path)
    if not path.is_file():
        raise MaceqError(f"{path}: no such image file")
    try:
        x = _decode(path, preprocess)
    except MaceqError:
        raise
    except Exception as e:  # noqa: BLE001 - any decoder failure is a bad file
        raise MaceqError(f"{path}: cannot decode image ({e.__class__.__name__}: {e})") from None
    return x[None]


class ImageFolder:
    """A folder (searched recursively) or single image file, streamed as preprocessed batches.

    ``labels``: ``"auto"`` (class subfolders when present, see
    :func:`maceq.datasets.labels.resolve_labels`), ``"folders"``, a CSV path,
    or None. ``classes``: an explicit class list for folder or name labels.
    ``limit``: keep only the first ``limit`` files of the sorted list.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        preprocess: Preprocess,
        *,
        labels: str | os.PathLike | None = "auto",
        classes: Sequence[str] | None = None,
        limit: int | None = None,
    ) -> None:
        if not isinstance(preprocess, Preprocess):
            raise TypeError("preprocess must be a maceq.datasets.preprocess.Preprocess")
        self.root = Path(root)
        self.preprocess = preprocess
        files = iter_image_files(self.root)
        if not files:
            exts = ", ".join(sorted(e[1:] for e in IMAGE_EXTS))
            raise MaceqError(f"{self.root}: no image files ({exts})")
        if limit is not None:
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise MaceqError(f"{self.root}: limit must be a positive int, got {limit!r}")
            files = files[:limit]
        self.files: list[Path] = files
        lab = resolve_labels(self.root, files, labels, classes=classes)
        self.labels: np.ndarray | None = None if lab is None else lab.values
        self.classes: tuple[str, ...] | None = None if lab is None else lab.classes
        self.skipped = 0
        self.skipped_paths: list[str] = []

    def __len__(self) -> int:
        """Number of candidate files (before any is found unreadable)."""
        return len(self.files)

    def shard(self, start: int, stop: int) -> "ImageFolder":
        """The files ``[start, stop)`` with their labels, as a folder of their own (for a worker)."""
        part = copy.copy(self)
        part.files = self.files[start:stop]
        part.labels = None if self.labels is None else self.labels[start:stop]
        part.skipped, part.skipped_paths = 0, []
        return part

    def iter_batches(self, batch_size: int) -> Iterator[Batch]:
        """Yield batches of up to ``batch_size`` readable images, in file order.

        Unreadable files are skipped with an :class:`UnreadableImageWarning`
        naming them and counted in ``.skipped`` (reset at each pass). When no
        file of the pass is readable, MaceqError names the folder.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise MaceqError(f"batch size must be a positive int, got {batch_size!r}")
        self.skipped = 0
        self.skipped_paths = []
        buf: np.ndarray | None = None
        paths: list[str] = []
        idx: list[int] = []
        yielded = 0
        for i, path in enumerate(self.files):
            try:
                x = _decode(path, self.preprocess)
            except MaceqError:
                raise
            except Exception as e:  # noqa: BLE001 - any decoder failure is a bad file
                self.skipped += 1
                self.skipped_paths.append(str(path))
                warnings.warn(
                    f"{path}: skipped, cannot decode image ({e.__class__.__name__}: {e})",
                    UnreadableImageWarning,
                    stacklevel=2,
                )
                continue
            if buf is None:
                buf = np.empty((batch_size,) + x.shape, dtype=np.float32)
            elif x.shape != buf.shape[1:]:
                raise MaceqError(
                    f"{path}: preprocessed shape {x.shape} differs from {buf.shape[1:]} of "
                    f"{paths[0]} in the same batch; set center_crop or resize"
                )
            buf[len(paths)] = x
            paths.append(str(path))
            idx.append(i)
            if len(paths) == batch_size:
                yield self._batch(buf, paths, idx)
                yielded += len(paths)
                buf, paths, idx = None, [], []
        if paths:
            assert buf is not None
            yield self._batch(buf[: len(paths)], paths, idx)
            yielded += len(paths)
        if yielded == 0:
            raise MaceqError(
                f"{self.root}: no readable image ({self.skipped} file(s) could not be decoded)"
            )

    def _batch(self, data: np.ndarray, paths: list[str], idx: list[int]) -> Batch:
        labels = None if self.labels is None else self.labels[np.asarray(idx, dtype=np.int64)]
        return Batch(data, paths, labels)
