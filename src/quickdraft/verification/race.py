"""Shared randomness for exponential races (ERSD, Kobus & Gündüz 2025).

Sampling by exponential race
----------------------------
Give every token ``v`` an arrival time :math:`E_v \\sim \\mathrm{Exp}(1)`, independently. Then

.. math::

    W(p) = \\arg\\min_v \\frac{E_v}{p(v)} \\quad\\text{is distributed exactly as } p,

because :math:`E_v / p(v) \\sim \\mathrm{Exp}(p(v))` and the first arrival among independent
exponential clocks with rates :math:`p(v)` is ``v`` with probability :math:`p(v) / \\sum_u p(u)`
(the Gumbel-max trick written with :math:`G_v = -\\log E_v`). Tokens with :math:`p(v) = 0` never win.

If the draft and the target race with the *same* arrival times, the draft's winner
:math:`W(q)` equals the target's winner :math:`W(p)` with high probability when ``q ≈ p``
(Kobus & Gündüz, "Speculative Sampling via Exponential Races", Findings of ACL 2025,
arXiv:2504.15475). Chain ERSD accepts a drafted token iff it is the target's winner at that
position, and emits the target's winner at the first mismatch; the output is therefore token for
token the target's own race sample — whatever the drafter proposed.

Counter-based arrival times
---------------------------
The arrival times of one (seed, row, absolute position) are regenerated on demand from a 64-bit
key, never stored across steps:

* ``key = mix(mix(mix(seed + γ) + row) + position)`` (:func:`race_keys`), where ``mix`` is the
  SplitMix64 finaliser (Steele, Lea & Flood, "Fast splittable pseudorandom number generators",
  OOPSLA 2014) and ``γ = 0x9E3779B97F4A7C15``. For a fixed seed and row, distinct positions give
  distinct keys (``mix`` is a bijection of 64-bit words).
* token ``v``'s 64-bit word is ``mix(key + (v + 1)·γ)`` — exactly the ``v``-th output of a SplitMix64
  stream started at ``key``; its top 52 bits give ``u ∈ (0, 1)`` and ``E_v = −log(1 − u)``
  (computed in float64, returned as float32).

Everything is vectorised over the leading dimensions, identical on every device, and needs no
``torch.Generator``. Regenerating ``[B, K+1, V]`` arrivals costs about 10 ms for ``B = 1, K = 8,
V = 151,936`` on one CPU core (see the test suite for the measurement).
"""

from __future__ import annotations

import torch

from quickdraft.errors import QuickdraftError

_MASK64 = (1 << 64) - 1


def _signed(c: int) -> int:
    """A 64-bit unsigned constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= (1 << 63) else c


#: SplitMix64 increment (golden ratio) and finaliser multipliers, as int64 bit patterns
GAMMA = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)

#: elements processed at once when regenerating arrival times: small enough to stay in cache
#: (the hash is a dozen elementwise passes, memory-bound on whole tensors), large enough to keep
#: the Python overhead per chunk negligible
_CHUNK_ELEMENTS = 1 << 17


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    # a 0-d tensor shift amount takes torch's vectorised path; the mask clears the sign copies
    return torch.bitwise_right_shift(x, torch.tensor(s, device=x.device)) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser on int64 tensors (wrapping arithmetic), a bijection of 64-bit words.

    ``x ^= x >>> 30; x *= 0xBF58476D1CE4E5B9; x ^= x >>> 27; x *= 0x94D049BB133111EB; x ^= x >>> 31``.
    Returns a new tensor.
    """
    x = x ^ _srl(x, 30)
    x.mul_(_M1)
    x ^= _srl(x, 27)
    x.mul_(_M2)
    x ^= _srl(x, 31)
    return x


