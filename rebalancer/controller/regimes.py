"""Load that comes back: a library of load regimes per deployment, and a drift forecast.

Serving traffic repeats (prefill- and decode-heavy phases, the day's tenant mix) and
drifts. The adaptive policy meets each return as if it were new: its decayed estimate
has to move over before a plan pays. The `regimes` policy (opt in: `PolicyConfig.regimes`)
keeps, per deployment, a `RegimeLibrary`:
- Regimes: the windows clustered online. A window's distance to a regime is what a
  placement cares about: the balancedness the regime's own fit (a from-scratch placement
  on its centroid) loses on the window's load, against what it reaches on the centroid
  (`distances`). Within `RegimeConfig.match_distance` the window joins the nearest
  regime; otherwise it starts a new one (the library holds `capacity`; the least seen
  goes). Per regime: the load centroid (mean per-layer shares), its fit, the ready
  placement (the best one that served it, reached through the cost gate), how often it
  came back and how long it stayed.
- Three predictors of the next window's load, each scored online by how far its
  prediction was from the window that came (mean per-layer total-variation distance of
  the shares, `share_distance`): the matched regime's centroid, a drift forecast (the
  trend between a fast and a slow exponential mean of the shares, extrapolated one
  window ahead, restarted at a jump between regimes: `forecast`; a decision on it looks
  `RegimeConfig.forecast_horizon_windows` ahead) and the adaptive estimate. The
  decision uses the one with the lowest running error, except that a window recognised
  as the return of a known regime takes that regime's centroid at once.
- Candidates: the migration-aware fit on the chosen load (as adaptive), the recognised
  regime's ready placement, and, when known regimes alternate faster than a move pays
  (mean stay at most `fast_run_windows`), a max-min placement over the regimes in play
  (`maxmin_placement`). On a jump to a load never seen, once such a load went back
  within a few windows before (bursts), the fit is hedged: the max-min placement over
  that window and the regime it left (`RegimeConfig.hedge_jumps`; one window cannot tell
  a burst that goes back from a load that stays). Each goes through
  the same cost gate (`decide.gate_decision`);
  a load that is a regime's centroid or the smoothed forecast is worth many windows, so
  its noise margin is smaller, and its hysteresis is `RegimeConfig.gain_threshold`.
  The plans only that smaller hysteresis takes ("extra": `is_extra`) move at most
  `RegimeConfig.extra_slots_share` of the slots the plans that cleared the policy's own
  moved (`RegimeLibrary.slots_main`, `slots_extra`). A candidate that gains
  `RegimeConfig.sure_gain` (the trivial placement an engine starts with, a burst) is
  decided on after one window, the policy's `min_windows` waived, and waits only the min
  interval scaled to its gain (`sure_gate`).

Everything here is a function of its arguments: `decide_regimes` takes the library and
the windows folded since the last decision and returns the Decision with the updated
library in `Decision.state` (the controller runs it in its decision worker and keeps the
library it gets back; the simulator runs it inline). `RegimeLibrary.to_record` /
`from_record` are what the store keeps (rebalancer/controller/store.py, `save_regimes`).

Shapes: L layers, E logical experts, P physical slots, G GPUs; counts and loads [L, E],
placements (phy2log) [L, P].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from rebalancer.controller.decide import (
    Decision,
    PolicyConfig,
    evaluate_candidate,
    gate_decision,
    no_load_decision,
    predicted_balance,
)
from rebalancer.errors import InputError
from rebalancer.placement import compute_placement, lower_bound_balancedness
from rebalancer.placement.metrics import balancedness_of
from rebalancer.wire.shape import ClusterShape

PREDICTORS = ("regime", "forecast", "estimate")


def pool_key(pool: str) -> str:
    """Where the store keeps a replica pool's library: beside the deployments' (a
    deployment's name never holds a colon, rebalancer.controller.service.NAME_RE)."""
    return f"pool:{pool}"


def copy_library(library: RegimeLibrary) -> RegimeLibrary:
    """An independent copy (a new pool member starts from its pool's library)."""
    copy = RegimeLibrary.from_record(*library.to_record())
    copy.changed = True  # the copy is not in the store yet
    for r in copy.regimes:
        r.stored = (0, False)
    return copy


# The loads a decision may use (the first word of Decision.load).
LOADS = (*PREDICTORS, "alternation")
# Known regimes' ids kept for the alternation test and the operator's view.
RECENT_WINDOWS = 32


@dataclass(frozen=True)
class RegimeConfig:
    """How regimes are told apart and used (defaults for the DeepSeek-V3 traces: the
    same workload's windows lose 0.005-0.02 of balancedness on each other's fit, two
    workloads 0.08 or more)."""

    match_distance: float = 0.04
    """A window joins the nearest regime whose fit loses at most this balancedness on it."""

    capacity: int = 16
    """Regimes kept per deployment; a new one evicts the least seen (not the current)."""

    drift_max_moved_fraction: float = 0.03
    """Budget of the small move offered while the load drifts (0: none)."""

    drift_gain_threshold: float = 0.005
    """Hysteresis of that small move (its noise margin is added)."""

    known_windows: int = 3
    """Windows a regime needs before its return is recognised and its centroid decided on."""

    gain_threshold: float = 0.005
    """Hysteresis on a regime's centroid or the forecast (their noise margin is added)."""

    max_effective_windows: float = 64.0
    """Cap on the windows a centroid is worth to the noise margin (a regime drifts too)."""

    forecast_fast: float = 0.3
    """Weight of the old value per window of the forecast's fast exponential mean."""

    forecast_slow: float = 0.8
    """The same for its slow mean (> forecast_fast): their gap over their lag gap is the trend."""

    forecast_horizon_windows: float = 1.0
    """Windows ahead of the newest one that a decision on the drift forecast fits and
    gates on (1: the next window). A plan serves several windows after it lands, so a
    longer look ahead places for a later load, and takes plans sooner while the load
    drifts: more plans and more slots moved (BENCHMARKS.md, the regimes policy)."""

    forecast_effective_windows: float = 1.5
    """Windows the forecast is worth to the noise margin (the fast mean's, less the trend's
    noise)."""

    score_decay: float = 0.7
    """Weight of a predictor's old running error per window."""

    fast_run_windows: float = 4.0
    """Known regimes that stay this many windows or fewer on average (over the last
    RECENT_WINDOWS) alternate too fast for moves: a max-min placement is offered."""

    maxmin_rounds: int = 4
    """Fits of the max-min placement's multiplicative-weights search."""

    extra_slots_share: float = 0.15
    """Slots the plans taken only by this policy's smaller hysteresis may move (a regime's
    centroid refined, the drift's small move), as a share of the slots moved by the plans
    that cleared the policy's own `gain_threshold`, over the deployment's life: what the
    adaptive policy would not have moved stays within this share of what it would."""

    hedge_jumps: bool = True
    """On a jump to a load never seen, once such a load went back within
    `fast_run_windows` windows before (`RegimeLibrary.went_back`: this deployment has
    bursts), fit the max-min placement over that window and the regime it jumped from
    (migration-aware, the policy's budget) instead of the window alone: one window cannot
    tell a burst that goes back from a load that stays, and a placement fitted to a burst
    alone serves the load it goes back to worse than the one before it did, until the next
    plan. Where new loads stay (phases) the fit serves them at once (False: never hedge)."""

    sure_gain: float = 0.2
    """A candidate that gains this much balancedness on the load (the trivial placement
    an engine starts with gains about 0.5, a burst's 6-fold hot experts about 0.4) is
    decided on after one window: the policy's `min_windows` is waived for it, the gain is
    far beyond any window's noise; and it waits only the policy's min interval scaled by
    `gain_threshold / gain`, the time it needs to repay a plan (`sure_gate`; 0: never)."""

    def validate(self) -> None:
        for name, lo, hi in (
            ("match_distance", 0.0, 1.0),
            ("gain_threshold", 0.0, 1.0),
            ("drift_max_moved_fraction", 0.0, 1.0),
            ("drift_gain_threshold", 0.0, 1.0),
            ("forecast_fast", 0.0, 0.99),
            ("forecast_slow", 0.0, 0.99),
            ("score_decay", 0.0, 1.0),
            ("sure_gain", 0.0, 1.0),
            ("extra_slots_share", 0.0, 10.0),
        ):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and lo <= value <= hi):
                raise InputError(f"regimes {name} must be in [{lo}, {hi}], got {value!r}")
        if not isinstance(self.hedge_jumps, bool):
            raise InputError(f"regimes hedge_jumps must be a boolean, got {self.hedge_jumps!r}")
        for name in ("capacity", "known_windows", "maxmin_rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"regimes {name} must be an integer >= 1, got {value!r}")
        if self.forecast_slow <= self.forecast_fast:
            raise InputError("regimes forecast_slow must be above forecast_fast")
        for name in (
            "max_effective_windows",
            "fast_run_windows",
            "forecast_effective_windows",
            "forecast_horizon_windows",
        ):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 1):
                raise InputError(f"regimes {name} must be >= 1, got {value!r}")


