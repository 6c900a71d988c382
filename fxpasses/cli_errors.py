"""What the command line's subcommands share: exit codes, the one-line error and its code,
and the ``--device`` check (the demo's and ``explain``'s)."""

from __future__ import annotations

import argparse
import contextlib
from typing import Callable, Iterator

import torch

EXIT_OK, EXIT_NOT_APPLIED, EXIT_USAGE, EXIT_LOAD = 0, 1, 2, 3
EXIT_CODES = f"""exit codes:
  {EXIT_OK}  ok
  {EXIT_NOT_APPLIED}  no certificate of a --require-applied pass says applied (refused, or absent)
  {EXIT_USAGE}  usage error: bad option, unknown pass name, missing --inputs
  {EXIT_LOAD}  the loss, its inputs or the report could not be loaded or run (a report that
     fails its schema or integrity checks included), or the renderer for --svg/--png
     (Graphviz's dot) is missing"""


class CliError(Exception):
    """A failure to report in one line, with the exit code it maps to."""

    def __init__(self, message: str, code: int = EXIT_LOAD):
        super().__init__(message)
        self.code = code


@contextlib.contextmanager
def failing_as(what: str) -> Iterator[None]:
    """Turn any exception but a CliError into ``CliError("could not {what}: ...")`` (exit 3)."""
    try:
        yield
    except CliError:
        raise
    except Exception as exc:
        raise CliError(f"could not {what}: {type(exc).__name__}: {exc}") from exc


# -- options ----------------------------------------------------------------------------------
def at_least(least: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``least`` (anything else is argparse's usage error)."""
    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value
    return integer


def check_device(text: str) -> torch.device:
    """``--device`` as a torch.device; a usage error (one line, exit 2) for a name torch does not
    know or a CUDA device this machine does not have."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise CliError(f"--device {text!r} is not a torch device", EXIT_USAGE) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CliError(f"--device {text}: this torch ({torch.__version__}) sees no CUDA "
                           f"device; run with --device cpu", EXIT_USAGE)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise CliError(f"--device {text}: there are {torch.cuda.device_count()} CUDA "
                           f"device(s)", EXIT_USAGE)
    return device
