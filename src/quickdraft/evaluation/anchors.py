"""The tools people use today, run on the same prompts and models as quickdraft's methods.

Each anchor takes token ids and returns the new ids with wall times, so benchmark rows compare
like with like. Times are end to end (prefill included), because that is what these tools expose.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from quickdraft.verification.sampling import SamplingParams


@dataclass
class AnchorResult:
    new_ids: list[int]
    seconds: float  # wall time of the whole call, prefill included
    #: OpenVINO GenAI's speculative decoding's own counts and inference times for the call
    #: (:func:`genai_speculative_metrics`); None for every other anchor
    speculative: dict | None = None

    @property
    def drafted_nothing(self) -> bool:
        """A speculative call that emitted more than one token and drafted none: not speculative
        decoding (GenAI's pipeline decodes so after a call of it failed)."""
        return bool(self.speculative) and self.speculative.get("drafted_tokens") == 0 and len(self.new_ids) > 1


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


def llamacpp_generate(
    gguf_path,
    prompt_ids: list[int],
    *,
    sampling: SamplingParams,
    max_new_tokens: int,
    eos_token_ids: set[int],
    seed: int = 0,
    n_threads: int | None = None,
    model=None,
) -> AnchorResult:
    """llama.cpp plain decoding of a GGUF file, as its own ``llama-simple`` example does it: one
    ``llama_decode`` per token and llama.cpp's own sampler chain (greedy at temperature 0, else
    top-k → top-p → temperature → seeded draw), so no logits are copied to Python.

    ``model`` may be a :class:`quickdraft.backends.llamacpp.LlamaGGUF` already loaded from
    ``gguf_path`` (it is cleared and reused); otherwise the file is loaded for this call (load time
    excluded). Needs ``llama-cpp-python`` (``pip install 'quickdraft[llamacpp]'``); raises a
    :class:`QuickdraftError` saying so when it is missing.
    """
    from quickdraft.backends.llamacpp import LlamaGGUF

    own = model is None
    gguf = model if model is not None else LlamaGGUF(
        gguf_path, n_ctx=len(prompt_ids) + max_new_tokens + 8, n_threads=n_threads or torch.get_num_threads()
    )
    lib = gguf.lib
    chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
    if sampling.greedy:
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
    else:
        if sampling.top_k:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(int(sampling.top_k)))
        if sampling.top_p < 1.0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(float(sampling.top_p), 1))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(float(sampling.temperature)))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(int(seed) & 0xFFFFFFFF))
    try:
        gguf.clear()
        start = time.perf_counter()
        pos = 0
        for i in range(0, len(prompt_ids), gguf.n_batch):  # prefill, logits for the last token only
            part = prompt_ids[i:i + gguf.n_batch]
            gguf.decode(part, pos, [i + j == len(prompt_ids) - 1 for j in range(len(part))])
            pos += len(part)
        new_ids: list[int] = []
        while len(new_ids) < max_new_tokens:
            token = int(lib.llama_sampler_sample(chain, gguf.ctx, -1))
            new_ids.append(token)
            if token in eos_token_ids or len(new_ids) == max_new_tokens:
                break
            gguf.decode([token], pos, [True])
            pos += 1
        seconds = time.perf_counter() - start
    finally:
        lib.llama_sampler_free(chain)
        if own:
            gguf.close()
    return AnchorResult(new_ids=new_ids, seconds=seconds)


def openvino_genai_pipeline(target_dir, draft_dir=None, *, n_threads: int | None = None, tuned: bool = False):
    """An OpenVINO GenAI ``LLMPipeline`` over GenAI-layout exports
    (:func:`quickdraft.backends.openvino.export.export` with ``layout="genai"``); with ``draft_dir``
    it runs GenAI's own speculative decoding. ``tuned``: each model compiled with the CPU plugin
    settings our runner uses (:func:`quickdraft.backends.openvino.runner.tuned_config`) instead of the
    plugin's defaults. Needs ``openvino-genai`` (``quickdraft[openvino]``)."""
    try:
        import openvino_genai
    except ImportError as err:  # pragma: no cover - depends on the environment
        from quickdraft.errors import QuickdraftError

        raise QuickdraftError(f"the OpenVINO GenAI anchors need openvino-genai: pip install 'quickdraft[openvino]' ({err})") from None

    def properties(path, drafting: bool = False) -> dict:
        out = {"INFERENCE_NUM_THREADS": int(n_threads or torch.get_num_threads())}
        if tuned:
            from quickdraft.backends.openvino.export import read_manifest
            from quickdraft.backends.openvino.runner import tuned_config

            out.update(tuned_config(read_manifest(path), drafting))
        return out

    if draft_dir is None:
        return openvino_genai.LLMPipeline(str(target_dir), "CPU", **properties(target_dir))
    draft = openvino_genai.draft_model(str(draft_dir), "CPU", **properties(draft_dir, drafting=True))
    return openvino_genai.LLMPipeline(str(target_dir), "CPU", draft_model=draft, scheduler_config=speculative_scheduler(),
                                      **properties(target_dir))


