"""Graph helpers shared by every module (private): gradients, state, constants.

Every module of :mod:`lasagne_accum` builds its state (velocities, moments,
accumulators, counters) through :func:`state_like` and :func:`scalar_state`,
so all state variables follow one convention: same dtype (or a wider float
for accumulators), same static shape as their parameter, and a readable,
stable name such as ``W1.adam_m`` that checkpoints rely on.
:func:`get_or_compute_grads` is Lasagne's (re-exported by
:mod:`lasagne_accum.updates`), and :func:`hyperparameter` makes a checked
scalar of a number or a symbolic value.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Mapping, cast

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.gradient import DisconnectedInputError
from pytensor.graph.traversal import ancestors
from pytensor.tensor.variable import TensorVariable

from ._checks import check_number, check_params, is_number, param_label

if TYPE_CHECKING:
    from pytensor.graph.basic import Variable
    from pytensor.tensor.sharedvar import TensorSharedVariable

    from ._typing import LossOrGrads, Params, Scalar

__all__ = ["get_or_compute_grads", "state_like", "scalar_state", "hyperparameter",
           "accumulator_dtype", "as_host_array", "write_value", "sum_of_squares"]


def sum_of_squares(x: Any, dtype: str) -> TensorVariable:
    """``sum(sqr(cast(x, dtype)))``: the squared norm of `x`, summed in `dtype`.

    Tagged so that the C and Numba modes of :func:`lasagne_accum.mode` compute it
    with one vectorized loop (:class:`lasagne_accum._pytensor.sum_squares.SumSquares`);
    other modes run PyTensor's own reduction.
    """
    from ._pytensor.sum_squares import TAG

    out = pt.sqr(pt.cast(x, dtype)).sum()
    setattr(out.tag, TAG, True)
    return out


def as_host_array(value: Any) -> np.ndarray:
    """A shared variable's value as a numpy array, wherever it lives.

    Shared values are numpy arrays under the C and Numba backends, JAX arrays
    after a call compiled with ``mode="JAX"`` and torch tensors with
    ``mode="PYTORCH"``; device values are copied to the host (a copy of its
    own: the device value may be updated in place, or donated, later).

    Examples
    --------
    >>> as_host_array([1.0, 2.0])
    array([1., 2.])
    """
    from ._pytensor.values import to_host

    return np.asarray(to_host(value))


def write_value(variable: SharedVariable, value: Any) -> None:
    """Set a shared variable to `value` (a numpy array), where its current value lives.

    A torch tensor of the same shape receives the values in place (it stays
    on its device, and PyTorch-mode functions keep updating the same
    storage); any other value is replaced with ``set_value`` (a JAX-mode
    function moves a numpy value to the device on its next call).

    Examples
    --------
    >>> import pytensor
    >>> w = pytensor.shared(np.zeros(2), name="w")
    >>> write_value(w, np.array([1.0, 2.0])); w.get_value()
    array([1., 2.])
    """
    from ._pytensor.values import backend_of_value

    current = variable.get_value(borrow=True)
    kind = backend_of_value(current)
    host = np.asarray(value)
    if kind == "pytorch" and tuple(current.shape) == host.shape:
        import torch

        with torch.no_grad():
            current.copy_(torch.as_tensor(host.astype(variable.type.dtype, copy=False)))
        return
    variable.set_value(host)



def _check_grad(grad, param, i):
    """Return `grad` as a tensor of `param`'s dtype, or raise naming `param`."""
    label = param_label(param, i)
    try:
        grad = pt.as_tensor_variable(grad)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"gradient for {label} is not a tensor expression: {exc}") from None
    if grad.type.ndim != param.type.ndim:
        raise ValueError(
            f"gradient for {label} has {grad.type.ndim} dimensions but {label} has "
            f"{param.type.ndim}; pass grads in the same order as params"
        )
    pshape = param.type.shape
    # A shared variable's static shape is usually unknown; its value is not.
    value_shape = np.shape(param.get_value(borrow=True))
    for axis, (g, p, v) in enumerate(zip(grad.type.shape, pshape, value_shape)):
        known = p if p is not None else v
        if g is not None and g != known:
            raise ValueError(
                f"gradient for {label} has length {g} on axis {axis} but {label} has "
                f"length {known}; pass grads in the same order as params"
            )
    if not grad.type.dtype.startswith("float"):
        raise TypeError(
            f"gradient for {label} has dtype {grad.type.dtype}; a float gradient is needed"
        )
    if grad.type.dtype != param.type.dtype:
        grad = pt.cast(grad, param.type.dtype)
    return grad


