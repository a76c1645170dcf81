"""Fuzz the command line in-process (rebalancer.cli.main) with random and mutated argv for
plan, evaluate, trace, simulate (tiny sizes) and admin (against no server).

Every run must end with an exit code of the documented set (0 ok, 1 failed: out of memory
or an OS refusal, 2 bad input; admin: 3-6 from the gRPC status, 5 unreachable), never a
traceback; a failure prints its reason as the last line of stderr, one line, after at
most argparse's usage; no input file changes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from rebalancer.formats import write_placement
from rebalancer.sim.trace import Trace
from tests.fuzz.cli_helpers import check_run

HUGE = str(2**40)
L, E = 2, 4


# ------------------------------------------------------------------ input files


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    d = tmp_path_factory.mktemp("fuzz_cli")
    counts = np.array([[10, 1, 3, 0], [2, 2, 9, 5]], dtype=np.int64)
    (d / "counts.json").write_text(json.dumps({"logical_count": counts.tolist()}))
    np.savez(d / "counts.npz", logical_count=counts)
    write_placement(d / "placement.json", np.array([[0, 1, 2, 3], [3, 2, 1, 0]]), num_gpus=2)
    write_placement(
        d / "placement6.json", np.array([[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 2, 2]]), num_gpus=2
    )
    trace = Trace(np.random.default_rng(0).integers(0, 50, size=(3, L, E)), 2.0, "t")
    trace.save(d / "trace.npz")
    (d / "trace.json").write_text(json.dumps({"logical_count": trace.counts.tolist()}))
    (d / "trace.jsonl").write_text(
        "".join(
            json.dumps(
                {"problem_id": 0, "token_idx": t, "layer": layer, "experts": [t % E, (t + 1) % E]}
            )
            + "\n"
            for t in range(5)
            for layer in range(L)
        )
    )
    for suffix in (".json", ".npz", ".pt", ".jsonl", ".bin"):
        (d / f"garbage{suffix}").write_bytes(b"\x80\x02garbage\xff")
    (d / "dir").mkdir()
    (d / "out").mkdir()
    paths = {p.name: str(p) for p in d.iterdir()}
    paths["missing"] = str(d / "missing.json")
    paths["out_json"] = str(d / "out" / "o.json")
    paths["out_npz"] = str(d / "out" / "o.npz")
    paths["out_in_missing_dir"] = str(d / "nope" / "o.json")
    paths["out_npz_in_missing_dir"] = str(d / "nope" / "o.npz")
    paths["out_is_dir"] = str(d / "dir")
    paths["out_npz_is_dir"] = str(d / "dir.npz")
    (d / "dir.npz").mkdir()
    before = _digests(d)
    yield paths
    assert _digests(d) == before, "an input file changed"


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in d.iterdir() if p.is_file()}


# ------------------------------------------------------------------ argv strategies
#
# Each flag has values that fit the tiny files (L=2 layers, E=4 experts) and values that do
# not; an argv starts valid and gets a few flags corrupted, dropped, repeated or added, so
# both the success paths and every refusal are reached. Sizes stay tiny: the placement
# engine's memory grows superlinearly in slots, so no moderate P/G is drawn (only absurd
# ones, refused by the layout bound of wire/layout.py).

bad_ints = st.sampled_from(["0", "-1", "-7", HUGE, "x", "", "1.5", "nan", "1e3", "٣", "\udcff"])
bad_floats = st.sampled_from(["-1", "nan", "inf", "-inf", "1e308", "x", "", "2", "\udcff"])
text = st.text(st.characters(exclude_categories=["Cc"]), max_size=6) | st.sampled_from(
    ["\udcff", "a b", "-x", "--", "="]
)
Spec = dict[str, tuple[st.SearchStrategy[str] | None, st.SearchStrategy[str] | None]]


def path_of(*names: str) -> st.SearchStrategy[str]:
    """A placeholder `@name` for a file of the `files` fixture (see `resolve`)."""
    return st.sampled_from(["@" + n for n in names])


def resolve(argv: list[str], files: dict[str, str]) -> list[str]:
    return [files[tok[1:]] if tok.startswith("@") and tok[1:] in files else tok for tok in argv]


def flags(
    draw: st.DrawFn, spec: Spec, required: tuple[str, ...], positional: tuple[str, ...] = ()
) -> list[str]:
    """Required flags present, optional ones at times, values valid except for up to two
    corrupted ones (of those present); sometimes a flag dropped or an unknown one added;
    in drawn order. spec: flag -> (valid values, invalid values); (None, None): a switch."""
    present = [f for f in spec if f in required or draw(st.integers(0, 9)) < 3]
    can_corrupt = sorted(f for f in present if spec[f][1] is not None)
    corrupt = set()
    if can_corrupt and draw(st.integers(0, 2)):
        corrupt = set(
            draw(st.lists(st.sampled_from(can_corrupt), min_size=1, max_size=2, unique=True))
        )
    items: list[list[str]] = []
    for flag in present:
        good, bad = spec[flag]
        if good is None:
            items.append([flag])
            continue
        value = draw(bad if flag in corrupt and bad is not None else good)
        items.append([value] if flag in positional else [flag, value])
    if items and draw(st.integers(0, 9)) == 0:
        items.pop(draw(st.integers(0, len(items) - 1)))
    if draw(st.integers(0, 9)) == 0:
        items.append(draw(st.sampled_from([["--bogus"], ["--json"], ["extra"], ["-h"]])))
    order = draw(st.permutations(range(len(items))))
    return [tok for i in order for tok in items[i]]


COUNT_FILES = ("counts.json", "counts.npz")
BAD_COUNT_FILES = (
    "garbage.json",
    "garbage.npz",
    "garbage.pt",
    "garbage.bin",
    "missing",
    "dir",
    "placement.json",
)
OUT = ("out_json",)
BAD_OUT = ("out_in_missing_dir", "out_is_dir")


@st.composite
def plan_argv(draw: st.DrawFn) -> list[str]:
    spec: Spec = {
        "--counts": (path_of(*COUNT_FILES), path_of(*BAD_COUNT_FILES, "trace.npz")),
        "--gpus": (st.just("2"), st.sampled_from(["1", "4", "3"]) | bad_ints),
        "--slots": (st.sampled_from(["4", "6", "8"]), st.sampled_from(["2", "5", "12"]) | bad_ints),
        "--nodes": (st.sampled_from(["1", "2"]), st.sampled_from(["3", "4"]) | bad_ints),
        "--groups": (st.sampled_from(["1", "2", "4"]), st.sampled_from(["3", "8"]) | bad_ints),
        "--previous": (
            path_of("placement.json"),
            path_of("placement6.json", "garbage.json", "counts.json", "missing"),
        ),
        "--max-moved-fraction": (st.sampled_from(["0.25", "1", "0.5"]), bad_floats | st.just("0")),
        "--max-moved-bytes": (st.sampled_from(["0", "100", "5000"]), bad_ints),
        "--expert-bytes": (st.sampled_from(["10", "1000"]), bad_ints),
        "--algorithm": (
            st.sampled_from(["auto", "greedy", "balanced", "migration", "reference"]),
            text,
        ),
        "--out": (path_of(*OUT), path_of(*BAD_OUT)),
        "--sglang-out": (path_of(*OUT), path_of(*BAD_OUT)),
        "--json": (None, None),
    }
    return ["plan", *flags(draw, spec, ("--counts", "--gpus", "--slots"))]


@given(plan_argv())
@example(
    argv=["plan", "--counts", "@counts.json", "--gpus", "1", "--slots", HUGE]
)  # MemoryError traceback
@example(
    argv=[
        "plan",
        "--counts",
        "@counts.json",
        "--gpus",
        "2",
        "--slots",
        "4",
        "--out",
        "@out_in_missing_dir",
    ]
)  # FileNotFoundError traceback
@example(
    argv=["plan", "--counts", "@counts.json", "--gpus", "2", "--slots", "4", "--out", "@out_is_dir"]
)
def test_plan(files: dict[str, str], argv: list[str]) -> None:
    check_run(resolve(argv, files), {0, 1, 2})


@st.composite
def evaluate_argv(draw: st.DrawFn) -> list[str]:
    spec: Spec = {
        "--placement": (
            path_of("placement.json", "placement6.json"),
            path_of("counts.json", "garbage.json", "garbage.npz", "missing", "dir", "trace.npz"),
        ),
        "--counts": (path_of(*COUNT_FILES), path_of(*BAD_COUNT_FILES, "trace.json")),
        "--json": (None, None),
    }
    return ["evaluate", *flags(draw, spec, ("--placement", "--counts"))]


@given(evaluate_argv())
def test_evaluate(files: dict[str, str], argv: list[str]) -> None:
    check_run(resolve(argv, files), {0, 2})


def test_no_command() -> None:
    check_run([], {2})  # exit 2 with the help on stdout and nothing on stderr


def test_evaluate_valid(files: dict[str, str]) -> None:
    code, out, _ = check_run(
        [
            "evaluate",
            "--placement",
            files["placement.json"],
            "--counts",
            files["counts.json"],
            "--json",
        ],
        {0},
    )
    assert 0 < json.loads(out)["balancedness"] <= 1


TRACES = ("trace.npz", "trace.json", "trace.jsonl", "counts.json")
BAD_TRACES = (
    "garbage.json",
    "garbage.npz",
    "garbage.jsonl",
    "garbage.bin",
    "missing",
    "dir",
    "placement.json",
)


@st.composite
def trace_argv(draw: st.DrawFn) -> list[str]:
    action = draw(st.sampled_from(["make", "info", "convert", "convert", "bogus", ""]))
    npz_out = (path_of("out_npz"), path_of("out_json", "out_npz_in_missing_dir", "out_npz_is_dir"))
    if action == "make":
        spec: Spec = {
            "--kind": (st.sampled_from(["phase", "mix", "burst"]), text),
            "--out": npz_out,
            "--windows": (st.sampled_from(["1", "2", "3"]), bad_ints),
            "--tokens-per-window": (st.sampled_from(["1", "16"]), bad_ints),
            "--top-k": (st.sampled_from(["1", "2", "4"]), bad_ints),
            "--window-seconds": (st.sampled_from(["1", "5", "0.5"]), bad_floats),
            "--seed": (st.sampled_from(["0", "1"]), st.sampled_from(["-1", HUGE, "x"])),
            "--source": (
                path_of("counts.json", "counts.npz"),
                path_of(*BAD_COUNT_FILES, "trace.json"),
            ),
            "--json": (None, None),
        }
        argv = flags(draw, spec, ("--out", "--windows", "--tokens-per-window", "--source"))
    else:
        spec = {
            "path": (path_of(*TRACES), path_of(*BAD_TRACES)),
            "--tokens-per-window": (st.sampled_from(["1", "2", "8"]), bad_ints),
            "--out": npz_out,
            "--window-seconds": (st.sampled_from(["1", "5"]), bad_floats),
        }
        argv = flags(
            draw,
            spec,
            ("path", "--out") if action == "convert" else ("path",),
            positional=("path",),
        )
    return ["trace", *([action] if action else []), *argv]


@given(trace_argv())
@example(argv=["trace"])  # exit 2 with the help on stdout and nothing on stderr
@example(
    argv=[
        "trace",
        "make",
        "--out",
        "@out_npz",
        "--windows",
        "1",
        "--tokens-per-window",
        "4",
        "--source",
        "@trace.json",
    ]
)  # a [T, L, E] source: IndexError traceback (datasets.py)
@example(
    argv=[
        "trace",
        "make",
        "--out",
        "@out_npz",
        "--windows",
        "1",
        "--tokens-per-window",
        "4",
        "--source",
        "@counts.json",
        "--seed",
        "-1",
    ]
)  # ValueError traceback (numpy seed)
def test_trace(files: dict[str, str], argv: list[str]) -> None:
    check_run(resolve(argv, files), {0, 1, 2})


@st.composite
def simulate_argv(draw: st.DrawFn) -> list[str]:
    from rebalancer.controller.decide import PolicyConfig
    from rebalancer.sim import POLICIES, CostModel

    good_values = st.sampled_from(["1", "0.5", "0.1", "2"])
    numeric_bad = st.sampled_from(["0", "-1", "1e9", "NaN", "Infinity", "1e400"])
    other_bad = st.sampled_from(["null", "true", '"x"', "[1]", "{}", "x", ""])

    def key_values(
        keys: list[str], bad_values: st.SearchStrategy[str]
    ) -> tuple[st.SearchStrategy[str], st.SearchStrategy[str]]:
        good = st.builds(lambda k, v: f"{k}={v}", st.sampled_from(keys), good_values)
        bad = (
            st.builds(lambda k, v: f"{k}={v}", st.sampled_from([*keys, "bogus"]), bad_values) | text
        )
        return good, bad

    spec: Spec = {
        "--trace": (path_of(*TRACES), path_of(*BAD_TRACES)),
        "--gpus": (st.sampled_from(["1", "2"]), st.sampled_from(["3", "4"]) | bad_ints),
        "--slots": (st.sampled_from(["4", "6", "8"]), st.sampled_from(["2", "5"]) | bad_ints),
        "--nodes": (st.just("1"), st.sampled_from(["2", "3"]) | bad_ints),
        "--groups": (st.sampled_from(["0", "2", "4"]), st.sampled_from(["3", "8"]) | bad_ints),
        "--policy": (
            st.sampled_from([*POLICIES, "all", "none,adaptive"]),
            st.sampled_from(["x", "", ",", "all,x"]),
        ),
        "--tokens-per-window": (st.sampled_from(["1", "2"]), bad_ints),
        "--num-experts": (st.sampled_from(["4", "8"]), st.sampled_from(["1", "2"]) | bad_ints),
        "--window-seconds": (st.sampled_from(["1", "5"]), bad_floats),
        "--expert-bytes": (st.sampled_from(["1000", "1"]), bad_ints),
        "--period-steps": (st.sampled_from(["1", "100"]), bad_ints),
        "--periodic-algorithm": (
            st.sampled_from(["greedy", "balanced", "auto"]),
            st.sampled_from(["migration", "x"]),
        ),
        "--start": (st.sampled_from(["trivial", "static"]), text),
        "--set": key_values(
            [f for f in PolicyConfig.setting_names() if f != "paused"], numeric_bad | other_bad
        ),
        "--cost": key_values(list(CostModel.__dataclass_fields__), numeric_bad | other_bad),
        "--json": (None, None),
    }
    return ["simulate", *flags(draw, spec, ("--trace", "--gpus", "--slots"))]


@pytest.mark.timeout(120)
@given(simulate_argv())
def test_simulate(files: dict[str, str], argv: list[str]) -> None:
    check_run(resolve(argv, files), {0, 1, 2})


# ------------------------------------------------------------------ admin, no server

NO_SERVER = "127.0.0.1:1"  # nothing listens on port 1: connection refused at once


@st.composite
def admin_argv(draw: st.DrawFn) -> list[str]:
    spec: Spec = {
        "--address": (
            st.sampled_from([NO_SERVER, "[::1]:1", "unix:/nonexistent/sock"]),
            st.sampled_from(["", " ", "\udcff", "a b", "127.0.0.1:99999"]),
        ),
        "--token": (
            st.sampled_from(["tok", "é"[:0] + "t0k"]),
            st.sampled_from(["", "a\x01b", "\udcff", "é", "a\nb"]),
        ),
        "--timeout": (
            st.sampled_from(["0.5", "0.2"]),
            st.sampled_from(["0", "-1", "nan", "inf", "1e300", "x"]),
        ),
        "--ca": (path_of("garbage.bin"), path_of("missing", "dir")),
        "--cert": (path_of("garbage.bin"), path_of("missing")),
        "--key": (path_of("garbage.bin"), path_of("missing")),
        "--json": (None, None),
    }
    head = flags(draw, spec, ("--address", "--timeout"))
    if "--address" not in head:
        head += ["--address", NO_SERVER]
    if "--timeout" not in head:
        head += ["--timeout", "0.5"]
    action = draw(
        st.sampled_from(
            ["status", "placement", "history", "force", "pause", "resume", "policy", "x", ""]
        )
    )
    tail: list[str] = [action] if action else []
    if action and draw(st.integers(0, 9)):
        tail.append(draw(st.sampled_from(["dep", "dep", "", "a b", "\udcff", "x" * 200])))
    if action == "placement":
        tail += flags(
            draw,
            {
                "--out": (path_of(*OUT), path_of(*BAD_OUT)),
                "--sglang": (path_of(*OUT), path_of(*BAD_OUT)),
            },
            (),
        )
    elif action == "history":
        tail += flags(
            draw,
            {"--limit": (st.sampled_from(["0", "5"]), st.sampled_from(["-1", str(2**32), "x"]))},
            (),
        )
    elif action == "force":
        tail += flags(
            draw,
            {
                "--dry-run": (None, None),
                "--max-moved-fraction": (st.sampled_from(["0.5", "0"]), bad_floats),
            },
            (),
        )
    elif action == "policy":
        tail += draw(
            st.lists(
                st.sampled_from(
                    [
                        "gain_threshold=0.1",
                        "min_windows=-1",
                        f"min_windows={2**32}",
                        "shrink=maybe",
                        "shrink=true",
                        "decay=x",
                        "bogus=1",
                        "noeq",
                        "=",
                        "decay=nan",
                        "\udcff=1",
                    ]
                ),
                max_size=3,
            )
        )
    return ["admin", *head, *tail]


@given(admin_argv())
@example(
    argv=["admin", "--address", NO_SERVER, "history", "dep", "--limit", "-1"]
)  # ValueError traceback
@example(argv=["admin", "--address", NO_SERVER, "status", "\udcff"])  # UnicodeEncodeError traceback
@example(
    argv=["admin", "--address", NO_SERVER, "--token", "\udcff", "status"]
)  # UnicodeEncodeError traceback
@example(argv=["admin", "--address", "", "status"])  # gRPC UNKNOWN, exit 1
@example(
    argv=["admin", "--address", NO_SERVER, "--token", "a\x01", "status"]
)  # gRPC INTERNAL, exit 1
@example(
    argv=["admin", "--address", NO_SERVER, "--timeout", "nan", "status"]
)  # exit 5 "unreachable"
@example(
    argv=["admin", "--address", NO_SERVER, "policy", "dep", "min_windows=-1"]
)  # exit 5, never checked
def test_admin_without_server(files: dict[str, str], argv: list[str]) -> None:
    code, _, err = check_run(resolve(argv, files), {2, 5})
    if code == 5:
        assert "UNAVAILABLE" in err or "DEADLINE_EXCEEDED" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["trace", "info", "@garbage.jsonl"],
        ["trace", "convert", "@garbage.jsonl", "--out", "@out_npz"],
        ["simulate", "--trace", "@garbage.jsonl", "--gpus", "2", "--slots", "4"],
    ],
)
def test_trace_garbage_jsonl(files: dict[str, str], argv: list[str]) -> None:
    """A .jsonl that is not UTF-8 escaped as UnicodeDecodeError (sim/trace.py _load_jsonl)."""
    _, _, err = check_run(resolve(argv, files), {2})
    assert "garbage.jsonl:1: not UTF-8 text" in err


@pytest.mark.parametrize(
    "setting",
    [
        'expert_bytes="x"',
        "moe_fraction=[1]",
        'fixed_seconds_per_layer="x"',
        "expert_bytes={}",
        "seconds_per_token=true",
        f"expert_bytes={2**70}",
    ],
)
def test_simulate_cost_types(files: dict[str, str], setting: str) -> None:
    """A --cost value that is not a number (JSON string, list, object) escaped as TypeError
    (sim/cost.py CostModel.validate, via simulate_cmd._key_values)."""
    _, _, err = check_run(
        [
            "simulate",
            "--trace",
            files["trace.npz"],
            "--gpus",
            "2",
            "--slots",
            "4",
            "--cost",
            setting,
        ],
        {2},
    )
    assert f"cost {setting.partition('=')[0]} must be" in err


@pytest.mark.parametrize("seconds", ["1e308", "1e7", "inf"])
def test_simulate_huge_window_seconds(files: dict[str, str], seconds: str) -> None:
    """simulate --window-seconds 1e308 overflowed to inf in controller/cost.py derived_timing
    (_ceil_tenth) and escaped as OverflowError."""
    _, _, err = check_run(
        [
            "simulate",
            "--trace",
            files["trace.npz"],
            "--gpus",
            "1",
            "--slots",
            "4",
            "--window-seconds",
            seconds,
            "--policy",
            "adaptive",
        ],
        {2},
    )
    assert "window seconds must be in (0, 1e+06]" in err


@pytest.mark.parametrize(
    "gpus, slots, refusal",
    [
        ("1", "4096", "slots (4096) must be at most 2048"),
        ("1", "65536", "slots (65536) must be at most 2048"),
        ("1", "2048", "slots per GPU (2048 / 1 = 2048) must be at most 1024"),
    ],
)
def test_plan_memory_quadratic_in_slots_per_gpu(
    files: dict[str, str], gpus: str, slots: str, refusal: str
) -> None:
    """compute_placement's memory and time grow with the square of the slots (per GPU and
    in all: P/G = 2048: 0.35 GB, 1.2 s; 4096: 1.4 GB, 4.4 s; 65536: out of memory after
    40 s and 17 GB), so `plan --gpus 1 --slots 4096` on 4 experts failed under a 1 GiB
    address-space limit: the layout bound (wire/layout.py check_layout) now refuses it at
    once, with exit 2, under the same limit."""
    import subprocess
    import sys

    child = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30)); "
        "from rebalancer.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            child,
            "plan",
            "--counts",
            files["counts.json"],
            "--gpus",
            gpus,
            "--slots",
            slots,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [f"rebalancer plan: error: {refusal}"], out.stderr
