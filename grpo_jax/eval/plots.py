"""PNG plots of training curves (matplotlib, headless)."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from grpo_jax.eval.stats import t_band


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_history(history: Sequence[Mapping], keys: Sequence[str], path: str, *, title: str = "") -> str:
    """One panel per key, x = step; points only where a record has the key (eval every N)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        pts = [(h["step"], h[key]) for h in history if isinstance(h.get(key), (int, float))]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, ms=3)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)  # figures stay open until closed: a long run would leak them
    return path


def moving_average(rows: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last `window` points of each row ([seeds, points]); the first
    points average over what is available."""
    if window <= 1:
        return rows
    csum = np.cumsum(rows, axis=-1)
    out = csum.copy()
    out[..., window:] = csum[..., window:] - csum[..., :-window]
    counts = np.minimum(np.arange(1, rows.shape[-1] + 1), window)
    return out / counts


def plot_runs(curves: Mapping[str, Sequence[Sequence[float]]], steps: Sequence[float], path: str, *,
              ylabel: str, title: str = "", xlabel: str = "step", logx: bool = False,
              bars: Mapping[str, float] | None = None, bar_label: str = "", smooth: int = 1,
              references: Mapping[str, float] | None = None) -> str:
    """Mean over seeds with its 95% Student-t interval as a band (`stats.t_band`), one line
    per method. curves[name] = [seed][point].
    `references` (label -> value) are dashed horizontal lines, such as a bar to clear: not runs,
    so their labels carry no seed count.
    `bars` (one value per method, e.g. peak memory) adds a bar panel on the right in the
    same colours. `smooth` > 1 plots each seed's trailing moving average over that many
    points (noisy per-step rewards) before the mean and band are taken."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2 if bars else 1, figsize=(10.5 if bars else 6, 4), squeeze=False)
    ax = axes[0][0]
    colors = {}
    for name, runs in curves.items():
        arr = moving_average(np.asarray(runs, dtype=float), smooth)
        mean, low, high = t_band(arr)
        (line,) = ax.plot(steps, mean, label=f"{name} (n={arr.shape[0]})")
        colors[name] = line.get_color()
        if arr.shape[0] > 1:
            ax.fill_between(steps, low, high, alpha=0.2, color=line.get_color())
    for name, value in (references or {}).items():
        ax.axhline(value, linestyle="--", color="gray", label=name)
    if bars:
        bx = axes[0][1]
        names = list(bars)
        rects = bx.bar(names, [bars[n] for n in names], color=[colors.get(n, "gray") for n in names])
        bx.bar_label(rects, fmt="%.1f")
        bx.set_ylabel(bar_label)
        bx.grid(alpha=0.3, axis="y")
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    return _save(fig, path)
