"""A stand-in for a torchvision whose compiled ops do not load, for real Ultralytics fits.

A CUDA build of torchvision beside a CPU build of torch fails at ``import torchvision``
(``RuntimeError: operator torchvision::nms does not exist``); Ultralytics' validator and predictor
import it only to prefer its NMS, and fall back to their own pure-torch NMS otherwise. Where that
import raises anything but ImportError, :func:`ensure_torchvision` puts a module named
``torchvision`` in ``sys.modules`` whose ``ops.nms`` is Ultralytics' own ``TorchNMS.nms``, and says
so (returns True). A working torchvision, or none at all, is left alone.
"""

from __future__ import annotations

import sys
import types


def ensure_torchvision() -> bool:
    """True when the stand-in was installed (see the module docstring)."""
    if isinstance(sys.modules.get("torchvision"), types.ModuleType):
        return getattr(sys.modules["torchvision"], "__stand_in__", False)
    try:
        import torchvision  # noqa: F401
        return False
    except ImportError:
        return False
    except Exception:  # noqa: BLE001 - the compiled ops failed to register
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
    from ultralytics.utils.nms import TorchNMS

    stand_in = types.ModuleType("torchvision")
    stand_in.__stand_in__ = True
    stand_in.ops = types.SimpleNamespace(nms=TorchNMS.nms)
    sys.modules["torchvision"] = stand_in
    return True
