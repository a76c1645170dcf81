"""Online adaptive expert-placement rebalancer for MoE inference.

This package is the controller side and what both sides share: numpy, scipy (placement),
grpc and protobuf, never torch. Its layers, bottom up (ARCHITECTURE.md, "Layering"):
`errors` and the generated `v1` API; `wire` (codec, channel options, placement layout);
`placement` (the math); `controller`; `sim`; `cli` and `demo` on top. Torch lives in the
sibling package `worker_hooks`, which imports only the bottom layers.
"""

__version__ = "0.1.0"
