"""fxpasses.signature: pytree inputs <-> flat tensor placeholders, constants and output trees."""

import torch

from fxpasses.signature import CallSignature, flatten_call


def _call():
    a, b = torch.randn(3, 2), torch.randn(4, dtype=torch.float64)
    return (a, {"b": b, "scale": 2.0, "name": "x"}), {"flag": True}


def test_tensors_become_placeholders_and_the_rest_constants():
    args, kwargs = _call()
    sig = CallSignature.of_call(args, kwargs, ("pred", "extra"))
    leaves, spec = flatten_call(args, kwargs)
    assert sig.placeholder_names == ("pred", "extra_b")
    assert sorted(type(v).__name__ for _, v in sig.constants) == ["bool", "float", "str"]
    assert sig.matches(leaves, spec)
    (a, rest), kw = sig.rebuild_inputs(sig.tensors(leaves))
    assert a is args[0] and rest["b"] is args[1]["b"] and rest["scale"] == 2.0 and kw == {"flag": True}


def test_a_changed_constant_dtype_or_device_is_another_signature():
    args, kwargs = _call()
    sig = CallSignature.of_call(args, kwargs)
    for changed in [((args[0], {**args[1], "scale": 3.0}), kwargs),
                    ((args[0].double(), args[1]), kwargs),
                    (args, {"flag": False})]:
        leaves, spec = flatten_call(*changed)
        assert not sig.matches(leaves, spec)
    leaves, spec = flatten_call((torch.randn(7, 2), args[1]), kwargs)  # another shape: same
    assert sig.matches(leaves, spec)


def test_objects_compare_by_equality_and_else_by_identity():
    class Opaque:
        def __eq__(self, other):
            raise TypeError("no")

    thing = Opaque()
    sig = CallSignature.of_call((torch.ones(1), thing), {})
    assert sig.matches(*flatten_call((torch.ones(1), thing), {}))
    assert not sig.matches(*flatten_call((torch.ones(1), Opaque()), {}))
