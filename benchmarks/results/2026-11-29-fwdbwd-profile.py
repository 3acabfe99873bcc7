"""Issue 40 item 5: where one steady Adam step's time goes, by op type and by forward /
backward / update, from ONNX Runtime's profiler (shares are roughly load-independent); and
our Adam step against torch's on the same model and batch (wall time, interleaved rounds).

    python benchmarks/results/2026-11-29-fwdbwd-profile.py lenet5 [STEPS]
    python benchmarks/results/2026-11-29-fwdbwd-profile.py lstm [STEPS]   # byte LM, T=64, H=256, batch 32
    python benchmarks/results/2026-11-29-fwdbwd-profile.py time lenet5|lstm [ROUNDS] [STEPS] [THREADS]
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections import Counter, defaultdict

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def lenet5():
    import kfac_compiler as kc
    from models.cnn import build_lenet5
    plan = kc.compile(build_lenet5(seed=0), loss="softmax_cross_entropy", output="logits", emit=False)
    rng = np.random.default_rng(0)
    x = rng.random((128, 1, 28, 28), dtype=np.float32)
    y = rng.integers(0, 10, 128)
    return plan, {"input": x}, y, 128


def lstm_model(T=64, H=256, V=256, E=64):
    import torch
    from torch import nn

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, E)
            self.rnn = nn.LSTM(E, H, batch_first=True)
            self.out = nn.Linear(H, V)

        def forward(self, tokens):
            return self.out(self.rnn(self.emb(tokens))[0])
    torch.manual_seed(0)
    return LM(), torch.zeros((32, T), dtype=torch.int64)


def lstm(T=64):
    import io

    import onnx
    import torch

    import kfac_compiler as kc
    net, ex = lstm_model(T)
    buf = io.BytesIO()
    torch.onnx.export(net, (ex,), buf, input_names=["tokens"], output_names=["logits"], dynamo=False,
                      dynamic_axes={"tokens": {0: "N"}, "logits": {0: "N"}})
    t0 = time.perf_counter()
    plan = kc.compile(onnx.load_from_string(buf.getvalue()), loss="softmax_cross_entropy", output="logits", emit=False)
    print(f"compile {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (32, T)).astype(np.int64)
    y = rng.integers(0, 256, (32, T)).astype(np.int64)
    return plan, {"tokens": x}, y, 32


def phases(model) -> dict[str, str]:
    """Node name -> "forward" (the loss's ancestors), "update" (reads the optimizer's state or
    hyperparameters, directly or through other nodes) or "backward" (the rest: cotangents,
    the gradient norm)."""
    nodes = list(model.graph.node)
    producer = {o: n for n in nodes for o in n.output}
    fwd, stack = set(), ["loss"]
    while stack:
        n = producer.get(stack.pop())
        if n is not None and n.name not in fwd:
            fwd.add(n.name)
            stack.extend(n.input)
    tainted = {i.name for i in model.graph.input if i.name.startswith(("hp/", "adam_m/", "adam_v/"))}
    out = {}
    for n in nodes:  # topological order
        if n.name in fwd:
            out[n.name] = "forward"
        elif any(i in tainted for i in n.input):
            out[n.name] = "update"
            tainted.update(n.output)
        else:
            out[n.name] = "backward"
    return out


def torch_twin(name: str, plan_model=None):
    """(torch module with our initial weights, loss function) for `name`."""
    import torch
    from torch import nn
    if name == "lstm":
        net, _ = lstm_model()
        return net, lambda out, y: nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    from onnx import numpy_helper

    from models.cnn import build_lenet5

    class LeNet5(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = nn.Conv2d(1, 6, 5, padding=2), nn.Conv2d(6, 16, 5)
            self.fc1, self.fc2, self.fc3 = nn.Linear(400, 120), nn.Linear(120, 84), nn.Linear(84, 10)

        def forward(self, x):
            x = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
            x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2).flatten(1)
            return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))
    net = LeNet5()
    net.load_state_dict({t.name: torch.from_numpy(numpy_helper.to_array(t).copy())
                         for t in build_lenet5(seed=0).graph.initializer})
    return net, nn.functional.cross_entropy


def time_steps(name: str, rounds: int, steps: int, threads: int) -> None:
    """Our Adam step (Trainer.step, lr 1e-3) against torch.optim.Adam's (zero_grad, forward,
    backward, step) on the same batch, `threads` intra-op threads each: `rounds` interleaved
    blocks of `steps` steps after 10 warm-up steps; the median and range of the block means."""
    import torch

    from kfac_compiler.runtime import Trainer
    torch.set_num_threads(threads)
    plan, feeds, y, bs = {"lenet5": lenet5, "lstm": lstm}[name]()
    tr = Trainer(plan, optimizer="adam", device="cpu", batch_size=bs, seed=0, threads=threads, learning_rate=1e-3)
    net, loss_fn = torch_twin(name)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    tx, ty = torch.from_numpy(next(iter(feeds.values()))), torch.from_numpy(y)

    def ours():
        tr.step(feeds, y)

    def theirs():
        opt.zero_grad(set_to_none=True)
        loss_fn(net(tx), ty).backward()
        opt.step()
    res = {"ours": [], "torch": []}
    for fn in (ours, theirs):
        for _ in range(10):
            fn()
    for _ in range(rounds):
        for key, fn in (("ours", ours), ("torch", theirs)):
            time.sleep(0.1)
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            res[key].append((time.perf_counter() - t0) / steps * 1e3)
    med = {k: float(np.median(v)) for k, v in res.items()}
    for k, v in res.items():
        print(f"{name} {k}: median {med[k]:.2f} ms (range {min(v):.2f}-{max(v):.2f}) over {rounds} blocks of {steps}")
    print(f"{name}: ours / torch = {med['ours'] / med['torch']:.2f}x ({threads} threads each)")


def main():
    if sys.argv[1] == "time":
        a = sys.argv[2:] + [None] * 4
        return time_steps(a[0], int(a[1] or 10), int(a[2] or 20), int(a[3] or 2))
    name = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.runtime.device import PROFILE_ENV
    plan, feeds, y, bs = {"lenet5": lenet5, "lstm": lstm}[name]()
    from kfac_compiler.backend.registry import emit_subgraph
    model, _ = emit_subgraph(plan, "adam_step")
    phase_of = phases(model)
    os.environ[PROFILE_ENV] = os.path.join(tempfile.mkdtemp(), "prof")
    t0 = time.perf_counter()
    tr = Trainer(plan, optimizer="adam", device="cpu", batch_size=bs, seed=0, threads=1)
    tr.step(feeds, y)
    print(f"trainer setup + first step {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    for _ in range(steps):
        tr.step(feeds, y)
    tot_by_op, cnt_by_op, by_phase, by_node = Counter(), Counter(), Counter(), Counter()
    nodes_by_phase = defaultdict(set)
    for label, prog in tr.programs().items():
        with open(prog.session.end_profiling()) as f:
            events = json.load(f)
        runs = sum(1 for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
        if runs < steps:
            continue
        for e in events:
            if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
                continue
            nm, op = e["name"][:-len("_kernel_time")], e["args"]["op_name"]
            base = next((nm[:i] for i in [len(nm)] + [k for k, ch in enumerate(nm) if ch == "/"][::-1]
                         if nm[:i] in phase_of), None)
            phase = phase_of[base] if base is not None else "ORT-inserted"
            tot_by_op[op] += e["dur"]
            cnt_by_op[op] += 1
            by_phase[phase] += e["dur"]
            by_node[(op, nm)] += e["dur"]
            nodes_by_phase[phase].add(nm)
        print(f"session {label}: {runs} runs", file=sys.stderr)
    total = sum(tot_by_op.values())
    n = steps + 1
    print(f"{name}: {total / n / 1000:.2f} ms of kernels per step (profiled, 1 thread); adam_step nodes "
          f"{len(model.graph.node)} emitted, {sum(cnt_by_op.values()) / n:.0f} run by ORT")
    print("phase: share, distinct nodes")
    for ph, v in by_phase.most_common():
        print(f"  {ph}: {100 * v / total:.1f}%, {len(nodes_by_phase[ph])}")
    print("op type: share, nodes per step, us per step")
    for op, v in tot_by_op.most_common(25):
        print(f"  {op}: {100 * v / total:.1f}%, {cnt_by_op[op] / n:.0f}, {v / n:.0f}")
    print("top nodes: share, us per step")
    for (op, nm), v in by_node.most_common(25):
        print(f"  {op} {nm}: {100 * v / total:.1f}%, {v / n:.0f}")


if __name__ == "__main__":
    main()
