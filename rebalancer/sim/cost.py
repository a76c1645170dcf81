"""The cost model the simulator charges every policy with.

A placement matters only through time: the busiest GPU of a layer sets that layer's step
time, stalls stop serving, and weight transfers beside serving slow it down. The model:
- Per layer and step, time = fixed + per-token cost x (tokens routed to the busiest GPU).
  `fixed` covers what does not scale with a GPU's routed tokens (attention, norms, kernel
  launch and all-to-all latency); the per-token part covers the expert GEMMs and the
  dispatch/combine bytes. Unless given explicitly, both are calibrated per trace so that a
  perfectly balanced window takes `window_seconds`, of which `moe_fraction` scales with
  load. Counts are per window, so imbalance inside a window (per step) is not modelled.
- Weights move at `intra_node_gbps` between GPUs of a node and `inter_node_gbps` across
  nodes, per receiving GPU, all GPUs in parallel: a plan takes as long as its busiest
  receiver (plus `plan_overhead_seconds` for the prepare/commit round trips).
- While transfers run beside serving, serving takes `1 + overlap_penalty` times as long
  (copies share SMs, HBM and links with the all-to-all). At commit, serving pauses
  between two graph replays to copy the staged experts into their live slots (the
  busiest rank's received bytes over `commit_gbps`) and to swap the maps (`swap_seconds`).
Defaults are the H200 measurements of bench.gpu_hooks and bench.gpu_migration where they
exist (BENCHMARKS.md, "Worker hooks on GPU"): weights between the GPUs of a node beside a
serving loop at about 300 GB/s (the ipc transport: 306-310 GB/s measured), serving 15%
slower meanwhile (between the ipc transport's +6.8% and NCCL's +31%, as plans across
nodes use NCCL), staged-weight commit at about 700 GB/s (54 experts of 84 MiB in 6.7
ms), map swap 14 us. The inter-node bandwidth is not measured yet.
- Engines that rebalance in-process (`periodic`) stop serving for
  `max(periodic_stall_seconds, transfer time)` per rebalance.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rebalancer.controller.decide import DEEPSEEK_V3_EXPERT_BYTES
from rebalancer.errors import InputError

# Mixtral-8x7B expert in FP8: w1, w3 (4096 x 14336) and w2 (14336 x 4096).
MIXTRAL_8X7B_EXPERT_BYTES = 3 * 4096 * 14336


@dataclass(frozen=True)
class CostModel:
    # Serving step time at perfect balance, and the share of it that scales with the
    # tokens routed to a GPU (the rest is fixed per layer and step).
    step_seconds: float = 0.05
    moe_fraction: float = 0.6
    # Explicit per-layer costs; None calibrates them from the trace (see module docstring).
    fixed_seconds_per_layer: float | None = None
    seconds_per_token: float | None = None
    # Bytes of one expert's weights, and per-GPU receive bandwidths (GB/s) beside serving:
    # intra-node measured on H200 NVLink; inter-node assumed (a 400 Gb/s NIC shared with
    # the all-to-all's RDMA traffic).
    expert_bytes: int = DEEPSEEK_V3_EXPERT_BYTES
    intra_node_gbps: float = 300.0
    inter_node_gbps: float = 20.0
    # Serving slowdown while transfers run beside it (measured +6.8% ipc, +31% NCCL).
    overlap_penalty: float = 0.15
    # Commit pause: staged experts copied into live slots at this rate, then the map swap.
    commit_gbps: float = 700.0
    swap_seconds: float = 0.00002
    # Controller round trips of a plan (prepare, prepared reports, commit).
    plan_overhead_seconds: float = 0.1
    # Blocking stall of one in-process rebalance (SGLang ~1-2 s, vLLM 0.65-1.7 s at EP32).
    periodic_stall_seconds: float = 1.5

    def validate(self) -> None:
        positive = ("step_seconds", "intra_node_gbps", "inter_node_gbps", "commit_gbps")
        for name in positive:
            value = getattr(self, name)
            if not (np.isfinite(value) and value > 0):
                raise InputError(f"cost {name} must be > 0, got {value}")
        non_negative = (
            "overlap_penalty",
            "swap_seconds",
            "plan_overhead_seconds",
            "periodic_stall_seconds",
            "expert_bytes",
        )
        for name in non_negative:
            value = getattr(self, name)
            if not (np.isfinite(value) and value >= 0):
                raise InputError(f"cost {name} must be >= 0, got {value}")
        if not 0.0 < self.moe_fraction <= 1.0:
            raise InputError(f"cost moe_fraction must be in (0, 1], got {self.moe_fraction}")
        for name in ("fixed_seconds_per_layer", "seconds_per_token"):
            value = getattr(self, name)
            if value is not None and not (np.isfinite(value) and value >= 0):
                raise InputError(f"cost {name} must be >= 0, got {value}")


@dataclass(frozen=True)
class WindowClock:
    """Serving time of windows under the cost model, calibrated for one trace."""

    steps_per_window: float
    fixed_seconds_per_layer: float
    seconds_per_token: float
    num_layers: int

    @classmethod
    def calibrate(
        cls, cost: CostModel, counts: np.ndarray, window_seconds: float, num_gpus: int
    ) -> WindowClock:
        """Per-layer costs so that a balanced average window takes `window_seconds`."""
        num_layers = counts.shape[1]
        steps = window_seconds / cost.step_seconds
        fixed = cost.fixed_seconds_per_layer
        if fixed is None:
            fixed = (1.0 - cost.moe_fraction) * cost.step_seconds / num_layers
        per_token = cost.seconds_per_token
        if per_token is None:
            # Mean over windows of sum over layers of the balanced per-GPU load.
            balanced_load = float(counts.sum(axis=(1, 2)).mean()) / num_gpus
            per_token = cost.moe_fraction * window_seconds / max(balanced_load, 1e-12)
        return cls(steps, float(fixed), float(per_token), num_layers)

    def seconds(self, max_load_sum: float) -> float:
        """Serving time of a window whose busiest-GPU loads sum (over layers) to this."""
        return (
            self.steps_per_window * self.num_layers * self.fixed_seconds_per_layer
            + self.seconds_per_token * max_load_sum
        )


def commit_pause_seconds(rows: np.ndarray, num_gpus: int, cost: CostModel) -> float:
    """The serving pause to copy staged experts into live slots: the busiest receiver's."""
    rows = np.asarray(rows)
    if rows.shape[0] == 0:
        return 0.0
    received = np.bincount(rows[:, 1], minlength=num_gpus)
    return float(received.max()) * cost.expert_bytes / (cost.commit_gbps * 1e9)


