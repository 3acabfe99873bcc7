"""The CUDA path against the CPU: the same plan trained on both devices follows the same
trajectory, the state stays on the GPU, and checkpoints move between devices.

Every test here needs a working CUDA execution provider (onnxruntime-gpu with its CUDA
libraries and a GPU) and is skipped with the probe's reason otherwise; the torch exports also
need torch. The CPU and the GPU differ in summation order (cuBLAS, cuDNN), so trajectories
agree to float32 rounding amplified over a few steps, not bit for bit; K-FAC's default inverse
method ("auto") is the emitted "schur" on both.
"""
from __future__ import annotations

import numpy as np
import pytest

import kfac_compiler as kc
from kfac_compiler import contract as C
from kfac_compiler import linalg
from kfac_compiler.models import ZOO
from kfac_compiler.runtime import Curvature, Trainer
from kfac_compiler.runtime.checkpoint import stored_state
from kfac_compiler.runtime.device import CUDA_EP, PROFILE_ENV, cuda_status
from kfac_compiler.runtime.ort_profile import read_profile

_OK, _WHY = cuda_status()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not _OK, reason=f"CUDA does not work here: {_WHY}")]

STEPS = 6


def zoo_plan(name):
    e = ZOO[name]
    inputs, y = e.make_data(n=512, seed=0)
    return kc.compile(e.build(seed=0), loss=e.loss, output="logits", emit=False), inputs, y


def batch(inputs, y, step, bs):
    idx = np.random.default_rng([3, step]).choice(len(y), bs, replace=False)
    return {k: v[idx] for k, v in inputs.items()}, y[idx]


def trajectory(plan, inputs, y, device, optimizer, steps=STEPS, bs=64, **knobs):
    """(losses, final parameters, initial parameters, trainer) of `steps` steps."""
    tr = Trainer(plan, optimizer=optimizer, device=device, seed=0, batch_size=bs, **knobs)
    if device == "cuda":
        assert all(p.session.get_providers()[0] == CUDA_EP for p in tr.programs().values())
    start = tr.parameters()
    losses = [tr.step(*batch(inputs, y, s, bs))["loss"] for s in range(steps)]
    return np.array(losses), tr.parameters(), start


def assert_same_trajectory(cpu, gpu, loss_rtol, move_rtol):
    """Losses agree to loss_rtol; the parameters' distance between the devices is at most
    move_rtol of the distance they moved (over all parameters: a parameter whose gradient is
    zero in exact arithmetic, such as a key bias under softmax, moves by rounding alone, and
    K-FAC's inverse amplifies it, so no per-parameter bound holds)."""
    np.testing.assert_allclose(gpu[0], cpu[0], rtol=loss_rtol, atol=1e-5)
    names = sorted(cpu[1])
    flat = {d: np.concatenate([r[1][k].ravel() for k in names]).astype(np.float64) for d, r in (("cpu", cpu), ("gpu", gpu))}
    moved = np.linalg.norm(flat["cpu"] - np.concatenate([cpu[2][k].ravel() for k in names]))
    apart = np.linalg.norm(flat["gpu"] - flat["cpu"])
    assert apart <= move_rtol * moved, f"devices {apart:.3g} apart after moving {moved:.3g}"


@pytest.mark.parametrize("optimizer", ["kfac", "adam", "sgd"])
@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_trajectories_agree(name, optimizer):
    plan, inputs, y = zoo_plan(name)
    cpu = trajectory(plan, inputs, y, "cpu", optimizer)
    gpu = trajectory(plan, inputs, y, "cuda", optimizer)
    assert_same_trajectory(cpu, gpu, loss_rtol=2e-3, move_rtol=2e-2)


def test_curvature_factors_agree():
    plan, inputs, y = zoo_plan("small_cnn")
    xb, yb = batch(inputs, y, 0, 64)
    stats = {d: Curvature(plan, device=d).estimate(xb, yb, mode="empirical") for d in ("cpu", "cuda")}
    for layer, factors in stats["cpu"].items():
        for f, v in factors.items():
            np.testing.assert_allclose(stats["cuda"][layer][f], v, rtol=1e-3, atol=1e-5 * float(np.abs(v).max()))


