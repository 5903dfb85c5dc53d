"""``decentadam-train``: a recipe's training command, installed by ``pip install 'decentadam[recipes]'``.

::

    decentadam-train translation --preset multi30k-en-de data=DIR     # the recipe by name
    decentadam-train --preset multi30k-en-de data=DIR                 # or by one of its presets
    accelerate launch --multi_gpu --num_processes 4 $(which decentadam-train) --preset ...

The rest of the command line is the recipe's own (``python -m recipes.RECIPE.train --help``); the
``python -m`` forms work as before, from any directory once the package is installed.
"""

from __future__ import annotations

import importlib
import itertools
import sys

__all__ = ["RECIPES", "train"]

RECIPES = ("translation", "imagenet")


def _presets(recipe: str) -> list[str]:
    config = importlib.import_module(f"recipes.{recipe}.config")
    return list(config.PRESETS.names())


def _usage() -> str:
    lines = ["usage: decentadam-train [RECIPE] --preset NAME [options] [section.key=value ...]", ""]
    lines += [f"  {recipe}: presets {', '.join(_presets(recipe))}" for recipe in RECIPES]
    lines += [
        "",
        "RECIPE may be left out when the preset names it. A recipe's options: decentadam-train RECIPE --help",
    ]
    return "\n".join(lines)


def recipe_of(argv: list[str]) -> tuple[str, list[str]]:
    """(recipe, the recipe's arguments) of ``decentadam-train``'s arguments; ValueError saying what
    to pass when neither the first argument nor ``--preset`` names a recipe."""
    if argv and argv[0] in RECIPES:
        return argv[0], argv[1:]
    preset = next(
        (b for a, b in itertools.pairwise(argv) if a == "--preset"),
        next((a.split("=", 1)[1] for a in argv if a.startswith("--preset=")), None),
    )
    owners = [recipe for recipe in RECIPES if preset in _presets(recipe)]
    if len(owners) == 1:
        return owners[0], argv
    given = f"--preset {preset} is not a preset of a recipe" if preset else "no recipe and no --preset given"
    raise ValueError(
        f"{given}: name the recipe first ({' or '.join(RECIPES)}), e.g. decentadam-train "
        f"translation --preset FILE.toml; decentadam-train --help lists the presets"
    )


def train(argv: list[str] | None = None) -> None:
    """Run the recipe that ``argv`` (the command line) names, with the rest of it."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if args else sys.stderr)
        sys.exit(0 if args else 2)
    try:
        recipe, rest = recipe_of(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    importlib.import_module(f"recipes.{recipe}.train").run(rest)
