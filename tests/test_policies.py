"""Draft-length policies: stopping arithmetic, state transitions, and that no policy changes the output."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from quickdraft.decoding.drafters import ModelDrafter
from quickdraft.decoding.engine import generate
from quickdraft.errors import QuickdraftError
from quickdraft.decoding.head import AcceptanceHead
from quickdraft.methods import build_policy
from quickdraft.backends.costs import StepCost
from quickdraft.decoding.policies import (
    Confidence,
    Constant,
    CostAware,
    Heuristic,
    Policy,
    SpecDecPP,
    batch_stop,
    best_draft_length,
    expected_tokens,
    heuristic_next_k,
    rejection_risk,
)
from quickdraft.verification.rules import Lossless
from quickdraft.backends.runner import ModelRunner
from quickdraft.verification.sampling import SamplingParams

from conftest import TINY_VOCAB, chi_square_pvalue, counts_after_first, exact_after_first, perturbed_copy, tiny_lm
from test_engine import PROMPTS

#: the vocabulary of the goodness-of-fit models (three tokens: 512 cells)
SMALL_V = 8


def constant_head(p: float, hidden: int = 32) -> AcceptanceHead:
    """A head that predicts acceptance probability ``p`` for every hidden state."""
    head = AcceptanceHead(hidden, num_layers=0)
    with torch.no_grad():
        head.out.weight.zero_()
        head.out.bias.fill_(math.log(p / (1 - p)))
    return head


def random_head(seed: int, hidden: int = 32) -> AcceptanceHead:
    torch.manual_seed(seed)
    return AcceptanceHead(hidden, num_layers=1).eval()


def confidence_head(weights: list[float], bias: float, hidden: int = 32, mean=None, std=None) -> AcceptanceHead:
    """A head that ignores the hidden state: logit = bias + weights . (s - mean) / std, ``s`` the
    draft's confidence inputs (top prob, entropy, log top prob, log prob of the drafted token)."""
    head = AcceptanceHead(hidden, num_layers=0, num_stats=4)
    with torch.no_grad():
        head.out.weight.zero_()
        head.out.bias.fill_(bias)
        head.stats_out.weight.copy_(torch.tensor([weights]))
        if mean is not None:
            head.stats_mean.copy_(torch.tensor(mean))
        if std is not None:
            head.stats_std.copy_(torch.tensor(std))
    return head.eval()


# -- the stopping rule's arithmetic ----------------------------------------------------------------


def test_rejection_risk_is_one_minus_the_product():
    probs = torch.tensor([[0.9, 0.5], [1.0, 1.0], [0.2, 1.0]])
    assert torch.allclose(rejection_risk(probs), torch.tensor([0.55, 0.0, 0.8]))
    assert rejection_risk(torch.zeros(3, 0)).tolist() == [0.0, 0.0, 0.0]  # nothing drafted, nothing at risk
    with pytest.raises(QuickdraftError, match=r"\[B, n\]"):
        rejection_risk(torch.tensor([0.5]))


def test_batch_stop_rules_and_strict_threshold():
    risk = torch.tensor([0.1, 0.2, 0.9])  # mean 0.4
    assert batch_stop(risk, 0.35, "mean") and not batch_stop(risk, 0.45, "mean")
    assert batch_stop(risk, 0.5, "any") and not batch_stop(risk, 0.95, "any")
    assert not batch_stop(risk, 0.15, "all") and batch_stop(risk, 0.05, "all")
    assert not batch_stop(torch.tensor([0.3]), 0.3)  # keep drafting while 1 - prod <= h
    with pytest.raises(QuickdraftError, match="batch rule"):
        batch_stop(risk, 0.5, "median")


def test_heuristic_schedule():
    assert heuristic_next_k(4, True, 1, 16) == 6
    assert heuristic_next_k(4, False, 1, 16) == 3
    assert heuristic_next_k(15, True, 1, 16) == 16
    assert heuristic_next_k(1, False, 1, 16) == 1


# -- state transitions -----------------------------------------------------------------------------


