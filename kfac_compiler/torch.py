"""The torch bridge: an `nn.Module` to an ONNX file the compiler trains, and the trained values
back into the module (docs/torch.md). Needs torch (the optional extra `torch`); importing
kfac_compiler does not import this module.

    import kfac_compiler, kfac_compiler.torch as kt
    kt.export(net, (x,), "net.onnx")                  # ONNX file + parameter manifest
    plan = kfac_compiler.compile("net.onnx", loss="softmax_cross_entropy")
    trainer = kfac_compiler.Trainer(plan); trainer.step({"input": x}, y) ...
    kt.load_trained(net, trainer)                     # net's parameters (and BatchNorm statistics) trained

The manifest (metadata_props key `kfac_compiler.torch_manifest`, JSON) says for every float
initializer of the file what it is on the torch side:

    {"version": 1, "exporter": "dynamo", "torch_version": "2.x",
     "parameters": [torch parameter names], "buffers": [torch buffer names],
     "ties": {alias: parameter},           # the module's own ties (named_parameters duplicates)
     "initializers": {name: entry},
     "unmapped": [torch parameters in no initializer (unused, or folded into constants)]}

    entry: {"role": "parameter", "torch": P, "transposed": bool}            the parameter (or its transpose)
           {"role": "parameter", "torch": P, "transposed": false, "reshaped": true}  its values in another shape
           {"role": "parameter", "torch": P, "transposed": bool, "copy_of": I}  a second initializer of P (tied to I)
           {"role": "parameter", "blocks": [[P, src0, src1, d, dst0, dst1], ...]}  rows of P packed
                  (a fused LSTM/GRU/RNN weight: W[d, dst0:dst1] = P[src0:src1])
           {"role": "buffer", "torch": B}
           {"role": "constant"}                     not a torch tensor (a literal, a folded value)
           {"role": "ambiguous", "candidates": [...]}   equal to several torch tensors: the rule decides
    an entry may carry "merged": [Q, ...]: parameters the exporter merged into this initializer
    (equal values, no initializer of their own); they are trained as one and all get its value back;
    and "frozen": true where every torch parameter it holds has requires_grad=False: the compiler
    freezes it (passes/trainable.py), as torch's optimizers leave it.

A module over onnx_files.LAZY_EXTERNAL_BYTES (1 GiB) is written as path + path.data (external
data), and load_trained reads such a file tensor by tensor (docs/torch.md, "Models over 2 GB").

The mapping comes from the exporter's names where the initializer holds that torch tensor's
value, and from exact value equality (or its transpose, or row blocks of a recurrent module's
weights) otherwise; a tensor whose elements are all equal is matched by name only.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import onnx
from onnx import numpy_helper

from kfac_compiler import onnx_files
from kfac_compiler.atomic import temp_path
from kfac_compiler.contract import TORCH_MANIFEST_KEY
from kfac_compiler.errors import KfacError
from kfac_compiler.graph import fold_recurrent_params

try:
    import torch
    from torch import nn
except ImportError as e:  # pragma: no cover - exercised only without torch
    raise ImportError("kfac_compiler.torch needs torch (pip install 'kfac_compiler[torch]')") from e

MANIFEST_KEY = TORCH_MANIFEST_KEY
EXPORTERS = ("dynamo", "torchscript")
DEFAULT_EXPORTER = "dynamo"
_FLOAT = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
# the recurrent modules whose weights exporters pack (gate blocks of H rows, in ONNX's gate
# order: LSTM i,f,g,o -> i,o,f,c; GRU r,z,n -> z,r,h): matched block by block, by value
_RECURRENT = (nn.LSTM, nn.GRU, nn.RNN)
_RUNNING = ("running_mean", "running_var")


class BridgeError(KfacError):
    """A module, file or trained source the bridge cannot map (one line naming what)."""


# ------------------------------------------------------------------------------ export
def export(module: nn.Module, example_inputs: Any, path: str | os.PathLike, exporter: str | None = None,
           input_names: Sequence[str] | None = None, output_names: Sequence[str] | None = None,
           dynamic_batch: bool = True, opset: int | None = None) -> onnx.ModelProto:
    """Export `module` on `example_inputs` (a tensor, an array or a tuple of them) to `path`,
    with the parameter manifest in the model's metadata; returns the written model.

    exporter: "dynamo" (torch.export, the default: it keeps the torch names of parameters and
    buffers and merges no equal initializers; its graph optimizer is off, which would fold
    BatchNorm into the convolution weights under their names) or "torchscript". The module is
    exported in its current mode (module.train() / eval() per submodule; the TorchScript
    exporter preserves each). Names default to input, input_1, ... and logits, output_1, ...
    dynamic_batch: the first axis of every input and output is a symbolic N.
    """
    exporter = exporter or DEFAULT_EXPORTER
    if exporter not in EXPORTERS:
        raise BridgeError(f"exporter must be one of {', '.join(EXPORTERS)}, got {exporter!r}")
    for name, m in module.named_modules():  # torch's cumulative average has no ONNX form
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats \
                and m.momentum is None:
            raise BridgeError(f"BatchNorm {name!r} has momentum=None (a cumulative average of the batches' "
                              "statistics), which ONNX's BatchNormalization cannot express; give it a momentum "
                              "(e.g. 0.1) or export it in eval mode")
    _check_embeddings(module)
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    args = tuple(torch.from_numpy(np.asarray(a)) if not isinstance(a, torch.Tensor) else a for a in args)
    ins = list(input_names) if input_names else ["input" if i == 0 else f"input_{i}" for i in range(len(args))]
    path = os.fspath(path)
    # a large module goes through a file with external data (protobuf holds 2 GiB at most),
    # written by the exporter into a folder of ours beside `path`
    folder = temp_path(path + ".export") if _state_bytes(module) > onnx_files.LAZY_EXTERNAL_BYTES else None
    try:
        model = _exported(module, args, ins, output_names, exporter, dynamic_batch, opset, folder)
        manifest = build_manifest(module, model, exporter)
        _running_statistics(module, model, manifest)
        _batch_statistics(module, model, manifest)
        set_manifest(model, manifest)
        values: dict[str, np.ndarray] = {}
        if onnx_files.stored_bytes(model) > onnx_files.LAZY_EXTERNAL_BYTES:  # what the exporter held in memory
            values = {t.name: onnx_files.tensor_array(t) for t in model.graph.initializer if not onnx_files.on_disk(t)}
        if not onnx_files.needs_external(model, values):
            onnx.save(model, path)
            return model
        from kfac_compiler.runtime.checkpoint import write_with_external_data

        write_with_external_data(path, model, values, what="the exported model")
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    return onnx_files.load_onnx(path)  # its values left in path + ".data"


def _check_embeddings(module: nn.Module) -> None:
    """Embedding options whose training semantics ONNX's Gather cannot carry: max_norm
    (torch renormalizes the weight's rows in place during the forward, without a gradient:
    TorchScript dropped it, torch.export differentiated through it, and the export's own
    forward renormalized the module's weight) and scale_grad_by_freq (each row's gradient
    divided by its token's count in the batch) are refused; padding_idx (a row whose gradient
    torch keeps at 0) is a warning: here that row trains from what reaches it, nothing where
    the padded positions are masked out of the loss and attention."""
    padded = []
    for name, m in module.named_modules():
        if not isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            continue
        for option, why in (("max_norm", "renormalizes the weight's rows in place during the forward, without a "
                                          "gradient"),
                            ("scale_grad_by_freq", "divides each row's gradient by its token's count in the batch")):
            if getattr(m, option, None):
                raise BridgeError(f"{type(m).__name__} {name!r} has {option}={getattr(m, option)!r}: torch {why}, "
                                  "which an ONNX Gather cannot express; export it without that option")
        if getattr(m, "padding_idx", None) is not None:
            padded.append(f"{name} (row {m.padding_idx})")
    if padded:
        warnings.warn(f"Embedding padding_idx: {', '.join(padded[:4])}{', ...' if len(padded) > 4 else ''}: torch keeps "
                      "that row's gradient 0, the exported Gather does not; the row trains from what reaches it, "
                      "nothing when the padded positions are masked out of the loss (weights, ignore_index) and "
                      "out of attention", stacklevel=3)


def _state_bytes(module: nn.Module) -> int:
    """The bytes of the module's parameters and buffers (each tensor once)."""
    seen = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.numel() * t.element_size() for t in seen.values())


