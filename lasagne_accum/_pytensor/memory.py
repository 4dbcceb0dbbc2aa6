"""XLA's memory analysis of a function compiled with ``lasagne_accum.mode("JAX")``.

The function's jitted callable (:class:`~.jax_linker.DonatingCall`) is lowered
for abstract inputs (shapes and dtypes only: nothing is allocated or run)
and compiled; ``compiled.memory_analysis()`` then says how many bytes its
arguments, outputs, donated-and-reused outputs and temporaries take.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = ["analyse", "inputs_of"]


def inputs_of(fn) -> list[Any]:
    """The inputs of compiled function `fn`, in the order its jitted callable takes them."""
    return list(fn.maker.fgraph.inputs)


def _jitted(fn):
    call = getattr(getattr(fn, "vm", None), "jit_fn", None)
    jitted = getattr(call, "jitted", None)
    if jitted is None:
        raise TypeError("memory analysis needs a function compiled with "
                        "lasagne_accum.mode('JAX')")
    return call, jitted


def analyse(fn, shapes: Sequence[tuple[tuple[int, ...], str]]) -> dict[str, int]:
    """Bytes of a call of `fn` with inputs of these ``(shape, dtype)``, from XLA.

    Parameters
    ----------
    fn : pytensor compiled function
        Compiled with ``lasagne_accum.mode("JAX")``.
    shapes : list of (shape, dtype)
        One per input of :func:`inputs_of`, shared variables included.

    Returns
    -------
    dict
        ``arguments``, ``outputs``, ``aliased`` (outputs written into donated
        arguments), ``temporaries``.
    """
    import jax

    call, jitted = _jitted(fn)
    static = set(getattr(call, "_static_args", ()))
    if static:
        raise ValueError("memory analysis of a function with scalar shape inputs "
                         "(static arguments) is not supported")
    abstract = [jax.ShapeDtypeStruct(tuple(int(n) for n in shape), np.dtype(dtype))
                for shape, dtype in shapes]
    stats = jitted.lower(*abstract).compile().memory_analysis()
    return {"arguments": int(stats.argument_size_in_bytes),
            "outputs": int(stats.output_size_in_bytes),
            "aliased": int(stats.alias_size_in_bytes),
            "temporaries": int(stats.temp_size_in_bytes)}
