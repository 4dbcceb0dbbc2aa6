"""Shared parts of the examples: data, models, a progress bar, plotting, flag checks.

Nothing here is part of the library; the examples import it so that each one
shows only what it is about. Run any example with ``--help`` for its flags.

* :func:`load_digits`: scikit-learn's 1797 bundled 8x8 digits (offline).
* :func:`load_mnist` / :func:`read_idx`: the MNIST IDX files (plain or
  ``.gz``) from a directory; bad files raise :class:`DataError`.
* :func:`build_mlp`, :func:`build_cnn`: symbolic models built from PyTensor
  ops only. The CNN's convolution is im2col (one integer index gathers the
  patches under the filter) followed by one matrix product, and max-pooling
  is a reshape and a ``max``: no convolution or pooling op is needed.
* :func:`load_data_or_exit`: the bundled digits or MNIST, with ``--train-size``.
* :func:`add_flags`: the flags several examples share (:data:`FLAGS`), each
  with the example's default.
* :func:`progress`: tqdm when installed, plain lines on stderr otherwise.
"""

import argparse
import contextlib
import gzip
import os
import struct
import sys
import time

import numpy as np
import pytensor
import pytensor.tensor as pt

import lasagne_accum
from lasagne_accum import updates as rules
from lasagne_accum.progress import Progress

OPTIMIZERS = ["sgd", "momentum", "nesterov_momentum", "adagrad", "rmsprop", "adadelta",
              "adam", "adamax", "amsgrad"]
MODES = ["CVM", "NUMBA", "JAX", "PYTORCH", "FAST_RUN", "FAST_COMPILE"]


#: PyTensor's Python implementations behind the usual graph rewrites: nothing
#: is compiled. For functions called a few times (evaluating a test set once
#: per epoch), where compiling would cost more than it saves.
PYTHON_MODE = pytensor.compile.mode.Mode(linker="py", optimizer="fast_run").excluding("fusion")


class DataError(Exception):
    """A data set that is missing or unreadable; the examples print it in one line."""


# --------------------------------------------------------------------- data


