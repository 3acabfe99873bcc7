"""K-FAC with the quadratic model on the whole batch (the new default) against its 64-example
sub-batch (the old default): steps to tuned Adam's loss and interleaved step times."""
import sys, time
sys.path.insert(0, "benchmarks")
import numpy as np
import harness
harness.import_paths()
from bench_to_target import zoo_case, train, ours

TARGETS = {"digits_autoencoder": (256, 14.32364), "mlp_classifier": (128, 0.00017)}
for name, (bs, target) in TARGETS.items():
    plan, x, y = zoo_case(name)
    runs = {}
    for label, kw in (("whole", {}), ("q64", {"qmodel_batch_size": 64})):
        r = train(plan, x, y, bs, "kfac", 600, targets=[target], **kw)
        runs[label] = r.hit(target)[0]
    # interleaved step times
    steppers = {label: ours(plan, x, y, bs, "kfac", **kw)[0] for label, kw in (("whole", {}), ("q64", {"qmodel_batch_size": 64}))}
    times = {l: [] for l in steppers}
    k = {l: 0 for l in steppers}
    for l, s in steppers.items():
        for _ in range(20):  # warm up
            s(k[l]); k[l] += 1
    for rnd in range(5):
        for l, s in steppers.items():
            t0 = time.perf_counter()
            for _ in range(40):
                s(k[l]); k[l] += 1
            times[l].append((time.perf_counter() - t0) / 40 * 1e3)
    med = {l: float(np.median(v)) for l, v in times.items()}
    print(f"{name}: steps to target whole {runs['whole']} q64 {runs['q64']}; ms/step whole {med['whole']:.2f} "
          f"({min(times['whole']):.2f}-{max(times['whole']):.2f}) q64 {med['q64']:.2f} ({min(times['q64']):.2f}-{max(times['q64']):.2f}); "
          f"time to target whole/q64 {runs['whole'] * med['whole'] / (runs['q64'] * med['q64']):.2f}x" if runs['whole'] and runs['q64'] else f"{name}: {runs}")
