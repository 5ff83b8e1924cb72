"""Prompt sets: built-ins, JSONL and ShareGPT files, random prompts, and their errors."""

from __future__ import annotations

import json

import pytest

from ddtree_cli.bench.workloads import BUILTIN, load_file, load_workload
from ddtree_cli.errors import ConfigError


@pytest.mark.parametrize("name", BUILTIN)
def test_builtin_sets_are_a_few_dozen_distinct_prompts(name):
    prompts = load_workload(name, 40)
    assert len({p.text for p in prompts}) == 40
    assert all(p.text and p.id.startswith(name) for p in prompts)


def test_selection_depends_only_on_dataset_count_and_seed():
    a = load_workload("math", 10, seed=3)
    assert a == load_workload("math", 10, seed=3)
    assert a != load_workload("math", 10, seed=4)
    # A larger request extends the same order, so a prefix stays a prefix.
    assert load_workload("math", 12, seed=3)[:10] == a


def test_random_prompts_are_words_and_reproducible():
    a = load_workload("random", 4, seed=1, random_input_len=7)
    assert a == load_workload("random", 4, seed=1, random_input_len=7)
    assert all(len(p.text.split()) == 7 for p in a)


def test_jsonl_with_text_and_input_ids(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"id": "a", "prompt": "hello"})
        + "\n\n"
        + json.dumps({"input_ids": [1, 2, 3]})
        + "\n"
    )
    prompts = load_file(path)
    assert prompts[0].payload() == {"text": "hello"}
    assert prompts[1].payload() == {"input_ids": [1, 2, 3]}


def test_sharegpt_takes_the_first_human_turn_and_skips_empty_records(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(
        json.dumps(
            [
                {
                    "id": "x",
                    "conversations": [
                        {"from": "human", "value": "Q1"},
                        {"from": "gpt", "value": "A"},
                    ],
                },
                {"conversations": [{"from": "gpt", "value": "only an answer"}]},
                {
                    "conversations": [
                        {"from": "system", "value": "s"},
                        {"from": "human", "value": "Q2"},
                    ]
                },
            ]
        )
    )
    assert [p.text for p in load_file(path)] == ["Q1", "Q2"]


def test_broken_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: invalid JSON"):
        load_file(path)


def test_record_without_a_prompt_is_an_error(tmp_path):
    path = tmp_path / "odd.jsonl"
    path.write_text('{"question": "no prompt key"}\n')
    with pytest.raises(ConfigError, match=r"odd\.jsonl:1: no prompt"):
        load_file(path)


def test_too_few_prompts_and_unknown_dataset_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="has 48 prompts"):
        load_workload("chat", 1000)
    with pytest.raises(ConfigError, match="unknown dataset"):
        load_workload(str(tmp_path / "missing.jsonl"), 3)
