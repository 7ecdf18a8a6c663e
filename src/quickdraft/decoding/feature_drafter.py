"""Drafting with an EAGLE-style feature drafter: chains (method ``"feature"``) and dynamic trees
(method ``"tree"`` with a :class:`FeatureTreeDrafter`: EAGLE-2's configuration).

The drafter (:class:`quickdraft.decoding.feature_model.FeatureDraftModel`) reads pairs ``(f_i,
x_{i+1})`` of the target's hidden state at position ``i`` and the next token; its runner's KV cache
holds one slot per pair, at position ``i``. The state kept per row between steps:

``runner.lengths[r]``
    pairs fed with the target's *true* features (``0 .. lengths - 1``);
``known[r]``
    true features of the next positions, not fed yet.

A step (sequence of ``L`` tokens; the target holds ``x_0 .. x_{L-2}``, so ``f_0 .. f_{L-2}`` are
known):

1. propose: feed the pending true pairs ``(known, x_{lengths+1} ..)`` in one forward; its last
   output ``g_{L-1}`` gives the first draft token ``d_1`` (for ``x_L``); each further token feeds
   ``(g, d)`` (a chain) or a layer of ``(g_parent, child)`` nodes (a tree);
2. the target scores the draft and records its hidden states
   (:attr:`quickdraft.backends.runner.ModelRunner.recent_hidden`);
3. commit: the drafter drops every pair it fed with an estimate ``g`` and takes the target's
   true features of the tokens now in the target's cache as ``known``.

The target must be a torch :class:`~quickdraft.backends.runner.ModelRunner` (it records its hidden
states); the OpenVINO and llama.cpp runners do not return them.
"""

from __future__ import annotations

import torch

from quickdraft.backends.runner import ModelRunner
from quickdraft.decoding.drafters import ModelDrafter
from quickdraft.decoding.policies import Policy
from quickdraft.decoding.tree import TreeConfig
from quickdraft.decoding.tree_decoding import TreeDrafter, TreeProposal, TreeProposer
from quickdraft.errors import QuickdraftError
from quickdraft.verification.rules import Rule
from quickdraft.verification.sampling import SamplingParams


def require_torch_target(target) -> None:
    """Raise unless ``target`` is a torch runner, the only kind that returns its hidden states."""
    if not isinstance(target, ModelRunner):
        raise QuickdraftError(
            f"the feature drafter reads the target's hidden states, which a {type(target).__name__} does not "
            "return; run it on the torch backend")