# -- pure functions on loads and placements ----------------------------------------------


def shares(counts: np.ndarray) -> np.ndarray:
    """Per-layer shares of a window's counts [L, E] (rows sum to 1; a layer without load
    stays 0). Returns [L, E] float64."""
    c = np.asarray(counts, dtype=np.float64)
    total = c.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, c / np.where(total > 0, total, 1.0), 0.0)


def share_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over layers of the total-variation distance between two shares [L, E] (0..1)."""
    return float(0.5 * np.abs(a - b).sum(axis=1).mean())


def balance(phy2log: np.ndarray, load: np.ndarray, num_gpus: int) -> float:
    """Balancedness of a placement [L, P] on a load [L, E] (mean over loaded layers)."""
    per_layer = balancedness_of(np.asarray(phy2log, dtype=np.int64), load, num_gpus)
    valid = per_layer[~np.isnan(per_layer)]
    return float(valid.mean()) if valid.size else 1.0


def fit(
    load: np.ndarray,
    shape: ClusterShape,
    previous: np.ndarray | None = None,
    max_moved_fraction: float | None = None,
) -> np.ndarray:
    """The engine's best placement on `load` [L, E] (from scratch, or migration-aware
    from `previous` within the budget). Returns phy2log [L, P] int64."""
    result = compute_placement(
        load,
        shape.num_slots,
        shape.num_gpus,
        num_nodes=shape.num_nodes,
        num_groups=shape.num_groups or None,
        previous=previous,
        max_moved_fraction=max_moved_fraction,
    )
    return np.asarray(result.phy2log, dtype=np.int64)


def _compact(phy2log: np.ndarray) -> np.ndarray:
    """A placement as the library keeps it: int16 (experts < 2**15; MAX_SLOTS is 2048)."""
    return np.asarray(phy2log, dtype=np.int16)


def maxmin_placement(
    loads: np.ndarray,
    shape: ClusterShape,
    rounds: int = 4,
    previous: np.ndarray | None = None,
    max_moved_fraction: float | None = None,
) -> tuple[np.ndarray, float]:
    """A placement good for every load of `loads` [K, L, E] (shares): it maximises the
    worst balancedness over the K loads, by multiplicative weights: fit on the weighted
    mixture, weigh up the loads it serves worst, fit again; the best worst case wins.
    Redundant slots go where the loads disagree (experts hot in any of them). Each fit is
    from scratch, or migration-aware from `previous` [L, P] within `max_moved_fraction`.
    Returns (phy2log [L, P] int64, its worst balancedness)."""
    k = loads.shape[0]
    weights = np.full(k, 1.0 / k)
    best: np.ndarray | None = None
    best_worst = -1.0
    for _ in range(max(1, rounds)):
        mixture = np.tensordot(weights, loads, axes=1)
        placement = fit(mixture, shape, previous=previous, max_moved_fraction=max_moved_fraction)
        b = np.array([balance(placement, loads[i], shape.num_gpus) for i in range(k)])
        if b.min() > best_worst:
            best, best_worst = placement, float(b.min())
        weights = weights * np.exp(20.0 * (b.max() - b))
        weights /= weights.sum()
    assert best is not None
    return best, best_worst


# -- the library --------------------------------------------------------------------------


@dataclass
class Regime:
    """One recurring load: its centroid, its fit and ready placement, when it came back."""

    id: int
    total: np.ndarray  # [L, E] float32: sum of its windows' shares
    windows: int
    fit: (
        np.ndarray
    )  # [L, P] int16: from-scratch placement on the centroid (the distance's yardstick)
    fit_balance: float  # its balancedness on the centroid
    first_seen: float
    last_seen: float
    visits: int = 1  # stays: runs of consecutive windows
    ready: np.ndarray | None = None  # [L, P] int16: the best placement that served it
    fit_windows: int = 1  # windows the fit was made on
    stored: tuple[int, bool] = (0, False)  # (windows, ready) of the copy in the store

    @property
    def centroid(self) -> np.ndarray:
        """Mean shares [L, E] float64."""
        return self.total.astype(np.float64) / max(self.windows, 1)

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "windows": self.windows,
            "visits": self.visits,
            "mean_stay_windows": round(self.windows / max(self.visits, 1), 2),
            "first_seen": self.first_seen,
            "last_seen": self.last_seen,
            "fit_balancedness": round(self.fit_balance, 4),
            "ready": self.ready is not None,
        }


@dataclass
class RegimeLibrary:
    """A deployment's regimes and predictors (see the module docstring)."""

    regimes: list[Regime] = field(default_factory=list)
    next_id: int = 1
    current: int = 0  # regime of the newest window (0: none yet)
    recent: list[int] = field(default_factory=list)  # regime ids of the last windows
    jumps: list[bool] = field(default_factory=list)  # whether each of them came by a jump
    fast: np.ndarray | None = None  # the forecast's fast exponential mean [L, E] (shares)
    slow: np.ndarray | None = None  # and its slow one
    predictions: dict[str, np.ndarray] = field(default_factory=dict)  # made for the next window
    errors: dict[str, float] = field(default_factory=dict)  # running error per predictor
    windows: int = 0
    maxmin: dict[tuple[int, ...], np.ndarray] = field(default_factory=dict)
    # Slots of the plans taken: those that cleared the policy's own hysteresis, and the
    # extra ones taken only by a smaller one (RegimeConfig.extra_slots_share).
    slots_main: int = 0
    slots_extra: int = 0
    # Loads that came by a jump and were new: the regime the current one was entered from
    # (0: it was not such a load), and how many such loads went back to a known regime
    # within `fast_run_windows` windows (bursts; RegimeConfig.hedge_jumps reads it).
    came_from: int = 0
    went_back: int = 0
    # What the store holds: set when a regime is made, evicted or given a new ready
    # placement; `saved_windows` counts the windows the stored copy had.
    changed: bool = True
    saved_windows: int = 0
    evicted: list[int] = field(default_factory=list)  # ids gone since the last save
    dirty_ready: set[int] = field(default_factory=set)  # ready placement replaced since

    def save_due(self, every_windows: int = 30) -> bool:
        """Whether the store's copy is stale enough to write again: a regime was made,
        evicted or got a ready placement, or `every_windows` windows were folded."""
        return self.changed or self.windows - self.saved_windows >= every_windows

    def changes(
        self,
    ) -> tuple[
        tuple[dict[str, Any], dict[str, np.ndarray]],
        dict[int, tuple[dict[str, Any], dict[str, np.ndarray]]],
        list[int],
    ]:
        """What a save writes: the library's header (`to_record` without the regimes'
        arrays), the regimes changed since the last save (id -> record, arrays) and the
        ids evicted since; a regime's arrays are written only when they changed."""
        header, arrays = self.to_record(regime_arrays=False)
        rows = {
            r.id: _regime_record(r)
            for r in self.regimes
            if r.stored != (r.windows, r.ready is not None) or r.id in self.dirty_ready
        }
        return (header, arrays), rows, list(self.evicted)

    def mark_saved(self) -> None:
        self.changed = False
        self.saved_windows = self.windows
        self.evicted = []
        self.dirty_ready = set()
        for r in self.regimes:
            r.stored = (r.windows, r.ready is not None)

    def get(self, regime_id: int) -> Regime | None:
        for r in self.regimes:
            if r.id == regime_id:
                return r
        return None

    def summary(self) -> dict[str, Any]:
        """What `rebalancer admin regimes` shows: the library, newest first."""
        return {
            "current": self.current,
            "size": len(self.regimes),
            "windows": self.windows,
            "errors": {k: round(v, 5) for k, v in sorted(self.errors.items())},
            "recent": list(self.recent[-12:]),
            "regimes": [r.summary() for r in sorted(self.regimes, key=lambda r: -r.last_seen)],
        }

    # -- store -------------------------------------------------------------------------

    def to_record(self, regime_arrays: bool = True) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """(JSON-ready record, arrays): the whole library (`regime_arrays`), or its header
        with each regime's figures but not its arrays (the store keeps those a row each)."""
        arrays: dict[str, np.ndarray] = {}
        regimes = []
        for r in self.regimes:
            record, own = _regime_record(r)
            if regime_arrays:
                arrays.update({f"{k}{r.id}": v for k, v in own.items()})
            regimes.append(record)
        if self.fast is not None and self.slow is not None:
            arrays["fast"], arrays["slow"] = self.fast, self.slow
        record = {
            "version": 1,
            "regimes": regimes,
            "next_id": self.next_id,
            "current": self.current,
            "recent": list(self.recent),
            "jumps": list(self.jumps),
            "errors": dict(self.errors),
            "windows": self.windows,
            "slots_main": self.slots_main,
            "slots_extra": self.slots_extra,
            "came_from": self.came_from,
            "went_back": self.went_back,
        }
        return record, arrays

    @classmethod
    def from_record(cls, record: dict[str, Any], arrays: dict[str, np.ndarray]) -> RegimeLibrary:
        lib = cls(
            next_id=int(record["next_id"]),
            current=int(record["current"]),
            recent=[int(i) for i in record["recent"]],
            jumps=[bool(j) for j in record.get("jumps", [])],
            errors={str(k): float(v) for k, v in record["errors"].items()},
            windows=int(record["windows"]),
            fast=arrays.get("fast"),
            slow=arrays.get("slow"),
            changed=False,
            saved_windows=int(record["windows"]),
            slots_main=int(record.get("slots_main", 0)),
            slots_extra=int(record.get("slots_extra", 0)),
            came_from=int(record.get("came_from", 0)),
            went_back=int(record.get("went_back", 0)),
        )
        for row in record["regimes"]:
            i = int(row["id"])
            own = {k: arrays[f"{k}{i}"] for k in ("total", "fit", "ready") if f"{k}{i}" in arrays}
            lib.regimes.append(_regime_from_record(row, own))
        return lib

    @classmethod
    def from_rows(
        cls,
        header: dict[str, Any],
        arrays: dict[str, np.ndarray],
        rows: dict[int, tuple[dict[str, Any], dict[str, np.ndarray]]],
    ) -> RegimeLibrary:
        """The library from the store's header and regime rows (`changes`); the header
        lists which regimes are in it (a row it does not list is left out)."""
        lib = cls.from_record({**header, "regimes": []}, arrays)
        for row in header["regimes"]:
            stored = rows[int(row["id"])]
            lib.regimes.append(_regime_from_record(stored[0], stored[1]))
        return lib


