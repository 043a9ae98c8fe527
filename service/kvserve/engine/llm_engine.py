"""The step-level engine: add requests, call ``step()``, read outputs.

``LLM`` (offline) and the server's async engine both drive this class. One ``step()``
schedules a batch, runs one forward pass, samples, detokenizes, applies stop rules and
frees the blocks of finished requests.

A request with structured outputs waits, outside the scheduler, until its grammar is
compiled (in the compiler's threads, while the others keep stepping); then it is queued
like any other. So every request the scheduler holds can run.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import inspect
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2  # what transformers renders chat templates with
import torch

from kvserve.capacity import num_kv_blocks
from kvserve.config import (
    DEFAULT_CPU_KV_CACHE_MEMORY,
    EngineConfig,
    blocks_for,
    kv_cache_torch_dtype,
    model_dir_problem,
    speculative_settings,
    tokenizer_files,
    tokenizer_load_failure,
    tokenizer_problem,
)
from kvserve.conversation import ChatEnding, text_chars
from kvserve.detokenizer import IncrementalDetokenizer
from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.kv_events import KVEventPublisher, start_kv_events
from kvserve.engine.model_runner import KEEPALIVE, ModelRunner
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import Scheduler, SchedulerOutput
from kvserve.errors import CONTEXT_LENGTH_EXCEEDED, InvalidRequestError
from kvserve.json_input import read_json_object
from kvserve.lora.request import LoRARequest
from kvserve.model.config import ModelConfig
from kvserve.outputs import (
    CompletionOutput,
    FinishReason,
    Prefix,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from kvserve.parallel.group import GroupFailedError, TensorGroup
from kvserve.parallel.launch import (
    STOP_GRACE_SECONDS,
    Launch,
    LocalWorkers,
    cpu_threads_per_rank,
)
from kvserve.parallel.shard import check_shardable
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.metrics import SpecDecodeStats
from kvserve.spec_decode.suffix import make_proposer
from kvserve.structured.engine_side import StructuredOutputs

if TYPE_CHECKING:
    from kvserve.lora.adapter import LoRAWeights
    from kvserve.lora.manager import LoRAManager

log = logging.getLogger(__name__)

# Prompt logprobs are held per prompt token, with their alternatives, until the request
# ends, and travel to a gateway in one message: bounded (prompt tokens × (1 + N)).
MAX_PROMPT_LOGPROB_ENTRIES = 2**18


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_kv_blocks: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    # LoRA (zero and empty without it): the slots, and the adapters with running
    # requests and those whose requests all wait.
    max_lora: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    # Speculative decoding's cumulative counters (all zero with it off).
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)


@dataclass(frozen=True)
class ModelSetup:
    """What an engine derives from its config before it loads the model; rank 0 and
    the tensor-parallel workers (``kvserve.parallel.worker``) derive it alike."""

    model_dir: Path
    model_config: ModelConfig
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype

    @classmethod
    def resolve(cls, config: EngineConfig, rank: int = 0) -> ModelSetup:
        if (problem := model_dir_problem(config.model)) is not None:
            raise FileNotFoundError(problem)
        model_dir = Path(config.model)
        model_config = ModelConfig.from_file(model_dir)
        max_pos = model_config.max_position_embeddings
        max_model_len = config.max_model_len or max_pos
        if max_model_len > max_pos:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's "
                f"max_position_embeddings={max_pos}"
            )
        if config.tensor_parallel_size > 1:
            check_shardable(model_config, config.tensor_parallel_size)
        device = config.torch_device()
        if device.type == "cuda" and config.tensor_parallel_size > 1:
            device = torch.device("cuda", rank % torch.cuda.device_count())  # a GPU a rank
        dtype = config.torch_dtype(model_config.torch_dtype)
        kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, dtype)
        return cls(model_dir, model_config, max_model_len, device, dtype, kv_dtype)

    def runner(self, config: EngineConfig, group: TensorGroup | None) -> ModelRunner:
        return ModelRunner(
            self.model_dir,
            self.model_config,
            dtype=self.dtype,
            device=self.device,
            block_size=config.block_size,
            max_model_len=self.max_model_len,
            seed=config.seed,
            quantization=config.quantization,
            kv_cache_dtype=self.kv_cache_dtype,
            group=group,
        )

    def kv_pool_blocks(self, config: EngineConfig, rank_config: ModelConfig) -> int:
        """KV blocks of one rank's pool (``rank_config``: the rank's KV heads)."""
        c = config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        elem = self.kv_cache_dtype.itemsize  # 1 for fp8: twice bf16's blocks
        if c.kv_cache_memory is not None:
            budget = c.kv_cache_memory
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(c.gpu_memory_utilization * total) - (total - free)
        else:
            full = c.max_num_seqs * blocks_for(self.max_model_len, c.block_size)
            budget = min(
                DEFAULT_CPU_KV_CACHE_MEMORY,
                full * c.block_size * rank_config.kv_bytes_per_token(elem),
            )
        blocks = num_kv_blocks(rank_config, budget, c.block_size, elem)
        if blocks < 1:
            raise ValueError(
                f"the KV cache budget ({budget / 2**20:.1f} MiB) holds no block of "
                f"{c.block_size} tokens; raise kv_cache_memory or gpu_memory_utilization"
            )
        return blocks


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        clock: Callable[[], float] = time.monotonic,
        launch: Launch | None = None,
    ) -> None:
        """``launch``: where the tensor-parallel ranks run (default: all on this node)."""
        self.config = config
        self.clock = clock
        setup = ModelSetup.resolve(config)
        model_dir = setup.model_dir
        self.model_config = setup.model_config
        self.max_model_len = setup.max_model_len
        self.device, self.dtype = setup.device, setup.dtype
        self.kv_cache_dtype = setup.kv_cache_dtype
        if config.tensor_parallel_size > 1 and config.enable_lora:
            raise ValueError("enable_lora cannot be combined with tensor_parallel_size > 1 yet")
        self.tokenizer = _load_tokenizer(config.tokenizer or config.model)
        if self.tokenizer is None and config.tokenizer is not None:
            # Asked for by name: serving without it would refuse every text request.
            raise ValueError(tokenizer_problem(config.tokenizer, config.model))
        self.eos_token_ids = _eos_token_ids(model_dir, self.model_config, self.tokenizer)
        # No token stands for more characters than the longest token's text, so a prompt
        # of more than max_model_len times that (twice, for normalizers that drop
        # characters) cannot fit: it is refused before it is tokenized, which can take
        # seconds for megabytes of text.
        self.max_prompt_chars: int | None = None
        if self.tokenizer is not None:
            self.max_prompt_chars = 2 * self.max_model_len * _longest_token_chars(self.tokenizer)

        # Called (from a watcher thread) when a tensor-parallel worker dies: the async
        # engine fails the replica with it.
        self.on_worker_lost: Callable[[str], None] | None = None
        self.group: TensorGroup | None = None
        self.workers: LocalWorkers | None = None
        self._saved_threads: int | None = None  # torch's CPU threads before the group's
        self.kv_events: KVEventPublisher | None = None  # started once the pool exists
        if config.tensor_parallel_size > 1:
            self.group, self.workers = self._start_group(launch or Launch())
        try:
            self.runner = setup.runner(config, self.group)
            # LoRA slots before the KV pool: on CUDA the pool takes what memory is left.
            self.lora = self._lora_manager() if config.enable_lora else None
            if self.lora is not None:
                self.runner.lora = self.lora.layers
            blocks = setup.kv_pool_blocks(config, self.runner.config)
            self.num_kv_blocks = blocks if self.group is None else self.group.min_int(blocks)
            self.runner.allocate_kv_cache(self.num_kv_blocks)
        except BaseException:
            self.close()
            raise
        self.kv = KVCacheManager(
            self.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        # KV-cache events (docs/engine.md): None when off, and then the pool has no hooks.
        self.kv_events = start_kv_events(
            config.kv_events_endpoint,
            config.kv_events_replay_endpoint,
            config.kv_events_topic,
            pool=self.kv.pool,
            block_size=config.block_size,
            device_type=self.device.type,
        )
        spec = config.speculative_config
        self.spec_stats = SpecDecodeStats()
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            clock=clock,
            lora_slots=self.lora.slots if self.lora is not None else None,
            proposer=make_proposer(speculative_settings(spec)) if spec is not None else None,
            speculative_max_batch=config.speculative_max_batch,
            max_model_len=self.max_model_len,
        )
        self.requests: dict[str, Request] = {}
        self.last_schedule: SchedulerOutput | None = None  # for stats and tests
        # Structured outputs: made on the first constrained request.
        self._structured: StructuredOutputs | None = None
        # Requests enqueued while their grammar compiles, in arrival order.
        self.awaiting_grammar: dict[str, Request] = {}
        # Called (from a compiler thread) when a grammar an enqueued request waits for is
        # ready: the async engine wakes its thread with it.
        self.on_grammar_ready: Callable[[], None] | None = None
        # Requests that failed alone (their grammar), with why: finished "abort" in
        # step()'s outputs; the async engine takes them (``take_failures``) and fails
        # their streams instead.
        self.failures: list[tuple[Request, str]] = []

    # ---- tensor parallelism ----------------------------------------------------------
    def _start_group(self, launch: Launch) -> tuple[TensorGroup, LocalWorkers]:
        """Start this node's other ranks as workers and open the group as rank 0."""
        tp = self.config.tensor_parallel_size
        if launch.node_rank != 0:
            raise ValueError("only node 0 runs the engine; other nodes run workers only")
        launch = launch.with_port()
        ranks = launch.node_ranks(tp)
        if self.device.type == "cpu":  # put back by close()
            self._saved_threads = torch.get_num_threads()
            torch.set_num_threads(cpu_threads_per_rank(len(ranks)))
        workers = LocalWorkers(self.config, launch, ranks[1:], tp, self._worker_lost)
        try:
            assert launch.master_port is not None
            group = TensorGroup.join(
                0, tp, launch.master_addr, launch.master_port, self.device, workers.exited
            )
        except BaseException:
            workers.terminate()  # they have not joined: nothing to wait for
            raise
        return group, workers

    def _worker_lost(self, why: str) -> None:  # in a watcher thread
        if self.on_worker_lost is not None:
            self.on_worker_lost(why)

    def keepalive(self) -> None:
        """Exchange an empty message with the workers: an idle rank 0 learns that a
        worker on another node died (``GroupFailedError``), and no worker's wait for
        the next step runs into its timeout."""
        if self.group is not None:
            self.group.broadcast(KEEPALIVE)

    def close(self) -> None:
        """Stop the tensor-parallel workers (they leave after the stop message) and the
        KV-event publisher. Idempotent."""
        group, workers = self.group, self.workers
        self.group = self.workers = None
        if group is not None:
            # The workers' stop message (a worker already gone: the others leave alone).
            with contextlib.suppress(GroupFailedError):
                group.broadcast(None)
            group.close()
        if workers is not None:
            workers.stop(timeout=0 if group is None else STOP_GRACE_SECONDS)
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)
            self._saved_threads = None
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None

    def _lora_manager(self) -> LoRAManager:
        from kvserve.lora.layers import LoRALayers
        from kvserve.lora.manager import LoRAManager

        c = self.config
        layers = LoRALayers(
            self.runner.model,
            self.model_config,
            num_slots=c.max_loras,
            max_rank=c.max_lora_rank,
            dtype=self.dtype,
            device=self.device,
        )
        return LoRAManager(
            self.model_config,
            layers,
            max_loras=c.max_loras,
            max_cpu_loras=c.max_loras if c.max_cpu_loras is None else c.max_cpu_loras,
            max_rank=c.max_lora_rank,
        )

    # ---- LoRA adapters ---------------------------------------------------------------
    def add_lora(self, lora: LoRARequest, weights: LoRAWeights | None = None) -> None:
        """Read and check an adapter now (``LoRAError`` names what is wrong), so that its
        requests find it in host memory; or keep ``weights`` read by ``load_adapter``
        elsewhere. Call it from the thread that steps the engine."""
        self._require_lora()
        assert self.lora is not None
        self.lora.load(lora, weights)

    def remove_lora(self, lora: LoRARequest) -> None:
        """Drop an adapter from memory once no queued or running request needs it."""
        if self.lora is not None:
            self.lora.remove(lora)

    def _require_lora(self) -> None:
        if self.lora is None:
            raise InvalidRequestError(
                "LoRA adapters are off: start the engine with enable_lora=True "
                "(kvserve serve --enable-lora)",
                "model",
            )

    # ---- requests --------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        sample_index: int = 0,
    ) -> Request:
        """Queue a request. Raises ValueError (with the numbers) if it can never run."""
        req = self.build_request(
            request_id,
            prompt,
            params,
            arrival_time=arrival_time,
            cache_salt=cache_salt,
            lora_request=lora_request,
            sample_index=sample_index,
        )
        self.enqueue(req)
        return req

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        ending: ChatEnding = "generation_prompt",
    ) -> list[int]:
        """Token ids of ``messages`` rendered with the model's chat template, ending with
        the assistant's generation prompt unless ``ending`` says otherwise (one definition
        for every API). Only the template's own markers are control tokens; the input's
        are spelled as text.

        ``messages`` and ``tools`` are in the shapes Hugging Face templates take (OpenAI's,
        with a tool call's ``arguments`` as a mapping: ``kvserve/openai/messages.py``).
        ``template_kwargs`` are more variables for the template (vLLM's
        ``chat_template_kwargs``, e.g. ``{"enable_thinking": False}``); a name that is one
        of ``apply_chat_template``'s own parameters (``chat_template``: a client's own
        template) or a variable the renderer sets is refused (param
        ``chat_template_kwargs``).
        """
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise InvalidRequestError(
                "this model has no chat template; send a plain prompt (/v1/completions)",
                "messages",
            )
        self._check_prompt_chars(text_chars(messages, tools), "messages")
        kwargs = template_kwargs or {}
        reserved = sorted(set(kwargs) & _reserved_template_names(tok.__class__)) if kwargs else []
        if reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {', '.join(map(repr, reserved))}: the "
                "server sets it",
                "chat_template_kwargs",
            )
        try:
            # A control token written in a message, a tool or a template variable (a user
            # pasting "<|end|><|system|>" into a question, or a web page quoted there) is
            # encoded as text: only the template's own markers are tokens, so input cannot
            # forge a turn or a role (docs/security.md).
            ids = tok.apply_chat_template(
                messages,
                tools=tools,
                tokenize=True,
                return_dict=False,
                add_generation_prompt=ending == "generation_prompt",
                continue_final_message=ending == "continue_final_message",
                sanitize_control_tokens=True,
                **kwargs,
            )
        except jinja2.TemplateSyntaxError:
            raise  # the model's template is broken: the server's problem, not the request's
        except jinja2.TemplateError as exc:
            # The template refused this conversation: its own raise_exception (Mistral's,
            # Gemma's "Conversation roles must alternate ..."), or a field it needs.
            raise InvalidRequestError(
                f"the model's chat template refused these messages: {exc}", "messages"
            ) from None
        except ValueError as exc:  # transformers: a control token it cannot spell as text
            if ending == "continue_final_message" and "continue_final_message" in str(exc):
                # No final message with text to continue, or a template that has none.
                raise InvalidRequestError(str(exc), "continue_final_message") from None
            if "sanitize" not in str(exc):
                raise _template_failed(exc, kwargs) from None
            raise InvalidRequestError(
                f"the messages hold a control token of this model that its tokenizer "
                f"cannot encode as text ({exc})",
                "messages",
            ) from None
        except Exception as exc:
            # The template rendered this request's values and failed on them (a variable of
            # the wrong type: {"eos_token": 5} meets "'...' + eos_token" as a TypeError).
            # The request's fault, never the server's: a 500 would tell the gateway that
            # the replica is broken.
            raise _template_failed(exc, kwargs) from None
        return list(ids)

    def tokenize(self, prompt: str) -> list[int]:
        """A text prompt's token ids; InvalidRequestError for what cannot be a prompt."""
        if self.tokenizer is None:
            raise InvalidRequestError(
                "this model has no tokenizer: pass prompt token ids", "prompt"
            )
        _require_utf8(prompt, "prompt")
        self._check_prompt_chars(len(prompt), "prompt")
        return list(self.tokenizer.encode(prompt))

    def context_left(self, num_prompt_tokens: int) -> int:
        """What the context leaves for output after a prompt (at least 1): a chat's
        ``max_tokens`` when the client sets none."""
        return max(self.max_model_len - num_prompt_tokens, 1)

    def _check_prompt_chars(self, chars: int, param: str) -> None:
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise InvalidRequestError(
                f"the prompt has {chars} characters: more than fit in max_model_len="
                f"{self.max_model_len} tokens (at most {self.max_prompt_chars} characters)",
                param,
            )

    def build_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        external_id: str | None = None,
        lora_request: LoRARequest | None = None,
        sample_index: int = 0,
    ) -> Request:
        """Tokenize and validate a request without touching engine state.
        ``sample_index``: which of its prompt's samples it is (``SamplingParams.samples``).

        Safe to call from another thread than the one stepping the engine (the async
        server validates on its event loop, so bad input is answered before streaming).
        """
        params = params or SamplingParams()
        if lora_request is not None:
            self._require_lora()
        if isinstance(prompt, str):
            token_ids = self.tokenize(prompt)
            text: str | None = prompt
        else:
            token_ids, text = list(prompt), None
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids out of range [0, {vocab}): {bad[:5]}", "prompt"
            )
        if params.prompt_logprobs is not None:
            entries = len(token_ids) * (1 + params.prompt_logprobs)
            if entries > MAX_PROMPT_LOGPROB_ENTRIES:
                raise InvalidRequestError(
                    f"prompt_logprobs (echo with logprobs) for {len(token_ids)} prompt tokens "
                    f"with {params.prompt_logprobs} alternatives each is {entries:,} entries; "
                    f"at most {MAX_PROMPT_LOGPROB_ENTRIES:,}: ask for fewer alternatives or "
                    "send a shorter prompt",
                    "prompt_logprobs",
                )
        if params.logit_bias and (bad := [t for t in params.logit_bias if t >= vocab]):
            raise InvalidRequestError(
                f"logit_bias token ids out of range [0, {vocab}): {bad[:5]}", "logit_bias"
            )
        total = len(token_ids) + params.max_tokens
        # Blame the prompt when it alone leaves no room, else max_tokens.
        param = "prompt" if len(token_ids) >= self.max_model_len else "max_tokens"
        if total > self.max_model_len:
            raise InvalidRequestError(
                # OpenAI's opening words, which clients match to shorten and retry.
                f"This model's maximum context length is {self.max_model_len} tokens "
                f"(max_model_len): prompt ({len(token_ids)} tokens) + max_tokens "
                f"({params.max_tokens}) = {total} exceeds max_model_len={self.max_model_len}",
                param,
                CONTEXT_LENGTH_EXCEEDED,
            )
        if not self.kv.can_fit(total):
            raise InvalidRequestError(
                f"prompt + max_tokens = {total} tokens need {self.kv.blocks_needed(total)} KV "
                f"blocks but the whole pool has {self.num_kv_blocks} "
                f"(block_size={self.config.block_size})",
                param,
                CONTEXT_LENGTH_EXCEEDED,
            )
        req = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            metrics=RequestMetrics(
                arrival_time=self.clock() if arrival_time is None else arrival_time
            ),
            prompt=text,
            external_id=external_id,
            cache_salt=cache_salt,
            lora=lora_request,
            sample_index=sample_index,
            eos_token_ids=frozenset(() if params.ignore_eos else self.eos_token_ids),
            stop_token_ids=frozenset(params.stop_token_ids),
        )
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens,
            )
        if params.seed is not None:
            req.generator = self.runner.sampler.request_generator(params.seed)
        if params.structured_outputs is not None:
            # Validates (InvalidRequestError) and starts the compile in the background.
            req.grammar = self.structured.matcher(params.structured_outputs)
        return req

    @property
    def structured(self) -> StructuredOutputs:
        """The engine's structured outputs (InvalidRequestError without a tokenizer)."""
        if self._structured is None:
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "structured outputs need the model's tokenizer", "structured_outputs"
                )
            self._structured = StructuredOutputs(
                self.tokenizer, self.model_config.vocab_size, frozenset(self.eos_token_ids)
            )
        return self._structured

    def enqueue(self, req: Request) -> None:
        """Queue a request made by ``build_request``."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.lora is not None:
            self._require_lora()
            assert self.lora is not None
            self.lora.begin(req.lora)  # may read the adapter: LoRAError if it is bad
        self.requests[req.request_id] = req
        if req.grammar is None:
            self.scheduler.add_request(req)
            return
        # Queued by the next step() once compiled (at once if the compile is cached).
        self.awaiting_grammar[req.request_id] = req
        req.grammar.compiled.add_done_callback(self._grammar_ready)

    def _grammar_ready(self, _future: object) -> None:  # in a compiler thread
        if self.on_grammar_ready is not None:
            self.on_grammar_ready()

    def _admit_compiled(self) -> list[RequestOutput]:
        """Queue the requests whose grammar is ready; those whose grammar failed to
        compile fail alone (their outputs are returned)."""
        failed = []
        ready = [r for r in self.awaiting_grammar.values() if r.grammar and r.grammar.ready]
        for req in ready:
            assert req.grammar is not None
            try:
                req.grammar.start()
            except Exception as exc:
                failed.append(self._fail(req, f"structured outputs: {exc}"))
                continue
            del self.awaiting_grammar[req.request_id]
            self.scheduler.add_request(req)
        return failed

    def _fail(self, req: Request, why: str) -> RequestOutput:
        """End ``req`` alone, with "abort"; its output, for this step's outputs."""
        log.warning("request %s failed: %s", req.request_id, why)
        self.failures.append((req, why))
        self._finish(req, "abort")
        return self._output(req, "", [])

    def take_failures(self) -> list[tuple[Request, str]]:
        """Requests that failed alone since the last call, and why."""
        failures, self.failures = self.failures, []
        return failures

    def wait_for_grammar(self, timeout: float | None = None) -> None:
        """Block until a grammar an enqueued request waits for is ready (or ``timeout``):
        for a caller with nothing else to step."""
        futures = [r.grammar.compiled for r in self.awaiting_grammar.values() if r.grammar]
        if futures:
            concurrent.futures.wait(futures, timeout, concurrent.futures.FIRST_COMPLETED)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Remove requests wherever they are and free their blocks; unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outs = []
        for rid in ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, "abort")
                outs.append(self._output(req, "", []))
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self.awaiting_grammar)

    def has_work(self) -> bool:
        """``step()`` would do something: a request to schedule, or a compiled grammar
        whose request is still to be queued. (Only requests waiting for their grammar: no
        work until one is ready; see ``on_grammar_ready`` and ``wait_for_grammar``.)"""
        return self.scheduler.num_unfinished > 0 or any(
            r.grammar is not None and r.grammar.ready for r in self.awaiting_grammar.values()
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.awaiting_grammar),
            kv_cache_usage=self.kv.usage,
            num_kv_blocks=self.num_kv_blocks,
            prefix_cache_queried_tokens=self.kv.prefix_queried_tokens,
            prefix_cache_hit_tokens=self.kv.prefix_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            spec_decode=self.spec_stats.copy(),
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict[str, Any]:
        if self.lora is None:
            return {}
        running, waiting = self.lora.adapter_names()
        return {
            "max_lora": self.lora.slots.num_slots,
            "running_lora_adapters": running,
            "waiting_lora_adapters": waiting,
        }

    # ---- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = self._admit_compiled() if self.awaiting_grammar else []
        sched = self.last_schedule = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        lora_slots = None
        if self.lora is not None:  # each request's slot (-1: the base model); the LoRA
            # layers take the tokens in the runner's order (kvserve.lora.layers)
            lora_slots = {r.request_id: self.lora.slot(r.lora) for r, _ in sched.scheduled}
        try:
            sampled_reqs, sampled = self.runner.execute(sched.scheduled, self.kv.tables, lora_slots)
        except BaseException:
            # Nothing of this step was computed (a CUDA OOM, a kernel error); the blocks
            # it was to fill must not stay in the prefix cache (their removal events go
            # out with the next step's batch).
            for req, _ in sched.scheduled:
                self.kv.uncache_uncomputed(req)
            raise
        for req, n in sched.scheduled:
            req.num_computed_tokens += n
        now = self.clock()
        for req, tokens, logprobs in zip(
            sampled_reqs, sampled.token_ids, sampled.logprobs, strict=True
        ):
            if req.params.max_tokens == 0:  # it scored its prompt and asks for no token
                self._finish(req, "length")
                outputs.append(self._output(req, "", []))
                continue
            num_drafts = len(req.spec_token_ids)
            if num_drafts:
                # Rejected drafts' KV is past the new token: uncompute it, and give back
                # the blocks that held nothing else (the scheduler's invariant).
                req.num_computed_tokens -= num_drafts - (len(tokens) - 1)
                req.spec_token_ids = []
                self.spec_stats.observe(num_drafts, len(tokens) - 1)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            out = self._append_tokens(req, tokens, logprobs, now)
            if not req.is_finished:  # (finished, by a stop rule or alone: no blocks left)
                if self.config.recompute_every_step:
                    self.kv.free(req)
                    req.num_computed_tokens = 0
                elif num_drafts:
                    self.kv.trim(req, req.num_tokens)
            outputs.append(out)
        if self.kv_events is not None:  # the step's cache changes, as one batch
            self.kv_events.end_step()
        return outputs

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing done) while requests hold
        blocks, as vLLM's: reset once the engine is idle."""
        done = self.kv.pool.reset_prefix_cache()
        if self.kv_events is not None:
            self.kv_events.end_step()
        return done

    def _append_tokens(
        self,
        req: Request,
        tokens: list[int],
        logprobs: list[TokenLogprob | None],
        now: float,
    ) -> RequestOutput:
        """Append a step's tokens to ``req`` one by one, stopping (and dropping the rest)
        where a stop rule finishes it, or where its grammar refuses a token (it fails
        alone); its output."""
        reason: FinishReason | None = None
        delta_text = ""
        delta_ids: list[int] = []
        for token, logprob in zip(tokens, logprobs, strict=True):
            req.append_output_token(token)
            delta_ids.append(token)
            req.metrics.token_times.append(now)
            if req.logprobs is not None and logprob is not None:
                req.logprobs.append(logprob)
            if req.grammar is not None and not req.grammar.accept(token):
                self.structured.compiler.discard(req.grammar.compiled)
                return self._fail(req, f"structured outputs: {req.grammar.error}")
            # An EOS or stop token ends the output on itself: its text is left out.
            stop_token = False
            if token in req.eos_token_ids:
                reason, stop_token = "stop", True
            elif token in req.stop_token_ids:
                reason, req.stop_reason, stop_token = "stop", token, True
            elif req.grammar is not None and req.grammar.finished:
                reason = "stop"  # the grammar allows nothing more (docs/engine.md)
            elif (
                req.num_output_tokens >= req.params.max_tokens
                or req.num_tokens >= self.max_model_len
            ):
                reason = "length"
            if req.detokenizer is not None:
                stop_str = req.detokenizer.update([token], reason is not None, stop_token)
                if stop_str is not None:
                    reason, req.stop_reason = "stop", stop_str
                delta_text += req.detokenizer.delta_text
            if reason is not None:
                self._finish(req, reason)
                break
        return self._output(req, delta_text, delta_ids)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.finish_reason = reason
        req.metrics.finished_time = self.clock()
        if self.awaiting_grammar.pop(req.request_id, None) is not None:
            req.status = RequestStatus.FINISHED  # never reached the scheduler
        else:
            self.scheduler.finish(req)
        del self.requests[req.request_id]
        if req.lora is not None and self.lora is not None:
            self.lora.end(req.lora)

    def _output(self, req: Request, delta_text: str, delta_ids: list[int]) -> RequestOutput:
        text = req.detokenizer.text if req.detokenizer is not None else ""
        return RequestOutput(
            request_id=req.request_id,
            external_id=req.external_id,
            lora_request=req.lora,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=req.sample_index,
                    text=text,
                    token_ids=Prefix(req.output_token_ids),
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
                    logprobs=Prefix(req.logprobs) if req.logprobs is not None else None,
                    delta_text=delta_text,
                    delta_token_ids=delta_ids,
                )
            ],
            finished=req.is_finished,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            metrics=req.metrics,
            prompt_logprobs=req.prompt_logprobs,
        )

    # ---- evaluation helpers ----------------------------------------------------------
    def prompt_logprobs(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced log-softmax at every position, float32 [T, vocab].

        Uses free KV blocks temporarily; call it while no requests are running.
        """
        if self.has_unfinished_requests():
            raise RuntimeError("prompt_logprobs needs an idle engine")
        probe = Request(
            "__score__", list(token_ids), SamplingParams(max_tokens=1), RequestMetrics(0.0)
        )
        if not self.kv.allocate_slots(probe, len(token_ids)):
            raise ValueError(f"{len(token_ids)} tokens do not fit in the KV pool")
        try:
            return self.runner.prompt_logprobs(probe.request_id, token_ids, self.kv.tables)
        finally:
            self.kv.free(probe)


def _longest_token_chars(tokenizer: Any) -> int:
    """Characters of the longest token in the vocabulary (added tokens included)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


def _require_utf8(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{param} is not valid Unicode text (character {exc.start} is a lone surrogate)",
            param,
        ) from None


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    p = Path(path)
    present = tokenizer_files(p)
    if not present:
        return None
    try:
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # a foreign library's errors on a bad file (KeyError, JSON, ...)
        # Which JSON file is broken, if one is; else the library's own words.
        raise ValueError(
            tokenizer_problem(None, path)
            or tokenizer_load_failure(p, present, f"{type(e).__name__}: {' '.join(str(e).split())}")
        ) from None


def _eos_token_ids(model_dir: Path, config: ModelConfig, tokenizer: Any) -> set[int]:
    """EOS ids from generation_config.json, else config.json, else the tokenizer."""
    gen = model_dir / "generation_config.json"
    if gen.exists():
        eos = _generation_eos(gen)
        if eos is not None:
            return eos
    if config.eos_token_ids:
        return set(config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return {int(tokenizer.eos_token_id)}
    return set()


def _generation_eos(path: Path) -> set[int] | None:
    """generation_config.json's eos_token_id (one id or a list), or None if it has none."""
    try:
        eos = read_json_object(path).get("eos_token_id")
        if eos is None:
            return None
        return {int(i) for i in eos} if isinstance(eos, list) else {int(eos)}
    except (ValueError, TypeError) as e:  # JSONInputError is a ValueError
        raise ValueError(f"{path}: no usable eos_token_id: {e}") from None


def _template_failed(exc: Exception, template_kwargs: Mapping[str, Any]) -> InvalidRequestError:
    """The 400 for a chat template that failed while rendering a request: it names
    ``chat_template_kwargs`` when the request set template variables (the likelier
    cause), else ``messages``."""
    return InvalidRequestError(
        f"the model's chat template failed on this request ({type(exc).__name__}: {exc})",
        "chat_template_kwargs" if template_kwargs else "messages",
    )


# Variables the chat-template renderer sets itself (besides apply_chat_template's own
# parameters, which it takes by name).
_RENDERER_VARIABLES = frozenset({"messages", "raise_exception", "strftime_now"})


@functools.cache
def _reserved_template_names(tokenizer_type: Any) -> frozenset[str]:
    """What ``chat_template_kwargs`` may not set: ``apply_chat_template``'s parameters
    (``chat_template``, ``tokenize``, ``tools`` ...) and the renderer's own variables."""
    params = inspect.signature(tokenizer_type.apply_chat_template).parameters
    named = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return frozenset(named - {"self"}) | _RENDERER_VARIABLES