def load_digits(seed, test_fraction=0.25, dtype="float32"):
    """The 1797 8x8 digit images bundled with scikit-learn, scaled to [0, 1].

    Returns ``X_train, y_train, X_test, y_test``; images are flat rows of 64
    pixels, labels int64. The split is a permutation drawn from `seed`.
    """
    raw = _bundled_digits()
    X = (raw[:, :64] / 16.0).astype(dtype)
    y = raw[:, 64].astype("int64")
    order = np.random.RandomState(seed).permutation(len(X))
    n_test = int(len(X) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return X[train], y[train], X[test], y[test]


def _bundled_digits():
    """scikit-learn's ``digits.csv.gz`` (1797 rows: 64 pixels 0..16, then the label).

    Read straight from the installed package: importing scikit-learn itself
    takes seconds, more than this file. Falls back to ``sklearn.datasets``.
    """
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("this example needs scikit-learn: pip install -e '.[examples]'")
    for location in spec.submodule_search_locations:
        path = os.path.join(location, "datasets", "data", "digits.csv.gz")
        if os.path.exists(path):
            return np.loadtxt(path, delimiter=",")
    from sklearn.datasets import load_digits as sk_load_digits
    data = sk_load_digits()
    return np.column_stack([data.data, data.target])


_IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path):
    """Read one IDX file (the MNIST format), plain or gzip-compressed.

    The header is two zero bytes, a type code, the number of dimensions and
    one big-endian uint32 per dimension; the data must fill the rest of the
    file exactly.

    Raises
    ------
    DataError
        If the file cannot be read, is not an IDX file, or is truncated.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    if len(raw) < 4 or raw[:2] != b"\0\0" or raw[2] not in _IDX_TYPES or raw[3] == 0:
        raise DataError(f"{path} is not an IDX file (bad header {raw[:4]!r})")
    ndim = raw[3]
    if len(raw) < 4 + 4 * ndim:
        raise DataError(f"{path}: header truncated")
    shape = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    dtype = np.dtype(_IDX_TYPES[raw[2]])
    expected = int(np.prod(shape)) * dtype.itemsize
    data = raw[4 + 4 * ndim:]
    if len(data) != expected:
        raise DataError(f"{path}: header says shape {shape} ({expected} bytes of data), "
                        f"file has {len(data)}")
    return np.frombuffer(data, dtype).reshape(shape)


MNIST_FILES = {"train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
               "test_images": "t10k-images-idx3-ubyte", "test_labels": "t10k-labels-idx1-ubyte"}


def load_mnist(directory, dtype="float32"):
    """MNIST from the four standard IDX files in `directory` (each may end in ``.gz``).

    Returns ``X_train, y_train, X_test, y_test`` like :func:`load_digits`
    (28x28 images as flat rows of 784 pixels in [0, 1]).
    """
    if not os.path.isdir(directory):
        raise DataError(f"MNIST directory not found: {directory}")
    arrays = {}
    for key, name in MNIST_FILES.items():
        for candidate in (name, name + ".gz"):
            path = os.path.join(directory, candidate)
            if os.path.exists(path):
                arrays[key] = read_idx(path)
                break
        else:
            raise DataError(f"{directory}: missing {name} (or {name}.gz)")
    out = []
    for part in ("train", "test"):
        images, labels = arrays[f"{part}_images"], arrays[f"{part}_labels"]
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise DataError(f"{directory}: {part} images {images.shape} and labels "
                            f"{labels.shape} do not match")
        if labels.size and (labels.min() < 0 or labels.max() > 9):
            raise DataError(f"{directory}: {part} labels outside 0..9")
        out += [(images.reshape(len(images), -1) / np.float32(255)).astype(dtype),
                labels.astype("int64")]
    if out[0].shape[1] != out[2].shape[1]:
        raise DataError(f"{directory}: train and test images differ in size")
    return tuple(out)


def load_data(mnist_dir, seed, dtype="float32"):
    """MNIST from `mnist_dir` when given, else the bundled digits; plus the image side."""
    data = load_mnist(mnist_dir, dtype) if mnist_dir else load_digits(seed, dtype=dtype)
    side = int(round(np.sqrt(data[0].shape[1])))
    if side * side != data[0].shape[1]:
        raise DataError(f"images of {data[0].shape[1]} pixels are not square")
    if side < 4:
        raise DataError(f"images of {side}x{side} pixels are too small for the CNN")
    if len(data[0]) == 0 or len(data[2]) == 0:
        raise DataError("no training or no test examples")
    return data, side


def load_data_or_exit(seed, train_size=None, mnist_dir=None, dtype="float32"):
    """:func:`load_data`, the first `train_size` training examples; a one-line exit on error."""
    try:
        data, side = load_data(mnist_dir, seed, dtype)
    except DataError as exc:
        fail(str(exc))
    if train_size:
        data = (data[0][:train_size], data[1][:train_size]) + data[2:]
    return data, side


def minibatches(X, y, batch_size, rng=None, limit=None, multiple=1):
    """Split (X, y) into mini-batches, shuffled when `rng` is given.

    At most `limit` batches; with `multiple`, the examples used are the first
    multiple of it (the rest of the shuffled order waits for the next epoch).
    """
    order = rng.permutation(len(X)) if rng is not None else np.arange(len(X))
    order = order[:len(order) - len(order) % multiple]
    starts = range(0, len(order), batch_size)
    if limit is not None:
        starts = starts[:limit]
    return [(X[order[i:i + batch_size]], y[order[i:i + batch_size]]) for i in starts]


# ------------------------------------------------------------------- models


class Model:
    """A symbolic classifier: inputs ``x`` (flat images) and ``y`` (labels).

    Attributes: ``params`` (shared variables), ``loss`` (mean cross-entropy),
    ``accuracy`` (fraction correct), ``logits``.
    """

    def __init__(self, x, y, params, logits):
        self.x, self.y, self.params, self.logits = x, y, params, logits
        log_probs = logits - pt.logsumexp(logits, axis=1, keepdims=True)
        self.loss = -log_probs[pt.arange(y.shape[0]), y].mean()
        self.accuracy = pt.eq(pt.argmax(logits, axis=1), y).mean()

    def evaluator(self, mode=None, batch_size=1000):
        """A function ``(X, y) -> (loss, accuracy)`` over a whole set, in chunks."""
        fn = pytensor.function([self.x, self.y], [self.loss, self.accuracy],
                               mode=lasagne_accum.mode(mode or lasagne_accum.default_modes()[0]))

        def evaluate(X, y):
            loss = acc = 0.0
            for i in range(0, len(X), batch_size):
                l, a = fn(X[i:i + batch_size], y[i:i + batch_size])
                n = len(X[i:i + batch_size])
                loss, acc = loss + float(l) * n, acc + float(a) * n
            return loss / len(X), acc / len(X)

        return evaluate


def _init(rng, dtype):
    def glorot(shape, name, fan=None):
        fan_in, fan_out = fan or (shape[0], shape[-1])
        bound = np.sqrt(6.0 / (fan_in + fan_out))
        return pytensor.shared(rng.uniform(-bound, bound, shape).astype(dtype), name=name)

    def zeros(n, name):
        return pytensor.shared(np.zeros(n, dtype), name=name)

    return glorot, zeros


def build_mlp(n_in, n_hidden=64, n_out=10, seed=0, dtype="float32"):
    """A ReLU MLP ``n_in -> n_hidden -> n_out``; returns a :class:`Model`."""
    glorot, zeros = _init(np.random.RandomState(seed), dtype)
    W1, b1 = glorot((n_in, n_hidden), "W1"), zeros(n_hidden, "b1")
    W2, b2 = glorot((n_hidden, n_out), "W2"), zeros(n_out, "b2")
    x, y = pt.matrix("x", dtype=dtype), pt.vector("y", dtype="int64")
    hidden = pt.maximum(x @ W1 + b1, 0)
    return Model(x, y, [W1, b1, W2, b2], hidden @ W2 + b2)


def conv2d(images, W, b, k, height, width):
    """A 'valid' k x k convolution of NHWC `images` by im2col and one matrix product.

    im2col: one integer index gathers, for every output position, the k*k
    input pixels under the filter, giving patches of shape
    (batch * Ho * Wo, k * k * channels); one matrix product with the filters
    ``W`` of shape (k * k * channels, filters) computes all outputs, and a
    reshape gives the maps (batch, Ho, Wo, filters). The gather's gradient is
    a scatter-add, so PyTensor differentiates the whole thing. (Stacking the
    k*k shifted slices ``images[:, i:i+Ho, j:j+Wo]`` works too; the single
    gather compiles about twice as fast.)
    """
    ho, wo = height - k + 1, width - k + 1
    rows = np.arange(ho)[:, None, None, None] + np.arange(k)[None, None, :, None]
    cols = np.arange(wo)[None, :, None, None] + np.arange(k)[None, None, None, :]
    index = (rows * width + cols).reshape(-1)           # (ho, wo, k, k) pixel numbers
    batch, channels = images.shape[0], images.shape[3]
    pixels = images.reshape((batch, height * width, channels))
    patches = pixels[:, index, :].reshape((batch * ho * wo, W.shape[0]))
    return (patches @ W + b).reshape((batch, ho, wo, W.shape[1]))


def max_pool_2x2(maps, height, width):
    """2x2 max-pooling of NHWC `maps` (odd trailing rows/columns dropped)."""
    h, w = height // 2, width // 2
    maps = maps[:, :2 * h, :2 * w, :]
    return maps.reshape((maps.shape[0], h, 2, w, 2, maps.shape[3])).max(axis=(2, 4))


def build_cnn(side, filters=16, n_hidden=64, n_out=10, seed=0, dtype="float32", k=3):
    """Lasagne's mnist.py CNN, scaled to small images, without dropout.

    ``side x side`` grey image -> k x k conv (`filters`, ReLU) -> 2x2 max-pool
    -> dense `n_hidden` (ReLU) -> dense `n_out`. On the 8x8 digits: 6x6x16
    feature maps, pooled to 3x3x16 = 144 features.
    """
    glorot, zeros = _init(np.random.RandomState(seed), dtype)
    conv = side - k + 1
    pooled = (conv // 2) ** 2 * filters
    Wc = glorot((k * k, filters), "W_conv", fan=(k * k, k * k * filters))
    bc = zeros(filters, "b_conv")
    W1, b1 = glorot((pooled, n_hidden), "W1"), zeros(n_hidden, "b1")
    W2, b2 = glorot((n_hidden, n_out), "W2"), zeros(n_out, "b2")
    x, y = pt.matrix("x", dtype=dtype), pt.vector("y", dtype="int64")
    images = x.reshape((x.shape[0], side, side, 1))
    maps = pt.maximum(conv2d(images, Wc, bc, k, side, side), 0)
    features = max_pool_2x2(maps, conv, conv).reshape((x.shape[0], pooled))
    hidden = pt.maximum(features @ W1 + b1, 0)
    return Model(x, y, [Wc, bc, W1, b1, W2, b2], hidden @ W2 + b2)


def build_model(kind, side, seed=0, dtype="float32", **sizes):
    """``build_cnn`` or ``build_mlp`` by name."""
    if kind == "cnn":
        return build_cnn(side, seed=seed, dtype=dtype, **sizes)
    return build_mlp(side * side, seed=seed, dtype=dtype, **sizes)


def value(var):
    """A shared variable's value as a numpy array, wherever the mode keeps it.

    A numpy array under C and Numba, a JAX array after a ``--mode JAX`` call, a
    torch tensor (on the GPU with CUDA) after a ``--mode PYTORCH`` one.
    """
    current = var.get_value()
    if hasattr(current, "detach"):   # torch
        return current.detach().cpu().numpy()
    return np.asarray(current)


def rule(name):
    """The update rule called `name` from :mod:`lasagne_accum.updates`."""
    return getattr(rules, name)


def rule_kwargs(name, lr, momentum=None):
    """Hyperparameters for rule `name`: the learning rate, and momentum where it applies."""
    kwargs = {"learning_rate": lr}
    if momentum is not None and name in ("momentum", "nesterov_momentum"):
        kwargs["momentum"] = momentum
    return kwargs


# -------------------------------------------------------------------- flags


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keep the description's line breaks; append ``(default: X)`` to each flag's help.

    Flags whose default is None or False, or whose help already names its
    default, are left as they are.
    """

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (default is not None and default is not False and default is not argparse.SUPPRESS
                and "default" not in text and action.option_strings):
            text += " (default: %(default)s)"
        return text


