"""The documentation site as a reader gets it: built with ``mkdocs build --strict``, then parsed.

Checks what a broken docstring or page would show in the browser: literal reST roles or
``.. math::`` blocks, maths left unrendered, public classes whose page omits the methods users
call (inherited ones included), and links between pages or to anchors that go nowhere. External
links are not followed (the tests run offline).
"""

from __future__ import annotations

import html
import posixpath
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

pytest.importorskip("mkdocs")

ROOT = Path(__file__).resolve().parents[2]
#: The path the site is served under (``site_url``), which absolute links start with.
SITE_PATH = urlsplit(
    re.search(r"^site_url: (\S+)$", (ROOT / "mkdocs.yml").read_text(), re.M)[1]
).path
REST_ROLE = re.compile(r":(?:class|meth|func|mod|data|attr|exc|obj|ref|py:\w+):`")
#: Methods every listed class's API page must show, inherited or not.
USER_METHODS = (
    "fit",
    "__call__",
    "optimize_prior_precision",
    "log_marginal_likelihood",
    "sample",
    "state_dict",
)
CLASS_PAGES = {
    "laplace.baselaplace.FullLaplace": "api/baselaplace/index.html",
    "laplace.baselaplace.KronLaplace": "api/baselaplace/index.html",
    "laplace.baselaplace.DiagLaplace": "api/baselaplace/index.html",
    "laplace.baselaplace.LowRankLaplace": "api/baselaplace/index.html",
    "laplace.baselaplace.MatFreeLaplace": "api/baselaplace/index.html",
    "laplace.lllaplace.KronLLLaplace": "api/lllaplace/index.html",
    "laplace.subnetlaplace.FullSubnetLaplace": "api/subnetlaplace/index.html",
}


class _Page(HTMLParser):
    """The ids, links and visible text of one HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.text: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if values.get("id"):
            self.ids.add(values["id"])
        if tag == "a" and values.get("href"):
            self.links.append(values["href"])
        if tag in ("script", "style"):
            self._skip += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style"):
            self._skip -= 1

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.text.append(data)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, _Page]:
    """Every page of the site built into a temporary folder, parsed."""
    out = tmp_path_factory.mktemp("site")
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    result = subprocess.run(build, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    pages = {}
    for path in out.rglob("*.html"):
        page = _Page()
        page.feed(path.read_text(encoding="utf-8"))
        pages[path.relative_to(out)] = page
    return pages


@pytest.mark.slow
def test_api_pages_show_no_rest_markup_and_no_raw_maths(site):
    for path, page in site.items():
        text = html.unescape("".join(page.text))
        assert not REST_ROLE.search(text), f"{path}: literal reST role {REST_ROLE.search(text)[0]}"
        assert ".. math::" not in text, f"{path}: raw .. math:: block"
        assert "\\(" not in text and "\\[" not in text, f"{path}: unrendered maths"


@pytest.mark.slow
@pytest.mark.parametrize("qualname", list(CLASS_PAGES))
def test_class_pages_list_the_methods_users_call(site, qualname):
    page = site[Path(CLASS_PAGES[qualname])]
    missing = [m for m in USER_METHODS if f"{qualname}.{m}" not in page.ids]
    assert not missing, f"{qualname}'s page lacks {missing}"


@pytest.mark.slow
def test_links_between_pages_and_to_anchors_resolve(site):
    broken = []
    for path, page in site.items():
        for href in page.links:
            parts = urlsplit(href)
            if parts.scheme or parts.netloc or href.startswith("mailto:"):
                continue  # external: not followed offline
            if parts.path.startswith(SITE_PATH):
                resolved = unquote(parts.path[len(SITE_PATH) :])
            elif parts.path:
                resolved = posixpath.join(path.parent.as_posix(), unquote(parts.path))
            else:
                resolved = path.as_posix()
            target = Path(posixpath.normpath(resolved))
            if not target.suffix:
                target = target / "index.html"
            if target not in site:
                if (target.suffix or "") in ("", ".html"):
                    broken.append(f"{path}: {href}")
                continue
            if parts.fragment and unquote(parts.fragment) not in site[target].ids:
                broken.append(f"{path}: {href} (no such anchor)")
    assert not broken, "\n".join(broken[:30])
