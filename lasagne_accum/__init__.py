"""lasagne_accum: Lasagne-style symbolic update rules for PyTensor.

Every function builds graph and returns an ``OrderedDict`` of updates for
``pytensor.function``; nothing runs behind your back. Beyond Lasagne's rule
set, the library accumulates gradients over mini-batches (train with an
effective batch of N*B when only B fits in memory) in a two-function form
(:func:`accumulate_gradients`) and a single-function form (``average=N`` on
every rule, :func:`with_accumulated_gradients`).
"""

__version__ = "0.2.0"

from . import backends as _backends
from . import updates
from . import schedules
from .accumulate import Accumulation, accumulate_gradients, reset
from .averaged import SteppingUpdates, with_accumulated_gradients
from .averaging import ExponentialMovingAverage, ModelAverage
from .state import collect_state, load_state, save_state
from .training import AccumulationTrainer, compile_accumulation, run_epoch
from .updates import *  # noqa: F403  the rules and Lasagne's helpers: updates.__all__

__all__ = ["__version__", "updates"]
__all__ += updates.__all__  # every rule, get_or_compute_grads, the norm constraints
__all__ += [
    "schedules",
    "accumulate_gradients",
    "reset",
    "Accumulation",
    "with_accumulated_gradients",
    "SteppingUpdates",
    "ModelAverage",
    "ExponentialMovingAverage",
    "compile_accumulation",
    "AccumulationTrainer",
    "run_epoch",
    "save_state",
    "load_state",
    "collect_state",
]

_backends.install()
