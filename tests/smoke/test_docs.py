"""The documentation: the README and the pages under docs/ build as a site with no broken link,
anchor or missing page (`mkdocs build --strict`), every page is reachable from the README, the
site's home is the README, the module map names every module, and every test a page cites exists.
The settings tables on docs/configuration.md are checked by tests/daemon/test_settings.py and
tests/unit/test_connector_settings.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
# docs/dev/ is the development record (the benchmarks' lab notebook, the vLLM notes): in the site's
# nav, but neither required to be reachable from the README nor held to the page rules below.
PAGES = sorted(page for page in DOCS.rglob("*.md") if "dev" not in page.relative_to(DOCS).parts)
MAX_README_LINES = 250

_LOCAL_LINK = re.compile(r"\]\(([^)\s#]+\.md)(?:#[^)\s]*)?\)")
_CITED_TEST = re.compile(r"`(tests/[\w/]+\.py)::(test_\w+)`")
# An issue number means nothing to a reader, who has no tracker to open.
_ISSUE_NUMBER = re.compile(r"\bissues? \d+", re.IGNORECASE)


def site_home(readme: str) -> str:
    """docs/index.md as it must read: the README, its links made relative to docs/."""
    return readme.replace("](docs/", "](")


def _linked_pages(page: Path) -> set[Path]:
    return {(page.parent / target).resolve() for target in _LOCAL_LINK.findall(page.read_text())}


def test_the_site_builds_with_no_broken_link_or_missing_page(tmp_path: Path) -> None:
    site = tmp_path / "site"
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                           cwd=ROOT, capture_output=True, text=True, timeout=240,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stdout + built.stderr
    for page in PAGES:
        relative = page.relative_to(DOCS).with_suffix("")
        html = site / "index.html" if relative.name == "index" else site / relative / "index.html"
        assert html.is_file(), f"{page} was not built"


def test_every_page_is_reachable_from_the_readme() -> None:
    seen: set[Path] = set()
    todo = [README.resolve()]
    while todo:
        page = todo.pop()
        if page in seen or not page.is_file():
            continue
        seen.add(page)
        todo += [linked for linked in _linked_pages(page) if linked.is_relative_to(DOCS)]
    # docs/index.md is the README itself, as the site's home.
    unreachable = [str(page.relative_to(ROOT)) for page in PAGES
                   if page.resolve() not in seen and page != DOCS / "index.md"]
    assert not unreachable, f"pages no link from README.md leads to: {unreachable}"


def test_the_readme_is_short_draws_the_processes_and_names_the_test_command() -> None:
    readme = README.read_text()
    assert len(readme.splitlines()) < MAX_README_LINES
    assert "```mermaid" in readme
    assert "scripts/test.sh" in readme  # .ci/run runs the README's test command


def test_the_sites_home_is_the_readme() -> None:
    assert (DOCS / "index.md").read_text() == site_home(README.read_text()), \
        "regenerate docs/index.md: tests.smoke.test_docs.site_home(README.md's text)"


def test_the_module_map_names_every_module() -> None:
    architecture = (DOCS / "architecture.md").read_text()
    module_map = architecture[architecture.index("## Module map"):]
    modules = [module for package in ("lmcache_mp", "vllm_adapter")
               for module in sorted((ROOT / package).rglob("*.py")) if module.name != "__init__.py"]
    missing = [str(module.relative_to(ROOT)) for module in modules
               if not re.search(rf"(?<!\w){re.escape(module.name)}", module_map)]
    assert not missing, f"modules docs/architecture.md's module map does not name: {missing}"


def test_every_test_a_page_cites_exists() -> None:
    cited = [(page, path, name) for page in PAGES for path, name in _CITED_TEST.findall(page.read_text())]
    assert cited, "docs/guarantees.md names its tests as `tests/FILE.py::test_NAME`"
    missing = [f"{page.relative_to(ROOT)}: {path}::{name}" for page, path, name in cited
               if not (ROOT / path).is_file()
               or not re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.MULTILINE)]
    assert not missing, f"cited tests that do not exist: {missing}"


def test_no_page_says_issue_n() -> None:
    said = [f"{page.relative_to(ROOT)}: {match}" for page in [README, *PAGES]
            for match in _ISSUE_NUMBER.findall(page.read_text())]
    assert not said, said
