"""The backend registry: a missing optional extra names its install command; import still works."""

from __future__ import annotations

import importlib
import sys

import pytest


@pytest.mark.parametrize("backend", ["asdl", "backpack"])
def test_missing_extra_raises_import_error_with_install_command(monkeypatch, backend):
    names = {"asdl": ["AsdlGGN", "asdl_ggn"], "backpack": ["BackPackEF", "backpack_ef"]}[backend]
    monkeypatch.setitem(sys.modules, backend, None)
    for mod in [m for m in sys.modules if m.startswith(f"laplace.curvature.{backend}")]:
        monkeypatch.delitem(sys.modules, mod)
    curvature = importlib.import_module("laplace.curvature")
    with pytest.raises(ImportError, match=rf"pip install 'laplace-ng\[{backend}\]'"):
        getattr(curvature, names[0])
    with pytest.raises(ImportError, match="laplace-ng"):
        curvature.CURVATURE_BACKENDS[names[1]]
    assert names[1] not in list(curvature.CURVATURE_BACKENDS)
    assert names[1] not in curvature.CURVATURE_BACKENDS


@pytest.mark.slow  # a fresh interpreter imports torch (~10 s)
def test_laplace_imports_without_the_extras():
    code = (
        "import sys; sys.modules['asdl'] = None; sys.modules['backpack'] = None\n"
        "import laplace, laplace.curvature as c\n"
        "from laplace.curvature import *\n"
        "assert 'asdl_ggn' not in c.CURVATURE_BACKENDS\n"
        "assert 'curvlinops_ggn' in c.CURVATURE_BACKENDS\n"
    )
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True)
