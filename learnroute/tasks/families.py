"""Synthetic task families that are not needle retrieval in a noise or prose haystack.

Built like the RULER-style tasks in :mod:`learnroute.tasks.ruler` (same ``Sample``, the same
per-(task, split, seed, index) random stream, fitted to a target length in the model's
tokens with ``_fit``, an answer prefix, RULER's metrics) and registered in its ``TASKS``:

- ``kv_json``: a JSON object of UUID keys and UUID values; give the value of one key
  (the key-value retrieval task of "Lost in the Middle", Liu et al. 2023, arXiv 2307.03172).
- ``code_passkey``: generated Python source with several module constants; give the value
  of the named one.
- ``fact_pairs``: a fact sheet (one row per person: name, city, phone, job); give the phone
  of the person who lives in a named city (two facts of one row: the city, then the phone).
- ``icl_labels``: labelled examples (word -> made-up label, one label per semantic
  category, the mapping drawn per sample); give the label of a word seen in no example.

Each generator returns (context, question, answer prefix, answers, meta) like RULER's; the
context holds the instruction and the data, the question comes after it, so query-agnostic
compression never sees the question.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

from learnroute.tasks.ruler import _distinct, _fit, _uuid


def _depth_index(depth: float, k: int) -> int:
    """Where the queried unit goes among ``k`` filler units (0..k)."""
    return int(round(depth * k))


# ---------------------------------------------------------------- kv_json


def kv_json(tokenizer, n_tokens, rng):
    """A JSON object of UUID -> UUID pairs; give the value of the queried key (Lost in the Middle)."""
    key, value = _uuid(rng), _uuid(rng)
    depth = rng.random()
    pair_seed = rng.random()
    intro = "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n"

    def build(k: int) -> str:
        r = random.Random(pair_seed)
        pairs = [(_uuid(r), _uuid(r)) for _ in range(k)]
        pairs.insert(_depth_index(depth, k), (key, value))
        return intro + json.dumps(dict(pairs), indent=1)

    context = _fit(build, tokenizer, n_tokens)
    question = f'\n\nKey: "{key}"\nWhat is the value corresponding to this key in the JSON object above?'
    prefix = "Corresponding value:"
    return context, question, prefix, [value], {"depth": depth, "key": key}


# ---------------------------------------------------------------- code_passkey

_VERBS = ("load", "parse", "render", "update", "merge", "filter", "compute", "format", "fetch", "build", "check",
          "encode", "decode", "scale", "count", "split", "resolve", "collect", "convert", "validate")
_NOUNS = ("record", "buffer", "config", "header", "token", "matrix", "packet", "report", "session", "profile",
          "index", "queue", "schema", "window", "vector", "ledger", "batch", "cursor", "layout", "signal")
_ARGS = ("items", "value", "data", "count", "limit", "offset", "name", "size", "key", "path", "mode", "rows")
_CONST_A = ("AMBER", "BRAVE", "CALM", "DUSTY", "EAGER", "FANCY", "GENTLE", "HOLLOW", "ICY", "JOLLY", "KEEN",
            "LUCKY", "MISTY", "NOBLE", "PROUD", "QUIET", "RAPID", "SILENT", "TIDY", "VIVID")
_CONST_B = ("RIVER", "MOON", "FALCON", "FOREST", "HARBOR", "CANYON", "MEADOW", "LANTERN", "GLACIER", "ORCHARD",
            "COMET", "WILLOW", "BADGER", "SUMMIT", "PEBBLE", "ANCHOR", "VIOLIN", "SADDLE", "TULIP", "ISLAND")


def _function(r: random.Random) -> str:
    """One small generated Python function (no long digit strings: they belong to the constants)."""
    name = f"{r.choice(_VERBS)}_{r.choice(_NOUNS)}"
    a, b = r.sample(_ARGS, 2)
    body = r.choice(
        (
            f"    result = {a} + {b} * {r.randint(2, 9)}\n    if result > {r.randint(10, 99)}:\n"
            f"        return result - {r.randint(1, 9)}\n    return result\n",
            f"    out = []\n    for item in {a}:\n        if item != {b}:\n            out.append(item)\n"
            f"    return out[:{r.randint(2, 20)}]\n",
            f"    table = {{}}\n    for i, item in enumerate({a}):\n        table[item] = i * {r.randint(2, 9)}\n"
            f"    return table.get({b}, {r.randint(0, 9)})\n",
            f"    if not {a}:\n        raise ValueError(\"empty {a}\")\n    return str({a}).strip() + str({b})\n",
        )
    )
    doc = f'    """{name.split("_")[0].capitalize()} the {name.split("_")[1]} from {a} and {b}."""\n'
    return f"def {name}({a}, {b}):\n{doc}{body}"


def code_passkey(tokenizer, n_tokens, rng):
    """Generated Python source with 4 module constants (7-digit values); give the named one's value."""
    names = _distinct(rng, lambda r: f"{r.choice(_CONST_A)}_{r.choice(_CONST_B)}", 4)
    values = _distinct(rng, lambda r: str(r.randint(1_000_000, 9_999_999)), 4)
    depths = [rng.random() for _ in names]
    code_seed = rng.random()
    intro = "Below is the source code of a Python module. Read it carefully: I will ask you about it.\n\n"

    def build(k: int) -> str:
        r = random.Random(code_seed)
        units = ["import math\nimport os\n"] + [_function(r) for _ in range(k)]
        for name, value, depth in sorted(zip(names, values, depths), key=lambda p: -p[2]):
            units.insert(1 + _depth_index(depth, k), f"{name} = {value}\n")
        return intro + "\n\n".join(u.rstrip("\n") for u in units) + "\n"

    context = _fit(build, tokenizer, n_tokens)
    question = f"\nQuestion: What is the value of the constant {names[0]} in the Python code above?"
    prefix = f"Answer: In the code above, {names[0]} ="
    return context, question, prefix, [values[0]], {"depths": depths, "constants": dict(zip(names, values))}


