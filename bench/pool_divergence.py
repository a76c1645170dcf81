"""Where the pool divergence threshold comes from (replica_pools.DivergenceConfig).

On the shipped DeepSeek-V3 counts (58 layers x 256 experts, six workloads):
1. the total variation between each pair of workloads' per-layer distributions (what a
   member on another workload differs by), averaged over layers;
2. the divergence statistic (excess total variation, replica_pools.excess_tv) of windows
   drawn by multinomial sampling from one workload against that workload itself (sampling
   noise alone), and of windows of another workload against it, at several window sizes
   (routed picks per layer).

    python -m bench.pool_divergence [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import numpy as np

from rebalancer.controller.replica_pools import excess_tv
from rebalancer.datasets import deepseek_v3_files, load_deepseek_v3

PICKS = (2_000, 8_000, 32_000, 128_000)


def mean_tv(a: np.ndarray, b: np.ndarray) -> float:
    p, q = a / a.sum(1, keepdims=True), b / b.sum(1, keepdims=True)
    return float(np.mean(0.5 * np.abs(p - q).sum(1)))


def draw(rng: np.random.Generator, counts: np.ndarray, picks: int) -> np.ndarray:
    p = counts / counts.sum(1, keepdims=True)
    return np.stack([rng.multinomial(picks, row) for row in p]).astype(np.float64)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    loads = {f.stem: load_deepseek_v3(f).astype(np.float64) for f in deepseek_v3_files()}
    pairs = {
        f"{a} vs {b}": mean_tv(loads[a], loads[b])
        for a, b in itertools.combinations(sorted(loads), 2)
    }
    noise, other = {}, {}
    for picks in PICKS:
        same = [
            excess_tv(draw(rng, c, picks), c)
            for c in loads.values()
            for _ in range(args.draws // 4 or 1)
        ]
        diff = [
            excess_tv(draw(rng, loads[b], picks), loads[a])
            for a, b in itertools.permutations(sorted(loads), 2)
            if a[:6] != b[:6]
        ]  # prefill vs decode
        noise[picks] = {"mean": float(np.mean(same)), "max": float(np.max(same))}
        other[picks] = {"min": float(np.min(diff)), "mean": float(np.mean(diff))}
    out = {"workload_tv": pairs, "sampling_noise_excess": noise, "prefill_vs_decode_excess": other}
    if args.json:
        print(json.dumps(out))
        return 0
    for name, value in sorted(pairs.items(), key=lambda kv: kv[1]):
        print(f"TV {value:.3f}  {name}")
    for picks in PICKS:
        print(
            f"{picks:>7d} picks/layer: sampling noise excess mean {noise[picks]['mean']:.4f} max "
            f"{noise[picks]['max']:.4f}; prefill vs decode excess min {other[picks]['min']:.3f} "
            f"mean {other[picks]['mean']:.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
