"""The worker extension attaches to the EPLB step of the model runner in use, or says
why not: no vLLM needed (the extension imports vLLM only inside what vLLM calls)."""

from __future__ import annotations

import logging
import types

import pytest

from rebalancer.wire.link import Link
from worker_hooks.engines.vllm import plugin
from worker_hooks.engines.vllm.config import VLLMAdapterConfig

CONFIG = VLLMAdapterConfig(Link("127.0.0.1:1", deployment="vllm"))


@pytest.fixture(autouse=True)
def fresh_status(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugin, "_status", plugin.AttachStatus())
    monkeypatch.setattr(plugin, "_adapter", None)


def test_a_runner_without_an_eplb_step_is_reported_loudly(caplog: pytest.LogCaptureFixture) -> None:
    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=None))
    with caplog.at_level(logging.WARNING, logger="worker_hooks.engines.vllm"):
        assert plugin.attach(worker, CONFIG) is False
    status = plugin.attach_status()
    assert status["attached"] is False and status["failures"] == 1
    assert "neither `eplb.step` (Model Runner V2) nor `eplb_step`" in status["reason"]
    assert any(
        r.levelno == logging.WARNING and "rebalancer inert" in r.getMessage()
        for r in caplog.records
    )


def test_v2_and_v1_entries_are_found() -> None:
    calls: list[tuple[bool, bool]] = []

    class Controller:  # the shape of V2's EPLBController: step and state
        state = None

        def step(self, is_dummy: bool = False, is_profile: bool = False) -> None:
            calls.append((is_dummy, is_profile))

    v2 = types.SimpleNamespace(model_runner=types.SimpleNamespace(eplb=Controller()))
    assert plugin.attach(v2, CONFIG) and plugin.attach_status()["runner"] == "v2"
    v2.model_runner.eplb.step(is_dummy=True)  # wrapped, still vLLM's step underneath
    assert calls == [(True, False)]
    v1 = types.SimpleNamespace(
        model_runner=types.SimpleNamespace(eplb_step=lambda **kw: None, eplb_state=None)
    )
    assert plugin.attach(v1, CONFIG) and plugin.attach_status()["runner"] == "v1"


def test_the_adapter_waits_while_vllms_map_has_empty_slots(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Elastic EP grew the slots (`reconfigure_physical_expert_slots` fills them with -1):
    no adapter is built on a map some slots of which hold no expert, vLLM's default policy
    answers until its rearrangement fills them, and the adapter starts after that."""

    model_state = _model_state("m", [[0, 1, -1, -1]])
    state = types.SimpleNamespace(model_states={"m": model_state})
    with caplog.at_level(logging.INFO, logger="worker_hooks.engines.vllm"):
        assert plugin._build_adapter(CONFIG, state) is None
        assert plugin._build_adapter(CONFIG, state) is None
    assert plugin.attach_status()["waiting"] is True
    assert (
        sum("2 slots of vLLM's map hold no expert yet" in r.getMessage() for r in caplog.records)
        == 1
    )


def _model_state(name: str, phy2log: list[list[int]], experts: int = 2) -> types.SimpleNamespace:
    """What the layer set reads of vLLM's `EplbModelState` (stand-in: no vLLM here)."""
    import torch

    return types.SimpleNamespace(
        model_name=name,
        physical_to_logical_map=torch.tensor(phy2log),
        model=types.SimpleNamespace(num_logical_experts=experts),
        rebalanced=False,
    )


def test_the_layer_set_is_the_main_model_then_its_drafters_of_the_same_expert_shape() -> None:
    """vLLM registers a drafter first, the main model last; the layer set puts the main
    model's rows first, keeps a drafter with the main model's experts and slots, and
    leaves out one of another shape. Policy calls come in registration order: the
    drafter's opens the rearrangement (the agreement runs there), the main model's
    follows; a map shape only one model has names its model."""
    import torch

    from worker_hooks.engines.vllm.layer_set import LayerSet

    draft = _model_state("m (draft)", [[0, 1, 1, 0]])
    other = _model_state("n (draft)", [[0, 1, 2]], experts=3)
    main = _model_state("m", [[0, 1, 0, 1], [1, 0, 1, 0]])
    state = types.SimpleNamespace(model_states={"m (draft)": draft, "n (draft)": other, "m": main})
    layers = LayerSet(state)
    assert layers.models[0] is main and layers.models[1] is draft and len(layers.models) == 2
    assert layers.rows == [slice(0, 2), slice(2, 3)] and layers.left_out() == ["n (draft)"]
    assert layers.read_map().tolist() == [[0, 1, 0, 1], [1, 0, 1, 0], [0, 1, 1, 0]]
    assert layers.index_of(other) is None and layers.index_of(draft) == 1
    assert layers.opens_rearrangement(1) and not layers.opens_rearrangement(0)
    # One rearrangement: the drafter, the model of another shape, the main model.
    asked = [
        layers.model_of_call(torch.zeros(1, 4)),
        layers.model_of_call(torch.zeros(1, 3)),
        layers.model_of_call(torch.zeros(2, 4)),
    ]
    assert asked[0] is draft and asked[1] is other and asked[2] is main
    main.rebalanced = True
    assert layers.rebalancing()


def test_expert_groups_are_registered_when_vllm_keeps_several() -> None:
    from worker_hooks.engines.vllm.layer_set import expert_groups

    def model(groups: int | None, experts: int = 256) -> object:
        return types.SimpleNamespace(num_expert_groups=groups, num_logical_experts=experts)

    assert expert_groups(model(8)) == 8  # DeepSeek-V3: 256 experts in 8 groups
    assert [expert_groups(model(g)) for g in (1, 0, None)] == [0, 0, 0]  # none
    assert expert_groups(model(3)) == 0  # groups that do not divide the experts: not a layout
