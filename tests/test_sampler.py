"""Sampler building blocks against plain math."""

from __future__ import annotations

import pytest
import torch

from engine.messages.request import Request
from engine.messages.sampling_params import SamplingParams
from engine.native import load_source
from engine.native import rows as rows_kernel
from engine.runner import sampler


def rows_for(*params, outputs=()):
    requests = []
    for i, p in enumerate(params):
        r = Request(str(i), [1, 2, 3], p)
        for t in outputs[i] if outputs else ():
            r.append_output(t)
        requests.append(r)
    return sampler.SamplingRows(requests, torch.device("cpu"))


def test_top_k_top_p_min_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    rows = rows_for(SamplingParams(top_k=2), SamplingParams(top_p=0.7), SamplingParams(min_p=0.2))
    probs = sampler.sampling_probs(logits, rows)
    assert torch.equal(probs > 0, torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool))
    torch.testing.assert_close(probs[0], torch.tensor([0.625, 0.375, 0, 0]))


def test_penalties_follow_hf_and_openai_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0, 0.5]])
    rows = rows_for(
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25), outputs=[[4, 4]]
    )
    sampler.apply_penalties(logits, rows)
    # prompt [1, 2, 3] and output [4, 4] are "seen": positive logits halved, negative doubled;
    # token 4 (output twice) additionally loses 2 * 0.5 + 0.25
    torch.testing.assert_close(logits, torch.tensor([[2.0, -4.0, 0.5, 0.5, 0.25 - 1.25]]))


