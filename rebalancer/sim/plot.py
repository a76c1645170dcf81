"""Balancedness over time for the policies of one run, rebalance events marked.

One small PNG per trace: the operator sees at a glance where a frozen placement goes
stale, where the periodic refits land, and when the adaptive controller chose to move.
matplotlib is imported here only, with the non-interactive backend.
"""

from __future__ import annotations

from pathlib import Path

from rebalancer.errors import InputError
from rebalancer.sim.engine import PolicyResult

# One fixed colour per policy so plots of different traces read the same way.
COLOURS = {
    "none": "#9e9e9e",
    "static": "#8d6e63",
    "periodic": "#fb8c00",
    "adaptive": "#1e88e5",
    "follow": "#43a047",
    "oracle": "#212121",
    "hindsight": "#8e24aa",
}


def plot_balancedness(
    results: dict[str, PolicyResult], path: str | Path, title: str, window_seconds: float
) -> None:
    """Write a PNG of per-window balancedness; markers at each policy's rebalances."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise InputError("--plot needs matplotlib (pip install matplotlib)") from exc
    fig, ax = plt.subplots(figsize=(8.0, 3.6), dpi=80)
    for name, res in results.items():
        colour = COLOURS.get(name)
        xs = [w * window_seconds / 60.0 for w in range(len(res.balancedness_per_window))]
        width = 1.8 if name == "adaptive" else 1.0
        ax.plot(xs, res.balancedness_per_window, color=colour, lw=width, label=name)
        if name in ("periodic", "adaptive") and res.rebalance_windows:
            marks = [w for w in res.rebalance_windows if w < len(res.balancedness_per_window)]
            ax.plot(
                [w * window_seconds / 60.0 for w in marks],
                [res.balancedness_per_window[w] for w in marks],
                linestyle="none",
                marker="v" if name == "periodic" else "o",
                ms=4,
                color=colour,
            )
    ax.set_xlabel("time (minutes of windows)")
    ax.set_ylabel("balancedness (mean/max GPU load)")
    ax.set_ylim(0.0, 1.02)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=3, loc="lower right")
    fig.tight_layout()
    fig.savefig(Path(path))
    plt.close(fig)
