"""Arrays derived from a model's constant arrays, computed once per live array.

Every run of a model converts its constant filters the same way (a layout, an offset filter in
float32, the byte sums of each filter). :func:`derived` keeps each such result beside a weak
reference to its source array and drops it when the source is freed, so a model's conversions live
as long as the model. Results are read-only copies that never refer to the source.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable

import numpy as np

from maceq.errors import MaceqError

__all__ = ["derived", "view_ident", "ShapedCall"]

_CACHE: dict = {}  # id(array) -> (weak reference to it, {key: read-only array derived from it})


def view_ident(a: np.ndarray) -> tuple[np.ndarray, tuple]:
    """(the array owning ``a``'s memory, what tells ``a`` apart among the views of it: shape, strides, offset in it,
    type). A reshape made on every run of a model's constant has the same of both."""
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    offset = a.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    return root, (a.shape, a.strides, offset, a.dtype.str)


class ShapedCall:
    """A kernel prepared for one input shape, everything but the input converted once: ``call(x)`` runs it on a
    uint8 ``x`` of that shape (the gpu's convolutions, nnlib's nodes: a model's op keeps one per input shape)."""

    def __init__(self, shape: tuple, run, what: str):
        self.shape, self._run, self.what = tuple(shape), run, what

    def __call__(self, x):
        x = np.asarray(x)
        if x.shape != self.shape or x.dtype != np.uint8:
            raise MaceqError(f"{self.what}: made for uint8 input {self.shape}, got {x.dtype} {x.shape}")
        return self._run(x)


def derived(src: np.ndarray, key: Hashable, make: Callable[[np.ndarray], object]):
    """``make(src)`` computed once per live array ``src`` and ``key``, kept until ``src`` is freed; an array result is
    made read-only (any other object is kept as it is, and must not be None).

    A view counts as its base array seen through the view's shape, strides, offset and type (a kernel that
    reshapes a model's constant on every run still finds its conversion). ``make`` must return a new array (not
    a view of ``src``: that would keep ``src`` alive for ever)."""
    root, view = view_ident(src)
    if root is not src:
        key = (key,) + view
    i = id(root)
    entry = _CACHE.get(i)
    if entry is None or entry[0]() is not root:
        # the default arguments keep the callback working while the interpreter shuts down
        entry = _CACHE[i] = (weakref.ref(root, lambda _ref, i=i, pop=_CACHE.pop: pop(i, None)), {})
    hit = entry[1].get(key)
    if hit is None:
        hit = make(src)
        if isinstance(hit, np.ndarray):
            if np.shares_memory(hit, root):
                raise ValueError("derived: make() returned a view of its source")
            hit.flags.writeable = False
        entry[1][key] = hit
    return hit
