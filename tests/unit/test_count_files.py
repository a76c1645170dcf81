"""Count files with the shared expert's column: rebalancer.formats, the hook's writer and
`rebalancer plan --dispatch` on what a real (CPU) hook recorded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rebalancer.cli import main
from rebalancer.errors import InputError
from rebalancer.formats import load_counts, read_counts, write_counts
from rebalancer.wire.layout import trivial_placement
from rebalancer.wire.shape import ClusterShape
from worker_hooks.hook import (
    CommitConfig,
    DispatchConfig,
    HookConfig,
    Link,
    RebalanceHook,
    WindowConfig,
)

REPO = Path(__file__).resolve().parents[2]
L, E, G = 3, 8, 2
LOGICAL = np.arange(L * E).reshape(L, E) * 3
SHARED = LOGICAL.sum(axis=1) // 3  # top-3 routing: one shared pick per token
GPU = np.stack([LOGICAL[:, : E // 2].sum(axis=1), LOGICAL[:, E // 2 :].sum(axis=1)], axis=1)
GPU_SHARED = np.stack([SHARED - SHARED // 4, SHARED // 4], axis=1)


@pytest.mark.parametrize("suffix", [".json", ".npz", ".NPZ"])
@pytest.mark.parametrize("with_shared", [False, True])
def test_round_trip(tmp_path: Path, suffix: str, with_shared: bool) -> None:
    path = tmp_path / f"counts{suffix}"
    extra = (SHARED, GPU, GPU_SHARED) if with_shared else (None, GPU, None)
    write_counts(path, LOGICAL, *extra)
    assert path.is_file()  # ".NPZ" kept as given, not made "counts.NPZ.npz"
    got = read_counts(path)
    assert got.logical.dtype == np.float64
    np.testing.assert_array_equal(got.logical, LOGICAL)
    np.testing.assert_array_equal(got.gpu, GPU)
    if with_shared:
        np.testing.assert_array_equal(got.shared, SHARED)
        np.testing.assert_array_equal(got.gpu_shared, GPU_SHARED)
    else:
        assert got.shared is None and got.gpu_shared is None


def test_round_trip_logical_only_and_fractions(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    write_counts(path, LOGICAL)
    assert list(json.loads(path.read_text())) == ["logical_count"]  # SGLang's summed form
    got = read_counts(path)
    assert got.shared is None and got.gpu is None and got.gpu_shared is None
    # whole numbers as integers (as SGLang writes them), fractions as they are
    write_counts(path, LOGICAL + 0.5, SHARED)
    doc = json.loads(path.read_text())
    assert doc["logical_count"][0][0] == 0.5 and isinstance(doc["shared_count"][0], int)
    np.testing.assert_array_equal(read_counts(path).logical, LOGICAL + 0.5)


def test_pt_dump_layout_with_steps(tmp_path: Path) -> None:
    """SGLang's dump: a dict with `rank` and [T, ...] tensors, summed over T."""
    path = tmp_path / "dump.pt"
    steps = 3
    torch.save(
        {
            "rank": 0,
            "logical_count": torch.tensor(np.stack([LOGICAL] * steps)),
            "shared_count": torch.tensor(np.stack([SHARED] * steps)),
            "gpu_count": torch.tensor(np.stack([GPU] * steps)),
            "gpu_shared_count": torch.tensor(np.stack([GPU_SHARED] * steps)),
            "average_utilization_rate_over_window": None,
        },
        path,
    )
    got = read_counts(path)
    np.testing.assert_array_equal(got.logical, steps * LOGICAL)
    np.testing.assert_array_equal(got.shared, steps * SHARED)
    np.testing.assert_array_equal(got.gpu, steps * GPU)
    np.testing.assert_array_equal(got.gpu_shared, steps * GPU_SHARED)
    flat = tmp_path / "flat.pt"
    torch.save({"logical_count": torch.tensor(LOGICAL), "shared_count": torch.tensor(SHARED)}, flat)
    assert read_counts(flat).gpu is None
    np.testing.assert_array_equal(read_counts(flat).shared, SHARED)
    bad = tmp_path / "bad.pt"
    torch.save({"logical_count": torch.tensor(LOGICAL), "shared_count": [1, 2, 3]}, bad)
    with pytest.raises(InputError, match="'shared_count' is not a tensor"):
        read_counts(bad)


