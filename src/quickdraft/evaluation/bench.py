"""The benchmark harness behind ``quickdraft bench``: every method and anchor on the same prompts.

One run measures a list of *entries* (a named method with parameters, or an anchor) on the prompts
of one dataset, at one or more temperatures, in one process:

1. **Load** the models once; the load time is reported separately (``run.json``), never in a rate.
2. **Warm up**: every entry generates a few tokens on the first prompt before anything is timed.
3. **Interleave**: for prompt ``i`` the entries run in the order of the entry list rotated by
   ``i`` (:func:`schedule`), so machine drift (other jobs, thermal state) hits every entry alike
   and no entry is always first after a model switch.
4. **Cache**: each (temperature, entry, prompt) cell is written to ``DIR/raw/...json`` as soon as
   it finishes (atomic rename); a rerun with the same ``--out`` skips finished cells, so an
   interrupted run resumes where it stopped and a run can be extended (more prompts, more entries).
5. **Quality**, after generation: HumanEval answers go through
   :func:`quickdraft.evaluation.extract.extract_program` and the sandbox
   (:func:`quickdraft.evaluation.sandbox.run_humaneval_checks`, one child process per problem with limits,
   never in this process; the sandbox's isolation mode and network level are logged and recorded
   in the session's ``sandbox`` in ``run.json`` and in each record's ``quality``); every
   completion gets a *fidelity* figure, the target's mean log-likelihood of the generated tokens
   under its raw (temperature-1) distribution, from one target forward. Agreement with
   target-alone greedy output is derived in :mod:`quickdraft.evaluation.report`.
6. **Report**: :func:`quickdraft.evaluation.report.write_reports` turns the raw cells into ``summary.csv``,
   ``summary.json``, ``summary.md`` and PNG plots.

Entries are written ``name[:key=value,...]``, e.g. ``ar``, ``sd:k=6``, ``sd:policy=heuristic``,
``fsd:divergence=js,threshold=0.4``, ``fsd:hybrid=true``; the keys are the keyword parameters of
:func:`quickdraft.methods.build_method`. Anchors: ``hf-ar`` (Hugging Face ``generate`` on the
target), ``hf-assisted`` (``assistant_model=draft``), ``hf-prompt-lookup``
(``prompt_lookup_num_tokens``) and ``llamacpp`` (llama.cpp on the target GGUF, optional).

Timing: engine entries report *decode* tokens/s (prefill excluded, as
:attr:`quickdraft.decoding.metrics.GenerationMetrics.tokens_per_second`) and end-to-end tokens/s; anchors
expose only end to end, so cross-tool comparisons use the end-to-end column.

A sweep config (TOML) sets the same fields as the command line plus ``[[sweep]]`` tables whose
list values are expanded as a Cartesian product::

    title = "FSD study"
    dataset = "humaneval"
    limit = 20
    temperatures = [0.0]
    max_new_tokens = 256
    methods = ["ar", "sd:k=4"]

    [[sweep]]
    method = "fsd"
    divergence = ["js"]
    threshold = [0.2, 0.4, 0.8]
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import json
import os
import platform
import shlex
import sys
import time
import tomllib
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from quickdraft.errors import QuickdraftError
from quickdraft.verification.sampling import SamplingParams
from quickdraft.evaluation.report import load_records

#: Schema version of the per-cell JSON records.
SCHEMA_VERSION = 1
ANCHOR_NAMES: tuple[str, ...] = ("hf-ar", "hf-assisted", "hf-prompt-lookup", "llamacpp", "ovgenai-ar", "ovgenai-sd")
#: anchors that run the torch models of the pipeline (Hugging Face ``generate``)
_HF_ANCHORS = ("hf-ar", "hf-assisted", "hf-prompt-lookup")
#: build_method keywords that are not per-entry parameters (set by the run)
_RUN_KEYWORDS = {"sampling", "seed"}


# ------------------------------------------------------------------------------------------------
# Entries: parsing "name:key=value,..." and expanding sweeps
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """One thing to benchmark: a quickdraft method with parameters, or an anchor.

    Attributes
    ----------
    name:
        A method of :data:`quickdraft.methods.METHOD_NAMES` or an anchor of :data:`ANCHOR_NAMES`.
    params:
        ``(key, value)`` pairs sorted by key, typed as :func:`~quickdraft.methods.build_method`'s
        keyword defaults (anchors take ``k``, the prompt-lookup length, only).
    """

    name: str
    params: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        """Canonical text, e.g. ``fsd:divergence=js,threshold=0.4``: the key of results and caches."""
        if not self.params:
            return self.name
        return self.name + ":" + ",".join(f"{k}={_format_value(v)}" for k, v in self.params)

    @property
    def is_anchor(self) -> bool:
        return self.name in ANCHOR_NAMES

    def kwargs(self) -> dict[str, Any]:
        return dict(self.params)


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return format(value, "g")
    return str(value)


def _parameter_types() -> dict[str, type]:
    """The keyword parameters of build_method and the type of each (from its default)."""
    from quickdraft.methods import build_method

    types: dict[str, type] = {}
    for name, param in inspect.signature(build_method).parameters.items():
        if param.kind is not inspect.Parameter.KEYWORD_ONLY or name in _RUN_KEYWORDS:
            continue
        default = param.default
        types[name] = type(default) if default is not None and default is not inspect.Parameter.empty else str
    return types


def _coerce(key: str, value: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise QuickdraftError(f"parameter {key}={value!r} must be true or false")
    try:
        if kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if kind is float:
            return float(value)
    except (TypeError, ValueError):
        raise QuickdraftError(f"parameter {key}={value!r} must be a{'n integer' if kind is int else ' number'}") from None
    return str(value)


def make_entry(name: str, params: dict[str, Any] | None = None) -> Entry:
    """Validate ``name`` and ``params`` and return the canonical :class:`Entry`."""
    from quickdraft.methods import METHOD_NAMES

    name = name.strip()
    params = dict(params or {})
    if name in ANCHOR_NAMES:
        allowed = {"k": int} if name in ("hf-prompt-lookup", "ovgenai-sd") else {}
    elif name in METHOD_NAMES:
        allowed = _parameter_types()
    else:
        raise QuickdraftError(
            f"unknown method {name!r}; choose one of {', '.join(METHOD_NAMES)} or an anchor "
            f"({', '.join(ANCHOR_NAMES)})"
        )
    typed = []
    for key, value in params.items():
        if key not in allowed:
            keys = ", ".join(sorted(allowed)) or "none"
            raise QuickdraftError(f"unknown parameter {key!r} for {name}; it takes: {keys}")
        typed.append((key, _coerce(key, value, allowed[key])))
    return Entry(name, tuple(sorted(typed)))


def parse_entry(text: str) -> Entry:
    """Parse ``name[:key=value,...]``, e.g. ``fsd:divergence=js,threshold=0.4``."""
    name, _, rest = text.strip().partition(":")
    params: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise QuickdraftError(f"bad method parameter {item!r} in {text!r}; write key=value")
        params[key.strip()] = value.strip()
    return make_entry(name, params)


def parse_entries(text: str | list[str] | None) -> list[Entry]:
    """Entries from a list of strings, or one string separated by ``;`` or by commas before a name.

    ``"ar,sd:k=6,fsd:divergence=js,threshold=0.4"`` splits at commas followed by a known method
    or anchor name, so parameters can themselves be comma separated.
    """
    if text is None:
        return []
    items = text if isinstance(text, list) else _split_methods(text)
    entries = [parse_entry(t) for t in items if t.strip()]
    return entries


def _split_methods(text: str) -> list[str]:
    from quickdraft.methods import METHOD_NAMES

    names = set(METHOD_NAMES) | set(ANCHOR_NAMES)
    parts: list[str] = []
    for chunk in text.replace(";", ",").split(","):
        head = chunk.strip().partition(":")[0]
        if parts and ("=" in chunk and ":" not in chunk) and head not in names:
            parts[-1] += "," + chunk  # a parameter of the previous entry
        else:
            parts.append(chunk)
    return parts


def expand_sweep(table: dict[str, Any]) -> list[Entry]:
    """Entries of one ``[[sweep]]`` table: list values are crossed (Cartesian product, in key order).

    >>> [e.label for e in expand_sweep({"method": "fsd", "divergence": ["js", "tv"], "threshold": [0.2, 0.4]})]
    ['fsd:divergence=js,threshold=0.2', 'fsd:divergence=js,threshold=0.4', 'fsd:divergence=tv,threshold=0.2', 'fsd:divergence=tv,threshold=0.4']
    """
    table = dict(table)
    if "method" not in table:
        raise QuickdraftError("a [[sweep]] table needs method = \"name\"")
    name = table.pop("method")
    keys = list(table)
    values = [v if isinstance(v, list) else [v] for v in table.values()]
    return [make_entry(name, dict(zip(keys, combo))) for combo in itertools.product(*values)]


def _dedupe(entries: list[Entry]) -> list[Entry]:
    seen: set[str] = set()
    out = []
    for e in entries:
        if e.label not in seen:
            seen.add(e.label)
            out.append(e)
    return out


# ------------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------------
@dataclass
class BenchConfig:
    """Everything that defines a run (written to ``run.json``; a resumed run must agree on it).

    Attributes
    ----------
    entries:
        Methods and anchors, in the base order that :func:`schedule` rotates.
    dataset:
        ``humaneval`` or ``mtbench``.
    limit:
        The first ``limit`` prompts of the dataset in file order (``None``: all).
    temperatures:
        Sampling temperatures; every entry runs at each (0 = greedy).
    top_p, top_k:
        Nucleus mass and top-k (0: off) of every sampled cell (FSD's paper samples at T = 0.6 with
        top-p 0.9 and top-k 50); greedy cells ignore them.
    seed:
        Base seed; every entry generates prompt ``id`` with seed ``prompt_seed(seed, id)``
        (:func:`prompt_seed`), so no two prompts share random draws or race noise.
    max_new_tokens:
        Token budget of every completion.
    baseline:
        Label of the lossless reference for paired comparisons; ``None`` picks the first ``sd``
        entry, else ``ar``.
    warmup_tokens:
        Tokens each entry generates on the first prompt before timing (0: no warm-up).
    fidelity:
        Compute the target's mean log-likelihood of every completion.
    sandbox_workers:
        Concurrent sandboxes for HumanEval checks.
    title, description:
        Free text for reports and the benchmarks page.
    """

    entries: list[Entry]
    dataset: str = "humaneval"
    limit: Optional[int] = 4
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_new_tokens: int = 128
    baseline: Optional[str] = None
    warmup_tokens: int = 8
    fidelity: bool = True
    sandbox_workers: int = 1
    title: str = ""
    description: str = ""

    def __post_init__(self) -> None:
        if not self.entries:
            raise QuickdraftError("no methods to benchmark: give --methods or a config with methods / [[sweep]]")
        if self.dataset not in ("humaneval", "mtbench"):
            raise QuickdraftError(f"unknown dataset {self.dataset!r}; choose humaneval or mtbench")
        if self.max_new_tokens < 1:
            raise QuickdraftError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise QuickdraftError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        for t in self.temperatures:
            self.sampling(t)  # validates
        labels = [e.label for e in self.entries]
        if self.baseline is not None and self.baseline not in labels:
            raise QuickdraftError(f"baseline {self.baseline!r} is not among the methods ({', '.join(labels)})")

    def sampling(self, temperature: float) -> SamplingParams:
        """The sampling parameters of a cell at ``temperature``."""
        return SamplingParams(temperature=temperature, top_p=self.top_p, top_k=self.top_k or None)

    @property
    def baseline_label(self) -> str | None:
        if self.baseline:
            return self.baseline
        labels = [e.label for e in self.entries]
        for e in self.entries:
            if e.name == "sd":
                return e.label
        return "ar" if "ar" in labels else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["entries"] = [e.label for e in self.entries]
        d["baseline"] = self.baseline_label
        return d


def load_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a TOML sweep config into plain fields (``entries`` already expanded)."""
    p = Path(path)
    if not p.is_file():
        raise QuickdraftError(f"config file not found: {p}")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise QuickdraftError(f"config {p} is not valid TOML: {err}") from None
    known = {
        "title", "description", "dataset", "limit", "temperature", "temperatures", "top_p", "top_k", "seed",
        "max_new_tokens",
        "methods", "anchors", "sweep", "baseline", "warmup_tokens", "fidelity", "sandbox_workers",
        "target", "draft", "dtype", "draft_dtype", "threads", "backend", "quantize", "quantize_draft",
        "plugin_defaults", "datastore", "datastore_field",
    }
    unknown = sorted(set(data) - known)
    if unknown:
        raise QuickdraftError(f"config {p}: unknown field(s) {', '.join(unknown)}")
    fields = {k: v for k, v in data.items() if k not in ("methods", "anchors", "sweep", "temperature")}
    if "temperature" in data:
        fields["temperatures"] = data["temperature"] if isinstance(data["temperature"], list) else [data["temperature"]]
    entries = parse_entries(list(data.get("methods", [])))
    for table in data.get("sweep", []):
        entries += expand_sweep(table)
    entries += parse_entries(list(data.get("anchors", [])))
    fields["entries"] = entries
    return fields


