"""The external references the benchmarks run beside our runtime: torch's Adam and
kfac-pytorch (KFACPreconditioner + SGD) on the same torch module as the export.

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


def torch_setup(net, device: str, optimizer: str, periods: tuple[int, int], skip_layers=(), kfac_path=None):
    """(module on the device, torch optimizer, kfac-pytorch preconditioner or None, device)."""
    import torch

    dev = torch.device("cuda" if device == "cuda" else "cpu")
    net = net.to(dev)
    net.train()
    for m in net.modules():  # the exported function: running statistics, no dropout
        if isinstance(m, (torch.nn.modules.batchnorm._BatchNorm, torch.nn.Dropout)):
            m.eval()
    pre = None
    if optimizer == "adam":
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
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
