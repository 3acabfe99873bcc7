"""Save the update_statistics graphs of small_cnn and transformer_block to OUT: with `base`,
from the tree at /tmp/sn/base (a `git archive e063e80`) instead of this checkout, by pointing
the editable install's paths there (2026-11-29-kfac-stats-nodes.md).

    python 2026-11-29-kfac-stats-nodes-emit.py OUT [base]
"""
import os
import sys
import warnings

import onnx

out = sys.argv[1]
if len(sys.argv) > 2 and sys.argv[2] == "base":
    import __editable___kfac_compiler_0_1_0_finder as finder  # the venv's editable install

    for key, path in list(finder.MAPPING.items()):
        finder.MAPPING[key] = path.replace("/work/wt-statsnodes", "/tmp/sn/base")

import kfac_compiler as kc  # noqa: E402
from kfac_compiler.backend import emit_subgraph  # noqa: E402
from kfac_compiler.models import ZOO  # noqa: E402

os.makedirs(out, exist_ok=True)
for name in ["small_cnn", "transformer_block"]:
    e = ZOO[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = kc.compile(e.build(seed=0), loss=e.loss, output=e.output_name, emit=False)
    model, _ = emit_subgraph(plan, "update_statistics")
    onnx.save(model, f"{out}/{name}.onnx")
print(kc.__file__)
