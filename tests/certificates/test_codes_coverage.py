"""Every code in the registry is exercised: some test asserts it by name."""

from __future__ import annotations

from pathlib import Path

from fxpasses.certificates import REGISTRY

TESTS = Path(__file__).resolve().parents[1]


def test_every_registered_code_is_asserted_by_a_test():
    sources = "".join(p.read_text() for p in TESTS.rglob("test_*.py") if p.name != Path(__file__).name)
    missing = [code for code in REGISTRY if f'"{code}"' not in sources]
    assert not missing, f"codes no test asserts: {missing}"
