"""``kvserve chat``: an interactive, streaming chat in the terminal.

Two backends share one REPL: ``HTTPBackend`` talks to a running kvserve (or any
OpenAI-compatible) server over ``POST /v1/chat/completions`` with SSE streaming, and
``InProcessBackend`` runs the engine in this process. Both stream text deltas for the
whole conversation (system prompt and every turn) and can abort a generation midway.

``--tools`` (in-process) offers the model tools that run here (:class:`LocalTools`; the demo
model's ``search_hotels`` over its world model): when the answer is a tool call, the REPL
prints the call, runs it, prints the result, appends both to the conversation and lets the
model go on -- an agent loop, offline. Calls are read out of the streamed text by the
server's own Hermes parser (``kvserve.openai.tool_parsers``).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import io
import itertools
import json
import queue
import random
import sys
import threading
from collections.abc import Callable, Coroutine, Generator, Iterator
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO, TypeVar

import httpx

from kvserve.arg_types import positive_int
from kvserve.openai.tool_parsers import ParsedToolCall, ToolParse, make_tool_parser
from kvserve.sse_events import DONE, error_message, event_data, parse_event

if TYPE_CHECKING:
    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.engine.request import Request

Message = dict[str, Any]
T = TypeVar("T")

#: Tool calls in a row before the REPL gives up on an answer (a model that keeps calling).
MAX_TOOL_ROUNDS = 3

DEFAULT_URL = "http://127.0.0.1:8000"
HELP = """commands:
  /reset  forget the conversation (the system prompt stays)
  /exit   quit (so does Ctrl-D)
  /help   this text
Ctrl-C stops the answer being generated; Ctrl-C at the prompt clears the line."""


class ChatError(Exception):
    """A turn failed (bad request, server error, lost connection); the REPL carries on."""


class ChatConnectError(ChatError):
    """The server cannot be reached at all."""


@dataclass(frozen=True)
class ChatParams:
    """Sampling settings sent with every turn."""

    temperature: float = 0.7
    max_tokens: int = 256
    seed: int | None = None


class ChatBackend(Protocol):
    """Where the answers come from; the REPL only needs these calls."""

    label: str  # what the banner says we talk to

    def stream(
        self,
        messages: list[Message],
        params: ChatParams,
        tools: list[dict[str, Any]] | None = None,
    ) -> Iterator[str]:
        """Yield the assistant's answer to ``messages`` (offering ``tools``) as text deltas."""
        ...

    def abort(self) -> None:
        """Stop the generation in progress (if any) so it stops costing compute."""
        ...

    def close(self) -> None:
        """Release connections, threads and the engine."""
        ...


