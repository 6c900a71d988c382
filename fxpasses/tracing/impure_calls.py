"""Values the loss takes from outside torch that change from call to call, refused while tracing.

A trace keeps every Python number it does not follow as a constant of the graph. A number the
loss draws from Python's ``random``, from ``numpy.random``, from a clock or from the operating
system's entropy is a different one on every native call: a graph would repeat the first call's
forever, a silently stale value. :func:`per_call_sources` names the module functions that give
such values; while a trace runs each is replaced by one that refuses the trace when the loss's
own code (a user file) calls it.

Seen: calls through the module (``random.random()``, ``random.uniform(a, b)``, ``np.random.rand()``,
``time.time()``, ``os.urandom(n)``). Not seen: a function bound to another name before the trace
(``from random import random``), a ``random.Random`` or numpy ``Generator`` made outside the loss
and drawn from inside it, ``np.random.default_rng()`` and ``uuid``/``secrets`` (they draw through
the standard library, not the loss's code). A ``random.Random(seed)`` made inside the loss draws
the same numbers on every call, natively too: a constant, rightly.

Written by hand: a concrete trace runs Python; Dynamo's table of such functions
(``torch._dynamo.trace_rules``) belongs to its own bytecode tracer.
"""

from __future__ import annotations

import os
import random
import sys
import time
from types import ModuleType

CLOCKS = ("time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns",
          "process_time", "process_time_ns", "thread_time", "thread_time_ns")


def per_call_sources() -> list[tuple[ModuleType, str]]:
    """(module, name) of each function whose value differs per call: ``random``'s functions
    (methods of its hidden generator), numpy's global-state random functions when numpy is
    imported, the ``time`` clocks and ``os.urandom``."""
    hidden = getattr(random, "_inst", None)
    found = [(random, n) for n in random.__all__ if getattr(getattr(random, n), "__self__", None) is hidden]
    module = sys.modules.get("numpy.random")
    state = getattr(module, "mtrand", None)
    found += [(module, n) for n in getattr(module, "__all__", ())
              if isinstance(getattr(getattr(module, n, None), "__self__", None), getattr(state, "RandomState", ()))]
    found += [(time, n) for n in CLOCKS if hasattr(time, n)]
    return found + [(os, "urandom")]
