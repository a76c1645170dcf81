"""A deployment's policy: when to rebalance, how the load is estimated, what moves cost.

`PolicyConfig` holds the decision gate's settings and three sections, each the settings
object of the module that uses them: `estimator` (rebalancer/controller/estimate.py,
`EstimatorConfig`), `cost` (rebalancer/controller/cost.py, `CostParams`) and
`contingency` (rebalancer/controller/contingency.py, `ContingencyConfig`). Nothing is
copied between them: the estimator, the cost model and the contingency planner read their
own section.

Outside Python a setting has one flat name, the field name of the v1 `Policy` message
(proto/rebalancer/v1/rebalancer.proto): the admin API (GetPolicy, SetPolicy, `rebalancer
admin policy DEP key=value`), the controller's TOML `[policy]` table, `rebalancer
simulate --set` and docs/operations.md all name settings so. `POLICY_SETTINGS` is the one
map between those names and where a setting lives here; `to_flat` / `with_settings` are
the one conversion. The store keeps `to_flat()` too: rows written before the sections
existed load unchanged, and a controller rolled back reads the rows this one wrote.
`from_dict` (TOML, the store) also takes the sections as tables (`[policy.estimator]`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Literal

from rebalancer.controller.contingency import ContingencyConfig
from rebalancer.controller.cost import (
    CostParams,
    ReferenceDeployment,
    derived_timing,
)
from rebalancer.controller.estimate import EstimatorConfig
from rebalancer.errors import InputError
from rebalancer.wire.shape import ClusterShape

if TYPE_CHECKING:
    from collections.abc import Mapping

# Defaults the timing defaults are derived from (rebalancer/controller/cost.py).
_GAIN_THRESHOLD = 0.02
_MAX_MOVED_FRACTION = 0.25
_TIMING = derived_timing(EstimatorConfig.decay, _GAIN_THRESHOLD, _MAX_MOVED_FRACTION)

Section = Literal["estimator", "cost", "contingency"]
SECTIONS: tuple[Section, ...] = ("estimator", "cost", "contingency")

# Flat setting name (the v1 Policy message's, TOML's, the CLI's) -> (section, field) for
# the settings that live in a section; every other flat name is a PolicyConfig field.
POLICY_SETTINGS: dict[str, tuple[Section, str]] = {
    "decay": ("estimator", "decay"),
    "estimate_window": ("estimator", "window"),
    "shrink": ("estimator", "shrink"),
    "prior_decay": ("estimator", "prior_decay"),
    "link_bandwidth_gbps": ("cost", "inter_node_gbps"),
    "intra_node_gbps": ("cost", "intra_node_gbps"),
    "step_seconds": ("cost", "step_seconds"),
    "overlap_penalty": ("cost", "overlap_penalty"),
    "commit_gbps": ("cost", "commit_gbps"),
    "swap_seconds": ("cost", "swap_seconds"),
    "scale_down_nodes": ("contingency", "scale_down_nodes"),
}

# Settings newer than the store's first strict readers: a stored row names one only when
# it is not at its default (`PolicyConfig.to_stored`), so a controller rolled back to
# before it (which refuses unknown names) still reads every row that does not use it.
STORED_WHEN_SET: frozenset[str] = frozenset({"scale_down_nodes", "regimes"})


@dataclass
class PolicyConfig:
    """When to rebalance; mirrors the proto message rebalancer.v1.Policy (plus a few knobs).

    Every setting but `paused` (set by pause/resume) and `cost.intra_node_gbps` (not on
    the v1 wire yet) is a field of the Policy message, under its flat name
    (`POLICY_SETTINGS`). `min_interval_seconds` and `decision_period_seconds` default to
    what the cost model derives from the other defaults (rebalancer/controller/cost.py,
    `derived_timing`).
    """

    min_interval_seconds: float = _TIMING.min_interval_seconds
    """No two rebalances closer than this (seconds of the controller's clock). Default:
    the time the smallest accepted gain needs to repay the largest plan, at least one
    window plus the estimate's half-life (2.2 s for ~1 s windows; `for_windows`)."""

    gain_threshold: float = _GAIN_THRESHOLD
    """Hysteresis: minimum predicted balancedness gain (candidate - current, layer mean)."""

    horizon_seconds: float = 300.0
    """The predicted step-time saving is credited over this horizon."""

    max_moved_fraction: float = _MAX_MOVED_FRACTION
    """Migration budget per plan: at most this fraction of the slots change."""

    min_windows: int = 2
    """Windows folded into the estimate before the first decision."""

    decision_period_seconds: float = _TIMING.decision_period_seconds
    """How often the controller runs a decision (it decides only on a folded window).
    Default: the estimate's half-life, at least one window (1.0 s for ~1 s windows)."""

    prepare_timeout_seconds: float = 30.0
    """A rank that has not prepared within this time aborts the plan."""

    paused: bool = False
    """No policy rebalances while paused (forced ones still run)."""

    noise_z: float = 2.0
    """Sampling-noise margin added to the hysteresis, in standard errors of a GPU's load:
    a candidate fitted on a noisy estimate looks better on it than it will serve."""

    regimes: bool = False
    """Opt in to the regimes policy (rebalancer/controller/regimes.py): the windows are
    clustered into recurring load regimes kept in the store, a returning regime is
    recognised within a window or two and decided on with its centroid and ready
    placement, smooth drift on a forecast; the same gate. Off: the adaptive policy.
    Not on the v1 wire yet: set in TOML's [policy] or `rebalancer simulate --set`."""

    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    """How the load estimate the decisions read is kept (decay or sliding window, and the
    empirical-Bayes shrinkage toward the long-run prior)."""

    cost: CostParams = field(default_factory=CostParams)
    """What moving expert weights costs this deployment: the gate charges plans with it,
    and the timing defaults are derived from it."""

    contingency: ContingencyConfig = field(default_factory=ContingencyConfig)
    """What the survivor placements are planned for besides every single rank and node
    loss: the scale-downs the deployment declares it may take."""

    def for_windows(self, shape: ClusterShape, window_seconds: float) -> PolicyConfig:
        """A copy with `min_interval_seconds` and `decision_period_seconds` derived for
        this deployment and window length (`cost.derived_timing`) from this policy's
        estimator, gain_threshold, max_moved_fraction and cost. The defaults are this for
        `cost.REFERENCE`: DeepSeek-V3 at EP32 on 4 nodes, ~1 s windows."""
        self.validate()
        shape.validate()
        if not (math.isfinite(window_seconds) and window_seconds > 0):
            raise InputError(f"window_seconds must be > 0, got {window_seconds}")
        deployment = ReferenceDeployment(shape, window_seconds)
        timing = derived_timing(
            self.estimator.decay,
            self.gain_threshold,
            self.max_moved_fraction,
            self.cost,
            deployment,
            self.estimator.window,
        )
        return replace(
            self,
            min_interval_seconds=timing.min_interval_seconds,
            decision_period_seconds=timing.decision_period_seconds,
        )

    def validate(self) -> None:
        """Raise InputError naming (by its flat name) the first setting out of range."""
        for section, kind in (
            ("estimator", EstimatorConfig),
            ("cost", CostParams),
            ("contingency", ContingencyConfig),
        ):
            if not isinstance(getattr(self, section), kind):
                raise InputError(
                    f"policy {section} must be a {kind.__name__}, got {getattr(self, section)!r}"
                )
        self.contingency.validate()
        settings = self.to_flat()

        def number(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            value = settings[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InputError(f"policy {name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise InputError(f"policy {name} must be finite, got {value}")
            if value < lo or (lo_open and value == lo) or value > hi:
                left = "(" if lo_open else "["
                raise InputError(f"policy {name} must be in {left}{lo}, {hi}], got {value}")

        inf = math.inf
        number("min_interval_seconds", 0.0, inf)
        number("gain_threshold", 0.0, 1.0)
        number("horizon_seconds", 0.0, inf, lo_open=True)
        number("max_moved_fraction", 0.0, 1.0, lo_open=True)
        number("decay", 0.0, 1.0)
        number("decision_period_seconds", 0.0, inf, lo_open=True)
        number("prepare_timeout_seconds", 0.0, inf, lo_open=True)
        number("link_bandwidth_gbps", 0.0, inf, lo_open=True)
        number("intra_node_gbps", 0.0, inf, lo_open=True)
        number("step_seconds", 0.0, inf, lo_open=True)
        number("overlap_penalty", 0.0, 1.0)
        number("swap_seconds", 0.0, inf)
        number("commit_gbps", 0.0, inf, lo_open=True)
        number("noise_z", 0.0, inf)
        number("prior_decay", 0.0, 1.0)
        for name in ("min_windows", "estimate_window"):
            value = settings[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InputError(f"policy {name} must be an integer >= 0, got {value!r}")
        for name in ("paused", "shrink", "regimes"):
            if not isinstance(settings[name], bool):
                raise InputError(f"policy {name} must be a boolean, got {settings[name]!r}")

    # -- flat names <-> sections: the one conversion -----------------------------------

    @staticmethod
    def setting_names() -> tuple[str, ...]:
        """Every setting's flat name: the gate's fields, then the sections' settings."""
        top = tuple(f.name for f in fields(PolicyConfig) if f.name not in SECTIONS)
        return top + tuple(POLICY_SETTINGS)

    def to_flat(self) -> dict[str, Any]:
        """Every setting under its flat name (`setting_names()` order)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in SECTIONS}
        for name, (section, key) in POLICY_SETTINGS.items():
            out[name] = getattr(getattr(self, section), key)
        return out

    def to_stored(self) -> dict[str, Any]:
        """`to_flat()` as the store keeps it: without the STORED_WHEN_SET settings that
        are at their default."""
        defaults = PolicyConfig().to_flat()
        return {
            name: value
            for name, value in self.to_flat().items()
            if name not in STORED_WHEN_SET or value != defaults[name]
        }

    def with_settings(self, values: Mapping[str, Any]) -> PolicyConfig:
        """A copy with the settings named by flat name changed (not validated); an
        unknown name is an InputError listing the known ones."""
        unknown = sorted(set(values) - set(self.setting_names()))
        if unknown:
            raise InputError(
                f"unknown policy field(s): {', '.join(unknown)}; "
                f"expected some of {', '.join(self.setting_names())}"
            )
        top = {k: v for k, v in values.items() if k not in POLICY_SETTINGS}
        sections: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
        for name, value in values.items():
            if name in POLICY_SETTINGS:
                section, key = POLICY_SETTINGS[name]
                sections[section][key] = value
        return replace(
            self,
            **top,
            **{
                s: replace(getattr(self, s), **changes)
                for s, changes in sections.items()
                if changes
            },
        )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> PolicyConfig:
        """Build from a mapping (TOML's `[policy]`, a store row): flat names and/or the
        sections as tables of their own field names (`estimator = {window = 4}`); unknown
        keys are an InputError, missing ones keep defaults."""
        flat: dict[str, Any] = {}
        by_field = {where: name for name, where in POLICY_SETTINGS.items()}
        for key, value in values.items():
            if key not in SECTIONS:
                flat[key] = value
                continue
            if not isinstance(value, dict):
                raise InputError(
                    f"policy {key} must be a table of settings, got {type(value).__name__}"
                )
            for sub, sub_value in value.items():
                name = by_field.get((key, sub))  # type: ignore[arg-type]
                if name is None:
                    raise InputError(f"unknown policy field(s): {key}.{sub}")
                flat[name] = sub_value
        twice = sorted(
            name
            for name, (section, sub) in POLICY_SETTINGS.items()
            if name in values and isinstance(values.get(section), dict) and sub in values[section]
        )
        if twice:
            raise InputError(
                f"policy setting(s) given twice (flat and in a section): {', '.join(twice)}"
            )
        config = cls().with_settings(flat)
        config.validate()
        return config
