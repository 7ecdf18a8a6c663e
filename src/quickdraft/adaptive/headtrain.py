"""Training the SpecDec++ acceptance head (``quickdraft train-head``), on CPU.

Data (Huang, Guo & Wang 2024, Sec. 3.2 and their ``data/`` scripts), one example per response token:

1. **responses and labels, in lockstep** (:func:`lockstep_batch`) -- ``B`` training prompts
   (:mod:`quickdraft.adaptive.trainprompts`, default 16) are prefilled in both models, then target and
   draft decode together, one batched forward each per step (in float32 a forward over 16 rows
   costs ~2x one row on a CPU; in bf16 without native bf16 units it costs ~16x, hence
   :func:`run_training`'s float32 default). At step ``j`` both models condition on the
   *target's* prefix ``X_{<j}``: the target's distribution ``p_j`` gives the response token
   ``x_j ~ p_j`` (plain sampling, temperature 1 by default) and, with the draft's ``q_j``, the label.
   The draft samples ``y_j ~ q_j`` and the label is the exact acceptance probability of speculative
   sampling, ``a_j = min(1, p_j(y_j) / q_j(y_j))`` (:func:`acceptance_labels`; at temperature 0
   it is ``1[argmax q_j = argmax p_j]``), for every label temperature asked for (one head each).
   So no forward over ``prompt + X`` is ever repeated.
2. **mixed context** -- ``Z_j = y_j`` except at a random share ``r`` (default 15%) of positions where
   ``Z_j = x_j`` and no loss is taken (:func:`mix_tokens`), so the head sees prefixes of both kinds.
3. **features** -- the draft's cache is rolled back to the prompts and ``Z`` is fed (one batched
   forward per 32 columns); the feature of position ``j`` is the draft's last hidden state at token
   ``Z_j`` (the state the policy reads when ``Z_j`` is fed back to draft the next token). Next to
   the features the draft's own confidence at ``y_j`` is kept (top probability, entropy and the
   probability of ``y_j`` under the temperature-1 ``q_j``, :func:`quickdraft.decoding.head.confidence_features`):
   the optional second input of the head (``confidence_inputs``, default off: the paper's head reads
   the hidden state only) and the logistic baseline's only one.
4. **cache** -- every batch is saved under ``~/.cache/quickdraft/specdecpp/`` (:func:`build_dataset`),
   so an interrupted build resumes and retraining takes seconds.
5. **training** -- the draft model is frozen; the head minimises the weighted binary cross-entropy
   with soft labels (:func:`weighted_bce`)

   .. math::  \\ell = -\\frac{\\sum_j a_j \\log \\hat P_j + w (1 - a_j) \\log(1 - \\hat P_j)}{\\sum_j a_j + w (1 - a_j)}

   with rejection weight ``w`` (default 6). Its minimiser is ``P̂ = a / (a + w (1 − a))``, not
   ``a``: the weighted head under-predicts acceptance on purpose (it makes the policy stop earlier
   for the same ``h``); :func:`unweight` maps it back to a calibrated probability. With confidence
   inputs (``TrainConfig.confidence_inputs``) the head starts from the logistic baseline: its ``v``
   and ``c`` come from the baseline's fit, ``c`` shifted by ``−log w`` (the weighted loss's optimum
   for a well-specified logistic model), the hidden state's output weights start at zero, and
   training adds what the hidden state knows beyond the draft's confidence.

Prompts are split into training, validation and test prompts (whole prompts, not positions): the
validation positions choose the epoch, the test positions give the Brier scores and the reliability
plot. Baselines on the same test positions: the training-set mean (a constant), the test set's own
mean (the best constant, Brier = the labels' variance), and a logistic regression on the draft's
confidence (:func:`quickdraft.decoding.head.baseline_design`).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

import torch
import typer

from quickdraft.errors import QuickdraftError
from quickdraft.decoding.head import (
    NUM_CONFIDENCE_STATS,
    READS,
    AcceptanceHead,
    HeadMetadata,
    baseline_design,
    confidence_features,
    model_fingerprint,
    save_head,
)
from quickdraft.verification.sampling import SamplingParams, logits_to_probs

DEFAULT_HEAD_PATH = "models/heads/specdecpp-qwen2.5-coder-0.5b.pt"


@dataclass
class TrainConfig:
    """Settings of ``quickdraft train-head``.

    Attributes
    ----------
    num_prompts: training prompts (validation and test prompts included); at most 491 exist.
    max_new_tokens: longest target response.
    gen_batch: prompts decoded together, target and draft in lockstep (:func:`lockstep_batch`).
    response_temperature: temperature of the target's responses (0 = greedy).
    temperature: temperature of the draft samples and of the labels' ``p`` and ``q``.
    mix_ratio: share of positions that keep the target's token as context (no loss there).
    reject_weight: weight ``w`` of the rejection class in the loss.
    num_layers: residual layers of the head (the paper: 3).
    shared_blocks: every layer is the same block (the paper's code); False: one block per layer.
    epochs: training epochs (the validation-best epoch is kept).
    lr: AdamW learning rate (cosine-decayed to 0 over the epochs).
    weight_decay: AdamW weight decay.
    batch_size: positions per optimisation step.
    holdout: share of prompts held out (half validation, half test).
    seed: seeds prompts' sample, draft samples, mixing, split and initialisation.
    confidence_inputs: the head also reads the draft's confidence at the drafted token
        (``num_stats = 4``, :func:`quickdraft.decoding.head.baseline_design` of the examples' ``draft_stats``;
        ignored when the examples have none). False (the default) trains the paper's
        hidden-state-only head.
    reads: the draft state the head scores a token from (:data:`quickdraft.decoding.head.READS`):
        ``"fed"`` (the paper's; the state at ``Z_j`` in the mixed context) or ``"drawing"`` (the
        state whose logits drew ``y_j``, over the target's prefix ``X_<j``: :func:`drawing_states`;
        every position is a training position, the mixing does not touch that context).
    """

    num_prompts: int = 288
    max_new_tokens: int = 128
    gen_batch: int = 16
    response_temperature: float = 1.0
    temperature: float = 1.0
    mix_ratio: float = 0.15
    reject_weight: float = 6.0
    num_layers: int = 3
    shared_blocks: bool = True
    epochs: int = 30
    lr: float = 3e-4
    weight_decay: float = 0.1
    batch_size: int = 256
    holdout: float = 0.2
    seed: int = 0
    confidence_inputs: bool = False
    reads: str = "fed"

    def __post_init__(self) -> None:
        if self.reads not in READS:
            raise QuickdraftError(f"reads must be one of {', '.join(READS)}, got {self.reads!r}")
        if not 0.0 <= self.mix_ratio < 1.0:
            raise QuickdraftError(f"mix_ratio must be in [0, 1), got {self.mix_ratio}")
        if self.reject_weight <= 0:
            raise QuickdraftError(f"reject_weight must be > 0, got {self.reject_weight}")
        if not 0.0 < self.holdout < 1.0:
            raise QuickdraftError(f"holdout must be in (0, 1), got {self.holdout}")
        for name in ("num_prompts", "max_new_tokens", "gen_batch", "epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise QuickdraftError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0 or self.response_temperature < 0:
            raise QuickdraftError("temperatures must be >= 0")


@dataclass
class Examples:
    """Cached training data: one row per response position.

    Attributes
    ----------
    features: ``[N, H]`` draft hidden states (bf16).
    labels: ``[N]`` acceptance probabilities ``a_j`` (float32).
    loss_mask: ``[N]`` bool, False where the context token is the target's (no loss).
    groups: ``[N]`` int64 prompt index (for the held-out split).
    data_hash: SHA-256 over prompts, responses, draft samples and labels.
    draft_stats: ``[N, 3]`` the draft's confidence at ``y_j`` (:func:`quickdraft.decoding.head.confidence_features`),
        or None.
    temperature: the label temperature.
    drawing_features: ``[N, H]`` the draft's states that drew ``y_j`` (:func:`drawing_states`), or None.
    """

    features: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    groups: torch.Tensor
    data_hash: str
    draft_stats: Optional[torch.Tensor] = None
    temperature: float = 1.0
    drawing_features: Optional[torch.Tensor] = None

    def training_view(self, reads: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features [N, H], usable [N] bool)`` of a head that reads ``reads``: the fed states at the
        loss positions, or the drawing states at every position (the mixing never touches their
        context)."""
        if reads != "drawing":
            return self.features, self.loss_mask
        if self.drawing_features is None:
            raise QuickdraftError("a head on the drawing state needs the examples' drawing_features (build_dataset "
                                  "with reads='drawing')")
        return self.drawing_features, torch.ones_like(self.loss_mask)


# ---------------------------------------------------------------------------------------------
# pure pieces
# ---------------------------------------------------------------------------------------------


def acceptance_labels(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, generator: torch.Generator, greedy: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft one token per position and its exact acceptance probability.

    Parameters
    ----------
    target_probs, draft_probs:
        ``[n, V]`` next-token distributions of target and draft given the same prefixes.
    generator:
        Randomness of the draft samples.
    greedy:
        Draft the argmax instead of sampling (temperature 0).

    Returns
    -------
    ``(draft_ids [n], labels [n])`` with ``labels = min(1, p(y) / q(y))``.
    """
    if target_probs.shape != draft_probs.shape or target_probs.dim() != 2:
        raise QuickdraftError(f"need equal [n, V] shapes, got {tuple(target_probs.shape)} and {tuple(draft_probs.shape)}")
    if greedy:
        ids = draft_probs.argmax(dim=-1)
    else:
        ids = torch.multinomial(draft_probs.float(), 1, generator=generator).squeeze(-1)
    p = target_probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1).float()
    q = draft_probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1).float()
    return ids, torch.where(q > 0, (p / q.clamp_min(1e-30)).clamp_max(1.0), (p > 0).float())


def mix_tokens(
    target_ids: torch.Tensor, draft_ids: torch.Tensor, ratio: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """SpecDec++'s mixed context: keep the target's token at a random share ``ratio`` of positions.

    Returns ``(mixed_ids [n], loss_mask [n])``; ``loss_mask`` is False where the target token was kept.

    >>> g = torch.Generator().manual_seed(0)
    >>> mix_tokens(torch.tensor([1, 2, 3]), torch.tensor([7, 8, 9]), 0.0, g)[0].tolist()
    [7, 8, 9]
    """
    keep_target = torch.rand(target_ids.shape, generator=generator) < ratio
    return torch.where(keep_target, target_ids, draft_ids), ~keep_target


def weighted_bce(logits: torch.Tensor, labels: torch.Tensor, reject_weight: float) -> torch.Tensor:
    """Weighted binary cross-entropy with soft labels (see the module docstring).

    ``logits [N]`` of acceptance, ``labels [N]`` in ``[0, 1]``; normalised by the total weight.
    """
    log_acc = torch.nn.functional.logsigmoid(logits)
    log_rej = torch.nn.functional.logsigmoid(-logits)
    weights = labels + reject_weight * (1.0 - labels)
    return -(labels * log_acc + reject_weight * (1.0 - labels) * log_rej).sum() / weights.sum().clamp_min(1e-12)


def unweight(pred: torch.Tensor, reject_weight: float) -> torch.Tensor:
    """Invert the weighting: from ``P̂ = a / (a + w (1 − a))`` back to ``a = w P̂ / (1 − P̂ + w P̂)``."""
    return reject_weight * pred / (1.0 - pred + reject_weight * pred)


def brier_score(pred: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean squared error of predicted acceptance probabilities against the exact ones."""
    return float(((pred.float() - labels.float()) ** 2).mean())


def reliability_table(pred: torch.Tensor, labels: torch.Tensor, bins: int = 10) -> list[dict]:
    """Per equal-width bin of the prediction: count, mean prediction, mean label."""
    idx = (pred.clamp(0, 1 - 1e-9) * bins).long()
    rows = []
    for b in range(bins):
        sel = idx == b
        n = int(sel.sum())
        rows.append({
            "bin": [b / bins, (b + 1) / bins],
            "count": n,
            "mean_pred": float(pred[sel].mean()) if n else None,
            "mean_label": float(labels[sel].mean()) if n else None,
        })
    return rows


def fit_logistic(x: torch.Tensor, labels: torch.Tensor, steps: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    """Logistic regression with soft labels (plain, unweighted cross-entropy), by L-BFGS.

    Parameters
    ----------
    x:
        ``[N, F]`` inputs (standardised inside).
    labels:
        ``[N]`` targets in ``[0, 1]``.

    Returns
    -------
    ``(weights [F + 1], predictions [N])``; ``weights[-1]`` is the bias; predict new inputs with
    :func:`predict_logistic`. The standardisation is folded into the weights.
    """
    x = x.float()
    mean, std = x.mean(dim=0), x.std(dim=0).clamp_min(1e-6)
    z = (x - mean) / std
    w = torch.zeros(x.shape[1] + 1, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=steps, line_search_fn="strong_wolfe")
    y = labels.float()

    def closure():
        opt.zero_grad()
        logits = z @ w[:-1] + w[-1]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y)
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        coef = w[:-1] / std
        weights = torch.cat([coef, (w[-1] - (mean * coef).sum()).reshape(1)])
    return weights.detach(), predict_logistic(weights.detach(), x)


def predict_logistic(weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``sigmoid(x @ weights[:-1] + weights[-1])`` for inputs ``[N, F]`` -> ``[N]``."""
    return torch.sigmoid(x.float() @ weights[:-1] + weights[-1])


def _hash_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# data construction (needs the models)
# ---------------------------------------------------------------------------------------------


def specdecpp_cache_dir() -> Path:
    from quickdraft.models import default_cache_dir

    return default_cache_dir() / "specdecpp"


def _prompt_batches(prompt_ids: list[list[int]], batch: int) -> list[list[int]]:
    """Indices of ``prompt_ids`` in batches of ``batch``, prompts of similar length together (less
    left padding). Deterministic; a prompt keeps its index as its group.

    >>> _prompt_batches([[1, 2, 3], [1], [1, 2]], 2)
    [[1, 2], [0]]
    """
    order = sorted(range(len(prompt_ids)), key=lambda i: (len(prompt_ids[i]), i))
    return [order[s:s + batch] for s in range(0, len(order), batch)]


@torch.inference_mode()
def lockstep_batch(pipe, prompts: list[list[int]], cfg: TrainConfig, temperatures: tuple[float, ...],
                   seed: int, eos_ids: set[int] | None = None) -> dict:
    """Steps 1-4 of the module docstring for one batch of prompts, target and draft in lockstep.

    Both models prefill the left-padded prompts, then decode together one token per step for all
    ``B`` rows: the target's distribution ``p_j`` (the row's response token ``x_j`` is sampled from
    it at ``cfg.response_temperature``) and the draft's ``q_j`` both condition on the target's prefix
    ``X_{<j}``, so each step gives every row's label at every label temperature without another
    forward. A row stops after an EOS token (kept). Then, per label temperature, the draft's cache
    is rolled back to the prompts and the mixed sequence ``Z`` is fed in chunks for the features.

    Parameters
    ----------
    pipe:
        Has ``target`` and ``draft`` (:class:`quickdraft.backends.runner.ModelRunner`) and ``vocab_size``.
    prompts:
        ``B`` non-empty token-id lists.
    cfg:
        ``max_new_tokens``, ``response_temperature``, ``mix_ratio``.
    temperatures:
        Label temperatures (0 = greedy labels ``1[argmax q = argmax p]``).
    seed:
        Seeds the responses, the draft samples and the mixing (one generator each).
    eos_ids:
        End-of-sequence token ids.

    Returns
    -------
    ``{"responses": B lists, "rows": [n] int64 row of each kept position, "by_temperature": {T: {
    "features" [n, H] bf16, "labels" [n], "loss_mask" [n], "draft_stats" [n, 3], "draft_ids" [n],
    "mixed_ids" [n]}}}``; positions are row-major (row 0's response first).
    """
    from quickdraft.decoding.drafters import pending_block
    from quickdraft.verification.sampling import raw_probs, sample

    temps = tuple(float(t) for t in temperatures)
    eos = set(eos_ids or ())
    vocab, b = pipe.vocab_size, len(prompts)
    target, draft = pipe.target, pipe.draft
    resp_gen = torch.Generator().manual_seed(seed)
    gens = {t: torch.Generator().manual_seed(seed + 1 + 1000 * i) for i, t in enumerate(temps)}
    resp_params = SamplingParams(temperature=cfg.response_temperature)
    label_params = {t: SamplingParams(temperature=t) for t in temps}

    # 1. prefill the prompts (left-padded) in both models
    ids, valid = pending_block(prompts, torch.zeros(b, dtype=torch.long))  # [B, P]
    target.reset(b)
    draft.reset(b)
    target_logits = target.forward(ids, valid, logits_to_keep=1).logits[:, -1, :vocab]  # [B, V]
    draft_logits = draft.forward(ids, valid, logits_to_keep=1).logits[:, -1, :vocab]  # [B, V]

    # 2. decode in lockstep; label every row at every step
    responses: list[list[int]] = [[] for _ in range(b)]
    alive = torch.ones(b, dtype=torch.bool)
    live_cols, x_cols = [], []  # per step: [B] bool, [B] int64
    drafted = {t: {"ids": [], "labels": [], "stats": []} for t in temps}
    for _ in range(cfg.max_new_tokens):
        draft_raw = raw_probs(draft_logits)  # [B, V]
        for t in temps:
            target_probs = logits_to_probs(target_logits, label_params[t])
            draft_probs = draft_raw if t == 1.0 else logits_to_probs(draft_logits, label_params[t])
            y, a = acceptance_labels(target_probs, draft_probs, gens[t], greedy=label_params[t].greedy)
            drafted[t]["ids"].append(y)
            drafted[t]["labels"].append(a)
            drafted[t]["stats"].append(confidence_features(draft_raw, y))
        resp_probs = logits_to_probs(target_logits, resp_params)
        x = resp_probs.argmax(dim=-1) if resp_params.greedy else sample(resp_probs, resp_gen)  # [B]
        live_cols.append(alive.clone())
        x_cols.append(x)
        for row in alive.nonzero().flatten().tolist():
            responses[row].append(int(x[row]))
            if int(x[row]) in eos:
                alive[row] = False
        if not alive.any():
            break
        target_logits = target.forward(x.unsqueeze(1), logits_to_keep=1).logits[:, -1, :vocab]
        draft_logits = draft.forward(x.unsqueeze(1), logits_to_keep=1).logits[:, -1, :vocab]
    live = torch.stack(live_cols, dim=1)  # [B, n]
    x_all = torch.stack(x_cols, dim=1)  # [B, n]
    n = live.shape[1]
    prompt_lengths = torch.tensor([len(p) for p in prompts])

    # 3-4. mixed context and features, per label temperature
    out: dict = {"responses": responses, "rows": live.nonzero()[:, 0], "by_temperature": {}}
    chunk = 32  # columns per feature forward: bounds the [B, chunk, V] logits the runner returns
    for t in temps:
        y = torch.stack(drafted[t]["ids"], dim=1)  # [B, n]
        mixed, mask = mix_tokens(x_all, y, cfg.mix_ratio, gens[t])  # [B, n] each
        draft.truncate(prompt_lengths)  # back to the prompts' cache
        hidden = []
        for s in range(0, n, chunk):
            block = mixed[:, s:s + chunk]
            hidden.append(draft.forward(block, logits_to_keep=block.shape[1], output_hidden=True).hidden)
        feats = torch.cat(hidden, dim=1)  # [B, n, H], the draft's state at Z_j
        out["by_temperature"][t] = {
            "features": feats[live].to(torch.bfloat16),
            "labels": torch.stack(drafted[t]["labels"], dim=1)[live],
            "loss_mask": mask[live],
            "draft_stats": torch.stack(drafted[t]["stats"], dim=1)[live],
            "draft_ids": y[live],
            "mixed_ids": mixed[live],
        }
    target.reset(0)
    draft.reset(0)
    return out


def drawing_states(draft, prompts: list[list[int]], responses: list[list[int]]) -> torch.Tensor:
    """The draft's hidden states that drew each response position's draft token, ``[n, H]`` bf16.

    Position ``j`` of a row's response ``x`` is labelled with the draft token ``y_j ~ q_j`` where ``q_j``
    conditions on the target's prefix ``X_<j`` (:func:`lockstep_batch`), so the state that drew
    ``y_j`` is the draft's last hidden state over ``prompt + x_<j``: one teacher-forced pass per row
    over ``prompt + x[:-1]``. Rows in order, positions in order: the order of :func:`lockstep_batch`'s
    positions. In a real step the state that draws draft token ``i`` sits on the accepted context
    and draft tokens ``0 .. i-1``, which equal the target's tokens whenever token ``i`` can be
    accepted at all, so this is the state the policy sees at every token whose label matters.
    """
    states = []
    for prompt, response in zip(prompts, responses):
        if not response:
            continue
        draft.reset(1)
        ids = torch.tensor([list(prompt) + list(response[:-1])], dtype=torch.long)
        out = draft.forward(ids, logits_to_keep=len(response), output_hidden=True)
        states.append(out.hidden[0].to(torch.bfloat16))
    draft.reset(0)
    return torch.cat(states)


def build_dataset(pipe, prompt_ids: list[list[int]], cfg: TrainConfig, temperatures: tuple[float, ...],
                  cache: Path | None, fingerprint: str = "", eos_ids: set[int] | None = None,
                  time_budget: float = 0.0, log=print) -> dict[float, Examples]:
    """:func:`lockstep_batch` over all prompts in batches of ``cfg.gen_batch``; one :class:`Examples`
    per label temperature, the group of a position being its prompt's index in ``prompt_ids``.

    Each batch is cached in ``cache`` (a file keyed by its prompts, the settings and ``fingerprint``
    of the models), so an interrupted build resumes. Batches run in a seeded random order; with
    ``time_budget > 0`` (seconds) no new batch is started once the budget would be exceeded
    (estimated from the batches so far) and the examples hold the batches done (cached ones
    included): a random subset of the prompts. Run again to add the rest. With
    ``cfg.reads == "drawing"`` each batch also gets :func:`drawing_states` (computed once, kept in
    its cache file).
    """
    temps = tuple(float(t) for t in temperatures)
    batches = _prompt_batches(prompt_ids, cfg.gen_batch)
    order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    results: list[tuple[list[int], dict]] = []
    t0, built, skipped = time.perf_counter(), 0, 0
    for bi in order:  # random order: a time budget keeps a random subset of batches, not the shortest prompts
        idx = batches[bi]
        batch = [prompt_ids[i] for i in idx]
        seed = cfg.seed + 7919 * bi
        key = _hash_json({"t": "lockstep-v1", "ids": batch, "n": cfg.max_new_tokens, "T": cfg.response_temperature,
                          "temps": list(temps), "mix": cfg.mix_ratio, "seed": seed, "models": fingerprint})
        path = cache / f"lockstep-{key[:24]}.pt" if cache is not None else None
        if path is not None and path.exists():
            data = torch.load(path, weights_only=True)
            if cfg.reads == "drawing" and "drawing_features" not in data:
                data["drawing_features"] = drawing_states(pipe.draft, batch, data["responses"])
                torch.save(data, path)
            results.append((idx, data))
            continue
        elapsed = time.perf_counter() - t0
        if time_budget and elapsed + (elapsed / built if built else 0.0) > time_budget:
            skipped += 1
            continue
        t1 = time.perf_counter()
        data = lockstep_batch(pipe, batch, cfg, temps, seed=seed, eos_ids=eos_ids)
        data["by_temperature"] = {str(t): v for t, v in data["by_temperature"].items()}  # torch.load-safe keys
        if cfg.reads == "drawing":
            data["drawing_features"] = drawing_states(pipe.draft, batch, data["responses"])
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(data, path)
        built += 1
        results.append((idx, data))
        log(f"  batch {len(results)}/{len(batches)}: {len(data['rows'])} positions in {time.perf_counter() - t1:.0f} s")
    if skipped:
        log(f"time budget spent: {len(results)}/{len(batches)} batches ({sum(len(i) for i, _ in results)} prompts) "
            "are used; the others are skipped (run again to add them)")
    if not results:
        raise QuickdraftError("no training data: the time budget ended before the first batch")
    examples = {}
    for t in temps:
        parts = {k: [] for k in ("features", "labels", "loss_mask", "draft_stats", "groups")}
        digest = hashlib.sha256()
        for idx, data in results:
            d = data["by_temperature"][str(t)]
            for k in ("features", "labels", "loss_mask", "draft_stats"):
                parts[k].append(d[k])
            parts["groups"].append(torch.tensor(idx, dtype=torch.long)[data["rows"]])
            digest.update(json.dumps([[prompt_ids[i] for i in idx], data["responses"], d["draft_ids"].tolist(),
                                      d["mixed_ids"].tolist(), t]).encode())
            digest.update(d["labels"].float().numpy().tobytes())
        examples[t] = Examples(
            features=torch.cat(parts["features"]), labels=torch.cat(parts["labels"]).float(),
            loss_mask=torch.cat(parts["loss_mask"]), groups=torch.cat(parts["groups"]), data_hash=digest.hexdigest(),
            draft_stats=torch.cat(parts["draft_stats"]), temperature=t,
            drawing_features=torch.cat([data["drawing_features"] for _, data in results])
            if cfg.reads == "drawing" else None,
        )
    return examples


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------


def split_groups(groups: torch.Tensor, holdout: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool masks ``([N], [N])`` of validation and test positions: a seeded ``holdout`` share of the
    prompts is held out, its first half (at least one prompt) for validation, the rest for testing."""
    ids = groups.unique()
    gen = torch.Generator().manual_seed(seed)
    perm = ids[torch.randperm(len(ids), generator=gen)]
    n_hold = max(2, int(round(holdout * len(ids))))
    if n_hold >= len(ids):
        raise QuickdraftError(f"too few prompts ({len(ids)}) to hold out validation and test prompts")
    n_val = max(1, n_hold // 2)
    return torch.isin(groups, perm[:n_val]), torch.isin(groups, perm[n_val:n_hold])


def train_head(examples: Examples, cfg: TrainConfig, metadata: HeadMetadata | None = None,
               log=print, draft_cost: float | None = None,
               thresholds: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98),
               ) -> tuple[AcceptanceHead, dict]:
    """Fit an :class:`AcceptanceHead` on the loss positions of ``examples``.

    With ``draft_cost`` (a draft forward's time over a target forward's), the report also holds
    :func:`simulate_policies` on the test prompts: fixed K = 1..10 and SpecDec++ at ``thresholds``
    (the raw, weighted head's risk grows fast, hence the grid up to 0.98), and the best threshold
    with its grid neighbours as ``suggested_thresholds``.

    With ``cfg.confidence_inputs`` and ``examples.draft_stats`` the head has ``num_stats = 4`` and
    reads ``baseline_design(draft_stats)`` next to the hidden states wherever it is called, starting
    from the logistic baseline's fit (module docstring, step 5).

    With ``cfg.reads == "drawing"`` the head reads ``examples.drawing_features`` and trains on every
    position (the context-only positions of the mixing included: the drawing state never saw the
    mixed context).

    Returns the head of the epoch with the lowest validation loss and a report: losses per epoch,
    Brier scores on the test positions (the head's, un-weighted with :func:`unweight`, and those of
    the baselines), reliability tables of the test positions, ``confidence_inputs`` (whether the
    head reads the draft's confidence).
    """
    torch.manual_seed(cfg.seed)  # nn.Linear's initialisation reads the global generator
    features, usable = examples.training_view(cfg.reads)
    val, test = split_groups(examples.groups, cfg.holdout, cfg.seed)
    train_sel = usable & ~val & ~test
    val_sel, test_sel = usable & val, usable & test
    if int(train_sel.sum()) == 0 or int(val_sel.sum()) == 0 or int(test_sel.sum()) == 0:
        raise QuickdraftError("too little training data: no training, validation or test positions")
    x_tr, y_tr = features[train_sel].float(), examples.labels[train_sel]
    x_va, y_va = features[val_sel].float(), examples.labels[val_sel]
    x_te, y_te = features[test_sel].float(), examples.labels[test_sel]
    has_stats = examples.draft_stats is not None
    use_stats = bool(cfg.confidence_inputs) and has_stats

    def design(sel: torch.Tensor) -> torch.Tensor | None:
        """The draft's confidence design at the positions ``sel`` (None without draft stats)."""
        return baseline_design(examples.draft_stats[sel]) if has_stats else None

    d_tr, d_te = design(train_sel), design(test_sel)
    s_tr, s_va, s_te = (d_tr, design(val_sel), d_te) if use_stats else (None, None, None)  # the head's inputs
    base_weights = None
    if has_stats:  # the simple baseline: logistic on the draft's confidence
        base_weights, _ = fit_logistic(d_tr, y_tr)
    head = AcceptanceHead(x_tr.shape[1], cfg.num_layers, metadata, num_stats=NUM_CONFIDENCE_STATS if use_stats else 0,
                          shared_blocks=cfg.shared_blocks, reads=cfg.reads)
    head.set_normalisation(x_tr, s_tr)
    with torch.no_grad():
        if use_stats:  # start at the logistic baseline (weighted: bias - log w), the hidden term at 0
            coef = base_weights[:-1]
            head.stats_out.weight.copy_((coef * head.stats_std).unsqueeze(0))  # in standardised units
            head.out.bias.fill_(float(base_weights[-1] + (coef * head.stats_mean).sum()) - math.log(cfg.reject_weight))
            head.out.weight.zero_()
        else:  # start at the (weighted) base rate
            rate = float(y_tr.mean())
            head.out.bias.fill_(math.log(max(rate, 1e-3) / max(cfg.reject_weight * (1 - rate), 1e-3)))
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = math.ceil(len(y_tr) / cfg.batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs * steps_per_epoch)
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    history = []
    best = (float("inf"), None, -1)
    for epoch in range(cfg.epochs):
        head.train()
        perm = torch.randperm(len(y_tr), generator=gen)
        total = 0.0
        for s in range(0, len(perm), cfg.batch_size):
            idx = perm[s:s + cfg.batch_size]
            loss = weighted_bce(head(x_tr[idx], None if s_tr is None else s_tr[idx]), y_tr[idx], cfg.reject_weight)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach()) * len(idx)
        head.eval()
        with torch.no_grad():
            ev = float(weighted_bce(head(x_va, s_va), y_va, cfg.reject_weight))
        history.append({"epoch": epoch, "train_loss": total / len(perm), "heldout_loss": ev})
        if ev < best[0]:
            best = (ev, {k: v.clone() for k, v in head.state_dict().items()}, epoch)
    head.load_state_dict(best[1])
    head.eval()
    with torch.no_grad():
        pred = torch.sigmoid(head(x_te, s_te))
    calibrated = unweight(pred, cfg.reject_weight)
    report = {
        "confidence_inputs": use_stats,
        "reads": cfg.reads,
        "train_positions": int(train_sel.sum()),
        "validation_positions": int(val_sel.sum()),
        "heldout_positions": int(test_sel.sum()),
        "heldout_prompts": int(examples.groups[test].unique().numel()),
        "best_epoch": best[2],
        "history": history,
        "train_mean_label": float(y_tr.mean()),
        "heldout_mean_label": float(y_te.mean()),
        "brier_raw": brier_score(pred, y_te),
        "brier_unweighted": brier_score(calibrated, y_te),
        "brier_constant_baseline": brier_score(torch.full_like(y_te, float(y_tr.mean())), y_te),
        "brier_base_rate": brier_score(torch.full_like(y_te, float(y_te.mean())), y_te),
        "reliability_raw": reliability_table(pred, y_te),
        "reliability_unweighted": reliability_table(calibrated, y_te),
    }
    msg = (f"  head on the {cfg.reads} {'state + draft confidence' if use_stats else 'state'}, "
           f"best epoch {best[2]}: validation loss {best[0]:.4f}; test Brier raw {report['brier_raw']:.4f}, "
           f"unweighted {report['brier_unweighted']:.4f}, constant {report['brier_constant_baseline']:.4f}, "
           f"base rate {report['brier_base_rate']:.4f}")
    if base_weights is not None:
        weights = base_weights
        base_pred = predict_logistic(weights, d_te)
        report["brier_logistic_baseline"] = brier_score(base_pred, y_te)
        report["logistic_baseline_weights"] = weights.tolist()
        report["reliability_logistic_baseline"] = reliability_table(base_pred, y_te)
        msg += f", logistic on draft confidence {report['brier_logistic_baseline']:.4f}"
    log(msg)
    if draft_cost is not None:
        with torch.no_grad():
            all_pred = torch.sigmoid(head(features[test].float(), design(test) if use_stats else None))  # what the policy reads
        sim = simulate_policies(examples.labels[test], all_pred, examples.groups[test], draft_cost,
                                thresholds=thresholds, max_k=10, reads=cfg.reads)
        best_fixed = max((n for n in sim if n.startswith("fixed")), key=sim.get)
        best_sdpp = max((n for n in sim if n.startswith("specdecpp")), key=sim.get)
        report["simulated_tokens_per_target_time"] = {"draft_cost": draft_cost, **sim}
        best_h = float(best_sdpp.removeprefix("specdecpp_h"))
        i = min(range(len(thresholds)), key=lambda j: abs(thresholds[j] - best_h))
        report["suggested_thresholds"] = list(thresholds[max(0, i - 1): i + 2])  # the best and its neighbours
        log(f"  offline estimate (test prompts, draft cost {draft_cost:.2f}): best fixed {best_fixed} "
            f"{sim[best_fixed]:.3f}, best {best_sdpp} {sim[best_sdpp]:.3f} new tokens per target-forward time")
    return head, report


def _ahead(values: torch.Tensor, width: int, fill: float) -> torch.Tensor:
    """``[n] -> [n, width]``: row ``s`` holds ``values[s], values[s + 1], ...`` (``fill`` past the end)."""
    padded = torch.cat([values.float(), torch.full((width,), fill)])
    return padded.unfold(0, width, 1)[: values.numel()]


def expected_new_tokens(labels: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Expected new tokens of a step that starts at each position of one response and drafts
    ``lengths[s]`` tokens, if the drafted tokens' acceptance probabilities are the labels ahead.

    .. math::  E_s = 1 + \\sum_{i=0}^{K_s - 1} \\prod_{l=0}^{i} a_{s+l}

    (the accepted tokens plus the recovered or bonus token). ``labels [n]``, ``lengths [n]`` -> ``[n]``.

    >>> expected_new_tokens(torch.tensor([0.5, 1.0, 1.0]), torch.tensor([2, 2, 1])).tolist()
    [2.0, 3.0, 2.0]
    """
    width = max(1, int(lengths.max()))
    alive = _ahead(labels, width, 0.0).cumprod(dim=1)  # [n, width]: P(tokens 0..i all accepted)
    use = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    return 1.0 + (alive * use).sum(dim=1)


def specdecpp_lengths(preds: torch.Tensor, threshold: float, max_k: int, reads: str = "fed") -> torch.Tensor:
    """Draft lengths :class:`quickdraft.decoding.policies.SpecDecPP` chooses at each start of one response,
    from the head's predictions ``preds [n]`` (the same numbers the policy reads): after drafting
    token ``i >= 1`` it stops once ``1 - prod_{l < i} P̂_{s+l} > h`` (``[n]`` int64, in ``1..max_k``);
    a head on the drawing state (``reads="drawing"``) also scores token ``i`` itself, so the product
    runs over ``l <= i`` and a step may stop after one token.

    >>> specdecpp_lengths(torch.tensor([0.9, 0.9, 0.2, 0.9]), 0.5, 10).tolist()
    [4, 3, 2, 3]
    >>> specdecpp_lengths(torch.tensor([0.9, 0.9, 0.2, 0.9]), 0.5, 10, reads="drawing").tolist()
    [3, 2, 1, 2]
    """
    risk = 1.0 - _ahead(preds, max_k, 0.0).cumprod(dim=1)  # [n, max_k]: risk after scoring tokens 0..i
    # risk column i decides after drafting token i (drawing state) or token i + 1 (fed state)
    lag = 0 if reads == "drawing" else 1
    stop = risk[:, : max_k - lag] > threshold
    if stop.shape[1] == 0:  # max_k = 1 with the fed state: nothing is scored before the one token
        return torch.ones(preds.numel(), dtype=torch.long)
    drafted = stop.float().argmax(dim=1) + 1 + lag
    return torch.where(stop.any(dim=1), drafted, torch.full_like(drafted, max_k))


def simulate_policies(labels: torch.Tensor, preds: torch.Tensor, groups: torch.Tensor, draft_cost: float,
                      fixed_k: tuple[int, ...] = tuple(range(1, 11)), thresholds: tuple[float, ...] = (),
                      max_k: int = 10, reads: str = "fed") -> dict[str, float]:
    """Offline estimate of each policy's speed, in new tokens per target-forward time.

    A step starting at any response position ``s`` (renewal-reward: every position is a start) costs
    ``K_s * draft_cost + 1`` target-forward times (a draft forward per token; verifying ``K`` tokens
    costs one forward on a memory-bound target) and yields :func:`expected_new_tokens`. Labels are
    exact acceptance probabilities given the target's prefix; the estimate ignores that a real draft's
    prefix is the draft's own accepted tokens. ``labels, preds, groups [N]`` (one response per group);
    ``reads`` as in :func:`specdecpp_lengths`.
    """
    results: dict[str, float] = {}
    responses = [groups == g for g in groups.unique()]
    policies: list[tuple[str, object]] = [(f"fixed_k{k}", k) for k in fixed_k]
    policies += [(f"specdecpp_h{h:g}", h) for h in thresholds]
    for name, arg in policies:
        new = cost = 0.0
        for sel in responses:
            a, p = labels[sel], preds[sel]
            ks = torch.full_like(a, int(arg), dtype=torch.long) if name.startswith("fixed") else \
                specdecpp_lengths(p, float(arg), max_k, reads)
            new += float(expected_new_tokens(a, ks).sum())
            cost += float((ks.float() * draft_cost + 1.0).sum())
        results[name] = new / cost
    return results


def plot_reliability(reports: list[tuple[str, dict]], path: str | Path) -> Path:
    """Reliability diagrams (mean exact acceptance probability per bin of the prediction), one panel
    per ``(title, report)``, as PNG: the head (un-weighted) and the logistic baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(reports), figsize=(5 * len(reports), 5), squeeze=False)
    for ax, (title, report) in zip(axes[0], reports):
        ax.plot([0, 1], [0, 1], ":", color="gray", label="perfect calibration")
        curves = [("reliability_unweighted", f"head, un-weighted (Brier {report['brier_unweighted']:.4f})", "o")]
        if "reliability_logistic_baseline" in report:
            curves.append(("reliability_logistic_baseline",
                           f"logistic on draft confidence (Brier {report['brier_logistic_baseline']:.4f})", "s"))
        for key, label, marker in curves:
            rows = [r for r in report[key] if r["count"] >= 10]
            ax.plot([r["mean_pred"] for r in rows], [r["mean_label"] for r in rows], marker=marker, label=label)
        ax.axhline(report["heldout_mean_label"], color="black", lw=0.8, alpha=0.5,
                   label=f"base rate {report['heldout_mean_label']:.3f} (Brier {report['brier_base_rate']:.4f})")
        ax.set_xlabel("predicted P(accept | earlier accepted)")
        ax.set_ylabel("mean exact acceptance probability")
        ax.set_title(f"{title}: {report['heldout_positions']} test positions", fontsize=10)
        ax.legend(loc="upper left", fontsize=7)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------


def head_path_for(out: str | Path, temperature: float, several: bool) -> Path:
    """``out`` itself for one temperature; ``<stem>-t<T><suffix>`` when several heads are trained.

    >>> str(head_path_for("h/specdecpp.pt", 0.7, True))
    'h/specdecpp-t0.7.pt'
    """
    out = Path(out)
    if not several:
        return out
    return out.with_name(f"{out.stem}-t{temperature:g}{out.suffix}")


@torch.inference_mode()
def measure_draft_cost(pipe, context: int = 256, steps: int = 8) -> float:
    """Median time of a one-token draft forward over that of a target forward (B = 1, after a
    ``context``-token prefill), the cost ratio the offline policy estimate needs."""
    import statistics

    times = {}
    tokens = (torch.arange(context + steps + 1) * 7919 + 11) % pipe.vocab_size  # arbitrary valid ids
    for name, runner in (("target", pipe.target), ("draft", pipe.draft)):
        runner.reset(1)
        runner.forward(tokens[:context].unsqueeze(0), logits_to_keep=1)
        samples = []
        for i in range(steps + 1):
            t0 = time.perf_counter()
            runner.forward(tokens[context + i].reshape(1, 1), logits_to_keep=1)
            samples.append(time.perf_counter() - t0)
        times[name] = statistics.median(samples[1:])
        runner.reset(0)
    return times["draft"] / times["target"]


def run_training(cfg: TrainConfig, target: str = "target", draft: str = "draft", out: str = DEFAULT_HEAD_PATH,
                 report_path: str | None = None, plot_path: str | None = None, threads: int | None = None,
                 temperatures: tuple[float, ...] | None = None, time_budget: float = 0.0, dtype: str = "float32",
                 log=print) -> dict[float, tuple[AcceptanceHead, dict]]:
    """The whole pipeline: prompts, lockstep data (cached per batch), training, saving; one head per
    label temperature (default: ``cfg.temperature`` only), written by :func:`head_path_for` (the
    default ``out`` always gets the ``-t<T>`` suffix, the names ``benchmarks/bench_adaptive.py`` reads).

    ``time_budget`` (seconds, 0 = none) caps the data building (see :func:`build_dataset`).
    ``dtype`` of both models while building the data: float32 by default, because on CPUs without
    native bf16 matrix units a bf16 matmul costs in proportion to the rows it multiplies, while a
    float32 one over 16 rows costs ~2x one row (the head then reads bf16 or float32 states alike)."""
    from quickdraft.models import ALIASES
    from quickdraft.pipeline import Pipeline, set_threads
    from quickdraft.adaptive.trainprompts import training_prompts

    temps = tuple(float(t) for t in (temperatures or (cfg.temperature,)))
    set_threads(threads)
    t_start = time.perf_counter()
    cache = specdecpp_cache_dir()
    pipe = Pipeline.from_specs(target, draft, dtype=dtype)
    prompts = training_prompts(cfg.num_prompts, seed=cfg.seed)
    prompt_ids = [pipe.encode(p) for p in prompts]
    fingerprint = model_fingerprint(pipe.draft_model)
    draft_cost = measure_draft_cost(pipe)
    log(f"draft forward / target forward time at B = 1: {draft_cost:.3f}")
    models_key = _hash_json([fingerprint, model_fingerprint(pipe.target_model), str(pipe.draft_model.dtype)])
    log(f"{len(prompts)} prompts from the standard library's docstrings; target and draft in lockstep, "
        f"{cfg.gen_batch} prompts per batch, responses at T={cfg.response_temperature:g}, "
        f"labels at T = {', '.join(f'{t:g}' for t in temps)} ...")
    t0 = time.perf_counter()
    examples = build_dataset(pipe, prompt_ids, cfg, temps, cache, fingerprint=models_key, eos_ids=pipe.eos_ids(),
                             time_budget=time_budget - (t0 - t_start) if time_budget else 0.0, log=log)
    t_data = time.perf_counter() - t0
    results: dict[float, tuple[AcceptanceHead, dict]] = {}
    for t in temps:
        ex = examples[t]
        meta = HeadMetadata(
            draft=ALIASES.get(draft, draft), target=ALIASES.get(target, target),
            draft_fingerprint=fingerprint, data_hash=ex.data_hash, temperature=t,
        )
        labelled = int(ex.training_view(cfg.reads)[1].sum())
        log(f"T={t:g}: training on {labelled} labelled positions ...")
        t0 = time.perf_counter()
        head, report = train_head(ex, replace(cfg, temperature=t), meta, log, draft_cost=draft_cost)
        report.update(
            config=asdict(replace(cfg, temperature=t)), target=meta.target, draft=meta.draft, data_hash=meta.data_hash,
            num_prompts=len(prompts), prompts_used=int(ex.groups.unique().numel()), dtype=dtype,
            response_tokens=int(ex.labels.numel()),
            labelled_positions=labelled,
            seconds={"data_all_temperatures_incl_cache_loads": t_data, "training": time.perf_counter() - t0},
        )
        head.metadata.extra = {k: report[k] for k in (
            "brier_raw", "brier_unweighted", "brier_constant_baseline", "brier_base_rate", "brier_logistic_baseline",
            "train_positions", "validation_positions", "heldout_positions", "response_tokens", "prompts_used",
            "confidence_inputs", "reads")
            if k in report}
        head.metadata.extra["reject_weight"] = cfg.reject_weight
        if "suggested_thresholds" in report:
            head.metadata.extra["suggested_thresholds"] = report["suggested_thresholds"]
        head.metadata.extra["config"] = report["config"]
        path = head_path_for(out, t, len(temps) > 1 or Path(out) == Path(DEFAULT_HEAD_PATH))  # default: always -t<T>
        save_head(head, path)
        report["head_path"] = str(path)
        log(f"head saved to {path} ({path.stat().st_size / 1e6:.1f} MB)")
        results[t] = (head, report)
    total = time.perf_counter() - t_start
    if report_path:
        Path(report_path).parent.mkdir(parents=True, exist_ok=True)
        payload = {f"T={t:g}": r for t, (_, r) in results.items()}
        payload["total_seconds"] = total
        Path(report_path).write_text(json.dumps(payload, indent=1))
    if plot_path:
        plot_reliability([(f"SpecDec++ head, T={t:g}", r) for t, (_, r) in results.items()], plot_path)
    return results


def train_head_command(
    out: str = typer.Option(DEFAULT_HEAD_PATH, "--out", help="Head file; -t<T> goes before the suffix for several temperatures and for the default path."),
    target: str = typer.Option("target", help="Target model (registry name, alias, directory or .gguf)."),
    draft: str = typer.Option("draft", help="Draft model the head reads the hidden states of."),
    num_prompts: int = typer.Option(TrainConfig.num_prompts, "--num-prompts", help="Training prompts (20% held out)."),
    max_new_tokens: int = typer.Option(TrainConfig.max_new_tokens, "--max-new-tokens", help="Longest target response."),
    gen_batch: int = typer.Option(TrainConfig.gen_batch, "--gen-batch", help="Prompts decoded together (lockstep)."),
    response_temperature: float = typer.Option(TrainConfig.response_temperature, "--response-temperature",
                                               help="Temperature of the target's responses (0 = greedy)."),
    temperature: list[float] = typer.Option([0.0, 0.7], "--temperature",
                                            help="Label temperature; repeat for one head per temperature."),
    mix_ratio: float = typer.Option(TrainConfig.mix_ratio, "--mix-ratio",
                                    help="Share of positions with the target's token as context."),
    reject_weight: float = typer.Option(TrainConfig.reject_weight, "--reject-weight",
                                        help="Loss weight of the rejection class."),
    num_layers: int = typer.Option(TrainConfig.num_layers, "--num-layers", help="Residual layers of the head (paper: 3)."),
    shared_blocks: bool = typer.Option(TrainConfig.shared_blocks, "--shared-blocks/--own-blocks",
                                       help="One residual block applied at every layer (the paper's code), or one per layer."),
    epochs: int = typer.Option(TrainConfig.epochs),
    lr: float = typer.Option(TrainConfig.lr, "--lr"),
    weight_decay: float = typer.Option(TrainConfig.weight_decay, "--weight-decay"),
    seed: int = typer.Option(TrainConfig.seed),
    confidence_inputs: bool = typer.Option(TrainConfig.confidence_inputs, "--confidence-inputs/--no-confidence-inputs",
                                           help="The head also reads the draft's confidence at the drafted token "
                                                "(top probability, entropy, log probabilities); off (default) = the paper's "
                                                "hidden-state-only head."),
    reads: str = typer.Option(TrainConfig.reads, "--reads",
                              help="The draft state a token is scored from: 'fed' (the paper's: the state at the token, "
                                   "so at least two tokens are drafted) or 'drawing' (the state that drew it: a step "
                                   "may stop after one token)."),
    threads: Optional[int] = typer.Option(None, help="torch threads."),
    time_budget: float = typer.Option(0.0, "--time-budget", help="Seconds; start no data batch after this and "
                                      "train on the batches done (cached: run again to add more). 0 = no limit."),
    dtype: str = typer.Option("float32", help="Model dtype while building the data (float32, bfloat16, auto)."),
    report: Optional[str] = typer.Option(None, help="Write the training report (JSON) here."),
    plot: Optional[str] = typer.Option(None, help="Write the reliability plot (PNG) here."),
) -> None:
    """Train the SpecDec++ acceptance-prediction head for a draft/target pair, on CPU."""
    try:
        if not temperature:
            raise QuickdraftError("give at least one --temperature")
        cfg = TrainConfig(num_prompts=num_prompts, max_new_tokens=max_new_tokens, gen_batch=gen_batch,
                          response_temperature=response_temperature, temperature=temperature[0], mix_ratio=mix_ratio,
                          reject_weight=reject_weight, num_layers=num_layers, epochs=epochs, lr=lr,
                          weight_decay=weight_decay, seed=seed, confidence_inputs=confidence_inputs,
                          shared_blocks=shared_blocks, reads=reads)
        run_training(cfg, target=target, draft=draft, out=out, report_path=report, plot_path=plot, threads=threads,
                     temperatures=tuple(temperature), time_budget=time_budget, dtype=dtype,
                     log=lambda m: typer.echo(m, err=True))
    except QuickdraftError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(code=2)
