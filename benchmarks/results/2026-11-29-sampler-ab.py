"""Steps to tuned Adam's 500/1000-step losses on the digits classifier, per trainer seed, with
the sampled targets drawn by inverse CDF (main) or Gumbel-max (the code before 3df597f patched in)."""
import json, sys
sys.path.insert(0, "benchmarks")
import numpy as np
import bench_to_target as bt
from kfac_compiler.losses.softmax_cross_entropy import SoftmaxCrossEntropy as S

new = (S.emit_sampled_grad, S.noise_shape)

def gumbel(self, b, z, noise):
    g = b.neg(b.op("Log", [b.neg(b.op("Log", [noise]))]))
    perturbed = b.add(z, g)
    top = b.reduce("ReduceMax", perturbed, [-1], keepdims=True)
    onehot = b.cast(b.op("Equal", [perturbed, top]), b.float_type)
    return b.sub(b.op("Softmax", [z], axis=-1), onehot)

model, bs, targets, seeds, steps = sys.argv[1], int(sys.argv[2]), [float(t) for t in sys.argv[3].split(",")], int(sys.argv[4]), int(sys.argv[5])
out = {"gumbel": [], "inverse_cdf": []}
for seed in range(seeds):
    for arm in ("gumbel", "inverse_cdf"):
        if arm == "gumbel":
            S.emit_sampled_grad, S.noise_shape = gumbel, lambda self, shape: tuple(shape)
        else:
            S.emit_sampled_grad, S.noise_shape = new
        plan, x, y = bt.zoo_case(model)
        r = bt.train(plan, x, y, bs, "kfac", steps, targets=targets, seed=seed)
        out[arm].append([r.hit(t)[0] for t in targets])
    print(seed, {k: v[-1] for k, v in out.items()}, flush=True)
for arm, v in out.items():
    a = np.array([[np.nan if s is None else s for s in row] for row in v], float)
    print(arm, "per seed", v, "median", np.nanmedian(a, axis=0).tolist(), "reached", (~np.isnan(a)).sum(0).tolist())
