"""The worker extension attaches to the EPLB step of the model runner in use, or says
why not: no vLLM needed (the extension imports vLLM only inside what vLLM calls)."""

from __future__ import annotations

import logging
import types

import pytest

from worker_hooks.engines.vllm import plugin
from worker_hooks.engines.vllm.config import VLLMAdapterConfig

CONFIG = VLLMAdapterConfig(address="127.0.0.1:1")


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
    assert any(r.levelno == logging.WARNING and "rebalancer inert" in r.getMessage() for r in caplog.records)


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
    v1 = types.SimpleNamespace(model_runner=types.SimpleNamespace(eplb_step=lambda **kw: None, eplb_state=None))
    assert plugin.attach(v1, CONFIG) and plugin.attach_status()["runner"] == "v1"


def test_the_adapter_waits_while_vllms_map_has_empty_slots(caplog: pytest.LogCaptureFixture) -> None:
    """Elastic EP grew the slots (`reconfigure_physical_expert_slots` fills them with -1):
    no adapter is built on a map some slots of which hold no expert, vLLM's default policy
    answers until its rearrangement fills them, and the adapter starts after that."""
    import torch

    model_state = types.SimpleNamespace(model_name="m", physical_to_logical_map=torch.tensor([[0, 1, -1, -1]]))
    state = types.SimpleNamespace(model_states={"m": model_state})
    with caplog.at_level(logging.INFO, logger="worker_hooks.engines.vllm"):
        assert plugin._build_adapter(CONFIG, state) is None
        assert plugin._build_adapter(CONFIG, state) is None
    assert plugin.attach_status()["waiting"] is True
    assert sum("2 slots of vLLM's map hold no expert yet" in r.getMessage() for r in caplog.records) == 1


def test_expert_groups_are_registered_when_vllm_keeps_several() -> None:
    from worker_hooks.engines.vllm.adapter import expert_groups

    def model(groups: int | None, experts: int = 256) -> object:
        return types.SimpleNamespace(num_expert_groups=groups, num_logical_experts=experts)

    assert expert_groups(model(8)) == 8  # DeepSeek-V3: 256 experts in 8 groups
    assert [expert_groups(model(g)) for g in (1, 0, None)] == [0, 0, 0]  # none
    assert expert_groups(model(3)) == 0  # groups that do not divide the experts: not a layout
