"""A llama.cpp backend: :class:`LlamaCppRunner` runs a GGUF file behind the ``ModelRunner`` interface.

It drives ``llama-cpp-python``'s low-level C API directly (no high-level ``Llama`` object):

* one ``llama_decode`` per ``forward`` over the whole block of ``m`` new tokens, asking for logits
  only at the last ``logits_to_keep`` positions (``llama_batch.logits[i] = 1``), so verifying K
  draft tokens is one call that returns ``[1, K+1, V]`` float32 logits;
* roll-back is ``llama_memory_seq_rm(mem, seq=0, p0=new_length, p1=-1)``, which drops every cached
  position ``>= new_length`` (the ``llama_kv_cache_seq_rm`` of older releases);
* the sampling, the verification and the rules stay in torch, on the logits this backend returns.

Exactness. llama.cpp's CPU kernels depend on how many tokens one ``llama_decode`` holds, so the
logits of a token verified inside a block of K+1 are not bitwise those of the same token decoded
alone. Three kernel switches cause it (measured with llama-cpp-python 0.3.36, Qwen2.5 Q4_K_M):

* repacked weights (``use_extra_bufts``) multiply 4 rows at a time with a GEMM kernel and the
  remaining rows with a GEMV kernel, so blocks of 4 or more tokens differ from 1-token decodes;
* without repacking, blocks of 8 or more tokens still take another kernel path;
* flash attention over an F16/F32 KV cache decodes a single token with a split-KV kernel once the
  cache view reaches 512 cells (more than 256 cached tokens), and a block with the per-row kernel.

By default (``exact=False``: repacking on, llama.cpp's default attention and F16 cache) greedy
speculative output therefore can depart from this backend's plain greedy output, and the runner's
plain greedy output (prompt minus its last token in one call, then one token per call) can depart
from llama.cpp's own (whole prompt in one call). ``exact=True`` turns the three switches off: no
repacking, flash attention on, a BF16 KV cache (no split-KV kernel), and blocks of up to
:data:`EXACT_SPLIT_MAX` tokens (every verification block) decoded in calls of at most
:data:`EXACT_CALL_TOKENS` tokens. Then every token's logits are bitwise those of 1-token decoding
and greedy speculative output equals plain greedy output, at 1.2-1.4x the time per forward on
the machine measured (docs/backends.md, benchmarks/bench_llamacpp_exactness.py).

Batch size 1 only (``reset(B)`` with ``B > 1`` raises); trees would use more sequence ids.

Weight repacking is on by default except on CPUs with AMX: with AMX repacking on, the first
forward of the default models crashes.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from quickdraft.errors import QuickdraftError
from quickdraft.verification.verify import MAX_DRAFT_LENGTH
from quickdraft.backends.runner import ForwardOutput

_BACKEND_READY = False

#: In exact mode, the most tokens one ``llama_decode`` call holds: blocks of up to this many tokens
#: give each token bitwise the logits of 1-token decoding (8 or more take another matmul path).
EXACT_CALL_TOKENS = 7
#: In exact mode, blocks of more tokens than this (prefills) are decoded in one call each, as
#: outside exact mode (the same prompt is prefilled the same way by every method); every
#: verification block (at most ``MAX_DRAFT_LENGTH`` drafts plus one) is split.
EXACT_SPLIT_MAX = MAX_DRAFT_LENGTH + 1
#: ``ggml_type`` of the KV cache in exact mode (``GGML_TYPE_BF16``).
_GGML_TYPE_BF16 = 30


def import_llama_cpp():
    """The ``llama_cpp`` module, or a :class:`QuickdraftError` saying how to install it."""
    try:
        import llama_cpp  # noqa: PLC0415
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise QuickdraftError(
            "the llamacpp backend needs llama-cpp-python: pip install 'quickdraft[llamacpp]' "
            f"(compiles llama.cpp, ~4 min) ({err})"
        ) from None
    return llama_cpp


def default_repack() -> bool:
    """Whether to let llama.cpp repack weights (``use_extra_bufts``) by default: yes, unless the CPU
    has AMX, where the repacked first forward crashes on the default models."""
    from quickdraft.models import cpu_flags

    return not any(flag.startswith("amx") for flag in cpu_flags())


def is_available() -> bool:
    """Whether ``llama-cpp-python`` can be imported."""
    try:
        import_llama_cpp()
    except QuickdraftError:
        return False
    return True


def _init_backend(llama_cpp) -> None:
    global _BACKEND_READY
    if not _BACKEND_READY:
        llama_cpp.llama_backend_init()
        _silence_logs(llama_cpp)
        _BACKEND_READY = True


_LOG_CALLBACK = None  # keep the ctypes callback alive


def _silence_logs(llama_cpp) -> None:
    """Drop llama.cpp's informational logging (errors still reach stderr)."""
    global _LOG_CALLBACK
    if os.environ.get("QUICKDRAFT_LLAMA_VERBOSE"):
        return

    @llama_cpp.llama_log_callback
    def _log(level, text, user_data):  # pragma: no cover - C callback
        if level == 4 and text:  # GGML_LOG_LEVEL_ERROR (NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5)
            os.write(2, text)

    _LOG_CALLBACK = _log
    llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


