"""Regeneration through a server: requests/s of `dflash regenerate --endpoint` at concurrency 1 and 32.

    python bench/bench_regenerate.py                                  (20 ms a request; 1 and 32 at once)
    python bench/bench_regenerate.py --latency-ms 50 --concurrency 1,8,64 --conversations 100,2000

The server is a loopback ThreadingHTTPServer in its own process (so it does not share the client's GIL)
that answers POST /v1/chat/completions in the OpenAI shape after sleeping --latency-ms. The client is
the real run loop (dflash.regenerate.server.regenerate_via_server: thread pool, retries, one fsynced line
per conversation) on single-turn conversations, one request each. It prints requests/s at each
concurrency beside the ideal (concurrency / latency) and the ratio to the first, and the cost of one
fsynced append on the output's file system, which bounds the rate from above.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from dflash.regenerate.server import JsonlAppender, regenerate_via_server
from dflash.regenerate.client import ChatClient


def serve(latency_s: float, port: multiprocessing.Value) -> None:
    """A chat-completions server that sleeps latency_s, then answers with a fixed short reply."""
    reply = json.dumps({"object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "a regenerated answer of a few words"}}]}).encode()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            time.sleep(latency_s)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    httpd.request_queue_size = 256  # the default 5 drops connections when 32+ arrive at once
    port.value = httpd.server_address[1]
    httpd.serve_forever()


def fsync_append_ms(directory: Path, n: int = 200) -> float:
    """Mean cost in ms of one fsynced JSONL append (the output's per-conversation write)."""
    path = directory / "fsync.jsonl"
    writer = JsonlAppender(path)
    record = {"id": "x" * 20, "messages": [{"role": "user", "content": "q" * 200},
                                           {"role": "assistant", "content": "a" * 400}]}
    start = time.perf_counter()
    for _ in range(n):
        writer.write(record)
    elapsed = time.perf_counter() - start
    writer.close()
    path.unlink()
    return elapsed / n * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--latency-ms", type=float, default=20.0, help="server's sleep per request")
    p.add_argument("--concurrency", default="1,32", help="comma-separated concurrencies; the first is the base")
    p.add_argument("--conversations", default="200,3200",
                   help="conversations per concurrency (comma-separated, or one for all)")
    p.add_argument("--dir", default=None, help="where the output is written (default: a temporary directory)")
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    counts = [int(n) for n in args.conversations.split(",")]
    counts = counts * len(levels) if len(counts) == 1 else counts
    if len(counts) != len(levels):
        p.error("--conversations needs one count, or one per --concurrency")

    port = multiprocessing.Value("i", 0)
    server = multiprocessing.Process(target=serve, args=(args.latency_ms / 1e3, port), daemon=True)
    server.start()
    while not port.value:
        time.sleep(0.01)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        fsync_ms = fsync_append_ms(tmp)
        for concurrency, n in zip(levels, counts):
            data = tmp / f"in-{concurrency}.jsonl"
            data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"prompt {i}"}]}) + "\n"
                                    for i in range(n)))
            client = ChatClient(url=f"http://127.0.0.1:{port.value}/v1/chat/completions", model="bench",
                                max_tokens=64, timeout=30, retries=3, backoff=0.05)
            summary = regenerate_via_server(client, data, tmp / f"out-{concurrency}.jsonl",
                                            concurrency=concurrency, progress=False)
            if summary.exit_code or summary.written != n:
                print(summary.message(), file=sys.stderr)
                return 1
            rows.append((concurrency, n, summary.seconds, summary.requests / summary.seconds))
    server.terminate()

    print(f"server latency {args.latency_ms:g} ms per request; fsynced append {fsync_ms:.2f} ms "
          f"({os.cpu_count()} CPUs)")
    print(f"{'concurrency':>11} {'requests':>9} {'seconds':>8} {'requests/s':>11} {'ideal':>8} {'ratio':>6}")
    base = rows[0][3]
    for concurrency, n, seconds, rate in rows:
        ideal = concurrency / (args.latency_ms / 1e3)
        print(f"{concurrency:>11} {n:>9} {seconds:>8.2f} {rate:>11.1f} {ideal:>8.0f} {rate / base:>5.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
