"""Tiny random-weight models of the five MoE families the adapter serves, from configs.

Tests, the reference worker and the bench build the same model on every rank from a
family name and a seed (no download, no hub access): every rank then holds identical
non-expert weights, and any rank can rebuild any logical expert to check its slots.
DeepSeek-V4's first layers route by a frozen token -> experts table (`tid2eid`), which a
random init leaves all zero; `build_tiny_model` fills it with distinct random experts
per token so hash-routed layers spread their load as a real table does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, get_args

from worker_hooks.engines import require_engine

if TYPE_CHECKING:
    import torch

Family = Literal["deepseek_v3", "qwen3_moe", "mixtral", "olmoe", "deepseek_v4"]
FAMILIES: tuple[Family, ...] = get_args(Family)


def _config_kwargs(
    family: Family, experts: int, top_k: int, layers: int, hidden: int
) -> tuple[str, dict[str, Any]]:
    """The transformers config class name and its arguments for a tiny model."""
    heads = 4
    common: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        num_experts_per_tok=top_k,
        max_position_embeddings=256,
    )
    if family == "deepseek_v3":
        return "DeepseekV3Config", dict(
            common,
            intermediate_size=2 * hidden,
            moe_intermediate_size=hidden,
            n_routed_experts=experts,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            rope_scaling=None,
        )
    if family == "qwen3_moe":
        return "Qwen3MoeConfig", dict(
            common,
            intermediate_size=2 * hidden,
            moe_intermediate_size=hidden,
            num_experts=experts,
            head_dim=hidden // heads,
            norm_topk_prob=True,
        )
    if family == "mixtral":
        return "MixtralConfig", dict(common, intermediate_size=hidden, num_local_experts=experts)
    if family == "olmoe":
        return "OlmoeConfig", dict(
            common, intermediate_size=hidden, num_experts=experts, pad_token_id=1, eos_token_id=2
        )
    if family == "deepseek_v4":
        return "DeepseekV4Config", dict(
            common,
            moe_intermediate_size=hidden,
            n_routed_experts=experts,
            num_key_value_heads=1,
            head_dim=32,
            q_lora_rank=32,
            o_groups=2,
            o_lora_rank=16,
            index_n_heads=2,
            index_head_dim=16,
            index_topk=8,
            sliding_window=16,
            hc_mult=2,
            hc_sinkhorn_iters=3,
            layer_types=["sliding_attention"] * layers,
            mlp_layer_types=["hash_moe"] + ["moe"] * (layers - 1),
        )
    raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")


def tiny_config(
    family: Family, experts: int = 16, top_k: int = 4, layers: int = 3, hidden: int = 64
) -> Any:
    """A transformers config of `family` with small shapes (fp32, eager attention)."""
    transformers = require_engine("transformers", "transformers", "transformers")

    name, kwargs = _config_kwargs(family, experts, top_k, layers, hidden)
    config = getattr(transformers, name)(**kwargs)
    config._attn_implementation = "eager"
    return config


def build_tiny_model(
    family: Family, seed: int = 0, experts_implementation: str = "batched_mm", **shape: int
) -> torch.nn.Module:
    """A causal LM of `family` with random weights drawn from `seed`, in eval mode.

    `batched_mm` computes every (token, expert) pick as its own small product, so the
    unwrapped model is the bit-exact reference of the adapter's CPU expert compute."""
    import torch

    transformers = require_engine("transformers", "transformers", "transformers")
    config = tiny_config(family, **shape)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, experts_implementation=experts_implementation
    )
    gen = torch.Generator().manual_seed(seed + 1)
    for module in model.modules():
        table = getattr(getattr(module, "gate", None), "tid2eid", None)
        if isinstance(table, torch.Tensor):  # DeepSeek-V4 hash routing: distinct experts per token
            vocab, top_k = table.shape
            num_experts = module.gate.num_experts
            keys = torch.rand(vocab, num_experts, generator=gen)
            table.copy_(keys.topk(top_k, dim=1).indices)
    return model.eval()
