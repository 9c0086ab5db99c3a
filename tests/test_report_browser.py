"""The sweep report's HTML page in a real headless browser (Debian's chromium, installed by `make sys-deps`):
it renders, the charts are drawn (not blank) and the browser logs no console message (the page has no script,
so any message is a load or rendering error)."""
from __future__ import annotations

import base64
import re

from _browser_util import CHROMIUM, NO_CHROMIUM, TAB_BLUE, look, near, pixels
from _skips import needs_setup
from _sweep_util import lr_sweep
from trainer.experiments import report

pytestmark = needs_setup(CHROMIUM is None, NO_CHROMIUM)


def test_the_report_page_renders_its_table_and_charts_in_headless_chromium(tmp_path):
    root, names = lr_sweep(tmp_path / "lr")
    res = report.report(str(root))
    page = root / "report" / "report.html"
    html = page.read_text()
    charts = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert len(charts) == 3
    for c in charts:  # each embedded chart decodes to a picture with something drawn on it
        px = pixels(base64.b64decode(c))
        assert px.shape[0] > 200 and px.shape[1] > 400 and near(px, TAB_BLUE) > 50

    px, console = look(page, tmp_path)
    assert console == [], console
    assert px.shape[:2] == (2400, 1400)
    # Not blank: the table and three charts cover a good part of the page, and the charts' lines are there
    # (a chart that failed to load shows as a small broken-image icon, with none of these pixels).
    assert (px.min(-1) < 200).mean() > 0.01
    assert near(px, TAB_BLUE) > 500
    # The table's numbers are on the page: every trial, its best validation loss.
    for row in res["rows"]:
        assert f"<td>{row['trial']}</td>" in html and f"<td>{row['best_val_loss']:.4f}</td>" in html
