"""``quickdraft serve`` on tiny models, through the official ``openai`` client on loopback.

Row operations of the runner and the engine's :class:`Decoder` first (rows joining and leaving a
running batch give the texts of the same prompts decoded alone), then the HTTP server: completions,
chat, streaming, every speculation setting, bad requests, a client disconnect, graceful shutdown, a
bounded load test, and one short completion on the real default pair (``slow``).
"""

from __future__ import annotations

import copy
import functools
import json
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
try:  # the HTTP client the openai package is built on (httpx2 for openai >= 3, httpx before)
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    httpx = pytest.importorskip("httpx")
import uvicorn  # noqa: E402

from quickdraft.decoding.engine import Decoder, generate  # noqa: E402
from quickdraft.pipeline import Pipeline  # noqa: E402
from quickdraft.decoding.policies import Constant  # noqa: E402
from quickdraft.backends.runner import ModelRunner  # noqa: E402
from quickdraft.verification.sampling import SamplingParams  # noqa: E402
from quickdraft.errors import QuickdraftError  # noqa: E402
from quickdraft.serve.app import ServerConfig, create_app  # noqa: E402
from quickdraft.serve.scheduler import held_back  # noqa: E402
from quickdraft.serve.settings import ServeDefaults, build_spec  # noqa: E402

from conftest import TINY_VOCAB, tiny_lm, word_tokenizer  # noqa: E402

MODEL = "tiny"
CHAT_TEMPLATE = (
    "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
)
PROMPTS = ["w5 w6 w7 w8", "w9 w10", "w11 w12 w13 w14 w15 w16", "w3 w4 w5 w3 w4 w5 w3 w4", "w20", "w30 w31 w32"]


# -- fixtures --------------------------------------------------------------------------------------
def _tokenizer():
    tok = word_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def pipe(tiny_target, tiny_draft):
    return Pipeline(tiny_target, _tokenizer(), tiny_draft)


class Server:
    """A uvicorn server in a background thread on 127.0.0.1 and an ephemeral port."""

    def __init__(self, pipe, config: ServerConfig) -> None:
        self.app = create_app(pipe, config)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_config=None, access_log=False, log_level="warning",
                                                    timeout_graceful_shutdown=30))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    @property
    def scheduler(self):
        return self.app.state.scheduler

    def stop(self, timeout: float = 60) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "server did not shut down"


@pytest.fixture(scope="module")
def server(pipe, one_thread):
    srv = Server(pipe, ServerConfig(model_name=MODEL, max_tokens=24, max_rows=16))
    yield srv
    srv.stop()


def _reference(pipe, prompt_ids: list[int], max_tokens: int, method: str = "sd", k: int = 4, policy: str = "constant",
               temperature: float = 0.0, seed: int = 0, n: int = 1, stop: tuple[str, ...] = (), top_p: float = 1.0,
               **spec_kw) -> list[str]:
    """The texts of the request served alone: Pipeline.generate with the same settings."""
    sampling = SamplingParams(temperature=temperature, top_p=top_p)
    settings = ServeDefaults(method=method, k=k, policy=policy, **spec_kw)
    spec = build_spec(settings, sampling, seed)
    out = pipe.generate([], prompt_ids=[prompt_ids] * n, method=spec.engine_method, policy=spec.policy, rule=spec.rule,
                        sampling=sampling, max_new_tokens=max_tokens, seed=seed, stop_strings=stop, phrase=spec.phrase)
    return [c.text for c in out.completions]


def _ids(pipe, text: str) -> list[int]:
    return list(pipe.tokenizer(text, add_special_tokens=True)["input_ids"])


# -- runner and decoder ----------------------------------------------------------------------------
def test_runner_rows_join_leave_and_compact(tiny_target):
    runner, alone = ModelRunner(tiny_target), ModelRunner(tiny_target)
    runner.reset(1)
    runner.forward(torch.tensor([[1, 2, 3, 4, 5]]))
    runner.add_rows(1)
    assert runner.batch_size == 2 and runner.lengths.tolist() == [5, 0]
    block = torch.tensor([[0, 0, 6, 7], [8, 9, 10, 11]])
    out = runner.forward(block, torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)).logits
    alone.reset(1)
    assert torch.allclose(out[1], alone.forward(torch.tensor([[8, 9, 10, 11]])).logits[0], atol=1e-5)
    runner.truncate(torch.tensor([6, 3]))  # row 0 drops 7, row 1 drops 11: holes in both rows
    alone.truncate(torch.tensor([3]))
    runner.compact()
    assert runner.num_holes == 3 and runner.num_slots == 6  # row 1 holds 3 tokens, left-padded to 6
    runner.remove_rows([0])
    assert runner.batch_size == 1 and runner.num_slots == 3 and runner.lengths.tolist() == [3]
    again = runner.forward(torch.tensor([[12]])).logits
    assert torch.allclose(again, alone.forward(torch.tensor([[12]])).logits, atol=1e-5)


