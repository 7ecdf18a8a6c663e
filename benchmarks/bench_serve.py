"""Serving benchmark: throughput and latency of ``quickdraft serve`` under concurrent clients.

Starts ``quickdraft serve`` in a subprocess on 127.0.0.1, then, at each concurrency level (default 1,
4, 16), runs ``--requests`` streamed completions (at least one per client) twice: with speculative
decoding (``"speculative": {"method": "sd", "k": K, "policy": P}`` for each ``--policies`` P, default
``constant``) and plain (``"method": "ar"``), through one server (the setting is per request). Where ``llama-cpp-python[server]`` is installed and the
target's GGUF is in the cache, ``python -m llama_cpp.server`` on the same target is measured the
same way; otherwise that row is skipped with the reason printed and recorded.

``--mixed-temperature T`` adds a row whose requests alternate between temperature 0 and ``T`` (two
sampling settings: two batches in the server, which take turns), with the time to first token per
temperature: whether one setting's requests wait for the other's.

``--seeded T`` adds rows at temperature ``T`` where request ``i`` carries ``"seed": i``: ``sd`` (a
seeded request keeps a batch of its own, so that its text is the one it gets alone) and ``ersd``
(draws keyed by seed, row and position: seeded requests share one batch), beside ``ersd`` without
seeds (the shared batch unconstrained).

Per row: requests, completion tokens, wall time, throughput (completion tokens / wall time),
time to first token and inter-token latency (``(t_last - t_first) / (tokens - 1)`` per request,
from the arrival times of the streamed chunks; a speculative step streams several tokens in one
chunk), mean, p50 and p90, and the mean acceptance length the server reported. Completion tokens
are the ``usage`` the server streams; llama-cpp-python's server streams none, so there they are the
streamed chunks (one per token; ``token_count`` in a row says which). A stream that is cut (no
``finish_reason`` or no ``[DONE]``) or drops its connection counts as a failed request.

    python benchmarks/bench_serve.py --out benchmarks/results/serve.json
    python benchmarks/bench_serve.py --tiny --requests 4 --max-tokens 16 --out benchmarks/results/serve_smoke.json

``--tiny`` serves two tiny randomly initialised models over a word tokenizer (saved to a temporary
directory, served by this script's own server process) instead of the default pair: a smoke run of
the harness, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

try:  # the HTTP client of the openai package (httpx2 for openai >= 3, httpx before)
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

CODE_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python function that counts the words in a text file.",
    "Write a Python class for a stack with push, pop and peek.",
    "Write a Python function that flattens a nested list.",
    "Write a Python function that returns the prime numbers below n.",
    "Write a Python function that parses a CSV line with quoted fields.",
]
TINY_PROMPTS = ["w5 w6 w7 w8", "w9 w10", "w11 w12 w13 w14 w15 w16", "w3 w4 w5 w3 w4 w5", "w20 w21", "w30 w31 w32"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="target")
    p.add_argument("--draft", default="draft")
    p.add_argument("--backend", default="torch", help="the server's --backend (torch, openvino, auto, llamacpp)")
    p.add_argument("--tiny", action="store_true", help="serve tiny random models (a smoke run of the harness)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=16, help="requests per row (at least one per client)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--policies", nargs="+", default=["constant"],
                   help="draft-length policies of the sd rows (quickdraft-sd: constant; others quickdraft-sd-<policy>)")
    p.add_argument("--mixed-temperature", type=float, default=None, metavar="T",
                   help="also a row of sd requests alternating between temperature 0 and T (two settings, two "
                        "batches in the server), with time to first token per temperature")
    p.add_argument("--seeded", type=float, default=None, metavar="T",
                   help="also rows of seeded requests at temperature T (sd and ersd) and of unseeded ersd ones")
    p.add_argument("--skip-uniform", action="store_true", help="only the mixed row (with --mixed-temperature)")
    p.add_argument("--skip-llamacpp", action="store_true", help="no llama-cpp-python server row")
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions (default: /v1/completions)")
    p.add_argument("--gguf", default=None, help="target GGUF for the llama.cpp row (default: the cache's)")
    p.add_argument("--llamacpp-threads", type=int, default=os.cpu_count() or 1,
                   help="--n_threads/--n_threads_batch of the llama.cpp server (default: all cores)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed for one row")
    p.add_argument("--label", default=None, help="recorded as is (e.g. 'smoke run')")
    p.add_argument("--out", default="benchmarks/results/serve.json")
    p.add_argument("--serve-tiny", nargs=2, metavar=("TARGET_DIR", "DRAFT_DIR"), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args()


def cpu_info() -> dict:
    """``lscpu``'s model name and flags (the flags that decide the fast kernels listed apart)."""
    info: dict = {"machine": platform.machine(), "cpus": os.cpu_count()}
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name":
            info["model_name"] = value.strip()
        elif key.strip() == "Flags":
            info["flags"] = value.split()
            info["simd_flags"] = sorted(f for f in info["flags"] if f.startswith(("avx", "amx", "fma")))
    return info


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def word_tokenizer():
    """Word ``w<i>`` is token ``i`` (``w0`` .. ``w63``), split on whitespace; ``w63`` ends a text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(64)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w63", unk_token="w0")


def save_tiny_pair(directory: Path) -> tuple[str, str]:
    """Two tiny Qwen2 models (the draft a perturbed copy of the target), as HF directories."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    paths = []
    for name, seed, noise in (("target", 0, 0.0), ("draft", 0, 0.3)):
        torch.manual_seed(seed)
        config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             tie_word_embeddings=False)
        model = Qwen2ForCausalLM(config).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)
            gen = torch.Generator().manual_seed(1)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * noise * p.std().clamp_min(1e-3))
        path = directory / name
        model.save_pretrained(path)
        paths.append(str(path))
    return paths[0], paths[1]


