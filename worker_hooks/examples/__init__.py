"""Reference MoE models and the demo's worker: examples of an engine, not the product.

- `moe_cpu`: the fp32 CPU MoE layer the demo and the CPU tests serve, whole in one
  process (`ReferenceMoE`) and spread over an EP group on the hook's live weights
  (`ExpertParallelMoE`), with deterministic per-expert weights, so outputs can be
  compared bit for bit.
- `moe_gpu`: a DeepSeek-V3-shaped MoE block for CUDA (`ReferenceMoEBlock`): router,
  hooks, grouped SwiGLU experts, capturable in a CUDA graph; used by the GPU benches.
- `cpu_worker`: a complete CPU expert-parallel worker process built on `worker_hooks`
  (what an engine integration looks like), started by `rebalancer demo`.
"""