def _drafter(method: str, target_model, draft_model):
    """A fresh drafter of ``method`` over its own runner of ``draft_model`` (the pipeline's choice)."""
    from quickdraft.decoding.phrase import PhraseConfig

    return Pipeline(target_model, _tokenizer(), draft_model).drafter_for(
        method, draft=ModelRunner(draft_model), phrase=PhraseConfig(max_phrase=4, max_draft=6))


@pytest.mark.parametrize("method", ["sd", "phrase_sd", "scd", "amusd"])
def test_decoder_rows_joining_and_leaving_decode_as_alone(tiny_target, tiny_draft, one_thread, method):
    """Rows that join a running batch and leave it when done get the tokens of their prompts decoded
    alone (greedy: sd, phrase_sd and amusd give plain greedy decoding, scd greedy contrastive decoding)."""
    from quickdraft.verification.rules import Contrastive

    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [3, 4, 5, 3, 4]]
    budgets = [30, 12, 25, 20]
    rule = Contrastive(alpha=0.1, beta=0.5, greedy_drafts=True) if method == "scd" else None
    if method == "scd":  # greedy contrastive decoding of each prompt alone
        alone = [generate(ModelRunner(tiny_target), [p], method="cd", drafter=_drafter("cd", tiny_target, tiny_draft), rule=rule,
                          max_new_tokens=m).sequences[0] for p, m in zip(prompts, budgets)]
    else:
        alone = [generate(ModelRunner(tiny_target), [p], method="ar", max_new_tokens=m).sequences[0]
                 for p, m in zip(prompts, budgets)]
    target = ModelRunner(tiny_target)
    drafter = _drafter(method, tiny_target, tiny_draft)
    dec = Decoder(target, prompts[:2], method=method, drafter=drafter, rule=rule, policy=Constant(3), max_new_tokens=30)
    dec.max_new_tokens[1] = budgets[1]
    done: dict[int, list[int]] = {}
    owners = [0, 1]
    for step in range(200):
        if step == 2:
            dec.add_rows([prompts[2]], [budgets[2]])
            owners.append(2)
        if step == 4:
            dec.add_rows([prompts[3]], [budgets[3]])
            owners.append(3)
        dec.step()
        finished = [r for r in range(dec.batch_size) if not bool(dec.active[r])]
        for r in finished:
            done[owners[r]] = dec.new_ids[r]
        if finished:
            dec.remove_rows(finished)
            owners = [o for r, o in enumerate(owners) if r not in finished]
            dec.compact(min_slots=1)
        if len(done) == 4:
            break
    assert [done[i] for i in range(4)] == alone
    assert dec.batch_size == 0 and target.batch_size == 0


def test_held_back_keeps_a_possible_stop_string_prefix():
    assert held_back("abc w1", ("w12",)) == 2
    assert held_back("abc w", ("w12", "xyz")) == 1
    assert held_back("abc", ("w12",)) == 0


# -- HTTP: happy paths -----------------------------------------------------------------------------
def test_models_health_and_metrics(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["waiting"] == 0
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("quickdraft_requests_total", "quickdraft_completion_tokens_total", "quickdraft_tokens_per_second",
                 "quickdraft_mean_acceptance_length", "quickdraft_queue_depth", "quickdraft_running_rows"):
        assert name in text


def test_completion_equals_the_engine_and_reports_acceptance(server, pipe):
    prompt = PROMPTS[0]
    r = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=20,
                                         extra_body={"speculative": {"method": "sd", "k": 4}})
    ids = _ids(pipe, prompt)
    assert r.choices[0].text == _reference(pipe, ids, 20)[0]
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == len(ids)
    assert 1 <= r.usage.completion_tokens <= 20
    qd = r.model_extra["quickdraft"]
    assert qd["settings"]["method"] == "sd" and qd["settings"]["k"] == 4
    assert qd["drafted_tokens"] >= qd["accepted_tokens"] > 0
    assert qd["target_forwards"] == qd["steps"] + 1  # prefill + one verification per step
    assert qd["mean_acceptance_length"] == pytest.approx((qd["accepted_tokens"] + qd["steps"]) / qd["steps"])
    assert qd["steps"] < r.usage.completion_tokens  # speculation saved target forwards


