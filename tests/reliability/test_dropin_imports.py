"""``import laplace`` loads laplace-torch 0.3's modules, reaches its names, and stays light.

The lists below were obtained from laplace-torch 0.3 (with torch 2.13, torchmetrics 1.9 and its
backends asdfghjkl 0.1a4, backpack-for-pytorch 1.7.1, curvlinops-for-pytorch 3.0.1) in a
fresh interpreter: ``import laplace, sys; sorted(m for m in sys.modules if m == "laplace" or
m.startswith("laplace."))``, and for each of those modules the names of its ``__all__``, the
classes and functions it defines (``obj.__module__`` is the module) and its submodules.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from importlib.util import find_spec

import pytest

#: ``sys.modules`` entries of the ``laplace`` package after laplace-torch 0.3's ``import laplace``.
LAPLACE_TORCH_MODULES = (
    "laplace",
    "laplace.baselaplace",
    "laplace.curvature",
    "laplace.curvature.asdfghjkl",
    "laplace.curvature.asdl",
    "laplace.curvature.backpack",
    "laplace.curvature.curvature",
    "laplace.curvature.curvlinops",
    "laplace.laplace",
    "laplace.lllaplace",
    "laplace.marglik_training",
    "laplace.subnetlaplace",
    "laplace.utils",
    "laplace.utils.enums",
    "laplace.utils.feature_extractor",
    "laplace.utils.functional_utils",
    "laplace.utils.matrix",
    "laplace.utils.metrics",
    "laplace.utils.subnetmask",
    "laplace.utils.swag",
    "laplace.utils.utils",
)

_ENUMS = [
    "FunctionalApproximation",
    "HessianStructure",
    "Likelihood",
    "LinkApprox",
    "PredType",
    "PriorStructure",
    "SubsetOfWeights",
    "TuningMethod",
]
_FUNCTIONAL_UTILS = [
    "batch_size",
    "classification_targets",
    "concatenate_rows",
    "draw_gaussian",
    "preserve_model_gradients",
    "regression_targets",
    "same_configuration",
    "select_rows",
    "split_batch",
    "subset_loader",
    "to_device",
    "training_indices",
]
_SUBNET_MASKS = [
    "LargestMagnitudeSubnetMask",
    "LargestVarianceDiagLaplaceSubnetMask",
    "LargestVarianceSWAGSubnetMask",
    "LastLayerSubnetMask",
    "ModuleNameSubnetMask",
    "ParamNameSubnetMask",
    "RandomSubnetMask",
    "SubnetMask",
]
_UTILS_UTILS = [
    "SoDSampler",
    "block_diag",
    "diagonal_add_scalar",
    "expand_prior_precision",
    "fix_prior_prec_structure",
    "get_nll",
    "invsqrt_precision",
    "kron",
    "normal_samples",
    "parameters_per_layer",
    "symeig",
    "validate",
]

#: The public names laplace-torch 0.3 reaches from each of those modules.
LAPLACE_TORCH_NAMES: dict[str, list[str]] = {
    "laplace": [
        *_ENUMS,
        "BaseFunctionalLaplace",
        "BaseLaplace",
        "DiagLLLaplace",
        "DiagLaplace",
        "DiagSubnetLaplace",
        "ELLA",
        "FullLLLaplace",
        "FullLaplace",
        "FullSubnetLaplace",
        "FunctionalLLLaplace",
        "FunctionalLaplace",
        "KronLLLaplace",
        "KronLaplace",
        "LLLaplace",
        "Laplace",
        "LowRankLaplace",
        "ParametricLaplace",
        "SubnetLaplace",
        "VaLLA",
        "baselaplace",
        "curvature",
        "laplace",
        "lllaplace",
        "marglik_training",
        "subnetlaplace",
        "utils",
    ],
    "laplace.baselaplace": [
        "BaseFunctionalLaplace",
        "BaseLaplace",
        "DiagLaplace",
        "ELLA",
        "FullLaplace",
        "FunctionalLaplace",
        "KronLaplace",
        "LowRankLaplace",
        "ParametricLaplace",
        "VaLLA",
    ],
    "laplace.curvature": [
        "AsdlEF",
        "AsdlGGN",
        "AsdlHessian",
        "AsdlInterface",
        "BackPackEF",
        "BackPackGGN",
        "BackPackInterface",
        "CurvatureInterface",
        "CurvlinopsEF",
        "CurvlinopsGGN",
        "CurvlinopsHessian",
        "CurvlinopsInterface",
        "EFInterface",
        "GGNInterface",
        "asdfghjkl",
        "asdl",
        "backpack",
        "curvature",
        "curvlinops",
    ],
    "laplace.curvature.asdfghjkl": [
        "AsdfghjklEF",
        "AsdfghjklGGN",
        "AsdfghjklHessian",
        "AsdfghjklInterface",
    ],
    "laplace.curvature.asdl": ["AsdlEF", "AsdlGGN", "AsdlHessian", "AsdlInterface"],
    "laplace.curvature.backpack": ["BackPackEF", "BackPackGGN", "BackPackInterface"],
    "laplace.curvature.curvature": ["CurvatureInterface", "EFInterface", "GGNInterface"],
    "laplace.curvature.curvlinops": [
        "CurvlinopsEF",
        "CurvlinopsGGN",
        "CurvlinopsHessian",
        "CurvlinopsInterface",
    ],
    "laplace.laplace": ["Laplace"],
    "laplace.lllaplace": [
        "DiagLLLaplace",
        "FullLLLaplace",
        "FunctionalLLLaplace",
        "KronLLLaplace",
        "LLLaplace",
    ],
    "laplace.marglik_training": ["marglik_training"],
    "laplace.subnetlaplace": ["DiagSubnetLaplace", "FullSubnetLaplace", "SubnetLaplace"],
    "laplace.utils": [
        *_ENUMS,
        *_FUNCTIONAL_UTILS,
        *_SUBNET_MASKS,
        *_UTILS_UTILS,
        "FeatureExtractor",
        "Kron",
        "KronDecomposed",
        "RunningNLLMetric",
        "_is_batchnorm",
        "_is_valid_scalar",
        "enums",
        "feature_extractor",
        "fit_diagonal_swag_var",
        "functional_utils",
        "matrix",
        "metrics",
        "subnetmask",
        "swag",
        "utils",
    ],
    "laplace.utils.enums": _ENUMS,
    "laplace.utils.feature_extractor": ["FeatureExtractor", "FeatureReduction"],
    "laplace.utils.functional_utils": _FUNCTIONAL_UTILS,
    "laplace.utils.matrix": ["Kron", "KronDecomposed"],
    "laplace.utils.metrics": ["RunningNLLMetric"],
    "laplace.utils.subnetmask": [*_SUBNET_MASKS, "ScoreBasedSubnetMask"],
    "laplace.utils.swag": ["fit_diagonal_swag_var"],
    "laplace.utils.utils": _UTILS_UTILS,
}

#: Libraries ``import laplace`` leaves to the first use of what needs them.
HEAVY_LIBRARIES = ("torchmetrics", "scipy", "transformers", "asdl", "backpack", "curvlinops")

#: The optional backends' names and the library each needs.
OPTIONAL = {
    **dict.fromkeys(("AsdlEF", "AsdlGGN", "AsdlHessian", "AsdlInterface"), "asdl"),
    **dict.fromkeys(("BackPackEF", "BackPackGGN", "BackPackInterface"), "backpack"),
}


def _fresh(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON object, returned here."""
    result = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    )
    return json.loads(result.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def after_import() -> dict:
    """The ``laplace`` modules and heavy libraries in ``sys.modules`` after ``import laplace``."""
    return _fresh(
        "import json, sys\n"
        "import laplace\n"
        "print(json.dumps({'modules': [m for m in sys.modules if m.split('.')[0] == 'laplace'],"
        f" 'heavy': [m for m in sys.modules if m.split('.')[0] in {HEAVY_LIBRARIES!r}]}}))"
    )


def test_import_loads_every_module_laplace_torch_loads(after_import):
    missing = sorted(set(LAPLACE_TORCH_MODULES) - set(after_import["modules"]))
    assert not missing, f"import laplace does not load {missing}"


def test_import_leaves_heavy_libraries_for_first_use(after_import):
    assert after_import["heavy"] == []


@pytest.mark.parametrize("module", sorted(LAPLACE_TORCH_NAMES))
def test_each_module_reaches_laplace_torchs_names(module):
    loaded = importlib.import_module(module)
    usable = [n for n in LAPLACE_TORCH_NAMES[module] if find_spec(OPTIONAL.get(n, "torch"))]
    missing = [name for name in usable if not hasattr(loaded, name)]
    assert not missing, f"{module} lacks {missing}"


def test_lazy_names_are_the_objects_of_their_owners():
    import laplace.utils
    from laplace.utils.metrics import RunningNLLMetric
    from laplace.utils.running_nll import RunningNLLMetric as owned

    assert RunningNLLMetric is owned is laplace.utils.RunningNLLMetric
    with pytest.raises(AttributeError, match="no attribute 'Missing'"):
        laplace.utils.Missing  # noqa: B018


def test_third_party_backend_modules_load_without_their_library():
    result = _fresh(
        "import json, sys\n"
        "sys.modules['asdl'] = sys.modules['backpack'] = None\n"
        "import torch, laplace\n"
        "from laplace.curvature.asdl import AsdlGGN\n"
        "from laplace.curvature.backpack import BackPackGGN\n"
        "model = torch.nn.Linear(2, 1)\n"
        "errors = {}\n"
        "try:\n"
        "    AsdlGGN(model, 'regression')\n"
        "except ImportError as error:\n"
        "    errors['asdl'] = str(error)\n"
        "try:\n"
        "    BackPackGGN(model, 'regression').diag(torch.ones(3, 2), torch.ones(3, 1))\n"
        "except ImportError as error:\n"
        "    errors['backpack'] = str(error)\n"
        "print(json.dumps(errors))"
    )
    assert "pip install 'laplace-ng[asdl]'" in result["asdl"]
    assert "pip install 'laplace-ng[backpack]'" in result["backpack"]


#: The classes each laplace-torch 0.3 module defines (``cls.__module__`` is the module), from
#: the same fresh interpreter: their pickles and qualified names carry these paths.
LAPLACE_TORCH_CLASSES = {
    "laplace.baselaplace": "BaseLaplace ParametricLaplace FullLaplace KronLaplace LowRankLaplace "
    "DiagLaplace BaseFunctionalLaplace FunctionalLaplace ELLA VaLLA",
    "laplace.curvature.asdfghjkl": "AsdfghjklInterface AsdfghjklHessian AsdfghjklGGN AsdfghjklEF",
    "laplace.curvature.asdl": "AsdlInterface AsdlHessian AsdlGGN AsdlEF",
    "laplace.curvature.backpack": "BackPackInterface BackPackGGN BackPackEF",
    "laplace.curvature.curvature": "CurvatureInterface GGNInterface EFInterface",
    "laplace.curvature.curvlinops": "CurvlinopsInterface CurvlinopsGGN CurvlinopsEF "
    "CurvlinopsHessian",
    "laplace.lllaplace": "LLLaplace FullLLLaplace KronLLLaplace DiagLLLaplace FunctionalLLLaplace",
    "laplace.subnetlaplace": "SubnetLaplace FullSubnetLaplace DiagSubnetLaplace",
    "laplace.utils.enums": " ".join(_ENUMS),
    "laplace.utils.feature_extractor": "FeatureReduction FeatureExtractor",
    "laplace.utils.matrix": "Kron KronDecomposed",
    "laplace.utils.metrics": "RunningNLLMetric",
    "laplace.utils.subnetmask": " ".join([*_SUBNET_MASKS, "ScoreBasedSubnetMask"]),
    "laplace.utils.utils": "SoDSampler",
}

_PUBLIC_CLASSES = [
    (path, name) for path, names in LAPLACE_TORCH_CLASSES.items() for name in names.split()
]


@pytest.mark.parametrize(("path", "name"), _PUBLIC_CLASSES)
def test_public_classes_report_laplace_torchs_module(path, name):
    cls = getattr(importlib.import_module(path), name)
    assert (cls.__module__, cls.__qualname__) == (path, name)


def test_pickled_classes_load_after_their_defining_modules_move(monkeypatch, tmp_path):
    """Saved with ``torch.save``, loaded with every defining module gone from ``sys.modules``
    and blocked (as if renamed): the pickles name the public modules only."""
    import torch

    classes = [getattr(importlib.import_module(p), n) for p, n in _PUBLIC_CLASSES]
    defining = {
        cls.__dict__.get("__init__", cls).__module__
        for cls in classes
        if "__init__" in cls.__dict__
    } - set(LAPLACE_TORCH_CLASSES)
    assert defining, "the classes should be defined in internal modules"
    torch.save(classes, tmp_path / "classes.pt")
    for module in defining:  # an import of the old path now fails
        monkeypatch.setitem(sys.modules, module, None)
    loaded = torch.load(tmp_path / "classes.pt", weights_only=False)
    assert loaded == classes
