"""Retrieval drafting (REST): the suffix array and its search against brute force, the most frequent
continuation, datastores on disk, exactness through the engine (greedy equality, goodness of fit
with a control that must fail), the pipeline and the command line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from quickdraft.decoding.drafters import ModelDrafter, NGramModelDrafter
from quickdraft.decoding.engine import generate
from quickdraft.errors import QuickdraftError
from quickdraft.pipeline import Pipeline
from quickdraft.decoding.policies import Constant
from quickdraft.decoding.retrieval import (
    SEPARATOR, RetrievalDrafter, RetrievalIndex, most_frequent_path, read_datastore, suffix_array,
    suffix_array_numpy,
)
from quickdraft.verification.rules import Greedy, Lossless
from quickdraft.backends.runner import ModelRunner
from quickdraft.verification.sampling import SamplingParams

from conftest import TINY_VOCAB, chi_square_pvalue, counts_after_first, exact_after_first, tiny_lm, word_tokenizer
from test_cli import _run, tiny_pipeline  # noqa: F401  (tiny_pipeline is a fixture)


def _random_stream(seed: int, n: int, alphabet: int) -> np.ndarray:
    """``[n]`` tokens in ``[0, alphabet)`` with a separator about every 15 tokens."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, alphabet, n).astype(np.int32)
    tokens[rng.random(n) < 1 / 15] = SEPARATOR
    return tokens


def _brute_positions(tokens: np.ndarray, query: list[int]) -> list[int]:
    m = len(query)
    return [i for i in range(len(tokens) - m + 1) if tokens[i:i + m].tolist() == query]


@pytest.mark.parametrize("seed, n, alphabet", [(0, 1, 3), (1, 50, 2), (2, 400, 3), (3, 600, 40)])
def test_suffix_array_sorts_the_suffixes(seed, n, alphabet):
    tokens = _random_stream(seed, n, alphabet)
    expected = sorted(range(n), key=lambda i: tokens[i:].tolist())
    assert suffix_array(tokens).tolist() == expected
    assert suffix_array_numpy(tokens).tolist() == expected


@pytest.mark.parametrize("seed, alphabet", [(0, 2), (1, 4), (2, 30)])
def test_search_finds_exactly_the_positions_a_scan_finds(seed, alphabet):
    tokens = _random_stream(seed, 2000, alphabet)
    index = RetrievalIndex(tokens)
    rng = np.random.default_rng(100 + seed)
    found_some = missed_some = False
    for length in (1, 2, 3, 5, 8, 16):
        for _ in range(20):
            start = int(rng.integers(0, len(tokens) - length))
            queries = [tokens[start:start + length].tolist(), rng.integers(0, alphabet, length).tolist()]
            for query in queries:
                if SEPARATOR in query:
                    continue
                expected = _brute_positions(tokens, query)
                assert sorted(index.find(query).tolist()) == expected, query
                found_some |= bool(expected)
                missed_some |= not expected
    assert sorted(index.find([alphabet + 5]).tolist()) == []  # a token the stream never holds
    assert found_some and missed_some


def test_longest_suffix_is_the_longest_that_occurs():
    tokens = _random_stream(7, 3000, 3)
    index = RetrievalIndex(tokens)
    rng = np.random.default_rng(8)
    for _ in range(50):
        context = rng.integers(0, 3, 30).tolist()
        occurring = [n for n in range(2, 17) if _brute_positions(tokens, context[-n:])]
        assert index.longest_suffix(context, max_suffix=16, min_suffix=2) == max(occurring, default=0)
    assert index.longest_suffix([9, 9, 9]) == 0


def test_the_draft_is_the_most_frequent_path_of_the_longest_match():
    # after [10, 11]: [1, 2, 3] three times, [1, 2, 4] twice, [5, 6] four times
    docs = [[10, 11, 1, 2, 3]] * 3 + [[10, 11, 1, 2, 4]] * 2 + [[10, 11, 5, 6]] * 4 + [[9, 10, 11, 7, 7]]
    index = RetrievalIndex.from_token_lists(docs)
    # the trie's most frequent first token is 1 (5 of 10), then 2, then 3 (3 of 5)
    assert index.draft([0, 10, 11], 4) == [1, 2, 3]
    assert index.draft([0, 10, 11], 2) == [1, 2]
    # a longer match wins over frequency; a draft never crosses a document's end
    assert index.draft([9, 10, 11], 4) == [7, 7]
    assert index.draft([2, 3], 4) == [] and index.draft([10, 11, 1, 2, 3], 4) == []
    assert index.draft([8, 8], 4) == []  # no suffix of two tokens occurs
    assert index.draft([0, 10, 11], 4, max_matches=1) in ([1, 2, 3], [1, 2, 4], [5, 6], [7, 7])
    assert most_frequent_path(np.array([[7, 8, -1], [7, 9, -1], [7, 8, 1]])) == [7, 8, 1]


