"""pass@1 with binomial confidence intervals, and paired comparisons of two methods.

With one completion per problem (greedy or a single sample), pass@1 is the share of problems
whose completion passes its tests: ``k`` passes out of ``n`` problems, an estimate of a binomial
proportion. Two methods run on the *same* problems are compared on the problems where they
disagree (McNemar), which removes the between-problem variance that dominates unpaired intervals.

References
----------
.. [1] E. B. Wilson, "Probable inference, the law of succession, and statistical inference",
   JASA 22 (1927).
.. [2] C. J. Clopper and E. S. Pearson, "The use of confidence or fiducial limits illustrated in
   the case of the binomial", Biometrika 26 (1934).
.. [3] Q. McNemar, "Note on the sampling error of the difference between correlated proportions
   or percentages", Psychometrika 12 (1947); the exact form conditions on the discordant pairs.
.. [4] M. Chen et al., "Evaluating Large Language Models Trained on Code" (HumanEval), 2021.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from scipy import stats

from quickdraft.errors import QuickdraftError

IntervalMethod = Literal["wilson", "exact"]


@dataclass(frozen=True)
class PassRate:
    """pass@1 with a confidence interval.

    Attributes
    ----------
    passed, total:
        Problems passed and problems attempted (unparseable answers count as attempted and failed).
    rate:
        ``passed / total``.
    low, high:
        Two-sided confidence interval for the true pass rate.
    confidence:
        Confidence level of the interval, e.g. 0.95.
    method:
        ``"wilson"`` (score interval [1]_) or ``"exact"`` (Clopper–Pearson [2]_).
    """

    passed: int
    total: int
    rate: float
    low: float
    high: float
    confidence: float
    method: IntervalMethod

    def __str__(self) -> str:
        pct = 100 * self.confidence
        return (
            f"{100 * self.rate:.1f}% ({self.passed}/{self.total}; {pct:g}% CI "
            f"{100 * self.low:.1f}–{100 * self.high:.1f})"
        )


@dataclass(frozen=True)
class PairedComparison:
    """Two methods on the same problems (method A vs method B).

    Attributes
    ----------
    total:
        Number of problems both methods were run on.
    both, only_a, only_b, neither:
        The 2×2 table: passed by both, by A only, by B only, by neither.
    rate_a, rate_b:
        pass@1 of each method.
    difference:
        ``rate_a − rate_b = (only_a − only_b) / total``.
    p_value:
        Two-sided exact McNemar p-value [3]_: under H0 (equal pass rates) each discordant problem
        is equally likely to favour A or B, so ``only_a ~ Binomial(only_a + only_b, 1/2)``.
        1.0 when there are no discordant problems.
    """

    total: int
    both: int
    only_a: int
    only_b: int
    neither: int
    rate_a: float
    rate_b: float
    difference: float
    p_value: float


def wilson_interval(passed: int, total: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion [1]_.

    .. math::

        \\frac{\\hat p + \\frac{z^2}{2n} \\pm z \\sqrt{\\frac{\\hat p (1-\\hat p)}{n} + \\frac{z^2}{4n^2}}}
             {1 + \\frac{z^2}{n}},
        \\qquad z = \\Phi^{-1}\\left(1 - \\frac{1-\\text{confidence}}{2}\\right).

    Unlike the Wald interval it stays inside [0, 1] and is sensible at 0/n and n/n.

    Examples
    --------
    >>> [round(x, 4) for x in wilson_interval(0, 10)]
    [0.0, 0.2775]
    """
    _check_counts(passed, total, confidence)
    z = float(stats.norm.ppf(1 - (1 - confidence) / 2))
    p_hat = passed / total
    denom = 1 + z * z / total
    centre = (p_hat + z * z / (2 * total)) / denom
    half = z * math.sqrt(p_hat * (1 - p_hat) / total + z * z / (4 * total * total)) / denom
    # At 0/n and n/n the bound is exactly 0 or 1; avoid returning 0.9999999999999999.
    low = 0.0 if passed == 0 else max(0.0, centre - half)
    high = 1.0 if passed == total else min(1.0, centre + half)
    return low, high


