"""The Fisher-block contract (the registry and the menu are in registry.py).

A block owns the curvature of one Layer (its linked parameters). It says which factors it
keeps (shapes, for the plan), emits the ONNX nodes that estimate them from one batch, emits
the nodes that refresh their damped inverses, and emits the nodes that multiply a gradient
by the block's curvature, its inverse or a matrix power.

Conventions (docs/conventions.md): N batch size, T weight-sharing positions of a use, R
uses. a~ is the layer input (conv: the receptive-field patch ordered like the flattened
weight (C_in/group, *kernel)) with a homogeneous coordinate appended LAST for the bias.
delta is the per-example loss gradient w.r.t. the layer output (N times the gradient of the
mean loss). A = 1/(N T R) sum a~ a~^T, G = 1/N sum delta delta^T, F_block ~ A (x) G for the
matrix [W | b] (rows outputs, columns inputs then bias).
"""
from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

import numpy as np

from kfac_compiler import linalg
from kfac_compiler.blocks.gram import GramStatistic
from kfac_compiler.blocks.registry import BLOCK_CLASSES, BLOCKS, block_class, register_block  # noqa: F401  (lived here)
from kfac_compiler.builder import GraphBuilder
from kfac_compiler.errors import ConfigError
from kfac_compiler.ir import FactorSpec, Layer


class InverseState(dict):
    """What emit_inverse returns: {inverse_specs() name: tensor name} (a plain dict for
    callers that iterate it) plus the attribute `ok`: the name of a boolean scalar tensor,
    False when a factor or its inverse was NaN/Inf/singular (the state is then `previous`,
    or the identity without one)."""

    ok: str | None = None


