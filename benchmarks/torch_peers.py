"""The external references the benchmarks run beside our runtime: torch's Adam and
kfac-pytorch (KFACPreconditioner + SGD) on the same torch module as the export, and torch
twins of zoo models (the same function with the same weights) for the zoo's peers.

kfac-pytorch is not on PyPI: point `--kfac-pytorch PATH` (or the KFAC_PYTORCH environment
variable) at a directory holding its `kfac` package; without one the peer is skipped with a
note. The module trains in train mode with BatchNorm and Dropout in eval mode, so it computes
the function the export computes (BatchNorm on its running statistics, no dropout) while
kfac-pytorch's hooks, which only record in train mode, still see every layer.
"""
from __future__ import annotations

import os
import sys
import time

KFAC_PYTORCH_ENV = "KFAC_PYTORCH"
PEERS = ("torch_adam", "kfac_pytorch", "kfac_jax")


def peer_missing(peer: str, kfac_path: str | None = None) -> str | None:
    """Why `peer` cannot run here (one line), or None when it can."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (pip install torch)"
    if peer == "kfac_pytorch":
        found = kfac_pytorch_path(kfac_path)
        if not found and importlib.util.find_spec("kfac") is None:
            return "no --kfac-pytorch PATH or $KFAC_PYTORCH with its `kfac` package (it is not on PyPI)"
        try:  # its kfac/__init__.py asks for its own installed version: a bare checkout fails there
            importlib.metadata.version("kfac-pytorch")
        except importlib.metadata.PackageNotFoundError:
            return f"kfac-pytorch is not installed, and its package reads its installed version at import: " \
                   f"pip install --no-deps {found or 'DIR'}"
    if peer == "kfac_jax":
        if importlib.util.find_spec("kfac_jax") is None:
            return "kfac-jax is not installed"
        return "kfac-jax is installed, but no benchmark runs it yet (the twins are torch modules)"
    return None


def kfac_pytorch_path(path: str | None = None) -> str | None:
    """The directory to import kfac-pytorch from (the argument, else $KFAC_PYTORCH), or None
    when neither names a directory with a `kfac` package."""
    path = path or os.environ.get(KFAC_PYTORCH_ENV)
    if path and os.path.isfile(os.path.join(path, "kfac", "__init__.py")):
        return os.path.abspath(path)
    return None


def import_kfac_pytorch(path: str | None = None):
    """KFACPreconditioner from `path` (see kfac_pytorch_path) or an importable `kfac`."""
    found = kfac_pytorch_path(path)
    if found and found not in sys.path:
        sys.path.insert(0, found)
    from kfac.preconditioner import KFACPreconditioner

    return KFACPreconditioner


def torch_setup(net, device: str, optimizer: str, periods: tuple[int, int], skip_layers=(), kfac_path=None,
                lr: float = 1e-3):
    """(module on the device, torch optimizer, kfac-pytorch preconditioner or None, device);
    `lr` is Adam's."""
    import torch

    dev = torch.device("cuda" if device == "cuda" else "cpu")
    net = net.to(dev)
    net.train()
    for m in net.modules():  # the exported function: running statistics, no dropout
        if isinstance(m, (torch.nn.modules.batchnorm._BatchNorm, torch.nn.Dropout)):
            m.eval()
    pre = None
    if optimizer == "adam":
        opt = torch.optim.Adam(net.parameters(), lr=lr)
    elif optimizer == "kfac":
        KFACPreconditioner = import_kfac_pytorch(kfac_path)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        pre = KFACPreconditioner(net, factor_update_steps=periods[0], inv_update_steps=periods[1], lr=0.1,
                                 damping=0.003, skip_layers=list(skip_layers) or None)
    else:
        raise ValueError(f"unknown torch peer {optimizer!r}; choose adam or kfac")
    return net, opt, pre, dev


def torch_loss(out, t):
    """Our convention: the mean over the batch; an LM's loss summed over positions."""
    import torch

    if out.dim() == 3:
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1),
                                                 reduction="sum") / out.shape[0]
    return torch.nn.functional.cross_entropy(out, t)


def torch_step(net, opt, pre, xb, yb):
    opt.zero_grad(set_to_none=True)
    loss = torch_loss(net(xb), yb)
    loss.backward()
    if pre is not None:
        pre.step()
    opt.step()
    return loss


def timed_torch_step(net, opt, pre, dev, xb, yb) -> tuple[float, float]:
    """(wall seconds, loss) of one step; the host reads the loss back, as ours does."""
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = float(torch_step(net, opt, pre, xb, yb).item())
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, loss


def full_loss_torch(net, dev, x, y, batch: int = 512) -> float:
    import torch

    with torch.no_grad():
        total = 0.0
        for s in range(0, len(y), batch):
            xb = torch.from_numpy(x[s:s + batch]).to(dev)
            yb = torch.from_numpy(y[s:s + batch]).to(dev)
            total += float(torch_loss(net(xb), yb)) * len(yb)
    return total / len(y)


# ------------------------------------------------------------------------------ zoo twins
def small_cnn_twin(model, channels=(8, 16)):
    """The zoo's small CNN (models/cnn.py) as a torch module with the ONNX model's weights."""
    import torch
    from onnx import numpy_helper

    weights = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in model.graph.initializer}
    c1, c2 = channels

    class Twin(torch.nn.Module):  # Conv3x3-Relu-MaxPool2-Conv3x3-Relu-GAP-Gemm, as build_small_cnn
        def __init__(self):
            super().__init__()
            self.conv1 = torch.nn.Conv2d(1, c1, 3, padding=1)
            self.conv2 = torch.nn.Conv2d(c1, c2, 3, padding=1)
            self.fc = torch.nn.Linear(c2, 10)

        def forward(self, x):
            x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
            return self.fc(torch.relu(self.conv2(x)).mean((2, 3)))

    twin = Twin()
    twin.load_state_dict(weights)
    return twin


def gemm_chain_twin(model):
    """An ONNX chain of Gemm (transB=1) and Relu/Tanh/Sigmoid nodes as nn.Sequential with the
    same weights (the zoo's mlp_classifier); None for any other graph."""
    import torch
    from onnx import numpy_helper

    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    acts = {"Relu": torch.nn.ReLU, "Tanh": torch.nn.Tanh, "Sigmoid": torch.nn.Sigmoid}
    layers = []
    for node in model.graph.node:
        if node.op_type in acts:
            layers.append(acts[node.op_type]())
            continue
        attrs = {a.name: a.i for a in node.attribute}
        if node.op_type != "Gemm" or attrs.get("transB") != 1 or attrs.get("transA", 0) or len(node.input) != 3:
            return None
        w, b = inits[node.input[1]], inits[node.input[2]]
        lin = torch.nn.Linear(w.shape[1], w.shape[0])
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(w.copy()))
            lin.bias.copy_(torch.from_numpy(b.copy()))
        layers.append(lin)
    return torch.nn.Sequential(*layers)


def zoo_twin(name: str, model, loss: str):
    """(torch twin of zoo model `name` with `model`'s weights, None) or (None, why not)."""
    if loss != "softmax_cross_entropy":
        return None, f"no torch twin for {loss} (the peers compute softmax cross-entropy)"
    if name == "small_cnn":
        return small_cnn_twin(model), None
    twin = gemm_chain_twin(model)
    return (twin, None) if twin is not None else (None, f"no torch twin of {name}'s graph")
