"""The stop-string matcher against the obvious search, for text that arrives piece by piece."""

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.host.stop_strings import StopStringMatcher, find_stop_string


def brute_force(text: str, num_new_chars: int, stops) -> int:
    """Earliest start of a stop string that ends inside the last num_new_chars characters."""
    starts = [
        index
        for stop in stops
        for index in range(len(text) - len(stop) + 1)
        if text.startswith(stop, index) and index + len(stop) > len(text) - num_new_chars
    ]
    return min(starts, default=-1)


alphabet = st.sampled_from("abc\u00e9\u4e2d ")


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text(alphabet, min_size=1, max_size=5), min_size=1, max_size=6),
    pieces=st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=1, max_size=12),
)
def test_matches_the_obvious_search_piece_by_piece(stops, pieces):
    matcher = StopStringMatcher(stops)
    text = ""
    for piece in pieces:
        text += piece
        expected = brute_force(text, len(piece), stops)
        assert matcher.feed(piece) == expected
        if expected != -1:
            return  # the sequence stops here


def test_the_earliest_start_wins_even_when_it_ends_later():
    matcher = StopStringMatcher(["cd", "abcde"])
    assert matcher.feed("xab") == -1
    assert matcher.feed("cde") == 1  # "cd" ends first, but "abcde" starts first


def test_find_stop_string_keeps_its_matcher_on_the_sequence_and_catches_up():
    seq = SimpleNamespace(params=SimpleNamespace(stop=("END", "stop here")), text="", stop_matcher=None)
    for piece in ["Some", " text", " to st", "op her"]:
        seq.text += piece
        assert find_stop_string(seq, piece) == -1
    matcher = seq.stop_matcher
    seq.text += "e."
    assert find_stop_string(seq, "e.") == len("Some text to ")
    assert seq.stop_matcher is matcher
    skipped = SimpleNamespace(params=seq.params, text="abc EN", stop_matcher=None)
    skipped.text += "D"
    assert find_stop_string(skipped, "D") == 4  # text fed before the matcher existed is caught up on


def test_many_stop_strings_share_one_automaton():
    stops = [f"<stop-{i}>" for i in range(20000)]
    matcher = StopStringMatcher(stops)
    assert len(matcher.children) < sum(len(stop) for stop in stops)  # shared prefixes share nodes
    assert matcher.feed("text <stop-1999") == -1
    assert matcher.feed("9>") == len("text ")
