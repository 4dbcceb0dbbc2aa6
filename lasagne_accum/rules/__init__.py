"""The update rules: Lasagne's set (:mod:`.lasagne`) and the large-batch set (:mod:`.large_batch`).

Every rule builds graph and returns an ``OrderedDict`` of updates; the
public homes are :mod:`lasagne_accum.updates` (Lasagne's module name) and the
package's top level.
"""

from .large_batch import adamw, lamb, lars
from .lasagne import (
    adadelta,
    adagrad,
    adam,
    adamax,
    amsgrad,
    apply_momentum,
    apply_nesterov_momentum,
    momentum,
    nesterov_momentum,
    rmsprop,
    sgd,
)

__all__ = ["sgd", "momentum", "nesterov_momentum", "apply_momentum",
           "apply_nesterov_momentum", "adagrad", "rmsprop", "adadelta", "adam", "adamax",
           "amsgrad", "adamw", "lars", "lamb"]
