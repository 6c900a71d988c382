"""fxpasses.steps: one training step of a loss, and the differences of two losses' steps."""

import math

import torch

from fxpasses.steps import differences, grad_leaves, step


def inputs():
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(5, 3, generator=g, requires_grad=True),
            "mask": torch.rand(5, generator=g) > 0.5, "w": torch.randn(3, generator=g)}


def loss(batch):
    return {"total": (batch["x"] * batch["w"]).sum() ** 2, "aux": batch["x"].sum()}


def total(out):
    return out["total"]


def test_a_step_clears_the_grads_and_backpropagates_the_objective():
    batch = inputs()
    assert grad_leaves(batch) == [batch["x"]]
    batch["x"].grad = torch.full_like(batch["x"], 7.0)  # stale: must not accumulate
    out = step(loss, batch, total)
    expected = 2 * (batch["x"] * batch["w"]).sum() * batch["w"].expand(5, 3)
    torch.testing.assert_close(batch["x"].grad, expected.detach())
    assert set(out) == {"total", "aux"}


def test_identical_losses_differ_by_nothing():
    assert differences(loss, loss, inputs(), total) == (0.0, 0.0)


def test_a_planted_difference_in_value_or_gradient_is_measured():
    def scaled(batch):
        return {"total": loss(batch)["total"] * (1 + 1e-3)}

    def shifted_gradient(batch):  # same value, gradient of x changed
        x = batch["x"]
        return {"total": loss(batch)["total"] + (x - x.detach()).sum()}

    value_diff, grad_diff = differences(loss, scaled, inputs(), total)
    assert math.isclose(value_diff, 1e-3, rel_tol=1e-4) and math.isclose(grad_diff, 1e-3, rel_tol=1e-4)
    value_diff, grad_diff = differences(loss, shifted_gradient, inputs(), total)
    assert value_diff == 0.0 and grad_diff > 0


def test_a_gradient_missing_on_one_side_is_an_infinite_difference():
    def detached(batch):
        return {"total": loss(batch)["total"].detach() + batch["x"].sum() * 0}

    def no_grad_at_all(batch):
        return {"total": loss(batch)["total"].detach().requires_grad_()}

    assert differences(loss, no_grad_at_all, inputs(), total)[1] == math.inf
    assert differences(loss, detached, inputs(), total)[1] > 0  # zeros: a full difference


def test_a_zero_reference_value_gives_the_absolute_difference():
    zero = lambda batch: batch["x"].sum() * 0  # noqa: E731
    one = lambda batch: batch["x"].sum() * 0 + 1  # noqa: E731
    assert differences(zero, one, inputs())[0] == 1.0
