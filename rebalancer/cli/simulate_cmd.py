"""`rebalancer simulate`: replay a routing trace through the placement policies.

Shows an operator, on their own routing data, what online rebalancing buys over a
frozen placement and over in-process periodic EPLB, and what it costs in bytes moved.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import TYPE_CHECKING, Any

from rebalancer.errors import InputError

if TYPE_CHECKING:
    from rebalancer.controller.policy_config import PolicyConfig

DESCRIPTION = """\
Replay a trace of windowed expert counts through placement policies and report, per
policy, mean balancedness (sum of mean GPU load / sum of max GPU load), relative
throughput (vs perfect balance with free migration; stalls and transfer overlap
included), rebalances, slots and bytes moved. The last line of output is one JSON
object (with --policy all: one key per policy).

Policies: none (trivial placement), static (fitted on the first windows, frozen),
periodic (greedy refit every K windows with a blocking stall, like SGLang/vLLM EPLB),
adaptive (the controller: estimate, cost gate, migration-aware plan, overlapped
transfers), follow (refit on the previous window, free), oracle (refit on the window
itself, free: an upper bound), hindsight (one placement fitted on the whole trace, held
fixed, free: what the best-informed fixed placement reaches), regimes (adaptive with the
regimes policy: recurring load regimes recognised and decided on with their ready
placements, a drift forecast; the same gate and costs).