def _regime_record(r: Regime) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """One regime as (JSON-ready record, arrays named total, fit and ready)."""
    arrays = {"total": r.total, "fit": r.fit}
    if r.ready is not None:
        arrays["ready"] = r.ready
    record = {
        "id": r.id,
        "windows": r.windows,
        "fit_balance": r.fit_balance,
        "first_seen": r.first_seen,
        "last_seen": r.last_seen,
        "visits": r.visits,
        "fit_windows": r.fit_windows,
    }
    return record, arrays


def _regime_from_record(row: dict[str, Any], arrays: dict[str, np.ndarray]) -> Regime:
    ready = arrays.get("ready")
    r = Regime(
        id=int(row["id"]),
        total=np.asarray(arrays["total"], dtype=np.float32),
        windows=int(row["windows"]),
        fit=_compact(arrays["fit"]),
        fit_balance=float(row["fit_balance"]),
        first_seen=float(row["first_seen"]),
        last_seen=float(row["last_seen"]),
        visits=int(row["visits"]),
        ready=None if ready is None else _compact(ready),
        fit_windows=int(row.get("fit_windows", 1)),
    )
    r.stored = (r.windows, r.ready is not None)
    return r


def distances(lib: RegimeLibrary, x: np.ndarray, num_gpus: int) -> np.ndarray:
    """Each regime's distance to the shares `x` [L, E]: the balancedness its fit loses on
    x against the centroid it was fitted on (>= 0). Returns [K] in library order."""
    return np.array([max(0.0, r.fit_balance - balance(r.fit, x, num_gpus)) for r in lib.regimes])


