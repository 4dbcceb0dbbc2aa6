"""State on the device: JAX donation, PyTorch device tensors, moving values between modes.

Functions compiled with ``lasagne_accum.mode("JAX")`` donate the buffers of
the shared variables they update; with ``mode("PYTORCH", device=...)`` state
stays a torch tensor on the device, updated in place. Each test checks the
numbers against the C backend (or numpy) and the placement or memory claim
directly: buffer addresses, live JAX bytes, ``data_ptr()``, tensor devices.
The C functions compile for real (``real_backend``): "the C backend's
numbers" are the reference here.
"""

import gc
import importlib.util

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import lasagne_accum as la
from lasagne_accum._graph import as_host_array

needs_jax = pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                               reason="jax not installed")
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="torch not installed")
pytestmark = pytest.mark.real_backend


def _regression(shape, dtype="float64", seed=0, name="W"):
    """A tanh regression on one weight matrix: the weight, inputs and loss."""
    rng = np.random.RandomState(seed)
    W = pytensor.shared((rng.randn(*shape) * 0.01).astype(dtype), name=name)
    x, y = pt.matrix("x", dtype=dtype), pt.matrix("y", dtype=dtype)
    loss = ((pt.tanh(x @ W) - y) ** 2).mean()
    return W, x, y, loss


def _batches(shape, dtype="float64", n=3):
    rng = np.random.RandomState(1)
    return [(rng.randn(4, shape[0]).astype(dtype), rng.randn(4, shape[1]).astype(dtype))
            for _ in range(n)]


def _train(mode, shape, calls=3, average=2):
    W, x, y, loss = _regression(shape)
    upd = la.adam(loss, [W], 0.01, average=average)
    f = pytensor.function([x, y], loss, updates=upd, mode=mode)
    for batch in _batches(shape, n=calls):
        f(*batch)
    return f, upd


# ------------------------------------------------------------------------ JAX


@needs_jax
def test_jax_updates_state_in_its_own_buffers_and_keeps_one_copy():
    """A 64 MB float64 parameter through ``adam(..., average=2)``: W, both moments and
    the gradient buffer (256 MB). After a call every updated variable's new value sits
    in its old buffer (donated), and the live JAX arrays hold the state once."""
    import jax

    shape = (2048, 4096)                       # 64 MiB of float64
    f, upd = _train(la.mode("JAX"), shape, calls=2)
    state = sum(as_host_array(v.get_value(borrow=True)).nbytes for v in upd)
    assert state >= 4 * 64 * 2 ** 20
    batch = _batches(shape, n=1)[0]
    for _ in range(2):   # a stepping call and a buffering call
        before = {v.name: v.get_value(borrow=True).unsafe_buffer_pointer() for v in upd}
        f(*batch)
        after = {v.name: v.get_value(borrow=True).unsafe_buffer_pointer() for v in upd}
        assert after == before
        gc.collect()
        live = sum(a.nbytes for a in jax.live_arrays())
        assert live <= 1.05 * state, (live, state)


@needs_jax
def test_jax_donation_gives_the_numbers_of_c_and_of_plain_jax():
    shape = (40, 30)
    ours = _train(la.mode("JAX"), shape, calls=5)[1]
    got = {v.name: as_host_array(v.get_value()) for v in ours}
    c = {v.name: v.get_value() for v in _train(la.mode("CVM"), shape, calls=5)[1]}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # PyTensor's own JAX mode warns about its asserts
        plain = {v.name: np.asarray(v.get_value())
                 for v in _train("JAX", shape, calls=5)[1]}
    for name, want in c.items():
        np.testing.assert_allclose(got[name].astype(float), want.astype(float), rtol=1e-12,
                                   atol=1e-15, err_msg=name)
        np.testing.assert_array_equal(got[name], plain[name], err_msg=name)


@needs_jax
def test_jax_value_held_elsewhere_is_not_donated():
    """``get_value(borrow=True)`` is the state's own array: the next call donates a copy
    instead, so what the user holds keeps its values; ``get_value()`` is a copy."""
    W, x, y, loss = _regression((6, 3))
    f = pytensor.function([x, y], loss, updates=la.sgd(loss, [W], 0.1),
                          mode=la.mode("JAX"))
    batches = _batches((6, 3), n=3)
    f(*batches[0])
    borrowed, copied = W.get_value(borrow=True), W.get_value()
    assert borrowed.unsafe_buffer_pointer() != copied.unsafe_buffer_pointer()
    kept = np.array(borrowed)
    f(*batches[1])
    assert not borrowed.is_deleted()
    np.testing.assert_array_equal(np.asarray(borrowed), kept)
    np.testing.assert_array_equal(np.asarray(copied), kept)
    assert not np.array_equal(np.asarray(W.get_value()), kept)   # W itself moved on