class LlamaGGUF:
    """A loaded GGUF model plus one context (KV cache), freed on :meth:`close`.

    Parameters
    ----------
    path:
        The ``.gguf`` file.
    n_ctx:
        KV-cache capacity in tokens (the maximum sequence length).
    n_threads:
        CPU threads for single-token and batch decoding.
    n_batch:
        Largest block passed to one ``llama_decode`` (longer prefills are split).
    repack:
        ``use_extra_bufts``: let llama.cpp repack weights for the CPU's extra buffer types;
        ``None`` (default): on unless the CPU has AMX (:func:`default_repack`).
    exact:
        Choose the kernels so that a token's logits do not depend on the block it is decoded in
        (see the module docstring): no repacking, flash attention, BF16 KV cache, and
        :meth:`decode` splits blocks of up to :data:`EXACT_SPLIT_MAX` tokens into calls of at most
        :data:`EXACT_CALL_TOKENS`.
    """

    def __init__(self, path: str | os.PathLike[str], *, n_ctx: int = 4096, n_threads: int = 2,
                 n_batch: int = 512, repack: bool | None = None, exact: bool = False) -> None:
        self.lib = lib = import_llama_cpp()
        path = Path(path)
        if not path.is_file():
            raise QuickdraftError(f"no GGUF file at {path}")
        if exact and repack:
            raise QuickdraftError("exact mode needs repack off (repacked weights give block-size dependent logits)")
        _init_backend(lib)
        self.exact = bool(exact)
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = 0
        if hasattr(mparams, "use_extra_bufts"):
            mparams.use_extra_bufts = False if exact else (default_repack() if repack is None else bool(repack))
        #: whether llama.cpp may repack the weights (None: this llama.cpp cannot)
        self.repack = bool(mparams.use_extra_bufts) if hasattr(mparams, "use_extra_bufts") else None
        self.model = lib.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise QuickdraftError(f"llama.cpp could not load {path}")
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = int(n_ctx)
        cparams.n_batch = int(n_batch)
        cparams.n_ubatch = int(n_batch)
        cparams.n_threads = int(n_threads)
        cparams.n_threads_batch = int(n_threads)
        cparams.n_seq_max = 1
        if exact:
            cparams.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
            cparams.type_k = cparams.type_v = _GGML_TYPE_BF16
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise QuickdraftError(f"llama.cpp could not create a context of {n_ctx} tokens for {path}")
        self.path = path
        self.n_ctx = int(lib.llama_n_ctx(self.ctx))
        #: the threads llama.cpp decodes with, as it reports them
        self.n_threads = int(lib.llama_n_threads(self.ctx))
        self.n_batch = int(n_batch)
        self.memory = lib.llama_get_memory(self.ctx)
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))
        self.batch = lib.llama_batch_init(self.n_batch, 0, 1)
        self._split_logits: np.ndarray | None = None

    def decode(self, tokens: list[int], start_pos: int, want_logits: list[bool]) -> None:
        """Decode ``tokens`` at positions ``start_pos, start_pos + 1, …`` of sequence 0: one
        ``llama_decode``, or in exact mode, for blocks of more than :data:`EXACT_CALL_TOKENS` and at
        most :data:`EXACT_SPLIT_MAX` tokens, one call per :data:`EXACT_CALL_TOKENS` tokens."""
        n = len(tokens)
        if n > self.n_batch:
            raise QuickdraftError(f"llama.cpp batch of {n} tokens exceeds n_batch={self.n_batch}")
        self._split_logits = None
        if not (self.exact and EXACT_CALL_TOKENS < n <= EXACT_SPLIT_MAX):
            self._decode_call(tokens, start_pos, want_logits)
            return
        parts = []
        for i in range(0, n, EXACT_CALL_TOKENS):
            want = want_logits[i:i + EXACT_CALL_TOKENS]
            self._decode_call(tokens[i:i + EXACT_CALL_TOKENS], start_pos + i, want)
            if any(want):
                parts.append(self._read_logits(sum(want)))
        self._split_logits = np.concatenate(parts) if parts else np.zeros((0, self.n_vocab), np.float32)

    def _decode_call(self, tokens: list[int], start_pos: int, want_logits: list[bool]) -> None:
        n = len(tokens)
        b = self.batch
        b.n_tokens = n
        for i, (tok, want) in enumerate(zip(tokens, want_logits)):
            b.token[i] = tok
            b.pos[i] = start_pos + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1 if want else 0
        code = self.lib.llama_decode(self.ctx, b)
        if code != 0:
            raise QuickdraftError(f"llama_decode failed with code {code} ({n} tokens at position {start_pos})")

    def _read_logits(self, rows: int) -> np.ndarray:
        ptr = self.lib.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(ptr, shape=(rows, self.n_vocab)).copy()

    def logits(self, rows: int) -> np.ndarray:
        """``[rows, n_vocab]`` float32 copy of the logits the last :meth:`decode` produced."""
        if self._split_logits is not None:
            if rows != len(self._split_logits):
                raise QuickdraftError(f"the last decode produced {len(self._split_logits)} rows of logits, not {rows}")
            return self._split_logits.copy()
        return self._read_logits(rows)

    def remove_from(self, position: int) -> None:
        """Drop every cached token at a position ``>= position``."""
        if not self.lib.llama_memory_seq_rm(self.memory, 0, int(position), -1):
            raise QuickdraftError(f"llama.cpp could not remove cached positions >= {position}")

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.memory, True)

    def close(self) -> None:
        lib = self.lib
        if getattr(self, "batch", None) is not None:
            lib.llama_batch_free(self.batch)
            self.batch = None
        if getattr(self, "ctx", None):
            lib.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            lib.llama_model_free(self.model)
            self.model = None

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        try:
            self.close()
        except Exception:
            pass


