"""The Grafana dashboard (deploy/grafana/rebalancer.json) without Grafana: every panel's
queries, with Grafana's variables set as Grafana sets them, asked of a real Prometheus
(rebalancer.launch.prometheus) over a live run, and each panel drawn from the answers at
its place on the dashboard's grid (matplotlib, imported when drawing).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rebalancer.launch.prometheus import Prometheus


def grafana_to_promql(
    expr: str, deployment: str = ".*", rate_interval: str = "5m", range_: str = "1h"
) -> str:
    """A dashboard query with Grafana's variables replaced (by default with values any
    PromQL parser accepts; for a live run, with the run's)."""
    for var, value in (
        ("$__rate_interval", rate_interval),
        ("$__interval", rate_interval),
        ("$__range", range_),
        ("${deployment}", deployment),
        ("$deployment", deployment),
    ):
        expr = expr.replace(var, value)
    if "$" in expr:
        raise ValueError(f"unknown Grafana variable in {expr!r}")
    return expr


@dataclass(frozen=True)
class Query:
    panel: str  # the panel's title
    ref: str  # the target's refId
    legend: str  # the target's legendFormat
    expr: str  # as the dashboard holds it


def dashboard_queries(dashboard: dict[str, Any]) -> list[Query]:
    """Every query of every panel (rows hold none)."""
    return [
        Query(p["title"], t["refId"], t.get("legendFormat", ""), t["expr"])
        for p in dashboard["panels"]
        if p["type"] != "row"
        for t in p["targets"]
    ]


def rate_interval(step: float, scrape_interval: float) -> str:
    """Grafana's $__rate_interval: max($__interval + scrape interval, 4 x scrape interval)."""
    return f"{max(step + scrape_interval, 4 * scrape_interval):g}s"


# One query's answer: Prometheus's query_range matrix.
Answers = dict[Query, list[dict[str, Any]]]


def ask(
    prom: Prometheus, queries: list[Query], deployment: str, start: float, end: float, step: float
) -> Answers:
    """Each query over [start, end], variables as Grafana sets them for that span."""
    interval = rate_interval(step, prom.scrape_interval)
    span = f"{max(1, math.ceil(end - start))}s"
    return {
        q: prom.query_range(grafana_to_promql(q.expr, deployment, interval, span), start, end, step)
        for q in queries
    }


def has_data(answer: list[dict[str, Any]]) -> bool:
    """Whether a query_range answer holds a number anywhere (a series of NaNs shows nothing)."""
    return any(not math.isnan(float(v)) for series in answer for _, v in series["values"])


def legend(fmt: str, labels: dict[str, str]) -> str:
    return (
        re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip() or "value"
    )


def panel_series(
    query: Query, answer: list[dict[str, Any]], start: float, step: float, points: int
) -> dict[str, list[float]]:
    """The answer as named series on the grid start + k * step (NaN where it has none)."""
    out = {}
    for series in answer:
        values = [math.nan] * points
        for t, v in series["values"]:
            k = round((float(t) - start) / step)
            if 0 <= k < points:
                values[k] = float(v)
        out[legend(query.legend, series["metric"])] = values
    return out


# ------------------------------------------------------------------ drawing


