"""How the n drafts of one multi-draft step are drawn from the draft distribution.

Each scheme returns :class:`Drafts`: the ``n`` draft tokens per row *and* the conditional law
each one was drawn from given the earlier ones,

.. math::

    q_i(\\cdot) = \\Pr[x_i = \\cdot \\mid x_1, \\dots, x_{i-1}],

which is exactly what a recursive verifier needs at step ``i``. A verifier that works from these
proposals can never test a draft against a law it was not drawn from.

Schemes (``q`` = ``draft_probs``):

``with_replacement``
    ``x_1 … x_n`` i.i.d. from ``q``; ``q_i = q``.
``without_replacement``
    Sequential sampling without replacement: ``x_i`` from ``q`` restricted to
    ``V \\ {x_1 … x_{i-1}}`` and renormalised, which is ``q_i``. Drawn in one shot as an
    exponential race (``argsort`` of ``E_x / q(x)``, ``E_x ~ Exp(1)``), the Gumbel-top-k trick of
    Kool et al. 2019, whose sorted order has exactly the sequential law.
``greedy``
    Hu et al. 2025 ("Towards Optimal Multi-draft Speculative Decoding", ICLR): the ``n − 1``
    most likely draft tokens ``T`` deterministically (ties towards the lowest id), then one token
    from ``q_R = q·1_R / q(R)``, ``R = V \\ T``. The proposal of a top token is a point mass
    ``δ_{x_i}``; the last proposal is ``q_R``.

Both schemes without replacement need ``n ≤ |supp q|`` (checked by the caller).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quickdraft.verification.sampling import sample_rows


@dataclass
class Drafts:
    """Drafts of one step and the laws they were drawn from.

    Attributes
    ----------
    ids:
        ``[B, n]`` int64 draft tokens, in drawing order.
    proposals:
        ``n`` tensors ``[B, V]`` float64: ``proposals[i]`` is the law of ``ids[:, i]`` given
        ``ids[:, :i]`` (rows sum to 1; the same tensor object may repeat).
    """

    ids: torch.Tensor
    proposals: list[torch.Tensor]


def _remove(probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``probs [B, V]`` with the tokens ``ids [B, k]`` zeroed and each row renormalised."""
    out = probs.scatter(-1, ids, 0.0)
    return out / out.sum(dim=-1, keepdim=True)


def draft_with_replacement(draft_probs: torch.Tensor, num_drafts: int, generator: torch.Generator | None) -> Drafts:
    """``num_drafts`` i.i.d. draws per row from ``draft_probs [B, V]`` (float64)."""
    ids = torch.stack([sample_rows(draft_probs, generator) for _ in range(num_drafts)], dim=-1)  # [B, n]
    return Drafts(ids=ids, proposals=[draft_probs] * num_drafts)


def draft_without_replacement(
    draft_probs: torch.Tensor, num_drafts: int, generator: torch.Generator | None
) -> Drafts:
    """``num_drafts`` distinct tokens per row, sequentially without replacement from ``draft_probs [B, V]``.

    Exponential race: with ``E_x ~ Exp(1)`` i.i.d., the token with the smallest ``E_x / q(x)`` is
    distributed as ``q``, and the remaining keys are again an exponential race over the rest of
    the vocabulary (memorylessness), so the ``n`` smallest keys in order are a sequential draw
    without replacement.
    """
    noise = torch.empty_like(draft_probs).exponential_(generator=generator)  # [B, V]
    keys = torch.where(draft_probs > 0, noise / draft_probs, torch.full_like(noise, float("inf")))
    ids = torch.topk(keys, num_drafts, dim=-1, largest=False, sorted=True).indices  # [B, n]
    proposals = [draft_probs]
    for i in range(1, num_drafts):
        proposals.append(_remove(draft_probs, ids[:, :i]))
    return Drafts(ids=ids, proposals=proposals)


def draft_greedy(draft_probs: torch.Tensor, num_drafts: int, generator: torch.Generator | None) -> Drafts:
    """Top ``num_drafts − 1`` tokens of ``draft_probs [B, V]`` plus one draw from the renormalised rest."""
    b, v = draft_probs.shape
    # n - 1 argmax passes: torch.argmax returns the first maximal index, so ties go to the lowest id
    masked = draft_probs.clone()
    top = torch.empty(b, num_drafts - 1, dtype=torch.long, device=draft_probs.device)  # [B, n-1]
    for i in range(num_drafts - 1):
        top[:, i] = masked.argmax(dim=-1)
        masked.scatter_(-1, top[:, i : i + 1], -1.0)
    rest = _remove(draft_probs, top)  # q_R [B, V]
    last = sample_rows(rest, generator).unsqueeze(-1)  # [B, 1]
    ids = torch.cat([top, last], dim=-1)  # [B, n]
    point_masses = [
        torch.zeros(b, v, dtype=draft_probs.dtype, device=draft_probs.device).scatter_(-1, top[:, i : i + 1], 1.0)
        for i in range(num_drafts - 1)
    ]
    return Drafts(ids=ids, proposals=point_masses + [rest])


#: registry of draft schemes by their public name
SAMPLERS = {
    "with_replacement": draft_with_replacement,
    "without_replacement": draft_without_replacement,
    "greedy": draft_greedy,
}
