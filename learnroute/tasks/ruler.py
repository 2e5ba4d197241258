"""RULER-style synthetic long-context tasks (Hsieh et al. 2024, arXiv 2404.06654), offline.

Every generator builds a sample whose context fills a target length in the model's own
tokens, from a seeded ``random.Random``: the same (task, split, seed, index) gives
byte-identical samples. Prompts follow RULER's templates (instruction and haystack in the
context, the question and answer prefix after it, so query-agnostic compression never
sees the question). Prose comes from ``pydoc_data.topics`` (ships with Python).
"""

from __future__ import annotations

import hashlib
import random
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
SPLITS = ("calibration", "eval")


@dataclass
class Sample:
    """One task instance. ``answers`` are the references; ``metric`` names how they count."""

    id: str
    task: str
    split: str
    context: str
    question: str
    answer_prefix: str
    answers: list[str]
    metric: str = "string_match_all"
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _rng(task: str, split: str, seed: int, index: int) -> random.Random:
    """A stream per (task, split, seed, index); splits hash apart, so they never share draws."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    digest = hashlib.sha256(f"learnroute/{task}/{split}/{seed}/{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


_PROSE: list[str] | None = None


def prose_sentences() -> list[str]:
    """English sentences from Python's bundled documentation topics (deterministic order)."""
    global _PROSE
    if _PROSE is None:
        from pydoc_data.topics import topics

        text = " ".join(topics[k] for k in sorted(topics))
        text = re.sub(r"\s+", " ", text)
        sents = re.split(r"(?<=[.!?])\s+", text)
        _PROSE = [s for s in sents if 40 <= len(s) <= 300 and s[0].isupper() and s.isascii()]
    return _PROSE


def count_tokens(tokenizer, text: str) -> int:
    """Tokens of ``text`` in the model's tokenizer, without special tokens."""
    return len(tokenizer.encode(text, add_special_tokens=False))


def _fit(build: Callable[[int], str], tokenizer, n_tokens: int) -> str:
    """``build(k)`` for the largest k whose text stays within ``n_tokens`` tokens (k >= 1)."""
    lo, hi = 1, 2
    while count_tokens(tokenizer, build(hi)) <= n_tokens and hi < 1 << 20:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count_tokens(tokenizer, build(mid)) <= n_tokens:
            lo = mid
        else:
            hi = mid
    return build(lo)


def _insert(units: list[str], needles: list[str], depths: list[float]) -> list[str]:
    """Put each needle at its relative depth among the haystack units."""
    out = list(units)
    for needle, depth in sorted(zip(needles, depths), key=lambda p: -p[1]):
        out.insert(int(round(depth * len(units))), needle)
    return out


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _key(rng: random.Random) -> str:
    words = ("amber", "brave", "calm", "dusty", "eager", "fancy", "gentle", "hollow", "icy", "jolly", "keen",
             "lucky", "misty", "noble", "odd", "proud", "quiet", "rapid", "silent", "tidy")
    nouns = ("river", "moon", "falcon", "forest", "harbor", "canyon", "meadow", "lantern", "glacier", "orchard",
             "comet", "willow", "badger", "summit", "thimble", "pebble", "anchor", "violin", "saddle", "tulip")
    return f"{rng.choice(words)}-{rng.choice(nouns)}"