class LlamaCppRunner:
    """The ``ModelRunner`` interface over a GGUF model run by llama.cpp (batch size 1).

    Parameters
    ----------
    path:
        The ``.gguf`` file.
    name:
        Used in error messages ("target", "draft").
    vocab_size:
        Width of the returned logits (default: the GGUF's vocabulary). When it is larger than the
        GGUF's vocabulary the extra columns are ``-inf`` (tokens the model cannot emit); when smaller,
        the logits are cut.
    n_ctx, n_threads, n_batch, repack:
        See :class:`LlamaGGUF`.
    exact:
        Every token's logits bitwise those of 1-token decoding, whatever block it comes in (see
        the module docstring and :class:`LlamaGGUF`).
    generation_config:
        Exposed as ``model.generation_config`` (for EOS ids), optional.

    Attributes
    ----------
    lengths:
        ``[B]`` int64 tokens held in the cache.
    num_forwards:
        ``llama_decode`` calls made through :meth:`forward` (a split prefill counts once).
    model:
        A stand-in with ``config.vocab_size`` and ``config.max_position_embeddings``.
    """

    def __init__(self, path: str | os.PathLike[str], name: str = "model", *, vocab_size: int | None = None,
                 n_ctx: int = 4096, n_threads: int = 2, n_batch: int = 512, repack: bool | None = None,
                 exact: bool = False, generation_config=None) -> None:
        self.gguf = LlamaGGUF(path, n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch, repack=repack, exact=exact)
        self.exact = bool(exact)
        self.name = name
        self.device = torch.device("cpu")
        self.vocab_size = int(vocab_size) if vocab_size else self.gguf.n_vocab
        self.max_positions = self.gguf.n_ctx
        config = SimpleNamespace(vocab_size=self.vocab_size, max_position_embeddings=self.max_positions)
        self.model = SimpleNamespace(config=config, generation_config=generation_config, name_or_path=str(path))
        self.num_forwards = 0
        self.reset(0)

    def cost_identity(self) -> dict | None:
        """What decides this runner's forward times (:func:`quickdraft.backends.costs.cost_key`)."""
        from quickdraft.backends.costs import path_identity

        weights = path_identity(self.gguf.path)
        version = getattr(self.gguf.lib, "__version__", None)
        return None if weights is None else {
            "runtime": f"llama.cpp {version}", "weights": weights, "threads": self.gguf.n_threads,
            "batch": self.gguf.n_batch, "repack": self.gguf.repack, "exact": self.exact}

    # -- state -----------------------------------------------------------------------------------
    def reset(self, batch_size: int) -> None:
        if batch_size > 1:
            raise QuickdraftError(
                f"{self.name}: the llamacpp backend runs one sequence at a time (batch size 1), got {batch_size} prompts; "
                "generate them one by one or use --backend torch"
            )
        self.gguf.clear()
        self.lengths = torch.zeros(batch_size, dtype=torch.long)  # [B]

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    # -- forward ---------------------------------------------------------------------------------
    def forward(
        self,
        tokens: torch.Tensor,
        valid: torch.Tensor | None = None,
        *,
        logits_to_keep: int = 0,
        output_hidden: bool = False,
    ) -> ForwardOutput:
        """Append ``tokens [1, m]`` (left padding marked False in ``valid [1, m]``) and return the
        float32 logits ``[1, logits_to_keep or m, V]`` of the last columns (zeros at padding)."""
        if output_hidden:
            raise QuickdraftError(f"{self.name}: the llamacpp backend does not return hidden states; "
                                  "use a draft-length policy that does not need them")
        if tokens.dim() != 2:
            raise QuickdraftError(f"{self.name}: tokens must be [B, m], got shape {tuple(tokens.shape)}")
        b, m = tokens.shape
        if b != self.batch_size:
            raise QuickdraftError(f"{self.name}: batch of {b} rows, cache has {self.batch_size}")
        row_valid = torch.ones(m, dtype=torch.bool) if valid is None else valid[0].cpu()
        ids = tokens[0].cpu()[row_valid].tolist()
        n_pad = m - len(ids)
        if n_pad and bool(row_valid[n_pad:].logical_not().any()):
            raise QuickdraftError(f"{self.name}: padding must come before the valid tokens (left-padded)")
        keep = m if logits_to_keep <= 0 else min(int(logits_to_keep), m)
        start = int(self.lengths[0])
        if start + len(ids) > self.max_positions:
            raise QuickdraftError(
                f"{self.name}: context overflow: {start + len(ids)} tokens exceed the llama.cpp context of "
                f"{self.max_positions}; shorten the prompt or max_new_tokens"
            )
        out = torch.zeros(1, keep, self.vocab_size, dtype=torch.float32)  # [1, keep, V]
        n_real_kept = min(keep, len(ids))  # kept columns that hold real tokens (the last ones)
        pos, chunk = 0, self.gguf.n_batch
        while pos < len(ids):
            part = ids[pos:pos + chunk]
            first_kept = len(ids) - n_real_kept  # index (within ids) of the first token whose logits we keep
            want = [pos + i >= first_kept for i in range(len(part))]
            self.gguf.decode(part, start + pos, want)
            rows = sum(want)
            if rows:
                logits = torch.from_numpy(self.gguf.logits(rows))  # [rows, n_vocab]
                col0 = keep - n_real_kept + (pos + want.index(True) - first_kept)
                width = min(self.vocab_size, logits.shape[1])
                out[0, col0:col0 + rows, :width] = logits[:, :width]
                if width < self.vocab_size:
                    out[0, col0:col0 + rows, width:] = float("-inf")
            pos += len(part)
        self.lengths = self.lengths + len(ids)
        self.num_forwards += 1
        if torch.isnan(out).any():
            raise QuickdraftError(f"the {self.name} model produced NaN logits")
        return ForwardOutput(logits=out, hidden=None)

    def truncate(self, new_lengths: torch.Tensor) -> None:
        """Roll back to the first ``new_lengths[0]`` tokens (``[B]`` int64)."""
        new_lengths = new_lengths.cpu()
        if (new_lengths > self.lengths).any():
            raise QuickdraftError(f"{self.name}: cannot truncate a row beyond its length")
        if self.batch_size and int(new_lengths[0]) < int(self.lengths[0]):
            self.gguf.remove_from(int(new_lengths[0]))
        self.lengths = new_lengths.clone().long()

    def close(self) -> None:
        self.gguf.close()


