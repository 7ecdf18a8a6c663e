"""Text in, text out: tokenisation, chat templates, stop strings and streaming around :mod:`engine`.

>>> pipe = Pipeline.from_specs("target", "draft")              # doctest: +SKIP
>>> out = pipe.generate(["Write a bubble sort in Python."], method="sd", k=4)   # doctest: +SKIP
>>> print(out.completions[0].text, out.metrics.tokens_per_second)             # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from quickdraft.decoding.amusd import AsyncDrafter
from quickdraft.decoding.contrastive import ContrastiveDrafter
from quickdraft.decoding.drafters import ModelDrafter, NGramDrafter, NGramModelDrafter
from quickdraft.decoding.engine import SKIPPABLE, Method, generate
from quickdraft.errors import QuickdraftError
from quickdraft.decoding.metrics import GenerationMetrics
from quickdraft.decoding.phrase import PhraseConfig, PhraseDrafter
from quickdraft.decoding.policies import Constant, CostAware, Policy
from quickdraft.decoding.retrieval import RetrievalDrafter, RetrievalIndex
from quickdraft.verification.rules import Fuzzy, Latent, LatentNeighbourhoods, Rule
from quickdraft.backends.costs import CostCache, StepCost, cost_key, measure_step_cost
from quickdraft.backends.runner import ModelRunner
from quickdraft.verification.sampling import SamplingParams
from quickdraft.decoding.tree import TreeConfig
from quickdraft.decoding.tree_decoding import TreeDrafter


#: end-of-turn / end-of-text markers of common chat models (Qwen, Llama 3, Phi)
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>")


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "eos" | "length" | "stop"
    metrics: GenerationMetrics


@dataclass
class PipelineOutput:
    completions: list[Completion]
    metrics: GenerationMetrics  # the whole batch


#: the openvino backend's draft when ``quantize`` is ``auto`` and nothing is said of the draft: int4
#: weights and a head over the 49,152 most frequent token ids (docs/openvino.md: a draft forward
#: costs about half the int8 one's; every lossless method stays exact)
OPENVINO_DRAFT_QUANTIZE = "int4"
#: weight formats only the openvino backend has (``int4all``: int4 with the head and embedding in int4)
OPENVINO_ONLY_FORMATS: tuple[str, ...] = ("int4all",)
#: who drafts: the draft model, or the target's feature drafter (:mod:`quickdraft.decoding.feature_drafter`)
DRAFTER_KINDS: tuple[str, ...] = ("model", "feature")
OPENVINO_DRAFT_VOCAB = 49152


def resolve_quantize(backend: str, quantize: str) -> str:
    """``quantize="auto"`` is the backend's default weights: as loaded on torch (``none``), NNCF
    ``int8`` on openvino, the GGUF's own quantisation on llamacpp (``none``: nothing applied)."""
    if quantize != "auto":
        return quantize
    return "int8" if backend == "openvino" else "none"