def _distinct(rng: random.Random, make: Callable[[random.Random], str], n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        v = make(rng)
        if v not in out:
            out.append(v)
    return out


def _haystack_units(rng: random.Random, kind: str, k: int) -> list[str]:
    if kind == "noise":
        return [NOISE] * k
    prose = prose_sentences()
    start = rng.randrange(len(prose))
    return [prose[(start + i) % len(prose)] for i in range(k)]


def _niah(
    tokenizer, n_tokens: int, rng: random.Random, *, haystack: str, value: str, n_keys: int = 1,
    n_values: int = 1, n_queries: int = 1,
) -> tuple[str, str, str, list[str], dict]:
    """The needle-in-a-haystack family: returns context, question, prefix, answers, meta."""
    kind = "uuids" if value == "uuid" else "numbers"
    make = _uuid if value == "uuid" else _number
    keys = _distinct(rng, _key, n_keys)
    queried = keys[:n_queries]
    values = {k: _distinct(rng, make, n_values if k == keys[0] else 1) for k in keys}
    needles = [NEEDLE.format(kind=kind, key=k, value=v) for k in keys for v in values[k]]
    depths = [rng.random() for _ in needles]
    hay_seed = rng.random()
    intro = (
        f"Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
        f"I will quiz you about the {kind} afterwards.\n"
    )

    def build(k: int) -> str:
        units = _haystack_units(random.Random(hay_seed), haystack, k)
        return intro + " ".join(_insert(units, needles, depths))

    context = _fit(build, tokenizer, n_tokens)
    who = ", ".join(queried[:-1]) + f", and {queried[-1]}" if len(queried) > 1 else queried[0]
    question = f"\nWhat are all the special magic {kind} for {who} mentioned in the provided text?"
    prefix = f"The special magic {kind} for {who} mentioned in the provided text are"
    answers = [v for k in queried for v in values[k]]
    return context, question, prefix, answers, {"depths": depths, "keys": keys}


def niah_single_1(tokenizer, n_tokens, rng):
    """Noise haystack, one 7-digit number."""
    return _niah(tokenizer, n_tokens, rng, haystack="noise", value="number")


def niah_single_2(tokenizer, n_tokens, rng):
    """Prose haystack, one 7-digit number."""
    return _niah(tokenizer, n_tokens, rng, haystack="prose", value="number")


def niah_single_3(tokenizer, n_tokens, rng):
    """Prose haystack, one UUID."""
    return _niah(tokenizer, n_tokens, rng, haystack="prose", value="uuid")


def niah_multikey(tokenizer, n_tokens, rng):
    """Prose haystack, the needle plus 3 distractor needles with other keys."""
    return _niah(tokenizer, n_tokens, rng, haystack="prose", value="number", n_keys=4)


def niah_multivalue(tokenizer, n_tokens, rng):
    """Noise haystack, 4 values for the one key asked; all must be found."""
    return _niah(tokenizer, n_tokens, rng, haystack="noise", value="number", n_values=4)


def niah_multiquery(tokenizer, n_tokens, rng):
    """Noise haystack, 4 keys, all asked at once."""
    return _niah(tokenizer, n_tokens, rng, haystack="noise", value="number", n_keys=4, n_queries=4)


def _var_name(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(5))


def variable_tracking(tokenizer, n_tokens, rng):
    """One chain ``VAR A = 12345``, ``VAR B = VAR A`` … (5 names) in noise; name them all."""
    names = _distinct(rng, _var_name, 5)
    value = str(rng.randint(10_000, 99_999))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 5)]
    depths = sorted(rng.random() for _ in chain)
    intro = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"

    def build(k: int) -> str:
        return intro + " ".join(_insert([NOISE] * k, chain, depths))

    context = _fit(build, tokenizer, n_tokens)
    question = f"\nQuestion: Find all variables that are assigned the value {value} in the text above."
    prefix = (
        f"Answer: According to the chain(s) of variable assignment in the text above, 5 variables are "
        f"assigned the value {value}, they are:"
    )
    return context, question, prefix, names, {"value": value}


_WORDS: list[str] | None = None


def _vocabulary() -> list[str]:
    """Plain lowercase words from the bundled prose (deterministic)."""
    global _WORDS
    if _WORDS is None:
        seen: dict[str, None] = {}
        for s in prose_sentences():
            # Whole words only: without boundaries "membership" would yield "embership".
            for w in re.findall(r"\b[a-z]{4,10}\b", s):
                seen.setdefault(w, None)
        _WORDS = sorted(seen)
    return _WORDS


