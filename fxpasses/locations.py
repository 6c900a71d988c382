"""Source locations: which frames are the user's, and the user's line for a node or an exception.

Certificates, refusals and recorded exceptions all point at the *user's* code: the innermost frame
outside torch and outside fxpasses' own machinery (the bundled workloads count as user code, so
their certificates name their lines). One rule, used everywhere:

* :func:`node_location` — the user's line of a graph node, from the stack trace torch.fx recorded
  in ``node.meta["stack_trace"]`` (for a node made by torch's own modules only, such as an
  ``nn.Sequential``'s layer call, the innermost ``forward`` frame: the module's line);
* :func:`exception_location` — the user's line of an exception's traceback;
* :func:`failing_node` — the node of a GraphModule whose generated line raised, through the line
  map torch.fx keeps for its generated code (``GraphModule._lineno_map``); :func:`node_at_line`
  the node of any generated line.
"""

from __future__ import annotations

import functools
import linecache
import os
import re
import site
import sys
import sysconfig
import traceback
from dataclasses import dataclass

import torch
import torch.fx as fx

TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(__file__)
_WORKLOADS_DIR = os.path.join(_OWN_DIR, "workloads")
# the random losses of fxpasses.testing are bundled losses too (their settings are the loss's)
_BUNDLED_LOSSES = (_WORKLOADS_DIR, os.path.join(_OWN_DIR, "testing", "loss_programs.py"))
_STDLIB = sysconfig.get_paths()["stdlib"]
# every site-packages directory, not only this environment's: a virtual environment made with
# --system-site-packages sees the base installation's, which lies inside the base's stdlib folder
_INSTALLED = tuple({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                    *getattr(site, "getsitepackages", list)(), site.getusersitepackages()})
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)')


@functools.lru_cache(maxsize=4096)  # asked for every frame a trace's profile hook sees
def is_user_file(path: str) -> bool:
    """Frames outside torch, fxpasses' machinery and Python's standard library (the bundled
    workloads, the random losses of :mod:`fxpasses.testing.loss_programs` and installed
    third-party packages are user code)."""
    if path.startswith(_BUNDLED_LOSSES):
        return True
    if path.startswith(_STDLIB) and not path.startswith(_INSTALLED):
        return False
    return not path.startswith((TORCH_DIR, _OWN_DIR, "<"))


def shown(text: str) -> str:
    """``text`` with installed packages' paths made relative to site-packages and the working
    directory's made relative to it (``ultralytics/utils/loss.py:790``): for reading; reports
    keep the full paths."""
    for prefix in sorted({*_INSTALLED, os.getcwd()}, key=len, reverse=True):
        text = text.replace(prefix.rstrip(os.sep) + os.sep, "")
    return text


def is_user_class(cls: type) -> bool:
    """A class defined in a user file (see :func:`is_user_file`)."""
    module = getattr(sys.modules.get(cls.__module__), "__file__", None) or ""
    return cls.__module__ != "builtins" and bool(module) and is_user_file(module)


@dataclass(frozen=True)
class Location:
    """A line of source: ``file:line``, the function it is in and the line's text."""

    file: str
    line: int
    function: str = ""

    @property
    def text(self) -> str:
        return linecache.getline(self.file, self.line).strip()

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


def stack_frames(stack_trace: str) -> list[Location]:
    """The frames of a recorded stack trace (torch.fx's ``node.meta["stack_trace"]``), outermost first."""
    return [Location(m["file"], int(m["line"]), m["name"]) for m in _FRAME.finditer(stack_trace or "")]


def node_source(node: fx.Node) -> Location | None:
    """The user's line of ``node`` (see the module docstring), or None when nothing is recorded."""
    frames = stack_frames(node.meta.get("stack_trace") or "")
    user = [f for f in frames if is_user_file(f.file)]
    if user:
        return user[-1]
    modules = [f for f in frames if f.file.startswith(TORCH_DIR) and f.function == "forward"]
    return modules[-1] if modules else None


def node_location(node: fx.Node) -> str:
    """``file:line`` of :func:`node_source`, or ''."""
    found = node_source(node)
    return str(found) if found else ""


def exception_location(exc: BaseException) -> Location | None:
    """The innermost frame of ``exc``'s traceback in user code, or None."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if is_user_file(f.filename)]
    if not frames:
        return None
    return Location(frames[-1].filename, frames[-1].lineno or 0, frames[-1].name)


def failing_node(gm: fx.GraphModule, exc: BaseException) -> fx.Node | None:
    """The node whose generated line of ``gm.forward`` was executing when ``exc`` was raised.

    Needs the traceback through ``gm.forward`` itself: call ``gm.forward(...)``, since calling
    ``gm(...)`` re-raises without it.
    """
    filename = gm.forward.__code__.co_filename
    lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == filename]
    return node_at_line(gm, lines[-1]) if lines else None


def node_at_line(gm: fx.GraphModule, line: int) -> fx.Node | None:
    """The node of ``gm`` whose generated line of ``gm.forward`` is ``line`` (a frame's
    ``f_lineno``), through the line map torch.fx keeps for its generated code."""
    line_map = getattr(gm, "_lineno_map", None)
    if not line_map:
        return None
    index = line_map.get(line - _prologue_start(gm))
    nodes = list(gm.graph.nodes)
    return nodes[index] if index is not None and 0 <= index < len(nodes) else None


def _prologue_start(gm: fx.GraphModule) -> int:
    """The line of ``def forward`` in ``gm.code``, from which torch.fx's line map counts.

    torch >= 2.10 records it as ``gm._prologue_start``; before, it is found in the code.
    """
    start = getattr(gm, "_prologue_start", None)
    if start is None:
        lines = gm.code.splitlines()
        start = next((i for i, line in enumerate(lines, 1) if line.startswith("def forward")), 0)
    return start
