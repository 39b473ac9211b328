"""Generate presets/samples/sst2-sample: sentiment sentences (label 0 negative / 1 positive).

All text is written for this script: ~80 standalone sentences, plus ~60 sentence frames filled
from per-domain vocabulary (films, books, restaurants, albums, hotels, games, gadgets, plays).
The frames include negation ("not bad at all"), contrast ("X, but overall Y": the last clause
decides) and hedged praise, so the label is not readable off one keyword and a template is not
solved in a few steps. Nothing is copied from GLUE/SST-2.

Deterministic: the same seed writes the same bytes. Validation never repeats a train sentence.

    python scripts/gen_sst2_sample.py [--out presets/samples/sst2-sample] [--seed 7]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

N_TRAIN, N_VALIDATION, SEED = 900, 100, 7
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "presets" / "samples" / "sst2-sample"

# domain -> (names for the whole thing, aspects of it: all singular so "was" fits)
DOMAINS: dict[str, tuple[list[str], list[str]]] = {
    "film": (["the film", "this movie", "the sequel", "the documentary", "the thriller", "the comedy"],
             ["the plot", "the acting", "the soundtrack", "the dialogue", "the pacing", "the ending",
              "the camera work", "the lead performance", "the script"]),
    "book": (["the novel", "this book", "the memoir", "the short story collection", "the biography"],
             ["the prose", "the first chapter", "the main character", "the ending", "the translation",
              "the central mystery", "the world building"]),
    "restaurant": (["the restaurant", "this little bistro", "the new cafe", "the noodle bar", "the diner"],
                   ["the service", "the soup", "the dessert", "the wine list", "the bread", "the decor",
                    "the main course"]),
    "album": (["the album", "this record", "the debut EP", "the live recording"],
              ["the opening track", "the production", "the singing", "the guitar work", "the mix",
               "the closing song"]),
    "hotel": (["the hotel", "this guesthouse", "the resort", "the hostel"],
              ["the room", "the breakfast", "the location", "the front desk", "the bed", "the view"]),
    "game": (["the game", "this puzzle game", "the expansion", "the racing game"],
             ["the level design", "the story mode", "the control scheme", "the art style", "the music",
              "the multiplayer mode"]),
    "gadget": (["the phone", "this laptop", "the headset", "the camera", "the smart watch"],
               ["the battery", "the screen", "the keyboard", "the build quality", "the software",
                "the speaker"]),
    "play": (["the play", "this production", "the musical", "the opera"],
             ["the staging", "the second act", "the chorus", "the costume design", "the lighting",
              "the orchestra"]),
}

POS_ADJ = [
    "wonderful", "charming", "gripping", "delightful", "superb", "moving", "clever", "inventive", "warm",
    "polished", "thoughtful", "generous", "stunning", "vivid", "elegant", "heartfelt", "sharp",
    "satisfying", "lovely", "remarkable", "joyful", "fresh", "confident", "graceful",
]
NEG_ADJ = [
    "dull", "clumsy", "tedious", "bland", "sloppy", "lifeless", "shallow", "grating", "forgettable",
    "muddled", "stale", "hollow", "cheap", "awkward", "joyless", "flat", "irritating", "sluggish",
    "tiresome", "lazy", "confusing", "overlong", "disappointing", "cold",
]
INTENS = ["", "", "really ", "truly ", "genuinely ", "remarkably ", "quite ", "so "]
POS_VERB = ["loved", "adored", "enjoyed every minute of", "was won over by", "fell for",
            "could not stop thinking about"]
NEG_VERB = ["regretted", "gave up on", "was bored by", "could barely sit through", "was let down by",
            "lost patience with"]

# Frames: {s} = the thing, {a}/{b} = two different aspects, {p}/{q} = positive adjectives,
# {n}/{m} = negative adjectives, {ap}/{an} = "a"/"an" + {p}/{n}, {i} = intensifier, {pv}/{nv} =
# verbs. The label follows each frame.
FRAMES: list[tuple[str, int]] = [
    ("{s} is {i}{p}.", 1), ("{s} is {i}{n}.", 0),
    ("{a} was {p} and {b} was even better.", 1), ("{a} was {n} and {b} was even worse.", 0),
    ("I {pv} {s}.", 1), ("I {nv} {s}.", 0),
    ("{a} was {n}, but {s} as a whole is {p}.", 1), ("{a} was {p}, but {s} as a whole is {n}.", 0),
    ("{a} is {i}{p}, {b} is {q}, and I would go back tomorrow.", 1),
    ("{a} is {i}{n}, {b} is {m}, and I would not go back.", 0),
    ("{s} is not {n} at all.", 1), ("{s} is not {p} at all.", 0),
    ("{s} is anything but {n}.", 1), ("{s} is anything but {p}.", 0),
    ("nothing about {a} felt {n}.", 1), ("nothing about {a} felt {p}.", 0),
    ("who knew {s} could be this {p}?", 1), ("how did {s} end up this {n}?", 0),
    ("I expected little, yet {s} turned out {i}{p}.", 1), ("I expected a lot, yet {s} turned out {i}{n}.", 0),
    ("{a} alone makes {s} worth it.", 1), ("{a} alone ruins {s}.", 0),
    ("{ap} surprise: {a} is the best I have seen in years.", 1),
    ("{an} mess: {a} is the worst I have seen in years.", 0),
    ("even {a}, which I feared would be {n}, is {p}.", 1),
    ("even {a}, which I hoped would be {p}, is {n}.", 0),
    ("it is hard to imagine a more {p} evening than this.", 1),
    ("it is hard to imagine a more {n} evening than this.", 0),
    ("{s} never once feels {n}.", 1), ("{s} never once manages to be {p}.", 0),
    ("I recommend {s} to anyone who wants something {p}.", 1),
    ("I would not recommend {s} to anyone; it is {n} from start to finish.", 0),
    ("without being showy, {a} is {p} and {b} is {q}.", 1),
    ("despite the hype, {a} is {n} and {b} is {m}.", 0),
    ("{a} could have been {n}, but it is handled in a {p} way.", 1),
    ("{a} could have been {p}, but it is handled in a {n} way.", 0),
    ("my only complaint is that {s} had to end.", 1), ("my only wish was for {s} to end sooner.", 0),
    ("{s} is the kind of {p} thing that stays with you.", 1),
    ("{s} is the kind of {n} thing you forget by the next day.", 0),
    ("not perfect, but {a} is {p} enough to carry {s}.", 1),
    ("not terrible, but {a} is too {n} to save {s}.", 0),
    ("{i}{p} from the first minute to the last.", 1), ("{i}{n} from the first minute to the last.", 0),
    ("the people behind {s} clearly cared, and it shows in {a}.", 1),
    ("the people behind {s} clearly did not care, and it shows in {a}.", 0),
    ("I was ready to be bored, but {a} kept me hooked.", 1),
    ("I was ready to be thrilled, but {a} left me cold.", 0),
    ("five stars for {a}, and four for {b}.", 1), ("one star for {a}, and none for {b}.", 0),
    ("I keep telling friends how {p} {a} was.", 1), ("I keep warning friends how {n} {a} was.", 0),
]

# Standalone sentences: no slots, written one by one for variety of vocabulary and syntax.
STANDALONE: list[tuple[str, int]] = [(s, 1) for s in [
    "a quiet triumph that rewards patience.", "I laughed harder than I have in months.",
    "every small detail seems to have been chosen with care.", "it left me smiling all the way home.",
    "the best money I have spent this year.", "a warm, funny and surprisingly wise piece of work.",
    "I would happily go through the whole thing again.", "it earns every one of its big moments.",
    "rarely has something so modest felt so rich.", "an easy recommendation for a rainy weekend.",
    "the final scene had the whole room cheering.", "smart, brisk and never condescending.",
    "it found a way into my heart that I did not expect.", "a small gem that deserves a bigger audience.",
    "I came for one reason and stayed for ten more.", "pure pleasure, start to finish.",
    "it does exactly what it promises, and does it beautifully.", "the staff went out of their way for us.",
    "worth every minute of the long wait.", "a generous, big-hearted surprise.",
    "the kind of craft that makes it look easy.", "I have already told everyone I know about it.",
    "bold choices, and nearly all of them pay off.", "it made an ordinary evening feel special.",
    "honest, tender and often very funny.", "a real step up from everything that came before.",
    "the details reward a second and a third visit.", "it holds your attention without ever shouting.",
    "confident work from people who know what they are doing.", "I could not have asked for more.",
    "this is how it should be done.", "it is easy to love and hard to forget.",
    "the ideas are fresh and the execution is sure.", "I walked in skeptical and left a fan.",
    "a lovely surprise on every level.", "it lifted my mood for the rest of the week.",
    "a thrill from the opening line.", "simply one of the finest I have come across.",
    "nothing here is wasted.", "it gets better every time I return to it.",
]] + [(s, 0) for s in [
    "a long, flat slog with no reward at the end.", "I checked the time more often than I laughed.",
    "every good idea is buried under three bad ones.", "it left me annoyed all the way home.",
    "the worst money I have spent this year.", "a cold, noisy and strangely empty piece of work.",
    "I would not sit through it again for any price.", "it never earns any of its big moments.",
    "rarely has something so loud felt so empty.", "not even worth it on a free weekend.",
    "the final scene had half the room checking their phones.", "slow, smug and oddly pointless.",
    "it tries so hard to be liked that it becomes tiring.", "a mess that should have stayed a draft.",
    "I came for one reason and found none.", "pure frustration, start to finish.",
    "it promises a lot and delivers almost nothing.", "the staff made it clear we were a bother.",
    "not worth a fraction of the long wait.", "a stingy, half-hearted effort.",
    "the seams show everywhere you look.", "I have already told everyone I know to skip it.",
    "bold choices, and nearly all of them fall apart.", "it made a good evening feel like a chore.",
    "dishonest, preachy and rarely funny.", "a real step down from everything that came before.",
    "the flaws only grow on a second visit.", "it shouts for attention and still loses it.",
    "careless work from people who should know better.", "I expected far more than this.",
    "this is how it should not be done.", "it is hard to like and easy to forget.",
    "the ideas are stale and the execution is shaky.", "I walked in hopeful and left disappointed.",
    "an unpleasant surprise on every level.", "it soured my mood for the rest of the week.",
    "a bore from the opening line.", "simply one of the weakest I have come across.",
    "most of it feels like filler.", "it gets worse every time I return to it.",
]]


def article(word: str) -> str:
    """'a dull' / 'an awkward'."""
    return ("an " if word[0] in "aeiou" else "a ") + word


def fill(frame: str, r: random.Random) -> str:
    """Fill one frame with vocabulary from one randomly chosen domain."""
    subjects, aspects = DOMAINS[r.choice(sorted(DOMAINS))]
    a, b = r.sample(aspects, 2)
    p, q = r.sample(POS_ADJ, 2)
    n, m = r.sample(NEG_ADJ, 2)
    text = frame.format(s=r.choice(subjects), a=a, b=b, p=p, q=q, n=n, m=m, ap=article(p),
                        an=article(n), i=r.choice(INTENS), pv=r.choice(POS_VERB), nv=r.choice(NEG_VERB))
    return text[0].upper() + text[1:]


def generate(seed: int = SEED, n_train: int = N_TRAIN, n_val: int = N_VALIDATION) -> tuple[list, list]:
    """Return (train, validation) lists of {sentence, label} dicts, balanced by label."""
    rng = random.Random(seed)
    rows: dict[str, int] = {s[0].upper() + s[1:]: y for s, y in STANDALONE}
    per_label = (n_train + n_val) // 2
    counts = [sum(1 for y in rows.values() if y == k) for k in (0, 1)]
    for label in (0, 1):
        frames = [f for f, y in FRAMES if y == label]
        while counts[label] < per_label:
            text = fill(rng.choice(frames), rng)
            if text not in rows:
                rows[text] = label
                counts[label] += 1
    out = [{"sentence": s, "label": y} for s, y in rows.items()]
    rng.shuffle(out)
    return out[n_val:], out[:n_val]


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