#: ``max_num_batched_tokens`` of GenAI's latency-oriented default (``size_t``'s maximum)
SCHEDULER_UNLIMITED = 2**64 - 1


def speculative_scheduler():
    """The scheduler of GenAI's speculative pipeline: GenAI's own default for an ``LLMPipeline``
    (no limit on the tokens batched in a step) without its prefix cache. With the prefix cache on,
    ``openvino-genai==2026.4.1.0``'s speculative decoding at T > 0 raises ``content_length <=
    prompt_ids.size() + m_generated_ids.size()`` (the hash of a cache block) and the pipeline then
    drafts nothing on any later call (docs/openvino.md, "OpenVINO GenAI as an anchor")."""
    import openvino_genai

    config = openvino_genai.SchedulerConfig()
    config.max_num_batched_tokens = SCHEDULER_UNLIMITED
    config.enable_prefix_caching = False
    return config


def openvino_genai_generate(
    pipeline,
    prompt_ids: list[int],
    *,
    sampling: SamplingParams,
    max_new_tokens: int,
    eos_token_ids: set[int],
    seed: int = 0,
    num_assistant_tokens: int | None = None,
    reuse_prefix: bool = False,
) -> AnchorResult:
    """OpenVINO GenAI's ``generate`` on token ids: plain decoding, or its speculative decoding with
    ``num_assistant_tokens`` draft tokens per step (a pipeline made with a draft model).

    The plain pipeline keeps its KV cache between calls and prefills only what follows the longest
    prefix shared with the previous call's tokens (the speculative one has no prefix cache:
    :func:`speculative_scheduler`). Unless ``reuse_prefix``, an untimed one-token call on a prompt
    that shares no first token with ``prompt_ids`` runs first in the plain pipeline, so that the
    timed call prefills its whole prompt, as every other engine in a benchmark does."""
    import numpy as np
    import openvino
    import openvino_genai

    config = openvino_genai.GenerationConfig()
    config.max_new_tokens = int(max_new_tokens)
    config.stop_token_ids = set(int(t) for t in eos_token_ids)
    if sampling.greedy:
        config.do_sample = False
    else:
        config.do_sample = True
        config.temperature = float(sampling.temperature)
        config.top_p = float(sampling.top_p)
        config.top_k = int(sampling.top_k or 0)
        config.rng_seed = int(seed)
    if num_assistant_tokens:
        config.num_assistant_tokens = int(num_assistant_tokens)
    ids = openvino.Tensor(np.asarray([prompt_ids], dtype=np.int64))
    if not reuse_prefix and not num_assistant_tokens:  # the speculative pipeline keeps no prefix
        other = openvino.Tensor(np.asarray([[1 if prompt_ids[0] != 1 else 2]], dtype=np.int64))
        flush = openvino_genai.GenerationConfig()
        flush.max_new_tokens = 1
        flush.do_sample = False
        pipeline.generate(other, flush)
    start = time.perf_counter()
    out = pipeline.generate(ids, config)
    seconds = time.perf_counter() - start
    new_ids = [int(t) for t in out.tokens[0]]
    return AnchorResult(new_ids=new_ids, seconds=seconds,
                        speculative=genai_speculative_metrics(out) if num_assistant_tokens else None)


def genai_speculative_metrics(out) -> dict | None:
    """What OpenVINO GenAI's speculative decoding reports of one ``generate`` call
    (``extended_perf_metrics``): the draft tokens it proposed and how many the target accepted, and
    the total inference time of each model in seconds, its prefills included; ``None`` where the
    result carries no such metrics."""
    m = getattr(out, "extended_perf_metrics", None)
    if m is None or not hasattr(m, "get_num_accepted_tokens"):
        return None
    return {
        "drafted_tokens": int(m.get_num_draft_tokens()),
        "accepted_tokens": int(m.get_num_accepted_tokens()),
        "target_infer_seconds": float(m.main_model_metrics.get_inference_duration().mean) / 1e3,
        "draft_infer_seconds": float(m.draft_model_metrics.get_inference_duration().mean) / 1e3,
    }
