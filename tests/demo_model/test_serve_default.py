"""`kvserve serve` with no model serves the bundled demo model (what `make run` does)."""

from __future__ import annotations

import json

import httpx
import pytest

from kvserve.demo_model import DEMO_MODEL_NAME, corpus
from tests.support.cli_server import start_cli_server

QUESTION = "Hotels in Kyoto under $200 with an onsen?"


@pytest.mark.slow
def test_serve_without_a_model_answers_a_streamed_hotel_question() -> None:
    proc, url, _ = start_cli_server(None)
    try:
        models = httpx.get(f"{url}/v1/models").json()
        assert [m["id"] for m in models["data"]] == [DEMO_MODEL_NAME]
        body = {
            "model": DEMO_MODEL_NAME,
            "stream": True,
            "temperature": 0,
            "max_tokens": 128,
            "messages": [{"role": "user", "content": QUESTION}],
        }
        text = ""
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = json.loads(line[len("data: ") :])["choices"][0]["delta"]
                    text += delta.get("content") or ""
        request = corpus.HotelRequest("Kyoto", "hotel", 200, ("onsen",))
        assert corpus.check_answer(request, text), text
        assert "Kyoto" in text
    finally:
        proc.terminate()
        proc.wait(timeout=60)