class FisherBlock:
    """Base class. Subclasses set `name`, `layer_kinds` (and where the block appears in the
    menu: `uses`, `menu_rank`; see registry.py) and implement the specs, the statistics, the
    inverse and ONE power hook, `emit_power` with its twin `numpy_power`: (F + damping)^p v
    from the factors or from a state. emit_multiply (p = 1), emit_multiply_inverse (p = -1,
    the inverse state), emit_multiply_matpower (integer p), emit_multiply_state and their
    numpy twins are derived from it (docs/extending_blocks.md).

    `param_shapes` maps each of the layer's parameter names to its initializer shape.
    `input_shapes` (optional) gives the static shape of each use's input tensor
    (layer.uses[u].input), dynamic dims as None/str; blocks that need it (FLOP estimates,
    the rank of a scale_and_shift input) otherwise read layer.attrs["input_shape"].
    `options` are block options (documented per block: damping_mode, inverse_options, ...).
    Tensor names passed to and returned by the emit_* methods live in the graph that the
    GraphBuilder `b` appends to.
    """

    name: ClassVar[str] = ""
    layer_kinds: ClassVar[tuple[str, ...]] = ()
    uses: ClassVar[str] = "any"  # "single" | "multi" | "any": which of the kind's menus list it
    menu_rank: ClassVar[int] = 100  # place in its menus, lowest first (= the default)
    # True: numpy_matpower gives a state for any real exp (an eigendecomposition), used by
    # numpy_multiply_matpower for exp = 1 too; False: only the inverse state (exp = -1).
    host_matpowers: ClassVar[bool] = False
    # Inverse-state slots (inverse_specs() names) that are also moving averages re-estimated
    # on every statistics step from a statistic that reads the inverse state (ekfac's S in
    # the eigenbases A_Q, G_Q): emit_statistics / numpy_statistics then get `state=` (the
    # inverse slots) and return these names beside the factors; the back end folds them
    # into the inverse slots with the factors' moving-average coefficient, and a graph that
    # updates them preconditions with the updated value. Empty: statistics see no state.
    state_statistics: ClassVar[tuple[str, ...]] = ()
    # True: emit_statistics / numpy_statistics take `masked` (bool). The back end passes
    # masked=True for a weighted loss: a row (position) of a use whose cotangent is 0 in every
    # seed (a masked position or an example of weight 0: nothing of the loss depends on it)
    # is then left out of the statistics of the layer's activations (A: the mean over the
    # other rows; ops.emit_live). Statistics of the cotangents (G) and of per-example
    # gradients leave such rows out anyway. False: a weighted run's activation statistics
    # still count every row. emit_statistics may get an ops.LiveCount instead of True (a
    # step a data-parallel run cuts): the number of live rows then passes through it before
    # it divides (ops.emit_live_count, ops.emit_token_counts do that).
    masks_rows: ClassVar[bool] = False
    # True: emit_statistics takes `examples`, the batch's number of examples N (a float scalar
    # tensor; the back end passes the loss output's leading dim), and divides its sums over
    # rows of cotangents (G = 1/N sum delta delta^T) by it. A layer's rows are examples x
    # positions in any layout: an attention projection on time-major [T, N, D] or merged
    # [T*N, D] rows (torch's nn.MultiheadAttention) has T or T*N as the cotangents' leading
    # dim, which is N only for batch-major rows. With `examples` None (the numpy twins, the
    # lower-level API) the leading dim stands in (ops.emit_examples). Per-example statistics
    # (diagonal blocks, ekfac's S, scale_and_shift, broadcast) still group rows into examples
    # by the leading axis (docs/conventions.md "The example axis").
    divides_by_examples: ClassVar[bool] = False
    # How the statistics group a use's rows into examples (passes/batch_axis places each
    # tensor's example axis): "pooled": sums over all rows (Kronecker factors, the generic
    # pseudo-example): any layout. "movable": per-example, every axis but the last a position
    # (fully connected, embedding lookups): the back end hands the block its tensors with the
    # example axis moved to the front (ops.emit_batch_major) when a use is time-major or
    # merged. "leading": per-example by the leading axis, correct only for batch-major rows;
    # compile warns (plan.notes) about a layer whose rows it placed off the leading axis.
    example_rows: str = "leading"  # a class attribute; a block may refine it per instance (scale_and_shift)
    # "movable" blocks: True when they pair a use's input rows with its output rows (the input
    # is moved too and must be placed alike); False when they read only the output's rows
    # (broadcast: its input is batch-less indices or unused)
    moves_inputs: bool = True
    # True: the power hook needs the current parameter values (a reparametrized layer such as
    # blocks/weight_norm.py maps between its parameters and the weight its factors describe):
    # emit_power / numpy_power and the multiplies derived from them take `params` ({parameter
    # name: tensor name} in the graph, where the parameters are state inputs of their own
    # names; {name: array} in numpy). False: they are called without it.
    reads_params: ClassVar[bool] = False

    def __init__(
        self,
        layer: Layer,
        param_shapes: dict[str, tuple[int, ...]],
        input_shapes: list[tuple | None] | None = None,
        **options,
    ) -> None:
        self.layer = layer
        self.param_shapes = param_shapes
        self.input_shapes = input_shapes
        self.options = options

    # What the plan records -------------------------------------------------
    @abstractmethod
    def factor_specs(self) -> list[FactorSpec]:
        """The factors kept as moving averages (names unique within the block)."""
        raise NotImplementedError

    @abstractmethod
    def inverse_specs(self) -> list[FactorSpec]:
        """The state refreshed by the inverse update (damped inverses, eigenbases, ...)."""
        raise NotImplementedError

    @abstractmethod
    def stats_flops(self, batch: int) -> int:
        """FLOPs of one statistics update for a batch of `batch` examples."""
        raise NotImplementedError

    @abstractmethod
    def inverse_flops(self, method: str = linalg.DEFAULT_METHOD) -> int:
        """FLOPs of one inverse update by `method` (a concrete linalg method)."""
        raise NotImplementedError

    def apply_flops(self) -> int:
        """FLOPs of one preconditioning multiply by the inverse state: paid on every step, so
        no schedule amortizes it (the cost-aware choice, passes/budget.py, reads it)."""
        return 2 * self.param_elements()

    def positions_per_example(self) -> int:
        """Weight-sharing positions per example (conv output locations, tokens), summed over uses."""
        return 1

    def forward_flops(self, batch: int) -> int:
        """FLOPs of the layer's own forward pass on `batch` examples (its backward costs about
        twice that): the unit the cost-aware choice measures the curvature work in."""
        return 2 * batch * self.positions_per_example() * self.param_elements()

    def param_elements(self) -> int:
        return sum(int(np.prod(s)) for s in self.param_shapes.values())

    # What the emitted graphs compute ---------------------------------------
    @abstractmethod
    def emit_statistics(
        self, b: GraphBuilder, inputs: list[str], cotangents: list[list[str]]
    ) -> dict[str, str | GramStatistic]:
        """One batch's estimate of every factor.

        inputs[u]: forward value of layer.uses[u].input. cotangents[u][s]: per-example loss
        gradient delta w.r.t. layer.uses[u].output for seed s, already scaled so that the
        factor is the SUM over seeds (the estimator folds 1/num_samples in).
        Returns {factor name: tensor name, or a statistics.GramStatistic (X^T X / count left
        as its operands; statistics.emit_statistic materializes it)} for every factor_specs()
        entry. A block with `state_statistics` is called with the keyword `state` (its
        inverse slots) and returns those names too; a block with `masks_rows` is called
        with the keyword `masked` for a weighted loss; a block with `divides_by_examples` with the
        keyword `examples`.
        """
        raise NotImplementedError

    @abstractmethod
    def emit_inverse(
        self,
        b: GraphBuilder,
        factors: dict[str, str],
        damping: str,
        method: str,
        previous: dict[str, str] | None = None,
    ) -> dict[str, str]:
        """Damped inverse state from the (moving-average) factors; damping is a scalar tensor.

        `previous` (optional) maps inverse_specs() names to the current state: a warm start
        (Newton-Schulz) and the value kept when the new inverse is not usable. The result
        is an InverseState: every inverse_specs() name, and `.ok`, a boolean scalar tensor
        (False: the state returned is `previous`, or the identity without one, because a
        factor or its inverse was NaN/Inf/singular). Pass `previous` (the state slots):
        without it a failed block falls back to the identity. Host-side inverses
        (inverse_is_host(method): linalg.HOST_METHODS, exact damping, the RNN series
        blocks) are not emitted: the runtime calls numpy_inverse(factors, damping, method,
        previous) -> (state, ok) instead and uploads the state.
        """
        raise NotImplementedError

    @property
    def host_inverse_only(self) -> bool:
        """True when the inverse is host-side whatever the method (see inverse_is_host): the
        one override a host-only block needs (inverse_is_host and the parts blocks' stacking
        follow from it)."""
        return False

    def inverse_is_host(self, method: str) -> bool:
        """True when this block's inverse for `method` is computed on the host
        (numpy_inverse) rather than emitted (emit_inverse): host methods (linalg.HOST_METHODS),
        and every method for a host-only block (exact damping, the RNN series blocks)."""
        return self.host_inverse_only or linalg.is_host_method(method)

    # The power hook: a block implements these two; the multiplies below derive from them --
    @abstractmethod
    def emit_power(
        self,
        b: GraphBuilder,
        vectors: dict[str, str],
        exp: float | None,
        *,
        factors: dict[str, str] | None = None,
        damping: str | None = None,
        state: dict[str, str] | None = None,
    ) -> dict[str, str]:
        """(F + damping)^exp v in ONNX, v keyed by parameter name; one of two operands:

        * `factors` and `damping` (a scalar tensor): the damped curvature raised to `exp`;
          exp = 1 always, integer exps where the block can emit them;
        * `state`: a state already holding the power: the inverse state (emit_inverse /
          numpy_inverse) for exp = -1, or a numpy_matpower state (exp None).

        A power the block cannot emit raises ConfigError naming the layer and the host way
        (numpy_matpower, numpy_inverse)."""
        raise NotImplementedError

    @abstractmethod
    def numpy_power(
        self,
        vectors: dict,
        exp: float | None,
        *,
        factors: dict | None = None,
        damping: float | None = None,
        state: dict | None = None,
    ) -> dict:
        """numpy twin of emit_power (float64 inside). With factors it is called for exp = 1;
        other host powers go through a numpy_matpower state (numpy_multiply_matpower)."""
        raise NotImplementedError

    # Derived from the hook ------------------------------------------------------------------
    def _params_kw(self, params: dict | None) -> dict:
        """{"params": params} for a block that reads them (reads_params), else {}."""
        if not self.reads_params:
            return {}
        if params is None:
            raise ConfigError(f"layer {self.layer.name!r}: the {self.name!r} block needs the parameter values "
                              "to multiply (pass params=)")
        return {"params": params}

    def emit_multiply(
        self, b: GraphBuilder, vectors: dict[str, str], factors: dict[str, str], damping: str,
        params: dict[str, str] | None = None,
    ) -> dict[str, str]:
        """(F + damping) v for the block's parameters."""
        return self.emit_power(b, vectors, 1, factors=factors, damping=damping, **self._params_kw(params))

    def emit_multiply_inverse(
        self, b: GraphBuilder, grads: dict[str, str], inverses: dict[str, str], params: dict[str, str] | None = None
    ) -> dict[str, str]:
        """(F + damping)^-1 g for the block's parameters, g keyed by parameter name, by the
        inverse state (emit_inverse, or numpy_inverse uploaded)."""
        return self.emit_power(b, grads, -1, state=inverses, **self._params_kw(params))

    def emit_multiply_state(self, b: GraphBuilder, vectors: dict[str, str], state: dict[str, str],
                            params: dict[str, str] | None = None) -> dict[str, str]:
        """Multiply by a host state (numpy_matpower, numpy_inverse) fed to the graph."""
        return self.emit_power(b, vectors, None, state=state, **self._params_kw(params))

    def emit_multiply_matpower(
        self, b: GraphBuilder, vectors: dict[str, str], factors: dict[str, str], damping: str, exp: float,
        params: dict[str, str] | None = None,
    ) -> dict[str, str]:
        """(F + damping)^exp v for an integer exp, in ONNX (fractional exps: host-side
        numpy_matpower, then emit_multiply_state with that state)."""
        return self.emit_power(b, vectors, exp, factors=factors, damping=damping, **self._params_kw(params))

    # The preconditioner's state for a power other than -1 (kfac-jax's precon_power) ----------
    def check_power(self, exp: float) -> None:
        """ConfigError naming the layer when the block has no state for (F + damping)^exp."""
        if exp != -1 and not self.host_matpowers:
            raise ConfigError(
                f"layer {self.layer.name!r}: the {self.name!r} block has no matrix power {exp:g} "
                "(precon_power); use precon_power=-1 or another approximation for this layer"
            )

    def emits_power(self, exp: float, method: str) -> bool:
        """True when emit_power_state emits the state for `exp` (else numpy_power_state)."""
        return exp == -1 and not self.inverse_is_host(method)

    def emit_power_state(self, b: GraphBuilder, factors: dict[str, str], damping: str, exp: float,
                         method: str, previous: dict[str, str] | None = None) -> InverseState:
        """The state keyed like inverse_specs() that emit_multiply_inverse turns into
        (F + damping)^exp v; exp = -1 is emit_inverse."""
        if exp == -1:
            return self.emit_inverse(b, factors, damping, method, previous)
        raise ConfigError(f"layer {self.layer.name!r}: matrix power {exp:g} of {self.name!r} is host-side "
                          "(numpy_power_state)")

    def numpy_power_state(self, factors: dict, damping: float, exp: float, method: str = "eigh",
                          previous: dict | None = None) -> tuple[dict, bool]:
        """numpy twin of emit_power_state: numpy_inverse for -1, else numpy_matpower's state
        under the inverse slots' names; not ok => previous (or numpy_inverse's fallback)."""
        if exp == -1:
            return self.numpy_inverse(factors, damping, method, previous)
        self.check_power(exp)
        state, ok = self.numpy_matpower(factors, damping, exp)
        state = {(k[:-4] + "_inv" if k.endswith("_pow") else k): v for k, v in state.items()}
        if not ok:
            return (dict(previous) if previous is not None else self.numpy_inverse(factors, damping, method)[0]), False
        return state, True

    # numpy twins (host-side inverse methods, tests); arrays keyed like the emit_* methods
    @abstractmethod
    def numpy_statistics(self, inputs: list, cotangents: list[list]) -> dict:
        raise NotImplementedError

    @abstractmethod
    def numpy_inverse(self, factors: dict, damping: float, method: str = "eigh", previous: dict | None = None):
        """-> (state keyed like inverse_specs(), ok: bool); not ok => state = previous (or identity)."""
        raise NotImplementedError

    def numpy_matpower(self, factors: dict, damping: float, exp: float):
        """-> (state for emit_multiply_state / numpy_multiply_state, ok). Here: the inverse
        state for exp = -1; blocks with host_matpowers compute any real exp."""
        if exp == -1:
            return self.numpy_inverse(factors, damping)
        raise ConfigError(f"layer {self.layer.name!r}: {self.name} supports matrix powers 1 and -1 only")

    def numpy_multiply(self, vectors: dict, factors: dict, damping: float, params: dict | None = None) -> dict:
        return self.numpy_power(vectors, 1, factors=factors, damping=damping, **self._params_kw(params))

    def numpy_multiply_inverse(self, grads: dict, state: dict, params: dict | None = None) -> dict:
        return self.numpy_power(grads, -1, state=state, **self._params_kw(params))

    def numpy_multiply_state(self, vectors: dict, state: dict, params: dict | None = None) -> dict:
        return self.numpy_power(vectors, None, state=state, **self._params_kw(params))

    def numpy_multiply_matpower(self, vectors: dict, factors: dict, damping: float, exp: float,
                                params: dict | None = None) -> dict:
        """(F + damping)^exp v for any real exp the block supports, via numpy_matpower's state."""
        if exp == 1 and not self.host_matpowers:
            return self.numpy_multiply(vectors, factors, damping, params)
        state, _ = self.numpy_matpower(factors, damping, exp)
        return self.numpy_power(vectors, exp, state=state, **self._params_kw(params))


def make_block(
    layer: Layer,
    param_shapes: dict[str, tuple[int, ...]],
    input_shapes: list[tuple | None] | None = None,
    **options,
) -> FisherBlock:
    """The block object for a layer whose `approximation` is set."""
    cls = block_class(layer.approximation or "", layer.kind)
    if cls is None:
        raise ConfigError(f"layer {layer.name!r}: no Fisher block {layer.approximation!r} for kind {layer.kind!r}")
    return cls(layer, param_shapes, input_shapes, **options)
