"""Render the Grafana dashboard (deploy/grafana/rebalancer.json) over a live demo run,
without Grafana: what an operator would see, as a PNG (docs/dashboard.png).

It starts `rebalancer demo --metrics-port 0` (a real controller, sidecars and CPU
workers), scrapes the controller's /metrics every `--every` seconds while the demo runs,
then evaluates each panel's queries on the scraped samples and draws the panel at its
place on the dashboard's grid. The evaluator knows the shapes of PromQL the dashboard
uses (a selector with matchers and an optional `== 1`; `sum`/`max` by labels of a
selector, or of `rate`/`increase` over a range; `histogram_quantile` of a summed rate or
increase of buckets; a ratio of two summed rates); a panel with any other query says
"not evaluated" on the image, as do the sidecar panels (the demo's sidecars are not
scraped). Windows are the demo's: `$__rate_interval` is 10 s here, not Grafana's.

    .venv/bin/python scripts/render_dashboard.py --out docs/dashboard.png
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "rebalancer.json"
RATE_WINDOW = 10.0  # seconds standing in for $__rate_interval on a one-minute run

Labels = tuple[tuple[str, str], ...]
# One scrape: (seconds since the first, {(name, labels): value})
Scrape = tuple[float, dict[tuple[str, Labels], float]]


def parse_exposition(text: str) -> dict[tuple[str, Labels], float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def run_demo(args: argparse.Namespace) -> list[Scrape]:
    """Run the demo, scraping its controller until it ends."""
    cmd = [sys.executable, "-m", "rebalancer", "demo", "--metrics-port", "0", "--windows", str(args.windows)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    scrapes: list[Scrape] = []
    port: list[int] = []
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", line)
            if m:
                port.append(int(m.group(1)))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    start = time.monotonic()
    try:
        while proc.poll() is None:
            if port:
                try:
                    text = urllib.request.urlopen(f"http://127.0.0.1:{port[0]}/metrics", timeout=2).read().decode()
                    scrapes.append((time.monotonic() - start, parse_exposition(text)))
                except OSError:
                    pass  # the controller is stopping
            time.sleep(args.every)
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(60)
        reader.join(5)
    if proc.returncode != 0:
        sys.stdout.write("".join(lines[-30:]))
        raise SystemExit(f"demo exited with {proc.returncode}")
    summary = [ln for ln in lines if ln.startswith("  ")]
    print("".join(summary[-24:]), end="")
    return scrapes


# ------------------------------------------------------------------ a small PromQL subset

_MATCHER = re.compile(r'(\w+)\s*(=~|!=|=)\s*"([^"]*)"')


def select(scrape: dict[tuple[str, Labels], float], name: str, matchers: str) -> dict[Labels, float]:
    conds = _MATCHER.findall(matchers or "")
    out = {}
    for (n, labels), v in scrape.items():
        if n != name:
            continue
        d = dict(labels)
        ok = True
        for key, op, value in conds:
            have = d.get(key, "")
            if op == "=" and have != value or op == "!=" and have == value:
                ok = False
            elif op == "=~" and not re.fullmatch(value, have):
                ok = False
        if ok:
            out[labels] = v
    return out


def group(values: dict[Labels, float], by: list[str] | None, how: str) -> dict[Labels, float]:
    out: dict[Labels, list[float]] = defaultdict(list)
    for labels, v in values.items():
        d = dict(labels)
        out[tuple((k, d.get(k, "")) for k in (by or []))].append(v)
    return {k: float(sum(vs) if how == "sum" else max(vs)) for k, vs in out.items()}


def over_range(scrapes: list[Scrape], i: int, name: str, matchers: str, fn: str, window: float) -> dict[Labels, float]:
    """rate or increase of a counter at scrape i over the last `window` seconds."""
    t1, now = scrapes[i]
    j = i
    while j > 0 and t1 - scrapes[j - 1][0] <= window:
        j -= 1
    t0, then = scrapes[j]
    a, b = select(then, name, matchers), select(now, name, matchers)
    out = {}
    for labels, v in b.items():
        dv = v - a.get(labels, 0.0) if v >= a.get(labels, 0.0) else v  # a reset starts from 0
        out[labels] = dv / max(t1 - t0, 1e-9) if fn == "rate" else dv
    return out


def quantile(q: float, buckets: dict[Labels, float], by: list[str]) -> dict[Labels, float]:
    """histogram_quantile over buckets summed by `by` + le (linear inside a bucket)."""
    groups: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
    for labels, v in buckets.items():
        d = dict(labels)
        groups[tuple((k, d.get(k, "")) for k in by if k != "le")].append((float(d["le"]), v))
    out = {}
    for key, pairs in groups.items():
        pairs.sort()
        total = pairs[-1][1]
        if total <= 0:
            continue
        rank, prev_le, prev_c = q * total, 0.0, 0.0
        for le, c in pairs:
            if c >= rank:
                if math.isinf(le):
                    out[key] = prev_le
                else:
                    out[key] = prev_le + (le - prev_le) * (rank - prev_c) / max(c - prev_c, 1e-12)
                break
            prev_le, prev_c = le, c
    return out


SEL = r"(\w+)(\{[^}]*\})?"
RANGE = r"\[([^\]]+)\]"


def evaluate(expr: str, scrapes: list[Scrape], i: int) -> dict[Labels, float] | None:
    """The query's value at scrape i; None when its shape is not one this evaluator knows."""
    expr = expr.replace('=~"$deployment"', '=~".*"').strip()
    now = scrapes[i][1]

    def window(text: str) -> float:
        if text == "$__rate_interval":
            return RATE_WINDOW
        if text == "$__range" or text == "1h":
            return math.inf
        raise ValueError(text)

    if m := re.fullmatch(SEL + r"(\s*==\s*1)?", expr):
        values = select(now, m.group(1), m.group(2) or "")
        return {k: v for k, v in values.items() if v == 1} if m.group(3) else values
    if m := re.fullmatch(r"(sum|max) by \(([^)]*)\) \(" + SEL + r"\)", expr):
        return group(select(now, m.group(3), m.group(4) or ""), [s.strip() for s in m.group(2).split(",")], m.group(1))
    if m := re.fullmatch(r"(sum|max)(?: by \(([^)]*)\))?\s*\((rate|increase)\(" + SEL + RANGE + r"\)\)", expr):
        by = [s.strip() for s in m.group(2).split(",")] if m.group(2) else []
        return group(over_range(scrapes, i, m.group(4), m.group(5) or "", m.group(3), window(m.group(6))), by, m.group(1))
    if m := re.fullmatch(r"histogram_quantile\(([\d.]+), sum by \(([^)]*)\) \((rate|increase)\(" + SEL + RANGE + r"\)\)\)", expr):
        by = [s.strip() for s in m.group(2).split(",")]
        summed = group(over_range(scrapes, i, m.group(4), m.group(5) or "", m.group(3), window(m.group(6))), by, "sum")
        return quantile(float(m.group(1)), {tuple(k): v for k, v in summed.items()}, by)
    if m := re.fullmatch(r"(.+?) / (.+)", expr):
        a, b = evaluate(m.group(1), scrapes, i), evaluate(m.group(2), scrapes, i)
        if a is None or b is None:
            return None
        return {k: a[k] / b[k] for k in a if k in b and b[k] > 0}
    return None