def serve_tiny(target: str, draft: str, port: int, k: int, max_batch: int) -> None:
    """Serve the tiny pair with the word tokenizer (the server process of ``--tiny``)."""
    from transformers import AutoModelForCausalLM

    from quickdraft.pipeline import Pipeline
    from quickdraft.serve.app import ServerConfig
    from quickdraft.serve.server import run_server
    from quickdraft.serve.settings import ServeDefaults

    models = [AutoModelForCausalLM.from_pretrained(p).eval() for p in (target, draft)]
    pipe = Pipeline(models[0], word_tokenizer(), models[1])
    config = ServerConfig(model_name="bench", max_rows=max_batch, defaults=ServeDefaults(k=k))
    run_server(pipe, config, port=port, log_level="warning")


class ServerProcess:
    """A server subprocess on 127.0.0.1; stopped with SIGINT (graceful), then killed if needed."""

    def __init__(self, argv: list[str], port: int, log_path: Path, ready_timeout: float = 900.0) -> None:
        self.argv = argv
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ready_timeout
        while True:
            if self.proc.poll() is not None:
                self.log.close()
                tail = log_path.read_text()[-2000:]
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server not ready after {ready_timeout:.0f} s; see {log_path}")
            time.sleep(0.5)
        self.model = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]["id"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(2)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def parse_stream(lines, chat: bool, clock) -> dict:
    """Read one streamed completion (SSE ``data:`` lines); ``clock()`` is the time since the request.

    Completion tokens are the ``usage`` the server reported (``stream_options.include_usage``) or, if
    it reported none (llama-cpp-python's server ignores ``stream_options``: its streams carry no
    ``usage``), the number of chunks that carried text: that server streams one chunk per generated
    token (several only where a UTF-8 character spans tokens, so the count is then a lower bound).
    A stream that ends before ``data: [DONE]`` or without a ``finish_reason`` (llama-cpp-python's
    server, with ``interrupt_requests`` on, cuts a stream when another request arrives: one token,
    then ``[DONE]``, then the connection is dropped) is an error, not a short completion.
    """
    stamps: list[float] = []
    usage, extra, error = None, None, None
    text_chunks, finished, done = 0, False, False
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            error = chunk["error"]
        for c in chunk.get("choices") or []:
            text = (c.get("delta") or {}).get("content") if chat else c.get("text")
            if text:
                stamps.append(clock())
                text_chunks += 1
            finished = finished or c.get("finish_reason") is not None
        usage = chunk.get("usage") or usage
        extra = chunk.get("quickdraft") or extra
    if error is None and not done:
        error = "stream ended before data: [DONE]"
    elif error is None and not finished:
        error = "stream cut: [DONE] without a finish_reason"
    reported = (usage or {}).get("completion_tokens")
    return {"error": error, "stamps": stamps, "tokens": reported if reported is not None else text_chunks,
            "token_count": "usage" if reported is not None else "chunks", "quickdraft": extra}


def one_request(url: str, body: dict, chat: bool) -> dict:
    """Stream one completion; returns arrival times and counts (a transport error is an error)."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    t0 = time.perf_counter()
    try:
        with httpx.stream("POST", url + path, json=body, timeout=600) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {r.read().decode()[:200]}"}
            res = parse_stream(r.iter_lines(), chat, lambda: time.perf_counter() - t0)
    except httpx.HTTPError as err:
        return {"error": f"{type(err).__name__}: {err}"}
    return {**res, "seconds": time.perf_counter() - t0}


def summary(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None}
    ordered = sorted(values)
    return {"mean": statistics.fmean(values), "p50": statistics.median(values),
            "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]}


def run_row(url: str, model: str, prompts: list[str], concurrency: int, requests: int, max_tokens: int,
            speculative: dict | None, chat: bool, timeout: float, temperatures: tuple[float, ...] = (0.0,),
            seeded: bool = False) -> dict:
    """``requests`` streamed requests from ``concurrency`` client threads; request ``i`` samples at
    ``temperatures[i % len(temperatures)]`` (several: time to first token also per temperature), with
    ``"seed": i`` where ``seeded``."""
    requests = max(requests, concurrency)
    todo = list(range(requests))
    lock = threading.Lock()
    results: list[dict] = []

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            prompt = prompts[i % len(prompts)]
            temperature = temperatures[i % len(temperatures)]
            body = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
                    "stream_options": {"include_usage": True}}
            if chat:
                body["messages"] = [{"role": "user", "content": prompt}]
            else:
                body["prompt"] = prompt
            if speculative is not None:
                body["speculative"] = speculative
            if seeded:
                body["seed"] = i
            res = {**one_request(url, body, chat), "temperature": temperature}
            with lock:
                results.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, timeout - (time.perf_counter() - t0)))
    wall = time.perf_counter() - t0
    if any(t.is_alive() for t in threads):
        return {"error": f"row exceeded {timeout:.0f} s", "done": len(results)}
    ok = [r for r in results if not r.get("error")]
    tokens = sum(r["tokens"] or 0 for r in ok)
    ttft = [r["stamps"][0] for r in ok if r["stamps"]]
    itl = [(r["stamps"][-1] - r["stamps"][0]) / (r["tokens"] - 1) for r in ok if r["stamps"] and (r["tokens"] or 0) > 1]
    mal = [r["quickdraft"]["mean_acceptance_length"] for r in ok if r.get("quickdraft")]
    by_temperature = {str(t): summary([r["stamps"][0] for r in ok if r["stamps"] and r["temperature"] == t])
                      for t in temperatures} if len(temperatures) > 1 else None
    return {
        "concurrency": concurrency, "requests": requests, "failed": len(results) - len(ok),
        "errors": sorted({str(r["error"])[:200] for r in results if r.get("error")}),
        "completion_tokens": tokens, "token_count": sorted({r["token_count"] for r in ok}),
        "wall_seconds": wall, "throughput_tokens_per_second": tokens / wall if wall else 0.0,
        "ttft_seconds": summary(ttft), "itl_seconds": summary(itl), "ttft_seconds_by_temperature": by_temperature,
        "mean_acceptance_length": statistics.fmean(mal) if mal else None,
    }


def save(path: Path, record: dict) -> None:
    """Write the results so far (after every row: a crash keeps what was measured)."""
    path.write_text(json.dumps(record, indent=2) + "\n")


def llamacpp_argv(gguf: str, port: int, threads: int, n_ctx: int = 4096) -> list[str]:
    """``python -m llama_cpp.server`` on ``gguf``. ``--interrupt_requests False``: by default that server
    cuts the running stream whenever another request is waiting (one token, ``[DONE]``, connection
    dropped), so concurrent clients would measure cut streams; with it off, requests queue as they do
    in llama-server. Threads as the quickdraft server's (all cores; llama-cpp-python's default
    decodes on half of them)."""
    return [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port", str(port),
            "--n_ctx", str(n_ctx), "--n_threads", str(threads), "--n_threads_batch", str(threads),
            "--interrupt_requests", "False"]


def llamacpp_unavailable(gguf: str | None) -> tuple[str | None, str | None]:
    """(reason to skip, GGUF path)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as err:
        return f"llama-cpp-python is not installed ({err}); pip install 'llama-cpp-python[server]'", None
    try:
        import llama_cpp.server.app  # noqa: F401  (imports the server's own dependencies)
    except ImportError as err:
        return (f"llama-cpp-python is installed without its server dependencies ({err}); "
                "pip install 'llama-cpp-python[server]'"), None
    if gguf is None:
        try:
            from quickdraft.backends.llamacpp import gguf_path_for

            gguf = str(gguf_path_for("target"))
        except Exception as err:  # noqa: BLE001 - any reason is a reason to skip
            return f"no target GGUF ({err}); pass --gguf", None
    if not Path(gguf).is_file():
        return f"GGUF {gguf} not found; pass --gguf", None
    return None, gguf


