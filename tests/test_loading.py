"""Checkpoint and cache set-up paths: sharded safetensors, the KV pool sized from a memory
budget, bfloat16, and the conformance kit's own pytest entry point."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

from engine import LLM, SamplingParams
from engine.testing import reference
from tests.conftest import TINY_LLAMA


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path, tiny_llama):
    folder, hf_model = tiny_llama
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, safe_serialization=True, max_shard_size="2MB")
    assert len(glob.glob(os.path.join(sharded, "*.safetensors"))) > 1
    prompts = reference.random_prompts(TINY_LLAMA["vocab_size"], [9, 4], seed=8)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    one = LLM(folder, dtype="float32", num_blocks=64, max_model_len=256).generate(prompts, params)
    many = LLM(str(sharded), dtype="float32", num_blocks=64, max_model_len=256).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in one] == [o.outputs[0].token_ids for o in many]


def test_kv_pool_is_sized_from_the_memory_budget(tiny_llama):
    budget = 8 * 2**20
    llm = LLM(tiny_llama[0], dtype="bfloat16", kv_cache_memory=budget, block_size=16, max_model_len=256)
    # per block: 2 layers x (K and V) x 16 tokens x 2 KV heads x 16 dims x 2 bytes
    assert llm.engine.kv_cache_manager.num_blocks == budget // (2 * 2 * 16 * 2 * 16 * 2)
    out = llm.generate("bf16 works too", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5


def test_engine_conformance_flag_collects_every_registration():
    """Run from this folder, so this suite's conftest registers its seam plugins in-process;
    its test modules are not collected (importing them all took most of this test's time)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--engine-conformance",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "conformance_all",
            "--ignore-glob",
            "test_*.py",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(__file__),
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "Test_attention_torch" in out and "Test_scheduler_default" in out and "Test_kv_default" in out
    assert "Test_model_engine_models_llama_model_LlamaForCausalLM" in out
    assert "Test_grammar_test_choice" in out  # registered in-process, by tests/conftest.py
    # each cache layout a backend reads gets its contract, and only those
    assert "Test_latent_attention_mla_torch" in out and "Test_attention_mla_torch" not in out
    assert "Test_latent_attention_torch" not in out
