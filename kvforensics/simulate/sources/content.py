"""Synthetic prompt/output text for target-model requests, with real leaks in affected outputs.

Texts are random words from a vocabulary of pronounceable made-up words generated from the seed:
no real personal data. Each affected output contains runs of >= ``RUN_WORDS`` consecutive words
copied from the prompt or output of every request in its ``content_leaked_from``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvforensics.simulate.traffic import STREAM_CONTENT

VOCABULARY_SIZE = 3_000
RUN_WORDS = 12
CONSONANTS = "bcdfghjklmnprstvz"
VOWELS = "aeiou"


def vocabulary(seed: int) -> list[str]:
    rng = np.random.default_rng([seed, STREAM_CONTENT, 0])
    words: set[str] = set()
    out: list[str] = []
    while len(out) < VOCABULARY_SIZE:
        syllables = int(rng.integers(1, 4))
        word = "".join(
            CONSONANTS[int(rng.integers(len(CONSONANTS)))] + VOWELS[int(rng.integers(len(VOWELS)))]
            for _ in range(syllables)
        )
        if rng.random() < 0.3:
            word += CONSONANTS[int(rng.integers(len(CONSONANTS)))]
        if word not in words:
            words.add(word)
            out.append(word)
    return out


@dataclass(frozen=True)
class Text:
    prompt: str
    output: str


class ContentWriter:
    """Deterministic texts: one RNG stream per seed, consumed in request order."""

    def __init__(self, seed: int) -> None:
        self.words = np.array(vocabulary(seed), dtype=object)
        self.rng = np.random.default_rng([seed, STREAM_CONTENT, 1])

    def phrase(self, lo: int, hi: int) -> str:
        n = int(self.rng.integers(lo, hi + 1))
        return " ".join(self.words[self.rng.integers(0, len(self.words), size=n)])

    def ordinary(self) -> Text:
        return Text(self.phrase(18, 40), self.phrase(14, 24))

    def leaked_output(self, sources: list[Text]) -> str:
        """Garbled generation stitched from runs of the sources' prompts and outputs."""
        if not sources:  # only never-written pages were read: plain garbage
            return self.phrase(14, 24)
        parts = [self.phrase(3, 8)]
        for src in sources:
            use_prompt = self.rng.random() < 0.65 or len(src.output.split()) < RUN_WORDS
            text = src.prompt if use_prompt else src.output
            words = text.split()
            run = int(self.rng.integers(RUN_WORDS, min(len(words), RUN_WORDS + 8) + 1))
            first = int(self.rng.integers(0, len(words) - run + 1))
            parts.append(" ".join(words[first : first + run]))
            parts.append(self.phrase(2, 6))
        return " ".join(parts)


def has_run(output: str, source: str, run: int = RUN_WORDS) -> bool:
    """True when ``output`` contains ``run`` consecutive words of ``source``."""
    src = source.split()
    grams = {tuple(src[i : i + run]) for i in range(len(src) - run + 1)}
    out = output.split()
    return any(tuple(out[i : i + run]) in grams for i in range(len(out) - run + 1))
