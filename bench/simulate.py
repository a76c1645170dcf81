"""What online rebalancing buys on real routing: every policy on drifting traces.

Builds drifting traces from the summed DeepSeek-V3 workload files (phase changes, smooth
mixes, bursts; each at 65,536 and, "-noisy", 8,192 tokens per window) at G=32, P=288 on
4 nodes, and replays the real Mixtral GSM8K routing at
G=8 with P=8 and P=16; runs every policy (rebalancer.sim.POLICIES) on each, prints a table, checks
the targets of the simulator issue, writes one plot per trace into docs/ and replaces the
`## Simulator` section of BENCHMARKS.md. The changing policies start from the trivial
placement (what an engine loads); a second pass starts them from the static fit (an
engine given a recorded distribution) and is summarised beside it.

    python -m bench.simulate                 # everything (several minutes on 2 cores)
    python -m bench.simulate --windows 60 --no-write   # a quick look
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rebalancer.controller.decide import PolicyConfig
from rebalancer.datasets import mixtral_gsm8k_file
from rebalancer.sim import (
    POLICIES,
    SimConfig,
    Trace,
    TraceGenConfig,
    deepseek_v3_sources,
    load_trace,
    make_trace,
    simulate,
)
from rebalancer.sim.cost import MIXTRAL_8X7B_EXPERT_BYTES
from rebalancer.sim.engine import PolicyResult
from rebalancer.sim.plot import plot_balancedness
from rebalancer.wire.shape import ClusterShape

REPO = Path(__file__).resolve().parent.parent
SECTION = "## Simulator"


@dataclass
class Case:
    name: str
    trace: Trace
    config: SimConfig
    # Unpredictable bursts are exempt from the 95%-of-oracle target.
    predictable: bool


def _case(name: str, trace: Trace, config: SimConfig, predictable: bool) -> Case:
    """A case whose adaptive policy has the timing derived for the trace's windows (what
    `rebalancer simulate` runs by default; PolicyConfig's defaults are for ~1 s windows)."""
    policy = config.policy.for_windows(config.shape, trace.window_seconds)
    return Case(name, trace, dataclasses.replace(config, policy=policy), predictable)


# Fast drift (opt-in: `--traces ...,fast`): one-second windows, workload phases of 2-6
# windows and mixes that turn over in ~12, the case the derived minimum interval is for.
FAST: dict[str, dict[str, Any]] = {
    "phase": {"phase_min_windows": 2, "phase_max_windows": 6},
    "mix": {"mix_period_windows": 12.0},
    "burst": {},
}