def test_heuristic_state_transitions():
    pol = Heuristic(initial_k=4, min_k=2, max_k=7)
    assert pol.begin_step() == 4 and pol.begin_step() == 4  # asking twice does not move the state
    pol.update(4, torch.tensor([4]))
    assert pol.begin_step() == 6
    pol.update(6, torch.tensor([6]))
    assert pol.begin_step() == 7  # clipped at max_k
    for _ in range(10):
        pol.update(pol.begin_step(), torch.tensor([0]))
    assert pol.begin_step() == 2  # clipped at min_k
    pol.update(2, torch.tensor([2, 2, 0]))  # 2 of 3 rows fully accepted -> counts as full
    assert pol.begin_step() == 4
    pol.update(4, torch.tensor([4, 1, 0]))  # 1 of 3 -> not full
    assert pol.begin_step() == 3
    pol.reset()
    assert pol.begin_step() == 4
    with pytest.raises(QuickdraftError, match="min_k <= initial_k"):
        Heuristic(initial_k=20, max_k=10)


def test_confidence_state_transitions():
    pol = Confidence(p_min=0.6, max_k=5)
    confident = torch.tensor([[0.9, 0.1]])
    unsure = torch.tensor([[0.5, 0.5]])
    assert pol.begin_step() == 5
    assert pol.keep_drafting(0, confident, None)
    assert not pol.keep_drafting(1, unsure, None)
    pol.begin_step()  # a new step forgets the low-confidence token
    assert pol.keep_drafting(0, confident, None)
    # batch: a row stays "at risk" for the rest of the step once it was unsure; mean rule, h = 1/2
    pol.begin_step()
    assert pol.keep_drafting(0, torch.tensor([[0.5, 0.5], [0.9, 0.1], [0.9, 0.1]]), None)  # 1/3 at risk
    assert not pol.keep_drafting(1, torch.tensor([[0.9, 0.1], [0.5, 0.5], [0.9, 0.1]]), None)  # 2/3
    anyrule = Confidence(p_min=0.6, max_k=5, batch_rule="any")
    anyrule.begin_step()
    assert not anyrule.keep_drafting(0, torch.tensor([[0.5, 0.5], [0.9, 0.1], [0.9, 0.1]]), None)
    with pytest.raises(QuickdraftError, match="p_min"):
        Confidence(p_min=1.5)


def test_specdecpp_stops_when_predicted_rejection_risk_passes_h():
    pol = SpecDecPP(constant_head(0.8), threshold=0.3, max_k=10)
    h = torch.zeros(1, 32)
    probs = torch.full((1, 4), 0.25)
    assert pol.begin_step() == 10
    assert pol.keep_drafting(0, probs, h)  # hidden of the accepted context: nothing scored yet
    assert pol.keep_drafting(1, probs, h)  # risk 1 - 0.8 = 0.2 <= 0.3
    assert torch.allclose(pol.risk(), torch.tensor([0.2]))
    assert not pol.keep_drafting(2, probs, h)  # risk 1 - 0.64 = 0.36 > 0.3: 3 tokens drafted
    pol.begin_step()
    assert pol.risk() is None  # per-step state is reset
    # min_k forces drafting on regardless of the risk
    strict = SpecDecPP(constant_head(0.1), threshold=0.0, min_k=3, max_k=10)
    strict.begin_step()
    assert [strict.keep_drafting(i, probs, h) for i in range(4)] == [True, True, False, False]
    # batch, mean rule: rows with P = 0.9 and 0.5 -> mean risk after one scored token is 0.3
    head = AcceptanceHead(2, num_layers=0)
    with torch.no_grad():
        head.out.weight.copy_(torch.tensor([[1.0, 0.0]]))
        head.out.bias.zero_()
    two = torch.tensor([[math.log(9.0), 0.0], [0.0, 0.0]])  # sigmoid -> 0.9, 0.5
    for rule, expected in (("mean", True), ("any", False), ("all", True)):
        pol = SpecDecPP(head, threshold=0.35, batch_rule=rule)
        pol.begin_step()
        pol.keep_drafting(0, probs[:1].expand(2, 4), two)
        assert pol.keep_drafting(1, probs[:1].expand(2, 4), two) is expected, rule


