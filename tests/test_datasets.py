"""Image discovery, decoding, preprocessing and labels.

Oracles: torchvision's Resize/CenterCrop/ToTensor/Normalize written out here
independently with PIL + numpy (float32 per operation, as torch computes on
CPU); exact integer identities for the 'tf' preset; the Fashion-MNIST model's
accuracy on the real test images (which only holds with the right
preprocessing and class order).
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import yaml
from PIL import Image

from maceq.datasets import images as images_mod
from maceq.datasets.images import (
    Batch,
    ImageFolder,
    UnreadableImageWarning,
    iter_image_files,
    load_image,
)
from maceq.datasets.labels import FASHION_MNIST_CLASSES, labels_from_csv
from maceq.datasets.preprocess import (
    PRESETS,
    ColorOrder,
    Layout,
    Preprocess,
    preprocess_from_args,
)
from maceq.errors import MaceqError

DATA = Path("/work/shared/data")
PHOTOS = DATA / "photos" / "calib"
FMNIST = DATA / "fashion_mnist"


# -- an independent torchvision-equivalent pipeline --------------------------------
def tv_resize_short(img: Image.Image, size: int) -> Image.Image:
    # torchvision.transforms.functional._compute_resized_output_size
    w, h = img.size
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = size, int(size * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    if (new_w, new_h) == (w, h):
        return img
    return img.resize((new_w, new_h), Image.BILINEAR)


def tv_center_crop(arr: np.ndarray, ch: int, cw: int) -> np.ndarray:
    h, w = arr.shape[:2]
    top = int(round((h - ch) / 2.0))
    left = int(round((w - cw) / 2.0))
    return arr[top:top + ch, left:left + cw]


def tv_imagenet(path: Path) -> np.ndarray:
    img = Image.open(path).convert("RGB")
    img = tv_resize_short(img, 256)
    arr = tv_center_crop(np.array(img), 224, 224)
    t = arr.astype(np.float32) / np.float32(255.0)  # ToTensor: float().div(255)
    mean = np.array([0.485, 0.456, 0.406], dtype=np.float32)
    std = np.array([0.229, 0.224, 0.225], dtype=np.float32)
    t = (t - mean) / std  # Normalize: sub_(mean).div_(std)
    return t.transpose(2, 0, 1)


def photo_files(n: int) -> list[Path]:
    files = sorted(PHOTOS.glob("*.jpg"))
    assert len(files) >= n
    # spread over the folder so that several sizes/orientations come in
    return files[:: max(1, len(files) // n)][:n]


# -- presets -------------------------------------------------------------------
def test_imagenet_preset_equals_torchvision_pipeline_on_real_photos():
    pre = PRESETS["imagenet"]
    sizes = set()
    for path in photo_files(8):
        with Image.open(path) as im:
            sizes.add(im.size)
            got = pre.apply(im)
        want = tv_imagenet(path)
        assert got.dtype == np.float32 and got.shape == (3, 224, 224)
        mismatches = int((got.view(np.uint32) != want.view(np.uint32)).sum())
        assert mismatches == 0, f"{path}: {mismatches} differing float32 values"
    assert len(sizes) >= 2


def test_tf_preset_is_exact_affine_of_raw_pixels():
    path = photo_files(3)[1]
    got = PRESETS["tf"].apply(Image.open(path))
    img = tv_resize_short(Image.open(path).convert("RGB"), 256)
    raw = tv_center_crop(np.array(img), 224, 224).transpose(2, 0, 1).astype(np.float64)
    # (x*255 - 127)/128 with x = raw/255, exact in float64 and representable in float32
    want = (raw - 127.0) / 128.0
    assert np.array_equal(got.astype(np.float64), want)


def test_fmnist_preset_on_real_png():
    path = sorted((FMNIST / "calib" / "Bag").glob("*.png"))[0]
    got = PRESETS["fmnist"].apply(Image.open(path))
    raw = np.array(Image.open(path))
    assert raw.shape == (28, 28) and raw.dtype == np.uint8
    want = ((raw.astype(np.float32) / np.float32(255)) - np.float32(0.2860)) / np.float32(0.3530)
    assert got.shape == (1, 28, 28)
    assert np.array_equal(got[0], want)
    # and the real-valued formula to float32 precision
    exact = (raw / 255.0 - 0.2860) / 0.3530
    assert np.max(np.abs(got[0] - exact)) < 1e-6


def test_fmnist_model_accuracy_with_folder_labels():
    """The trained model scores ~90% only if preprocessing and class order are right."""
    ds = ImageFolder(FMNIST / "test", PRESETS["fmnist"], classes=FASHION_MNIST_CLASSES)
    assert len(ds) == 1000 and ds.classes == FASHION_MNIST_CLASSES
    sess = ort.InferenceSession(str(DATA / "models" / "fmnist_mobilenet.onnx"),
                                providers=["CPUExecutionProvider"])
    correct = total = 0
    for b in ds.iter_batches(250):
        logits = sess.run(["logits"], {"input": b.data})[0]
        correct += int((logits.argmax(1) == b.labels).sum())
        total += len(b.paths)
    assert total == 1000
    assert correct / total > 0.85, correct


# -- colour modes, layout, geometry ----------------------------------------------
def _plain(color: ColorOrder, layout: Layout = Layout.NCHW, **kw) -> Preprocess:
    return Preprocess(color=color, layout=layout, scale=1.0, **kw)


def test_color_conversions():
    rgb = np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3) * 3
    img = Image.fromarray(rgb, "RGB")
    out = _plain(ColorOrder.RGB).apply(img)
    assert np.array_equal(out, rgb.transpose(2, 0, 1).astype(np.float32))
    # BGR reverses channels; NHWC keeps HWC
    assert np.array_equal(_plain(ColorOrder.BGR).apply(img), out[::-1])
    assert np.array_equal(_plain(ColorOrder.RGB, Layout.NHWC).apply(img), rgb.astype(np.float32))
    # RGBA: alpha dropped, no compositing
    rgba = np.concatenate([rgb, np.full((4, 5, 1), 7, np.uint8)], axis=2)
    assert np.array_equal(_plain(ColorOrder.RGB).apply(Image.fromarray(rgba, "RGBA")), out)
    # grey -> RGB repeats the plane; RGB -> grey is ITU-R 601-2 (PIL's rounding)
    grey = rgb[:, :, 0]
    g3 = _plain(ColorOrder.RGB).apply(Image.fromarray(grey, "L"))
    assert np.array_equal(g3, np.repeat(grey[None].astype(np.float32), 3, axis=0))
    luma = _plain(ColorOrder.GRAY).apply(img)[0]
    ref = rgb[..., 0] * 0.299 + rgb[..., 1] * 0.587 + rgb[..., 2] * 0.114
    assert luma.shape == (4, 5) and np.max(np.abs(luma - ref)) <= 0.5 + 1e-9
    # palette -> its colours
    p = Image.new("P", (3, 2))
    p.putpalette([0, 0, 0, 200, 100, 50] + [0] * 762)
    p.putpixel((1, 1), 1)
    pv = _plain(ColorOrder.RGB).apply(p)
    assert list(pv[:, 1, 1]) == [200, 100, 50] and list(pv[:, 0, 0]) == [0, 0, 0]
    # CMYK -> PIL's RGB
    cm = Image.new("CMYK", (2, 2), (0, 255, 0, 0))
    assert list(_plain(ColorOrder.RGB).apply(cm)[:, 0, 0]) == [255, 0, 255]
    # LA -> grey
    la = Image.new("LA", (2, 2), (77, 3))
    assert _plain(ColorOrder.GRAY).apply(la).tolist() == [[[77.0, 77.0], [77.0, 77.0]]]


def test_16bit_png_maps_to_0_255(tmp_path):
    b = np.arange(256, dtype=np.uint16).reshape(16, 16)
    path = tmp_path / "deep.png"
    Image.fromarray(b * 257).save(path)
    assert Image.open(path).mode in ("I;16", "I")
    out = load_image(path, _plain(ColorOrder.GRAY))
    assert out.shape == (1, 1, 16, 16)
    assert np.array_equal(out[0, 0], b.astype(np.float32))
    out3 = load_image(path, _plain(ColorOrder.RGB))
    assert np.array_equal(out3[0], np.repeat(b[None].astype(np.float32), 3, axis=0))


def test_center_crop_pads_small_images_like_torchvision():
    img = Image.fromarray(np.full((3, 4), 9, np.uint8), "L")
    out = _plain(ColorOrder.GRAY, center_crop=(5, 7)).apply(img)[0]
    # pad left (7-4)//2=1, right 2; top (5-3)//2=1, bottom 1
    want = np.zeros((5, 7), np.float32)
    want[1:4, 1:5] = 9
    assert np.array_equal(out, want)
    # odd margin: round((6 - 3) / 2) = round(1.5) = 2 (ties to even)
    img = Image.fromarray(np.arange(6 * 6, dtype=np.uint8).reshape(6, 6), "L")
    out = _plain(ColorOrder.GRAY, center_crop=(3, 3)).apply(img)[0]
    assert np.array_equal(out, np.arange(36, dtype=np.float32).reshape(6, 6)[2:5, 2:5])


def test_resize_short_and_direct_resize_sizes():
    img = Image.new("RGB", (300, 200))
    assert _plain(ColorOrder.RGB, resize_short=100).apply(img).shape == (3, 100, 150)
    img = Image.new("RGB", (201, 300))
    assert _plain(ColorOrder.RGB, resize_short=100).apply(img).shape == (3, int(100 * 300 / 201), 100)
    assert _plain(ColorOrder.RGB, resize=(7, 9)).apply(img).shape == (3, 7, 9)
    assert PRESETS["fmnist"].apply(Image.new("L", (56, 40))).shape == (1, 28, 28)
    assert PRESETS["imagenet"].target_hw == (224, 224)
    assert Preprocess().target_hw is None


def test_huge_jpeg_uses_draft_with_bounded_error(tmp_path, monkeypatch):
    yy, xx = np.mgrid[0:800, 0:1200]
    smooth = np.stack([xx * 255 // 1199, yy * 255 // 799, (xx + yy) * 255 // 1998], axis=2).astype(np.uint8)
    path = _write(tmp_path / "big.jpg", smooth, "RGB")
    pre = _plain(ColorOrder.RGB, resize_short=50)
    full = load_image(path, pre)
    opened = []
    from PIL import JpegImagePlugin

    real_draft = JpegImagePlugin.JpegImageFile.draft

    def spy(self, mode, size):
        opened.append(size)
        return real_draft(self, mode, size)

    monkeypatch.setattr(images_mod, "DRAFT_MIN_PIXELS", 1000)
    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    drafted = load_image(path, pre)
    assert opened == [(300, 200)]  # 4x the 75x50 target
    assert drafted.shape == full.shape == (1, 3, 50, 75)
    assert not np.array_equal(drafted, full)  # the DCT-scaled decode really happened
    assert np.abs(drafted - full).mean() < 2.0


# -- dict / flags ------------------------------------------------------------------
def test_preprocess_dict_round_trip_and_validation():
    for name, pre in PRESETS.items():
        d = pre.to_dict()
        assert Preprocess.from_dict(json.loads(json.dumps(d))) == pre, name
        assert Preprocess.from_dict(yaml.safe_load(yaml.safe_dump(d))) == pre, name
    with pytest.raises(MaceqError, match="'resize_shortt'"):
        Preprocess.from_dict({"resize_shortt": 3})
    with pytest.raises(MaceqError, match="'color'"):
        Preprocess.from_dict({"color": "rgba"})
    with pytest.raises(MaceqError, match="'std'"):
        Preprocess.from_dict({"mean": [0.5, 0.5, 0.5]})
    with pytest.raises(MaceqError, match="'mean'"):
        Preprocess.from_dict({"mean": [0.5, 0.5], "std": [1, 1]})
    with pytest.raises(MaceqError, match="exclude"):
        Preprocess.from_dict({"resize": [2, 2], "resize_short": 4})
    with pytest.raises(MaceqError, match="preset"):
        Preprocess.from_dict({"preset": "nope"})
    p = Preprocess.from_dict({"preset": "imagenet", "color": "bgr"})
    assert p.color is ColorOrder.BGR and p.mean == PRESETS["imagenet"].mean


def test_preprocess_from_args_parses_cli_strings():
    p = preprocess_from_args("imagenet", {"center_crop": "200x100", "layout": "NHWC", "mean": None})
    assert p.center_crop == (200, 100) and p.layout is Layout.NHWC
    assert preprocess_from_args("tf", {"center_crop": "192"}).center_crop == (192, 192)
    assert p.mean == PRESETS["imagenet"].mean
    q = preprocess_from_args(None, {"mean": "0.5,0.5,0.5", "std": "0.5", "resize": "48,192"})
    assert q.mean == (0.5, 0.5, 0.5) and q.std == (0.5,) and q.resize == (48, 192)
    assert q.output_shape() == (3, 48, 192)
    with pytest.raises(MaceqError, match="'crop'"):
        preprocess_from_args("tf", {"crop": "3"})
    with pytest.raises(MaceqError, match="'resize_short'"):
        preprocess_from_args("tf", {"resize_short": "abc"})


# -- discovery and streaming ---------------------------------------------------------
def _write(path: Path, arr: np.ndarray, mode: str | None = None, fmt: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr, mode).save(path, format=fmt)
    return path


@pytest.fixture
def mixed_folder(tmp_path) -> Path:
    root = tmp_path / "imgs"
    rng = np.random.default_rng(0)
    _write(root / "b" / "x.PNG", rng.integers(0, 255, (10, 12), dtype=np.uint8))
    _write(root / "a" / "deep" / "y.jpg", rng.integers(0, 255, (10, 12, 3), dtype=np.uint8))
    _write(root / "a" / "z.BMP", rng.integers(0, 255, (10, 12, 3), dtype=np.uint8))
    rgba = rng.integers(0, 255, (10, 12, 4), dtype=np.uint8)
    _write(root / "b" / "w.webp", rgba, fmt="WEBP")
    p = Image.new("P", (12, 10))
    p.putpalette(list(range(256)) * 3)
    p.save(root / "a" / "pal.png")
    (root / "a" / "broken.jpeg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    (root / "b" / "notes.txt").write_text("not an image")
    (root / ".hidden").mkdir()
    _write(root / ".hidden" / "h.png", np.zeros((10, 12), np.uint8))
    return root


def test_iter_image_files_sorted_recursive_case_insensitive(mixed_folder):
    rel = [p.relative_to(mixed_folder).as_posix() for p in iter_image_files(mixed_folder)]
    assert rel == ["a/broken.jpeg", "a/deep/y.jpg", "a/pal.png", "a/z.BMP", "b/w.webp", "b/x.PNG"]
    single = mixed_folder / "a" / "z.BMP"
    assert iter_image_files(single) == [single]
    with pytest.raises(MaceqError, match="nowhere"):
        iter_image_files(mixed_folder / "nowhere")


def test_image_folder_streams_and_skips_corrupt(mixed_folder):
    pre = _plain(ColorOrder.RGB, resize=(8, 8))
    ds = ImageFolder(mixed_folder, pre)
    assert len(ds) == 6 and ds.classes == ("a", "b")
    with pytest.warns(UnreadableImageWarning, match="broken.jpeg"):
        batches = list(ds.iter_batches(2))
    assert [len(b.paths) for b in batches] == [2, 2, 1]
    assert ds.skipped == 1 and ds.skipped_paths[0].endswith("broken.jpeg")
    assert all(isinstance(b, Batch) and b.data.dtype == np.float32 for b in batches)
    assert batches[0].data.shape == (2, 3, 8, 8)
    assert [int(v) for b in batches for v in b.labels] == [0, 0, 0, 1, 1]
    # each batch holds exactly what an independent decode of its files gives
    for b in batches:
        for i, path in enumerate(b.paths):
            assert np.array_equal(b.data[i], load_image(path, pre)[0])


def test_image_folder_decodes_lazily(mixed_folder, monkeypatch):
    calls = []
    real = images_mod._decode

    def spy(path, pre):
        calls.append(path)
        return real(path, pre)

    monkeypatch.setattr(images_mod, "_decode", spy)
    ds = ImageFolder(mixed_folder, _plain(ColorOrder.GRAY, resize=(4, 4)), labels=None)
    it = ds.iter_batches(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnreadableImageWarning)
        first = next(it)
    assert len(first.paths) == 2 and len(calls) == 3  # broken + 2 good ones, nothing more
    assert first.labels is None


def test_image_folder_errors(tmp_path, mixed_folder):
    (tmp_path / "empty").mkdir()
    with pytest.raises(MaceqError, match="empty"):
        ImageFolder(tmp_path / "empty", PRESETS["fmnist"])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.png").write_bytes(b"garbage")
    (bad / "b.jpg").write_bytes(b"")
    ds = ImageFolder(bad, PRESETS["fmnist"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnreadableImageWarning)
        with pytest.raises(MaceqError, match="bad: no readable image"):
            list(ds.iter_batches(4))
    assert ds.skipped == 2
    with pytest.raises(MaceqError, match="a.png"):
        load_image(bad / "a.png", PRESETS["fmnist"])
    # differing shapes without crop/resize: named
    _write(mixed_folder / "a" / "zz_big.png", np.zeros((20, 20), np.uint8))
    ds = ImageFolder(mixed_folder / "a", _plain(ColorOrder.GRAY), labels=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnreadableImageWarning)
        with pytest.raises(MaceqError, match="zz_big.png"):
            list(ds.iter_batches(8))
    with pytest.raises(MaceqError, match="limit"):
        ImageFolder(mixed_folder, PRESETS["fmnist"], limit=0)


def test_limit_and_real_folder_labels():
    ds = ImageFolder(FMNIST / "calib", PRESETS["fmnist"], limit=120)
    assert len(ds) == 120
    # sorted class folders: Ankle_boot (50 files) then Bag
    assert ds.classes[:2] == ("Ankle_boot", "Bag")
    assert list(ds.labels[:50]) == [0] * 50 and list(ds.labels[50:100]) == [1] * 50
    ds2 = ImageFolder(FMNIST / "calib", PRESETS["fmnist"], classes=FASHION_MNIST_CLASSES)
    bag = FASHION_MNIST_CLASSES.index("Bag")
    for path, lab in zip(ds2.files, ds2.labels):
        assert FASHION_MNIST_CLASSES[lab] == path.parent.name
    assert int((ds2.labels == bag).sum()) == 50
    flat = ImageFolder(PHOTOS, PRESETS["imagenet"])
    assert flat.labels is None and len(flat) == 148
    with pytest.raises(MaceqError, match="class subfolder"):
        ImageFolder(PHOTOS, PRESETS["imagenet"], labels="folders")


# -- CSV labels ----------------------------------------------------------------------
@pytest.fixture
def csv_folder(tmp_path) -> Path:
    root = tmp_path / "c"
    for i in range(3):
        _write(root / f"im{i}.png", np.full((4, 4), i, np.uint8))
    return root


def test_csv_labels_ints_names_header(csv_folder):
    files = iter_image_files(csv_folder)
    csv = csv_folder.parent / "l.csv"
    csv.write_text("im2.png,5\n\n# comment\nim0.png,3\nim1.png,0\n")
    assert list(labels_from_csv(csv, csv_folder, files).values) == [3, 0, 5]
    csv.write_text("file,label\nim0.png,cat\nim1.png,dog\nim2.png,cat\n")
    lab = labels_from_csv(csv, csv_folder, files)
    assert list(lab.values) == [0, 1, 0] and lab.classes == ("cat", "dog")
    lab = labels_from_csv(csv, csv_folder, files, classes=["dog", "cat"])
    assert list(lab.values) == [1, 0, 1]
    ds = ImageFolder(csv_folder, _plain(ColorOrder.GRAY), labels=str(csv), classes=["dog", "cat"])
    (b,) = list(ds.iter_batches(3))
    assert list(b.labels) == [1, 0, 1] and b.data[2, 0, 0, 0] == 2.0
    # absolute path and limit: extra rows for existing files are fine
    csv.write_text(f"{csv_folder / 'im0.png'},1\nim1.png,2\nim2.png,2\n")
    ds = ImageFolder(csv_folder, _plain(ColorOrder.GRAY), labels=str(csv), limit=1)
    assert list(ds.labels) == [1]


@pytest.mark.parametrize(
    "text, match",
    [
        ("im0.png,1\nim1.png,x\nim2.png,1\n", r"l\.csv:2: .*'x'.*line 1"),
        ("im0.png,1\nim1.png,2,3\n", r"l\.csv:2: expected 2 fields"),
        ("im0.png,1\nnope.png,2\n", r"l\.csv:2: file 'nope.png' not found"),
        ("im0.png,1\nim1.png,-2\nim2.png,0\n", r"l\.csv:2: negative label"),
        ("im0.png,1\nim0.png,2\n", r"l\.csv:2: .*already labelled at line 1"),
        ("im0.png,1\nim1.png,2\n", r"l\.csv: no label for .*im2.png"),
        ("file,label\n", r"l\.csv: no label rows"),
        ("f,l\nim0.png,cat\nim1.png,bird\nim2.png,cat\n", r"l\.csv:3: label 'bird' is not in the class list"),
    ],
)
def test_csv_label_errors_name_file_and_line(csv_folder, text, match):
    csv = csv_folder.parent / "l.csv"
    csv.write_text(text)
    classes = ["cat", "dog"] if "bird" in text else None
    with pytest.raises(MaceqError, match=match):
        labels_from_csv(csv, csv_folder, iter_image_files(csv_folder), classes=classes)
