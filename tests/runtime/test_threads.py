"""Threads sharing one OptimizedLoss: every call is native's, in float64, values and gradients.

PairRLE + CaptureLoss (the emulated recorder: CUDA graphs' static buffers, on a CPU), masks so
that the paired flow call has a data-dependent row count and is replayed per row bucket. Each
thread runs forward and backward on its own inputs; a call that finds another thread inside the
optimized path runs natively, counted ``concurrent-call``; a call that finds another thread inside
a captured region runs that region eagerly.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from fxpasses import optimize
from fxpasses.cli import import_file
from fxpasses.passes import CaptureLoss, PairRLE
from fxpasses.runtime.capture import CapturedRegion
from fxpasses.runtime.emulated import EmulatedRecorder

flows = import_file(Path(__file__).parents[1] / "helpers" / "float64_flows.py")

pytestmark = pytest.mark.usefixtures("float64_default")

_PARAMETERS: dict[int, list[tuple[str, nn.Parameter]]] = {}


def _loss() -> nn.Module:
    loss = flows.TwoMasked()
    _PARAMETERS[id(loss)] = list(loss.named_parameters())  # as an optimizer would hold them
    return loss


def _params(loss: nn.Module) -> list[nn.Parameter]:
    return [p for _, p in _PARAMETERS[id(loss)]]


def _capture(recorder=None, **options) -> CaptureLoss:
    return CaptureLoss(devices=("cpu",), recorder=recorder or EmulatedRecorder(), min_bucket=64,
                       count_copies=False, record_after=1, **options)


def _inputs(seed: int, calls: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(40, 2, generator=g, requires_grad=True),
             torch.randn(30, 2, generator=g, requires_grad=True),
             torch.rand(40, generator=g) > 0.3, torch.rand(30, generator=g) > 0.3)
            for _ in range(calls)]


def _value_and_gradients(params: list[torch.Tensor], fn, args) -> tuple[torch.Tensor, tuple]:
    """The value and the gradients of the rows and of ``params``, the parameters as an optimizer
    holds them, taken before (autograd.grad: nothing accumulates into the shared parameters'
    .grad, so each thread's are its own)."""
    value = fn(*args)
    return value.detach(), torch.autograd.grad(value, [*args[:2], *params], allow_unused=True)


def _mismatches(loss, fast, args, want) -> list[str]:
    named = dict(_PARAMETERS[id(loss)])
    value, grads = _value_and_gradients(list(named.values()), fast, args)
    names = ["a", "b", *named]
    wrong = [] if torch.allclose(value, want[0], rtol=1e-12, atol=1e-12) else ["value"]
    return wrong + [n for n, g, w in zip(names, grads, want[1])
                    if g is None or not torch.allclose(g, w, rtol=1e-10, atol=1e-12)]


def test_threads_sharing_one_optimized_loss_get_native_values_and_gradients():
    loss = _loss()
    fast = optimize(loss, passes=[PairRLE(), _capture()])
    threads, calls = 3, 100
    inputs = [_inputs(seed, calls) for seed in range(threads)]
    expected = [[_value_and_gradients(_params(loss), loss, args) for args in own] for own in inputs]
    errors: list[str] = []
    start = threading.Barrier(threads)

    def worker(k: int) -> None:
        start.wait()  # no call before: the first trace races with the other threads' calls
        for i, args in enumerate(inputs[k]):
            try:
                wrong = _mismatches(loss, fast, args, expected[k][i])
            except Exception as exc:  # loud is allowed; it must reach the test
                wrong = [repr(exc)]
            if wrong:
                errors.append(f"thread {k} call {i}: {wrong}")

    running = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in running:
        t.start()
    for t in running:
        t.join()
    assert not errors, errors[:5]
    stats = fast.stats
    assert stats.calls == threads * calls and not stats.exceptions
    assert stats.native["concurrent-call"] > 0 and stats.optimized > 0, stats.render()
    assert any(c.get("replayed") for c in stats.sites.values()), stats.render()


def test_a_native_call_during_another_threads_recording_reads_the_real_parameters(monkeypatch):
    """A recording reads the parameters through aliases put on the module; a native call of
    another thread meanwhile would differentiate the aliases (its parameters' gradients lost).
    It waits for the recording instead, and runs natively."""
    import torch.nn.utils.stateless as stateless

    swapped, done, original = threading.Event(), threading.Event(), stateless._reparametrize_module

    @contextlib.contextmanager
    def lingering(module, swaps, *rest, **options):
        with original(module, swaps, *rest, **options):  # the aliases in place: until the other
            swapped.set()  # thread's call is done, or (it waits for this one) a second
            if not done.is_set() and not done.wait(1.0):
                done.set()
            yield

    monkeypatch.setattr(stateless, "_reparametrize_module", lingering)
    loss = _loss()
    fast = optimize(loss, passes=[PairRLE(), _capture()])
    first, second = _inputs(0, 1)[0], _inputs(1, 1)[0]
    want = _value_and_gradients(_params(loss), loss, second)
    recording = threading.Thread(target=lambda: _value_and_gradients(_params(loss), fast, first))
    recording.start()
    assert swapped.wait(60)
    try:
        wrong = _mismatches(loss, fast, second, want)  # the other thread owns the optimized path
    finally:
        done.set()
    recording.join()
    assert wrong == []
    assert fast.stats.native == {"concurrent-call": 1}
    assert any(c.get("recorded") for c in fast.stats.sites.values()), fast.stats.render()


def test_threads_racing_through_replays_and_backwards_get_native_values():
    loss = flows.TwoBranch()
    fast = optimize(loss, passes=[PairRLE(), CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder(),
                                                         min_bucket=8, count_copies=False,
                                                         record_after=1)])
    inputs = [(torch.randn(9 + i % 5, 2), torch.randn(4 + i % 3, 2)) for i in range(40)]
    expected = [loss(a, b).detach() for a, b in inputs]
    fast(*inputs[0])  # optimize once; then threads race through replays and backwards
    errors: list[str] = []

    def worker(offset: int) -> None:
        for i in range(offset, offset + 100):
            a, b = inputs[i % len(inputs)]
            value = fast(a, b)
            value.backward()
            if not torch.allclose(value.detach(), expected[i % len(inputs)], rtol=1e-12, atol=1e-12):
                errors.append(f"call {i}: {value.item()} != {expected[i % len(inputs)].item()}")

    threads = [threading.Thread(target=worker, args=(k * 7,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    assert fast.stats.exceptions == []


def test_a_call_while_another_thread_is_inside_a_region_runs_it_eagerly():
    region = CapturedRegion("r", lambda x: (x * 2).exp(), recorder=EmulatedRecorder())
    inside, leave = threading.Event(), threading.Event()

    def occupy() -> None:
        with region.lock:
            inside.set()
            leave.wait(10)

    other = threading.Thread(target=occupy)
    other.start()
    inside.wait(10)
    x = torch.randn(3)
    assert torch.equal(region(x), (x * 2).exp())
    leave.set()
    other.join()
    assert region.counters == {"concurrent-call": 1}
