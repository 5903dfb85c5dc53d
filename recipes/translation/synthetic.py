"""A synthetic English->German parallel corpus from a small grammar and lexicon (the project's own).

Offline demos and tests need parallel text that ships with the code. This module generates it,
deterministically from a seed: sentences such as

    Today, the small dog sees a red ball under the old tree.
    Heute sieht der kleine Hund einen roten Ball unter dem alten Baum.

Nothing is copied from a corpus: the lexicon below (30 nouns, 12 adjectives, 15 verbs, 6
prepositions) and the rules were written for this project. The German side is correct grammar
for what the generator produces, and learning it takes more than word-for-word lookup: gender and
case agreement of articles and adjectives (der/den/dem, kleine/kleinen/kleiner), plural forms and
dative plurals (Bäume -> Bäumen), ``in dem`` -> ``im``, verb-second order after a fronted adverb
(``Heute sieht der Hund``), and ``nicht`` at the end of a negated clause (English ``does not``).

::

    python -m recipes.translation.synthetic DIR          # train 20,000 / val 500 / test 500 pairs

writes ``DIR/{train,val,test}.{en,de}.gz``, the layout that ``data.read_local`` reads.
"""

from __future__ import annotations

import argparse
import gzip
import random
from pathlib import Path

# English singular, English plural, German singular, German plural, gender (m/f/n), animate
NOUNS = [
    ("dog", "dogs", "Hund", "Hunde", "m", True),
    ("cat", "cats", "Katze", "Katzen", "f", True),
    ("child", "children", "Kind", "Kinder", "n", True),
    ("man", "men", "Mann", "Männer", "m", True),
    ("woman", "women", "Frau", "Frauen", "f", True),
    ("girl", "girls", "Mädchen", "Mädchen", "n", True),
    ("teacher", "teachers", "Lehrer", "Lehrer", "m", True),
    ("bird", "birds", "Vogel", "Vögel", "m", True),
    ("horse", "horses", "Pferd", "Pferde", "n", True),
    ("friend", "friends", "Freund", "Freunde", "m", True),
    ("ball", "balls", "Ball", "Bälle", "m", False),
    ("book", "books", "Buch", "Bücher", "n", False),
    ("car", "cars", "Auto", "Autos", "n", False),
    ("table", "tables", "Tisch", "Tische", "m", False),
    ("tree", "trees", "Baum", "Bäume", "m", False),
    ("house", "houses", "Haus", "Häuser", "n", False),
    ("apple", "apples", "Apfel", "Äpfel", "m", False),
    ("flower", "flowers", "Blume", "Blumen", "f", False),
    ("chair", "chairs", "Stuhl", "Stühle", "m", False),
    ("bicycle", "bicycles", "Fahrrad", "Fahrräder", "n", False),
    ("garden", "gardens", "Garten", "Gärten", "m", False),
    ("street", "streets", "Straße", "Straßen", "f", False),
    ("window", "windows", "Fenster", "Fenster", "n", False),
    ("door", "doors", "Tür", "Türen", "f", False),
    ("bridge", "bridges", "Brücke", "Brücken", "f", False),
    ("river", "rivers", "Fluss", "Flüsse", "m", False),
    ("cup", "cups", "Tasse", "Tassen", "f", False),
    ("letter", "letters", "Brief", "Briefe", "m", False),
    ("picture", "pictures", "Bild", "Bilder", "n", False),
    ("boat", "boats", "Boot", "Boote", "n", False),
]
ADJECTIVES = [
    ("small", "klein"),
    ("big", "groß"),
    ("red", "rot"),
    ("blue", "blau"),
    ("old", "alt"),
    ("young", "jung"),
    ("green", "grün"),
    ("white", "weiß"),
    ("black", "schwarz"),
    ("new", "neu"),
    ("beautiful", "schön"),
    ("yellow", "gelb"),
]
# English 3rd person singular, plural; German 3rd person singular, plural
TRANSITIVE = [
    ("sees", "see", "sieht", "sehen"),
    ("finds", "find", "findet", "finden"),
    ("carries", "carry", "trägt", "tragen"),
    ("buys", "buy", "kauft", "kaufen"),
    ("paints", "paint", "malt", "malen"),
    ("likes", "like", "mag", "mögen"),
    ("washes", "wash", "wäscht", "waschen"),
    ("needs", "need", "braucht", "brauchen"),
    ("holds", "hold", "hält", "halten"),
    ("watches", "watch", "beobachtet", "beobachten"),
]
INTRANSITIVE = [
    ("sleeps", "sleep", "schläft", "schlafen"),
    ("sits", "sit", "sitzt", "sitzen"),
    ("waits", "wait", "wartet", "warten"),
    ("plays", "play", "spielt", "spielen"),
    ("stands", "stand", "steht", "stehen"),
]
PREPOSITIONS = [
    ("in", "in"),
    ("on", "auf"),
    ("under", "unter"),
    ("next to", "neben"),
    ("behind", "hinter"),
    ("in front of", "vor"),
]
ADVERBS = [
    ("Today", "Heute"),
    ("Now", "Jetzt"),
    ("In the morning", "Am Morgen"),
    ("In the evening", "Am Abend"),
]
DETERMINERS = ["the", "a", "my", "his", "her"]  # plural "a" is no article: "dogs" / "Hunde"
GENDER = {"m": 0, "f": 1, "n": 2, "pl": 3}
CASE = {"nom": 0, "acc": 1, "dat": 2}
# [case][gender] tables; gender order m, f, n, plural
DEFINITE = [["der", "die", "das", "die"], ["den", "die", "das", "die"], ["dem", "der", "dem", "den"]]
INDEFINITE = [["ein", "eine", "ein", ""], ["einen", "eine", "ein", ""], ["einem", "einer", "einem", ""]]
POSSESSIVE_ENDING = [["", "e", "", "e"], ["en", "e", "", "e"], ["em", "er", "em", "en"]]  # mein-, sein-, ihr-
WEAK = [["e", "e", "e", "en"], ["en", "e", "e", "en"], ["en", "en", "en", "en"]]  # after der/die/das
MIXED = [["er", "e", "es", "en"], ["en", "e", "es", "en"], ["en", "en", "en", "en"]]  # after ein/mein
STRONG_PLURAL = ["e", "e", "en"]  # no article, plural: nom, acc, dat
POSSESSIVE = {"my": "mein", "his": "sein", "her": "ihr"}


