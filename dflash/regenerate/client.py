"""A client of an OpenAI-compatible chat-completions server (vLLM, SGLang), standard library only.

    ChatClient(url=chat_completions_url("http://host:8000"), model=..., max_tokens=...)
      .complete(messages) --POST {model, messages, max_tokens, temperature[, seed, tools, chat_template_kwargs]}-->
      Reply(content, reasoning, cut)      retried on connection errors, timeouts, 408/429/5xx

One client is shared by every worker thread of `dflash regenerate --endpoint` (dflash/regenerate/server.py):
it holds no connection state, and each request opens its own connection.
"""

from __future__ import annotations

import json
import logging
import random
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.client import HTTPException

from dflash.errors import ConfigError, ServerError

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})  # the server may answer later; others will not
MAX_BACKOFF_S = 60.0  # the longest wait between two attempts, Retry-After included


def chat_completions_url(endpoint: str) -> str:
    """The URL to POST to: `http://host:8000` and `http://host:8000/v1` both give
    `http://host:8000/v1/chat/completions`; a URL already ending in /chat/completions is kept."""
    parts = urllib.parse.urlsplit(endpoint.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--endpoint {endpoint!r} is not an http(s) URL with a host; pass the server's base "
                          "URL, e.g. http://localhost:8000 (vLLM) or http://localhost:30000 (SGLang).")
    try:
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number in range
    except ValueError as exc:
        raise ConfigError(f"--endpoint {endpoint!r}: {exc}; e.g. http://localhost:8000") from None
    path = parts.path.rstrip("/")
    if not path.endswith("/chat/completions"):
        path += "/chat/completions" if path.endswith("/v1") else "/v1/chat/completions"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


class Stopped(Exception):
    """The run is stopping (SIGTERM/SIGINT): the conversation was not finished and is left for --resume."""


class RequestFailed(Exception):
    """A request failed for good: not retryable, or still failing after every retry."""

    def __init__(self, reason: str, attempts: int):
        super().__init__(reason)
        self.reason, self.attempts = reason, attempts


@dataclass(frozen=True)
class Reply:
    content: str
    reasoning: str | None
    cut: bool  # finish_reason == "length": the answer hit max_tokens and is kept, cut there


