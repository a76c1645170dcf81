"""The GPU benches' host-side logic, on CPU: the transformers bench alternates the stock
model and the adapter by swapping modules in place, both replaying the same routings in a
round; its CPU smoke run gives every figure with its spread, and the stock variant still
serves the stock model after the adapter was attached beside it. The GPU paths run on a
GPU only (bench.gpu_hooks' graphs, the transformers bench's graphed blocks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from bench.gpu_hooks import figure_line, jsonable  # noqa: E402
from bench.gpu_transformers import BenchConfig, install, interleaved_phase, swap_set  # noqa: E402
from bench.interleave import spread  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


class Tagged(nn.Module):
    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag


def toy_model() -> nn.Module:
    layer = nn.Module()
    layer.mlp = Tagged("bare")
    model = nn.Module()
    model.layers = nn.ModuleList([layer, nn.Module()])
    model.layers[1].mlp = Tagged("bare")
    return model


def test_a_swap_set_puts_each_module_at_its_path() -> None:
    model = toy_model()
    stock = swap_set(model, {"layers.0.mlp": Tagged("stock0"), "layers.1.mlp": Tagged("stock1")})
    adapter = swap_set(
        model, {"layers.0.mlp": Tagged("adapter0"), "layers.1.mlp": Tagged("adapter1")}
    )
    install(adapter)
    assert [m.mlp.tag for m in model.layers] == ["adapter0", "adapter1"]
    install(stock)
    assert [m.mlp.tag for m in model.layers] == ["stock0", "stock1"]
    with pytest.raises(AttributeError):
        swap_set(model, {"layers.0.nothing.mlp": Tagged("x")})


def test_variants_alternate_with_their_own_modules_on_the_same_routings() -> None:
    model = toy_model()
    served: list[tuple[str, str, int]] = []  # (variant, module installed, routing index)

    def step(variant: str):  # type: ignore[no-untyped-def]
        return lambda i: served.append((variant, model.layers[0].mlp.tag, i))

    variants = {
        "stock": (swap_set(model, {"layers.0.mlp": Tagged("stock")}), step("stock")),
        "adapter": (swap_set(model, {"layers.0.mlp": Tagged("adapter")}), step("adapter")),
    }
    cfg = BenchConfig(device="cpu", steps=5, block_steps=2)  # 3 rounds of 2 (whole blocks)
    times = interleaved_phase(variants, cfg, torch.device("cpu"))
    assert {k: [len(r) for r in v] for k, v in times.items()} == {
        "stock": [2, 2, 2],
        "adapter": [2, 2, 2],
    }
    # every step ran on its own variant's modules
    assert all(variant == tag for variant, tag, _ in served)
    # warm-up round, then A B / B A; one untimed step after each switch
    order = [v for v, _, _ in served]
    assert (
        order
        == ["stock"] * 3
        + ["adapter"] * 3
        + ["adapter"] * 3
        + ["stock"] * 3
        + ["stock"] * 3
        + ["adapter"] * 3
        + ["adapter"] * 3
        + ["stock"] * 3
    )
    # within a round both variants replay the same routings (untimed switch step first)
    for variant in ("stock", "adapter"):
        assert [i for v, _, i in served if v == variant] == [-3, -2, -1, -1, 0, 1, 1, 2, 3, 3, 4, 5]


def test_hook_bench_prints_spreads_as_text_and_json() -> None:
    figures = {"dispatch_load_ms": 0.275, "dispatch_load_pct_of_block": spread([0.9, 1.0, 1.1])}
    assert jsonable(figures) == {
        "dispatch_load_ms": 0.275,
        "dispatch_load_pct_of_block": {
            "median": 1.0,
            "q1": 0.95,
            "q3": 1.05,
            "min": 0.9,
            "max": 1.1,
            "n": 3,
        },
    }
    line = figure_line(
        "dispatch", "dispatch_load_pct_of_block", figures["dispatch_load_pct_of_block"]
    )
    assert line.endswith("1.000 % (IQR 0.950..1.050, range 0.900..1.100, 3 rounds)")


def test_transformers_bench_on_cpu_gives_interleaved_figures_and_keeps_the_stock_model(
    tmp_path: Path,
) -> None:
    """The whole bench at tiny shapes (real embedded controller on loopback, one rank);
    it leaves no folder behind (its store and rendezvous live in one it removes)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu_transformers",
            "--device",
            "cpu",
            "--small",
            "--steps",
            "4",
            "--block-steps",
            "2",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,  # the bench waits for its plan up to 120 s
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert list(tmp_path.glob("bench-tf-*")) == []
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["rounds"] == 2
    for key in (
        "hook_overhead_pct_spread",
        "after_overhead_pct_spread",
        "round_ms_unwrapped",
        "round_ms_before",
    ):
        assert out[key]["n"] == 2 and out[key]["min"] <= out[key]["median"] <= out[key]["max"], key
    # The spread is printed to 3 places, the figure to 2: rounding twice may differ by one.
    assert abs(out["hook_overhead_pct"] - out["hook_overhead_pct_spread"]["median"]) <= 0.0051
    # the stock variant served the stock model to the end, beside the adapter
    assert out["logit_diff_stock_at_end_vs_start"] == 0.0
    assert out["logit_diff_wrapped_vs_stock"] < 1e-4 * out["logit_scale"]
    assert out["version"] >= 1 and out["hook_plan_slots_moved"] > 0
    assert "hook overhead" in proc.stdout and "rounds" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--block-steps", "0"], "--block-steps must be at least 1"),
        (["--layers", "0"], "--layers must be at least 1"),
        (["--tokens", "-5"], "--tokens must be at least 1"),
    ],
)
def test_transformers_bench_refuses_empty_phases_in_one_line(args: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_transformers", "--device", "cpu", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