class Pipeline:
    """A target model (and optionally a draft model) with their tokenizer.

    Parameters
    ----------
    target_model, tokenizer:
        The target causal LM and its tokenizer.
    draft_model:
        Optional draft causal LM; its vocabulary must be the target's (checked by the caller with
        :func:`quickdraft.models.check_compatible`, done by :meth:`from_specs`).
    """

    def __init__(self, target_model, tokenizer, draft_model=None, *, target_runner=None, draft_runner=None) -> None:
        self.target_model = target_model
        self.tokenizer = tokenizer
        self.draft_model = draft_model
        # a runner of another backend (quickdraft.backends) replaces the torch ModelRunner
        self.target = target_runner if target_runner is not None else ModelRunner(target_model, "target")
        self.draft = draft_runner if draft_runner is not None else (
            ModelRunner(draft_model, "draft") if draft_model is not None else None
        )
        self.vocab_size = int(target_model.config.vocab_size)
        self._eos_ids: frozenset[int] | None = None  # filled by the first eos_ids()
        self.datastore: RetrievalIndex | None = None  # what rest / rest_sd retrieve from (set_datastore)
        self._neighbourhoods: LatentNeighbourhoods | None = None  # of the last k asked for
        #: a feature drafter's runner (:meth:`load_feature_drafter`): what drafter="feature" drafts with
        self.feature_draft: ModelRunner | None = None
        self._step_costs: StepCost | None = None  # the cost policy's measured forward costs (step_costs)
        if draft_model is not None and int(draft_model.config.vocab_size) != self.vocab_size:
            raise QuickdraftError(
                f"target and draft vocabularies differ: logits of size {self.vocab_size} vs "
                f"{int(draft_model.config.vocab_size)}"
            )

    @classmethod
    def from_specs(
        cls, target: str = "target", draft: str | None = "draft", dtype: str = "auto", *,
        backend: str = "torch", quantize: str = "auto", quantize_draft: str | None = None,
        pack: bool | None = None, draft_dtype: str | None = None, exact: bool = False,
        draft_vocab: int | None = None, threads: tuple[int, int] | None = None, plugin_defaults: bool = False,
    ) -> "Pipeline":
        """Load models by registry name, alias (``target``/``draft``), HF directory or GGUF file.

        ``backend="auto"`` is :func:`quickdraft.backends.resolve_backend`'s choice (``openvino`` where
        it is installed, else ``torch``). ``backend="llamacpp"`` runs both models' GGUF files through llama.cpp
        (:mod:`quickdraft.backends.llamacpp`, batch size 1); ``backend="openvino"`` runs OpenVINO
        exports of both models (:mod:`quickdraft.backends.openvino`, made once into the cache entry),
        with NNCF weight compression ``quantize`` (``auto`` = ``int8``, ``int4``, ``none``). On the
        torch backend ``quantize`` (``auto`` = ``none``, ``int8``, ``int4``) swaps the models' linear
        layers for weight-only quantised ones (:mod:`quickdraft.backends.quant`); ``quantize_draft`` overrides it for the draft alone (default: the
        same as ``quantize``). Quantising only the draft keeps every lossless method exactly
        target-distributed — the target's weights are untouched — while each draft step reads
        about a quarter of the bytes (``docs/performance.md``). ``pack`` puts the fp32 linear layers
        left after quantisation on oneDNN with pre-packed weights (:mod:`quickdraft.backends.packed`; default
        ``None``: where that is the fast path — fp32 on a CPU without native bf16), so that a
        verification forward over K + 1 tokens costs about as much as a one-token forward.
        ``draft_dtype`` (``auto``, ``bfloat16``, ``float32``; default ``None``: as ``dtype``) is the
        draft's dtype (:func:`quickdraft.models.resolve_draft_dtype`). ``exact`` (openvino, llamacpp) runs
        the models with batch-invariant arithmetic, so that greedy speculative output equals plain
        greedy output token for token (:class:`quickdraft.backends.openvino.OpenVINORunner`).
        ``draft_vocab`` (openvino) exports the draft with a head over that many token ids only
        (:func:`quickdraft.backends.openvino.export.draft_vocab_ids`): each draft forward reads fewer
        bytes, the drafter proposes from that subset, and every lossless method stays lossless;
        ``0`` keeps the full head. On openvino with ``quantize="auto"`` the draft's defaults are
        :data:`OPENVINO_DRAFT_QUANTIZE` weights and a head of :data:`OPENVINO_DRAFT_VOCAB` ids
        (where the vocabulary is larger); an explicit ``quantize`` applies to both models.
        ``plugin_defaults`` (openvino): compile both models with the CPU plugin's own settings
        instead of :func:`quickdraft.backends.openvino.runner.tuned_config`'s.
        ``threads`` (openvino) = the inference threads of the target and of the draft (default: each
        gets torch's thread count); ``amusd`` runs both models at once and wants the cores split
        between them (:func:`quickdraft.decoding.amusd.split_threads`).
        """
        from quickdraft.backends import BACKEND_NAMES, resolve_backend
        from quickdraft.models import check_compatible, load_model, resolve_draft_dtype
        from quickdraft.backends.quant import QUANTIZE_NAMES, quantize_by_name

        backend = resolve_backend(backend)
        if backend not in BACKEND_NAMES:
            raise QuickdraftError(f"unknown backend {backend!r}; choose one of auto, {', '.join(BACKEND_NAMES)}")
        # nothing said of the draft's weights: the openvino backend's draft preset
        default_draft = backend == "openvino" and quantize == "auto" and quantize_draft is None
        if quantize_draft is None:
            quantize_draft = OPENVINO_DRAFT_QUANTIZE if default_draft else quantize
        names = QUANTIZE_NAMES + (OPENVINO_ONLY_FORMATS if backend == "openvino" else ())
        for what, name in (("quantize", quantize), ("quantize_draft", quantize_draft)):
            if name in OPENVINO_ONLY_FORMATS and backend != "openvino":
                raise QuickdraftError(f"{what} {name!r} is a weight format of the openvino backend, not {backend}")
            if name != "auto" and name not in names:
                raise QuickdraftError(f"unknown {what} {name!r}; choose one of auto, {', '.join(names)}")
        quantize = resolve_quantize(backend, quantize)
        quantize_draft = resolve_quantize(backend, quantize_draft)
        if draft_vocab is not None and (isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int) or draft_vocab < 0):
            raise QuickdraftError(f"draft_vocab must be a number of token ids >= 0 (0: the full head), got {draft_vocab!r}")
        if draft_vocab and backend != "openvino":
            raise QuickdraftError(f"a draft vocabulary (--draft-vocab) is implemented for the openvino backend, not {backend}")
        if threads is not None and backend != "openvino":
            raise QuickdraftError(f"threads per model apply to the openvino backend, not {backend}")
        if plugin_defaults and backend != "openvino":
            raise QuickdraftError(f"plugin defaults apply to the openvino backend, not {backend}")
        if backend == "openvino":
            preset_vocab = draft_vocab is None and default_draft
            return cls._from_openvino(target, draft, quantize, quantize_draft, exact,
                                      OPENVINO_DRAFT_VOCAB if preset_vocab else (draft_vocab or None),
                                      vocab_if_larger=preset_vocab, threads=threads, tuned=not plugin_defaults)
        if backend == "llamacpp":
            if quantize != "none" or quantize_draft != "none":
                raise QuickdraftError("--quantize applies to the torch backend; llama.cpp runs the GGUF's own quantisation")
            from quickdraft.backends.llamacpp import load_llamacpp

            # exact: the target's verification on batch-invariant kernels (the draft only proposes)
            target_runner, tokenizer = load_llamacpp(target, "target", exact=True if exact else None)
            draft_runner = None
            if draft is not None:
                draft_runner, draft_tokenizer = load_llamacpp(draft, "draft")
                check_compatible(tokenizer, draft_tokenizer, target_runner.model, draft_runner.model)
            return cls(
                target_runner.model, tokenizer, draft_runner.model if draft_runner else None,
                target_runner=target_runner, draft_runner=draft_runner,
            )
        if exact:
            raise QuickdraftError("exact applies to the openvino and llamacpp backends (whose default kernels depend on "
                                  "the block size)")
        target_model, tokenizer = load_model(target, dtype=dtype)
        draft_model = None
        if draft is not None:
            draft_torch_dtype = resolve_draft_dtype(draft_dtype, dtype)
            draft_model, draft_tokenizer = load_model(draft, dtype=str(draft_torch_dtype).removeprefix("torch."))
            check_compatible(tokenizer, draft_tokenizer, target_model, draft_model)
        from quickdraft.backends.packed import maybe_pack

        quantize_by_name(target_model, quantize)
        maybe_pack(target_model, pack)
        if draft_model is not None:
            quantize_by_name(draft_model, quantize_draft)
            maybe_pack(draft_model, pack)
        return cls(target_model, tokenizer, draft_model)

    @classmethod
    def _from_openvino(cls, target: str, draft: str | None, quantize: str, quantize_draft: str,
                       exact: bool = False, draft_vocab: int | None = None,
                       vocab_if_larger: bool = False, threads: tuple[int, int] | None = None,
                       tuned: bool = True) -> "Pipeline":
        """Both models as OpenVINO exports; ``quantize`` / ``quantize_draft`` pick the NNCF weight
        format (``int8``, ``int4``, or ``none``: float32); ``vocab_if_larger``: ``draft_vocab`` applies
        only where the vocabulary has more ids (a preset, not the user's choice).

        Each model gets torch's thread count (unless ``threads`` gives one per model), and torch is
        then set to one thread
        (:func:`quickdraft.backends.threads.yield_torch_threads`): the engine's own
        torch work per step is small, and torch's idle OpenMP workers spinning beside OpenVINO's
        threads slow every forward by up to 2x on a 2-core CPU."""
        from quickdraft.backends.openvino import load_openvino
        from quickdraft.backends.threads import yield_torch_threads
        from quickdraft.models import check_compatible

        cores = yield_torch_threads()
        target_threads, draft_threads = threads or (cores, cores)

        target_runner, tokenizer = load_openvino(target, "target", weight_format=quantize, n_threads=target_threads,
                                                 exact=exact, tuned=tuned)
        draft_runner = None
        if draft is not None:
            if vocab_if_larger and draft_vocab is not None and draft_vocab >= target_runner.vocab_size:
                draft_vocab = None
            draft_runner, draft_tokenizer = load_openvino(
                draft, "draft", weight_format=quantize_draft, n_threads=draft_threads, exact=exact,
                vocab_size=target_runner.vocab_size, draft_vocab=draft_vocab, tuned=tuned,
                drafting=True)
            check_compatible(tokenizer, draft_tokenizer, target_runner.model, draft_runner.model)
        return cls(
            target_runner.model, tokenizer, draft_runner.model if draft_runner else None,
            target_runner=target_runner, draft_runner=draft_runner,
        )

    # -- text <-> ids ----------------------------------------------------------------------------
    def encode(self, prompt: str, chat: bool | None = None) -> list[int]:
        """Token ids of ``prompt``; with ``chat`` (default: when the tokenizer has a chat template)
        the prompt becomes a user message under the model's chat template."""
        check_prompt_text(prompt)
        use_chat = chat if chat is not None else bool(getattr(self.tokenizer, "chat_template", None))
        if use_chat:
            return self.encode_messages([{"role": "user", "content": prompt}])
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def encode_messages(self, messages) -> list[int]:
        """Token ids of chat ``messages`` under the model's chat template, ready for the reply."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise QuickdraftError("this tokenizer has no chat template; pass plain text with chat=False")
        messages = list(messages)
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                check_utf8(content, "message content")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def eos_ids(self) -> set[int]:
        """The ids that end a generation: the tokenizer's and the generation config's end-of-sequence
        ids and the chat end-of-turn markers the tokenizer knows as special tokens (computed once:
        reading the vocabulary costs ~0.2 s on a 151k-token tokenizer)."""
        if self._eos_ids is None:
            self._eos_ids = frozenset(self._find_eos_ids())
        return set(self._eos_ids)

    def _find_eos_ids(self) -> set[int]:
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        gen = getattr(self.target_model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
        # chat models end a turn with their end-of-turn token even when the config names another
        vocab = self.tokenizer.get_vocab()
        for token in END_OF_TURN_TOKENS:
            if token in vocab and token in (self.tokenizer.all_special_tokens or []) + list(
                getattr(self.tokenizer, "added_tokens_encoder", {}) or {}
            ):
                ids.add(int(vocab[token]))
        return ids

    def set_datastore(self, source: str | Path | RetrievalIndex | None, field: str = "text") -> RetrievalIndex | None:
        """Make ``source`` the datastore of the ``rest`` and ``rest_sd`` methods and return its index:
        a :class:`RetrievalIndex`, a saved index (``.npz``), or a directory, text file or ``.jsonl``
        corpus (``field``: its text field) tokenised with this pipeline's tokenizer
        (:meth:`RetrievalIndex.from_path`). ``None`` removes it."""
        if source is None or isinstance(source, RetrievalIndex):
            self.datastore = source
        else:
            self.datastore = RetrievalIndex.from_path(source, self.tokenizer, field)
        return self.datastore

    #: (shortest, longest) n-gram matched by default: any repeat for ``ngram`` (a miss costs
    #: nothing there), two tokens or more for ``ngram_sd`` (a miss costs a draft-model step)
    NGRAM_DEFAULTS = {"ngram": (1, 3), "ngram_sd": (2, 4)}

    def load_feature_drafter(self, path: str | Path | None = None, head_vocab: int | None = None) -> None:
        """Load the target's EAGLE-style feature drafter (``path``: a directory written by
        ``quickdraft train-drafter``; default: the one in the target's cache entry) for
        ``drafter="feature"``; ``head_vocab`` overrides its head cut (0: the whole head). The torch
        backend only: the drafter reads the target's hidden states."""
        from quickdraft.decoding.feature_drafter import require_torch_target
        from quickdraft.decoding.feature_model import FeatureDraftModel, default_drafter_dir

        require_torch_target(self.target)
        if path is None:
            path = default_drafter_dir(getattr(self.target_model, "name_or_path", None) or "target")
        model, _ = FeatureDraftModel.load(path, self.target_model, head_vocab=head_vocab,
                                          eos_ids=tuple(sorted(self.eos_ids())))
        self.feature_draft = ModelRunner(model, "feature drafter")

    def drafter_for(self, method: str, ngram: tuple[int, int] | None = None, lookup_k: int = 8,
                    tree: TreeConfig | None = None, verifier: str = "rrs", draft: ModelRunner | None = None,
                    datastore: RetrievalIndex | None = None, phrase: PhraseConfig | None = None,
                    drafter: str = "model"):
        """The drafter of ``method`` (``None`` for ``ar``) over ``draft`` (default: this pipeline's
        draft runner); ``tree`` and ``verifier`` shape the ``tree`` method's trees (default
        :class:`TreeConfig`); ``rest`` and ``rest_sd`` retrieve from ``datastore`` (default:
        :attr:`datastore`); ``phrase_sd`` drafts with ``phrase`` (default :class:`PhraseConfig`); ``cd``
        and ``scd`` take the draft model as the amateur (:class:`ContrastiveDrafter`, its full head).
        ``drafter="feature"``: chains (``sd`` and the chain rules) and trees come from the feature
        drafter (:meth:`load_feature_drafter`) instead of the draft model."""
        if drafter not in DRAFTER_KINDS:
            raise QuickdraftError(f"unknown drafter {drafter!r}; choose one of {', '.join(DRAFTER_KINDS)}")
        if drafter == "feature":
            return self._feature_drafter_for(method, tree, verifier)
        ngram_min, ngram_max = ngram or self.NGRAM_DEFAULTS.get(method, (1, 3))
        draft = draft if draft is not None else self.draft
        datastore = datastore if datastore is not None else self.datastore
        if method in ("rest", "rest_sd") and datastore is None:
            raise QuickdraftError(f"method {method!r} needs a datastore to retrieve from (--datastore PATH)")
        if method == "ngram":
            return NGramDrafter(self.vocab_size, max_ngram=ngram_max, min_ngram=ngram_min)
        if method == "rest":
            return RetrievalDrafter(self.vocab_size, datastore)
        if method == "ar":
            return None
        if draft is None:
            raise QuickdraftError(f"method {method!r} needs a draft model (--draft)")
        if method == "tree":
            return TreeDrafter(draft, self.vocab_size, tree or TreeConfig(), verifier)
        if method == "ngram_sd":
            return NGramModelDrafter(
                NGramDrafter(self.vocab_size, max_ngram=ngram_max, min_ngram=ngram_min),
                ModelDrafter(draft, self.vocab_size), lookup_k=lookup_k,
            )
        if method == "rest_sd":
            return NGramModelDrafter(RetrievalDrafter(self.vocab_size, datastore),
                                     ModelDrafter(draft, self.vocab_size), lookup_k=lookup_k)
        if method == "phrase_sd":
            return PhraseDrafter(draft, self.vocab_size, phrase or PhraseConfig())
        if method == "amusd":
            return AsyncDrafter(draft, self.vocab_size)
        if method in ("cd", "scd"):
            self._require_full_head(draft, f"method {method!r} contrasts the target with the draft model's whole "
                                           "distribution")
            return ContrastiveDrafter(draft, self.vocab_size, drafts=method == "scd")
        return ModelDrafter(draft, self.vocab_size)

    def _feature_drafter_for(self, method: str, tree: TreeConfig | None, verifier: str):
        from quickdraft.decoding.feature_drafter import FeatureDrafter, FeatureTreeDrafter

        if method == "ar":
            return None
        if method not in ("sd", "tree"):
            raise QuickdraftError(f"the feature drafter drafts chains (sd, fsd, typical, ersd, lantern) and trees, "
                                  f"not method {method!r}")
        if self.feature_draft is None:
            raise QuickdraftError("drafter 'feature' needs a feature drafter: Pipeline.load_feature_drafter() "
                                  "(train one with `quickdraft train-drafter`)")
        if method == "tree":
            return FeatureTreeDrafter(self.feature_draft, self.target, self.vocab_size, tree or TreeConfig(), verifier)
        return FeatureDrafter(self.feature_draft, self.target, self.vocab_size)

    # -- latent neighbourhoods (LANTERN) ---------------------------------------------------------
    def token_embeddings(self) -> torch.Tensor:
        """``[V, D]`` the target's input token embeddings.

        On the torch backend the loaded model's embedding weight; on the others the
        ``*embed_tokens.weight`` tensor of the safetensors in the model's directory or the cache
        entry above its export (the OpenVINO exports live inside their cache entry). A GGUF file
        (llama.cpp) has no safetensors: that is a :class:`QuickdraftError`.
        """
        get = getattr(self.target_model, "get_input_embeddings", None)
        if callable(get):
            return get().weight.detach()
        source = Path(str(getattr(self.target_model, "name_or_path", "")))
        for directory in (source, source.parent):
            for path in sorted(directory.glob("*.safetensors")) if directory.is_dir() else ():
                from safetensors import safe_open

                with safe_open(str(path), framework="pt") as weights:
                    for key in weights.keys():
                        if key.endswith("embed_tokens.weight"):
                            return weights.get_tensor(key)
        raise QuickdraftError(
            f"LANTERN needs the target's token embeddings, and no safetensors with an embed_tokens weight was found "
            f"beside {source} (the llamacpp backend's GGUF files do not give them); use --backend torch or openvino"
        )

    def latent_neighbourhoods(self, k: int) -> LatentNeighbourhoods:
        """The target's latent neighbourhoods of size k (:class:`quickdraft.verification.rules.LatentNeighbourhoods`:
        rows computed as tokens are drafted and kept), one per pipeline while k stays the same.
        A k beyond the vocabulary gives all V tokens."""
        k = min(k, self.vocab_size)
        if self._neighbourhoods is None or self._neighbourhoods.k != k:
            embeddings = self.token_embeddings()
            if embeddings.shape[0] != self.vocab_size:
                raise QuickdraftError(f"the target's embedding has {embeddings.shape[0]} rows, its vocabulary "
                                      f"{self.vocab_size} tokens: LANTERN needs one embedding per token")
            self._neighbourhoods = LatentNeighbourhoods(embeddings, k)
        return self._neighbourhoods

    def _require_full_head(self, draft, why: str, other: str = "") -> None:
        """A :class:`QuickdraftError` saying ``why`` when ``draft`` (a runner) has a head cut to part
        of the vocabulary (an openvino draft exported with ``--draft-vocab``); ``other``: another way out."""
        head_ids = getattr(draft, "head_ids", None)
        if head_ids is not None:
            raise QuickdraftError(
                f"{why}; this draft has a reduced head of {len(head_ids):,} of the {self.vocab_size:,} token ids: "
                f"load it with its full head (--draft-vocab 0, or an explicit --quantize-draft){other}")

    def ready_rule(self, rule: Rule | None) -> Rule | None:
        """``rule`` with what it needs from the target attached: a :class:`~quickdraft.verification.rules.Latent`
        rule without neighbourhoods gets the target's (:meth:`latent_neighbourhoods`). A rule that needs
        the draft's whole distribution (``needs_full_draft``) with a draft whose head was cut to part
        of the vocabulary is a :class:`QuickdraftError` naming the fix."""
        if getattr(rule, "needs_full_draft", False):
            if isinstance(rule, Fuzzy):
                self._require_full_head(self.draft, f"FSD's {rule.divergence!r} divergence is infinite wherever the "
                                        "draft gives a token no probability, so every draft would be rejected",
                                        other=", or use a divergence that stays finite (jsd, kl, tv)")
            else:
                self._require_full_head(self.draft, f"the {rule.name} rule reads the draft's probability of every token")
        if isinstance(rule, Latent) and rule.neighbours is None:
            return dataclasses.replace(rule, neighbours=self.latent_neighbourhoods(rule.k))
        return rule

    def ready_policy(self, policy: Policy, method: str, max_rows: int = 1) -> Policy:
        """``policy`` ready for ``method`` on this pipeline: a :class:`CostAware` policy without
        costs gets this pipeline's measured forward costs (:meth:`step_costs`, over batches of up to
        ``max_rows`` rows), without the draft model's for the model-free drafters (``ngram``,
        ``rest``)."""
        if not isinstance(policy, CostAware) or policy.costs is not None or method not in SKIPPABLE:
            return policy
        costs = self.step_costs(policy.max_k, max_rows=max_rows)
        return dataclasses.replace(policy, costs=costs.without_draft() if method in ("ngram", "rest") else costs)

    def step_costs(self, max_k: int = 8, *, max_rows: int = 1, cache: CostCache | None | bool = True,
                   refresh: bool = False, on_measure: Callable[[CostCache | None], None] | None = None) -> StepCost:
        """The target's forward costs over 1 … ``max_k + 1`` tokens and the draft's over one, in one
        batch row and, for ``max_rows > 1``, in the batches of
        :func:`~quickdraft.backends.costs.batch_grid` (``StepCost.batched``).

        Measured on this pipeline's runners after a 128-token context
        (:func:`quickdraft.backends.costs.measure_step_cost`, median of 3 rounds; about 11 s for the
        default pair on llama.cpp on two AVX2 cores) and kept for the pipeline's life. ``cache``: a
        :class:`~quickdraft.backends.costs.CostCache` that keeps them across processes, keyed by
        the machine and the runners (:func:`~quickdraft.backends.costs.cost_key`); ``True``: the
        one in the model cache; ``False`` or ``None``: none. ``refresh``: measure again (and store).
        ``on_measure(store)`` is called just before a measurement (``store``: where it will be kept,
        ``None`` where it will not), so that a caller can say why it waits.
        """
        held = self._step_costs
        if not refresh and held is not None and len(held.target) >= max_k + 1 and held.max_rows >= max_rows:
            return held
        store = CostCache.default() if cache is True else (cache or None)
        key = cost_key(self.target, self.draft) if store is not None else None
        cost = None if key is None or refresh else store.get(key, max_k, max_rows)
        if cost is None:
            if on_measure is not None:
                on_measure(store if key is not None else None)
            context = [(7 * i + 11) % min(self.vocab_size, 1000) for i in range(128)]
            cost = measure_step_cost(self.target, self.draft, context, max_k, repeats=3, max_rows=max_rows)
            if key is not None:
                store.put(key, cost)
        self._step_costs = cost
        return cost

    # -- generation ------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[str] | str,
        *,
        method: Method = "sd",
        k: int = 4,
        policy: Policy | None = None,
        rule: Rule | None = None,
        sampling: SamplingParams = SamplingParams(),
        max_new_tokens: int = 128,
        seed: int | None = 0,
        stop_strings: tuple[str, ...] = (),
        chat: bool | None = None,
        on_text: Callable[[int, str], None] | None = None,
        prompt_ids: list[list[int]] | None = None,
        tree: TreeConfig | None = None,
        verifier: str = "rrs",
        ngram: tuple[int, int] | None = None,
        lookup_k: int = 8,
        datastore: str | Path | RetrievalIndex | None = None,
        phrase: PhraseConfig | None = None,
        drafter: str = "model",
    ) -> PipelineOutput:
        """Generate a completion for every prompt (one real batch through the models).

        ``prompts`` is a list of texts, or one text (one prompt, one completion). ``stop_strings``
        must be non-empty texts. ``prompt_ids`` (token ids in the target's vocabulary) replace
        ``prompts`` when given.

        ``ngram`` = (shortest, longest) n-gram the ``ngram`` and ``ngram_sd`` methods match (default:
        :attr:`NGRAM_DEFAULTS`): a longer shortest n-gram drafts less often and more accurately, for
        backends whose verification cost grows with K. ``lookup_k``: tokens an ``ngram_sd`` lookup
        step copies (its model steps draft ``policy``'s length), and likewise a ``rest_sd`` retrieval
        step. ``datastore``: what ``rest`` and ``rest_sd`` retrieve from in this call (a
        :class:`RetrievalIndex` or a path, indexed anew; default: the pipeline's, :meth:`set_datastore`).
        ``phrase``: the phrase pool and draft limits of ``phrase_sd`` (default :class:`PhraseConfig`).
        ``drafter``: ``model`` (the draft model) or ``feature`` (the feature drafter, :meth:`drafter_for`).
        A LANTERN ``rule``
        (:class:`~quickdraft.verification.rules.Latent`) without neighbourhoods gets the target's
        (:meth:`ready_rule`).
        """
        stop_strings = check_stop_strings(stop_strings)
        if datastore is not None and not isinstance(datastore, RetrievalIndex):
            datastore = RetrievalIndex.from_path(datastore, self.tokenizer)
        if prompt_ids is None:
            if isinstance(prompts, str):
                prompts = [prompts]
            if not isinstance(prompts, (list, tuple)) or not prompts:
                raise QuickdraftError("prompts must be a text or a non-empty list of texts")
        ids = prompt_ids if prompt_ids is not None else [self.encode(p, chat) for p in prompts]
        printed = [0] * len(ids)
        texts: list[str] = [""] * len(ids)
        new_ids: list[list[int]] = [[] for _ in ids]

        def decode(tokens: list[int]) -> str:
            return self.tokenizer.decode(tokens, skip_special_tokens=True)

        def stop(row: int, tokens: list[int]) -> int | None:
            if not stop_strings:
                return None
            text = decode(tokens)
            if not any(s in text for s in stop_strings):
                return None
            for j in range(1, len(tokens) + 1):  # fewest tokens whose text holds a stop string
                if any(s in decode(tokens[:j]) for s in stop_strings):
                    return j
            return len(tokens)

        def on_tokens(row: int, tokens: list[int]) -> None:
            new_ids[row].extend(tokens)
            if on_text is None:
                return
            text = _cut_at_stop(decode(new_ids[row]), stop_strings)
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next tokens
                return
            if len(text) > printed[row]:
                on_text(row, text[printed[row]:])
                printed[row] = len(text)

        try:
            out = generate(
                self.target,
                ids,
                method=method,
                drafter=self.drafter_for(method, ngram=ngram, lookup_k=lookup_k, tree=tree, verifier=verifier,
                                         datastore=datastore, phrase=phrase, drafter=drafter),
                rule=self.ready_rule(rule),
                policy=self.ready_policy(policy or Constant(k), method, max_rows=len(ids)),
                sampling=sampling,
                max_new_tokens=max_new_tokens,
                seed=seed,
                eos_token_ids=self.eos_ids(),
                stop=stop if stop_strings else None,
                on_tokens=on_tokens,
            )
        finally:
            if drafter == "feature":  # the target stops recording its hidden states
                self.target.record_hidden = False
        completions = []
        for row, seq in enumerate(out.sequences):
            texts[row] = _cut_at_stop(decode(seq), stop_strings)
            completions.append(Completion(texts[row], seq, out.finish_reasons[row], out.metrics[row]))
        return PipelineOutput(completions, out.batch_metrics)


