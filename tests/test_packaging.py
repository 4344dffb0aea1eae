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
#: Lightning releases whose ``load_from_checkpoint`` imports modules a checkpoint names (``_instantiator``),
#: bypassing ``weights_only`` (CVE-2026-58659, PYSEC-2026-3624, GHSA-qqmf-gpg7-g8gw); fixed in 2.6.6.
CODE_FROM_CHECKPOINT_LIGHTNING = ("2.5.2", "2.6.0", "2.6.1", "2.6.4", "2.6.5")


def requirement(name: str) -> Requirement:
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (found,) = [r for r in map(Requirement, dependencies) if r.name == name]
    return found


def test_lightning_requirement_admits_no_release_that_runs_code_from_a_checkpoint_nor_a_compromised_one():
    lightning = requirement("lightning")
    for bad in COMPROMISED_LIGHTNING + CODE_FROM_CHECKPOINT_LIGHTNING:
        assert not lightning.specifier.contains(bad, prereleases=True), f"{lightning} admits lightning {bad}"
    assert lightning.specifier.contains("2.6.6") and lightning.specifier.contains("2.6.9")  # the fixed ones stay
    assert not lightning.specifier.contains("2.7.0")  # beyond the tested range of tests/test_lightning_private.py
    assert lightning.specifier.contains(version("lightning")), f"installed lightning {version('lightning')} not in {lightning}"


def test_the_version_is_the_changelogs_newest_release_and_the_unreleased_section_stays_short():
    import re

    import lightning_async_pp

    changelog = (PYPROJECT.parent / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", changelog, re.M)
    assert releases, "CHANGELOG.md has no released version (`## [X.Y.Z] - YYYY-MM-DD`)"
    newest = releases[0][0]
    assert tomllib.loads(PYPROJECT.read_text())["project"]["version"] == newest == lightning_async_pp.__version__
    keys = [tuple(map(int, v.split("."))) for v, _ in releases]
    assert keys == sorted(keys, reverse=True) and [d for _, d in releases] == sorted((d for _, d in releases), reverse=True)
    unreleased = changelog[changelog.index("## [Unreleased]"):changelog.index(f"## [{newest}]")]
    assert len(unreleased.encode()) <= 25_000, "cut a release: the Unreleased section is past 25 KB (docs/contributing.md)"