def test_specdecpp_with_confidence_inputs_stops_when_the_draft_is_unsure():
    """A head on the draft's top probability alone: P = sigmoid(20 (top - 0.6)). Token i's confidence
    is handed over at call i and scored at call i + 1, with the hidden state of token i."""
    head = confidence_head([20.0, 0.0, 0.0, 0.0], bias=-12.0)
    sure = torch.tensor([[0.95, 0.03, 0.01, 0.01]])  # P = sigmoid(7) ~ 0.999
    unsure = torch.tensor([[0.30, 0.25, 0.25, 0.20]])  # P = sigmoid(-6) ~ 0.0025
    h = torch.randn(1, 32, generator=torch.Generator().manual_seed(0))  # ignored by the head
    first = torch.tensor([0])
    pol = SpecDecPP(head, threshold=0.3, max_k=10)
    pol.begin_step()
    assert all(pol.keep_drafting(i, sure, h, token=first) for i in range(9))  # sure all the way: max_k
    assert pol.risk().item() == pytest.approx(1 - torch.sigmoid(torch.tensor(7.0)).item() ** 8, rel=1e-4)
    pol.begin_step()
    assert pol.keep_drafting(0, sure, h, token=first)  # nothing scored yet
    assert pol.keep_drafting(1, unsure, h, token=first)  # scores token 0 (sure)
    assert pol.risk().item() < 0.01
    assert not pol.keep_drafting(2, sure, h, token=first)  # scores token 1 (unsure): stop, 3 drafted
    assert pol.risk().item() > 0.99
    # the drafted token matters too: a head on log q(token), same distribution, different tokens
    by_token = confidence_head([0.0, 0.0, 0.0, 4.0], bias=4.0)  # log 0.95 -> P ~ 0.98; log 0.01 -> P ~ 0
    for token, expected in ((torch.tensor([0]), True), (torch.tensor([3]), False)):
        pol = SpecDecPP(by_token, threshold=0.3, max_k=10)
        pol.begin_step()
        pol.keep_drafting(0, sure, h, token=token)
        assert pol.keep_drafting(1, sure, h, token=first) is expected
    # a batch (mean rule): one sure row and one unsure row -> mean risk ~0.5
    both = torch.cat([sure, unsure])
    for threshold, expected in ((0.4, False), (0.6, True)):
        pol = SpecDecPP(head, threshold=threshold, max_k=10)
        pol.begin_step()
        pol.keep_drafting(0, both, h.expand(2, 32), token=torch.tensor([0, 0]))
        assert pol.keep_drafting(1, both, h.expand(2, 32), token=torch.tensor([0, 0])) is expected
    # such a head needs the drafted token
    pol = SpecDecPP(head, threshold=0.3)
    pol.begin_step()
    with pytest.raises(QuickdraftError, match="token="):
        pol.keep_drafting(0, sure, h)


def test_specdecpp_with_a_drawing_state_head_scores_each_token_at_once():
    """A head that reads the state that drew a token scores it at the call that hands it over, so the
    policy can stop after one token (a head reading the fed state cannot stop before two)."""
    sure = torch.tensor([[0.95, 0.03, 0.01, 0.01]])
    unsure = torch.tensor([[0.30, 0.25, 0.25, 0.20]])
    h = torch.zeros(1, 32)
    first = torch.tensor([0])
    drawing = confidence_head([20.0, 0.0, 0.0, 0.0], bias=-12.0)  # P = sigmoid(20 (top - 0.6))
    drawing.reads = "drawing"
    pol = SpecDecPP(drawing, threshold=0.3, max_k=10)
    pol.begin_step()
    assert not pol.keep_drafting(0, unsure, h, token=first)  # token 0 scored at once: one token drafted
    assert pol.risk().item() > 0.99
    pol.begin_step()
    assert pol.keep_drafting(0, sure, h, token=first) and pol.risk().item() < 0.01
    assert not pol.keep_drafting(1, unsure, h, token=first)  # token 1 scored at call 1: two drafted
    fed = confidence_head([20.0, 0.0, 0.0, 0.0], bias=-12.0)
    pol = SpecDecPP(fed, threshold=0.3, max_k=10)
    pol.begin_step()
    assert pol.keep_drafting(0, unsure, h, token=first)  # the fed state's head has scored nothing yet
    # a constant drawing-state head: risks 1 - 0.8^(i+1), one token earlier than the fed state's
    const = constant_head(0.8)
    const.reads = "drawing"
    pol = SpecDecPP(const, threshold=0.3, max_k=10)
    pol.begin_step()
    probs = torch.full((1, 4), 0.25)
    assert [pol.keep_drafting(i, probs, h) for i in range(2)] == [True, False]
    with pytest.raises(QuickdraftError, match="reads one of"):
        AcceptanceHead(8, reads="next")


