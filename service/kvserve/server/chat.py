"""A chat request made ready for the engine: its prompt, its output constraint and the
reader of its answer. One definition for the HTTP route and the gRPC servicer.

Refusals are ``InvalidRequestError`` naming the client's field (``tools``,
``tools[2].function.parameters``, ``response_format.json_schema.schema``, ...); each
front end turns them into its own 400.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from kvserve.conversation import ChatEnding
from kvserve.engine.async_engine import AsyncEngine
from kvserve.errors import InvalidRequestError
from kvserve.openai.chat_output import ChatOutputParser, ChatParsing
from kvserve.openai.reasoning import opens_in_prompt
from kvserve.openai.structured import Constraint
from kvserve.openai.tool_grammar import tool_call_grammar
from kvserve.openai.tools import ChatTools
from kvserve.sampling_params import StructuredOutputsParams


@dataclass
class PreparedChat:
    prompt_ids: list[int]
    constraint: StructuredOutputsParams | None
    # A new reader of one answer (one per sample), given its skip_special_tokens; None:
    # the answer is plain content.
    new_parser: Callable[[bool], ChatOutputParser | None]
    constraint_param: str | None = None  # the field the constraint came in


async def prepare_chat(
    engine: AsyncEngine,
    parsing: ChatParsing,
    messages: list[dict[str, Any]],
    tools: ChatTools,
    constraint: Constraint | None,
    template_kwargs: dict[str, Any] | None = None,
    ending: ChatEnding = "generation_prompt",
) -> PreparedChat:
    """Check the tools and the constraint, build the tool-call grammar if one is needed,
    and render the prompt (a long one off the event loop)."""
    if tools.calls_possible and parsing.tool_parser is None:
        raise InvalidRequestError(
            "this model has no tool-call parser: the server was started without "
            "--tool-call-parser and its chat template names no known call format; send "
            'tool_choice "none" to offer tools without reading calls',
            "tools",
        )
    checks: list[tuple[StructuredOutputsParams, str]] = [
        (StructuredOutputsParams(json=t.parameters), f"tools[{i}].function.parameters")
        for i, t in enumerate(tools.tools)
    ]
    chosen: Constraint | None = constraint
    if tools.constrained:
        assert parsing.tool_parser is not None
        if constraint is not None:
            raise InvalidRequestError(
                f"{constraint.param} cannot be combined with tool_choice "
                f'"{tools.choice.mode}" or strict tools (both constrain the output)',
                constraint.param,
            )
        grammar = tool_call_grammar(parsing.tool_parser, tools, parsing.special_markers)
        chosen = Constraint(StructuredOutputsParams(grammar=grammar), "tools")
    # A schema or a tool call describes the answer, which a reasoning model gives after its
    # think block; a regex, choice or grammar describes the whole output (a client may
    # write the block into it).
    answer_only = tools.constrained or (
        chosen is not None and chosen.params.kind in ("json", "json_object")
    )
    if chosen is not None and parsing.reasoning_parser is not None and answer_only:
        opened = opens_in_prompt(parsing.reasoning_parser)
        think_block: Literal["open", "optional"] = "open" if opened else "optional"
        chosen = Constraint(replace(chosen.params, think_block=think_block), chosen.param)
    if chosen is not None:
        checks.append((chosen.params, chosen.param))
    if checks:
        # Checking compiles (cached by content): off the event loop, like a long prompt.
        await asyncio.to_thread(_check_all, engine, checks)
    prompt_ids = await engine.chat_prompt(messages, tools.template_tools(), template_kwargs, ending)
    return PreparedChat(
        prompt_ids,
        chosen.params if chosen else None,
        functools.partial(parsing.parser, tools),
        chosen.param if chosen else None,
    )


def _check_all(engine: AsyncEngine, checks: list[tuple[StructuredOutputsParams, str]]) -> None:
    """Each constraint checked with the engine's own tokenizer, so that the engine's check
    when the request is made is a cache hit (not a compile on the event loop)."""
    for params, param in checks:
        try:
            engine.engine.structured.grammar(params)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{param}: {exc}", param) from None


async def validate_constraint(engine: AsyncEngine, constraint: Constraint) -> None:
    """A completion's constraint checked (``InvalidRequestError`` naming its field)."""
    await asyncio.to_thread(_check_all, engine, [(constraint.params, constraint.param)])
