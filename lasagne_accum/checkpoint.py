"""Checkpoints of all training state: params, rule state, accumulators, counters.

:func:`save_state` writes every shared variable that the given update
dictionaries (or objects holding them) touch into one ``.npz`` file keyed by
the variables' names; :func:`load_state` puts them back. No pickle is
involved in either direction, and a save replaces the previous file
atomically, so a crash mid-save leaves the old checkpoint whole.

The file is a zip archive of ``.npy`` members (what :func:`numpy.load`
reads), one per variable, plus a small JSON manifest that maps each name to
its member, so any name round-trips, and holds the loop state you pass as
``metadata`` (epoch, position, the data RNG's state): :func:`load_state`
returns it. :func:`load_state` checks every name,
dtype and shape from the members' ``.npy`` headers before it reads any
data, so a file that does not fit the model costs no memory.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import socket
import tempfile
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Collection

import numpy as np
from numpy.lib import format as npy_format
from pytensor.compile.sharedvalue import SharedVariable

from ._graph import as_host_array, write_value
from .accumulate import Accumulation

if TYPE_CHECKING:
    from ._typing import PathLike

__all__ = ["save_state", "load_state", "collect_state", "save_arrays", "read_arrays"]

FORMAT_VERSION = 2
# The format marker. Format 1: a scalar array holding 1 (members ``name.npy``).
# Format 2: a uint8 array of UTF-8 JSON ``{"format": 2, "names": [[name, member], ...]}``.
_MARKER = "__lasagne_accum_state__.npy"
# np.savez's own parameters, which cannot be the keys of its members
_SAVEZ_NAMES = ("file.npy", "allow_pickle.npy")
_NO_PICKLE = ({"allow_pickle": False}
              if "allow_pickle" in inspect.signature(np.savez).parameters else {})


def _walk(obj, out, seen):
    if isinstance(obj, SharedVariable):
        if id(obj) not in seen:
            seen.add(id(obj))
            out.append(obj)
    elif isinstance(obj, Mapping):
        for key in obj:
            _walk(key, out, seen)
    elif hasattr(obj, "apply_updates") and hasattr(obj, "accumulation"):  # a trainer
        _walk([obj.accumulation, getattr(obj, "accumulate_updates", None) or {},
               obj.apply_updates], out, seen)
    elif hasattr(obj, "updates") and isinstance(getattr(obj, "updates"), Mapping):
        _walk(obj.updates, out, seen)  # ModelAverage, ExponentialMovingAverage
    elif isinstance(obj, (list, tuple, Accumulation)):   # an Accumulation: its two dicts
        for item in obj:
            _walk(item, out, seen)
    else:
        raise TypeError(
            f"cannot collect state from {type(obj).__name__}; pass update dictionaries, "
            "shared variables, or lists of them"
        )


def _collect(objects):
    """``(named, made_up)``: :func:`collect_state`'s dict, and the names it had to invent."""
    variables = []
    seen = set()
    for obj in objects:
        _walk(obj, variables, seen)
    counts = {}
    for var in variables:
        if var.name:
            counts[var.name] = counts.get(var.name, 0) + 1
    named, made_up = OrderedDict(), []
    for i, var in enumerate(variables):
        base = var.name or f"var{i}"
        name, k = base, 1
        while name in named:
            k += 1
            name = f"{base}#{k}"
        named[name] = var
        if not var.name or counts[var.name] > 1:
            made_up.append(name)
    return named, made_up


def collect_state(*objects: Any) -> OrderedDict[str, SharedVariable]:
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
        order of appearance. Such made-up keys depend on the order the
        variables were found in: :func:`save_state` warns about them and
        :func:`load_state` refuses them.

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> from lasagne_accum import adam
    >>> w = pytensor.shared(np.zeros(2), name="w")
    >>> list(collect_state(adam((w ** 2).sum(), [w])))
    ['w.adam_m', 'w.adam_v', 'w', 'adam.t']
    """
    return _collect(objects)[0]


# ------------------------------------------------------------------ writing


def _tmp_prefix(path):
    """``.tmp-<target>-<host>-<pid>-``: a human can tell whose temporary file it is."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:64]
    return f".tmp-{os.path.basename(path)[:100]}-{host}-{os.getpid()}-"


def _members(names):
    """``{name: zip member}``: ``name.npy`` where the zip format and np.savez keep it,
    else ``__escaped{i}.npy``."""
    out, used = OrderedDict(), {_MARKER, *_SAVEZ_NAMES}
    for i, name in enumerate(names):
        member = f"{name}.npy"
        if zipfile.ZipInfo(member).filename != member or member in used:
            k = i
            while f"__escaped{k}.npy" in used or f"__escaped{k}" in names:
                k += len(names) + 1
            member = f"__escaped{k}.npy"
        used.add(member)
        out[name] = member
    return out


