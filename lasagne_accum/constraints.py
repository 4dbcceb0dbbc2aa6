"""Norm constraints: Lasagne's ``norm_constraint`` and ``total_norm_constraint``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import pytensor.tensor as pt

from ._graph import hyperparameter

if TYPE_CHECKING:
    from pytensor.graph.basic import Variable
    from pytensor.tensor.variable import TensorVariable

    from ._typing import Scalar

__all__ = ["norm_constraint", "total_norm_constraint"]


def _float_dtype(var):
    dtype = var.type.dtype
    return dtype if dtype.startswith("float") else "float64"


def norm_constraint(
    tensor_var: Variable,
    max_norm: Scalar,
    norm_axes: int | Sequence[int] | None = None,
    epsilon: Scalar = 1e-7,
) -> TensorVariable:
    """Max weight norm constraint: rescale slices whose norm exceeds `max_norm`.

    The norm is taken over `norm_axes`; every slice along the remaining axes
    whose norm exceeds `max_norm` is scaled down to it:

    * ``norms = sqrt(sum(tensor_var ** 2, axis=norm_axes, keepdims=True))``
    * ``constrained = tensor_var * clip(norms, 0, max_norm) / (epsilon + norms)``

    Parameters
    ----------
    tensor_var : TensorVariable
        The tensor to constrain, typically ``updates[W]``.
    max_norm : float or symbolic scalar
        The largest norm a slice may have.
    norm_axes : sequence of int, optional
        Axes to take the norm over. By default (as in Lasagne) axis 0 for a
        2-D tensor (the norm of each column: the incoming weights of a dense
        unit) and all axes but the first for a 3-, 4- or 5-D tensor (the norm
        of each convolution filter). Other ranks need `norm_axes`.
    epsilon : float
        Added to the norms before dividing, so that a zero slice stays zero
        instead of producing NaN. Default 1e-7.

    Returns
    -------
    TensorVariable
        The constrained tensor, of the same dtype as `tensor_var`.

    Raises
    ------
    ValueError
        If `tensor_var` has a rank without default axes and `norm_axes` is not
        given, or `max_norm` or `epsilon` is a negative number.

    Notes
    -----
    Apply it to the *update* of a parameter (after the rule), for example
    ``updates[W] = norm_constraint(updates[W], 3.0)``. Slices whose norm is
    below `max_norm` are multiplied by ``norms / (epsilon + norms)``, which is
    1 up to `epsilon`, as in Lasagne.

    References
    ----------
    .. [1] Srivastava, N. et al. (2014): Dropout: A Simple Way to Prevent
       Neural Networks from Overfitting. JMLR 15, 1929-1958.

    Examples
    --------
    >>> import numpy as np, pytensor.tensor as pt
    >>> W = pt.matrix("W")
    >>> f = norm_constraint(W, 1.0)
    >>> f.eval({W: np.array([[3.0, 0.1], [4.0, 0.0]])}).round(4)
    array([[0.6, 0.1],
           [0.8, 0. ]])
    """
    tensor_var = pt.as_tensor_variable(tensor_var)
    ndim = tensor_var.type.ndim
    if norm_axes is not None:
        sum_over = tuple(int(a) for a in np.atleast_1d(norm_axes))
        for a in sum_over:
            if not -ndim <= a < ndim:
                raise ValueError(f"norm_axes contains {a}, out of range for a {ndim}-D tensor")
    elif ndim == 2:
        sum_over = (0,)
    elif ndim in (3, 4, 5):
        sum_over = tuple(range(1, ndim))
    else:
        raise ValueError(
            f"norm_constraint has no default norm_axes for a {ndim}-D tensor "
            f"({tensor_var}); pass norm_axes explicitly"
        )
    dtype = _float_dtype(tensor_var)
    max_norm = hyperparameter(max_norm, "max_norm", dtype, low=0)
    epsilon = hyperparameter(epsilon, "epsilon", dtype, low=0)
    norms = pt.sqrt(pt.sum(pt.sqr(tensor_var), axis=sum_over, keepdims=True))
    target_norms = pt.clip(norms, 0, max_norm)
    return tensor_var * (target_norms / (epsilon + norms))


def total_norm_constraint(
    tensor_vars: Sequence[Variable],
    max_norm: Scalar,
    epsilon: Scalar = 1e-7,
    return_norm: bool = False,
) -> list[TensorVariable] | tuple[list[TensorVariable], TensorVariable]:
    """Rescale a list of tensors so that their joint L2 norm is at most `max_norm`.

    * ``norm = sqrt(sum_i sum(tensor_vars[i] ** 2))``
    * ``scaled_i = tensor_vars[i] * clip(norm, 0, max_norm) / (epsilon + norm)``

    Parameters
    ----------
    tensor_vars : list of TensorVariable
        The tensors to rescale together, typically the gradients.
    max_norm : float or symbolic scalar
        The largest total norm allowed.
    epsilon : float
        Added to the norm before dividing. Default 1e-7.
    return_norm : bool
        If True, also return the total norm before rescaling.

    Returns
    -------
    list of TensorVariable, or (list, TensorVariable)
        The rescaled tensors, each in its own dtype, and the norm when
        `return_norm` is True.

    Raises
    ------
    ValueError
        If `tensor_vars` is empty or `max_norm`/`epsilon` is a negative number.

    Notes
    -----
    With gradient accumulation, clip the *accumulated* gradients (the
    ``.grads`` of :func:`lasagne_accum.accumulate_gradients`) once per optimizer
    step, never every mini-batch's gradient.

    References
    ----------
    .. [1] Sutskever, I., Vinyals, O. & Le, Q. V. (2014): Sequence to sequence
       learning with neural networks. NIPS 27, 3104-3112.

    Examples
    --------
    >>> import numpy as np, pytensor.tensor as pt
    >>> a, b = pt.vector("a"), pt.vector("b")
    >>> (sa, sb), norm = total_norm_constraint([a, b], 1.0, return_norm=True)
    >>> float(norm.eval({a: [3.0], b: [4.0]}))
    5.0
    >>> sa.eval({a: [3.0], b: [4.0]}).round(4)
    array([0.6])
    """
    tensor_vars = [pt.as_tensor_variable(t) for t in tensor_vars]
    if not tensor_vars:
        raise ValueError("total_norm_constraint needs at least one tensor")
    dtype = np.result_type(*[_float_dtype(t) for t in tensor_vars]).name
    norm = pt.sqrt(sum(pt.sum(pt.sqr(pt.cast(t, dtype))) for t in tensor_vars))
    target_norm = pt.clip(norm, 0, hyperparameter(max_norm, "max_norm", dtype, low=0))
    multiplier = target_norm / (hyperparameter(epsilon, "epsilon", dtype, low=0) + norm)
    scaled = [
        t * (multiplier if t.type.dtype == dtype else pt.cast(multiplier, t.type.dtype))
        for t in tensor_vars
    ]
    return (scaled, norm) if return_norm else scaled
