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

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from rebalancer.controller.decide import PolicyConfig
from rebalancer.launch.processes import free_port
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
"""  # noqa: E501
HOOK_RESULT = (
    "result = {'windows': hook.stats.windows, 'steps': hook.stats.steps, 'mode': "
    "config.dispatch.mode}"
)

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
    return [
        (text.count("\n", 0, m.start(1)) + 1, m.group(1))
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)
    ]


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
    assert len(hook_blocks) == 2 and len(adapter_blocks) == 1, (
        "a README block this test does not run"
    )
    assert len(blocks) == len(hook_blocks) + len(adapter_blocks), (
        "a README block this test does not run"
    )
    # Paused: the hook's windows are what is checked here (plans: tests/integration).
    ctl = start_controller(tmp_path / "c.sqlite", replace(PolicyConfig(), paused=True))
    assert ctl.server is not None
    env = {**os.environ, "REBALANCER_ADDRESS": ctl.server.address, "OMP_NUM_THREADS": "1"}
    runs = [
        (HOOK_PRELUDE, hook_blocks, HOOK_RESULT, str(rank), f"file://{tmp_path}/hook-rdzv")
        for rank in (0, 1)
    ]
    runs.append(
        (
            TRANSFORMERS_PRELUDE,
            adapter_blocks,
            TRANSFORMERS_RESULT,
            "0",
            f"file://{tmp_path}/tf-rdzv",
        )
    )
    procs: list[subprocess.Popen[str]] = []
    try:
        for i, (prelude, chosen, result, rank, rendezvous) in enumerate(runs):
            program = tmp_path / f"program{i}.json"
            program.write_text(json.dumps([textwrap.dedent(prelude), chosen, result]))
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", RUNNER, rank, rendezvous, str(program)],
                    cwd=tmp_path,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        outputs = []
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-4000:]
            (line,) = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            outputs.append(json.loads(line[len("RESULT ") :]))

        def deployment(name: str) -> Any:
            return ctl.call(lambda: ctl.server.controller.deployments.get(name))  # type: ignore[union-attr]

        # Every pick the hook counted (2 ranks x 40 steps x 32 tokens x top 2 x 2 layers, in 2
        # full windows and the last, partial, one sent at finish) reached the controller.
        hook_a, hook_b, adapter = outputs
        assert hook_a == hook_b == {"windows": 3, "steps": 40, "mode": "load+shared"}
        picks = 2 * 40 * 32 * 2 * 2
        wait_for(
            lambda: (
                deployment("deepseek-v3-prod") is not None
                and deployment("deepseek-v3-prod").stats.tokens_folded == picks
            ),
            30,
            "the hook's picks folded",
        )
        assert deployment("deepseek-v3-prod").shape.num_gpus == 2
        assert adapter["windows"] >= 1 and adapter["logits"][:2] == [1, 16]
        wait_for(
            lambda: deployment("ds-v3") is not None and deployment("ds-v3").stats.tokens_folded > 0,
            30,
            "the adapter's picks folded",
        )
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
        ctl.stop()


# ---------------------------------------------------------------------------------------
# The shell commands of README.md and docs/*.md, run as written.
#
# Every fenced block of these files names its language; the ```bash ones hold commands.
# Each command (continuation lines joined, comments dropped, split at `;`, a trailing `&`
# for the background) is either run below, in a fresh folder with `.venv/bin` first on
# PATH, or listed in NOT_RUN with the reason, or in SMALLER with the shorter run the same
# document names. A command in none of them fails the test, and so does a listed one that
# no longer appears: the docs cannot drift from what runs.

DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGUAGES = {"bash"}
OTHER_LANGUAGES = {"python", "yaml", "text"}
VENV_BIN = ROOT / ".venv" / "bin"

CLUSTER = "needs a Kubernetes cluster (the manifests are rendered and checked by tests/unit/deploy)"
NOT_RUN: dict[str, str] = {
    "./dev test": (
        "the suite itself, with ruff, mypy and the proto checks: CI's entry point "
        "(.ci/run ends in it)"
    ),
    "podman build -t sglang-rebalancer:v0.5.23 -f deploy/engines/sglang.Containerfile .": (
        "pulls SGLang's published image (GBs) from a registry; the layers are linted by "
        "tests/unit/deploy"
    ),
    "podman build -t vllm-openai-rebalancer:v0.33.0 -f deploy/engines/vllm.Containerfile .": (
        "pulls vLLM's published image (GBs) from a registry; the layers are linted by "
        "tests/unit/deploy"
    ),
    (
        "export REBALANCER_ADDRESS=unix:/run/rebalancer/agent.sock "
        "REBALANCER_DEPLOYMENT=deepseek-v3-prod"
    ): "the engine container's environment, for the engine command after it",
    (
        "python -m sglang.launch_server --model-path deepseek-ai/DeepSeek-V3 --ep-size 32 "
        "--enable-eplb ..."
    ): "DeepSeek-V3 on 32 GPUs (tests/engines runs the adapter in SGLang's own code)",
    (
        "vllm serve deepseek-ai/DeepSeek-V3 --enable-expert-parallel --enable-eplb --eplb-config "
        '\'{"window_size": 3000, "step_interval": 3000}\' --worker-extension-cls '
        "worker_hooks.engines.vllm.RebalancerWorkerExtension ..."
    ): "DeepSeek-V3 on GPUs (tests/engines runs the adapter in vLLM's own code)",
    "kubectl apply -k deploy/kubernetes/overlays/dev": CLUSTER,
    "kubectl -n rebalancer-dev rollout status deploy/rebalancer": CLUSTER,
    "kubectl -n rebalancer-dev exec deploy/rebalancer -- rebalancer admin status": CLUSTER,
    "kubectl create namespace rebalancer": CLUSTER,
    (
        "kubectl -n rebalancer create secret generic rebalancer-admin-token "
        '--from-literal=token="$(openssl rand -hex 32)"'
    ): CLUSTER,
    "kubectl apply -k deploy/kubernetes/overlays/prod": CLUSTER,
    "kubectl apply -k deploy/kubernetes/overlays/shards": CLUSTER,
    "kubectl -n rebalancer-shards exec rebalancer-0 -- rebalancer admin status": CLUSTER,
    "kubectl -n rebalancer rollout status deploy/rebalancer": CLUSTER,
    "kubectl -n rebalancer port-forward svc/rebalancer 50051": CLUSTER,
    (
        "export REBALANCER_ADMIN_TOKEN=$(kubectl -n rebalancer get secret rebalancer-admin-token "
        "-o jsonpath='{.data.token}' | base64 -d)"
    ): CLUSTER,
    "rebalancer admin --ca ca.crt --cert admin.crt --key admin.key status": (
        "the prod controller's certificates, through the port-forward above (admin over mutual "
        "TLS with a token: tests/integration/test_security.py)"
    ),
    (
        "rebalancer simulate --gpus 32 --slots 288 --nodes 4 --trace phase.npz --policy all "
        "--plot phase.png"
    ): "eight policies over 240 windows of G=32: about a minute of CPU (the plot: tests/unit/sim)",
    "python -m bench.simulate": (
        "rewrites BENCHMARKS.md's section and docs/sim_*.png in the tree; several minutes"
    ),
    "./dev admin force my-deployment --dry-run": (
        "my-deployment stands for a deployment's name: none registered with this controller "
        "(the first hour's `rebalancer admin force demo --dry-run` runs)"
    ),
    "./dev admin policy my-deployment gain_threshold=0.05": (
        "my-deployment stands for a deployment's name "
        "(admin policy on a live one: tests/integration/test_admin_cli.py)"
    ),
    "./dev simulate --gpus 32 --slots 288 --nodes 4 --trace TRACE.npz --policy all": (
        "TRACE.npz stands for a trace (docs/simulator.md's commands run on a real one)"
    ),
}
# command -> the shorter run of it that the same document names (run instead).
SMALLER: dict[str, str] = {"./dev demo": "./dev demo --windows 6"}

# command -> a regular expression its stdout must match (besides exit 0).
EXPECT: dict[str, str] = {
    "./dev demo --windows 6": (
        r"max_output_diff\s+0\.0000\n  weights_match_map\s+True\n  "
        r"ranks_agree_on_versions\s+True"
    ),
    "rebalancer trace make --kind phase --windows 240 --out phase.npz": (
        r"wrote phase\.npz: 240 windows"
    ),
    (
        "rebalancer simulate --gpus 8 --slots 16 --trace "
        "rebalancer/data/mixtral-8x7b/gsm8k_routing.jsonl "
        "--tokens-per-window 16 --cost expert_bytes=176160768 --policy adaptive --json"
    ): r'"policy": "adaptive"',
    (
        "rebalancer simulate --trace phase.npz --gpus 32 --slots 288 --policy adaptive,static "
        "--dispatch all --batch-tokens 64,256,512,4096,16384 --json"
    ): r'"load\+shared": \{"relative_step_throughput"',
    "rebalancer admin status": r"no deployments",
    "./dev admin status": r"no deployments",
    (
        "./dev plan --counts rebalancer/data/deepseek-v3/prefill_in4096.json --gpus 32 "
        "--slots 288 --nodes 4 --json"
    ): r'"balancedness_before": 0\.44',
    "rebalancer admin status demo": r"demo",
    "rebalancer admin history demo --limit 5": r"decision",
    "rebalancer admin force demo --dry-run": r"dry_run: balancedness [0-9.]+ -> [0-9.]+",
    "rebalancer admin pause demo": r"pause",
    "rebalancer admin force demo --wait 60": r"plan",
    "rebalancer admin --json status demo | jq .deployments[0].last_decision": r'"outcome"',
    (
        "curl -s localhost:9400/metrics | grep -E "
        "'rebalancer_(balancedness|rebalancing_state|plans_total)'"
    ): r'rebalancer_balancedness\{deployment="demo"',
}


@dataclasses.dataclass(frozen=True)
class Command:
    doc: str
    block: int  # the line of its fence: a block is one shell session (its own `%1`, `%2`)
    line: int
    text: str  # whitespace collapsed: the key of the tables above
    background: bool


def fenced(path: Path) -> list[tuple[int, str, str]]:
    """(line of the fence, language, body) of every fenced block."""
    text = path.read_text()
    return [
        (text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2))
        for m in re.finditer(r"^```(\S*)\n(.*?)^```", text, re.S | re.M)
    ]


def split_outside_quotes(line: str) -> tuple[list[str], str]:
    """The line cut at each `;` outside quotes, and what follows an unquoted ` #`."""
    parts, current, quote = [], "", ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return [*parts, current], line[i:]
        elif ch == ";":
            parts.append(current)
            current = ""
            continue
        current += ch
    return [*parts, current], ""


def shell_commands(path: Path) -> list[Command]:
    found = []
    for fence, language, body in fenced(path):
        if language not in SHELL_LANGUAGES:
            continue
        logical: list[tuple[int, str]] = []
        pending = ""
        for i, raw in enumerate(body.split("\n")):
            if not pending:
                start = fence + 1 + i
            if raw.rstrip().endswith("\\"):
                pending += raw.rstrip()[:-1] + " "
                continue
            logical.append((start, pending + raw))
            pending = ""
        for line, text in logical:
            for part in split_outside_quotes(text)[0]:
                command = " ".join(part.split())
                if not command:
                    continue
                background = command.endswith("&") and not command.endswith("&&")
                found.append(
                    Command(path.name, fence, line, command.rstrip("&").rstrip(), background)
                )
    return found


def test_every_docs_block_names_its_language() -> None:
    """A block without a language, or in one this test does not know, could hide a command."""
    unknown = [
        (path.name, line, language)
        for path in DOCS
        for line, language, _ in fenced(path)
        if language not in SHELL_LANGUAGES | OTHER_LANGUAGES
    ]
    assert not unknown, (
        f"fenced blocks with no or an unknown language (use ```bash for commands): {unknown}"
    )


def test_the_command_tables_match_the_docs() -> None:
    """Cheap, and without processes: every command is run or listed, every listed one is there."""
    commands = {c.text for path in DOCS for c in shell_commands(path)}
    assert not set(NOT_RUN) & set(SMALLER)
    stale = (set(NOT_RUN) | set(SMALLER)) - commands
    assert not stale, f"listed, but in no docs block any more: {sorted(stale)}"
    for command, shorter in SMALLER.items():
        (doc,) = {path for path in DOCS for c in shell_commands(path) if c.text == command}
        assert f"`{shorter}`" in doc.read_text(), (
            f"{doc.name} does not name the shorter run `{shorter}`"
        )
    foreground = {
        SMALLER.get(c.text, c.text)
        for path in DOCS
        for c in shell_commands(path)
        if c.text not in NOT_RUN and not c.background and not c.text.startswith("kill ")
    }
    background = {
        c.text
        for path in DOCS
        for c in shell_commands(path)
        if c.text not in NOT_RUN and c.background
    }
    assert all(
        c.startswith(("rebalancer serve ", "./dev serve ", "rebalancer demo ")) for c in background
    ), background
    ran_or_expected = foreground
    unchecked = foreground - set(EXPECT)
    assert not unchecked, (
        f"docs commands this file neither runs with a check nor lists: {sorted(unchecked)}"
    )
    assert not set(EXPECT) - ran_or_expected, (
        f"checks of commands no docs block holds: {set(EXPECT) - ran_or_expected}"
    )


def metric(port: int, name: str, deployment: str) -> float:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return 0.0
    m = re.search(rf'^{name}\{{[^}}]*deployment="{deployment}"[^}}]*\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# The docs' commands run as the docs size them (the simulator's dispatch example alone is
# 1.5-2 CPU minutes): on a busy CI machine the test needs more than the suite's 300 s.
@pytest.mark.timeout(1200)
def test_every_docs_command_runs_as_written(tmp_path: Path) -> None:
    """Each command not listed in NOT_RUN runs in order, in one fresh folder, and exits 0
    with what EXPECT asks for. Only the ports of the first hour change: the docs' 50051 and
    9400 become free ones (REBALANCER_ADDRESS stands for `admin`'s default address).
    Background commands are started, waited for as an operator would (the controller
    listening; the demo's first window folded) and ended by the docs' own `kill`."""
    stamp = list((ROOT / ".venv").glob(".installed-*"))
    assert stamp, (
        "no .venv built for this pyproject.toml: `./dev setup` first (./dev would build it inside "
        "a test)"
    )
    grpc_port, metrics_port = free_port(), free_port()
    ports = {"50051": str(grpc_port), "9400": str(metrics_port)}
    env = {
        **os.environ,
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1",
        "REBALANCER_ADDRESS": f"127.0.0.1:{grpc_port}",
    }
    env.pop("REBALANCER_ADMIN_TOKEN", None)
    blocks = {
        (path, c.block): [d for d in shell_commands(path) if d.block == c.block]
        for path in DOCS
        for c in shell_commands(path)
    }
    folders: dict[tuple[Path, int], Path] = {}
    for (path, fence), commands in blocks.items():  # a fresh folder per block, as a new terminal's
        folder = folders[path, fence] = tmp_path / f"{path.stem}-{fence}"
        folder.mkdir()
        # `./dev` is the clone's (it runs every command but test and setup in the caller's folder).
        (folder / "dev").write_text(f'#!/bin/sh\nexec "{ROOT / "dev"}" "$@"\n')
        (folder / "dev").chmod(0o755)
        # A repository path in a command means the clone's file: it is linked in, at its
        # path. (Only the files named: a folder `rebalancer` holding more would shadow
        # the package for the `python -m rebalancer` children of serve and demo.)
        for token in {tok for c in commands if c.text not in NOT_RUN for tok in c.text.split()}:
            if "/" in token and not token.startswith(("/", ".")) and (ROOT / token).is_file():
                (folder / token).parent.mkdir(parents=True, exist_ok=True)
                (folder / token).symlink_to(ROOT / token)
    jobs: list[subprocess.Popen[bytes]] = []  # every one started, for the finally
    session: dict[int, list[subprocess.Popen[bytes]]] = {}  # block -> its jobs, as `%N` counts them
    ran: list[str] = []
    try:
        for path in DOCS:
            for command in shell_commands(path):
                if command.text in NOT_RUN:
                    continue
                text = SMALLER.get(command.text, command.text)
                for doc_port, port in ports.items():
                    text = text.replace(doc_port, port)
                where = f"{command.doc}:{command.line}: {text}"
                print(f"{time.monotonic():.1f} $ {where}", flush=True)  # shown when the test fails
                block_jobs = session.setdefault(command.block, [])
                cwd = folders[path, command.block]
                if command.background:
                    log = (tmp_path / f"job{len(jobs) + 1}.log").open("wb")
                    jobs.append(
                        subprocess.Popen(
                            ["bash", "-c", "exec " + text],
                            cwd=cwd,
                            env=env,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
                    block_jobs.append(jobs[-1])
                    if re.match(r"(rebalancer|\./dev) serve ", command.text):
                        wait_for(
                            lambda: listening(grpc_port) or jobs[-1].poll() is not None, 60, where
                        )
                    elif command.text.startswith("rebalancer demo"):
                        # "meanwhile": once the controller folded a window of the demo's ranks
                        wait_for(
                            lambda: (
                                metric(metrics_port, "rebalancer_windows_folded_total", "demo") >= 1
                                or jobs[-1].poll() is not None
                            ),
                            150,
                            where,
                        )
                    else:
                        raise AssertionError(
                            f"{where}: a background command this test does not know"
                        )
                    assert jobs[-1].poll() is None, (
                        f"{where} ended: {(tmp_path / log.name).read_text()[-3000:]}"
                    )
                elif m := re.fullmatch(r"kill((?: %\d+)+)", text):
                    for job in (int(n) for n in m.group(1).split("%")[1:]):
                        proc = block_jobs[job - 1]
                        proc.terminate()
                        code = proc.wait(60)
                        # SIGTERM is how both are meant to stop: the controller drains and exits 0,
                        # the demo ends its workers and sidecars (the session guard sees any left)
                        # and exits 128 + SIGTERM.
                        serve = " serve " in proc.args[-1]  # type: ignore[index]
                        assert code == (0 if serve else 128 + signal.SIGTERM), (
                            f"{where}: job {job} exited {code}"
                        )
                else:
                    done = subprocess.run(
                        ["bash", "-o", "pipefail", "-c", text],
                        cwd=cwd,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=600,
                    )
                    assert done.returncode == 0, (
                        f"{where}: exit {done.returncode}\n"
                        f"{done.stdout[-2000:]}{done.stderr[-2000:]}"
                    )
                    assert re.search(
                        EXPECT[SMALLER.get(command.text, command.text)], done.stdout
                    ), f"{where}: not in its output:\n{done.stdout[-3000:]}"
                ran.append(text)
        # The operator's first hour is all there, in its order.
        firsts = [
            r"rebalancer serve .*",
            "rebalancer admin status",
            r"rebalancer demo --controller .*",
            "rebalancer admin status demo",
            r"rebalancer admin history demo .*",
            "rebalancer admin force demo --dry-run",
            "rebalancer admin pause demo",
            "rebalancer admin force demo --wait 60",
            r"kill .*",
        ]
        # Each step found after the one before it (README's own examples may name the same
        # commands earlier).
        positions, start = [], 0
        for f in firsts:
            start = next((i for i in range(start, len(ran)) if re.fullmatch(f, ran[i])), -1)
            assert start >= 0, f"{f!r} not run after the step before it: {ran}"
            positions.append(start)
            start += 1
    finally:
        for proc in reversed(jobs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
