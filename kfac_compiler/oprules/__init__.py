"""Differentiation rules: one per ONNX op, keyed by (domain, op_type) and an opset range.

A rule knows how to emit, in standard ONNX ops only, the reverse-mode product (vjp: output
cotangents -> input cotangents) and optionally the forward-mode product (jvp: input tangents
-> output tangents) of one forward node. The autodiff pass (kfac_compiler.passes.autodiff)
walks the graph and calls them; see docs/autodiff.md.

Registering a rule::

    from kfac_compiler.oprules import register

    @register("Tanh")                       # domain="", since=1, until=None
    def tanh_vjp(b, view, node, gys, needs=None):
        (g,) = gys                          # cotangent of each output (None: no cotangent)
        y = node.output[0]                  # forward tensors are available by name
        d = b.sub(b.const(1.0), b.mul(y, y))
        return [b.mul(g, d)]                # cotangent of each input (None: none)

    @tanh_vjp.defjvp
    def tanh_jvp(b, view, node, tangents):  # tangent of each input (None: zero)
        ...
        return [ty]                         # tangent of each output (None: zero)

`needs` (optional fifth argument of a vjp) is a list of booleans, one per input, telling
which input cotangents the caller will use; rules may skip the others (return None there).
Ops with no gradient (Shape, comparisons, integer ops, ...) are registered with
`register_nondiff`: their outputs carry no (co)tangent.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import onnx

from kfac_compiler.errors import UnsupportedOpError

VjpFn = Callable[..., Sequence[str | None]]
JvpFn = Callable[..., Sequence[str | None]]


def _norm_domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


@dataclass
class Rule:
    """A differentiation rule for one op over an opset range [since, until]."""

    op_type: str
    domain: str = ""
    since: int = 1
    until: int | None = None
    vjp_fn: VjpFn | None = None
    jvp_fn: JvpFn | None = None
    # check_fn(view, node) raises UnsupportedOpError for attribute combinations the rule
    # cannot differentiate (run before anything is emitted)
    check_fn: Callable | None = None
    nondiff: bool = False
    # input slots that can carry a gradient (None: every float input)
    inputs: tuple[int, ...] | None = None
    _vjp_takes_needs: bool = False

    # ----------------------------------------------------------- decorators
    def defjvp(self, fn: JvpFn) -> JvpFn:
        """Attach the forward-mode rule `fn(b, view, node, tangents) -> output tangents`."""
        self.jvp_fn = fn
        return fn

    def defcheck(self, fn: Callable) -> Callable:
        """Attach `fn(view, node)` that raises UnsupportedOpError for unsupported forms."""
        self.check_fn = fn
        return fn

    def check(self, view, node) -> None:
        if self.check_fn is not None:
            self.check_fn(view, node)

    # ------------------------------------------------------------- queries
    def covers(self, opset: int) -> bool:
        return self.since <= opset and (self.until is None or opset <= self.until)

    @property
    def has_jvp(self) -> bool:
        return self.nondiff or self.jvp_fn is not None

    def diff_slot(self, i: int) -> bool:
        return not self.nondiff and (self.inputs is None or i in self.inputs)

    # ---------------------------------------------------------------- calls
    def vjp(self, b, view, node, gys, needs=None) -> list[str | None]:
        n_in = len(node.input)
        if self.nondiff:
            return [None] * n_in
        if self._vjp_takes_needs:
            res = self.vjp_fn(b, view, node, list(gys), needs)
        else:
            res = self.vjp_fn(b, view, node, list(gys))
        res = list(res) + [None] * (n_in - len(res))
        return res[:n_in]

    def jvp(self, b, view, node, tangents) -> list[str | None]:
        n_out = len(node.output)
        if self.nondiff:
            return [None] * n_out
        if self.jvp_fn is None:
            raise UnsupportedOpError(f"{describe(node, view.opset)} has no forward-mode (jvp) rule; "
                                     f"{remedy(None, 'add a jvp to its rule')}")
        res = list(self.jvp_fn(b, view, node, list(tangents)))
        res = res + [None] * (n_out - len(res))
        return res[:n_out]

    __call__ = vjp


# (domain, op_type) -> rules over disjoint opset ranges
RULES: dict[tuple[str, str], list[Rule]] = {}


def _add(rule: Rule) -> Rule:
    key = (rule.domain, rule.op_type)
    lst = RULES.setdefault(key, [])
    # a later registration for an overlapping range replaces the earlier one (user override)
    lst[:] = [r for r in lst if not _overlap(r, rule)]
    lst.append(rule)
    lst.sort(key=lambda r: r.since)
    return rule


def _overlap(a: Rule, c: Rule) -> bool:
    a_hi = a.until if a.until is not None else 10**9
    c_hi = c.until if c.until is not None else 10**9
    return a.since <= c_hi and c.since <= a_hi


def register(
    op_type: str | Iterable[str],
    domain: str = "",
    since: int = 1,
    until: int | None = None,
    inputs: Sequence[int] | None = None,
) -> Callable[[VjpFn], Rule]:
    """Decorator registering `fn(b, view, node, gys[, needs]) -> input cotangents` as the vjp
    of `op_type` (one name or several) for opsets since..until (inclusive). `inputs` lists
    the input slots that can carry a gradient (default: every float input). Returns the
    Rule (use `@rule.defjvp` to attach the forward-mode rule)."""
    names = [op_type] if isinstance(op_type, str) else list(op_type)

    def deco(fn: VjpFn) -> Rule:
        takes_needs = len(inspect.signature(fn).parameters) >= 5
        made = []
        for name in names:
            made.append(_add(Rule(
                op_type=name,
                domain=_norm_domain(domain),
                since=since,
                until=until,
                vjp_fn=fn,
                inputs=None if inputs is None else tuple(inputs),
                _vjp_takes_needs=takes_needs,
            )))
        return made[0] if len(made) == 1 else _MultiRule(made)  # type: ignore[return-value]

    return deco


class _MultiRule:
    """The value `register` returns for several op types: `defjvp` attaches to all."""

    def __init__(self, rules: list[Rule]) -> None:
        self.rules = [r for r in rules]

    def defjvp(self, fn: JvpFn) -> JvpFn:
        for r in self.rules:
            r.jvp_fn = fn
        return fn

    def defcheck(self, fn: Callable) -> Callable:
        for r in self.rules:
            r.check_fn = fn
        return fn


def register_nondiff(*op_types: str, domain: str = "", since: int = 1, until: int | None = None) -> None:
    """Declare ops whose outputs carry no gradient (piecewise constant or integer-valued)."""
    for name in op_types:
        _add(Rule(op_type=name, domain=_norm_domain(domain), since=since, until=until, nondiff=True))


def _qual(node: onnx.NodeProto) -> str:
    d = _norm_domain(node.domain)
    return f"{d}::{node.op_type}" if d else node.op_type


def find(node: onnx.NodeProto, opset: int) -> Rule | None:
    """The rule for `node` at `opset`, or None."""
    for r in RULES.get((_norm_domain(node.domain), node.op_type), ()):
        if r.covers(opset):
            return r
    return None


def lookup(node: onnx.NodeProto, opset: int, behind: Sequence[str] | None = None) -> Rule:
    """The rule for `node` at `opset`; UnsupportedOpError (one line) when there is none.
    `behind`: the trainable parameters whose gradient paths reach the node (named in the
    message as what to exclude)."""
    rule = find(node, opset)
    if rule is not None:
        return rule
    known = RULES.get((_norm_domain(node.domain), node.op_type))
    if known:
        ranges = ", ".join(f"{r.since}..{r.until or ''}" for r in known)
        why = f"has no gradient rule at this opset (rules exist for opsets {ranges})"
    else:
        why = "has no gradient rule"
    raise UnsupportedOpError(f"{describe(node, opset)} {why}; {remedy(behind)}")


def describe(node: onnx.NodeProto, opset: int) -> str:
    """"node 'name': op X (domain D, opset N)"."""
    return f"node {node.name!r}: op {node.op_type} (domain {_norm_domain(node.domain) or 'ai.onnx'}, opset {opset})"


def remedy(behind: Sequence[str] | None, what: str = "register a gradient rule for it") -> str:
    """What to do about an op without a rule: exclude the parameters behind it, or add a rule."""
    docs = "docs/extending.md#an-op-rule"
    if behind is None:
        return f"exclude the parameters whose gradients pass through it (--exclude) or {what} ({docs})"
    if not behind:
        return f"{what} ({docs})"
    shown = list(behind)[:6]
    more = f" ... ({len(behind)} parameters in all)" if len(behind) > len(shown) else ""
    flags = " ".join(f"--exclude {p}" for p in shown)
    return f"exclude the parameters behind it ({flags}{more}) or {what} ({docs})"


def supported_ops(jvp: bool = False, nondiff: bool = True) -> list[str]:
    """Sorted op names having a rule (with `jvp=True`: having a forward-mode rule)."""
    out = set()
    for (domain, op), rules in RULES.items():
        for r in rules:
            if (not nondiff and r.nondiff) or (jvp and not r.has_jvp):
                continue
            out.add(f"{domain}::{op}" if domain else op)
    return sorted(out)


# populate the registry (no two modules register the same op, so the order is immaterial)
from kfac_compiler.oprules import (  # noqa: E402,F401
    arithmetic,
    attention,
    conv,
    einsum,
    matmul,
    nondifferentiable,
    normalization,
    pooling,
    reduce,
    resize,
    rms_norm,
    sampling,
    selection,
    softmax,
    spectral,
    tensor,
    unary,
)

# helpers for rule authors (extensions included): a float constant in the builder's float type,
# a cotangent summed back to a broadcast operand's shape, whether an input's cotangent is needed,
# the jvp of an op linear in one input
from kfac_compiler.oprules._util import c as const  # noqa: E402
from kfac_compiler.oprules._util import linear_jvp, need, unbroadcast  # noqa: E402

__all__ = ["RULES", "Rule", "const", "describe", "find", "linear_jvp", "lookup", "need", "register",
           "register_nondiff", "remedy", "supported_ops", "unbroadcast"]