class FeatureState:
    """The per-row bookkeeping of a feature drafter (see the module docstring): which pairs its
    cache holds with true features, and the true features not fed yet."""

    def __init__(self, runner: ModelRunner, target: ModelRunner) -> None:
        require_torch_target(target)
        self.runner = runner
        self.target = target
        self.known: list[torch.Tensor] = []
        self.true_lengths: torch.Tensor | None = None  # [B] pairs fed with true features, during a step
        target.record_hidden = True

    def start(self, sequences: list[list[int]]) -> None:
        self.runner.reset(len(sequences))
        hidden = int(self.runner.model.config.hidden_size)
        self.known = [torch.empty(0, hidden) for _ in sequences]
        self.true_lengths = None

    def take_target_features(self) -> None:
        """Append to ``known`` the target's recorded features of the positions its cache now holds
        that the drafter has neither fed nor kept yet."""
        target = self.target
        if target.recent_hidden is None:
            return
        hidden, positions = target.recent_hidden, target.recent_positions
        upto = target.lengths.tolist()
        fed = self.runner.lengths.tolist()
        for row in range(len(self.known)):
            need = int(fed[row]) + self.known[row].shape[0]
            take = (positions[row] >= need) & (positions[row] < upto[row])
            if not bool(take.any()):
                continue
            pos = positions[row][take]
            order = torch.argsort(pos)
            pos = pos[order]
            if int(pos[0]) != need or bool((pos.diff() != 1).any()):
                raise QuickdraftError(
                    f"feature drafter: row {row} needs the target's feature of position {need}, the target recorded "
                    f"{pos.tolist()}")
            feats = hidden[row][take][order].detach().float().cpu()
            self.known[row] = torch.cat([self.known[row], feats])

    def pending(self, sequences: list[list[int]], keep_last: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The left-padded block of pending true pairs: ``(ids [B, W], features [B, W, H], valid, fed [B])``;
        ``keep_last``: hold back each row's last pair (its output drafts the first token). A row with no
        true pair pending feeds its last token with a zero feature (a prompt of one token), not counted
        as true."""
        hidden = int(self.runner.model.config.hidden_size)
        lengths = self.runner.lengths.tolist()
        rows = []
        for row, seq in enumerate(sequences):
            feats = self.known[row]
            a = int(lengths[row])
            # a finished row's target may hold accepted tokens its sequence cut (budget, EOS, stop)
            n = max(min(feats.shape[0], len(seq) - 1 - a) - (1 if keep_last else 0), 0)
            if n == 0 and not keep_last:
                rows.append(([seq[-1]], torch.zeros(1, hidden), 0))
                continue
            rows.append((seq[a + 1: a + 1 + n], feats[:n], n))
        width = max(1, max(len(r[0]) for r in rows))
        b = len(rows)
        ids = torch.zeros((b, width), dtype=torch.long)
        valid = torch.zeros((b, width), dtype=torch.bool)
        feats = torch.zeros((b, width, hidden))
        for row, (toks, f, _) in enumerate(rows):
            if toks:
                ids[row, width - len(toks):] = torch.tensor(toks, dtype=torch.long)
                valid[row, width - len(toks):] = True
                feats[row, width - len(toks):] = f
        fed = torch.tensor([r[2] for r in rows], dtype=torch.long)
        return ids, feats, valid, fed

    def prefill(self, sequences: list[list[int]]) -> None:
        """Take the prompt's features and feed every true pair but the last of each row."""
        self.take_target_features()
        ids, feats, valid, fed = self.pending(sequences, keep_last=True)
        if bool(valid.any()):
            self.runner.forward(ids, valid, logits_to_keep=1, features=feats)
        for row, n in enumerate(fed.tolist()):
            self.known[row] = self.known[row][n:]

    def feed_pending(self, sequences: list[list[int]]):
        """Feed every pending true pair; returns the forward's output (last column: the first draft)."""
        before = self.runner.lengths.clone()
        ids, feats, valid, fed = self.pending(sequences, keep_last=False)
        out = self.runner.forward(ids, valid, logits_to_keep=1, output_hidden=True, features=feats)
        self.true_lengths = before + fed.to(before.device)
        for row, n in enumerate(fed.tolist()):
            self.known[row] = self.known[row][n:]
        return out

    def commit(self) -> None:
        """Drop the pairs fed with estimates, then take the target's new true features."""
        if self.true_lengths is not None:
            self.runner.truncate(torch.minimum(self.runner.lengths, self.true_lengths))
            self.true_lengths = None
        self.take_target_features()


class FeatureDrafter(ModelDrafter):
    """Chains from a feature drafter: the first token from the pending true pairs, each further
    one from the pair of the previous estimate and token (:class:`ModelDrafter`'s drafting loop).

    Parameters
    ----------
    runner:
        A runner over a :class:`quickdraft.decoding.feature_model.FeatureDraftModel`.
    target:
        The target's runner (torch), whose hidden states the drafter reads.
    vocab_size:
        The target's vocabulary size.
    """

    name = "feature"

    def __init__(self, runner: ModelRunner, target: ModelRunner, vocab_size: int) -> None:
        super().__init__(runner, vocab_size)
        self.state = FeatureState(runner, target)

    def start(self, sequences: list[list[int]]) -> None:
        self.state.start(sequences)

    def prefill(self, sequences: list[list[int]]) -> None:
        self.state.prefill(sequences)

    def first_forward(self, sequences: list[list[int]], policy: Policy):
        if getattr(policy, "needs_hidden", False):
            raise QuickdraftError(f"policy {policy.name!r} reads a draft model's hidden state; the feature drafter "
                                  "has none of that kind")
        return self.state.feed_pending(sequences)

    def next_forward(self, token: torch.Tensor, out, policy: Policy):
        return self.runner.forward(token.unsqueeze(1), None, logits_to_keep=1, output_hidden=True,
                                   features=out.hidden[:, -1:])

    def commit(self, sequences: list[list[int]], valid_prefix: torch.Tensor) -> None:
        self.state.commit()


class FeatureTreeDrafter(TreeDrafter):
    """Dynamic (EAGLE-2) or static token trees grown by a feature drafter (method ``"tree"``):
    a node's pair is its parent's estimate and its own token. Parameters as :class:`TreeDrafter`,
    plus the target's runner."""

    name = "feature_tree"

    def __init__(self, runner: ModelRunner, target: ModelRunner, vocab_size: int, config: TreeConfig = TreeConfig(),
                 verifier: str = "rrs") -> None:
        require_torch_target(target)
        super().__init__(runner, vocab_size, config, verifier)
        self.target = target

    def proposer(self, policy, rule: Rule, sampling: SamplingParams) -> "FeatureTreeProposer":
        return FeatureTreeProposer(self, rule, sampling)


class FeatureTreeProposer(TreeProposer):
    """:class:`TreeProposer` whose draft side is a feature drafter's :class:`FeatureState`."""

    def __init__(self, drafter: FeatureTreeDrafter, rule: Rule, sampling: SamplingParams) -> None:
        super().__init__(drafter, rule, sampling)
        self.state = FeatureState(drafter.runner, drafter.target)

    def start(self, sequences: list[list[int]]) -> None:
        self.state.start(sequences)
        self.runner.num_forwards = 0

    def prefill(self, sequences: list[list[int]]) -> None:
        self.state.prefill(sequences)

    def begin(self, sequences: list[list[int]]):
        """Feed the pending true pairs; a frontier node pairs its token with its parent's estimate
        (a depth-1 node with the root's)."""
        draft = self.runner
        out = self.state.feed_pending(sequences)
        root_logits = out.logits[:, -1, : self.drafter.vocab_size].cpu()
        root_g = out.hidden[:, -1]  # [B, H] the estimate every depth-1 node pairs with
        draft.begin_tree()
        fed_g: list[torch.Tensor] = []  # estimates of the tree block's slots, in slot order

        def expand(tokens, depths, mask, valid):
            t = draft.tree_size
            b, f = tokens.shape
            feats = root_g.unsqueeze(1).expand(b, f, -1)
            if t:
                # a node's parent is its deepest fed ancestor: the latest tree-block slot it attends to
                seen = mask[:, :, :t].to(torch.bool)
                slot = torch.where(seen, torch.arange(1, t + 1), 0).max(dim=2).values - 1  # [B, f], -1: the root
                block = torch.cat(fed_g, dim=1)  # [B, t, H]
                parent_g = block.gather(1, slot.clamp_min(0).to(block.device).unsqueeze(-1).expand(-1, -1, block.shape[-1]))
                feats = torch.where((slot >= 0).to(block.device).unsqueeze(-1), parent_g, feats)
            res = draft.forward_tree(tokens, depths, mask, valid, output_hidden=True, features=feats)
            fed_g.append(res.hidden)
            return res.logits.cpu()

        return root_logits, expand


class FeatureTreeProposal(TreeProposal):
    """A feature drafter's tree: the target keeps the walked path; the drafter drops its whole tree
    block (its nodes were fed with estimates) and takes the target's features of the path."""

    def commit(self, target, sequences, walk, seq_lens, active) -> None:
        active = active.cpu()
        target.commit_tree(walk.path.clamp_min(0), torch.where(active, walk.num_accepted + 1, 0))
        runner = self.proposer.runner
        b = runner.batch_size
        runner.commit_tree(torch.zeros((b, 0), dtype=torch.long), torch.zeros(b, dtype=torch.long))
        self.proposer.state.commit()


FeatureTreeProposer.proposal_type = FeatureTreeProposal
