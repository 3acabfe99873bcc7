"""The tied embedding + head with both Kronecker terms kept, and where the Kronecker terms
miss (issue 36 item 3), for 2026-11-30-tied-sum.md. The blocks `kron_tied_sum`,
`kron_tied_sum_energy`, `kron_tied_vocab_diag_energy` (tied tables) and `kron_energy`
(embeddings) are defined and registered here as extension blocks: they were measured and not
added to the library.

    python benchmarks/results/2026-11-30-tied-sum.py check
    python benchmarks/results/2026-11-30-tied-sum.py steps OUT.json SEEDS APPROX...
    python benchmarks/results/2026-11-30-tied-sum.py cross OUT.json SEED STEPS,...
    python benchmarks/results/2026-11-30-tied-sum.py lstm OUT.json SEEDS EMBEDDING_APPROX
    python benchmarks/results/2026-11-30-tied-sum.py bench BENCH_TO_TARGET_ARGS...

`check`: kron_tied_sum's inverse and multiply against the dense solve of its definition (numpy
and ONNX Runtime). `steps`: the GPT of 2026-11-28-gpt-spikes.py (2 layers of width 128, tied
head, context 64, 256 bytes; its data and batches), default K-FAC with `approximations:
{tied_embedding: APPROX}` ("adam": our Adam at lr 1e-3), 600 steps per seed (SEEDS
comma-separated: the GPT's initialization, the batch order, the trainer's), held-out loss per
byte every 50 steps, the largest batch loss after step 100, the rejected steps. `cross`: the
table's per-use Fisher against its Kronecker terms (cross's docstring). `lstm`: an embedding's
block on 2026-11-30-lstm-to-target.py's byte LM (lstm's docstring). `bench`:
benchmarks/bench_to_target.py with these blocks registered (e.g. `real-exports --only gpt gpt2
--approx tied_embedding=kron_tied_sum --out -`). Env KFAC_TIED_SUM_SHARE: each term's share of
the damping in kron_tied_sum (default 0.5); KFAC_KNOBS: K-FAC options as JSON for `steps`.
Deterministic; needs torch.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import sys
import tempfile
import time

import numpy as np
import torch

import kfac_compiler
import kfac_compiler.torch as kt
from kfac_compiler import linalg
from kfac_compiler.blocks.embedding import EmbeddingKron
from kfac_compiler.blocks.ops import emit_concat
from kfac_compiler.blocks.registry import register_block
from kfac_compiler.blocks.tied import TIED_FACTORS, TiedEmbeddingKronVocabDiag, TiedKronBase
from kfac_compiler.errors import ConfigError
from kfac_compiler.ir import FactorSpec
from kfac_compiler.models.torch_exports import gpt
from kfac_compiler.runtime import Trainer
from kfac_compiler.runtime.data import batch_indices

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
spikes = importlib.import_module("2026-11-28-gpt-spikes")  # its data: windows of the stdlib's bytes
T, BS, STEPS = spikes.T, spikes.BS, 600


SHARE = float(os.environ.get("KFAC_TIED_SUM_SHARE", "0.5"))


@register_block
class TiedEmbeddingKronSum(TiedKronBase):
    """Both Kronecker terms kept, the vocabulary factors diagonal: the curvature of vocabulary
    column v of M = E^T is C_v = a_v R_1 + g_v R_2 (a = diag L_1 = A_V, g = diag L_2 = G_V,
    R_1 = G_D, R_2 = A_D), with no nearest-Kronecker fit between the terms (which understated
    the lookup curvature of frequent tokens where the head term dominates: docs/conventions.md).

    Damping: each term gets SHARE (default half) of it by the pi split, (a + pi_1 s)(R_1 + s/pi_1 I) +
    (g + pi_2 s)(R_2 + s/pi_2 I) with s = sqrt(damping / 2): a term that vanishes leaves
    damping / 2 (x) I, as a Kronecker block's pi split leaves damping. With a', g', R_1', R_2'
    the damped factors, one generalized eigenbasis Q (R_1' Q = R_2' Q diag(mu), Q^T R_2' Q = I;
    host eigh at every refresh) diagonalizes every column's curvature at once:
    C_v = Q^-T diag(a'_v mu + g'_v) Q^-1, so C_v^-1 x = Q [(Q^T x) / (a'_v mu + g'_v)].
    Inverse state Q [D, D], mu [D], a' [V], g' [V]: O(V + D^2), like kron_tied_vocab_diag;
    a preconditioning costs 4 V D^2 (two [V, D] x [D, D] products)."""

    name = "kron_tied_sum"
    menu_rank = 3
    vocab_diag = True
    host_matpowers = False

    def __init__(self, layer, param_shapes, input_shapes=None, **options):
        # the pi split applies per term (above); damping_mode and combine do not apply
        options.pop("damping_mode", None)
        options.pop("combine", None)
        super().__init__(layer, param_shapes, input_shapes, **options)

    # ---- plan records
    def inverse_specs(self) -> list[FactorSpec]:
        V, D = self.vocab, self.dim
        return [FactorSpec("Q", (D, D), role="Q"), FactorSpec("mu", (D,), role="mu", init="ones"),
                FactorSpec("a", (V,), role="a", init="ones"), FactorSpec("g", (V,), role="g", init="zeros")]

    def inverse_flops(self, method: str = linalg.DEFAULT_METHOD) -> int:
        return 20 * self.dim**3  # two host eigh of [D, D] and their products

    def apply_flops(self) -> int:
        return 4 * self.vocab * self.dim**2 + 2 * self.vocab * self.dim

    def check_power(self, exp: float) -> None:
        if exp != -1:  # Q is not orthogonal: Q diag(s^p) Q^T is C^p only for p = -1
            raise ConfigError(
                f"layer {self.layer.name!r}: the 'kron_tied_sum' block has no matrix power {exp:g} "
                "(precon_power); use precon_power=-1 or approximation 'kron_tied_vocab_diag' for this layer"
            )

    # ---- the refresh on the host
    @property
    def host_inverse_only(self) -> bool:
        return True

    def emit_inverse(self, b, factors, damping, method=linalg.DEFAULT_METHOD, previous=None):
        raise ConfigError(f"layer {self.layer.name!r}: the 'kron_tied_sum' inverse is computed on the host "
                          "(numpy_inverse: a generalized eigh)")

    def np_terms(self, factors: dict, damping: float) -> tuple[np.ndarray, ...]:
        """(a', R_1', g', R_2') in float64: each term damped by the pi split of damping / 2."""
        f = {k: np.asarray(factors[k], np.float64) for k in TIED_FACTORS}
        half = float(damping) * SHARE
        da, d1 = linalg.np_damping_split(f["A_V"], f["G_D"], half, a_diag=True)
        dg, d2 = linalg.np_damping_split(f["G_V"], f["A_D"], half, a_diag=True)
        return (f["A_V"] + da, linalg.np_add_diagonal(f["G_D"], d1),
                f["G_V"] + dg, linalg.np_add_diagonal(f["A_D"], d2))

    def numpy_inverse(self, factors, damping, method="eigh", previous=None):
        dtype = np.result_type(*[np.asarray(factors[k]).dtype for k in TIED_FACTORS])
        ok = all(np.isfinite(np.asarray(factors[k])).all() for k in TIED_FACTORS) and float(damping) > 0
        state = None
        if ok:
            try:
                a, R1, g, R2 = self.np_terms(factors, damping)
                s2, U2 = np.linalg.eigh(linalg.np_symmetrized(R2))
                ok = bool(s2.min() > 0)
                if ok:
                    P = U2 / np.sqrt(s2)  # P^T R_2' P = I
                    mu, U = np.linalg.eigh(linalg.np_symmetrized(P.T @ R1 @ P))
                    mu = np.maximum(mu, 0.0)
                    state = {"Q": P @ U, "mu": mu, "a": a, "g": g}
                    ok = bool(np.all(a > 0) and np.all(g > 0) and np.isfinite(state["Q"]).all())
            except np.linalg.LinAlgError:
                ok = False
        if not ok:
            state = dict(previous) if previous is not None else {
                "Q": np.eye(self.dim), "mu": np.ones(self.dim), "a": np.ones(self.vocab), "g": np.zeros(self.vocab)}
        return {k: np.asarray(v, dtype=dtype) for k, v in state.items()}, ok

    def numpy_matpower(self, factors, damping, exp):
        self.check_power(exp)  # -1 only
        return self.numpy_inverse(factors, damping)

    def np_cholesky_parts(self, factors, damping, inverse=False):
        raise ConfigError(f"layer {self.layer.name!r}: the 'kron_tied_sum' block is a sum of two Kronecker "
                          "products and has no Kronecker Cholesky factor; use approximation 'kron_tied_vocab_diag'")

    # ---- the power hook, on the table as stored (E [V, D] = M^T: row v is column v of M)
    def emit_power(self, b, vectors, exp, *, factors=None, damping=None, state=None):
        w = self.layer.weight
        X = vectors[w]
        if state is not None:  # C_v^-1 x_v = Q [(Q^T x_v) / (a'_v mu + g'_v)], all rows at once
            scale = b.add(b.mul(b.unsqueeze(state["a"], [1]), b.unsqueeze(state["mu"], [0])),
                          b.unsqueeze(state["g"], [1]))
            Y = b.div(b.matmul(X, state["Q"]), scale)
            return {w: b.matmul(Y, b.transpose(state["Q"], [1, 0]))}
        if exp != 1:
            raise ConfigError(f"layer {self.layer.name!r}: 'kron_tied_sum' powers other than 1 are host-side "
                              "(numpy_inverse)")
        a, R1, g, R2 = self._emit_terms(b, factors, damping)
        return {w: b.add(b.mul(b.matmul(X, R1), b.unsqueeze(a, [1])), b.mul(b.matmul(X, R2), b.unsqueeze(g, [1])))}

    def _emit_terms(self, b, f, damping):
        """The ONNX twin of np_terms."""
        V, D = self.vocab, self.dim
        half = b.mul(damping, b.const(SHARE))
        da, d1 = linalg.emit_damping_split(b, f["A_V"], V, f["G_D"], D, half, a_diag=True)
        dg, d2 = linalg.emit_damping_split(b, f["G_V"], V, f["A_D"], D, half, a_diag=True)
        return (b.add(f["A_V"], da), linalg.emit_add_diagonal(b, f["G_D"], D, d1),
                b.add(f["G_V"], dg), linalg.emit_add_diagonal(b, f["A_D"], D, d2))

    def numpy_power(self, vectors, exp, *, factors=None, damping=None, state=None):
        w = self.layer.weight
        X = np.asarray(vectors[w], np.float64)
        if state is not None:
            Q = np.asarray(state["Q"], np.float64)
            scale = (np.asarray(state["a"], np.float64)[:, None] * np.asarray(state["mu"], np.float64)[None, :]
                     + np.asarray(state["g"], np.float64)[:, None])
            return {w: ((X @ Q) / scale) @ Q.T}
        if exp != 1:
            return self.numpy_multiply_matpower(vectors, factors, damping, exp)
        a, R1, g, R2 = self.np_terms(factors, damping)
        return {w: (X @ R1) * a[:, None] + (X @ R2) * g[:, None]}


class EnergyWeightedLookups:
    """The lookup factor A_V weighted by each looked-up row's cotangent energy ||delta||^2
    (summed over the seeds) instead of counted: A_V[v] = sum_{rows of v} ||delta||^2 / sum_rows
    ||delta||^2. With one shared G for every token, A_V[v] is row v's share of the curvature;
    the count gives every occurrence the same share, this gives each its own (rows that carry
    no gradient, masked positions included, weigh 0). Same shapes, same cost."""

    def emit_statistics(self, b, inputs, cotangents, masked=False, examples=None):
        out = super().emit_statistics(b, inputs, cotangents, masked, examples)
        lookups = self.lookups if hasattr(self, "lookups") else range(len(inputs))
        width = self.dim
        idx = emit_concat(b, [b.reshape(inputs[u], [-1]) for u in lookups], axis=0)
        energy = []
        for u in lookups:
            e = None
            for d in cotangents[u]:
                sq = b.reduce_sum(b.mul(b.reshape(d, [-1, width]), b.reshape(d, [-1, width])), [1])
                e = sq if e is None else b.add(e, sq)
            energy.append(e)
        w = emit_concat(b, energy, axis=0)
        vocab = self.vocab
        counts = b.op("ScatterElements", [b.const(np.zeros(vocab)), idx, w], axis=0, reduction="add")
        key = "A_V" if "A_V" in out else "A"
        out[key] = b.div(counts, b.op("Max", [b.reduce_sum(w, None), b.const(1e-30)]))
        return out

    def numpy_statistics(self, inputs, cotangents, masked=False):
        out = super().numpy_statistics(inputs, cotangents, masked)
        lookups = self.lookups if hasattr(self, "lookups") else range(len(inputs))
        idx = np.concatenate([np.asarray(inputs[u]).reshape(-1) for u in lookups]) % self.vocab
        w = np.concatenate([sum((np.asarray(d, np.float64).reshape(-1, self.dim) ** 2).sum(1) for d in cotangents[u])
                            for u in lookups])
        key = "A_V" if "A_V" in out else "A"
        out[key] = np.bincount(idx, weights=w, minlength=self.vocab) / max(float(w.sum()), 1e-30)
        return out


@register_block
class TiedVocabDiagEnergy(EnergyWeightedLookups, TiedEmbeddingKronVocabDiag):
    """kron_tied_vocab_diag with the energy-weighted lookup factor."""

    name = "kron_tied_vocab_diag_energy"
    menu_rank = 11


@register_block
class TiedSumEnergy(EnergyWeightedLookups, TiedEmbeddingKronSum):
    """kron_tied_sum with the energy-weighted lookup factor."""

    name = "kron_tied_sum_energy"
    menu_rank = 12


@register_block
class EmbeddingKronEnergy(EnergyWeightedLookups, EmbeddingKron):
    """An embedding's kron with the energy-weighted index factor A."""

    name = "kron_energy"
    menu_rank = 11


