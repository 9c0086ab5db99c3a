"""A report page in a real headless browser (Debian's chromium, installed by `make sys-deps`)."""
from __future__ import annotations

import io
import shutil
import subprocess
from pathlib import Path

import numpy as np

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NO_CHROMIUM = ("no chromium on PATH: `make sys-deps` installs Debian's chromium package (apt-get install "
               "chromium)")
TAB_BLUE = (31, 119, 180)  # matplotlib's first line colour: the charts' lines and points


def pixels(png: bytes) -> np.ndarray:
    from PIL import Image
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def near(px: np.ndarray, rgb, tol: int = 12) -> int:
    return int((np.abs(px.astype(int) - np.array(rgb)).max(-1) <= tol).sum())


def look(page: Path, tmp: Path, height: int = 2400) -> tuple[np.ndarray, list[str]]:
    """(a screenshot of the page, 1400 wide, as pixels; the console messages the browser logged)."""
    shot = tmp / "shot.png"
    p = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                        "--hide-scrollbars", "--enable-logging=stderr", "--v=0", f"--window-size=1400,{height}",
                        "--virtual-time-budget=5000", f"--screenshot={shot}", page.as_uri()],
                       capture_output=True, text=True, timeout=120, cwd=tmp)
    assert p.returncode == 0, p.stderr[-3000:]
    return pixels(shot.read_bytes()), [ln for ln in p.stderr.splitlines() if ":CONSOLE" in ln]