def _exported(module: nn.Module, args: tuple, ins: list[str], output_names: Sequence[str] | None, exporter: str,
              dynamic_batch: bool, opset: int | None, folder: str | None) -> onnx.ModelProto:
    """The exporter's model of `module` (in `folder`, with external data, where given), the
    module's modes and state left as they were."""
    modes = {name: m.training for name, m in module.named_modules()}
    # the exporters run the forward: a BatchNorm in training mode updates its statistics (the
    # buffers only: a copy of the parameters would double a large module's memory)
    saved = {k: v.detach().clone() for k, v in module.named_buffers()}
    try:
        with torch.no_grad():
            probe = module(*args)
        n_out = len(probe) if isinstance(probe, (tuple, list)) else 1
        outs = list(output_names) if output_names else ["logits" if i == 0 else f"output_{i}" for i in range(n_out)]
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)  # a stale one of a killed export with our pid
            os.mkdir(folder)
        run = _export_dynamo if exporter == "dynamo" else _export_ts
        return run(module, args, ins, outs, dynamic_batch, opset, folder)
    finally:
        for name, m in module.named_modules():  # the exporters may switch modes
            m.training = modes[name]
        buffers = dict(module.named_buffers())
        with torch.no_grad():
            for k, v in saved.items():
                buffers[k].copy_(v)


