"""LANTERN's relaxed acceptance (:class:`quickdraft.verification.rules.Latent`) and its neighbourhood table.

The distortion bound tested here (derived in the ``Latent`` docstring): LANTERN's δ bounds each
relaxed target, TV(p, p̃_x) = m_δ(x) ≤ δ. One verification step then emits token y with probability

    π(y) = min(q(y), p(y) + m_δ(y)) + (1 − β)·norm(max(0, p − q))(y),

whose distance from the target is exactly the acceptance gained over the lossless rule,

    TV(π, p) = Σ_y min((q(y) − p(y))₊, m_δ(y)) = β − β_lossless ≤ min(TV(p, q), δ·|{y : q(y) > p(y)}|),

and 0 (π = p) when δ = 0 or k = 1. The bound is tight: a draft that over-proposes n tokens can
move the output n·δ away from the target, more than δ.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from quickdraft.cli import app
from quickdraft.decoding.drafters import ModelDrafter
from quickdraft.decoding.engine import generate
from quickdraft.errors import QuickdraftError
from quickdraft.methods import build_method
from quickdraft.pipeline import Pipeline
from quickdraft.verification.rules import (
    Latent,
    LatentNeighbourhoods,
    Lossless,
    VerifyContext,
    acceptance_probability,
    latent_mass,
    latent_neighbourhoods,
    residual,
)
from quickdraft.backends.runner import ModelRunner
from quickdraft.verification.sampling import SamplingParams
from quickdraft.verification.verify import verify_chain

from conftest import TINY_VOCAB, chi_square_pvalue, word_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]


def _random_case(gen: torch.Generator, v: int, concentration: float):
    """A random target and draft (Dirichlet, float64) and random embeddings ``[V, 8]``."""
    alpha = torch.full((v,), concentration, dtype=torch.float64)
    dirichlet = torch.distributions.Dirichlet(alpha)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))  # Dirichlet has no generator
    target, draft = dirichlet.sample(), dirichlet.sample()
    embeddings = torch.randn(v, 8, generator=gen, dtype=torch.float64)
    return target, draft, embeddings


def one_step_distribution(target: torch.Tensor, draft: torch.Tensor, neighbours: torch.Tensor, delta: float):
    """Exact distribution ``[V]`` of the token one LANTERN step emits at the first draft position
    (the accepted draft or the recovered token), and the acceptance probability β."""
    v = target.shape[0]
    moved = latent_mass(target.expand(v, v), torch.arange(v), neighbours, delta)  # m_δ(y) for every y
    accepted = draft * acceptance_probability(target + moved, draft)  # q(y)·min(1, p̃_y(y)/q(y))
    beta = accepted.sum()
    return accepted + (1 - beta) * residual(target, draft), beta


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


# ---------------------------------------------------------------------------------------------
# (1) the distortion bound, exactly
# ---------------------------------------------------------------------------------------------


def test_one_step_distortion_is_the_extra_acceptance_within_the_bound():
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for case in range(150):
        v = int(torch.randint(4, 40, (1,), generator=gen))
        target, draft, embeddings = _random_case(gen, v, concentration=[0.1, 0.5, 2.0][case % 3])
        table = latent_neighbourhoods(embeddings, v)
        for k in (1, 2, max(2, v // 3), v):
            for delta in (0.0, 0.01, 0.1, 0.3, 1.0):
                neighbours = table[:, :k]
                moved = latent_mass(target.expand(v, v), torch.arange(v), neighbours, delta)
                # LANTERN's constraint: each relaxed target p̃_x is within δ of p, and TV(p, p̃_x) = m_δ(x)
                for x in range(0, v, max(1, v // 5)):
                    relaxed = target.clone()
                    pooled = neighbours[x][: 1 + int((target[neighbours[x][1:]].cumsum(0) <= delta).sum())]
                    relaxed[pooled] = 0
                    relaxed[x] = target[pooled].sum()
                    assert _tv(relaxed, target) == pytest.approx(float(moved[x]), abs=1e-12)
                    assert float(moved[x]) <= delta + 1e-12
                output, beta = one_step_distribution(target, draft, neighbours, delta)
                _, beta_lossless = one_step_distribution(target, draft, neighbours, 0.0)
                assert (output >= -1e-15).all() and float(output.sum()) == pytest.approx(1.0, abs=1e-12)
                distortion = _tv(output, target)
                exact = float(torch.minimum((draft - target).clamp_min(0), moved).sum())
                assert distortion == pytest.approx(exact, abs=1e-12)
                assert distortion == pytest.approx(float(beta - beta_lossless), abs=1e-12)
                bound = min(_tv(target, draft), delta * int((draft > target).sum()))
                assert distortion <= bound + 1e-12
                if delta == 0.0 or k == 1:  # nothing pooled: the lossless rule, exactly the target
                    assert distortion < 1e-12
                checked += distortion > 1e-3
    assert checked > 100  # the relaxation really moved the output in many cases


def test_distortion_grows_with_delta_and_k():
    gen = torch.Generator().manual_seed(1)
    target, draft, embeddings = _random_case(gen, 30, concentration=0.5)
    table = latent_neighbourhoods(embeddings, 30)
    betas = [[float(one_step_distribution(target, draft, table[:, :k], d)[1]) for d in (0, 0.05, 0.2, 0.5)]
             for k in (1, 3, 10, 30)]
    assert all(row == sorted(row) for row in betas)  # acceptance non-decreasing in δ ...
    assert all(list(col) == sorted(col) for col in zip(*betas))  # ... and in k
    assert betas[0][-1] == pytest.approx(betas[0][0]) and betas[-1][-1] > betas[-1][0] + 0.05


def test_output_can_move_n_deltas_when_the_draft_over_proposes_n_tokens():
    """The per-token δ does not bound the output: p uniform on 40 tokens, q uniform on the first
    10, every neighbour of those among the last 30; δ = 0.05 pools two neighbours (0.025 each) onto
    each drafted token, and the output moves 10·δ = 0.5 from p — the bound, attained."""
    v, delta = 40, 0.05
    target = torch.full((v,), 1 / v, dtype=torch.float64)
    draft = torch.zeros(v, dtype=torch.float64)
    draft[:10] = 0.1
    neighbours = torch.stack([torch.tensor([x, 10 + x, 20 + x, 30 + x]) for x in range(v)]) % v
    neighbours[:, 0] = torch.arange(v)
    output, _ = one_step_distribution(target, draft, neighbours, delta)
    assert _tv(output, target) == pytest.approx(10 * delta, abs=1e-12)
    assert _tv(output, target) > delta


# ---------------------------------------------------------------------------------------------
# (2) the sampled rule matches the analytic distribution
# ---------------------------------------------------------------------------------------------


def _sampled_first_tokens(target, draft, neighbours, delta, n, seed):
    rule = Latent(k=neighbours.shape[1], delta=delta, neighbours=neighbours)
    gen = torch.Generator().manual_seed(seed)
    ctx = VerifyContext(generator=gen)
    draft_probs = draft.float().expand(n, 1, -1).contiguous()  # [n, K=1, V]
    target_probs = target.float().expand(n, 2, -1).contiguous()  # [n, K+1, V]
    draft_ids = rule.propose(draft_probs[:, 0], ctx).unsqueeze(1)  # [n, 1]
    out = verify_chain(draft_ids, draft_probs, target_probs, rule, ctx=ctx)
    return out.output_ids[:, 0].numpy(), out


def test_sampled_output_matches_the_analytic_distribution_and_a_moved_one_fails():
    gen = torch.Generator().manual_seed(2)
    target, draft, embeddings = _random_case(gen, 16, concentration=0.7)
    k, delta, n = 6, 0.3, 60_000
    neighbours = latent_neighbourhoods(embeddings, k)
    tokens, out = _sampled_first_tokens(target, draft, neighbours, delta, n, seed=3)
    counts = np.bincount(tokens, minlength=16)
    expected, beta = one_step_distribution(target, draft, neighbours, delta)
    control, _ = one_step_distribution(target, draft, neighbours, 0.05)  # the analytic law at another δ
    assert _tv(expected, control) > 0.03  # the control is far enough to be detectable
    assert chi_square_pvalue(counts, expected.numpy()) > 1e-4
    assert chi_square_pvalue(counts, control.numpy()) < 1e-6
    assert chi_square_pvalue(counts, target.numpy()) < 1e-6  # and the rule is lossy here
    # the acceptance rate is β (binomial, 4.5 standard deviations)
    accepted = out.num_accepted.double().mean().item()
    assert abs(accepted - float(beta)) < 4.5 * math.sqrt(float(beta * (1 - beta)) / n)
    assert 0 < out.num_lossy.sum() < out.num_accepted.sum()


def test_zero_delta_is_lossless_draw_for_draw():
    gen = torch.Generator().manual_seed(4)
    target, draft, embeddings = _random_case(gen, 16, concentration=0.7)
    neighbours = latent_neighbourhoods(embeddings, 8)
    draft_probs = draft.float().expand(500, 3, -1).contiguous()
    target_probs = target.float().expand(500, 4, -1).contiguous()
    draft_ids = torch.multinomial(draft_probs[:, 0], 3, replacement=True, generator=gen)
    runs = {}
    for name, rule in (("lossless", Lossless()), ("delta0", Latent(k=8, delta=0.0, neighbours=neighbours)),
                       ("k1", Latent(k=1, delta=0.5, neighbours=neighbours)),
                       ("relaxed", Latent(k=8, delta=0.3, neighbours=neighbours))):
        out = verify_chain(draft_ids, draft_probs, target_probs, rule, torch.Generator().manual_seed(5))
        runs[name] = out
    for name in ("delta0", "k1"):
        assert torch.equal(runs[name].output_ids, runs["lossless"].output_ids)
        assert runs[name].num_lossy.sum() == 0
    assert Latent(k=8, delta=0.0).lossless and Latent(k=1, delta=0.5).lossless and not Latent().lossless
    # with the same uniforms the relaxed rule accepts everything the lossless one does, and more
    assert (runs["relaxed"].num_accepted >= runs["lossless"].num_accepted).all()
    assert runs["relaxed"].num_accepted.sum() > runs["lossless"].num_accepted.sum()


# ---------------------------------------------------------------------------------------------
# (3) the neighbourhood table
# ---------------------------------------------------------------------------------------------


def _brute_force(embeddings: torch.Tensor, k: int) -> torch.Tensor:
    unit = embeddings / embeddings.norm(dim=-1, keepdim=True)
    similarity = unit @ unit.T  # [V, V]
    similarity.fill_diagonal_(math.inf)
    return similarity.argsort(dim=-1, descending=True)[:, :k]


def test_neighbourhoods_match_brute_force_for_every_chunking():
    gen = torch.Generator().manual_seed(6)
    embeddings = torch.randn(97, 12, generator=gen)
    for k in (1, 5, 97):
        expected = _brute_force(embeddings, k)
        for chunk_size in (1, 7, 32, 97, 500):
            table = latent_neighbourhoods(embeddings, k, chunk_size=chunk_size)
            assert table.dtype == torch.long and table.shape == (97, k)
            assert torch.equal(table, expected), (k, chunk_size)
    # cosine, not dot product: scaling a row changes nothing
    scaled = embeddings * torch.rand(97, 1, generator=gen).add(0.1) * 100
    assert torch.equal(latent_neighbourhoods(scaled, 5), latent_neighbourhoods(embeddings, 5))


def test_every_token_is_its_own_nearest_neighbour():
    gen = torch.Generator().manual_seed(7)
    embeddings = torch.randn(20, 4, generator=gen)
    embeddings[5] = embeddings[3]  # a duplicate row
    embeddings[7] = 0  # a zero row
    table = latent_neighbourhoods(embeddings, 4, chunk_size=3)
    assert torch.equal(table[:, 0], torch.arange(20))
    assert table[3, 1] == 5 and table[5, 1] == 3  # the duplicate is the next nearest
    assert all(len(set(row.tolist())) == 4 for row in table)  # no token twice
    lazy = LatentNeighbourhoods(embeddings, 4)
    assert torch.equal(lazy[torch.arange(20)], table)


def test_lazy_rows_equal_the_full_table_across_calls():
    """Random ids (duplicates, repeats across calls, any shape) give the full table's rows; each
    row is computed once, on its first call."""
    gen = torch.Generator().manual_seed(8)
    for v, d, k in ((97, 12, 5), (300, 16, 300), (50, 3, 1)):
        embeddings = torch.randn(v, d, generator=gen)
        embeddings[v // 2] = 0  # a zero row
        full = latent_neighbourhoods(embeddings, k)
        lazy = LatentNeighbourhoods(embeddings, k)
        assert lazy.shape == (v, k) and lazy.computed == 0
        seen: set[int] = set()
        for call in range(8):
            shape = [(6,), (2, 5), (3, 1, 4), (40,)][call % 4]
            ids = torch.randint(0, v, shape, generator=gen)
            ids.view(-1)[0] = ids.view(-1)[-1]  # a duplicate within the call
            if seen and call % 2:  # a row computed by an earlier call
                ids.view(-1)[1] = next(iter(seen))
            rows = lazy[ids]
            assert rows.dtype == torch.long and rows.shape == (*shape, k)
            assert torch.equal(rows, full[ids]), (v, k, call)
            seen |= set(ids.view(-1).tolist())
            assert lazy.computed == len(seen)
        assert torch.equal(lazy.rows(torch.arange(v)), full)  # the rest, and the cached rows unchanged
        assert lazy.computed == v


def test_lazy_rows_compute_only_new_tokens_in_one_batch(monkeypatch):
    from quickdraft.verification import rules

    embeddings = torch.randn(64, 8, generator=torch.Generator().manual_seed(9))
    lazy = LatentNeighbourhoods(embeddings, 4)
    batches = []
    nearest = rules._nearest
    monkeypatch.setattr(rules, "_nearest", lambda matrix, norms, rows, k: batches.append(rows.tolist())
                        or nearest(matrix, norms, rows, k))
    lazy[torch.tensor([[5, 3, 5], [9, 3, 3]])]
    lazy[torch.tensor([3, 5, 9])]  # all cached: no matmul
    lazy[torch.tensor([9, 1, 1, 5])]
    assert batches == [[3, 5, 9], [1]]
    assert lazy.computed == 4 and "computed=4" in repr(lazy)


# ---------------------------------------------------------------------------------------------
# (4) validation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, needle", [
    (dict(k=0), "k must be an integer >= 1"),
    (dict(k=2.5), "k must be an integer >= 1"),
    (dict(k=True), "k must be an integer >= 1"),
    (dict(delta=-0.1), r"delta must be a total-variation budget in \[0, 1\]"),
    (dict(delta=1.5), r"in \[0, 1\]"),
    (dict(delta=math.nan), r"in \[0, 1\]"),
    (dict(delta="0.1"), r"in \[0, 1\]"),
    (dict(k=3, neighbours=torch.arange(10).unsqueeze(1)), "fewer than k=3"),
    (dict(k=1, neighbours=torch.arange(10, dtype=torch.int32).unsqueeze(1)), "int64"),
    (dict(k=2, neighbours=torch.arange(10).flip(0).unsqueeze(1).repeat(1, 2)), "every token first"),
    (dict(k=3, neighbours=LatentNeighbourhoods(torch.randn(10, 2), 4)), "computes 4 columns, k=3 needs 3"),
])
def test_rule_validation(kwargs, needle):
    with pytest.raises(QuickdraftError, match=needle):
        Latent(**kwargs)


def test_table_validation_and_a_missing_table():
    table = latent_neighbourhoods(torch.randn(10, 3), 4)
    assert Latent(k=2, neighbours=table).neighbours.shape == (10, 2)  # a wider table is cut to k
    assert Latent(k=2, neighbours=table) == Latent(k=2)  # the table is not part of equality
    assert Latent(k=100, neighbours=latent_neighbourhoods(torch.randn(10, 3), 10)).neighbours.shape == (10, 10)
    assert Latent(k=100, neighbours=LatentNeighbourhoods(torch.randn(10, 3), 10)).neighbours.shape == (10, 10)
    probs = torch.full((1, 1, 10), 0.1)
    ids = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(QuickdraftError, match="no neighbourhood table"):
        Latent().accept(ids, probs, probs, VerifyContext())
    with pytest.raises(QuickdraftError, match="cover 10 tokens, the distributions 12"):
        Latent(k=2, neighbours=table).accept(ids, torch.full((1, 1, 12), 1 / 12), torch.full((1, 1, 12), 1 / 12),
                                             VerifyContext())
    for args, needle in [((torch.randn(10), 2), r"floating \[V, D\]"), ((torch.ones(4, 2, dtype=torch.long), 2), "floating"),
                         ((torch.randn(10, 3), 0), r"in \[1, V=10\]"), ((torch.randn(10, 3), 11), r"in \[1, V=10\]")]:
        with pytest.raises(QuickdraftError, match=needle):
            latent_neighbourhoods(*args)
    with pytest.raises(QuickdraftError, match="chunk_size"):
        latent_neighbourhoods(torch.randn(10, 3), 2, chunk_size=0)
    for args, needle in [((torch.randn(10), 2), r"floating \[V, D\]"), ((torch.randn(10, 3), 11), r"in \[1, V=10\]")]:
        with pytest.raises(QuickdraftError, match=needle):
            LatentNeighbourhoods(*args)
    lazy = LatentNeighbourhoods(torch.randn(10, 3), 2)
    with pytest.raises(QuickdraftError, match="cover 10 tokens, the distributions 12"):
        Latent(k=2, neighbours=lazy).accept(ids, torch.full((1, 1, 12), 1 / 12), torch.full((1, 1, 12), 1 / 12),
                                            VerifyContext())


def test_method_and_command_line_validation():
    spec = build_method("lantern", lantern_k=12, lantern_delta=0.25)
    assert spec.rule == Latent(k=12, delta=0.25) and spec.engine_method == "sd" and spec.needs_draft
    assert not spec.rule.greedy_drafts
    with pytest.raises(QuickdraftError, match="k must be"):
        build_method("lantern", lantern_k=0)
    runner = CliRunner()
    for args, needle in ((["--lantern-k", "0"], "k must be"), (["--lantern-delta", "2"], "delta must be")):
        result = runner.invoke(app, ["generate", "hello", "--method", "lantern", *args])
        assert result.exit_code == 2, result.output
        lines = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and needle in lines[0], result.output


# ---------------------------------------------------------------------------------------------
# (5) end to end on tiny models
# ---------------------------------------------------------------------------------------------


def _embedding_table(model, k: int) -> torch.Tensor:
    return latent_neighbourhoods(model.get_input_embeddings().weight, k)


def test_engine_lossless_at_zero_delta_and_acceptance_grows_with_delta(soft_target, tiny_draft):
    target = ModelRunner(soft_target)
    drafter = ModelDrafter(ModelRunner(tiny_draft, "draft"), TINY_VOCAB)
    table = _embedding_table(soft_target, 16)
    params = SamplingParams(temperature=1.0)

    def run(rule, seed=0):
        return generate(target, PROMPTS * 2, method="sd", drafter=drafter, rule=rule, sampling=params,
                        max_new_tokens=24, seed=seed)

    for seed in (0, 1):
        lossless = run(Lossless(), seed)
        for rule in (Latent(k=16, delta=0.0, neighbours=table), Latent(k=1, delta=0.5, neighbours=table)):
            out = run(rule, seed)
            assert out.sequences == lossless.sequences
            assert out.batch_metrics.accepted_tokens == lossless.batch_metrics.accepted_tokens
            assert out.batch_metrics.lossy_accepted_tokens == 0
    rates = []
    for delta in (0.0, 0.1, 0.3, 0.6):
        m = run(Latent(k=16, delta=delta, neighbours=table)).batch_metrics
        rates.append(m.acceptance_rate)
        assert (m.lossy_accepted_tokens > 0) == (delta > 0)
    assert rates == sorted(rates) and rates[-1] > rates[0] + 0.1, rates


def test_engine_output_is_the_same_with_lazy_and_full_neighbourhoods(soft_target, tiny_draft):
    target = ModelRunner(soft_target)
    drafter = ModelDrafter(ModelRunner(tiny_draft, "draft"), TINY_VOCAB)
    embeddings = soft_target.get_input_embeddings().weight
    params = SamplingParams(temperature=1.0)
    for seed, delta in ((0, 0.3), (1, 0.6)):
        lazy = LatentNeighbourhoods(embeddings, 16)
        runs = [generate(target, PROMPTS * 2, method="sd", drafter=drafter, sampling=params, max_new_tokens=24,
                         seed=seed, rule=Latent(k=16, delta=delta, neighbours=neighbours))
                for neighbours in (_embedding_table(soft_target, 16), lazy)]
        assert runs[0].sequences == runs[1].sequences
        assert runs[0].batch_metrics.accepted_tokens == runs[1].batch_metrics.accepted_tokens
        assert runs[0].batch_metrics.lossy_accepted_tokens == runs[1].batch_metrics.lossy_accepted_tokens > 0
        assert 0 < lazy.computed < TINY_VOCAB  # only the drafted tokens' rows


def test_pipeline_attaches_the_targets_neighbourhoods(soft_target, tiny_draft):
    pipe = Pipeline(soft_target, word_tokenizer(), tiny_draft)
    neighbourhoods = pipe.latent_neighbourhoods(8)
    assert isinstance(neighbourhoods, LatentNeighbourhoods) and neighbourhoods.computed == 0
    assert torch.equal(neighbourhoods[torch.arange(TINY_VOCAB)], _embedding_table(soft_target, 8))
    assert pipe.latent_neighbourhoods(8) is neighbourhoods  # one per pipeline and k: its rows are kept
    assert pipe.latent_neighbourhoods(10**6).k == TINY_VOCAB
    assert pipe.ready_rule(Latent(k=4)).neighbours.shape == (TINY_VOCAB, 4)
    params = SamplingParams(temperature=1.0)
    via_pipeline = pipe.generate("", prompt_ids=PROMPTS, method="sd", rule=Latent(k=8, delta=0.3), sampling=params,
                                 max_new_tokens=16, seed=2)
    direct = generate(ModelRunner(soft_target), PROMPTS, method="sd",
                      drafter=ModelDrafter(ModelRunner(tiny_draft, "draft"), TINY_VOCAB),
                      rule=Latent(k=8, delta=0.3, neighbours=_embedding_table(soft_target, 8)), sampling=params,
                      max_new_tokens=16, seed=2)
    assert [c.token_ids for c in via_pipeline.completions] == direct.sequences


def test_embeddings_come_from_the_safetensors_beside_an_export(tmp_path, soft_target):
    """Backends without a torch model read the embedding from the safetensors of the model
    directory or of the cache entry above the export; a GGUF file is a clear error."""
    soft_target.save_pretrained(tmp_path)
    tokenizer = word_tokenizer()
    stand_in = SimpleNamespace(config=soft_target.config, name_or_path=str(tmp_path / "openvino-int8"))
    pipe = Pipeline(stand_in, tokenizer, target_runner=SimpleNamespace())
    torch.testing.assert_close(pipe.token_embeddings(), soft_target.get_input_embeddings().weight, rtol=0, atol=0)
    assert torch.equal(pipe.latent_neighbourhoods(5)[torch.arange(TINY_VOCAB)], _embedding_table(soft_target, 5))
    gguf = SimpleNamespace(config=soft_target.config, name_or_path=str(tmp_path / "elsewhere" / "model.gguf"))
    with pytest.raises(QuickdraftError, match="llamacpp"):
        Pipeline(gguf, tokenizer, target_runner=SimpleNamespace()).token_embeddings()


def test_command_line_lantern_runs_and_zero_delta_prints_the_sd_text(monkeypatch, soft_target, tiny_draft):
    pipe = Pipeline(soft_target, word_tokenizer(), tiny_draft)
    monkeypatch.setattr(Pipeline, "from_specs", classmethod(lambda cls, *args, **kwargs: pipe))
    common = ["generate", "w1 w2 w3 w4", "--no-chat", "--temperature", "1.0", "--max-new-tokens", "24", "--json",
              "--seed", "2", "--policy", "constant"]
    runner = CliRunner()

    def run(*extra):
        result = runner.invoke(app, [*common, *extra])
        assert result.exit_code == 0, result.output
        return json.loads(result.output[result.output.index("{"):])

    relaxed = run("--method", "lantern", "--lantern-k", "16", "--lantern-delta", "0.6")
    assert relaxed["metrics"]["draft_forwards"] > 0 and relaxed["metrics"]["lossy_share"] > 0
    lossless = run("--method", "sd")
    assert run("--method", "lantern", "--lantern-delta", "0")["text"] == lossless["text"]
    assert relaxed["text"] != lossless["text"]
