"""``kvserve serve --speculative-config``: the flag reaches the engine, greedy completions
are unchanged, and the speculative-decoding counters reach ``/metrics``."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx

from tests.support.cli_server import start_cli_server
from tests.support.prometheus import metric

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
# A prompt whose continuation on the tiny random model loops, so drafts are accepted.
BODY = {
    "model": "m",
    "prompt": [40, 41, 42, 43, 40, 41, 42, 43, 40, 41],
    "max_tokens": 32,
    "temperature": 0,
    "ignore_eos": True,
}


def _complete(url: str) -> str:
    r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    text: str = r.json()["choices"][0]["text"]
    return text


def test_the_flag_speculates_and_exports_its_counters(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    model = checkpoint_dir("llama")
    plain, plain_url, _ = start_cli_server(model)
    try:
        expected = _complete(plain_url)
        assert metric(plain_url, "kvserve_spec_decode_num_drafts_total") == 0
    finally:
        plain.stop()
    proc, url, _ = start_cli_server(
        model, "--speculative-config", json.dumps(NGRAM), "--metrics-compat", "vllm"
    )
    try:
        assert _complete(url) == expected, proc.tail()
        drafts = metric(url, "kvserve_spec_decode_num_drafts_total")
        draft_tokens = metric(url, "kvserve_spec_decode_num_draft_tokens_total")
        accepted = metric(url, "kvserve_spec_decode_num_accepted_tokens_total")
        first = metric(url, "kvserve_spec_decode_num_accepted_tokens_per_pos_total", position="0")
        per_pos = metric(url, "kvserve_spec_decode_num_accepted_tokens_per_pos_total")
        assert 0 < drafts <= draft_tokens, proc.tail()
        assert 0 < accepted < draft_tokens
        assert per_pos == accepted  # each accepted token is counted at its one position
        assert 0 < first <= drafts
        # --metrics-compat vllm: the same counts under vLLM's names (nothing runs between
        # the scrapes: the one request has finished).
        for name, ours in [
            ("num_drafts_total", drafts),
            ("num_draft_tokens_total", draft_tokens),
            ("num_accepted_tokens_total", accepted),
            ("num_accepted_tokens_per_pos_total", per_pos),
        ]:
            assert metric(url, f"vllm:spec_decode_{name}", model_name="m", engine="0") == ours
    finally:
        proc.stop()


def test_a_bad_config_stops_serve_naming_the_key(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    bad = json.dumps({"method": "ngram", "num_speculative_tokens": 0})
    args = ["--model", str(checkpoint_dir("llama")), "--speculative-config", bad]
    done = subprocess.run(
        [sys.executable, "-m", "kvserve", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "speculative_config.num_speculative_tokens" in done.stderr, done.stderr
