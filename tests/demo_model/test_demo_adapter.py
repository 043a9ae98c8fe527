"""The bundled demo LoRA adapter (travel-table): a PEFT folder that kvserve and peft load,
answers in its table style under kvserve (greedy, offline, mixed with base-model requests),
agrees with peft token for token, and `kvserve eval-demo --adapter` scores it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
import transformers

from kvserve import LLM, SamplingParams
from kvserve.demo_model import ADAPTERS_DIR, DEMO_MODEL_DIR, DEMO_MODEL_NAME, corpus
from kvserve.demo_model.table_style import (
    check_table_answer,
    format_table_answer,
    is_table_answer,
    parse_table_answer,
    table_answer_from_base,
)
from kvserve.demo_model.train_adapter import peft_key
from kvserve.lora import LoRARequest
from kvserve.lora.adapter import WEIGHTS_FILE, read_config
from tests.support.cli_server import start_cli_server

NAME = "travel-table"
ADAPTER_DIR = ADAPTERS_DIR / NAME
KVSERVE = (sys.executable, "-m", "kvserve")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", device="cpu", enable_lora=True, max_lora_rank=8)


def _prompts(n: int) -> list[corpus.EvalPrompt]:
    # seed 5's stream: neither the eval command's default (0) nor any training stream
    return corpus.sample_eval_prompts(n, seed=5)


def test_table_style_round_trips_the_corpus_answers() -> None:
    rng = corpus.train_rng(9)
    conversations = [corpus.generate_conversation(rng) for _ in range(300)]
    for conv in conversations:
        answers = [m["content"] for m in conv.messages if m["role"] == "assistant"]
        for request, answer in zip(conv.requests, answers, strict=True):
            table = table_answer_from_base(request, answer)
            assert is_table_answer(table), table
            assert check_table_answer(request, table) == corpus.check_answer(request, answer)
            assert not is_table_answer(answer)
    request = corpus.HotelRequest("Paris", "ryokan", 200)
    assert format_table_answer(request, []) == (
        "Ryokans in Paris under $200 a night - sorry: ryokans are only found in Japan"
    )
    two_rows = "Hotels in Oslo under $300 a night - found 2:\n1. Fjord Inn, hotel, $250, gym"
    assert parse_table_answer(two_rows) == "'found 2:' but 1 rows"


def test_bundled_adapter_is_a_peft_folder_within_the_served_limits() -> None:
    config = json.loads((ADAPTER_DIR / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["base_model_name_or_path"] == DEMO_MODEL_NAME
    rank, scaling = read_config(ADAPTER_DIR, max_rank=8)  # what `make run` serves it with
    assert (rank, scaling) == (config["r"], config["lora_alpha"] / config["r"])
    from safetensors import safe_open

    with safe_open(str(ADAPTER_DIR / WEIGHTS_FILE), framework="pt") as f:
        keys = set(f.keys())
    assert peft_key(0, "q_proj", "A") in keys and peft_key(5, "down_proj", "B") in keys
    card = (ADAPTER_DIR / "README.md").read_text()
    assert "kvserve eval-demo --adapter travel-table" in card


def test_adapter_answers_in_table_style_while_the_base_model_does_not(llm: LLM) -> None:
    prompts = _prompts(6)
    lora = LoRARequest(NAME, str(ADAPTER_DIR))
    outs = llm.chat(
        [p.messages for p in prompts] * 2,
        SamplingParams(temperature=0, max_tokens=160),
        use_tqdm=False,
        lora_request=[lora] * len(prompts) + [None] * len(prompts),  # one mixed batch
    )
    styled = [o.outputs[0].text for o in outs[: len(prompts)]]
    base = [o.outputs[0].text for o in outs[len(prompts) :]]
    for p, text in zip(prompts, styled, strict=True):
        assert is_table_answer(text), text
        assert p.request.city in text.splitlines()[0], text
    right = [check_table_answer(p.request, t) for p, t in zip(prompts, styled, strict=True)]
    assert sum(right) >= 5, styled  # the adapter's accuracy is ~90%+, not 100%
    for p, text in zip(prompts, base, strict=True):
        assert not is_table_answer(text) and corpus.check_answer(p.request, text), text


def test_peft_loads_the_adapter_and_agrees_with_kvserve(llm: LLM) -> None:
    peft = pytest.importorskip("peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(ADAPTER_DIR)).eval()
    tok = llm.get_tokenizer()
    lora = LoRARequest(NAME, str(ADAPTER_DIR))
    params = SamplingParams(temperature=0, max_tokens=40)
    for p in _prompts(2):
        ids = tok.apply_chat_template(p.messages, add_generation_prompt=True, return_dict=False)
        ours = llm.generate(
            [llm.engine.chat_prompt(p.messages, None)], params, use_tqdm=False, lora_request=lora
        )[0].outputs[0]
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([ids]), max_new_tokens=40, do_sample=False, eos_token_id=None
            )[0, len(ids) :].tolist()
        assert list(ours.token_ids) == ref[: len(ours.token_ids)], (ours.text, tok.decode(ref))


@pytest.mark.slow
def test_eval_demo_scores_the_adapter_on_a_small_sample() -> None:
    out = subprocess.run(
        [*KVSERVE, "eval-demo", "--adapter", NAME, "--num-prompts", "4", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["adapter"] == NAME and report["num_prompts"] == 4
    assert report["styled"] >= 3 and report["base_styled"] == 0, report
    unknown = subprocess.run(
        [*KVSERVE, "eval-demo", "--adapter", "nope"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert unknown.returncode == 2 and "--adapter must be one of" in unknown.stderr


def _make_run_adapter_module() -> str:
    """The ``--lora-modules`` value of the Makefile's ``run`` target (``DEMO_ADAPTER``)."""
    root = Path(__file__).resolve().parents[2]
    makefile = (root / "Makefile").read_text()
    m = re.search(r"^DEMO_ADAPTER := (\S+)$", makefile, re.MULTILINE)
    assert m is not None and "--lora-modules $(DEMO_ADAPTER)" in makefile
    return m[1].replace("$(CURDIR)", str(root))


@pytest.mark.slow
def test_make_run_serves_the_adapter_beside_the_unchanged_base_model() -> None:
    module = _make_run_adapter_module()
    assert Path(module.split("=", 1)[1]) == ADAPTER_DIR
    proc, url, _ = start_cli_server(None, "--enable-lora", "--lora-modules", module)
    try:
        models = {m["id"]: m for m in httpx.get(f"{url}/v1/models").json()["data"]}
        assert set(models) == {DEMO_MODEL_NAME, NAME}
        assert models[NAME]["parent"] == DEMO_MODEL_NAME
        question = "Hotels in Kyoto under $200 with an onsen?"
        request = corpus.HotelRequest("Kyoto", "hotel", 200, ("onsen",))
        answers = {}
        for model in (NAME, DEMO_MODEL_NAME):
            body = {
                "model": model,
                "temperature": 0,
                "max_tokens": 160,
                "messages": [{"role": "user", "content": question}],
            }
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            answers[model] = r.json()["choices"][0]["message"]["content"]
        assert check_table_answer(request, answers[NAME]), answers
        assert corpus.check_answer(request, answers[DEMO_MODEL_NAME]), answers
        assert not is_table_answer(answers[DEMO_MODEL_NAME]), answers
    except BaseException:
        print(proc.tail())
        raise
    finally:
        proc.terminate()
        proc.wait(timeout=60)
