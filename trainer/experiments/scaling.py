"""The scaling-law fit of a sweep: L(C) = a * C^-b + c over the best trial of each model size (`frontier`).

Least squares with one-sigma uncertainties from the fit's covariance: scipy's curve_fit when scipy is there,
else a numpy Levenberg-Marquardt with the same covariance. Jax-free.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.common.config import UsageError

PARAMETERS = 3  # a, b, c
# More points than parameters: through PARAMETERS points or fewer some curve of the law passes exactly, and the
# fit would say nothing about the law (nor have an uncertainty).
MIN_POINTS = PARAMETERS + 1
LAW = "L = a·C^-b + c"


@dataclass(frozen=True)
class PowerLaw:
    """L(C) = a * C^-b + c, with one-sigma uncertainties from the fit's covariance."""
    a: float
    b: float
    c: float
    a_err: float
    b_err: float
    c_err: float
    n: int

    def __call__(self, x):
        import numpy as np
        return self.a * np.asarray(x, float) ** -self.b + self.c

    def describe(self, x: str = "C") -> str:
        return (f"L({x}) = a * {x}^-b + c with a = {self.a:.4g} ± {self.a_err:.2g}, b = {self.b:.4g} ± "
                f"{self.b_err:.2g}, c = {self.c:.4g} ± {self.c_err:.2g} ({self.n} points)")


def final_loss(r: dict) -> float | None:
    """The loss a trial is judged by: its best validation loss, else its last training loss."""
    return r["best_val_loss"] if r.get("best_val_loss") is not None else r.get("final_train_loss")


def frontier(rows: list[dict]) -> list[tuple[float, float]]:
    """(FLOPs, loss) of the best finished trial of each model size: what a scaling law in compute describes
    (the other axes of the sweep, such as the learning rate, are tuned away)."""
    best: dict[int, dict] = {}
    for r in rows:
        if r["status"] == "done" and r.get("flops") and final_loss(r) is not None:
            if r["params"] not in best or final_loss(r) < final_loss(best[r["params"]]):
                best[r["params"]] = r
    return sorted((r["flops"], final_loss(r)) for r in best.values())


def plus_minus(value: float, err: float) -> str:
    """'0.0523 ± 0.0041': the error to 2 significant digits, the value to the same decimals."""
    if not (math.isfinite(err) and err > 0):
        return f"{value:.4g} ± ?"
    decimals = max(0, 1 - math.floor(math.log10(err)))
    return f"{value:.{decimals}f} ± {err:.{decimals}f}"


def fit_power_law(x, y, use_scipy: bool = True) -> PowerLaw:
    """Least-squares fit of y = a * x^-b + c (b > 0, c < min y). x is scaled by its geometric mean for the
    fit (x spans many decades), then a and its error are mapped back by the delta method."""
    import numpy as np
    x, y = np.asarray(x, float), np.asarray(y, float)
    ok = np.isfinite(x) & np.isfinite(y) & (x > 0)
    x, y = x[ok], y[ok]
    if len(x) < MIN_POINTS:
        raise UsageError(f"a power-law fit needs at least {MIN_POINTS} finished points with loss and compute, "
                         f"got {len(x)}")
    x0 = float(np.exp(np.mean(np.log(x))))
    u = x / x0
    f = lambda u, a, b, c: a * u ** -b + c
    p0 = _initial(u, y)
    p = cov = None
    if use_scipy:
        try:
            from scipy.optimize import curve_fit
        except ImportError:
            curve_fit = None
        if curve_fit is not None:
            lo, hi = [0.0, 0.0, -np.inf], [np.inf, 10.0, float(y.min())]
            p, cov = curve_fit(f, u, y, p0=np.clip(p0, np.array(lo) + 1e-12, np.array(hi) - 1e-12),
                               bounds=(lo, hi), maxfev=20000)
    if p is None:
        p, cov = _levenberg_marquardt(f, u, y, p0)
    a_s, b, c = (float(v) for v in p)
    err = np.sqrt(np.clip(np.diag(cov), 0, None)) if np.all(np.isfinite(cov)) else np.full(3, np.inf)
    # a = a_s * x0^b: d(ln a) = d(ln a_s) + ln(x0) db
    ln0 = math.log(x0)
    var_ln_a = (cov[0, 0] / a_s**2 + ln0**2 * cov[1, 1] + 2 * ln0 * cov[0, 1] / a_s) if a_s > 0 else np.inf
    a = a_s * x0**b
    return PowerLaw(a=a, b=b, c=c, a_err=float(abs(a) * math.sqrt(max(var_ln_a, 0.0))), b_err=float(err[1]),
                    c_err=float(err[2]), n=len(x))


def _initial(u, y):
    """Scan c below min(y); for each, a line through log(y - c) vs log(u) gives a and b. Keep the best."""
    import numpy as np
    best, span = None, float(y.max() - y.min()) or 1.0
    for c in float(y.min()) - span * np.geomspace(1e-3, 100, 60):
        z = np.log(y - c)
        slope, icpt = np.polyfit(np.log(u), z, 1)
        a, b = math.exp(icpt), -slope
        sse = float(np.sum((a * u ** -b + c - y) ** 2))
        if b > 0 and (best is None or sse < best[0]):
            best = (sse, np.array([a, b, c]))
    return best[1] if best is not None else np.array([span, 0.5, float(y.min()) - span])


def _levenberg_marquardt(f, u, y, p, iters: int = 200):
    """numpy-only fit (when scipy is absent), covariance = s^2 (J^T J)^-1 as curve_fit reports it."""
    import numpy as np
    p, lam = np.asarray(p, float), 1e-3

    def jac(p):
        a, b, _ = p
        return np.stack([u ** -b, -a * np.log(u) * u ** -b, np.ones_like(u)], axis=1)
    r = y - f(u, *p)
    for _ in range(iters):
        J = jac(p)
        A = J.T @ J
        step = np.linalg.solve(A + lam * np.diag(np.diag(A)), J.T @ r)
        q = p + step
        rq = y - f(u, *q)
        if np.sum(rq**2) < np.sum(r**2):
            p, r, lam = q, rq, lam / 3
            if np.max(np.abs(step) / (np.abs(p) + 1e-12)) < 1e-10:
                break
        else:
            lam *= 5
    J = jac(p)
    dof = max(len(y) - 3, 1)
    cov = np.linalg.pinv(J.T @ J) * (np.sum(r**2) / dof)
    return p, cov