def mix64_int(x: int) -> int:
    """Reference implementation of :func:`mix64` on Python integers (unsigned 64-bit result)."""
    x &= _MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def race_keys(seed: int | torch.Tensor, row_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """64-bit keys of the arrival times at (seed, row, absolute position).

    Parameters
    ----------
    seed:
        Any Python integer (reduced modulo 2**64), or an int64 tensor of seeds (their 64-bit patterns,
        :func:`seed_words`) broadcastable against ``row_ids``: one seed per row.
    row_ids:
        int64 stable ids of the sequences, broadcastable against ``positions``.
    positions:
        int64 absolute positions (number of tokens before the token being raced for).

    Returns
    -------
    torch.Tensor
        int64 keys with the broadcast shape of ``row_ids`` and ``positions``.
    """
    if isinstance(seed, torch.Tensor):
        if seed.dtype != torch.int64:
            raise QuickdraftError(f"race seeds must be an int64 tensor, got {seed.dtype}")
        h = mix64(seed.to(positions.device) + GAMMA)  # wrapping, as the integer branch
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise QuickdraftError(f"race seed must be an integer, got {seed!r}")
    else:
        s = _signed(((seed & _MASK64) + 0x9E3779B97F4A7C15) & _MASK64)
        h = mix64(torch.full((), s, dtype=torch.int64, device=positions.device))
    h = mix64(h + row_ids.long())
    return mix64(h + positions.long())


def seed_words(seeds) -> torch.Tensor:
    """Python integer seeds as the int64 tensor of their 64-bit patterns (each reduced modulo 2**64),
    for :func:`race_keys`: ``race_keys(seed_words([s]), ...)`` equals ``race_keys(s, ...)``."""
    seeds = list(seeds)
    for s in seeds:
        if isinstance(s, bool) or not isinstance(s, int):
            raise QuickdraftError(f"race seed must be an integer, got {s!r}")
    return torch.tensor([_signed(s & _MASK64) for s in seeds], dtype=torch.int64)


def _token_steps(vocab_size: int, device: torch.device) -> torch.Tensor:
    """``(v + 1)·γ`` for every token, int64 ``[V]`` (wrapping)."""
    return torch.arange(1, vocab_size + 1, dtype=torch.int64, device=device).mul_(GAMMA)


def arrival_times(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Arrival times ``E [..., V]`` (float32, i.i.d. Exp(1)) for int64 ``keys [...]``.

    Deterministic in ``keys``: the same key always yields the same vector.
    """
    if vocab_size < 1:
        raise QuickdraftError(f"vocab_size must be >= 1, got {vocab_size}")
    steps = _token_steps(vocab_size, keys.device)
    flat = keys.reshape(-1).long()
    out = torch.empty((flat.shape[0], vocab_size), dtype=torch.float32, device=keys.device)
    rows = max(1, _CHUNK_ELEMENTS // vocab_size)
    for start in range(0, flat.shape[0], rows):
        out[start : start + rows] = _arrivals(flat[start : start + rows], steps)
    return out.reshape(*keys.shape, vocab_size)


def _arrivals(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Arrival times ``[R, V]`` for ``keys [R]`` given the token steps ``[V]`` (no chunking)."""
    x = mix64(keys.unsqueeze(-1) + steps)  # [R, V] the v-th SplitMix64 outputs of each key
    # u = (top 52 bits + 1/2) / 2^52, exactly representable, in [2^-53, 1 - 2^-53]; E = -log(1 - u)
    # is then finite and > 0 and keeps full relative precision near 0, where the winners are
    u = _srl(x, 12).double().add_(0.5).mul_(2.0**-52)
    return u.neg_().log1p_().neg_().float()


def _scores(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``p(v) / E_v`` for ``probs [R, V]``, ``keys [R]`` — larger is earlier: ``argmax`` of the
    score is ``argmin`` of ``E_v / p(v)``."""
    return probs / _arrivals(keys.long(), _token_steps(probs.shape[-1], probs.device))


def _chunked(fn, probs: torch.Tensor, keys: torch.Tensor, width: int) -> torch.Tensor:
    """Apply ``fn(probs_rows [R, V], keys [R]) -> [R, width]`` over row chunks to bound memory."""
    v = probs.shape[-1]
    lead = probs.shape[:-1]
    if keys.shape != lead:
        raise QuickdraftError(f"keys must have shape {tuple(lead)} (the probs' leading dims), got {tuple(keys.shape)}")
    flat_p = probs.reshape(-1, v)
    flat_k = keys.reshape(-1)
    rows = max(1, _CHUNK_ELEMENTS // max(v, 1))
    out = torch.empty((flat_p.shape[0], width), dtype=torch.long, device=probs.device)
    for start in range(0, flat_p.shape[0], rows):
        stop = start + rows
        out[start:stop] = fn(flat_p[start:stop], flat_k[start:stop])
    return out.reshape(*lead, width)


def race_sample(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The race winner ``argmin_v E_v / p(v)`` for every row.

    Parameters
    ----------
    probs:
        ``[..., V]`` probabilities (need not be normalised; at least one positive entry per row).
    keys:
        ``[...]`` int64 keys from :func:`race_keys`.

    Returns
    -------
    torch.Tensor
        ``[...]`` int64 token ids, each distributed as its row of ``probs`` when the keys are
        distinct.
    """
    return _chunked(lambda p, k: _scores(p, k).argmax(dim=-1, keepdim=True), probs, keys, 1).squeeze(-1)


def race_candidates(probs: torch.Tensor, keys: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` earliest arrivals under ``probs``: tokens sorted by ``E_v / p(v)`` ascending.

    Candidate 0 is :func:`race_sample`'s winner. Used by ERSD with several candidates per
    position: the draft proposes its ``n`` earliest arrivals and the target's winner is looked up
    among them (:func:`accept_race_branches`).

    Parameters
    ----------
    probs:
        ``[..., V]`` the draft's probabilities.
    keys:
        ``[...]`` int64 keys.
    n:
        Number of candidates, ``1 <= n <= V``.

    Returns
    -------
    torch.Tensor
        ``[..., n]`` int64 token ids.
    """
    v = probs.shape[-1]
    if int(n) != n or not 1 <= n <= v:
        raise QuickdraftError(f"number of race candidates must be an integer in [1, {v}], got {n!r}")
    return _chunked(lambda p, k: _scores(p, k).topk(int(n), dim=-1).indices, probs, keys, int(n))


def race_order(probs: torch.Tensor, arrivals: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` earliest arrivals under ``probs`` given the arrival times, and how late each came.

    Same candidates as :func:`race_candidates` when ``arrivals`` are :func:`arrival_times` of the
    same keys; taking the arrival times lets several distributions race with one position's
    noise without regenerating it (every node of a token tree at one depth).

    Parameters
    ----------
    probs:
        ``[..., V]`` probabilities.
    arrivals:
        ``[..., V]`` arrival times ``E`` (broadcast against ``probs``).
    n:
        Number of candidates, ``1 <= n <= V``.

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        ``ids [..., n]`` sorted by ``E_v / p(v)`` ascending, and ``log_margin [..., n]``
        ``= log((p(c_0)/E_{c_0}) / (p(c_j)/E_{c_j})) <= 0``: 0 for the winner ``c_0``, more negative
        the later candidate ``j`` arrived (``-inf`` for tokens with ``p = 0``, which never arrive).
    """
    v = probs.shape[-1]
    if int(n) != n or not 1 <= n <= v:
        raise QuickdraftError(f"number of race candidates must be an integer in [1, {v}], got {n!r}")
    top = (probs / arrivals).topk(int(n), dim=-1)  # [..., n] rates p/E, largest (earliest) first
    return top.indices, top.values.log() - top.values[..., :1].log()


def accept_race_branches(candidate_ids: torch.Tensor, target_winners: torch.Tensor):
    """ERSD verification of ``n`` draft branches of ``K`` tokens each (a small token tree).

    Branch ``j`` of row ``b`` is the token path ``candidate_ids[b, :, j]``; branches may share
    prefixes (a trie). ``target_winners[b, i, j]`` is the target's race winner at depth ``i`` after
    the prefix ``candidate_ids[b, :i, j]`` (depth ``K`` is the bonus position); branches with the
    same prefix have the same winner there.

    Walking down from the root, the *alive* branches are those whose first ``i`` tokens equal the
    target's winners so far (they share that prefix, hence the winner at depth ``i``). Depth ``i``
    is accepted iff some alive branch has the target's winner as its token; the walk continues
    down those branches. At the first depth with no match, the target's winner is emitted (the
    recovered token); after ``K`` accepted depths the winner at depth ``K`` (the bonus token).
    Whatever the candidates, the emitted tokens are exactly the target's race winners along the
    emitted path (drafter invariance).

    Worked example (one row, K = 2, n = 3): branches ``[7, 1], [7, 4], [2, 9]`` (``7`` and ``2``
    are the draft's two earliest arrivals at depth 0; branches 0 and 1 share the prefix ``[7]``).
    Target winners: depth 0 → ``7`` for every branch; depth 1 after ``[7]`` → ``4``; depth 2 after
    ``[7, 4]`` → ``5``. Depth 0: branches 0, 1 match (alive). Depth 1: branch 1 matches. All
    accepted: output ``[7, 4, 5]``, ``num_accepted = 2``, ``branch = 1``.

    Parameters
    ----------
    candidate_ids:
        ``[B, K, n]`` int64 draft tokens, branch ``j`` in column ``j``.
    target_winners:
        ``[B, K+1, n]`` int64 target race winners after each branch's prefix.

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor, torch.Tensor]
        ``output_ids [B, K+1]`` (accepted tokens, then the recovered-or-bonus token, then ``-1``),
        ``num_accepted [B]`` and ``branch [B]`` (the lowest-index branch that matched every
        accepted depth; ``0`` when nothing was accepted).
    """
    if candidate_ids.dim() != 3:
        raise QuickdraftError(f"candidate_ids must be [B, K, n], got shape {tuple(candidate_ids.shape)}")
    b, k, n = candidate_ids.shape
    if target_winners.shape != (b, k + 1, n):
        raise QuickdraftError(
            f"target_winners must be [B={b}, K+1={k + 1}, n={n}], got shape {tuple(target_winners.shape)}"
        )
    device = candidate_ids.device
    match = candidate_ids == target_winners[:, :k]  # [B, K, n]
    # a branch is alive at depth i+1 iff it matched at every depth <= i
    alive_after = match.long().cumprod(dim=1).bool()  # [B, K, n]
    depth_ok = alive_after.any(dim=-1)  # [B, K]
    num_accepted = depth_ok.long().cumprod(dim=1).sum(dim=1)  # [B]
    # the branch followed: lowest index alive after the last accepted depth (any branch if none)
    rows = torch.arange(b, device=device)
    last_alive = torch.ones((b, n), dtype=torch.bool, device=device)
    if k > 0:
        at = (num_accepted - 1).clamp_min(0)
        last_alive = torch.where((num_accepted > 0).unsqueeze(1), alive_after[rows, at], last_alive)
    branch = last_alive.long().argmax(dim=-1)  # first True
    out = torch.full((b, k + 1), -1, dtype=torch.long, device=device)
    if k > 0:
        path = candidate_ids[rows, :, branch]  # [B, K]
        keep = torch.arange(k, device=device).unsqueeze(0) < num_accepted.unsqueeze(1)
        out[:, :k] = torch.where(keep, path, out[:, :k])
    out[rows, num_accepted] = target_winners[rows, num_accepted, branch]
    return out, num_accepted, branch
