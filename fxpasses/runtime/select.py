"""The one host read of a selection level: row counts in, capacities (buckets) out.

    # x[m] == x.flatten(0, m.dim() - 1)[idx][:count]   idx = the True positions of m, padded to C

SelectRows replaces boolean-mask selections by gathers into a static capacity ``C`` (a bucket:
the next power of two of the count, at least ``min_bucket``). The counts stay on the device for
everything that runs inside recorded graphs (validity masks, the divisors of means); only the
buckets, and the counts of rows handed back to the caller, are needed on the host. A
:class:`ReadCounts` reads the counts of every selection of one level with ONE synchronisation
(``torch.stack(counts).tolist()``).

An empty selection has no real row to copy into its padding, so the call is abandoned
(:class:`~fxpasses.runtime.abandon.Abandon`, code ``selection-empty``): ``OptimizedLoss`` runs it
natively, counted (and never traced again for it: a new trace would abandon it too). The read
happens before any value of the call reaches the caller.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch._guards import detect_fake_mode

from . import RuntimeOp
from .abandon import Abandon
from .paired_capture import bucket


class ReadCounts(RuntimeOp):
    """``read(*counts) -> (bucket_1, ..., bucket_k, count_1, ..., count_k)`` as Python ints.

    ``counts``: 0-dim integer tensors (one per selection of the level); ``sites``: the source
    location of each, named when one is empty.
    """

    pure = True
    capturable = False

    def __init__(self, op_id: str, sites: Sequence[str], min_bucket: int):
        super().__init__(op_id)
        self.sites = tuple(sites)
        self.min_bucket = min_bucket

    def __call__(self, *counts: torch.Tensor) -> tuple[int, ...]:
        self.count("read")
        values = [int(v) for v in torch.stack(counts).tolist()]  # the one host synchronisation
        for count, site in zip(values, self.sites):
            if count == 0:
                self.count("selection-empty")
                raise Abandon("selection-empty", site, "a selection is empty: no real row to pad with",
                              retrace=False)  # any trace's read abandons it again
        return (*(bucket(v, self.min_bucket) for v in values), *values)

    def propagate(self, *counts: torch.Tensor) -> tuple[torch.SymInt, ...]:
        """Fresh unbacked sizes: buckets at least ``min_bucket``, counts in ``[1, bucket]``."""
        shape_env = detect_fake_mode(list(counts)).shape_env
        buckets = [shape_env.create_unbacked_symint() for _ in counts]
        sizes = [shape_env.create_unbacked_symint() for _ in counts]
        for capacity, size in zip(buckets, sizes):
            torch._check(capacity >= self.min_bucket)
            torch._check(size >= 1)
            torch._check(size <= capacity)
        return (*buckets, *sizes)
