"""Named decoding methods: the names used by the CLI, the benchmark and the results files.

A method is a drafter kind plus an acceptance rule plus a draft-length policy:

=========  =========  =========================================  ==========================
name       drafter    rule                                       notes
=========  =========  =========================================  ==========================
ar         none       greedy / sampling from the target          the baseline
sd         draft LM   greedy (T = 0) or lossless (T > 0)         Leviathan/Chen
ngram      n-gram     greedy (T = 0) or lossless (T > 0)         prompt lookup decoding
ngram_sd   both       greedy (T = 0) or lossless (T > 0)         prompt lookup where it matches,
                                                                 else the draft model
rest       datastore  greedy (T = 0) or lossless (T > 0)         REST retrieval (needs a datastore)
rest_sd    both       greedy (T = 0) or lossless (T > 0)         retrieval where it matches,
                                                                 else the draft model
phrase_sd  draft LM   greedy (T = 0) or lossless (T > 0)         Ouroboros phrases from a pool
           + pool                                                extend the draft model's drafts
amusd      draft LM   greedy (T = 0) or lossless (T > 0)         AMUSD: the next block drafted on
                                                                 a thread of its own during
                                                                 verification; --policy constant
cd         draft LM   Contrastive(cd_alpha, cd_beta)             contrastive decoding: no drafts,
                                                                 the draft model the amateur
scd        draft LM   Contrastive(cd_alpha, cd_beta)             speculative contrastive decoding:
                                                                 lossless w.r.t. cd, not the target
fsd        draft LM   Fuzzy(divergence, threshold, hybrid)       lossy unless T = 0
typical    draft LM   Typical(epsilon, delta)                    lossy
lantern    draft LM   Latent(lantern_k, lantern_delta)           lossy unless δ = 0 or k = 1;
                                                                 needs the target's embeddings
ersd       draft LM   ExponentialRace(seed, candidates)          lossless, shared randomness;
                                                                 candidates > 1: a race tree
tree       draft LM   tree walk with rrs / kseq / optimal_greedy  lossless; ``rule="fsd"``: FSD on trees;
                                                                 ``rule="ersd"``: ERSD on trees
=========  =========  =========================================  ==========================
"""

from __future__ import annotations

from dataclasses import dataclass

from quickdraft.decoding.engine import default_rule
from quickdraft.errors import QuickdraftError
from quickdraft.decoding.policies import Constant, Policy
from quickdraft.verification.rules import Rule
from quickdraft.verification.sampling import SamplingParams

METHOD_NAMES: tuple[str, ...] = (
    "ar", "sd", "ngram", "ngram_sd", "rest", "rest_sd", "phrase_sd", "amusd", "cd", "scd", "fsd", "typical", "lantern",
    "ersd", "tree")
#: how lossy rules draft: ``auto`` (FSD: greedy, hybrid FSD and typical: sampled), ``greedy``, ``sampled``
DRAFT_MODES: tuple[str, ...] = ("auto", "greedy", "sampled")


@dataclass
class MethodSpec:
    name: str
    engine_method: str  # quickdraft.decoding.engine.METHODS: "ar", "sd", ..., "phrase_sd", "amusd", "cd", "scd", "tree"
    rule: Rule
    policy: Policy
    needs_draft: bool
    needs_datastore: bool = False  # retrieval (rest, rest_sd): a datastore to retrieve from
    tree: object | None = None  # quickdraft.decoding.tree.TreeConfig for engine_method "tree"
    verifier: str = "rrs"  # step-level verifier at every tree node
    phrase: object | None = None  # quickdraft.decoding.phrase.PhraseConfig for phrase_sd


#: the draft-length policies by name (:func:`build_policy`); ``auto`` is :func:`build_method`'s
#: choice: ``cost`` for a method that may make plain steps (:func:`may_skip_drafting`), else ``constant``
POLICY_NAMES: tuple[str, ...] = ("constant", "heuristic", "confidence", "specdecpp", "cost", "auto")


