"""Per-prompt seeds of the benchmark harness (:func:`quickdraft.evaluation.bench.prompt_seed`).

The harness generates one prompt at a time as row 0 of a batch of one. With a seed shared by all
prompts, sampling methods would reuse one random stream on every prompt, and ERSD — whose race
noise is keyed by (seed, row, absolute position) — the same arrival times at every position.
Each prompt therefore gets a seed hashed from the base seed and its id.
"""

from __future__ import annotations

import json

import pytest
import torch

from quickdraft.evaluation.bench import BenchConfig, load_records, parse_entries, prompt_seed, run_bench
from quickdraft.evaluation.datasets import Prompt
from quickdraft.errors import QuickdraftError
from quickdraft.pipeline import Pipeline

from conftest import RecodedPipe, word_tokenizer


pytestmark = pytest.mark.usefixtures("one_thread")


def test_prompt_seed_is_a_stable_hash_of_seed_and_prompt_id():
    ids = [f"HumanEval/{i}" for i in range(164)] + [f"mtbench/{i}" for i in range(81, 161)]
    seeds = [prompt_seed(0, i) for i in ids]
    assert len(set(seeds)) == len(ids)  # no two prompts share a stream
    assert all(0 <= s < 2**31 for s in seeds)  # valid for torch, HF and llama.cpp's 32-bit seeds
    assert prompt_seed(0, "HumanEval/1") == prompt_seed(0, "HumanEval/1")  # deterministic
    # unlike seed + index, base seeds do not hand one prompt's stream to another prompt
    assert prompt_seed(0, "HumanEval/1") != prompt_seed(1, "HumanEval/0")
    assert {prompt_seed(s, "HumanEval/0") for s in range(50)}.isdisjoint({prompt_seed(0, i) for i in ids[1:]})
    with pytest.raises(QuickdraftError, match="seed"):
        prompt_seed(1.5, "HumanEval/0")


@pytest.fixture(scope="module")
def same_ids_pipe(tiny_target, tiny_draft):
    # a flatter target than conftest's (its lm_head is sharpened 8x): sampling is not near-greedy
    target = type(tiny_target)(tiny_target.config).eval()
    target.load_state_dict(tiny_target.state_dict())
    with torch.no_grad():
        target.lm_head.weight.div_(4.0)
    # every prompt encodes to the same token ids
    return RecodedPipe(Pipeline(target, word_tokenizer(), tiny_draft), lambda prompt: [5, 9, 14, 3, 22])


def _prompts(n: int) -> list[Prompt]:
    return [
        Prompt(id=f"Same/{i}", dataset="mtbench", messages=({"role": "user", "content": "x"},), raw="x", metadata={})
        for i in range(n)
    ]


def test_identical_prompts_get_their_own_noise_in_every_sampling_method(same_ids_pipe, tmp_path):
    """Six prompts with the same token ids: at T = 1 every sampling entry (torch-generator ones and
    ERSD's race) gives different completions, recorded with the per-prompt seeds; at T = 0 they
    are all the greedy completion."""
    prompts = _prompts(6)
    entries = "ar,sd:k=3,ersd:k=3,ersd:k=3,candidates=2"
    config = BenchConfig(entries=parse_entries(entries), dataset="mtbench", limit=6, temperatures=[0.0, 1.0],
                         max_new_tokens=16, warmup_tokens=0, fidelity=False, seed=3)
    run_bench(same_ids_pipe, prompts, config, tmp_path / "run", progress=False, log=lambda m: None)
    records = load_records(tmp_path / "run")
    assert len(records) == 4 * 6 * 2
    for r in records:
        assert r["seed"] == prompt_seed(3, r["prompt_id"])
    for label in ("ar", "sd:k=3", "ersd:k=3", "ersd:candidates=2,k=3"):
        sampled = {tuple(r["token_ids"]) for r in records if r["method"] == label and r["temperature"] == 1.0}
        greedy = {tuple(r["token_ids"]) for r in records if r["method"] == label and r["temperature"] == 0.0}
        assert len(greedy) == 1, label
        assert len(sampled) >= 5, (label, len(sampled))  # with one shared seed they would all be equal
    # ERSD is drafter- and candidate-invariant: with the same seed it is the target's race sample
    by = lambda label: {r["prompt_id"]: r["token_ids"] for r in records if r["method"] == label and r["temperature"] == 1.0}  # noqa: E731
    assert by("ersd:k=3") == by("ersd:candidates=2,k=3")


def test_resuming_a_run_made_with_other_seeds_is_refused(same_ids_pipe, tmp_path):
    prompts = _prompts(2)
    config = BenchConfig(entries=parse_entries("ar"), dataset="mtbench", limit=2, temperatures=[1.0],
                         max_new_tokens=4, warmup_tokens=0, fidelity=False)
    out = tmp_path / "run"
    run_bench(same_ids_pipe, prompts, config, out, progress=False, log=lambda m: None)
    # a cell written by the former ``seed + index`` scheme
    cell = next((out / "raw").glob("*/*/*.json"))
    record = json.loads(cell.read_text())
    record["seed"] = record["prompt_index"]
    cell.write_text(json.dumps(record))
    with pytest.raises(QuickdraftError, match="other seeds"):
        run_bench(same_ids_pipe, prompts, config, out, progress=False, log=lambda m: None)
