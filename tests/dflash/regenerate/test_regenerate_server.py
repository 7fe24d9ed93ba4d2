"""dflash regenerate --endpoint: the client against a real OpenAI-shaped HTTP server on loopback.

The server (ThreadingHTTPServer on port 0, in a thread) answers POST /v1/chat/completions with the
number of messages it was sent and the last user text, so each test can check what the client sent.
Each test gives it a `behave(request) -> (status, body, delay)` to inject errors, latency and reasoning.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash.cli import main
from dflash.errors import ConfigError, DataError
from dflash.regenerate.local import reply_slots
from dflash.regenerate.server import done_keys, errors_path, prompt_hash, read_conversations, regenerate_via_server
from dflash.regenerate.client import ChatClient, chat_completions_url

REPO = Path(__file__).resolve().parents[3]


def completion(content, *, reasoning=None, reasoning_key="reasoning", finish="stop"):
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message[reasoning_key] = reasoning
    return {"id": "cmpl-1", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}]}


def echo(request):
    """200 with 'answer to <last user text> after <n> messages'."""
    last = [m for m in request["messages"] if m["role"] == "user"][-1]["content"]
    return 200, completion(f"answer to {last} after {len(request['messages'])} messages"), 0.0


class FakeServer:
    """An OpenAI chat-completions server on 127.0.0.1; records every request and the most in flight."""

    def __init__(self, behave=echo):
        self.behave, self.requests, self.headers = behave, [], []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest's output clean
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append(body)
                    server.headers.append(dict(self.headers))
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    if self.path != "/v1/chat/completions":
                        status, payload, delay = 404, {"error": {"message": f"no route {self.path}"}}, 0.0
                    else:
                        status, payload, delay = server.behave(body)
                    time.sleep(delay)
                    data = json.dumps(payload).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    if status == 429:
                        self.send_header("Retry-After", "0")
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and went away
                    pass
                finally:
                    with server.lock:
                        server.in_flight -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def write_data(path: Path, conversations: list) -> Path:
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    return path


def user(text):
    return {"role": "user", "content": text}


def client_for(server, **kw) -> ChatClient:
    return ChatClient(url=chat_completions_url(server.url), model="m", max_tokens=16,
                      **{"retries": 3, "backoff": 0.01, "timeout": 5.0, **kw})


def read_out(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]  # fails on a torn line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- URLs and keys --------------------------------------------------------------------------------
def test_endpoint_url_forms():
    assert chat_completions_url("http://h:8000") == "http://h:8000/v1/chat/completions"
    assert chat_completions_url("http://h:8000/v1/") == "http://h:8000/v1/chat/completions"
    assert chat_completions_url("https://h/proxy/v1/chat/completions") == "https://h/proxy/v1/chat/completions"
    for bad in ("localhost:8000", "ftp://h/v1", "http://", "http://h:99999"):
        with pytest.raises(ConfigError, match="--endpoint"):
            chat_completions_url(bad)


def test_bad_endpoint_fails_before_any_work(tmp_path, capsys):
    data = write_data(tmp_path / "in.jsonl", [{"messages": [user("a")]}])
    out = tmp_path / "out.jsonl"
    assert main(["regenerate", "--endpoint", "localhost:8000", "--model", "m", "--data", str(data),
                 "--out", str(out)]) == 2
    assert "is not an http(s) URL" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("options, message", [
    (["--endpoint", "http://127.0.0.1:1"], "--endpoint needs --model"),
    (["--endpoint", "http://127.0.0.1:1", "--model", "m", "--chat-template-kwargs", "{bad"], "is not JSON"),
    (["--endpoint", "http://127.0.0.1:1", "--model", "m", "--concurrency", "0"], "--concurrency (0)"),
    (["--target", "some/dir", "--resume"], "--model and --resume go with --endpoint"),
])
def test_bad_options_are_refused_before_any_work(tmp_path, capsys, options, message):
    data = write_data(tmp_path / "in.jsonl", [{"messages": [user("a")]}])
    out = tmp_path / "out.jsonl"
    assert main(["regenerate", *options, "--data", str(data), "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_keys_are_ids_else_prompt_hashes_and_duplicate_ids_are_refused(tmp_path):
    conv = {"messages": [user("q"), {"role": "assistant", "content": "a"}]}
    data = write_data(tmp_path / "in.jsonl", [{"id": 7, **conv}, conv, conv, "not a conversation"])
    items, report = read_conversations(data)
    assert [i.key for i in items] == ["7", prompt_hash([user("q")]), prompt_hash([user("q")]) + "~1"]
    assert [i.line for i in items] == [1, 2, 3] and report.n_skipped == 1
    write_data(data, [{"id": "x", **conv}, {"id": "x", **conv}])
    with pytest.raises(DataError, match="lines 1 and 2 have the same id 'x'"):
        read_conversations(data)


# ---- successful runs ------------------------------------------------------------------------------
def test_every_turn_answered_in_order_and_request_shape(tmp_path, monkeypatch, capsys):
    multi = {"id": "multi", "messages": [{"role": "system", "content": "be brief"}, user("one"),
                                         {"role": "assistant", "content": "old 1"}, user("two"),
                                         {"role": "assistant", "content": "old 2"}]}
    final_prompt = {"messages": [user("alone")]}
    data = write_data(tmp_path / "in.jsonl", [multi, final_prompt])
    out = tmp_path / "out.jsonl"
    monkeypatch.setenv("DFLASH_TEST_KEY", "sk-secret-123")
    with FakeServer() as server:
        assert main(["regenerate", "--endpoint", server.url + "/v1", "--model", "served-name", "--data", str(data),
                     "--out", str(out), "--max-new-tokens", "32", "--chat-template-kwargs",
                     '{"enable_thinking": false}', "--api-key-env", "DFLASH_TEST_KEY", "--no-progress"]) == 0
    rows = {r["id"]: r["messages"] for r in read_out(out)}
    assert rows["multi"] == [multi["messages"][0], user("one"),
                             {"role": "assistant", "content": "answer to one after 2 messages"}, user("two"),
                             {"role": "assistant", "content": "answer to two after 4 messages"}]
    assert rows[prompt_hash([user("alone")])] == [user("alone"),
                                                  {"role": "assistant", "content": "answer to alone after 1 messages"}]
    second_turn = next(r for r in server.requests if len(r["messages"]) == 4)
    assert second_turn["messages"][2]["content"] == "answer to one after 2 messages"  # its own answer, not "old 1"
    assert second_turn == {**second_turn, "model": "served-name", "max_tokens": 32, "temperature": 0.0,
                           "chat_template_kwargs": {"enable_thinking": False}}
    assert "seed" not in second_turn  # greedy
    assert {h["Authorization"] for h in server.headers} == {"Bearer sk-secret-123"}
    printed = capsys.readouterr()
    assert "sk-secret" not in printed.out + printed.err
    assert "wrote 2 conversations" in printed.out
    assert not errors_path(out).exists()


@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])
def test_reasoning_is_kept_as_reasoning_content(tmp_path, key):
    def think(request):
        n = len(request["messages"])
        return 200, completion(f"answer {n}", reasoning=f"thought {n}", reasoning_key=key,
                               finish="length" if n == 1 else "stop"), 0.0

    data = write_data(tmp_path / "in.jsonl", [{"messages": [user("a"), {"role": "assistant", "content": "x"},
                                                            user("b")]}])
    with FakeServer(think) as server:
        summary = regenerate_via_server(client_for(server), data, tmp_path / "out.jsonl", progress=False)
    assert summary.exit_code == 0 and summary.cut == 1
    (row,) = read_out(tmp_path / "out.jsonl")
    assert row["messages"][1] == {"role": "assistant", "content": "answer 1", "reasoning_content": "thought 1"}
    assert row["messages"][3] == {"role": "assistant", "content": "answer 3", "reasoning_content": "thought 3"}
    # the history sent for the second turn carries the answer, not the reasoning
    assert server.requests[1]["messages"][1] == {"role": "assistant", "content": "answer 1"}


def test_tool_call_turns_are_kept_and_sent_in_the_wire_format():
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    messages = [user("weather?"), {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "weather", "content": "-3 C"}]
    assert reply_slots(messages) == [3]  # the call stays; the answer after the tool result is the target's
    assert reply_slots([*messages, {"role": "assistant", "content": "cold"}]) == [3]
    sent = json.loads(ChatClient(url="http://h/v1/chat/completions", model="m", max_tokens=4).body(messages))
    assert sent["messages"][1]["tool_calls"][0]["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # the caller's copy untouched


# ---- errors, retries, timeouts --------------------------------------------------------------------
def test_transient_500_and_429_are_retried(tmp_path):
    script = iter([(500, {"error": {"message": "engine busy"}}, 0.0), (429, {"error": {"message": "slow"}}, 0.0)])

    def flaky(request):
        return next(script, None) or echo(request)

    data = write_data(tmp_path / "in.jsonl", [{"messages": [user("a")]}])
    with FakeServer(flaky) as server:
        summary = regenerate_via_server(client_for(server), data, tmp_path / "out.jsonl", progress=False)
    assert (summary.exit_code, summary.written, summary.failed, summary.requests) == (0, 1, 0, 3)
    assert len(server.requests) == 3


def test_persistent_errors_are_reported_per_conversation(tmp_path, capsys):
    def poisoned(request):
        text = request["messages"][-1]["content"]
        if text == "poison":
            return 500, {"error": {"message": "CUDA error: an illegal memory access"}}, 0.0
        if text == "too long":
            return 400, {"error": {"message": "maximum context length is 8 tokens"}}, 0.0
        return echo(request)

    data = write_data(tmp_path / "in.jsonl", [{"messages": [user(t)]} for t in ("ok 1", "poison", "too long", "ok 2")])
    out = tmp_path / "out.jsonl"
    with FakeServer(poisoned) as server:
        code = main(["regenerate", "--endpoint", server.url, "--model", "m", "--data", str(data), "--out", str(out),
                     "--retries", "2", "--backoff", "0.01", "--concurrency", "1", "--no-progress"])
    assert code == 8
    assert sorted(r["messages"][0]["content"] for r in read_out(out)) == ["ok 1", "ok 2"]
    errors = {e["line"]: e for e in read_out(errors_path(out))}
    assert set(errors) == {2, 3}
    assert errors[2]["attempts"] == 3 and "HTTP 500" in errors[2]["error"] and "illegal memory" in errors[2]["error"]
    assert errors[3]["attempts"] == 1 and "maximum context length" in errors[3]["error"]  # a 400 is not retried
    err = capsys.readouterr().err
    assert "2 failed" in err and str(errors_path(out)) in err and "--resume" in err


def test_timeouts_are_retried_then_reported(tmp_path):
    slow_once = iter([True])

    def slow_first(request):
        return (*echo(request)[:2], 2.0 if next(slow_once, False) else 0.0)

    data = write_data(tmp_path / "in.jsonl", [{"messages": [user("a")]}])
    with FakeServer(slow_first) as server:
        summary = regenerate_via_server(client_for(server, timeout=0.3), data, tmp_path / "a.jsonl", progress=False)
    assert (summary.written, summary.requests) == (1, 2)

    with FakeServer(lambda r: (*echo(r)[:2], 2.0)) as server:
        summary = regenerate_via_server(client_for(server, timeout=0.2, retries=1), data, tmp_path / "b.jsonl",
                                        progress=False)
    assert (summary.written, summary.failed, summary.exit_code) == (0, 1, 8)
    (error,) = read_out(errors_path(tmp_path / "b.jsonl"))
    assert "timed out" in error["error"] and error["attempts"] == 2


class GoneAfterStart(ChatClient):
    """A client whose server answered the check at the start of the run, then went away."""

    def check_reachable(self, timeout: float = 10.0) -> None:
        pass


def test_no_server_at_all_fails_at_once_and_writes_nothing(tmp_path, capsys):
    data = write_data(tmp_path / "in.jsonl", [{"messages": [user(str(i))]} for i in range(3)])
    out = tmp_path / "out.jsonl"
    start = time.monotonic()
    code = main(["regenerate", "--endpoint", f"http://127.0.0.1:{free_port()}", "--model", "m", "--data", str(data),
                 "--out", str(out), "--no-progress"])
    assert code == 8 and time.monotonic() - start < 5
    assert "nothing listens at http://127.0.0.1:" in capsys.readouterr().err
    assert not out.exists() and not errors_path(out).exists()


def test_a_server_gone_mid_run_is_retried_then_reported(tmp_path):
    data = write_data(tmp_path / "in.jsonl", [{"messages": [user(str(i))]} for i in range(3)])
    out = tmp_path / "out.jsonl"
    client = GoneAfterStart(url=f"http://127.0.0.1:{free_port()}/v1/chat/completions", model="m", max_tokens=4,
                            retries=2, backoff=0.01)
    summary = regenerate_via_server(client, data, out, progress=False)
    assert (summary.failed, summary.written, summary.exit_code) == (3, 0, 8)
    assert not out.exists()  # nothing written: no empty file that would look like a result
    errors = read_out(errors_path(out))
    assert len(errors) == 3 and all(e["attempts"] == 3 and "ConnectionRefusedError" in e["error"] for e in errors)
    assert "3 failed" in summary.message()


def test_failures_in_a_row_stop_the_run(tmp_path):
    data = write_data(tmp_path / "in.jsonl", [{"messages": [user(str(i))]} for i in range(20)])
    client = GoneAfterStart(url=f"http://127.0.0.1:{free_port()}/v1/chat/completions", model="m", max_tokens=4,
                            retries=0)
    summary = regenerate_via_server(client, data, tmp_path / "out.jsonl", concurrency=1, max_failures_in_a_row=3,
                                    progress=False)
    assert (summary.failed, summary.written, summary.exit_code) == (3, 0, 8)
    assert "3 failures in a row" in summary.message() and "(3 failed, 17 not tried)" in summary.message()


# ---- concurrency, resume, signals -----------------------------------------------------------------
def test_concurrency_is_bounded(tmp_path):
    data = write_data(tmp_path / "in.jsonl", [{"messages": [user(str(i))]} for i in range(24)])
    with FakeServer(lambda r: (*echo(r)[:2], 0.05)) as server:
        summary = regenerate_via_server(client_for(server), data, tmp_path / "out.jsonl", concurrency=4,
                                        progress=False)
    assert summary.written == 24 and len(server.requests) == 24
    assert server.max_in_flight == 4


def test_existing_output_needs_resume_and_torn_line_is_cut(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "messages": []}\n{"id": "b", "mess')
    data = write_data(tmp_path / "in.jsonl", [{"messages": [user("a")]}])
    with pytest.raises(ConfigError, match="--resume"):
        regenerate_via_server(client_for(SimpleNamespace(url="http://127.0.0.1:1")), data, out, progress=False)
    assert done_keys(out) == {"a"}
    assert out.read_text() == '{"id": "a", "messages": []}\n'


def test_sigterm_then_resume_completes_only_the_missing(tmp_path):
    n = 60
    data = write_data(tmp_path / "in.jsonl", [{"id": f"c{i}", "messages": [user(str(i))]} for i in range(n)])
    out = tmp_path / "out.jsonl"
    with FakeServer(lambda r: (*echo(r)[:2], 0.1)) as server:
        cmd = [sys.executable, "-m", "dflash.cli", "regenerate", "--endpoint", server.url, "--model", "m",
               "--data", str(data), "--out", str(out), "--concurrency", "2", "--no-progress"]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while (not out.exists() or out.read_text().count("\n") < 6) and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 143, err
        assert "stopped by SIGTERM" in err and "--resume" in err
        first = read_out(out)  # every line whole
        assert 6 <= len(first) < n
        with out.open("a") as f:  # what a SIGKILL mid-write would leave
            f.write('{"id": "c59", "messages": [{"role": "us')
        before = len(server.requests)
        result = subprocess.run(cmd + ["--resume"], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert "torn last line" in result.stderr
    rows = read_out(out)
    assert sorted(r["id"] for r in rows) == sorted(f"c{i}" for i in range(n))  # each once
    assert len(server.requests) - before == n - len(first)  # only the missing ones were asked for
    assert f"{len(first)} already there" in result.stdout
    assert os.path.getsize(out) == sum(len(json.dumps(r, ensure_ascii=False)) + 1 for r in rows)