Replicas (--replicas R): R replicas of one model behind one endpoint, each window an
independent draw of --replica-tokens tokens per replica from the trace's routing; the
adaptive policy pooled (one estimate from all members' windows) against per deployment
(each member alone), and a member joining at --join-window warm (the pool's placement)
or trivial. Adds a "replicas" key to the JSON (docs/simulator.md).

Failures (--fail RANK@WINDOW, --fail-node NODE@WINDOW, repeatable, one window): from that
window on, on the survivors: the >= 1-replica repair (vLLM's fault-tolerance path), a
from-scratch re-placement (SGLang's elastic path) and the controller's planned survivor
placement, each fitted on the windows before the failure. Adds "failure":
{repair|scratch|planned: {balancedness_after, slots_moved, relative_throughput}} to the
JSON (relative throughput without the transfers' cost).

Trace formats: .npz (logical_count [T, L, E], window_seconds), SGLang .pt dumps (or a
directory of dumps),
.json (logical_count [L, E] or [T, L, E]), per-token .jsonl (grouped into windows of
--tokens-per-window tokens).
"""


# --cost keys that name a migration-cost parameter (rebalancer.controller.cost.CostParams):
# they are the adaptive policy's `cost` section, so the gate decides with what the
# simulator charges. KEY -> the setting's flat name (as --set and the Policy message name it).
POLICY_COST_KEYS = {
    "step_seconds": "step_seconds",
    "intra_node_gbps": "intra_node_gbps",
    "inter_node_gbps": "link_bandwidth_gbps",
    "overlap_penalty": "overlap_penalty",
    "commit_gbps": "commit_gbps",
    "swap_seconds": "swap_seconds",
}

# The policy fields `--timing` derives.
TIMING_KEYS = ("min_interval_seconds", "decision_period_seconds")


def _key_values(
    items: list[str],
    target: Any,
    what: str,
    aliases: dict[str, str] | None = None,
    also: tuple[str, ...] = (),
) -> Any:
    """Apply KEY=VALUE overrides to a dataclass, parsing values as JSON when possible.

    `aliases` maps further accepted keys to field names; `also` names keys the caller
    accepts elsewhere (for the error message)."""
    known = [f.name for f in dataclasses.fields(target)]
    return dataclasses.replace(target, **_parse_key_values(items, known, what, aliases, also))


def _policy_settings(
    items: list[str], policy: PolicyConfig, what: str, aliases: dict[str, str] | None = None
) -> PolicyConfig:
    """Apply KEY=VALUE overrides to a PolicyConfig, KEY a setting's flat name (the names
    of the v1 Policy message and the controller's TOML, `PolicyConfig.setting_names`)."""
    return policy.with_settings(
        _parse_key_values(items, list(policy.setting_names()), what, aliases)
    )


def _parse_key_values(
    items: list[str],
    known: list[str],
    what: str,
    aliases: dict[str, str] | None = None,
    also: tuple[str, ...] = (),
) -> dict[str, Any]:
    """KEY=VALUE items as {KEY: VALUE}, VALUE parsed as JSON when possible; InputError
    naming the accepted keys otherwise."""
    aliases = aliases or {}
    changes: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = aliases.get(key, key)
        if not sep or key not in known:
            names = [*known, *(a for a in (*aliases, *also) if a not in known)]
            raise InputError(
                f"{what}: expected KEY=VALUE with KEY in {', '.join(names)}, got {item!r}"
            )
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        changes[key] = value
    return changes


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="replay a routing trace through the placement policies",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", required=True, help="trace file (.npz, .pt, .json, .jsonl)")
    p.add_argument("--gpus", type=int, required=True, help="EP ranks G")
    p.add_argument("--slots", type=int, required=True, help="physical slots P (P %% G == 0)")
    p.add_argument("--nodes", type=int, default=1, help="nodes N (G %% N == 0)")
    p.add_argument("--groups", type=int, default=0, help="expert groups (0: none)")
    p.add_argument(
        "--policy",
        default="all",
        help="none|static|periodic|adaptive|follow|oracle|hindsight|regimes|all, or a comma list",
    )
    p.add_argument("--tokens-per-window", type=int, default=8, help=".jsonl: tokens per window")
    p.add_argument("--num-experts", type=int, default=None, help=".jsonl: experts per layer")
    p.add_argument(
        "--window-seconds", type=float, default=None, help="override the trace's window length"
    )
    p.add_argument("--expert-bytes", type=int, default=None, help="bytes of one expert's weights")
    p.add_argument(
        "--period-steps", type=int, default=None, help="periodic: steps between refits (1000)"
    )
    p.add_argument(
        "--periodic-algorithm",
        default=None,
        help="placement algorithm of static/periodic (default greedy, like the engines)",
    )
    p.add_argument(
        "--start",
        default="trivial",
        help="where periodic/adaptive/follow/oracle start: trivial (default) or static",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="adaptive policy field (repeatable)",
    )
    p.add_argument(
        "--timing",
        choices=("trace", "defaults"),
        default="trace",
        help=(
            "adaptive min_interval_seconds and decision_period_seconds: derived for the "
            "trace's window length and the simulated deployment (trace, default; "
            "PolicyConfig.for_windows), or PolicyConfig's defaults, derived for ~1 s windows "
            "of DeepSeek-V3 at EP32 (defaults); --set overrides either"
        ),
    )
    p.add_argument(
        "--cost",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=(
            "cost model field (repeatable): the serving clock's (moe_fraction, "
            "seconds_per_token, fixed_seconds_per_layer, expert_bytes, plan_overhead_seconds, "
            "periodic_stall_seconds) or a migration-cost parameter (step_seconds, "
            "intra_node_gbps, inter_node_gbps, overlap_penalty, commit_gbps, swap_seconds), "
            "which sets the adaptive policy's field of that name (inter_node_gbps: "
            "link_bandwidth_gbps) so the gate and the simulator agree"
        ),
    )
    p.add_argument(
        "--dispatch",
        default=None,
        help=(
            "also model each step under these dispatch modes (split|load|load+shared, a "
            "comma list, or all): per policy and batch size, the relative step throughput "
            "of each mode and its ratio to split on the same sampled steps"
        ),
    )
    p.add_argument(
        "--batch-tokens",
        default=None,
        help="with --dispatch: tokens per GPU per step, a comma list (default "
        "64,128,256,512,4096,16384)",
    )
    p.add_argument(
        "--step-windows",
        type=int,
        default=None,
        help="with --dispatch: windows sampled for the per-step model (default 32)",
    )
    p.add_argument(
        "--waterfill-passes",
        type=int,
        default=None,
        help="with --dispatch: water-filling passes of the load modes "
        "(HookConfig.dispatch.waterfill_passes)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="also simulate R replicas pooled vs per deployment, and a joining member",
    )
    p.add_argument(
        "--replica-tokens",
        type=int,
        default=None,
        help="with --replicas: tokens each replica routes per window (default 512)",
    )
    p.add_argument(
        "--replica-top-k",
        type=int,
        default=None,
        help="with --replicas: experts per token of the sampled windows (default 8)",
    )
    p.add_argument(
        "--join-window",
        type=int,
        default=None,
        help="with --replicas: the window a member joins at (default mid-trace)",
    )
    p.add_argument("--seed", type=int, default=0, help="with --replicas: sampling seed")
    p.add_argument(
        "--fail",
        action="append",
        default=[],
        metavar="RANK@WINDOW",
        help="lose this rank at this window (repeatable; one window for all): compare "
        "the >= 1-replica repair, a from-scratch re-placement and the planned "
        'survivor placement from then on (a "failure" key in the JSON)',
    )
    p.add_argument(
        "--fail-node",
        action="append",
        default=[],
        metavar="NODE@WINDOW",
        help="lose every rank of this node at this window (repeatable), as --fail",
    )
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw balancedness over time")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    p.set_defaults(func=run)


def _table(results: dict[str, Any]) -> str:
    head = (
        f"{'policy':9s} {'balanced':>8s} {'rel_tput':>8s} {'rebal':>6s} {'slots':>9s} "
        f"{'GB_moved':>10s} {'stall_s':>8s}"
    )
    lines = [head]
    for name, r in results.items():
        lines.append(
            f"{name:9s} {r.mean_balancedness:8.4f} {r.relative_throughput:8.4f} {r.rebalances:6d} "
            f"{r.slots_moved:9d} {r.bytes_moved / 1e9:10.1f} {r.stall_seconds:8.2f}"
        )
    return "\n".join(lines)


def _dispatch_table(results: dict[str, Any]) -> str:
    lines = [f"{'policy':9s} {'batch':>6s} {'mode':12s} {'step_tput':>9s} {'vs_split':>8s}"]
    for name, r in results.items():
        for batch, modes in r.dispatch.items():
            for mode, figures in modes.items():
                lines.append(
                    f"{name:9s} {batch:>6s} {mode:12s} {figures['relative_step_throughput']:9.4f} "
                    f"{figures['vs_split'] or float('nan'):8.4f}"
                )
    return "\n".join(lines)


def _int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise InputError(f"{what} must be a comma list of integers, got {text!r}") from None
    if not values:
        raise InputError(f"{what} must name at least one value, got {text!r}")
    return values


def _step_config(args: argparse.Namespace) -> Any:
    """The per-step model's settings from --dispatch / --batch-tokens, or None."""
    from rebalancer.sim.steps import DECODE_BATCH_TOKENS, PREFILL_BATCH_TOKENS, StepConfig
    from rebalancer.wire.dispatch import DISPATCH_MODES, check_dispatch_mode

    if args.dispatch is None:
        if (
            args.batch_tokens is not None
            or args.step_windows is not None
            or args.waterfill_passes is not None
        ):
            raise InputError(
                "--batch-tokens, --step-windows and --waterfill-passes need --dispatch"
            )
        return None
    if args.dispatch == "all":
        modes = DISPATCH_MODES
    else:
        modes = tuple(
            check_dispatch_mode(m.strip(), "--dispatch mode")
            for m in args.dispatch.split(",")
            if m.strip()
        )
        if not modes:
            raise InputError(f"--dispatch names no mode: {args.dispatch!r}")
    batch = (
        DECODE_BATCH_TOKENS + PREFILL_BATCH_TOKENS
        if args.batch_tokens is None
        else _int_list(args.batch_tokens, "--batch-tokens")
    )
    config = StepConfig(batch_tokens=batch, modes=modes)
    if args.step_windows is not None:
        config = dataclasses.replace(config, sampled_windows=args.step_windows)
    if args.waterfill_passes is not None:
        config = dataclasses.replace(config, waterfill_passes=args.waterfill_passes)
    config.validate()
    return config


def _replica_config(args: argparse.Namespace) -> Any:
    """The replica simulation's settings from --replicas and its options, or None."""
    from rebalancer.sim.replicas import ReplicaConfig

    if args.replicas is None:
        if (
            args.replica_tokens is not None
            or args.join_window is not None
            or args.replica_top_k is not None
        ):
            raise InputError("--replica-tokens, --replica-top-k and --join-window need --replicas")
        return None
    config = ReplicaConfig(replicas=args.replicas, join_window=args.join_window, seed=args.seed)
    if args.replica_tokens is not None:
        config = dataclasses.replace(config, tokens_per_window=args.replica_tokens)
    if args.replica_top_k is not None:
        config = dataclasses.replace(config, top_k=args.replica_top_k)
    return config


def _replicas_table(out: dict[str, Any]) -> str:
    lines = [
        f"replicas R={out['replicas']}, {out['tokens_per_window']} tokens per replica window:",
        f"{'adaptive':15s} {'rel_tput':>8s} {'balanced':>8s} {'rebal':>6s} {'slots':>9s}",
    ]
    for name in ("pooled", "per_deployment"):
        f = out[name]
        lines.append(
            f"{name:15s} {f['relative_throughput']:8.4f} {f['mean_balancedness']:8.4f} "
            f"{f['rebalances']:6d} {f['slots_moved']:9d}"
        )
    lines.append(
        f"joiner at window {out['join_window']} (pool {out['pool_balancedness_at_join']:.4f}): "
        f"warm {out['warm_first_windows']}, trivial {out['trivial_first_windows']}"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from rebalancer.controller.decide import PolicyConfig
    from rebalancer.sim import (
        FIT_ALGORITHMS,
        POLICIES,
        CostModel,
        PeriodicConfig,
        SimConfig,
        load_trace,
        simulate,
    )
    from rebalancer.wire.shape import DEEPSEEK_V3_EXPERT_BYTES, ClusterShape, check_expert_bytes

    if args.plot:  # where the plot goes, checked before the replay: a typo must not cost the run
        from rebalancer.cli.plan_cmd import check_output_path

        check_output_path(args.plot, "--plot")
    if args.policy == "all":
        policies = list(POLICIES)
    else:
        policies = [p.strip() for p in args.policy.split(",") if p.strip()]
        unknown = [p for p in policies if p not in POLICIES]
        if unknown or not policies:
            raise InputError(
                f"unknown policy {args.policy!r}; expected one of {', '.join(POLICIES)} or all"
            )
    steps = _step_config(args)
    replica_config = _replica_config(args)
    failure = None
    if args.fail or args.fail_node:
        from rebalancer.sim.failure import parse_failures
        from rebalancer.wire.layout import check_layout

        check_layout(args.slots, args.slots, args.gpus, args.nodes)  # G, N sane before they index
        failure = parse_failures(args.fail, args.fail_node, args.gpus, args.nodes)
    trace = load_trace(
        args.trace,
        tokens_per_window=args.tokens_per_window,
        window_seconds=args.window_seconds,
        num_experts=args.num_experts,
    )
    if failure is not None:
        from rebalancer.sim.failure import check_window

        check_window(failure, trace.num_windows)  # before the replay
    # expert_bytes is the shape's (what each plan's transfer is charged), the rest of
    # --cost the serving clock's or the migration model's.
    shape_items = [i for i in args.cost if i.partition("=")[0] == "expert_bytes"]
    serving = [
        i for i in args.cost if i.partition("=")[0] not in POLICY_COST_KEYS and i not in shape_items
    ]
    migration = [i for i in args.cost if i.partition("=")[0] in POLICY_COST_KEYS]
    expert_bytes = DEEPSEEK_V3_EXPERT_BYTES
    if shape_items:
        given = _parse_key_values(shape_items, ["expert_bytes"], "--cost")["expert_bytes"]
        expert_bytes = check_expert_bytes(given, "cost expert_bytes")
    if args.expert_bytes is not None:
        expert_bytes = check_expert_bytes(args.expert_bytes, "--expert-bytes")
    cost = _key_values(serving, CostModel(), "--cost", also=("expert_bytes", *POLICY_COST_KEYS))
    cost.validate()
    policy = _policy_settings(args.set, PolicyConfig(), "--set")
    policy = _policy_settings(migration, policy, "--cost", POLICY_COST_KEYS)
    periodic = PeriodicConfig()
    if args.period_steps is not None:
        periodic = dataclasses.replace(periodic, period_steps=args.period_steps)
    if args.periodic_algorithm is not None:
        if args.periodic_algorithm not in FIT_ALGORITHMS:
            raise InputError(
                f"--periodic-algorithm must be one of {', '.join(FIT_ALGORITHMS)}, "
                f"got {args.periodic_algorithm!r}"
            )
        periodic = dataclasses.replace(periodic, algorithm=args.periodic_algorithm)
    shape = ClusterShape(
        num_layers=trace.num_layers,
        num_logical=trace.num_experts,
        num_slots=args.slots,
        num_gpus=args.gpus,
        num_nodes=args.nodes,
        num_groups=args.groups,
        expert_bytes=expert_bytes,
    )
    config = SimConfig(
        shape=shape,
        cost=cost,
        policy=policy,
        periodic=periodic,
        start=args.start,
    )
    if args.timing == "trace":
        derived = policy.for_windows(config.shape, trace.window_seconds)
        given = {item.partition("=")[0] for item in args.set} & set(TIMING_KEYS)
        policy = dataclasses.replace(derived, **{k: getattr(policy, k) for k in given})
        config = dataclasses.replace(config, policy=policy)
    results = simulate(trace, config, policies)
    if steps is not None:
        from rebalancer.sim.steps import attach_step_balance, decide_under_modes

        # The adaptive policy decides under each mode it is modelled in, as the controller does.
        decided = (
            decide_under_modes(trace, config, steps, results["adaptive"])
            if "adaptive" in results
            else None
        )
        attach_step_balance(results, trace, config.shape.num_gpus, steps, decided)
    if args.plot:
        from rebalancer.sim.plot import plot_balancedness

        title = f"{trace.name}: G={args.gpus}, P={args.slots}, {trace.num_windows} windows"
        plot_balancedness(results, args.plot, title, trace.window_seconds)
    summaries: dict[str, Any] = {name: r.summary() for name, r in results.items()}
    replicas = None
    if replica_config is not None:
        from rebalancer.sim.replicas import simulate_replicas

        replicas = simulate_replicas(trace, config, replica_config)
    failed = None
    if failure is not None:
        from rebalancer.sim.failure import simulate_failure

        failed = simulate_failure(trace, config, failure)
    if not args.json:
        print(
            f"trace {trace.name}: {trace.num_windows} windows x {trace.num_layers} layers x "
            f"{trace.num_experts} experts, {trace.window_seconds:g} s per window; "
            f"G={args.gpus} P={args.slots} N={args.nodes}; adaptive timing ({args.timing}): "
            + ", ".join(f"{k}={getattr(config.policy, k):g}" for k in TIMING_KEYS)
        )
        print(_table(results))
        if steps is not None:
            print(_dispatch_table(results))
        if replicas is not None:
            print(_replicas_table(replicas))
        if failed is not None:
            from rebalancer.sim.failure import failure_table

            print(failure_table(failed))
    out = summaries[policies[0]] if len(policies) == 1 and args.policy != "all" else summaries
    if replicas is not None:
        out = {**out, "replicas": replicas}
    if failed is not None:
        out = {**out, "failure": failed}
    print(json.dumps(out))
    return 0