def check_utf8(text: str, what: str) -> None:
    """Raise :class:`QuickdraftError` unless ``text`` is encodable as UTF-8 (a str holding a lone
    surrogate, e.g. from command-line bytes that are not UTF-8, is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise QuickdraftError(
            f"{what} is not valid UTF-8 text: {text[err.start:err.end]!r} at character {err.start}"
        ) from None


def check_prompt_text(prompt: str) -> None:
    """Raise :class:`QuickdraftError` unless ``prompt`` is a non-blank, UTF-8 encodable str."""
    if not isinstance(prompt, str):
        raise QuickdraftError(f"a prompt must be a str, got {type(prompt).__name__}")
    if not prompt.strip():
        raise QuickdraftError("empty prompt: give some text to continue")
    check_utf8(prompt, "prompt")


def check_stop_strings(stop_strings) -> tuple[str, ...]:
    """``stop_strings`` as a tuple, after checking that each is a non-empty, UTF-8 encodable str
    (an empty stop string occurs in every text and would end generation after one token)."""
    if isinstance(stop_strings, str):
        stop_strings = (stop_strings,)
    stop_strings = tuple(stop_strings)
    for s in stop_strings:
        if not isinstance(s, str):
            raise QuickdraftError(f"a stop string must be a str, got {type(s).__name__}")
        if not s:
            raise QuickdraftError("empty stop string: it would end generation after the first token")
        check_utf8(s, "stop string")
    return stop_strings


def _cut_at_stop(text: str, stop_strings: tuple[str, ...]) -> str:
    cuts = [text.find(s) for s in stop_strings if s and s in text]
    return text[: min(cuts)] if cuts else text


def set_threads(n: int | None) -> None:
    if n:
        torch.set_num_threads(n)
