"""Whether this interpreter finds compiled bytecode for the modules a first call imports lazily.

A first call of an optimized loss imports what a native one never does (torch's fake tensors,
symbolic shapes, sympy): without their ``.pyc`` files (``PYTHONPYCACHEPREFIX`` pointed at an
empty folder, ``PYTHONDONTWRITEBYTECODE`` set, a ``--no-compile`` install) every process compiles
them from source, seconds a process that a pip-installed environment, which compiles them at
install, does not spend. Benchmarks print this, so that a figure says which it measured.
"""

from __future__ import annotations

import importlib.util
import os
import sys

# files the first call imports and a native call does not, under their top-level packages
LAZY = (("torch", "_subclasses/fake_tensor.py"), ("torch", "fx/experimental/symbolic_shapes.py"),
        ("torch", "_dynamo/eval_frame.py"), ("torch", "_refs/__init__.py"), ("sympy", "core/expr.py"))


def bytecode_cache() -> dict:
    """``cached``: how many of :data:`LAZY` have a ``.pyc`` where this interpreter looks
    (``sys.pycache_prefix`` honoured); ``writes``: whether a process writes those it lacks.
    Imports nothing: finding a submodule's spec would import its packages, moving their import
    time out of what a benchmark times next."""
    found = 0
    for package, file in LAZY:
        spec = importlib.util.find_spec(package)  # a top-level spec: found, not imported
        locations = list(getattr(spec, "submodule_search_locations", None) or ())
        if locations:
            source = os.path.join(locations[0], file)
            found += os.path.exists(source) and os.path.exists(importlib.util.cache_from_source(source))
    return {"cached": found, "of": len(LAZY), "writes": not sys.dont_write_bytecode,
            "prefix": sys.pycache_prefix}


def describe() -> str:
    """One line for a benchmark's output."""
    c = bytecode_cache()
    state = "compiled" if c["cached"] == c["of"] else "from source" if not c["cached"] else "partly compiled"
    return (f"bytecode of the first call's lazy imports: {state} ({c['cached']}/{c['of']} cached"
            f"{', prefix ' + c['prefix'] if c['prefix'] else ''}; "
            f"{'writes' if c['writes'] else 'does not write'} what it lacks)")