@needs_jax
def test_jax_deleted_value_raises_naming_the_variable():
    W, x, y, loss = _regression((6, 3), name="W_hidden")
    f = pytensor.function([x, y], loss, updates=la.sgd(loss, [W], 0.1),
                          mode=la.mode("JAX"))
    batch = _batches((6, 3), n=1)[0]
    f(*batch)
    W.get_value(borrow=True).delete()   # as a donation by some other JAX code would
    with pytest.raises(RuntimeError, match=r"W_hidden: its value is a JAX array that has "
                                           r"been deleted"):
        f(*batch)


@pytest.mark.parametrize("backend", [pytest.param("JAX", marks=needs_jax),
                                     pytest.param("PYTORCH", marks=needs_torch)])
def test_updating_a_variable_and_its_clone_is_refused_at_compile_time(backend):
    w = pytensor.shared(np.zeros(3), name="w_shared")
    twin = w.clone()     # the same value (container) under another variable
    with pytest.raises(ValueError, match=r"w_shared is updated twice in one function: "
                                         r"w_shared and a clone\(\) of it share one value"):
        pytensor.function([], [], updates={w: w + 1, twin: twin * 2},
                          mode=la.mode(backend, **({"device": "cpu"}
                                                   if backend == "PYTORCH" else {})))


@needs_jax
def test_jax_refuses_device_and_compile():
    with pytest.raises(ValueError, match=r"device= applies to the PYTORCH backend only; "
                                         r"JAX puts arrays on its default device"):
        la.mode("JAX", device="cpu")
    with pytest.raises(ValueError, match="compile= applies to the PYTORCH backend only"):
        la.mode("NUMBA", compile=True)


# -------------------------------------------------------------------- PyTorch


@needs_torch
def test_pytorch_state_stays_on_the_device_updated_in_place():
    import torch

    shape = (40, 30)
    W, x, y, loss = _regression(shape)
    upd = la.adam(loss, [W], 0.01, average=2)
    f = pytensor.function([x, y], loss, updates=upd,
                          mode=la.mode("PYTORCH", device="cpu"))
    batches = _batches(shape, n=5)
    first = f(*batches[0])
    assert isinstance(first, np.ndarray)             # what you asked for comes back
    pointers = {v.name: v.get_value(borrow=True).data_ptr() for v in upd}
    for batch in batches[1:]:
        f(*batch)
    for v in upd:
        value = v.get_value(borrow=True)
        assert isinstance(value, torch.Tensor) and value.device.type == "cpu", v.name
        assert value.data_ptr() == pointers[v.name], v.name
    c = {v.name: v.get_value() for v in _train(la.mode("CVM"), shape, calls=5)[1]}
    for v in upd:
        np.testing.assert_allclose(as_host_array(v.get_value()).astype(float),
                                   c[v.name].astype(float), rtol=1e-12, atol=1e-15,
                                   err_msg=v.name)


@needs_torch
def test_pytorch_runs_every_op_on_the_chosen_device():
    """On the ``meta`` device (shapes only, no data) any tensor the step made on the
    CPU would meet a meta tensor and fail: the whole Adam step runs there."""
    import torch

    W, x, y, loss = _regression((5, 3))
    upd = la.adam(loss, [W], 0.01)
    f = pytensor.function([x, y], [], updates=upd, mode=la.mode("PYTORCH", device="meta"))
    for batch in _batches((5, 3), n=2):
        f(*batch)
    for v in upd:
        value = v.get_value(borrow=True)
        assert isinstance(value, torch.Tensor) and value.device.type == "meta", v.name
    assert tuple(W.get_value(borrow=True).shape) == (5, 3)


@needs_torch
def test_pytorch_device_that_does_not_exist_is_refused():
    import torch

    if torch.cuda.is_available():
        bad, message = f"cuda:{torch.cuda.device_count()}", r"CUDA device\(s\): cuda:0 to"
    else:
        bad, message = "cuda", "this machine has no CUDA device"
    with pytest.raises(ValueError, match=message):
        la.mode("PYTORCH", device=bad)
    with pytest.raises(ValueError, match="'gpu0' is not a torch device"):
        la.mode("PYTORCH", device="gpu0")
    default = la.mode("PYTORCH")
    assert default.linker.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


@needs_torch
@pytest.mark.slow
def test_pytorch_compiled_matches_eager_in_place():
    """``compile=True`` (torch.compile, the default on an accelerator) on the CPU: the
    same numbers as the eager run, state in place."""
    shape = (6, 3)
    runs = {}
    for compiled in (False, True):
        W, x, y, loss = _regression(shape)
        upd = la.adam(loss, [W], 0.01, average=2)
        f = pytensor.function([x, y], loss, updates=upd,
                              mode=la.mode("PYTORCH", device="cpu", compile=compiled))
        batches = _batches(shape, n=4)
        f(*batches[0])
        pointers = {v.name: v.get_value(borrow=True).data_ptr() for v in upd}
        losses = [float(f(*b)) for b in batches[1:]]
        assert all(v.get_value(borrow=True).data_ptr() == pointers[v.name] for v in upd)
        runs[compiled] = losses, {v.name: as_host_array(v.get_value()) for v in upd}
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-12)
    for name, want in runs[False][1].items():
        np.testing.assert_allclose(runs[True][1][name].astype(float), want.astype(float),
                                   rtol=1e-12, atol=1e-15, err_msg=name)


