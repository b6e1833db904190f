"""lm-eval, run as its users run it, scores the same against `engine serve` (its
`local-completions` model: loglikelihoods from `echo` + `logprobs` prompt log-probs,
generations with stop sequences) as its own `hf` model on the same weights.

lm-eval lives in its own environment (`make lm-eval`, also part of `make test`): its
dependencies are not the engine's. The tasks are small local ones written here.
"""

from __future__ import annotations

import glob
import json
import os
import random
import subprocess
from pathlib import Path

import pytest

from tests.serving import serve

ROOT = Path(__file__).resolve().parents[1]
LM_EVAL = os.environ.get("LM_EVAL", str(ROOT / ".venv-lmeval" / "bin" / "lm_eval"))
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists(LM_EVAL), reason="no lm-eval environment: run `make lm-eval`"),
]

MC_TASK = """task: tessellm_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """task: tessellm_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
"""


def write_tasks(folder: Path) -> None:
    rng = random.Random(0)
    subjects = ["river", "mountain", "city", "planet", "color", "animal", "song", "tree"]
    mc = [
        {
            "question": f"Question {i}: which {(s := rng.choice(subjects))} is the best?",
            "choices": [f"the {s} number {rng.randint(1, 99)}" for _ in range(4)],
            "answer": rng.randrange(4),
        }
        for i in range(16)
    ]
    gen = [
        {"question": f"Say something about the {rng.choice(subjects)} {i}:", "answer": "nothing"}
        for i in range(8)
    ]
    for name, rows in (("mc", mc), ("gen", gen)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "mc.yaml").write_text(MC_TASK.format(folder=folder))
    (folder / "gen.yaml").write_text(GEN_TASK.format(folder=folder))


def run_lm_eval(tasks: Path, out: Path, model: str, model_args: str) -> tuple[dict, dict]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [
        LM_EVAL,
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        "tessellm_mc,tessellm_gen",
        "--include_path",
        str(tasks),
        "--output_path",
        str(out),
        "--log_samples",
        "--batch_size",
        "1",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(Path(glob.glob(f"{out}/**/results_*.json", recursive=True)[0]).read_text())[
        "results"
    ]
    samples = {}
    for task in ("tessellm_mc", "tessellm_gen"):
        path = glob.glob(f"{out}/**/samples_{task}_*.jsonl", recursive=True)[0]
        samples[task] = {
            row["doc_id"]: row["filtered_resps"]
            for row in map(json.loads, Path(path).read_text().splitlines())
        }
    return results, samples


def test_local_completions_scores_like_hf(tiny_llama, tmp_path):
    folder = tiny_llama[0]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write_tasks(tasks)
    hf_results, hf_samples = run_lm_eval(tasks, tmp_path / "hf", "hf", f"pretrained={folder},dtype=float32")
    args = (
        "--dtype",
        "float32",
        "--num-blocks",
        "256",
        "--max-model-len",
        "512",
        "--served-model-name",
        "tiny",
    )
    with serve(folder, *args, api_key=None) as server:
        model_args = (
            f"model=tiny,base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={folder},num_concurrent=4,max_retries=1"
        )
        ours, our_samples = run_lm_eval(tasks, tmp_path / "ours", "local-completions", model_args)
    for task, metric, items in (("tessellm_mc", "acc,none", 16), ("tessellm_gen", "exact_match,none", 8)):
        assert abs(ours[task][metric] - hf_results[task][metric]) * items <= 1 + 1e-9, (
            task,
            ours,
            hf_results,
        )
    for doc, choices in hf_samples["tessellm_mc"].items():  # every choice's loglikelihood, closely
        expected = [float(loglik) for loglik, _ in choices]
        got = [float(loglik) for loglik, _ in our_samples["tessellm_mc"][doc]]
        assert got == pytest.approx(expected, abs=2e-3), doc
        assert all(x != 0.0 for x in got)
    same_text = sum(
        our_samples["tessellm_gen"][d] == texts for d, texts in hf_samples["tessellm_gen"].items()
    )
    assert same_text >= len(hf_samples["tessellm_gen"]) - 1
