"""Models exported by torch.onnx.export compile to the same layers as their onnx.helper twins.

Skipped unless torch is importable (it is not a dependency of kfac_compiler).
"""
from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from kfac_compiler.frontend import compile_frontend  # noqa: E402
from kfac_compiler.models import get_model  # noqa: E402


class MLP(nn.Module):  # the twin of models/mlp.py (mlp_classifier)
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 128)
        self.fc3 = nn.Linear(128, 10)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class SmallCNN(nn.Module):  # the twin of models/cnn.py (small_cnn)
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.relu(self.conv2(x))
        x = torch.flatten(torch.mean(x, dim=(2, 3), keepdim=True), 1)
        return self.fc(x)


CASES = {"mlp_classifier": (MLP, (4, 64)), "small_cnn": (SmallCNN, (4, 1, 8, 8))}


def table(plan):
    return [(l.name, l.kind, l.params, l.num_uses, l.approximation) for l in plan.layers]


@pytest.mark.slow
@pytest.mark.parametrize("dynamo", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_torch_export_matches_helper_twin(tmp_path, name, dynamo):
    if dynamo:
        pytest.importorskip("onnxscript")
    cls, shape = CASES[name]
    model = cls().eval()
    path = tmp_path / f"{name}.onnx"
    kwargs = dict(input_names=["input"], output_names=["logits"], opset_version=17)
    if dynamo:
        kwargs["dynamic_shapes"] = {"x": {0: torch.export.Dim("N")}}
    else:
        kwargs["dynamic_axes"] = {"input": {0: "N"}, "logits": {0: "N"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(model, (torch.randn(*shape),), str(path), dynamo=dynamo, **kwargs)
        except TypeError:  # an older torch without the dynamo switch
            if dynamo:
                pytest.skip("this torch has no dynamo exporter")
            torch.onnx.export(model, (torch.randn(*shape),), str(path), **kwargs)
        exported = compile_frontend(path, "softmax_cross_entropy", output="logits")
        twin = compile_frontend(get_model(name), "softmax_cross_entropy")
    assert table(exported) == table(twin)
    for a, b in zip(exported.layers, twin.layers):
        assert [s.shape for s in exported.factors[a.name] or []] == [s.shape for s in twin.factors[b.name] or []]
