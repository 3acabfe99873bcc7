"""Pass 3: link parameters into layers (one Fisher block each).

Policies (docs/frontend.md, "Linking"):
  * weight + bias of a match are linked into one layer;
  * the matches of ONE weight with ONE kind (and the same attributes) become one layer with
    several uses (an unrolled RNN's W_x: 8 uses); its bias is linked only if every use adds
    the same bias, otherwise the bias is released (it gets its own layer, see below);
  * a bias linked to several different weights is released from all of them; a released
    bias whose every use is an Add to the data (a tied head's bias, an RNN bias added alone
    at the later steps and after the first step's MatMul) becomes one "broadcast" layer over
    all its uses (exact per-example gradients), any other a generic layer;
  * a weight matched by exactly the kinds embedding and fully_connected, every fully connected
    use reading it as "out_in" (a tied embedding table E [V, D]: Gather(E, ids) and the output
    head MatMul(h, Transpose(E)) or Gemm(h, E, transB=1)) becomes ONE layer of kind
    "tied_embedding" with all its uses (block "diagonal" by default, docs/conventions.md
    "Tied embeddings"); a head bias is not linked to it (it gets its own layer, with a note on
    the tied layer);
  * any other weight matched by several kinds, or with different attributes, gets ONE generic
    layer holding it with all its uses (approximation "diagonal" by default) and a warning
    naming the parameter and the kinds;
  * user links (config `links`, like TF K-FAC define_linked_parameters) take their parameters
    out of every match and form one generic layer with the chosen approximation;
  * every trainable parameter left over gets a generic layer of its own.
Layer names: the weight's name with one trailing ".weight", ".kernel", ".scale", ".gamma",
"/weight", "/kernel", "/scale", "/gamma", "_weight" or a weight norm's v (".weight_v",
".parametrizations.weight.original1") or tf2onnx's "/<op>/ReadVariableOp:0" removed ("fc1.weight" -> "fc1",
"sequential/dense/MatMul/ReadVariableOp:0" -> "sequential/dense",
"enc1.kernel" -> "enc1", "ln1.scale" -> "ln1"); when that is empty or collides with another
layer or parameter name, the full weight name. A user link is named by its `name` or by its
parameters joined with "+". Layers are ordered by their first node in the graph.
"""
from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Iterable

import onnx

from kfac_compiler.errors import ConfigError
from kfac_compiler.graph import GraphView
from kfac_compiler.ir import Layer, LayerMatch, LayerUse
from kfac_compiler.patterns import bias_broadcast_matches

# (torch's weight norm: v is `.parametrizations.weight.original1`, old style `.weight_v`)
WEIGHT_SUFFIXES = (".weight", ".kernel", ".scale", ".gamma", "/weight", "/kernel", "/scale", "/gamma", "_weight",
                   ".parametrizations.weight.original1", ".weight_v")
# attrs that describe one use, not the layer (ignored when checking the uses agree)
_PER_USE_ATTRS = ("scale_input",)


# tf2onnx's names: '<model>/<layer>/<TF op>/ReadVariableOp:0' ('.../dense/MatMul/ReadVariableOp:0')
_TF2ONNX_TAIL = re.compile(r"/ReadVariableOp(/resource)?(:\d+)?$")


def layer_base_names(weight: str) -> list[str]:
    """Readable layer names derived from a weight name, the shortest first: a collision
    moves a layer to the next (tf2onnx's '<layer>/<op>/ReadVariableOp:0': '<layer>', then
    '<layer>/<op>', as a kernel and a bias of one Keras layer in layers of their own); the
    weight's own name last."""
    names = []
    tf = _TF2ONNX_TAIL.sub("", weight)
    if tf != weight and tf:
        head = tf.rpartition("/")[0]
        names += [head, tf] if head else [tf]
    else:
        names += [weight[: -len(sfx)] for sfx in WEIGHT_SUFFIXES if weight.endswith(sfx) and len(weight) > len(sfx)][:1]
    return list(dict.fromkeys([*names, weight]))