# ---- over HTTP -----------------------------------------------------------------------
class HTTPBackend:
    """An OpenAI-compatible server's ``/v1/chat/completions``, streamed over SSE."""

    def __init__(self, url: str, model: str | None = None, *, read_timeout: float = 300.0) -> None:
        base = url.rstrip("/")
        # Accept an OpenAI-style base URL ending in /v1 as well as the server root.
        base = base.removesuffix("/v1")
        self.url = base
        self.label = base
        # The read timeout bounds the gap between two chunks, and a long prompt's
        # prefill on a CPU can take a while before the first one.
        self._client = httpx.Client(base_url=base, timeout=httpx.Timeout(10.0, read=read_timeout))
        self._response: httpx.Response | None = None
        self._aborted = False
        try:
            self.model = self._resolve_model(model)
        except BaseException:
            self._client.close()
            raise
        self.label = f"{self.model} at {base}"

    def _resolve_model(self, model: str | None) -> str:
        # Always ask /v1/models: it doubles as the check that the server is reachable.
        try:
            resp = self._client.get("/v1/models")
        except httpx.TransportError as exc:
            raise ChatConnectError(f"cannot reach {self.url}: {_describe(exc)}") from exc
        if model is not None:
            return model  # the server may not list models; the name was given anyway
        if resp.status_code != 200:
            raise ChatError(
                f"GET {self.url}/v1/models failed: {_error_message(resp)} "
                "(pass --served-model-name NAME)"
            )
        try:
            return str(resp.json()["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ChatError(
                f"{self.url}/v1/models lists no model (pass --served-model-name NAME)"
            ) from exc

    def stream(
        self,
        messages: list[Message],
        params: ChatParams,
        tools: list[dict[str, Any]] | None = None,
    ) -> Iterator[str]:
        """Stream one answer; closing the response makes the server abort the request."""
        if tools:
            # The server parses calls into delta.tool_calls; this client reads text only.
            raise ChatError("tools run in-process only (kvserve chat --tools without --url)")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "stream": True,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        self._aborted = False
        try:
            with self._client.stream("POST", "/v1/chat/completions", json=body) as resp:
                self._response = resp
                if resp.status_code != 200:
                    resp.read()
                    raise ChatError(_error_message(resp))
                for line in resp.iter_lines():
                    if self._aborted:
                        # Closing the response stops the reads, but lines already read
                        # in the same chunk are still in httpx's decoder: drop them.
                        return
                    data = event_data(line)
                    if data is None:
                        continue  # SSE comments, blank separators
                    if data == DONE:
                        return
                    yield from _deltas(data)
        except httpx.ConnectError as exc:  # the server went away between turns
            raise ChatError(f"cannot reach {self.url}: {_describe(exc)}") from exc
        except (httpx.TransportError, httpx.StreamError) as exc:
            if self._aborted:
                return  # abort() closed the response under us: that is the point
            raise ChatError(f"lost the connection to {self.url}: {_describe(exc)}") from exc
        finally:
            self._response = None

    def abort(self) -> None:
        """Close the streaming response: the server sees the disconnect and aborts."""
        self._aborted = True
        resp = self._response
        if resp is not None:
            resp.close()

    def close(self) -> None:
        self.abort()
        self._client.close()


def _deltas(data: str) -> Iterator[str]:
    """The content delta of one SSE event, if any; raises ChatError for an error event."""
    try:
        event = parse_event(data)
    except ValueError as exc:
        raise ChatError(f"the server sent an event that is not JSON: {data[:80]!r}") from exc
    if event.error is not None:
        raise ChatError(event.error)
    if event.text:
        yield event.text


def _error_message(resp: httpx.Response) -> str:
    """One line from an error response: the OpenAI error message when there is one."""
    try:
        payload = resp.json()
    except ValueError:
        text = resp.text.strip().splitlines()
        return f"HTTP {resp.status_code}" + (f": {text[0][:200]}" if text else "")
    return f"HTTP {resp.status_code}: {error_message(payload)}"


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


# ---- in this process -----------------------------------------------------------------
_END = object()  # marks the end of a stream in the delta queue


class InProcessBackend:
    """The async engine in this process, its event loop on a background thread.

    The REPL is synchronous (``input()`` blocks), so the engine's asyncio face lives on
    its own loop thread; deltas cross back through a thread-safe queue.
    """

    def __init__(
        self,
        model: str | PathLike[str],
        *,
        dtype: str = "auto",
        device: str = "auto",
        seed: int = 0,
    ) -> None:
        from kvserve.config import EngineConfig
        from kvserve.engine.async_engine import AsyncEngine
        from kvserve.engine.cpu_threads import call_in_short_lived_thread
        from kvserve.engine.llm_engine import LLMEngine

        # One conversation at a time: a few sequences is plenty, and on a CPU the KV
        # pool is sized from max_num_seqs, so this keeps memory small.
        # Loaded in a thread that exits, so only the engine thread computes with torch
        # (see kvserve.engine.cpu_threads).
        config = EngineConfig(
            model=str(model), dtype=dtype, device=device, max_num_seqs=4, seed=seed
        )
        llm = call_in_short_lived_thread(LLMEngine, config)
        tok = llm.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ChatError(f"the model in {model} has no chat template")
        self.engine: AsyncEngine = AsyncEngine(llm)
        self.label = f"{model} (in-process, {llm.device})"
        self._tokenizer: Any = tok
        self.renders_tools = "<tool_call>" in str(tok.chat_template)  # a Hermes-style template
        self._ids = itertools.count()
        self._lock = threading.Lock()
        # The stream being read: its pump, its queue, and the flag abort() sets.
        self._current: (
            tuple[concurrent.futures.Future[None], queue.Queue[object], threading.Event] | None
        ) = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvserve-chat-loop", daemon=True
        )
        self._thread.start()
        self._call(self._start())

    async def _start(self) -> None:
        self.engine.start()  # must run on the loop the engine will hand outputs to

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def stream(
        self,
        messages: list[Message],
        params: ChatParams,
        tools: list[dict[str, Any]] | None = None,
    ) -> Iterator[str]:
        """Render the chat template, then stream the engine's text deltas."""
        from kvserve.engine.async_engine import EngineDeadError
        from kvserve.sampling_params import SamplingParams

        prompt_ids = self.engine.engine.chat_prompt(messages, tools)
        # Like the server's default: never ask for more than the context has room for,
        # so a long conversation still gets an answer (the engine rejects a full one).
        room = self.engine.engine.max_model_len - len(prompt_ids)
        try:
            sampling = SamplingParams(
                max_tokens=max(1, min(params.max_tokens, room)),
                temperature=params.temperature,
                seed=params.seed,
            )
            req = self.engine.make_request(prompt_ids, sampling, f"chat-{next(self._ids)}")
        except (ValueError, EngineDeadError) as exc:
            hint = " (/reset starts a new conversation)" if room < 1 else ""
            raise ChatError(f"{exc}{hint}") from exc
        return self._stream(req)

    def _stream(self, req: Request) -> Generator[str, None, None]:
        deltas: queue.Queue[object] = queue.Queue()
        future = asyncio.run_coroutine_threadsafe(self._pump(req, deltas), self._loop)
        aborted = threading.Event()
        with self._lock:
            self._current = (future, deltas, aborted)
        try:
            while True:
                item = _get(deltas)
                if item is _END or aborted.is_set():
                    return  # deltas queued before an abort are dropped with the rest
                if isinstance(item, BaseException):
                    raise ChatError(str(item)) from item
                assert isinstance(item, str)
                yield item
        finally:
            # Left early (Ctrl-C, abort, the consumer stopped): cancelling the pump makes
            # the engine stream's cleanup abort the request before the next step.
            future.cancel()
            with self._lock:
                if self._current is not None and self._current[0] is future:
                    self._current = None

    async def _pump(self, req: Request, deltas: queue.Queue[object]) -> None:
        from kvserve.engine.async_engine import EngineDeadError, RequestFailedError

        try:
            async for out in self.engine.stream(req):
                delta = out.outputs[0].delta_text
                if delta:
                    deltas.put(delta)
        except (RequestFailedError, EngineDeadError) as exc:
            deltas.put(exc)
            return
        finally:
            deltas.put(_END)  # after an error it is never read; harmless

    def abort(self) -> None:
        """Abort the request in the engine and end the stream being read."""
        with self._lock:
            current, self._current = self._current, None
        if current is not None:
            future, deltas, aborted = current
            aborted.set()
            future.cancel()
            deltas.put(_END)

    def close(self) -> None:
        self.abort()
        if self._loop.is_running():
            self._call(self.engine.stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._loop.close()


def _get(q: queue.Queue[object]) -> object:
    # A timeout keeps the wait interruptible by Ctrl-C on every platform (a bare blocking
    # get is not on Windows); it is not a poll for data, get returns as soon as it can.
    while True:
        try:
            return q.get(timeout=0.5)
        except queue.Empty:
            continue


# ---- local tools ---------------------------------------------------------------------
@dataclass(frozen=True)
class LocalTools:
    """Tools offered to the model and run in this process.

    ``definitions`` are OpenAI-style function tools; ``run(name, arguments)`` returns the
    result text for the tool message (never raises for bad arguments: it says what is wrong,
    as a tool would).
    """

    definitions: list[dict[str, Any]]
    run: Callable[[str, dict[str, Any]], str]

    @property
    def names(self) -> frozenset[str]:
        return frozenset(str(d["function"]["name"]) for d in self.definitions)


def demo_tools(seed: int = 0) -> LocalTools:
    """The demo model's ``search_hotels``, answered from its world model (invented listings
    that follow the world's rules; ``seed`` makes them reproducible)."""
    from kvserve.demo_model import corpus

    rng = random.Random(f"kvserve-chat-tools:{seed}")

    def run(name: str, arguments: dict[str, Any]) -> str:
        if name != "search_hotels":
            return f"Error: unknown tool {name!r}"
        return corpus.search_hotels(arguments, rng)

    return LocalTools([corpus.SEARCH_HOTELS_TOOL], run)


# ---- the REPL ------------------------------------------------------------------------
class Repl:
    """Read a line, stream the answer, keep the history; shared by both backends."""

    def __init__(
        self,
        backend: ChatBackend,
        params: ChatParams,
        *,
        system: str | None = None,
        tools: LocalTools | None = None,
        interactive: bool = False,
        read_line: Callable[[str], str] = input,
        out: TextIO | None = None,
        err: TextIO | None = None,
    ) -> None:
        self.backend = backend
        self.params = params
        self.system = system
        self.tools = tools
        self.interactive = interactive
        self.read_line = read_line
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.history: list[Message] = []
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def run(self) -> int:
        """Loop until EOF or /exit; returns the exit code."""
        prompt = "you> " if self.interactive else ""
        while True:
            try:
                line = self.read_line(prompt)
            except EOFError:
                if self.interactive:
                    self.out.write("\n")  # leave the shell prompt on a fresh line
                return 0
            except KeyboardInterrupt:
                # Ctrl-C at the prompt drops the line being typed, not the session.
                self.out.write("\n")
                continue
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                if self.command(text):
                    return 0
                continue
            self.turn(text)

    def command(self, text: str) -> bool:
        """Run a slash command; True means quit."""
        name = text.split()[0].lower()
        if name in ("/exit", "/quit"):
            return True
        if name == "/reset":
            self.reset()
            self.out.write("[history cleared]\n")
        elif name == "/help":
            self.out.write(HELP + "\n")
        else:
            self.out.write(f"unknown command {name}; /help lists them\n")
        self.out.flush()
        return False

    def turn(self, text: str) -> None:
        """One user message and the streamed answer (after any tool calls it takes)."""
        start = len(self.history)
        self.history.append({"role": "user", "content": text})
        for _ in range(MAX_TOOL_ROUNDS + 1):
            try:
                content, calls = self._generate()
            except ChatError as exc:
                # Drop the failed turn so the history stays user/assistant alternating and
                # the next turn does not resend whatever the server refused.
                del self.history[start:]
                self.err.write(f"error: {_one_line(str(exc))}\n")
                self.err.flush()
                return
            if not calls:
                # A stopped answer stays too: the user saw it, and the model should as well.
                self.history.append({"role": "assistant", "content": content})
                return
            self._run_calls(content, calls)
        self.err.write(f"error: no answer after {MAX_TOOL_ROUNDS + 1} rounds of tool calls\n")
        self.err.flush()
        del self.history[start:]

    def _generate(self) -> tuple[str, list[ParsedToolCall]]:
        """Stream one assistant message: its text, and the tool calls in it (when tools are
        offered, calls are not shown as text but as one ``[call]`` line each)."""
        self.out.write("assistant> ")
        self.out.flush()
        parts: list[str] = []
        calls: list[ParsedToolCall] = []
        parser = make_tool_parser("hermes", self.tools.names) if self.tools else None
        stream: Iterator[str] | None = None
        try:
            definitions = self.tools.definitions if self.tools else None
            stream = self.backend.stream(list(self.history), self.params, definitions)
            for delta in stream:
                if parser is None:
                    parts.append(delta)
                    self.out.write(delta)
                else:
                    self._show(parser.feed(delta), parts, calls)
                self.out.flush()
            if parser is not None:
                self._show(parser.finish(), parts, calls)
        except KeyboardInterrupt:
            self.backend.abort()
            self.out.write("\n[stopped]\n")
            self.out.flush()
            return "".join(parts), []  # a call cut short is not run
        except ChatError:
            self.out.write("\n")
            self.out.flush()
            raise
        else:
            if not calls or parts:
                self.out.write("\n")
            self.out.flush()
        finally:
            if isinstance(stream, Generator):
                stream.close()
        return "".join(parts), calls

    def _show(self, parse: ToolParse, parts: list[str], calls: list[ParsedToolCall]) -> None:
        if parse.content:
            parts.append(parse.content)
            self.out.write(parse.content)
        for call in parse.calls:
            calls.append(call)
            lead = "\n" if parts or len(calls) > 1 else ""
            self.out.write(f"{lead}[call] {call.name}({call.arguments})")

    def _run_calls(self, content: str, calls: list[ParsedToolCall]) -> None:
        """Append the assistant's calls, run each, print and append its result."""
        assert self.tools is not None
        self.out.write("\n")
        self.history.append(
            {
                "role": "assistant",
                "content": content,
                "tool_calls": [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": json.loads(c.arguments)},
                    }
                    for c in calls
                ],
            }
        )
        for call in calls:
            result = self.tools.run(call.name, json.loads(call.arguments))
            shown = result.replace("\n", "\n" + " " * len("[result] "))  # lines aligned
            self.out.write(f"[result] {shown}\n")
            self.history.append({"role": "tool", "tool_call_id": call.id, "content": result})
        self.out.flush()


