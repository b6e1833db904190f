"""models-llava against ``transformers``' LlavaForConditionalGeneration on a tiny random
checkpoint: greedy tokens (and their log-probs) for one image, two images, an image request
batched with text-only ones, and a prefill chunked through the image span; the encoder cache
and the prefix cache keyed by the image."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine_models_llava.testing import random_image, save_tiny_llava

PLUGINS = ["models-llava", "attention-torch"]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("llava"))
    model, processor = save_tiny_llava(folder)
    return folder, model, processor


def engine(folder: str, **options) -> LLM:
    options = {"num_blocks": 96, "block_size": 8, "max_model_len": 256, **options}
    return LLM(folder, dtype="float32", plugins=PLUGINS, **options)


def reference(checkpoint, text: str, images: list) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their log-probs."""
    _, model, processor = checkpoint
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    logprobs = [step.log_softmax(-1)[0, t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def prompt(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0)


def check_parity(checkpoint, llm: LLM, cases: list[tuple[str, list]]) -> None:
    outputs = llm.generate([prompt(text, images) for text, images in cases], GREEDY)
    for (text, images), output in zip(cases, outputs):
        tokens, logprobs = reference(checkpoint, text, images)
        completion = output.outputs[0]
        assert completion.token_ids == tokens, text
        ours = [entry[token].logprob for entry, token in zip(completion.logprobs, tokens)]
        assert ours == pytest.approx(logprobs, abs=2e-4)


def test_one_image_matches_transformers(checkpoint):
    check_parity(checkpoint, engine(checkpoint[0]), [("deep <image> blue sea", [random_image(1)])])


def test_two_images_match_transformers(checkpoint):
    cases = [("<image> deep blue <image> sea", [random_image(2), random_image(3, (40, 70))])]
    check_parity(checkpoint, engine(checkpoint[0]), cases)


def test_image_batched_with_text_only_requests(checkpoint):
    cases = [
        ("deep blue sea, red green", []),
        ("red <image> green", [random_image(4)]),
        ("true false null", []),
    ]
    check_parity(checkpoint, engine(checkpoint[0]), cases)


def test_prefill_chunked_through_the_image_span(checkpoint):
    """7-token chunks cut the 16-token image span; the encoder still runs once for the whole
    image and each chunk gets its rows."""
    llm = engine(checkpoint[0], max_num_batched_tokens=7)
    case = ("deep blue <image> sea", [random_image(5)])
    check_parity(checkpoint, llm, [case])
    assert llm.engine.runner.encoder_cache.encoder_runs == 1
    ids = llm.generate(prompt(*case), GREEDY)[0].prompt_token_ids
    image_token = checkpoint[1].config.image_token_id
    span = [i for i, token in enumerate(ids) if token == image_token]
    cuts = [cut for cut in range(7, len(ids), 7) if span[0] < cut <= span[-1]]
    assert len(span) == 16 and len(cuts) >= 2  # the chunk boundaries fall inside the image


def test_same_image_reuses_encoder_and_prefix_cache(checkpoint):
    llm = engine(checkpoint[0])
    image = random_image(6)
    first = llm.generate(prompt("deep <image> blue sea", [image]), GREEDY)[0]
    assert llm.engine.runner.encoder_cache.encoder_runs == 1
    again = llm.generate(prompt("deep <image> blue sea", [random_image(6)]), GREEDY)[0]  # equal pixels
    assert llm.engine.runner.encoder_cache.encoder_runs == 1  # from the encoder cache
    assert again.num_cached_tokens == 16  # two full 8-token blocks over the image
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_other_image_with_the_same_text_misses(checkpoint):
    llm = engine(checkpoint[0])
    llm.generate(prompt("deep <image> blue sea", [random_image(7)]), GREEDY)
    other = llm.generate(prompt("deep <image> blue sea", [random_image(8)]), GREEDY)[0]
    assert other.num_cached_tokens == 0  # every block overlaps the image: other keys
    assert llm.engine.runner.encoder_cache.encoder_runs == 2
    tokens, _ = reference(checkpoint, "deep <image> blue sea", [random_image(8)])
    assert other.outputs[0].token_ids == tokens


def test_placeholders_must_pair_with_images(checkpoint):
    llm = engine(checkpoint[0])
    with pytest.raises(ValueError, match="2 image\\(s\\) but the prompt has 1 image placeholder"):
        llm.generate(prompt("deep <image> blue", [random_image(1), random_image(2)]), GREEDY)
