"""kvserve.json_input: each way JSON someone else wrote can be wrong, named."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.json_input import JSONInputError, parse_json, parse_json_object, read_json_object


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"\xff{}", "^not UTF-8: "),
        ("{not json", "^not valid JSON: Expecting property name"),
        ("[" * 100_000 + "]" * 100_000, "^JSON nested too deeply to read$"),  # RecursionError
        ("[1, 2]", "^expected a JSON object, got list$"),
        ("null", "^expected a JSON object, got NoneType$"),
    ],
)
def test_each_problem_is_one_value_error_naming_it(data: str | bytes, problem: str) -> None:
    with pytest.raises(JSONInputError, match=problem) as caught:
        parse_json_object(data)
    assert isinstance(caught.value, ValueError) and not caught.value.missing


def test_any_value_parses_and_objects_come_back() -> None:
    assert parse_json(b"[1, 2]") == [1, 2]
    assert parse_json_object('{"a": {"b": 1}}') == {"a": {"b": 1}}


def test_files_missing_unreadable_and_good(tmp_path: Path) -> None:
    with pytest.raises(JSONInputError, match=r"^missing$") as caught:
        read_json_object(tmp_path / "absent.json")
    assert caught.value.missing
    with pytest.raises(JSONInputError, match=r"^unreadable: Is a directory$"):
        read_json_object(tmp_path)
    (tmp_path / "ok.json").write_text('{"eos_token_id": 2}', encoding="utf-8")
    assert read_json_object(tmp_path / "ok.json") == {"eos_token_id": 2}