@dataclass(frozen=True)
class Observation:
    """What one window did to the library."""

    regime: int
    distance: float  # to the regime it joined (inf: a new regime)
    new: bool
    returned: bool  # a jump to a known regime other than the previous window's


def _score(lib: RegimeLibrary, x: np.ndarray, decay: float) -> None:
    """Charge each predictor the distance between its prediction and the window `x`."""
    for name, predicted in lib.predictions.items():
        err = share_distance(predicted, x)
        old = lib.errors.get(name)
        lib.errors[name] = err if old is None else decay * old + (1.0 - decay) * err


def _refit(r: Regime, shape: ClusterShape) -> None:
    """Fit the regime's centroid again once its windows have doubled since the last fit."""
    if r.windows >= 2 * r.fit_windows:
        r.fit = _compact(fit(r.centroid, shape))
        r.fit_windows = r.windows
    r.fit_balance = balance(r.fit, r.centroid, shape.num_gpus)


def observe(
    lib: RegimeLibrary,
    counts: np.ndarray,
    now: float,
    shape: ClusterShape,
    config: RegimeConfig,
    estimate: np.ndarray | None = None,
) -> Observation:
    """Fold one window of counts [L, E] into the library (in place): score the predictors
    on it, join it to the nearest regime within `match_distance` or start a regime,
    update the forecast, and make the predictions for the next window (`estimate` [L, E],
    the adaptive estimate after this window, is the third predictor)."""
    x = shares(counts)
    if float(x.sum()) <= 0.0:
        return Observation(lib.current, math.inf, False, False)
    _score(lib, x, config.score_decay)
    lib.windows += 1
    d = distances(lib, x, shape.num_gpus)
    previous = lib.current
    # The distance to the previous window's regime, before a new regime or an eviction
    # changes the library's order: a jump is a window far from it, not a drift.
    at = [i for i, old in enumerate(lib.regimes) if old.id == previous]
    jump = not at or float(d[at[0]]) > 2.0 * config.match_distance
    if d.size and float(d.min()) <= config.match_distance:
        r = lib.regimes[int(d.argmin())]
        dist = float(d.min())
        known = r.windows >= config.known_windows
        r.total = (r.total + x).astype(np.float32)
        r.windows += 1
        if r.id != previous:
            r.visits += 1
        r.last_seen = now
        _refit(r, shape)
        new = False
    else:
        if len(lib.regimes) >= config.capacity:
            evictable = [r for r in lib.regimes if r.id != previous] or lib.regimes
            victim = min(evictable, key=lambda r: (r.windows, r.last_seen))
            lib.regimes.remove(victim)
            lib.evicted.append(victim.id)
            lib.changed = True
            lib.maxmin = {k: v for k, v in lib.maxmin.items() if victim.id not in k}
        placement = fit(x, shape)
        r = Regime(
            id=lib.next_id,
            total=x.astype(np.float32),
            windows=1,
            fit=_compact(placement),
            fit_balance=balance(placement, x, shape.num_gpus),
            first_seen=now,
            last_seen=now,
        )
        lib.next_id += 1
        lib.regimes.append(r)
        lib.changed = True
        dist, known, new = math.inf, False, True
    changed = r.id != previous
    if changed:
        left = lib.get(previous)
        if (
            lib.came_from
            and not new
            and left is not None
            and left.windows <= config.fast_run_windows
        ):
            lib.went_back += 1  # a new load that did not last: a burst
        lib.came_from = previous if new and jump and previous else 0
    lib.current = r.id
    lib.recent = (lib.recent + [r.id])[-RECENT_WINDOWS:]
    lib.jumps = (lib.jumps + [bool(changed and jump)])[-RECENT_WINDOWS:]
    if (changed and jump) or lib.fast is None or lib.slow is None:
        lib.fast, lib.slow = x.copy(), x.copy()
    else:
        lib.fast = config.forecast_fast * lib.fast + (1.0 - config.forecast_fast) * x
        lib.slow = config.forecast_slow * lib.slow + (1.0 - config.forecast_slow) * x
    lib.predictions = {"regime": r.centroid, "forecast": forecast(lib, config)}
    if estimate is not None:
        lib.predictions["estimate"] = shares(estimate)
    return Observation(r.id, dist, new, changed and known and jump)


