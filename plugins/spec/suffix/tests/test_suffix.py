from hypothesis import given, settings
from hypothesis import strategies as st

from engine.testing.spec import DrafterContract
from engine_spec_suffix.automaton import SuffixAutomaton


def brute_earlier_match(tokens):
    n = len(tokens)
    for length in range(n - 1, 0, -1):
        suffix = tokens[n - length :]
        for end in range(length - 1, n - 1):
            if tokens[end - length + 1 : end + 1] == suffix:
                return length, end
    return 0, -1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40))
def test_earlier_match_agrees_with_brute_force(tokens):
    automaton = SuffixAutomaton()
    for i, token in enumerate(tokens):
        automaton.extend(token)
        assert automaton.earlier_match() == brute_earlier_match(tokens[: i + 1])


def test_match_against_a_corpus():
    corpus = SuffixAutomaton()
    for token in [1, 2, 3, 4, 5, -1, 7, 2, 3, 9]:
        corpus.extend(token)
    assert corpus.match([8, 8, 2, 3]) == (2, 2)  # "2 3" first ends at index 2, followed by 4 5
    assert corpus.match([6, 6]) == (0, -1)


class TestSuffix(DrafterContract):
    speculative_config = {"method": "suffix", "num_speculative_tokens": 5}


class TestSuffixWithCorpus(DrafterContract):
    speculative_config = {"method": "suffix", "num_speculative_tokens": 5, "corpus": True, "min_match": 3}
