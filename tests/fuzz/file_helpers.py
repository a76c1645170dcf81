"""Bytes of count, placement and trace files, valid and mutated, for the file fuzzers."""

from __future__ import annotations

import io

import numpy as np
from hypothesis import strategies as st


def npz_bytes(**arrays: object) -> bytes:
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)  # type: ignore[arg-type]
    return buf.getvalue()


def pt_bytes(obj: object) -> bytes:
    import torch  # the callers skip without torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def mutate(data: bytes, flips: list[tuple[int, int]], cut: int | None) -> bytes:
    out = bytearray(data)
    for pos, value in flips:
        if out:
            out[pos % len(out)] = value
    if cut is not None and out:
        out = out[: cut % (len(out) + 1)]
    return bytes(out)


mutations = st.tuples(
    st.lists(st.tuples(st.integers(0, 2**20), st.integers(0, 255)), max_size=3),
    st.one_of(st.none(), st.integers(0, 2**20)),
)
