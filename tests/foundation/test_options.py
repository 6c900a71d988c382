"""Every bad option is a one-line TypeError or ValueError where it is given, naming the option."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from fxpasses import optimize
from fxpasses.passes import CaptureLoss, PairCalls, PairRLE, SelectRows


def _loss(a, b):
    return (a * b).sum()


_OPTIMIZE = [  # (options of optimize(), exception, the option's name)
    ({"density_methods": "log_prob"}, TypeError, "density_methods"),
    ({"density_methods": ["log prob"]}, ValueError, "density_methods"),
    ({"density_methods": [3]}, TypeError, "density_methods"),
    ({"density_methods": None}, TypeError, "density_methods"),
    ({"leaf_functions": [1]}, TypeError, "leaf_functions"),
    ({"leaf_functions": abs}, TypeError, "leaf_functions"),
    ({"leaf_functions": [nn.Linear]}, TypeError, "leaf_functions"),
    ({"leaf_modules": [3]}, TypeError, "leaf_modules"),
    ({"leaf_modules": ["flow"]}, TypeError, "leaf_modules"),
    ({"leaf_modules": nn.Linear}, TypeError, "leaf_modules"),
    ({"leaf_modules": [int]}, TypeError, "leaf_modules"),
    ({"max_specializations": 0}, ValueError, "max_specializations"),
    ({"max_specializations": 2.0}, TypeError, "max_specializations"),
    ({"max_specializations": True}, TypeError, "max_specializations"),
]


def _id(v) -> str:
    """A parameter's id, stable across processes (no object addresses: xdist compares them)."""
    return re.sub(r" at 0x[0-9a-f]+", "", repr(v))[:40]


@pytest.mark.parametrize("options, error, name", _OPTIMIZE, ids=_id)
def test_a_bad_option_of_optimize_is_an_error_naming_it(options, error, name):
    with pytest.raises(error) as raised:
        optimize(_loss, [PairRLE()], **options)
    assert type(raised.value) is error and name in str(raised.value)
    assert "\n" not in str(raised.value)


def test_good_options_of_optimize_are_taken():
    fast = optimize(_loss, [PairRLE()], density_methods=("log_prob", "score"),
                    leaf_functions=[abs], leaf_modules=[nn.Linear, nn.Linear(2, 2)],
                    max_specializations=3)
    a = torch.randn(3, requires_grad=True)
    assert torch.equal(fast(a, a), _loss(a, a))


_CAPTURE = [(name, value, error) for name, values in {
    "max_recordings": [(0, ValueError), (-1, ValueError), (2.5, TypeError), ("8", TypeError),
                       (True, TypeError)],
    "record_after": [(0, ValueError), (1.0, TypeError), (None, TypeError)],
    "min_region_ops": [(-1, ValueError), (0, ValueError), (4.0, TypeError), (False, TypeError)],
    "min_bucket": [(0, ValueError), (-8, ValueError), (64.0, TypeError)],
    "count_copies": [(1, TypeError), ("no", TypeError), (None, TypeError)],
    "devices": [("cuda", TypeError), ([0], TypeError), ([""], TypeError), (None, TypeError)],
    "recorder": [(object(), TypeError), ("emulated", TypeError)],
}.items() for value, error in values]


@pytest.mark.parametrize("name, value, error", _CAPTURE, ids=_id)
def test_a_bad_option_of_capture_loss_is_an_error_naming_it(name, value, error):
    with pytest.raises(error) as raised:
        CaptureLoss(**{name: value})
    assert type(raised.value) is error and name in str(raised.value)


@pytest.mark.parametrize("value, error", [(0, ValueError), (4.0, TypeError), (True, TypeError)])
def test_a_bad_option_of_select_rows_is_an_error_naming_it(value, error):
    with pytest.raises(error) as raised:
        SelectRows(min_bucket=value)
    assert type(raised.value) is error and "min_bucket" in str(raised.value)


_PAIR = [  # (positional methods, keyword options, exception, the option's name)
    (("no such method",), {}, ValueError, "methods"),
    (("log_prob()",), {}, ValueError, "methods"),
    (("",), {}, ValueError, "methods"),
    ((3,), {}, TypeError, "methods"),
    ((["log_prob"],), {}, TypeError, "methods"),
    ((), {"modules": "flow"}, TypeError, "modules"),
    ((), {"modules": [3]}, TypeError, "modules"),
    ((), {"modules": [nn.Linear(2, 2)]}, TypeError, "modules"),
    ((), {"modules": nn.Linear}, TypeError, "modules"),
    ((), {"modules": [int]}, TypeError, "modules"),
    ((), {"allow_overrides": nn.Linear}, TypeError, "allow_overrides"),
    ((), {"allow_overrides": ["Flow"]}, TypeError, "allow_overrides"),
]


@pytest.mark.parametrize("pass_type", [PairRLE, PairCalls])
@pytest.mark.parametrize("methods, options, error, name", _PAIR, ids=_id)
def test_a_bad_option_of_a_pairing_pass_is_an_error_naming_it(pass_type, methods, options, error, name):
    with pytest.raises(error) as raised:
        pass_type(*methods, **options)
    assert type(raised.value) is error and name in str(raised.value)


def test_a_method_no_module_has_is_found_at_trace_time():
    """``PairRLE("no_such_method")`` names a method: only the traced graph can tell that no
    module of the loss has it, and the pass then refuses with no-site."""
    fast = optimize(_loss, [PairRLE("no_such_method", modules=["flow", nn.Linear],
                                    allow_overrides=(nn.Linear,))])
    a = torch.randn(3)
    assert torch.equal(fast(a, a), _loss(a, a))
    assert [c.codes for c in fast.certificates if c.pass_name == "PairRLE"] == [("no-site",)]