def test_inverses_are_computed_on_the_gpu():
    """The default ("auto") inverse method on CUDA is emitted ("schur"), run by the CUDA
    provider: no block is inverted on the host, and the inverses match numpy's."""
    plan, inputs, y = zoo_plan("mlp_classifier")
    tr = Trainer(plan, optimizer="kfac", device="cuda", seed=0, batch_size=64)
    assert tr.inverse_method == "schur"
    damping = tr.damping + tr.config.l2_reg
    tr.step(*batch(inputs, y, 0, 64))
    assert not tr.policy.refresher.host_layers and not tr.policy.refresher.fallbacks
    st = tr.state()
    for layer in ("fc1", "fc2", "fc3"):
        A, G = st[f"factor/{layer}/A"].astype(np.float64), st[f"factor/{layer}/G"].astype(np.float64)
        dA, dG = linalg.np_damping_split(A, G, damping)
        for M, d, inv in ((A, dA, st[f"inverse/{layer}/A_inv"]), (G, dG, st[f"inverse/{layer}/G_inv"])):
            want = np.linalg.inv(M + float(d) * np.eye(len(M)))
            assert np.linalg.norm(inv - want) <= 1e-3 * np.linalg.norm(want), layer


@pytest.mark.parametrize("name", ["mlp_classifier", "small_cnn", "transformer_block"])
def test_steady_step_moves_only_the_batch(tmp_path, name, monkeypatch):
    """Per steady-state K-FAC step the runtime uploads the batch, the sampled-Fisher noise and
    changed hp scalars, and ONNX Runtime copies no tensor between host and device beyond
    scalars (no factor, inverse or parameter leaves the GPU)."""
    plan, inputs, y = zoo_plan(name)
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "prof"))
    tr = Trainer(plan, optimizer="kfac", device="cuda", seed=0, batch_size=64)
    monkeypatch.delenv(PROFILE_ENV)
    for s in range(3):
        tr.step(*batch(inputs, y, s, 64))
    b0 = tr.store.upload_bytes
    for s in range(3, 3 + STEPS):
        tr.step(*batch(inputs, y, s, 64))
    uploaded = (tr.store.upload_bytes - b0) / STEPS
    # the step's data inputs: the batch, its targets and the noise of the sampled Fisher
    data = sum(tr.store.data(n).numpy().nbytes for n in tr.policy.step_program().data_inputs)
    assert data <= uploaded <= data + 16 * 4  # + a few changed hp scalars
    for label, prog in tr.programs().items():
        prof = read_profile(prog.session.end_profiling())
        if not prof.runs:
            continue
        per_run = prof.copy_bytes() / prof.runs
        assert per_run <= 256, (label, prof.copies, prof.cpu_nodes)


def test_checkpoint_moves_between_devices(tmp_path):
    """K-FAC's step multi-tensor on CUDA (one flat velocity/*), per parameter on the CPU (the
    default on both): the checkpoint stores the per-parameter slots, which both resume."""
    plan, inputs, y = zoo_plan("mlp_classifier")
    tr = Trainer(plan, optimizer="kfac", device="cuda", seed=0, batch_size=64, multi_tensor=True)
    assert C.flat(C.VELOCITY) in tr.store
    for s in range(3):
        tr.step(*batch(inputs, y, s, 64))
    path = tr.save_checkpoint(tmp_path / "ck.npz")
    on_cpu = Trainer.load_checkpoint(path, plan, device="cpu", batch_size=64)
    on_gpu = Trainer.load_checkpoint(path, plan, device="cuda", batch_size=64)
    assert C.velocity(tr.params[0]) in on_cpu.store
    for k, v in stored_state(on_gpu).items():
        np.testing.assert_array_equal(stored_state(on_cpu)[k], v)
    losses = {d: [t.step(*batch(inputs, y, s, 64))["loss"] for s in range(3, 6)] for d, t in
              (("cpu", on_cpu), ("cuda", on_gpu))}
    np.testing.assert_allclose(losses["cuda"], losses["cpu"], rtol=1e-3)


