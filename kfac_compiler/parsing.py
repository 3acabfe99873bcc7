"""Strict parsing of booleans and numbers given as text (command-line values, environment
variables) and checking of values given by the API.

Python's truthiness turns any non-empty string into True ("no", "off", "0.0"), and float()
accepts "nan" and "inf": both give silently wrong settings. Here a boolean is one of a
fixed set of words, a number is finite unless the caller allows otherwise, and everything
else is a one-line ConfigError naming the option.
"""
from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from kfac_compiler.errors import ConfigError

TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")
BOOL_WORDS = "true/false, 1/0, yes/no or on/off"
MAX_NESTING = 100  # a document's deepest nesting of arrays/tables; ours need fewer than 10
T = TypeVar("T")


def nesting_checked(load: Callable[[], T]) -> T:
    """load() (a JSON or TOML decoder's call), with a document nested deeper than MAX_NESTING
    refused as a ValueError, which the callers already turn into their one-line error. The
    decoders' own limit is Python's recursion limit (a RecursionError with thousands of
    lines of traceback), and the code walking a document recurses too."""
    try:
        doc = load()
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_NESTING} levels") from None
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth >= MAX_NESTING:
                    raise ValueError(f"nested deeper than {MAX_NESTING} levels")
                stack.append((child, depth + 1))
    return doc


def parse_bool(text: str, name: str) -> bool:
    """'true'/'1'/'yes'/'on' -> True, 'false'/'0'/'no'/'off' -> False (any case); else ConfigError."""
    low = text.strip().lower()
    if low in TRUE_WORDS:
        return True
    if low in FALSE_WORDS:
        return False
    raise ConfigError(f"{name}: {text!r} is not a boolean; use {BOOL_WORDS}")


def parse_int(text: str, name: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ConfigError(f"{name}: {text!r} is not an integer") from None


def parse_float(text: str, name: str) -> float:
    """A finite float (NaN and infinities are refused: no setting of ours means them)."""
    try:
        value = float(text.strip())
    except ValueError:
        raise ConfigError(f"{name}: {text!r} is not a number") from None
    if not math.isfinite(value):
        raise ConfigError(f"{name}: {text!r} is not a finite number")
    return value


def check_bool(value: Any, name: str) -> bool:
    """An API boolean: True/False (numpy's too) or the integers 0 and 1; never truthiness."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral) and int(value) in (0, 1):
        return bool(value)
    raise ConfigError(f"{name} must be True or False, got {value!r}")


def check_int(value: Any, name: str, low: int | None = None) -> int:
    """An API integer (Python's or numpy's, not a bool, not a float), at least `low`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if low is not None and int(value) < low:
        raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def check_float(value: Any, name: str, positive: bool = False) -> float:
    """An API float: a finite real number (not a bool, not a string); > 0 if `positive`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if positive and float(value) <= 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")
    return float(value)


def compile_patterns(patterns: list[str], what: str) -> list[re.Pattern]:
    """Compile name-or-regex patterns; a bad regex is a ConfigError naming it."""
    out = []
    for p in patterns:
        try:
            out.append(re.compile(p))
        except re.error as e:
            raise ConfigError(f"{what}: bad regular expression {p!r}: {e}") from None
    return out


def name_matches(name: str, pattern: str, compiled: re.Pattern | None = None) -> bool:
    """Exact name, or a full regex match."""
    if name == pattern:
        return True
    rx = compiled if compiled is not None else re.compile(pattern)
    return rx.fullmatch(name) is not None
