"""PolicyConfig's sections (estimator, cost) and the flat names outside Python: the store's
rows, the v1 Policy message, the TOML [policy] table and `simulate --set` name each
setting the same way, and old rows and files still load."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest

from rebalancer.controller.admin import policy_from_msg, policy_msg
from rebalancer.controller.config import load_config
from rebalancer.controller.cost import CostParams
from rebalancer.controller.estimate import EstimatorConfig
from rebalancer.controller.policy_config import POLICY_SETTINGS, SECTIONS, PolicyConfig
from rebalancer.controller.registry import Registry
from rebalancer.controller.store import Store
from rebalancer.errors import InputError
from rebalancer.placement import trivial_placement
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire.shape import ClusterShape

L, E, P, G = 2, 4, 6, 2

# A policy row as the controller stored it before the sections (every field flat, the
# old `PolicyConfig.to_dict()`), none at its default.
OLD_FLAT_ROW = {
    "min_interval_seconds": 4.0,
    "gain_threshold": 0.05,
    "horizon_seconds": 120.0,
    "max_moved_fraction": 0.5,
    "decay": 0.6,
    "min_windows": 3,
    "decision_period_seconds": 2.0,
    "prepare_timeout_seconds": 12.0,
    "link_bandwidth_gbps": 5.0,
    "step_seconds": 0.02,
    "paused": True,
    "overlap_penalty": 0.3,
    "commit_gbps": 90.0,
    "swap_seconds": 1e-4,
    "estimate_window": 4,
    "noise_z": 1.5,
    "shrink": False,
    "prior_decay": 0.9,
    "intra_node_gbps": 150.0,
}
OLD_AS_SECTIONS = PolicyConfig(
    min_interval_seconds=4.0,
    gain_threshold=0.05,
    horizon_seconds=120.0,
    max_moved_fraction=0.5,
    min_windows=3,
    decision_period_seconds=2.0,
    prepare_timeout_seconds=12.0,
    paused=True,
    noise_z=1.5,
    estimator=EstimatorConfig(decay=0.6, window=4, prior_decay=0.9, shrink=False),
    cost=CostParams(
        step_seconds=0.02,
        intra_node_gbps=150.0,
        inter_node_gbps=5.0,
        overlap_penalty=0.3,
        commit_gbps=90.0,
        swap_seconds=1e-4,
    ),
)


def _restart(db: Path) -> Registry:
    registry = Registry(Store(db), lambda: 100.0, PolicyConfig())
    registry.load()
    return registry


def test_a_flat_policy_stored_before_the_sections_still_loads(tmp_path: Path) -> None:
    db = tmp_path / "c.sqlite"
    store = Store(db)
    shape = {"num_layers": L, "num_logical": E, "num_slots": P, "num_gpus": G}
    store.create_deployment("old", shape, OLD_FLAT_ROW, 0, trivial_placement(L, E, P, G), now=0.0)
    store.create_deployment(
        "older", shape, {"decay": 0.6}, 0, trivial_placement(L, E, P, G), now=0.0
    )
    store.close()
    registry = _restart(db)
    assert registry.deployment("old").policy == OLD_AS_SECTIONS
    assert registry.deployment("old").loop.estimator.config == OLD_AS_SECTIONS.estimator
    assert registry.deployment("older").policy.estimator == EstimatorConfig(decay=0.6)
    registry.store.close()


def test_the_store_keeps_flat_names_a_rolled_back_controller_reads(tmp_path: Path) -> None:
    """What this controller stores has the old row's keys: the controller before the
    sections (which refused unknown keys) reads it back."""
    db = tmp_path / "c.sqlite"
    registry = Registry(Store(db), lambda: 100.0, OLD_AS_SECTIONS)
    registry.register("d", 0, ClusterShape(L, E, P, G), 0, None, "w0")
    registry.store.close()
    (row,) = Store(db).load_deployments()
    assert row.policy == OLD_FLAT_ROW
    assert json.loads(json.dumps(row.policy)) == OLD_FLAT_ROW
    assert _restart(db).deployment("d").policy == OLD_AS_SECTIONS


def test_flat_names_and_sections_are_one_map() -> None:
    policy = OLD_AS_SECTIONS
    assert policy.to_stored() == OLD_FLAT_ROW
    assert policy.to_flat() == {**OLD_FLAT_ROW, "scale_down_nodes": [], "regimes": False}
    assert PolicyConfig().with_settings(OLD_FLAT_ROW) == policy
    assert PolicyConfig.from_dict(OLD_FLAT_ROW) == policy
    sections = {
        "estimator": {"decay": 0.6, "window": 4, "prior_decay": 0.9, "shrink": False},
        "cost": {
            "step_seconds": 0.02,
            "intra_node_gbps": 150.0,
            "inter_node_gbps": 5.0,
            "overlap_penalty": 0.3,
            "commit_gbps": 90.0,
            "swap_seconds": 1e-4,
        },
    }
    top = {k: v for k, v in OLD_FLAT_ROW.items() if k not in POLICY_SETTINGS}
    assert PolicyConfig.from_dict({**top, **sections}) == policy
    # Every field of a section has exactly one flat name; the wire's names are among them.
    for section in SECTIONS:
        names = [sub for s, sub in POLICY_SETTINGS.values() if s == section]
        assert sorted(names) == sorted(f.name for f in fields(getattr(policy, section)))
    assert {f.name for f in pb.Policy.DESCRIPTOR.fields} <= set(PolicyConfig.setting_names())


@pytest.mark.parametrize(
    "values, message",
    [
        ({"decy": 0.5}, "unknown policy field(s): decy; expected some of min_interval_seconds"),
        ({"estimator": {"decay": 0.5, "windw": 2}}, "unknown policy field(s): estimator.windw"),
        ({"estimator": 0.5}, "policy estimator must be a table"),
        ({"decay": 0.5, "estimator": {"decay": 0.6}}, "given twice (flat and in a section): decay"),
        ({"cost": {"inter_node_gbps": 0.0}}, "policy link_bandwidth_gbps must be in (0.0, inf]"),
        ({"estimator": {"decay": 1.5}}, "policy decay must be in [0.0, 1.0]"),
    ],
)
def test_bad_policy_mappings_are_refused_precisely(values: dict, message: str) -> None:
    with pytest.raises(InputError) as err:
        PolicyConfig.from_dict(values)
    assert message in str(err.value)


def test_a_section_of_the_wrong_type_is_an_input_error() -> None:
    with pytest.raises(InputError, match="policy cost must be a CostParams"):
        PolicyConfig(cost={"step_seconds": 1.0}).validate()  # type: ignore[arg-type]


def test_the_wire_message_round_trips_the_sections() -> None:
    msg = policy_msg(OLD_AS_SECTIONS)
    assert msg.link_bandwidth_gbps == 5.0 and msg.decay == 0.6 and msg.estimate_window == 4
    back = policy_from_msg(msg, PolicyConfig())
    # intra_node_gbps and paused are not on the v1 wire: the base's are kept.
    assert back == PolicyConfig().with_settings(
        {k: v for k, v in OLD_FLAT_ROW.items() if k not in ("intra_node_gbps", "paused")}
    )


def test_toml_policy_takes_flat_names_and_section_tables(tmp_path: Path) -> None:
    flat = tmp_path / "flat.toml"
    flat.write_text("[policy]\ndecay = 0.6\nlink_bandwidth_gbps = 5.0\nmin_windows = 3\n")
    nested = tmp_path / "nested.toml"
    nested.write_text(
        "[policy]\nmin_windows = 3\n\n[policy.estimator]\ndecay = 0.6\n\n"
        "[policy.cost]\ninter_node_gbps = 5.0\n"
    )
    expected = PolicyConfig(
        min_windows=3, estimator=EstimatorConfig(decay=0.6), cost=CostParams(inter_node_gbps=5.0)
    )
    assert load_config(flat).policy == expected == load_config(nested).policy
    twice = tmp_path / "twice.toml"
    twice.write_text("[policy]\ndecay = 0.6\n\n[policy.estimator]\ndecay = 0.5\n")
    with pytest.raises(
        InputError, match=r"policy setting\(s\) given twice \(flat and in a section\): decay"
    ):
        load_config(twice)
