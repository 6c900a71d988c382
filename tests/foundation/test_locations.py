"""fxpasses.locations: the user's line of a node, of an exception, and the node that raised."""

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
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


@pytest.mark.skipif(sys.prefix != sys.base_prefix, reason="needs an interpreter outside a virtual environment")
def test_packages_of_the_base_installation_are_user_code_in_a_system_site_packages_venv(tmp_path):
    """In a virtual environment made with --system-site-packages, the base installation's
    site-packages (where its third-party packages, Ultralytics among them, live) lies inside the
    base's standard-library folder: those files are user code, not the standard library (the
    real criterion was otherwise traced as library code: guards at the caller's line, a trace per
    batch)."""
    venv.create(tmp_path / "venv", system_site_packages=True, with_pip=False)
    python = tmp_path / "venv" / "bin" / "python"
    code = ("import json, pytest, functools, fxpasses.locations as l; "
            "print(json.dumps([l.is_user_file(pytest.__file__), l.is_user_file(functools.__file__)]))")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [True, False]
