"""Regeneration through an OpenAI-compatible inference server (vLLM, SGLang): the path for real data sets.

    is a server there? (ChatClient.check_reachable: connection refused or an unknown host fails at once,
      before --out is created)
    chat.jsonl --read_conversations--> (key, messages) --skip keys already in out (--resume)-->
      ThreadPoolExecutor, --concurrency conversations at once, each answering its turns in order:
        ChatClient.complete (dflash/regenerate/client.py): POST {endpoint}/v1/chat/completions,
        retried on connection errors, timeouts, 408, 429 and 5xx
      --> each finished conversation appended to out: {"id": key, "messages": [...]}, flushed + fsynced
      --> failures after the retries: one line each in <out stem>.errors.jsonl, a summary, exit code 8

Which turns are answered, and how, is the in-process path's rule (dflash/regenerate/local.py): every assistant
turn, plus one appended after a final user prompt, in order, so a later answer sees the target's earlier
answers. The reasoning a server returns (vLLM's `message.reasoning`; older vLLM and SGLang's
`reasoning_content`) is kept as the assistant message's `reasoning_content`, which the Qwen chat templates
read. Earlier turns are sent without it (the Qwen templates drop it from history anyway).

A conversation's key is its record's `id`, else a hash of its non-assistant messages (the prompts); a
duplicate hash gets a `~N` suffix so identical prompts are all answered. The output is always valid
JSONL: lines are written whole, and a torn last line (a kill mid-write) is cut off by `--resume`. A run
that writes no conversation leaves no --out it created (an empty file would look like a result).
Lines come in completion order, not input order.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from dflash.data.chat import Conversation, DataReport, chat_lines, jsonl_record, tools_of
from dflash.errors import ConfigError, DataError, ServerError
from dflash.regenerate.local import reply_slots
from dflash.regenerate.client import ChatClient, RequestFailed, Stopped

log = logging.getLogger(__name__)


def answer_conversation(client: ChatClient, messages: list[dict]) -> tuple[list[dict], int, int]:
    """The conversation with every reply slot answered by the server, in order; (messages, cut, requests)."""
    result = Conversation([dict(m) for m in messages], tools_of(messages))
    n_cut = n_requests = 0
    for slot in reply_slots(messages):
        reply, attempts = client.complete(Conversation(result[:slot], result.tools))
        n_requests += attempts
        answer = {"role": "assistant", "content": reply.content}
        if reply.reasoning:
            answer["reasoning_content"] = reply.reasoning
        result[slot:slot + 1] = [answer]  # replaces the dataset's answer, or appends after a final prompt
        n_cut += reply.cut
    return result, n_cut, n_requests


# --------------------------------------------------------------------------------------------------
# Input and output files
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Item:
    key: str
    line: int
    messages: list[dict]


def prompt_hash(messages: list[dict]) -> str:
    prompts = [m for m in messages if m["role"] != "assistant"]
    text = json.dumps(prompts, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:20]


def read_conversations(path, on_error: str = "skip") -> tuple[list[Item], DataReport]:
    """The conversations of a chat JSONL with their keys (see the module docstring); bad lines as
    load_chat_jsonl treats them. Two records with the same `id` are a DataError naming both lines."""
    report, items, seen, hashes = DataReport(source=str(path)), [], {}, Counter()
    for lineno, record, messages in chat_lines(path, report, on_error):
        if isinstance(record, dict) and record.get("id") is not None:
            key = str(record["id"])
            if key in seen:
                raise DataError(f"{path}: lines {seen[key]} and {lineno} have the same id {key!r}; ids "
                                "identify conversations for --resume, so they must be unique.")
        else:
            key = prompt_hash(messages)
            hashes[key] += 1
            key = key if hashes[key] == 1 else f"{key}~{hashes[key] - 1}"
        seen[key] = lineno
        items.append(Item(key, lineno, messages))
    return items, report


def errors_path(out: Path) -> Path:
    """regen.jsonl -> regen.errors.jsonl (other names: <name>.errors.jsonl)."""
    return out.with_suffix(".errors.jsonl") if out.suffix == ".jsonl" else out.with_name(out.name + ".errors.jsonl")


def done_keys(out: Path) -> set[str]:
    """Keys of the conversations already in `out`, after cutting a torn last line (a kill mid-write)."""
    data = out.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        log.warning("%s: cutting a torn last line (%d bytes) left by an interrupted run", out, len(data) - end)
        with out.open("r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())
    keys = set()
    for lineno, raw in enumerate(data[:end].splitlines(), start=1):
        try:
            keys.add(str(json.loads(raw)["id"]))
        except (ValueError, KeyError, TypeError):
            raise DataError(f"{out}:{lineno}: not a line this command wrote (no JSON object with an \"id\"); "
                            "--resume needs the output of an earlier `dflash regenerate --endpoint` run.") from None
    return keys


class JsonlAppender:
    """Appends whole lines to a JSONL file, each flushed and fsynced before `write` returns. An exclusive
    lock on the file keeps a second run from writing into it at the same time."""

    def __init__(self, path: Path, *, lock: bool = False):
        import fcntl

        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if lock:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(self.fd)
                raise ConfigError(f"{path} is being written by another `dflash regenerate`; wait for it or "
                                  "pick another --out.") from None

    def write(self, record: dict) -> None:
        data = memoryview((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        while data:
            data = data[os.write(self.fd, data):]
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------
@dataclass
class RunSummary:
    out: Path
    total: int  # conversations in the input
    skipped: int = 0  # already in out (--resume)
    written: int = 0
    failed: int = 0
    requests: int = 0  # HTTP requests, retries included
    cut: int = 0  # answers that hit max_tokens
    reasons: Counter = field(default_factory=Counter)
    stopped_by: str | None = None  # "SIGTERM", "SIGINT", or "failures in a row"
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        if self.stopped_by in ("SIGINT", "SIGTERM"):
            return 128 + signal.Signals[self.stopped_by].value  # 130, 143: the shell's convention
        return ServerError.exit_code if self.failed or self.stopped_by else 0

    def message(self) -> str:
        line = (f"wrote {self.written} conversations to {self.out} in {self.seconds:.1f} s "
                f"({self.skipped} already there, {self.failed} failed, {self.total} in the input; "
                f"{self.requests} requests, {self.cut} answers hit max_tokens)")
        if self.failed:
            top = "; ".join(f"{n} x {reason}" for reason, n in self.reasons.most_common(3))
            line += f"\nfailed: {top}\nevery failure, by conversation: {errors_path(self.out)}"
        if self.stopped_by or self.failed:
            left = self.total - self.skipped - self.written
            why = f"stopped by {self.stopped_by}: " if self.stopped_by else ""
            line += (f"\n{why}{left} conversations not written ({self.failed} failed, {left - self.failed} not "
                     "tried); run again with --resume to do only those")
        return line


class _SignalStop:
    """SIGTERM/SIGINT set `event` (the run stops submitting and writes what is in flight); a second one
    exits at once (every line written so far is already on disk)."""

    def __init__(self, event: threading.Event, summary: RunSummary):
        self.event, self.summary, self.previous = event, summary, {}

    def __enter__(self):
        def handler(signum, _frame):
            name = signal.Signals(signum).name
            if self.event.is_set():
                os._exit(128 + signum)
            self.summary.stopped_by = name
            self.event.set()
            log.warning("%s: finishing the requests in flight, then stopping (again: stop at once)", name)

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, handler)
        return self

    def __exit__(self, *exc):
        for sig, previous in self.previous.items():
            signal.signal(sig, previous)


def _check_client_options(client: ChatClient, concurrency: int) -> None:
    """Refuse a concurrency, token limit, retry count, timeout or temperature out of range, naming its flag."""
    if concurrency < 1 or client.retries < 0 or client.timeout <= 0 or client.max_tokens < 1:
        raise ConfigError(f"--concurrency ({concurrency}) and --max-new-tokens ({client.max_tokens}) must be "
                          f">= 1, --retries ({client.retries}) >= 0 and --timeout ({client.timeout}) > 0.")
    if client.temperature < 0:
        raise ConfigError(f"--temperature must be >= 0 (0 = greedy), got {client.temperature}.")


def _finished_conversations(pool: ThreadPoolExecutor, client: ChatClient, todo: list[Item], concurrency: int):
    """(item, future) of each conversation of `todo` as it finishes, at most `concurrency` in flight; none
    is submitted once client.stop is set."""
    queue, pending = iter(todo), {}
    while True:
        while not client.stop.is_set() and len(pending) < concurrency:
            item = next(queue, None)
            if item is None:
                break
            pending[pool.submit(answer_conversation, client, item.messages)] = item
        if not pending:
            break
        finished, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
        for future in finished:
            yield pending.pop(future), future


def _record_failure(summary: RunSummary, errors: JsonlAppender, item: Item, exc: RequestFailed) -> None:
    """Count a conversation that failed after its retries, and write its line to the errors file."""
    summary.failed += 1
    summary.requests += exc.attempts
    summary.reasons[exc.reason.split(":")[0]] += 1
    errors.write({"id": item.key, "line": item.line, "error": exc.reason, "attempts": exc.attempts})


def _record_written(summary: RunSummary, writer: JsonlAppender, item: Item, messages: list[dict], n_cut: int,
                    n_requests: int) -> None:
    """Append an answered conversation to the output, and count it."""
    writer.write({"id": item.key, **jsonl_record(messages)})
    summary.written += 1
    summary.requests += n_requests
    summary.cut += n_cut


def regenerate_via_server(client: ChatClient, data, out, *, concurrency: int = 32, resume: bool = False,
                          on_bad_line: str = "skip", max_failures_in_a_row: int = 50,
                          progress: bool = True) -> RunSummary:
    """Answer every conversation of `data` through `client`'s server and append each to `out` as it
    completes (module docstring). Returns the summary; its exit_code is 0 only if every one was written."""
    from tqdm.auto import tqdm

    _check_client_options(client, concurrency)
    out = Path(out)
    if out.exists() and not resume:
        raise ConfigError(f"{out} exists; pass --resume to add only the conversations it lacks, or pick "
                          "another --out.")
    client.check_reachable()  # no server at all: one clear error now, not every request retried
    items, report = read_conversations(data, on_bad_line)
    summary = RunSummary(out=out, total=len(items))
    out.parent.mkdir(parents=True, exist_ok=True)
    created = not out.exists()
    writer = JsonlAppender(out, lock=True)
    errors_file = errors_path(out)
    errors_file.unlink(missing_ok=True)  # this run's failures only: the earlier ones are retried now
    errors = None
    try:
        done = done_keys(out)
        todo = [item for item in items if item.key not in done]
        summary.skipped = len(items) - len(todo)
        log.info("%s; %d already in %s, %d to do", report, summary.skipped, out, len(todo))
        start, in_a_row = time.monotonic(), 0
        bar = tqdm(total=len(todo), unit="conv", desc="regenerate", disable=not progress, dynamic_ncols=True)
        with _SignalStop(client.stop, summary), ThreadPoolExecutor(concurrency) as pool:
            for item, future in _finished_conversations(pool, client, todo, concurrency):
                try:
                    messages, n_cut, n_requests = future.result()
                except Stopped:
                    continue
                except RequestFailed as exc:
                    errors = errors or JsonlAppender(errors_file)
                    _record_failure(summary, errors, item, exc)
                    in_a_row += 1
                    if max_failures_in_a_row and in_a_row >= max_failures_in_a_row and not client.stop.is_set():
                        summary.stopped_by = f"{in_a_row} failures in a row"
                        log.error("%d conversations in a row failed (last: %s): stopping; is the server up?",
                                  in_a_row, exc.reason)
                        client.stop.set()
                else:
                    _record_written(summary, writer, item, messages, n_cut, n_requests)
                    in_a_row = 0
                bar.update(1)
                bar.set_postfix(failed=summary.failed, refresh=False)
        bar.close()
        summary.seconds = time.monotonic() - start
    finally:
        writer.close()
        if errors is not None:
            errors.close()
        if created and not summary.written:  # an empty file would only look like a result
            out.unlink(missing_ok=True)
    return summary


def regenerate_from_args(args) -> RunSummary:
    """`dflash regenerate --endpoint`: the client from the parsed options (checked before any work), then
    the run. The API key is read from the variable --api-key-env names and never printed."""
    from dflash.regenerate.client import chat_completions_url

    url = chat_completions_url(args.endpoint)
    if not args.model:
        raise ConfigError("--endpoint needs --model: the name the server serves the target under (vLLM: "
                          "--served-model-name, else the path it was started with; see GET <URL>/v1/models).")
    kwargs = None
    if args.chat_template_kwargs:
        try:
            kwargs = json.loads(args.chat_template_kwargs)
        except ValueError as exc:
            raise ConfigError(f"--chat-template-kwargs is not JSON ({exc}); e.g. "
                              "'{\"enable_thinking\": false}'") from None
        if not isinstance(kwargs, dict):
            raise ConfigError(f"--chat-template-kwargs must be a JSON object, got {args.chat_template_kwargs!r}")
    client = ChatClient(url=url, model=args.model, max_tokens=args.max_new_tokens, temperature=args.temperature,
                        seed=args.seed, chat_template_kwargs=kwargs, api_key=os.environ.get(args.api_key_env) or None,
                        timeout=args.timeout, retries=args.retries, backoff=args.backoff)
    log.info("regenerating through %s (model %s, %d at once)", url, args.model, args.concurrency)
    return regenerate_via_server(client, args.data, args.out, concurrency=args.concurrency, resume=args.resume,
                                 on_bad_line=args.on_bad_line, max_failures_in_a_row=args.max_failures_in_a_row,
                                 progress=args.progress)