def _one_line(text: str) -> str:
    return " ".join(text.split())


# ---- the command ---------------------------------------------------------------------
def _temperature(value: str) -> float:
    t = float(value)
    if not 0 <= t <= 2:
        raise argparse.ArgumentTypeError(f"must be in [0, 2], got {value}")
    return t


def add_arguments(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--url",
        help=f"an OpenAI-compatible server to talk to (e.g. {DEFAULT_URL}); "
        "without it the engine runs in this process",
    )
    where.add_argument(
        "--model",
        metavar="DIR",
        help="Hugging Face checkpoint directory to run in-process (default: the demo model)",
    )
    p.add_argument(
        "--served-model-name",
        metavar="NAME",
        help='the "model" to send with --url (default: the first one /v1/models lists)',
    )
    p.add_argument("--system", metavar="TEXT", help="a system prompt that starts the conversation")
    p.add_argument(
        "--tools",
        action="store_true",
        help="in-process only: offer the demo model's search_hotels tool and run its calls "
        "here, over the demo's world model (a call, its result, then the answer)",
    )
    p.add_argument("--temperature", type=_temperature, default=0.7, metavar="T", help="0 is greedy")
    p.add_argument("--max-tokens", type=positive_int, default=256, metavar="N", help="per answer")
    p.add_argument("--seed", type=int, metavar="N", help="sampling seed (reproducible answers)")
    p.add_argument("--dtype", default="auto", help="in-process only: auto, float32, bfloat16")
    p.add_argument("--device", default="auto", help="in-process only: auto, cpu or cuda")