def get_or_compute_grads(loss_or_grads: LossOrGrads, params: Params) -> list[TensorVariable]:
    """Return a list of gradient expressions, one per parameter.

    Parameters
    ----------
    loss_or_grads : symbolic scalar or list of expressions
        A scalar loss expression, or a list of gradient expressions (one per
        parameter, in the order of `params`).
    params : list of shared variables
        The variables to return the gradients for.

    Returns
    -------
    list of expressions
        If `loss_or_grads` is a list, its elements checked against `params`
        and cast to each parameter's dtype; otherwise
        ``pytensor.grad(loss_or_grads, params)``.

    Raises
    ------
    ValueError
        If `loss_or_grads` is a list of a different length than `params`, a
        gradient's shape cannot match its parameter, the loss is not a scalar,
        or a parameter appears twice.
    TypeError
        If an element of `params` is not a float shared variable.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> w = pytensor.shared(np.ones(3), name="w")
    >>> x = pt.vector("x")
    >>> (g,) = get_or_compute_grads(pt.sum(w * x), [w])
    >>> g.eval({x: [1.0, 2.0, 3.0]})
    array([1., 2., 3.])
    """
    params = check_params(params)
    if isinstance(loss_or_grads, (list, tuple)):
        if len(loss_or_grads) != len(params):
            raise ValueError(
                f"got {len(loss_or_grads)} gradient expressions for {len(params)} "
                "parameters; pass one gradient per parameter"
            )
        return [_check_grad(g, p, i) for i, (g, p) in enumerate(zip(loss_or_grads, params))]
    if not isinstance(loss_or_grads, pytensor.graph.basic.Variable):
        raise TypeError(
            "loss_or_grads must be a scalar loss expression or a list of gradients, "
            f"got {type(loss_or_grads).__name__}"
        )
    ndim = getattr(loss_or_grads.type, "ndim", None)
    if ndim != 0:
        hint = "reduce it first (for example with .mean())"
        if ndim is not None and len(params) == 1 and ndim == params[0].type.ndim:
            hint = (
                f"if it is the gradient of {param_label(params[0], 0)}, pass a list with one "
                f"gradient per parameter ([grad]); if it is a loss, {hint}"
            )
        raise ValueError(
            f"loss_or_grads must be a scalar loss or a list of gradients; got a single "
            f"{ndim}-dimensional {loss_or_grads.type} (the loss must be a scalar): {hint}"
        )
    try:
        grads = cast("list[Variable]", pytensor.grad(loss_or_grads, params))
    except DisconnectedInputError:
        inputs = set(ancestors([loss_or_grads]))
        loose = [f"params[{i}] ({param_label(p, i)})" for i, p in enumerate(params)
                 if p not in inputs]
        raise ValueError(
            f"the loss does not depend on {', '.join(loose) or 'some of the params'}; "
            "remove it from params (or pass its gradient yourself in a list)"
        ) from None
    return [_check_grad(g, p, i) for i, (g, p) in enumerate(zip(grads, params))]


def accumulator_dtype(dtype: str | np.dtype) -> str:
    """The dtype to accumulate values of `dtype` in: at least float32."""
    return "float64" if str(dtype) == "float64" else "float32"