@dataclass
class ChatClient:
    """POSTs chat completions to one server; `complete` retries what a later attempt may fix.

    Retried: connection errors (refused, reset), timeouts, HTTP 408/429/5xx; waits are exponential
    (backoff, 2 x backoff, ... capped at MAX_BACKOFF_S) with full jitter, or the server's Retry-After.
    Not retried: other 4xx (a bad request, an unknown model) and a 200 whose body is not a completion.
    """

    url: str
    model: str
    max_tokens: int
    temperature: float = 0.0
    seed: int = 0
    chat_template_kwargs: dict | None = None
    api_key: str | None = field(default=None, repr=False)  # never printed
    timeout: float = 600.0  # seconds a request may wait on the socket (unstreamed: the whole generation)
    retries: int = 5  # attempts after the first
    backoff: float = 1.0  # seconds before the first retry
    stop: threading.Event = field(default_factory=threading.Event, repr=False)

    def body(self, messages: list[dict]) -> bytes:
        """The request's JSON. History goes without `reasoning_content` (the Qwen templates drop it from
        earlier turns), and tool-call arguments as the JSON strings of the OpenAI wire format (dflash.data.chat
        keeps them as mappings, the form chat templates iterate)."""
        request = {"model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature,
                   "messages": [_wire_message(m) for m in messages]}
        if self.temperature > 0:
            request["seed"] = self.seed
        if getattr(messages, "tools", None):  # the server renders them as the target's tools block
            request["tools"] = messages.tools
        if self.chat_template_kwargs:
            request["chat_template_kwargs"] = self.chat_template_kwargs
        return json.dumps(request, ensure_ascii=False).encode("utf-8")

    def post(self, body: bytes) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            return json.loads(response.read())

    def check_reachable(self, timeout: float = 10.0) -> None:
        """Fail fast, before any work, when nothing can answer at the server's address: the connection is
        refused (no server listens on that port) or the host name does not resolve. A ServerError names the
        URL and the fix. Any HTTP answer, an error status included, means a server is there; a time-out is
        left to the retries of each request (a busy server may answer later)."""
        models = self.url.removesuffix("/chat/completions") + "/models"
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        request = urllib.request.Request(models, headers=headers, method="GET")
        try:
            with urllib.request.urlopen(request, timeout=min(timeout, self.timeout)):
                return
        except urllib.error.HTTPError:
            return
        except urllib.error.URLError as exc:
            cause = exc.reason
        except (HTTPException, OSError):
            return
        where = urllib.parse.urlsplit(self.url)
        if isinstance(cause, ConnectionRefusedError):
            raise ServerError(f"nothing listens at {where.scheme}://{where.netloc} (connection refused, for "
                              f"{self.url}); start the server there (e.g. vllm serve MODEL --port "
                              f"{where.port or 80}), or pass the --endpoint it listens on. No request was sent "
                              "and no output was written.") from None
        if isinstance(cause, socket.gaierror):
            raise ServerError(f"the host of --endpoint {self.url} does not resolve ({cause}); check the host name "
                              "in --endpoint. No request was sent and no output was written.") from None

    def complete(self, messages: list[dict]) -> tuple[Reply, int]:
        """The server's next assistant message after `messages`, and the attempts it took."""
        body = self.body(messages)
        for attempt in range(1, self.retries + 2):
            if self.stop.is_set():
                raise Stopped
            retry_after = None
            try:
                return parse_reply(self.post(body)), attempt
            except urllib.error.HTTPError as exc:
                reason = f"HTTP {exc.code} {exc.reason}: {_error_text(exc)}"
                if exc.code not in RETRY_STATUSES:
                    raise RequestFailed(reason, attempt) from None
                retry_after = _seconds(exc.headers.get("Retry-After"))
            except (urllib.error.URLError, HTTPException, OSError) as exc:  # refused, reset, timed out
                cause = getattr(exc, "reason", exc)
                reason = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
            except ValueError as exc:  # a 200 whose body is not JSON, or not a chat completion
                raise RequestFailed(f"bad response: {exc}", attempt) from None
            if attempt > self.retries:
                raise RequestFailed(f"{reason} (after {attempt} attempts)", attempt)
            delay = retry_after if retry_after is not None else random.uniform(0, self.backoff * 2 ** (attempt - 1))
            log.debug("attempt %d failed (%s); retrying in %.2f s", attempt, reason, delay)
            if self.stop.wait(min(delay, MAX_BACKOFF_S)):
                raise Stopped
        raise AssertionError("unreachable")


def _wire_message(message: dict) -> dict:
    wire = {k: v for k, v in message.items() if k != "reasoning_content"}
    calls = []
    for call in wire.get("tool_calls") or []:
        args = call["function"].get("arguments", {})
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append({**call, "function": {**call["function"], "arguments": args}})
    if calls:
        wire["tool_calls"] = calls
    return wire


def parse_reply(response: dict) -> Reply:
    """choices[0].message of a chat completion; ValueError saying what is missing."""
    try:
        choice = response["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"no choices[0].message in {json.dumps(response)[:200]}") from None
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    return Reply(content=message.get("content") or "", reasoning=reasoning or None,
                 cut=choice.get("finish_reason") == "length")


def _error_text(exc: urllib.error.HTTPError) -> str:
    """The server's error message (OpenAI shape {"error": {"message"}} or FastAPI's {"detail"}), short."""
    try:
        raw = exc.read().decode("utf-8", "replace")
    except OSError:
        return ""
    try:
        data = json.loads(raw)
        error = data.get("error", data.get("detail", data)) if isinstance(data, dict) else data
        raw = error.get("message", error) if isinstance(error, dict) else error
    except ValueError:
        pass
    return " ".join(str(raw).split())[:300]


def _seconds(value) -> float | None:
    try:
        return max(0.0, float(value))
    except (TypeError, ValueError):
        return None  # absent, or an HTTP date: use the exponential backoff
