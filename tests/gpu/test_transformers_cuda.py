"""The transformers adapter on a GPU: each MoE block captured in a CUDA graph replays what
eager runs, and keeps doing so across a placement committed through the hook's own path
(weights migrated into spare rows, maps swapped in place between replays, no recapture).
Skipped without CUDA or transformers."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

EXPERTS, REDUNDANT, SPARE, TOKENS = 16, 4, 3, 24


@pytest.fixture(scope="module", autouse=True)
def world_of_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    folder: Path = tmp_path_factory.mktemp("rdzv")
    dist.init_process_group("gloo", init_method=f"file://{folder}/rdzv", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_graphed_blocks_replay_eager_across_a_committed_placement(family: str) -> None:
    from tests.engines.transformers.test_adapter import _commit_through_hook, _shuffled_placement
    from worker_hooks.engines.transformers import AdapterConfig, Link, attach, graph_moe_blocks
    from worker_hooks.engines.transformers.families import build_tiny_model
    from worker_hooks.engines.transformers.worker import token_batch, weights_match_map

    device = torch.device("cuda", 0)
    # bfloat16: torch's grouped products of other dtypes loop over the groups on the host.
    reference = build_tiny_model(family, seed=5, experts=EXPERTS).to(device, torch.bfloat16)  # type: ignore[arg-type]
    model = copy.deepcopy(reference)
    ep = attach(
        model,
        AdapterConfig(
            link=Link("127.0.0.1:1", deployment="t"),
            redundant_slots=REDUNDANT,
            spare_rows=SPARE,
            agree_every=2,
        ),
    )
    ids = token_batch(0, 0, TOKENS, int(reference.config.vocab_size), seed=1).to(device)

    def logits(m: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return m(ids).logits.clone()

    eager = logits(model)
    # The grouped products (CUDA) against transformers' own experts: same picks, other
    # kernels, bfloat16 rounding.
    torch.testing.assert_close(eager, logits(reference), rtol=2e-2, atol=2e-2)
    hidden = int(reference.config.hidden_size)

    def example(_block: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        return torch.randn(1, TOKENS, hidden, device=device, dtype=torch.bfloat16), {}

    graph_moe_blocks(model, example)
    graphed = logits(model)
    assert torch.equal(graphed, eager)

    old = ep.hook.phy2log.copy()
    new = _shuffled_placement(old, EXPERTS, seed=11)
    _commit_through_hook(ep, new)
    np.testing.assert_array_equal(ep.hook.phy2log, new)
    assert (ep.hook.rows.rows != np.arange(ep.hook.config.slots_per_rank)).any()
    assert weights_match_map(ep, reference)
    # Same graphs, new maps and rows: the same logits (each pick computed by a copy of its expert).
    torch.testing.assert_close(logits(model), eager, rtol=2e-2, atol=2e-2)


def test_capture_of_float32_experts_is_refused_with_the_reason() -> None:
    from worker_hooks.engines.transformers import AdapterConfig, Link, attach, graph_moe_blocks
    from worker_hooks.engines.transformers.families import build_tiny_model

    model = build_tiny_model("qwen3_moe", seed=5, experts=EXPERTS).to("cuda")  # type: ignore[arg-type]
    attach(model, AdapterConfig(Link("127.0.0.1:1", deployment="t"), redundant_slots=REDUNDANT))
    with pytest.raises(ValueError, match="needs bfloat16 expert weights on a CUDA device"):
        graph_moe_blocks(model, lambda _b: (torch.zeros(1, TOKENS, 8, device="cuda"), {}))
