"""The replays' batched copies (``_copy_all``) write exactly what one ``copy_`` per pair writes."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpasses.runtime.capture import _copy_all

_DTYPES = [torch.float32, torch.float64, torch.int64, torch.bool, torch.float16]


def _source(kind: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(4, 6, generator=g) * 5).to(dtype)
    return {"dense": base, "transposed": base.t(), "expanded": base[:1].expand(4, 6),
            "sliced": base[:, ::2]}[kind]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(_DTYPES), st.sampled_from(_DTYPES),
                          st.sampled_from(["dense", "transposed", "expanded", "sliced"])), max_size=8))
def test_batched_copies_equal_one_copy_per_pair(pairs):
    values = [_source(kind, src, seed) for seed, (_, src, kind) in enumerate(pairs)]
    targets = [torch.full(v.shape, 7).to(dst) for v, (dst, _, _) in zip(values, pairs)]
    expected = [t.clone().copy_(v) for t, v in zip(targets, values)]
    _copy_all(targets, values)
    for got, want in zip(targets, expected):
        assert got.dtype == want.dtype and torch.equal(got, want)
