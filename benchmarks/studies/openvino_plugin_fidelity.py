"""How far each CPU-plugin setting moves an export's next-token distributions from exact arithmetic.

``openvino_plugin_settings.py`` measures what the settings cost; this measures what they change.
The reference is the same export compiled with ``exact=True`` (float32 activations and KV cache, no
on-the-fly activation quantisation): the weights are the same, so every difference comes from the
runtime's arithmetic. Texts are HumanEval problems as chat with their canonical solution as the
answer, teacher-forced: the prompt is prefilled, then the answer is fed in blocks of ``m`` tokens
(m = 1: plain decoding's path; m = 5: a K = 4 verification's), and every answer position's
distribution is compared with the reference's: KL(reference ‖ setting) in nats, agreement of the
top token, and the largest absolute logit difference.

    python benchmarks/studies/openvino_plugin_fidelity.py --out benchmarks/results/openvino_plugin_fidelity.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from openvino_compression import _lscpu  # the studies' CPU record (this script's folder is on sys.path)
from openvino_plugin_settings import SETTINGS


def answer_logits(runner, prompt: list[int], answer: list[int], m: int) -> torch.Tensor:
    """``[len(answer), V]`` float64 log-probabilities of the distribution that predicts each answer
    token: the prompt's last position, then each answer token but the last, fed in blocks of ``m``."""
    runner.reset(1)
    rows = [runner.forward(torch.tensor([prompt]), logits_to_keep=1).logits[0, -1:]]
    body = answer[:-1]
    for i in range(0, len(body), m):
        block = body[i:i + m]
        rows.append(runner.forward(torch.tensor([block]), logits_to_keep=len(block)).logits[0])
    return torch.log_softmax(torch.cat(rows).double(), dim=-1)


def compare(ref: torch.Tensor, other: torch.Tensor) -> dict:
    kl = (ref.exp() * (ref - other)).sum(dim=-1)
    finite = torch.isfinite(ref) & torch.isfinite(other)
    diff = torch.where(finite, (ref - other).abs(), torch.zeros_like(ref)).amax(dim=-1)
    return {"kl": kl.tolist(), "top1_equal": (ref.argmax(-1) == other.argmax(-1)).tolist(),
            "max_abs_logprob_diff": diff.tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="int4", help="the target export's weight format")
    parser.add_argument("--problems", type=int, default=8, help="the first N HumanEval problems")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=["plugin", "tuned"])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from quickdraft.backends.openvino import load_openvino
    from quickdraft.backends.openvino.runner import OpenVINORunner
    from quickdraft.evaluation.datasets import load_dataset

    reference, tokenizer = load_openvino("target", "target", weight_format=args.weights, n_threads=args.threads,
                                         exact=True)
    runners = {name: OpenVINORunner(reference.path, name, n_threads=args.threads, **SETTINGS[name])
               for name in args.settings}
    texts = []
    for problem in load_dataset("humaneval", args.problems):
        prompt = tokenizer.apply_chat_template(list(problem.messages), add_generation_prompt=True, tokenize=False)
        answer = "```python\n" + problem.raw + problem.metadata["canonical_solution"] + "```"
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        a_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        texts.append((problem.id, p_ids, a_ids))
    per_text = []
    for pid, p_ids, a_ids in texts:
        ref = answer_logits(reference, p_ids, a_ids, max(args.blocks))  # exact: the block does not matter
        row = {"prompt_id": pid, "prompt_tokens": len(p_ids), "answer_tokens": len(a_ids), "settings": {}}
        for name, runner in runners.items():
            for m in args.blocks:
                row["settings"][f"{name}/m={m}"] = compare(ref, answer_logits(runner, p_ids, a_ids, m))
        per_text.append(row)
        print(pid, {k: round(float(np.mean(v["kl"])), 5) for k, v in row["settings"].items()}, flush=True)
    summary = {}
    for key in per_text[0]["settings"]:
        kl = np.concatenate([r["settings"][key]["kl"] for r in per_text])
        top = np.concatenate([r["settings"][key]["top1_equal"] for r in per_text])
        diff = np.concatenate([r["settings"][key]["max_abs_logprob_diff"] for r in per_text])
        summary[key] = {"positions": int(len(kl)), "mean_kl": float(kl.mean()), "p99_kl": float(np.quantile(kl, 0.99)),
                        "top1_agreement": float(top.mean()), "median_max_abs_logprob_diff": float(np.median(diff))}
        print(key, summary[key], flush=True)
    result = {"command": "python benchmarks/studies/openvino_plugin_fidelity.py " + " ".join(
                  f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items()),
              "machine": _lscpu(), "reference": {"path": str(reference.path), "config": reference.plugin_config},
              "compiled": {name: r.plugin_config for name, r in runners.items()},
              "summary": summary, "per_text": per_text}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