def engine_method_of(name: str, candidates: int = 1) -> str:
    """The engine's method (:data:`quickdraft.decoding.engine.METHODS`) that runs method ``name``:
    the chain rules (``fsd``, ``typical``, ``lantern``, ``ersd`` with one candidate) run as ``sd``,
    ERSD with ``candidates`` > 1 as ``tree`` (a race tree), every other method as itself
    (:func:`build_method`'s ``MethodSpec.engine_method``)."""
    if name in ("fsd", "typical", "lantern") or (name == "ersd" and candidates <= 1):
        return "sd"
    return "tree" if name == "ersd" else name


def may_skip_drafting(name: str, candidates: int = 1) -> bool:
    """Whether method ``name`` drafts one chain a step, so that a step may be a plain step instead
    (what ``--policy cost`` chooses where no draft pays): the engine runs it as one of
    :data:`quickdraft.decoding.engine.SKIPPABLE` — not ``amusd`` (it drafts during verification),
    ``cd`` / ``scd`` (the amateur scores every token), trees, nor ``ar``, which never drafts."""
    from quickdraft.decoding.engine import SKIPPABLE

    return engine_method_of(name, candidates) in SKIPPABLE


def build_policy(policy: str, k: int, head: str | None = None, stop_threshold: float = 0.5) -> Policy:
    """A draft-length policy by name (see :mod:`quickdraft.decoding.policies`).

    ``k`` is the draft length of ``constant``, the first draft length of ``heuristic`` and the
    most tokens per step of ``confidence``, ``specdecpp`` and ``cost`` (``auto``: ``cost`` here;
    :func:`build_method` resolves it by method); ``stop_threshold`` is
    ``p_min`` of ``confidence`` and the threshold ``h`` of ``specdecpp``. ``cost`` gets the
    backend's measured forward costs from the pipeline that runs it
    (:meth:`quickdraft.pipeline.Pipeline.ready_policy`).
    """
    from quickdraft.decoding import policies

    if policy == "constant":
        return Constant(k)
    if policy == "heuristic":
        return policies.Heuristic(initial_k=k, max_k=max(k, 16))
    if policy == "confidence":
        return policies.Confidence(p_min=stop_threshold, max_k=k)
    if policy in ("cost", "auto"):
        return policies.CostAware(max_k=k)
    if policy == "specdecpp":
        if head is None:
            raise QuickdraftError("--policy specdecpp needs --head PATH (train one with `quickdraft train-head`)")
        return policies.SpecDecPP.from_file(head, threshold=stop_threshold, max_k=k)
    raise QuickdraftError(f"unknown policy {policy!r}; choose one of {', '.join(POLICY_NAMES)}")


