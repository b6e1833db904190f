"""The `engine generate` command, run as a user would."""

from __future__ import annotations

import os
import subprocess
import sys

from engine import LLM, SamplingParams

ENGINE = os.path.join(os.path.dirname(sys.executable), "engine")


def test_generate_streams_the_greedy_text(tiny_llama):
    folder = tiny_llama[0]
    args = ["--dtype", "float32", "--num-blocks", "64", "--max-model-len", "256"]
    result = subprocess.run(
        [ENGINE, "generate", "--model", folder, "--prompt", "The sky is", "--max-tokens", "8", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    llm = LLM(folder, dtype="float32", num_blocks=64, max_model_len=256)
    expected = llm.generate("The sky is", SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
    assert result.stdout == expected + "\n"


def test_generate_reports_bad_arguments_in_one_line(tiny_llama):
    result = subprocess.run(
        [ENGINE, "generate", "--model", "/no/such/model", "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and "cannot load" in result.stderr
    result = subprocess.run(
        [
            ENGINE,
            "generate",
            "--model",
            tiny_llama[0],
            "--prompt",
            "x",
            "--max-tokens",
            "-3",
            "--num-blocks",
            "64",
            "--max-model-len",
            "256",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 2 and "max_tokens must be at least 1" in result.stderr
