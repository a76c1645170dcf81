"""The declared scale-downs (policy scale_down_nodes) outside Python: the v1 Policy
message carries them with presence (absent keeps the deployment's, present and empty
clears them), `admin policy` parses and prints them, `admin contingency` names them; the
controller's TOML takes them flat or in `[policy.contingency]` and refuses bad ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from rebalancer.cli.admin_cmd import _contingency_text, _parse_settings, _policy_value
from rebalancer.controller.admin import policy_from_msg, policy_msg
from rebalancer.controller.config import load_config
from rebalancer.controller.decide import PolicyConfig
from rebalancer.errors import InputError
from rebalancer.v1 import rebalancer_pb2 as pb


def test_the_policy_message_carries_the_counts_with_presence() -> None:
    declared = PolicyConfig().with_settings({"scale_down_nodes": [7, 6]})
    msg = policy_msg(declared)
    assert msg.HasField("scale_down_nodes") and list(msg.scale_down_nodes.counts) == [7, 6]
    assert policy_from_msg(msg, PolicyConfig()).contingency.scale_down_nodes == [7, 6]
    absent = pb.Policy.FromString(msg.SerializeToString())
    absent.ClearField("scale_down_nodes")  # a client that does not know the field
    assert policy_from_msg(absent, declared).contingency.scale_down_nodes == [7, 6]
    cleared = pb.Policy.FromString(msg.SerializeToString())
    cleared.scale_down_nodes.CopyFrom(pb.NodeCounts())
    assert policy_from_msg(cleared, declared).contingency.scale_down_nodes == []


def test_a_zero_count_on_the_wire_is_refused_precisely() -> None:
    msg = policy_msg(PolicyConfig())
    msg.scale_down_nodes.CopyFrom(pb.NodeCounts(counts=[3, 0]))
    with pytest.raises(InputError, match="0 nodes: a deployment scales down to 1 node at least"):
        policy_from_msg(msg, PolicyConfig())


def test_admin_policy_parses_and_prints_a_list_of_counts() -> None:
    assert _parse_settings(["scale_down_nodes=7,6", "decay=0.5"], pb) == [
        ("scale_down_nodes", [7, 6]),
        ("decay", 0.5),
    ]
    assert _parse_settings(["scale_down_nodes="], pb) == [("scale_down_nodes", [])]
    for bad, part in (("scale_down_nodes=7,-1", "'-1'"), ("scale_down_nodes=2.5", "'2.5'")):
        with pytest.raises(InputError, match=f"{part} is not a whole number of nodes"):
            _parse_settings([bad], pb)
    assert _policy_value(pb.NodeCounts(counts=[7, 6])) == "7, 6"
    assert _policy_value(pb.NodeCounts()) == "none"


def test_admin_contingency_names_a_scale_down_by_the_nodes_left() -> None:
    reply = pb.ContingencyResponse(
        planned=True,
        base_version=3,
        computed_at=0.0,
        balancedness_now=0.99,
        losses=[
            pb.PlannedLoss(kind="node", lost_ranks=[6, 7], balancedness=0.9),
            pb.PlannedLoss(
                kind="scale_down", lost_ranks=[4, 5, 6, 7], balancedness=0.8, slots_moved=5
            ),
            pb.PlannedLoss(kind="scale_down", lost_ranks=[2, 3, 4, 5, 6, 7], unserved=2),
        ],
    )
    lines = _contingency_text("d", reply).splitlines()
    assert lines[3].split() == ["down", "to", "2", "nodes", "0.800", "5", "0", "ranks", "4-7", "go"]
    assert lines[4].split()[:5] == ["down", "to", "1", "nodes", "-"]
    assert lines[4].endswith("ranks 2-7 go; cannot serve: 2 experts a layer without a slot")


@pytest.mark.parametrize(
    "line, message",
    [
        (
            "scale_down_nodes = [7, 0]",
            "scale_down_nodes: 0 nodes: a deployment scales down to 1 node at least",
        ),
        ("scale_down_nodes = [6.5]", "scale_down_nodes: 6.5 is not a whole number of nodes"),
        ("scale_down_nodes = 7", "scale_down_nodes must be a list of node counts, got 7"),
    ],
)
def test_a_bad_toml_default_is_refused_naming_the_count(
    tmp_path: Path, line: str, message: str
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f"[policy]\n{line}\n")
    with pytest.raises(InputError) as err:
        load_config(path)
    assert message in str(err.value)
    ok = tmp_path / "ok.toml"
    ok.write_text("[policy.contingency]\nscale_down_nodes = [7, 6]\n")
    assert load_config(ok).policy.contingency.scale_down_nodes == [7, 6]
