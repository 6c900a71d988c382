"""fxpasses.locations: the user's line of a node, of an exception, and the node that raised."""

import torch
import torch.fx as fx

from fxpasses.locations import exception_location, failing_node, is_user_file, node_location, node_source


class _Loss(torch.nn.Module):
    def forward(self, x):
        y = x.exp()  # the line of `exp`
        return torch.ones(2) @ y.sum()  # raises: a 0-d right operand


def _traced():
    tracer = fx.Tracer()
    tracer.record_stack_traces = True
    root = _Loss()
    return fx.GraphModule(root, tracer.trace(root))


def test_user_files_exclude_torch_and_fxpasses_but_not_the_workloads():
    import fxpasses.locations as own
    from fxpasses.workloads.pose import loss as workload
    assert is_user_file(__file__)
    assert not is_user_file(torch.__file__) and not is_user_file(own.__file__)
    assert is_user_file(workload.__file__)


def test_node_location_is_the_users_line():
    gm = _traced()
    exp = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "exp")
    source = node_source(exp)
    assert node_location(exp) == f"{__file__}:{_Loss.forward.__code__.co_firstlineno + 1}"
    assert source.function == "forward" and "the line of `exp`" in source.text


def test_failing_node_names_the_node_whose_line_raised():
    gm = _traced()
    try:
        gm.forward(torch.randn(3))
    except RuntimeError as exc:
        node = failing_node(gm, exc)
        assert node is not None and "matmul" in node.format_node()
        assert exception_location(exc).function == "test_failing_node_names_the_node_whose_line_raised"
    else:
        raise AssertionError("the traced loss should raise")
