"""OpenAI request schemas (unknown parameters are refused by name) and their mapping
onto ``SamplingParams``."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from kvserve.conversation import ChatEnding, chat_ending
from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import INT32_MAX, MAX_N, SamplingParams, StructuredOutputsParams

# OpenAI request fields this server does not implement whose ``null`` asks for nothing:
# clients that serialise every field of their request model send them so. Any other
# value is still refused by name.
UNSET_WHEN_NULL = frozenset(
    {
        "audio", "best_of", "function_call", "functions", "modalities", "moderation",
        "prediction", "prompt_cache_options", "suffix", "verbosity", "web_search_options",
    }
)  # fmt: skip


class OpenAIObject(BaseModel):
    """An object of an OpenAI request: unknown fields are refused by name, and ``null``
    means "left out", as in OpenAI's API. A field with a default other than null gets
    that default; a field named in ``unset_when_null`` (OpenAI's, not implemented here)
    is ignored when null and refused otherwise. A required field's null is refused as
    what it is. (The OpenAI SDK's ``message.model_dump()``, and clients that serialise
    unset fields, send such nulls.)"""

    # A float is finite: NaN and ±Infinity (JSON literals pydantic-core's parser reads,
    # or strings such as "nan" and "inf") are refused by name, not compared with bounds.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    unset_when_null: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _null_is_left_out(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if v is not None
            or not (k in cls.unset_when_null or (k in fields and _defaults_to_a_value(fields[k])))
        }


def _defaults_to_a_value(field: FieldInfo) -> bool:
    return not field.is_required() and field.default is not None


def _refused_if_true(why: str) -> AfterValidator:
    """An OpenAI flag asking for something this server does not do: false and null are
    taken, true is refused with ``why``."""

    def check(value: bool | None) -> bool | None:
        if value:
            raise ValueError(f"{why}: send false or leave it out")
        return value

    return AfterValidator(check)


class StreamOptions(OpenAIObject):
    include_usage: bool = False
    # OpenAI's padding of stream events against size side channels.
    include_obfuscation: Annotated[
        bool | None, _refused_if_true("this server does not obfuscate streams")
    ] = None
    # vLLM's usage on every chunk: not sent; false (what clients that send every field
    # send) asks for nothing.
    continuous_usage_stats: Annotated[
        bool | None, _refused_if_true("this server sends usage only in the last chunk")
    ] = None


# vLLM's bound is "long enough to be unpredictable"; this one keeps a salt a key, not a body.
MAX_CACHE_SALT_CHARS = 1024


class StructuredOutputsRequest(OpenAIObject):
    """vLLM's ``structured_outputs`` request field; exactly one kind is set (checked when
    it becomes ``StructuredOutputsParams``, in ``openai/structured.py``)."""

    model_config = ConfigDict(populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class CommonRequest(OpenAIObject):
    """The fields completions and chat completions share."""

    unset_when_null = UNSET_WHEN_NULL

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    # OpenAI's: token id, written as a string → a bias in [-100, 100] added to its logit
    # (range and count are checked with the other sampling parameters).
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions (vLLM-compatible names).
    top_k: int = 0
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    # vLLM's: token ids that end the output like EOS, the stop string that ended it kept
    # in the text, special tokens kept in the text (what clients written for vLLM send).
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Prefix-cache isolation (vLLM's name and meaning): a request reuses cached prompt
    # blocks only from requests with the same salt. Behind the gateway, the tenant's own
    # salt is always applied as well (docs/architecture.md).
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # vLLM's constraint on the output (one of json, json_object, regex, choice, grammar).
    structured_outputs: StructuredOutputsRequest | None = None
    # OpenAI fields that ask nothing of the model, which SDKs and agent frameworks send:
    # accepted and ignored (README, "Parameters").
    # Only ``store: true`` is refused: nothing here stores completions.
    store: Annotated[bool | None, _refused_if_true("this server does not store completions")] = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    service_tier: str | None = Field(None, max_length=64)
    safety_identifier: str | None = Field(None, max_length=256)
    prompt_cache_key: str | None = Field(None, max_length=256)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _keys_are_token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise ValueError(f"keys must be token ids written as decimal numbers, got {key!r}")
        return bias

    @property
    def stop_list(self) -> list[str]:
        """``stop`` as a list (OpenAI takes one string or several)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        structured: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            logit_bias=(
                None if self.logit_bias is None else {int(k): v for k, v in self.logit_bias.items()}
            ),
            seed=self.seed,
            stop=self.stop_list,
            stop_token_ids=self.stop_token_ids or [],
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            structured_outputs=structured,
            n=self.n,
            prompt_logprobs=self._prompt_logprobs(max_tokens),
        )

    def _prompt_logprobs(self, max_tokens: int) -> int | None:
        """echo with logprobs: the prompt's tokens are scored as well; echo with
        max_tokens 0 (only the prompt) has the engine score it."""
        if not isinstance(self, CompletionRequest) or not self.echo:
            return None
        if self.logprobs is None and max_tokens == 0:
            return 0
        return self.logprobs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(CommonRequest):
    # One prompt (text or token ids), or a batch of them (OpenAI's): n choices each.
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    # OpenAI's: the answer's text (and logprobs) start with the prompt's (scored by the model).
    echo: bool = False
    # OpenAI's: sample best_of candidates and return the n best. Only best_of = n (its
    # default, 1, with n = 1) is taken: nothing to choose from.
    best_of: int | None = None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if best_of is not None and best_of != n:
            raise ValueError(
                f"unsupported: best_of {best_of} with n {n} (only best_of = n: every "
                "sample is returned, none is chosen among more)"
            )
        return best_of

    @field_validator("prompt")
    @classmethod
    def _token_ids_fit_the_wire(
        cls, prompt: str | list[int] | list[str] | list[list[int]]
    ) -> object:
        # Token ids travel as int32; the engine then checks them against its vocabulary.
        if isinstance(prompt, list):
            for ids in (prompt, *(p for p in prompt if isinstance(p, list))):
                if any(isinstance(t, int) and not 0 <= t <= INT32_MAX for t in ids):
                    raise ValueError(f"token ids must be in [0, {INT32_MAX}]")
        return prompt


