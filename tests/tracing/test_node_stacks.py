"""A traced node's source stack: the innermost user frames (at most 12 of the 60 innermost
frames), formatted as ``traceback.format_list`` formats them, as the summary of every frame
filtered to user files gives them."""

from __future__ import annotations

import traceback

import torch

from fxpasses import LeafPolicy, trace
from fxpasses.locations import is_user_file
from fxpasses.tracing import recorder

# the reference, compiled as if it were fxpasses' own code (its frame is not a user frame)
_REFERENCE = """
def reference():
    frames = [f for f in traceback.StackSummary.extract(traceback.walk_stack(None), limit=60,
                                                        lookup_lines=False)
              if is_user_file(f.filename)]
    return "".join(traceback.format_list(frames[::-1][-12:]))
"""
_namespace = {"traceback": traceback, "is_user_file": is_user_file}
exec(compile(_REFERENCE, recorder.__file__, "exec"), _namespace)


def _nested(depth: int, read):
    return read() if depth == 0 else _nested(depth - 1, read)


def test_the_user_stack_is_the_reference_at_any_depth():
    for depth in (0, 5, 20):
        ours, theirs = _nested(depth, lambda: (recorder._user_stack(), _namespace["reference"]()))
        assert ours == theirs
        assert ours.count('File "') <= 12  # (pytest's own frames are user frames too: installed code)
        assert ours.rstrip().endswith("_namespace[\"reference\"]()))")  # innermost last
        assert "fxpasses" not in ours.replace(__file__, "")


class _Deep(torch.nn.Module):
    def forward(self, x):
        return self.inner(x)

    def inner(self, x):
        return x.exp()  # the line the node must name


def test_a_traced_node_names_the_users_lines_innermost_last():
    gm = trace(_Deep(), (torch.randn(3),), policy=LeafPolicy())
    exp = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "exp")
    stack = exp.meta["stack_trace"]
    assert stack.rstrip().endswith("return x.exp()  # the line the node must name")
    assert "in forward" in stack and stack.index("in forward") < stack.index("in inner")
