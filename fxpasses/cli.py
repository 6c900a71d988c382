"""The ``fxpasses`` command line (also ``python -m fxpasses``): ``fxpasses demo``, ``fxpasses
explain`` (see ``fxpasses explain --help``), ``fxpasses --version``.

Subcommands register themselves in :data:`SUBCOMMANDS`: a function that adds its parser to the
subparsers and sets ``run`` (``args -> exit code``) as its default. ``main(argv)`` parses, runs,
and turns a :class:`CliError` into a one-line message and its exit code.

A loss or input factory is named ``module:attr`` (``fxpasses.workloads.pose:DualBranchPoseLoss``)
or ``path/to/file.py:attr`` (the file is imported by path). As ``python file.py`` and
``python -m module`` would, the file's directory and the working directory are put on sys.path
first, so the loss can import its siblings.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import logging
import platform
import re
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from .version import __version__
from .cli_errors import (EXIT_CODES, EXIT_LOAD, EXIT_NOT_APPLIED, EXIT_OK, EXIT_USAGE, CliError,  # noqa: F401 (re-exported)
                         at_least, check_device, failing_as)
from .certificates.io import certificates_of, dumps, load, save
from .draw import RendererMissing, dot_text, find_dot, render
from .log import enable, progress
from .optimize import optimize
from .pipeline import Pass
from .report import build_report, render_report

# -- naming Python objects -------------------------------------------------------------------
def import_file(path: str | Path) -> ModuleType:
    """The module of the Python file at ``path``, imported once under a name made from its path."""
    path = Path(path)
    name = "fxpasses_file_" + re.sub(r"\W", "_", str(path.resolve()))
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it, as import does (dataclasses need it)
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def _importable_from(*folders: str | Path) -> None:
    """Put ``folders`` first on sys.path (in this order), once each."""
    for folder in reversed([str(Path(f).resolve()) for f in folders]):
        if folder not in sys.path:
            sys.path.insert(0, folder)


def load_object(spec: str) -> Any:
    """The object named ``module:attr`` or ``file.py:attr`` (``attr`` may be dotted); the
    file's directory (for a file) and the working directory are put on sys.path first."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise CliError(f"{spec!r} is not module:attr or file.py:attr", EXIT_USAGE)
    if where.endswith(".py"):
        _importable_from(Path(where).parent, Path.cwd())
        module = import_file(where)
    else:
        _importable_from(Path.cwd())
        module = importlib.import_module(where)
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _is_factory(obj: Any) -> bool:
    """A class, or a function that needs no argument."""
    if isinstance(obj, type):
        return True
    if not inspect.isfunction(obj):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in inspect.signature(obj).parameters.values())


def make_loss(obj: Any) -> Any:
    """``obj`` if it is a loss (an nn.Module or a callable taking inputs), else ``obj()``."""
    loss = obj() if _is_factory(obj) else obj
    if not callable(loss):
        raise CliError(f"{loss!r} is not a loss (an nn.Module or a callable)")
    return loss