def _valid_unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode text (lone surrogate at {exc.start})") from None
    return value


class ContentPart(BaseModel):
    """One part of a message's content. Any OpenAI part type parses; what this model
    cannot take (images, audio, files) is refused by ``openai/messages.py`` with the
    part's path as ``param``."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    refusal: str | None = None  # an assistant's refusal part

    @field_validator("text", "refusal")
    @classmethod
    def _valid_text(cls, value: str | None) -> str | None:
        return None if value is None else _valid_unicode(value)


class FunctionCall(OpenAIObject):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCall(OpenAIObject):
    """A call the assistant made, replayed in a conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


ChatRole = Literal["system", "user", "assistant", "developer", "tool"]
CHAT_ROLES: tuple[str, ...] = get_args(ChatRole)
# OpenAI's rule for function names; it also keeps a name plain text in a grammar.
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class ChatMessage(OpenAIObject):
    # A response message dumped by the OpenAI SDK carries these as null.
    unset_when_null = frozenset({"audio", "function_call"})
    role: ChatRole
    # Null only where OpenAI allows it (an assistant message with tool calls): checked in
    # openai/messages.py, which names the message.
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    # What a client echoes back from an earlier response (the OpenAI SDK's message).
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's name for it since 2026
    refusal: str | None = None
    # URL citations of an earlier answer: they say nothing to the model, so are ignored.
    annotations: list[Any] | None = None

    @field_validator("content")
    @classmethod
    def _valid_content(cls, value: str | list[ContentPart] | None) -> object:
        return _valid_unicode(value) if isinstance(value, str) else value


class FunctionDefinition(OpenAIObject):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (an object's)
    strict: bool | None = None


class Tool(OpenAIObject):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIObject):
    name: str


class NamedToolChoice(OpenAIObject):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(OpenAIObject):
    model_config = ConfigDict(populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIObject):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # Variables for the model's chat template (vLLM's name), e.g. Qwen3's
    # {"enable_thinking": false}; reasoning_effort is one more (as vLLM passes it).
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # vLLM's: how the rendered prompt ends (ChatEnding). The assistant's turn is opened for
    # a new answer unless add_generation_prompt is false; continue_final_message leaves
    # the final message open, so that the answer goes on from its text (a "prefill").
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def chat_ending(self) -> ChatEnding:
        """The prompt's ending these two fields ask for; InvalidRequestError when both."""
        try:
            return chat_ending(self.add_generation_prompt, self.continue_final_message)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), "continue_final_message") from None

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's extra variables: ``reasoning_effort``, then
        ``chat_template_kwargs`` (which wins); None when there are none."""
        effort = {"reasoning_effort": self.reasoning_effort} if self.reasoning_effort else {}
        merged = {**effort, **(self.chat_template_kwargs or {})}
        return merged or None


# ---- LoRA adapters at run time (vLLM's endpoints and bodies) ---------------------------
class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter``: serve the PEFT adapter at ``lora_path`` (a folder
    under the server's ``--lora-dir``) as the model ``lora_name``; with ``load_inplace``,
    in place of the adapter already loaded under that name, without a gap."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter``: stop serving ``lora_name`` (its requests in
    flight finish first)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
