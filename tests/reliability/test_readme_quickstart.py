"""The README's quickstart runs as written on the installed package and prints what it shows.

laplace-ng is installed with pip (``--no-deps --no-build-isolation --no-index``: offline) from a
copy of the repository's sources into a new virtual environment, and the quickstart block runs
with that environment's python from an empty working directory, so neither ``src/`` nor the
editable install of the development environment is imported. The new environment sees the
running environment's site packages (torch and the other dependencies) through a ``.pth`` file:
``venv --system-site-packages`` alone would give the base interpreter's, which is not the
development environment when that is itself a virtual environment (``make install``'s
``.venv``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: What pip needs to build the wheel (MANIFEST.in's other entries are for the sdist).
SOURCES = ["pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "src"]


def readme_quickstart() -> tuple[str, str]:
    """The quickstart's Python block and the output the README shows after it."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    found = re.search(
        r"^## Quickstart\n\n```python\n(.*?)^```\n\nprints\n\n```\n(.*?)^```", text, re.S | re.M
    )
    assert found, "README.md: no '## Quickstart' python block followed by 'prints' and a block"
    return found.group(1), found.group(2)


def test_readme_fits_a_screen_and_links_absolutely():
    """At most 150 lines, and every link and image absolute: it is a package index page too."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets, "no links found"
    relative = [target for target in targets if not target.startswith("https://")]
    assert not relative, f"relative links in README.md: {relative}"


def make_environment(tmp: Path) -> Path:
    """A new virtual environment with laplace-ng installed from a copy of the sources."""
    env_dir = tmp / "env"
    venv.EnvBuilder(system_site_packages=True, with_pip=False, symlinks=True).create(env_dir)
    env_python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [env_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    here = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(purelib, "_development_site.pth").write_text("\n".join(sorted(here)) + "\n")

    source = tmp / "source"
    for name in SOURCES:
        if (ROOT / name).is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
            shutil.copytree(ROOT / name, source / name, ignore=ignore)
        else:
            source.mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    pip = [env_python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    options = ["--no-deps", "--no-build-isolation", "--no-index", "--no-cache-dir"]
    run = subprocess.run([*pip, *options, str(source)], capture_output=True, text=True)
    assert run.returncode == 0, f"pip install failed:\n{run.stdout}\n{run.stderr}"
    return env_python


@pytest.mark.slow
def test_readme_quickstart_runs_on_the_installed_package(tmp_path):
    code, expected = readme_quickstart()
    env_python = make_environment(tmp_path)
    workdir = tmp_path / "work"
    workdir.mkdir()
    script = workdir / "quickstart.py"
    marker = "installed laplace: "
    script.write_text(
        code + f"\nimport sys as _sys, laplace as _laplace\n"
        f"print({marker!r} + _laplace.__file__ + ' ' + _laplace.__version__, file=_sys.stderr)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    run = subprocess.run(
        [env_python, script.name], cwd=workdir, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, f"the quickstart failed:\n{run.stderr}"

    found = re.search(f"^{marker}(.*) (.*)$", run.stderr, re.M)
    assert found, run.stderr
    module_file, version = Path(found.group(1)).resolve(), found.group(2)
    assert module_file.is_relative_to((tmp_path / "env").resolve()), (
        f"laplace was imported from {module_file}, not from the new environment"
    )
    assert version == _project_version(), f"installed version {version}"
    assert run.stdout == expected, (
        f"the quickstart printed\n{run.stdout}\nbut the README shows\n{expected}"
    )


def _project_version() -> str:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    return re.search(r'^version = "(.*)"', text, re.M).group(1)
