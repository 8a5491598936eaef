#!/usr/bin/env bash
# make bench-compare: laplace-torch 0.3 in a throwaway venv outside the repository, then
# benchmarks/compare.py runs every case under both libraries and prints the ratios.
# The venv gets the same CPU torch wheel, laplace-torch 0.3 without its declared torchvision
# (nothing laplace-torch imports needs it), and the rest of its runtime dependencies pinned by
# requirements/lock.txt. Extra arguments go to compare.py (e.g. --cases fit-kron-mlp).
set -euo pipefail
cd "$(dirname "$0")/.."
REF_VENV=${REF_VENV:-${TMPDIR:-/tmp}/laplace-torch-0.3-venv}
PY=${PY:-.venv/bin/python}
if [ ! -x "$REF_VENV/bin/python" ] || ! "$REF_VENV/bin/python" -c "import laplace" 2>/dev/null; then
    echo "creating $REF_VENV with laplace-torch 0.3"
    python3 -m venv "$REF_VENV"
    pip_ref=("$REF_VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps)
    "${pip_ref[@]}" "torch==$(grep -i '^torch==' requirements/lock.txt | cut -d= -f3)"
    "${pip_ref[@]}" laplace-torch==0.3
    grep -iE '^(asdfghjkl|backpack-for-pytorch|curvlinops-for-pytorch|einconv|einops|filelock|fsspec|jinja2|lightning-utilities|linear_operator|markupsafe|mpmath|networkx|numpy|opt_einsum|packaging|scipy|setuptools|sympy|torchmetrics|tqdm|typing_extensions|unfoldnd)==' \
        requirements/lock.txt > "$REF_VENV/requirements.txt"
    "${pip_ref[@]}" -r "$REF_VENV/requirements.txt"
fi
"$REF_VENV/bin/python" -c "import importlib.metadata as m; print('reference: laplace-torch', m.version('laplace-torch'), 'torch', m.version('torch'))"
exec "$PY" benchmarks/compare.py --ref-python "$REF_VENV/bin/python" "$@"