def build_method(
    name: str,
    *,
    k: int = 4,
    policy: str = "constant",
    sampling: SamplingParams = SamplingParams(),
    divergence: str = "js",
    threshold: float = 0.4,
    hybrid: bool = False,
    fsd_raw: bool = True,
    divergence_top_k: int = 50,
    divergence_top_p: float = 0.9,
    drafts: str = "auto",
    epsilon: float = 0.09,
    delta: float = 0.3,
    lantern_k: int = 100,
    lantern_delta: float = 0.1,
    cd_alpha: float = 0.1,
    cd_beta: float = 0.5,
    candidates: int = 1,
    seed: int = 0,
    head: str | None = None,
    stop_threshold: float = 0.5,
    tree_budget: int = 16,
    depth: int = 4,
    topk: int = 4,
    verifier: str = "rrs",
    tree_sampling: str = "topk",
    tree_rule: str = "lossless",
    tree_shape: str = "dynamic",
    rank_law: str = "",
    phrase_len: int = 8,
    phrase_pool: int = 4096,
    phrase_max_draft: int = 16,
) -> MethodSpec:
    """Build the rule and policy of a named method, validating every parameter.

    ``policy`` names a draft-length policy (:data:`POLICY_NAMES`, :func:`build_policy`); ``auto``
    is ``cost`` where :func:`may_skip_drafting` (the step may be a plain step), else ``constant``.
    FSD and typical acceptance take ``fsd_raw`` (FSD: divergence on the raw temperature-1
    distributions, as the FSD reference; ``False``: on the processed ones), ``divergence_top_k``
    (the k of the ``topk_*`` divergences), ``divergence_top_p`` (the nucleus of the ``topp_*``
    divergences) and ``drafts`` (:data:`DRAFT_MODES`); the other methods ignore the first three
    and refuse a ``drafts`` other than ``auto``. ``divergence`` names a divergence of
    :mod:`quickdraft.verification.divergences`; the default ``js`` is FSD's "JS" (the FSD reference code's
    default, whose usage example uses threshold 0.4), ``jsd`` the textbook Jensen–Shannon divergence.
    ``lantern_k`` and ``lantern_delta`` are the neighbourhood size and total-variation budget of
    :class:`quickdraft.verification.rules.Latent`; its neighbourhood table is attached by ``Pipeline.generate``.
    ``tree_shape`` (``tree`` with ``tree_rule="ersd"``): ``dynamic`` (EAGLE-2-style race trees of
    ``depth``, ``topk``, ``tree_budget``) or ``optimal`` (the static Tunstall tree of ``tree_budget``
    nodes, at most ``depth`` deep, for the pair's rank law at the sampling temperature, read from the
    file ``rank_law``; ``""``: the default pair's shipped laws; :mod:`quickdraft.decoding.tree_shapes`).
    ``cd_alpha`` and ``cd_beta`` are contrastive decoding's plausibility cut α and amateur weight β
    (:class:`quickdraft.verification.rules.Contrastive`) of ``cd`` and ``scd``.
    ``phrase_len``, ``phrase_pool`` and ``phrase_max_draft`` are ``phrase_sd``'s
    :class:`quickdraft.decoding.phrase.PhraseConfig` (longest phrase, phrases per row, draft tokens per step).
    """
    if name not in METHOD_NAMES:
        raise QuickdraftError(f"unknown method {name!r}; choose one of {', '.join(METHOD_NAMES)}")
    if drafts not in DRAFT_MODES:
        raise QuickdraftError(f"unknown drafts {drafts!r}; choose one of {', '.join(DRAFT_MODES)}")
    if drafts != "auto" and name not in ("fsd", "typical"):
        raise QuickdraftError(f"drafts={drafts} applies to fsd and typical only (method {name!r} drafts by its own rule)")
    from quickdraft.verification import rules

    def fuzzy() -> rules.Fuzzy:
        greedy_drafts = {"auto": None, "greedy": True, "sampled": False}[drafts]
        return rules.Fuzzy(divergence=divergence, threshold=threshold, top_k=divergence_top_k, top_p=divergence_top_p,
                           use_raw=fsd_raw,
                           hybrid=hybrid, greedy_drafts=greedy_drafts)

    if policy == "auto":  # the cost policy where a step may be a plain step
        policy = "cost" if may_skip_drafting(name, candidates) else "constant"
    pol = build_policy(policy, k, head, stop_threshold)
    if policy == "cost" and not may_skip_drafting(name, candidates):
        chains = ", ".join(n for n in METHOD_NAMES if may_skip_drafting(n))
        raise QuickdraftError(f"--policy cost chooses between drafting a chain and a plain step; {name} has no such "
                              f"choice (use it with {chains}; ersd with one candidate)")
    if name == "ar":
        return MethodSpec(name, "ar", default_rule(sampling), pol, needs_draft=False)
    if name == "amusd":  # the draft model drafts the next block during verification
        if policy != "constant":
            raise QuickdraftError(f"amusd drafts a constant K while the target verifies; use --policy constant, "
                                  f"not {policy!r}")
        return MethodSpec(name, name, default_rule(sampling), pol, needs_draft=True)
    if name == "phrase_sd":
        from quickdraft.decoding.phrase import PhraseConfig

        config = PhraseConfig(max_phrase=phrase_len, pool_size=phrase_pool, max_draft=phrase_max_draft)
        return MethodSpec(name, name, default_rule(sampling), pol, needs_draft=True, phrase=config)
    if name in ("cd", "scd"):  # the draft model is the amateur; greedy: exact match against cd's argmax
        rule = rules.Contrastive(alpha=cd_alpha, beta=cd_beta, greedy_drafts=sampling.greedy)
        return MethodSpec(name, name, rule, pol, needs_draft=True)
    if name in ("sd", "ngram", "ngram_sd", "rest", "rest_sd"):
        return MethodSpec(name, name, default_rule(sampling), pol, needs_draft=name not in ("ngram", "rest"),
                          needs_datastore=name in ("rest", "rest_sd"))
    if name == "tree":
        from quickdraft.decoding.tree import TreeConfig, check_combination

        from quickdraft.decoding.tree_shapes import TREE_SHAPES, RankLawFile, optimal_tree_config

        if tree_shape not in TREE_SHAPES:
            raise QuickdraftError(f"unknown tree shape {tree_shape!r}; choose one of {', '.join(TREE_SHAPES)}")
        if tree_shape == "optimal":  # the static Tunstall tree of the pair's rank law
            if tree_rule != "ersd":
                raise QuickdraftError("tree shape 'optimal' is a race tree: use it with rule ersd")
            law = RankLawFile.load(rank_law).at(sampling.temperature).law
            config = optimal_tree_config(law, tree_budget, max_depth=depth)
            rule = rules.ExponentialRace(seed=seed, candidates=config.topk)
            return MethodSpec(name, "tree", rule, pol, needs_draft=True, tree=config, verifier=verifier)
        if tree_rule == "ersd":  # race candidates unless another scheme is asked for (any is lossless)
            scheme = "race" if tree_sampling == "topk" else tree_sampling
            config = TreeConfig(depth=depth, topk=topk, budget=tree_budget, scheme=scheme)
            rule = rules.ExponentialRace(seed=seed, candidates=topk)
            return MethodSpec(name, "tree", rule, pol, needs_draft=True, tree=config, verifier=verifier)
        config = TreeConfig(depth=depth, topk=topk, budget=tree_budget, scheme=tree_sampling)
        if not sampling.greedy:
            check_combination(tree_sampling, verifier)
        if tree_rule == "fsd":
            rule = fuzzy()
        elif tree_rule == "lossless":
            rule = default_rule(sampling)
        else:
            raise QuickdraftError(f"unknown tree rule {tree_rule!r}; choose lossless, fsd or ersd")
        return MethodSpec(name, "tree", rule, pol, needs_draft=True, tree=config, verifier=verifier)
    if name == "fsd":
        rule = fuzzy()
    elif name == "typical":
        rule = rules.Typical(epsilon=epsilon, delta=delta, greedy_drafts=drafts == "greedy")
    elif name == "lantern":
        rule = rules.Latent(k=lantern_k, delta=lantern_delta)
    else:  # ersd
        rule = rules.ExponentialRace(seed=seed, candidates=candidates)
        if candidates > 1:  # the draft's n earliest arrivals at each depth: a tree of depth K
            from quickdraft.decoding.tree import TreeConfig

            if policy != "constant":
                raise QuickdraftError("ERSD with candidates > 1 runs on a tree of fixed depth K: use --policy constant")
            config = TreeConfig(depth=k, topk=candidates, budget=tree_budget, scheme="race")
            return MethodSpec(name, "tree", rule, pol, needs_draft=True, tree=config)
    return MethodSpec(name, engine_method_of(name, candidates), rule, pol, needs_draft=True)