def test_specdecpp_errors():
    pol = SpecDecPP(constant_head(0.8), threshold=0.5)
    pol.begin_step()
    with pytest.raises(QuickdraftError, match="hidden states"):
        pol.keep_drafting(1, torch.ones(1, 4) / 4, None)
    with pytest.raises(QuickdraftError, match="hidden size 32"):
        pol.keep_drafting(1, torch.ones(1, 4) / 4, torch.zeros(1, 16))
    with pytest.raises(QuickdraftError, match="threshold"):
        SpecDecPP(constant_head(0.8), threshold=1.5)
    with pytest.raises(QuickdraftError, match="min_k <= max_k"):
        SpecDecPP(constant_head(0.8), min_k=5, max_k=2)


def test_build_policy_names(tmp_path):
    from quickdraft.decoding.head import save_head

    assert isinstance(build_policy("heuristic", 4), Heuristic)
    conf = build_policy("confidence", 6, stop_threshold=0.4)
    assert isinstance(conf, Confidence) and conf.p_min == 0.4 and conf.max_k == 6
    path = save_head(constant_head(0.7), tmp_path / "h.pt")
    pol = build_policy("specdecpp", 8, head=str(path), stop_threshold=0.2)
    assert isinstance(pol, SpecDecPP) and pol.threshold == 0.2 and pol.max_k == 8
    with pytest.raises(QuickdraftError, match="needs --head"):
        build_policy("specdecpp", 8)
    with pytest.raises(QuickdraftError, match="unknown policy"):
        build_policy("oracle", 4)


# -- a policy never changes the output -------------------------------------------------------------


