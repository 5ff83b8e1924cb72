"""Fixtures for doctor tests: fact sets captured from real machines (see each file's
``_provenance``) and verbatim strings users reported (``captures.json``, with sources)."""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


def load_facts(name: str) -> dict:
    return copy.deepcopy(json.loads((FIXTURES / f"{name}.json").read_text()))


# `ddtree doctor` on an H200 in each state of benchmarks/sglang_h200/doctor_states.sh
# (fixtures/README.md says when, how and with what).
H200_STATES = FIXTURES / "h200_sglang_0517"


def load_h200_state(state: str, kind: str = "facts") -> dict:
    """One state's ``--save-facts`` facts of the local host (kind "facts") or its recorded
    ``doctor --json`` report (kind "doctor"), as written on the H200."""
    data = json.loads(gzip.decompress((H200_STATES / f"{state}.{kind}.json.gz").read_bytes()))
    return data["local"] if kind == "facts" else data


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
