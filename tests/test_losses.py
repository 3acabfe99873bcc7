"""Losses: ONNX emitters against numpy truth, finite differences and the Fisher definition."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto

from kfac_compiler.builder import GraphBuilder, value_info
from kfac_compiler.errors import ConfigError
from kfac_compiler.losses import LOSSES
from kfac_compiler.losses import make_loss as _make_loss

SHAPES = {"softmax_cross_entropy": (4, 3, 5), "sigmoid_cross_entropy": (4, 6), "squared_error": (4, 6),
          "multi_head": (4, 15 + 4 + 2)}
# multi_head: three heads on one concatenated output (kfac_compiler/losses/heads.py)
HEADS = [{"output": "a", "loss": "softmax_cross_entropy", "coefficient": 0.7, "targets": "a", "shape": [3, 5]},
         {"output": "b", "loss": "squared_error", "coefficient": 0.3, "targets": "b", "shape": [4],
          "options": {"variance": 2.0}},
         {"output": "c", "loss": "sigmoid_cross_entropy", "coefficient": 2.0, "targets": "c", "shape": [2]}]


def make_loss(kind, **opts):
    return _make_loss(kind, **({"heads": HEADS} if kind == "multi_head" else {}), **opts)


def _targets(kind, shape, rng):
    if kind == "multi_head":
        n = shape[0]
        return make_loss(kind).pack_targets({h["targets"]: _targets(h["loss"], (n, *h["shape"]), rng)
                                             for h in HEADS}, "test")
    if kind == "softmax_cross_entropy":
        return rng.integers(0, shape[-1], size=shape[:-1]).astype(np.int64)
    if kind == "sigmoid_cross_entropy":
        return rng.uniform(size=shape).astype(np.float32)
    return rng.normal(size=shape).astype(np.float32)


def _run(kind, emit, feeds, extra_inputs=(), **opts):
    """Build z, y(, v) -> emit(...) as a one-output graph and run it in ORT."""
    loss = make_loss(kind, **opts)
    b = GraphBuilder(17)
    z_shape = feeds["z"].shape
    inputs = [value_info("z", TensorProto.FLOAT, z_shape)]
    if "y" in feeds:
        inputs.append(value_info("y", loss.target_type(), feeds["y"].shape))
    for name in extra_inputs:
        inputs.append(value_info(name, TensorProto.FLOAT, feeds[name].shape))
    out = emit(loss, b)
    b.identity(out, "out")
    model = b.make_model("t", inputs, [value_info("out", TensorProto.FLOAT, None)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0], loss


@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_loss_value_and_gradient_match_numpy_and_finite_differences(kind):
    rng = np.random.default_rng(0)
    shape = SHAPES[kind]
    z = rng.normal(size=shape).astype(np.float32)
    y = _targets(kind, shape, rng)
    value, loss = _run(kind, lambda l, b: l.emit_loss(b, "z", "y"), {"z": z, "y": y})
    z64 = z.astype(np.float64)
    truth = loss.np_per_example(z64, y).mean()
    assert value == pytest.approx(truth, rel=1e-5)
    grad, _ = _run(kind, lambda l, b: l.emit_grad(b, "z", "y"), {"z": z, "y": y})
    # central differences of sum_n l_n
    eps = 1e-6
    fd = np.zeros_like(z64)
    for idx in np.ndindex(*shape):
        zp, zm = z64.copy(), z64.copy()
        zp[idx] += eps
        zm[idx] -= eps
        fd[idx] = (loss.np_per_example(zp, y).sum() - loss.np_per_example(zm, y).sum()) / (2 * eps)
    np.testing.assert_allclose(grad, fd, atol=1e-5)
    np.testing.assert_allclose(loss.np_grad(z64, y), fd, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_fisher_sqrt_squares_to_fisher_and_fisher_times(kind):
    rng = np.random.default_rng(1)
    shape = (1,) + SHAPES[kind][1:]
    z = rng.normal(size=shape).astype(np.float32)
    k = int(np.prod(shape))
    cols, fcols = [], []
    for j in range(k):
        e = np.zeros(shape, np.float32)
        e.reshape(-1)[j] = 1
        bv, loss = _run(kind, lambda l, b: l.emit_fisher_sqrt_times(b, "z", "v"), {"z": z, "v": e}, ["v"])
        fv, _ = _run(kind, lambda l, b: l.emit_fisher_times(b, "z", "v"), {"z": z, "v": e}, ["v"])
        cols.append(bv.reshape(-1))
        fcols.append(fv.reshape(-1))
    B = np.stack(cols, axis=1)
    F = loss.np_fisher(z[0].astype(np.float64))
    np.testing.assert_allclose(B @ B.T, F, atol=1e-5)
    np.testing.assert_allclose(np.stack(fcols, axis=1), F, atol=1e-5)


@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_sampled_gradients_have_the_fisher_as_second_moment(kind):
    """E[g g^T] over targets drawn from the model equals F_z (Monte Carlo, 20000 draws)."""
    rng = np.random.default_rng(2)
    shape = (1,) + SHAPES[kind][1:]
    draws = 20000
    z = np.repeat(rng.normal(size=shape).astype(np.float32), draws, axis=0)
    loss = make_loss(kind)
    size = loss.noise_shape(z.shape)
    noise = rng.uniform(1e-7, 1 - 1e-7, size=size) if loss.noise == "uniform" else rng.normal(size=size)
    g, _ = _run(kind, lambda l, b: l.emit_sampled_grad(b, "z", "u", z.shape),
                {"z": z, "u": noise.astype(np.float32)}, ["u"])
    g = g.reshape(draws, -1).astype(np.float64)
    F = loss.np_fisher(z[0].astype(np.float64))
    np.testing.assert_allclose(g.mean(axis=0), 0, atol=0.03)
    np.testing.assert_allclose(g.T @ g / draws, F, atol=0.03)


def _inverse_cdf(z, u):
    """numpy's draw for uniforms u [..., 1]: the first class whose cumulative probability
    (float64) reaches u times the row's total."""
    p = make_loss("softmax_cross_entropy")._np_softmax(z.astype(np.float64))
    cdf = np.cumsum(p, axis=-1)
    return np.argmax(cdf >= u * cdf[..., -1:], axis=-1)


