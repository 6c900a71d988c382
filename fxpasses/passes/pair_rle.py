"""PairRLE: one flow call for both branches' RLE keypoint residuals.

A dual-branch pose loss scores each branch's visible keypoint residuals with the same RLE flow
(``flow.log_prob``). Pairing stacks both branches' selected rows, runs the flow once and splits:
a RealNVP with six coupling conditioners of three ``nn.Linear`` each goes from 36 linear calls to
18. Each branch keeps its own mean and alpha weight (the split uses that call's row counts), and
selection precedes the stacking, so unlabelled points never reach the flow.
"""

from __future__ import annotations

from .pair_calls import PairCalls


class PairRLE(PairCalls):
    """:class:`PairCalls` named for the RLE flow: ``PairRLE()`` pairs the ``log_prob`` calls on
    each module.

    Args:
        *methods (str): other method names to pair instead (``PairRLE("forward")``).
        modules (Sequence[str | type]): restrict to these module paths or ``nn.Module`` classes.
        allow_overrides (Sequence[type]): classes whose overriding of inherited scoring code is
            intended.

    Raises:
        TypeError, ValueError: as :class:`PairCalls`.
    """

    name = "PairRLE"