#: The largest metadata a checkpoint holds, as JSON text.
MAX_METADATA_BYTES = 1 << 20


def _json_or_raise(value, what):
    """`value` as JSON text: a dict with string keys, JSON values, finite numbers."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"{what} must be a dict, got {type(value).__name__}")

    def check(obj, where, depth=0):
        if depth > 100:
            raise ValueError(f"{what}{where} nests more than 100 levels deep (a dict or "
                             "list that contains itself?)")
        if isinstance(obj, Mapping):
            for k, v in obj.items():
                if not isinstance(k, str):
                    raise TypeError(f"{what}{where}: key {k!r} is not a string (JSON keys are "
                                    "strings; it would not come back as it went in)")
                check(v, f"{where}[{k!r}]", depth + 1)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                check(v, f"{where}[{i}]", depth + 1)
        elif isinstance(obj, float):
            if obj != obj or obj in (float("inf"), float("-inf")):
                raise ValueError(f"{what}{where} is {obj}, which JSON cannot hold")
        elif obj is not None and not isinstance(obj, (str, bool, int)):
            hint = (" (convert numpy numbers with int() or float(), arrays with .tolist())"
                    if isinstance(obj, (np.generic, np.ndarray)) else "")
            raise TypeError(f"{what}{where} is of type {type(obj).__name__}, which JSON "
                            f"cannot hold{hint}")

    check(value, "")
    text = json.dumps(dict(value))
    if len(text.encode("utf-8")) > MAX_METADATA_BYTES:
        raise ValueError(f"{what} takes {len(text.encode('utf-8'))} bytes as JSON, more than "
                         f"the {MAX_METADATA_BYTES} a checkpoint holds; keep large data in "
                         "shared variables (they are saved as arrays)")
    return dict(value)


def save_arrays(path: PathLike, arrays: Mapping[str, np.ndarray], *,
                metadata: Mapping[str, Any] | None = None,
                library: Mapping[str, Any] | None = None) -> list[str]:
    """Write ``{name: array}`` to a checkpoint file, atomically (see :func:`save_state`).

    Parameters
    ----------
    path : str or os.PathLike
    arrays : dict
        ``{name: numpy array}``; any string is a valid name. Object arrays
        are refused (the file never holds pickles).
    metadata : dict, optional
        JSON-serialisable loop state, returned by :func:`load_state`.
    library : dict, optional
        The library's own counters (a trainer's steps), kept apart from
        `metadata`.

    Returns
    -------
    list of str
        The names written.

    Raises
    ------
    TypeError
        A name is not a string, or an array has dtype object.
    """
    arrays = OrderedDict(arrays)
    for name, value in arrays.items():
        if not isinstance(name, str):
            raise TypeError(f"checkpoint names must be strings, got {name!r}")
        if np.asarray(value).dtype.hasobject:
            raise TypeError(f"{name}: dtype object cannot be saved without pickle")
    members = _members(list(arrays))
    manifest: dict[str, Any] = dict(format=FORMAT_VERSION,
                                    names=[[n, m] for n, m in members.items()])
    for key, what, given in (("metadata", "metadata", metadata),
                             ("lasagne_accum", "library", library)):
        if given is not None:
            manifest[key] = _json_or_raise(given, what)
    text = np.frombuffer(json.dumps(manifest).encode("utf-8"), np.uint8)
    entries: dict[str, Any] = {_MARKER[:-4]: text}    # np.savez's keys: the members less .npy
    entries.update((members[n][:-4], value) for n, value in arrays.items())
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(path), suffix=".npz",
                               dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **_NO_PICKLE, **entries)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_directory(os.path.dirname(os.path.abspath(path)))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)        # this save's own temporary file; never another writer's
        raise
    return list(arrays)


def _fsync_directory(directory):
    """Flush the directory entry of a rename to disk, so that the new checkpoint, not the
    old one, is there after a power loss (where the system can: not on Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):     # some file systems refuse a directory fsync
            os.fsync(fd)
    finally:
        os.close(fd)


