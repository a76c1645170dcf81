"""Online adaptive expert-placement rebalancer for MoE inference.

The controller side (this package) is numpy-only; torch lives in worker_hooks.
"""

__version__ = "0.1.0"