def draw(
    dashboard: dict[str, Any],
    answers: Answers,
    start: float,
    end: float,
    step: float,
    out: Path,
    title: str,
) -> list[str]:
    """Every panel at its grid place, from the answers; one report line per panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = dashboard["panels"]
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    unit_h = 0.42  # inches per grid unit
    fig = plt.figure(figsize=(24, bottom * unit_h + 1.2), dpi=70)
    fig.patch.set_facecolor("#111217")
    fig.suptitle(title, color="white", fontsize=16, y=0.997)
    points = int(round((end - start) / step)) + 1
    times = np.arange(points) * step
    by_panel: dict[str, list[Query]] = {}
    for q in answers:
        by_panel.setdefault(q.panel, []).append(q)
    report = []

    def axes(pos: dict[str, int]) -> Any:
        x0, w = pos["x"] / 24, pos["w"] / 24
        top = 1 - (pos["y"] * unit_h + 1.0) / (bottom * unit_h + 1.2)
        h = pos["h"] * unit_h / (bottom * unit_h + 1.2)
        ax = fig.add_axes(
            (x0 + 0.03 * w, top - h + 0.35 * h / pos["h"], w * 0.93, h - 0.9 * h / pos["h"])
        )
        ax.set_facecolor("#181b1f")
        for spine in ax.spines.values():
            spine.set_color("#333")
        ax.tick_params(colors="#aaa", labelsize=8)
        return ax

    for p in panels:
        pos, kind = p["gridPos"], p["type"]
        if kind == "row":
            y = 1 - (pos["y"] * unit_h + 1.0 + 0.2) / (bottom * unit_h + 1.2)
            fig.text(
                0.005,
                y,
                p["title"].replace("$deployment", "demo"),
                color="white",
                fontsize=14,
                weight="bold",
            )
            continue
        ax = axes(pos)
        ax.set_title(p["title"], color="white", fontsize=11, loc="left")
        series: dict[str, list[float]] = {}
        empty = []
        for q in by_panel.get(p["title"], []):
            got = panel_series(q, answers[q], start, step, points)
            if not any(not math.isnan(v) for values in got.values() for v in values):
                empty.append(q.ref)
            series.update(got)
        report.append(
            f"{p['title']}: {len(series)} series"
            + (f", queries {empty} returned no data" if empty else "")
        )
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        if kind == "stat":
            ax.set_xticks([])
            ax.set_yticks([])
            mappings = p["fieldConfig"]["defaults"].get("mappings") or []
            texts = []
            for name, values in series.items():
                last = next((v for v in reversed(values) if not math.isnan(v)), math.nan)
                text = fmt(last, unit)
                for m in mappings:
                    text = (
                        m.get("options", {})
                        .get(str(int(last)) if not math.isnan(last) else "", {})
                        .get("text", text)
                    )
                mode = p["options"].get("textMode")
                texts.append(
                    name if mode == "name" else text if mode == "value" else f"{name}: {text}"
                )
            ax.text(
                0.5,
                0.45,
                "\n".join(texts) or "no data",
                ha="center",
                va="center",
                color="#73bf69",
                fontsize=22 if len(texts) == 1 else 15,
                transform=ax.transAxes,
                weight="bold",
            )
        elif kind == "heatmap":
            names = sorted(series, key=lambda s: int(s) if s.isdigit() else 0)
            if names:
                grid = np.array([series[n] for n in names])
                im = ax.imshow(
                    grid,
                    aspect="auto",
                    cmap="Oranges",
                    origin="lower",
                    interpolation="nearest",
                    extent=(times[0], times[-1], -0.5, len(names) - 0.5),
                )
                ax.set_yticks(range(len(names)), [f"layer {n}" for n in names])
                ax.set_xlabel("seconds into the run", color="#aaa", fontsize=8)
                cb = fig.colorbar(im, ax=ax, fraction=0.03)
                cb.ax.tick_params(colors="#aaa", labelsize=8)
                cb.set_label("max/mean GPU load", color="#aaa")
        else:
            bars = p["fieldConfig"]["defaults"]["custom"]["drawStyle"] == "bars"
            for name, values in series.items():
                ax.plot(
                    times,
                    values,
                    label=name,
                    linewidth=1.4,
                    drawstyle="steps-post" if bars else "default",
                )
            ax.grid(color="#2a2d33")
            ax.set_xlim(times[0], times[-1])
            if unit == "percentunit":
                ax.set_ylim(top=1.0)
            if series:
                ax.legend(
                    fontsize=7,
                    loc="best",
                    facecolor="#181b1f",
                    labelcolor="#ccc",
                    framealpha=0.8,
                    ncol=2,
                )
            ax.set_xlabel(f"seconds into the run ({unit})", color="#777", fontsize=7)
        if empty:
            ax.text(
                0.99,
                0.02,
                f"no data: {','.join(empty)}",
                ha="right",
                color="#e0a040",
                fontsize=8,
                transform=ax.transAxes,
            )
    fig.savefig(out, facecolor=fig.get_facecolor())
    plt.close(fig)
    return report


def fmt(value: float, unit: str) -> str:
    if math.isnan(value):
        return "no data"
    if unit == "percentunit":
        return f"{value:.1%}"
    if unit == "bytes":
        return f"{value / 1e6:.1f} MB"
    if unit == "s":
        return f"{value:.3g} s"
    return f"{value:.0f}" if value == int(value) else f"{value:.3g}"


def last_all_connected(
    prom: Prometheus, deployment: str, start: float, end: float, step: float
) -> float:
    """The last time in [start, end] every rank of `deployment` was connected (the run,
    before the workers leave), or `end` if never."""
    answer = prom.query_range(
        f'rebalancer_connected_ranks{{deployment="{deployment}"}} '
        f'== rebalancer_ranks{{deployment="{deployment}"}}',
        start,
        end,
        step,
    )
    times = [float(t) for series in answer for t, _ in series["values"]]
    return max(times, default=end)