def test_adam_checkpoint_moves_between_devices_and_update_layouts(tmp_path):
    """Adam's update multi-tensor on CUDA (flat moment slots), per parameter on the CPU (the
    default on both): a checkpoint of one resumes on the other."""
    plan, inputs, y = zoo_plan("mlp_classifier")
    tr = Trainer(plan, optimizer="adam", device="cuda", seed=0, batch_size=64, multi_tensor=True)
    assert C.flat(C.ADAM_M) in tr.store
    for s in range(3):
        tr.step(*batch(inputs, y, s, 64))
    path = tr.save_checkpoint(tmp_path / "ck.npz")
    on_cpu = Trainer.load_checkpoint(path, plan, device="cpu", batch_size=64)
    assert C.adam_m(tr.params[0]) in on_cpu.store
    for k, v in stored_state(tr).items():
        np.testing.assert_array_equal(stored_state(on_cpu)[k], v)
    losses = {d: [t.step(*batch(inputs, y, s, 64))["loss"] for s in range(3, 6)] for d, t in
              (("cpu", on_cpu), ("cuda", tr))}
    np.testing.assert_allclose(losses["cuda"], losses["cpu"], rtol=1e-3)


# ----------------------------------------------------------------------------- torch exports
@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "gpt"])
def test_exported_model_trajectories_agree(tmp_path, name):
    pytest.importorskip("torch")
    from kfac_compiler.models import torch_exports as te

    if name == "resnet18":
        net, (inputs, y) = te.resnet18(), te.digits_images(256)
    else:
        net, (inputs, y) = te.gpt(), te.digits_sequences(256)
    path = te.export(net, str(tmp_path / f"{name}.onnx"), inputs["input"][:2])
    plan = kc.compile(path, loss="softmax_cross_entropy", output="logits", emit=False)
    for optimizer in ("kfac", "adam"):
        cpu = trajectory(plan, inputs, y, "cpu", optimizer, steps=4, bs=32)
        gpu = trajectory(plan, inputs, y, "cuda", optimizer, steps=4, bs=32)
        assert_same_trajectory(cpu, gpu, loss_rtol=5e-3, move_rtol=5e-2)


@pytest.mark.parametrize("optimizer,reference", [("kfac", {"static_steps": True}), ("adam", {})])
def test_cuda_graphs_follow_the_uncaptured_steps(optimizer, reference):
    """cuda_graphs: the step sessions are made with ONNX Runtime's CUDA graph capture, record
    their kernels on a binding's second run and replay them after; the trajectory is the
    uncaptured static graphs' (K-FAC) or the dynamic graph's (Adam) to rounding, with every
    step kind's buffers bound once per parity."""
    plan, inputs, y = zoo_plan("small_cnn")
    ref = trajectory(plan, inputs, y, "cuda", optimizer, steps=8, **reference)
    tr = Trainer(plan, optimizer=optimizer, device="cuda", seed=0, batch_size=64, cuda_graphs=True)
    start = tr.parameters()
    losses = [tr.step(*batch(inputs, y, s, 64))["loss"] for s in range(8)]
    assert_same_trajectory(ref, (np.array(losses), tr.parameters(), start), loss_rtol=1e-4, move_rtol=1e-3)
    steps = [p for p in tr.programs().values() if getattr(p, "capture", False)]
    assert steps, "no step session was made for capture"
    for prog in steps:
        assert prog.session.get_provider_options()[CUDA_EP]["enable_cuda_graph"] == "1"
        # one graph per parity of the state buffers it binds, not one per step
        assert 1 <= len(prog._graph_ids) <= 4, prog.name
