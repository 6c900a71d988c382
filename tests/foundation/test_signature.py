"""fxpasses.signature: pytree inputs <-> graph inputs (tensors, floats, objects) and constants."""

import torch

from fxpasses.signature import CallSignature, flatten_call


def _call():
    a, b = torch.randn(3, 2), torch.randn(4, dtype=torch.float64)
    return (a, {"b": b, "scale": 2.0, "name": "x"}), {"flag": True}


def test_tensors_and_floats_become_inputs_and_the_rest_constants():
    args, kwargs = _call()
    sig = CallSignature.of_call(args, kwargs, ("pred", "extra"))
    leaves, spec = flatten_call(args, kwargs)
    assert sig.placeholder_names == ("pred", "extra_b", "extra_scale")
    assert sorted(type(v).__name__ for _, v in sig.constants) == ["bool", "str"]
    assert sig.matches(leaves, spec)
    (a, rest), kw = sig.rebuild_inputs(sig.inputs(leaves))
    assert a is args[0] and rest["b"] is args[1]["b"] and rest["scale"] == 2.0 and kw == {"flag": True}


def test_a_changed_constant_dtype_or_device_is_another_signature():
    args, kwargs = _call()
    sig = CallSignature.of_call(args, kwargs)
    for changed in [((args[0], {**args[1], "name": "y"}), kwargs),
                    ((args[0].double(), args[1]), kwargs),
                    ((args[0][0], args[1]), kwargs),  # another rank
                    ((args[0], {**args[1], "scale": 3}), kwargs),  # an int where a float was
                    (args, {"flag": False})]:
        leaves, spec = flatten_call(*changed)
        assert not sig.matches(leaves, spec)
    for same in [((torch.randn(7, 2), args[1]), kwargs),  # another shape
                 ((args[0], {**args[1], "scale": 3.5}), kwargs)]:  # another float: an input
        assert sig.matches(*flatten_call(*same))


def test_objects_are_inputs_matched_by_type():
    class Config:
        gain = 2.0

    class Other:
        gain = 2.0

    sig = CallSignature.of_call((torch.ones(1), Config()), {})
    assert sig.placeholder_names == ("arg_0", "arg_1")  # read through on each call (sources)
    assert sig.matches(*flatten_call((torch.ones(1), Config()), {}))
    assert not sig.matches(*flatten_call((torch.ones(1), Other()), {}))
