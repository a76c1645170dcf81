"""Cost of the worker hooks on one GPU: `python -m bench.gpu_hooks`.

Measures, on one DeepSeek-V3-sized MoE layer (or a few) replayed as a CUDA graph:
- the replay time of the block without hooks (the baseline) and with the recorder
  (logical + physical counts) and replica dispatch inside the graph;
- the hooks alone, captured in a graph of their own;
(the three interleaved in one process: `--rounds` rounds, each replaying every graph
`--replays` times in turn, order reversed every other round, a warm-up round dropped;
each overhead is the median of its per-round ratios, given with their interquartile
range and range: bench/interleave.py)
- the swap pause between replays: committing a staged DeepSeek-V3-shaped map
  (61 layers x 256 experts) and one layer's staged expert weights;
- a window closed between replays by the hook's pipeline (`WindowPipeline.close_as`);
- with `--dispatch all` (or a comma list of modes), each dispatch mode
  (rebalancer.wire.dispatch) as `RebalanceHook.route` runs it, at EP32 with a shared
  expert, captured in a CUDA graph of its own over every layer of the block, against the
  block's replay, interleaved with it round by round as above (`--route-replays`
  replays a round): `dispatch_<mode>_ms` and `dispatch_<mode>_pct_of_block`, the median
  of the per-round shares (the target: at most 1 %), with their spread. One GPU stands in for rank 0
  of 32: the other ranks' counts of the step are a static function of its own (so the water-fill
  works on a real spread); the all-gather of `[G, E + 1]` counts that replaces it on a real EP group
  is not in the figure (latency-bound, ~10-20 us per layer at EP32 on NVLink; measure it on 2 GPUs).
  Without CUDA, the modes run eagerly at small shapes on CPU (a smoke check only).
Prints one line per figure and a JSON object last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from bench.interleave import Spread, overhead_pct, run_interleaved, share_pct
from rebalancer.wire.dispatch import DISPATCH_MODES, WATERFILL_PASSES, check_dispatch_mode
from rebalancer.wire.layout import trivial_placement
from rebalancer.wire.shape import ClusterShape
from worker_hooks.dispatch import ReplicaDispatch
from worker_hooks.examples.moe_gpu import MoEBlockConfig, ReferenceMoEBlock
from worker_hooks.hook import DispatchConfig, HookConfig, Link, RebalanceHook
from worker_hooks.record import ExpertRecorder
from worker_hooks.session.windows import WindowPipeline


@dataclass
class HookBenchConfig:
    tokens: int = 4096
    num_layers: int = 2
    hidden: int = 7168
    intermediate: int = 2048
    num_experts: int = 256
    top_k: int = 8
    replays: int = 20  # block graph replays per round (the block takes ~28 ms)
    route_replays: int = 200  # dispatch graph replays per round (a route takes ~0.3 ms)
    rounds: int = 15
    map_layers: int = 61
    moved_experts: int = 8
    # Dispatch modes to measure ("all", a comma list, or "" for none); EP size emulated.
    dispatch: str = ""
    dispatch_gpus: int = 32
    dispatch_slots: int = 288
    waterfill_passes: int = WATERFILL_PASSES
    compile_dispatch: int = 0  # 1: DispatchConfig.compile (torch.compile, CUDA only)


def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def time_replays(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Mean milliseconds per replay over `replays` back-to-back replays."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def interleaved(
    graphs: dict[str, tuple[torch.cuda.CUDAGraph, int]], cfg: HookBenchConfig
) -> dict[str, list[float]]:
    """Each graph (with its replays per round) timed once a round, alternating round by
    round so drift hits them alike; a warm-up round is dropped. Milliseconds per replay,
    round i at index i of every list."""

    def measure(graph: torch.cuda.CUDAGraph, replays: int) -> Callable[[int], float]:
        return lambda _round: time_replays(graph, replays)

    return run_interleaved(
        {k: measure(g, n) for k, (g, n) in graphs.items()}, cfg.rounds, warmup_rounds=1
    )


def identity_map(num_layers: int, num_experts: int) -> np.ndarray:
    return np.broadcast_to(
        np.arange(num_experts)[None, :, None], (num_layers, num_experts, 1)
    ).copy()


def deepseek_like_map(
    num_layers: int, num_experts: int, num_slots: int, rng: np.random.Generator
) -> np.ndarray:
    """A log2phy with redundant replicas of random hot experts, R = 4."""
    out = np.full((num_layers, num_experts, 4), -1, dtype=np.int64)
    for layer in range(num_layers):
        extra = rng.choice(num_experts, num_slots - num_experts, replace=True)
        phy2log = rng.permutation(np.concatenate([np.arange(num_experts), extra]))
        fill = np.zeros(num_experts, dtype=np.int64)
        for slot, expert in enumerate(phy2log):
            if fill[expert] < 4:
                out[layer, expert, fill[expert]] = slot
                fill[expert] += 1
    return out


Figures = dict[str, float | Spread]


def block_config(cfg: HookBenchConfig) -> MoEBlockConfig:
    return MoEBlockConfig(
        hidden=cfg.hidden,
        intermediate=cfg.intermediate,
        num_experts=cfg.num_experts,
        top_k=cfg.top_k,
        num_layers=cfg.num_layers,
    )


def plain_block(cfg: HookBenchConfig, dev: torch.device) -> tuple[ReferenceMoEBlock, torch.Tensor]:
    """The reference block without hooks (the baseline) and an input of the served shape."""
    mcfg = block_config(cfg)
    phy2log = torch.arange(cfg.num_experts).repeat(cfg.num_layers, 1)
    x = torch.randn(cfg.tokens, cfg.hidden, device=dev, dtype=mcfg.dtype)
    return ReferenceMoEBlock(mcfg, phy2log, dev, seed=0), x


def bench_block(cfg: HookBenchConfig, dev: torch.device) -> Figures:
    mcfg = block_config(cfg)
    phy2log = torch.arange(cfg.num_experts).repeat(cfg.num_layers, 1)
    plain, x = plain_block(cfg, dev)
    disp = ReplicaDispatch(
        identity_map(cfg.num_layers, cfg.num_experts), 1, 0, max_replicas=4, device=dev
    )
    rec = ExpertRecorder(cfg.num_layers, cfg.num_experts, num_physical=cfg.num_experts, device=dev)
    hooked = ReferenceMoEBlock(
        mcfg, phy2log, dev, dispatch=disp, recorder=rec, seed=0, weights=plain.weights
    )
    out_plain, out_hooked = torch.empty_like(x), torch.empty_like(x)
    g_plain = capture(lambda: out_plain.copy_(plain.forward(x)))
    g_hooked = capture(lambda: out_hooked.copy_(hooked.forward(x)))
    g_plain.replay()
    g_hooked.replay()
    torch.cuda.synchronize()
    same = bool(torch.equal(out_plain, out_hooked))
    # The hooks alone, on the router output of the block's first layer.
    ids, _ = plain.route(0, x, None)

    def hooks_only() -> None:
        for layer in range(cfg.num_layers):
            rec.record(layer, ids)
            rec.record_physical(layer, disp.dispatch(layer, ids))

    g_hooks = capture(hooks_only)
    times = interleaved(
        {
            "plain": (g_plain, cfg.replays),
            "hooked": (g_hooked, cfg.replays),
            "hooks_only": (g_hooks, cfg.replays),
        },
        cfg,
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    rec.take_window()
    flops = 2 * 3 * cfg.hidden * cfg.intermediate * cfg.tokens * cfg.top_k * cfg.num_layers
    return {
        "block_ms": med["plain"],
        "block_hooked_ms": med["hooked"],
        "hooks_only_ms": med["hooks_only"],
        # per round: hooked / plain - 1, and hooks alone / plain
        "overhead_pct_diff": overhead_pct(times["plain"], times["hooked"]),
        "overhead_pct_hooks_only": share_pct(times["plain"], times["hooks_only"]),
        "block_spread_pct": 100 * (max(times["plain"]) - min(times["plain"])) / med["plain"],
        "block_tflops": flops / med["plain"] / 1e9,
        "outputs_identical": float(same),
    }


def dispatch_modes(text: str) -> list[str]:
    if not text:
        return []
    if text == "all":
        return list(DISPATCH_MODES)
    return [check_dispatch_mode(m.strip()) for m in text.split(",") if m.strip()]


def dispatch_hook(cfg: HookBenchConfig, mode: str, dev: torch.device) -> RebalanceHook:
    """Rank 0 of `dispatch_gpus` with a shared expert, on a DeepSeek-like placement; the
    other ranks' counts are its own, rolled (static ops: capturable)."""
    G, P, E = cfg.dispatch_gpus, cfg.dispatch_slots, cfg.num_experts
    rng = np.random.default_rng(0)
    phy2log = trivial_placement(cfg.num_layers, E, P, G)
    phy2log[:, E:] = rng.integers(0, E, size=(cfg.num_layers, P - E))
    config = HookConfig(
        link=Link("127.0.0.1:1", deployment="bench"),
        rank=0,
        shape=ClusterShape(
            num_layers=cfg.num_layers,
            num_logical=E,
            num_slots=P,
            num_gpus=G,
            expert_bytes=0,
            top_k=cfg.top_k,
        ),
        shared_expert=True,
        dispatch=DispatchConfig(
            mode=mode,
            waterfill_passes=cfg.waterfill_passes,  # type: ignore[arg-type]
            compile=bool(cfg.compile_dispatch) and dev.type == "cuda",
        ),
    )
    weights = {"w": torch.zeros(cfg.num_layers, P // G, 1, device=dev)}

    # rank r's counts: rank 0's rotated by 3 r experts (one gather, so the stand-in adds
    # one kernel where the real all-gather is one collective)
    width = E + 1
    rotate = (
        torch.arange(width, device=dev)[None, :] + 3 * torch.arange(G, device=dev)[:, None]
    ) % width

    def gather(local: torch.Tensor) -> torch.Tensor:
        return local[rotate]

    return RebalanceHook(config, phy2log, weights, None, None, device=dev, counts_gather=gather)


# aten ops that only make a view or allocate: no kernel
_NO_KERNEL = frozenset(
    f"aten::{name}"
    for name in (
        "view",
        "reshape",
        "_reshape_alias",
        "_unsafe_view",
        "unsqueeze",
        "squeeze",
        "slice",
        "select",
        "t",
        "transpose",
        "permute",
        "expand",
        "expand_as",
        "as_strided",
        "alias",
        "detach",
        "empty",
        "empty_like",
        "empty_strided",
        "resize_",
        "result_type",
    )
)


def ops_per_layer(fn: Callable[[], object]) -> int:
    """Kernel-launching aten ops of one call (top-level, views and allocations left out):
    replayed from a graph each costs a kernel (~2 us), so it is the dispatch's cost on a
    GPU where the work itself is tiny. Counted on the host, so also without a GPU."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm: one-time work is not per step
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    count = 0
    for event in prof.events():
        parent = event.cpu_parent
        top = parent is None or not parent.name.startswith("aten::")
        if event.name.startswith("aten::") and top and event.name not in _NO_KERNEL:
            count += 1
    return count


def bench_dispatch(cfg: HookBenchConfig, dev: torch.device) -> Figures:
    """Each mode's route over every layer, replayed as a graph interleaved with the
    block's graph, the baseline (eager on CPU, no baseline)."""
    out: Figures = {}
    gen = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, cfg.num_experts, (cfg.tokens, cfg.top_k), device=dev, generator=gen)
    routes: dict[str, Callable[[], object]] = {}
    results: dict[str, list[torch.Tensor]] = {}
    for mode in dispatch_modes(cfg.dispatch):
        hook = dispatch_hook(cfg, mode, dev)
        results[mode] = [
            torch.empty(cfg.tokens, cfg.top_k + 1, dtype=ids.dtype, device=dev)
            for _ in range(cfg.num_layers)
        ]

        def route(hook: RebalanceHook = hook, res: list[torch.Tensor] = results[mode]) -> None:
            for layer in range(cfg.num_layers):
                res[layer].copy_(hook.route(layer, ids))

        routes[mode] = route
        out[f"dispatch_{mode}_ops_per_layer"] = float(
            ops_per_layer(lambda hook=hook: hook.route(0, ids))
        )
    if dev.type == "cuda":
        graphs = {mode: capture(fn) for mode, fn in routes.items()}
        eager = {}
        for mode, fn in routes.items():  # capture + replay equals eager
            graphs[mode].replay()
            torch.cuda.synchronize()
            replayed = [r.clone() for r in results[mode]]
            fn()
            torch.cuda.synchronize()
            eager[mode] = all(
                torch.equal(a, b) for a, b in zip(replayed, results[mode], strict=True)
            )
        plain, x = plain_block(cfg, dev)
        block_out = torch.empty_like(x)
        g_block = capture(lambda: block_out.copy_(plain.forward(x)))
        times = interleaved(
            {
                "block": (g_block, cfg.replays),
                **{m: (g, cfg.route_replays) for m, g in graphs.items()},
            },
            cfg,
        )
        out["dispatch_block_ms"] = statistics.median(times["block"])
        for mode in routes:
            out[f"dispatch_{mode}_ms"] = statistics.median(times[mode])
            out[f"dispatch_{mode}_pct_of_block"] = share_pct(times["block"], times[mode])
            out[f"dispatch_{mode}_replay_equals_eager"] = float(eager[mode])
    else:
        for mode, fn in routes.items():
            fn()
            t0 = time.perf_counter()
            for _ in range(cfg.replays):
                fn()
            out[f"dispatch_{mode}_ms"] = 1e3 * (time.perf_counter() - t0) / cfg.replays
    return out


def bench_swap(cfg: HookBenchConfig, dev: torch.device) -> Figures:
    rng = np.random.default_rng(0)
    num_slots = cfg.num_experts + 32
    maps = [deepseek_like_map(cfg.map_layers, cfg.num_experts, num_slots, rng) for _ in range(2)]
    disp = ReplicaDispatch(maps[0], num_gpus=8, rank=3, device=dev, num_physical=num_slots)
    ids = torch.randint(0, cfg.num_experts, (cfg.tokens, cfg.top_k), device=dev)
    out = torch.empty_like(ids)
    graph = capture(lambda: out.copy_(disp.dispatch(5, ids)))
    stage_s, commit_host_us, commit_dev_us = [], [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(20):
        graph.replay()
        t0 = time.perf_counter()
        disp.stage(maps[(i + 1) % 2])
        torch.cuda.synchronize()
        stage_s.append(time.perf_counter() - t0)
        start.record()
        t1 = time.perf_counter()
        disp.commit()
        commit_host_us.append(1e6 * (time.perf_counter() - t1))
        end.record()
        graph.replay()
        end.synchronize()
        commit_dev_us.append(1e3 * start.elapsed_time(end))
    # The replay after a commit routes by the new map.
    torch.cuda.synchronize()
    ref = ReplicaDispatch(maps[20 % 2], num_gpus=8, rank=3, num_physical=num_slots).dispatch(
        5, ids.cpu()
    )
    follows = bool(torch.equal(out.cpu(), ref))
    # One layer's staged weights: moved_experts experts of DeepSeek-V3 size.
    per_expert = 3 * cfg.hidden * cfg.intermediate
    slots = 32
    live = torch.empty(slots, per_expert, dtype=torch.bfloat16, device=dev)
    staged = torch.randn(cfg.moved_experts, per_expert, dtype=torch.bfloat16, device=dev)
    dst = torch.tensor(rng.choice(slots, cfg.moved_experts, replace=False), device=dev)
    w_us = []
    for _ in range(20):
        start.record()
        live.index_copy_(0, dst, staged)
        end.record()
        end.synchronize()
        w_us.append(1e3 * start.elapsed_time(end))
    map_bytes = disp.table.numel() * 8 + disp.log2phy.numel() * 8
    return {
        "map_commit_device_us": statistics.median(commit_dev_us[2:]),
        "map_commit_host_us": statistics.median(commit_host_us[2:]),
        "map_stage_ms": 1e3 * statistics.median(stage_s[2:]),
        "map_bytes": float(map_bytes),
        "replay_follows_new_map": float(follows),
        "weights_commit_us": statistics.median(w_us[2:]),
        "weights_commit_bytes": float(cfg.moved_experts * per_expert * 2),
    }


class _Sink:
    """Takes the windows (an agent's `submit_window`), counting them."""

    def __init__(self) -> None:
        self.windows = 0

    def submit_window(self, *window: object) -> None:
        self.windows += 1


def bench_snapshot(cfg: HookBenchConfig, dev: torch.device) -> Figures:
    """A window closed between replays by the hook's pipeline (worker_hooks/session/
    windows.py): the host time of the close, and how long after it the window is ready."""
    rec = ExpertRecorder(61, 257, num_physical=288, device=dev)
    ids = torch.randint(-1, 257, (cfg.tokens, 9), device=dev)
    graph = capture(lambda: rec.record(10, ids))
    sink = _Sink()
    pipeline = WindowPipeline(sink, rec.counts)  # type: ignore[arg-type]
    host_us, wait_us = [], []
    for step in range(20):
        graph.replay()
        t0 = time.perf_counter()
        pipeline.close_as(2 * step + 1, 0, rec.split)
        host_us.append(1e6 * (time.perf_counter() - t0))
        graph.replay()
        t1 = time.perf_counter()
        while pipeline.in_flight:
            pipeline.poll()
        wait_us.append(1e6 * (time.perf_counter() - t1))
    return {
        "snapshot_begin_host_us": statistics.median(host_us[2:]),
        "snapshot_ready_after_us": statistics.median(wait_us[2:]),
    }


def copy_bandwidth(dev: torch.device) -> float:
    """Device-to-device copy, GB/s counting bytes read plus written (the ceiling)."""
    src = torch.empty(1 << 31, dtype=torch.uint8, device=dev).random_()
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dst.copy_(src)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) / 1e3) / 1e9


