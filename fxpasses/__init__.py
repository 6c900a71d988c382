"""fxpasses: certified torch.fx rewrites that make PyTorch training losses faster.

    from fxpasses import optimize
    from fxpasses.passes import PairRLE, CaptureLoss
    fast = optimize(loss_fn, passes=[PairRLE(), CaptureLoss()])
    out = fast(*inputs)          # same values and gradients as loss_fn(*inputs)
    print(fast.explain())        # certificates, graph diff, what ran natively and why
"""

from .optimize import OptimizedLoss, optimize
from .pipeline import Pass, PassResult, run_pipeline
from .trace import LeafPolicy, TraceFailure, trace
from .version import __version__

__all__ = ["LeafPolicy", "OptimizedLoss", "Pass", "PassResult", "TraceFailure", "optimize",
           "run_pipeline", "trace", "__version__"]
