"""The real-sized model builders of kfac_compiler.models.torch_exports that the scale benchmark
uses: MobileNetV2's twin is torchvision's network, and the large-vocabulary LM task is the
digits sequences spelled in the big vocabulary.

Skipped unless torch is importable (it is not a dependency of kfac_compiler).
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kfac_compiler.models import torch_exports as te  # noqa: E402


def test_mobilenet_v2_twin_has_torchvisions_size_names_and_shapes():
    # torchvision's mobilenet_v2 (width 1.0, ImageNet head) has 3,504,872 parameters
    assert sum(p.numel() for p in te._MobileNetV2(1000).parameters()) == 3_504_872
    net = te.mobilenet_v2()
    # the 10-class head: 3,504,872 - (1280 * 1000 + 1000) + (1280 * 10 + 10)
    assert sum(p.numel() for p in net.parameters()) == 2_236_682
    shapes = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    # torchvision's names: features.1 is the t=1 block (depthwise, projection), features.2 the
    # first t=6 block (expansion 16 -> 96, depthwise, projection 96 -> 24), features.18 the last 1x1
    assert shapes["features.0.0.weight"] == (32, 3, 3, 3)
    assert shapes["features.1.conv.0.0.weight"] == (32, 1, 3, 3)
    assert shapes["features.1.conv.1.weight"] == (16, 32, 1, 1)
    assert shapes["features.2.conv.0.0.weight"] == (96, 16, 1, 1)
    assert shapes["features.2.conv.1.0.weight"] == (96, 1, 3, 3)
    assert shapes["features.2.conv.2.weight"] == (24, 96, 1, 1)
    assert shapes["features.17.conv.2.weight"] == (320, 960, 1, 1)
    assert shapes["features.18.0.weight"] == (1280, 320, 1, 1)
    assert shapes["classifier.1.weight"] == (10, 1280)
    convs = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 52 and sum(m.groups > 1 for m in convs) == 17
    # residual connections exactly where stride is 1 and the width is kept: 10 of the 17 blocks
    assert sum(getattr(m, "use_res_connect", False) for m in net.modules()) == 10


def test_large_vocab_sequences_are_the_digits_spelled_with_17_fixed_tokens():
    vocab = 50257
    (small, small_y), (big, big_y) = te.digits_sequences(40), te.digits_sequences(40, vocab=vocab)
    spell = te.vocab_injection(vocab)
    assert len(np.unique(spell)) == 17 and spell.min() >= 0 and spell.max() < vocab
    np.testing.assert_array_equal(spell, te.vocab_injection(vocab))  # fixed across calls
    np.testing.assert_array_equal(big["input"], spell[small["input"]])
    np.testing.assert_array_equal(big_y, spell[small_y])
    np.testing.assert_array_equal(big_y[:, :-1], big["input"][:, 1:])  # next-token targets
    assert set(np.unique(big["input"])) <= set(spell.tolist())
    with pytest.raises(ValueError, match="at least 17"):
        te.vocab_injection(10)


def test_gpt_with_a_large_vocabulary_ties_its_head_to_the_embedding():
    vocab = 50257
    net = te.gpt(vocab=vocab, d_model=64, n_layer=2, n_head=2)
    assert net.head.weight is net.wte.weight and tuple(net.wte.weight.shape) == (vocab, 64)
    tokens = torch.from_numpy(te.digits_sequences(2, vocab=vocab)[0]["input"])
    with torch.no_grad():
        logits = net.eval()(tokens)
    assert tuple(logits.shape) == (2, 64, vocab)


@pytest.mark.slow
def test_mobilenet_v2_export_compiles_to_its_convolutions(tmp_path):
    import kfac_compiler as kc

    net, (inputs, _) = te.mobilenet_v2(), te.digits_images(2)
    path = te.export(net, str(tmp_path / "mobilenet_v2.onnx"), inputs["input"])
    plan = kc.compile(path, loss="softmax_cross_entropy", output="logits", emit=False)
    totals = plan.totals()
    # each BatchNorm folded into its convolution: its gains and shifts (2 C) become a conv bias (C)
    channels = sum(m.num_features for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d))
    assert totals["layers_by_kind"] == {"conv": 35, "depthwise_conv": 17, "fully_connected": 1}
    assert totals["param_elements"] == 2_236_682 - channels