def test_chat_uses_the_chat_template(server, pipe):
    messages = [{"role": "system", "content": "w40"}, {"role": "user", "content": "w5 w6 w7"}]
    r = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16)
    ids = pipe.encode_messages(messages)
    assert ids[:2] == [1, 40] and ids[-1] == 3  # w1 ... w2 ... w3 from the template
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == _reference(pipe, ids, 16)[0]
    assert r.usage.prompt_tokens == len(ids)


def test_streaming_completion_and_chat_match_the_full_response(server):
    for prompt in PROMPTS[:2]:
        full = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=20)
        chunks = list(server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, stream=True,
                                                       stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == [full.choices[0].finish_reason]
        assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
        assert chunks[-1].model_extra["quickdraft"]["steps"] == full.model_extra["quickdraft"]["steps"]
    messages = [{"role": "user", "content": "w9 w10 w11"}]
    full = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20)
    stream = list(server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == full.choices[0].message.content


def test_prompt_forms_token_ids_and_several_prompts(server, pipe):
    ids = _ids(pipe, PROMPTS[0])
    by_text = server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12)
    by_ids = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=12)
    assert by_ids.choices[0].text == by_text.choices[0].text
    several = server.client.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=12, n=2)
    assert [c.index for c in several.choices] == list(range(6))
    for i, prompt in enumerate(PROMPTS[:3]):
        alone = _reference(pipe, _ids(pipe, prompt), 12)[0]
        assert several.choices[2 * i].text == several.choices[2 * i + 1].text == alone
    assert several.usage.prompt_tokens == sum(len(_ids(pipe, p)) for p in PROMPTS[:3])


def test_requests_beyond_the_batch_wait_in_the_queue(slow_pipe, one_thread):
    """With room for 2 rows, 5 concurrent requests queue; all complete, with the texts served alone."""
    srv = Server(slow_pipe, ServerConfig(model_name=MODEL, max_rows=2))
    results: dict = {}
    depth = {"max": 0, "rows": 0}
    try:
        def call(i):
            results[i] = srv.client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=10,
                                                       extra_body={"speculative": {"method": "ar"}})

        threads = [threading.Thread(target=call, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            stats = srv.scheduler.stats()
            depth["max"] = max(depth["max"], stats["waiting"])
            depth["rows"] = max(depth["rows"], stats["running_rows"])
            time.sleep(0.005)
        for t in threads:
            t.join(60)
        assert depth["max"] >= 1 and depth["rows"] <= 2
        for i in range(5):
            assert results[i].choices[0].text == _reference(slow_pipe, _ids(slow_pipe, PROMPTS[i]), 10, method="ar")[0]
        assert "quickdraft_queue_depth 0.0" in httpx.get(f"{srv.url}/metrics").text
    finally:
        srv.stop()


def test_stream_wire_format_is_server_sent_events(server):
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert all(p["object"] == "text_completion" for p in payloads)
    assert payloads[-1]["choices"] == [] and "quickdraft" in payloads[-1]


def test_stop_strings_n_and_seed(server, pipe):
    prompt = PROMPTS[2]
    ids = _ids(pipe, prompt)
    text = _reference(pipe, ids, 20)[0]
    words = text.split()
    assert len(words) >= 4
    stop = words[3]
    r = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.find(stop)]
    streamed = "".join(c.choices[0].text for c in server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, stop=[stop], stream=True) if c.choices)
    assert streamed == r.choices[0].text
    # n = 2 at T = 0: two equal choices
    r = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, n=2)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == r.choices[1].text
    # a seed at T > 0 reproduces the request served alone
    kw = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0.9, seed=7)
    a = server.client.completions.create(**kw, n=2)
    b = server.client.completions.create(**kw, n=2)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert [c.text for c in a.choices] == _reference(pipe, ids, 16, temperature=0.9, seed=7, n=2)
    c = server.client.completions.create(**{**kw, "seed": 11}, top_p=0.8,
                                         extra_body={"speculative": {"method": "sd", "k": 3}})
    assert c.choices[0].text == _reference(pipe, ids, 16, k=3, temperature=0.9, seed=11, top_p=0.8)[0]