def link_params(
    matches: Iterable[LayerMatch],
    trainable: Iterable[str],
    user_links: Iterable[dict] = (),
    model: onnx.ModelProto | None = None,
    view: GraphView | None = None,
) -> list[Layer]:
    """Layers covering every trainable parameter exactly once (see the module docstring).

    `model` (or `view`) gives the graph order and the consumer nodes that make the uses of
    generic layers; without it generic layers have no uses and layers keep match order.
    """
    if view is None and model is not None:
        view = GraphView(model)
    trainable = list(trainable)
    trainable_set = set(trainable)
    matches = list(matches)
    user_links = list(user_links)
    order = {n.name: i for i, n in enumerate(view.nodes)} if view is not None else {}

    # -- user links take their parameters out of the matches
    linked: dict[str, int] = {}
    for i, link in enumerate(user_links):
        for p in link["params"]:
            if p not in trainable_set:
                raise ConfigError(
                    f"links[{i}]: {p!r} is not a trainable parameter "
                    f"(trainable: {', '.join(trainable[:12])}{', ...' if len(trainable) > 12 else ''})"
                )
            if p in linked:
                raise ConfigError(f"links[{i}]: parameter {p!r} is already linked in links[{linked[p]}]")
            linked[p] = i
    kept: list[LayerMatch] = []
    for m in matches:
        if m.weight in linked or set(m.attrs.get("extra_params", ())) & set(linked):
            continue
        if m.bias is not None and m.bias in linked:
            m = _drop_bias(m, view)
        kept.append(m)

    # -- group by weight
    groups: dict[str, list[LayerMatch]] = {}
    for m in kept:
        groups.setdefault(m.weight, []).append(m)

    layers: list[Layer] = []
    generic_params: dict[str, tuple[str, ...]] = {}  # param -> notes
    generic_attrs: dict[str, dict] = {}
    weight_groups: dict[str, list[LayerMatch]] = {}
    tied_groups: dict[str, list[LayerMatch]] = {}
    for w, ms in groups.items():
        kinds = list(dict.fromkeys(m.kind for m in ms))
        stray = _unmatched_reader(w, [m for m in kept if w in (m.weight, m.bias, *m.attrs.get("extra_params", ()))],
                                  view)
        if stray is None and _is_tied_embedding(ms):
            tied_groups[w] = ms
            continue
        why = _generic_reason(w, ms, kinds, stray)
        if why is not None:
            warnings.warn(why, stacklevel=2)
            generic_params[w] = (why,)
            generic_attrs[w] = {"shared_kinds": tuple(kinds)}
            continue
        weight_groups[w] = ms

    # -- biases: one consistent bias per weight, never shared between weights
    bias_of: dict[str, str | None] = {}
    notes: dict[str, list[str]] = {}
    released: dict[str, str] = {}
    for w, ms in weight_groups.items():
        biases = [m.bias for m in ms]
        if biases and all(b == biases[0] for b in biases) and biases[0] is not None:
            bias_of[w] = biases[0]
        else:
            bias_of[w] = None
            for b in dict.fromkeys(x for x in biases if x is not None):
                why = f"bias {b!r} is not linked to {w!r}: not every use of {w!r} adds it"
                released[b] = why
                notes.setdefault(w, []).append(why)
    tied_biases: set[str] = set()
    for w, ms in tied_groups.items():
        for b in dict.fromkeys(m.bias for m in ms if m.bias is not None):
            tied_biases.add(b)
            why = f"bias {b!r} of the tied output head is not linked to {w!r}: it gets its own layer"
            released[b] = why
            notes.setdefault(w, []).append(why)
    owners: dict[str, list[str]] = {}
    for w, b in bias_of.items():
        if b is not None:
            owners.setdefault(b, []).append(w)
    for b, ws in owners.items():
        if len(ws) > 1 or b in weight_groups or b in generic_params or b in tied_biases:
            for w in ws:
                bias_of[w] = None
                why = f"bias {b!r} is not linked to {w!r}: it is also used with {', '.join(x for x in ws if x != w) or 'another layer'}"
                released[b] = why
                notes.setdefault(w, []).append(why)

    # a weight that is also a released bias elsewhere (an RNN bias added alone at later steps,
    # as the fully connected bias at the first): its layer would miss the bias's uses
    for w in [w for w in weight_groups if w in released]:
        del weight_groups[w]
    # released biases added by Adds to the data: one broadcast layer over all their uses
    for p in released:
        ms = bias_broadcast_matches(view, p) if view is not None and p not in generic_params else None
        if ms and all(_layer_attrs(m) == _layer_attrs(ms[0]) for m in ms):
            weight_groups[p] = ms
            notes.setdefault(p, []).append(released[p])
            bias_of[p] = None

    for w, ms in weight_groups.items():
        b = bias_of[w]
        uses = []
        for m in ms:
            if b is None and m.bias is not None:
                m = _drop_bias(m, view)
            uses.append(m.use)
        attrs = dict(ms[0].attrs)
        layers.append(
            Layer(
                name="",
                kind=ms[0].kind,
                params=((w,) if b is None else (w, b)) + tuple(attrs.get("extra_params", ())),
                uses=tuple(uses),
                attrs=attrs,
                pattern=",".join(dict.fromkeys(m.pattern for m in ms)),
                notes=tuple(notes.get(w, ())),
            )
        )

    for w, ms in tied_groups.items():
        ms = [_drop_bias(m, view) if m.bias is not None else m for m in ms]
        emb = next(m for m in ms if m.kind == "embedding")
        layers.append(
            Layer(
                name="",
                kind="tied_embedding",
                params=(w,),
                uses=tuple(m.use for m in ms),
                attrs={
                    "vocab": int(emb.attrs["vocab"]),
                    "dim": int(emb.attrs["dim"]),
                    "use_kinds": tuple(m.kind for m in ms),
                    "alphas": tuple(float(m.attrs.get("alpha", 1.0)) if m.kind != "embedding" else 1.0 for m in ms),
                },
                pattern=",".join(dict.fromkeys(m.pattern for m in ms)),
                notes=tuple(notes.get(w, ())),
            )
        )

    # -- generic layers: shared/odd weights, released biases, unclaimed parameters
    claimed = {p for layer in layers for p in layer.params} | set(linked)
    for p in trainable:
        if p in claimed:
            continue
        note = generic_params.get(p) or ((released[p],) if p in released else ())
        layers.append(
            Layer(
                name="",
                kind="generic",
                params=(p,),
                uses=_consumer_uses(p, view),
                attrs=dict(generic_attrs.get(p, {})),
                pattern="generic",
                notes=tuple(note),
            )
        )
    named_links: list[Layer] = []
    for link in user_links:
        uses = tuple(u for p in link["params"] for u in _consumer_uses(p, view))
        named_links.append(
            Layer(
                name=link.get("name") or "+".join(link["params"]),
                kind="generic",
                params=tuple(link["params"]),
                uses=uses,
                attrs={"linked_by_user": True},
                approximation=link.get("approximation") or None,
                pattern="user_link",
            )
        )

    layers = _assign_names(layers, named_links, trainable)
    if order:
        layers.sort(key=lambda l: min((order.get(n, len(order)) for u in l.uses for n in u.nodes), default=len(order)))
    return layers


