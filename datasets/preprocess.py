"""Image preprocessing: geometry, colour order, layout and the value arithmetic.

A :class:`Preprocess` is frozen data; :meth:`Preprocess.apply` turns a decoded
PIL image into the float32 array a model takes (without the batch axis).

The steps, in this order (each one is skipped when its field is ``None``):

1. **Colour mode.** The image is converted to ``L`` (``GRAY``) or ``RGB``
   (``RGB``/``BGR``) with PIL's ``Image.convert``: RGBA/LA drop alpha (no
   compositing), palette images go through their palette, CMYK/YCbCr are
   converted by PIL, RGB->L uses PIL's ITU-R 601-2 luma
   ``L = R*299/1000 + G*587/1000 + B*114/1000``. 16-bit/32-bit integer images
   (modes ``I;16*`` and ``I``) become float mode ``F`` holding ``v / 257`` so
   that 65535 maps to 255.0 and an 8-bit value ``b`` stored as ``b*257`` maps
   back to ``b`` exactly; for RGB/BGR targets the grey plane is repeated.
2. **Geometry** (torchvision ``Resize``/``CenterCrop`` on PIL images).
   ``resize_short=S``: the short side becomes ``S`` and the long side
   ``int(S * long / short)`` (truncation), PIL bilinear; an image whose size
   already matches is left alone. ``resize=(h, w)``: PIL bilinear to exactly
   ``(h, w)``. The two are exclusive. ``center_crop=(h, w)``: when the image is
   smaller it is first zero-padded, left/top ``(ch - h)//2`` and right/bottom
   ``(ch - h + 1)//2``; then ``top = round((H - h) / 2)``,
   ``left = round((W - w) / 2)`` with Python's round (ties to even), exactly
   as torchvision.transforms.functional.center_crop.
3. **Channel order.** ``BGR`` reverses the channel axis, so ``mean``/``std``
   below are given in the model's channel order. ``C = 1`` for ``GRAY``.
4. **Values**, in float32, one IEEE operation at a time (numpy rounds each
   to nearest even), which reproduces torchvision's ToTensor + Normalize:

   * ``x = raw * scale``: when ``scale == 1.0 / n`` for an integer
     ``1 <= n <= 65535`` (Python floats, as ``1/255`` is written) this is
     ``float32(raw) / float32(n)``, the correctly rounded quotient that
     ToTensor's ``div(255)`` gives; otherwise ``float32(raw) * float32(scale)``.
   * if ``mean``/``std``: ``x = (x - float32(mean[c])) / float32(std[c])``;
   * if ``offset != 0``: ``x = x + float32(offset)``.

   ``raw`` is the 0..255 pixel value after geometry (an integer, except for
   16-bit sources, and after bilinear resizing in mode ``F``).
5. **Layout.** ``NCHW`` gives ``(C, H, W)`` and ``NHWC`` ``(H, W, C)``.

Presets (see :data:`PRESETS`):

* ``imagenet``: torchvision ImageNet: resize short 256, crop 224,
  ``(raw/255 - mean) / std``, RGB, NCHW.
* ``tf``: EfficientNet-Lite0's ``(x*255 - 127) / 128`` written as
  ``raw * (1/128) + (-127/128)``; both constants are powers of two over 128, so
  every result ``(raw - 127)/128`` is exact in float32. Resize 256, crop 224.
* ``fmnist``: grey 28x28, ``(raw/255 - 0.2860) / 0.3530``, NCHW.
* ``ppocr_det``: PaddleOCR DB text detector: BGR, ImageNet mean/std on raw/255,
  resized to 640x640 (sides must be multiples of 32; override with ``--resize``).
* ``ppocr_cls``: PaddleOCR text-orientation classifier: BGR, resized to 48x192,
  ``(raw/255 - 0.5) / 0.5``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from enum import Enum
from typing import Any, Mapping

import numpy as np
from PIL import Image

from maceq.errors import MaceqError, one_line

__all__ = [
    "ColorOrder",
    "Layout",
    "Preprocess",
    "PRESETS",
    "preprocess_from_args",
]


class ColorOrder(Enum):
    RGB = "rgb"
    BGR = "bgr"
    GRAY = "gray"


class Layout(Enum):
    NCHW = "nchw"
    NHWC = "nhwc"


def _parse_enum(kind: type[Enum], value: Any, key: str) -> Enum:
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        try:
            return kind(value.lower())
        except ValueError:
            pass
    choices = ", ".join(m.value for m in kind)
    raise MaceqError(f"preprocess key '{key}': {value!r} is not one of {choices}")


def _parse_hw(value: Any, key: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = (int(value), int(value))
    if isinstance(value, str):
        parts = value.lower().replace("x", ",").split(",")
        try:
            value = tuple(int(p) for p in parts if p.strip())
        except ValueError:
            raise MaceqError(f"preprocess key '{key}': {value!r} is not H,W") from None
    try:
        hw = tuple(int(v) for v in value)
        if len(hw) == 1:
            hw = (hw[0], hw[0])
            value = (value[0], value[0])
        exact = all(float(v) == int(v) for v in value)
    except (TypeError, ValueError, OverflowError):
        raise MaceqError(f"preprocess key '{key}': {value!r} is not a pair of ints") from None
    if len(hw) != 2 or min(hw) <= 0 or not exact:
        raise MaceqError(f"preprocess key '{key}': {value!r} is not two positive ints (h, w)")
    return hw  # type: ignore[return-value]


def _parse_float(value: Any, key: str) -> float:
    if isinstance(value, bool):
        raise MaceqError(f"preprocess key '{key}': {value!r} is not a number")
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError):
        raise MaceqError(f"preprocess key '{key}': {value!r} is not a number") from None
    if not math.isfinite(out):
        raise MaceqError(f"preprocess key '{key}': {value!r} is not finite")
    return out


def _parse_floats(value: Any, key: str) -> tuple[float, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [v for v in value.split(",") if v.strip()]
    elif isinstance(value, (int, float)):
        value = [value]
    try:
        items = list(value)
    except TypeError:
        raise MaceqError(f"preprocess key '{key}': {value!r} is not a list of numbers") from None
    if not items:
        raise MaceqError(f"preprocess key '{key}': empty list")
    return tuple(_parse_float(v, key) for v in items)



def _reciprocal_int(scale: float) -> int | None:
    """n when ``scale == 1.0 / n`` for an integer 1 <= n <= 65535, else None."""
    if scale <= 0 or not math.isfinite(1.0 / scale):  # a subnormal scale: 1/scale overflows
        return None
    n = round(1.0 / scale)
    if 1 <= n <= 65535 and 1.0 / n == scale:
        return n
    return None


@dataclass(frozen=True)
class Preprocess:
    """How to turn a decoded image into a model input (see the module docstring)."""

    color: ColorOrder = ColorOrder.RGB
    layout: Layout = Layout.NCHW
    resize_short: int | None = None
    resize: tuple[int, int] | None = None
    center_crop: tuple[int, int] | None = None
    scale: float = 1.0 / 255.0
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    offset: float = 0.0

    # -- validation -------------------------------------------------------------
    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "color", _parse_enum(ColorOrder, self.color, "color"))
        set_(self, "layout", _parse_enum(Layout, self.layout, "layout"))
        if self.resize_short is not None:
            rs = self.resize_short
            if isinstance(rs, bool) or not isinstance(rs, (int, np.integer, float, str)):
                raise MaceqError(f"preprocess key 'resize_short': {rs!r} is not a positive int")
            try:
                rs_i = int(rs)
                if float(rs) != rs_i:
                    raise ValueError
            except (ValueError, OverflowError):
                raise MaceqError(f"preprocess key 'resize_short': {rs!r} is not a positive int") from None
            if rs_i <= 0:
                raise MaceqError(f"preprocess key 'resize_short': {rs!r} is not a positive int")
            set_(self, "resize_short", rs_i)
        set_(self, "resize", _parse_hw(self.resize, "resize"))
        set_(self, "center_crop", _parse_hw(self.center_crop, "center_crop"))
        if self.resize is not None and self.resize_short is not None:
            raise MaceqError("preprocess keys 'resize' and 'resize_short' exclude each other")
        set_(self, "scale", _parse_float(self.scale, "scale"))
        if self.scale == 0.0:
            raise MaceqError("preprocess key 'scale': must not be 0")
        set_(self, "offset", _parse_float(self.offset, "offset"))
        set_(self, "mean", _parse_floats(self.mean, "mean"))
        set_(self, "std", _parse_floats(self.std, "std"))
        if (self.mean is None) != (self.std is None):
            raise MaceqError("preprocess keys 'mean' and 'std' must be given together")
        if self.mean is not None:
            channels = self.channels
            for key in ("mean", "std"):
                vals = getattr(self, key)
                if len(vals) not in (1, channels):
                    raise MaceqError(
                        f"preprocess key '{key}': {len(vals)} values for {channels} channel(s)"
                    )
            if any(s == 0.0 for s in self.std):
                raise MaceqError("preprocess key 'std': contains 0")

    # -- derived ---------------------------------------------------------------
    @property
    def channels(self) -> int:
        return 1 if self.color is ColorOrder.GRAY else 3

    @property
    def target_hw(self) -> tuple[int, int] | None:
        """Output (h, w) fixed by the crop or the direct resize; None if it depends on the image."""
        if self.center_crop is not None:
            return self.center_crop
        return self.resize

    def output_shape(self, hw: tuple[int, int] | None = None) -> tuple[int, ...] | None:
        """Per-image output shape (no batch axis), or None when unknown."""
        hw = self.target_hw or hw
        if hw is None:
            return None
        h, w = hw
        return (self.channels, h, w) if self.layout is Layout.NCHW else (h, w, self.channels)

    def fitted_to(self, dims) -> tuple["Preprocess", list[str]]:
        """This preprocessing completed from a model input's dims (with batch; ints, or names where
        free): the layout (NHWC when the last dim is 1 or 3 and the second is not), the channels
        (grayscale for 1), and the size when nothing fixes it (a resize, or a crop after
        ``resize_short``). Returns it and what was filled in; MaceqError when the size is free in both."""
        if len(dims) != 4:
            return self, []
        nhwc = dims[3] in (1, 3) and dims[1] not in (1, 3)
        c, h, w = (dims[3], dims[1], dims[2]) if nhwc else (dims[1], dims[2], dims[3])
        changes, over = [], {}
        if nhwc and self.layout is not Layout.NHWC:
            over["layout"] = Layout.NHWC
            changes.append("layout NHWC")
        if c == 1 and self.color is not ColorOrder.GRAY:
            over["color"] = ColorOrder.GRAY
            changes.append("grayscale")
        if self.target_hw is None:
            if not (isinstance(h, int) and isinstance(w, int) and h > 0 and w > 0):
                raise MaceqError(f"the model input's size is free ({'x'.join(map(str, dims))}) and the "
                                 f"preprocessing fixes none: give --resize H,W (or a --preset)")
            key = "center_crop" if self.resize_short is not None else "resize"
            over[key] = (h, w)
            changes.append(f"{'center crop' if key == 'center_crop' else 'resize'} to {h}x{w}")
        return (self.with_overrides(**over) if over else self), changes

    # -- (de)serialisation -----------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/YAML-safe dict; ``Preprocess.from_dict(p.to_dict()) == p``."""
        d = asdict(self)
        d["color"] = self.color.value
        d["layout"] = self.layout.value
        for key in ("resize", "center_crop", "mean", "std"):
            if d[key] is not None:
                d[key] = list(d[key])
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Preprocess":
        """Build from a dict; an unknown key raises MaceqError naming it.

        A ``preset`` key starts from that preset; the other keys override it.
        """
        if not isinstance(d, Mapping):
            raise MaceqError(f"preprocess: expected a mapping, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        for key in d:
            if key not in known and key != "preset":
                raise MaceqError(
                    f"preprocess: unknown key '{one_line(str(key))}' (known: preset, {', '.join(sorted(known))})"
                )
        kw = {k: v for k, v in d.items() if k != "preset"}
        if d.get("preset") is not None:
            return _preset(d["preset"]).with_overrides(**kw)
        return cls(**kw)

    def with_overrides(self, **kw: Any) -> "Preprocess":
        """A copy with some fields replaced (validated like from_dict)."""
        known = {f.name for f in fields(self)}
        for key in kw:
            if key not in known:
                raise MaceqError(f"preprocess: unknown key '{one_line(str(key))}'")
        return replace(self, **kw)

    # -- the work --------------------------------------------------------------
    def apply(self, img: Image.Image) -> np.ndarray:
        """The float32 model input for one image: (C, H, W) or (H, W, C)."""
        img = self._convert_mode(img)
        img = self._geometry(img)
        raw = np.asarray(img)
        if raw.ndim == 2:
            raw = raw[:, :, None]
        if self.channels == 3 and raw.shape[2] == 1:
            raw = np.repeat(raw, 3, axis=2)
        if self.color is ColorOrder.BGR:
            raw = raw[:, :, ::-1]
        x = self._values(raw)
        if self.layout is Layout.NCHW:
            x = x.transpose(2, 0, 1)
        return np.ascontiguousarray(x, dtype=np.float32)

    def _convert_mode(self, img: Image.Image) -> Image.Image:
        mode = img.mode
        if mode == "I" or mode.startswith("I;16"):
            # 16/32-bit integer samples: keep the precision, map 65535 -> 255.0
            # (step 1 of the module docstring).
            v = np.asarray(img, dtype=np.float64) / 257.0
            return Image.fromarray(v.astype(np.float32))  # 2-D float32 -> mode "F"
        if mode == "F":
            return img
        if self.color is ColorOrder.GRAY:
            return img if mode == "L" else img.convert("L")
        if mode == "RGB":
            return img
        if mode == "P" and "transparency" in img.info:
            img = img.convert("RGBA")  # avoids PIL's warning; alpha dropped next
        return img.convert("RGB")

    def _geometry(self, img: Image.Image) -> Image.Image:
        if self.resize_short is not None:
            w, h = img.size
            s = self.resize_short
            if w <= h:
                size = (s, int(s * h / w))
            else:
                size = (int(s * w / h), s)
            if size != img.size:
                img = img.resize(size, Image.Resampling.BILINEAR)
        elif self.resize is not None:
            rh, rw = self.resize
            if (rw, rh) != img.size:
                img = img.resize((rw, rh), Image.Resampling.BILINEAR)
        if self.center_crop is not None:
            img = _center_crop(img, self.center_crop)
        return img

    def _values(self, raw: np.ndarray) -> np.ndarray:
        f32 = np.float32
        x = raw.astype(f32)
        n = _reciprocal_int(self.scale)
        if n is not None:
            x = x / f32(n)
        else:
            x = x * f32(self.scale)
        if self.mean is not None:
            c = x.shape[2]
            mean = np.broadcast_to(np.asarray(self.mean, dtype=f32), (c,))
            std = np.broadcast_to(np.asarray(self.std, dtype=f32), (c,))
            x = (x - mean) / std
        if self.offset != 0.0:
            x = x + f32(self.offset)
        return x


def _center_crop(img: Image.Image, hw: tuple[int, int]) -> Image.Image:
    """torchvision.transforms.functional.center_crop for PIL images."""
    ch, cw = hw
    w, h = img.size
    if cw > w or ch > h:
        pad_l = (cw - w) // 2 if cw > w else 0
        pad_t = (ch - h) // 2 if ch > h else 0
        pad_r = (cw - w + 1) // 2 if cw > w else 0
        pad_b = (ch - h + 1) // 2 if ch > h else 0
        canvas = Image.new(img.mode, (w + pad_l + pad_r, h + pad_t + pad_b), 0)
        canvas.paste(img, (pad_l, pad_t))
        img = canvas
        w, h = img.size
        if (w, h) == (cw, ch):
            return img
    top = int(round((h - ch) / 2.0))
    left = int(round((w - cw) / 2.0))
    return img.crop((left, top, left + cw, top + ch))


_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)

