"""The one Adam core: the moments of adam, adamax, amsgrad, adamw and lamb (private).

Every Adam-family rule keeps an int64 step counter ``<prefix>.t`` and, per
parameter, a first moment ``m`` and a second one (``v``; adamax's ``u``;
amsgrad also its running maximum ``vhat``), all in one dtype policy: the
parameter's dtype, float32 for a float16 parameter (float16 cannot hold
Adam's epsilon 1e-8 or small squared gradients), the result cast back.

Two bias corrections are written on top of the moments, each as its
reference defines it: Lasagne's (adam, adamax, amsgrad: the corrections
folded into the step size, ``epsilon`` added to ``sqrt(v)``) and optax's
(adamw, lamb: ``m_hat / (sqrt(v_hat) + epsilon)``, the corrections in
float64).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytensor.tensor as pt

from .._graph import hyperparameter, scalar_state, state_like
from ._core import _cast, _compute_dtype

__all__ = ["Moments", "adam_moments", "optax_directions"]


@dataclass
class Moments:
    """One parameter's moments after this step, and the updates of their state."""

    param: Any
    dtype: str
    m: Any
    second: Any
    updates: OrderedDict


def adam_moments(grads, params, beta1, beta2, prefix, kind="adam"):
    """The step counter and each parameter's moments (see the module notes).

    Parameters
    ----------
    kind : {"adam", "adamax", "amsgrad"}
        The second moment: ``v`` (``b2 * v + (1 - b2) * g ** 2``), adamax's
        ``u = max(b2 * u, |g|)``, or amsgrad's running maximum of ``v``.

    Returns
    -------
    (t_prev, t_next, moments)
        The int64 counter ``<prefix>.t`` and its next value, and one
        :class:`Moments` per parameter (its ``updates`` hold the state's new
        values; the counter's is the caller's to add, last).
    """
    t_prev = scalar_state(f"{prefix}.t", "int64")
    t_next = t_prev + pt.constant(np.int64(1))
    moments = []
    for i, (param, g) in enumerate(zip(params, grads)):
        dtype = _compute_dtype(param)
        g = _cast(g, dtype)
        b1 = hyperparameter(beta1, "beta1", dtype)
        b2 = hyperparameter(beta2, "beta2", dtype)
        updates = OrderedDict()
        m_prev = state_like(param, f"{prefix}_m", i, dtype=dtype)
        m = b1 * m_prev + (1 - b1) * g
        updates[m_prev] = m
        if kind == "adamax":
            u_prev = state_like(param, f"{prefix}_u", i, dtype=dtype)
            second = pt.maximum(b2 * u_prev, abs(g))
            updates[u_prev] = second
        else:
            v_prev = state_like(param, f"{prefix}_v", i, dtype=dtype)
            second = b2 * v_prev + (1 - b2) * g ** 2
            updates[v_prev] = second
            if kind == "amsgrad":
                v_hat_prev = state_like(param, f"{prefix}_vhat", i, dtype=dtype)
                second = pt.maximum(v_hat_prev, second)
                updates[v_hat_prev] = second
        moments.append(Moments(param, dtype, m, second, updates))
    return t_prev, t_next, moments


def optax_directions(moments, beta1, beta2, epsilon, t_next):
    """optax's bias-corrected directions ``m_hat / (sqrt(v_hat) + epsilon)``.

    The corrections ``1 - beta ** t`` are computed in float64 and cast to
    each parameter's compute dtype, as optax does.
    """
    t_float = pt.cast(t_next, "float64")
    b1_t = hyperparameter(beta1, "beta1", "float64", low=0, high=1, high_open=True)
    b2_t = hyperparameter(beta2, "beta2", "float64", low=0, high=1)
    correction1, correction2 = 1 - b1_t ** t_float, 1 - b2_t ** t_float
    directions = []
    for mom in moments:
        eps = hyperparameter(epsilon, "epsilon", mom.dtype, low=0)
        m_hat = mom.m / _cast(correction1, mom.dtype)
        v_hat = mom.second / _cast(correction2, mom.dtype)
        directions.append(m_hat / (pt.sqrt(v_hat) + eps))
    return directions
