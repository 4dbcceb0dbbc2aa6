"""Type aliases of the public API (for annotations only).

Every module that uses them imports this one under ``typing.TYPE_CHECKING``
with ``from __future__ import annotations``, so nothing here is evaluated at
runtime and PyTensor's classes cost nothing in the hints.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Callable, Mapping, ParamSpec, Protocol, Sequence, Union, overload

from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Variable
from pytensor.tensor.variable import TensorVariable

__all__ = [
    "Params",
    "LossOrGrads",
    "Scalar",
    "LearningRate",
    "Updates",
    "UpdatesLike",
    "UpdateRule",
    "LossRule",
    "Exclude",
    "PathLike",
]

#: The parameters a rule updates: shared variables.
Params = Sequence[SharedVariable]
#: A scalar loss, or one gradient expression per parameter.
LossOrGrads = Union[Variable, Sequence[Variable]]
#: A hyperparameter: a Python number or a symbolic scalar.
Scalar = Union[float, Variable]
#: A learning rate: a number, a symbolic scalar or a schedule of the optimizer step.
LearningRate = Union[float, Variable, Callable[[TensorVariable], Any]]
#: What every rule returns: each shared variable mapped to its new value (keyed by
#: ``Variable``, as ``pytensor.function(updates=...)`` is typed: dict keys are invariant).
Updates = OrderedDict[Variable, Variable]
#: Updates as input: a mapping of shared variables to their new values.
UpdatesLike = Mapping[Any, Variable]
#: An update rule, or a partial of one: ``rule(loss_or_grads, params, **kwargs)``.
UpdateRule = Callable[..., Any]
#: Parameters left out of weight decay: a list of them or a predicate.
Exclude = Union[Sequence[SharedVariable], Callable[[SharedVariable], bool]]
#: A file path.
PathLike = Union[str, "os.PathLike[str]"]


_Hyper = ParamSpec("_Hyper")


class LossRule(Protocol[_Hyper]):
    """A loss-based rule (``adam``, ``sgd``, ...) as a type checker sees it.

    ``_Hyper`` is the rule's own hyperparameters (everything after `params`),
    taken from its definition, so one protocol types every rule: given
    `loss_or_grads` and `params` it returns the updates; given neither, a
    partial of the rule with those hyperparameters.
    """

    @overload
    def __call__(
        self,
        loss_or_grads: None = None,
        params: None = None,
        *args: _Hyper.args,
        **kwargs: _Hyper.kwargs,
    ) -> Callable[..., Updates]: ...
    @overload
    def __call__(
        self,
        loss_or_grads: LossOrGrads,
        params: Params,
        *args: _Hyper.args,
        **kwargs: _Hyper.kwargs,
    ) -> Updates: ...