def forecast(lib: RegimeLibrary, config: RegimeConfig, horizon: float = 1.0) -> np.ndarray:
    """The forecast shares [L, E] `horizon` windows ahead: an exponential mean of decay
    f lags (f / (1 - f)) windows behind a linear drift, so the fast and the slow mean
    differ by the trend times their lag gap; the fast mean plus the trend over its lag and
    the horizon, clipped at 0 and renormalised per layer."""
    if lib.fast is None or lib.slow is None:
        raise InputError("no window observed yet: nothing to forecast")
    lag_fast = config.forecast_fast / (1.0 - config.forecast_fast)
    lag_slow = config.forecast_slow / (1.0 - config.forecast_slow)
    trend = (lib.fast - lib.slow) / (lag_slow - lag_fast)
    return shares(np.clip(lib.fast + (horizon + lag_fast) * trend, 0.0, None))


def alternating(lib: RegimeLibrary, config: RegimeConfig) -> list[int]:
    """Known regimes in play when they alternate faster than `fast_run_windows` (over
    the recent windows), else []. Only jumps count (a drifting load walks from one
    regime to its neighbour), and only regimes that came back by a jump (a burst's
    one-off regime does not)."""
    recent = lib.recent
    if len(recent) < 2 * config.fast_run_windows or len(lib.jumps) != len(recent):
        return []
    known = {r.id for r in lib.regimes if r.windows >= config.known_windows}
    entered = [i for i, jumped in zip(recent, lib.jumps, strict=True) if jumped and i in known]
    in_play = sorted({i for i in entered if entered.count(i) >= 2})
    if len(in_play) < 2 or len(recent) / (len(entered) + 1) > config.fast_run_windows:
        return []
    return in_play


