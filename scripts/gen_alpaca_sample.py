"""Generate presets/samples/alpaca-sample: ~2,000 instruction records zfctl may ship.

Every record is made here from a seeded RNG and word lists written for this script (no copied
data set). The tasks are small and checkable so that the ~5M-parameter `tiny-llama` can show a
falling loss within a CPU demo: arithmetic, comparisons, string reversal, sorting, date and case
conversion, counting, and questions about a fictional catalogue whose facts are invented below.

Deterministic: the same seed writes the same bytes (no set/hash ordering, fixed JSON layout).
The validation split holds records whose (instruction, input) pair never occurs in train.

    python scripts/gen_alpaca_sample.py [--out presets/samples/alpaca-sample] [--seed 1234]
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

N_TRAIN, N_VALIDATION, SEED = 1880, 120, 1234
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "presets" / "samples" / "alpaca-sample"

WORDS = [
    "apple", "river", "stone", "cloud", "garden", "window", "candle", "forest", "bridge", "planet",
    "mirror", "pencil", "rocket", "silver", "orange", "yellow", "purple", "marble", "island", "tunnel",
    "castle", "dragon", "button", "ladder", "basket", "jacket", "pocket", "lemon", "melon", "tiger",
    "zebra", "rabbit", "turtle", "falcon", "copper", "bottle", "kettle", "harbor", "meadow", "valley",
    "canyon", "desert", "summer", "winter", "autumn", "spring", "morning", "evening", "shadow", "thunder",
    "lantern", "compass", "anchor", "saddle", "wagon", "engine", "signal", "puzzle", "riddle", "violin",
    "guitar", "trumpet", "carpet", "pillow", "blanket", "cookie", "muffin", "pepper", "ginger", "walnut",
    "cherry", "banana", "coffee", "butter", "paper", "ticket", "letter", "number", "circle", "square",
    "rhythm", "breeze", "storm", "frost", "ember", "glacier", "pebble", "feather", "needle", "thread",
    "hammer", "shovel", "bucket", "helmet", "banner", "parrot", "badger", "otter", "beaver", "spider",
    "dolphin", "salmon", "oyster", "velvet", "cotton", "linen", "wooden", "golden", "quiet", "gentle",
    "brave", "clever", "simple", "honest", "modest", "narrow", "hollow", "bright", "silent", "rapid",
    "steady",
]

MONTHS = [
    "January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
    "November", "December",
]

# A fictional catalogue: names are built from syllables, facts are drawn once from the RNG, so
# the model can only learn them from this data.
SYLLABLES = [
    "ka", "lo", "mi", "ra", "ven", "tor", "sul", "bri", "dan", "eth", "fel", "gor", "hal", "ix", "jun",
    "kel", "mor", "nal", "or", "pex", "qua",
]
COLORS = ["red", "blue", "green", "amber", "violet", "grey", "white", "black", "teal", "crimson"]
ITEMS = ["lamp", "kettle", "drone", "compass", "radio", "telescope", "backpack", "clock"]


def make_catalogue(rng: random.Random, n: int = 24) -> list[dict]:
    """Invent n fictional planets, each with a capital, a moon count, a colour and a product."""
    names: list[str] = []
    while len(names) < n:  # unique names, so that every question has one answer
        name = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()
        if name not in names:
            names.append(name)
    capitals: list[str] = []
    while len(capitals) < n:
        city = ("".join(rng.choice(SYLLABLES) for _ in range(2)) + "a").capitalize()
        if city not in capitals and city not in names:
            capitals.append(city)
    return [
        {"planet": p, "capital": c, "moons": rng.randint(0, 9), "color": rng.choice(COLORS),
         "item": rng.choice(ITEMS), "price": rng.randint(3, 99)}
        for p, c in zip(names, capitals)
    ]


Record = tuple[str, str, str]  # (instruction, input, output)


def t_add(r: random.Random) -> Record:
    a, b = r.randint(0, 99), r.randint(0, 99)
    if r.random() < 0.5:
        return f"What is {a} + {b}?", "", str(a + b)
    return "Add the two numbers.", f"{a} and {b}", str(a + b)


def t_sub(r: random.Random) -> Record:
    a = r.randint(10, 99)
    b = r.randint(0, a)
    return f"What is {a} - {b}?", "", str(a - b)


def t_mul(r: random.Random) -> Record:
    a, b = r.randint(2, 12), r.randint(2, 12)
    return r.choice([f"What is {a} times {b}?", f"Multiply {a} by {b}."]), "", str(a * b)


def t_compare(r: random.Random) -> Record:
    a, b = r.sample(range(100), 2)
    if r.random() < 0.5:
        return "Which number is larger?", f"{a} or {b}", str(max(a, b))
    return "Which number is smaller?", f"{a} or {b}", str(min(a, b))


def t_parity(r: random.Random) -> Record:
    n = r.randint(0, 999)
    return "Is the number even or odd?", str(n), "even" if n % 2 == 0 else "odd"


def t_reverse_word(r: random.Random) -> Record:
    w = r.choice(WORDS)
    return "Reverse the letters of the word.", w, w[::-1]


def t_reverse_list(r: random.Random) -> Record:
    ws = r.sample(WORDS, r.randint(3, 5))
    return "Reverse the order of the words.", " ".join(ws), " ".join(reversed(ws))


def t_sort_numbers(r: random.Random) -> Record:
    xs = r.sample(range(100), r.randint(3, 6))
    if r.random() < 0.5:
        return "Sort the numbers from smallest to largest.", ", ".join(map(str, xs)), \
            ", ".join(map(str, sorted(xs)))
    return "Sort the numbers from largest to smallest.", ", ".join(map(str, xs)), \
        ", ".join(map(str, sorted(xs, reverse=True)))


def t_sort_words(r: random.Random) -> Record:
    ws = r.sample(WORDS, r.randint(3, 5))
    return "Sort the words alphabetically.", " ".join(ws), " ".join(sorted(ws))


def t_date(r: random.Random) -> Record:
    y, m, d = r.randint(1950, 2049), r.randint(1, 12), r.randint(1, 28)
    iso = f"{y:04d}-{m:02d}-{d:02d}"
    kind = r.randrange(3)
    if kind == 0:
        return "Convert the date to DD/MM/YYYY.", iso, f"{d:02d}/{m:02d}/{y:04d}"
    if kind == 1:
        return "Write the date in words.", iso, f"{MONTHS[m - 1]} {d}, {y}"
    return "Convert the date to YYYY-MM-DD.", f"{MONTHS[m - 1]} {d}, {y}", iso


def t_case(r: random.Random) -> Record:
    ws = r.sample(WORDS, r.randint(2, 4))
    kind = r.randrange(4)
    if kind == 0:
        return "Convert the text to uppercase.", " ".join(ws), " ".join(ws).upper()
    if kind == 1:
        return "Convert the text to title case.", " ".join(ws), " ".join(w.capitalize() for w in ws)
    if kind == 2:
        return "Convert snake_case to camelCase.", "_".join(ws), ws[0] + "".join(
            w.capitalize() for w in ws[1:])
    return "Convert the words to snake_case.", " ".join(w.capitalize() for w in ws), "_".join(ws)


def t_count(r: random.Random) -> Record:
    kind = r.randrange(3)
    if kind == 0:
        w = r.choice(WORDS)
        return "How many letters are in the word?", w, str(len(w))
    if kind == 1:
        ws = r.sample(WORDS, r.randint(2, 8))
        return "How many words are in the text?", " ".join(ws), str(len(ws))
    w = r.choice(WORDS)
    ch = r.choice(sorted(w))
    return f"How many times does the letter '{ch}' appear in the word?", w, str(w.count(ch))


def t_letters(r: random.Random) -> Record:
    w = r.choice(WORDS)
    if r.random() < 0.5:
        return "What is the first letter of the word?", w, w[0]
    return "What is the last letter of the word?", w, w[-1]


def fact_task(catalogue: list[dict]) -> Callable[[random.Random], Record]:
    """Questions about the invented catalogue, in several phrasings per fact."""

    def t_fact(r: random.Random) -> Record:
        e = r.choice(catalogue)
        p = e["planet"]
        return r.choice([
            (f"What is the capital of {p}?", "", f"The capital of {p} is {e['capital']}."),
            (f"Name the capital city of the planet {p}.", "", f"The capital of {p} is {e['capital']}."),
            ("Which planet has this capital?", e["capital"], f"{e['capital']} is the capital of {p}."),
            (f"How many moons does {p} have?", "", f"{p} has {e['moons']} moons."),
            ("Give the number of moons of the planet.", p, f"{p} has {e['moons']} moons."),
            (f"What colour is the sky on {p}?", "", f"The sky on {p} is {e['color']}."),
            (f"What does a {e['item']} cost on {p}?", "",
             f"A {e['item']} on {p} costs {e['price']} credits."),
            ("Describe the planet.", p, (f"{p} has {e['moons']} moons, a {e['color']} sky and its "
                                        f"capital is {e['capital']}.")),
        ])

    return t_fact


def generate(seed: int = SEED, n_train: int = N_TRAIN, n_val: int = N_VALIDATION) -> tuple[list, list]:
    """Return (train, validation) lists of {instruction, input, output} dicts."""
    rng = random.Random(seed)
    catalogue = make_catalogue(rng)
    tasks = [t_add, t_sub, t_mul, t_compare, t_parity, t_reverse_word, t_reverse_list,
             t_sort_numbers, t_sort_words, t_date, t_case, t_count, t_letters, fact_task(catalogue)]
    weights = [1] * (len(tasks) - 1) + [3]  # facts need repetition to be memorised
    records: dict[tuple[str, str], str] = {}  # dict keeps insertion order: deterministic
    while len(records) < n_train + n_val:
        instruction, inp, out = rng.choices(tasks, weights)[0](rng)
        records.setdefault((instruction, inp), out)
    rows = [{"instruction": i, "input": x, "output": o} for (i, x), o in records.items()]
    rng.shuffle(rows)
    return rows[n_val:], rows[:n_val]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """One JSON object per line, keys in a fixed order, '\\n' line ends."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args(argv)
    train, val = generate(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "train.jsonl", train)
    write_jsonl(args.out / "validation.jsonl", val)
    print(f"wrote {len(train)} train and {len(val)} validation records to {args.out}")


if __name__ == "__main__":
    main()
