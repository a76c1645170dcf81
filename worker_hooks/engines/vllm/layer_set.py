"""Which of vLLM's EPLB models a deployment's layers are, and which model a policy call is for.

vLLM registers every MoE model of the engine with one `EplbState` (a drafter such as
DeepSeek MTP first, named "<model> (draft)", then the main model) and calls the policy
once per model at each rearrangement, in that order. The adapter balances them as one
deployment's layer set: the main model's MoE layers first (rows `0..L-1`, its own layer
numbers), then every drafter whose experts have the main model's shape (as many logical
experts, as many slots), in registration order. A model of another expert shape stays
outside the set: vLLM's own default policy answers for it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

DRAFT_SUFFIX = " (draft)"  # vLLM's eplb_draft_model_name: "<model> (draft)"


def main_model_state(eplb_state: Any) -> Any:
    """The main model's `EplbModelState`: the last one registered whose name is not a
    drafter's (both of vLLM's runners register a drafter first, the main model last)."""
    states = list(eplb_state.model_states.values())
    main = [s for s in states if not str(getattr(s, "model_name", "")).endswith(DRAFT_SUFFIX)]
    return (main or states)[-1]


def expert_groups(model: Any) -> int:
    """The expert groups vLLM's hierarchical policy keeps (`num_expert_groups`), as the
    shape registers them: 0 (none) unless there are several and they divide the experts."""
    groups = int(getattr(model, "num_expert_groups", 0) or 0)
    return groups if groups > 1 and int(model.num_logical_experts) % groups == 0 else 0


class LayerSet:
    """The models of one `EplbState` the adapter balances (`models`, main first) and each
    one's rows of the set's `[L, P]` map (`rows`)."""

    def __init__(self, eplb_state: Any) -> None:
        self.eplb_state = eplb_state
        main = main_model_state(eplb_state)
        slots, experts = main.physical_to_logical_map.shape[1], int(main.model.num_logical_experts)
        self.models = [main] + [
            s
            for s in eplb_state.model_states.values()
            if s is not main
            and s.physical_to_logical_map.shape[1] == slots
            and int(s.model.num_logical_experts) == experts
        ]
        bounds = np.cumsum([0] + [int(m.physical_to_logical_map.shape[0]) for m in self.models])
        self.rows = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        self._calls = 0  # policy calls seen: which model is asked next

    def index_of(self, model: Any) -> int | None:
        """`model`'s place in the set (by identity: vLLM's model states are dataclasses
        of tensors), or None when the set leaves it out."""
        return next((i for i, m in enumerate(self.models) if m is model), None)

    def left_out(self) -> list[str]:
        """The names of the models outside the set."""
        return [
            str(getattr(m, "model_name", "?"))
            for m in self.eplb_state.model_states.values()
            if self.index_of(m) is None
        ]

    def describe(self) -> str:
        return ", ".join(
            f"{getattr(m, 'model_name', '?')} (layers {r.start}-{r.stop - 1})"
            for m, r in zip(self.models, self.rows, strict=True)
        )

    def read_map(self) -> np.ndarray:
        """The set's map `[L, P]` as vLLM holds it now (a device read per model)."""
        return np.concatenate(
            [m.physical_to_logical_map.cpu().numpy().astype(np.int64) for m in self.models]
        )

    def empty_slots(self) -> int:
        """Slots of the set's maps that hold no expert (-1: elastic EP grew the slots, and
        vLLM's own rearrangement has not filled them yet)."""
        return sum(int((m.physical_to_logical_map < 0).sum()) for m in self.models)

    def window_rows(self, index: list[int]) -> torch.Tensor:
        """The set's `[L, P]` int64 sum of rows `index` of vLLM's load windows (one model,
        the usual case: its sum as is, no concatenated copy on the serving thread)."""
        sums = [m.expert_load_window[index].sum(dim=0, dtype=torch.int64) for m in self.models]
        return sums[0] if len(sums) == 1 else torch.cat(sums)

    def rebalancing(self) -> bool:
        """Whether vLLM's rearrangement still runs for a model of the set (async mode)."""
        return any(bool(m.rebalanced) for m in self.models)

    def model_of_call(self, old_map: torch.Tensor) -> Any:
        """The model this policy call is for. vLLM asks for every model of its `EplbState`
        once per rearrangement, in registration order (sync: inside `rearrange`; async:
        the worker thread, each model in turn), so the k-th call is for model k modulo
        their number; a map shape that only one model has settles it (and re-aligns the
        count)."""
        states = list(self.eplb_state.model_states.values())
        index = self._calls % len(states)
        fits = [
            i
            for i, s in enumerate(states)
            if tuple(s.physical_to_logical_map.shape) == tuple(old_map.shape)
        ]
        if len(fits) == 1:
            index = fits[0]
        self._calls = index + 1
        return states[index]

    def opens_rearrangement(self, index: int) -> bool:
        """Whether model `index` is the set's first model vLLM asks for in a rearrangement
        (registration order): the agreement runs at its call, once for the set."""
        first = next(
            m for m in self.eplb_state.model_states.values() if self.index_of(m) is not None
        )
        return first is self.models[index]