def check() -> None:
    """The inverse state against np.linalg.solve of the two damped Kronecker terms built by hand
    (row-major vec of E [V, D]), numpy and through ONNX Runtime; a vanished term too."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from kfac_compiler.builder import GraphBuilder
    from kfac_compiler.ir import Layer

    V, D = 7, 4
    layer = Layer("E", "tied_embedding", ("E",), (None, None), attrs={"vocab": V, "dim": D,
                  "use_kinds": ("embedding", "fully_connected")}, approximation="kron_tied_sum")
    blk = TiedEmbeddingKronSum(layer, {"E": (V, D)})
    rng = np.random.default_rng(0)
    for vanish in (False, True):
        Y, Z = rng.normal(size=(9, D)), rng.normal(size=(5, D))
        f = {"A_V": np.zeros(V) if vanish else rng.uniform(0.1, 1, V) / V, "G_D": np.zeros((D, D)) if vanish else Y.T @ Y / 9,
             "A_D": Z.T @ Z / 5, "G_V": rng.uniform(0.01, 1, V) / V}
        lam, s = 3e-2, math.sqrt(3e-2 * SHARE)
        dense = np.zeros((V * D, V * D))
        for vocab, dim in ((f["A_V"], f["G_D"]), (f["G_V"], f["A_D"])):
            tv, td = vocab.mean(), np.trace(dim) / D
            pi = math.sqrt(tv / td) if tv > 0 and td > 0 else 1.0
            dense += np.kron(np.diag(vocab + pi * s), dim + s / pi * np.eye(D))
        x = rng.normal(size=(V, D))
        want = np.linalg.solve(dense, x.reshape(-1)).reshape(V, D)
        state, ok = blk.numpy_inverse(f, lam)
        assert ok
        got = blk.numpy_multiply_inverse({"E": x}, state)["E"]
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(blk.numpy_multiply({"E": x}, f, lam)["E"].reshape(-1), dense @ x.reshape(-1),
                                   rtol=1e-12)
        feeds = {"x": x.astype(np.float32), **{f"s_{k}": v.astype(np.float32) for k, v in state.items()}}
        b = GraphBuilder(17, taken=feeds)
        out = blk.emit_multiply_inverse(b, {"E": "x"}, {k: f"s_{k}" for k in state})["E"]
        model = b.make_model("check", [helper.make_tensor_value_info(k, TensorProto.FLOAT, v.shape)
                                       for k, v in feeds.items()], [helper.make_empty_tensor_value_info(out)])
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(sess.run(None, feeds)[0], want, rtol=1e-4, atol=1e-5)
    print("kron_tied_sum: inverse = the dense solve (numpy 1e-10, ONNX Runtime float32 1e-4), with and without a vanished term")


def _use_gradients(module: torch.nn.Module, held: np.ndarray) -> dict[str, torch.Tensor]:
    """Targets sampled from the model's own distribution; float64: per-example gradients
    [N, V, D] of the table through its lookup ("gl") and its head ("gh"), and what the
    Kronecker terms are made of: the cotangents of the lookup's output "dx" [N, T, D], of the
    logits "dz" [N, T, V], and the head's input "h" [N, T, D]."""
    from torch.func import grad, vmap

    for p in module.parameters():
        p.requires_grad_(False)
    E = module.wte.weight

    def head_input(E_l, tokens):
        x = torch.nn.functional.embedding(tokens, E_l) + module.wpe(module.positions[:T])
        return x, module.ln_f(module.blocks(x[None]))[0]

    def loss(E_l, E_h, tokens, targets):
        return torch.nn.functional.cross_entropy(head_input(E_l, tokens)[1] @ E_h.T, targets, reduction="sum")

    tokens = torch.from_numpy(held[:, :-1])
    with torch.no_grad():
        probs = module(tokens).softmax(-1)
    targets = torch.distributions.Categorical(probs=probs).sample()
    gl, gh = vmap(grad(loss, argnums=(0, 1)), in_dims=(None, None, 0, 0))(E, E, tokens, targets)
    x = (torch.nn.functional.embedding(tokens, E) + module.wpe(module.positions[:T])).requires_grad_(True)
    h = module.ln_f(module.blocks(x))
    dz = probs - torch.nn.functional.one_hot(targets, probs.shape[-1]).to(probs.dtype)  # d CE_sum / d logits
    (dx,) = torch.autograd.grad((h @ E.T * dz).sum(), x)
    return {k: v.detach().double() for k, v in (("gl", gl), ("gh", gh), ("dx", dx), ("dz", dz), ("h", h))}

