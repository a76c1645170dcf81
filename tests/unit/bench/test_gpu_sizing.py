"""The transformers GPU bench sizes itself before it allocates (bench.gpu_transformers'
`memory_need` / `size_to_device`, pure arithmetic, on CPU): with its defaults it serves
the layers the GPU holds (one on an 80 GB H100, two on an H200), and refuses in one line
with the numbers what was asked for explicitly and cannot fit. Its one-GPU plan can move
weights without changing the work (`reshuffled`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from bench.gpu_transformers import (  # noqa: E402
    GIB,
    BenchConfig,
    SizeError,
    memory_need,
    model_config,
    reshuffled,
    size_to_device,
)
from rebalancer.wire.layout import trivial_placement  # noqa: E402

H100_FREE = int(78.5 * GIB)  # an 80 GB H100 with a CUDA context
H200_FREE = int(139.0 * GIB)
EXPERT_BYTES = 3 * 7168 * 2048 * 2  # DeepSeek-V3: gate_up [4096, 7168] + down [7168, 2048], bf16


def test_need_at_deepseek_v3_shapes_counts_stock_experts_beside_slot_rows() -> None:
    one = memory_need(BenchConfig(), layers=1)
    assert one.stock_experts == 256 * EXPERT_BYTES  # 21 GiB a layer, kept for the stock variant
    assert one.slot_rows == (256 + 32 + 16) * EXPERT_BYTES  # P = 288 slots + 16 spare rows
    assert one.staging == 16 * EXPERT_BYTES  # the one-GPU plan moves spare_rows experts a layer
    two = memory_need(BenchConfig(), layers=2)
    assert two.stock_experts == 2 * one.stock_experts and two.slot_rows == 2 * one.slot_rows
    # two layers are more than an H100 holds, fewer than an H200
    assert H100_FREE < two.total < H200_FREE
    # a rank of two holds half the slots, and its blocks see both ranks' tokens
    pair = memory_need(BenchConfig(), layers=1, world=2)
    assert pair.slot_rows == (144 + 16) * EXPERT_BYTES
    assert pair.activations > one.activations
    assert memory_need(BenchConfig(tokens=4096), 1).activations > one.activations


def test_need_matches_the_model_the_bench_builds() -> None:
    """The arithmetic reads the shapes model_config builds: the weights of the model on
    the meta device (no memory) are the stock experts and the other weights."""
    import transformers

    cfg = BenchConfig(layers=2)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            model_config(cfg), dtype=torch.bfloat16
        )
    experts = sum(p.numel() * 2 for n, p in model.named_parameters() if ".mlp.experts." in n)
    other = sum(p.numel() * 2 for n, p in model.named_parameters() if ".mlp.experts." not in n)
    need = memory_need(cfg, layers=2)
    assert need.stock_experts == experts
    assert abs(need.other_weights - other) < 1e-3 * other  # norms and biases left out


def test_defaults_take_the_layers_the_gpu_holds() -> None:
    asked = BenchConfig(auto_layers=True)  # the bench's defaults: up to 2 layers
    on_h100, need = size_to_device(asked, H100_FREE)
    assert on_h100.layers == 1 and need.layers == 1 and need.total <= H100_FREE
    assert on_h100.tokens == asked.tokens and on_h100.redundant == asked.redundant
    on_h200, need = size_to_device(asked, H200_FREE)
    assert on_h200.layers == 2 and need.total <= H200_FREE


def test_what_was_asked_for_and_cannot_fit_is_refused_in_one_line_with_the_numbers() -> None:
    with pytest.raises(SizeError) as refused:
        size_to_device(BenchConfig(layers=2), H100_FREE)  # --layers 2 given
    message = str(refused.value)
    need = memory_need(BenchConfig(), 2).total / GIB
    assert f"need {need:.1f} GiB" in message and "78.5 GiB free" in message
    assert "--layers 1 fits" in message and "\n" not in message
    # nothing fits, defaults or not: refused, not shrunk to zero layers
    with pytest.raises(SizeError, match=r"even 1 layer needs .* GiB"):
        size_to_device(BenchConfig(auto_layers=True, tokens=65536), H100_FREE)
    with pytest.raises(SizeError, match="20.0 GiB free"):
        size_to_device(BenchConfig(auto_layers=True), int(20 * GIB))


@pytest.mark.parametrize("kind", ["rotate", "random"])
def test_one_gpu_plan_moves_the_first_spare_rows_slots(kind: str) -> None:
    old = trivial_placement(3, 256, 288, 1)
    new = reshuffled(old, 256, 16, kind)  # type: ignore[arg-type]
    moved = new != old
    assert moved[:, 256:272].all() and not moved[:, :256].any() and not moved[:, 272:].any()
    for layer in range(3):  # every expert keeps its first copy
        assert set(new[layer].tolist()) == set(range(256))
    same_work = all(
        (np.bincount(new[layer], minlength=256) == np.bincount(old[layer], minlength=256)).all()
        for layer in range(3)
    )
    # rotate: the same experts keep the same replicas (the grouped products' work is
    # unchanged); random: other experts are replicated
    assert same_work == (kind == "rotate")
