"""lasagne_accum: Lasagne-style symbolic update rules for PyTensor.

Every function builds graph and returns an ``OrderedDict`` of updates for
``pytensor.function``; importing the package changes nothing in PyTensor.
Beyond Lasagne's rule set, the library accumulates gradients over
mini-batches (train with an effective batch of N*B when only B fits in
memory) in a two-function form (:func:`accumulate_gradients`) and a
single-function form (``average=N`` on every rule,
:func:`with_accumulated_gradients`). Its in-place fast paths and backend
fixes are included by name, in the functions you compile with
``mode=lasagne_accum.mode()``.
"""

__version__ = "0.2.0"

from . import schedules, updates
from .accumulate import Accumulation, accumulate_gradients, reset
from .batch_norm import batch_norm, batch_norm_updates
from .checkpoint import collect_state, load_state, save_state
from .memory import MemoryPlan, StepMemory, memory_plan, step_memory
from .machine import show_config
from .merge import merge_updates
from .noise import FollowNoiseScale, GradientNoise, NoiseEstimate, gradient_noise
from .model_average import ExponentialMovingAverage, ModelAverage
from .modes import default_modes, mode
from .single_function import SteppingUpdates, with_accumulated_gradients
from .training import AccumulationTrainer, compile_accumulation, run_epoch
from .updates import *  # noqa: F403  the rules and Lasagne's helpers: updates.__all__

__all__ = ["__version__", "updates"]
__all__ += updates.__all__  # every rule, get_or_compute_grads, the norm constraints
__all__ += [
    "schedules",
    "accumulate_gradients",
    "reset",
    "batch_norm",
    "batch_norm_updates",
    "gradient_noise",
    "GradientNoise",
    "NoiseEstimate",
    "FollowNoiseScale",
    "Accumulation",
    "with_accumulated_gradients",
    "SteppingUpdates",
    "ModelAverage",
    "ExponentialMovingAverage",
    "mode",
    "default_modes",
    "show_config",
    "memory_plan",
    "MemoryPlan",
    "step_memory",
    "StepMemory",
    "merge_updates",
    "compile_accumulation",
    "AccumulationTrainer",
    "run_epoch",
    "save_state",
    "load_state",
    "collect_state",
]