def save_state(path: PathLike, *objects: Any, metadata: Mapping[str, Any] | None = None
               ) -> list[str]:
    """Write all state the objects touch to one ``.npz`` file, atomically.

    Parameters
    ----------
    path : str or os.PathLike
        The checkpoint file; ``.npz`` is not appended.
    *objects
        What to save: see :func:`collect_state`.
    metadata : dict, optional
        Loop state to keep with the arrays (epoch, position in the epoch, the
        data RNG's state): a dict with string keys and JSON values (str,
        int, float, bool, None, lists and dicts of them), at most
        :data:`MAX_METADATA_BYTES` as JSON. :func:`load_state` returns it
        (tuples come back as lists).

    Returns
    -------
    list of str
        The names written.

    Raises
    ------
    TypeError
        `metadata` is not a dict, has a key that is not a string or a value
        JSON cannot hold (a numpy number, an array): the message names it.
    ValueError
        `metadata` holds NaN or infinity, or is too large.

    Warns
    -----
    UserWarning
        Some variables have no name or share one: their keys (``var3``,
        ``W#2``) depend on the order they were found in, and
        :func:`load_state` will refuse them. Name them uniquely.

    Notes
    -----
    The data go to a temporary file ``.tmp-<name>-<host>-<pid>-<random>.npz``
    of this save's own in the same directory, which is flushed to disk and
    then renamed over `path` (the directory is flushed too): readers see the
    old checkpoint or the new one,
    never a partial file, and writers on several machines can share the
    directory. A save that fails removes its temporary file; a process killed
    mid-save leaves it behind, and no save removes another's (on a shared
    disk a live writer elsewhere cannot be told from a dead one): delete such
    files when no save is running.

    Examples
    --------
    >>> import os, tempfile, numpy as np, pytensor
    >>> from lasagne_accum import sgd
    >>> w = pytensor.shared(np.arange(3.0), name="w")
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.npz")
    >>> save_state(path, sgd((w ** 2).sum(), [w], 0.1), metadata={"epoch": 3})
    ['w']
    >>> w.set_value(np.zeros(3)); load_state(path, [w]); w.get_value()
    {'epoch': 3}
    array([0., 1., 2.])
    """
    return write_state(path, objects, metadata)


def write_state(path: PathLike, objects: Any, metadata: Mapping[str, Any] | None = None,
                library: Mapping[str, Any] | None = None) -> list[str]:
    """:func:`save_state`, with the library's own counters (`library`) beside `metadata`."""
    named, made_up = _collect(objects)
    if not named:
        raise ValueError("save_state(): nothing to save")
    if made_up:
        warnings.warn(
            f"save_state(): {len(made_up)} variable(s) have no unique name and are saved "
            f"under order-dependent keys ({', '.join(made_up)}); load_state() refuses "
            "them. Give every shared variable a unique name.", UserWarning, stacklevel=2)
    return save_arrays(path, OrderedDict((n, _as_array(v.get_value(borrow=True)))
                                         for n, v in named.items()),
                       metadata=metadata, library=library)


#: The bit generators whose state a checkpoint can hold (numpy's own).
BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")


def _as_array(value: Any) -> np.ndarray:
    """A variable's value as the array a checkpoint holds.

    A random generator (the ``rng`` of ``pt.random`` draws, a dropout mask's) is
    kept as the UTF-8 JSON text of its bit generator's state, in a uint8 array.
    """
    if not isinstance(value, np.random.Generator):
        return as_host_array(value)

    def plain(obj):
        if isinstance(obj, dict):
            return {k: plain(v) for k, v in obj.items()}
        if isinstance(obj, np.ndarray):
            return obj.tolist()
        return obj.item() if isinstance(obj, np.generic) else obj

    state = plain(value.bit_generator.state)
    return np.frombuffer(json.dumps(state).encode("utf-8"), np.uint8).copy()


def _generator(name: str, text: np.ndarray, path: Any) -> np.random.Generator:
    """The random generator that :func:`_as_array` wrote as `text`; ValueError if it is not."""
    try:
        state = json.loads(bytes(np.asarray(text, np.uint8)).decode("utf-8"))
        kind = state["bit_generator"]
        if kind not in BIT_GENERATORS:
            raise ValueError(f"bit generator {kind!r} is not one of {', '.join(BIT_GENERATORS)}")
        bits = getattr(np.random, kind)()
        bits.state = state
    except (ValueError, TypeError, KeyError, UnicodeDecodeError, OverflowError) as exc:
        raise ValueError(f"cannot load {path}; nothing was loaded:\n  {name}: not the state "
                         f"of a numpy random generator ({exc})") from None
    return np.random.Generator(bits)


# ------------------------------------------------------------------ reading


def _not_readable(path, why):
    return ValueError(f"{path} is not a readable checkpoint (truncated or corrupt?): {why}")


