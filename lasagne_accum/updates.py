"""Lasagne's update rules on PyTensor.

Every rule builds graph and returns an :class:`~collections.OrderedDict`
mapping each shared variable (parameters and the rule's state) to its new
value; compile it with ``pytensor.function(inputs, outputs, updates=...)``.
Signatures, defaults and formulas are Lasagne's, so a script written for
``lasagne.updates`` only changes its import.

Additions, all optional:

* ``learning_rate`` may be a schedule, a callable of the optimizer step (see
  :mod:`lasagne_accum.schedules`): the rule then owns an int64 counter
  ``<rule>.schedule_step`` that advances once per optimizer step (per apply
  call in the two-function form, per stepping call with ``average=N``).
* ``average=N`` (every loss-based rule): the dictionary accumulates the
  gradients of N calls and steps on every N-th call only, in one compiled
  function (see :func:`lasagne_accum.with_accumulated_gradients`).
* Calling a rule with neither `loss_or_grads` nor `params` returns a partial
  of it with the given hyperparameters (the PyMC convention), to hand to
  another function as ``update_rule``.
* Dtypes are kept: a float32 model compiles to float32 updates under
  PyTensor's default ``floatX=float64``. A float16 parameter is updated in
  float32 (float32 state, the result cast back): float16 cannot hold Adam's
  epsilon or small squared gradients. PyTensor's Numba backend cannot compile
  float16 at all; compile float16 models with ``mode="CVM"``.
* Step counters (``adam.t``) are int64 whatever the parameters' dtype.
* ``name=`` on every rule replaces the rule's name in its state's names
  (``W.enc_m``, ``enc.t``), so several optimizers in one graph get stable names.
* Given ``accu.grads`` of :func:`lasagne_accum.accumulate_gradients` (or a
  copy of that list), a rule guards its updates: an apply on an empty window
  changes nothing.
* A misspelled keyword gets a suggestion (``lr=`` -> ``learning_rate=``).

The functions `norm_constraint`, `total_norm_constraint` and
`get_or_compute_grads` are here as in Lasagne. The rules live in
:mod:`lasagne_accum.rules` (Lasagne's set in ``rules/lasagne.py``, the
large-batch set in ``rules/large_batch.py``); this module is their Lasagne
home.
"""

from ._graph import get_or_compute_grads
from .constraints import norm_constraint, total_norm_constraint
from .rules import (
    adadelta,
    adagrad,
    adam,
    adamax,
    adamw,
    amsgrad,
    apply_momentum,
    apply_nesterov_momentum,
    lamb,
    lars,
    momentum,
    nesterov_momentum,
    rmsprop,
    sgd,
)

__all__ = [
    "sgd",
    "momentum",
    "nesterov_momentum",
    "apply_momentum",
    "apply_nesterov_momentum",
    "adagrad",
    "rmsprop",
    "adadelta",
    "adam",
    "adamax",
    "amsgrad",
    "get_or_compute_grads",
    "norm_constraint",
    "total_norm_constraint",
    "adamw",
    "lars",
    "lamb",
]
