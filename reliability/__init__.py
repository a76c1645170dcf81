"""The reliability harness: the chaos campaign, its fault proxy and worker, the soak run.

Beside the product like `bench/`, and layered like it (it imports the product, never a
test, a benchmark or a script); tests drive it (tests/integration/test_chaos.py). Not
installed: it runs from the repository (`python -m reliability.chaos`).
"""