# ---------------------------------------------------------------- fact_pairs

_FIRST = ("Alice", "Bruno", "Chen", "Dara", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jun", "Kofi", "Lena",
          "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wen", "Yara")
_LAST = ("Abbott", "Barros", "Castillo", "Dufresne", "Eriksen", "Fischer", "Gallo", "Haddad", "Ibsen", "Jovanovic",
         "Kowalski", "Lindqvist", "Moreau", "Novak", "Okafor", "Petrov", "Quint", "Rossi", "Sato", "Toivonen",
         "Ueda", "Varga", "Weber", "Zamora")
_TOWN_HEAD = ("Ash", "Brin", "Cald", "Dun", "Elm", "Fair", "Glen", "Hart", "Ivy", "Kings", "Lark", "Mar", "North",
              "Oak", "Pen", "Red", "Stone", "Thorn", "West", "Wolf", "Birch", "Cross", "Hazel", "Moss")
_TOWN_TAIL = ("ford", "wick", "dale", "more", "stead", "bury", "holt", "field", "haven", "ton", "mouth", "gate",
              "brook", "cliff", "ham", "ley", "worth", "combe")
_PEOPLE_POOL = [f"{f} {s}" for f in _FIRST for s in _LAST]
_TOWN_POOL = [h + t for h in _TOWN_HEAD for t in _TOWN_TAIL]  # 432 towns: sheets up to about 8k tokens
_JOBS = ("baker", "nurse", "pilot", "teacher", "plumber", "lawyer", "chemist", "farmer", "painter", "tailor",
         "dentist", "librarian", "carpenter", "engineer", "florist", "jeweler")