def legend(fmt: str, labels: Labels) -> str:
    d = dict(labels)
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: d.get(m.group(1), ""), fmt).strip() or "value"


# ------------------------------------------------------------------ drawing

def draw(dashboard: dict[str, Any], scrapes: list[Scrape], out: Path, title: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = dashboard["panels"]
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    unit_h = 0.42  # inches per grid unit
    fig = plt.figure(figsize=(24, bottom * unit_h + 1.2), dpi=70)
    fig.patch.set_facecolor("#111217")
    fig.suptitle(title, color="white", fontsize=18, y=0.997)
    times = np.array([t for t, _ in scrapes])
    report = []

    def axes(pos: dict[str, int], pad: float = 0.2) -> Any:
        x0, w = pos["x"] / 24, pos["w"] / 24
        top = 1 - (pos["y"] * unit_h + 1.0) / (bottom * unit_h + 1.2)
        h = pos["h"] * unit_h / (bottom * unit_h + 1.2)
        ax = fig.add_axes((x0 + 0.03 * w, top - h + 0.35 * h / pos["h"], w * 0.93, h - 0.9 * h / pos["h"]))
        ax.set_facecolor("#181b1f")
        for spine in ax.spines.values():
            spine.set_color("#333")
        ax.tick_params(colors="#aaa", labelsize=8)
        return ax

    for p in panels:
        pos, kind = p["gridPos"], p["type"]
        if kind == "row":
            y = 1 - (pos["y"] * unit_h + 1.0 + 0.2) / (bottom * unit_h + 1.2)
            fig.text(0.005, y, p["title"].replace("$deployment", "demo"), color="white", fontsize=14, weight="bold")
            continue
        ax = axes(pos)
        ax.set_title(p["title"], color="white", fontsize=11, loc="left")
        series: dict[str, list[float]] = {}
        unknown = []
        for t in p["targets"]:
            rows = [evaluate(t["expr"], scrapes, i) for i in range(len(scrapes))]
            if any(r is None for r in rows):
                unknown.append(t["refId"])
                continue
            keys = sorted({k for r in rows if r for k in r})
            for k in keys:
                name = legend(t.get("legendFormat", ""), k)
                series[name] = [r.get(k, float("nan")) if r else float("nan") for r in rows]
        if unknown and not series:
            ax.text(0.5, 0.5, "not evaluated here\n(sidecars not scraped in this render)" if "sidecar" in json.dumps(p["targets"]) else "not evaluated here",
                    ha="center", va="center", color="#888", fontsize=11, transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            report.append(f"{p['title']}: not evaluated")
            continue
        report.append(f"{p['title']}: {len(series)} series" + (f" (targets {unknown} not evaluated)" if unknown else ""))
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        if kind == "stat":
            ax.set_xticks([])
            ax.set_yticks([])
            mappings = p["fieldConfig"]["defaults"].get("mappings") or []
            texts = []
            for name, values in series.items():
                last = next((v for v in reversed(values) if not math.isnan(v)), float("nan"))
                text = fmt(last, unit)
                for m in mappings:
                    text = m.get("options", {}).get(str(int(last)) if not math.isnan(last) else "", {}).get("text", text)
                mode = p["options"].get("textMode")
                texts.append(name if mode == "name" else text if mode == "value" else f"{name}: {text}")
            ax.text(0.5, 0.45, "\n".join(texts) or "no data", ha="center", va="center", color="#73bf69",
                    fontsize=22 if len(texts) == 1 else 15, transform=ax.transAxes, weight="bold")
        elif kind == "heatmap":
            names = sorted(series, key=lambda s: int(s) if s.isdigit() else 0)
            if names:
                grid = np.array([series[n] for n in names])
                im = ax.imshow(grid, aspect="auto", cmap="Oranges", origin="lower", interpolation="nearest",
                               extent=(times[0], times[-1], -0.5, len(names) - 0.5))
                ax.set_yticks(range(len(names)), [f"layer {n}" for n in names])
                ax.set_xlabel("seconds into the demo", color="#aaa", fontsize=8)
                cb = fig.colorbar(im, ax=ax, fraction=0.03)
                cb.ax.tick_params(colors="#aaa", labelsize=8)
                cb.set_label("max/mean GPU load", color="#aaa")
        else:
            for name, values in series.items():
                ax.plot(times, values, label=name, linewidth=1.4,
                        drawstyle="steps-post" if p["fieldConfig"]["defaults"]["custom"]["drawStyle"] == "bars" else "default")
            ax.grid(color="#2a2d33")
            if unit == "percentunit":
                ax.set_ylim(top=1.0)
            if series:
                ax.legend(fontsize=7, loc="best", facecolor="#181b1f", labelcolor="#ccc", framealpha=0.8, ncol=2)
            ax.set_xlabel(f"seconds into the demo ({unit})", color="#777", fontsize=7)
        if unknown:
            ax.text(0.99, 0.02, f"targets {','.join(unknown)} not evaluated", ha="right", color="#888", fontsize=7,
                    transform=ax.transAxes)
    fig.savefig(out, facecolor=fig.get_facecolor())
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "dashboard.png"))
    p.add_argument("--windows", type=int, default=40, help="the demo's windows per rank")
    p.add_argument("--every", type=float, default=1.0, help="seconds between scrapes")
    p.add_argument("--scrapes", help="also write the scraped samples here (JSON)")
    p.add_argument("--from-scrapes", help="draw from samples --scrapes wrote (no demo run)")
    args = p.parse_args()
    if args.from_scrapes:
        raw = json.loads(Path(args.from_scrapes).read_text())
        scrapes = [(t, {(n, tuple(tuple(kv) for kv in lb)): v for n, lb, v in s}) for t, s in raw]
    else:
        scrapes = run_demo(args)
    # Up to the last scrape with the workers connected: after that the demo is tearing down.
    live = [i for i, (_, s) in enumerate(scrapes)
            if any(n == "rebalancer_connected_ranks" and v > 0 for (n, _), v in s.items())]
    scrapes = scrapes[: live[-1] + 1] if live else scrapes
    if len(scrapes) < 3:
        raise SystemExit(f"only {len(scrapes)} scrapes: the demo ended too soon")
    if args.scrapes:
        Path(args.scrapes).write_text(json.dumps([[t, [[n, list(lb), v] for (n, lb), v in s.items()]] for t, s in scrapes]))
    dashboard = json.loads(DASHBOARD.read_text())
    title = (f"{dashboard['title']}: rendered by scripts/render_dashboard.py (not Grafana) from "
             f"{len(scrapes)} scrapes of a live `rebalancer demo` (4 CPU workers in 2 pods), until the workers finished")
    for line in draw(dashboard, scrapes, Path(args.out), title):
        print(line)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
