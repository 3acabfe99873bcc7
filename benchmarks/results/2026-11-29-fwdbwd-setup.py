"""Issue 40 item 5: where an Adam plan's setup goes (compile, emission of adam_step, ONNX
Runtime's session) and the step graph's nodes, for LeNet-5 and the unrolled LSTM byte LM of
2026-11-29-fwdbwd-profile.py.

    python benchmarks/results/2026-11-29-fwdbwd-setup.py lenet5|lstm
"""
from __future__ import annotations

import collections
import importlib.util
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
_spec = importlib.util.spec_from_file_location("fwdbwd_profile", os.path.join(os.path.dirname(__file__),
                                                                             "2026-11-29-fwdbwd-profile.py"))
prof = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prof)


def main():
    import onnxruntime as ort

    import kfac_compiler
    from kfac_compiler.backend.registry import emit_subgraph
    from kfac_compiler.runtime.device import session_options
    print("kfac_compiler from", os.path.dirname(kfac_compiler.__file__), file=sys.stderr)
    t0 = time.perf_counter()
    plan, *_ = {"lenet5": prof.lenet5, "lstm": prof.lstm}[sys.argv[1]]()
    t1 = time.perf_counter()
    model, _ = emit_subgraph(plan, "adam_step")
    t2 = time.perf_counter()
    so = session_options(threads=1)
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    t3 = time.perf_counter()
    ops = collections.Counter(n.op_type for n in model.graph.node)
    print(f"{sys.argv[1]}: compile (incl. export) {t1 - t0:.2f} s, emit adam_step {t2 - t1:.2f} s, "
          f"ORT session {t3 - t2:.2f} s; adam_step nodes {len(model.graph.node)}")
    print("  top ops:", ", ".join(f"{k} {v}" for k, v in ops.most_common(14)))
    del sess


if __name__ == "__main__":
    main()
