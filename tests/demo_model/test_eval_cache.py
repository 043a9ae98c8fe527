"""``kvserve eval-demo`` keeps each training recipe's user messages in the user's cache:
the file is read back, one per recipe, made again when damaged, and a cache that cannot
be written does not stop the evaluation."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvserve.demo_model import corpus
from kvserve.demo_model.evaluate import training_user_messages
from kvserve.demo_model.train import TrainConfig


def _generated(cfg: TrainConfig) -> set[str]:
    convs = corpus.generate_corpus(cfg.num_conversations, cfg.seed, cfg.tool_share)
    return {m["content"] for c in convs for m in c.messages if m["role"] == "user"}


def test_a_recipes_user_messages_are_cached_and_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = tmp_path / "kvserve" / "eval-demo"
    cfg = TrainConfig(num_conversations=40, seed=3)
    expected = _generated(cfg)
    assert training_user_messages(cfg) == expected
    [file] = cache.iterdir()
    assert set(json.loads(file.read_text())) == expected
    # What the file holds is what is returned: it is read, not generated again.
    file.write_text(json.dumps(["from the cache"]))
    assert training_user_messages(cfg) == {"from the cache"}
    # Another recipe has a file of its own.
    other = dataclasses.replace(cfg, tool_share=0.5)
    assert training_user_messages(other) == _generated(other)
    assert len(list(cache.iterdir())) == 2
    # A damaged file, or one of the wrong shape, is made again.
    for damaged in ('["cut', '{"a": 1}', "[1, 2]"):
        file.write_text(damaged)
        assert training_user_messages(cfg) == expected
        assert set(json.loads(file.read_text())) == expected


def test_a_cache_that_cannot_be_written_still_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # no folder can be made under it
    cfg = TrainConfig(num_conversations=20, seed=1)
    assert training_user_messages(cfg) == _generated(cfg)
    assert list(tmp_path.iterdir()) == [blocker]