def _seeded_clients(srv, method: str, seeds: list[int | None], max_tokens: int = 16) -> tuple[dict, dict]:
    """Requests of ``method`` at T = 0.9, one client per seed (``None``: no seed; seeded ones with
    n = 1 or 2), started together; returns their texts and the peak batches and rows seen."""
    answers, peak, stop_watch = {}, {"batches": 0, "rows": 0}, threading.Event()
    start = threading.Barrier(len(seeds))

    def watch():
        while not stop_watch.is_set():
            stats = srv.scheduler.stats()
            peak["batches"] = max(peak["batches"], stats["batches"])
            peak["rows"] = max(peak["rows"], stats["running_rows"])
            time.sleep(0.002)

    def client(c: int):
        cl = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        start.wait()
        kw = {"seed": seeds[c], "n": 1 + c % 2} if seeds[c] is not None else {}
        r = cl.completions.create(model=MODEL, prompt=PROMPTS[c % len(PROMPTS)], max_tokens=max_tokens,
                                  temperature=0.9, extra_body={"speculative": {"method": method, "k": 3}}, **kw)
        answers[c] = [ch.text for ch in r.choices]

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(len(seeds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stop_watch.set()
    assert not any(t.is_alive() for t in threads)
    return answers, peak


def test_seeded_ersd_requests_share_one_batch_and_decode_as_alone(slow_pipe, one_thread):
    """Under ERSD, whose draws are keyed by (seed, row, position), seeded requests at T > 0 and an
    unseeded one run in one shared batch, and each seeded text is that of the request served alone.
    Under ``sd`` (negative control: the check sees concurrency) each seeded request keeps a batch of
    its own, with the same guarantee."""
    seeds = [101, 102, 103, 104, 105, 106, None]
    srv = Server(slow_pipe, ServerConfig(model_name=MODEL, max_rows=16))
    try:
        for method, batches in (("ersd", 1), ("sd", len(seeds))):
            answers, peak = _seeded_clients(srv, method, seeds)
            assert peak["batches"] == batches and peak["rows"] > 1, (method, peak)
            for c, seed in enumerate(seeds):
                if seed is not None:
                    ids = _ids(slow_pipe, PROMPTS[c % len(PROMPTS)])
                    assert answers[c] == _reference(slow_pipe, ids, 16, method=method, k=3, temperature=0.9, seed=seed,
                                                    n=1 + c % 2), (method, c)
    finally:
        srv.stop()


SETTINGS = [
    {"method": "ar"},
    {"method": "sd", "k": 2},
    {"method": "sd", "k": 6, "policy": "heuristic"},
    {"method": "sd", "k": 5, "policy": "confidence", "stop_threshold": 0.6},
    {"method": "sd", "k": 4, "policy": "specdecpp", "stop_threshold": 0.5},
    {"method": "sd", "k": 6, "policy": "cost"},
    {"method": "ngram", "k": 4, "policy": "cost"},
    {"method": "ngram", "k": 3},
    {"method": "ngram_sd", "k": 3},
    {"method": "fsd", "k": 6, "threshold": 0.4},
    {"method": "fsd", "k": 4, "threshold": 0.2, "divergence": "kl", "hybrid": True},
    {"method": "typical", "k": 4, "epsilon": 0.2, "delta": 0.5},
    {"method": "ersd", "k": 4},
    {"method": "phrase_sd", "k": 3},
    {"method": "amusd", "k": 3},
    {"method": "lantern", "k": 4, "lantern_k": 5, "lantern_delta": 0.3},
    {"method": "cd", "cd_alpha": 0.2, "cd_beta": 0.7},
    {"method": "scd", "k": 3, "cd_alpha": 0.1, "cd_beta": 0.5},
]


@pytest.fixture(scope="module")
def head_path(tmp_path_factory):
    from quickdraft.decoding.head import AcceptanceHead, save_head

    torch.manual_seed(0)
    return str(save_head(AcceptanceHead(32, 1), tmp_path_factory.mktemp("head") / "head.pt"))


def test_every_speculation_setting(pipe, head_path, one_thread):
    srv = Server(pipe, ServerConfig(model_name=MODEL, max_tokens=24, defaults=ServeDefaults(head=head_path)))
    try:
        for prompt in PROMPTS[:4:3]:
            ids = _ids(pipe, prompt)
            plain = _reference(pipe, ids, 24, method="ar")[0]
            for spec in SETTINGS:
                r = srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                                  extra_body={"speculative": spec})
                qd = r.model_extra["quickdraft"]
                kw = {key: v for key, v in spec.items() if key != "method"}
                expected = _reference(pipe, ids, 24, method=spec["method"], **kw, head=head_path)[0]
                assert r.choices[0].text == expected, spec
                if spec["method"] in ("ar", "sd", "ngram", "ngram_sd", "ersd", "phrase_sd", "amusd"):  # lossless: the greedy text
                    assert r.choices[0].text == plain, spec
                if spec["method"] == "scd":  # greedy scd is greedy contrastive decoding
                    cd = {key: spec[key] for key in ("cd_alpha", "cd_beta")}
                    assert r.choices[0].text == _reference(pipe, ids, 24, method="cd", **cd)[0], spec
                assert qd["settings"]["method"] == spec["method"]
                assert all(qd["settings"][key] == v for key, v in kw.items()), (spec, qd["settings"])
                if spec["method"] == "ar":
                    assert qd["drafted_tokens"] == 0 and qd["draft_forwards"] == 0
                elif spec["method"] != "ngram" and spec.get("policy") != "cost":  # (cost: where a draft pays)
                    assert qd["draft_forwards"] > 0, spec
    finally:
        srv.stop()


def test_the_cost_policy_decides_by_the_costs_at_the_batch_served(tiny_target, tiny_draft, monkeypatch, one_thread):
    """A server whose default policy is ``auto`` measures the cost policy's costs over batches up to
    its ``max_rows`` before it takes requests; under costs where a draft pays for one row and not
    for four, a lone request drafts and a request of four rows (``n = 4``) makes plain steps, both
    with the greedy text. A server whose default is ``constant`` measures nothing at start."""
    from quickdraft.backends.costs import RowsCost, StepCost

    flat = tuple(1.0 + 0.0125 * m for m in range(9))
    costs = StepCost(target=flat, draft=0.05, batched=(RowsCost(2, flat, 0.05),
                                                        RowsCost(4, tuple(4.0 * (1 + m) for m in range(9)), 0.2)))
    asked = []

    def measured(*args, max_rows=1, **kwargs):
        asked.append(max_rows)
        return costs

    monkeypatch.setattr("quickdraft.pipeline.measure_step_cost", measured)
    pipe = Pipeline(tiny_target, _tokenizer(), tiny_draft)  # costs not yet measured
    Server(pipe, ServerConfig(model_name=MODEL, max_tokens=24, max_rows=4)).stop()
    assert asked == []
    srv = Server(pipe, ServerConfig(model_name=MODEL, max_tokens=24, max_rows=4, defaults=ServeDefaults(policy="auto")))
    assert asked == [4]  # at start
    try:
        plain = _reference(pipe, _ids(pipe, PROMPTS[0]), 24, method="ar")[0]
        drafted = []
        for n in (1, 4):
            r = srv.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, n=n,
                                              extra_body={"speculative": {"method": "sd", "k": 4, "policy": "cost"}})
            assert [c.text for c in r.choices] == [plain] * n
            drafted.append(r.model_extra["quickdraft"]["drafted_tokens"])
        assert asked == [4] and drafted[0] > 0 and drafted[1] == 0, (asked, drafted)
    finally:
        srv.stop()


