"""Trace inputs: every format reads into the same windows; bad files are InputErrors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rebalancer.cli import main
from rebalancer.errors import InputError
from rebalancer.sim.generate import TraceGenConfig, make_trace
from rebalancer.sim.trace import Trace, load_trace


def _counts(t: int = 3, layers: int = 2, experts: int = 4, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50, size=(t, layers, experts))


def test_npz_round_trip(tmp_path: Path) -> None:
    trace = Trace(_counts(), window_seconds=2.5, name="x", labels=["a", "b", "c"])
    trace.save(tmp_path / "t.npz")
    back = load_trace(tmp_path / "t.npz")
    np.testing.assert_array_equal(back.counts, trace.counts)
    assert back.window_seconds == 2.5 and back.labels == ["a", "b", "c"]
    assert load_trace(tmp_path / "t.npz", window_seconds=1.0).window_seconds == 1.0


def test_empty_layers_are_dropped(tmp_path: Path) -> None:
    counts = _counts(layers=3)
    counts[:, 0] = 0  # a dense layer
    np.savez(tmp_path / "t.npz", logical_count=counts)
    back = load_trace(tmp_path / "t.npz")
    assert back.num_layers == 2
    np.testing.assert_array_equal(back.counts, counts[:, 1:])


def test_json_single_window(tmp_path: Path) -> None:
    counts = _counts(t=1)[0]
    (tmp_path / "s.json").write_text(json.dumps({"logical_count": counts.tolist()}))
    back = load_trace(tmp_path / "s.json")
    assert back.counts.shape == (1, 2, 4)
    np.testing.assert_array_equal(back.counts[0], counts)


def test_sglang_pt_dump(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    counts = _counts()
    torch.save({"logical_count": torch.tensor(counts)}, tmp_path / "d.pt")
    np.testing.assert_array_equal(load_trace(tmp_path / "d.pt").counts, counts)


def test_directory_of_dumps(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    counts = _counts(t=4, layers=3)
    counts[:, 0] = 0
    for i, window in enumerate(counts):  # one SGLang-style [L, E] dump per window
        torch.save({"logical_count": torch.tensor(window)}, tmp_path / f"dump_{i:03d}.pt")
    trace = load_trace(tmp_path)
    np.testing.assert_array_equal(trace.counts, counts[:, 1:])
    (tmp_path / "dump_999.json").write_text(json.dumps({"logical_count": [[1, 2]]}))
    with pytest.raises(InputError, match="disagree"):
        load_trace(tmp_path)
    with pytest.raises(InputError):
        load_trace(tmp_path / "empty_dir_missing")


def test_jsonl_tokens_grouped_in_generation_order(tmp_path: Path) -> None:
    lines = []
    # Layer-major per problem, like the Mixtral file: 2 problems, 3 then 2 tokens, 2 layers.
    for problem, tokens in ((0, 3), (1, 2)):
        for layer in range(2):
            for tok in range(tokens):
                experts = [(tok + layer) % 4, (tok + problem + 1) % 4]
                lines.append(
                    {"problem_id": problem, "layer": layer, "token_idx": tok, "experts": experts}
                )
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    trace = load_trace(path, tokens_per_window=2)
    assert trace.counts.shape == (3, 2, 4)  # 5 tokens in windows of 2
    # Every token routes to two experts in every layer.
    np.testing.assert_array_equal(trace.counts.sum(axis=2), [[4, 4], [4, 4], [2, 2]])
    # Window 1 holds token 2 of problem 0 and token 0 of problem 1; layer 0 experts:
    # token (0, 2): [2, 3]; token (1, 0): [0, 2].
    np.testing.assert_array_equal(trace.counts[1, 0], [1, 0, 2, 1])


def test_real_mixtral_file(mixtral_path: Path) -> None:
    trace = load_trace(mixtral_path, tokens_per_window=16)
    assert trace.num_layers == 32 and trace.num_experts == 8
    assert trace.counts.sum() == 2 * sum(1 for _ in mixtral_path.open())


@pytest.mark.parametrize(
    "name, content",
    [
        ("a.npz", b"not a zip file"),
        ("b.json", b'{"other": 1}'),
        ("c.json", b"[[1, 2], [3]]"),
        ("d.jsonl", b'{"layer": 0}\n'),
        ("e.jsonl", b""),
        ("f.csv", b"1,2,3"),
    ],
)
def test_bad_files(tmp_path: Path, name: str, content: bytes) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(InputError):
        load_trace(path)


@pytest.mark.parametrize(
    "counts",
    [
        np.zeros((3, 4)),  # one all-zero window
        -np.ones((2, 2, 4)),
        np.full((2, 2, 4), np.nan),
        np.full((2, 2, 4), 0.5),
        np.zeros((2, 2, 4)),
        np.ones((2, 2, 4, 1)),
    ],
)
def test_bad_arrays(tmp_path: Path, counts: np.ndarray) -> None:
    np.savez(tmp_path / "t.npz", logical_count=counts)
    with pytest.raises(InputError):
        load_trace(tmp_path / "t.npz")


def test_cli_bad_trace_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.npz"
    path.write_bytes(b"garbage")
    rc = main(["simulate", "--gpus", "4", "--slots", "8", "--trace", str(path), "--json"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "bad.npz" in err[0]
    rc = main(["simulate", "--gpus", "4", "--slots", "8", "--trace", str(tmp_path / "none.npz")])
    assert rc == 2


def test_generator_kinds_are_deterministic_and_sized() -> None:
    rng = np.random.default_rng(0)
    sources = {f"w{i}": rng.pareto(1.5, size=(3, 16)) + 0.1 for i in range(3)}
    for kind in ("phase", "mix", "burst"):
        cfg = TraceGenConfig(kind=kind, windows=30, tokens_per_window=100, top_k=2, seed=4)
        a, b = make_trace(sources, cfg), make_trace(sources, cfg)
        np.testing.assert_array_equal(a.counts, b.counts)
        assert a.counts.shape == (30, 3, 16)
        assert np.all(a.counts.sum(axis=2) == 200)
        assert len(a.labels) == 30
    phase = make_trace(sources, TraceGenConfig(kind="phase", windows=100, phase_max_windows=30))
    assert len(set(phase.labels)) > 1  # it does change workload
    with pytest.raises(InputError):
        make_trace(sources, TraceGenConfig(kind="wobble"))


def test_cli_trace_make_info_convert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(7)
    sources = []
    for i in range(2):
        path = tmp_path / f"w{i}.json"
        counts = rng.integers(1, 100, size=(3, 16))
        counts[0] = 0  # a dense layer, dropped
        path.write_text(json.dumps({"logical_count": counts.tolist()}))
        sources += ["--source", str(path)]
    out = tmp_path / "t.npz"
    args = ["trace", "make", "--kind", "phase", "--windows", "7", "--tokens-per-window", "50"]
    assert main(args + ["--top-k", "2", "--out", str(out), "--json"] + sources) == 0
    made = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert made["windows"] == 7 and made["layers"] == 2 and made["experts"] == 16
    trace = load_trace(out)
    assert np.all(trace.counts.sum(axis=2) == 100)
    assert main(["trace", "info", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["windows"] == 7
    assert main(["trace", "convert", str(out), "--out", str(tmp_path / "c.npz")]) == 0
    np.testing.assert_array_equal(load_trace(tmp_path / "c.npz").counts, trace.counts)
    assert main(args + ["--out", str(tmp_path / "t.csv")] + sources) == 2
    assert main(args + ["--out", str(out), "--source", str(tmp_path / "missing.json")]) == 2
    (tmp_path / "bad.json").write_text("{not json")
    assert main(args + ["--out", str(out), "--source", str(tmp_path / "bad.json")]) == 2


def test_trace_out_into_a_missing_folder_fails_before_the_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 34: `trace make --out` into a missing folder failed only after the trace was made."""
    import rebalancer.sim.generate
    import rebalancer.sim.trace

    def worked(*args: object, **kwargs: object) -> None:
        raise AssertionError("the work started")

    monkeypatch.setattr(rebalancer.sim.generate, "make_trace", worked)
    monkeypatch.setattr(rebalancer.sim.trace, "load_trace", worked)
    out = tmp_path / "missing" / "t.npz"
    assert main(["trace", "make", "--windows", "7", "--out", str(out)]) == 2
    assert (
        capsys.readouterr().err
        == f"rebalancer trace: error: --out {out}: folder {out.parent} does not exist\n"
    )
    assert main(["trace", "convert", str(tmp_path / "in.npz"), "--out", str(out)]) == 2
    assert f"--out {out}: folder {out.parent} does not exist" in capsys.readouterr().err