# -- the decision ---------------------------------------------------------------------------


def is_extra(gain: float, noise_margin: float, policy: PolicyConfig) -> bool:
    """Whether a candidate's balancedness `gain` falls short of the policy's own hysteresis
    (`gain_threshold` plus the noise margin of the load it was measured on): a plan the
    regimes policy takes only by its smaller hysteresis."""
    return gain < policy.gain_threshold + (noise_margin if math.isfinite(noise_margin) else 1.0)


def extra_allowed(library: RegimeLibrary, slots: int, config: RegimeConfig) -> bool:
    """Whether an extra plan of `slots` keeps the extra slots within
    `RegimeConfig.extra_slots_share` of the main plans' (`RegimeLibrary.slots_main`)."""
    return library.slots_extra + slots <= config.extra_slots_share * library.slots_main


def sure_gate(
    gain: float, windows: int, policy: PolicyConfig, config: RegimeConfig
) -> PolicyConfig:
    """The gate for a candidate that gains `gain` of balancedness after `windows` windows:
    the policy's, except that a sure gain (`RegimeConfig.sure_gain`, after one window at
    least) waives `min_windows` and holds the candidate to the min interval scaled to its
    gain: the interval is the time the smallest accepted gain (`gain_threshold`) needs to
    repay a plan, and this gain repays it `gain / gain_threshold` times sooner (a burst is
    chased in the window after the last plan, not two windows late)."""
    if not (config.sure_gain > 0 and windows >= 1 and gain >= config.sure_gain):
        return policy
    if windows < policy.min_windows:
        policy = replace(policy, min_windows=1)
    if policy.gain_threshold > 0:
        scaled = policy.min_interval_seconds * policy.gain_threshold / gain
        policy = replace(policy, min_interval_seconds=min(policy.min_interval_seconds, scaled))
    return policy