def _header(zf, member, path):
    """``(shape, dtype, data bytes)`` of an ``.npy`` member, from its header alone."""
    try:
        with zf.open(member) as fh:
            version = npy_format.read_magic(fh)
            if version not in ((1, 0), (2, 0), (3, 0)):
                raise ValueError(f"unsupported .npy version {version[0]}.{version[1]}")
            read = (npy_format.read_array_header_1_0 if version == (1, 0)
                    else npy_format.read_array_header_2_0)
            shape, _, dtype = read(fh)
    except (ValueError, EOFError, OSError, zipfile.BadZipFile, SyntaxError) as exc:
        raise _not_readable(path, f"{member}: {exc}") from None
    return tuple(shape), dtype, int(np.prod(shape, dtype=object)) * dtype.itemsize


def _data(zf, member, path):
    """An ``.npy`` member's array, read by numpy without pickle, once its header passed."""
    try:
        with zf.open(member) as fh:
            return npy_format.read_array(fh, allow_pickle=False)
    except (ValueError, EOFError, OSError, zipfile.BadZipFile) as exc:
        raise _not_readable(path, f"{member}: {exc}") from None


def read_arrays(
    path: PathLike,
    expected: Mapping[str, tuple[tuple[int, ...] | None, Any]],
    *,
    strict: bool = True,
    optional: Collection[str] = (),
    max_bytes: int = 1 << 26,
) -> dict[str, np.ndarray]:
    """Read named arrays from a checkpoint, checking every header before any data.

    Parameters
    ----------
    path : str or os.PathLike
    expected : dict
        ``{name: (shape, dtype)}``; `shape` None accepts any shape (up to
        `max_bytes`), `dtype` None any dtype.
    strict : bool
        True: the file must hold exactly these names (but those in
        `optional` may be missing). False: names missing on either side are
        skipped.
    optional : collection of str
        Names that may be missing even when `strict`.
    max_bytes : int
        The largest entry of free shape that is read.

    Returns
    -------
    dict
        ``{name: array}`` for the names found.

    Raises
    ------
    ValueError
        The file is not a readable checkpoint, its format version is
        unknown, or names, dtypes or shapes do not match (every problem is
        listed; nothing is read then).
    """
    return _read(path, expected, strict=strict, optional=optional, max_bytes=max_bytes)[0]


def _read(path, expected, *, strict=True, optional=(), max_bytes=1 << 26):
    """:func:`read_arrays`' arrays, and the manifest's ``metadata`` and ``lasagne_accum``
    entries (None where absent). Refuses foreign files and unknown versions."""
    path = os.fspath(path)
    try:
        zf = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise _not_readable(path, exc) from None
    with zf:
        files = zf.namelist()
        if _MARKER not in files:
            raise ValueError(f"{path} is not a lasagne_accum checkpoint (no format marker)")
        # the marker: format 1's integer scalar 1, or format 2's manifest as UTF-8 JSON
        shape, dtype, nbytes = _header(zf, _MARKER, path)
        if not ((shape == () and dtype.kind in "iu") or
                (dtype == np.uint8 and len(shape) == 1 and nbytes <= 1 << 24)):
            raise _not_readable(path, f"bad format marker ({dtype}, shape {shape})")
        marker = _data(zf, _MARKER, path)
        extras = {"metadata": None, "lasagne_accum": None}
        if marker.ndim == 0:                  # format 1: every other member is "<name>.npy"
            version = int(marker)
            pairs = [[f[:-4], f] for f in files if f.endswith(".npy") and f != _MARKER]
        else:
            try:
                manifest = json.loads(marker.tobytes().decode("utf-8"))
                version, pairs = manifest["format"], manifest.get("names")
                extras = {key: manifest.get(key) for key in extras}
            except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
                raise _not_readable(path, f"bad manifest ({exc})") from None
            if not all(v is None or isinstance(v, dict) for v in extras.values()):
                raise _not_readable(path, "bad manifest (metadata)")
        if version != (1 if marker.ndim == 0 else FORMAT_VERSION):
            raise ValueError(f"{path} is a lasagne_accum checkpoint of format version "
                             f"{version!r}; this version reads formats 1 and {FORMAT_VERSION}: "
                             "upgrade lasagne_accum to read it")
        if not isinstance(pairs, list) or not all(
                isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
                for p in pairs):
            raise _not_readable(path, "bad manifest (names)")
        index = OrderedDict()
        for name, member in pairs:
            if name in index:
                raise ValueError(f"{path}: the name {name!r} appears twice in the checkpoint; "
                                 "refusing to guess which one to load")
            if member not in files or member == _MARKER:
                raise _not_readable(path, f"member {member!r} of {name!r} is missing")
            index[name] = member
        problems = []
        if strict:
            missing = [n for n in expected if n not in index and n not in optional]
            extra = [n for n in index if n not in expected]
            if missing:
                problems.append(f"missing in the checkpoint: {', '.join(missing)}")
            if extra:
                problems.append(f"in the checkpoint but not in the model: {', '.join(extra)}")
        todo = [n for n in expected if n in index]
        for name in todo:        # headers only: no data is read until all of them fit
            shape, dtype = expected[name]
            got_shape, got_dtype, nbytes = _header(zf, index[name], path)
            stored = zf.getinfo(index[name]).file_size
            if got_dtype.hasobject:
                problems.append(f"{name}: holds Python objects (pickle), refused")
            elif dtype is not None and got_dtype != np.dtype(dtype):
                problems.append(f"{name}: dtype {got_dtype} in the checkpoint, "
                                f"{np.dtype(dtype)} in the model")
            elif shape is not None and got_shape != tuple(shape):
                problems.append(f"{name}: shape {got_shape} in the checkpoint, "
                                f"{tuple(shape)} in the model")
            elif shape is None and nbytes > max_bytes:
                problems.append(f"{name}: {nbytes} bytes in the checkpoint, more than "
                                f"the {max_bytes} allowed")
            elif nbytes > stored:
                problems.append(f"{name}: the header claims {nbytes} bytes but the "
                                f"member holds {stored} (truncated or corrupt)")
        if problems:
            raise ValueError(f"cannot load {path}; nothing was loaded:\n  " +
                             "\n  ".join(problems))
        return OrderedDict((n, _data(zf, index[n], path)) for n in todo), extras


