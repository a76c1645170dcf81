"""Generated gRPC code of proto/rebalancer/v1 (do not edit)."""