def common_words(tokenizer, n_tokens, rng):
    """A numbered word list: 10 common words, the rest 3 times each; name the 10 common ones.

    As in RULER, common words appear 30 times in long lists; short lists scale that down
    (never below 4, so they always outnumber the rare ones).
    """
    vocab = _vocabulary()
    words = rng.sample(vocab, min(len(vocab), 10 + 2000))
    common, rare = words[:10], words[10:]
    order_seed = rng.random()
    intro = (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.\n"
    )

    def build(k: int) -> str:
        # k rare words (3 times each) plus the 10 common ones (4..30 times each), shuffled
        items = common * max(4, min(30, 3 + k // 25)) + rare[: min(k, len(rare))] * 3
        random.Random(order_seed).shuffle(items)
        return intro + " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))

    context = _fit(build, tokenizer, n_tokens)
    question = "\nQuestion: What are the 10 most common words in the above list?"
    prefix = "Answer: The top 10 words that appear most often in the list are:"
    return context, question, prefix, common, {}


def frequent_words(tokenizer, n_tokens, rng):
    """Coded text with Zipf-distributed made-up words; name the three most frequent."""
    coded = _distinct(rng, lambda r: "".join(r.choice(string.ascii_lowercase) for _ in range(6)), 200)
    weights = [1.0 / (i + 1) ** 1.2 for i in range(len(coded))]
    draw_seed = rng.random()
    intro = (
        "Read the following coded text and track the frequency of each coded word. Find the three most "
        "frequently appeared coded words. "
    )

    def build(k: int) -> str:
        r = random.Random(draw_seed)
        return intro + " ".join(r.choices(coded, weights=weights, k=k)) + " ...."

    context = _fit(build, tokenizer, n_tokens)
    counts: dict[str, int] = {}
    for w in context[len(intro):].split():
        if w in coded:
            counts[w] = counts.get(w, 0) + 1
    top = sorted(counts, key=lambda w: (-counts[w], coded.index(w)))[:3]
    question = (
        "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
        "What are the three most frequently appeared words in the above coded text?"
    )
    prefix = "Answer: According to the coded text above, the three most frequently appeared words are:"
    return context, question, prefix, top, {}


_PEOPLE = ("Alice", "Bruno", "Chen", "Dara", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jun", "Kofi", "Lena",
           "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wen", "Yara")
_TOWNS = ("Brindle", "Caskwood", "Dunmore", "Elmstead", "Farrow", "Glenholt", "Harlow", "Ivybridge", "Kestrel",
          "Larkspur", "Marlow", "Northgate", "Oakridge", "Pendle", "Quarry", "Redfern", "Stonebury", "Thornby")
_COUNTRIES = ("Norway", "Peru", "Kenya", "Japan", "Chile", "Greece", "Canada", "Vietnam", "Morocco", "Finland",
              "Portugal", "Ghana", "Nepal", "Uruguay", "Iceland", "Mongolia")


def multihop_qa(tokenizer, n_tokens, rng):
    """Two-hop facts in prose ("X lives in Y." … "Y is a town in Z."): where does X live?

    Stands in for RULER's QA tasks (SQuAD/HotpotQA cannot be downloaded here); 5 people and
    their towns as distractors. Metric: string_match_part.
    """
    people = rng.sample(_PEOPLE, 5)
    towns = rng.sample(_TOWNS, 5)
    countries = rng.sample(_COUNTRIES, 5)
    facts = [f"{p} lives in {t}." for p, t in zip(people, towns)]
    facts += [f"{t} is a town in {c}." for t, c in zip(towns, countries)]
    depths = [rng.random() for _ in facts]
    hay_seed = rng.random()
    intro = "Answer the question based on the facts hidden in the following text.\n"

    def build(k: int) -> str:
        units = _haystack_units(random.Random(hay_seed), "prose", k)
        return intro + " ".join(_insert(units, facts, depths))

    context = _fit(build, tokenizer, n_tokens)
    question = f"\nQuestion: In which country does {people[0]} live?"
    prefix = "Answer:"
    return context, question, prefix, [countries[0]], {"hops": [people[0], towns[0], countries[0]]}


TASKS: dict[str, Callable] = {
    "niah_single_1": niah_single_1,
    "niah_single_2": niah_single_2,
    "niah_single_3": niah_single_3,
    "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue,
    "niah_multiquery": niah_multiquery,
    "variable_tracking": variable_tracking,
    "common_words": common_words,
    "frequent_words": frequent_words,
    "multihop_qa": multihop_qa,
}
METRIC = {"multihop_qa": "string_match_part"}
# RULER's tokens_to_generate per task family (scripts/data/synthetic/constants.py).
MAX_NEW_TOKENS = {"variable_tracking": 30, "common_words": 120, "frequent_words": 50, "multihop_qa": 32}
NIAH_MAX_NEW_TOKENS = 128

# The families beyond needle retrieval (learnroute.tasks.families) add themselves to TASKS,
# METRIC and MAX_NEW_TOKENS when the package loads (it imports them): imports go one way.


def make_sample(task: str, tokenizer, n_tokens: int, split: str, seed: int, index: int) -> Sample:
    """Sample ``index`` of ``task`` in ``split`` at about ``n_tokens`` context tokens."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; valid: {', '.join(TASKS)}")
    rng = _rng(task, split, seed, index)
    context, question, prefix, answers, meta = TASKS[task](tokenizer, n_tokens, rng)
    return Sample(
        id=f"{task}/{split}/{n_tokens}/{seed}/{index}",
        task=task,
        split=split,
        context=context,
        question=question,
        answer_prefix=prefix,
        answers=answers,
        metric=METRIC.get(task, "string_match_all"),
        meta={
            "n_tokens_target": n_tokens,
            "max_new_tokens": MAX_NEW_TOKENS.get(task, NIAH_MAX_NEW_TOKENS),
            **meta,
        },
    )


def make_samples(task: str, tokenizer, n: int, n_tokens: int, split: str, seed: int = 0) -> list[Sample]:
    """``n`` samples of one task and split."""
    return [make_sample(task, tokenizer, n_tokens, split, seed, i) for i in range(n)]
