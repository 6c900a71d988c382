"""PairRLE: one flow call for both branches' RLE keypoint residuals (seed WP-199b).

A dual-branch pose loss scores each branch's visible keypoint residuals with the same RLE flow
(``flow.log_prob``). Pairing stacks both branches' selected rows, runs the flow once and splits:
a RealNVP with six coupling conditioners of three ``nn.Linear`` each goes from 36 linear calls to
18. Each branch keeps its own mean and alpha weight (the split uses that call's row counts), and
selection precedes the stacking, so unlabelled points never reach the flow.
"""

from __future__ import annotations

from .pair_calls import PairCalls


class PairRLE(PairCalls):
    """``PairRLE()`` pairs the ``log_prob`` calls on each module; ``PairRLE("forward", ...)``
    names other methods, ``modules=`` restricts to module paths or classes (as PairCalls)."""

    name = "PairRLE"