# ------------------------------------------------------------------------------------------------
# Schedule and cache
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    """One generation: an entry on a prompt at a temperature."""

    temperature: float
    prompt_index: int
    entry: Entry


def schedule(entries: list[Entry], num_prompts: int, temperatures: list[float]) -> list[Cell]:
    """The interleaved run order: temperatures, then prompts, then entries rotated by the prompt index.

    >>> es = [Entry("ar"), Entry("sd"), Entry("fsd")]
    >>> [(c.prompt_index, c.entry.name) for c in schedule(es, 2, [0.0])]
    [(0, 'ar'), (0, 'sd'), (0, 'fsd'), (1, 'sd'), (1, 'fsd'), (1, 'ar')]
    """
    cells = []
    n = len(entries)
    for t in temperatures:
        for i in range(num_prompts):
            r = i % n if n else 0
            for entry in entries[r:] + entries[:r]:
                cells.append(Cell(float(t), i, entry))
    return cells


def _safe(text: str) -> str:
    keep = "".join(c if c.isalnum() or c in "-_.=" else "_" for c in text)
    return keep.strip("_") or "x"


def cell_path(out_dir: Path, temperature: float, label: str, prompt_id: str) -> Path:
    """``DIR/raw/T<temperature>/<label>/<prompt id>.json`` (file-system-safe names)."""
    return Path(out_dir) / "raw" / f"T{temperature:g}" / _safe(label) / f"{_safe(prompt_id)}.json"


