"""optimize(): the empty pipeline is exact, every whole-loss guard falls back, errors are clear."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.fx as fx
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

from fxpasses import PassResult, optimize
from fxpasses.certificates import Certificate, Site
from fxpasses.ir.runtime_op import RuntimeOp
from fxpasses.ir.abandon import Abandon


def _inputs(rows_a, rows_b, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows_a, 2, generator=g, dtype=dtype, requires_grad=True),
            torch.randn(rows_b, 2, generator=g, dtype=dtype, requires_grad=True))


def _value_and_grads(loss, a, b):
    a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
    params = [p for p in loss.parameters()]
    out = loss(a, b)
    grads = torch.autograd.grad(out, [a, b, *params])
    return out.detach(), grads


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows_a=st.integers(1, 40), rows_b=st.integers(1, 40), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_empty_pipeline_is_bit_exact(two_branch_loss, rows_a, rows_b, seed, dtype):
    loss = two_branch_loss.to(dtype)
    fast = optimize(loss)
    a, b = _inputs(rows_a, rows_b, seed, dtype)
    ref_value, ref_grads = _value_and_grads(loss, a, b)
    value, grads = _value_and_grads(fast, a, b)
    assert torch.equal(value, ref_value)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))
    assert fast.stats.optimized == 1 and not fast.stats.native


def test_state_dict_keys_and_parameters_are_the_originals(two_branch_loss):
    fast = optimize(two_branch_loss)
    assert list(fast.state_dict()) == list(two_branch_loss.state_dict())
    assert all(p is q for p, q in zip(fast.parameters(), two_branch_loss.parameters()))


def _guard_cases():
    """(name, action on the loss, expected reason code)."""
    def forward_hook(loss):
        loss.flow.inner.register_forward_hook(lambda *args: None)

    def pre_hook(loss):
        loss.flow.register_forward_pre_hook(lambda *args: None)

    def backward_hook(loss):
        loss.flow.outer.register_full_backward_hook(lambda *args: None)

    def instance_method(loss):
        original = loss.flow.log_prob
        loss.flow.log_prob = lambda x: original(x) * 2

    def class_method(loss):
        cls = type(loss.flow)
        original = cls.log_prob
        cls.log_prob = lambda self, x: original(self, x) * 2
        return lambda: setattr(cls, "log_prob", original)

    def replace_module(loss):
        loss.flow.inner = nn.Linear(2, 8)

    def eval_mode(loss):
        loss.eval()

    return [("forward hook", forward_hook, "hook-added"), ("pre hook", pre_hook, "hook-added"),
            ("backward hook", backward_hook, "hook-added"),
            ("instance method", instance_method, "method-replaced"),
            ("class method", class_method, "method-replaced"),
            ("module replaced", replace_module, "module-replaced"),
            ("eval mode", eval_mode, "mode-changed")]


@pytest.mark.parametrize("name,change,code", _guard_cases(), ids=[c[0] for c in _guard_cases()])
def test_each_whole_loss_guard_sends_the_next_call_native(two_branch_loss, name, change, code):
    fast = optimize(two_branch_loss)
    a, b = _inputs(4, 3)
    fast(a, b)
    undo = change(two_branch_loss)
    try:
        out = fast(a, b)
        assert torch.equal(out, two_branch_loss(a, b))  # the native (changed) semantics
        assert fast.stats.native == {code: 1} and fast.stats.optimized == 1
    finally:
        if undo:
            undo()


def test_global_hook_sends_the_next_call_native(two_branch_loss):
    fast = optimize(two_branch_loss)
    a, b = _inputs(4, 3)
    fast(a, b)
    handle = nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        fast(a, b)
    finally:
        handle.remove()
    fast(a, b)  # removing the hook restores the recorded state: optimized again
    assert fast.stats.native == {"hook-added": 1} and fast.stats.optimized == 2


def test_no_grad_runs_natively_and_autocast_gets_its_own_trace(two_branch_loss):
    fast = optimize(two_branch_loss)
    a, b = _inputs(4, 3)
    fast(a, b)
    with torch.no_grad():
        fast(a, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = fast(a, b)
        assert under_autocast.dtype == two_branch_loss(a, b).dtype
    fast(a, b)  # back to full precision: the first trace again
    assert fast.stats.native == {"grad-mode-changed": 1} and fast.stats.optimized == 3
    assert len(fast.specializations) == 2
    (reason,) = fast.stats.retraced
    assert reason.startswith("None")  # a whole-loss kind: autocast (no source)


class _SwitchesInside(nn.Module):
    """Makes ``x * 2`` under inference mode (no autograd history: native's gradient is 2), or a
    zero vector under another default dtype (native's value is float64): neither is a switch a
    graph replays."""

    def __init__(self, switch):
        super().__init__()
        self.switch = switch

    def forward(self, a, b):
        if self.switch == "random seed":  # the same draw every call
            torch.manual_seed(0)
            return (a * torch.rand(2)).sum() + b.sum()
        if self.switch == "generator seed":
            torch.default_generator.manual_seed(0)
            return (a * torch.rand(2)).sum() + b.sum()
        if self.switch == "random state":  # the same draw twice
            state = torch.get_rng_state()
            noise = torch.rand(2)
            torch.set_rng_state(state)
            return (a * noise).sum() + (a * torch.rand(2)).sum() + b.sum()
        if self.switch == "inference mode":
            with torch.inference_mode():
                twice = a * 2
            return (a * 2).sum() + twice.sum() + b.sum()
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        zeros = torch.zeros(2)
        torch.set_default_dtype(previous)
        return (a + zeros).sum() + b.sum()


@pytest.mark.parametrize("switch", ["inference mode", "default dtype", "random seed", "generator seed",
                                    "random state"])
def test_a_switch_inside_the_loss_that_a_graph_cannot_replay_is_refused(switch):
    """Each made a silently different value or gradient before it was refused: a gradient of 4
    where native's is 2, float32 where native's is float64, a draw the seed did not fix."""
    loss = _SwitchesInside(switch)
    fast = optimize(loss)
    for seed in range(2):
        a, b = _inputs(3, 2, seed)
        torch.manual_seed(seed)
        got = fast(a, b)
        torch.manual_seed(seed)
        want = loss(a.detach().requires_grad_(), b)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        if switch in ("inference mode", "default dtype"):
            (grad,) = torch.autograd.grad(got, [a])
            torch.testing.assert_close(grad, torch.full_like(a, 2.0 if switch == "inference mode" else 1.0))
    assert fast.stats.native == {"trace-unsupported": 2} and not fast.stats.optimized
    shown = {"generator seed": "random number generator", "random state": "random number generator",
             "random seed": "random number generator"}.get(switch, switch)
    assert shown in fast.certificates[0].message


def test_a_call_under_another_default_dtype_gets_its_own_trace():
    previous = torch.get_default_dtype()
    fast = optimize(lambda a, b: (a + torch.zeros(2)).sum() + b.sum())
    a, b = _inputs(3, 2)
    assert fast(a, b).dtype == torch.float32
    torch.set_default_dtype(torch.float64)
    try:
        assert fast(a, b).dtype == torch.float64  # native's: a float32 plus float64 zeros
    finally:
        torch.set_default_dtype(previous)
    fast(a, b)  # the first trace again
    assert fast.stats.optimized == 3 and len(fast.specializations) == 2
    (reason,) = fast.stats.retraced
    assert reason.startswith("None")  # a whole-loss kind: the default dtype (no source)


def test_a_call_with_grad_disabled_runs_natively_without_a_warning(two_branch_loss, caplog):
    fast = optimize(two_branch_loss)
    a, b = _inputs(4, 3)
    with caplog.at_level(logging.INFO, logger="fxpasses"):
        with torch.inference_mode():  # a validator's loss on the EMA model
            fast(a, b)
        with torch.no_grad():
            fast(a, b)
    assert fast.stats.native == {"grad-mode-changed": 2}
    assert [r.levelno for r in caplog.records] == [logging.INFO]  # logged once, not as a warning


def test_reoptimize_accepts_the_current_state(two_branch_loss):
    fast = optimize(two_branch_loss)
    a, b = _inputs(4, 3)
    fast(a, b)
    two_branch_loss.flow.register_forward_hook(lambda *args: None)
    fast(a, b)
    fast.reoptimize()
    fast(a, b)
    assert fast.stats.native == {"hook-added": 1} and fast.stats.optimized == 2


class _Boom(RuntimeOp):
    """Raises when called; shape propagation at optimization time passes through."""

    def propagate(self, x):
        return x

    def __call__(self, x):
        raise RuntimeError("injected failure")


_boom = _Boom("_boom")


class InjectFailure:
    """Test pass: route the first log_prob result through a function that raises."""

    name = "inject-failure"

    def run(self, gm: fx.GraphModule) -> PassResult:
        node = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "log_prob")
        with gm.graph.inserting_after(node):
            boom = gm.graph.call_function(_boom, (node,))
        node.replace_all_uses_with(boom, delete_user_cb=lambda user: user is not boom)
        return PassResult(gm, True, [Certificate("inject-failure", Site((node.name,)), "applied")])


def test_exception_in_optimized_path_returns_native_result(two_branch_loss):
    fast = optimize(two_branch_loss, passes=[InjectFailure()])
    a, b = _inputs(4, 3)
    out = fast(a, b)
    assert torch.equal(out, two_branch_loss(a, b))
    (exc,) = fast.stats.exceptions
    assert exc.type == "RuntimeError" and exc.message == "injected failure"
    assert exc.node == "_boom"
    fast(a, b)
    fast(a, b)  # the third failure in a row that native survived: the specialization is disabled
    fast(a, b)  # native without raising again
    assert fast.stats.native == {"optimized-path-raised": 3, "optimized-path-disabled": 1}
    assert len(fast.stats.exceptions) == 3


class CountThreads:
    """Test pass: notes torch's CPU thread count while the passes run; changes nothing."""

    name = "count-threads"

    def __init__(self):
        self.seen = []

    def run(self, gm: fx.GraphModule) -> PassResult:
        self.seen.append(torch.get_num_threads())
        return PassResult(gm, False, [])


def test_the_passes_run_on_one_cpu_thread_and_the_count_is_put_back(two_branch_loss):
    """Witnesses' tiny float64 ops split over threads that data-loader workers hold spin (the
    padding witness 25 times slower on two busy cores): the pipeline runs on one thread, and
    the caller's count is back once the call returns."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        counter = CountThreads()
        fast = optimize(two_branch_loss, passes=[counter])
        a, b = _inputs(4, 3)
        torch.testing.assert_close(fast(a, b), two_branch_loss(a, b))
        assert counter.seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_pipelines_in_two_threads_put_back_the_count_the_first_found():
    """Thread A enters, B enters, A leaves, B leaves: one thread throughout, the caller's count
    after (restoring per pipeline would leave A's restore undone by B's, or keep one thread)."""
    import threading

    from fxpasses.isolation import one_intra_op_thread

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def a():
        with one_intra_op_thread():
            a_in.set()
            b_in.wait()
        seen.append(("a left", torch.get_num_threads()))
        a_out.set()

    def b():
        a_in.wait()
        with one_intra_op_thread():
            b_in.set()
            a_out.wait()
            seen.append(("b inside", torch.get_num_threads()))
        seen.append(("b left", torch.get_num_threads()))

    try:
        threads = [threading.Thread(target=a), threading.Thread(target=b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert seen == [("a left", 1), ("b inside", 1), ("b left", 2)]
    finally:
        torch.set_num_threads(before)


def test_trace_failure_runs_natively_with_a_refusal():
    class Numpyish(nn.Module):
        def forward(self, a, b):
            return a.sum() * float(b.detach().numpy().sum())  # values leave torch

    fast = optimize(Numpyish())
    a, b = _inputs(4, 3)
    assert torch.equal(fast(a, b), Numpyish()(a, b))
    (cert,) = fast.certificates
    assert cert.codes == ("trace-unsupported",)
    fast(a, b)  # not traced again
    assert fast.stats.native == {"trace-unsupported": 2} and len(fast.specializations) == 1


def test_float_attributes_are_inputs_and_other_values_retrace_up_to_the_budget(two_branch_loss):
    fast = optimize(two_branch_loss, max_specializations=2)
    a, b = _inputs(4, 3)
    for alpha in (0.25, 0.5, 0.75):  # a float read as arithmetic: an input, one trace
        two_branch_loss.alpha = alpha
        assert torch.equal(fast(a, b), two_branch_loss(a, b))
    assert len(fast.specializations) == 1, fast.stats.retraced
    two_branch_loss.scale = torch.tensor(3.0)  # a buffer rebound: read live, no other trace
    assert torch.equal(fast(a, b), two_branch_loss(a, b))
    fast(a, b=b)  # another input structure: a second trace
    fast(a=a, b=b)  # and a third: past the budget
    assert len(fast.specializations) == 2
    assert fast.stats.optimized == 5 and fast.stats.native == {"specialization-budget": 1}


def test_bad_arguments_are_rejected_at_optimize_time(two_branch_loss):
    with pytest.raises(TypeError, match="callable"):
        optimize(3)
    with pytest.raises(TypeError, match="pass an instance: InjectFailure"):
        optimize(two_branch_loss, passes=[InjectFailure])
    with pytest.raises(TypeError, match="is not a pass"):
        optimize(two_branch_loss, passes=["PairRLE"])
    with pytest.raises(ValueError, match="appears twice"):
        optimize(two_branch_loss, passes=[InjectFailure(), InjectFailure()])
    with pytest.raises(TypeError, match="list of pass objects"):
        optimize(two_branch_loss, passes="PairRLE")
    with pytest.raises(ValueError, match="max_specializations"):
        optimize(two_branch_loss, max_specializations=0)


def test_explain_mentions_pipeline_counters_and_guards(two_branch_loss):
    fast = optimize(two_branch_loss, passes=[InjectFailure()])
    assert "not traced yet" in fast.explain()
    fast(*_inputs(4, 3))
    text = fast.explain()
    assert "inject-failure" in text and "optimized-path-raised" in text and "hook-added" in text


class ParamLoss(nn.Module):
    """A loss with a parameter: autocast caches its cast while the first call is traced."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 3))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight).float().pow(2).sum()


def test_first_call_under_autocast_returns_real_tensors():
    loss = ParamLoss()
    fast = optimize(loss)
    x = torch.randn(4, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fast(x)  # trace and fake propagation happen inside this autocast region
        again = loss(x)  # a real call after it in the same region must see a real cached cast
    assert type(out) is torch.Tensor and type(again) is torch.Tensor
    assert torch.equal(out, again) and out.item() == again.item()


class _AbandonOnRequest(RuntimeOp):
    """Abandons the calls it is told to (an assumption that fails for that call only)."""

    abandon = False

    def propagate(self, x):
        return x

    def __call__(self, x):
        if _AbandonOnRequest.abandon:
            raise Abandon("optimized-path-raised", "here.py:1", "told to")
        return x


class InsertAbandon:
    name = "insert-abandon"

    def run(self, gm: fx.GraphModule) -> PassResult:
        output = next(n for n in gm.graph.nodes if n.op == "output")
        (value,) = output.args[0]
        with gm.graph.inserting_before(output):
            checked = gm.graph.call_function(_AbandonOnRequest("abandon"), (value,))
        output.args = ((checked,),)
        return PassResult(gm, True, [Certificate("insert-abandon", Site((value.name,)), "applied")])


def test_an_abandoned_call_runs_natively_and_keeps_the_specialization(two_branch_loss):
    fast = optimize(two_branch_loss, passes=[InsertAbandon()])
    values = []
    for abandon in (False, True, False):
        a, b = _inputs(4, 3)
        _AbandonOnRequest.abandon = abandon
        values.append((fast(a, b), two_branch_loss(a, b)))
    _AbandonOnRequest.abandon = False
    assert all(torch.equal(got, want) for got, want in values)
    stats = fast.stats
    assert stats.optimized == 2 and stats.native == {"optimized-path-raised": 1}  # its code
    assert stats.abandoned == {"optimized-path-raised at here.py:1": 1}
    assert all(fast.disabled(s) is None for s in fast.specializations)


def test_a_mode_entered_inside_the_loss_is_refused():
    """``with torch.device(d):`` inside the loss is a torch function mode: it gave native's
    factories ``device=d``, and the graph, which does not replay it, made them on the CPU."""

    def loss(a):
        with torch.device("meta"):
            made = torch.zeros(2)
        return a.sum(), made

    fast = optimize(loss)
    for _ in range(2):
        assert fast(torch.ones(2))[1].device == loss(torch.ones(2))[1].device == torch.device("meta")
    assert fast.stats.native == {"trace-unsupported": 2}
    assert "mode is entered inside the loss" in fast.certificates[0].message


def test_a_trace_leaves_device_contexts_working_in_the_whole_process():
    """torch builds the table of factories a ``torch.device(d)`` context gives ``device=d`` once,
    on first use, from ``torch``'s attributes; a compiled function the loss calls built it while
    the trace had the factories patched, and from then on no device context applied to
    ``torch.zeros`` anywhere in the process (a tensor made on the CPU, silently)."""
    from torch.utils._device import _device_constructors

    _device_constructors.cache_clear()  # as in a process where no device context ran yet
    compiled = nn.Linear(2, 2)
    compiled.compile()  # compiled on its first call: inside the trace
    optimize(lambda a: compiled(a).sum() + torch.zeros(2).sum())(torch.ones(2))
    with torch.device("meta"):
        assert torch.zeros(2).device == torch.device("meta")


class _LeavesStateChanged(nn.Module):
    """Switches state and does not put it back: native leaves the change to its caller."""

    def __init__(self, what):
        super().__init__()
        self.what, self.teacher = what, nn.Dropout(0.5)

    def forward(self, a):
        if self.what == "module mode":
            self.teacher.eval()  # as a distillation loss keeps its teacher in eval mode
            return self.teacher(a).sum()
        torch.set_grad_enabled(False)
        return (a * 2).sum()


@pytest.mark.parametrize("what", ["module mode", "grad mode"])
def test_a_loss_that_leaves_a_mode_changed_is_refused(what):
    """Before, the graph kept the values but not the change: the teacher stayed in training
    mode after an optimized call, or grad mode came back on after the second."""
    loss = _LeavesStateChanged(what)
    fast = optimize(loss)
    try:
        for _ in range(2):
            loss.teacher.train()
            fast(torch.ones(3, requires_grad=True))
            assert not loss.teacher.training if what == "module mode" else not torch.is_grad_enabled()
            torch.set_grad_enabled(True)
    finally:
        torch.set_grad_enabled(True)
    assert fast.stats.native == {"trace-unsupported": 2} and not fast.stats.optimized
    assert "leaves grad mode or a module's train/eval mode changed" in fast.certificates[0].message


@pytest.mark.parametrize("write", ["a new key", "a list appended to"])
def test_a_loss_that_writes_into_its_input_containers_is_refused(write):
    """Native leaves ``batch["scaled"]`` (or a logged item) in the caller's containers; the
    graph kept the values and dropped the write, on every call, the first included."""

    def loss(batch):
        scaled = batch["x"] * 2
        if write == "a new key":
            batch["scaled"] = scaled
        else:
            batch["log"].append(scaled.detach())
        return scaled.sum()

    fast = optimize(loss)
    for step in range(2):
        batch = {"x": torch.full((2,), float(step + 1)), "log": []}
        assert float(fast(batch)) == 4.0 * (step + 1)
        assert ("scaled" in batch) if write == "a new key" else len(batch["log"]) == 1
    assert fast.stats.native == {"trace-unsupported": 2} and not fast.stats.optimized
    assert "writes into the containers of its inputs" in fast.certificates[0].message
