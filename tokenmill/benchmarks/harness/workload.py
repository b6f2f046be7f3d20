"""The words benchmark prompts are made of: pronounceable nonsense, so that prompts of a chosen length need no
data set and no tokenizer, and a seed gives the same prompts on every machine."""
from __future__ import annotations

import random


def word_list(rng: random.Random, size: int = 4096) -> list[str]:
    onsets = ["b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
              "st", "tr", "pl", "gr", "ch", "sh", "th"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "ea"]
    words: set[str] = set()
    while len(words) < size:
        words.add("".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(rng.randint(1, 3))))
    return sorted(words)