def _generic_reason(w: str, ms: list[LayerMatch], kinds: list[str], stray: onnx.NodeProto | None) -> str | None:
    """Why the matches of weight `w` make one generic layer instead of one of their kind (None:
    they do not): a reader no match covers, several kinds, or one kind's differing attributes."""
    if stray is not None:
        return (f"parameter {w!r} is also read by node {stray.name!r} ({stray.op_type}), which no "
                f"{' or '.join(kinds)} match covers: it gets one generic layer holding all its uses (approximation "
                "'diagonal' unless configured), since a block of the matched uses alone would leave that use's "
                "curvature out")
    if len(kinds) > 1:
        return (f"parameter {w!r} is used as {' and '.join(kinds)} ({len(ms)} uses): it gets one generic "
                "layer holding all its uses (approximation 'diagonal' unless configured; "
                "link it yourself with config `links` to choose)")
    ref = _layer_attrs(ms[0])
    odd = [m for m in ms if _layer_attrs(m) != ref]
    if odd:
        return (f"parameter {w!r} is used by {kinds[0]} layers with different attributes "
                f"({ref} vs {_layer_attrs(odd[0])}): it gets one generic layer")
    return None


# readers of a weight that carry no gradient: no curvature of theirs to lose
_SHAPE_READERS = ("Shape", "Size")