@pytest.mark.parametrize("suffix", [".json", ".npz"])
def test_sglang_still_reads_a_file_with_the_extra_keys(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"counts{suffix}"
    write_counts(path, LOGICAL, SHARED, GPU, GPU_SHARED)
    np.testing.assert_array_equal(load_counts(path), LOGICAL)
    if suffix == ".json":
        # What SGLang's --init-expert-location does with a JSON file: only logical_count.
        data = json.loads(path.read_text())
        assert torch.equal(torch.tensor(data["logical_count"]), torch.tensor(LOGICAL))


@pytest.mark.parametrize(
    "shared, message",
    [
        ([1, 2], "'shared_count' covers 2 layers, 'logical_count' 3"),
        ([1, -2, 3], "'shared_count' has a negative value at layer 1"),
        ([1, float("nan"), 3], "'shared_count' has NaN or infinite values"),
        (["1", "2", "3"], "'shared_count' is not a numeric array"),
        (
            [[[1, 2, 3]]],
            r"'shared_count' must have rank 1 \[layers\] or 2 \[steps, layers\], got rank 3",
        ),
        ([], r"'shared_count' is empty \(shape \(0,\)\)"),
        (None, "'shared_count' is not a numeric array"),
    ],
)
def test_bad_shared_count_is_refused(tmp_path: Path, shared: object, message: str) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"logical_count": LOGICAL.tolist(), "shared_count": shared}))
    with pytest.raises(InputError, match=message) as info:
        load_counts(path)  # the logical counts too: the file is bad
    assert "\n" not in str(info.value) and str(path) in str(info.value)
    if "numeric" not in message:  # the same check when writing
        with pytest.raises(InputError, match=message):
            write_counts(tmp_path / "out.npz", LOGICAL, np.asarray(shared, dtype=np.float64))
        assert not (tmp_path / "out.npz").exists()  # refused before anything is written


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"gpu_count": np.ones((2, G))}, "'gpu_count' covers 2 layers, 'logical_count' 3"),
        (
            {"gpu_count": np.ones((L, G)), "gpu_shared_count": np.ones((L, G + 1))},
            "'gpu_shared_count' has 3 GPUs, 'gpu_count' 2",
        ),
        ({"gpu_count": -np.ones((L, G))}, "'gpu_count' has a negative value at layer 0, GPU 0"),
        ({"gpu_shared_count": np.ones(L)}, r"'gpu_shared_count' must have rank 2 \[layers, GPUs\]"),
    ],
)
def test_bad_gpu_counts_are_refused(tmp_path: Path, extra: dict, message: str) -> None:
    path = tmp_path / "c.npz"
    np.savez(path, logical_count=LOGICAL, **extra)
    with pytest.raises(InputError, match=message):
        read_counts(path)


def test_write_refuses_other_suffixes(tmp_path: Path) -> None:
    for name in ("c.pt", "c.csv", "c"):
        with pytest.raises(
            InputError, match=r"cannot write counts as '.*' \(expected .json or .npz\)"
        ):
            write_counts(tmp_path / name, LOGICAL)


# -------------------------------------------------------------- a real hook on CPU

HL, HE, HG, HK, HT, STEPS = 3, 16, 4, 3, 50, 4
HP = 24  # slots: 8 replicas of hot experts
SLOTS_PER_RANK = HP // HG


