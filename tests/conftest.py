"""Shared test plumbing.

Real-component tests (test hosts, SGLang wheels, servers on loopback) call
:func:`require` for what they need. Where a need cannot be met they are skipped with the
reason — except in CI (``CI`` set), where a missing component is a failure, never a skip.
"""

from __future__ import annotations

import os

import pytest

IN_CI = bool(os.environ.get("CI"))


def require(condition: bool, reason: str) -> None:
    """Skip (locally) or fail (in CI) when a real component the test needs is missing."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"required in CI but unavailable: {reason}")
    pytest.skip(reason)