def gguf_path_for(spec: str | os.PathLike[str]) -> Path:
    """The GGUF file behind a model spec: a ``.gguf`` file itself, or the ``model.gguf`` that an
    installed cache entry (``quickdraft models install``) keeps next to its checkpoint."""
    from quickdraft.models import resolve

    path = resolve(spec)
    if path.is_file():
        if path.suffix != ".gguf":
            raise QuickdraftError(f"the llamacpp backend needs a .gguf file, got {path}")
        return path
    gguf = path / "model.gguf"
    if not gguf.is_file():
        raise QuickdraftError(f"no model.gguf in {path}; the llamacpp backend runs GGUF files only")
    return gguf


#: the methods ``--backend auto`` may run on llama.cpp (chains of one sequence; every acceptance rule of
#: these works on logits alone)
AUTO_METHODS: tuple[str, ...] = ("ar", "sd", "ngram", "ngram_sd", "fsd", "typical", "ersd")


def has_gguf(spec: str | os.PathLike[str]) -> bool:
    """Whether the model ``spec`` names has a GGUF file for this backend (:func:`gguf_path_for`)."""
    try:
        gguf_path_for(spec)
    except QuickdraftError:
        return False
    return True


def runs_on_llamacpp(method: str, engine_method: str, *, prompts: int, target: str, draft: str | None,
                     needs_hidden: bool = False, backend_options: bool = False) -> bool:
    """Whether a ``generate`` request runs on this backend, so that ``--backend auto`` may pick it
    (:func:`quickdraft.backends.resolve_backend`): one prompt, a method of :data:`AUTO_METHODS` as a
    chain (not a tree), no policy or drafter that reads hidden states (``needs_hidden``), no option of
    another backend (``backend_options``: weight formats, a draft vocabulary, plugin settings), and a
    GGUF file for the target and for the draft where the method drafts with one."""
    if prompts != 1 or method not in AUTO_METHODS or engine_method == "tree" or needs_hidden or backend_options:
        return False
    return has_gguf(target) and (draft is None or has_gguf(draft))


