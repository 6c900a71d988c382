"""The trainer's AMP check without a network, as on a GPU machine that reaches nothing.

On an accelerator the trainer's ``check_amp`` loads ``yolo26n.pt`` (downloaded when missing) to
compare FP32 and AMP predictions. Offline the download raises ConnectionError, which the check
catches: AMP stays on. Its model here sits on the ``meta`` device, which takes the accelerator's
path of the check (a CPU model returns False before it); the network is cut at name resolution
(nothing resolves) or at connection (names resolve, connections are refused: there the download
retries with sleeps of 5, 10 and 20 s unless ``YOLO_OFFLINE=1``, which ``bench/fit.py`` sets).
"""

from __future__ import annotations

import socket
import time

import pytest
import torch

CLOSED_PORT = 9  # discard: nothing listens on the loopback here


def _no_name_resolves(*args, **kwargs):
    raise socket.gaierror(socket.EAI_NONAME, "no network")


def _every_name_is_a_closed_port(host, port, *args, **kwargs):
    return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", CLOSED_PORT))]


@pytest.mark.parametrize("cut, offline_env", [(_no_name_resolves, None),
                                              (_every_name_is_a_closed_port, "1")])
def test_the_amp_check_offline_keeps_amp_on_at_once(cut, offline_env, monkeypatch):
    from ultralytics.utils import WEIGHTS_DIR
    from ultralytics.utils.checks import check_amp

    if (WEIGHTS_DIR / "yolo26n.pt").exists():
        pytest.skip(f"{WEIGHTS_DIR / 'yolo26n.pt'} is here: the check downloads nothing")
    monkeypatch.setattr(socket, "getaddrinfo", cut)
    if offline_env is None:
        monkeypatch.delenv("YOLO_OFFLINE", raising=False)
    else:
        monkeypatch.setenv("YOLO_OFFLINE", offline_env)
    for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    model = torch.nn.Linear(1, 1, device="meta")
    start = time.perf_counter()
    assert check_amp(model) is True
    assert time.perf_counter() - start < 4.0  # one attempt: no retry sleeps
    assert not (WEIGHTS_DIR / "yolo26n.pt").exists()
