"""kfac-jax on the zoo's transformer_block with our initial weights and batches (issue 36):
the reference of what kfac-jax's K-FAC does on the same problem, for 2026-11-29-transformer-steps.md.

    # in the project's venv: the weights, data and the 500 batches' rows -> tb.npz
    # (2026-11-29-transformer-steps.md, "kfac-jax on the same problem", has the command)
    # in a separate venv with kfac-jax and jax[cpu]:
    python benchmarks/results/2026-11-29-transformer-kfac-jax.py tb.npz '{"min_damping": 3e-4}'

The model is models/transformer.py's in JAX (pre-LN block, single head, causal mask -1e4,
erf-GELU, tied head); loss: softmax cross-entropy summed over the 8 tokens, mean over the
batch (ours), registered as kfac-jax's softmax cross-entropy over the N*T rows with weight
KJ_WEIGHT (default 1). kfac-jax divides its curvature by the data's batch size N, so weight 1
gives the GGN of our loss exactly; the first version of this script registered weight T (8),
which made kfac-jax's curvature, in its preconditioner and in its quadratic model, 8x the
true one and so its steps ~8x shorter (2026-11-29-transformer-step-scale.md).
kfac-jax's optimizer with the adaptive learning rate, momentum and damping (its defaults
otherwise; initial damping 1e-3, ours); the JSON sets further Optimizer options. Prints the
full-data loss every 5 steps, the first step at or below tuned Adam's 11.9837 and the median
update norm |theta_k+1 - theta_k| over steps 400-499.
"""
from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import kfac_jax
import numpy as np

TARGET = 11.983743667602539


def forward(p: dict, tokens: jnp.ndarray) -> jnp.ndarray:
    """logits [N, T, V] of models/transformer.py's block."""
    def ln(h, name):
        mu = h.mean(-1, keepdims=True)
        var = ((h - mu) ** 2).mean(-1, keepdims=True)
        return (h - mu) / jnp.sqrt(var + 1e-5) * p[name + ".scale"] + p[name + ".bias"]

    def lin(h, name):
        return h @ p[name + ".weight"] + p[name + ".bias"]

    T, D = p["pos_emb"].shape
    h = p["tok_emb"][tokens] + p["pos_emb"]
    a = ln(h, "ln1")
    q, k, v = lin(a, "attn.q"), lin(a, "attn.k"), lin(a, "attn.v")
    s = q @ jnp.swapaxes(k, 1, 2) / np.sqrt(D) + jnp.triu(jnp.full((T, T), -1e4), 1)
    h = h + lin(jax.nn.softmax(s, -1) @ v, "attn.proj")
    m = lin(ln(h, "ln2"), "mlp.fc1")
    m = 0.5 * m * (1.0 + jax.scipy.special.erf(m / np.sqrt(2.0)))
    h = h + lin(m, "mlp.fc2")
    return ln(h, "lnf") @ p["tok_emb"].T


def loss_fn(p, batch, register=True):
    x, y = batch
    logits = forward(p, x)
    V = logits.shape[-1]
    flat = logits.reshape(-1, V)
    if register:
        kfac_jax.register_softmax_cross_entropy_loss(flat, y.reshape(-1), weight=float(os.environ.get("KJ_WEIGHT", "1")))
    logp = jax.nn.log_softmax(flat)
    return -jnp.take_along_axis(logp, y.reshape(-1, 1), 1).sum() / x.shape[0]


def main() -> None:
    data = np.load(sys.argv[1])
    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    steps = int(options.pop("steps", 500))
    params = {k[2:]: jnp.asarray(data[k]) for k in data.files if k.startswith("w:")}
    x, y, idx = jnp.asarray(data["x"]), jnp.asarray(data["y"]), data["idx"]
    full = jax.jit(lambda p: loss_fn(p, (x, y), register=False))
    opt = kfac_jax.Optimizer(
        value_and_grad_func=jax.value_and_grad(loss_fn), l2_reg=0.0,
        use_adaptive_learning_rate=True, use_adaptive_momentum=True, use_adaptive_damping=True,
        initial_damping=1e-3, multi_device=False, num_burnin_steps=0, **options)
    rng = jax.random.PRNGKey(0)
    state = opt.init(params, rng, (x[idx[0]], y[idx[0]]))
    hit, curve, norms = None, [], []
    for k in range(steps):
        rng, key = jax.random.split(rng)
        old = {p: np.array(v, copy=True) for p, v in params.items()}  # the step donates its inputs
        params, state, stats = opt.step(params, state, key, batch=(x[idx[k]], y[idx[k]]), global_step_int=k)
        norms.append(float(np.sqrt(sum(np.sum((np.asarray(params[p]) - old[p]) ** 2) for p in params))))
        if (k + 1) % 5 == 0:
            loss = float(full(params))
            curve.append((k + 1, loss))
            if hit is None and loss <= TARGET:
                hit = k + 1
            if (k + 1) % 50 == 0:
                print(k + 1, round(loss, 4), "damping", float(stats.get("damping", np.nan)),
                      "lr", float(stats.get("learning_rate", np.nan)), flush=True)
    print(json.dumps({"options": options, "hit": hit, "final": curve[-1][1], "best": min(v for _, v in curve),
                      "median_update_norm_400_499": float(np.median(norms[400:500])) if steps >= 500 else None,
                      "curve": curve}))


if __name__ == "__main__":
    main()
