"""Pass 0: load and validate an ONNX model file.

`load_model(path, output)` returns the ModelProto (external data loaded) or raises a
one-line ModelError naming the file and the problem: missing file, not ONNX / truncated,
unsupported opset, missing external-data file or one outside the model's folder, no float initializers, unknown output.
`validate_model(model, output, source)` runs the same checks on an in-memory model.
"""
from __future__ import annotations

import math
import os
import re

import onnx
from google.protobuf.message import DecodeError

from kfac_compiler.builder import MAX_OPSET, MIN_OPSET, subgraphs
from kfac_compiler.errors import ModelError
from kfac_compiler.graph import FLOAT_TYPES, default_opset
from kfac_compiler.onnx_files import external_locations, load_external, outside_locations

_MAX_LISTED = 12


def load_model(path: str | os.PathLike, output: str | None = None) -> onnx.ModelProto:
    """Load `path` with its external data (over 1 GiB: left on disk, onnx_files.load_external)
    and validate it (see validate_model)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModelError(f"model file {path!r} does not exist")
    if os.path.isdir(path):
        raise ModelError(f"model file {path!r} is a directory, not an ONNX file")
    try:
        model = onnx.load(path, load_external_data=False)
    except (DecodeError, ValueError, RuntimeError, UnicodeDecodeError) as e:
        raise ModelError(f"{path!r} is not an ONNX model or is truncated ({_one_line(e)})") from None
    except OSError as e:
        raise ModelError(f"cannot read model file {path!r}: {e.strerror or e}") from None
    _check_looks_like_onnx(model, path)
    base = os.path.dirname(os.path.abspath(path))
    outside = outside_locations(model, base)
    if outside:
        raise ModelError(
            f"{path!r}: external data file {outside[0]!r} lies outside the model's folder {base!r}; "
            "move it next to the model and name it relative to the model's folder"
        )
    missing = sorted(
        {loc for loc in external_locations(model) if not os.path.isfile(os.path.join(base, loc))}
    )
    if missing:
        where = os.path.join(base, missing[0])
        what = ("is a folder" if os.path.isdir(where) else
                "is not a regular file (a device, pipe or socket)" if os.path.exists(where) else "is missing")
        raise ModelError(f"{path!r}: external data file {missing[0]!r} {what} (expected a file next to the model in "
                         f"{base!r})")
    if any(True for _ in external_locations(model)):
        try:
            load_external(model, base)
        except (OSError, ValueError, RuntimeError) as e:
            raise ModelError(f"{path!r}: cannot load external data ({_one_line(e)})") from None
    validate_model(model, output, source=path)
    return model


def validate_model(model: onnx.ModelProto, output: str | None = None, source: str = "<model>") -> None:
    """Check opset, parameters and the output name of an in-memory model."""
    if not isinstance(model, onnx.ModelProto):
        raise ModelError(f"{source}: expected an onnx.ModelProto, got {type(model).__name__}")
    _check_looks_like_onnx(model, source)
    opset = default_opset(model)
    if opset == 0:
        raise ModelError(f"{source!r} imports no default-domain (ai.onnx) opset")
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise ModelError(
            f"{source!r} uses opset {opset}; supported opsets are {MIN_OPSET}..{MAX_OPSET} "
            f"(convert with onnx.version_converter.convert_version(model, {max(min(opset, MAX_OPSET), MIN_OPSET)}))"
        )
    _check_structure(model, source)
    _check_with_onnx_checker(model, source)
    _check_shapes(model, source)
    g = model.graph
    if not any(t.data_type in FLOAT_TYPES for t in g.initializer):
        raise ModelError(
            f"{source!r} has no float initializers, so there are no parameters to train "
            "(weights stored as Constant nodes? re-export with parameters as initializers)"
        )
    check_output(model, output, source)


def check_output(model: onnx.ModelProto, output: str | None, source: str = "<model>") -> str:
    """The output to compile for: `output` if it names a tensor, the only graph output if None."""
    g = model.graph
    outputs = [o.name for o in g.output]
    if output is None:
        if len(outputs) == 1:
            return outputs[0]
        if not outputs:
            raise ModelError(f"{source!r} has no graph outputs; name a tensor with --output")
        raise ModelError(
            f"{source!r} has {len(outputs)} outputs ({_listing(outputs)}); choose one with --output, or give "
            "each its loss as a head (--head OUTPUT,LOSS,COEFF,TARGETS; heads=[...])"
        )
    tensors = {o for n in g.node for o in n.output if o}
    if output in outputs or output in tensors:
        return output
    others = [t for n in g.node for t in n.output if t and t not in outputs]
    raise ModelError(
        f"{source!r} has no tensor named {output!r}; graph outputs: {_listing(outputs)}"
        + (f"; other tensors: {_listing(others)}" if others else "")
    )


def _check_structure(model: onnx.ModelProto, source: str) -> None:
    """Every tensor has one definition and is defined before use, in the graph and in every
    subgraph (If branches, Loop/Scan bodies read outer-scope names defined before their node);
    initializer values fill their dims; an initializer that is also a graph input (its default
    value in ONNX, trained as a parameter: passes/canonicalize.py drops the input) is declared
    with its own type and shape.

    (onnx.checker is stricter than ONNX Runtime about e.g. missing output shapes, so it runs
    after these on a copy that declares what it insists on: `_check_with_onnx_checker`.)
    """
    g = model.graph
    for t in g.initializer:
        _check_initializer_size(t, source)
    _check_unique(source, "initializer", [t.name for t in g.initializer] + [s.values.name for s in g.sparse_initializer])
    _check_unique(source, "graph input", [i.name for i in g.input])
    inits = {t.name: t for t in g.initializer}
    for vi in g.input:
        if vi.name in inits:
            _check_default_value(source, vi, inits[vi.name])
    _check_scope(g, set(), source, "", _produced(g))


def _produced(g: onnx.GraphProto) -> set[str]:
    """Every name a node produces, in `g` and its subgraphs."""
    return {o for n in g.node for o in n.output if o} | {o for n in g.node for sub in subgraphs(n) for o in _produced(sub)}


def _check_unique(source: str, what: str, names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ModelError(f"{source!r} is not a valid ONNX model: {what} {name!r} is defined twice (a tensor has one "
                             "definition); re-export the model")
        seen.add(name)


def _check_default_value(source: str, vi: onnx.ValueInfoProto, t: onnx.TensorProto) -> None:
    """A graph input that is also an initializer is declared as what the initializer holds."""
    tt = vi.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim] if tt.HasField("shape") else None
    held = f"{onnx.TensorProto.DataType.Name(t.data_type).lower()}[{', '.join(map(str, t.dims))}]"
    type_ok = not tt.elem_type or tt.elem_type == t.data_type
    shape_ok = dims is None or (len(dims) == len(t.dims) and all(d in (None, k) for d, k in zip(dims, t.dims)))
    if not (type_ok and shape_ok):
        decl = (f"{onnx.TensorProto.DataType.Name(tt.elem_type).lower() if tt.elem_type else '?'}"
                f"[{', '.join('?' if d is None else str(d) for d in dims or [])}]")
        raise ModelError(f"{source!r}: initializer {t.name!r} is also a graph input declared {decl} but holds {held} "
                         "(an initializer that is an input is its default value); declare the input as the initializer "
                         "or drop the input")


def _check_scope(g: onnx.GraphProto, outer: set[str], source: str, where: str, produced: set[str]) -> None:
    """One graph (a subgraph with the names its enclosing scopes define before its node);
    `produced`: what nodes produce anywhere in the model."""
    defined = outer | {i.name for i in g.input} | {t.name for t in g.initializer}
    defined |= {s.values.name for s in g.sparse_initializer}
    inits = {t.name for t in g.initializer}
    producers: dict[str, str] = {}
    for node in g.node:
        label = node.name or node.op_type
        for name in node.input:
            if name and name not in defined:
                why = "is produced only after it" if name in produced else "is not defined anywhere"
                raise ModelError(f"{source!r} is not a valid ONNX model: input {name!r} of node {label!r}{where} {why}")
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):  # by name
                _check_scope(sub, defined, source, f" in the {attr.name} of node {label!r}{where}", produced)
        for name in (o for o in node.output if o):
            if name in producers or name in defined:
                if name not in producers and name in outer:
                    raise ModelError(f"{source!r} is not a valid ONNX model: tensor {name!r}, an output of node "
                                     f"{label!r}{where}, is already a tensor of an enclosing graph (names are unique "
                                     "across nested graphs)")
                other = f"node {producers[name]!r}" if name in producers else "an initializer" if name in inits \
                    else "a graph input"
                raise ModelError(f"{source!r} is not a valid ONNX model: tensor {name!r} is an output of node "
                                 f"{label!r}{where} and of {other} (a tensor has one producer)")
            producers[name] = label
        defined.update(o for o in node.output if o)


def _check_with_onnx_checker(model: onnx.ModelProto, source: str) -> None:
    """onnx.checker's check (node specs against their schemas: attributes, input and output
    counts; names; every scope) as one line naming the node. It runs on `light_copy`, which
    declares what the checker insists on and ONNX Runtime does not (types and shapes of graph
    inputs and outputs, IR >= 4's inputs apart from initializers): ONNX Runtime runs such models."""
    try:
        onnx.checker.check_model(light_copy(model, for_checker=True))
    except onnx.checker.ValidationError as e:
        text, _, context = str(e).partition("==> Context:")
        text = " ".join(text.split())
        node = re.search(r"Name: (\S*) OpType: (\S+)", context)
        where = f"node {node.group(1) or node.group(2)!r} ({node.group(2)}): " if node else ""
        raise ModelError(f"{source!r} is not a valid ONNX model: {where}{text[:300]} (onnx.checker); fix or re-export "
                         "the model") from None
    except ValueError:  # past protobuf's 2 GB even without its large weights
        return


UNCHECKED_DOMAIN = "kfac_compiler.unchecked"  # deprecated ops moved here in the checker's copy


def _domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


def _hide_deprecated(g: onnx.GraphProto, opsets: dict[str, int]) -> bool:
    """Move the nodes whose op is deprecated at the model's opset (GroupNormalization 18-20,
    Upsample: ONNX Runtime runs them, the checker refuses them) to a domain the checker does
    not know, in every scope of `g` (the checker's copy); whether there were any."""
    hidden = False
    for node in g.node:
        try:
            domain = _domain(node.domain)
            deprecated = onnx.defs.get_schema(node.op_type, opsets.get(domain, 0), domain).deprecated
        except onnx.defs.SchemaError:
            deprecated = False
        if deprecated:
            node.domain = UNCHECKED_DOMAIN
            hidden = True
        for sub in subgraphs(node):
            hidden = _hide_deprecated(sub, opsets) or hidden
    return hidden


LIGHT_ELEMENTS = 1024  # float initializers larger than this are declared, not copied, for the checks


def light_copy(model: onnx.ModelProto, for_checker: bool = False) -> onnx.ModelProto:
    """The model without the values of its large float initializers and of those in external
    data not loaded (declared as graph inputs of their type and shape instead: all the checker
    and shape inference read of them), so that checking a model does not serialize its weights
    (2 s and 6 s for 400 MB) or look for external files. `for_checker`:
    graph inputs and outputs without a type or shape get an unknown-shape float declaration,
    untyped value_info is dropped, the IR version is at least 4 and deprecated ops are left out
    of the schema check (`_hide_deprecated`)."""
    light = onnx.ModelProto()
    light.ir_version = max(model.ir_version, 4) if for_checker else model.ir_version
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    src, g = model.graph, light.graph
    g.name = src.name
    g.node.extend(src.node)
    g.input.extend(src.input)
    g.output.extend(src.output)
    g.value_info.extend(vi for vi in src.value_info if not for_checker or vi.type.HasField("tensor_type"))
    g.sparse_initializer.extend(src.sparse_initializer)
    declared = {i.name for i in src.input}
    for t in src.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL or (t.data_type in FLOAT_TYPES
                                                             and math.prod(t.dims) > LIGHT_ELEMENTS):
            if t.name not in declared:
                g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        else:
            g.initializer.append(t)
    if for_checker:
        opsets = {_domain(o.domain): o.version for o in model.opset_import}
        if _hide_deprecated(g, opsets):
            light.opset_import.append(onnx.helper.make_opsetid(UNCHECKED_DOMAIN, 1))
        for vi in list(g.input) + list(g.output):
            if not vi.type.HasField("tensor_type") and not vi.type.HasField("sequence_type") \
                    and not vi.type.HasField("optional_type") and not vi.type.HasField("map_type"):
                vi.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
            if vi.type.HasField("tensor_type") and not vi.type.tensor_type.HasField("shape"):
                vi.type.tensor_type.shape.dim.add().dim_param = "unknown"
    return light


# where the values of an initializer without raw_data are, per data type (onnx.proto3: the
# 16-bit and smaller types are stored one per int32; complex types two floats per element)
TYPED_FIELDS = {
    onnx.TensorProto.FLOAT: ("float_data", 1), onnx.TensorProto.DOUBLE: ("double_data", 1),
    onnx.TensorProto.INT64: ("int64_data", 1), onnx.TensorProto.UINT32: ("uint64_data", 1),
    onnx.TensorProto.UINT64: ("uint64_data", 1), onnx.TensorProto.INT32: ("int32_data", 1),
    onnx.TensorProto.INT16: ("int32_data", 1), onnx.TensorProto.INT8: ("int32_data", 1),
    onnx.TensorProto.UINT16: ("int32_data", 1), onnx.TensorProto.UINT8: ("int32_data", 1),
    onnx.TensorProto.BOOL: ("int32_data", 1), onnx.TensorProto.FLOAT16: ("int32_data", 1),
    onnx.TensorProto.BFLOAT16: ("int32_data", 1), onnx.TensorProto.COMPLEX64: ("float_data", 2),
    onnx.TensorProto.COMPLEX128: ("double_data", 2),
}


PACKED_TYPES = {getattr(onnx.TensorProto, n) for n in ("INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2")
                if hasattr(onnx.TensorProto, n)}  # several values per byte


def _check_initializer_size(t: onnx.TensorProto, source: str) -> None:
    """The values an initializer holds match its dims: a lie is one line here, not a numpy
    reshape traceback (or an allocation of the claimed size) wherever it is first read.
    External data not loaded (a ModelProto passed without it) and types packed below a
    byte are left to ONNX Runtime."""
    if any(d < 0 for d in t.dims):
        raise ModelError(f"{source!r}: initializer {t.name!r} has a negative dimension {list(t.dims)}; re-export "
                         "the model")
    if t.data_location == onnx.TensorProto.EXTERNAL or t.data_type in PACKED_TYPES:
        return
    elements = math.prod(t.dims)
    if t.HasField("raw_data"):
        try:
            itemsize = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        except (KeyError, TypeError, ValueError):
            return
        held, unit = len(t.raw_data), "bytes"
        need = elements * itemsize
    elif t.data_type in TYPED_FIELDS:
        field, per = TYPED_FIELDS[t.data_type]
        held, unit = len(getattr(t, field)), "values"
        need = elements * per
    else:
        return
    if held != need:
        shape = "x".join(map(str, t.dims)) or "scalar"
        raise ModelError(f"{source!r}: initializer {t.name!r} declares a {shape} tensor ({need} {unit}) but holds "
                         f"{held} {unit}; re-export the model")


STANDARD_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")
# what strict inference says of two shapes or types that contradict each other (not of an op
# whose output it could not infer)
CONTRADICTION = re.compile(r"mismatch|incompatible|inconsistent|differ in rank|bound to different types"
                           r"|existing shape differ|differs from existing", re.IGNORECASE)


def _check_shapes(model: onnx.ModelProto, source: str) -> None:
    """Declared shapes that contradict the graph (an input declared 32 wide feeding a weight of
    64 inputs) are one line naming the node, here, not an ONNX Runtime error when training
    starts: ONNX's strict shape inference finds them. Graphs with ops of other domains (whose
    shapes ONNX cannot infer) and models past protobuf's 2 GB are left to ONNX Runtime. The
    file's intermediate value_info is left out: ONNX Runtime runs a file whose declarations
    of inner tensors are stale (jax2onnx's NHWC shapes of NCHW tensors), and canonicalization
    drops those."""
    if any(n.domain not in STANDARD_DOMAINS for n in model.graph.node):
        return
    try:
        light = light_copy(model)
        del light.graph.value_info[:]
        onnx.shape_inference.infer_shapes(light, check_type=True, strict_mode=True, data_prop=True)
    except onnx.shape_inference.InferenceError as e:
        text = re.sub(r"\[\w+Error\]\s*|Inference error\(s\):\s*", "", " ".join(str(e).split()))
        for op, node, why in re.findall(r"\(op_type:([^,)\s]+)(?:, node name: ([^)]*))?\):\s*(.*?)(?=\s*\(op_type:|$)",
                                        text):
            if CONTRADICTION.search(why):  # not an op whose output ONNX could not infer
                at = f"node {node!r} ({op})" if node else f"a {op} node"
                raise ModelError(f"{source!r}: shapes or types that contradict each other at {at}: "
                                 f"{why[:200]}; fix the declared input or output shapes or types, or re-export the model") from None
    except (ValueError, RuntimeError):  # past protobuf's 2 GB: serialized whole to be inferred
        return


def _check_looks_like_onnx(model: onnx.ModelProto, source: str) -> None:
    if model.ir_version == 0 and not model.opset_import and len(model.graph.node) == 0:
        raise ModelError(f"{source!r} is not an ONNX model (empty or not a ModelProto)")
    if len(model.graph.node) == 0:
        raise ModelError(f"{source!r} has an empty graph (no nodes)")


def _listing(names: list[str]) -> str:
    if not names:
        return "(none)"
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split())
    return text[:300] + ("..." if len(text) > 300 else "")