# -- HTTP: bad requests ----------------------------------------------------------------------------
def _error(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_bad_requests_get_clear_4xx_and_the_server_keeps_serving(server, pipe):
    url = f"{server.url}/v1/completions"
    chat_url = f"{server.url}/v1/chat/completions"
    ok = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8}
    cases = [
        (url, b"{not json", 400, "malformed JSON"),
        (url, b"[1, 2]", 400, "JSON object"),
        (url, {**ok, "speculative": {"method": "nope"}}, 400, "unknown or unserved method"),
        (url, {**ok, "speculative": {"method": "tree"}}, 400, "token trees are not served"),
        (url, {**ok, "speculative": {"method": "amusd", "policy": "heuristic"}}, 400, "constant"),
        (url, {**ok, "speculative": {"method": "lantern", "lantern_delta": 2}}, 400, "speculative.lantern_delta"),
        (url, {**ok, "speculative": {"method": "lantern", "lantern_k": 10**6}}, 400, "speculative.lantern_k"),
        (url, {**ok, "speculative": {"method": "cd", "cd_alpha": 1.5}}, 400, "speculative.cd_alpha"),
        (url, {**ok, "speculative": {"method": "scd", "cd_beta": -1}}, 400, "speculative.cd_beta"),
        (url, {**ok, "speculative": {"method": "fsd", "threshold": -1}}, 400, "speculative.threshold"),
        (url, {**ok, "speculative": {"method": "fsd", "divergence": "cosine"}}, 400, "unknown divergence"),
        (url, {**ok, "speculative": {"k": 0}}, 400, "speculative.k"),
        (url, {**ok, "speculative": {"policy": "specdecpp"}}, 400, "--head"),
        (url, {**ok, "speculative": {"colour": "red"}}, 400, "speculative.colour"),
        (url, {**ok, "prompt": " ".join(["w5"] * 600)}, 400, "maximum context length"),
        (url, {**ok, "max_tokens": 600}, 400, "maximum context length"),
        (url, {**ok, "prompt": ""}, 400, "empty prompt"),
        (url, {**ok, "temperature": -1}, 400, "temperature"),
        (url, {**ok, "n": 17}, 400, "n"),
        (url, {**ok, "logprobs": 2}, 400, "logprobs"),
        (url, {**ok, "model": "gpt-4"}, 404, "does not exist"),
        (url, {"model": MODEL}, 400, "prompt"),
        (chat_url, {"model": MODEL, "messages": []}, 400, "messages"),
        (chat_url, {"model": MODEL, "messages": [{"role": "robot", "content": "w1"}]}, 400, "messages.0.role"),
        (url, b"x" * (2 << 20), 413, "exceeds the limit"),
    ]
    for target_url, body, status, fragment in cases:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(target_url, headers={"content-type": "application/json"}, timeout=30, **kw)
        assert r.status_code == status, (body if isinstance(body, dict) else body[:20], r.text)
        assert fragment in _error(r)["message"] or fragment == _error(r)["param"], r.text
    r = httpx.get(f"{server.url}/v1/nothing-here")
    assert r.status_code == 404 and _error(r)["code"] == "not_found"
    r = httpx.get(url)
    assert r.status_code == 405 and _error(r)
    with pytest.raises(openai.BadRequestError) as info:
        server.client.completions.create(model=MODEL, prompt="w5", max_tokens=8, extra_body={"speculative": {"method": "x"}})
    assert "unknown or unserved method" in str(info.value)
    r = server.client.completions.create(**ok)
    assert r.choices[0].text == _reference(pipe, _ids(pipe, PROMPTS[0]), 8)[0]
    assert server.scheduler.stats()["running_rows"] == 0


