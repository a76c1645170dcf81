"""`rebalancer plan` and `rebalancer evaluate`, in process and as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rebalancer.cli import main
from rebalancer.datasets import deepseek_v3_files

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def files():
    paths = deepseek_v3_files()
    return paths[0], paths[4]


def last_json(capsys):
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def test_plan_and_evaluate(tmp_path, capsys, files):
    first, second = files
    out = tmp_path / "PLACEMENT.json"
    sglang = tmp_path / "sglang.json"
    code = main(
        [
            "plan",
            "--counts",
            str(first),
            "--gpus",
            "32",
            "--slots",
            "288",
            "--nodes",
            "4",
            "--out",
            str(out),
            "--sglang-out",
            str(sglang),
            "--json",
        ]
    )
    assert code == 0
    report = last_json(capsys)
    assert report["balancedness"] > 0.99
    assert report["bound_balancedness"] >= report["balancedness"]
    assert report["moved_fraction"] == 0.0 and report["seconds"] > 0
    assert "physical_to_logical_map" in json.loads(sglang.read_text())

    assert main(["evaluate", "--placement", str(out), "--counts", str(first), "--json"]) == 0
    assert last_json(capsys)["balancedness"] == pytest.approx(report["balancedness"])
    assert main(["evaluate", "--placement", str(out), "--counts", str(second), "--json"]) == 0
    stale = last_json(capsys)["balancedness"]
    assert stale < report["balancedness"]

    code = main(
        [
            "plan",
            "--counts",
            str(second),
            "--gpus",
            "32",
            "--slots",
            "288",
            "--nodes",
            "4",
            "--previous",
            str(out),
            "--max-moved-fraction",
            "0.1",
            "--json",
        ]
    )
    assert code == 0
    replanned = last_json(capsys)
    assert 0 < replanned["moved_fraction"] <= 0.1
    assert replanned["balancedness"] > stale
    assert replanned["transfers"] > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpus", "32", "--slots", "300"], "multiple of GPUs"),
        (["--gpus", "32", "--slots", "128"], "at least the number of logical experts"),
        (["--gpus", "32", "--slots", "288", "--nodes", "5"], "multiple of nodes"),
        (["--gpus", "32", "--slots", "288", "--max-moved-fraction", "0.1"], "needs --previous"),
    ],
)
def test_plan_bad_flags_exit_2(capsys, files, argv, message):
    assert main(["plan", "--counts", str(files[0]), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_evaluate_shape_mismatch_exit_2(tmp_path, capsys, files):
    out = tmp_path / "p.json"
    assert (
        main(
            ["plan", "--counts", str(files[0]), "--gpus", "8", "--slots", "256", "--out", str(out)]
        )
        == 0
    )
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({"logical_count": [[1] * 128] * 61}))
    capsys.readouterr()
    assert main(["evaluate", "--placement", str(out), "--counts", str(bad)]) == 2
    assert "does not match" in capsys.readouterr().err


def test_subprocess_bad_counts_exit_2(tmp_path):
    bad = tmp_path / "neg.json"
    bad.write_text(json.dumps({"logical_count": [[1, -1]]}))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rebalancer",
            "plan",
            "--counts",
            str(bad),
            "--gpus",
            "2",
            "--slots",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "negative value" in proc.stderr


def test_plan_prints_balancedness_before_and_after(tmp_path, capsys, files):
    """Issue 34: `plan` printed the new placement's balancedness only. Before (the
    --previous placement, else the trivial one a deployment starts on) and after, in the
    text and in --json, each what `evaluate` says of that placement on the counts."""
    from rebalancer.formats import write_placement
    from rebalancer.wire.layout import trivial_placement

    first, second = files
    out = tmp_path / "PLACEMENT.json"
    flags = ["--gpus", "32", "--slots", "288", "--nodes", "4"]
    assert main(["plan", "--counts", str(first), *flags, "--out", str(out), "--json"]) == 0
    fresh = last_json(capsys)
    trivial = tmp_path / "trivial.json"
    counts = json.loads(first.read_text())["logical_count"]
    write_placement(
        str(trivial), trivial_placement(len(counts), len(counts[0]), 288, 32), 32, 4, len(counts[0])
    )
    assert main(["evaluate", "--placement", str(trivial), "--counts", str(first), "--json"]) == 0
    assert fresh["before"] == "trivial"
    assert fresh["balancedness_before"] == pytest.approx(last_json(capsys)["balancedness"])
    assert fresh["balancedness_before"] < 0.9 < fresh["balancedness"]

    assert main(["plan", "--counts", str(second), *flags, "--previous", str(out), "--json"]) == 0
    replanned = last_json(capsys)
    assert main(["evaluate", "--placement", str(out), "--counts", str(second), "--json"]) == 0
    assert replanned["before"] == "previous"
    assert replanned["balancedness_before"] == pytest.approx(last_json(capsys)["balancedness"])

    assert main(["plan", "--counts", str(second), *flags, "--previous", str(out)]) == 0
    text = capsys.readouterr().out
    assert (
        f"balancedness {replanned['balancedness_before']:.4f} on the previous placement -> "
        f"{replanned['balancedness']:.4f}"
    ) in text, text