def noun_phrase(rng: random.Random, case: str, animate: bool | None) -> tuple[str, str, bool]:
    """(English, German, plural) of a determiner + optional adjective + noun in ``case``."""
    nouns = [n for n in NOUNS if animate is None or n[5] == animate]
    en_sg, en_pl, de_sg, de_pl, gender, _ = rng.choice(nouns)
    plural = rng.random() < 0.3
    determiner = rng.choice(DETERMINERS)
    adjective = rng.choice(ADJECTIVES) if rng.random() < 0.5 else None
    c, g = CASE[case], GENDER["pl" if plural else gender]
    noun = de_pl if plural else de_sg
    if plural and case == "dat" and not noun.endswith(("n", "s")):
        noun += "n"  # dative plural: den Bäumen
    if determiner == "the":
        article, table = DEFINITE[c][g], WEAK
    elif determiner == "a":
        article, table = INDEFINITE[c][g], MIXED
    else:
        article, table = POSSESSIVE[determiner] + POSSESSIVE_ENDING[c][g], MIXED
    ending = STRONG_PLURAL[c] if plural and determiner == "a" else table[c][g]
    german_adjective = ""
    if adjective is not None:
        stem = adjective[1]
        german_adjective = stem + ending
    english = [] if plural and determiner == "a" else [determiner]
    english += [adjective[0]] if adjective is not None else []
    english.append(en_pl if plural else en_sg)
    if english[0] == "a" and english[1][0] in "aeiou":
        english[0] = "an"
    german = [w for w in (article, german_adjective, noun) if w]
    return " ".join(english), " ".join(german), plural


def sentence(rng: random.Random) -> tuple[str, str]:
    """One (English, German) pair."""
    subject_en, subject_de, plural = noun_phrase(rng, "nom", animate=True)
    number = 1 if plural else 0
    transitive = rng.random() < 0.6
    verb = rng.choice(TRANSITIVE if transitive else INTRANSITIVE)
    object_en = object_de = ""
    if transitive:
        object_en, object_de, _ = noun_phrase(rng, "acc", animate=None)
    place_en = place_de = ""
    if not transitive or rng.random() < 0.4:
        preposition_en, preposition_de = rng.choice(PREPOSITIONS)
        noun_en, noun_de, _ = noun_phrase(rng, "dat", animate=False)
        place_en = f"{preposition_en} {noun_en}"
        if preposition_de == "in" and noun_de.startswith("dem "):
            place_de = "im " + noun_de[4:]  # in dem -> im
        else:
            place_de = f"{preposition_de} {noun_de}"
    negated = not place_en and rng.random() < 0.3
    adverb = rng.choice(ADVERBS) if rng.random() < 0.25 else None

    english_verb = f"{'do' if plural else 'does'} not {verb[1]}" if negated else verb[number]
    english = " ".join(w for w in (subject_en, english_verb, object_en, place_en) if w)
    german_verb = verb[2 + number]
    rest = " ".join(w for w in (object_de, place_de, "nicht" if negated else "") if w)
    if adverb is not None:
        english = f"{adverb[0]}, {english}"
        german = " ".join(w for w in (adverb[1], german_verb, subject_de, rest) if w)  # verb second
    else:
        german = " ".join(w for w in (subject_de, german_verb, rest) if w)
    return english[0].upper() + english[1:] + ".", german[0].upper() + german[1:] + "."


def corpus(size: int, seed: int, exclude: set[str] | None = None) -> list[tuple[str, str]]:
    """``size`` distinct pairs (none whose English is in ``exclude``), deterministic in ``seed``."""
    rng = random.Random(seed)
    seen = set(exclude or ())
    pairs: list[tuple[str, str]] = []
    while len(pairs) < size:
        english, german = sentence(rng)
        if english not in seen:
            seen.add(english)
            pairs.append((english, german))
    return pairs


def write(directory: str | Path, train: int = 20000, val: int = 500, test: int = 500, seed: int = 0) -> Path:
    """Write ``{train,val,test}.{en,de}.gz`` into ``directory`` (disjoint splits); return it."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    test_pairs = corpus(test, seed + 2)
    val_pairs = corpus(val, seed + 1, exclude={e for e, _ in test_pairs})
    train_pairs = corpus(train, seed, exclude={e for e, _ in test_pairs + val_pairs})
    for split, pairs in (("train", train_pairs), ("val", val_pairs), ("test", test_pairs)):
        for column, lang in enumerate(("en", "de")):
            # mtime=0: the same corpus gives the same bytes, so the tokenizer cache key is stable
            with (
                open(root / f"{split}.{lang}.gz", "wb") as raw,
                gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz,
            ):
                gz.write("".join(pair[column] + "\n" for pair in pairs).encode())
    return root


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("directory")
    parser.add_argument("--train", type=int, default=20000)
    parser.add_argument("--val", type=int, default=500)
    parser.add_argument("--test", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write(args.directory, args.train, args.val, args.test, args.seed))