def _row_ratios(kron: torch.Tensor, true: torch.Tensor, rows: np.ndarray) -> list[float]:
    """Quantiles 0, 0.1, 0.5, 0.9, 1 over `rows` of each row's sum of kron over true's."""
    r = (kron.sum(1) / true.sum(1))[torch.from_numpy(rows)].numpy()
    return [float(q) for q in np.quantile(r, [0.0, 0.1, 0.5, 0.9, 1.0])]


def cross(out: str, seed: int, trained_steps: list[int]) -> None:
    """Where the table's Fisher differs from the Kronecker terms, on 256 held-out windows after
    each of `trained_steps` steps of default K-FAC (0: the initialization; _use_gradients):
    the traces of E[g_l^2], E[g_h^2] and the cross term 2 E[g_l g_h] (every Kronecker variant
    drops it, `diagonal` keeps it), and per vocabulary row the ratio of the Kronecker term's
    diagonal (A_V[v] G_D[d, d], G_V[v] A_D[d, d]) to the true one (quantiles over the rows of
    tokens that occur; the five most frequent tokens)."""
    train, held = spikes.windows()
    res = {}
    for steps_done in trained_steps:
        module = gpt(vocab=256, seq_len=T, d_model=128, n_layer=2, n_head=4, seed=seed).eval()
        if steps_done:
            tr = trainer("diagonal", seed, train)
            for s in range(steps_done):
                idx = batch_indices(len(train), BS, s, seed)
                tr.step({"input": train[idx, :-1]}, train[idx, 1:])
            kt.load_trained(module, tr)
        g = _use_gradients(module, held)
        gl, gh, n = g["gl"], g["gh"], len(held)
        ll, hh, lh = (gl * gl).mean(0), (gh * gh).mean(0), 2 * (gl * gh).mean(0)
        counts = np.bincount(held[:, :-1].reshape(-1), minlength=256)
        # the Kronecker terms' diagonals: A_V[v] G_D[d, d] and G_V[v] A_D[d, d]
        kl = torch.from_numpy(counts / counts.sum())[:, None] * (g["dx"] ** 2).sum((0, 1))[None, :] / n
        kh = ((g["dz"] ** 2).sum((0, 1)) / n)[:, None] * (g["h"] ** 2).mean((0, 1))[None, :]
        seen = counts > 0

        top = np.argsort(-counts)[:5]
        row = {"trace_lookup": float(ll.sum()), "trace_head": float(hh.sum()), "trace_cross": float(lh.sum()),
               "kron_over_true_trace": [float(kl.sum() / ll.sum()), float(kh.sum() / hh.sum())],
               "kron_over_true_rows_q0_10_50_90_100": {"lookup": _row_ratios(kl, ll, seen),
                                                       "head": _row_ratios(kh, hh, seen)},
               "top_tokens": [int(t) for t in top],
               "top_rows_kron_over_true_lookup": [float(kl[t].sum() / ll[t].sum()) for t in top],
               "top_rows_cross_over_terms": [float(lh[t].sum() / (ll[t].sum() + hh[t].sum())) for t in top],
               "seen_rows": int(seen.sum())}
        res[steps_done] = row
        print(steps_done, json.dumps(row), flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


def lstm(out: str, seeds: list[int], approx: str) -> None:
    """Default K-FAC with `approximations: {embedding: APPROX}` on 2026-11-30-lstm-to-target's
    byte LM (an untied Embedding(256, 64) -> LSTM(256)): held-out loss every 25 steps until the
    seed's target there (tuned torch AdamW's 1,000-step loss) or 1,000 steps."""
    import io

    import onnx

    lt = importlib.import_module("2026-11-30-lstm-to-target")
    targets = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "2026-11-30-lstm-to-target.json")))
    train, held = lt.windows()
    buf = io.BytesIO()
    torch.onnx.export(lt.fresh_net(), (torch.zeros((lt.BS, lt.T), dtype=torch.int64),), buf, input_names=["tokens"],
                      output_names=["logits"], dynamo=False, dynamic_axes={"tokens": {0: "N"}, "logits": {0: "N"}})
    plan = kfac_compiler.compile(onnx.load_from_string(buf.getvalue()), loss="softmax_cross_entropy", output="logits",
                                 config={"approximations": {"embedding": approx}})
    results = json.load(open(out)) if os.path.exists(out) else {}
    for seed in seeds:
        target = targets["steps"][str(seed)]["target"]
        curve = lt.ours_run(plan, train, held, 1000, seed, target, optimizer="kfac")
        results[f"{approx}/{seed}"] = {"target": target, "curve": curve,
                                       "steps": len(curve) * lt.EVERY if curve[-1] <= target else None}
        print(approx, seed, results[f"{approx}/{seed}"]["steps"], flush=True)
        with open(out, "w") as f:
            json.dump(results, f, indent=1)


