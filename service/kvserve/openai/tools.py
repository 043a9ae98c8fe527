"""A chat request's tools and tool choice: checked, and in the shapes the chat template,
the wire (``rpc/codec.py``) and the grammar (``openai/tool_grammar.py``) take.

The checks here need no tokenizer, so the gateway and the engine server both apply them
(400 naming ``tools`` or ``tool_choice``). Whether a parameter schema compiles is the
engine's check (``server/chat.py``), which names ``tools[i].function.parameters``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kvserve.openai.errors import OpenAIError
from kvserve.openai.protocol import ChatCompletionRequest

ToolChoiceMode = Literal["none", "auto", "required", "function"]
# A function without ``parameters`` takes none (OpenAI's "empty parameter list"): a forced
# call's arguments are ``{}``, not whatever object the model writes.
EMPTY_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {},
    "additionalProperties": False,
}


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call. ``parameters`` is its JSON schema (an object's)."""

    name: str
    description: str | None
    parameters: dict[str, Any]
    strict: bool = False

    def template_dict(self) -> dict[str, Any]:
        """As Hugging Face chat templates take a tool (OpenAI's shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """``mode`` "function" forces the call of ``function``."""

    mode: ToolChoiceMode = "auto"
    function: str | None = None


@dataclass(frozen=True)
class ChatTools:
    """A request's tools, as one value: what the engine needs to render, constrain and
    parse its calls."""

    tools: tuple[ToolSpec, ...] = ()
    choice: ToolChoice = ToolChoice("none")
    parallel: bool = True

    @property
    def calls_possible(self) -> bool:
        """Whether the output is read for calls (tools offered, choice not "none")."""
        return bool(self.tools) and self.choice.mode != "none"

    @property
    def constrained(self) -> bool:
        """Whether a grammar forces the calls' shape: a call is required, or a strict
        tool may be called."""
        return self.calls_possible and (
            self.choice.mode in ("required", "function") or any(t.strict for t in self.tools)
        )

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.template_dict() for t in self.tools] or None

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)


def chat_tools(body: ChatCompletionRequest) -> ChatTools:
    """The request's tools, checked: unique names, a ``tool_choice`` that names one of
    them, ``required`` only with tools."""
    specs: list[ToolSpec] = []
    seen: set[str] = set()
    for i, tool in enumerate(body.tools or ()):
        f = tool.function
        if f.name in seen:
            raise OpenAIError(
                400, f"tools[{i}]: the tool name {f.name!r} is used twice", param="tools"
            )
        seen.add(f.name)
        _check_object_schema(f.parameters, i)
        specs.append(
            ToolSpec(f.name, f.description, f.parameters or EMPTY_PARAMETERS, bool(f.strict))
        )
    choice = body.tool_choice
    if choice is None:
        resolved = ToolChoice("auto" if specs else "none")
    elif isinstance(choice, str):
        resolved = ToolChoice(choice)
    else:
        resolved = ToolChoice("function", choice.function.name)
        if choice.function.name not in seen:
            raise OpenAIError(
                400,
                f"tool_choice names the function {choice.function.name!r}, which is not "
                f"among the tools ({', '.join(sorted(seen)) or 'none given'})",
                param="tool_choice",
            )
    if resolved.mode == "required" and not specs:
        raise OpenAIError(400, 'tool_choice "required" needs tools', param="tool_choice")
    return ChatTools(tuple(specs), resolved, body.parallel_tool_calls)


def _check_object_schema(parameters: dict[str, Any] | None, i: int) -> None:
    """A function's arguments are a JSON object (OpenAI's rule, and what a client's
    ``json.loads(arguments)`` then ``**kwargs`` needs): a schema whose ``type`` says
    otherwise is refused, where a forced call would have given a string or a list."""
    kind = (parameters or {}).get("type", "object")
    kinds = kind if isinstance(kind, list) else [kind]
    if "object" not in kinds or len(kinds) > 1:
        raise OpenAIError(
            400,
            f"tools[{i}].function.parameters must be the JSON schema of an object "
            f'(type "object"), not of type {kind!r}: a function\'s arguments are an object',
            param=f"tools[{i}].function.parameters",
        )