def test_index_round_trips_through_a_file(tmp_path):
    index = RetrievalIndex(_random_stream(3, 500, 5))
    index.save(tmp_path / "index.npz")
    loaded = RetrievalIndex.from_path(tmp_path / "index.npz", tokenizer=None)
    assert np.array_equal(loaded.tokens, index.tokens) and np.array_equal(loaded.suffixes, index.suffixes)
    (tmp_path / "bad.npz").write_bytes(b"not an index")
    with pytest.raises(QuickdraftError, match="not a datastore index"):
        RetrievalIndex.load(tmp_path / "bad.npz")


def test_datastores_on_disk(tmp_path):
    tree = tmp_path / "src"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "a.py").write_text("w1 w2 w3")
    (tree / "b.txt").write_text("w4 w5")
    (tree / "blob.bin").write_bytes(b"\x00\x01\xff")  # binary: skipped
    (tree / ".git").mkdir()
    (tree / ".git" / "HEAD").write_text("w9 w9")  # hidden: skipped
    (tree / "c.jsonl").write_text(json.dumps({"text": "w6 w7"}) + "\n\n" + json.dumps({"text": "w8"}) + "\n")
    assert read_datastore(tree) == ["w4 w5", "w6 w7", "w8", "w1 w2 w3"]
    index = RetrievalIndex.from_path(tree, word_tokenizer())
    assert index.tokens.tolist() == [4, 5, -1, 6, 7, -1, 8, -1, 1, 2, 3, -1]
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "w1"}) + "\n")
    assert read_datastore(tmp_path / "d.jsonl", field="body") == ["w1"]


def test_glob_datastores_and_the_bench_spelling(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("w1 w2")
    (tmp_path / "b.py").write_text("w3")
    (tmp_path / "c.txt").write_text("w4")
    assert read_datastore(tmp_path / "*.py") == ["w3"]
    assert read_datastore(f"{tmp_path}/**/*.py") == ["w3", "w1 w2"]  # path order: b.py, pkg/a.py
    with pytest.raises(QuickdraftError, match="matches no text files"):
        read_datastore(tmp_path / "*.md")
    import sysconfig

    from quickdraft.evaluation.bench import expand_datastore

    monkeypatch.setenv("STORE_ROOT", str(tmp_path))
    assert expand_datastore("$STORE_ROOT/*.py") == f"{tmp_path}/*.py"
    assert expand_datastore("{stdlib}/*.py") == sysconfig.get_paths()["stdlib"] + "/*.py"
    assert len(read_datastore(expand_datastore("{stdlib}/json/*.py"))) >= 4  # the standard library's json package


@pytest.mark.parametrize("setup, needle", [
    (lambda p: p / "missing", "does not exist"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "holds no text files"),
    (lambda p: (p / "e.txt").write_text("  \n") and p / "e.txt", "is empty"),
    (lambda p: (p / "x.bin").write_bytes(b"\xff\xfe") and p / "x.bin", "not UTF-8"),
    (lambda p: (p / "f.jsonl").write_text('{"body": "w1"}\n') and p / "f.jsonl", "no text field 'text'"),
    (lambda p: (p / "g.jsonl").write_text("{not json\n") and p / "g.jsonl", "g.jsonl:1: not a JSON object"),
])
def test_bad_datastores_give_clear_errors(tmp_path, setup, needle):
    with pytest.raises(QuickdraftError, match=needle):
        read_datastore(setup(tmp_path))


def test_index_errors():
    with pytest.raises(QuickdraftError, match="no tokens"):
        RetrievalIndex.from_token_lists([[], []])
    index = RetrievalIndex.from_token_lists([[1, 2, 99]])
    with pytest.raises(QuickdraftError, match="token id 99"):
        RetrievalDrafter(64, index)
    with pytest.raises(QuickdraftError, match="min_suffix"):
        RetrievalDrafter(100, index, max_suffix=2, min_suffix=3)


PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]


