"""Stop strings found in O(new text) per token, however many stops a request has.

An Aho-Corasick automaton over the request's stop strings is fed each token's new text as it is
detokenized. It remembers where it stands in the text so far, so a token costs the length of its
own text (amortized), not the number or length of the stops: one request with thousands of stop
strings no longer slows every other request's step.
"""

from __future__ import annotations

from collections import deque


class StopStringMatcher:
    """Fed a sequence's text piece by piece; reports where the earliest stop string that a piece
    completes begins."""

    def __init__(self, stops: tuple[str, ...] | list[str]):
        self.children: list[dict[str, int]] = [{}]  # node -> {character: child node}; node 0 is the root
        self.fail: list[int] = [0]  # node -> the node of its longest proper suffix in the trie
        self.longest: list[int] = [0]  # node -> length of the longest stop string ending here (0: none)
        for stop in stops:
            self._insert(stop)
        self._link()
        self.node = 0
        self.num_fed_chars = 0

    def _insert(self, stop: str) -> None:
        node = 0
        for character in stop:
            child = self.children[node].get(character)
            if child is None:
                child = len(self.children)
                self.children[node][character] = child
                self.children.append({})
                self.fail.append(0)
                self.longest.append(0)
            node = child
        self.longest[node] = max(self.longest[node], len(stop))

    def _link(self) -> None:
        """Failure links breadth first; a node also matches every stop that ends its suffixes."""
        queue = deque(self.children[0].values())
        while queue:
            node = queue.popleft()
            self.longest[node] = max(self.longest[node], self.longest[self.fail[node]])
            for character, child in self.children[node].items():
                self.fail[child] = self._step(self.fail[node], character) if node else 0
                queue.append(child)

    def _step(self, node: int, character: str) -> int:
        while node and character not in self.children[node]:
            node = self.fail[node]
        return self.children[node].get(character, 0)

    def feed(self, text: str) -> int:
        """Append `text`; returns the index (in everything fed so far) where the earliest stop string
        ending inside `text` begins, or -1."""
        earliest = -1
        node, start = self.node, self.num_fed_chars
        for offset, character in enumerate(text):
            node = self._step(node, character)
            length = self.longest[node]
            if length:
                begin = start + offset + 1 - length
                if earliest == -1 or begin < earliest:
                    earliest = begin
        self.node, self.num_fed_chars = node, start + len(text)
        return earliest


def find_stop_string(seq, new_text: str) -> int:
    """Index in seq.text (which already ends with new_text) where a stop string completed by new_text
    begins, or -1. The matcher lives on the sequence (seq.stop_matcher) and catches up on any text
    it has not seen."""
    matcher = seq.stop_matcher
    if matcher is None:
        matcher = seq.stop_matcher = StopStringMatcher(seq.params.stop)
    seen_until = len(seq.text) - len(new_text)
    if matcher.num_fed_chars != seen_until:
        if matcher.num_fed_chars > seen_until:  # the text was cut: start over on what is left
            matcher = seq.stop_matcher = StopStringMatcher(seq.params.stop)
        matcher.feed(seq.text[matcher.num_fed_chars : seen_until])
    return matcher.feed(new_text)