def make_inputs(obj: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` from an input factory (or value): it gives ``(args_tuple, kwargs_dict)``,
    an args ``tuple``, or any other single value, which is the one argument."""
    value = obj() if callable(obj) else obj
    if type(value) is tuple and len(value) == 2 and type(value[0]) is tuple \
            and isinstance(value[1], dict):
        return value[0], dict(value[1])
    return (value, {}) if type(value) is tuple else ((value,), {})


def _known_passes() -> dict[str, type]:
    with failing_as("import fxpasses.passes"):
        module = importlib.import_module("fxpasses.passes")
    return {name: obj for name, obj in vars(module).items()
            if isinstance(obj, type) and callable(getattr(obj, "run", None))}


def resolve_passes(names: str) -> list[Pass]:
    """Pass instances for ``"PairRLE,CaptureLoss"``: names in fxpasses.passes, or module:attr."""
    passes = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        if ":" in name:
            with failing_as(f"load pass {name}"):
                obj = load_object(name)
        else:
            known = _known_passes()
            if name not in known:
                raise CliError(f"unknown pass {name!r}; fxpasses.passes has: "
                               f"{', '.join(sorted(known)) or 'none'} (or give module:Class)",
                               EXIT_USAGE)
            obj = known[name]
        passes.append(obj() if isinstance(obj, type) else obj)
    return passes


# -- fxpasses explain ------------------------------------------------------------------------
EXPLAIN_HELP = """Explain what fxpasses did to a loss: the pipeline; per pass the sites seen,
applied and refused by code; every certificate with its checks and evidence; run-time counters
(optimized vs native calls by reason, per-site counters such as replays and recordings); the
before/after graph diff.

TARGET is a saved certificate file (FILE.json, from OptimizedLoss.save_certificates or --save),
or a loss named module:attr or file.py:attr: an nn.Module or callable loss, or a class or
zero-argument function that returns one. A loss needs --inputs: a zero-argument function (or a
value) giving (args_tuple, kwargs_dict), an args tuple, or a single argument. The loss is
optimized with --passes and called --calls times (each followed by backward).

examples:
  fxpasses explain fxpasses.workloads.pose:DualBranchPoseLoss \\
      --inputs fxpasses.workloads.pose:make_batch --passes PairRLE,CaptureLoss --save pose.json
  fxpasses explain pose.json --require-applied PairRLE --svg pose.svg
"""


def add_explain(subparsers: Any) -> None:
    p = subparsers.add_parser("explain", help="report what fxpasses rewrote, refused and ran",
                              description=EXPLAIN_HELP, epilog=EXIT_CODES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="TARGET", help="FILE.json, module:attr or file.py:attr")
    p.add_argument("--inputs", metavar="SPEC", help="input factory, module:attr or file.py:attr")
    p.add_argument("--passes", default="", metavar="A,B",
                   help="passes by class name in fxpasses.passes (or module:attr), in order")
    p.add_argument("--calls", type=at_least(1), default=2, metavar="N",
                   help="calls to run, at least 1 (default 2)")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed before loading (0)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--brief", action="store_true",
                   help="leave out each check's evidence; fold long lists of nodes and guards")
    p.add_argument("--no-diff", action="store_true", help="leave out the graph diff")
    p.add_argument("--device", default="cpu",
                   help="move the loss and its input tensors to this device (default cpu)")
    p.add_argument("--save", metavar="PATH", help="also write the report to PATH (JSON)")
    p.add_argument("--svg", metavar="PATH", help="draw before/after graphs (needs Graphviz dot)")
    p.add_argument("--png", metavar="PATH", help="as --svg, in PNG")
    p.add_argument("--dot", metavar="PATH", help="write the drawing as DOT text (no Graphviz)")
    p.add_argument("--specialization", type=at_least(0), default=0, metavar="I",
                   help="which specialization to draw, from 0 (default 0)")
    p.add_argument("--require-applied", action="append", default=[], metavar="PASS",
                   help="exit 1 unless a certificate of PASS says applied (repeatable, or A,B)")
    p.set_defaults(run=run_explain)


def _backward(out: Any) -> None:
    grads = [t.sum() for t in pytree.tree_leaves(out)
             if isinstance(t, torch.Tensor) and t.requires_grad]
    if grads:
        sum(grads).backward()


def _on_device(device: torch.device, loss: Any, call_args: tuple, call_kwargs: dict) -> tuple:
    """The loss's modules and the input tensors on ``device`` (leaves keep requires_grad)."""
    if isinstance(loss, torch.nn.Module):
        loss.to(device)
    else:
        for value in vars(loss).values():
            if isinstance(value, torch.nn.Module):
                value.to(device)

    def move(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return t.detach().to(device).requires_grad_(t.requires_grad) if t.is_leaf else t.to(device)

    return loss, pytree.tree_map(move, tuple(call_args)), pytree.tree_map(move, dict(call_kwargs))


def _live_report(args: argparse.Namespace) -> dict[str, Any]:
    if not args.inputs:
        raise CliError(f"{args.target} is a loss: give its inputs with --inputs module:attr",
                       EXIT_USAGE)
    passes = resolve_passes(args.passes)
    device = check_device(args.device)
    if not passes:
        print("fxpasses: no --passes given: the loss is traced and run with none (name them, "
              "e.g. --passes PairRLE,SelectRows,CaptureLoss)", file=sys.stderr)
    torch.manual_seed(args.seed)
    with failing_as(f"load the loss {args.target}"):
        loss = make_loss(load_object(args.target))
    with failing_as(f"make inputs with {args.inputs}"):
        call_args, call_kwargs = make_inputs(load_object(args.inputs))
    with failing_as(f"move the loss and inputs to {device}"):
        loss, call_args, call_kwargs = _on_device(device, loss, call_args, call_kwargs)
    fast = optimize(loss, passes)
    with failing_as(f"run the loss {args.target}"):
        for _ in progress(range(args.calls), what="calls"):
            _backward(fast(*call_args, **call_kwargs))
    return build_report(fast)


def _report(args: argparse.Namespace) -> dict[str, Any]:
    if args.target.endswith(".json"):
        with failing_as(f"load {args.target}"):
            return load(args.target)
    if ":" not in args.target:
        raise CliError(f"TARGET {args.target!r} is neither FILE.json nor module:attr", EXIT_USAGE)
    return _live_report(args)


def _normal(name: str) -> str:
    return re.sub(r"[-_]", "", name).lower()


def not_applied(report: dict[str, Any], names: list[str]) -> dict[str, str]:
    """For each pass name (class or pass name, any case) that no certificate records as applied:
    why, in words (the codes of its certificates, counted)."""
    applied: set[str] = set()
    codes: dict[str, Counter] = {}
    for cert in certificates_of(report):
        key = _normal(cert.pass_name)
        if cert.applied:
            applied.add(key)
        codes.setdefault(key, Counter()).update(cert.codes)
    pipeline = {_normal(p) for p in report["pipeline"]}
    out = {}
    for name in (n.strip() for arg in names for n in arg.split(",") if n.strip()):
        key = _normal(name)
        if key not in applied:
            why = ", ".join(f"{code}: {n}" for code, n in codes.get(key, Counter()).items())
            out[name] = why or ("not in the pipeline" if key not in pipeline else "no site seen")
    return out


def run_explain(args: argparse.Namespace) -> int:
    pictures = [(path, fmt) for fmt in ("svg", "png") if (path := getattr(args, fmt))]
    if pictures:
        try:
            find_dot()  # before running anything
        except RendererMissing as exc:
            raise CliError(str(exc)) from None
    report = _report(args)
    made = len(report["specializations"])
    if args.specialization >= made:
        raise CliError(f"--specialization {args.specialization}: the report has {made} "
                       f"specialization(s)" + (f", 0 to {made - 1}" if made else ""), EXIT_USAGE)
    if args.save:
        with failing_as(f"save {args.save}"):
            save(report, args.save)
    sys.stdout.write(dumps(report) if args.json else
                     render_report(report, verbose=not args.brief, diff=not args.no_diff) + "\n")
    if args.dot or pictures:
        with failing_as("draw the graphs"):
            text = dot_text(report, args.specialization)
            if args.dot:
                Path(args.dot).write_text(text, encoding="utf-8")
            for path, fmt in pictures:
                render(text, path, fmt)
    missing = not_applied(report, args.require_applied)
    for name, why in missing.items():
        print(f"fxpasses: {name} did not apply: {why}", file=sys.stderr)
    return EXIT_NOT_APPLIED if missing else EXIT_OK


# -- the command -----------------------------------------------------------------------------
def add_demo(subparsers: Any) -> None:
    from .demo import add_demo as add  # imports the workload only when the parser is built
    add(subparsers)


SUBCOMMANDS: tuple[Callable[[Any], None], ...] = (add_demo, add_explain)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxpasses", epilog=EXIT_CODES,
                                     description="Certified torch.fx rewrites of training losses.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log progress (-v: INFO, -vv: DEBUG); or set FXPASSES_LOG")
    parser.add_argument("--version", action="version",
                        version=f"fxpasses {__version__} (torch {torch.__version__}, python "
                                f"{platform.python_version()})")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (see EXIT_CODES)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) and usage errors (2), already printed by argparse
        return int(exc.code or 0)
    if args.verbose:
        enable(logging.DEBUG if args.verbose > 1 else logging.INFO)
    try:
        return args.run(args)
    except CliError as exc:
        print(f"fxpasses: error: {exc}", file=sys.stderr)
        return exc.code


if __name__ == "__main__":
    sys.exit(main())
