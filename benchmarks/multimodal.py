"""Image requests offline (issue 28): requests/s and time to first token for image + text
prompts on a small random LLaVA (CLIP tower, Llama text model), with the encoder cache cold
(every image new), warm (the same images again, prefix caching off: only the encoder is
saved) and warm with prefix caching on (the image blocks are cached too).

    python benchmarks/multimodal.py [--num-prompts 16] [--image-size 224] [--output-len 16]
                                    [--threads N]

Each phase runs the prompts as one batch (requests/s) and then one at a time with
``max_tokens=1`` (TTFT, median). Cold phases use a fresh set of images each time. vLLM's CPU
build is not installed on this machine, so it is not measured here.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def build(folder: str, image_size: int):
    from engine_models_llava.testing import save_tiny_llava

    text = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8)
    vision = dict(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=8,
        image_size=image_size,
    )
    save_tiny_llava(folder, text=text, vision=vision)


def prompts(first_seed: int, count: int) -> list[dict]:
    from engine.testing.multimodal import random_image

    return [
        {
            "prompt": "deep <image> blue sea",
            "multi_modal_data": {"image": random_image(first_seed + i, (320, 240))},
        }
        for i in range(count)
    ]


def batch_rate(llm, batch: list[dict], output_len: int) -> float:
    """Requests/s of ``batch`` run together."""
    from engine import SamplingParams

    start = time.perf_counter()
    llm.generate(batch, SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True))
    return len(batch) / (time.perf_counter() - start)


def median_ttft(llm, batch: list[dict]) -> float:
    """Median milliseconds to the first token of each prompt run alone."""
    from engine import SamplingParams

    times = []
    for prompt in batch:
        start = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0))
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    import torch

    from engine import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.num_prompts
    with tempfile.TemporaryDirectory() as folder:
        build(folder, args.image_size)
        for caching in (False, True):
            llm = LLM(
                folder,
                dtype="float32",
                max_model_len=512,
                num_blocks=1024,
                block_size=16,
                enable_prefix_caching=caching,
            )
            seed = 1000 * (caching + 1)
            cold = batch_rate(llm, prompts(seed, n), args.output_len), median_ttft(llm, prompts(seed + n, n))
            warm = batch_rate(llm, prompts(seed, n), args.output_len), median_ttft(llm, prompts(seed + n, n))
            cache = llm.engine.runner.encoder_cache
            tokens = llm.engine.mm_processor.process_image(
                prompts(0, 1)[0]["multi_modal_data"]["image"]
            ).num_tokens
            print(
                f"prefix caching {'on ' if caching else 'off'} | {tokens} image tokens | "
                f"cold {cold[0]:.2f} req/s, TTFT {cold[1]:.1f} ms | warm {warm[0]:.2f} req/s, "
                f"TTFT {warm[1]:.1f} ms | encoder runs {cache.encoder_runs}, hits {cache.hits}"
            )


if __name__ == "__main__":
    main()
