"""Fixtures for doctor tests: fact sets captured from real machines (see each file's
``_provenance``) and verbatim strings users reported (``captures.json``, with sources)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


def load_facts(name: str) -> dict:
    return copy.deepcopy(json.loads((FIXTURES / f"{name}.json").read_text()))


@pytest.fixture
def captures() -> dict[str, str]:
    raw = json.loads((FIXTURES / "captures.json").read_text())
    return {key: value["text"] for key, value in raw.items()}


@pytest.fixture
def h200() -> dict:
    return load_facts("h200_sglang_0513")


@pytest.fixture
def rtx5080() -> dict:
    return load_facts("rtx5080_sglang_0_4_9")


@pytest.fixture
def a40() -> dict:
    return load_facts("a40_sglang_0_4_0")