def _sampled_classes(z, u):
    """The classes softmax cross-entropy's sampled gradient p - onehot(y) drew (its only
    negative entries), run in ORT, and that gradient."""
    g = _run("softmax_cross_entropy", lambda l, b: l.emit_sampled_grad(b, "z", "u", z.shape), {"z": z, "u": u}, ["u"])[0]
    y = np.argmin(g, axis=-1)
    assert np.all(np.take_along_axis(g, y[..., None], axis=-1) < 0)
    return y, g


def test_softmax_noise_is_one_uniform_per_row_from_1024_classes():
    """From PER_ROW_NOISE_CLASSES classes (a vocabulary) or an unknown count the host draws
    one uniform per row; below, one per class (Gumbel-max). The choice is a function of the
    output's shape alone: asking for one shape does not change another's form."""
    from kfac_compiler.losses.softmax_cross_entropy import PER_ROW_NOISE_CLASSES as K
    from kfac_compiler.losses.softmax_cross_entropy import per_row_noise

    loss = make_loss("softmax_cross_entropy")
    assert loss.noise_shape((8, 32, 50257)) == (8, 32, 1) and per_row_noise((8, 32, 50257))
    assert loss.noise_shape((8, K)) == (8, 1) and loss.noise_shape(("N", "V")) == ("N", 1)
    assert loss.noise_shape((8, 32, K - 1)) == (8, 32, K - 1) and not per_row_noise((8, 32, K - 1))


