"""Offline: vLLM's EPLB load window, saved with torch by the adapter's `save_load_dump`
from vLLM's real `EplbState`, read by `rebalancer plan`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rebalancer.errors import InputError
from rebalancer.formats import read_counts
from tests.engines.vllm import vllm_env

DUMP_SCRIPT = """
import sys, types, torch
from vllm.config import ParallelConfig
from vllm.config.parallel import EPLBConfig
from vllm.distributed import parallel_state
from vllm.distributed.eplb.eplb_state import EplbState
from tests.engines.vllm.worker import install_stand_ins
from worker_hooks.engines.vllm import save_load_dump
import torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
install_stand_ins(torch, dist.new_group(backend="gloo"))

class Layer:
    def __init__(self): self.w = [torch.zeros(6, 2)]
    def get_expert_weights(self): return self.w
    def set_eplb_state(self, moe_layer_idx, expert_load_view, logical_to_physical_map, logical_replica_count):
        self.view = expert_load_view[moe_layer_idx]

class Moe:
    num_moe_layers, num_expert_groups, num_logical_experts, num_physical_experts = 2, 1, 4, 6
    num_local_physical_experts, num_routed_experts, num_shared_experts, num_redundant_experts = 6, 4, 0, 2
    def __init__(self): self.moe_layers = [Layer(), Layer()]
    def set_eplb_state(self, view, l2p, count):
        self.expert_weights = [l.get_expert_weights() for l in self.moe_layers]
        for i, l in enumerate(self.moe_layers): l.set_eplb_state(i, view, l2p, count)

config = ParallelConfig(eplb_config=EPLBConfig(window_size=4, step_interval=100, communicator="torch_gloo"))
state = EplbState(config, torch.device("cpu"))
model = Moe()
state.add_model(model, types.SimpleNamespace(model="m", compute_hash=lambda: "m"))
state.expert_rearrangement_step = 96   # inside the recorded window
for step in range(3):                  # slot s of layer l gets (l + 1) * (s + 1) tokens a step
    for l, layer in enumerate(model.moe_layers):
        layer.view += torch.tensor([(l + 1) * (s + 1) for s in range(6)], dtype=torch.int32)
    state.step()
save_load_dump(state, sys.argv[1])
"""  # noqa: E501


@pytest.mark.slow
@pytest.mark.skipif(not vllm_env.available(), reason=vllm_env.MISSING)
def test_vllm_window_dump_is_planned(tmp_path: Path) -> None:
    dump = tmp_path / "vllm_load.pt"
    from rebalancer.launch.processes import free_port

    port = free_port()
    out = subprocess.run(
        [sys.executable, "-c", DUMP_SCRIPT, str(dump), str(port)],
        cwd=vllm_env.ROOT,
        env=vllm_env.environment(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # vLLM's initial map: slots 0..3 hold experts 0..3, slots 4, 5 hold experts 0, 1.
    expected = np.array(
        [
            [(layer + 1) * 3 * (s + 1 + (s + 5 if s < 2 else 0)) for s in range(4)]
            for layer in range(2)
        ],
        dtype=np.float64,
    )
    assert np.array_equal(read_counts(dump).logical, expected)
    cli = "import sys; from rebalancer.cli import main; sys.exit(main())"
    plan = subprocess.run(
        [
            sys.executable,
            "-c",
            cli,
            "plan",
            "--counts",
            str(dump),
            "--gpus",
            "2",
            "--slots",
            "6",
            "--json",
        ],
        cwd=vllm_env.ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plan.returncode == 0, plan.stderr
    summary = json.loads(plan.stdout.strip().splitlines()[-1])
    assert summary["balancedness"] > 0


def test_vllm_dump_that_does_not_fit_its_map_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.pt"
    torch.save(
        {
            "expert_load_window": torch.zeros(2, 3, 6, dtype=torch.int32),
            "physical_to_logical_map": torch.zeros(3, 5, dtype=torch.int64),
        },
        path,
    )
    with pytest.raises(InputError, match="does not fit"):
        read_counts(path)