def _cases(windows: int, tokens: int, which: set[str], seed_offset: int = 0) -> list[Case]:
    cases: list[Case] = []
    policy = PolicyConfig()
    if which & {"phase", "mix", "burst", "fast"}:
        sources = deepseek_v3_sources()

        def ds(trace: Trace) -> SimConfig:
            shape = ClusterShape(
                num_layers=trace.num_layers,
                num_logical=trace.num_experts,
                num_slots=288,
                num_gpus=32,
                num_nodes=4,
            )
            return SimConfig(shape=shape, policy=policy)

        for kind, seed in (("phase", 11), ("mix", 12), ("burst", 13)):
            if kind not in which:
                continue
            # The same drift seen through 8x fewer tokens per window: noisier windows.
            for tok, suffix in ((tokens, ""), (max(1, tokens // 8), "-noisy")):
                cfg = TraceGenConfig(
                    kind=kind, windows=windows, tokens_per_window=tok, seed=seed + seed_offset
                )
                trace = make_trace(sources, cfg, name=f"deepseek-v3-{kind}{suffix}")
                cases.append(_case(trace.name, trace, ds(trace), predictable=kind != "burst"))
        if "fast" in which:
            for kind, seed in (("phase", 11), ("mix", 12), ("burst", 13)):
                cfg = TraceGenConfig(
                    kind=kind,
                    windows=windows,
                    tokens_per_window=tokens,
                    window_seconds=1.0,
                    seed=seed + seed_offset,
                    **FAST[kind],
                )
                trace = make_trace(sources, cfg, name=f"deepseek-v3-{kind}-1s")
                cases.append(_case(trace.name, trace, ds(trace), predictable=kind != "burst"))
    if which & {"mixtral8", "mixtral16"}:
        trace = load_trace(mixtral_gsm8k_file(), tokens_per_window=16)
        trace.name = "mixtral-gsm8k"
        for slots in (8, 16):
            if f"mixtral{slots}" not in which:
                continue
            shape = ClusterShape(
                num_layers=trace.num_layers,
                num_logical=trace.num_experts,
                num_slots=slots,
                num_gpus=8,
                expert_bytes=MIXTRAL_8X7B_EXPERT_BYTES,
            )
            mixtral = SimConfig(shape=shape, policy=policy)
            cases.append(_case(f"mixtral-gsm8k-P{slots}", trace, mixtral, predictable=True))
    return cases


def _checks(case: Case, res: dict[str, PolicyResult]) -> dict[str, object]:
    a = res["adaptive"]
    out: dict[str, object] = {
        "adaptive_vs_follow": a.relative_throughput / res["follow"].relative_throughput,
        "adaptive_vs_oracle": a.relative_throughput / res["oracle"].relative_throughput,
        # What a fixed placement with the whole trace in hindsight reaches of oracle: the
        # rest of oracle is fitting each window's own counts, noise included.
        "hindsight_vs_oracle": (
            res["hindsight"].relative_throughput / res["oracle"].relative_throughput
        ),
        "beats_periodic": a.relative_throughput > res["periodic"].relative_throughput,
        "beats_static": a.relative_throughput > res["static"].relative_throughput,
        "bytes_vs_periodic": (
            a.bytes_moved / res["periodic"].bytes_moved if res["periodic"].bytes_moved else None
        ),
    }
    out["meets_follow_97"] = out["adaptive_vs_follow"] >= 0.97  # type: ignore[operator]
    if case.predictable:
        out["meets_oracle_95"] = out["adaptive_vs_oracle"] >= 0.95  # type: ignore[operator]
    return out


# Policies that depend on where they start: rerun from the static fit in the warm pass.
CHANGING = ("periodic", "adaptive", "follow", "oracle")


def _warm(case: Case, cold: dict[str, PolicyResult]) -> dict[str, PolicyResult]:
    """The changing policies again, started from the static fit; the rest as in `cold`."""
    config = dataclasses.replace(case.config, start="static")
    warm = simulate(case.trace, config, CHANGING)
    return {name: warm.get(name, cold[name]) for name in cold}


def _table(case: Case, res: dict[str, PolicyResult]) -> list[str]:
    lines = [
        f"**{case.name}** ({case.trace.num_windows} windows of "
        f"{case.trace.window_seconds:g} s, G={case.config.shape.num_gpus}, "
        f"P={case.config.shape.num_slots}, N={case.config.shape.num_nodes})",
        "",
        "| policy | balancedness | relative throughput | rebalances | slots moved "
        "| GB moved | stall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in res.items():
        lines.append(
            f"| {name} | {r.mean_balancedness:.4f} | {r.relative_throughput:.4f} | "
            f"{r.rebalances} | {r.slots_moved} | {r.bytes_moved / 1e9:.1f} | "
            f"{r.stall_seconds:.2f} |"
        )
    return lines


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def _write_section(body: str) -> None:
    path = REPO / "BENCHMARKS.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _m: body, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + body
    path.write_text(text)


def _summary(report: dict[str, dict[str, Any]], key: str) -> list[str]:
    """One markdown row per trace of the checks stored under `key`."""
    rows = [
        "| trace | adaptive / follow | adaptive / oracle | hindsight / oracle "
        "| beats periodic | beats static | adaptive bytes / periodic |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, item in report.items():
        c = item[key]
        ratio = c["bytes_vs_periodic"]
        rows.append(
            f"| {name} | {c['adaptive_vs_follow']:.4f} | {c['adaptive_vs_oracle']:.4f} | "
            f"{c['hindsight_vs_oracle']:.4f} | "
            f"{'yes' if c['beats_periodic'] else 'no'} | "
            f"{'yes' if c['beats_static'] else 'no'} | "
            f"{'n/a' if ratio is None else f'{ratio:.3f}'} |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=240, help="windows per DeepSeek trace")
    parser.add_argument("--tokens-per-window", type=int, default=65536)
    parser.add_argument(
        "--traces",
        default="phase,mix,burst,mixtral8,mixtral16",
        help="comma list of cases (also: fast, the 1 s-window traces)",
    )
    parser.add_argument(
        "--seed-offset",
        type=int,
        default=0,
        help="added to the trace seeds (11-13, on which the defaults were tuned): held-out traces",
    )
    parser.add_argument("--no-write", action="store_true", help="no BENCHMARKS.md, no plots")
    parser.add_argument("--json", action="store_true", help="only the JSON line")
    args = parser.parse_args(argv)

    which = {t.strip() for t in args.traces.split(",") if t.strip()}
    started = time.time()
    report: dict[str, dict[str, Any]] = {}
    md: list[str] = []
    for case in _cases(args.windows, args.tokens_per_window, which, args.seed_offset):
        t0 = time.time()
        res = simulate(case.trace, case.config, POLICIES)
        checks = _checks(case, res)
        warm_checks = _checks(case, _warm(case, res))
        report[case.name] = {
            "policies": {n: r.summary() for n, r in res.items()},
            "checks": checks,
            "warm_checks": warm_checks,
            "seconds": round(time.time() - t0, 1),
        }
        table = _table(case, res)
        md += table + [""]
        if not args.json:
            print("\n".join(table))
            print("checks:", json.dumps(checks, default=str))
            print(
                "from the static fit:",
                json.dumps(warm_checks, default=str),
                f"({time.time() - t0:.0f} s)\n",
            )
        if not args.no_write:
            png = REPO / "docs" / f"sim_{case.name}.png"
            title = (
                f"{case.name}: G={case.config.shape.num_gpus}, P={case.config.shape.num_slots}, "
                f"{case.trace.num_windows} windows"
            )
            plot_balancedness(res, png, title, case.trace.window_seconds)

    if not args.no_write:
        cmd = "python -m bench.simulate " + " ".join(argv if argv is not None else sys.argv[1:])
        summary_rows = _summary(report, "checks")
        warm_rows = _summary(report, "warm_checks")
        checks_of = {name: item["checks"] for name, item in report.items()}

        def failing(key: str) -> str:
            bad = [n for n, c in checks_of.items() if key in c and not c[key]]
            return "all met" if not bad else "not met on " + ", ".join(bad)

        targets = [
            f"- adaptive >= 97% of follow's relative throughput: {failing('meets_follow_97')}",
            "- adaptive >= 95% of oracle's on phase and mix traces (bursts exempt): "
            + failing("meets_oracle_95"),
            f"- adaptive beats periodic: {failing('beats_periodic')}",
            f"- adaptive beats static: {failing('beats_static')}",
            "- Mixtral: with P = G = 8 every placement is a permutation of one expert per GPU, "
            "so all placements balance alike and adaptive can only tie static (proved in "
            "tests/unit/controller/test_decide.py). At P = 16 the trace's 247 tokens give 32 "
            "routings per layer per 16-token window (about 4 per GPU): served balance is set by "
            "that sampling noise more than by how well a placement fits the mean load, so even "
            "the placement fitted on the whole trace in hindsight reaches only the hindsight / "
            "oracle share of oracle, which fits each window's own noise, and follow (the "
            "issue's causal reference) reaches 72 %. The gate finds no candidate with a gain "
            "significant at these counts and keeps the placement it started from: from the "
            "trivial one it beats the static fit, whose greedy on 10 noisy windows serves "
            "worse; from the static fit it ties it; lower noise margins make it move and lose "
            "(docs/simulator.md).",
        ]
        body = "\n".join(
            [
                SECTION,
                "",
                f"Command: `{cmd.strip()}`  ",
                f"Machine: {_machine()}  ",
                f"Date: {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, "
                f"{time.time() - started:.0f} s in all",
                "",
                "Policies, cost model and defaults: docs/simulator.md. Plots: "
                "docs/sim_<trace>.png.",
                "",
                "Periodic, adaptive, follow and oracle start from the trivial placement an "
                "engine loads:",
                "",
                *summary_rows,
                "",
                "The same policies started from the static fit (an engine given a recorded "
                "expert distribution, SGLang `--init-expert-location`); none, static and "
                "hindsight as above:",
                "",
                *warm_rows,
                "",
                "Targets of the simulator issue (trivial start), checked by the benchmark:",
                "",
                *targets,
                "",
                *md,
            ]
        )
        _write_section(body.rstrip("\n") + "\n\n")
    print(json.dumps(report, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
