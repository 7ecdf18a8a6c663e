"""Token trees: static trees as data (lists of paths) and dynamic EAGLE-2-style trees from a draft model.

A token tree holds, for every row of a batch, ``M = N + 1`` nodes: node 0 is the *root* (the last
emitted token, which the target has not seen yet) and nodes ``1 … N`` are draft tokens. A node's
*children* are the drafts for the position after its path. One target forward over all ``M`` nodes
with the tree attention mask (:func:`ancestor_mask`) and per-node positions ``length + depth``
gives the target's distribution after every path at once (:meth:`quickdraft.backends.runner.ModelRunner.forward_tree`).

Static trees
------------
As in Medusa and vLLM, a static tree is a list of paths of child *ranks*: ``[[0], [1], [0, 0]]`` is
the root's two best children and the best child of the first one. :func:`compile_paths` turns it
into parent indices, depths, the attention mask and the retrieve indices (one root-to-leaf node
list per leaf)::

    paths  [[0], [1], [0, 0]]  ->  nodes  0:root  1:[0]  2:[1]  3:[0,0]
    parents   [-1, 0, 0, 1]        depths [0, 1, 1, 2]
    mask      root [1 0 0 0]   [0] [1 1 0 0]   [1] [1 0 1 0]   [0,0] [1 1 0 1]
    retrieve  [[0, 2, -1], [0, 1, 3]]      (one row per leaf, leaves in node order)

Dynamic trees (EAGLE-2, Li et al. 2024, arXiv:2406.16858, §4)
--------------------------------------------------------------
Grow the tree depth by depth with the draft model: the *frontier* (the ``k`` nodes of the newest
layer with the highest cumulative draft probability ``Π q`` along their path) is fed to the draft
in one tree forward and each frontier node gets children; after ``d`` layers the candidates are
*reranked*: the ``N`` nodes with the highest cumulative probability are kept. Because a child's
cumulative probability never exceeds its parent's (ties broken towards the earlier node), the kept
set is closed under ancestors, so it is a tree.

How the children are drawn (``scheme``) and why the emitted sequence is exactly target-distributed
-----------------------------------------------------------------------------------------------
Verification (:mod:`quickdraft.decoding.tree_decoding`) walks down from the root; at node ``v`` a
step-level verifier of :mod:`quickdraft.verification.multidraft_verifiers` emits one token with law ``p_v``
(the target after ``v``'s path) from ``v``'s drafts; if the token is a child the walk continues
there, otherwise (or at a leaf, whose "verification" with zero drafts is a plain sample of
``p_v``) it stops. The step-level verifiers are lossless when, *given everything the walk has seen
so far*, the drafts at ``v`` have exactly the law the verifier is told. Two constructions keep that:

``topk`` (EAGLE-2, deterministic)
    Children are the draft's most likely tokens and the final rerank keeps the best ``N`` nodes.
    The whole tree is a deterministic function of the prefix and the draft model, never of the
    target or of the verifier's randomness, so each child is a draw from a *point mass* and RRS
    verifies it as such: accept child ``x_i`` with probability ``p_i(x_i)``; on rejection remove
    ``x_i`` from ``p_i`` and renormalise; after the last child sample what is left. (EAGLE's own
    sampling verifier is this.) Lossless for any deterministic tree. This is the only scheme
    allowed with the rerank, and the one used at temperature 0 (ranked by the draft's
    temperature-1 distribution), where verification is "follow the child that is the target's argmax".
``with_replacement`` / ``without_replacement`` / ``greedy`` (sampled children)
    Children of ``v`` are drawn from the draft's processed distribution ``q_v`` by the scheme of
    :mod:`quickdraft.verification.multidraft_proposals`. A post-hoc rerank would drop drawn children because of
    their values and bias the draft law, so there is none: the number of children of every
    frontier rank is fixed *before* drawing by a plan (:func:`sampled_plan`) that spreads the budget
    over the depths, and every drawn child is kept. Which nodes form the next frontier depends on
    values already drawn (their cumulative probability), which is allowed: it decides only whether a
    node *gets* children, before they are drawn, and fresh randomness draws them. Duplicates drawn
    with replacement share one node (the verifier still sees the full list of drafts; following
    the first node with the emitted token is a choice independent of that node's subtree).

``race`` (ERSD with several candidates, Kobus & Gündüz 2025, arXiv:2504.15475)
    Children of a node at depth ``t`` are the draft's ``k`` earliest arrivals under ``q_v`` in the
    exponential race keyed by (seed, row, absolute position of the child), the same arrival times
    the target races with at that position (:func:`quickdraft.verification.race.race_candidates`); every node
    at one depth shares its position's noise. Tokens with ``q_v = 0`` never arrive and are not
    kept. A child's score is its parent's plus its *race margin* ``log(s_j / s_0) <= 0``, with
    ``s = q(v) / E_v`` and ``s_0`` the draft's winner (:func:`quickdraft.verification.race.race_order`): how much
    later than the winner it arrived, the gap a target ``p ≈ q`` would have to close to pick it.
    The chain of the draft's winners thus scores 0 at every depth and is always kept (frontier and
    rerank, ties towards earlier nodes, as for ``topk``), so a race tree of depth ``K`` with budget
    ``≥ K`` accepts at least what chain ERSD with ``K`` drafts accepts on the same noise. The
    tree is a deterministic function of the prefix, the draft and the shared noise. It is verified
    by the race, not by a step-level verifier (:func:`quickdraft.decoding.tree_decoding.verify_tree` with
    ``race_keys``): the walk emits the target's race winner at every node, which makes the output
    the target's own race sample whatever the tree. At temperature 0 the candidates are the draft's
    top ``k`` by raw probability — the limit of the race order ``E_v / q(v)^{1/T}`` as ``T → 0``.

Valid (scheme, verifier) pairs are those of :mod:`quickdraft.verification.multidraft` plus (``topk``, ``rrs``);
``race`` trees go with the ERSD rule only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch

from quickdraft.errors import QuickdraftError
from quickdraft.decoding.policies import MAX_DRAFT_LENGTH
from quickdraft.verification.multidraft_proposals import SAMPLERS, Drafts, _remove
from quickdraft.verification.race import arrival_times, race_order
from quickdraft.verification.sampling import SamplingParams, logits_to_probs

#: how the children of a node are chosen (see the module docstring)
SCHEMES: tuple[str, ...] = ("topk", "with_replacement", "without_replacement", "greedy")
#: children are the draft's earliest exponential-race arrivals (ERSD; verified by the race only)
RACE_SCHEME = "race"
#: verifier -> schemes it is lossless for on trees
TREE_VERIFIERS: dict[str, frozenset[str]] = {
    "rrs": frozenset(SCHEMES),
    "kseq": frozenset({"with_replacement"}),
    "optimal_greedy": frozenset({"greedy"}),
}


# ---------------------------------------------------------------------------------------------
# static trees
# ---------------------------------------------------------------------------------------------


@dataclass
class CompiledTree:
    """A static tree compiled from paths (see the module docstring for a worked example).

    Attributes
    ----------
    paths: the paths in node order (sorted by length, then lexicographically); node ``i + 1`` is ``paths[i]``.
    parents: ``[M]`` int64 parent node of every node (``-1`` for the root).
    depths: ``[M]`` int64 (root 0).
    mask: ``[M, M]`` bool, ``mask[i, j]``: node ``j`` is ``i`` or an ancestor of ``i``.
    retrieve_indices: ``[leaves, D + 1]`` int64 root-to-leaf node lists, ``-1`` padded.
    num_children: ``[M]`` int64.
    """

    paths: list[tuple[int, ...]]
    parents: torch.Tensor
    depths: torch.Tensor
    mask: torch.Tensor
    retrieve_indices: torch.Tensor
    num_children: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return int(self.parents.shape[0])


def compile_paths(paths: list[list[int]] | list[tuple[int, ...]]) -> CompiledTree:
    """Compile a Medusa/vLLM-style list of child-rank paths into tree tensors (pure function).

    Every prefix of a path must itself be a path, and the children of a node must use the ranks
    ``0 … c − 1`` (``[0, 1]`` needs ``[0, 0]``). Raises :class:`QuickdraftError` otherwise.

    >>> t = compile_paths([[0], [1], [0, 0]])
    >>> t.parents.tolist(), t.depths.tolist(), t.retrieve_indices.tolist()
    ([-1, 0, 0, 1], [0, 1, 1, 2], [[0, 2, -1], [0, 1, 3]])
    """
    if not paths:
        raise QuickdraftError("a tree needs at least one path")
    norm = []
    for path in paths:
        path = tuple(path)
        if not path or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in path):
            raise QuickdraftError(f"tree path {list(path)!r} must be a non-empty list of child ranks >= 0")
        norm.append(path)
    if len(set(norm)) != len(norm):
        raise QuickdraftError("tree paths contain a duplicate")
    ordered = sorted(norm, key=lambda p: (len(p), p))
    index = {(): 0}
    for i, p in enumerate(ordered):
        index[p] = i + 1
    for p in ordered:
        if p[:-1] not in index:
            raise QuickdraftError(f"tree path {list(p)!r} has no parent path {list(p[:-1])!r}")
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in index:
            raise QuickdraftError(f"tree path {list(p)!r} skips rank {p[-1] - 1} among its siblings")
    m = len(ordered) + 1
    parents = torch.tensor([-1] + [index[p[:-1]] for p in ordered], dtype=torch.long)
    depths = torch.tensor([0] + [len(p) for p in ordered], dtype=torch.long)
    mask = ancestor_mask(parents.unsqueeze(0))[0]
    num_children = torch.bincount(parents[1:], minlength=m)
    leaves = [i for i in range(m) if num_children[i] == 0]
    width = int(depths.max()) + 1
    retrieve = torch.full((len(leaves), width), -1, dtype=torch.long)
    for row, leaf in enumerate(leaves):
        chain = []
        node = leaf
        while node >= 0:
            chain.append(node)
            node = int(parents[node])
        retrieve[row, : len(chain)] = torch.tensor(chain[::-1])
    return CompiledTree(ordered, parents, depths, mask, retrieve, num_children)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """Tree attention mask ``[B, M, M]`` from parent indices ``[B, M]`` (``-1`` = no parent).

    ``mask[b, i, j]`` is True iff ``j == i`` or ``j`` is an ancestor of ``i``. Parents must have
    smaller indices than their children (then ``M`` pointer jumps reach the root).
    """
    b, m = parents.shape
    mask = torch.eye(m, dtype=torch.bool, device=parents.device).expand(b, m, m).clone()
    cur = parents.clone()
    rows = torch.arange(b, device=parents.device).unsqueeze(1).expand(b, m)
    cols = torch.arange(m, device=parents.device).unsqueeze(0).expand(b, m)
    for _ in range(m):
        has = cur >= 0
        if not bool(has.any()):
            break
        mask[rows[has], cols[has], cur[has]] = True
        cur = torch.where(has, parents.gather(1, cur.clamp_min(0)), cur)
    return mask


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeConfig:
    """How the token tree of each step is built.

    Attributes
    ----------
    depth:
        ``d`` in ``[1, MAX_DRAFT_LENGTH]``, draft layers (= draft forwards per step).
    topk:
        ``k`` ≥ 1, children per expanded node and frontier width.
    budget:
        ``N`` ≥ 1, draft nodes per tree (the target verifies ``N + 1`` tokens per step, root
        included). Ignored for static ``paths``.
    scheme:
        ``"topk"`` (EAGLE-2 deterministic top-k + rerank), ``"with_replacement"``,
        ``"without_replacement"`` or ``"greedy"`` (sampled children), or ``"race"`` (ERSD
        candidates, ``k`` per node); see the module docstring.
    paths:
        A static tree (list of child-rank paths); ``None`` builds dynamic trees.
    """

    depth: int = 4
    topk: int = 4
    budget: int = 16
    scheme: str = "topk"
    paths: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        for name in ("depth", "topk", "budget"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise QuickdraftError(f"tree {name} must be an integer >= 1, got {value!r}")
        if self.depth > MAX_DRAFT_LENGTH:
            raise QuickdraftError(
                f"tree depth must be at most {MAX_DRAFT_LENGTH} (the maximum draft length), got {self.depth!r}")
        if self.scheme not in SCHEMES + (RACE_SCHEME,):
            raise QuickdraftError(
                f"unknown tree scheme {self.scheme!r}; choose one of {', '.join(SCHEMES + (RACE_SCHEME,))}"
            )
        if self.paths is not None:
            object.__setattr__(self, "paths", tuple(tuple(p) for p in self.paths))
            compile_paths(list(self.paths))  # validates

    @property
    def max_nodes(self) -> int:
        """``M`` = nodes per tree including the root."""
        if self.paths is not None:
            return len(self.paths) + 1
        if self.scheme in ("topk", RACE_SCHEME):
            return 1 + min(self.budget, self.topk + (self.depth - 1) * self.topk**2)
        return 1 + sum(sum(c) for c in sampled_plan(self.depth, self.topk, self.budget))

    @property
    def tree_depth(self) -> int:
        if self.paths is not None:
            return max(len(p) for p in self.paths)
        return self.depth

    def capped(self, depth: int) -> "TreeConfig":
        """This configuration with trees at most ``max(1, depth)`` deep: a dynamic tree gets
        ``depth`` layers, a static tree keeps its paths of at most ``depth`` nodes (which stay a
        valid tree: every kept path's parent is shorter). Itself when it is no deeper."""
        depth = max(1, int(depth))
        if self.tree_depth <= depth:
            return self
        if self.paths is not None:
            return dataclasses.replace(self, paths=tuple(p for p in self.paths if len(p) <= depth))
        return dataclasses.replace(self, depth=depth)


def check_combination(scheme: str, verifier: str) -> None:
    """Raise unless ``verifier`` is lossless for children drawn by ``scheme`` on trees."""
    if scheme == RACE_SCHEME:
        raise QuickdraftError("race-candidate trees are verified by the exponential race: use the ersd rule")
    if verifier not in TREE_VERIFIERS:
        raise QuickdraftError(f"unknown verifier {verifier!r}; choose one of {', '.join(TREE_VERIFIERS)}")
    if scheme not in TREE_VERIFIERS[verifier]:
        raise QuickdraftError(
            f"verifier {verifier!r} is not lossless for {scheme!r} tree children; it works with "
            f"{sorted(TREE_VERIFIERS[verifier])}"
        )


def sampled_plan(depth: int, topk: int, budget: int) -> list[list[int]]:
    """Children per frontier rank at every depth for sampled schemes, fixed before drawing.

    Depth 1: ``min(k, N)`` children of the root. Depth ``t ≥ 2``: an allowance of
    ``ceil(R / (d − t + 1))`` nodes (``R`` = budget left) filled in frontier-rank order with at
    most ``k`` children per node, and at most as many frontier nodes as the previous layer has.

    >>> sampled_plan(3, 4, 16)
    [[4], [4, 2], [4, 2]]
    """
    plan = [[min(topk, budget)]]
    left = budget - plan[0][0]
    width = plan[0][0]
    for t in range(2, depth + 1):
        allowance = math.ceil(left / (depth - t + 1)) if left > 0 else 0
        counts: list[int] = []
        while allowance - sum(counts) > 0 and len(counts) < min(topk, width):
            counts.append(min(topk, allowance - sum(counts)))
        if not counts:
            break
        plan.append(counts)
        left -= sum(counts)
        width = sum(counts)
    return plan


# ---------------------------------------------------------------------------------------------
# the batched tree
# ---------------------------------------------------------------------------------------------


@dataclass
class TokenTree:
    """One token tree per row (``M`` nodes, node 0 the root; ``c`` = most drafts at a node;
    ``E`` = expanded nodes, i.e. nodes fed to the draft model, the root first).

    Attributes
    ----------
    tokens, parents, depths: ``[B, M]`` int64 (parent ``-1`` for the root, and 0 for padding nodes).
    valid: ``[B, M]`` bool; padding nodes are never fed as real tokens nor followed.
    scores: ``[B, M]`` float32 log cumulative draft probability of the path.
    draft_ids: ``[B, M, c]`` int64 the drafts at each node in drawing order (``-1`` padded).
    num_drafts: ``[B, M]`` int64.
    child_of: ``[B, M, c]`` int64 node holding each draft (``-1`` none).
    expanded: ``[B, M]`` int64 index into ``expanded_probs`` (``-1``: not expanded).
    expanded_probs: ``[B, E, V]`` float32 processed draft distribution after each expanded node.
    expanded_raw: ``[B, E, V]`` float32 temperature-1 draft distributions, when asked for.
    draft_slot: ``[B, M]`` int64 slot of the node in the draft runner's tree block (``-1``: not fed).
    scheme: how the children were drawn.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    valid: torch.Tensor
    scores: torch.Tensor
    draft_ids: torch.Tensor
    num_drafts: torch.Tensor
    child_of: torch.Tensor
    expanded: torch.Tensor
    expanded_probs: torch.Tensor
    expanded_raw: torch.Tensor | None
    draft_slot: torch.Tensor
    scheme: str

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[1])

    def mask(self) -> torch.Tensor:
        """Tree attention mask ``[B, M, M]`` (padding nodes see only themselves and the root)."""
        return ancestor_mask(self.parents)


def proposals_for(scheme: str, draft_probs: torch.Tensor, draft_ids: torch.Tensor) -> Drafts:
    """The conditional laws the drafts ``[B, n]`` were drawn from, rebuilt from ``draft_probs [B, V]``.

    ``topk`` drafts are point masses; the sampled schemes follow
    :mod:`quickdraft.verification.multidraft_proposals`. ``draft_probs`` float64.
    """
    b, n = draft_ids.shape
    if scheme == "with_replacement":
        return Drafts(draft_ids, [draft_probs] * n)
    if scheme == "without_replacement":
        return Drafts(draft_ids, [draft_probs] + [_remove(draft_probs, draft_ids[:, :i]) for i in range(1, n)])
    point = [torch.zeros_like(draft_probs).scatter_(-1, draft_ids[:, i : i + 1], 1.0) for i in range(n)]
    if scheme == "topk":
        return Drafts(draft_ids, point)
    if scheme == "greedy":
        return Drafts(draft_ids, point[:-1] + [_remove(draft_probs, draft_ids[:, :-1])])
    raise QuickdraftError(f"unknown tree scheme {scheme!r}")


def _draw(scheme: str, probs: torch.Tensor, counts: torch.Tensor, width: int, generator) -> torch.Tensor:
    """Draw ``counts[b] ≤ width`` children per row from ``probs [B, V]`` (float64) by ``scheme``;
    returns ``[B, width]`` int64 (columns beyond a row's count are 0)."""
    out = torch.zeros(probs.shape[0], width, dtype=torch.long)
    for n in sorted(set(counts.tolist())):
        if n <= 0:
            continue
        rows = (counts == n).nonzero().squeeze(-1)
        out[rows, :n] = SAMPLERS[scheme](probs[rows], n, generator).ids
    return out


#: ``expand(tokens [B, f], depths [B, f], tree_mask [B, f, T + f], valid [B, f]) -> logits [B, f, V]``:
#: feed frontier nodes to the draft model's tree block (``depths`` are position offsets there)
ExpandFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def build_tree(
    root_tokens: torch.Tensor,
    root_logits: torch.Tensor,
    expand: ExpandFn,
    config: TreeConfig,
    sampling: SamplingParams,
    generator: torch.Generator | None = None,
    keep_raw: bool = False,
    race_keys: torch.Tensor | None = None,
) -> TokenTree:
    """Build one token tree per row with the draft model (EAGLE-2 style, or a static shape).

    Parameters
    ----------
    root_tokens:
        ``[B]`` int64 the last emitted token of every row.
    root_logits:
        ``[B, V]`` the draft's logits after the root.
    expand:
        Feeds a frontier to the draft model (see :data:`ExpandFn`); called ``depth − 1`` times.
    config:
        Tree shape and scheme. At temperature 0 the scheme must be ``topk``.
    sampling:
        The processed draft distribution ``q`` (drawing, ``topk`` ranking at T > 0).
    generator:
        Random source for sampled schemes.
    keep_raw:
        Also store the temperature-1 draft distributions (for FSD's divergence).
    race_keys:
        ``[B, d]`` int64 keys (:func:`quickdraft.verification.race.race_keys`) of the arrival times at the
        absolute positions of the depth-1 … depth-``d`` children; needed by the ``race`` scheme.
    """
    b, v = root_logits.shape
    k = config.topk
    scheme = config.scheme
    race = scheme == RACE_SCHEME
    if sampling.greedy and scheme not in ("topk", RACE_SCHEME):
        raise QuickdraftError("at temperature 0 the tree must use the deterministic 'topk' scheme")
    if race and (race_keys is None or race_keys.shape != (b, config.tree_depth)):
        raise QuickdraftError(
            f"the race scheme needs race_keys of shape [B={b}, d={config.tree_depth}], got "
            f"{None if race_keys is None else tuple(race_keys.shape)}"
        )
    static = compile_paths(list(config.paths)) if config.paths is not None else None

    def dists(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = logits_to_probs(logits, sampling)
        raw = logits.float().softmax(dim=-1)
        return q, (raw if sampling.greedy else q), raw

    # the tree so far, as lists of per-layer tensors; global node index = position in the concatenation
    tokens = [root_tokens.view(b, 1).long()]
    parents = [torch.full((b, 1), -1, dtype=torch.long)]
    depths = [torch.zeros(b, 1, dtype=torch.long)]
    valid = [torch.ones(b, 1, dtype=torch.bool)]
    scores = [torch.zeros(b, 1)]
    draft_slot = [torch.full((b, 1), -1, dtype=torch.long)]
    expanded_idx = [torch.zeros(b, 1, dtype=torch.long)]
    q0, rank0, raw0 = dists(root_logits)
    exp_probs, exp_raw = [q0.unsqueeze(1)], [raw0.unsqueeze(1)]
    # drafts drawn at each expanded node: (parent node [B, f], ids [B, f, c], counts [B, f], child node [B, f, c])
    drawn: list[tuple[torch.Tensor, ...]] = []

    frontier = torch.zeros(b, 1, dtype=torch.long)  # global node ids [B, f]
    frontier_valid = torch.ones(b, 1, dtype=torch.bool)
    layer_q, layer_rank = q0.unsqueeze(1), rank0.unsqueeze(1)  # [B, f, V]
    count = 1
    fed = 0  # slots in the draft's tree block
    if static is not None:
        plan = []
        for t in range(1, int(static.depths.max()) + 1):
            parents_t = [i for i in range(static.num_nodes) if int(static.depths[i]) == t - 1 and static.num_children[i] > 0]
            plan.append([int(static.num_children[i]) for i in parents_t])
    elif scheme in ("topk", RACE_SCHEME):
        plan = [[k]] + [[k] * k for _ in range(config.depth - 1)]
    else:
        plan = sampled_plan(config.depth, k, config.budget)

    for t, counts in enumerate(plan, start=1):
        # 1. children of every frontier node
        layer_tok, layer_par, layer_valid, layer_score, layer_child = [], [], [], [], []
        if race and not sampling.greedy:  # [B, V] the noise of this depth, shared by its nodes
            arrivals = arrival_times(race_keys[:, t - 1], v)
        for r, c in enumerate(counts):
            if r >= frontier.shape[1]:
                break
            q_r, rank_r = layer_q[:, r].double(), layer_rank[:, r].double()  # [B, V]
            parent = frontier[:, r]
            parent_score = torch.cat(scores, dim=1).gather(1, parent.unsqueeze(1))  # [B, 1]
            if scheme == "topk" or (race and sampling.greedy):
                ids = torch.topk(rank_r, c, dim=-1).indices  # [B, c] best first (ties: lowest id)
                n_eff = torch.full((b,), c, dtype=torch.long)
                ok = rank_r.gather(1, ids) > 0
            elif race:
                # [B, c] the c earliest arrivals under q with the noise of the children's position
                ids, margin = race_order(q_r, arrivals, c)
                n_eff = torch.full((b,), c, dtype=torch.long)
                ok = q_r.gather(1, ids) > 0  # zero-probability tokens never arrive
            else:
                support = (q_r > 0).sum(dim=-1)
                n_eff = torch.full((b,), c, dtype=torch.long)
                if scheme != "with_replacement":
                    n_eff = torch.minimum(n_eff, support)
                ids = _draw(scheme, q_r, n_eff, c, generator)
                cols = torch.arange(c).unsqueeze(0)
                ok = cols < n_eff.unsqueeze(1)
                dup = (ids.unsqueeze(2) == ids.unsqueeze(1)) & (cols.unsqueeze(1) < cols.unsqueeze(2))  # [B, c, c]
                ok = ok & ~dup.any(dim=2)
            ok = ok & frontier_valid[:, r : r + 1]
            n_eff = torch.where(frontier_valid[:, r], n_eff, 0)
            node_ids = count + torch.arange(c).unsqueeze(0).expand(b, c)  # [B, c]
            # the node holding each draft: the first column with the same token
            first = (ids.unsqueeze(2) == ids.unsqueeze(1)).long().argmax(dim=2)  # [B, c]
            child = torch.where(torch.arange(c).unsqueeze(0) < n_eff.unsqueeze(1), count + first, -1)
            drawn.append((parent, ids, n_eff, child))
            layer_tok.append(ids)
            layer_par.append(parent.unsqueeze(1).expand(b, c))
            layer_valid.append(ok)
            if race and not sampling.greedy:
                score = parent_score + margin.float()
            else:
                score = parent_score + rank_r.gather(1, ids).clamp_min(1e-30).log().float()
            layer_score.append(torch.where(ok, score, torch.full_like(score, -math.inf)))
            layer_child.append(node_ids)
            count += c
        if not layer_tok:
            break
        l_tok, l_par = torch.cat(layer_tok, 1), torch.cat(layer_par, 1)
        l_valid, l_score = torch.cat(layer_valid, 1), torch.cat(layer_score, 1)
        width = l_tok.shape[1]
        tokens.append(l_tok)
        parents.append(torch.where(l_valid, l_par, 0))
        depths.append(torch.full((b, width), t, dtype=torch.long))
        valid.append(l_valid)
        scores.append(l_score)
        draft_slot.append(torch.full((b, width), -1, dtype=torch.long))
        expanded_idx.append(torch.full((b, width), -1, dtype=torch.long))
        if t == len(plan):
            break
        # 2. the next frontier: the best nodes of this layer (static trees: the nodes with children)
        next_counts = plan[t]
        f = min(len(next_counts), width)
        if static is not None:
            base = count - width
            layer_nodes = [i for i in range(static.num_nodes) if int(static.depths[i]) == t and static.num_children[i] > 0]
            local = torch.tensor([i - base for i in layer_nodes], dtype=torch.long).unsqueeze(0).expand(b, -1)
        else:
            # [B, f] best first, ties towards the earlier node
            local = torch.sort(l_score, dim=1, descending=True, stable=True).indices[:, :f]
        frontier = (count - width) + local
        frontier_valid = l_valid.gather(1, local)
        # 3. feed the frontier to the draft: it attends to its fed ancestors (the root is in the prefix)
        all_parents = torch.cat(parents, 1)
        all_slots = torch.cat(draft_slot, 1)
        mask = torch.zeros(b, f, fed + f, dtype=torch.bool)
        mask[:, :, fed:] = torch.eye(f, dtype=torch.bool)
        cur = all_parents.gather(1, frontier)
        for _ in range(t - 1):
            slot = all_slots.gather(1, cur.clamp_min(0))
            has = (cur > 0) & (slot >= 0)
            rows, cols = has.nonzero(as_tuple=True)
            mask[rows, cols, slot[rows, cols]] = True
            cur = torch.where(cur > 0, all_parents.gather(1, cur.clamp_min(0)), cur)
        logits = expand(
            torch.cat(tokens, 1).gather(1, frontier), torch.full((b, f), t - 1, dtype=torch.long), mask, frontier_valid
        )[:, :, :v]
        q, rank, raw = dists(logits)
        layer_q, layer_rank = q, rank
        exp_probs.append(q)
        exp_raw.append(raw)
        new_slots = fed + torch.arange(f).unsqueeze(0).expand(b, f)
        draft_slot[-1] = draft_slot[-1].scatter(1, local, torch.where(frontier_valid, new_slots, -1))
        n_exp = sum(x.shape[1] for x in exp_probs) - f
        expanded_idx[-1] = expanded_idx[-1].scatter(1, local, n_exp + torch.arange(f).unsqueeze(0).expand(b, f))
        fed += f

    tok, par, dep = torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(depths, 1)
    val, sco = torch.cat(valid, 1), torch.cat(scores, 1)
    slots, exp_i = torch.cat(draft_slot, 1), torch.cat(expanded_idx, 1)
    m = tok.shape[1]
    cmax = max(x[1].shape[1] for x in drawn)
    draft_ids = torch.full((b, m, cmax), -1, dtype=torch.long)
    child_of = torch.full((b, m, cmax), -1, dtype=torch.long)
    num_drafts = torch.zeros(b, m, dtype=torch.long)
    rows = torch.arange(b)
    for parent, ids, n_eff, child in drawn:
        c = ids.shape[1]
        live = torch.arange(c).unsqueeze(0) < n_eff.unsqueeze(1)
        draft_ids[rows, parent, :c] = torch.where(live, ids, -1)
        child_of[rows, parent, :c] = child
        num_drafts[rows, parent] = n_eff

    if scheme in ("topk", RACE_SCHEME):
        # rerank to the budget (dynamic trees), then every node's drafts are its kept children
        if static is None and m - 1 > config.budget:
            order = torch.sort(torch.where(val[:, 1:], sco[:, 1:], -math.inf), dim=1, descending=True, stable=True).indices
            keep = torch.sort(order[:, : config.budget] + 1, dim=1).values
            keep = torch.cat([torch.zeros(b, 1, dtype=torch.long), keep], dim=1)  # [B, N + 1], index order
            new_index = torch.full((b, m), -1, dtype=torch.long)
            new_index.scatter_(1, keep, torch.arange(keep.shape[1]).unsqueeze(0).expand(b, -1))
            par = new_index.gather(1, par.gather(1, keep).clamp_min(0))
            par[:, 0] = -1
            tok, dep, val, sco = (x.gather(1, keep) for x in (tok, dep, val, sco))
            slots, exp_i = slots.gather(1, keep), exp_i.gather(1, keep)
            par = torch.where(val, par, 0)
            par[:, 0] = -1
            m = keep.shape[1]
        kids = (par.unsqueeze(1) == torch.arange(m).view(1, m, 1)) & val.unsqueeze(1)  # [B, parent, child]
        kids[:, :, 0] = False
        num_drafts = kids.sum(dim=2)
        cmax = max(1, int(num_drafts.max()))
        order = torch.sort((~kids).long(), dim=2, stable=True).indices[:, :, :cmax]  # kept children, index order
        live = torch.arange(cmax).view(1, 1, cmax) < num_drafts.unsqueeze(2)
        child_of = torch.where(live, order, -1)
        draft_ids = torch.where(live, tok.gather(1, order.reshape(b, -1)).reshape(b, m, cmax), -1)
    tok = torch.where(val, tok, 0)
    dep = torch.where(val, dep, 1)
    return TokenTree(
        tokens=tok, parents=par, depths=dep, valid=val, scores=sco, draft_ids=draft_ids,
        num_drafts=num_drafts, child_of=child_of, expanded=exp_i, expanded_probs=torch.cat(exp_probs, 1),
        expanded_raw=torch.cat(exp_raw, 1) if keep_raw else None, draft_slot=slots, scheme=scheme,
    )