class Recording(Policy):
    """Wraps a policy and records the draft length of every step."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.needs_hidden = inner.needs_hidden
        self.may_skip = getattr(inner, "may_skip", False)
        self.never_drafts = getattr(inner, "never_drafts", False)
        self.lengths: list[int] = []
        self.stops = 0  # steps the wrapped policy ended by answering keep_drafting with False
        self._n = 0

    def begin_step(self) -> int:
        self._n = 1
        return self.inner.begin_step()

    def keep_drafting(self, i, draft_probs, hidden, token=None):
        keep = self.inner.keep_drafting(i, draft_probs, hidden, token=token)
        self._n = i + 2 if keep else i + 1
        self.stops += not keep
        return keep

    def update(self, num_drafted, num_accepted):
        self.lengths.append(num_drafted)
        self.inner.update(num_drafted, num_accepted)


def _policies(draft_model=None):
    return [
        Constant(3),
        Heuristic(initial_k=2, max_k=8),
        Confidence(p_min=0.1, max_k=8, output_head=draft_model.lm_head),  # tiny draft: top probs ~0.06-0.13
        SpecDecPP(random_head(0), threshold=0.5, max_k=8),
        SpecDecPP(random_head(1), threshold=0.9, max_k=8, batch_rule="any"),
        # confidence inputs: the drafter must hand over the drafted tokens (tiny draft: top probs ~0.06-0.13)
        SpecDecPP(confidence_head([1.0, 0.0, 0.0, 1.0], bias=1.0, mean=[0.09, 0, 0, -3.0], std=[0.02, 1, 1, 0.5]),
                  threshold=0.5, max_k=8),
        # a head on the drawing state, which may stop after one token
        SpecDecPP(drawing(confidence_head([1.0, 0.0, 0.0, 1.0], bias=1.0, mean=[0.09, 0, 0, -3.0],
                                          std=[0.02, 1, 1, 0.5])), threshold=0.5, max_k=8),
    ]


def drawing(head: AcceptanceHead) -> AcceptanceHead:
    """``head`` reading the state that drew each token instead of the state at it."""
    head.reads = "drawing"
    return head


@pytest.mark.parametrize("index", range(7))
def test_greedy_output_equals_plain_decoding_with_every_policy(tiny_target, tiny_draft, index):
    target = ModelRunner(tiny_target, "target")
    plain = generate(target, PROMPTS, method="ar", max_new_tokens=24)
    for prompts in (PROMPTS[:1], PROMPTS):  # B = 1 and B = 3
        policy = Recording(_policies(tiny_draft)[index])
        drafter = ModelDrafter(ModelRunner(tiny_draft, "draft"), TINY_VOCAB)
        out = generate(target, prompts, method="sd", drafter=drafter, policy=policy, max_new_tokens=24)
        assert out.sequences == plain.sequences[: len(prompts)]
        assert out.batch_metrics.accepted_tokens > 0
        if index > 0:  # the adaptive policies really varied the draft length
            assert len(set(policy.lengths)) > 1, policy.lengths


class MisreportingDrafter(ModelDrafter):
    """A broken drafter: it hands the verifier a sharpened version of the distribution its tokens
    were drawn from (the classic drafted-one-way, verified-another-way bug). A policy cannot do
    this any more -- it only sees a copy of the draft's unwarped distribution -- so the negative
    control breaks the drafter instead, under the same adaptive policy."""

    def propose(self, *args, **kwargs):
        draft = super().propose(*args, **kwargs)
        sharp = draft.probs.pow(10)
        draft.probs = sharp / sharp.sum(dim=-1, keepdim=True)
        return draft


#: (name, factory) of the adaptive policies whose sampled output is tested against the target's law
ADAPTIVE = [
    ("heuristic", lambda: Heuristic(initial_k=1, max_k=3)),
    # the draft's top probabilities are ~0.2-0.6: at 0.42 the batch stops where most rows are unsure,
    # at some positions and not at others (0.38 never stops, 0.45 always after one token)
    ("confidence", lambda: Confidence(p_min=0.42, max_k=3, batch_rule="mean")),
    ("specdecpp", lambda: SpecDecPP(random_head(3), threshold=0.5, min_k=1, max_k=3)),
    ("specdecpp-drawing", lambda: SpecDecPP(drawing(random_head(3)), threshold=0.5, min_k=1, max_k=3)),
    # verification a token dearer per drafted token: 3 tokens at a confident start, fewer (or a plain
    # step) once the measured acceptance says so
    ("cost", lambda: CostAware(max_k=3, costs=StepCost((1.0, 1.5, 2.0, 2.5), draft=0.0), prior=0.9)),
]


@pytest.fixture(scope="module")
def small_pair():
    """A vocabulary-8 target and a draft that agrees with it often (so drafts of several tokens
    get accepted and the policies' decisions matter)."""
    target = tiny_lm(seed=21, vocab=SMALL_V, max_positions=64)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    return target, perturbed_copy(target, scale=0.5, seed=22)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", [name for name, _ in ADAPTIVE])
def test_sampling_with_an_adaptive_policy_matches_the_target(small_pair, name):
    """The lossless rule at T = 0.8 with an adaptive policy choosing every step's draft length:
    6,000 rows (6 batches of 1,000) generate five tokens; the three after the prefill's follow the
    target's exact law (512 cells, mean expected count ~12, cells below 5 pooled; chi-square p > 1e-4).
    Five tokens leave the first step a cap of three drafts, so the policy, not the cap, ends the
    first step's draft (lengths 1 and 2 here), and rows finish at different steps (two for some,
    up to four for others). With SpecDec++, a drafter that misreports its distributions fails the same
    test (p < 1e-6)."""
    factory = dict(ADAPTIVE)[name]
    target_model, draft_model = small_pair
    params = SamplingParams(temperature=0.8)
    prompt, batches, rows = [1, 2, 3], 6, 1_000
    exact = exact_after_first(target_model, prompt, params, 3)
    target = ModelRunner(target_model)

    def run(drafter_cls):
        drafter = drafter_cls(ModelRunner(draft_model), SMALL_V)
        counts = np.zeros((SMALL_V,) * 3)
        lengths, stops, steps = [], 0, set()
        for c in range(batches):
            policy = Recording(factory())
            out = generate(target, [prompt] * rows, method="sd", drafter=drafter, rule=Lossless(), policy=policy,
                           sampling=params, max_new_tokens=5, seed=100 + c)
            counts += counts_after_first(out.sequences, SMALL_V, 3)
            lengths += policy.lengths
            stops += policy.stops
            steps |= {m.steps for m in out.metrics}
        return counts, lengths, stops, steps

    counts, lengths, stops, steps = run(ModelDrafter)
    assert len(set(lengths)) > 1, lengths  # the policy varied the draft length
    if name not in ("heuristic", "cost"):  # (those two vary it between steps, the others within a step)
        assert stops > 0, lengths
    assert len(steps) > 1, steps  # rows finished at different steps
    assert chi_square_pvalue(counts, exact) > 1e-4
    if name == "specdecpp":
        bad, *_ = run(MisreportingDrafter)
        assert chi_square_pvalue(bad, exact) < 1e-6


# ---------------------------------------------------------------------------------------------
# the cost-aware policy
# ---------------------------------------------------------------------------------------------

#: a memory-bound target (verifying 9 tokens costs 1.1 of one) and a compute-bound one (llama.cpp
#: on two AVX2 cores: 5 tokens cost 3.7, a draft token 0.3 of a target token)
FLAT = StepCost(tuple(1.0 + 0.0125 * m for m in range(9)), draft=0.1)
STEEP = StepCost((1.0, 1.7, 2.4, 3.0, 3.7, 4.4, 5.1, 5.9, 6.6), draft=0.3)


def test_expected_tokens_is_the_mean_of_a_simulated_step():
    """``expected_tokens(α, k)`` against 200,000 simulated steps: accept each of ``k`` tokens with
    probability ``α`` until the first rejection, then one recovered or bonus token."""
    rng = np.random.default_rng(0)
    for alpha, k in ((0.3, 1), (0.7, 4), (0.9, 8), (1.0, 3)):
        accepted = (rng.random((200_000, k)) < alpha).cumprod(axis=1).sum(axis=1)
        assert expected_tokens(alpha, k) == pytest.approx(accepted.mean() + 1, abs=0.02)
        assert expected_tokens(alpha, k) == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1)


