"""Rewrite passes: each is a small object with a ``name`` and ``run(gm) -> PassResult``."""

from .capture_loss import CaptureLoss
from .pair_calls import PairCalls
from .pair_rle import PairRLE
from .select_rows import SelectRows

__all__ = ["CaptureLoss", "PairCalls", "PairRLE", "SelectRows"]