def main() -> None:
    args = parse_args()
    if args.serve_tiny:
        serve_tiny(*args.serve_tiny, port=args.port, k=args.k, max_batch=max(args.concurrency))
        return
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    record: dict = {
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "label": args.label, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu": cpu_info(), "python": platform.python_version(),
        "config": {k: v for k, v in vars(args).items() if k != "out"}, "rows": [],
    }
    tmp = tempfile.TemporaryDirectory(prefix="bench_serve_")
    if args.tiny:
        target, draft = save_tiny_pair(Path(tmp.name))
        prompts = TINY_PROMPTS
    else:
        target, draft = args.target, args.draft
        prompts = CODE_PROMPTS
    port = free_port()
    if args.tiny:  # the CLI cannot load the word tokenizer from a directory: the same server, built here
        argv = [sys.executable, __file__, "--serve-tiny", target, draft, "--port", str(port), "--k", str(args.k),
                "--concurrency", str(max(args.concurrency))]
    else:
        argv = [sys.executable, "-m", "quickdraft.cli", "serve", "--target", target, "--draft", draft,
                "--port", str(port), "--model-name", "bench", "--k", str(args.k), "--backend", args.backend,
                "--max-batch", str(max(args.concurrency)), "--log-level", "warning"]
        if {"cost", "auto"} & set(args.policies):  # the server measures its step costs at start, not in a timed row
            argv += ["--policy", "auto"]
    record["server_command"] = " ".join(shlex.quote(a) for a in argv)
    print(f"starting: {record['server_command']}", flush=True)
    server = ServerProcess(argv, port, Path(tmp.name) / "server.log")
    try:
        for c in args.concurrency:
            rows = [("quickdraft-sd" if policy == "constant" else f"quickdraft-sd-{policy}",
                     {"method": "sd", "k": args.k, "policy": policy}, (0.0,)) for policy in args.policies]
            rows = [] if args.skip_uniform else [*rows, ("quickdraft-ar", {"method": "ar"}, (0.0,))]
            if args.mixed_temperature is not None:
                rows.append((f"quickdraft-sd-mixed-t{args.mixed_temperature:g}",
                             {"method": "sd", "k": args.k, "policy": args.policies[0]}, (0.0, args.mixed_temperature)))
            rows = [(*row, False) for row in rows]
            if args.seeded is not None:
                t = args.seeded
                rows += [(f"quickdraft-{m}-t{t:g}{'-seeded' if seeded else ''}",
                          {"method": m, "k": args.k, "policy": args.policies[0]}, (t,), seeded)
                         for m, seeded in (("sd", True), ("ersd", True), ("ersd", False))]
            for name, spec, temperatures, seeded in rows:
                row = {"server": name, **run_row(server.url, server.model, prompts, c, args.requests, args.max_tokens,
                                                 spec, args.chat, args.timeout, temperatures, seeded)}
                record["rows"].append(row)
                save(out_path, record)
                print(json.dumps({k: row.get(k) for k in ("server", "concurrency", "throughput_tokens_per_second",
                                                          "ttft_seconds", "itl_seconds", "mean_acceptance_length",
                                                          "ttft_seconds_by_temperature", "failed")}), flush=True)
    finally:
        server.stop()
    reason, gguf = ("--skip-llamacpp", None) if args.skip_llamacpp else llamacpp_unavailable(args.gguf)
    if reason is None and args.tiny:
        reason = "--tiny serves models that have no GGUF"
    if reason:
        print(f"llama.cpp server row skipped: {reason}", flush=True)
        record["rows"].append({"server": "llama-cpp-python", "skipped": reason})
    else:
        lport = free_port()
        largv = llamacpp_argv(gguf, lport, args.llamacpp_threads)
        record["llamacpp_command"] = " ".join(shlex.quote(a) for a in largv)
        print(f"starting: {record['llamacpp_command']}", flush=True)
        try:
            lserver = ServerProcess(largv, lport, Path(tmp.name) / "llamacpp.log")
        except RuntimeError as err:
            print(f"llama.cpp server row skipped: it did not start: {err}", flush=True)
            record["rows"].append({"server": "llama-cpp-python", "skipped": f"did not start: {err}"})
            lserver = None
        try:
            for c in args.concurrency if lserver else ():
                row = {"server": "llama-cpp-python", **run_row(lserver.url, lserver.model, prompts, c, args.requests,
                                                               args.max_tokens, None, args.chat, args.timeout)}
                record["rows"].append(row)
                save(out_path, record)
                print(json.dumps({k: row.get(k) for k in ("server", "concurrency", "throughput_tokens_per_second",
                                                          "ttft_seconds", "itl_seconds", "failed")}), flush=True)
        finally:
            if lserver:
                lserver.stop()
    record["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    save(out_path, record)
    print(f"wrote {out_path}")
    tmp.cleanup()


if __name__ == "__main__":
    main()