def guard_updates(updates: Mapping[Any, Any], signal: Variable) -> OrderedDict:
    """Each variable of `updates` keeps its value on calls where `signal` is false.

    Every new value becomes ``switch(signal, new, var)`` and carries the signal as
    ``tag.step_signal`` (which :class:`lasagne_accum.ModelAverage` reads); a value
    that already carries this signal is kept as it is.
    """
    out = OrderedDict()
    for var, new in updates.items():
        new = pt.as_tensor_variable(new)
        if getattr(new.tag, "step_signal", None) is not signal:
            new = pt.switch(signal, new, var)
            new.tag.step_signal = signal
        out[var] = new
    return out


def state_like(
    param: SharedVariable,
    suffix: str,
    index: int | None = None,
    dtype: str | None = None,
    value: float = 0.0,
) -> TensorSharedVariable:
    """A shared variable shaped like `param`, filled with `value`.

    Parameters
    ----------
    param : shared variable
        The parameter the state belongs to.
    suffix : str
        Appended to the parameter's name: ``W1`` and ``"adam_m"`` give
        ``W1.adam_m``.
    index : int, optional
        Position of `param` in its list, used in the name when the parameter
        has none (``param0.adam_m``).
    dtype : str, optional
        Defaults to the parameter's dtype.
    value : float
        Initial value of every element.

    Returns
    -------
    TensorSharedVariable
        With the parameter's static shape (broadcast pattern) and current
        value shape.

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> W = pytensor.shared(np.ones((2, 3), dtype="float32"), name="W", shape=(2, 3))
    >>> m = state_like(W, "adam_m")
    >>> m.name, m.type.dtype, m.type.shape, m.get_value().sum()
    ('W.adam_m', 'float32', (2, 3), np.float32(0.0))
    """
    dtype = dtype or param.type.dtype
    shape = np.shape(param.get_value(borrow=True))
    return pytensor.shared(
        np.full(shape, value, dtype=dtype),
        name=f"{param_label(param, index)}.{suffix}",
        shape=param.type.shape,
    )


def scalar_state(name: str, dtype: str, value: float = 0) -> TensorSharedVariable:
    """A scalar shared variable (a counter or a running total).

    Examples
    --------
    >>> t = scalar_state("adam.t", "float32")
    >>> t.name, t.type.dtype, t.type.ndim
    ('adam.t', 'float32', 0)
    """
    return pytensor.shared(np.asarray(value, dtype=dtype), name=name)


def hyperparameter(
    value: Scalar,
    name: str,
    dtype: str,
    *,
    low: float | None = None,
    high: float | None = None,
    high_open: bool = False,
) -> TensorVariable:
    """Return `value` as a scalar of `dtype`, checking Python numbers.

    Parameters
    ----------
    value : number or symbolic scalar
        A Python/numpy number, or a scalar expression (a shared learning rate,
        for example, so that a schedule can change it between calls).
    name : str
        The hyperparameter's name, for error messages.
    dtype : str
        The dtype of the parameter it will be combined with; the value is cast
        to it so that a float32 model stays float32.
    low, high : float, optional
        Allowed range for a number (inclusive; `high` exclusive when
        `high_open`), checked by :func:`~lasagne_accum._checks.check_number`.
        Symbolic values cannot be checked at build time.

    Raises
    ------
    TypeError
        If `value` is neither a number nor a scalar expression.
    ValueError
        If a number is not finite or lies outside the allowed range.
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a number or a symbolic scalar, got a bool")
    if is_number(value):
        number = check_number(value, name, low=low, high=high, high_open=high_open)
        return pt.constant(np.asarray(number, dtype=dtype), name=name)
    if isinstance(value, pytensor.graph.basic.Variable):
        if getattr(value.type, "ndim", None) != 0:
            raise TypeError(f"{name} must be a scalar, got {value.type}")
        if not isinstance(value, TensorVariable):
            value = pt.as_tensor_variable(value)
        return value if value.type.dtype == dtype else pt.cast(value, dtype)
    raise TypeError(
        f"{name} must be a number or a symbolic scalar, got {type(value).__name__}"
    )


