"""The transformers adapter in one process, on each of the five families' real model code:
wrapped logits equal the unwrapped model's bit for bit (fp32, CPU), and still do after a
new placement is prepared and committed through the hook's own path (migration executor,
spare rows, commit agreement); DeepSeek-V4's hash-routed layer counts in its own layer."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from rebalancer.placement.transfers import transfers
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire import codec
from worker_hooks.engines.transformers import (
    AdapterConfig,
    ExpertParallelModel,
    Link,
    attach,
    find_moe_blocks,
)
from worker_hooks.engines.transformers.families import FAMILIES, Family, build_tiny_model
from worker_hooks.engines.transformers.worker import token_batch, weights_match_map

pytest.importorskip("transformers")

EXPERTS, REDUNDANT, SPARE = 16, 4, 3


@pytest.fixture(scope="module", autouse=True)
def world_of_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A one-rank gloo group: the commit agreement all-reduces over it."""
    folder: Path = tmp_path_factory.mktemp("rdzv")
    dist.init_process_group("gloo", init_method=f"file://{folder}/rdzv", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _wrapped(
    family: Family, **kw: int
) -> tuple[torch.nn.Module, torch.nn.Module, ExpertParallelModel]:
    reference = build_tiny_model(family, seed=5, experts=EXPERTS)
    model = copy.deepcopy(reference)
    # Nothing listens on port 1: the agent is never started, plans come from the test.
    config = AdapterConfig(
        link=Link("127.0.0.1:1", deployment="t"),
        redundant_slots=REDUNDANT,
        spare_rows=SPARE,
        agree_every=2,
        **kw,  # type: ignore[arg-type]
    )
    return reference, model, attach(model, config)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _commit_through_hook(ep: ExpertParallelModel, new: np.ndarray) -> None:
    """Prepare plan v+1 as the controller's Prepare would, commit it, step to the switch."""
    hook = ep.hook
    version = hook.version + 1
    moves = transfers(hook.phy2log, new, num_gpus=hook.config.shape.num_gpus)
    hook.plans.on_prepare(
        pb.Prepare(
            version=version,
            base_version=hook.version,
            placement=pb.Placement(version=version, phy2log=codec.encode(new.astype(np.int32))),
            transfers=codec.encode(moves.astype(np.int32)),
        )
    )
    assert hook.plans.migration is not None
    hook.plans.migration.join(30)
    assert hook.stats.prepared == version and hook.stats.failed == 0
    hook.plans.on_commit(version)
    for _ in range(4 * hook.config.commit.agree_every):
        if hook.version == version:
            break
        hook.step_end()
    assert hook.version == version


def _shuffled_placement(phy2log: np.ndarray, num_logical: int, seed: int) -> np.ndarray:
    """Every expert once plus replicas of other experts, at new slots, per layer."""
    rng = np.random.default_rng(seed)
    out = np.empty_like(phy2log)
    extra = phy2log.shape[1] - num_logical
    for layer in range(phy2log.shape[0]):
        row = np.concatenate(
            [np.arange(num_logical), rng.choice(num_logical, extra, replace=False)]
        )
        out[layer] = rng.permutation(row)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_bit_identical_before_and_after_a_committed_placement(family: Family) -> None:
    reference, model, ep = _wrapped(family)
    ids = token_batch(0, 0, 24, int(reference.config.vocab_size), seed=1).view(2, 12)
    before = _logits(model, ids)
    assert torch.equal(before, _logits(reference, ids))

    old = ep.hook.phy2log.copy()
    new = _shuffled_placement(old, EXPERTS, seed=11)
    _commit_through_hook(ep, new)
    assert ep.version == 1 and (ep.hook.phy2log != old).any()
    np.testing.assert_array_equal(ep.hook.phy2log, new)
    # Experts moved into spare rows while "serving"; commit only swapped maps for those.
    assert (ep.hook.rows.rows != np.arange(ep.hook.config.slots_per_rank)).any()
    assert weights_match_map(ep, reference)
    after = _logits(model, ids)
    assert torch.equal(after, before)
    # A second plan on top of the first: rows are reused as they free up.
    _commit_through_hook(ep, _shuffled_placement(new, EXPERTS, seed=12))
    assert ep.version == 2 and weights_match_map(ep, reference)
    assert torch.equal(_logits(model, ids), before)


def test_counts_land_per_layer_and_hash_layer_counts_its_table() -> None:
    reference, model, ep = _wrapped("deepseek_v4")
    blocks = find_moe_blocks(model)
    assert [b.hash_routed for b in blocks] == [True, False, False]
    ids = token_batch(3, 0, 20, int(reference.config.vocab_size), seed=2).view(1, 20)
    _logits(model, ids)
    counts = ep.hook.recorder.logical_counts.numpy()
    top_k = int(reference.config.num_experts_per_tok)
    assert (counts.sum(axis=1) == 20 * top_k).all()  # every MoE layer, its own row
    table = blocks[0].block.gate.tid2eid
    expected = np.bincount(table[ids.reshape(-1)].reshape(-1).numpy(), minlength=EXPERTS)
    np.testing.assert_array_equal(counts[0], expected)  # the hash layer counts its table's picks


def test_grouped_compute_matches_per_pick_within_rounding() -> None:
    """The CUDA path's grouped products, run on CPU: same picks, same rows; only the
    product kernels differ, so the logits agree to fp32 rounding."""
    reference, model, _ = _wrapped("qwen3_moe", expert_compute="grouped")  # type: ignore[arg-type]
    ids = token_batch(1, 0, 16, int(reference.config.vocab_size), seed=3).view(1, 16)
    torch.testing.assert_close(_logits(model, ids), _logits(reference, ids), rtol=1e-5, atol=1e-5)


def test_bad_setups_are_refused_with_their_reason() -> None:
    reference = build_tiny_model("mixtral", seed=0, experts=EXPERTS)
    with pytest.raises(ValueError, match="redundant_slots and spare_rows must be >= 0"):
        AdapterConfig(Link("x:1", deployment="t"), spare_rows=-1)
    with pytest.raises(ValueError, match="expert_compute must be one of auto, per_pick, grouped"):
        AdapterConfig(Link("x:1", deployment="t"), expert_compute="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="has no MoE block"):
        attach(
            torch.nn.Sequential(torch.nn.Linear(2, 2)),
            AdapterConfig(Link("x:1", deployment="t")),
        )
    attach(reference, AdapterConfig(Link("127.0.0.1:1", deployment="t")))
    with pytest.raises(ValueError, match="already attached"):
        attach(reference, AdapterConfig(Link("127.0.0.1:1", deployment="t")))
