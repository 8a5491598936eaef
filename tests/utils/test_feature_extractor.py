"""FeatureExtractor: last-layer detection, features, reductions, errors, hooks and pickling."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from conftest import CASE_BUILDERS, DictInputModel, TinyTransformer, assert_close
from laplace.utils import FeatureExtractor, FeatureReduction
from laplace.utils.enums import FeatureReduction as EnumsFeatureReduction


class HeadFirst(nn.Module):
    """Non-Sequential model whose head is registered before the body it runs after."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 2)
        self.body = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
        self.aux = nn.Linear(3, 3)  # registered last, never run

    def forward(self, x):
        return self.head(self.body(x))


def test_reduction_enum_values():
    assert FeatureReduction is EnumsFeatureReduction
    assert [m.value for m in FeatureReduction] == ["pick_first", "pick_last", "average"]
    assert FeatureReduction.AVERAGE == "average"


def test_detects_last_linear_of_sequential():
    model = CASE_BUILDERS["cnn_classification"]().model
    X = CASE_BUILDERS["cnn_classification"]().X
    extractor = FeatureExtractor(model)
    assert extractor.last_layer is None
    f, phi = extractor.forward_with_features(X)
    assert extractor.last_layer is model[4] and extractor.last_layer_name == "4"
    assert_close(f, model(X))
    assert_close(phi, model[:4](X))
    # later calls reuse the found layer
    _, phi2 = extractor.forward_with_features(X[:2])
    assert_close(phi2, phi[:2])


def test_detects_execution_order_not_registration_order():
    torch.manual_seed(0)
    model = HeadFirst()
    extractor = FeatureExtractor(model)
    extractor(torch.randn(2, 3))
    assert extractor.last_layer is model.head and extractor.last_layer_name == "head"
    # the alias is not registered twice: parameters are not duplicated
    assert len(list(extractor.parameters())) == len(list(model.parameters()))


def test_bare_linear_model_is_its_own_last_layer():
    model = nn.Linear(3, 2)
    extractor = FeatureExtractor(model)
    X = torch.randn(4, 3)
    _, phi = extractor.forward_with_features(X)
    assert extractor.last_layer is model and extractor.last_layer_name == ""
    assert_close(phi, X)


def test_dict_inputs():
    model = DictInputModel().double()
    X = {"input_ids": torch.randn(5, 3, dtype=torch.float64), "labels": torch.zeros(5)}
    f, phi = FeatureExtractor(model).forward_with_features(X)
    assert_close(f, model(X))
    assert_close(phi, model.net[:2](X["input_ids"]))


@pytest.mark.parametrize("reduction", list(FeatureReduction), ids=lambda r: r.value)
def test_feature_reductions(reduction):
    torch.manual_seed(1)
    model = TinyTransformer(reduction.value).double()
    X = {"input_ids": torch.randint(0, 11, (4, 5))}
    extractor = FeatureExtractor(model, feature_reduction=reduction.value)
    f, phi = extractor.forward_with_features(X)
    assert extractor.last_layer_name == "score" and phi.shape == (4, 6)
    # the reduced features reproduce the model's reduced logits through the head
    assert_close(model.score(phi), f)


def test_no_reduction_keeps_sequence_features():
    model = TinyTransformer("pick_last").double()
    _, phi = FeatureExtractor(model).forward_with_features({"input_ids": torch.zeros(2, 5).long()})
    assert phi.shape == (2, 5, 6)


def test_enable_backprop_keeps_features_in_graph():
    model = CASE_BUILDERS["mlp_regression_3out"]().model
    X = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    _, phi = FeatureExtractor(model).forward_with_features(X)
    assert not phi.requires_grad
    _, phi = FeatureExtractor(model, enable_backprop=True).forward_with_features(X)
    (grad,) = torch.autograd.grad(phi.sum(), X)
    assert grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("name", "match"),
    [("fc_out", "not a module of the model.*'0', '2'"), ("1", "needs a linear last layer.*Tanh")],
)
def test_bad_last_layer_name(name, match):
    model = CASE_BUILDERS["mlp_regression_3out"]().model
    with pytest.raises(ValueError, match=match):
        FeatureExtractor(model, last_layer_name=name)


def test_detected_last_layer_must_be_linear():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
    with pytest.raises(ValueError, match="'1' is a Tanh"):
        FeatureExtractor(model)(torch.randn(2, 3))


def test_bad_reduction():
    with pytest.raises(ValueError, match=r"feature_reduction='max'.*'pick_first'"):
        FeatureExtractor(nn.Linear(2, 2), feature_reduction="max")


def test_no_hooks_left_and_pickles():
    model = CASE_BUILDERS["mlp_classification"]().model
    extractor = FeatureExtractor(model)
    X = torch.randn(3, 3, dtype=torch.float64)
    extractor.forward_with_features(X)
    assert all(not m._forward_hooks for m in model.modules())
    clone = pickle.loads(pickle.dumps(extractor))
    assert clone.last_layer is clone.model[2]
    assert_close(clone.forward_with_features(X)[1], extractor.forward_with_features(X)[1])
    deep = copy.deepcopy(extractor)
    assert deep.last_layer is deep.model[2]
