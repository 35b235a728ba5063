"""The declared floors are the versions CI installs together: pyproject.toml and .ci/floors.txt agree."""

import re
from pathlib import Path

import pytest
from packaging.version import Version

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parents[2]


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / ".ci" / "floors.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower()] = Version(version)
    return pins


def test_every_core_floor_is_the_version_ci_installs():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + project["optional-dependencies"]["plot"]
    pins = _pins()
    for req in declared:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", req)
        assert m, f"{req!r}: a core dependency is declared as 'name>=floor' (a floor CI tests)"
        name, floor = m.group(1).lower(), Version(m.group(2))
        assert name in pins, f"{name} has no pin in .ci/floors.txt: its floor {floor} is untested"
        assert pins[name] == floor, f"{name}: pyproject says >={floor}, CI's floors environment installs {pins[name]}"
