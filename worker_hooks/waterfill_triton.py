"""The water-fill of one layer as one Triton kernel (`HookConfig.waterfill_kernel="triton"`).

`waterfill.waterfill` in torch is a few kernels per pass (the GPUs' loads, the sort, the
cumulative sum, the level, the damped move), ~2 us each even replayed from a CUDA graph,
so at 4 passes the water-fill alone costs more than the rest of the dispatch. The work
itself is tiny ([X, G] = 257 x 32 int64 at DeepSeek-V3's EP32), so here one program
holds the whole layer and runs every pass in registers: one launch per layer.

Same integers as the torch version, bit for bit (tests/gpu/test_waterfill_triton.py):
every value is a non-negative int64 (loads, levels, shares), so Triton's truncating
integer division equals torch's floor division. Padding to powers of two: padded GPUs
get a level above every real one (they sort last and are left out of the level), padded
experts no demand (their share stays 0).

Registered as the custom op `worker_hooks::waterfill` (torch.library.triton_op), so
`torch.compile` (`HookConfig.compile_dispatch`) calls the kernel from its own graph and
CUDA graph capture records it like any kernel. Triton is imported here only: a CPU
install never loads it.
"""

from __future__ import annotations

from fractions import Fraction

import torch
import triton
import triton.language as tl

from rebalancer.wire.dispatch import WATERFILL_DAMPING, WATERFILL_FAR, WATERFILL_PASSES

# A padded GPU's level: above every real one (WATERFILL_FAR plus any load), and its sum
# over 2^10 padded GPUs still far below int64's range.
_PADDED_LEVEL = WATERFILL_FAR << 1
# Left out of the minimum over sorted positions: the positions of padded GPUs.
_NOT_A_LEVEL = 1 << 62


@triton.jit
def _waterfill_kernel(
    demand_ptr, start_ptr, far_ptr, base_ptr, out_ptr, num_experts, num_gpus,
    PASSES: tl.constexpr, KEEP: tl.constexpr, MOVE: tl.constexpr, DENOMINATOR: tl.constexpr,
    BLOCK_X: tl.constexpr, BLOCK_G: tl.constexpr,
    PADDED_LEVEL: tl.constexpr, NOT_A_LEVEL: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_X)
    cols = tl.arange(0, BLOCK_G)
    row_ok = rows < num_experts
    col_ok = cols < num_gpus
    ok = row_ok[:, None] & col_ok[None, :]
    offsets = rows[:, None] * num_gpus + cols[None, :]
    start = tl.load(start_ptr + offsets, mask=ok, other=0)
    far = tl.load(far_ptr + offsets, mask=ok, other=PADDED_LEVEL)
    demand = tl.load(demand_ptr + rows, mask=row_ok, other=0)
    base = tl.load(base_ptr + cols, mask=col_ok, other=0)
    k = (cols + 1).to(tl.int64)  # GPUs at or below each sorted position
    share = start
    for _ in tl.static_range(PASSES):
        load = tl.sum(share, axis=0) + base  # [G]
        masked = load[None, :] - share + far  # [X, G] each GPU's load without this expert
        ordered = tl.sort(masked, dim=1)
        levels = (tl.cumsum(ordered, axis=1) + demand[:, None]) // k[None, :]
        level = tl.min(tl.where(col_ok[None, :], tl.maximum(levels, ordered), NOT_A_LEVEL), axis=1)
        target = tl.maximum(level[:, None] - masked, 0)
        share = tl.where(ok, (share * KEEP + target * MOVE) // DENOMINATOR, 0)
    peak = tl.max(tl.sum(share, axis=0) + base, axis=0)
    start_peak = tl.max(tl.sum(start, axis=0) + base, axis=0)
    tl.store(out_ptr + offsets, tl.where(peak < start_peak, share, start), mask=ok)


@torch.library.triton_op("worker_hooks::waterfill", mutates_args=())
def _waterfill_op(
    demand: torch.Tensor, start: torch.Tensor, far: torch.Tensor, base: torch.Tensor,
    passes: int, move: int, denominator: int,
) -> torch.Tensor:
    num_experts, num_gpus = start.shape
    out = torch.empty_like(start)
    torch.library.wrap_triton(_waterfill_kernel)[(1,)](
        demand, start, far, base, out, num_experts, num_gpus,
        PASSES=passes, KEEP=denominator - move, MOVE=move, DENOMINATOR=denominator,
        BLOCK_X=triton.next_power_of_2(num_experts), BLOCK_G=triton.next_power_of_2(num_gpus),
        PADDED_LEVEL=_PADDED_LEVEL, NOT_A_LEVEL=_NOT_A_LEVEL,
        num_warps=16,
    )
    return out


def waterfill(
    demand: torch.Tensor,
    start: torch.Tensor,
    far: torch.Tensor,
    base: torch.Tensor | None,
    passes: int = WATERFILL_PASSES,
    damping: Fraction = WATERFILL_DAMPING,
) -> torch.Tensor:
    """`waterfill.waterfill` in one launch: [X] demand, [X, G] start/far, [G] base (None:
    zero) -> [X, G] int64 units, the same integers."""
    if base is None:
        base = torch.zeros(start.shape[1], dtype=torch.int64, device=start.device)
    return _waterfill_op(
        demand.contiguous(), start.contiguous(), far.contiguous(), base.contiguous(),
        passes, damping.numerator, damping.denominator,
    )
