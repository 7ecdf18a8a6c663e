"""Token-tree speculative decoding with a draft model: one target forward verifies a whole tree.

:class:`TreeDrafter` is the drafter of method ``"tree"`` of :func:`quickdraft.decoding.engine.generate`;
its proposal (:class:`TreeProposal`) fills the four verbs of the engine's step
(:mod:`quickdraft.decoding.proposals`), for every row of the batch at once::

    1. propose  the draft model reads its pending tokens (root = last emitted token) and grows a
                token tree layer by layer (:func:`quickdraft.decoding.tree.build_tree`: d draft forwards;
                d at most the tokens left to generate minus one, and at least 1:
                :meth:`TreeConfig.capped <quickdraft.decoding.tree.TreeConfig.capped>`)
    2. score    one target forward over the M = N + 1 tree nodes with the tree attention mask
                (:meth:`ModelRunner.forward_tree`)                              -> [B, M, V]
    3. verify   walk down from the root (:func:`verify_tree`): at each node a step-level verifier
                emits one token distributed as the target; continue while it is a child
    4. commit   both runners keep only the accepted path's KV slots (:meth:`ModelRunner.commit_tree`)

Terms follow :mod:`quickdraft.verification.verify`: the accepted tokens are the tree nodes on the walked path,
then one recovered token (the walk left the tree) or bonus token (it reached a leaf); the
acceptance length is ``accepted + 1`` tokens per target forward. Metrics count the drafted tokens
as the tree's valid nodes and the per-position acceptance rates by depth.

Why the output is exactly target-distributed: see :mod:`quickdraft.decoding.tree`. At temperature 0 the walk
follows the child equal to the target's argmax, which reproduces plain greedy decoding.

FSD on trees (Holsman et al. 2025, arXiv:2502.20704, who apply FSD to EAGLE-2 trees): at node ``v``
with ``D(p_v, q_v) ≤ T`` (``p_v``, ``q_v`` the target's and the draft's distributions after ``v``'s
path, raw temperature-1 ones when the rule says so) the walk accepts ``v``'s *first* draft (the
draft's best child for ``topk`` trees) without a test, counted as a lossy acceptance; above the
threshold the node is verified losslessly by the chosen verifier. This is chain FSD's rule applied
at every node: the divergence is a property of the parent's two distributions, and the draft's
own ranking picks which branch to trust. Verifying above ``T`` losslessly (rather than sampling
``p_v`` and stopping) keeps the walk going down when the sample is a child and makes ``T = 0`` the
lossless tree decoder.

ERSD on trees (Kobus & Gündüz 2025, arXiv:2504.15475; :class:`quickdraft.verification.rules.ExponentialRace`):
the children of every node are the draft's earliest arrivals in the exponential race with the
arrival times of the child's absolute position (the ``race`` scheme of :mod:`quickdraft.decoding.tree`),
and the walk emits at each node the *target's* race winner ``argmin_v E_v / p_v(v)`` with the same
arrival times; it continues while that winner is one of the node's children and stops with it
otherwise (the recovered token) or at a leaf (the bonus token). Arrival times are keyed by
(seed, row, absolute position), so all nodes at one depth share them, and every emitted token is
the target's race winner given the emitted prefix: the output is token for token the output of
race-sampling the target alone with the same seed, whatever the draft, the depth and the number
of candidates. With one candidate per node and depth ``K`` it is chain ERSD.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from quickdraft.verification.divergences import get_divergence
from quickdraft.decoding.drafters import ModelDrafter, pending_block
from quickdraft.decoding.engine import GenerationOutput, TokenCallback, generate
from quickdraft.errors import QuickdraftError
from quickdraft.verification.sampling import sample_rows
from quickdraft.verification.multidraft_verifiers import kseq_verify, optimal_greedy_verify, rrs_verify
from quickdraft.verification.race import race_sample
from quickdraft.decoding.proposals import Walk
from quickdraft.verification.rules import ExponentialRace, Fuzzy, Greedy, Lossless, Rule, VerifyContext
from quickdraft.backends.runner import ModelRunner
from quickdraft.verification.sampling import SamplingParams, argmax, logits_to_probs, raw_probs
from quickdraft.decoding.tree import (
    RACE_SCHEME, SCHEMES, TokenTree, TreeConfig, build_tree, check_combination, proposals_for,
)


@dataclass
class TreeVerification:
    """Result of verifying one tree per row.

    Attributes
    ----------
    output_ids: ``[B, D + 1]`` int64 accepted tokens, then the recovered-or-bonus token, then ``-1``.
    path: ``[B, D + 1]`` int64 tree nodes of the kept path, root first (``-1`` padded).
    num_accepted: ``[B]`` int64 accepted draft tokens (the row emits ``num_accepted + 1``).
    num_lossy: ``[B]`` int64 accepted by FSD's divergence test.
    """

    output_ids: torch.Tensor
    path: torch.Tensor
    num_accepted: torch.Tensor
    num_lossy: torch.Tensor


def _node_token(
    verifier: str, scheme: str, target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_ids: torch.Tensor,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """One emitted token per row from ``target_probs [g, V]`` and the drafts ``[g, n]`` (n ≥ 1)."""
    drafts = proposals_for(scheme, draft_probs, draft_ids)
    if verifier == "rrs":
        return rrs_verify(target_probs, drafts, generator)
    if verifier == "kseq":
        return kseq_verify(target_probs, draft_probs, drafts, generator)
    return optimal_greedy_verify(target_probs, drafts, generator)


def verify_tree(
    tree: TokenTree,
    target_probs: torch.Tensor,
    *,
    verifier: str = "rrs",
    greedy: bool = False,
    fuzzy: Fuzzy | None = None,
    raw_target_probs: torch.Tensor | None = None,
    active: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    race_keys: torch.Tensor | None = None,
) -> TreeVerification:
    """Walk every row's tree from the root, emitting target-distributed tokens (batched).

    Parameters
    ----------
    tree:
        The trees (``M`` nodes per row).
    target_probs:
        ``[B, M, V]`` the target's processed distribution after every node's path.
    verifier:
        ``"rrs"``, ``"kseq"`` or ``"optimal_greedy"`` (must suit ``tree.scheme``).
    greedy:
        Temperature 0: emit the target's argmax at every node (follow the matching child).
    fuzzy:
        FSD rule (see the module docstring); ``None`` for lossless verification.
    raw_target_probs:
        ``[B, M, V]`` temperature-1 target distributions for FSD's divergence.
    active:
        ``[B]`` bool rows to verify (others emit nothing and keep only the root).
    generator:
        Random source.
    race_keys:
        ``[B, D + 1]`` int64 keys of the shared arrival times at the positions after depth-0 … D
        nodes (:func:`quickdraft.verification.race.race_keys`). Given: ERSD walk (emit the target's race
        winner at every node; ``verifier``, ``greedy`` and ``fuzzy`` are not used).
    """
    b, m, v = target_probs.shape
    if tree.tokens.shape != (b, m):
        raise QuickdraftError(f"target_probs must be [B={tree.tokens.shape[0]}, M={tree.num_nodes}, V], got {tuple(target_probs.shape)}")
    depth = int(tree.depths.max())
    if race_keys is not None:
        if race_keys.shape[0] != b or race_keys.dim() != 2 or race_keys.shape[1] < depth + 1:
            raise QuickdraftError(f"race_keys must be [B={b}, D+1>={depth + 1}], got {tuple(race_keys.shape)}")
        fuzzy = None
    elif not greedy:
        check_combination(tree.scheme, verifier)
    out = torch.full((b, depth + 1), -1, dtype=torch.long)
    path = torch.full((b, depth + 1), -1, dtype=torch.long)
    path[:, 0] = 0
    cur = torch.zeros(b, dtype=torch.long)
    num_accepted = torch.zeros(b, dtype=torch.long)
    num_lossy = torch.zeros(b, dtype=torch.long)
    done = torch.zeros(b, dtype=torch.bool) if active is None else ~active.cpu()
    divergence = get_divergence(fuzzy.divergence, fuzzy.top_k, fuzzy.top_p) if fuzzy is not None else None
    for step in range(depth + 1):
        rows = (~done).nonzero().squeeze(-1)
        if rows.numel() == 0:
            break
        node = cur[rows]
        p = target_probs[rows, node].double()  # [g, V]
        n_drafts = tree.num_drafts[rows, node]  # [g]
        ids = tree.draft_ids[rows, node]  # [g, c]
        token = torch.empty(rows.numel(), dtype=torch.long)
        lossy = torch.zeros(rows.numel(), dtype=torch.bool)
        if fuzzy is not None and fuzzy.threshold > 0:
            e = tree.expanded[rows, node].clamp_min(0)
            use_raw = fuzzy.use_raw and raw_target_probs is not None and tree.expanded_raw is not None
            q_d = (tree.expanded_raw if use_raw else tree.expanded_probs)[rows, e]
            p_d = raw_target_probs[rows, node] if use_raw else target_probs[rows, node]
            lossy = (n_drafts > 0) & (divergence(p_d.float(), q_d.float()) <= fuzzy.threshold)
            token[lossy] = ids[lossy, 0]
        if race_keys is not None:
            # the target's race winner after this node (processed probs as given, like chain ERSD)
            token = race_sample(target_probs[rows, node], race_keys[rows, step])
        elif greedy:
            token[~lossy] = argmax(p[~lossy])
        else:
            for n in sorted(set(n_drafts[~lossy].tolist())):
                g = ((n_drafts == n) & ~lossy).nonzero().squeeze(-1)
                if n == 0:  # a leaf: the bonus token
                    token[g] = sample_rows(p[g], generator)
                    continue
                q = tree.expanded_probs[rows[g], tree.expanded[rows[g], node[g]]].double()
                token[g] = _node_token(verifier, tree.scheme, p[g], q, ids[g, :n], generator)
        out[rows, step] = token
        # follow the node holding the emitted token, if it is one of the drafts
        match = (ids == token.unsqueeze(1)) & (torch.arange(ids.shape[1]).unsqueeze(0) < n_drafts.unsqueeze(1))
        found = match.any(dim=1)
        col = match.long().argmax(dim=1)
        child = tree.child_of[rows, node].gather(1, col.unsqueeze(1)).squeeze(1)
        go = found & (child >= 0)
        done[rows[~go]] = True
        if not bool(go.any()):
            break
        num_accepted[rows[go]] += 1
        num_lossy[rows[go & lossy]] += 1
        cur[rows[go]] = child[go]
        path[rows[go], step + 1] = child[go]
    return TreeVerification(output_ids=out, path=path, num_accepted=num_accepted, num_lossy=num_lossy)


class TreeDrafter:
    """Draft a token tree per row with a draft model (method ``"tree"`` of
    :func:`quickdraft.decoding.engine.generate`).

    Parameters
    ----------
    runner:
        The draft model's runner (same vocabulary as the target).
    vocab_size:
        The target's vocabulary size (logits are cut to it).
    config:
        Tree shape and how children are drawn (:class:`quickdraft.decoding.tree.TreeConfig`). At
        temperature 0 the ``topk`` scheme is used whatever ``config.scheme`` says.
    verifier:
        Step-level verifier at every node: ``"rrs"``, ``"kseq"``, ``"optimal_greedy"``
        (ignored at temperature 0, where the walk follows the target's argmax).
    """

    name = "tree"

    def __init__(self, runner: ModelRunner, vocab_size: int, config: TreeConfig = TreeConfig(),
                 verifier: str = "rrs") -> None:
        self.runner = runner
        self.vocab_size = int(vocab_size)
        self.config = config
        self.verifier = verifier

    def proposer(self, policy, rule: Rule, sampling: SamplingParams) -> "TreeProposer":
        """The proposer of one batch with ``rule`` and ``sampling`` (trees take no length policy:
        their depth is ``config``'s)."""
        return TreeProposer(self, rule, sampling)


class TreeProposer:
    """The drafting side of tree decoding for one batch: checks the rule, picks the scheme the
    rule and the temperature need, and grows one tree per row each step.

    ``rule``: a lossless rule for exact verification, :class:`quickdraft.verification.rules.Fuzzy` for FSD on
    trees, or :class:`quickdraft.verification.rules.ExponentialRace` for ERSD on trees (see the module
    docstring). ERSD verifies any tree losslessly; with ``config.scheme`` ``"topk"`` or ``"race"``
    the children are the race candidates (the ``race`` scheme), with a sampled scheme they are
    drawn by that scheme.
    """

    def __init__(self, drafter: TreeDrafter, rule: Rule, sampling: SamplingParams) -> None:
        if rule is not None and not isinstance(rule, (Fuzzy, Greedy, Lossless, ExponentialRace)):
            raise QuickdraftError(
                f"rule {rule.name!r} is not supported on trees; use fsd or ersd, or none for the lossless tree walk"
            )
        config, verifier = drafter.config, drafter.verifier
        self.fuzzy = rule if isinstance(rule, Fuzzy) else None
        self.race = rule if isinstance(rule, ExponentialRace) else None
        greedy = sampling.greedy
        if self.race is not None and (config.scheme == "topk" or (greedy and config.scheme in SCHEMES)):
            config = dataclasses.replace(config, scheme=RACE_SCHEME)
        elif greedy and config.scheme != "topk":
            config = dataclasses.replace(config, scheme="topk")
        if not greedy and self.race is None:
            check_combination(config.scheme, verifier)
        self.drafter = drafter
        self.config = config
        self.verifier = verifier
        self.sampling = sampling
        self.runner = drafter.runner
        self.model = ModelDrafter(drafter.runner, drafter.vocab_size)  # the draft model's batch and prefill
        self.room = config.tree_depth + 1
        self.max_positions = drafter.runner.max_positions

    def start(self, sequences: list[list[int]]) -> None:
        self.model.start(sequences)
        self.runner.num_forwards = 0

    def prefill(self, sequences: list[list[int]]) -> None:
        self.model.prefill(sequences)

    def begin(self, sequences: list[list[int]]):
        """Feed the draft its pending tokens and open its tree session; returns the draft's logits
        after each row's root ``[B, V]`` (on the host, where the tree is built) and the
        :data:`quickdraft.decoding.tree.ExpandFn` that feeds it a frontier."""
        draft = self.runner
        pend_ids, pend_valid = pending_block(sequences, draft.lengths)
        root_logits = draft.forward(pend_ids, pend_valid, logits_to_keep=1).logits[:, -1, : self.drafter.vocab_size].cpu()
        draft.begin_tree()

        def expand(tokens, depths, mask, valid):
            return draft.forward_tree(tokens, depths, mask, valid).logits.cpu()

        return root_logits, expand

    def propose(self, sequences, active, cap, ctx) -> "TreeProposal":
        """The draft reads its pending tokens (:meth:`begin`), then grows a tree no deeper than
        ``cap`` (at least one layer)."""
        config = self.config.capped(cap)
        forwards_before = self.runner.num_forwards
        root_logits, expand = self.begin(sequences)
        roots = torch.tensor([s[-1] for s in sequences], dtype=torch.long)
        keys = None
        if self.race is not None:  # [B, D + 1] noise of the positions after depth-0 … D nodes, by row
            b = len(sequences)
            keys = self.race.keys(ctx, b, torch.arange(config.tree_depth + 1).expand(b, -1), torch.device("cpu"))
        tree = build_tree(
            roots, root_logits, expand, config, self.sampling, ctx.generator, keep_raw=self.fuzzy is not None,
            race_keys=None if keys is None or config.scheme != RACE_SCHEME else keys[:, :-1],
        )
        return self.proposal_type(tree, keys, config.tree_depth, self.runner.num_forwards - forwards_before, self)


class TreeProposal:
    """One token tree per row (:class:`quickdraft.decoding.tree.TokenTree`, ``M`` nodes, root first).

    Scored by one tree-masked target forward (:meth:`ModelRunner.forward_tree`; the root is the
    target's only pending token), walked by :func:`verify_tree`, committed by keeping the walked
    path in both runners (:meth:`ModelRunner.commit_tree`).
    """

    def __init__(self, tree: TokenTree, race_keys: torch.Tensor | None, depth: int, forwards: int,
                 proposer: TreeProposer) -> None:
        self.tree = tree
        self.race_keys = race_keys  # [B, D + 1] ERSD's arrival-time keys, or None
        self.depth = depth
        self.forwards = forwards
        self.proposer = proposer

    def score(self, target: ModelRunner, sequences: list[list[int]]) -> torch.Tensor:
        tree = self.tree
        target.begin_tree()
        return target.forward_tree(tree.tokens, tree.depths, tree.mask(), tree.valid).logits  # [B, M, V']

    def verify(self, target_logits: torch.Tensor, ctx: VerifyContext, active: torch.Tensor) -> Walk:
        proposer, tree = self.proposer, self.tree
        target_logits = target_logits[:, :, : proposer.drafter.vocab_size].cpu()  # [B, M, V], walked on the host
        target_probs = logits_to_probs(target_logits, proposer.sampling)
        raw_target = raw_probs(target_logits) if proposer.fuzzy is not None else None
        result = verify_tree(
            tree, target_probs, verifier=proposer.verifier, greedy=proposer.sampling.greedy, fuzzy=proposer.fuzzy,
            raw_target_probs=raw_target, active=active, generator=ctx.generator, race_keys=self.race_keys,
        )
        b = tree.tokens.shape[0]
        return Walk(
            output_ids=result.output_ids, num_accepted=result.num_accepted, num_lossy=result.num_lossy,
            drafted_depth=torch.full((b,), self.depth, dtype=torch.long), drafted_nodes=tree.valid[:, 1:].sum(dim=1),
            path=result.path,
        )

    def commit(self, target, sequences, walk, seq_lens, active) -> None:
        """The target keeps root + accepted nodes; the draft the accepted nodes it was fed."""
        active = active.cpu()
        kept = walk.num_accepted + 1
        target.commit_tree(walk.path.clamp_min(0), torch.where(active, kept, 0))
        node_slots = self.tree.draft_slot.gather(1, walk.path[:, 1:].clamp_min(0))  # [B, D]
        on_path = torch.arange(node_slots.shape[1]).unsqueeze(0) < walk.num_accepted.unsqueeze(1)
        fed_prefix = ((node_slots >= 0) & on_path).long().cumprod(dim=1).sum(dim=1)
        self.proposer.runner.commit_tree(node_slots.clamp_min(0), torch.where(active, fed_prefix, 0))


TreeProposer.proposal_type = TreeProposal  # what propose() returns; a subclass may return its own


def generate_tree(
    target: ModelRunner,
    draft: ModelRunner,
    prompts: list[list[int]],
    *,
    config: TreeConfig = TreeConfig(),
    verifier: str = "rrs",
    rule: Rule | None = None,
    sampling: SamplingParams = SamplingParams(),
    max_new_tokens: int = 128,
    seed: int | None = 0,
    eos_token_ids: set[int] | None = None,
    stop: Callable[[int, list[int]], int | None] | None = None,
    on_tokens: TokenCallback | None = None,
) -> GenerationOutput:
    """Generate continuations of a batch of prompts with token-tree speculative decoding:
    :func:`quickdraft.decoding.engine.generate` with method ``"tree"`` and a :class:`TreeDrafter` over
    ``draft`` (``config``, ``verifier``); the other parameters are :func:`generate`'s."""
    return generate(
        target, prompts, method="tree",
        drafter=TreeDrafter(draft, int(target.model.config.vocab_size), config, verifier),
        rule=rule, sampling=sampling, max_new_tokens=max_new_tokens, seed=seed, eos_token_ids=eos_token_ids,
        stop=stop, on_tokens=on_tokens,
    )