def recorded_hook(mode: str, shared: bool = True, steps: int = STEPS) -> RebalanceHook:
    """Rank 0 of HG, run `steps` steps of skewed routing on every layer (one window a step).
    Under dispatch by load every rank is taken to have routed what rank 0 did."""
    config = HookConfig(
        link=Link("127.0.0.1:1", deployment="d"),
        rank=0,
        shape=ClusterShape(
            num_layers=HL, num_logical=HE, num_slots=HP, num_gpus=HG, expert_bytes=0, top_k=HK
        ),
        shared_expert=shared,
        windows=WindowConfig(steps=1),
        commit=CommitConfig(agree_every=10**6),
        dispatch=DispatchConfig(mode=mode),  # type: ignore[arg-type]
    )
    gather = None if mode == "split" else (lambda local: local.unsqueeze(0).repeat(HG, 1))
    hook = RebalanceHook(
        config,
        trivial_placement(HL, HE, HP, HG),
        {"w": torch.zeros(HL, SLOTS_PER_RANK, 1)},
        None,
        None,
        counts_gather=gather,
    )
    rng = np.random.default_rng(0)
    probs = np.r_[np.full(4, 6.0), np.ones(HE - 4)]
    probs /= probs.sum()
    for _ in range(steps):
        for layer in range(HL):
            ids = np.stack([rng.choice(HE, size=HK, replace=False, p=probs) for _ in range(HT)])
            hook.route(layer, torch.from_numpy(ids))
        hook.step_end()
    return hook


@pytest.mark.parametrize("suffix", [".json", ".npz", ".pt"])
@pytest.mark.parametrize("mode", ["split", "load+shared"])
def test_hook_writes_what_it_recorded(tmp_path: Path, suffix: str, mode: str) -> None:
    hook = recorded_hook(mode)
    assert hook.stats.windows == STEPS
    path = tmp_path / f"rank0{suffix}"
    hook.write_counts(path)
    got = read_counts(path)
    tokens = HT * STEPS
    assert got.logical.shape == (HL, HE)
    np.testing.assert_array_equal(got.logical.sum(axis=1), tokens * HK)
    np.testing.assert_array_equal(got.logical, hook.stats.logical_total[:, :HE])
    np.testing.assert_array_equal(got.shared, np.full(HL, tokens))  # one shared pick a token
    assert got.gpu is not None and got.gpu_shared is not None
    assert got.gpu.shape == got.gpu_shared.shape == (HL, HG)
    np.testing.assert_array_equal(got.gpu.sum(axis=1), tokens * HK)
    np.testing.assert_array_equal(got.gpu_shared.sum(axis=1), got.shared)
    if mode == "split":  # a token's shared expert stays on its own GPU
        np.testing.assert_array_equal(got.gpu_shared[:, 0], got.shared)
    if suffix == ".pt":  # SGLang's dump layout: what its loader takes
        dump = torch.load(path, weights_only=True)
        assert dump["rank"] == 0 and dump["logical_count"].shape == (1, HL, HE)
        assert dump["logical_count"].dtype == torch.int64


def test_hook_without_shared_expert_or_windows(tmp_path: Path) -> None:
    hook = recorded_hook("split", shared=False, steps=0)
    hook.write_counts(tmp_path / "empty.npz")  # nothing recorded yet: zeros
    got = read_counts(tmp_path / "empty.npz")
    assert got.shared is None and got.gpu_shared is None
    assert got.logical.shape == (HL, HE) and got.gpu.shape == (HL, HG) and not got.logical.any()
    hook = recorded_hook("split", shared=False, steps=1)
    hook.write_counts(tmp_path / "one.json")
    got = read_counts(tmp_path / "one.json")
    assert got.shared is None and got.gpu.sum() == HT * HK * HL
    with pytest.raises(InputError, match=r"cannot write counts as '.csv'"):
        hook.write_counts(tmp_path / "x.csv")


