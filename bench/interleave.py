"""Same-run baselines for the GPU benches: variants measured in alternating rounds in one
process, and each figure given as the median of its per-round values with their spread.

A figure measured once per variant in separate phases moves with whatever drifts between
the phases (clocks, the routing a phase happened to draw, the host's load): on one H200
the stock transformers step read 34.0, 39.6 and 37.5 ms in three runs, and an overhead
computed across two such phases read +3.1 %, -15.7 % and +1.9 %. Here every round runs
each variant once, back to back, on the same inputs, so a round's ratio sees the same
drift on both sides; the median over rounds is the figure and the rounds' range and
interquartile range are its spread. Pure Python: no torch, testable without a GPU.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


def round_orders(variants: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of the variants in each round: as given in even rounds, reversed in odd
    ones (A B, B A, A B, ...), so being first in a round (right after the other variant's
    work) or last falls on every variant equally often."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    if not variants:
        raise ValueError("no variant to measure")
    if len(set(variants)) != len(variants):
        raise ValueError(f"variant names repeat: {list(variants)}")
    forward = list(variants)
    return [forward if r % 2 == 0 else forward[::-1] for r in range(rounds)]


def run_interleaved(
    measure: Mapping[str, Callable[[int], T]], rounds: int, warmup_rounds: int = 1
) -> dict[str, list[T]]:
    """Call `measure[name](round)` for every variant in every round, in `round_orders`;
    the first `warmup_rounds` rounds run (allocator, caches, clocks) and are dropped.
    Returns each variant's `rounds` results, round i at index i (paired by round)."""
    if warmup_rounds < 0:
        raise ValueError(f"warmup_rounds must be >= 0, got {warmup_rounds}")
    names = list(measure)
    out: dict[str, list[T]] = {name: [] for name in names}
    for r, order in enumerate(round_orders(names, warmup_rounds + rounds)):
        for name in order:
            value = measure[name](r - warmup_rounds)  # warm-up rounds get negative indices
            if r >= warmup_rounds:
                out[name].append(value)
    return out


@dataclass(frozen=True)
class Spread:
    """The median of per-round values with their quartiles and range."""

    median: float
    q1: float
    q3: float
    min: float
    max: float
    n: int

    def as_dict(self, digits: int = 4) -> dict[str, float | int]:
        return {
            "median": round(self.median, digits),
            "q1": round(self.q1, digits),
            "q3": round(self.q3, digits),
            "min": round(self.min, digits),
            "max": round(self.max, digits),
            "n": self.n,
        }

    def text(self, unit: str = "", digits: int = 2, signed: bool = False) -> str:
        """`+0.41 % (IQR +0.20..+0.62, range -0.31..+1.10, 20 rounds)`."""
        f = f"{{:+.{digits}f}}" if signed else f"{{:.{digits}f}}"
        u = f" {unit}" if unit else ""
        return (
            f"{f.format(self.median)}{u} (IQR {f.format(self.q1)}..{f.format(self.q3)}, "
            f"range {f.format(self.min)}..{f.format(self.max)}, {self.n} rounds)"
        )


def spread(values: Sequence[float]) -> Spread:
    """Median, quartiles (inclusive method: for n = 1 all equal the value) and range."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("no values to summarize")
    if len(xs) == 1:
        q1 = q3 = xs[0]
    else:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return Spread(statistics.median(xs), q1, q3, min(xs), max(xs), len(xs))


def _paired(base: Sequence[float], other: Sequence[float]) -> list[tuple[float, float]]:
    if len(base) != len(other):
        raise ValueError(f"rounds differ: {len(base)} baseline values, {len(other)} of the variant")
    if not base:
        raise ValueError("no rounds")
    bad = [b for b in base if not b > 0]
    if bad:
        raise ValueError(f"baseline values must be positive, got {bad[0]}")
    return list(zip(base, other, strict=True))


def overhead_pct(base: Sequence[float], variant: Sequence[float]) -> Spread:
    """Per-round `100 * (variant / base - 1)`: how much slower the variant is than the
    baseline of its own round."""
    return spread([100.0 * (v / b - 1.0) for b, v in _paired(base, variant)])


def share_pct(base: Sequence[float], part: Sequence[float]) -> Spread:
    """Per-round `100 * part / base`: a piece of work (timed alone) as a share of the
    baseline of its own round."""
    return spread([100.0 * p / b for b, p in _paired(base, part)])