PRESETS: dict[str, Preprocess] = {
    "imagenet": Preprocess(
        color=ColorOrder.RGB, layout=Layout.NCHW, resize_short=256, center_crop=(224, 224),
        scale=1.0 / 255.0, mean=_IMAGENET_MEAN, std=_IMAGENET_STD,
    ),
    "tf": Preprocess(
        color=ColorOrder.RGB, layout=Layout.NCHW, resize_short=256, center_crop=(224, 224),
        scale=1.0 / 128.0, offset=-127.0 / 128.0,
    ),
    "fmnist": Preprocess(
        color=ColorOrder.GRAY, layout=Layout.NCHW, resize=(28, 28),
        scale=1.0 / 255.0, mean=(0.2860,), std=(0.3530,),
    ),
    "ppocr_det": Preprocess(
        color=ColorOrder.BGR, layout=Layout.NCHW, resize=(640, 640),
        scale=1.0 / 255.0, mean=_IMAGENET_MEAN, std=_IMAGENET_STD,
    ),
    "ppocr_cls": Preprocess(
        color=ColorOrder.BGR, layout=Layout.NCHW, resize=(48, 192),
        scale=1.0 / 255.0, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
    ),
}


def _preset(name: Any) -> Preprocess:
    if not isinstance(name, str) or name.lower() not in PRESETS:
        raise MaceqError(f"preprocess: unknown preset {name!r} (known: {', '.join(PRESETS)})")
    return PRESETS[name.lower()]


def preprocess_from_args(preset: str | None, overrides: Mapping[str, Any] | None = None) -> Preprocess:
    """The Preprocess for CLI flags: a preset (or the defaults) plus overrides.

    Override values may be strings as they come from the command line
    (``"224,224"``, ``"0.5,0.5,0.5"``, ``"bgr"``); ``None`` values are ignored.
    Unknown keys raise MaceqError naming the key.
    """
    kw = {k: v for k, v in (overrides or {}).items() if v is not None}
    base = _preset(preset) if preset is not None else Preprocess()
    return base.with_overrides(**kw)