def exact_from_env(name: str) -> bool:
    """Whether :func:`load_llamacpp` loads ``name`` in exact mode when not told: for the model named
    ``"target"`` when ``QUICKDRAFT_LLAMA_EXACT=1`` (a draft only proposes tokens, so its logits
    need no exactness and it keeps the faster kernels)."""
    return name == "target" and os.environ.get("QUICKDRAFT_LLAMA_EXACT", "") == "1"


def load_llamacpp(spec: str | os.PathLike[str], name: str, *, vocab_size: int | None = None,
                  n_ctx: int = 4096, n_threads: int | None = None, exact: bool | None = None):
    """``(LlamaCppRunner, tokenizer)`` for a registry name, alias, cache directory or GGUF file.

    The tokenizer is the Hugging Face one of the cache entry (or read from the GGUF), so token ids
    match the torch backend's. ``vocab_size`` defaults to the entry's ``config.json`` value, so the
    logits have the same width as on the torch backend. ``exact`` (see :class:`LlamaCppRunner`)
    defaults to :func:`exact_from_env`.
    """
    import json

    from transformers import AutoTokenizer, GenerationConfig

    from quickdraft.backends.threads import runtime_threads

    gguf = gguf_path_for(spec)
    entry = gguf.parent
    if (entry / "tokenizer.json").is_file() or (entry / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(entry)
    else:
        tokenizer = AutoTokenizer.from_pretrained(entry, gguf_file=gguf.name)
    generation_config = None
    if (entry / "generation_config.json").is_file():
        generation_config = GenerationConfig.from_pretrained(entry)
    if vocab_size is None and (entry / "config.json").is_file():
        vocab_size = int(json.loads((entry / "config.json").read_text()).get("vocab_size") or 0) or None
    runner = LlamaCppRunner(
        gguf, name, vocab_size=vocab_size, n_ctx=n_ctx, n_threads=n_threads or runtime_threads(),
        exact=exact_from_env(name) if exact is None else bool(exact), generation_config=generation_config,
    )
    return runner, tokenizer
