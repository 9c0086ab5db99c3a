"""The report's PNG charts (matplotlib, Agg): a sweep's loss curves, its final losses with the scaling-law fit
(`final_loss_figure`), the loss against the learning rate, and one run's curves. Jax-free.

Log axes are labelled with as many ticks as fit side by side (`label_log_axis`), and point labels sit beside
their points, not on them.
"""
from __future__ import annotations

import io
import math
import textwrap

from trainer.common.config import UsageError
from trainer.experiments.scaling import LAW, PowerLaw, final_loss, plus_minus

FIT_GID = "power-law-fit"  # the fitted line's artist id (tests find it by this)
NO_FIT_GID = "no-power-law-fit"  # the text said instead of a fitted line
POINT_LABEL_GID = "trial-label"


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise UsageError("charts need matplotlib: pip install 'tpuctl[report]' (make setup installs it)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    _plt().close(fig)
    return buf.getvalue()


# --- log axes ---------------------------------------------------------------------------------------

def tick_text(v: float) -> str:
    """8.2, 0.003, 1000 as they are; 2×10⁴ and 10¹¹ (mathtext) beyond."""
    if v <= 0:
        return ""
    e = math.floor(math.log10(v) + 1e-9)
    if -3 <= e <= 3:
        return f"{v:g}"
    m = round(v / 10**e, 2)
    if m >= 10:
        m, e = m / 10, e + 1
    return f"$10^{{{e}}}$" if m == 1 else f"${m:g}\\times10^{{{e}}}$"


def _candidates(lo: float, hi: float) -> list[list[float]]:
    """Tick values for [lo, hi], sparse to dense: decades, then 1-3, 1-2-5, 1-2-3-5 per decade; for an axis that
    spans less than a decade, round values (2, 2.5, 5 steps) as on a linear axis."""
    from matplotlib.ticker import LogLocator, MaxNLocator
    out = []
    for subs in ((1.0,), (1.0, 3.0), (1.0, 2.0, 5.0), (1.0, 2.0, 3.0, 5.0)):
        out.append(LogLocator(base=10, subs=subs, numticks=30).tick_values(lo, hi))
    for n in (3, 5, 8):
        out.append(MaxNLocator(nbins=n, steps=[1, 2, 2.5, 5, 10]).tick_values(lo, hi))
    return [[float(v) for v in vals if lo <= v <= hi and v > 0] for vals in out]


def _overlap(boxes, pad: float) -> bool:
    boxes = sorted(boxes, key=lambda b: (b.x0, b.y0))
    return any(a.x1 + pad > b.x0 and b.x1 + pad > a.x0 and a.y1 + pad > b.y0 and b.y1 + pad > a.y0
               for i, a in enumerate(boxes) for b in boxes[i + 1:])


def label_log_axis(ax, which: str = "x") -> None:
    """Fix a log axis's labelled ticks: the fewest of `_candidates` that give at least 3 labels, else 2, whose
    labels, drawn, do not touch each other. Unlabelled minor ticks keep the grid. Call it once every artist is on
    the axes (the view limits are read)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter
    axis = ax.xaxis if which == "x" else ax.yaxis
    if axis.get_scale() != "log":
        return
    fig = ax.figure
    ax.autoscale_view()  # settles the view limits
    lo, hi = sorted(ax.get_xlim() if which == "x" else ax.get_ylim())
    renderer = fig.canvas.get_renderer()
    pad = 4 * fig.dpi / 72  # 4 points between labels

    def fits(ticks) -> bool:
        axis.set_major_locator(FixedLocator(ticks))
        axis.draw(renderer)  # lays out this axis's tick labels (the figure is drawn afresh when saved)
        return not _overlap([t.get_window_extent(renderer) for t in axis.get_ticklabels() if t.get_text()], pad)

    axis.set_major_formatter(FuncFormatter(lambda v, _: tick_text(v)))
    axis.set_minor_locator(LogLocator(base=10, subs=tuple(range(2, 10)), numticks=30))
    axis.set_minor_formatter(NullFormatter())
    cands = _candidates(lo, hi)
    chosen = next((t for want in (3, 2) for t in cands if len(t) >= want and fits(t)), None)
    if chosen is None:  # nothing fits twice: the ends of the axis
        chosen = [lo, hi]
    axis.set_major_locator(FixedLocator(chosen))


# --- the charts -------------------------------------------------------------------------------------

# Where a label may go around its point, in points: (dx, dy, ha, va), beside it, then above or below it.
_AROUND = [(6, 6, "left", "bottom"), (6, -6, "left", "top"), (-6, 6, "right", "bottom"), (-6, -6, "right", "top"),
           (8, 0, "left", "center"), (-8, 0, "right", "center"), (0, 8, "center", "bottom"), (0, -8, "center", "top")]
MARKER_PT = 4  # half a scatter marker's width (its default size is 36 pt²), plus a little air


def _clashes(box, taken, frame, pad: float = 2.0) -> int:
    """How many of `taken` the box touches (within pad pixels), plus one if it leaves the frame."""
    inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
    return sum(box.padded(pad).overlaps(t) for t in taken) + (0 if inside else 1)


def _distance(box, p) -> float:
    return math.hypot(max(box.x0 - p[0], 0.0, p[0] - box.x1), max(box.y0 - p[1], 0.0, p[1] - box.y1))


def _label_points(ax, points: list[tuple[float, float, str]]) -> list:
    """Each point's name beside it, clear of every point and of the names placed before it, inside the axes:
    first choice above and to the right, or for points in the right third below and to the left (the far side
    of a falling curve through the points), else the first free place around it. Returns the display boxes
    taken (points and names)."""
    from matplotlib.transforms import Bbox
    fig = ax.figure
    ax.autoscale_view()
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    r = MARKER_PT * fig.dpi / 72
    centres = ax.transData.transform([(x, y) for x, y, _ in points])
    taken = [Bbox.from_extents(px - r, py - r, px + r, py + r) for px, py in centres]
    lo, hi = ax.get_xlim()
    log = ax.get_xscale() == "log"
    for i, (x, y, name) in enumerate(points):
        frac = (math.log(x / lo) / math.log(hi / lo)) if log else (x - lo) / ((hi - lo) or 1)
        order = ([_AROUND[3], _AROUND[1], _AROUND[2], _AROUND[0]] if frac > 0.66 else _AROUND[:4]) + _AROUND[4:]
        ann = ax.annotate(name, (x, y), textcoords="offset points", xytext=(0, 0), fontsize=7, gid=POINT_LABEL_GID)
        best = None
        for dx, dy, ha, va in order:
            ann.xyann = (dx, dy)
            ann.set_ha(ha)
            ann.set_va(va)
            box = ann.get_window_extent(renderer)
            own = _distance(box, centres[i])  # a name nearer another point would read as that point's
            n = _clashes(box, taken, frame) + sum(_distance(box, c) < own for j, c in enumerate(centres) if j != i)
            if best is None or n < best[0]:
                best = (n, (dx, dy, ha, va), box)
            if n == 0:
                break
        _, (dx, dy, ha, va), box = best
        ann.xyann = (dx, dy)
        ann.set_ha(ha)
        ann.set_va(va)
        taken.append(box)
    return taken


def _note(ax, text: str, taken: list) -> None:
    """A boxed note in the first corner of the axes clear of `taken` (points and their names)."""
    renderer = ax.figure.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    t = ax.text(0, 0, text, transform=ax.transAxes, fontsize=8, multialignment="left",
                bbox=dict(boxstyle="round", fc="white", ec="0.7"), gid=NO_FIT_GID)
    best = None
    for x, y, ha, va in ((0.97, 0.96, "right", "top"), (0.03, 0.04, "left", "bottom"),
                         (0.03, 0.96, "left", "top"), (0.97, 0.04, "right", "bottom")):
        t.set_position((x, y))
        t.set_ha(ha)
        t.set_va(va)
        n = _clashes(t.get_window_extent(renderer), taken, frame)  # the text's box; its frame adds a few px
        if best is None or n < best[0]:
            best = (n, (x, y, ha, va))
        if n == 0:
            break
    x, y, ha, va = best[1]
    t.set_position((x, y))
    t.set_ha(ha)
    t.set_va(va)


def fit_label(fit: PowerLaw) -> str:
    """The legend's line for the fit: the law, its exponent with one sigma, and its other terms."""
    return (f"fit $L = a\\,C^{{-b}} + c$ ({fit.n} sizes)\n"
            f"$b$ = {plus_minus(fit.b, fit.b_err)}, $c$ = {plus_minus(fit.c, fit.c_err)}")


def final_loss_figure(done: list[dict], fit: PowerLaw | None, no_fit: str | None = None):
    """Final loss against non-embedding parameters and against training FLOPs, log-log, each point named.
    The compute panel carries the fit as a dashed line over the fitted range, with its exponent in the legend;
    without a fit it says why (`no_fit`) instead of drawing a curve."""
    import numpy as np
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    loss = [final_loss(r) for r in done]
    sizes = [r["params_non_embedding"] or r["params"] for r in done]
    flops = [r["flops"] for r in done]
    ax1.scatter(sizes, loss, zorder=3)
    ax2.scatter(flops, loss, zorder=3, label="trials" if fit is not None else None)
    if fit is not None:
        xs = np.geomspace(min(flops), max(flops), 100)
        ax2.plot(xs, fit(xs), "--", color="C3", lw=1.5, label=fit_label(fit), gid=FIT_GID)
        ax2.legend(fontsize=8, loc="best")
    ax1.set(xlabel="non-embedding parameters", ylabel="final loss (best val, else train)",
            title="Final loss against parameters", xscale="log", yscale="log")
    ax2.set(xlabel="training FLOPs $C$", ylabel="final loss $L$", title="Final loss against compute",
            xscale="log", yscale="log")
    for ax, xs in ((ax1, sizes), (ax2, flops)):
        ax.margins(x=0.12, y=0.15)  # room for the point labels inside the axes
        ax.grid(alpha=0.3, which="both")
        label_log_axis(ax, "x")
        label_log_axis(ax, "y")
        taken = _label_points(ax, [(x, y, r["trial"]) for x, y, r in zip(xs, loss, done)])
    if fit is None and no_fit:
        _note(ax2, textwrap.fill(no_fit.replace(LAW, LAW.replace(" ", "\u00a0")), 48), taken)  # the law unbroken
    return fig


def sweep_charts(rows: list[dict], runs: list[dict], axes: dict, fit: PowerLaw | None,
                 no_fit: str | None = None) -> dict[str, bytes]:
    """name -> PNG bytes. no_fit: why there is no fit (said on the final-loss chart)."""
    from trainer.common.metrics import flops_per_token
    plt = _plt()
    charts = {}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r, run in zip(rows, runs):
        recs = sorted((m for m in run["metrics"] if isinstance(m.get("loss"), (int, float))), key=lambda m: m["step"])
        if not recs or run["config"] is None:
            continue
        c = run["config"]
        per_step = c.train.batch_size * c.model.seq_len * flops_per_token(c.model)
        steps = [m["step"] for m in recs]
        ax1.plot(steps, [m["loss"] for m in recs], label=r["trial"])
        ax2.plot([s * per_step for s in steps], [m["loss"] for m in recs], label=r["trial"])
    ax1.set(xlabel="step", ylabel="train loss", title="Loss against steps")
    ax2.set(xlabel="training FLOPs", ylabel="train loss", title="Loss against compute", xscale="log")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    label_log_axis(ax2, "x")
    ax1.legend(fontsize=7)
    charts["loss_curves"] = png(fig)

    done = [r for r in rows if r.get("final_train_loss") is not None and r.get("params")]
    if done:
        charts["final_loss"] = png(final_loss_figure(done, fit, no_fit))

    if "lr" in axes and len(axes["lr"]) > 1 and done:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        by_size: dict[int, list] = {}
        for r in done:
            by_size.setdefault(r["params"], []).append((r["lr"], final_loss(r)))
        for size, pts in sorted(by_size.items()):
            pts.sort()
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{size:,} params")
            best = min(pts, key=lambda p: p[1])
            ax.plot([best[0]], [best[1]], "*", ms=16, color=line.get_color(), markeredgecolor="k")
        ax.set(xscale="log", xlabel="learning rate", ylabel="final loss", title="Loss against LR (★ best per size)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        label_log_axis(ax, "x")
        charts["loss_vs_lr"] = png(fig)
    return charts


def run_chart(run: dict) -> bytes:
    plt = _plt()
    recs = sorted(run["metrics"], key=lambda m: m.get("step", 0))
    fig, axs = plt.subplots(2, 2, figsize=(11, 7))
    steps = [m["step"] for m in recs]
    axs[0, 0].plot(steps, [m.get("loss") for m in recs], label="train")
    val = [(m["step"], m["val_loss"]) for m in recs if m.get("val_loss") is not None]
    if val:
        axs[0, 0].plot(*zip(*val), "o-", label="val")
    axs[0, 0].set(title="loss", xlabel="step")
    axs[0, 0].legend()
    axs[0, 1].plot(steps, [m.get("lr") for m in recs])
    axs[0, 1].set(title="learning rate", xlabel="step")
    axs[1, 0].plot(steps, [m.get("tokens_per_s") for m in recs])
    axs[1, 0].set(title="tokens/s (global)", xlabel="step")
    axs[1, 1].plot(steps, [m.get("grad_norm") for m in recs])
    axs[1, 1].set(title="gradient norm", xlabel="step")
    for ax in axs.flat:
        ax.grid(alpha=0.3)
    fig.tight_layout()  # the lower charts' titles clear the upper charts' axis labels
    return png(fig)


def hosts_chart(records: list[dict], strag: dict | None) -> bytes | None:
    """Per-host step time and lateness (steptimes.straggler's) over the run (PNG), the straggler drawn thicker;
    None with records of fewer than 2 processes."""
    from trainer.common import steptimes
    from trainer.experiments.where_time_goes import host_step_times
    per_host = host_step_times(records)
    if len(per_host) < 2:  # one process: the run chart's tokens/s says it all
        return None
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    slow = strag["process"] if strag else None
    for p, xs in sorted(per_host.items()):
        label = f"process {p}" + (" (straggler)" if p == slow else "")
        ax1.plot([s for s, _ in xs], [t * 1e3 for _, t in xs], lw=2.5 if p == slow else 1, label=label)
    rows = sorted((r for r in records if r.get("hosts")), key=lambda r: r["step"])
    for p in sorted(per_host):
        pts = [(r["step"], max(lag, stall, 0.0)) for r in rows
               for q, (lag, stall) in enumerate(zip(steptimes.lags(r["hosts"]), steptimes.stalls(r["hosts"])))
               if q == p and lag is not None]
        ax2.plot([s for s, _ in pts], [v * 1e3 for _, v in pts], lw=2.5 if p == slow else 1, label=f"process {p}")
    ax1.set(title="step time per host (own clock)", xlabel="step", ylabel="ms")
    ax2.set(title="late beyond the other hosts (dispatch or stall)", xlabel="step", ylabel="ms")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return png(fig)


def chips_chart(records: list[dict]) -> bytes | None:
    """Each host's chip use over the run (PNG): mean duty cycle over its chips, and HBM used per chip at most,
    from libtpu's metrics sampled into metrics.jsonl (trainer/common/chipstats.py); None where no host sampled
    any (CPU hosts: no TPU)."""
    from trainer.common import chipstats
    per_host = chipstats.over_run(records)
    if not per_host:
        return None
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    for p, samples in sorted(per_host.items()):
        steps = [s["step"] for s in samples]
        duty = [sum(c["duty_cycle_pct"] for c in s["chips"]) / len(s["chips"]) for s in samples]
        hbm = [max(c["hbm_used_bytes"] for c in s["chips"]) / 2**30 for s in samples]
        ax1.plot(steps, duty, marker="o", ms=3, label=f"process {p}")
        ax2.plot(steps, hbm, marker="o", ms=3, label=f"process {p}")
    total = max(c["hbm_total_bytes"] for xs in per_host.values() for s in xs for c in s["chips"]) / 2**30
    ax2.axhline(total, color="grey", ls="--", lw=1, label=f"HBM per chip ({total:.0f} GiB)")
    ax1.set(title="chip duty cycle (mean over the host's chips)", xlabel="step", ylabel="%", ylim=(0, 105))
    ax2.set(title="HBM used (the fullest chip)", xlabel="step", ylabel="GiB", ylim=(0, total * 1.1))
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return png(fig)
