"""A region that records again names what moved: the input, the part of its signature, and both
values (fxpasses.runtime.recording_change), counted per region and shown by stats and explain()."""

import torch

from fxpasses.runtime.capture import CapturedRegion
from fxpasses.runtime.emulated import EmulatedRecorder


def _again(region):
    return dict(region.changes)


def _region():
    return CapturedRegion("r", lambda x, w, rows: (x * w).exp()[:rows], recorder=EmulatedRecorder(),
                          max_recordings=8, input_names=("pred", "o2m_weight", "rows"))


def test_a_changed_constant_is_named_with_both_values():
    region = _region()
    x = torch.randn(4, 3, requires_grad=True)
    for w in (0.8, 0.8, 0.1):
        region(x, w, 4).sum().backward()
    assert region.counters["recorded"] == 2 and region.counters["replayed"] == 3
    assert _again(region) == {"o2m_weight value: 0.8 -> 0.1": 1}


def test_the_nearest_recording_is_compared_and_shapes_and_grad_mode_are_named():
    region = _region()
    x = torch.randn(4, 3, requires_grad=True)
    region(x, 0.5, 4).sum().backward()
    region(torch.randn(5, 3, requires_grad=True), 0.5, 4).sum().backward()
    region(torch.randn(5, 3, requires_grad=True), 0.5, 2).sum().backward()  # nearest: the (5, 3) one
    with torch.no_grad():
        region(x, 0.5, 4)
    again = _again(region)
    ambient = [k for k in again if k.startswith("grad mode / autocast: (True,")]
    assert len(ambient) == 1 and "-> (False," in ambient[0], again
    assert again == {"pred shape: (4, 3) -> (5, 3)": 1, "rows value: 4 -> 2": 1, ambient[0]: 1}
