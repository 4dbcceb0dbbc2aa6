"""Shared pieces of the benchmark scripts: the 784-512-10 MLP and a timer.

Not a test: the scripts print ratio tables measured side by side in one run
(interleaved rounds, medians), because this kind of machine is shared and noisy.
"""

import time

import numpy as np
import pytensor
import pytensor.tensor as pt

SIZES = (784, 512, 10)
BATCH = 64


def mlp(dtype="float32", sizes=SIZES, seed=0):
    """A ReLU MLP: inputs (x, y), params [W1, b1, W2, b2], mean cross-entropy loss."""
    rng = np.random.RandomState(seed)
    n_in, n_hidden, n_out = sizes
    W1 = pytensor.shared((rng.randn(n_in, n_hidden) * 0.05).astype(dtype), name="W1")
    b1 = pytensor.shared(np.zeros(n_hidden, dtype), name="b1")
    W2 = pytensor.shared((rng.randn(n_hidden, n_out) * 0.05).astype(dtype), name="W2")
    b2 = pytensor.shared(np.zeros(n_out, dtype), name="b2")
    x = pt.matrix("x", dtype=dtype)
    y = pt.vector("y", dtype="int64")
    hidden = pt.maximum(x @ W1 + b1, 0)
    logits = hidden @ W2 + b2
    log_probs = logits - pt.logsumexp(logits, axis=1, keepdims=True)
    loss = -log_probs[pt.arange(y.shape[0]), y].mean()
    return (x, y), [W1, b1, W2, b2], loss


def batch(dtype="float32", size=BATCH, sizes=SIZES, seed=1):
    rng = np.random.RandomState(seed)
    return (rng.rand(size, sizes[0]).astype(dtype),
            rng.randint(0, sizes[2], size=size).astype("int64"))


def time_calls(fn, args=(), repeat=50):
    """Seconds per call of ``fn(*args)``, over `repeat` calls."""
    start = time.perf_counter()
    for _ in range(repeat):
        fn(*args)
    return (time.perf_counter() - start) / repeat


def median(values):
    return float(np.median(values)) if values else float("nan")


def available_modes():
    """Compilation modes installed here: C (with or without BLAS), Numba, JAX, PyTorch."""
    modes = ["CVM", "NUMBA"]
    for mode, module in (("JAX", "jax"), ("PYTORCH", "torch")):
        try:
            __import__(module)
        except ImportError:
            continue
        modes.append(mode)
    return modes
