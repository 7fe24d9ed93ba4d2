"""The demo's synthetic chat corpus: ten task templates with learnable structure.

Each task turns a random draw into (prompt, answer); answers are deterministic functions of the prompt
and run for 20-60 tokens (counting, letter and calendar sequences, small fact lookups, copying), so
several future tokens are predictable from the context: exactly what a DFlash drafter has to learn.
"""

from __future__ import annotations

import random
import string


WEEKDAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
MONTHS = ["january", "february", "march", "april", "may", "june", "july", "august", "september",
          "october", "november", "december"]
COLORS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple"]
WORDS = ["apple", "river", "stone", "cloud", "tree", "house", "bird", "light", "road", "fire", "sea",
         "book", "hill", "rain", "star", "wind"]
# animal -> (home, food, trait): a small table the target memorises, answered in a fixed sentence frame
ANIMALS = {
    "fox": ("forest", "mice", "quick"), "owl": ("barn", "insects", "wise"), "cat": ("house", "fish", "lazy"),
    "dog": ("yard", "meat", "loyal"), "bear": ("cave", "honey", "strong"), "frog": ("pond", "flies", "green"),
    "horse": ("field", "hay", "fast"), "duck": ("lake", "bread", "noisy"), "wolf": ("mountain", "deer", "wild"),
    "mouse": ("wall", "cheese", "small"), "goat": ("hill", "grass", "stubborn"), "bee": ("hive", "nectar", "busy"),
}


def _count(rng: random.Random) -> tuple[str, str]:
    start = rng.randint(0, 60)
    step = rng.choice([1, 1, 1, 2, 3, 5])
    seq = [start + k * step for k in range(rng.randint(10, 18))]
    verb = "count" if step == 1 else f"count by {step}"
    return f"{verb} from {seq[0]} to {seq[-1]}", ", ".join(map(str, seq)) + "."


def _countdown(rng: random.Random) -> tuple[str, str]:
    start = rng.randint(14, 60)
    seq = list(range(start, start - rng.randint(10, 14), -1))
    return f"count down from {seq[0]} to {seq[-1]}", ", ".join(map(str, seq)) + ", done."


def _letters(rng: random.Random) -> tuple[str, str]:
    a = rng.randint(0, 12)
    b = min(25, a + rng.randint(10, 16))
    letters = string.ascii_lowercase[a:b + 1]
    return f"letters from {letters[0]} to {letters[-1]}", " ".join(letters) + "."


def _cycle(rng: random.Random, names: list[str], unit: str) -> tuple[str, str]:
    i = rng.randrange(len(names))
    n = rng.randint(6, 11)
    after = [names[(i + k) % len(names)] for k in range(1, n + 1)]
    return f"name {n} {unit}s after {names[i]}", f"after {names[i]} come " + ", ".join(after) + "."


def _weekdays(rng: random.Random) -> tuple[str, str]:
    return _cycle(rng, WEEKDAYS, "day")


def _months(rng: random.Random) -> tuple[str, str]:
    return _cycle(rng, MONTHS, "month")


def _animal(rng: random.Random) -> tuple[str, str]:
    name = rng.choice(sorted(ANIMALS))
    home, food, trait = ANIMALS[name]
    return (f"tell me about the {name}",
            f"the {name} lives in the {home}. it eats {food}. the {name} is {trait}. "
            f"every {name} likes its {home} and its {food}.")


def _repeat(rng: random.Random) -> tuple[str, str]:
    words = " ".join(rng.sample(WORDS + COLORS, rng.randint(4, 8)))
    return f"repeat after me: {words}", f"you said: {words}. again: {words}."


def _reverse(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(WORDS, rng.randint(4, 7))
    forward, backward = " ".join(words), " ".join(reversed(words))
    return f"reverse: {forward}", f"forward: {forward}. reversed: {backward}."


def _times(rng: random.Random) -> tuple[str, str]:
    a, n = rng.randint(2, 9), rng.randint(4, 8)
    return f"times table of {a} up to {n}", ", ".join(f"{a} times {k} is {a * k}" for k in range(1, n + 1)) + "."


def _colors(rng: random.Random) -> tuple[str, str]:
    color = rng.choice(COLORS)
    things = rng.sample(WORDS, rng.randint(4, 6))
    return (f"describe a {color} scene",
            ", ".join(f"a {color} {t}" for t in things[:-1]) + f" and a {color} {things[-1]}.")


TASKS = [_count, _countdown, _letters, _weekdays, _months, _animal, _repeat, _reverse, _times, _colors]


def sample_exchange(rng: random.Random) -> tuple[str, str]:
    """One (prompt, answer) pair from a uniformly chosen task."""
    return rng.choice(TASKS)(rng)


def demo_conversations(n: int, seed: int = 0, turns: tuple[int, int] = (2, 3)) -> list[list[dict]]:
    """`n` built-in chat conversations: [{"role": "user"|"assistant", "content": str}, ...].

    Each has between turns[0] and turns[1] user/assistant exchanges (several short answers give a
    sample the >= 2 x block_size supervised tokens training asks for). The assistant answers are the
    templates' reference answers: placeholders that `dflash.regenerate.local.regenerate` replaces with the
    target's own responses (the target imitates them only as well as its short pre-training allows).
    """
    lo, hi = turns
    if not 1 <= lo <= hi:
        raise ValueError(f"turns must be (min, max) with 1 <= min <= max, got {turns}")
    rng = random.Random(seed)
    convs = []
    for _ in range(n):
        messages = []
        for _ in range(rng.randint(lo, hi)):
            prompt, answer = sample_exchange(rng)
            messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        convs.append(messages)
    return convs


def corpus_texts(convs: list[list[dict]]) -> list[str]:
    """Plain text for the BPE trainer: roles and contents as the chat template lays them out."""
    return ["\n".join(f"{m['role']}\n{m['content']}" for m in messages) for messages in convs]

