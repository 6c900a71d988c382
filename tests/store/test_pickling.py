"""Writing a pipeline's result: the loss's objects by path, what cannot travel refused."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from fxpasses.guards import TensorSeen
from fxpasses.store.live import live_objects
from fxpasses.store.pickling import NotStorable, StaleResult, dumps, loads


class _Held:
    """A plain object of a user class."""


class _Loss(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(2, 2)
        self.register_buffer("weights", torch.arange(4.0))
        self.branch = _Held()
        self.branch.flow = self.head  # one module reached by two paths


def test_the_loss_objects_come_back_as_the_other_loss_objects_at_their_paths():
    first, second = _Loss(), _Loss()
    data = dumps({"head": first.head, "bias": first.head.bias, "branch": first.branch,
                  "kept": torch.ones(2)}, live_objects(first))
    back = loads(data, second)
    assert back["head"] is second.head and back["bias"] is second.head.bias
    assert back["branch"] is second.branch and back["branch"].flow is second.head
    assert torch.equal(back["kept"], torch.ones(2))  # not the loss's: written by value


def test_a_folded_tensor_comes_back_only_while_it_holds_the_values_it_held():
    first, second = _Loss(), _Loss()
    data = dumps(TensorSeen.of(first.weights), live_objects(first))
    seen = loads(data, second)
    assert seen.tensor is second.weights and seen.version == second.weights._version
    second.weights.add_(1)
    with pytest.raises(StaleResult, match="other values"):
        loads(data, second)


@pytest.mark.parametrize("value", [threading.Lock(), _Held(), {"gain": 1.0}.get],
                         ids=["lock", "object-not-held", "method-of-a-dict-not-held"])
def test_what_cannot_travel_is_not_stored(value):
    with pytest.raises(NotStorable):
        dumps({"value": value}, live_objects(_Loss()))


def test_a_path_the_other_loss_lacks_is_a_stale_result():
    first = _Loss()
    data = dumps(first.branch, live_objects(first))
    with pytest.raises(StaleResult):
        loads(data, nn.Linear(2, 2))


def test_a_zero_dim_constant_is_keyed_by_its_bytes():
    from fxpasses.store.key import tensor_digest

    assert tensor_digest(torch.tensor(1.0)) == tensor_digest(torch.tensor(1.0))
    assert tensor_digest(torch.tensor(1.0)) != tensor_digest(torch.tensor(2.0))
    assert tensor_digest(torch.ones(3)[::2]) == tensor_digest(torch.ones(2))


def test_a_method_is_keyed_by_the_path_of_its_object_and_only_then():
    from fxpasses.store.key import Describer, Unkeyable

    loss = _Loss()
    describe = Describer(live_objects(loss))
    assert describe(loss.head.forward) == ["method", ["live", [".head"]], "forward"]
    with pytest.raises(Unkeyable, match="does not hold"):
        describe({"gain": 1.0}.get)


_LOCK = threading.Lock()  # a module's lock that a loss's code reads


def test_an_identity_on_an_unnamed_object_is_recorded_again_on_what_its_source_holds(monkeypatch):
    import sys

    from fxpasses.guards import Assumption
    from fxpasses.ir.sources import GlobalRoot, Source

    module = sys.modules[__name__]
    source = Source(GlobalRoot(vars(module), "_LOCK"))
    data = dumps(Assumption("identity", source, _LOCK, "here", "lock"), live_objects(_Loss()))
    other = threading.Lock()
    monkeypatch.setattr(module, "_LOCK", other)
    assert loads(data, _Loss()).expected is other  # this process's object at that source
    monkeypatch.setattr(module, "_LOCK", threading.RLock())
    with pytest.raises(StaleResult, match="was a _thread.lock"):
        loads(data, _Loss())


def test_an_identity_on_a_named_object_still_compares_after_reading_back():
    """A dtype is written by name: read back, it is the same object, and a source that holds
    another dtype now fails the assumption (it is not recorded again on what the source holds)."""
    from fxpasses.guards import Assumption
    from fxpasses.ir.sources import Attr, LossRoot, Roots, Source

    loss = _Loss()
    loss.dtype = torch.float32
    source = Source(LossRoot(), (Attr("dtype"),))
    data = dumps(Assumption("identity", source, torch.float32, "here", "float32"), live_objects(loss))
    other = _Loss()
    other.dtype = torch.float16
    back = loads(data, other)
    assert back.expected is torch.float32 and not back.holds(Roots(other, ()))