def figure_line(section: str, name: str, value: float | Spread) -> str:
    if isinstance(value, Spread):  # a percentage over rounds
        return f"{section:9s} {name:28s} {value.text('%', digits=3)}"
    return f"{section:9s} {name:28s} {value:12.4f}"


def jsonable(figures: Figures) -> dict[str, object]:
    return {k: v.as_dict() if isinstance(v, Spread) else v for k, v in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f, v in asdict(HookBenchConfig()).items():
        parser.add_argument(f"--{f.replace('_', '-')}", type=type(v), default=v)
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = vars(parser.parse_args())
    quiet = args.pop("json")
    for name in ("replays", "route_replays", "rounds"):
        if args[name] < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {args[name]}")
    cfg = HookBenchConfig(**{k.replace("-", "_"): v for k, v in args.items()})
    dispatch_modes(cfg.dispatch)  # a bad mode fails before any work
    if not torch.cuda.is_available():  # a smoke check of the dispatch modes, small shapes
        small = HookBenchConfig(
            tokens=64,
            num_layers=2,
            num_experts=32,
            top_k=4,
            replays=3,
            dispatch=cfg.dispatch or "all",
            dispatch_gpus=4,
            dispatch_slots=40,
            waterfill_passes=cfg.waterfill_passes,
        )
        figures = bench_dispatch(small, torch.device("cpu"))
        if not quiet:
            for k, v in figures.items():
                print(figure_line("dispatch", k, v), flush=True)
        print(
            json.dumps(
                {
                    "gpu": None,
                    "date": time.strftime("%Y-%m-%d"),
                    "config": asdict(small),
                    "dispatch": jsonable(figures),
                }
            )
        )
        return
    dev = torch.device("cuda")
    result: dict[str, object] = {
        "gpu": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "config": asdict(cfg),
        "copy_GBps": copy_bandwidth(dev),
    }
    benches: list[tuple[str, Callable[[HookBenchConfig, torch.device], Figures]]] = [
        ("block", bench_block),
        ("swap", bench_swap),
        ("snapshot", bench_snapshot),
    ]
    if cfg.dispatch:
        benches.append(("dispatch", bench_dispatch))
    for name, fn in benches:
        figures = fn(cfg, dev)
        if not quiet:
            for k, v in figures.items():
                print(figure_line(name, k, v), flush=True)
        result[name] = jsonable(figures)
        torch.cuda.empty_cache()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