def test_bitmask_unpacks_every_bit():
    logits = torch.zeros(1, 70)
    mask = torch.zeros(1, 3, dtype=torch.int32)
    for t in (0, 31, 32, 69):
        mask[0, t // 32] |= (1 << (t % 32)) if t % 32 < 31 else -(1 << 31)
    sampler.apply_bitmask(logits, mask)
    assert (logits[0] == 0).nonzero().flatten().tolist() == [0, 31, 32, 69]


def test_draft_verification_preserves_the_target_distribution():
    """Accept d with p(d), else resample from p without d: the outcome is distributed as p."""
    p = torch.tensor([0.1, 0.6, 0.3])
    request = Request("r", [1], SamplingParams(temperature=1.0, seed=7))
    counts = torch.zeros(3)
    trials = 6000
    for _ in range(trials):
        first = sampler.verify_drafts([0, 0], [2], p.unsqueeze(0).repeat(2, 1), request)[0]
        counts[first] += 1
    expected = p * trials
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 13.8  # p = 0.001 for 2 degrees of freedom


def test_greedy_verification_keeps_the_agreeing_prefix():
    request = Request("r", [1], SamplingParams(temperature=0))
    assert sampler.verify_drafts([5, 6, 7, 8], [5, 6, 9], None, request) == [5, 6, 7]
    assert sampler.verify_drafts([5, 6, 7, 8], [5, 6, 7], None, request) == [5, 6, 7, 8]
    assert sampler.verify_drafts([4, 6], [5], None, request) == [4]


def _first_token_distribution(p, q, trials=6000, seed=11):
    """Draw a draft from q, verify it against p, record the first emitted token."""
    request = Request("r", [1], SamplingParams(temperature=1.0, seed=seed))
    gen = torch.Generator().manual_seed(seed + 1)
    counts = torch.zeros(len(p))
    for _ in range(trials):
        draft = int(torch.multinomial(q, 1, generator=gen))
        first = sampler.verify_drafts([0, 0], [draft], torch.stack([p, p]), request, q.unsqueeze(0))[0]
        counts[first] += 1
    return counts


def test_rejection_sampler_with_draft_distributions_matches_the_target():
    """Chi-square over a 4-token vocabulary: a bad draft distribution (mass where p has
    little) and a good one (close to p) both leave the output distributed as p."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    for q in (torch.tensor([0.05, 0.05, 0.1, 0.8]), torch.tensor([0.45, 0.35, 0.15, 0.05])):
        counts = _first_token_distribution(p, q)
        expected = p * counts.sum()
        chi2 = ((counts - expected) ** 2 / expected).sum().item()
        assert chi2 < 16.3, (q, counts)  # p = 0.001 for 3 degrees of freedom


def _random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * torch.rand(rows, 1, generator=gen).mul(6).add(0.5)


def test_candidate_truncation_equals_sorting_the_whole_vocabulary():
    """Top-k / top-p / min-p from growing top-k windows keep exactly the tokens a full sort
    keeps, with the same renormalized probabilities: mixed rows in one batch, nuclei far
    wider than the first window (flat rows, top_p 0.99), k above the window, a greedy row."""
    from engine.testing.reference import sorted_sampling_probs

    vocab = 3001
    settings = [
        dict(top_k=5),
        dict(top_p=0.9),
        dict(top_p=0.99),
        dict(top_k=300, top_p=0.95),
        dict(min_p=0.1),
        dict(top_k=40, min_p=0.05),
        dict(temperature=0.3, top_p=0.5),
        dict(temperature=2.0),
        dict(top_k=vocab - 1, top_p=0.999),
        dict(temperature=0),
    ]
    params = [SamplingParams(**{"temperature": 1.0, **s}) for s in settings]
    logits = _random_logits(len(params), vocab, seed=3)
    logits[2] /= 20  # nearly flat: its 0.99 nucleus spans most of the vocabulary
    got = sampler.sampling_probs(logits, rows_for(*params))
    expected = sorted_sampling_probs(
        logits,
        [p.temperature if not p.greedy else 1.0 for p in params],
        [p.top_k for p in params],
        [p.top_p for p in params],
        [p.min_p for p in params],
    )
    for i, s in enumerate(settings):
        assert torch.equal(got[i] > 0, expected[i] > 0), (
            s,
            int((got[i] > 0).sum()),
            int((expected[i] > 0).sum()),
        )
        torch.testing.assert_close(got[i], expected[i], atol=1e-6, rtol=1e-4, msg=str(s))


CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}  # chi-square at p = 0.001, by degrees of freedom


def _sparse(vocab: int, mass: dict[int, float]) -> torch.Tensor:
    p = torch.zeros(vocab)
    for token, value in mass.items():
        p[token] = value
    return p


@pytest.mark.parametrize(
    "p",
    [
        torch.tensor([0.0, 0.5, 0.0, 0.3, 0.15, 0.05, 0.0]),  # within one (partial) block
        _sparse(1000, {3: 0.2, 255: 0.3, 256: 0.25, 700: 0.15, 999: 0.1}),  # block edges and the tail block
        _sparse(512, {0: 0.4, 511: 0.6}),  # whole blocks only
    ],
    ids=["one-block", "across-blocks", "whole-blocks"],
)
def test_inverse_cdf_draws_follow_the_distribution_and_skip_masked_tokens(p):
    logits = p.log().repeat(4000, 1)  # zero-probability tokens are -inf logits
    tokens, _ = sampler.sample(logits, rows_for(*[SamplingParams(temperature=1.0)] * 4000))
    counts = torch.bincount(tokens, minlength=len(p)).float()
    assert counts[p == 0].sum() == 0
    expected = p[p > 0] * len(tokens)
    chi2 = ((counts[p > 0] - expected) ** 2 / expected).sum().item()
    assert chi2 < CHI2_999[len(expected) - 1]


def test_a_seeded_row_draws_the_same_tokens_alone_and_in_a_batch():
    vocab = 500
    logits = _random_logits(6, vocab, seed=5)
    seeded = [SamplingParams(temperature=1.0, seed=42), SamplingParams(temperature=0.8, top_p=0.9, seed=9)]
    for j, params in enumerate(seeded):
        alone = [int(sampler.sample(logits[2:3].clone(), rows_for(params))[0]) for _ in range(1)]
        others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0), SamplingParams(top_k=3)]
        batch_rows = rows_for(
            *others[:2], params, others[2], SamplingParams(temperature=0.5), SamplingParams()
        )
        batched = int(sampler.sample(logits.clone(), batch_rows)[0][2])
        assert alone == [batched], params


def test_sampling_returns_distributions_only_when_asked():
    logits = _random_logits(3, 50, seed=1)
    rows = rows_for(SamplingParams(temperature=1.0), SamplingParams(temperature=0), SamplingParams(top_k=4))
    assert sampler.sample(logits, rows)[1] is None
    tokens, probs = sampler.sample(logits, rows, need_probs=True)
    assert probs.shape == (3, 50) and int(tokens[1]) == int(logits[1].argmax())
    assert int((probs[2] > 0).sum()) == 4 and probs[2, tokens[2]] > 0


# the builds a CPU may run: its own, AVX2 with AVX-512 off (on an AVX-512 machine the native
# build never runs that path) and the compiler's baseline (the scalar loop)
ARGMAX_BUILDS = {"native": {}, "avx2": {"extra_flags": ("-mno-avx512f",)}, "portable": {"portable": True}}


@pytest.mark.skipif(
    rows_kernel.argmax(torch.zeros(1, 1)) is None, reason="the row kernel cannot be built here"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("build", ARGMAX_BUILDS)
@pytest.mark.parametrize("n", [1, 5, 7, 8, 9, 15, 16, 17, 33, 49152])
def test_the_row_argmax_kernel_is_numpys_on_ties_nans_and_tails(n, build, dtype):
    """Rows whose maxima, ties, NaNs and infinities fall in every vector lane and in the tail
    past the last whole vector, many rows (split over the threads) and rows of a wider matrix:
    numpy's first-maximum index of the float32 values, NaN counting as the maximum, in every
    build, for float32 rows and for bfloat16 ones (whose rounding makes ties common)."""
    if build == "avx2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("no AVX2 on this CPU")
    kernel = load_source(rows_kernel.SOURCE, **ARGMAX_BUILDS[build])[rows_kernel.ARGMAX_SYMBOLS[dtype]]
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(300, n + 3, generator=gen).to(dtype)[:, :n]  # rows n + 3 apart
    values = torch.tensor([float("nan"), float("inf"), float("-inf"), 4.0], dtype=dtype)
    for row in range(300):
        for _ in range(row % 4):
            x[row, torch.randint(0, n, (1,), generator=gen)] = values[
                torch.randint(0, 4, (1,), generator=gen)
            ]
    x[0] = float("-inf")
    x[1] = 4.0
    out = torch.empty(300, dtype=torch.int64)
    kernel(x.data_ptr(), 300, n, x.stride(0), out.data_ptr())
    assert torch.equal(out, torch.from_numpy(x.float().numpy().argmax(axis=-1)))
    assert torch.equal(rows_kernel.argmax(x), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_greedy_picks_the_first_maximum_with_nan_as_the_maximum(dtype):
    """The CPU path (the core's C kernel for float32 and bfloat16, numpy's argmax for float64) gives torch's
    ``max(dim=-1)`` index: ties go to the first, a NaN beats every number, the first NaN wins,
    and a row of -inf is index 0."""
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[1, [7, 300]] = 50.0
    logits[2, [40, 9]] = float("nan")
    logits[2, 3] = float("inf")
    logits[3] = float("-inf")
    logits[4, 999] = float("inf")
    got = rows_kernel.first_max(logits)
    assert got.dtype == torch.int64
    assert got.tolist() == logits.max(dim=-1).indices.tolist()
    assert got[1] == 7 and got[2] == 9 and got[3] == 0 and got[4] == 999
