"""The sweep report's HTML page in a real headless browser (Debian's chromium, installed by `make sys-deps`):
it renders, the charts are drawn (not blank) and the browser logs no console message (the page has no script,
so any message is a load or rendering error)."""
from __future__ import annotations

import base64
import io
import re
import shutil
import subprocess

import numpy as np
import pytest

from _sweep_util import lr_sweep
from trainer.experiments import report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH: `make sys-deps` installs Debian's "
                                                         "chromium package (apt-get install chromium)")
TAB_BLUE = (31, 119, 180)  # matplotlib's first line colour: the charts' lines and points


def _pixels(png: bytes) -> np.ndarray:
    from PIL import Image
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def _near(px: np.ndarray, rgb, tol: int = 12) -> int:
    return int((np.abs(px.astype(int) - np.array(rgb)).max(-1) <= tol).sum())


def test_the_report_page_renders_its_table_and_charts_in_headless_chromium(tmp_path):
    root, names = lr_sweep(tmp_path / "lr")
    res = report.report(str(root))
    page = root / "report" / "report.html"
    html = page.read_text()
    charts = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert len(charts) == 3
    for c in charts:  # each embedded chart decodes to a picture with something drawn on it
        px = _pixels(base64.b64decode(c))
        assert px.shape[0] > 200 and px.shape[1] > 400 and _near(px, TAB_BLUE) > 50

    shot = tmp_path / "shot.png"
    p = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                        "--hide-scrollbars", "--enable-logging=stderr", "--v=0", "--window-size=1400,2400",
                        "--virtual-time-budget=5000", f"--screenshot={shot}", page.as_uri()],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    console = [ln for ln in p.stderr.splitlines() if ":CONSOLE" in ln]
    assert console == [], console
    px = _pixels(shot.read_bytes())
    assert px.shape[:2] == (2400, 1400)
    # Not blank: the table and three charts cover a good part of the page, and the charts' lines are there
    # (a chart that failed to load shows as a small broken-image icon, with none of these pixels).
    assert (px.min(-1) < 200).mean() > 0.01
    assert _near(px, TAB_BLUE) > 500
    # The table's numbers are on the page: every trial, its best validation loss.
    for row in res["rows"]:
        assert f"<td>{row['trial']}</td>" in html and f"<td>{row['best_val_loss']:.4f}</td>" in html
