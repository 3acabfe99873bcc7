"""kfac_compiler.runtime: execute a compiled plan with ONNX Runtime (CPU or CUDA).

    from kfac_compiler.runtime import Trainer, Curvature, gradients
    trainer = Trainer(plan, optimizer="kfac", device="auto")
    metrics = trainer.step({"input": x}, targets=y)

Layers (docs/runtime.md):
  device.py      resolve_device / get_device: providers, a cached CUDA probe (no silent fallback)
  state.py       StateStore: double-buffered device state, pre-allocated data, hp scalars
  program.py     Program: one session per subgraph, IOBinding driven by the contract's info
  fit.py         fit(): the API's loop with held-out evaluation and early stopping; batches(): the CLI's batches
  trainer.py     Trainer: the training loop's step(), evaluate(), export(), checkpoints, for
                 any optimizer plugin (kfac_compiler.optimizers: settings, graphs, policies)
  inverses.py    InverseRefresher: emitted and host-side inverse refreshes
  curvature.py   Curvature and gradients(): the lower-level API
  checkpoint.py  atomic .npz checkpoints with a plan fingerprint
  data.py        batch checks, host noise, datasets for the CLI
  ort_profile.py what ONNX Runtime ran where (KFAC_ORT_PROFILE)
  static_shapes.py a graph's symbolic dims fixed to one batch's (K-FAC's static_steps)
  capture.py     capture_blockers(): what would stop CUDA graph capture of a graph
"""
from __future__ import annotations

from kfac_compiler.optimizers import AdamConfig, KfacConfig, SgdConfig, make_config
from kfac_compiler.runtime.curvature import Curvature, gradients
from kfac_compiler.runtime.device import cuda_available, get_device, resolve_device
from kfac_compiler.runtime.fit import History, batches, fit
from kfac_compiler.runtime.program import ContractError, Program
from kfac_compiler.runtime.state import StateStore
from kfac_compiler.runtime.trainer import Trainer

__all__ = [
    "AdamConfig", "ContractError", "Curvature", "History", "KfacConfig", "Program", "SgdConfig", "StateStore",
    "Trainer", "batches", "cuda_available", "fit", "get_device", "gradients", "make_config", "resolve_device",
]
