"""Content hashes: of a certificate or a report (canonical JSON), and of a graph (its code).

``content_digest(data)`` is ``"sha256:"`` and the SHA-256 of ``data``'s canonical JSON (keys
sorted, no whitespace, strict), leaving out a top-level ``"digest"`` key: the value stored under
that key in a certificate or a report file. It detects any edit made after writing — by a person
or a tool that does not recompute it — not a forgery: anyone can recompute a plain hash.
``code_fingerprint(code)`` is the graph fingerprint the pipeline records for each step, a hash of
the code torch.fx generated for the graph (``fingerprint(gm)``), so a recorded step can be checked
against its code.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import torch.fx as fx

DIGEST_KEY = "digest"
ALGORITHM = "sha256"


def canonical_json(data: Any) -> str:
    """``data`` as one canonical JSON text (the form that is hashed)."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def content_digest(data: Mapping[str, Any]) -> str:
    """``"sha256:<hex>"`` of ``data`` without its ``"digest"`` key (see the module docstring)."""
    body = {key: value for key, value in data.items() if key != DIGEST_KEY}
    return f"{ALGORITHM}:" + hashlib.sha256(canonical_json(body).encode()).hexdigest()


def code_fingerprint(code: str) -> str:
    """The fingerprint of a graph whose generated code is ``code`` (16 hex digits)."""
    return hashlib.sha256(code.encode()).hexdigest()[:16]


def fingerprint(gm: fx.GraphModule) -> str:
    """The fingerprint of ``gm``'s graph: :func:`code_fingerprint` of its generated code."""
    return code_fingerprint(gm.graph.python_code("self").src)