def test_best_draft_length_maximises_tokens_per_second():
    """Against a brute force over every length, for random non-decreasing cost curves; on a flat
    curve the length grows with the acceptance rate, on the steep one no draft ever pays."""
    rng = np.random.default_rng(1)
    for _ in range(200):
        costs = StepCost(tuple(np.cumsum(rng.uniform(0.05, 1.0, size=9))), draft=float(rng.uniform(0, 0.5)),
                         overhead=float(rng.uniform(0, 0.1)))
        alpha, max_k = float(rng.uniform(0.01, 0.99)), int(rng.integers(1, 9))
        rates = [expected_tokens(alpha, k) / costs.step(k) for k in range(max_k + 1)]
        k = best_draft_length(alpha, costs, max_k)
        assert rates[k] == pytest.approx(max(rates))
    lengths = [best_draft_length(a, FLAT, 8) for a in (0.1, 0.3, 0.5, 0.7, 0.9, 0.97)]
    assert lengths == sorted(lengths) and lengths[0] <= 1 and lengths[-1] == 8
    assert all(best_draft_length(a, STEEP, 8) == 0 for a in (0.5, 0.9, 0.95))
    assert best_draft_length(0.9, STEEP.without_draft(), 8) > 0  # free drafts (prompt lookup) can pay


def test_the_cost_policy_needs_costs_for_its_longest_draft():
    assert STEEP.without_draft().draft == 0.0 and STEEP.without_draft().target == STEEP.target
    with pytest.raises(QuickdraftError, match="up to 4 tokens, not 9"):
        CostAware(max_k=8, costs=StepCost((1.0, 1.5, 2.0, 2.5), draft=0.1)).begin_step()