def trainer(approx: str, seed: int, train: np.ndarray) -> Trainer:
    path = os.path.join(tempfile.mkdtemp(), "gpt.onnx")
    kt.export(gpt(vocab=256, seq_len=T, d_model=128, n_layer=2, n_head=4, seed=seed).eval(),
              (torch.from_numpy(train[:2, :-1]),), path)
    if approx == "adam":
        return Trainer(kfac_compiler.compile(path, loss="softmax_cross_entropy"), optimizer="adam",
                       learning_rate=1e-3, seed=seed)
    plan = kfac_compiler.compile(path, loss="softmax_cross_entropy",
                                 config={"approximations": {"tied_embedding": approx}})
    return Trainer(plan, optimizer="kfac", seed=seed, **json.loads(os.environ.get("KFAC_KNOBS", "{}")))


def steps(out: str, seeds: list[int], approxes: list[str]) -> None:
    train, held = spikes.windows()
    results = json.load(open(out)) if os.path.exists(out) else {}
    for approx in approxes:
        for seed in seeds:
            tr, held_losses, batch, rejected, t0 = trainer(approx, seed, train), [], [], 0, time.time()
            for s in range(STEPS):
                idx = batch_indices(len(train), BS, s, seed)
                m = tr.step({"input": train[idx, :-1]}, train[idx, 1:])
                batch.append(float(m["loss"]) / T)
                rejected += int(m.get("rejected", 0))
                if (s + 1) % 50 == 0:
                    held_losses.append(float(tr.evaluate({"input": held[:, :-1]}, held[:, 1:])["loss"]) / T)
            results[f"{approx}/{seed}"] = {"held": held_losses, "max_batch_after_100": max(batch[100:]),
                                           "rejected": rejected, "seconds": time.time() - t0}
            print(approx, seed, [round(h, 3) for h in held_losses], f"max batch {max(batch[100:]):.3f}",
                  f"rejected {rejected}", f"{time.time() - t0:.0f} s", flush=True)
            with open(out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "check":
        check()
    elif cmd == "bench":
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        bench = importlib.import_module("bench_to_target")
        sys.exit(bench.harness.main(bench.parser(), "to-target", sys.argv[2:]))
    elif cmd == "cross":
        cross(sys.argv[2], int(sys.argv[3]), [int(s) for s in sys.argv[4].split(",")])
    elif cmd == "lstm":
        lstm(sys.argv[2], [int(x) for x in sys.argv[3].split(",")], sys.argv[4])
    else:
        steps(sys.argv[2], [int(s) for s in sys.argv[3].split(",")], sys.argv[4:])