def strip_traces(model: onnx.ModelProto) -> onnx.ModelProto:
    """Drop the dynamo exporter's per-node stack traces and FX node dumps (metadata_props
    `pkg.torch.onnx.stack_trace`, `pkg.torch.onnx.fx_node`: two thirds of a small model's
    bytes, and local paths); the namespace and class hierarchy entries are kept."""
    drop = {"pkg.torch.onnx.stack_trace", "pkg.torch.onnx.fx_node"}
    for node in model.graph.node:
        keep = [(p.key, p.value) for p in node.metadata_props if p.key not in drop]
        del node.metadata_props[:]
        for k, v in keep:
            node.metadata_props.add(key=k, value=v)
    return model


def _export_dynamo(module, args, ins, outs, dynamic_batch, opset, folder: str | None) -> onnx.ModelProto:
    last: Exception | None = None
    prog = None
    shapes = ({0: torch.export.Dim("N", min=2)},) * len(args) if dynamic_batch else None
    for dyn in ((shapes, None) if dynamic_batch else (None,)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                prog = torch.onnx.export(module, args, dynamo=True, input_names=ins, output_names=outs,
                                         dynamic_shapes=dyn, optimize=False, verbose=False, opset_version=opset)
            break
        except Exception as e:  # noqa: BLE001 - retried with a static batch
            last = e
    if prog is None:
        assert last is not None
        raise BridgeError(f"the dynamo exporter failed: {type(last).__name__}: {str(last).splitlines()[0][:300]}") \
            from last
    if folder is None:
        return strip_traces(prog.model_proto)
    prog.save(os.path.join(folder, _EXPORTED), external_data=True)  # its tensors written one by one
    return strip_traces(_load_exported(folder))


_EXPORTED = "model.onnx"  # the exporter's file in the folder of a large export


def _load_exported(folder: str) -> onnx.ModelProto:
    """The exporter's file in `folder`, its external data left there above
    onnx_files.LAZY_EXTERNAL_BYTES (onnx_files.load_external)."""
    return onnx_files.load_onnx(os.path.join(folder, _EXPORTED))


def _export_ts(module, args, ins, outs, dynamic_batch, opset, folder: str | None) -> onnx.ModelProto:
    buf = io.BytesIO()
    axes = {n: {0: "N"} for n in ins + outs} if dynamic_batch else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # constant folding off: on, it folds a weight's Transpose and a recurrent module's
        # packed weights into new initializers (still mapped, by value) and BatchNorm into Conv;
        # initializers as inputs: else an eval-mode export merges equal initializers (every
        # fresh LayerNorm gain into one), tying what the module never tied. To a file path
        # (a large module's), it writes external data itself where the model passes 2 GiB.
        try:
            torch.onnx.export(module, args, os.path.join(folder, _EXPORTED) if folder else cast(Any, buf),
                              dynamo=False, input_names=ins, output_names=outs,
                              opset_version=opset or 17, dynamic_axes=axes, do_constant_folding=False,
                              training=torch.onnx.TrainingMode.PRESERVE, keep_initializers_as_inputs=True)
        except Exception as e:  # noqa: BLE001 - the exporter's own refusal (an op it has no symbolic for)
            first = " ".join((str(e).strip().splitlines() or [""])[0].split())
            raise BridgeError(f"the torchscript exporter failed: {type(e).__name__}: {first[:300]}") from e
    model = _load_exported(folder) if folder else onnx.load_from_string(buf.getvalue())
    inits = {t.name for t in model.graph.initializer}
    kept = [i for i in model.graph.input if i.name not in inits]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    return model


def _running_statistics(module: nn.Module, model: onnx.ModelProto, manifest: dict[str, Any]) -> None:
    """The module's running statistics (as before the export's forward passes) in the
    initializers that hold them."""
    state = module.state_dict()
    for init in model.graph.initializer:
        e = manifest["initializers"].get(init.name, {})
        if e.get("role") == "buffer" and e["torch"].endswith(_RUNNING):
            dtype = onnx.helper.tensor_dtype_to_np_dtype(init.data_type)
            init.CopyFrom(numpy_helper.from_array(_np(state[e["torch"]]).astype(dtype), init.name))


def _batch_statistics(module: nn.Module, model: onnx.ModelProto, manifest: dict[str, Any]) -> None:
    """Mark training_mode=1 on the BatchNormalization nodes of BatchNorm modules in training
    mode: the dynamo exporter (torch 2.14, optimize off) writes them in inference form (over
    the running statistics), which is not the module's forward."""
    training = {f"{n}.running_mean" for n, m in module.named_modules()
                if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats}
    entries = manifest["initializers"]
    taken = {o for n in model.graph.node for o in n.output} | {t.name for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx") or len(node.input) < 5:
            continue
        if entries.get(node.input[3], {}).get("torch") not in training:
            continue
        if not any(a.name == "training_mode" and a.i for a in node.attribute):
            kept = [a for a in node.attribute if a.name != "training_mode"]
            del node.attribute[:]
            node.attribute.extend(kept + [onnx.helper.make_attribute("training_mode", 1)])
        while len(node.output) < 3:  # the op needs its running statistics' outputs in training mode
            node.output.append("")
        for i, suffix in ((1, "running_mean"), (2, "running_var")):
            if not node.output[i]:
                name = f"{node.name or node.output[0]}/{suffix}"
                while name in taken:
                    name += "_"
                taken.add(name)
                node.output[i] = name


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float64 if t.dtype == torch.float64 else torch.float32).numpy()


def _digest(a: np.ndarray) -> bytes:
    """A digest of `a`'s float32 values in C order: a key for matching by value that does not
    hold a copy of every tensor (a model may pass 2 GiB)."""
    return hashlib.blake2b(np.ascontiguousarray(a, np.float32).data, digest_size=32).digest()


def _uniform(a: np.ndarray) -> bool:
    return a.size < 2 or bool(np.all(a == a.flat[0]))


def build_manifest(module: nn.Module, model: onnx.ModelProto, exporter: str = "") -> dict[str, Any]:
    """The manifest of `model` exported from `module` (see the module docstring)."""
    params = dict(module.named_parameters())
    ties = {}
    for alias, p in module.named_parameters(remove_duplicate=False):
        owner = next(n for n, q in params.items() if q is p)
        if alias != owner:
            ties[alias] = owner
    buffers = {n: b for n, b in module.named_buffers() if b.is_floating_point()}
    tensors: dict[str, tuple[str, np.ndarray]] = {n: ("parameter", _np(p)) for n, p in params.items()}
    tensors.update({n: ("buffer", _np(b)) for n, b in buffers.items()})
    by_bytes: dict[tuple, list[str]] = {}
    for n, (_, a) in tensors.items():
        if not _uniform(a):
            by_bytes.setdefault((a.shape, _digest(a)), []).append(n)

    by_flat: dict[tuple, list[str]] = {}
    for (shape, raw), names in by_bytes.items():
        by_flat.setdefault((int(np.prod(shape)), raw), []).extend(names)

    def lookup(a: np.ndarray) -> list[str]:
        return by_bytes.get((a.shape, _digest(a)), []) if not _uniform(a) else []

    def reshaped(a: np.ndarray) -> list[str]:  # the same values in another shape (a folded Unsqueeze)
        names = by_flat.get((a.size, _digest(a)), []) if not _uniform(a) else []
        return [n for n in names if tensors[n][1].shape != a.shape]

    entries: dict[str, dict[str, Any]] = {}
    rnn = _recurrent_rows(module, params)
    for t in model.graph.initializer:
        if t.data_type not in _FLOAT:
            continue
        a = onnx_files.tensor_view(t)  # mapped, not read, where the export left it on disk
        name = ties.get(t.name, t.name)
        # by name where the value is the tensor's (a running statistic: where the shape is, the
        # export's forward passes may have updated it)
        if name in tensors and tensors[name][1].shape == a.shape and (
                np.array_equal(tensors[name][1], a) or (name in buffers and name.endswith(_RUNNING))):
            entries[t.name] = {"role": tensors[name][0], "torch": name}
            if tensors[name][0] == "parameter":
                entries[t.name]["transposed"] = False
            continue
        found = [(n, False) for n in lookup(a)] + ([(n, True) for n in lookup(np.ascontiguousarray(a.T))]
                                                   if a.ndim == 2 else [])
        if len(found) == 1:
            n, tr = found[0]
            entries[t.name] = {"role": tensors[n][0], "torch": n}
            if tensors[n][0] == "parameter":
                entries[t.name]["transposed"] = tr
        elif found:
            entries[t.name] = {"role": "ambiguous", "candidates": [n for n, _ in found]}
        elif len(flat := reshaped(a)) == 1:
            entries[t.name] = {"role": tensors[flat[0]][0], "torch": flat[0]}
            if tensors[flat[0]][0] == "parameter":
                entries[t.name].update(transposed=False, reshaped=True)
        elif flat:
            entries[t.name] = {"role": "ambiguous", "candidates": flat}
        elif (blocks := _match_blocks(a, rnn)) is not None:
            entries[t.name] = {"role": "parameter", "blocks": blocks}
        else:
            entries[t.name] = {"role": "constant"}
    # several initializers of one parameter: the first plain one (else the first not reshaped,
    # else the first) is the parameter, the others its copies
    holders: dict[str, list[str]] = {}
    for init, e in entries.items():
        if e["role"] == "parameter" and "torch" in e:
            holders.setdefault(e["torch"], []).append(init)
    for inits in holders.values():
        primary = next((i for i in inits if not entries[i]["transposed"] and not entries[i].get("reshaped")),
                       next((i for i in inits if not entries[i].get("reshaped")), inits[0]))
        for i in inits:
            if i != primary:
                entries[i]["copy_of"] = primary
    covered = set(holders) | {b[0] for e in entries.values() for b in e.get("blocks", [])}
    # an exporter's merge of equal tensors: a parameter in no initializer whose value (uniform
    # ones included) equals a parameter's plain initializer of the same shape. Not in our own
    # exports, which merge nothing (dynamo never does; TorchScript keeps initializers as
    # inputs): there a parameter in no initializer is unused (an untaken branch), and calling
    # it merged wrote another parameter's trained values into it
    plain = [entries[i] for inits in holders.values() for i in inits
             if "copy_of" not in entries[i] and not entries[i]["transposed"] and not entries[i].get("reshaped")]
    for pname in params if exporter not in EXPORTERS else []:
        if pname in covered:
            continue
        value = tensors[pname][1]
        for host in plain:
            held = tensors[host["torch"]][1]
            if held.shape == value.shape and np.array_equal(held, value):
                host.setdefault("merged", []).append(pname)
                covered.add(pname)
                break
    for e in entries.values():  # every torch parameter it holds frozen (requires_grad=False): frozen too
        if e["role"] == "parameter" and not any(params[n].requires_grad for n in _entry_parameters(e)):
            e["frozen"] = True
    return {"version": 1, "exporter": exporter, "torch_version": torch.__version__,
            "parameters": list(params), "buffers": list(buffers), "ties": ties, "initializers": entries,
            "unmapped": [p for p in params if p not in covered]}


def _entry_parameters(e: dict[str, Any]) -> list[str]:
    """The torch parameters a manifest entry of role "parameter" holds (its merged ones too)."""
    names = [e["torch"]] if "torch" in e else list(dict.fromkeys(b[0] for b in e["blocks"]))
    return names + list(e.get("merged", []))


def _recurrent_rows(module: nn.Module, params: dict[str, Any]) -> list[tuple[str, int, np.ndarray]]:
    """(parameter, gate rows H, value) of every recurrent module's weight."""
    out = []
    for mname, m in module.named_modules():
        if type(m) not in _RECURRENT:
            continue
        for pname, p in m.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if full in params:
                out.append((full, int(m.hidden_size), _np(p)))
    return out


def _match_blocks(a: np.ndarray, rnn) -> list[list[Any]] | None:
    """Row blocks of `a` ([D, rows, ...]) each equal to one gate block of a recurrent weight."""
    if not rnn or a.ndim < 2 or a.shape[0] > 2:
        return None
    blocks: list[list[Any]] = []
    for d in range(a.shape[0]):
        row = 0
        while row < a.shape[1]:
            hit = None
            for name, H, v in rnn:
                if v.shape[1:] != a.shape[2:] or row + H > a.shape[1]:
                    continue
                piece = a[d, row:row + H]
                if _uniform(piece):
                    continue
                for g in range(v.shape[0] // H):
                    if np.array_equal(v[g * H:(g + 1) * H], piece):
                        hit = [name, g * H, (g + 1) * H, d, row, row + H]
                        break
                if hit:
                    break
            if hit is None:
                return None
            blocks.append(hit)
            row += H
    return blocks


def set_manifest(model: onnx.ModelProto, manifest: dict[str, Any]) -> None:
    keep = [(p.key, p.value) for p in model.metadata_props if p.key != MANIFEST_KEY]
    del model.metadata_props[:]
    for k, v in keep + [(MANIFEST_KEY, json.dumps(manifest, sort_keys=True))]:
        model.metadata_props.add(key=k, value=v)


def read_manifest(model: onnx.ModelProto | str | os.PathLike) -> dict[str, Any] | None:
    """The manifest of a model or file, or None."""
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(os.fspath(model), load_external_data=False)
    props = {p.key: p.value for p in model.metadata_props}
    return json.loads(props[MANIFEST_KEY]) if MANIFEST_KEY in props else None


def torch_parameters(manifest: dict[str, Any]) -> dict[str, list[str]]:
    """{initializer: the torch parameters it trains}: the initializers that are trained (a
    copy is not one: it is tied to its parameter's initializer)."""
    out = {}
    for init, e in manifest["initializers"].items():
        if e["role"] != "parameter" or "copy_of" in e:
            continue
        out[init] = _entry_parameters(e)
    return out


def plan_parameters(plan: Any) -> dict[str, list[str]]:
    """{trainable initializer of a compiled plan: the torch parameters it trains} (a fused
    recurrent weight's lowered pieces each name their weight's parameters); an initializer the
    manifest does not map (a plan without one, an ambiguous entry) maps to []."""
    from kfac_compiler.passes.trainable import torch_roles

    roles = torch_roles(plan.model) or {}
    out: dict[str, list[str]] = {}
    for name in plan.trainable:
        e = roles.get(name, {})
        if e.get("role") != "parameter":
            out[name] = []
            continue
        out[name] = _entry_parameters(e)
    return out


# ------------------------------------------------------------------------------ load back
def load_trained(module: nn.Module, source: Any, manifest: dict[str, Any] | str | os.PathLike | None = None,
                 strict: bool = True) -> list[str]:
    """Write trained values into `module`'s parameters and BatchNorm running statistics; returns
    the torch names written.

    source: a Trainer, a trained .onnx file (Trainer.export's output) or model, or a dict of
    arrays keyed by initializer names of the model (Trainer.parameters(), either layout) or by
    torch names. The manifest comes from the source's model metadata, else from `manifest` (a dict,
    or the exported file). strict: a torch parameter of the manifest without a trained value is
    an error (one line naming it).
    """
    values, model = _source_values(source)
    # a Trainer's plan holds only what reaches its output: a parameter it dropped (another
    # output's head) was not trained, and the module's value is the one to keep
    compiled = {t.name for t in model.graph.initializer} if model is not None and hasattr(source, "plan") else None
    man = manifest if isinstance(manifest, dict) else read_manifest(manifest) if manifest is not None else None
    if man is None and model is not None:
        man = read_manifest(model)
    state = module.state_dict(keep_vars=True)
    if man is None:
        if values and all(k in state for k in values):  # a dict keyed by torch names
            _write(module, state, values)
            return list(values)
        raise BridgeError("no torch manifest: the source's model has none and no manifest= was given "
                          "(export the module with kfac_compiler.torch.export)")
    if model is not None:  # lowered recurrent pieces -> the fused op's W, R, B
        values.update(fold_recurrent_params(model, values))
    out: dict[str, np.ndarray] = {}
    missing: list[str] = []
    unwritten: list[str] = []  # running statistics the source does not hold (Trainer.parameters())
    for init, e in man["initializers"].items():
        if e["role"] == "parameter" and "copy_of" not in e:
            if init not in values and (e.get("frozen") or (compiled is not None and init not in compiled)):
                continue  # requires_grad=False, or not in the plan: the module's value is the trained one
            if init not in values:
                missing.append(", ".join([e.get("torch") or e["blocks"][0][0]] + list(e.get("merged", []))))
                continue
            v = np.asarray(values[init])
            if "blocks" in e:
                for p, s0, s1, d, d0, d1 in e["blocks"]:
                    if p not in out:
                        out[p] = _np(state[p]).copy()
                    out[p][s0:s1] = v[d, d0:d1]
            else:
                v = v.T if e["transposed"] else v
                v = v.reshape(state[e["torch"]].shape) if e.get("reshaped") else v
                for p in [e["torch"]] + list(e.get("merged", [])):
                    out[p] = v
        elif e["role"] == "buffer" and e["torch"].endswith(_RUNNING):
            if init in values:
                out[e["torch"]] = np.asarray(values[init])
            else:
                unwritten.append(e["torch"])
    for alias, owner in man.get("ties", {}).items():
        if owner in out:
            out.pop(alias, None)
    if missing and strict:
        raise BridgeError(f"no trained value for torch parameter(s) {'; '.join(missing)} (initializers "
                          f"{', '.join(i for i, e in man['initializers'].items() if e['role'] == 'parameter' and 'copy_of' not in e and i not in values)} "
                          "are not in the source: frozen by the plan, e.g. by its config's exclude, or not on the "
                          "path to the output it was compiled for? pass the Trainer or its exported file, or "
                          "strict=False to write the ones that are)")
    unknown = [p for p in out if p not in state]
    if unknown:
        raise BridgeError(f"the module has no parameter or buffer {', '.join(unknown)} (a different module than the export's?)")
    _write(module, state, out)
    modules = dict(module.named_modules())  # the statistics of BatchNorms in training mode: they moved
    unwritten = [n for n in unwritten if getattr(modules.get(n.rsplit(".", 1)[0] if "." in n else ""), "training", False)]
    if unwritten:
        warnings.warn(f"load_trained: the source holds no value for the running statistics {', '.join(unwritten[:4])}"
                      f"{', ...' if len(unwritten) > 4 else ''}, which keep the module's (Trainer.parameters() has "
                      "none: pass the Trainer or its exported file to write them)", stacklevel=2)
    return list(out)


def _load_file(path: str) -> onnx.ModelProto:
    """A trained .onnx file, its external data (which must lie in its folder) loaded or left
    on disk as onnx_files.load_external decides."""
    return onnx_files.load_onnx(path, lambda outside: BridgeError(
        f"{path!r} names external data outside its folder ({', '.join(outside[:3])}); move the data files beside "
        "the model"))


def _write(module: nn.Module, state: Mapping[str, Any], values: Mapping[str, np.ndarray]) -> None:
    with torch.no_grad():
        for name, v in values.items():
            t = state[name]
            arr = np.asarray(v)
            if tuple(arr.shape) != tuple(t.shape):
                raise BridgeError(f"trained value for {name!r} has shape {list(arr.shape)}, the module's {list(t.shape)}")
            # copied straight from the array (a value mapped from a file is read here, page by
            # page); through a copy where torch cannot take the array as it is
            ok = arr.flags.writeable and arr.dtype.isnative and all(st >= 0 for st in arr.strides)
            t.copy_(torch.from_numpy(arr if ok else np.array(arr, copy=True)))


def _source_values(source: Any) -> tuple[dict[str, np.ndarray], onnx.ModelProto | None]:
    """The trained values (keyed by initializer) and the model that names them. A file's
    values left on disk (over onnx_files.LAZY_EXTERNAL_BYTES) are mapped, read tensor by tensor
    as they are written into the module; a Trainer's come from its store, with its plan's model
    (Trainer.exported_model refuses a model over that size)."""
    if isinstance(source, Mapping):
        return {k: np.asarray(v) for k, v in source.items()}, None
    if isinstance(source, (str, os.PathLike)):
        source = _load_file(os.fspath(source))
    if isinstance(source, onnx.ModelProto):
        return {t.name: onnx_files.tensor_view(t) for t in source.graph.initializer}, source
    if hasattr(source, "trained_values") and hasattr(source, "plan"):  # a Trainer
        return source.trained_values(), source.plan.model
    raise BridgeError(f"load_trained takes a Trainer, a trained .onnx file or model, or a dict of arrays; "
                      f"got {type(source).__name__}")


__all__ = ["DEFAULT_EXPORTER", "EXPORTERS", "MANIFEST_KEY", "BridgeError", "build_manifest", "export",
           "load_trained", "plan_parameters", "read_manifest", "set_manifest", "torch_parameters"]