def clopper_pearson_interval(passed: int, total: int, confidence: float = 0.95) -> tuple[float, float]:
    """Exact (Clopper–Pearson) interval [2]_, via :meth:`scipy.stats.binomtest(...).proportion_ci`.

    It inverts two one-sided binomial tests, so its coverage is at least ``confidence`` for every
    true rate (conservative).
    """
    _check_counts(passed, total, confidence)
    ci = stats.binomtest(passed, total).proportion_ci(confidence_level=confidence, method="exact")
    return float(ci.low), float(ci.high)


def pass_at_1(
    results: Sequence[bool] | Mapping[str, bool], confidence: float = 0.95, method: IntervalMethod = "wilson"
) -> PassRate:
    """pass@1 of one method with a binomial confidence interval.

    Parameters
    ----------
    results:
        One pass/fail per problem, as a sequence or a mapping from problem id to pass/fail.
    confidence:
        Two-sided confidence level in (0, 1).
    method:
        ``"wilson"`` or ``"exact"`` (Clopper–Pearson).

    Examples
    --------
    >>> str(pass_at_1([True] * 3 + [False]))
    '75.0% (3/4; 95% CI 30.1–95.4)'
    """
    values = list(results.values()) if isinstance(results, Mapping) else list(results)
    passed, total = sum(bool(v) for v in values), len(values)
    if method == "wilson":
        low, high = wilson_interval(passed, total, confidence)
    elif method == "exact":
        low, high = clopper_pearson_interval(passed, total, confidence)
    else:
        raise QuickdraftError(f"unknown interval method {method!r}; choose 'wilson' or 'exact'")
    return PassRate(passed, total, passed / total, low, high, confidence, method)


def compare_paired(
    results_a: Sequence[bool] | Mapping[str, bool], results_b: Sequence[bool] | Mapping[str, bool]
) -> PairedComparison:
    """Compare two methods run on the same problems with the exact McNemar test [3]_.

    Parameters
    ----------
    results_a, results_b:
        Pass/fail per problem: two sequences of equal length in the same problem order, or two
        mappings from problem id to pass/fail with the same ids.

    Examples
    --------
    >>> cmp = compare_paired([True] * 9 + [False], [False] * 9 + [True])
    >>> (cmp.only_a, cmp.only_b, round(cmp.p_value, 6))
    (9, 1, 0.021484)
    """
    a, b = _paired_lists(results_a, results_b)
    both = sum(x and y for x, y in zip(a, b))
    only_a = sum(x and not y for x, y in zip(a, b))
    only_b = sum(y and not x for x, y in zip(a, b))
    neither = len(a) - both - only_a - only_b
    discordant = only_a + only_b
    p_value = 1.0 if discordant == 0 else float(stats.binomtest(only_a, discordant, 0.5).pvalue)
    total = len(a)
    return PairedComparison(
        total=total,
        both=both,
        only_a=only_a,
        only_b=only_b,
        neither=neither,
        rate_a=(both + only_a) / total,
        rate_b=(both + only_b) / total,
        difference=(only_a - only_b) / total,
        p_value=min(1.0, p_value),
    )


@dataclass(frozen=True)
class PairedMeanDifference:
    """A per-problem score of two methods on the same problems (A − B), with a t interval.

    Attributes
    ----------
    total:
        Number of problems both methods were run on.
    mean_a, mean_b:
        Mean score of each method over the problems (each problem weighs the same).
    difference:
        ``mean_a − mean_b``, the mean of the per-problem differences.
    low, high:
        Two-sided confidence interval for the mean difference (Student's t on the per-problem
        differences, ``total − 1`` degrees of freedom).
    p_value:
        Two-sided paired t-test p-value for a zero mean difference.
    confidence:
        Confidence level of the interval.
    """

    total: int
    mean_a: float
    mean_b: float
    difference: float
    low: float
    high: float
    p_value: float
    confidence: float


