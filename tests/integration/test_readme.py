"""README.md's Python runs as written, against a real controller on loopback.

Each ```python block of the README is executed unchanged, in real processes: the hook of
"Turning it on" (then the per-step dispatch line, in the same namespace) on two gloo
ranks, the transformers adapter on a tiny model in a world of one. The names a snippet
leaves to the integrator (rank, L, E, P, G, phy2log, weights, the groups, device, the
serving loop's steps, the model and its batches) come from a small prelude here; the
address from REBALANCER_ADDRESS, as the sidecar component sets it in the engine
container. The README's line numbers appear in any traceback. A block this test does not
know fails it: a new snippet needs its prelude.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from rebalancer.controller.decide import PolicyConfig
from tests.integration.conftest import start_controller

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

# Two ranks of one EP group, as an engine would have them.
HOOK_PRELUDE = """
import sys, torch, torch.distributed as dist
from rebalancer.wire.layout import trivial_placement
rank, G = int(sys.argv[1]), 2
dist.init_process_group("gloo", init_method=sys.argv[2], rank=rank, world_size=G)
agree_group, migrate_group = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
L, E, P, device = 2, 8, 12, "cpu"
phy2log = trivial_placement(L, E, P, G)
weights = {"w13": torch.randn(L, P // G, 16, 8), "w2": torch.randn(L, P // G, 8, 16)}
generator = torch.Generator().manual_seed(rank)
forward_steps = [[torch.randint(0, E, (32, 2), generator=generator) for _ in range(L)] for _ in range(40)]
"""
HOOK_RESULT = "result = {'windows': hook.stats.windows, 'steps': hook.stats.steps, 'mode': config.dispatch.mode}"

# A world of one and a tiny DeepSeek-V3 (random weights) with its token batches.
TRANSFORMERS_PRELUDE = """
import sys, torch.distributed as dist
from worker_hooks.engines.transformers.families import build_tiny_model
from worker_hooks.engines.transformers.worker import token_batch
dist.init_process_group("gloo", init_method=sys.argv[2], rank=0, world_size=1)
model = build_tiny_model("deepseek_v3", experts=16)
batches = [token_batch(step, 0, 16, 128, seed=0) for step in range(20)]
"""
TRANSFORMERS_RESULT = "result = {'windows': ep.hook.stats.windows, 'logits': list(logits.shape)}"

RUNNER = """
import json, sys
namespace = {"__name__": "__readme__"}
with open(sys.argv[3]) as f:
    prelude, blocks, result = json.load(f)
exec(compile(prelude, "<test prelude>", "exec"), namespace)
for line, code in blocks:  # padded, so a traceback names the README's own line
    exec(compile("\\n" * (line - 1) + code, "README.md", "exec"), namespace)
exec(result, namespace)
print("RESULT " + json.dumps(namespace["result"]), flush=True)
"""


def python_blocks() -> list[tuple[int, str]]:
    """(first line of its code, code) of every ```python block of the README."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


def wait_for(predicate: Callable[[], object], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_the_readme_python_runs_as_written(tmp_path: Path) -> None:
    blocks = python_blocks()
    hook_blocks = [b for b in blocks if "RebalanceHook(" in b[1] or "DispatchConfig(" in b[1]]
    adapter_blocks = [b for b in blocks if "attach(" in b[1]]
    assert len(hook_blocks) == 2 and len(adapter_blocks) == 1, "a README block this test does not run"
    assert len(blocks) == len(hook_blocks) + len(adapter_blocks), "a README block this test does not run"
    # Paused: the hook's windows are what is checked here (plans: tests/integration).
    ctl = start_controller(tmp_path / "c.sqlite", replace(PolicyConfig(), paused=True))
    assert ctl.server is not None
    env = {**os.environ, "REBALANCER_ADDRESS": ctl.server.address, "OMP_NUM_THREADS": "1"}
    runs = [(HOOK_PRELUDE, hook_blocks, HOOK_RESULT, str(rank), f"file://{tmp_path}/hook-rdzv") for rank in (0, 1)]
    runs.append((TRANSFORMERS_PRELUDE, adapter_blocks, TRANSFORMERS_RESULT, "0", f"file://{tmp_path}/tf-rdzv"))
    procs: list[subprocess.Popen[str]] = []
    try:
        for i, (prelude, chosen, result, rank, rendezvous) in enumerate(runs):
            program = tmp_path / f"program{i}.json"
            program.write_text(json.dumps([textwrap.dedent(prelude), chosen, result]))
            procs.append(subprocess.Popen([sys.executable, "-c", RUNNER, rank, rendezvous, str(program)], cwd=tmp_path,
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outputs = []
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-4000:]
            (line,) = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            outputs.append(json.loads(line[len("RESULT "):]))

        def deployment(name: str) -> Any:
            return ctl.call(lambda: ctl.server.controller.deployments.get(name))  # type: ignore[union-attr]

        # Every pick the hook counted (2 ranks x 40 steps x 32 tokens x top 2 x 2 layers, in 2
        # full windows and the last, partial, one sent at finish) reached the controller.
        hook_a, hook_b, adapter = outputs
        assert hook_a == hook_b == {"windows": 3, "steps": 40, "mode": "load+shared"}
        picks = 2 * 40 * 32 * 2 * 2
        wait_for(lambda: deployment("deepseek-v3-prod") is not None
                 and deployment("deepseek-v3-prod").stats.tokens_folded == picks, 30, "the hook's picks folded")
        assert deployment("deepseek-v3-prod").shape.num_gpus == 2
        assert adapter["windows"] >= 1 and adapter["logits"][:2] == [1, 16]
        wait_for(lambda: deployment("ds-v3") is not None and deployment("ds-v3").stats.tokens_folded > 0, 30,
                 "the adapter's picks folded")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
        ctl.stop()
