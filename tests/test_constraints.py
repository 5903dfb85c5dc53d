"""constraints.txt (issue 46, item 9): the exact versions behind the committed numbers, which `make`
and CI install; they must satisfy what pyproject.toml asks for, or a fresh install fails."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

requirements = pytest.importorskip("packaging.requirements", reason="reads the requirements with packaging")
from packaging.utils import canonicalize_name  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def pinned() -> dict[str, str]:
    lines = [line.strip() for line in (ROOT / "constraints.txt").read_text().splitlines()]
    pins = dict(line.split("==", 1) for line in lines if line and not line.startswith("#"))
    return {canonicalize_name(name): version for name, version in pins.items()}


def test_every_line_is_an_exact_pin_and_the_pins_satisfy_the_dev_and_recipes_extras() -> None:
    lines = [line for line in (ROOT / "constraints.txt").read_text().splitlines() if line and line[0] != "#"]
    assert all(line.count("==") == 1 and "+" not in line for line in lines), lines
    pins = pinned()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [
        *project["dependencies"],
        *extras["dev"],
        *extras["recipes"],
        *extras["hf"],
        *extras["accelerate"],
    ]
    environment = {"python_version": "3.11", "extra": ""}
    for text in wanted:
        requirement = requirements.Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate(environment):
            continue
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is a dependency but constraints.txt does not pin it"
        assert requirement.specifier.contains(pins[name], prereleases=True), (text, pins[name])
    assert pins["torch"] == "2.13.0"  # the Makefile's TORCH_SPEC
    assert "torch==2.13.0" in (ROOT / "Makefile").read_text()
    assert "-c constraints.txt" in (ROOT / "Makefile").read_text()
