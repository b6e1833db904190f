import numpy as np

from engine.testing.spec import DrafterContract
from engine_spec_ngram.drafter import lookup


def test_lookup_prefers_the_longest_most_recent_match():
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3])
    assert lookup(tokens, 1, 3, 2) == [7, 8]  # "1 2 3" last seen before 7 8
    assert lookup(tokens, 1, 3, 10) == [7, 8, 5, 1, 2, 3]
    assert lookup(np.array([4, 5, 6]), 1, 3, 3) == []
    assert lookup(np.array([5, 1, 5]), 1, 2, 2) == [1, 5]


class TestNgram(DrafterContract):
    speculative_config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
