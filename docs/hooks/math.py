"""MkDocs hook: render the site's maths to MathML at build time, so pages need no script or CDN.

``pymdownx.arithmatex`` (generic mode) marks ``$...$`` and ``$$...$$`` in the docs and the
docstrings as ``<span class="arithmatex">\\(...\\)</span>`` and
``<div class="arithmatex">\\[...\\]</div>``; this hook replaces each with the MathML that
``latex2mathml`` writes, which browsers render natively. The site builds and renders offline.
"""

from __future__ import annotations

import html
import re

from latex2mathml.converter import convert

MATH = re.compile(
    r'<(?P<tag>span|div) class="arithmatex">\s*\\(?P<open>[(\[])(?P<tex>.*?)\\[)\]]\s*</(?P=tag)>',
    re.DOTALL,
)


def _to_mathml(match: re.Match[str]) -> str:
    display = "block" if match["open"] == "[" else "inline"
    return convert(html.unescape(match["tex"]).strip(), display=display)


def on_page_content(html_text: str, **_: object) -> str:
    """Replace every arithmatex span/div of a rendered page by MathML."""
    return MATH.sub(_to_mathml, html_text)
