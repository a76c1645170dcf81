from __future__ import annotations

import json

import numpy as np
import pytest

from rebalancer.errors import InputError
from rebalancer.formats import (
    load_counts,
    read_placement,
    write_placement,
    write_sglang_expert_location,
)
from rebalancer.placement import compute_placement

COUNTS = np.arange(24).reshape(3, 8)


def test_json_counts(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"logical_count": COUNTS.tolist()}))
    counts = load_counts(path)
    assert counts.dtype == np.float64 and (counts == COUNTS).all()


def test_real_file_reads(deepseek):
    from rebalancer.datasets import deepseek_v3_files

    path = deepseek_v3_files()[0]
    assert (load_counts(path) == deepseek[path.stem]).all()


def test_npz_counts_sum_over_time(tmp_path):
    path = tmp_path / "c.npz"
    np.savez(path, logical_count=np.stack([COUNTS, COUNTS]))
    assert (load_counts(path) == 2 * COUNTS).all()


def test_pt_counts(tmp_path):
    torch = pytest.importorskip("torch")
    stacked = tmp_path / "dump.pt"
    torch.save({"logical_count": torch.tensor(np.stack([COUNTS, COUNTS, COUNTS]))}, stacked)
    assert (load_counts(stacked) == 3 * COUNTS).all()
    flat = tmp_path / "flat.pt"
    torch.save({"logical_count": torch.tensor(COUNTS)}, flat)
    assert (load_counts(flat) == COUNTS).all()
    missing = tmp_path / "missing.pt"
    torch.save({"other": torch.tensor(COUNTS)}, missing)
    with pytest.raises(InputError, match="missing key 'logical_count'"):
        load_counts(missing)


@pytest.mark.parametrize(
    "content, message",
    [
        ({"other": [[1]]}, "missing key 'logical_count'"),
        ({"logical_count": [1, 2, 3]}, "rank 1"),
        ({"logical_count": [[[[1]]]]}, "rank 4"),
        ({"logical_count": [[1, -2], [3, 4]]}, "negative value at layer 0, expert 1"),
        ({"logical_count": [[1, 2], [3]]}, "equal-length"),
        ({"logical_count": []}, "rank 1"),
        ([1, 2], "missing key"),
    ],
)
def test_bad_json_counts(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(InputError, match=message.replace("[", r"\[")) as info:
        load_counts(path)
    assert "\n" not in str(info.value)


def test_unreadable_files(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        load_counts(tmp_path / "nope.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        load_counts(tmp_path / "x.json")
    (tmp_path / "x.csv").write_text("1,2")
    with pytest.raises(InputError, match="unknown counts format"):
        load_counts(tmp_path / "x.csv")
    np.savez(tmp_path / "y.npz", other=COUNTS)
    with pytest.raises(InputError, match="missing key"):
        load_counts(tmp_path / "y.npz")


def test_a_folder_is_named_as_one(tmp_path, capsys):
    """Issue 34: `plan --counts /tmp` said "no such file" for a folder."""
    from rebalancer.cli import main
    from rebalancer.formats import read_placement

    for read in (load_counts, read_placement):
        with pytest.raises(InputError, match="is a folder, not a file"):
            read(tmp_path)
    assert main(["plan", "--counts", str(tmp_path), "--gpus", "2", "--slots", "4"]) == 2
    assert (
        capsys.readouterr().err == f"rebalancer plan: error: {tmp_path}: is a folder, not a file\n"
    )


def test_placement_round_trip(tmp_path):
    result = compute_placement(COUNTS, 12, 4, 2)
    path = tmp_path / "PLACEMENT.json"
    write_placement(path, result.phy2log, 4, 2, 8, version=7)
    saved = read_placement(path)
    assert (saved.phy2log == result.phy2log).all()
    assert (saved.num_gpus, saved.num_nodes, saved.num_logical, saved.version) == (4, 2, 8, 7)
    write_placement(path, result.phy2log, 4)
    assert read_placement(path).version is None


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"num_gpus": 4}, "missing key 'phy2log'"),
        ({"phy2log": [[0, 1, 2, 3]]}, "missing key 'num_gpus'"),
        ({"phy2log": [[0, 1, 2, 3]], "num_gpus": 3}, "do not divide"),
        ({"phy2log": [[0, 1, 2, 3]], "num_gpus": 2, "num_nodes": 3}, "nodes"),
        ({"phy2log": [[0, 1, 2, 2]], "num_gpus": 2, "num_logical": 4}, "no replica of expert 3"),
        ({"phy2log": [[0, -1]], "num_gpus": 2}, "negative"),
        ({"phy2log": [[0, 1]], "num_gpus": "2"}, "positive integer"),
        ({"phy2log": [[0, 1]], "num_gpus": 2, "version": "x"}, "version"),
    ],
)
def test_bad_placements(tmp_path, doc, message):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(InputError, match=message):
        read_placement(path)


def test_sglang_export(tmp_path):
    result = compute_placement(COUNTS, 12, 4)
    path = tmp_path / "sglang.json"
    write_sglang_expert_location(path, result.phy2log)
    data = json.loads(path.read_text())
    assert list(data) == ["physical_to_logical_map"]
    assert data["physical_to_logical_map"] == result.phy2log.tolist()
