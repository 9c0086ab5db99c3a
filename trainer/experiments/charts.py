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
    fig.canvas.draw()  # settles the view limits and the renderer
    lo, hi = sorted(ax.get_xlim() if which == "x" else ax.get_ylim())
    renderer = fig.canvas.get_renderer()
    pad = 4 * fig.dpi / 72  # 4 points between labels

    def fits(ticks) -> bool:
        axis.set_major_locator(FixedLocator(ticks))
        fig.canvas.draw()
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

def _label_points(ax, points: list[tuple[float, float, str]]) -> None:
    """Each point's name beside it: above and to the right, or for points in the right third below and to the
    left (inside the axes, and on the far side of a falling curve through the points)."""
    lo, hi = ax.get_xlim()
    log = ax.get_xscale() == "log"
    for x, y, name in points:
        frac = (math.log(x / lo) / math.log(hi / lo)) if log else (x - lo) / ((hi - lo) or 1)
        right = frac > 0.66
        ax.annotate(name, (x, y), xytext=(-6, -6) if right else (6, 6), textcoords="offset points",
                    ha="right" if right else "left", va="top" if right else "bottom", fontsize=7,
                    gid=POINT_LABEL_GID)


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
    elif no_fit:
        text = textwrap.fill(no_fit.replace(LAW, LAW.replace(" ", "\u00a0")), 48)  # the law on one line
        ax2.text(0.97, 0.96, text, transform=ax2.transAxes, ha="right", va="top", fontsize=8,
                 multialignment="left",
                 bbox=dict(boxstyle="round", fc="white", ec="0.7"), gid=NO_FIT_GID)
    ax1.set(xlabel="non-embedding parameters", ylabel="final loss (best val, else train)",
            title="Final loss against parameters", xscale="log", yscale="log")
    ax2.set(xlabel="training FLOPs $C$", ylabel="final loss $L$", title="Final loss against compute",
            xscale="log", yscale="log")
    for ax, xs in ((ax1, sizes), (ax2, flops)):
        ax.margins(x=0.12, y=0.15)  # room for the point labels inside the axes
        ax.grid(alpha=0.3, which="both")
        label_log_axis(ax, "x")
        label_log_axis(ax, "y")
        _label_points(ax, [(x, y, r["trial"]) for x, y, r in zip(xs, loss, done)])
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

