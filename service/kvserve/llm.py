"""The offline API: generate for a list of prompts and get the outputs back in order."""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Unpack

from kvserve.config import EngineConfig, model_dir_problem
from kvserve.conversation import chat_ending
from kvserve.engine_kwargs import EngineKwargs
from kvserve.engine_options import check_kwargs
from kvserve.lora.request import LoRARequest
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine

Prompt = str | list[int]
Message = dict[str, Any]

PROGRESS_BAR_MIN_PROMPTS = 32


class LLM:
    """Run a Hugging Face checkpoint directory with continuous batching, offline.

    >>> llm = LLM(model="path/to/hf_dir", dtype="bfloat16")
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8))[0].outputs[0].text

    With ``tensor_parallel_size > 1`` the worker ranks are processes of their own:
    ``close()`` (or a ``with`` block) stops them; they also die with this process.
    """

    def __init__(
        self, model: str | os.PathLike[str] | None = None, **engine_args: Unpack[EngineKwargs]
    ) -> None:
        """``engine_args`` are ``EngineConfig``'s fields (``docs/engine.md``, "Options");
        a misspelt one is a ``TypeError`` that names it."""
        check_kwargs(engine_args)
        if model is None:
            from kvserve.demo_model import default_model_dir

            model = default_model_dir()  # the bundled travel-assistant demo model
        config = EngineConfig(model=str(model), **engine_args)
        if (problem := model_dir_problem(config.model)) is not None:
            raise FileNotFoundError(problem)
        # Imported once the settings and the folder are known to be valid: refusing a
        # wrong one does not wait for torch to load (seconds).
        from kvserve.engine.llm_engine import LLMEngine

        self.engine: LLMEngine = LLMEngine(config)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's worker processes and publishers (if any)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        ``prompts``: a string, a list of token ids, or a list of either.
        ``sampling_params``: one for all prompts, or one per prompt.
        ``lora_request``: the LoRA adapter for all prompts, or one per prompt (None: the
        base model); needs ``LLM(..., enable_lora=True)``. Each adapter is read and
        checked before any prompt is queued (``LoRAError`` names what is wrong).
        A request whose structured-outputs grammar fails inside the engine (it was
        validated when added, so this should not happen) ends alone with finish reason
        "abort"; the engine logs why.
        """
        batch = _as_prompt_list(prompts)
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(batch):
                raise ValueError(
                    f"got {len(sampling_params)} sampling_params for {len(batch)} prompts"
                )
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(batch)
        loras: list[LoRARequest | None]
        if isinstance(lora_request, Sequence):
            if len(lora_request) != len(batch):
                raise ValueError(f"got {len(lora_request)} lora_request for {len(batch)} prompts")
            loras = list(lora_request)
        else:
            loras = [lora_request] * len(batch)
        for adapter in dict.fromkeys(x for x in loras if x is not None):
            self.engine.add_lora(adapter)

        # One engine request per sample: a prompt with n > 1 is n requests (their
        # outputs are joined into one RequestOutput, vLLM's shape).
        groups: list[list[str]] = []
        try:
            for prompt, p, lora in zip(batch, params, loras, strict=True):
                groups.append([])
                for i, sample in enumerate(p.samples()):
                    rid = f"offline-{next(self._ids)}"
                    groups[-1].append(rid)
                    req = self.engine.add_request(
                        rid,
                        prompt,
                        sample,
                        cache_salt=cache_salt,
                        lora_request=lora,
                        sample_index=i,
                    )
                    prompt = req.prompt_token_ids  # tokenized once for all its samples
        except ValueError:
            self.engine.abort_request(rid for group in groups for rid in group)
            raise
        done = self._run([rid for group in groups for rid in group], use_tqdm)
        return [joined_samples([done[rid] for rid in group]) for group in groups]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them.

        ``tools``: OpenAI-style function tools (``{"type": "function", "function": {...}}``)
        that the template renders; messages may carry ``tool_calls`` (their ``arguments``
        a dict, as Hugging Face templates take them) and ``tool`` results. The outputs
        are the raw text: reading calls out of it is the server's (``--tool-call-parser``).
        ``lora_request``: as for ``generate``, one for all conversations or one each.
        ``chat_template_kwargs``: more variables for the template (vLLM's name), e.g.
        Qwen3's ``{"enable_thinking": False}``. ``add_generation_prompt`` and
        ``continue_final_message`` (vLLM's): the prompt ends with the assistant's turn
        opened (the default), or with nothing added, or with the final message left open
        for the model to continue (then ``add_generation_prompt`` must be False).
        """
        conversations: list[list[Message]] = (
            [messages]  # type: ignore[list-item]
            if messages and isinstance(messages[0], dict)
            else messages  # type: ignore[assignment]
        )
        ending = chat_ending(add_generation_prompt, continue_final_message)
        prompts: list[Prompt] = [
            self.engine.chat_prompt(conv, tools, chat_template_kwargs, ending)
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _run(self, ids: list[str], use_tqdm: bool | None) -> dict[str, RequestOutput]:
        show = len(ids) >= PROGRESS_BAR_MIN_PROMPTS if use_tqdm is None else use_tqdm
        bar = None
        if show:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generating", unit="req", file=sys.stderr)
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        try:
            while self.engine.has_unfinished_requests() and len(done) < len(ids):
                if not self.engine.has_work():  # only requests whose grammar compiles
                    self.engine.wait_for_grammar()
                    continue
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            self.engine.abort_request(ids)
            raise
        finally:
            if bar is not None:
                bar.close()
        return done


def joined_samples(outputs: list[RequestOutput]) -> RequestOutput:
    """The finished outputs of one prompt's samples (``SamplingParams.samples``) as one
    output with a completion per sample (each ``index`` its place): the first sample's request,
    prompt, cached tokens and timeline, and every sample's completion."""
    if len(outputs) == 1:
        return outputs[0]
    return dataclasses.replace(outputs[0], outputs=[out.outputs[0] for out in outputs])


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # type: ignore[list-item]
    for p in items:
        if not isinstance(p, str | list):
            raise TypeError(f"a prompt must be a string or a list of token ids, got {type(p)}")
    return items  # type: ignore[return-value]
