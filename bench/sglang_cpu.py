"""SGLang's real EPLB code on CPU ranks, for the SGLang adapter's tests (tests/engines/sglang)
and bench/sglang_staged.py alike: where SGLang is found, the environment of a process that
imports it, and one EP rank set up on an initialised gloo group with a tiny MoE model.

SGLang pins torch 2.14.1 (the venv has 2.13.0 CPU), so scripts/sglang_env.sh installs
the SGLang wheel and the light packages its EPLB code imports with `--no-deps` into
.ci/tools/sglang-site (CI: `.ci/run --tools`). SGLang runs in worker processes with that
folder and cpu_shims (stubs of triton and torchvision: bench/cpu_shims) on PYTHONPATH.

Stood in on a rank: the model-class lookup `ModelConfigForExpertLocation.from_model_config`
(it would import SGLang's DeepSeek model code, which needs GPU kernels), the recorder's
`get_device` (answers "cpu") and `torch.cpu.empty_cache` (a no-op the updater calls once);
with lp dispatch, the GPU-only parts of SGLang's lp solver (`_lp_stand_ins`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(os.environ.get("REBALANCER_SGLANG_SITE", ROOT / ".ci" / "tools" / "sglang-site"))
SHIMS = Path(__file__).resolve().parent / "cpu_shims"
MISSING = f"SGLang is not provisioned at {SITE}: run scripts/sglang_env.sh (CI: .ci/run --tools)"


def available() -> bool:
    return (SITE / "sglang" / "srt" / "eplb" / "eplb_manager.py").is_file()


def environment(**extra: str) -> dict[str, str]:
    """The environment of a process that imports SGLang: the repo, SGLang's folder, the
    CPU shims (after SGLang's folder, so a real triton there would win)."""
    env = dict(os.environ)
    paths = [str(ROOT), str(SITE), str(SHIMS)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("SGLANG_ROLE_NAMESPACES", "off")
    env.update(extra)
    return env


NUM_LAYERS = 4  # layer 0 dense (first_k_dense_replace=1), 1..3 MoE
NUM_EXPERTS = 8
REDUNDANT = 4  # 12 slots over 4 ranks
TOP_K = 2


def write_model(folder: Path, num_layers: int = NUM_LAYERS) -> None:
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_hidden_layers": num_layers,
        "first_k_dense_replace": 1,
        "n_routed_experts": NUM_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "n_group": 1,
        "topk_group": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "moe_intermediate_size": 8,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "vocab_size": 64,
        "kv_lora_rank": 8,
        "q_lora_rank": None,
        "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 4,
        "v_head_dim": 4,
        "max_position_embeddings": 64,
    }
    (folder / "config.json").write_text(json.dumps(config))


def sglang_cpu_rank(
    rank: int,
    world: int,
    folder: Path,
    num_layers: int = NUM_LAYERS,
    rebalance_iterations: int = 1000,
    dispatch: str | None = None,
    recorder_mode: str | None = None,
) -> Any:
    """SGLang set up on one CPU rank of an initialised gloo group: the tiny model written to
    `folder`/model-rank<rank>, the server args published, and the stand-ins a CPU rank needs
    (module docstring). Returns SGLang's ModelConfig. The tests' worker and
    bench/sglang_staged.py both start their ranks here. `dispatch` and `recorder_mode`:
    SGLang's --ep-dispatch-algorithm and --expert-distribution-recorder-mode (None: what
    SGLang picks with --enable-eplb)."""
    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.eplb import expert_distribution
    from sglang.srt.eplb.expert_location import ModelConfigForExpertLocation
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    model_dir = folder / f"model-rank{rank}"
    model_dir.mkdir(exist_ok=True)
    write_model(model_dir, num_layers)
    extra: dict[str, Any] = {}
    if dispatch == "lp":  # SGLang takes lp only with an a2a backend (DeepEP's, as in production)
        extra.update(ep_dispatch_algorithm="lp", moe_a2a_backend="deepep", deepep_mode="normal")
    elif dispatch is not None:
        extra.update(ep_dispatch_algorithm=dispatch)
    if recorder_mode is not None:
        extra.update(expert_distribution_recorder_mode=recorder_mode)
    server_args = ServerArgs(
        model_path=str(model_dir),
        device="cpu",
        tp_size=world,
        ep_size=world,
        enable_eplb=True,
        ep_num_redundant_experts=REDUNDANT,
        skip_tokenizer_init=True,
        eplb_rebalance_num_iterations=rebalance_iterations,
        **extra,
    )
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=rank))
    if dispatch == "lp":
        _lp_stand_ins()
    model_config = ModelConfig.from_server_args(server_args)
    # Stand-in for the model-class lookup (see the module docstring).
    ModelConfigForExpertLocation.from_model_config = staticmethod(  # type: ignore[method-assign]
        lambda _config: ModelConfigForExpertLocation(num_layers, NUM_EXPERTS, None)
    )
    # The recorder asks sglang.srt.utils.get_device(), which raises without an accelerator
    # (its CPU answer needs SGLANG_USE_CPU_ENGINE, whose platform needs sgl_kernel).
    expert_distribution.get_device = lambda *_a, **_k: "cpu"
    # The updater empties the device cache once (torch.get_device_module().empty_cache());
    # torch.cpu has none.
    if not hasattr(torch.cpu, "empty_cache"):
        torch.cpu.empty_cache = lambda: None
    return model_config


def _lp_stand_ins() -> None:
    """The GPU-only parts of SGLang's lp dispatch, stood in on CPU: the solver's JIT kernel
    warm-up (`torch_solver.warmup`, a no-op), its fused interior-point solve
    (`LPLBSolver._solve`: each replica the solver knows gets an equal share, where the real
    LP weighs them by load) and the CUDA dispatch kernel
    (`_topk_ids_logical_to_physical_probability`: each token's replica column drawn from
    the solver's probabilities, then SGLang's own `partial_logical_to_all_physical_map`
    read at it, as `cuda_solver.dispatch_probability` does). The EP group of the solver's
    all-reduce is None (one rank's counts): the stand-in solve does not read them. The
    solvers themselves are SGLang's `LPLBSolver`, built by SGLang's `init_lplb_solvers`."""
    import torch
    from sglang.kernels.ops.lplb import torch_solver
    from sglang.srt.eplb import expert_location_dispatch
    from sglang.srt.eplb.lplb_solver import LPLBSolver
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(moe_ep_group=None)
    torch_solver.warmup = lambda *_a, **_k: None

    def solve(self: Any, global_counts: Any) -> Any:
        valid = (self.log2phy != -1).float()
        return valid / valid.sum(dim=1, keepdim=True)

    def dispatch(topk_ids: Any, info: Any, log2phy_prob: Any) -> Any:
        flat = topk_ids.flatten().long()
        column = torch.multinomial(log2phy_prob[flat], 1).flatten()
        physical = info.partial_logical_to_all_physical_map[flat, column]
        return physical.view(topk_ids.shape).to(topk_ids.dtype)

    LPLBSolver._solve = solve  # type: ignore[method-assign]
    expert_location_dispatch._topk_ids_logical_to_physical_probability = dispatch
