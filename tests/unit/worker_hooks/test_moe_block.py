"""The reference MoE block on CPU (fp32): matches a per-token loop, and a rebalance
(weights moved to new slots, maps swapped in place) leaves the output bit-identical."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from worker_hooks.dispatch import ReplicaDispatch
from worker_hooks.examples.moe_gpu import MoEBlockConfig, ReferenceMoEBlock, expert_weights
from worker_hooks.record import ExpertRecorder

CPU = torch.device("cpu")


def _cfg(**kw: object) -> MoEBlockConfig:
    base: dict[str, object] = dict(
        hidden=32, intermediate=16, num_experts=8, top_k=2, num_layers=2, dtype=torch.float32
    )
    base.update(kw)
    return MoEBlockConfig(**base)  # type: ignore[arg-type]


def _log2phy(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    width = int(np.bincount(phy2log.reshape(-1) % num_experts).max())
    out = np.full((phy2log.shape[0], num_experts, max(width, 1)), -1, dtype=np.int64)
    for layer, row in enumerate(phy2log):
        fill = np.zeros(num_experts, dtype=np.int64)
        for slot, expert in enumerate(row):
            out[layer, expert, fill[expert]] = slot
            fill[expert] += 1
    return out


def test_matches_per_token_loop() -> None:
    cfg = _cfg()
    phy2log = torch.arange(8).repeat(2, 1)
    rec = ExpertRecorder(cfg.num_layers, cfg.num_experts)
    block = ReferenceMoEBlock(cfg, phy2log, CPU, recorder=rec, seed=3)
    x = torch.randn(13, cfg.hidden, generator=torch.Generator().manual_seed(0))
    out = block.forward(x)
    ref = x.clone()
    seen = np.zeros((cfg.num_layers, cfg.num_experts), dtype=np.int64)
    for layer in range(cfg.num_layers):
        probs = (ref @ block.gate[layer].T).softmax(-1)
        weight, ids = torch.topk(probs, cfg.top_k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        nxt = ref.clone()
        for t in range(ref.shape[0]):
            for k in range(cfg.top_k):
                e = int(ids[t, k])
                seen[layer, e] += 1
                w13, w2 = expert_weights(cfg, layer, e, CPU)
                gate, up = (w13 @ ref[t]).chunk(2)
                nxt[t] += weight[t, k] * (w2 @ (F.silu(gate) * up))
        ref = nxt
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(rec.take_window()[0], seen)


def test_rebalance_keeps_output_bit_identical() -> None:
    # P = 12 slots on 2 "ranks" of 6, simulated in one process: the block of each rank
    # computes its picks; the sum over ranks is the layer output.
    cfg = _cfg(num_gpus=2, num_redundant=4)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(29, cfg.hidden, generator=gen)
    forced = torch.randint(0, cfg.num_experts, (cfg.num_layers, 29, cfg.top_k), generator=gen)
    forced[:, -2:] = -1

    def placement(seed: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        rows = [
            rng.permutation(np.concatenate([np.arange(8), rng.integers(0, 8, 4)])) for _ in range(2)
        ]
        return np.stack(rows)

    def run(blocks: list[ReferenceMoEBlock]) -> torch.Tensor:
        y = x.clone()
        for layer in range(cfg.num_layers):
            ids, weight = blocks[0].route(layer, y, forced[layer])
            per_pick = sum(b.experts(layer, y, b.dispatch(layer, ids)) for b in blocks)
            y = y + (per_pick * weight[..., None]).sum(dim=1)
        return y

    old, new = placement(0), placement(1)
    # Every rank holds the dispatchers of all source ranks (token chunk r starts on r).
    disps = [
        [ReplicaDispatch(_log2phy(old, 8), num_gpus=2, rank=r, max_replicas=6) for r in range(2)]
        for _ in range(2)
    ]
    blocks = [
        ReferenceMoEBlock(
            _cfg(num_gpus=2, num_redundant=4, rank=rank),
            torch.from_numpy(old),
            CPU,
            dispatch=disps[rank],
            seed=5,
        )
        for rank in range(2)
    ]
    before = run(blocks)

    def ptrs() -> list[int]:
        return [b.weights["w13"].data_ptr() for b in blocks] + [
            d.table.data_ptr() for row in disps for d in row
        ]

    kept = ptrs()
    for b in blocks:
        b.fill_from(torch.from_numpy(new))  # what a migration leaves in the slots
        for d in b.dispatchers:
            d.update_(_log2phy(new, 8))
    after = run(blocks)
    assert (old != new).mean() > 0.5
    assert ptrs() == kept
    assert torch.equal(before, after)
    # And the sum over ranks is the right function, not just a stable one.
    ref = run_reference(x, forced, blocks[0], cfg)
    torch.testing.assert_close(after, ref, rtol=1e-4, atol=1e-5)


def run_reference(
    x: torch.Tensor, forced: torch.Tensor, block: ReferenceMoEBlock, cfg: MoEBlockConfig
) -> torch.Tensor:
    y = x.clone()
    for layer in range(cfg.num_layers):
        ids, weight = block.route(layer, y, forced[layer])
        nxt = y.clone()
        for t in range(y.shape[0]):
            for k in range(cfg.top_k):
                if ids[t, k] < 0:
                    continue
                w13, w2 = expert_weights(cfg, layer, int(ids[t, k]), CPU)
                gate, up = (w13 @ y[t]).chunk(2)
                nxt[t] += weight[t, k] * (w2 @ (F.silu(gate) * up))
        y = nxt
    return y