def _unmatched_reader(weight: str, ms: list[LayerMatch], view: GraphView | None) -> onnx.NodeProto | None:
    """A node reading `weight` that none of the uses of its matches (`ms`: those it is the
    weight, bias or an extra parameter of) contains (the Transpose of a
    tied decoder F.linear(h, W.t()) that torch.export writes beside the encoder's Gemm): the
    layer of the matches would hold only their uses, and its block silently miss that one's
    curvature (the implied gradient's cosine with the true one was 0.937)."""
    if view is None:
        return None
    covered = {n for m in ms for n in m.use.nodes}
    return next((n for n in view.consumers.get(weight, [])
                 if n.name not in covered and n.op_type not in _SHAPE_READERS), None)


def _is_tied_embedding(ms: list[LayerMatch]) -> bool:
    """The matches of one weight are a tied embedding: kinds exactly {embedding,
    fully_connected}, every embedding use with the same (vocab, dim), every fully connected
    use reading the [vocab, dim] table as "out_in" (logits = h E^T)."""
    if {m.kind for m in ms} != {"embedding", "fully_connected"}:
        return False
    embs = [m for m in ms if m.kind == "embedding"]
    ref = (embs[0].attrs.get("vocab"), embs[0].attrs.get("dim"))
    if any((m.attrs.get("vocab"), m.attrs.get("dim")) != ref for m in embs) or None in ref:
        return False
    return all(m.attrs.get("weight_layout") == "out_in" for m in ms if m.kind == "fully_connected")


def _layer_attrs(m: LayerMatch) -> dict:
    return {k: v for k, v in m.attrs.items() if k not in _PER_USE_ATTRS}


def _drop_bias(m: LayerMatch, view: GraphView | None) -> LayerMatch:
    """The match without its bias; a separate bias Add node is trimmed from the use."""
    use = m.use
    if view is not None and m.bias is not None:
        for name in use.nodes:
            node = view.node_by_name[name]
            if node.op_type == "Add" and m.bias in node.input and name != use.nodes[0]:
                other = [i for i in node.input if i != m.bias]
                inner = {o for n in use.nodes if n != name for o in view.node_by_name[n].output}
                if len(other) == 1 and other[0] in inner:
                    use = LayerUse(
                        nodes=tuple(n for n in use.nodes if n != name),
                        input=use.input,
                        output=use.output if use.output != node.output[0] else other[0],
                    )
                break
    attrs = dict(m.attrs)
    if "beta" in attrs:
        attrs["beta"] = 1.0
    return dataclasses.replace(m, bias=None, use=use, attrs=attrs)


def _consumer_uses(param: str, view: GraphView | None) -> tuple[LayerUse, ...]:
    if view is None:
        return ()
    uses = []
    for node in view.consumers.get(param, []):
        if any(u.nodes == (node.name,) for u in uses):
            continue
        uses.append(LayerUse(nodes=(node.name,), input=param, output=node.output[0]))
    return tuple(uses)


def _assign_names(layers: list[Layer], user_layers: list[Layer], trainable: list[str]) -> list[Layer]:
    params = set(trainable)
    fixed = [l.name for l in user_layers]
    for name in fixed:
        if fixed.count(name) > 1:
            raise ConfigError(f"links: two links are named {name!r}")
    choices = [layer_base_names(l.weight) for l in layers]
    level = [0] * len(layers)
    while True:  # each colliding layer moves to its next, longer name
        names = [c[lv] for c, lv in zip(choices, level)]
        counts: dict[str, int] = {}
        for n in names + fixed:
            counts[n] = counts.get(n, 0) + 1
        clash = [i for i, n in enumerate(names) if (counts[n] > 1 or (n in params and n != layers[i].weight))
                 and level[i] < len(choices[i]) - 1]
        if not clash:
            break
        for i in clash:
            level[i] += 1
    out = [dataclasses.replace(layer, name=name) for layer, name in zip(layers, names)]
    taken = {l.name for l in out}
    for l in user_layers:
        if l.name in taken:
            raise ConfigError(f"links: the name {l.name!r} is already a layer name; choose another")
    return out + list(user_layers)
