"""The same-run baseline of the GPU benches (bench/interleave.py): variants alternate
round by round, every figure is the median of per-round ratios with its spread."""

from __future__ import annotations

import itertools

import pytest

from bench.interleave import Spread, overhead_pct, round_orders, run_interleaved, share_pct, spread


def test_rounds_alternate_the_order_so_no_variant_is_always_first() -> None:
    assert round_orders(["stock", "adapter"], 4) == [
        ["stock", "adapter"],
        ["adapter", "stock"],
        ["stock", "adapter"],
        ["adapter", "stock"],
    ]
    orders = round_orders(["a", "b", "c"], 2)
    assert orders == [["a", "b", "c"], ["c", "b", "a"]]


@pytest.mark.parametrize(
    ("variants", "rounds", "message"),
    [
        (["a", "b"], 0, "rounds must be at least 1"),
        ([], 3, "no variant"),
        (["a", "a"], 3, "repeat"),
    ],
)
def test_bad_round_plans_are_refused_with_the_reason(
    variants: list[str], rounds: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        round_orders(variants, rounds)


def test_warmup_rounds_run_first_and_are_dropped_and_rounds_stay_paired() -> None:
    calls: list[tuple[str, int]] = []

    def measure(name: str):  # type: ignore[no-untyped-def]
        def block(r: int) -> str:
            calls.append((name, r))
            return f"{name}{r}"

        return block

    out = run_interleaved({"a": measure("a"), "b": measure("b")}, rounds=3, warmup_rounds=1)
    # warm-up round -1 first, then a b / b a alternation over the timed rounds
    assert calls == [
        ("a", -1),
        ("b", -1),
        ("b", 0),
        ("a", 0),
        ("a", 1),
        ("b", 1),
        ("b", 2),
        ("a", 2),
    ]
    assert out == {"a": ["a0", "a1", "a2"], "b": ["b0", "b1", "b2"]}
    with pytest.raises(ValueError, match="warmup_rounds"):
        run_interleaved({"a": measure("a")}, rounds=1, warmup_rounds=-1)


def test_interleaving_cancels_a_drift_that_fakes_an_overhead_between_phases() -> None:
    """The failure seen on an H200 (stock 34.0-39.6 ms from run to run, overhead +3.1 %,
    -15.7 %, +1.9 %): a machine that slows down while the bench runs. Measured in two
    phases (all baseline steps, then all variant steps), a 1 % overhead reads as ~+19 %;
    interleaved, every round's ratio sees the same drift on both sides."""
    clock = itertools.count()
    true_overhead = 1.01

    def on_drifting_machine(work: float):  # type: ignore[no-untyped-def]
        # each call is 0.5 % slower than the one before (clocks, heat, a neighbour's load)
        return lambda _round: work * (1 + 0.005 * next(clock))

    stock, adapter = on_drifting_machine(1.0), on_drifting_machine(true_overhead)
    phases_base = [stock(i) for i in range(20)]
    phases_variant = [adapter(i) for i in range(20)]
    assert overhead_pct(phases_base, phases_variant).median > 10  # the phase artefact

    clock = itertools.count()
    stock, adapter = on_drifting_machine(1.0), on_drifting_machine(true_overhead)
    times = run_interleaved({"stock": stock, "adapter": adapter}, rounds=20, warmup_rounds=1)
    over = overhead_pct(times["stock"], times["adapter"])
    assert over.median == pytest.approx(1.0, abs=0.05)
    # the order alternates, so the drift inside a round splits both ways around the truth
    assert over.min < 1.0 < over.max


def test_spread_gives_median_quartiles_and_range() -> None:
    s = spread([5.0, 1.0, 3.0, 2.0, 4.0])
    assert s == Spread(median=3.0, q1=2.0, q3=4.0, min=1.0, max=5.0, n=5)
    assert spread([7.0]) == Spread(7.0, 7.0, 7.0, 7.0, 7.0, 1)
    assert s.as_dict(1) == {"median": 3.0, "q1": 2.0, "q3": 4.0, "min": 1.0, "max": 5.0, "n": 5}
    assert (
        s.text("%", digits=1, signed=True) == "+3.0 % (IQR +2.0..+4.0, range +1.0..+5.0, 5 rounds)"
    )
    with pytest.raises(ValueError, match="no values"):
        spread([])


def test_overhead_and_share_are_per_round_ratios() -> None:
    base = [10.0, 20.0, 10.0]
    assert overhead_pct(base, [10.1, 20.2, 10.3]).median == pytest.approx(1.0)
    assert overhead_pct(base, [10.1, 20.2, 10.3]).max == pytest.approx(3.0)
    assert share_pct(base, [0.1, 0.1, 0.2]).median == pytest.approx(1.0)
    assert share_pct(base, [0.1, 0.1, 0.2]).min == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("base", "other", "message"),
    [
        ([1.0, 2.0], [1.0], "rounds differ"),
        ([], [], "no rounds"),
        ([1.0, 0.0], [1.0, 1.0], "must be positive"),
    ],
)
def test_unpaired_or_empty_rounds_are_refused(
    base: list[float], other: list[float], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        overhead_pct(base, other)