def plan_json(capsys, counts: Path, *argv: str) -> dict:
    code = main(
        ["plan", "--counts", str(counts), "--gpus", str(HG), "--slots", str(HP), "--json", *argv]
    )
    assert code == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_plan_dispatch_on_a_recorded_file(tmp_path: Path, capsys) -> None:
    path = tmp_path / "rank0.json"
    recorded_hook("split").write_counts(path)
    split = plan_json(capsys, path)
    assert split["dispatch"] == "split" and split["shared_load_from"] == "shared_count"
    both = plan_json(capsys, path, "--dispatch", "load+shared")
    assert both["dispatch"] == "load+shared" and both["shared_load_from"] == "shared_count"
    # The water-fill keeps a layer's result only where it lowers the peak: never below
    # split (up to the 2^-32 units it fills in).
    assert both["dispatch_balancedness"] >= split["dispatch_balancedness"] - 1e-9
    assert both["balancedness"] == split["balancedness"]  # the same placement
    load = plan_json(capsys, path, "--dispatch", "load")
    assert both["dispatch_balancedness"] >= load["dispatch_balancedness"] - 1e-9

    # Without the shared column: --top-k estimates it; without either load+shared is refused.
    routed = tmp_path / "routed.json"
    write_counts(routed, read_counts(path).logical)
    plain = plan_json(capsys, routed)
    assert plain["shared_load_from"] is None
    assert plain["dispatch_balancedness"] == pytest.approx(plain["balancedness"])
    est = plan_json(capsys, routed, "--dispatch", "load+shared", "--top-k", str(HK))
    assert est["shared_load_from"] == "top_k"
    # routed picks / top_k is exactly the tokens here: the same as the measured column
    assert est["dispatch_balancedness"] == pytest.approx(both["dispatch_balancedness"])

    for argv, message in [
        (["--dispatch", "load+shared"], "needs the shared expert's load"),
        (["--dispatch", "even"], "unknown --dispatch mode 'even'"),
        (["--top-k", "0"], "--top-k must be in [1, 16]"),
    ]:
        assert (
            main(["plan", "--counts", str(routed), "--gpus", str(HG), "--slots", str(HP), *argv])
            == 2
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0]


def test_subprocess_load_shared_without_shared_load_exit_2(tmp_path: Path) -> None:
    routed = tmp_path / "routed.npz"
    write_counts(routed, LOGICAL)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rebalancer",
            "plan",
            "--counts",
            str(routed),
            "--gpus",
            "2",
            "--slots",
            "8",
            "--dispatch",
            "load+shared",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0
    assert "has no shared_count, give --top-k" in proc.stderr


def test_counts_of_1e308_are_refused_without_overflow(tmp_path: Path) -> None:
    """1e308 counts summed to infinity: `plan` printed numpy overflow warnings and
    "balancedness 1.0000". A count above 2^53 (what float64 counts exactly) is refused,
    naming where, with exit code 2 and one line; 2^53 itself plans."""
    counts = np.ones((L, E))
    counts[1, 5] = 1e308
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"logical_count": counts.tolist()}))
    with pytest.raises(
        InputError, match=r"'logical_count' has 1e\+308 at \[1, 5\], above the largest count 2\^53"
    ):
        read_counts(path)
    run = subprocess.run(
        [
            sys.executable,
            "-W",
            "error",
            "-m",
            "rebalancer",
            "plan",
            "--counts",
            str(path),
            "--gpus",
            "2",
            "--slots",
            "10",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert run.returncode == 2 and run.stdout == "", run.stderr
    assert run.stderr.splitlines() == [
        f"rebalancer plan: error: {path}: 'logical_count' has 1e+308 at [1, 5], "
        "above the largest count 2^53"
    ]
    counts[1, 5] = 2.0**53
    path.write_text(json.dumps({"logical_count": counts.tolist()}))
    run = subprocess.run(
        [
            sys.executable,
            "-W",
            "error",
            "-m",
            "rebalancer",
            "plan",
            "--counts",
            str(path),
            "--gpus",
            "2",
            "--slots",
            "10",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert run.returncode == 0 and "RuntimeWarning" not in run.stderr, run.stderr
