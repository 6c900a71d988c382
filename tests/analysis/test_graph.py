"""fxpasses.analysis.graph: the networkx view of an fx graph and its reachability questions."""

import networkx as nx
import torch
import torch.fx as fx

from fxpasses.analysis.graph import dependent_pairs, downstream, grad_modes, to_digraph


def _graph():
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.exp, (x,))
    off = g.call_function(torch._C._set_grad_enabled, (False,))
    b = g.call_function(torch.neg, (x,))
    on = g.call_function(torch._C._set_grad_enabled, (True,))
    c = g.call_function(torch.add, (a, b))
    d = g.call_function(torch.exp, (c,))
    g.output(d)
    return g, dict(x=x, a=a, b=b, c=c, d=d, off=off, on=on)


def test_edges_follow_uses():
    g, n = _graph()
    digraph = to_digraph(g)
    assert digraph.has_edge(n["x"], n["a"]) and digraph.has_edge(n["a"], n["c"])
    assert not digraph.has_edge(n["c"], n["a"])


def test_dependent_pairs_name_the_direction_and_independent_nodes_have_none():
    g, n = _graph()
    digraph = to_digraph(g)
    assert dependent_pairs(digraph, [n["a"], n["b"]]) == []
    assert dependent_pairs(digraph, [n["d"], n["a"]]) == [(n["a"].name, n["d"].name)]


def test_downstream_is_every_dependent_node():
    g, n = _graph()
    assert downstream([n["b"]]) == {n["c"], n["d"], next(iter(n["d"].users))}


def test_downstream_walks_users_as_descendants_walk_the_digraph():
    g, n = _graph()
    for start in ([n["x"]], [n["b"]], [n["a"], n["b"]], [n["d"]]):
        assert downstream(start) == set().union(*(nx.descendants(to_digraph(g), s) for s in start))


def test_grad_modes_follow_the_recorded_switches():
    g, n = _graph()
    modes = grad_modes(g)
    assert modes[n["a"]] and not modes[n["b"]] and modes[n["c"]]
