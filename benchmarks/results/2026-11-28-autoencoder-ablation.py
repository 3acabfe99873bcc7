"""Steps of default K-FAC (and one knob changed) to tuned Adam's 1000-step loss on the digits
autoencoder (batch 256; the loss on all 1797 digits every 5 steps).

    python benchmarks/results/2026-11-28-autoencoder-ablation.py '{}' '{"damping": 0.01}' ...
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_to_target as bt  # noqa: E402

TARGET = 14.32364  # tuned Adam (lr 3e-3) after 1000 steps: 2026-11-28-to-target-digits.md
plan, x, y = bt.zoo_case("digits_autoencoder")
for knobs in [json.loads(a) for a in sys.argv[1:]]:
    r = bt.train(plan, x, y, 256, "kfac", 300, targets=[TARGET], **knobs)
    print(knobs, "steps", r.hit(TARGET)[0], f"final {r.loss:.4f}", flush=True)