def load_state(path: PathLike, *objects: Any, strict: bool = True) -> dict[str, Any]:
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
        False: names missing on either side are ignored. Either way, state
        that checkpoints of an earlier version lack (the single-function
        form's ``<name>.zeroed``, added after 0.2.0) is set to the value that is
        right for them.

    Returns
    -------
    dict
        The `metadata` given to :func:`save_state` (``{}`` if none).

    Raises
    ------
    ValueError
        If the file is truncated, not a checkpoint or of an unknown format
        version; if names, shapes or dtypes do not match (the message lists
        every mismatch and nothing is loaded); if some variables have no
        unique name (their made-up keys ``var3``/``W#2`` would be guessed).

    Notes
    -----
    The file is read without pickle. Names, dtypes and shapes are checked
    from the ``.npy`` headers before any data is read, so a file that does
    not fit the model costs no memory, whatever sizes its headers claim.
    All checks run before the first value is set, so a failed load leaves
    the model as it was.
    """
    return read_state(path, objects, strict=strict)[0]


def read_state(path: PathLike, objects: Any, strict: bool = True
               ) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """:func:`load_state`: ``(metadata, the library's counters, the names loaded)``."""
    named, made_up = _collect(objects)
    if made_up:
        raise ValueError(
            f"cannot load {path}: variable(s) {', '.join(made_up)} have no unique name, so "
            "which saved array belongs to which is a guess; give every shared variable a "
            "unique name (pytensor.shared(value, name=...)) and save again")
    expected: dict[str, tuple[Any, np.dtype]] = OrderedDict()
    generators = set()
    for name, var in named.items():
        value = var.get_value(borrow=True)
        if isinstance(value, np.random.Generator):   # its state as JSON text: any length
            generators.add(name)
            expected[name] = (None, np.dtype(np.uint8))
            continue
        current = as_host_array(value)
        expected[name] = (current.shape, current.dtype)
    # state that older checkpoints lack, with the value that is right for them
    # (the single-function form's `<name>.zeroed`: False, the buffers are reset)
    defaults = {name: var.tag.checkpoint_default for name, var in named.items()
                if hasattr(var.tag, "checkpoint_default")}
    arrays, extras = _read(path, expected, strict=strict, optional=defaults)
    for name in generators & set(arrays):   # every check before the first value is set
        arrays[name] = _generator(name, arrays[name], path)
    for name, default in defaults.items():
        if name not in arrays:
            write_value(named[name], np.asarray(default, dtype=expected[name][1]))
    for name, value in arrays.items():
        if name in generators:
            named[name].set_value(value)
        else:
            write_value(named[name], value)
    return extras["metadata"] or {}, extras["lasagne_accum"] or {}, list(arrays)