def test_a_method_the_models_cannot_run_is_a_400(tiny_target, tiny_draft, one_thread):
    """cd, scd and FSD's js read the draft's whole distribution: with a draft whose head was cut
    to part of the vocabulary they are refused with a 400; FSD with jsd and sd are still served."""
    cut = Pipeline(tiny_target, _tokenizer(), tiny_draft)
    cut.draft.head_ids = torch.arange(TINY_VOCAB // 2)  # as an openvino draft with a reduced head
    srv = Server(cut, ServerConfig(model_name=MODEL, max_tokens=8))
    try:
        for spec in ({"method": "cd"}, {"method": "scd"}, {"method": "fsd", "divergence": "js"}):
            with pytest.raises(openai.BadRequestError) as info:
                srv.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8,
                                              extra_body={"speculative": spec})
            assert "--draft-vocab 0" in str(info.value) and info.value.status_code == 400
        r = srv.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8,  # a finite divergence
                                          extra_body={"speculative": {"method": "fsd", "divergence": "jsd"}})
        assert r.choices[0].finish_reason == "length"
        del cut.draft.head_ids
        r = srv.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8)
        assert r.choices[0].finish_reason == "length" and srv.scheduler.stats()["running_rows"] == 0
    finally:
        srv.stop()


def test_a_failing_batch_fails_only_its_requests(pipe, one_thread):
    """A step that raises (here: every step of the ``typical`` batch) fails the requests of that
    batch with a 500 in the OpenAI format; a concurrent request of another batch completes."""
    srv = Server(pipe, ServerConfig(model_name=MODEL))
    make = srv.scheduler._new_batch

    def new_batch(key):
        batch = make(key)
        if key.settings.method == "typical":
            def broken():
                raise RuntimeError("injected failure")
            batch.decoder.step = broken
        return batch

    srv.scheduler._new_batch = new_batch
    try:
        results: dict = {}

        def call(name, spec, max_tokens):
            results[name] = httpx.post(f"{srv.url}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": PROMPTS[0], "max_tokens": max_tokens, "speculative": spec})

        threads = [threading.Thread(target=call, args=("bad", {"method": "typical"}, 8)),
                   threading.Thread(target=call, args=("good", {"method": "sd"}, 24))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results["bad"].status_code == 500
        assert "injected failure" in _error(results["bad"])["message"]
        assert results["good"].status_code == 200
        assert results["good"].json()["choices"][0]["text"] == _reference(pipe, _ids(pipe, PROMPTS[0]), 24)[0]
        again = srv.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8)
        assert again.choices[0].finish_reason in ("length", "stop")
    finally:
        srv.stop()


