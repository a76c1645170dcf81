"""The offline path against SGLang's own code, on every DeepSeek-V3 workload.

For each workload: SGLang's recorder dump (`.pt`, `logical_count [T, L, E]`) ->
`rebalancer plan --sglang-out` (the CLI, in a subprocess) -> the file given to SGLang's
`--init-expert-location`, loaded by SGLang's own `compute_initial_expert_location_metadata`.
Beside it, SGLang's own `ExpertLocationMetadata.init_by_eplb` on the same dump (what
`--init-expert-location dump.pt` would install). Prints the balancedness of both on the
dump's counts, layout DeepSeek-V3 at EP32: 288 slots, 4 nodes, 8 expert groups.

Needs SGLang importable (scripts/sglang_env.sh provisions it):
    PYTHONPATH=.ci/tools/sglang-site:bench/cpu_shims \
        .venv/bin/python -m bench.sglang_offline [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import numpy as np

GPUS, SLOTS, NODES, GROUPS = 32, 288, 4, 8


def _sglang_context(model_dir: Path, init_expert_location: str) -> object:
    """Publish SGLang's runtime context for rank 0 of an EP32 DeepSeek-V3 and return its
    ModelConfig. The model-class lookup is stood in (it would import SGLang's GPU model
    code); SGLang's placement code and loader are its own."""
    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.eplb.expert_location import ModelConfigForExpertLocation
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "n_group": GROUPS,
        "topk_group": 4,
        "hidden_size": 64,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
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
    (model_dir / "config.json").write_text(json.dumps(config))
    server_args = ServerArgs(
        model_path=str(model_dir),
        device="cpu",
        tp_size=GPUS,
        ep_size=GPUS,
        nnodes=NODES,
        enable_eplb=True,
        ep_num_redundant_experts=SLOTS - 256,
        skip_tokenizer_init=True,
        init_expert_location=init_expert_location,
        dist_init_addr="127.0.0.1:1",
    )
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    ModelConfigForExpertLocation.from_model_config = staticmethod(  # type: ignore[method-assign]
        lambda _config: ModelConfigForExpertLocation(61, 256, GROUPS)
    )
    if not torch.distributed.is_initialized():  # init_by_eplb asks for this process's rank
        torch.distributed.init_process_group(
            "gloo",
            init_method="tcp://127.0.0.1:0",
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=30),
        )
    return ModelConfig.from_server_args(server_args)


def run(emit=print) -> dict:
    import torch
    from sglang.srt.eplb import expert_location as sgl_location

    from rebalancer.datasets import deepseek_v3_files
    from rebalancer.placement.metrics import balancedness

    rows = []
    with tempfile.TemporaryDirectory(prefix="sglang-offline-") as tmp:
        folder = Path(tmp)
        model_config = None
        for path in deepseek_v3_files():
            counts = np.asarray(json.loads(path.read_text())["logical_count"], dtype=np.int64)
            dump = folder / f"{path.stem}.pt"  # the form SGLang's recorder dumps: [T, L, E]
            torch.save({"rank": 0, "logical_count": torch.from_numpy(counts)[None]}, dump)
            ours_file = folder / f"{path.stem}.sglang.json"
            start = time.perf_counter()
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "rebalancer",
                    "plan",
                    "--counts",
                    str(dump),
                    "--gpus",
                    str(GPUS),
                    "--slots",
                    str(SLOTS),
                    "--nodes",
                    str(NODES),
                    "--groups",
                    str(GROUPS),
                    "--sglang-out",
                    str(ours_file),
                    "--json",
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            plan_seconds = time.perf_counter() - start
            report = json.loads(out.stdout.strip().splitlines()[-1])
            if model_config is None:
                model_config = _sglang_context(folder, str(ours_file))
            # SGLang's own loader installs our file ...
            from sglang.srt.runtime_context import get_exec

            with get_exec().moe.override(init_expert_location=str(ours_file)):
                installed = sgl_location.compute_initial_expert_location_metadata(
                    model_config, moe_ep_rank=0
                )
            ours = installed.physical_to_logical_map_cpu.numpy()
            # ... and its own EPLB on the same dump.
            start = time.perf_counter()
            theirs_meta = sgl_location.ExpertLocationMetadata.init_by_eplb(
                model_config, logical_count=torch.load(dump, weights_only=True)["logical_count"]
            )
            sglang_seconds = time.perf_counter() - start
            theirs = theirs_meta.physical_to_logical_map_cpu.numpy()
            row = {
                "workload": path.stem,
                "ours": balancedness(ours, counts, GPUS),
                "sglang_init_by_eplb": balancedness(theirs, counts, GPUS),
                "bound": report["bound_balancedness"],
                "loaded_equals_planned": bool(
                    np.array_equal(
                        ours,
                        np.asarray(json.loads(ours_file.read_text())["physical_to_logical_map"]),
                    )
                ),
                "plan_cli_seconds": plan_seconds,
                "sglang_seconds": sglang_seconds,
            }
            rows.append(row)
            emit(
                f"{row['workload']:24s} ours {row['ours']:.4f}  SGLang init_by_eplb "
                f"{row['sglang_init_by_eplb']:.4f}  bound {row['bound']:.4f}  "
                f"loaded by SGLang: {row['loaded_equals_planned']}"
            )
    summary = {
        "layout": {"gpus": GPUS, "slots": SLOTS, "nodes": NODES, "groups": GROUPS},
        "workloads": rows,
        "ours_mean": float(np.mean([r["ours"] for r in rows])),
        "sglang_mean": float(np.mean([r["sglang_init_by_eplb"] for r in rows])),
    }
    emit(f"mean: ours {summary['ours_mean']:.4f}, SGLang init_by_eplb {summary['sglang_mean']:.4f}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args()
    summary = run()
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
