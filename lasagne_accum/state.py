"""Checkpoints of all training state: params, rule state, accumulators, counters.

:func:`save_state` writes every shared variable that the given update
dictionaries (or objects holding them) touch into one ``.npz`` file keyed by
the variables' names; :func:`load_state` puts them back. No pickle is
involved in either direction, and a save replaces the previous file
atomically, so a crash mid-save leaves the old checkpoint whole.
"""

import os
import tempfile
import zipfile
from collections.abc import Mapping

import numpy as np
from pytensor.compile.sharedvalue import SharedVariable

__all__ = ["save_state", "load_state", "collect_state"]

_FORMAT_KEY = "__lasagne_accum_state__"
_FORMAT_VERSION = 1


def _walk(obj, out, seen):
    if isinstance(obj, SharedVariable):
        if id(obj) not in seen:
            seen.add(id(obj))
            out.append(obj)
    elif isinstance(obj, Mapping):
        for key in obj:
            _walk(key, out, seen)
    elif hasattr(obj, "apply_updates") and hasattr(obj, "accumulation"):  # a trainer
        _walk([obj.accumulation, obj.apply_updates], out, seen)
    elif hasattr(obj, "updates") and isinstance(getattr(obj, "updates"), Mapping):
        _walk(obj.updates, out, seen)  # ModelAverage, ExponentialMovingAverage
    elif isinstance(obj, (list, tuple)):  # includes Accumulation
        for item in obj:
            _walk(item, out, seen)
    else:
        raise TypeError(
            f"cannot collect state from {type(obj).__name__}; pass update dictionaries, "
            "shared variables, or lists of them"
        )


def collect_state(*objects):
    """Name every shared variable the objects update.

    Parameters
    ----------
    *objects
        Update dictionaries (their keys are collected), shared variables,
        :class:`~lasagne_accum.Accumulation` results, trainers from
        :func:`~lasagne_accum.compile_accumulation`, model averages, or lists
        of these.

    Returns
    -------
    dict
        ``{name: shared variable}`` in the order found. A variable without a
        name is called ``var{i}``; a repeated name gets ``#2``, ``#3``... in
        order of appearance, so the same code builds the same keys.

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> from lasagne_accum import adam
    >>> w = pytensor.shared(np.zeros(2), name="w")
    >>> list(collect_state(adam((w ** 2).sum(), [w])))
    ['w.adam_m', 'w.adam_v', 'w', 'adam.t']
    """
    variables = []
    seen = set()
    for obj in objects:
        _walk(obj, variables, seen)
    named = {}
    for i, var in enumerate(variables):
        base = var.name or f"var{i}"
        name, k = base, 1
        while name in named:
            k += 1
            name = f"{base}#{k}"
        named[name] = var
    return named


def _host(value):
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def save_state(path, *objects):
    """Write all state the objects touch to one ``.npz`` file, atomically.

    Parameters
    ----------
    path : str or os.PathLike
        The checkpoint file; ``.npz`` is not appended.
    *objects
        What to save: see :func:`collect_state`.

    Returns
    -------
    list of str
        The names written.

    Notes
    -----
    The data go to a temporary file in the same directory, which is flushed
    to disk and then renamed over `path`: readers see the old checkpoint or
    the new one, never a partial file.

    Examples
    --------
    >>> import os, tempfile, numpy as np, pytensor
    >>> from lasagne_accum import sgd
    >>> w = pytensor.shared(np.arange(3.0), name="w")
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.npz")
    >>> save_state(path, sgd((w ** 2).sum(), [w], 0.1))
    ['w']
    >>> w.set_value(np.zeros(3)); load_state(path, [w]); w.get_value()
    ['w']
    array([0., 1., 2.])
    """
    named = collect_state(*objects)
    if not named:
        raise ValueError("save_state(): nothing to save")
    arrays = {name: _host(var.get_value(borrow=True)) for name, var in named.items()}
    arrays[_FORMAT_KEY] = np.array(_FORMAT_VERSION)
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **arrays)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return list(named)


def load_state(path, *objects, strict=True):
    """Load a checkpoint written by :func:`save_state` into the same variables.

    Parameters
    ----------
    path : str or os.PathLike
        The checkpoint file.
    *objects
        What to load into, collected as in :func:`save_state` (build the
        model and its update dictionaries the same way first).
    strict : bool
        True (default): the checkpoint must hold exactly the collected names.
        False: names missing on either side are ignored.

    Returns
    -------
    list of str
        The names loaded.

    Raises
    ------
    ValueError
        If the file is truncated or not a checkpoint, or names, shapes or
        dtypes do not match; the message lists every mismatch and nothing is
        loaded.

    Notes
    -----
    The file is read with ``allow_pickle=False``. All checks run before the
    first value is set, so a failed load leaves the model as it was.
    """
    named = collect_state(*objects)
    try:
        with np.load(os.fspath(path), allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except FileNotFoundError:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError) as exc:
        raise ValueError(f"{path} is not a readable checkpoint (truncated or corrupt?): {exc}") \
            from None
    if _FORMAT_KEY not in arrays:
        raise ValueError(f"{path} is not a lasagne_accum checkpoint")
    arrays.pop(_FORMAT_KEY)

    problems = []
    if strict:
        missing = [n for n in named if n not in arrays]
        extra = [n for n in arrays if n not in named]
        if missing:
            problems.append(f"missing in the checkpoint: {', '.join(missing)}")
        if extra:
            problems.append(f"in the checkpoint but not in the model: {', '.join(extra)}")
    todo = [(n, var) for n, var in named.items() if n in arrays]
    for name, var in todo:
        value = arrays[name]
        current = _host(var.get_value(borrow=True))
        if value.dtype != current.dtype:
            problems.append(f"{name}: dtype {value.dtype} in the checkpoint, {current.dtype} in the model")
        elif value.shape != current.shape:
            problems.append(f"{name}: shape {value.shape} in the checkpoint, {current.shape} in the model")
    if problems:
        raise ValueError(f"cannot load {path}; nothing was loaded:\n  " + "\n  ".join(problems))
    for name, var in todo:
        var.set_value(arrays[name])
    return [n for n, _ in todo]