def test_cli_serve_refuses_bad_defaults_before_loading_models():
    from typer.testing import CliRunner

    from quickdraft.cli import app

    runner = CliRunner()
    for args, fragment in ((["--method", "tree"], "not served"), (["--k", "0"], "k must be"),
                           (["--policy", "specdecpp"], "--head"), (["--method", "fsd", "--threshold", "-1"], "threshold"),
                           (["--draft", "none"], "needs a draft model")):
        result = runner.invoke(app, ["serve", "--target", "/nonexistent", *args])
        assert result.exit_code == 2, (args, result.output)
        assert fragment in result.output, (args, result.output)


def test_cli_serve_runs_on_openvino_where_installed_never_llamacpp(monkeypatch):
    from typer.testing import CliRunner

    from quickdraft.backends.openvino import is_available
    from quickdraft.cli import app

    chosen = []

    def from_specs(*args, backend, **kwargs):
        chosen.append(backend)
        raise QuickdraftError("stopped before loading")

    monkeypatch.setattr(Pipeline, "from_specs", from_specs)
    monkeypatch.setattr("quickdraft.backends.prefers_llamacpp", lambda flags: True)  # as on an AVX2-only CPU
    result = CliRunner().invoke(app, ["serve", "--target", "target"])
    assert result.exit_code == 2 and "stopped before loading" in result.output
    assert chosen == ["openvino" if is_available() else "torch"]


# -- disconnects, shutdown, load -------------------------------------------------------------------
@pytest.fixture(scope="module")
def slow_pipe(tiny_target, tiny_draft):
    """The tiny pair with 15 ms per target forward, so that a long stream is still running when the
    test acts on it."""
    target = copy.deepcopy(tiny_target)
    fast = target.forward

    @functools.wraps(fast)  # keeps forward's signature, which the runner reads for the cache argument's name
    def slow_forward(*args, **kwargs):
        time.sleep(0.015)
        return fast(*args, **kwargs)

    target.forward = slow_forward
    return Pipeline(target, _tokenizer(), tiny_draft)


LONG_PROMPT = "w5 w6 w7 w8"


def _long_enough(pipe, max_tokens: int) -> None:
    ids = _ids(pipe, LONG_PROMPT)
    out = generate(ModelRunner(pipe.target_model), [ids], method="ar", max_new_tokens=max_tokens,
                   eos_token_ids=pipe.eos_ids())
    assert out.finish_reasons == ["length"], "the prompt must not reach EOS for this test"


