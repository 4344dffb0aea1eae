"""What pyproject.toml lets pip install: the requirement itself, read as pip reads it (``packaging``)."""
from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
#: Compromised Lightning releases (advisory GHSA-w37p-236h-pfx3, yanked from PyPI).
COMPROMISED_LIGHTNING = ("2.6.2", "2.6.3")


def requirement(name: str) -> Requirement:
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (found,) = [r for r in map(Requirement, dependencies) if r.name == name]
    return found


def test_lightning_requirement_excludes_the_compromised_releases_and_admits_the_installed_one():
    lightning = requirement("lightning")
    for bad in COMPROMISED_LIGHTNING:
        assert not lightning.specifier.contains(bad, prereleases=True), f"{lightning} admits lightning {bad}"
    assert lightning.specifier.contains("2.6.1") and lightning.specifier.contains("2.6.4")  # the neighbours stay
    assert lightning.specifier.contains(version("lightning")), f"installed lightning {version('lightning')} not in {lightning}"
