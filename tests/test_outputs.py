"""Step outputs: each one's cumulative tokens and logprobs are a snapshot of that step,
taken without copying (``kvserve.outputs.Prefix``)."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.outputs import Prefix


def test_prefix_is_a_frozen_read_only_view_of_a_growing_list() -> None:
    items = [10, 11, 12]
    view = Prefix(items)
    items.extend([13, 14])
    assert len(view) == 3 and list(view) == [10, 11, 12]
    assert view == [10, 11, 12] and view == (10, 11, 12) and view != [10, 11, 12, 13]
    assert view[0] == 10 and view[-1] == 12 and view[1:] == [11, 12] and view[::-1] == [12, 11, 10]
    assert view[-10:] == [10, 11, 12] and view[5:] == []
    assert 12 in view and 13 not in view and view.index(11) == 1
    assert repr(view) == "[10, 11, 12]"
    # The + operator itself is under test (list + Prefix works as list + list).
    assert [1] + view == [1, 10, 11, 12]  # noqa: RUF005
    assert view + [1] == [10, 11, 12, 1]  # noqa: RUF005
    with pytest.raises(IndexError):
        view[3]
    with pytest.raises(IndexError):
        view[-4]
    with pytest.raises(TypeError):
        hash(view)


def test_each_step_output_keeps_its_own_tokens_and_logprobs(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    engine = LLM(str(checkpoint_dir("llama")), dtype="float32", device="cpu").engine
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    engine.add_request("a", list(range(3, 20)), params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    final = outputs[-1].outputs[0]
    assert final.finish_reason == "length" and len(final.token_ids) == 6
    assert final.logprobs is not None and len(final.logprobs) == 6
    # Later steps appended to the request's lists; earlier outputs still show their step.
    for i, out in enumerate(outputs, start=1):
        c = out.outputs[0]
        assert c.token_ids == list(final.token_ids)[:i]
        assert c.delta_token_ids == [final.token_ids[i - 1]]
        assert c.logprobs is not None and list(c.logprobs) == list(final.logprobs)[:i]
