"""Prompt-lookup drafting (scheduler/ngram.py) against a brute-force reference."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.scheduler.ngram import NgramDrafter


def reference(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The longest suffix (hi down to lo) with an earlier occurrence; its latest one's followers,
    read on into the draft as it is written where they reach the end."""
    end = len(tokens)
    for n in range(min(hi, end - 1), lo - 1, -1):
        suffix = tokens[end - n :]
        for start in range(end - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                written = list(tokens)
                for j in range(k):
                    written.append(written[start + n + j])
                return written[end:]
    return []


def test_a_quoted_span_is_proposed():
    prompt = [5, 6, 7, 8, 9, 10, 11, 3, 4]
    drafter = NgramDrafter(2, 4)
    assert drafter.propose(prompt, [6, 7], 3) == [8, 9, 10]  # "6 7" was followed by "8 9 10"
    assert drafter.propose(prompt, [6, 7, 8, 9], 5) == [10, 11, 3, 4, 6]  # runs into the output too
    assert drafter.propose(prompt, [6, 7, 8, 9, 10, 11, 3, 4, 6], 5) == [7, 8, 9, 10, 11]
    assert NgramDrafter(2, 4).propose([1, 2], [3], 4) == []  # nothing repeats


def test_a_loop_is_drafted_round_and_round():
    """An output repeating a 3-token line: "1 2" last occurred 3 tokens back, followed by
    "0 1 2" up to the end; the draft goes on round the loop rather than stopping there."""
    drafter = NgramDrafter(2, 4)
    assert drafter.propose([9, 8], [0, 1, 2, 0, 1, 2], 7) == [0, 1, 2, 0, 1, 2, 0]
    assert drafter.propose([9, 8], [0, 1, 2, 0, 1, 2, 0], 2) == [1, 2]  # a short one as before
    assert NgramDrafter(1, 1).propose([4], [4], 3) == [4, 4, 4]  # a token repeated: period 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 6), st.integers(1, 3), st.integers(0, 3),
       st.integers(1, 60))
def test_incremental_drafts_equal_the_reference(tokens, k, lo, extra, prompt_len):
    hi = lo + extra
    drafter = NgramDrafter(lo, hi)
    prompt = tokens[: min(prompt_len, len(tokens))]
    for end in range(len(prompt), len(tokens) + 1):  # the output grows one token at a time
        assert drafter.propose(prompt, tokens[len(prompt) : end], k) == reference(tokens[:end], k, lo, hi)