def compare_paired_means(
    scores_a: Mapping[str, float], scores_b: Mapping[str, float], confidence: float = 0.95
) -> PairedMeanDifference:
    """Compare a continuous per-problem score (e.g. the target's mean log-likelihood of each output)
    of two methods run on the same problems, by the paired t-test on the per-problem differences.

    Pairing removes the between-problem variance, which dominates: prompts differ far more in how
    predictable their answers are than two decoding methods differ on one prompt.

    Examples
    --------
    >>> a = {"a": -0.5, "b": -0.7, "c": -0.9, "d": -0.6, "e": -0.8}
    >>> b = {"a": -0.4, "b": -0.5, "c": -0.6, "d": -0.4, "e": -0.6}
    >>> cmp = compare_paired_means(a, b)
    >>> round(cmp.difference, 4), cmp.high < 0
    (-0.2, True)
    """
    if not 0 < confidence < 1:
        raise QuickdraftError(f"confidence must be in (0, 1), got {confidence}")
    order = _common_ids(scores_a, scores_b)
    a = [float(scores_a[i]) for i in order]
    b = [float(scores_b[i]) for i in order]
    bad = [i for i, x, y in zip(order, a, b) if not (math.isfinite(x) and math.isfinite(y))]
    if bad:
        raise QuickdraftError(f"paired scores must be finite numbers; not for {bad[:3]}")
    if len(order) < 2:
        raise QuickdraftError(f"a paired t interval needs at least 2 problems, got {len(order)}")
    diffs = [x - y for x, y in zip(a, b)]
    n = len(diffs)
    mean = sum(diffs) / n
    if max(diffs) - min(diffs) <= 1e-12 * max(1.0, abs(mean)):  # no spread: the t statistic is undefined
        low = high = mean
        p_value = 1.0 if mean == 0 else 0.0
    else:
        test = stats.ttest_1samp(diffs, 0.0)
        ci = test.confidence_interval(confidence_level=confidence)
        low, high, p_value = float(ci.low), float(ci.high), float(test.pvalue)
    return PairedMeanDifference(
        total=n, mean_a=sum(a) / n, mean_b=sum(b) / n, difference=mean, low=low, high=high,
        p_value=p_value, confidence=confidence,
    )


def _common_ids(a: Mapping[str, object], b: Mapping[str, object]) -> list[str]:
    """The problem ids of two paired mappings, sorted; they must hold the same problems."""
    ids_a, ids_b = set(a), set(b)
    if ids_a != ids_b:
        raise QuickdraftError(
            f"paired comparison needs the same problems: {len(ids_a - ids_b)} only in A, "
            f"{len(ids_b - ids_a)} only in B (e.g. {sorted(ids_a ^ ids_b)[:3]})"
        )
    return sorted(ids_a)


def _paired_lists(
    results_a: Sequence[bool] | Mapping[str, bool], results_b: Sequence[bool] | Mapping[str, bool]
) -> tuple[list[bool], list[bool]]:
    if isinstance(results_a, Mapping) != isinstance(results_b, Mapping):
        raise QuickdraftError("pass both results as mappings (id -> passed) or both as sequences")
    if isinstance(results_a, Mapping):
        order = _common_ids(results_a, results_b)
        a, b = [bool(results_a[i]) for i in order], [bool(results_b[i]) for i in order]
    else:
        a, b = [bool(x) for x in results_a], [bool(x) for x in results_b]
        if len(a) != len(b):
            raise QuickdraftError(f"paired comparison needs equal lengths, got {len(a)} and {len(b)}")
    if not a:
        raise QuickdraftError("paired comparison needs at least one problem")
    return a, b


def _check_counts(passed: int, total: int, confidence: float) -> None:
    if total < 1:
        raise QuickdraftError("a pass rate needs at least one problem")
    if not 0 <= passed <= total:
        raise QuickdraftError(f"passed must be between 0 and total={total}, got {passed}")
    if not 0 < confidence < 1:
        raise QuickdraftError(f"confidence must be in (0, 1), got {confidence}")