def _write_json(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=1, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------
# Running one cell
# ------------------------------------------------------------------------------------------------
def prompt_seed(seed: int, prompt_id: str) -> int:
    """The seed every entry uses for one prompt: a hash of the run's base seed and the prompt id.

    The harness generates one prompt at a time as row 0 of a batch of one, so with one seed for
    every prompt, sampling methods would reuse the same random stream on every prompt — and ERSD,
    whose race noise is keyed by (seed, row, absolute position), the same arrival times at every
    position the prompts have in common. Hashing the prompt id gives each prompt its own stream,
    independent of the prompt's index (``--limit``, dataset order) and distinct across base seeds
    (``seed + index`` would give prompt 1 of seed 0 the stream of prompt 0 of seed 1).

    Parameters
    ----------
    seed:
        The run's base seed (``--seed``).
    prompt_id:
        The prompt's stable id, e.g. ``"HumanEval/3"``.

    Returns
    -------
    int
        The first 31 bits of SHA-256(``"{seed}:{prompt_id}"``): a valid seed for torch,
        Hugging Face ``generate`` and llama.cpp (32-bit seeds) alike.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise QuickdraftError(f"seed must be an integer, got {seed!r}")
    digest = hashlib.sha256(f"{seed}:{prompt_id}".encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def _check_seeds(records: list[dict[str, Any]], seed: int) -> None:
    """Refuse to resume a run whose cached sampled cells used other seeds than
    :func:`prompt_seed` gives (e.g. ``seed + index``): their draws would not be comparable with
    the cells run now."""
    for r in records:
        if r.get("temperature", 0) > 0 and r.get("seed") != prompt_seed(seed, r["prompt_id"]):
            raise QuickdraftError(
                f"the output directory holds sampled cells made with other seeds ({r['method']} on "
                f"{r['prompt_id']}: seed {r.get('seed')!r}, now {prompt_seed(seed, r['prompt_id'])}); "
                "use another --out"
            )


def encode_prompt(pipe, prompt) -> list[int]:
    """Token ids of a :class:`~quickdraft.evaluation.datasets.Prompt`: its chat messages under the model's chat
    template, or its raw text when the tokenizer has no template (tiny test models)."""
    if getattr(pipe.tokenizer, "chat_template", None):
        return pipe.encode_messages(prompt.messages)
    return pipe.encode(prompt.raw, chat=False)


class CellRunner:
    """Runs entries on token ids with one loaded :class:`~quickdraft.pipeline.Pipeline`."""

    def __init__(self, pipe, max_new_tokens: int, llamacpp_model: str | None = None) -> None:
        self.pipe = pipe
        self._genai: dict[str, Any] = {}
        self.max_new_tokens = max_new_tokens
        self.eos = pipe.eos_ids()
        self.llamacpp_model = llamacpp_model
        self._llama = None
        self.llamacpp_load_seconds: float | None = None

    def available(self, entry: Entry) -> str | None:
        """``None`` when ``entry`` can run here, else one line saying why it is skipped."""
        if entry.name == "llamacpp":
            from quickdraft.evaluation import anchors

            if not hasattr(anchors, "llamacpp_generate"):
                return "llamacpp: skipped (quickdraft.evaluation.anchors has no llamacpp_generate)"
            try:
                import llama_cpp  # noqa: F401
            except ImportError:
                return "llamacpp: skipped (llama-cpp-python is not installed: pip install 'quickdraft[llamacpp]')"
            if self._gguf_path() is None:
                return "llamacpp: skipped (no target GGUF found; pass --llamacpp-model FILE.gguf)"
            return None
        if entry.name in _HF_ANCHORS and not _is_torch_model(self.pipe.target_model):
            return f"{entry.name}: skipped (Hugging Face generate needs the torch backend)"
        if entry.name.startswith("ovgenai-"):
            from quickdraft.backends.openvino import is_available

            if not is_available():
                return f"{entry.name}: skipped (OpenVINO is not installed: pip install 'quickdraft[openvino]')"
            try:
                import openvino_genai  # noqa: F401
            except ImportError:
                return f"{entry.name}: skipped (openvino-genai is not installed: pip install 'quickdraft[openvino]')"
            if entry.name == "ovgenai-sd" and self.pipe.draft is None:
                return f"{entry.name}: skipped (no draft model loaded)"
            return None
        if entry.name in ("hf-assisted",) and self.pipe.draft_model is None:
            return f"{entry.name}: skipped (no draft model loaded)"
        if not entry.is_anchor:
            from quickdraft.methods import build_method

            if build_method(entry.name, **entry.kwargs()).needs_draft and self.pipe.draft is None:
                return f"{entry.label}: skipped (no draft model loaded)"
        return None

    def run(self, entry: Entry, ids: list[int], sampling: SamplingParams, seed: int, max_new_tokens: int) -> dict[str, Any]:
        """Generate once; returns the measured fields of a record (no prompt/run bookkeeping)."""
        if entry.is_anchor:
            return self._run_anchor(entry, ids, sampling, seed, max_new_tokens)
        from quickdraft.methods import build_method

        spec = build_method(entry.name, sampling=sampling, seed=seed, **entry.kwargs())
        out = self.pipe.generate(
            [""], prompt_ids=[ids], method=spec.engine_method, rule=spec.rule, policy=spec.policy,
            sampling=sampling, max_new_tokens=max_new_tokens, seed=seed, tree=spec.tree, verifier=spec.verifier,
        )
        c = out.completions[0]
        m = c.metrics
        return {
            "kind": "method",
            "lossless": bool(getattr(spec.rule, "lossless", True)),
            "token_ids": list(c.token_ids),
            "text": c.text,
            "finish_reason": c.finish_reason,
            "new_tokens": m.new_tokens,
            "seconds": m.prefill_seconds + m.decode_seconds,
            "prefill_seconds": m.prefill_seconds,
            "decode_seconds": m.decode_seconds,
            "target_forwards": m.target_forwards,
            "draft_forwards": m.draft_forwards,
            "metrics": m.to_dict(),
        }

    def _run_anchor(self, entry: Entry, ids, sampling, seed, max_new_tokens) -> dict[str, Any]:
        from quickdraft.evaluation import anchors

        if entry.name == "llamacpp":
            res = self._llamacpp(ids, sampling, seed, max_new_tokens)
        elif entry.name.startswith("ovgenai-"):
            res = anchors.openvino_genai_generate(
                self._genai_pipeline(entry.name), ids, sampling=sampling, max_new_tokens=max_new_tokens,
                eos_token_ids=self.eos, seed=seed,
                num_assistant_tokens=int(entry.kwargs().get("k", 4)) if entry.name == "ovgenai-sd" else None,
            )
        else:
            lookup = entry.kwargs().get("k", 10) if entry.name == "hf-prompt-lookup" else None
            res = anchors.hf_generate(
                self.pipe.target_model, ids, sampling=sampling, max_new_tokens=max_new_tokens,
                eos_token_ids=self.eos, seed=seed,
                assistant_model=self.pipe.draft_model if entry.name == "hf-assisted" else None,
                prompt_lookup_num_tokens=lookup,
            )
        new_ids = list(res.new_ids)
        cut = next((i for i, t in enumerate(new_ids) if t in self.eos), None)
        kept = new_ids if cut is None else new_ids[: cut + 1]
        text = self.pipe.tokenizer.decode(kept, skip_special_tokens=True)
        return {
            "kind": "anchor",
            # llama.cpp runs a Q4_K_M quantisation of the target; GenAI the OpenVINO export's weights,
            # which are the target's own only on the openvino backend
            "lossless": entry.name != "llamacpp" and (not entry.name.startswith("ovgenai-") or self._on_openvino()),
            "token_ids": kept,
            "text": text,
            "finish_reason": "eos" if cut is not None else "length",
            "new_tokens": len(kept),
            "seconds": res.seconds,
            "prefill_seconds": None,
            "decode_seconds": None,
            "target_forwards": None,
            "draft_forwards": None,
            "metrics": None,
        }

    def _on_openvino(self) -> bool:
        return type(self.pipe.target).__name__ == "OpenVINORunner"

    def _genai_pipeline(self, name: str):
        """OpenVINO GenAI's pipeline (plain, or speculative with the draft) over GenAI-layout exports
        of the pipeline's models, in the weight format of its OpenVINO exports (int8 elsewhere);
        made once, load time never timed."""
        if name not in self._genai:
            import torch

            from quickdraft.evaluation import anchors
            from quickdraft.backends.openvino import export_for

            weights = "int8"
            if self._on_openvino():
                weights = self.pipe.target.export_info.get("weight_format", "int8")
            source = lambda runner, role: (  # noqa: E731 - the runner's Hugging Face directory
                runner.export_info.get("source") if type(runner).__name__ == "OpenVINORunner" else role)
            target = export_for(source(self.pipe.target, "target"), weights, layout="genai")
            draft = export_for(source(self.pipe.draft, "draft"), weights, layout="genai") if name == "ovgenai-sd" else None
            from quickdraft.backends.threads import runtime_threads

            self._genai[name] = anchors.openvino_genai_pipeline(target, draft, n_threads=runtime_threads())
        return self._genai[name]

    def _gguf_path(self) -> Path | None:
        """The llama.cpp anchor's GGUF: ``--llamacpp-model``, else the target's cache entry's
        ``model.gguf`` (the verified Q4_K_M file the bf16 checkpoint was converted from)."""
        if self.llamacpp_model:
            return Path(self.llamacpp_model)
        source = getattr(self.pipe.target_model.config, "_name_or_path", "") or ""
        if not source:
            return None
        # a cache entry holds the GGUF; an OpenVINO export lies one folder below its entry
        candidates = [Path(source) / "model.gguf", Path(source).parent / "model.gguf"]
        return next((c for c in candidates if c.is_file()), None)

    def _llamacpp(self, ids, sampling, seed, max_new_tokens):
        from quickdraft.evaluation import anchors
        # the process's thread count: torch runs on one thread beside the openvino backend
        from quickdraft.backends.threads import runtime_threads

        if self._llama is None:  # load once; the load time is logged, never timed
            from quickdraft.backends.llamacpp import LlamaGGUF

            start = time.perf_counter()
            self._llama = LlamaGGUF(self._gguf_path(), n_ctx=4096, n_threads=runtime_threads())
            self.llamacpp_load_seconds = time.perf_counter() - start
        return anchors.llamacpp_generate(
            self._gguf_path(), ids, sampling=sampling, max_new_tokens=max_new_tokens, eos_token_ids=self.eos,
            seed=seed, n_threads=runtime_threads(), model=self._llama,
        )


@dataclass
class Fidelity:
    """Target's view of a completion: mean and total log-likelihood of the new tokens."""

    target_mean_logprob: float | None
    target_logprob_sum: float | None
    scored_tokens: int


def _is_torch_model(model) -> bool:
    import torch

    return isinstance(model, torch.nn.Module)


def target_fidelity(target_model, prompt_ids: list[int], new_ids: list[int]) -> Fidelity:
    """Mean log-likelihood of ``new_ids`` under the target's raw (temperature-1) distribution.

    .. math:: \\bar\\ell = \\frac1N \\sum_{j=1}^{N} \\log p_{\\text{target}}(y_j \\mid x, y_{<j})

    One forward over prompt + completion. A lossy method that leaves the target's distribution
    shows a lower :math:`\\bar\\ell` than target-alone sampling at the same temperature.
    """
    import torch

    if not new_ids:
        return Fidelity(None, None, 0)
    with torch.inference_mode():
        input_ids = torch.tensor([list(prompt_ids) + list(new_ids)])  # [1, P+N]
        n = len(new_ids)
        if _is_torch_model(target_model):
            logits = target_model(input_ids).logits[0, len(prompt_ids) - 1 : -1].float()  # [N, V]
        else:  # a runner of another backend: the head over the last N + 1 positions only
            target_model.reset(1)
            logits = target_model.forward(input_ids, logits_to_keep=n + 1).logits[0, :n].float()  # [N, V]
        logprobs = torch.log_softmax(logits, dim=-1)  # [N, V]: position P - 1 + j predicts y_j
        picked = logprobs.gather(-1, torch.tensor(new_ids).unsqueeze(-1)).squeeze(-1)  # [N]
    total = float(picked.sum())
    return Fidelity(total / len(new_ids), total, len(new_ids))


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------
def _machine() -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    try:
        info["load_average_at_start"] = list(os.getloadavg())
    except OSError:
        pass
    return info


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _models_meta(target: str, draft: str | None, dtype: str, quantize: str, quantize_draft: str | None,
                 draft_dtype: str | None = None, backend: str = "torch", datastore: dict | None = None,
                 draft_head: int | str | None = None, plugin_defaults: bool = False) -> dict:
    """The models of a run as recorded in ``run.json``: quantisation only when used, so that a run
    directory without these keys still resumes; ``draft_dtype`` is the dtype the draft was loaded in;
    ``datastore`` (path and tokens) where retrieval methods run; ``draft_head``: an openvino draft's
    head, ``"full"`` or the number of token ids it keeps (:func:`_draft_head`); ``plugin_defaults``
    where the openvino models were compiled with the CPU plugin's own settings."""
    meta: dict[str, Any] = {"target": target, "draft": draft, "dtype": dtype}
    if datastore is not None:
        meta["datastore"] = datastore
    if draft_head is not None and draft is not None:
        meta["draft_head"] = draft_head
    if backend != "torch":
        meta["backend"] = backend
    if plugin_defaults:
        meta["plugin_defaults"] = True
    if draft is not None and draft_dtype is not None:
        meta["draft_dtype"] = draft_dtype
    if quantize != "none":
        meta["quantize"] = quantize
    if draft is not None and (quantize_draft or quantize) != "none":
        meta["quantize_draft"] = quantize_draft or quantize
    return meta


def _draft_head(pipe) -> int | str | None:
    """An openvino draft's head: the number of token ids it keeps, or ``"full"``; ``None`` elsewhere."""
    runner = getattr(pipe, "draft", None)
    if runner is None or not hasattr(runner, "export_info"):
        return None
    ids = getattr(runner, "head_ids", None)
    return "full" if ids is None else int(len(ids))


def expand_datastore(spec: str) -> str:
    """A datastore path from a config or the command line: ``~`` and ``$VARS`` expanded, and
    ``{stdlib}`` replaced by this Python's standard library directory (a code corpus every machine
    has, e.g. ``{stdlib}/*.py``)."""
    import sysconfig

    return os.path.expanduser(os.path.expandvars(spec.replace("{stdlib}", sysconfig.get_paths()["stdlib"])))


def _check_same_run(existing: dict[str, Any], config: BenchConfig, models: dict[str, Any]) -> None:
    old = existing.get("config", {})
    defaults = {"top_p": 1.0, "top_k": 0}  # a run recorded before these settings existed used them
    for key in ("dataset", "seed", "max_new_tokens", "top_p", "top_k"):
        if old and (key in old or key in defaults) and old.get(key, defaults.get(key)) != getattr(config, key):
            raise QuickdraftError(
                f"the output directory holds a run with {key}={old.get(key, defaults.get(key))!r}, not "
                f"{getattr(config, key)!r}; "
                "use another --out (cached cells would not be comparable)"
            )
    if existing.get("models") and existing["models"] != models:
        raise QuickdraftError(
            f"the output directory holds a run with models {existing['models']}, not {models}; use another --out"
        )


def run_bench(
    pipe,
    prompts: list,
    config: BenchConfig,
    out_dir: str | os.PathLike[str],
    *,
    command: str = "",
    model_load_seconds: float | None = None,
    models: dict[str, Any] | None = None,
    progress: bool = True,
    after_cell: Callable[[Cell, dict[str, Any]], None] | None = None,
    llamacpp_model: str | None = None,
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr),
) -> dict[str, Any]:
    """Run (or resume) a benchmark into ``out_dir`` and write its reports.

    Parameters
    ----------
    pipe:
        A loaded :class:`~quickdraft.pipeline.Pipeline` (with a draft model when an entry needs one).
    prompts:
        :class:`~quickdraft.evaluation.datasets.Prompt` objects, already limited; prompt ``id`` gets seed
        ``prompt_seed(config.seed, id)`` (:func:`prompt_seed`).
    config:
        The run definition.
    out_dir:
        Run directory: ``run.json``, ``raw/`` cells, reports.
    command:
        The exact command line, recorded in ``run.json`` for every session.
    after_cell:
        Called with each finished cell and its record (tests use it to interrupt a run).

    Returns
    -------
    dict
        The ``run.json`` payload.
    """
    from quickdraft.evaluation import report

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    models = models or {}
    run_file = out / "run.json"
    meta = json.loads(run_file.read_text(encoding="utf-8")) if run_file.is_file() else {}
    _check_same_run(meta, config, models)
    _check_seeds(load_records(out), config.seed)

    runner = CellRunner(pipe, config.max_new_tokens, llamacpp_model=llamacpp_model)
    entries = []
    skipped = []
    for e in config.entries:
        why = runner.available(e)
        if why:
            log(why)
            skipped.append(why)
        else:
            entries.append(e)

    session = {
        "command": command, "started": _now(), "model_load_seconds": model_load_seconds,
        "machine": _machine(), "skipped": skipped,
    }
    if any(p.dataset == "humaneval" for p in prompts):
        from quickdraft.evaluation.sandbox import sandbox_info

        session["sandbox"] = sandbox_info()
        log(_describe_sandbox(session["sandbox"]))
    meta.update(
        schema=SCHEMA_VERSION, title=config.title or meta.get("title", ""),
        description=config.description or meta.get("description", ""),
        config=config.to_dict(), models=models, prompts=[p.id for p in prompts],
        entries=[e.label for e in entries],
    )
    meta.setdefault("sessions", []).append(session)
    _write_json(run_file, meta)

    prompt_ids = [encode_prompt(pipe, p) for p in prompts]
    cells = schedule(entries, len(prompts), config.temperatures)
    todo = [c for c in cells if not cell_path(out, c.temperature, c.entry.label, prompts[c.prompt_index].id).is_file()]
    existing = load_records(out)
    next_index = max((r.get("run_index", -1) for r in existing), default=-1) + 1
    session_no = len(meta["sessions"]) - 1
    log(f"{len(cells) - len(todo)} of {len(cells)} cells cached in {out}; {len(todo)} to run")

    # 2. warm-up: every entry once, short, untimed
    if todo and config.warmup_tokens > 0:
        for e in entries:
            runner.run(e, prompt_ids[0], config.sampling(config.temperatures[0]),
                       prompt_seed(config.seed, prompts[0].id),
                       min(config.warmup_tokens, config.max_new_tokens))

    # 3. interleaved generation
    from tqdm import tqdm

    bar = tqdm(total=len(todo), desc="bench", unit="gen", disable=not progress, mininterval=2.0, file=sys.stderr)
    for cell in todo:
        prompt = prompts[cell.prompt_index]
        bar.set_postfix_str(f"T={cell.temperature:g} {prompt.id} {cell.entry.label}", refresh=False)
        seed = prompt_seed(config.seed, prompt.id)
        started = _now()
        measured = runner.run(cell.entry, prompt_ids[cell.prompt_index], config.sampling(cell.temperature),
                              seed, config.max_new_tokens)
        order = [c.entry.label for c in cells if c.temperature == cell.temperature and c.prompt_index == cell.prompt_index]
        record = {
            "schema": SCHEMA_VERSION,
            "method": cell.entry.label,
            "name": cell.entry.name,
            "params": cell.entry.kwargs(),
            "prompt_id": prompt.id,
            "prompt_index": cell.prompt_index,
            "dataset": prompt.dataset,
            "temperature": cell.temperature,
            "seed": seed,
            "max_new_tokens": config.max_new_tokens,
            "prompt_tokens": len(prompt_ids[cell.prompt_index]),
            "run_index": next_index,
            "session": session_no,
            "position_in_prompt": order.index(cell.entry.label),
            "started_at": started,
            **measured,
        }
        next_index += 1
        _write_json(cell_path(out, cell.temperature, cell.entry.label, prompt.id), record)
        bar.update(1)
        if after_cell is not None:
            after_cell(cell, record)
    bar.close()

    # 5. quality and fidelity (cached in the records as well)
    evaluate(out, prompts, prompt_ids, pipe if config.fidelity else None, workers=config.sandbox_workers, log=log)

    if runner.llamacpp_load_seconds is not None:
        session["llamacpp_load_seconds"] = runner.llamacpp_load_seconds
    session["finished"] = _now()
    session["cells_run"] = len(todo)
    _write_json(run_file, meta)
    report.write_reports(out)
    return meta