def test_softmax_sampled_gradient_is_the_inverse_cdf_draw():
    """At 1,100 classes the sampled gradient is p - onehot(y) for y drawn by inverse CDF from
    ONE uniform per row (the host draws [N, T, 1], not a logits-sized array), computed in
    numpy from the same uniforms, row by row."""
    rng = np.random.default_rng(6)
    z = (2 * rng.normal(size=(32, 3, 1100))).astype(np.float32)
    u = rng.uniform(1e-7, 1 - 1e-7, size=(32, 3, 1)).astype(np.float32)
    y, g = _sampled_classes(z, u)
    np.testing.assert_array_equal(y, _inverse_cdf(z, u))
    assert len(np.unique(y)) > 50
    np.testing.assert_allclose(g, make_loss("softmax_cross_entropy").np_grad(z.astype(np.float64), y), atol=1e-6)


def test_softmax_sampled_gradient_below_1024_classes_is_the_gumbel_max_draw():
    """Below 1,024 classes the sampled class is argmax(z - log(-log u)) over one uniform per
    class, numpy's from the same uniforms."""
    rng = np.random.default_rng(7)
    z = rng.normal(size=(64, 3, 7)).astype(np.float32)
    u = rng.uniform(1e-7, 1 - 1e-7, size=z.shape).astype(np.float32)
    y, _ = _sampled_classes(z, u)
    np.testing.assert_array_equal(y, np.argmax(z.astype(np.float64) - np.log(-np.log(u.astype(np.float64))), axis=-1))
    assert len(np.unique(y)) == 7