def fact_pairs(tokenizer, n_tokens, rng):
    """A fact sheet of people (name, city, phone, job); give the phone of the person living in a city."""
    depth = rng.random()
    sheet_seed = rng.random()
    intro = "Below is a fact sheet about some people: one line per person, with their city, phone and job.\n\n"

    def sheet(k: int) -> tuple[tuple[str, str, str, str], list[tuple[str, str, str, str]]]:
        """The asked row and the k + 1 rows of the sheet (names, cities and phones all distinct)."""
        r = random.Random(sheet_seed)
        people = r.sample(_PEOPLE_POOL, min(k + 1, len(_PEOPLE_POOL)))
        towns = r.sample(_TOWN_POOL, min(k + 1, len(_TOWN_POOL)))
        phones = _distinct(r, lambda q: f"{q.randint(200, 989)}-{q.randint(1000, 9999)}", len(towns))
        table = [(p, t, ph, r.choice(_JOBS)) for p, t, ph in zip(people, towns, phones)]
        target = table.pop(0)  # drawn with the others, so no other row shares its name, city or phone
        table.insert(_depth_index(depth, len(table)), target)
        return target, table

    def build(k: int) -> str:
        return intro + "\n".join(f"{p} lives in {t}. Phone: {ph}. Job: {j}." for p, t, ph, j in sheet(k)[1])

    context = _fit(build, tokenizer, n_tokens)
    (person, town, phone, job), _ = sheet(context.count("\n") - intro.count("\n"))
    question = f"\nQuestion: What is the phone number of the person who lives in {town}?"
    prefix = f"Answer: The person who lives in {town} has the phone number"
    return context, question, prefix, [phone], {"depth": depth, "row": [person, town, phone, job]}


# ---------------------------------------------------------------- icl_labels

_CATEGORIES = {
    "animal": ("tiger", "lion", "wolf", "zebra", "rabbit", "horse", "monkey", "giraffe", "elephant", "bear", "fox",
               "deer", "camel", "donkey", "squirrel", "leopard", "hippo", "kangaroo", "panda", "goat", "sheep",
               "cow", "otter", "beaver"),
    "fruit": ("apple", "banana", "cherry", "mango", "peach", "pear", "grape", "lemon", "orange", "plum", "melon",
              "kiwi", "apricot", "papaya", "lime", "coconut", "pineapple", "strawberry", "raspberry", "blueberry",
              "fig", "guava", "watermelon", "tangerine"),
    "vehicle": ("car", "bus", "truck", "bicycle", "train", "airplane", "boat", "motorcycle", "tractor", "van",
                "taxi", "scooter", "helicopter", "ship", "tram", "subway", "jeep", "canoe", "yacht", "ambulance",
                "limousine", "rocket", "sailboat", "minibus"),
    "color": ("red", "blue", "green", "yellow", "purple", "pink", "brown", "black", "white", "gray", "violet",
              "indigo", "crimson", "turquoise", "beige", "maroon", "navy", "teal", "scarlet", "magenta", "olive",
              "lavender", "gold", "silver"),
}
_LABELS = ("dax", "wug", "blick", "fep", "toma", "zorp", "kiki", "lorp", "miv", "snarf", "tupa", "gazz")


def icl_labels(tokenizer, n_tokens, rng):
    """Labelled examples (word -> made-up label, one per category); label a word no example shows."""
    cats = sorted(_CATEGORIES)
    labels = dict(zip(cats, rng.sample(_LABELS, len(cats))))
    cat = rng.choice(cats)
    query = rng.choice(_CATEGORIES[cat])
    pool = [(w, c) for c in cats for w in _CATEGORIES[c] if w != query]
    ex_seed = rng.random()
    intro = (
        "Each word below is given a label. Words of the same kind always get the same label. "
        "Learn the labels from the examples.\n\n"
    )

    def build(k: int) -> str:
        r = random.Random(ex_seed)
        # k examples: shuffled passes over the pool, so every category shows early and often
        examples: list[tuple[str, str]] = []
        while len(examples) < k:
            batch = list(pool)
            r.shuffle(batch)
            examples += batch
        return intro + "\n".join(f"Word: {w}\nLabel: {labels[c]}" for w, c in examples[:k])

    context = _fit(build, tokenizer, n_tokens)
    question = f"\n\nWord: {query}\nQuestion: Following the examples above, what is the label of the word {query}?"
    prefix = "Label:"
    return context, question, prefix, [labels[cat]], {"category": cat, "query": query, "labels": labels}


FAMILIES: dict[str, Callable] = {
    "kv_json": kv_json,
    "code_passkey": code_passkey,
    "fact_pairs": fact_pairs,
    "icl_labels": icl_labels,
}
FAMILY_METRIC: dict[str, str] = {}  # all string_match_all
FAMILY_MAX_NEW_TOKENS = {"kv_json": 64, "code_passkey": 16, "fact_pairs": 16, "icl_labels": 8}
