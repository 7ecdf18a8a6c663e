"""Theory toolkit: optimal and achieved acceptance rates, chain and race formulas (numpy/scipy only).

All functions take distributions as 1-D arrays ``[V]`` (numpy, lists or torch tensors) and return
Python floats; bad input raises :class:`quickdraft.errors.QuickdraftError`. Derivations are in
``docs/theory.md``.
"""

from quickdraft.theory.chain import best_draft_length, chain_acceptance, expected_tokens_per_call, speedup
from quickdraft.theory.curves import acceptance_curves
from quickdraft.theory.ersd import (
    DraftTree,
    draft_tree_expected_tokens,
    ersd_expected_tokens,
    ersd_kl_lower_bound,
    ersd_upper_bound,
    optimal_draft_tree,
    race_log_rank_bound,
    race_rank_distribution,
    race_rank_entropy,
)
from quickdraft.theory.multidraft import (
    GreedyPlan,
    draft_tuple_distribution,
    greedy_optimal_plan,
    kseq_rho,
    optimal_acceptance,
    optimal_acceptance_lp,
    verifier_acceptance,
)
from quickdraft.theory.races import (
    race_acceptance,
    race_chain_speedup,
    race_expected_tokens,
    race_tree_size,
    race_tree_speedup,
)
from quickdraft.theory.rrs_wor import RrsWorInterval, rrs_without_replacement_interval

__all__ = [
    "DraftTree",
    "GreedyPlan",
    "RrsWorInterval",
    "acceptance_curves",
    "best_draft_length",
    "chain_acceptance",
    "draft_tree_expected_tokens",
    "draft_tuple_distribution",
    "ersd_expected_tokens",
    "ersd_kl_lower_bound",
    "ersd_upper_bound",
    "expected_tokens_per_call",
    "greedy_optimal_plan",
    "kseq_rho",
    "optimal_acceptance",
    "optimal_acceptance_lp",
    "optimal_draft_tree",
    "race_acceptance",
    "race_chain_speedup",
    "race_expected_tokens",
    "race_log_rank_bound",
    "race_rank_distribution",
    "race_rank_entropy",
    "race_tree_size",
    "race_tree_speedup",
    "rrs_without_replacement_interval",
    "speedup",
    "verifier_acceptance",
]
