"""Replicas of one model behind one endpoint: a pool that learns together, against
deployments that each learn alone, and a member that joins mid-trace.

A trace gives each window's routing distribution per layer. R replicas serve the same
traffic mix but each sees its own tokens: every replica window is an independent draw of
`tokens_per_window x top_k` routed picks per layer from that distribution. With few
tokens per replica window, one replica's counts are noisy; the pool's (summed over its
members) are R times less so.

- per_deployment: every replica runs the adaptive policy (the controller's PolicyLoop,
  estimator, gate and migration-aware placement) on its own windows only;
- pooled: every replica runs the adaptive policy whose estimate sees the pool's windows
  (summed over members) while it serves its own. The live controller computes the pool's
  plan once and prepares it on each member; here each member's loop computes the same
  plan from the same estimate (the members' virtual clocks differ only by their own
  serving time). Every member pays for its own migration. Rolling (a cap on members
  moving together) is not modelled: each member migrates when its plan is due, which
  charges the same per-member cost and only moves when the gain arrives;
- a joiner: one more replica, sampled afresh, that starts serving at `join_window`, either
  warm (the pool's newest placement installed before it serves: a plan the pool is still
  rolling out included, since a new member loads its weights anyway) or from the trivial
  placement an engine loads. Both then follow the pool's estimate from there on.

Fleet figures sum over members: relative throughput = ideal seconds / served seconds
(stalls and overlap included), slots and bytes moved, rebalances.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from rebalancer.errors import InputError
from rebalancer.sim.engine import PolicyResult, SimConfig, Simulator
from rebalancer.sim.steps import window_probs
from rebalancer.sim.trace import Trace

# Routed picks per token of the shipped DeepSeek-V3 data.
DEFAULT_TOP_K = 8


@dataclass(frozen=True)
class ReplicaConfig:
    """How the replicas of a pool are simulated."""

    replicas: int
    # Tokens each replica routes in one window (each picks `top_k` experts per layer):
    # small enough and one replica's counts are mostly sampling noise.
    tokens_per_window: int = 512
    top_k: int = DEFAULT_TOP_K
    # The window at which a member joins (None: the middle of the trace).
    join_window: int | None = None
    # Windows of the joiner reported, warm and trivial start.
    first_windows: int = 5
    seed: int = 0

    def validate(self, num_windows: int) -> None:
        if self.replicas < 1:
            raise InputError(f"replicas must be >= 1, got {self.replicas}")
        for name in ("tokens_per_window", "top_k", "first_windows"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1, got {getattr(self, name)}")
        if num_windows < 2:
            raise InputError(f"the trace has {num_windows} window(s); replicas need at least 2")
        join = self.join_at(num_windows)
        if not 1 <= join < num_windows:
            raise InputError(f"join_window must be in [1, {num_windows - 1}], got {join}")

    def join_at(self, num_windows: int) -> int:
        return num_windows // 2 if self.join_window is None else self.join_window


def sample_replicas(
    trace: Trace, replicas: int, tokens_per_window: int, top_k: int, rng: np.random.Generator
) -> np.ndarray:
    """Independent replica windows drawn from the trace's per-window routing.

    Returns: [R, T, L, E] int64, each replica window `tokens_per_window * top_k` picks
    per layer."""
    num_windows, num_layers, num_logical = trace.counts.shape
    out = np.empty((replicas, num_windows, num_layers, num_logical), dtype=np.int64)
    for w in range(num_windows):
        probs = np.broadcast_to(window_probs(trace.counts[w]), (replicas, num_layers, num_logical))
        out[:, w] = rng.multinomial(tokens_per_window * top_k, probs)
    return out


def _as_trace(trace: Trace, counts: np.ndarray, name: str) -> Trace:
    return replace(trace, counts=counts, name=name)


def fleet(results: list[PolicyResult]) -> dict[str, Any]:
    """Figures of a fleet of members (module doc: sums over members)."""
    ideal = sum(r.ideal_seconds for r in results)
    served = sum(r.serving_seconds + r.stall_seconds for r in results)
    return {
        "members": len(results),
        "relative_throughput": round(ideal / served if served else 1.0, 6),
        "mean_balancedness": round(float(np.mean([r.mean_balancedness for r in results])), 6),
        "rebalances": sum(r.rebalances for r in results),
        "slots_moved": sum(r.slots_moved for r in results),
        "bytes_moved": sum(r.bytes_moved for r in results),
    }


def newest_placement(result: PolicyResult, window: int) -> np.ndarray:
    """The newest placement the adaptive policy had decided on before `window`: a plan
    still moving weights included, since a joining member loads its weights anyway and
    can load them in any placement for free; else the placement serving `window`."""
    for entry in reversed(result.decision_log):
        decision = entry["decision"]
        if entry["window"] < window and decision.take and decision.candidate is not None:
            return np.asarray(decision.candidate)
    return result.placements[window]


def simulate_replicas(trace: Trace, config: SimConfig, replicas: ReplicaConfig) -> dict[str, Any]:
    """Pooled against per-deployment adaptive over `replicas.replicas` members, and a
    joining member warm and trivial (module doc). JSON-ready."""
    replicas.validate(trace.num_windows)
    rng = np.random.default_rng(replicas.seed)
    R = replicas.replicas
    join = replicas.join_at(trace.num_windows)
    members = sample_replicas(trace, R + 1, replicas.tokens_per_window, replicas.top_k, rng)
    joiner_counts, members = members[R, join:], members[:R]
    pool = members.sum(axis=0)  # [T, L, E]: the pool's windows
    alone = [
        Simulator(_as_trace(trace, members[r], f"{trace.name}#r{r}"), config).run("adaptive")
        for r in range(R)
    ]
    pooled = [
        Simulator(_as_trace(trace, members[r], f"{trace.name}#r{r}"), config, observed=pool).run(
            "adaptive"
        )
        for r in range(R)
    ]
    # What a joining member is told: the pool's newest placement (member 0's; every
    # member serves the pool's, up to when each one's plan lands), and the pool's
    # balancedness in the window it joins at.
    pool_placement = newest_placement(pooled[0], join)
    pool_balance = float(np.mean([r.balancedness_per_window[join] for r in pooled]))
    joiner_trace = _as_trace(trace, joiner_counts, f"{trace.name}#joiner")
    joiner_observed = pool[join:]
    warm = Simulator(joiner_trace, config, start=pool_placement, observed=joiner_observed).run(
        "adaptive"
    )
    cold = Simulator(joiner_trace, config, observed=joiner_observed).run("adaptive")
    k = min(replicas.first_windows, trace.num_windows - join)
    return {
        "replicas": R,
        "tokens_per_window": replicas.tokens_per_window,
        "top_k": replicas.top_k,
        "seed": replicas.seed,
        "pooled": fleet(pooled),
        "per_deployment": fleet(alone),
        "join_window": join,
        "pool_balancedness_at_join": round(pool_balance, 6),
        "warm_first_windows": [round(b, 6) for b in warm.balancedness_per_window[:k]],
        "trivial_first_windows": [round(b, 6) for b in cold.balancedness_per_window[:k]],
        "warm_first_window_ratio": round(warm.balancedness_per_window[0] / pool_balance, 6),
        "trivial_first_window_ratio": round(cold.balancedness_per_window[0] / pool_balance, 6),
    }