def parser(doc):
    """An ArgumentParser whose description is the example's docstring up to its usage lines."""
    description = doc.strip().split("\n\n    python ")[0]
    return argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)


def fast_compiles(pch=True, jobs=None):
    """Compile C modules faster with the repository's ``tools/fastcompile.py``, if it is there.

    Precompiled headers (`pch`) and up to `jobs` modules at once (None: one per
    core; 1: one by one). The same compiled code, a faster cold start. Returns
    False where the tool is missing (an installed copy of the examples).
    """
    tools = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
    if os.path.isdir(tools) and tools not in sys.path:
        sys.path.insert(0, tools)
    try:
        import fastcompile
    except ImportError:
        return False
    fastcompile.use_precompiled_headers(pch)
    fastcompile.use_parallel_compile(jobs)
    return True


def mode_names(name=None):
    """The accumulate and apply steps' mode names: `name` for both, else the library's
    defaults (``lasagne_accum.default_modes()``)."""
    return (name, name) if name else lasagne_accum.default_modes()


@contextlib.contextmanager
def compiling(what):
    """Say that `what` is compiling (on stderr, at once), then how long it took."""
    print(f"compiling {what}...", end=" ", file=sys.stderr, flush=True)
    start = time.perf_counter()
    yield
    print(f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def positive_int(text):
    """argparse type: an integer >= 1 (else a one-line usage error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _float_flag(text, ok, what):
    """argparse type: a number for which ``ok(value)`` holds, else ``must be {what}``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value


def positive_float(text):
    """argparse type: a finite number > 0."""
    return _float_flag(text, lambda v: np.isfinite(v) and v > 0, "a finite number > 0")


def unit_float(text):
    """argparse type: a number in [0, 1)."""
    return _float_flag(text, lambda v: 0 <= v < 1, "in [0, 1)")


def mode_name(text):
    """argparse type: a PyTensor compilation mode, case-insensitive."""
    if text.upper() not in MODES:
        raise argparse.ArgumentTypeError(f"unknown mode {text!r} (choose from {', '.join(MODES)})")
    return text.upper()


def fail(message):
    """Print ``error: message`` on stderr and exit with status 1 (no traceback)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


def row_numbers(p, text, n_rows):
    """``--rows``: the 1-based row numbers in comma-separated `text` (None: all `n_rows`)."""
    if text is None:
        return list(range(1, n_rows + 1))
    try:
        rows = [int(r) for r in text.split(",")]
    except ValueError:
        p.error(f"--rows: expected comma-separated integers, got {text!r}")
    if not rows or any(r < 1 or r > n_rows for r in rows):
        p.error(f"--rows: row numbers go from 1 to {n_rows}")
    return rows


#: The flags several examples share: argparse keywords (no default) and help.
FLAGS = {
    "model": (dict(choices=["cnn", "mlp"]),
              "the im2col CNN of models.py, or a one-hidden-layer MLP"),
    "optimizer": (dict(choices=OPTIMIZERS), "update rule"),
    "lr": (dict(type=positive_float), "learning rate"),
    "momentum": (dict(type=unit_float), "momentum of momentum and nesterov_momentum"),
    "epochs": (dict(type=positive_int), "passes over the training set"),
    "dtype": (dict(choices=["float64", "float32"]),
              "model precision; float64 prints the same numbers on every machine"),
    "train_size": (dict(type=positive_int),
                   "use the first N training examples only (default: all)"),
    "mode": (dict(type=mode_name), "PyTensor mode of every function (CVM, NUMBA, JAX...); "
                                   "default: lasagne_accum.default_modes()"),
    "seed": (dict(type=int), "seed of the initial parameters, the split and the order"),
    "out": ({}, "directory for the plot"),
    "no_plot": (dict(action="store_true"), "do not draw the plot"),
    "no_progress": (dict(action="store_true"), "no progress bar"),
}


def add_flags(p, **defaults):
    """Add shared flags of :data:`FLAGS` to parser `p`, in order, with these defaults.

    ``add_flags(p, lr=0.01, seed=0)`` adds ``--lr`` and ``--seed``; a value
    ``(default, help)`` replaces the shared help text.
    """
    for name, value in defaults.items():
        default, text = value if isinstance(value, tuple) else (value, None)
        kwargs, shared = FLAGS[name]
        p.add_argument("--" + name.replace("_", "-"), default=default, help=text or shared,
                       **kwargs)


def out_dir(path):
    """Create the output directory if needed and return it (exit 1 if impossible)."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        fail(f"cannot create output directory {path}: {exc.strerror or exc}")
    return path


# --------------------------------------------------------- progress, plots


# The library's progress bar (tqdm when installed, plain lines otherwise).
progress = Progress


def report(out, name, table, draw, start):
    """Print `table` and write it to ``OUT/name.txt``, the figure ``draw(plt)`` makes to
    ``OUT/name.png`` (none when `draw` is None), then the seconds since `start`."""
    print(table)
    out = out_dir(out)
    with open(os.path.join(out, name + ".txt"), "w") as f:
        f.write(table + "\n")
    if draw is not None:
        path = save_plot(os.path.join(out, name + ".png"), draw)
        if path:
            print(f"plot: {path}")
    print(f"done in {time.perf_counter() - start:.1f} s (compiling included)")


def save_plot(path, draw):
    """Call ``draw(plt)`` and save the figure to `path`; None if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no plot saved "
              "(pip install matplotlib)", file=sys.stderr)
        return None
    fig = plt.figure(figsize=(7, 4.5))
    try:
        draw(plt)
        fig.savefig(path, dpi=100, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path