@pytest.mark.parametrize("classes", [40, pytest.param(1100, marks=pytest.mark.slow)])  # 1,100: 4 s
def test_softmax_sampled_classes_have_the_model_s_frequencies(classes):
    """Over 400,000 draws from one row (39 classes with probabilities from 0.2 down to ~1e-5,
    the others with float32 probability 0; Gumbel-max at 40 classes, inverse CDF at 1,100)
    the classes' counts match p: Pearson's chi-square over the 39 below its 0.1% critical
    value, each count within 5 standard deviations, a zero-probability class never drawn.
    The same uniforms give the same draws (the host's seeded stream is the only randomness)."""
    from scipy.stats import chi2

    row = np.concatenate([np.linspace(3.0, -6.0, 39), np.full(classes - 39, -200.0)]).astype(np.float32)
    draws = 400_000
    z = np.broadcast_to(row, (draws, 1, classes))
    shape = make_loss("softmax_cross_entropy").noise_shape(z.shape)
    u = np.random.default_rng(12).uniform(1e-7, 1 - 1e-7, size=shape).astype(np.float32)
    if classes < 1024:
        z = z.copy()
    else:  # 1.8 GB of logits at 1,100 classes: 10 chunks of draws
        z = np.broadcast_to(row, (draws // 10, 1, classes)).copy()
    y = np.concatenate([_sampled_classes(z, u[k:k + len(z)])[0][:, 0] for k in range(0, draws, len(z))])
    counts = np.bincount(y, minlength=classes)
    p = make_loss("softmax_cross_entropy")._np_softmax(row.astype(np.float64))
    assert counts[39:].sum() == 0 and np.all(row[39:].astype(np.float64) - row.max() < -190)
    expected = draws * p[:39]
    stat = float(np.sum((counts[:39] - expected) ** 2 / expected))
    assert stat < chi2.ppf(0.999, 38), stat
    assert np.all(np.abs(counts[:39] - expected) <= 5 * np.sqrt(expected * (1 - p[:39]))), counts
    np.testing.assert_array_equal(_sampled_classes(z, u[:len(z)])[0][:, 0], y[:len(z)])


def _fisher_dots(kind, z, tangents, weight=None):
    """The emitted {(i, j): sum_n w_n t_i,n . F t_j,n} (the quadratic model's curvature terms)
    as a [3] vector (0,0), (0,1), (1,1), run in ORT on float32 inputs."""
    names = [f"t{i}" for i in range(len(tangents))]
    feeds = {"z": z, **dict(zip(names, tangents))}
    extra = list(names)
    if weight is not None:
        feeds["w"] = weight
        extra.append("w")

    def build(loss, b):
        dots = loss.emit_fisher_dots(b, "z", names, "w" if weight is not None else None)
        return b.op("Concat", [b.reshape(dots[k], [1]) for k in ((0, 0), (0, 1), (1, 1))], axis=0)

    return _run(kind, build, feeds, extra)


def _np_fisher_dots(loss, z, tangents, weight=None):
    w = np.ones(len(z)) if weight is None else weight.reshape(len(z), -1)[:, 0].astype(np.float64)
    out = np.zeros(3)
    for n in range(len(z)):
        F = loss.np_fisher(z[n].astype(np.float64))
        t = [x[n].reshape(-1).astype(np.float64) for x in tangents]
        out += w[n] * np.array([t[0] @ F @ t[0], t[0] @ F @ t[1], t[1] @ F @ t[1]])
    return out


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_fisher_dots_match_the_fisher_matrix(kind, weighted):
    """emit_fisher_dots (the quadratic model's c11, c12, c22 before the mean) against
    t_i^T F t_j with F from np_fisher, example weights or none."""
    rng = np.random.default_rng(4)
    shape = SHAPES[kind]
    z = rng.normal(size=shape).astype(np.float32)
    tangents = [rng.normal(size=shape).astype(np.float32) for _ in range(2)]
    weight = rng.uniform(0.5, 2.0, size=(shape[0],) + (1,) * (len(shape) - 1)).astype(np.float32) if weighted else None
    got, loss = _fisher_dots(kind, z, tangents, weight)
    np.testing.assert_allclose(got, _np_fisher_dots(loss, z, tangents, weight), rtol=1e-5, atol=1e-5)


def test_softmax_fisher_dots_ignore_a_shift_of_the_tangents():
    """Softmax's F_z maps a constant over the classes to 0, so tangents shifted by 50 per
    row give the dots of the unshifted ones (float64 truth): the dots centre each tangent
    under p before multiplying, not sum p t t - (p.t)^2, which loses ~50^2 to float32."""
    rng = np.random.default_rng(5)
    shape = SHAPES["softmax_cross_entropy"]
    z = rng.normal(size=shape).astype(np.float32)
    tangents = [rng.normal(size=shape) for _ in range(2)]
    shifted = [(t + 50.0 * rng.normal(size=shape[:-1] + (1,))).astype(np.float32) for t in tangents]
    got, loss = _fisher_dots("softmax_cross_entropy", z, shifted)
    np.testing.assert_allclose(got, _np_fisher_dots(loss, z, tangents), rtol=1e-4, atol=1e-4)


def test_unknown_loss_and_bad_variance_are_one_line_errors():
    with pytest.raises(ConfigError, match="unknown loss 'hinge'"):
        make_loss("hinge")
    with pytest.raises(ConfigError, match="variance must be > 0"):
        make_loss("squared_error", variance=0.0)
    for scale in (float("inf"), 1e-45, 1e31):  # inf: a loss of 0 for any output; 1e-45: inf
        with pytest.raises(ConfigError, match=r"variance must be in \[1e-30, 1e\+30\]"):
            make_loss("squared_error", variance=scale)


def test_squared_error_variance_scales_loss_and_fisher():
    rng = np.random.default_rng(3)
    z = rng.normal(size=(3, 2)).astype(np.float32)
    y = rng.normal(size=(3, 2)).astype(np.float32)
    value, loss = _run("squared_error", lambda l, b: l.emit_loss(b, "z", "y"), {"z": z, "y": y}, variance=4.0)
    assert value == pytest.approx(((z - y) ** 2).sum() / 8.0 / 3.0, rel=1e-5)
    np.testing.assert_allclose(loss.np_fisher(z[0]), np.eye(2) / 4.0)
