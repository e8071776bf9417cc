"""report.html in a real browser: headless Chromium (Debian's ``chromium`` package) loads it from a
file:// URL, dumps the DOM it built and takes a screenshot.

Checks: the title, the tables and the figures are in the rendered DOM; no script element exists
(node names are text); the browser logged no console message (the page has no script, so any
message is a Content-Security-Policy violation, a load failure or an error); the screenshot shows
the plots' line colour (the figures were decoded and painted). Negative controls prove each
detector bites: a page that logs to the console, and a page whose figure is broken.

Chromium missing is a failure with the install hint, never a skip.
Set MACEQ_UPDATE_SCREENSHOT=1 to refresh docs/report-screenshot.png from this run.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from maceq.tests.test_report import EVIL, parse, real_report

REPO = Path(__file__).resolve().parents[1]
SCREENSHOT = REPO / "docs" / "report-screenshot.png"
WINDOW = (1280, 1500)
#: matplotlib's first line colour (C0, #1f77b4): the error-vs-depth plots' accumulated SQNR line.
C0 = np.array([0x1F, 0x77, 0xB4])
#: Chromium writes each console message to stderr as '...:INFO:CONSOLE:<line>] "<message>", source: ...'
#: (older builds: 'CONSOLE(<line>)'); the level is not in the line, so every message counts.
CONSOLE = re.compile(r":CONSOLE(?::\d+|\(\d+\))\] (.*)")


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        exe = shutil.which(name)
        if exe:
            return exe
    pytest.fail("chromium is not installed: the report browser test needs it "
                "(Debian/Ubuntu: apt-get install -y chromium)")


def browse(url: str, tmp: Path, *args: str) -> tuple[str, list[str]]:
    """Run headless Chromium on ``url``; returns (stdout, console messages)."""
    cmd = [chromium(), "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run", "--disable-extensions",
           "--hide-scrollbars", f"--user-data-dir={tmp / 'chromium-profile'}", "--enable-logging=stderr", "--v=0",
           *args, url]
    env = dict(os.environ, HOME=str(tmp))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, f"chromium exited {p.returncode}: {p.stderr[-2000:]}"
    return p.stdout, [m.group(1) for m in map(CONSOLE.search, p.stderr.splitlines()) if m]


def dump_dom(path: Path, tmp: Path) -> tuple[str, list[str]]:
    return browse(path.resolve().as_uri(), tmp, "--dump-dom")


def screenshot(path: Path, tmp: Path, out: Path) -> tuple[np.ndarray, list[str]]:
    _, console = browse(path.resolve().as_uri(), tmp, f"--screenshot={out}", f"--window-size={WINDOW[0]},{WINDOW[1]}")
    return np.asarray(Image.open(out).convert("RGB")), console


def c0_pixels(img: np.ndarray) -> int:
    return int(np.sum(np.all(np.abs(img.astype(np.int16) - C0) <= 12, axis=-1)))


@pytest.fixture(scope="module")
def real(tmp_path_factory, shared_data):
    return real_report(tmp_path_factory.getbasetemp() / "maceq-report", shared_data)


def test_detectors_bite(tmp_path, real):
    """Negative controls: console messages are seen, and a broken figure paints no plot colour."""
    page = tmp_path / "bad.html"
    page.write_text('<!DOCTYPE html><html><head><title>t</title></head><body><p>x</p>'
                    '<script>console.error("boom"); missing();</script></body></html>')
    dom, console = dump_dom(page, tmp_path)
    assert parse(dom).title == "t"
    assert any("boom" in m for m in console) and any("missing is not defined" in m for m in console)
    src = parse(real.files.html.read_text()).imgs[0]
    for name, s, want_plot in (("good.html", src, True), ("broken.html", src[:-400] + "AAAA", False)):
        page = tmp_path / name
        page.write_text(f'<!DOCTYPE html><html><head><title>f</title></head><body><img src="{s}"></body></html>')
        img, console = screenshot(page, tmp_path, tmp_path / (name + ".png"))
        assert console == []
        assert (c0_pixels(img) > 200) is want_plot, name


def test_report_renders_in_chromium(tmp_path, real):
    html = real.files.html
    dom_text, console = dump_dom(html, tmp_path)
    assert console == [], console
    dom = parse(dom_text)
    assert dom.title == "maceq report: fmnist_evil"
    assert dom.tags.count("table") >= 8
    assert "script" not in dom.tags
    figs = [s for s in dom.imgs if s.startswith("data:image/svg+xml;base64,")]
    assert len(figs) == len(dom.imgs) == 8
    text = "".join(dom.text)
    assert text.count(EVIL) >= 4  # the node name is text in the rendered page
    assert "Error vs depth" in text and "Layers (worst first)" in text

    shot = tmp_path / "report.png"
    img, console = screenshot(html, tmp_path, shot)
    assert console == [], console
    assert img.shape == (WINDOW[1], WINDOW[0], 3)
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 50  # not a blank page
    assert c0_pixels(img) > 1000  # the error-vs-depth plots were painted
    if os.environ.get("MACEQ_UPDATE_SCREENSHOT") == "1":
        small = Image.open(shot).convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT)
        small.save(SCREENSHOT, optimize=True)