@needs_torch
def test_pytorch_output_that_is_updated_state_keeps_the_old_value():
    """Returning a variable the function also updates in place gives its value from
    before the call (the tensor is copied before it is overwritten)."""
    w = pytensor.shared(np.arange(3.0), name="w")
    f = pytensor.function([], w, updates={w: w * 2 + 1},
                          mode=la.mode("PYTORCH", device="cpu"))
    np.testing.assert_array_equal(f(), [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(f(), [1.0, 3.0, 5.0])
    np.testing.assert_array_equal(as_host_array(w.get_value()), [3.0, 7.0, 11.0])


# --------------------------------------------------------------- mixing modes


def _modes_installed():
    modes = ["CVM", "NUMBA"]
    if importlib.util.find_spec("jax"):
        modes.append("JAX")
    if importlib.util.find_spec("torch"):
        modes.append("PYTORCH")
    return modes


def test_one_variable_through_every_mode_converts_its_value():
    """One parameter trained by a C, a Numba, a JAX and a PyTorch function in turn, each
    taking what the previous one left (a numpy array, a JAX array, a torch tensor):
    the numbers of the same calls all in C."""
    order = _modes_installed() * 2
    shape = (5, 3)
    batches = _batches(shape, n=len(order))

    def run(modes):
        W, x, y, loss = _regression(shape)
        upd = la.momentum(loss, [W], 0.05, momentum=0.9)
        fns = {}
        for m, batch in zip(modes, batches):
            if m not in fns:   # compiled while W holds the previous mode's value
                fns[m] = pytensor.function([x, y], loss, updates=upd, mode=la.mode(m))
            fns[m](*batch)
        return {v.name: as_host_array(v.get_value()) for v in upd}

    got, want = run(order), run(["CVM"] * len(order))
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-15,
                                   err_msg=name)


@needs_torch
def test_a_value_that_cannot_be_converted_names_the_variable_and_both_modes():
    w = pytensor.shared(np.zeros(3), name="w_meta")
    on_meta = pytensor.function([], [], updates={w: w + 1},
                                mode=la.mode("PYTORCH", device="meta"))
    on_meta()
    in_c = pytensor.function([], [], updates={w: w * 2}, mode=la.mode("CVM"))
    with pytest.raises(ValueError, match=r"w_meta holds a value of the PYTORCH backend "
                                         r"\(Tensor\), which this C function could not "
                                         r"convert"):
        in_c()


# ----------------------------------------- checkpoints and averages on the device


@pytest.mark.parametrize("backend", [pytest.param("JAX", marks=needs_jax),
                                     pytest.param("PYTORCH", marks=needs_torch)])
def test_checkpoint_model_average_and_ema_on_device_state(backend, tmp_path):
    """compile_accumulation with a ModelAverage and an EMA: the same numbers as C; a
    checkpoint of device state loads back exactly; apply/restore swap the averages in
    and the trained values back bit for bit, into the same tensors for PyTorch."""
    shape = (5, 3)

    def trainer(mode):
        W, x, y, loss = _regression(shape)
        t = la.compile_accumulation([x, y], loss, [W], la.adam, dict(learning_rate=0.05),
                                    every=2, mode=mode,
                                    model_average=dict(average_window_rate=0.5,
                                                       min_average_window=2,
                                                       max_average_window=3),
                                    ema=dict(decay=0.5))
        for batch in _batches(shape, n=8):
            t.step(*batch)
        return t, W

    got, W = trainer(la.mode(backend, **({"device": "cpu"} if backend == "PYTORCH" else {})))
    want, W_c = trainer("CVM")
    for average in ("model_average", "ema"):
        np.testing.assert_allclose(getattr(got, average).averages()[0],
                                   getattr(want, average).averages()[0], rtol=1e-12)
    trained = as_host_array(W.get_value())
    np.testing.assert_allclose(trained, W_c.get_value(), rtol=1e-12)

    pointer = W.get_value(borrow=True).data_ptr() if backend == "PYTORCH" else None
    with got.model_average.apply():
        np.testing.assert_array_equal(as_host_array(W.get_value()),
                                      got.model_average.averages()[0])
    np.testing.assert_array_equal(as_host_array(W.get_value()), trained)
    if pointer is not None:
        assert W.get_value(borrow=True).data_ptr() == pointer

    saved = {v.name: as_host_array(v.get_value()) for v in got.apply_updates}
    got.save(tmp_path / "state.npz")
    for batch in _batches(shape, n=2):
        got.step(*batch)       # move on, then go back
    got.load(tmp_path / "state.npz")
    for v in got.apply_updates:
        np.testing.assert_array_equal(as_host_array(v.get_value()), saved[v.name],
                                      err_msg=v.name)
    if pointer is not None:
        assert W.get_value(borrow=True).data_ptr() == pointer
