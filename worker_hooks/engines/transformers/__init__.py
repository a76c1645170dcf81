"""Hugging Face transformers MoE models served with expert parallelism through `worker_hooks`.

`attach(model, AdapterConfig(Link(...), ...))` (worker_hooks/engines/transformers/adapter.py) swaps
the experts of every MoE block for slot-aware ones driven by a `RebalanceHook`; `families` builds
tiny random-weight models of the supported families for tests and benches. transformers itself
is imported only by `families`, when a model is built.
"""

from worker_hooks.engines.transformers.adapter import (
    AdapterConfig,
    ExpertParallelModel,
    Link,
    MoEBlock,
    SlotExperts,
    attach,
    find_moe_blocks,
    graph_moe_blocks,
)

__all__ = [
    "AdapterConfig",
    "ExpertParallelModel",
    "Link",
    "MoEBlock",
    "SlotExperts",
    "attach",
    "find_moe_blocks",
    "graph_moe_blocks",
]
