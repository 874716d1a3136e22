"""The documentation site's API reference names every public name of tandem's packages, and its
generated pages (CLI, environment) come from the code. Uses the site that `scripts/test.sh` built
(``site/``); builds one when it is missing."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["tandem", "tandem.optim", "tandem.kvstore", "tandem.models", "tandem.data"]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = ROOT / "site"
    if (built / "reference" / "api" / "index.html").exists():
        return built
    if shutil.which("mkdocs") is None and importlib.util.find_spec("mkdocs") is None:
        pytest.fail("mkdocs is not installed: scripts/env.sh installs the [docs] extra")
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(target)], cwd=ROOT,
                   check=True, capture_output=True, timeout=600)
    return target


def _anchors(page: Path) -> set[str]:
    return set(re.findall(r'id="([\w.]+)"', page.read_text()))


@pytest.mark.parametrize("package", PACKAGES)
def test_api_reference_lists_every_public_name(site: Path, package: str) -> None:
    anchors = _anchors(site / "reference" / "api" / "index.html")
    names = [n for n in importlib.import_module(package).__all__ if not n.startswith("__")]
    missing = [n for n in names if not any(a == f"{package}.{n}" or (a.startswith("tandem.") and a.endswith(f".{n}"))
                                           for a in anchors)]
    assert not missing, f"docs/reference/api.md does not document {package}: {missing}"


def test_generated_references_follow_the_code(site: Path) -> None:
    from tandem.env import all_knobs

    environment = (site / "reference" / "environment" / "index.html").read_text()
    assert all(knob.name in environment for knob in all_knobs())
    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert "--model" in cli and "tandem launch" in cli