def _describe_sandbox(info: dict[str, str]) -> str:
    """One line for the log: the sandbox's isolation mode and what it does to the network."""
    return f"HumanEval sandbox: isolation {info['mode']}; network {info['network']} ({info['network_meaning']})"


def evaluate(out_dir: Path, prompts: list, prompt_ids: list[list[int]], pipe=None, workers: int = 1,
             log: Callable[[str], None] = lambda msg: None) -> int:
    """Add ``quality`` (HumanEval: extraction status, sandbox outcome) and ``fidelity`` to every
    record that lacks them; returns the number of records updated."""
    from quickdraft.evaluation.extract import extract_program
    from quickdraft.evaluation.sandbox import run_humaneval_checks

    by_id = {p.id: (p, ids) for p, ids in zip(prompts, prompt_ids)}
    paths = {}
    records = []
    for path in sorted((Path(out_dir) / "raw").glob("*/*/*.json")):
        rec = json.loads(path.read_text(encoding="utf-8"))
        if rec["prompt_id"] in by_id:
            paths[id(rec)] = path
            records.append(rec)
    changed: set[int] = set()

    jobs, job_records = [], []
    for rec in records:
        prompt = by_id[rec["prompt_id"]][0]
        if prompt.dataset != "humaneval" or "quality" in rec:
            continue
        extraction = extract_program(rec["text"], prompt.raw, prompt.metadata["entry_point"])
        rec["quality"] = {"extraction": extraction.status, "parsed": extraction.parsed}
        jobs.append((prompt, extraction.program))
        job_records.append(rec)
    if jobs:
        log(f"checking {len(jobs)} HumanEval completions in the sandbox")
        for rec, outcome in zip(job_records, run_humaneval_checks(jobs, workers=workers)):
            rec["quality"].update(passed=bool(outcome.passed), sandbox_status=outcome.status, detail=outcome.detail[:300],
                                  isolation=outcome.isolation, network=outcome.network)
            changed.add(id(rec))

    if pipe is not None:
        todo = [r for r in records if "fidelity" not in r]
        if todo:
            log(f"scoring {len(todo)} completions with the target (fidelity)")
        for rec in todo:
            ids = by_id[rec["prompt_id"]][1]
            scorer = pipe.target_model if _is_torch_model(pipe.target_model) else pipe.target
            rec["fidelity"] = asdict(target_fidelity(scorer, ids, rec["token_ids"]))
            changed.add(id(rec))
    for rec in records:
        if id(rec) in changed:
            _write_json(paths[id(rec)], rec)
    return len(changed)


