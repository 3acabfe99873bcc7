"""A new differentiation rule from one file: Mish (opset 18), y = x tanh(softplus(x)).

    dy/dx = tanh(s) + x sigmoid(x) (1 - tanh(s)^2),  s = softplus(x)

`unary` registers an elementwise op from one function returning v * f'(x); it serves as both
the reverse-mode rule (v: the output's cotangent) and the forward-mode rule (v: the input's
tangent). See docs/extending.md, "An op rule", and docs/autodiff.md for rules of any shape.
"""
from __future__ import annotations

from kfac_compiler.oprules import const
from kfac_compiler.oprules.unary import unary


@unary("Mish", since=18)
def mish(b, node, x, y, v):
    t = b.op("Tanh", [b.op("Softplus", [x])])
    slope = b.add(t, b.mul(b.mul(x, b.op("Sigmoid", [x])), b.sub(const(b, 1.0), b.mul(t, t))))
    return b.mul(v, slope)