def _datastore_of(sequences: list[list[int]], seed: int = 0) -> RetrievalIndex:
    """The generated ``sequences``, two copies of each with every fifth token of its second half
    changed (more frequent, so that some retrieved tokens are rejected), and unrelated random documents."""
    rng = np.random.default_rng(seed)
    docs = [list(s) for s in sequences]
    for s in sequences:
        noisy = list(s)
        for i in range(len(s) // 2, len(s), 5):
            noisy[i] = (noisy[i] + 1) % TINY_VOCAB
        docs += [noisy, noisy]
    docs += [rng.integers(0, TINY_VOCAB, 40).tolist() for _ in range(20)]
    return RetrievalIndex.from_token_lists(docs)


@pytest.mark.parametrize("rule", [Greedy(), Lossless()])
def test_rest_greedy_equals_plain_greedy_and_accepts_retrieved_tokens(tiny_target, rule):
    target = ModelRunner(tiny_target)
    plain = generate(target, PROMPTS, method="ar", max_new_tokens=40)
    index = _datastore_of(plain.sequences)
    for batch in (PROMPTS[:1], PROMPTS):
        out = generate(target, batch, method="rest", drafter=RetrievalDrafter(TINY_VOCAB, index), rule=rule,
                       policy=Constant(4), max_new_tokens=40)
        assert out.sequences == plain.sequences[: len(batch)]
        m = out.batch_metrics
        assert 0 < m.accepted_tokens < m.drafted_tokens and m.draft_forwards == 0
        assert m.steps < sum(len(s) for s in out.sequences)


@pytest.mark.parametrize("rule", [Greedy(), Lossless()])
def test_rest_sd_greedy_equals_plain_greedy_and_uses_both_drafters(tiny_target, tiny_draft, rule):
    target = ModelRunner(tiny_target)
    plain = generate(target, PROMPTS, method="ar", max_new_tokens=40)
    index = _datastore_of([s[: len(s) // 2] for s in plain.sequences])  # the second halves are not retrieved
    for batch in (PROMPTS[:1], PROMPTS):
        drafter = NGramModelDrafter(RetrievalDrafter(TINY_VOCAB, index),
                                    ModelDrafter(ModelRunner(tiny_draft), TINY_VOCAB), lookup_k=6)
        out = generate(target, batch, method="rest_sd", drafter=drafter, rule=rule, policy=Constant(3),
                       max_new_tokens=40)
        assert drafter.name == "rest_sd"
        assert out.sequences == plain.sequences[: len(batch)]
        assert drafter.lookup_steps > 0 and out.batch_metrics.draft_forwards > 0
        assert out.batch_metrics.accepted_tokens > 0


class AcceptAll(Lossless):
    """A broken rule: every drafted token accepted."""

    def accept(self, draft_ids, draft_probs, target_probs, ctx):
        return torch.ones_like(draft_ids, dtype=torch.bool), None


@pytest.mark.parametrize("method", ["rest", "rest_sd"])
def test_rest_sampling_matches_the_target(one_thread, method):
    """At T = 1 on a vocabulary-8 pair, 10,000 rows generate four tokens through retrieved
    (one-hot) drafts, and for ``rest_sd`` draft-model steps where retrieval finds nothing; the
    three after the prefill's follow the target's exact law (512 cells, chi-square p > 1e-4). Accepting every draft
    fails the same test (p < 1e-6)."""
    v, n = 8, 10_000
    model = tiny_lm(seed=31, vocab=v, max_positions=64)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    params = SamplingParams(temperature=1.0)
    prompt = [5, 4, 7, 5, 4]
    exact = exact_after_first(model, prompt, params, 3)
    index = RetrievalIndex.from_token_lists([[5, 4, 7, 5, 4, 7, 5, 4, 7], [3, 6, 2, 6]])
    target = ModelRunner(model)

    def run(rule):
        drafter = RetrievalDrafter(v, index)
        if method == "rest_sd":
            drafter = NGramModelDrafter(drafter, ModelDrafter(ModelRunner(tiny_lm(seed=7, vocab=v, max_positions=64)), v),
                                        lookup_k=3)
        out = generate(target, [prompt] * n, method=method, drafter=drafter, rule=rule, policy=Constant(3),
                       sampling=params, max_new_tokens=4, seed=17)
        counts = counts_after_first(out.sequences, v, 3)
        return counts, out.batch_metrics

    counts, metrics = run(Lossless())
    assert n // 10 < metrics.accepted_tokens < metrics.drafted_tokens  # retrieved tokens accepted and rejected
    if method == "rest_sd":
        assert metrics.draft_forwards > 0
    assert chi_square_pvalue(counts, exact) > 1e-4
    assert chi_square_pvalue(run(AcceptAll())[0], exact) < 1e-6


def test_pipeline_retrieves_from_a_datastore(tiny_target, tiny_draft, tmp_path):
    pipe = Pipeline(tiny_target, word_tokenizer(), tiny_draft)
    plain = pipe.generate("w1 w2 w3", method="ar", max_new_tokens=20, chat=False)
    (tmp_path / "store.txt").write_text("w1 w2 w3 " + plain.completions[0].text)
    with pytest.raises(QuickdraftError, match="needs a datastore"):
        pipe.generate("w1 w2 w3", method="rest", max_new_tokens=20, chat=False)
    for method in ("rest", "rest_sd"):
        out = pipe.generate("w1 w2 w3", method=method, max_new_tokens=20, chat=False, datastore=tmp_path / "store.txt")
        assert out.completions[0].text == plain.completions[0].text
        assert out.metrics.accepted_tokens > 0
    assert pipe.datastore is None  # a datastore given to generate is for that call
    pipe.set_datastore(tmp_path / "store.txt")
    assert pipe.generate("w1 w2 w3", method="rest", max_new_tokens=20, chat=False).metrics.accepted_tokens > 0


@pytest.mark.parametrize("args, needle", [
    (["--method", "rest"], "give --datastore PATH"),
    (["--method", "rest_sd"], "give --datastore PATH"),
    (["--method", "sd", "--datastore", "."], "--datastore applies to the retrieval methods"),
    (["--method", "rest", "--datastore", "/nonexistent/store"], "/nonexistent/store does not exist"),
])
def test_cli_datastore_errors(args, needle):
    result = _run("generate", "hello", *args, "--target", "/nonexistent/model/dir")
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0], result.output


def test_bench_needs_a_datastore_for_retrieval(tmp_path):
    result = _run("bench", "--methods", "sd,rest_sd:k=8", "--dataset", "humaneval", "--limit", "1",
                  "--out", str(tmp_path / "run"), "--target", "/nonexistent/model/dir")
    assert result.exit_code == 2, result.output
    assert "rest_sd:k=8 retrieve from a datastore: give --datastore" in result.output


def test_cli_rest_end_to_end(tiny_pipeline, tmp_path):  # noqa: F811
    (tmp_path / "corpus.jsonl").write_text(json.dumps({"body": "w1 w2 w3 w4 w5 w6"}) + "\n")
    common = ["generate", "w1 w2 w3", "--no-chat", "--max-new-tokens", "8", "--json"]
    result = _run(*common, "--method", "rest", "--datastore", str(tmp_path / "corpus.jsonl"),
                  "--datastore-field", "body")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output[result.output.index("{"):])
    plain = json.loads((r := _run(*common, "--method", "ar")).output[r.output.index("{"):])
    assert payload["text"] == plain["text"] and payload["metrics"]["draft_forwards"] == 0
    bad = _run(*common, "--method", "rest", "--datastore", str(tmp_path / "corpus.jsonl"))
    assert bad.exit_code == 2 and "no text field 'text'" in bad.output


def test_the_server_serves_the_retrieval_methods(tiny_target, tiny_draft):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from quickdraft.serve.app import ServerConfig, create_app

    pipe = Pipeline(tiny_target, word_tokenizer(), tiny_draft)
    plain = pipe.generate("w1 w2 w3", method="ar", max_new_tokens=12, chat=False).completions[0].text
    body = {"model": "m", "prompt": "w1 w2 w3", "max_tokens": 12}
    with TestClient(create_app(pipe, ServerConfig(model_name="m", max_tokens=12, max_rows=4))) as client:
        refused = client.post("/v1/completions", json={**body, "speculative": {"method": "rest"}})
        assert refused.status_code == 400 and "--datastore" in refused.json()["error"]["message"]
        pipe.set_datastore(RetrievalIndex.from_texts(["w1 w2 w3 " + plain], pipe.tokenizer))
        for method in ("rest", "rest_sd"):
            reply = client.post("/v1/completions", json={**body, "speculative": {"method": method}}).json()
            assert reply["choices"][0]["text"] == plain and reply["quickdraft"]["accepted_tokens"] > 0
