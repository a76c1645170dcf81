"""The hook's jobs apart: the agent (and the plan driver it calls) never reach the hook
object; they know the plan handlers and the served placement only."""

from __future__ import annotations

import gc
import types

import torch

from rebalancer.placement import trivial_placement
from rebalancer.wire.shape import ClusterShape
from worker_hooks.hook import HookConfig, Link, RebalanceHook
from worker_hooks.plans import PlanDriver

L, E, P, G = 2, 4, 8, 2


def reachable_from(root: object) -> list[object]:
    """Every object `root` refers to, transitively, short of classes, modules and module
    globals (what any function reaches through its `__globals__`)."""
    seen: set[int] = set()
    found: list[object] = []
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType)):
            continue
        if isinstance(obj, dict) and "__builtins__" in obj:
            continue
        seen.add(id(obj))
        found.append(obj)
        stack.extend(gc.get_referents(obj))
    return found


def test_the_agent_reaches_the_plan_driver_not_the_hook() -> None:
    """The hook and its agent held each other (the hook was the agent's PlanHandlers and
    its version callback a closure over the hook)."""
    config = HookConfig(
        link=Link("127.0.0.1:1", deployment="d"),
        rank=0,
        shape=ClusterShape(num_layers=L, num_logical=E, num_slots=P, num_gpus=G, expert_bytes=0),
    )
    hook = RebalanceHook(
        config, trivial_placement(L, E, P, G), {"w": torch.zeros(L, P // G, 1)}, None, None
    )
    assert isinstance(hook.agent.handlers, PlanDriver)
    assert hook.plans is hook.agent.handlers
    reached = {id(obj) for obj in reachable_from(hook.agent)}
    assert id(hook.plans) in reached and id(hook.served) in reached  # what it needs
    assert id(hook) not in reached