def test_cost_aware_estimates_the_acceptance_rate_and_probes():
    """Fed steps of 64 rows with geometric acceptance at rate 0.7, the estimate settles near 0.7;
    on a target where drafts pay only above 0.72 it then makes plain steps, with a one-token probe
    after every ``probe_every`` of them; where no draft could pay, it never drafts."""
    rng = np.random.default_rng(2)
    policy = CostAware(max_k=4, costs=STEEP.without_draft(), prior=0.5, probe_every=5)
    for _ in range(60):
        k = 4
        accepted = (rng.random((64, k)) < 0.7).cumprod(axis=1).sum(axis=1)
        policy.update(k, torch.from_numpy(accepted))
    assert policy.alpha == pytest.approx(0.7, abs=0.04)
    ks = []
    for _ in range(12):
        k = policy.begin_step()
        ks.append(k)
        policy.update(k, torch.zeros(1, dtype=torch.long) if k == 0 else torch.tensor([0]))
    assert ks[:5] == [0] * 5 and ks[5] == 1 and ks[6:11] == [0] * 5 and ks[11] == 1
    never = CostAware(max_k=8, costs=STEEP, probe_every=1)
    for _ in range(5):
        assert never.begin_step() == 0
        never.update(0, torch.zeros(1, dtype=torch.long))
    with pytest.raises(QuickdraftError, match="forward costs"):
        CostAware().begin_step()
    for bad in (dict(max_k=0), dict(prior=1.0), dict(memory=1.0), dict(probe_every=0), dict(probe_alpha=0.0)):
        with pytest.raises(QuickdraftError):
            CostAware(**bad)


@pytest.mark.parametrize("method", ["sd", "ngram"])
def test_cost_aware_greedy_equals_plain_greedy(tiny_target, tiny_draft, method):
    """Whatever lengths the policy picks (drafts of several tokens on a flat curve; on the steep one
    plain steps, and for free lookup drafts probes that turn into drafts where the copies are
    accepted), the greedy text is plain decoding's; on the steep curve ``sd`` makes no draft
    forward at all, nor a prefill."""
    from quickdraft.decoding.drafters import NGramDrafter

    target = ModelRunner(tiny_target)
    prompts = [p * 3 for p in PROMPTS]  # repeats for prompt lookup to find
    plain = generate(target, prompts, method="ar", max_new_tokens=30).sequences
    for costs, drafts in ((FLAT, True), (STEEP, False)):
        drafter = (ModelDrafter(ModelRunner(tiny_draft), TINY_VOCAB) if method == "sd"
                   else NGramDrafter(TINY_VOCAB, 3, 1))
        policy = Recording(CostAware(max_k=6, costs=costs if method == "sd" else costs.without_draft()))
        out = generate(target, prompts, method=method, drafter=drafter, policy=policy, max_new_tokens=30)
        assert out.sequences == plain
        if method == "sd":
            assert (out.batch_metrics.drafted_tokens > 0) == drafts, policy.lengths
            if not drafts:  # no draft forward at all, not even a prefill
                assert out.batch_metrics.draft_forwards == 0 and set(policy.lengths) == {0}
                assert drafter.runner.num_forwards == 0
        else:  # plain steps and drafts
            assert 0 in policy.lengths and max(policy.lengths) > 0, policy.lengths


def test_the_cost_policy_is_for_chains():
    from quickdraft.decoding.amusd import AsyncDrafter

    target = ModelRunner(tiny_lm(seed=0))
    for method, drafter in (("ar", None), ("amusd", AsyncDrafter(ModelRunner(tiny_lm(seed=1)), TINY_VOCAB))):
        with pytest.raises(QuickdraftError, match="chooses between drafting a chain and a plain step"):
            generate(target, PROMPTS, method=method, drafter=drafter, policy=CostAware(costs=FLAT), max_new_tokens=4)
    assert isinstance(build_policy("cost", 6), CostAware) and build_policy("cost", 6).max_k == 6
    from quickdraft.methods import build_method

    assert isinstance(build_method("fsd", policy="cost", k=6).policy, CostAware)
    for name in ("ar", "amusd", "cd"):
        with pytest.raises(QuickdraftError, match="policy cost chooses"):
            build_method(name, policy="cost")