def default_model_path() -> Path:
    """The bundled demo model's directory (FileNotFoundError when this install has none)."""
    from kvserve.demo_model import default_model_dir

    return default_model_dir()


def _make_backend(args: argparse.Namespace) -> ChatBackend | int:
    """The backend the arguments ask for, or an exit code after printing why not."""
    if args.url:
        if args.tools:
            print(
                "kvserve chat: error: --tools runs the tools in-process: drop --url",
                file=sys.stderr,
            )
            return 2
        try:
            return HTTPBackend(args.url, args.served_model_name)
        except ChatError as exc:
            print(f"kvserve chat: error: {_one_line(str(exc))}", file=sys.stderr)
            return 1
    try:
        model = Path(args.model).expanduser() if args.model else default_model_path()
    except FileNotFoundError as exc:  # an install without the bundled model
        print(
            f"kvserve chat: error: {exc} (--model DIR), or chat with a server (--url URL)",
            file=sys.stderr,
        )
        return 2
    print(f"loading {model} ...", file=sys.stderr, flush=True)
    try:
        return InProcessBackend(model, dtype=args.dtype, device=args.device, seed=args.seed or 0)
    except (ChatError, ValueError, FileNotFoundError) as exc:
        print(f"kvserve chat: error: {_one_line(str(exc))}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    """The ``kvserve chat`` command: 0 at EOF or /exit, 1 if the server is unreachable."""
    # Model output can hold any character: never let an encoding error end the chat.
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="replace")
    backend = _make_backend(args)
    if isinstance(backend, int):
        return backend
    if args.tools and not getattr(backend, "renders_tools", False):
        print(
            "kvserve chat: warning: this model's chat template does not render tools "
            "(a model trained with `kvserve train-demo --no-tools` does not); it will not call "
            "them",
            file=sys.stderr,
        )
    interactive = sys.stdin.isatty()
    if interactive:
        # Line editing and history for input(); readline is not on every platform.
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401
        print(f"chatting with {backend.label}; /help for commands, Ctrl-D to quit")
    params = ChatParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    try:
        tools = demo_tools(args.seed or 0) if args.tools else None
        return Repl(backend, params, system=args.system, tools=tools, interactive=interactive).run()
    finally:
        backend.close()
