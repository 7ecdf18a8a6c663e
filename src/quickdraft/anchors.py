"""The tools people use today, run on the same prompts and models as quickdraft's methods.

Each anchor takes token ids and returns the new ids with wall times, so benchmark rows compare
like with like. Times are end to end (prefill included), because that is what these tools expose.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from quickdraft.sampling import SamplingParams


@dataclass
class AnchorResult:
    new_ids: list[int]
    seconds: float  # wall time of the whole call, prefill included


def _sampling_kwargs(sampling: SamplingParams) -> dict:
    if sampling.greedy:
        return {"do_sample": False}
    kwargs = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p}
    kwargs["top_k"] = sampling.top_k or 0
    return kwargs


@torch.inference_mode()
def hf_generate(
    target_model,
    prompt_ids: list[int],
    *,
    sampling: SamplingParams,
    max_new_tokens: int,
    eos_token_ids: set[int],
    seed: int = 0,
    assistant_model=None,
    prompt_lookup_num_tokens: int | None = None,
) -> AnchorResult:
    """Hugging Face ``generate``: plain, assisted (``assistant_model``, its default adaptive draft
    length) or prompt lookup (``prompt_lookup_num_tokens``)."""
    input_ids = torch.tensor([prompt_ids])
    kwargs = dict(_sampling_kwargs(sampling), max_new_tokens=max_new_tokens, eos_token_id=sorted(eos_token_ids))
    if assistant_model is not None:
        kwargs["assistant_model"] = assistant_model
    if prompt_lookup_num_tokens:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = target_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), pad_token_id=min(eos_token_ids), **kwargs)
    seconds = time.perf_counter() - start
    return AnchorResult(new_ids=out[0, len(prompt_ids):].tolist(), seconds=seconds)
