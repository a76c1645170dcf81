"""Adapters that let real inference engines use the rebalancer without patching them.

Each engine is imported lazily inside its own subpackage, so importing `engines` costs
nothing and a CPU path never loads an engine it does not use.
"""