def decide_regimes(
    library: RegimeLibrary,
    pending: list[tuple[np.ndarray, float]],
    estimate: np.ndarray,
    current: np.ndarray,
    shape: ClusterShape,
    policy: PolicyConfig,
    now: float,
    last_rebalance: float | None,
    windows: int,
    effective_windows: float | np.ndarray | None = None,
    config: RegimeConfig | None = None,
) -> Decision:
    """The regimes policy's decision: fold the windows `pending` ([(counts [L, E], time)],
    those since the last decision) into `library`, pick the load to decide on and the
    candidates, and run the cost gate. `estimate` [L, E], `current` [L, P] and the rest as
    for `decide`. Returns the Decision; `Decision.state` is the library (updated in place)."""
    config = config or RegimeConfig()
    config.validate()
    estimate = np.asarray(estimate, dtype=np.float64)
    current = np.asarray(current)
    observation = None
    for counts, seen in pending:
        observation = observe(library, counts, seen, shape, config, estimate)
    if float(estimate.sum()) <= 0.0 or library.current == 0:
        return replace(no_load_decision(windows, now), state=library)
    ew: float | np.ndarray = windows if effective_windows is None else effective_windows
    tokens = estimate.sum(axis=1, keepdims=True)  # per-layer scale of one window
    regime = library.get(library.current)
    assert regime is not None
    # Keep the regime's ready placement: the best that served it so far.
    centroid = regime.centroid
    if regime.ready is None or balance(current, centroid, shape.num_gpus) > balance(
        regime.ready, centroid, shape.num_gpus
    ):
        regime.ready = _compact(current)
        library.dirty_ready.add(regime.id)
        library.changed = True
    # 1. The load: a recognised return, fast alternation, or the best-scored predictor.
    loads: dict[str, tuple[np.ndarray, float | np.ndarray]] = {
        "estimate": (estimate, ew),
        "forecast": (
            forecast(library, config, config.forecast_horizon_windows) * tokens,
            config.forecast_effective_windows,
        ),
        "regime": (centroid * tokens, min(float(regime.windows), config.max_effective_windows)),
    }
    in_play = alternating(library, config)
    ready: np.ndarray | None = None
    hedged: np.ndarray | None = None  # the fit candidate's stand-in on a jump (hedge_jumps)
    worth: float | np.ndarray
    if in_play:
        playing = sorted((r for r in library.regimes if r.id in in_play), key=lambda r: r.id)
        mix = np.stack([r.centroid for r in playing])
        freq = np.array([library.recent.count(r.id) for r in playing], dtype=np.float64)
        key = tuple(r.id for r in playing)
        if key not in library.maxmin:
            library.maxmin[key] = maxmin_placement(mix, shape, config.maxmin_rounds)[0]
        ready = library.maxmin[key]
        load_name = "alternation"
        load = np.tensordot(freq / freq.sum(), mix, axes=1) * tokens
        worth = min(float(sum(r.windows for r in playing)), config.max_effective_windows)
        stay = len(library.recent) / (1 + sum(1 for j in library.jumps if j))
        why = (
            f"regimes {', '.join(map(str, in_play))} alternate every {stay:.1f} windows: "
            "their max-min placement"
        )
    elif observation is not None and observation.returned:
        load_name, (load, worth) = "regime", loads["regime"]
        ready = regime.ready if not np.array_equal(regime.ready, current) else None
        why = (
            f"regime {regime.id} recognised (distance {observation.distance:.3f}, seen "
            f"{regime.windows} windows in {regime.visits} stays): its centroid and ready placement"
        )
    elif observation is not None and observation.new and library.jumps and library.jumps[-1]:
        # A jump to a load never seen: the forecast restarted on the new window, while
        # the estimate still holds the old load.
        load_name, (load, worth) = "forecast", loads["forecast"]
        why = (
            f"a jump to a new regime {regime.id} "
            f"(no regime within {config.match_distance:g}): its window"
        )
        left = library.get(library.came_from)
        if config.hedge_jumps and library.went_back and left is not None:
            hedge = np.stack([shares(load), left.centroid])
            hedged, worst = maxmin_placement(
                hedge, shape, config.maxmin_rounds, current, policy.max_moved_fraction
            )
            why += (
                f", hedged with regime {left.id} it left (worst balancedness {worst:.3f} "
                "over the two)"
            )
    else:
        scored = {k: library.errors.get(k, math.inf) for k in loads}
        if regime.windows < config.known_windows:
            scored["regime"] = math.inf  # too few windows to be worth more than the estimate
        load_name = min(PREDICTORS, key=lambda k: scored[k])
        load, worth = loads[load_name]
        errs = ", ".join(f"{k} {v:.4f}" for k, v in scored.items() if math.isfinite(v))
        why = f"{load_name} predicted the last windows best ({errs or 'no score yet'})"
        if load_name == "regime":
            why = f"regime {regime.id} ({regime.windows} windows): " + why
    # 2. The candidates, each through the gate on that load.
    # A known regime's centroid is worth many windows: a smaller hysteresis (its noise
    # margin still counts). The estimate and the forecast keep the policy's.
    gate_policy = policy
    if load_name in ("regime", "alternation") and float(np.min(worth)) >= config.known_windows:
        gate_policy = replace(
            policy, gain_threshold=min(policy.gain_threshold, config.gain_threshold)
        )
    b_current = predicted_balance(current, load, shape)
    bound = float(lower_bound_balancedness(load, shape.num_slots, shape.num_gpus, shape.num_nodes))
    candidates: list[tuple[str, np.ndarray, PolicyConfig]] = [
        (
            "fit",
            fit(load, shape, previous=current, max_moved_fraction=policy.max_moved_fraction),
            gate_policy,
        )
        if hedged is None
        else ("hedge", hedged, gate_policy)
    ]
    if ready is not None and not np.array_equal(ready, current):
        candidates.append(("ready", np.asarray(ready, dtype=np.int64), gate_policy))
    if (
        config.drift_max_moved_fraction
        and ready is None
        and hedged is None
        and load_name != "alternation"
    ):
        # Drift: a small move of the slots that pay most, held to the smaller hysteresis.
        budget = min(policy.max_moved_fraction, config.drift_max_moved_fraction)
        small = replace(
            policy, gain_threshold=min(policy.gain_threshold, config.drift_gain_threshold)
        )
        candidates.append(
            ("trim", fit(load, shape, previous=current, max_moved_fraction=budget), small)
        )
    best: Decision | None = None
    best_net = -math.inf
    best_extra = False
    for name, candidate, gate in candidates:
        ev = evaluate_candidate(
            load, current, candidate, shape, gate, worth, current_balance=b_current, bound=bound
        )
        gate = sure_gate(ev.b_candidate - ev.b_current, windows, gate, config)
        extra = is_extra(ev.b_candidate - ev.b_current, ev.noise_margin, policy)
        decision = gate_decision(
            ev, gate, now, last_rebalance, windows, load=f"{load_name} ({name} placement): {why}"
        )
        if decision.take and extra and not extra_allowed(library, ev.slots_moved, config):
            decision = replace(
                decision,
                outcome="skip_gain",
                gate="skip_gain",
                candidate=None,
                reason=(
                    f"gain below the policy's threshold {policy.gain_threshold:g} and the extra "
                    f"slots spent ({library.slots_extra} of {config.extra_slots_share:g} x "
                    f"{library.slots_main}): {decision.reason}"
                ),
            )
        net = ev.gain - ev.cost.seconds
        if (
            best is None
            or (decision.take and not best.take)
            or (decision.take == best.take and net > best_net)
        ):
            best, best_net, best_extra = decision, net, extra
    assert best is not None
    if best.take:
        if best_extra:
            library.slots_extra += best.slots_moved
        else:
            library.slots_main += best.slots_moved
    return replace(best, state=library)
