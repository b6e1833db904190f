"""Multimodal model contract: a model plugin that reads images (``Model.multimodal_processor``)
against its ``transformers`` reference on a tiny random checkpoint the plugin builds
(:meth:`MultiModalContract.save_checkpoint`: its family's processor and config are its own).
Greedy tokens and their log-probs for one image, two images, an image request batched with
text-only ones, a prefill chunked through an image span and steps held to the encoder budget;
the encoder runs once per distinct image, the same image hits the prefix cache and another
image with the same text does not.

Prompts are text with the checkpoint's image placeholder (``image_placeholder``) among
pieces of the kit's tiny tokenizer (:mod:`engine.testing.tiny_tokenizer`); images are random
pixels of odd sizes, so the processor's resizing runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.plugins import Registration

NEW_TOKENS = 8
LOGPROB_ATOL = 2e-4
BLOCK_SIZE = 8


def random_image(seed: int, size: tuple[int, int] = (64, 48)):
    """A PIL image of random pixels, ``size`` = (width, height)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


class MultiModalContract:
    """Subclass in the plugin's tests: set ``model_class`` and ``image_placeholder`` and
    implement ``save_checkpoint``. ``plugins``: the engine's allow-list (None: all installed)."""

    model_class: str  # "package.module:Class"
    image_placeholder: str = "<image>"  # how a prompt's text marks an image
    plugins: tuple[str, ...] | None = None
    attention_backend: str | None = None

    @classmethod
    def save_checkpoint(cls, folder: str):
        """Save a tiny random checkpoint with its processor (whose tokenizer holds the kit's
        tiny tokenizer's pieces and the image placeholder) to ``folder``; return the
        ``transformers`` model (in eval mode, float32) and processor."""
        raise NotImplementedError

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint(cls, tmp_path_factory):
        folder = str(tmp_path_factory.mktemp("multimodal"))
        model, processor = cls.save_checkpoint(folder)
        return folder, model, processor

    def _llm(self, folder: str, **options):
        from engine import LLM

        options = {"num_blocks": 96, "block_size": BLOCK_SIZE, "max_model_len": 256, **options}
        llm = LLM(
            folder, dtype="float32", plugins=self.plugins, attention_backend=self.attention_backend, **options
        )
        wanted = Registration("models", "", self.model_class, "").load()
        assert type(llm.engine.model) is wanted, f"the engine served {type(llm.engine.model)}"
        return llm

    def _text(self, template: str) -> str:
        return template.replace("<image>", self.image_placeholder)

    def _prompt(self, template: str, images: list) -> dict:
        text = self._text(template)
        return {"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}

    def _reference(self, checkpoint, template: str, images: list) -> tuple[list[int], list[float]]:
        """transformers' greedy tokens and their log-probs."""
        _, model, processor = checkpoint
        inputs = processor(text=self._text(template), images=images or None, return_tensors="pt")
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

    def _check_parity(self, checkpoint, llm, cases: list[tuple[str, list]]) -> list:
        from engine import SamplingParams

        greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0)
        outputs = llm.generate([self._prompt(text, images) for text, images in cases], greedy)
        for (text, images), output in zip(cases, outputs):
            tokens, logprobs = self._reference(checkpoint, text, images)
            completion = output.outputs[0]
            assert completion.token_ids == tokens, text
            ours = [entry[token].logprob for entry, token in zip(completion.logprobs, tokens)]
            assert ours == pytest.approx(logprobs, abs=LOGPROB_ATOL), text
        return outputs

    def test_one_image_matches_transformers(self, checkpoint):
        self._check_parity(
            checkpoint, self._llm(checkpoint[0]), [("deep <image> blue sea", [random_image(1)])]
        )

    def test_two_images_match_transformers(self, checkpoint):
        cases = [("<image> deep blue <image> sea", [random_image(2), random_image(3, (40, 70))])]
        self._check_parity(checkpoint, self._llm(checkpoint[0]), cases)

    def test_image_batched_with_text_only_requests(self, checkpoint):
        cases = [
            ("deep blue sea, red green", []),
            ("red <image> green", [random_image(4)]),
            ("true false null", []),
        ]
        self._check_parity(checkpoint, self._llm(checkpoint[0]), cases)

    def test_prefill_chunked_through_the_image_span(self, checkpoint):
        """5-token chunks cut the image span at least once (the kit asks for an image of more
        than 5 tokens); the encoder still runs once for the whole image."""
        llm = self._llm(checkpoint[0], max_num_batched_tokens=5)
        [output] = self._check_parity(checkpoint, llm, [("deep blue <image> sea", [random_image(5)])])
        assert llm.engine.runner.encoder_cache.encoder_runs == 1
        [item] = _items(llm, output.prompt_token_ids, [random_image(5)])
        cuts = [cut for cut in range(5, len(output.prompt_token_ids), 5) if item.offset < cut < item.end]
        assert cuts, f"no chunk boundary inside the image span [{item.offset}, {item.end})"

    def test_encoder_budget_holds_each_step_to_its_image_tokens(self, checkpoint):
        """Two requests whose images one step would reach together: with the encoder budget
        (``max_num_encoder_input_tokens``) at one image's tokens, no step encodes both, and
        the tokens stay transformers'; with the default budget one step encodes both."""
        cases = [("deep <image> sea", [random_image(13)]), ("red <image> green", [random_image(14)])]
        per_image = self._llm(checkpoint[0]).engine.mm_processor.process_image(random_image(13)).num_tokens
        for budget, most in ((None, 2), (per_image, 1)):
            llm = self._llm(checkpoint[0], max_num_encoder_input_tokens=budget)
            encoded = _encoded_per_step(llm)
            self._check_parity(checkpoint, llm, cases)
            assert sum(encoded) == 2 and max(encoded) == most, (budget, encoded)

    def test_greedy_under_preemption_matches_transformers(self, checkpoint):
        """Four image requests in a pool of 6 8-token blocks that cannot hold them all: requests
        are preempted and their prompts, images included, recomputed (the encoder output
        comes from the cache, or is encoded again after eviction)."""
        llm = self._llm(
            checkpoint[0],
            num_blocks=7,
            max_num_batched_tokens=24,
            max_model_len=48,
            enable_prefix_caching=False,
            mm_encoder_cache_bytes=1,  # nothing kept: a recomputed image is encoded again
        )
        cases = [(text, [random_image(20 + i)]) for i, text in enumerate(["deep <image>", "<image> sea"] * 2)]
        self._check_parity(checkpoint, llm, cases)
        assert llm.engine.stats()["preemptions"] > 0, "the pool must be small enough to preempt"
        assert llm.engine.runner.encoder_cache.encoder_runs > len(cases)

    def test_same_image_reuses_encoder_and_prefix_cache(self, checkpoint):
        llm = self._llm(checkpoint[0])
        from engine import SamplingParams

        greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
        first = llm.generate(self._prompt("deep <image> blue sea", [random_image(6)]), greedy)[0]
        assert llm.engine.runner.encoder_cache.encoder_runs == 1
        again = llm.generate(self._prompt("deep <image> blue sea", [random_image(6)]), greedy)[
            0
        ]  # equal pixels
        assert llm.engine.runner.encoder_cache.encoder_runs == 1  # its rows came from the encoder cache
        full_blocks = (len(again.prompt_token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert again.num_cached_tokens == full_blocks > 0
        assert again.outputs[0].token_ids == first.outputs[0].token_ids

    def test_other_image_with_the_same_text_misses(self, checkpoint):
        from engine import SamplingParams

        llm = self._llm(checkpoint[0])
        greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
        llm.generate(self._prompt("<image> deep blue sea", [random_image(7)]), greedy)
        other = llm.generate(self._prompt("<image> deep blue sea", [random_image(8)]), greedy)[0]
        assert other.num_cached_tokens == 0  # the first block holds the image: another key
        assert llm.engine.runner.encoder_cache.encoder_runs == 2
        tokens, _ = self._reference(checkpoint, "<image> deep blue sea", [random_image(8)])
        assert other.outputs[0].token_ids == tokens

    def test_placeholders_must_pair_with_images(self, checkpoint):
        from engine import SamplingParams

        llm = self._llm(checkpoint[0])
        with pytest.raises(ValueError, match="2 image\\(s\\) but the prompt has 1 image placeholder"):
            llm.generate(
                self._prompt("deep <image> blue", [random_image(1), random_image(2)]), SamplingParams()
            )

    @pytest.mark.slow  # starts an engine-core process
    def test_images_cross_the_engine_core_process(self, checkpoint):
        """The server's client: the items (pixel tensors) cross the ZMQ socket to the
        engine-core process and the tokens come back as ``transformers``' own."""
        import asyncio

        from transformers import AutoConfig

        from engine import SamplingParams
        from engine.client.async_engine import AsyncEngine
        from engine.messages.multimodal import expand_placeholders

        folder, _, hf_processor = checkpoint
        model_cls = Registration("models", "", self.model_class, "").load()
        processor = model_cls.multimodal_processor(folder, AutoConfig.from_pretrained(folder))
        images = [random_image(9), random_image(10, (30, 90))]
        template = "deep <image> blue <image> sea"
        ids = hf_processor.tokenizer(self._text(template))["input_ids"]
        ids, items = expand_placeholders(ids, images, processor)
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
        options = dict(
            model=folder, dtype="float32", plugins=self.plugins, num_blocks=96, block_size=BLOCK_SIZE
        )

        async def run() -> list[int]:
            engine = AsyncEngine({**options, "max_model_len": 256})
            await engine.start()
            try:
                handle = engine.submit([("mm", ids, params)], mm_items=items)
                return [token async for delta in handle.deltas() for token in delta.token_ids]
            finally:
                await engine.shutdown()

        assert asyncio.run(run()) == self._reference(checkpoint, template, images)[0]


def _encoded_per_step(llm) -> list[int]:
    """A list that gets, after each engine step of ``llm``, how many images the step encoded."""
    encoded: list[int] = []
    cache, step = llm.engine.runner.encoder_cache, llm.engine.step

    def counted():
        before = cache.encoder_runs
        outputs = step()
        encoded.append(cache.encoder_runs - before)
        return outputs

    llm.engine.step = counted
    return encoded


def _items(llm, prompt_token_ids: list[int], images: list):
    """The items the engine made of ``images`` in a prompt (their spans)."""
    from engine.messages.multimodal import expand_placeholders

    processor = llm.engine.mm_processor
    placeholder = processor.placeholder_token_id
    collapsed: list[int] = []
    for token in prompt_token_ids:  # back to one placeholder per image
        if not (token == placeholder and collapsed and collapsed[-1] == placeholder):
            collapsed.append(token)
    return expand_placeholders(collapsed, images, processor)[1]
