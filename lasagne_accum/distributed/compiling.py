"""The one place where the parameter server compiles: trainers' and shards' functions."""

import pytensor

from ..modes import default_modes, float_dtype, mode

__all__ = ["compile_function"]


def compile_function(inputs, outputs, updates, compile_mode=None, *, role):
    """``pytensor.function(inputs, outputs, updates=updates)`` in the server's mode.

    Parameters
    ----------
    inputs, outputs, updates
        As for ``pytensor.function``.
    compile_mode : str, optional
        A PyTensor mode's name or Mode, compiled through
        :func:`lasagne_accum.mode`; default, the library's base mode for `role`.
    role : {"accumulate", "apply"}
        What the function does: a trainer's accumulation step, or a step of
        the rule (a shard's apply function, a trainer's read-and-reset of its
        buffer), which may be fastest in different backends.
    """
    if role not in ("accumulate", "apply"):
        raise ValueError(f"role must be 'accumulate' or 'apply', got {role!r}")
    if compile_mode is None:
        accumulate_mode, apply_mode = default_modes(float_dtype(updates or outputs))
        compile_mode = accumulate_mode if role == "accumulate" else apply_mode
    return pytensor.function(inputs, outputs, updates=updates, mode=mode(compile_mode))
