"""Generate presets/samples/chat-sample: a few hundred multi-turn conversations zfctl may ship.

Every conversation is made here from a seeded RNG and word lists written for this script (no
copied data set), in the OpenAI ``messages`` layout (``data.template: chat``). Each one has two or
three exchanges in which the later questions refer back to the earlier answers ("and if you double
it?"), so a model has to read the conversation to answer them; about a third open with a system
turn. The tasks are small and checkable: arithmetic chains, counting and sorting a word list, unit
conversion, spelling, and the facts of a fictional catalogue of planets invented below.

Deterministic: the same seed writes the same bytes (no set/hash ordering, fixed JSON layout).
The validation split holds conversations whose opening question never occurs in train.

    python scripts/gen_chat_sample.py [--out presets/samples/chat-sample] [--seed 4321]
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

N_TRAIN, N_VALIDATION, SEED = 400, 40, 4321
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "presets" / "samples" / "chat-sample"

WORDS = [
    "apple", "river", "stone", "cloud", "garden", "window", "candle", "forest", "bridge", "planet",
    "mirror", "pencil", "rocket", "silver", "orange", "marble", "island", "tunnel", "castle", "dragon",
    "button", "ladder", "basket", "jacket", "pocket", "lemon", "melon", "tiger", "zebra", "rabbit",
    "turtle", "falcon", "copper", "bottle", "kettle", "harbor", "meadow", "valley", "canyon", "desert",
    "lantern", "compass", "anchor", "saddle", "wagon", "engine", "signal", "puzzle", "riddle", "violin",
]
SYSTEMS = [
    "You are a concise assistant. Answer in one short sentence.",
    "You are a patient tutor. Show the result plainly.",
    "Keep every answer short and exact.",
]
SYLLABLES = ["ka", "lo", "mi", "ra", "ven", "tor", "sul", "bri", "dan", "eth", "fel", "gor", "hal", "jun"]
COLORS = ["red", "blue", "green", "amber", "violet", "grey", "white", "teal"]
ITEMS = ["lamps", "kettles", "compasses", "radios", "clocks", "lanterns"]

Turn = dict[str, str]


def make_catalogue(rng: random.Random, n: int = 20) -> list[dict]:
    """Invent n fictional planets with a capital, a moon count, a colour and a product."""
    names: list[str] = []
    while len(names) < n:  # unique names: every question has one answer
        name = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()
        if name not in names:
            names.append(name)
    capitals: list[str] = []
    while len(capitals) < n:
        city = ("".join(rng.choice(SYLLABLES) for _ in range(2)) + "a").capitalize()
        if city not in capitals and city not in names:
            capitals.append(city)
    return [{"planet": p, "capital": c, "moons": rng.randint(0, 9), "color": rng.choice(COLORS),
             "item": rng.choice(ITEMS), "price": rng.randint(3, 99)} for p, c in zip(names, capitals)]


def user(text: str) -> Turn:
    return {"role": "user", "content": text}


def assistant(text: str) -> Turn:
    return {"role": "assistant", "content": text}


def c_arithmetic(r: random.Random, _: list[dict]) -> list[Turn]:
    a, b = r.randint(2, 60), r.randint(2, 60)
    s = a + b
    turns = [user(f"What is {a} + {b}?"), assistant(f"{a} + {b} = {s}.")]
    if r.random() < 0.5:
        turns += [user("And if you double it?"), assistant(f"Doubled, {s} is {2 * s}.")]
        s *= 2
    else:
        c = r.randint(1, s - 1)
        turns += [user(f"Now subtract {c}."), assistant(f"{s} - {c} = {s - c}.")]
        s -= c
    turns += [user("Is that even or odd?"), assistant(f"{s} is {'even' if s % 2 == 0 else 'odd'}.")]
    return turns


def c_words(r: random.Random, _: list[dict]) -> list[Turn]:
    words = r.sample(WORDS, r.randint(3, 5))
    turns = [user(f"Here are some words: {', '.join(words)}. How many are there?"),
             assistant(f"There are {len(words)} words.")]
    turns += [user("Sort them alphabetically."), assistant(", ".join(sorted(words)) + ".")]
    if r.random() < 0.5:
        turns += [user("Spell the first one you listed backwards."), assistant(f"{min(words)[::-1]}.")]
    return turns


def c_planet(r: random.Random, catalogue: list[dict]) -> list[Turn]:
    p = r.choice(catalogue)
    ask = r.choice(["Tell me about the planet {}.", "What do you know about {}?", "Describe the planet {}."])
    turns = [user(ask.format(p["planet"])),
             assistant(f"{p['planet']} has {p['moons']} moons, and its capital is {p['capital']}.")]
    follow = [
        (user("What colour is it?"), assistant(f"{p['planet']} is {p['color']}.")),
        (user("What does it sell?"), assistant(f"{p['planet']} sells {p['item']} for {p['price']} coins each.")),
        (user("How many moons again?"), assistant(f"{p['moons']}.")),
    ]
    for q, a in r.sample(follow, r.randint(1, 2)):
        turns += [q, a]
    return turns


UNITS = [("hours", "minutes", 60, "seconds", 60), ("days", "hours", 24, "minutes", 60),
         ("kilometres", "metres", 1000, "centimetres", 100)]


def c_units(r: random.Random, _: list[dict]) -> list[Turn]:
    big, mid, k1, small, k2 = r.choice(UNITS)
    n = r.randint(2, 40)
    turns = [user(f"How many {mid} are in {n} {big}?"), assistant(f"{n} {big} are {k1 * n} {mid}.")]
    turns += [user(f"And how many {small} is that?"), assistant(f"{k1 * n} {mid} are {k1 * k2 * n} {small}.")]
    return turns


def c_spelling(r: random.Random, _: list[dict]) -> list[Turn]:
    w = r.choice(WORDS)
    ask = r.choice(["How many letters does the word {} have?", "Count the letters in {}."])
    turns = [user(ask.format(w)), assistant(f"{w} has {len(w)} letters.")]
    turns += [user("Write it in capitals."), assistant(f"{w.upper()}.")]
    if r.random() < 0.5:
        turns += [user("And backwards?"), assistant(f"{w[::-1]}.")]
    return turns


KINDS: list[Callable[[random.Random, list[dict]], list[Turn]]] = [
    c_arithmetic, c_words, c_planet, c_units, c_spelling,
]


def conversations(seed: int) -> tuple[list[dict], list[dict]]:
    """(train, validation) records; no opening question of validation occurs in train."""
    rng = random.Random(seed)
    catalogue = make_catalogue(rng)
    seen: dict[str, dict] = {}
    while len(seen) < N_TRAIN + N_VALIDATION:
        turns = rng.choice(KINDS)(rng, catalogue)
        if rng.random() < 1 / 3:
            turns = [{"role": "system", "content": rng.choice(SYSTEMS)}, *turns]
        opening = next(t["content"] for t in turns if t["role"] == "user")
        seen.setdefault(opening, {"messages": turns})  # an opening already drawn is skipped
    records = list(seen.values())
    rng.shuffle(records)
    return records[:N_TRAIN], records[N_TRAIN:]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args(argv)
    train, validation = conversations(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", train), ("validation.jsonl", validation)):
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        (args.out / name).write_text(text, encoding="utf-8")
    print(f"wrote {len(train)} train and {len(validation)} validation conversations to {args.out}")


if __name__ == "__main__":
    main()