def rank_receive_seconds(
    rows: np.ndarray, num_gpus: int, num_nodes: int, cost: CostModel
) -> np.ndarray:
    """Seconds each rank [G] needs to receive its incoming experts of a transfer list."""
    rows = np.asarray(rows)
    if rows.shape[0] == 0:
        return np.zeros(num_gpus)
    dst, src = rows[:, 1], rows[:, 3]
    remote = dst != src  # a copy inside one GPU costs HBM time only
    per_node = num_gpus // num_nodes
    inter = remote & (dst // per_node != src // per_node)
    intra = remote & ~inter
    intra_n = np.bincount(dst[intra], minlength=num_gpus)
    inter_n = np.bincount(dst[inter], minlength=num_gpus)
    return cost.expert_bytes * (
        intra_n / (cost.intra_node_gbps * 1e9) + inter_n / (cost.inter_node_gbps * 1e9)
    )


def transfer_seconds(
    rows: np.ndarray, num_gpus: int, num_nodes: int, cost: CostModel
) -> tuple[float, int]:
    """Time for a transfer list [K, 5] (busiest receiver) and the bytes sent between GPUs."""
    rows = np.asarray(rows)
    if rows.shape[0] == 0:
        return 0.0, 0
    per_rank = rank_receive_seconds(rows, num_gpus, num_nodes, cost)
    remote = int(np.count_nonzero(rows[:, 1] != rows[:, 3]))
    return float(per_rank.max()), remote * int(cost.expert_bytes)
