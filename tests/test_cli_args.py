"""Engine flags as vLLM spells them: sizes and counts with units, dtype aliases, --config
files, flags without effect noted, unknown flags refused in one line with the closest match."""

from __future__ import annotations

import argparse
import subprocess

import pytest

from engine.entrypoints.cli_args import (
    ArgumentParser,
    add_engine_arguments,
    engine_options,
    expand_config_files,
    parse_count,
    parse_size,
)
from tests.serving import ENGINE


def parse(*argv: str) -> dict:
    parser = ArgumentParser(prog="engine")
    add_engine_arguments(parser)
    return engine_options(parser.parse_args(list(argv)))


def test_sizes_and_counts():
    assert parse_size("4GiB") == 4 * 2**30 == parse_size("4G") == parse_size("4 gib")
    assert (
        parse_size("4GB") == 4 * 10**9 and parse_size("512MiB") == 512 * 2**20 and parse_size("1e9") == 10**9
    )
    assert parse_count("32k") == 32000 and parse_count("32K") == 32768 and parse_count("4096") == 4096
    for bad in ("lots", "-1G", "4XB"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


def test_vllm_spellings_map_to_engine_options():
    options = parse(
        "--gpu-memory-utilization",
        "0.5",
        "--kv-cache-memory-bytes",
        "1GiB",
        "--num-gpu-blocks-override",
        "64",
        "-q",
        "int8-w8a8",
        "-tp",
        "1",
        "--dtype",
        "half",
        "--max-model-len",
        "2k",
        "--scheduling-policy",
        "priority",
        "--no-enable-prefix-caching",
    )
    assert options == {
        "memory_utilization": 0.5,
        "kv_cache_memory": 2**30,
        "num_blocks": 64,
        "quantization": "int8-w8a8",
        "tensor_parallel_size": 1,
        "dtype": "float16",
        "max_model_len": 2000,
        "policy": "priority",
        "enable_prefix_caching": False,
    }
    assert parse("--dtype", "float")["dtype"] == "float32"


def test_flags_without_effect_are_accepted_and_named(capsys):
    options = parse("--trust-remote-code", "--swap-space", "4", "--max-num-seqs", "8")
    assert options == {"max_num_seqs": 8}
    err = capsys.readouterr().err
    assert "--trust-remote-code has no effect" in err and "--swap-space has no effect" in err


def test_config_file_flags_sit_where_config_was(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("max-num-seqs: 8\nenable_prefix_caching: false\nspeculative-config: {method: ngram}\n")
    argv = expand_config_files(["serve", "--config", str(path), "--max-num-seqs", "16"])
    assert argv == [
        "serve",
        "--max-num-seqs",
        "8",
        "--no-enable-prefix-caching",
        "--speculative-config",
        '{"method": "ngram"}',
        "--max-num-seqs",
        "16",
    ]
    assert parse(*argv[1:])["max_num_seqs"] == 16  # the command line after --config wins


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        (
            "--max-num-seq",
            "unknown flag --max-num-seq; did you mean --max-num-seqs?",
        ),  # no silent abbreviation
        ("--gpu-memory-utilisation", "did you mean --gpu-memory-utilization?"),
        ("--frobnicate", "unknown flag --frobnicate; see `engine --help`"),
    ],
)
def test_unknown_flag_is_one_line_with_the_closest(flag, message):
    result = subprocess.run(
        [ENGINE, "serve", flag, "1"], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 2 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_memory_utilization_sizes_the_kv_cache(tiny_llama):
    from engine import LLM
    from engine.builtin.platforms import CpuPlatform

    used, total = CpuPlatform().memory_in_use()  # this process's resident memory: it grows with the suite
    share = (used + 256 * 2**20) / total  # what the process holds now and about 256 MiB more
    small = LLM(tiny_llama[0], dtype="float32", memory_utilization=share)
    assert small.engine.kv_cache_manager.num_blocks > 2
    with pytest.raises(ValueError, match="memory_utilization"):
        LLM(tiny_llama[0], dtype="float32", memory_utilization=1e-6)