def test_client_disconnect_mid_stream_frees_its_row(slow_pipe, one_thread):
    _long_enough(slow_pipe, 300)
    srv = Server(slow_pipe, ServerConfig(model_name=MODEL))
    try:
        body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 300, "stream": True,
                "speculative": {"method": "ar"}}
        other = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 40, "speculative": {"method": "ar"}}
        result: dict = {}
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{srv.url}/v1/completions", json=body) as r:
                got = []
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        got.append(line)
                    if len(got) == 3:
                        break
                assert srv.scheduler.stats()["running_rows"] == 1
                waiter = threading.Thread(target=lambda: result.update(r=httpx.post(
                    f"{srv.url}/v1/completions", json=other, timeout=60)))
                waiter.start()
            t_closed = time.monotonic()
        # the stream's row leaves its batch (the token count below shows it did so before its 300
        # tokens, >= 4.5 s of forwards)
        while srv.scheduler.stats()["running_rows"] > (1 if waiter.is_alive() else 0):
            assert time.monotonic() - t_closed < 10.0, srv.scheduler.stats()
            time.sleep(0.01)
        waiter.join(60)
        assert result["r"].status_code == 200  # the other request was not harmed
        assert result["r"].json()["choices"][0]["finish_reason"] in ("length", "stop")
        deadline = time.monotonic() + 10
        while srv.scheduler.stats()["running_rows"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        metrics = httpx.get(f"{srv.url}/metrics").text
        generated = next(float(line.split()[-1]) for line in metrics.splitlines()
                         if line.startswith("quickdraft_completion_tokens_total"))
        streamed = generated - result["r"].json()["usage"]["completion_tokens"]
        assert 3 <= streamed < 300  # the stream stopped early
    finally:
        srv.stop()


def test_graceful_shutdown_finishes_running_requests(slow_pipe, one_thread):
    _long_enough(slow_pipe, 60)
    srv = Server(slow_pipe, ServerConfig(model_name=MODEL))
    chunks: list = []
    first = threading.Event()

    def consume():
        for c in srv.client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=60, stream=True,
                                               extra_body={"speculative": {"method": "ar"}}):
            chunks.append(c)
            first.set()

    reader = threading.Thread(target=consume)
    reader.start()
    assert first.wait(30)
    srv.stop()  # asks uvicorn to exit while the stream runs
    reader.join(30)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert sum(len(c.choices[0].text.split()) for c in chunks if c.choices) == 60
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{srv.url}/health", timeout=2)


def test_load_concurrent_clients_get_the_answers_served_alone(pipe, one_thread):
    """16 clients x 2 requests with mixed settings, all at T = 0: every answer is complete and
    equal to the same request served alone; requests really share batches."""
    srv = Server(pipe, ServerConfig(model_name=MODEL, max_rows=16))
    specs = [{"method": "sd", "k": 4}, {"method": "ngram", "k": 3}, {"method": "ar"}, {"method": "sd", "k": 2}]
    jobs = [(PROMPTS[(c + j) % len(PROMPTS)], specs[(c + 2 * j) % len(specs)], 16 + (c % 5) * 4)
            for c in range(16) for j in range(2)]
    expected = {}
    for prompt, spec, max_tokens in jobs:
        key = (prompt, spec["method"], spec.get("k"), max_tokens)
        if key not in expected:
            kw = {"k": spec["k"]} if "k" in spec else {}
            expected[key] = _reference(pipe, _ids(pipe, prompt), max_tokens, method=spec["method"], **kw)[0]
    answers: dict[int, tuple] = {}
    peak = {"rows": 0}
    stop_watch = threading.Event()

    def watch():
        while not stop_watch.is_set():
            peak["rows"] = max(peak["rows"], srv.scheduler.stats()["running_rows"])
            time.sleep(0.002)

    def client(c: int):
        cl = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        for j in range(2):
            prompt, spec, max_tokens = jobs[2 * c + j]
            if (c + j) % 2:
                r = cl.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                          extra_body={"speculative": spec})
                answers[2 * c + j] = (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens)
            else:
                text, finish = "", None
                for chunk in cl.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
                                                   extra_body={"speculative": spec}):
                    if chunk.choices:
                        text += chunk.choices[0].text
                        finish = chunk.choices[0].finish_reason or finish
                answers[2 * c + j] = (text, finish, None)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(16)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(1.0, 240 - (time.monotonic() - t0)))
        assert not any(t.is_alive() for t in threads), "load test exceeded its time bound"
    finally:
        stop_watch.set()
        srv.stop()
    assert len(answers) == len(jobs)
    for i, (prompt, spec, max_tokens) in enumerate(jobs):
        text, finish, tokens = answers[i]
        assert finish in ("length", "stop"), (i, finish)
        assert text == expected[(prompt, spec["method"], spec.get("k"), max_tokens)], (i, spec)
        if finish == "length" and tokens is not None:
            assert tokens == max_tokens
    assert peak["rows"] > 1, "requests never shared a batch"


@pytest.mark.slow
def test_real_default_pair_short_completion(real_models):
    real = Pipeline.from_specs("target", "draft")
    srv = Server(real, ServerConfig(model_name="target", max_tokens=16))
    try:
        r = srv.client.completions.create(model="target", prompt="def add(a, b):", max_tokens=12,
                                          extra_body={"speculative": {"method": "sd", "k": 4}})
        assert r.choices[0].text.strip()
        assert r.usage.completion_tokens <= 12
        qd = r.model_extra["quickdraft"]
        assert qd["accepted_tokens"] > 0 and qd["mean_acceptance_length"] > 1.0
    finally:
        srv.stop()
