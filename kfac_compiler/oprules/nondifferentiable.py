"""The ops with no gradient: their outputs are piecewise constant, integer-valued, random or
shape-derived, so they carry no (co)tangent (see `register_nondiff`)."""
from __future__ import annotations

from kfac_compiler.oprules import register_nondiff

register_nondiff(
    "Shape", "Size", "Constant", "ConstantOfShape", "Range", "EyeLike", "OneHot",
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor",
    "IsNaN", "IsInf", "ArgMax", "ArgMin", "NonZero", "Floor", "Ceil", "Round", "Sign",
    "Hardmax", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
    "Multinomial", "Bernoulli", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor",
    "BitwiseNot", "NonMaxSuppression", "StringNormalizer", "RegexFullMatch",
)