# ------------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------------
def bench_command(
    methods: Optional[str] = typer.Option(
        None, help="Comma-separated entries, e.g. 'ar,sd:k=4,fsd:divergence=js,threshold=0.4' (name[:key=value,...], keys as in build_method)."
    ),
    dataset: Optional[str] = typer.Option(None, help="humaneval or mtbench (default humaneval)."),
    limit: Optional[int] = typer.Option(None, help="First N prompts of the dataset (default 4)."),
    temperature: Optional[list[float]] = typer.Option(None, "--temperature", help="Repeatable; default 0."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Top-p of sampled cells (default 1: off)."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Top-k of sampled cells (default 0: off)."),
    seed: Optional[int] = typer.Option(None, help="Base seed (default 0); each prompt uses a hash of it and the prompt id."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="Default 128."),
    out: str = typer.Option(..., "--out", help="Run directory (cells cached there: rerun to resume)."),
    config: Optional[str] = typer.Option(None, "--config", help="TOML sweep config; command-line options override it."),
    anchors: Optional[str] = typer.Option(
        None, help="Comma-separated: hf-ar, hf-assisted, hf-prompt-lookup, llamacpp, ovgenai-ar, ovgenai-sd:k=4."),
    baseline: Optional[str] = typer.Option(None, help="Lossless reference for paired tests (default: first sd entry)."),
    target: Optional[str] = typer.Option(None, help="Target model (default: the registry's target)."),
    draft: Optional[str] = typer.Option(None, help="Draft model (default: the registry's draft)."),
    dtype: Optional[str] = typer.Option(None, help="auto, bfloat16 or float32."),
    draft_dtype: Optional[str] = typer.Option(
        None, "--draft-dtype", help="Draft dtype (default: as --dtype)."),
    threads: Optional[int] = typer.Option(None, help="torch threads (default: torch's)."),
    backend: Optional[str] = typer.Option(None, help="auto, torch, openvino or llamacpp (as for `generate`; default auto)."),
    quantize: Optional[str] = typer.Option(None, help="auto, none, int8, int4 or int4all (as for `generate`)."),
    quantize_draft: Optional[str] = typer.Option(
        None, "--quantize-draft", help="Override --quantize for the draft alone (int4: lossless methods stay exact)."),
    plugin_defaults: bool = typer.Option(
        False, "--plugin-defaults", help="openvino: compile the models with the CPU plugin's own settings instead of "
        "quickdraft's tuned ones (as for `generate`)."),
    warmup_tokens: Optional[int] = typer.Option(None, "--warmup-tokens", help="Default 8; 0 disables warm-up."),
    sandbox_workers: Optional[int] = typer.Option(None, "--sandbox-workers", help="Concurrent HumanEval sandboxes (default 1)."),
    llamacpp_model: Optional[str] = typer.Option(None, "--llamacpp-model", help="GGUF for the llamacpp anchor."),
    datastore: Optional[str] = typer.Option(
        None, "--datastore", help="rest, rest_sd: what to retrieve drafts from (as for `generate`; also a glob "
                                  "pattern; {stdlib} stands for this Python's standard library directory)."),
    datastore_field: Optional[str] = typer.Option(None, "--datastore-field", help="The text field of a .jsonl datastore."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
) -> None:
    """Benchmark methods and anchors on HumanEval / MT-Bench: speed, acceptance, pass@1, fidelity."""
    try:
        file_fields = load_config_file(config) if config else {}
        entries = list(file_fields.pop("entries", []))
        if methods is not None:
            entries = parse_entries(methods) + [e for e in entries if e.is_anchor]
        if anchors is not None:
            entries = [e for e in entries if not e.is_anchor] + parse_entries(anchors)
        model_fields = {
            k: file_fields.pop(k, None)
            for k in ("target", "draft", "dtype", "draft_dtype", "threads", "backend", "quantize", "quantize_draft",
                      "plugin_defaults", "datastore", "datastore_field")
        }
        cli = {
            "dataset": dataset, "limit": limit, "temperatures": list(temperature) if temperature else None,
            "top_p": top_p, "top_k": top_k,
            "seed": seed, "max_new_tokens": max_new_tokens, "baseline": baseline, "warmup_tokens": warmup_tokens,
            "sandbox_workers": sandbox_workers,
        }
        merged = {**file_fields, **{k: v for k, v in cli.items() if v is not None}}
        cfg = BenchConfig(entries=_dedupe(entries), **merged)
        target = target or model_fields["target"] or "target"
        draft_spec = draft or model_fields["draft"] or "draft"
        dtype = dtype or model_fields["dtype"] or "auto"
        threads = threads or model_fields["threads"]
        from quickdraft.backends import resolve_backend

        backend = resolve_backend(backend or model_fields["backend"] or "auto")
        quantize = quantize or model_fields["quantize"] or "auto"
        quantize_draft = quantize_draft or model_fields["quantize_draft"]
        draft_dtype = draft_dtype or model_fields["draft_dtype"]
        plugin_defaults = bool(plugin_defaults or model_fields["plugin_defaults"])

        from quickdraft.evaluation.datasets import load_dataset
        from quickdraft.pipeline import resolve_quantize
        from quickdraft.methods import build_method

        prompts = load_dataset(cfg.dataset, cfg.limit)
        datastore = datastore or model_fields["datastore"]
        specs = {e.label: build_method(e.name, **e.kwargs()) for e in cfg.entries if not e.is_anchor}
        needs_datastore = [label for label, spec in specs.items() if spec.needs_datastore]
        if needs_datastore and datastore is None:
            raise QuickdraftError(f"{', '.join(needs_datastore)} retrieve from a datastore: give --datastore or "
                                  "`datastore` in the config")
        needs_draft = any(
            e.name in ("hf-assisted", "ovgenai-sd") or (e.label in specs and specs[e.label].needs_draft)
            for e in cfg.entries
        )
        import torch

        if threads:
            torch.set_num_threads(threads)
        from quickdraft.pipeline import Pipeline

        t0 = time.perf_counter()
        # a rule that reads the draft's probability of every token (FSD's js, contrastive decoding):
        # the openvino draft with its full head instead of the backend's cut-vocabulary preset
        full_head = backend == "openvino" and any(spec.rule.needs_full_draft for spec in specs.values())
        pipe = Pipeline.from_specs(
            target, draft_spec if needs_draft else None, dtype=dtype, backend=backend, quantize=quantize,
            quantize_draft=quantize_draft, draft_dtype=draft_dtype, draft_vocab=0 if full_head else None,
            plugin_defaults=plugin_defaults,
        )
        load_seconds = time.perf_counter() - t0
        typer.echo(f"models loaded in {load_seconds:.1f} s (excluded from every rate)", err=True)
        datastore_meta = None
        if datastore is not None:
            datastore = expand_datastore(datastore)
            t0 = time.perf_counter()
            index = pipe.set_datastore(datastore, datastore_field or model_fields["datastore_field"] or "text")
            datastore_meta = {"path": datastore, "tokens": int(len(index.tokens))}
            typer.echo(f"datastore {datastore}: {len(index.tokens):,} tokens indexed in "
                       f"{time.perf_counter() - t0:.1f} s", err=True)
        command = "quickdraft bench " + shlex.join(sys.argv[2:] if len(sys.argv) > 1 and sys.argv[1] == "bench" else sys.argv[1:])
        meta = run_bench(
            pipe, prompts, cfg, out, command=command, model_load_seconds=load_seconds,
            models=_models_meta(target, draft_spec if needs_draft else None, dtype,
                                resolve_quantize(backend, quantize),
                                # an openvino draft as loaded (the backend's preset when nothing was said)
                                getattr(pipe.draft, "export_info", {}).get("weight_format")
                                or (quantize_draft and resolve_quantize(backend, quantize_draft)),
                                draft_dtype=None if pipe.draft_model is None
                                else str(getattr(pipe.draft_model, "dtype", "")).removeprefix("torch.") or None,
                                backend=backend, datastore=datastore_meta, draft_head=_draft_head(pipe),
                                plugin_defaults=plugin_defaults),
            progress=not no_progress, llamacpp_model=llamacpp_model,
        )
    except QuickdraftError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(code=2)
    md = Path(out) / "summary.md"
    if md.is_file():
        typer.echo(md.read_text(encoding="utf-8"))
    typer.echo(f"results in {out} ({len(meta['entries'])} entries, {len(meta['prompts'])} prompts)", err=True)
