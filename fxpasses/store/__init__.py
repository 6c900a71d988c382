"""Pipeline results kept across processes: a trace's passes run once per key, not per process.

``optimize(loss, passes, store="~/.cache/fxpasses")`` keeps, after the passes ran on a trace, the
rewritten graph with its certificates in that directory, under a key of everything the pipeline
read (:mod:`.key`); a later process that traces the same loss to the same graph, with the same
assumptions, structure, sources, passes, versions and device, reads the result back instead of
running the passes (:mod:`.pickling`: the loss's own objects rebound by path, a call's state
started fresh, the generated code checked against the code stored). Every lookup is certified
(pass name ``store``): the key, the entry read or why none was (no entry; which parts the newest
entry's key differs in; an entry that could not be used), and where the result was stored or
why it could not be. The passes' own certificates are the stored ones: their evidence (witness
runs included) was taken in the process that stored them, on its first call, as within one
process it serves every later call.

A directory's entries (about 2.5 MB each for the real criterion) are kept under
:data:`MAX_BYTES`: the least recently read or written are removed first. Reading one runs
pickle: a store directory must be as trusted as the code that reads it.

This is what torch's own caches do for compiled code (Inductor's FX graph cache), with the key
written by hand: no platform cache keys a concretely traced graph with run-time guards.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch.fx as fx

from ..certificates import Certificate, Check, Site
from ..certificates.digest import canonical_json, fingerprint
from ..ir.runtime_op import RuntimeOp
from ..log import logger
from ..pipeline import PipelineRun
from .key import FORMAT, Unkeyable, differences, key_of, key_parts
from .live import LiveObjects, live_objects
from .pickling import NotStorable, StaleResult, dumps, loads

_SITE = Site((), (), "the pipeline's result")
MAX_BYTES = 2**30  # a directory's entries beyond this: the least recently used are removed


@dataclass
class Lookup:
    """One trace's lookup: the result read (or None), its certificate's evidence so far, and
    what :meth:`keep` needs to store the result of a pipeline that ran instead."""

    store: "ResultStore"
    run: PipelineRun | None
    evidence: dict[str, Any]
    code: str | None
    key: str | None = None
    parts: dict[str, Any] | None = None
    live: LiveObjects | None = None
    stored: Check | None = None

    def refuse(self, why: str) -> None:
        """Do not use the result read (it does not fit this loss): the passes run instead."""
        self.run, self.code = None, "stored-result-unusable"
        self.evidence["why"] = why[:400]

    def keep(self, run: PipelineRun, seconds: float) -> None:
        """Store ``run`` (a pipeline that ran on this key's trace), unless the key failed."""
        if self.key is None:
            return
        try:
            where = self.store.write(self.key, self.parts, run, self.live, seconds)
        except (NotStorable, OSError) as exc:
            self.stored = Check("result-stored", False, {"why": f"{type(exc).__name__}: {exc}"[:400]},
                                "result-not-storable")
            return
        self.stored = Check("result-stored", True, {"path": str(where)})

    @property
    def certificate(self) -> Certificate:
        checks = [Check("stored-result", self.run is not None, self.evidence, self.code)]
        if self.stored is not None:
            checks.append(self.stored)
        return Certificate.from_checks("store", _SITE, checks)


class ResultStore:
    """A directory of stored pipeline results, one file per key (written whole, then renamed)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory).expanduser()

    def __repr__(self) -> str:
        return f"ResultStore({str(self.directory)!r})"

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.fxresult"

    def lookup(self, loss: Any, gm: fx.GraphModule, assumptions: Sequence[Any], passes: Sequence[Any],
               inputs: Sequence[Any]) -> Lookup:
        """The stored result for this trace, or None with the reason (see the module docstring)."""
        start = time.perf_counter()
        live = live_objects(loss)
        try:
            parts = key_parts(live, gm, assumptions, passes, inputs)
        except Unkeyable as exc:
            return Lookup(self, None, {"why": str(exc)[:400]}, "result-unkeyable")
        key = key_of(parts)
        evidence: dict[str, Any] = {"key": key, "directory": str(self.directory),
                                    "key_s": round(time.perf_counter() - start, 3)}
        return self.look_again(Lookup(self, None, evidence, None, key, parts, live), loss)

    def look_again(self, found: Lookup, loss: Any) -> Lookup:
        """``found`` (a lookup's key, made earlier) with the entry stored under it now, if any."""
        key, evidence = found.key, found.evidence
        if not self.path(key).exists():
            found.code = "stored-result-absent"
            evidence["nearest_entry_differs_in"] = self._nearest_differences(found.parts)
            return found
        start = time.perf_counter()
        try:
            found.run = self.read(key, loss)
        except StaleResult as exc:
            found.code = "stored-result-unusable"
            evidence["why"] = str(exc)[:400]
            logger.warning("stored pipeline result %s not used: %s", key[:12], exc)
            return found
        found.code = None
        evidence["read_s"] = round(time.perf_counter() - start, 3)
        evidence["made"] = self._made(key)
        return found

    def write(self, key: str, parts: dict[str, Any], run: PipelineRun, live: LiveObjects,
              seconds: float) -> Path:
        """Store ``run`` under ``key``; raises NotStorable or OSError."""
        data = dumps(run, live)
        made = {"host": platform.node(), "pid": os.getpid(), "pipeline_s": round(seconds, 3),
                "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "code": run.snapshots[-1].fingerprint}
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.path(key)
        partial = target.with_suffix(f".{os.getpid()}.{threading.get_ident()}.partial")
        partial.write_bytes(json.dumps({"format": FORMAT, "key": key, "made": made}).encode() + b"\n" + data)
        os.replace(partial, target)
        target.with_suffix(".parts.json").write_text(canonical_json(parts))
        self._evict(keep=target)
        return target

    def _evict(self, keep: Path) -> None:
        """Remove the least recently used entries (read or written) while the directory's
        entries hold more than :data:`MAX_BYTES`; never ``keep``."""
        entries = []
        for entry in self.directory.glob("*.fxresult"):
            try:
                stat = entry.stat()
            except OSError:  # removed by another process meanwhile
                continue
            entries.append((stat.st_mtime, stat.st_size, entry))
        total = sum(size for _, size, _ in entries)
        for _, size, entry in sorted(entries, key=lambda e: e[0]):
            if total <= MAX_BYTES:
                break
            if entry != keep:
                for path in (entry, entry.with_suffix(".parts.json")):
                    path.unlink(missing_ok=True)
                total -= size

    def read(self, key: str, loss: Any) -> PipelineRun:
        """The result stored under ``key``, rebound to ``loss``; raises StaleResult."""
        try:
            first, data = self.path(key).read_bytes().split(b"\n", 1)
            header = json.loads(first)
        except (OSError, ValueError) as exc:
            raise StaleResult(f"unreadable entry: {type(exc).__name__}: {exc}"[:300]) from exc
        if header.get("format") != FORMAT or header.get("key") != key:
            raise StaleResult(f"entry of format {header.get('format')} for key {header.get('key')}")
        run = loads(data, loss)
        if not isinstance(run, PipelineRun) or fingerprint(run.graph_module) != header["made"]["code"]:
            raise StaleResult("the graph read back does not generate the code stored")
        try:
            os.utime(self.path(key))  # used now: the last to be removed (_evict)
        except OSError:
            pass
        for module in run.graph_module.modules():  # counts are this process's own
            if isinstance(module, fx.GraphModule):
                for node in module.graph.nodes:
                    if isinstance(node.target, RuntimeOp):
                        node.target.counters.clear()
        return run

    def _made(self, key: str) -> dict[str, Any]:
        with open(self.path(key), "rb") as f:
            return json.loads(f.readline())["made"]

    def _nearest_differences(self, parts: dict[str, Any]) -> list[str] | None:
        """The parts in which the newest stored entry's key differs from ``parts`` (None: none)."""
        entries = sorted(self.directory.glob("*.parts.json"), key=lambda p: p.stat().st_mtime) \
            if self.directory.is_dir() else []
        for entry in reversed(entries):
            try:
                return differences(json.loads(entry.read_text()), parts)
            except (OSError, ValueError):
                continue
        return None
