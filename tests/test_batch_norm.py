"""batch_norm and its running statistics under accumulation, against PyTorch (float64).

PyTorch is the reference: ``torch.nn.BatchNorm1d``/``2d`` for one layer, and for a model
with two batch-norm layers a PyTorch loop that runs forward and backward per micro-batch
in train mode and steps every K (what DDP with per-device batch norm computes). The
pooled running statistics are checked against the mean and unbiased variance of the
window's activations as PyTorch computed them.
"""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import lasagne_accum as la

torch = pytest.importorskip("torch", reason="PyTorch is the reference (the torch extra)")

SIZES = (6, 10, 8, 3)
K, B = 4, 8
WINDOWS = 8


def _shared(value, name):
    return pytensor.shared(np.array(value, dtype="float64"), name=name)


@pytest.mark.parametrize("shape", [(7, 3), (5, 3, 4, 2)], ids=["1d", "2d"])
def test_one_layer_equals_torch_batchnorm(shape):
    rng = np.random.default_rng(0)
    X = rng.normal(size=shape) * 2 + 1
    c = shape[1]
    g, b = _shared(rng.normal(size=c), "g"), _shared(rng.normal(size=c), "b")
    rm, rv = _shared(rng.normal(size=c), "rm"), _shared(rng.uniform(0.5, 2, size=c), "rv")
    x = pt.tensor("x", shape=(None,) * len(shape), dtype="float64")
    y = la.batch_norm(x, g, b, rm, rv, epsilon=1e-5, alpha=0.1)
    ev = la.batch_norm(x, g, b, rm, rv, deterministic=True)
    train = pytensor.function([x], y, updates=la.batch_norm_updates(y))
    evaluate = pytensor.function([x], ev)
    bn = (torch.nn.BatchNorm1d if len(shape) == 2 else torch.nn.BatchNorm2d)(
        c, eps=1e-5, momentum=0.1).double()
    with torch.no_grad():
        bn.weight.copy_(torch.tensor(g.get_value()))
        bn.bias.copy_(torch.tensor(b.get_value()))
        bn.running_mean.copy_(torch.tensor(rm.get_value()))
        bn.running_var.copy_(torch.tensor(rv.get_value()))
    for _ in range(3):
        got = train(X)
        want = bn.train()(torch.tensor(X)).detach().numpy()
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(rm.get_value(), bn.running_mean.numpy(), rtol=1e-12)
        np.testing.assert_allclose(rv.get_value(), bn.running_var.numpy(), rtol=1e-12)
        X = X * 1.5 - 0.3
    np.testing.assert_allclose(evaluate(X), bn.eval()(torch.tensor(X)).detach().numpy(),
                               rtol=1e-12, atol=1e-12)


def _init(seed=1):
    rng = np.random.default_rng(seed)
    layers = []
    for n_in, n_out in zip(SIZES[:-1], SIZES[1:]):
        layers.append((rng.normal(size=(n_in, n_out)) / np.sqrt(n_in), rng.normal(size=n_out)))
    bn = [(rng.uniform(0.5, 1.5, size=n), rng.normal(size=n) * 0.1) for n in SIZES[1:3]]
    return layers, bn


def _ours(rule, kwargs, prefix="p", **options):
    """Our two-BN-layer model compiled by compile_accumulation(**options): the trainer, the
    parameters (in TorchModel.params' order) and the running statistics."""
    (l1, l2, l3), (bn1, bn2) = _init()
    names = iter(range(100))
    sh = lambda v: _shared(v, f"{prefix}{next(names)}")  # noqa: E731
    # no bias before a batch norm (see TorchModel)
    W = [(sh(l1[0]),), (sh(l2[0]),), (sh(l3[0]), sh(l3[1]))]
    G = [(sh(g), sh(b)) for g, b in (bn1, bn2)]
    R = [(_shared(np.zeros(n), f"{prefix}rm{i}"), _shared(np.ones(n), f"{prefix}rv{i}"))
         for i, n in enumerate(SIZES[1:3])]
    x, t = pt.matrix("x", dtype="float64"), pt.vector("t", dtype="int64")
    h = x
    for i in range(2):
        h = pt.maximum(la.batch_norm(h @ W[i][0], *G[i], *R[i]), 0)
    logits = h @ W[2][0] + W[2][1]
    logp = logits - pt.logsumexp(logits, axis=1, keepdims=True)
    loss = -logp[pt.arange(t.shape[0]), t].mean()
    params = [p for pair in W for p in pair] + [p for pair in G for p in pair]
    trainer = la.compile_accumulation([x, t], loss, params, rule, kwargs, every=K,
                                      weight=x.shape[0], **options)
    return trainer, params, [v for pair in R for v in pair]


class TorchModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        (l1, l2, l3), (bn1, bn2) = _init()
        # no bias before a batch norm: its gradient is zero up to rounding, which Adam
        # would normalise into steps of noise
        self.linears = torch.nn.ModuleList(torch.nn.Linear(a, b, bias=(i == 2)).double()
                                           for i, (a, b) in enumerate(zip(SIZES[:-1],
                                                                          SIZES[1:])))
        self.bns = torch.nn.ModuleList(torch.nn.BatchNorm1d(n, eps=1e-5, momentum=0.1).double()
                                       for n in SIZES[1:3])
        with torch.no_grad():
            for lin, (w, b) in zip(self.linears, (l1, l2, l3)):
                lin.weight.copy_(torch.tensor(w.T))
                if lin.bias is not None:
                    lin.bias.copy_(torch.tensor(b))
            for bn, (g, b) in zip(self.bns, (bn1, bn2)):
                bn.weight.copy_(torch.tensor(g))
                bn.bias.copy_(torch.tensor(b))
        self.seen = []          # each BN layer's input, per forward

    def forward(self, x):
        inputs = []
        for i in range(2):
            x = self.linears[i](x)
            inputs.append(x.detach().numpy().copy())
            x = torch.relu(self.bns[i](x))
        self.seen.append(inputs)
        return self.linears[2](x)

    def params(self):
        """In our order: W (in x out), b per linear, then gamma, beta per BN."""
        out = []
        for lin in self.linears:
            out += [lin.weight.detach().numpy().T]
            if lin.bias is not None:
                out += [lin.bias.detach().numpy()]
        for bn in self.bns:
            out += [bn.weight.detach().numpy(), bn.bias.detach().numpy()]
        return out

    def running(self):
        return [a for bn in self.bns for a in (bn.running_mean.numpy(), bn.running_var.numpy())]


def _data(sizes):
    rng = np.random.default_rng(3)
    n = sum(sizes) * WINDOWS
    return rng.normal(size=(n, SIZES[0])), rng.integers(0, SIZES[-1], size=n)


RULES = {"momentum": (la.momentum, dict(learning_rate=0.05, momentum=0.9),
                      lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
         "adam": (la.adam, dict(learning_rate=0.01, epsilon=1e-16),
                  lambda p: torch.optim.Adam(p, lr=0.01, eps=1e-16))}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_ghost_each_equals_a_torch_loop_over_micro_batches(rule):
    """Ghost batches with running_stats='each' equal PyTorch training per micro-batch in
    train mode and stepping every K (DDP with per-device batch norm), after every window."""
    fn, kwargs, torch_opt = RULES[rule]
    trainer, params, running = _ours(fn, kwargs)
    model = TorchModel()
    opt = torch_opt(model.parameters())
    X, T = _data([B] * K)
    for w in range(WINDOWS):
        opt.zero_grad()
        for k in range(K):
            s = slice((w * K + k) * B, (w * K + k + 1) * B)
            trainer.step(X[s], T[s])
            out = model(torch.tensor(X[s]))
            (torch.nn.functional.cross_entropy(out, torch.tensor(T[s])) / K).backward()
        opt.step()
        for ours, theirs in zip(params, model.params()):
            np.testing.assert_allclose(ours.get_value(), theirs, rtol=1e-10, atol=1e-12,
                                       err_msg=f"{rule} window {w}")
        for ours, theirs in zip(running, model.running()):
            np.testing.assert_allclose(ours.get_value(), theirs, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("sizes", [(B,) * K, (5, 11, 8, 9)], ids=["equal", "unequal"])
def test_pooled_running_stats_are_the_windows_mean_and_unbiased_variance(sizes):
    """running_stats='pooled' moves each running average once per window, by the mean and
    unbiased variance of the window's activations (PyTorch's forward gives them); the
    parameters train as with 'each'."""
    trainer, params, running = _ours(la.momentum, dict(learning_rate=0.05, momentum=0.9),
                                     running_stats="pooled")
    model = TorchModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    X, T = _data(sizes)
    expect = [np.zeros(SIZES[1]), np.ones(SIZES[1]), np.zeros(SIZES[2]), np.ones(SIZES[2])]
    start = 0
    for w in range(WINDOWS):
        opt.zero_grad()
        model.seen.clear()
        total = sum(sizes)
        for size in sizes:
            s = slice(start, start + size)
            start += size
            trainer.step(X[s], T[s])
            out = model(torch.tensor(X[s]))
            (torch.nn.functional.cross_entropy(out, torch.tensor(T[s])) * size / total
             ).backward()
        opt.step()
        for layer in range(2):
            acts = np.concatenate([seen[layer] for seen in model.seen])
            m, v = expect[2 * layer], expect[2 * layer + 1]
            expect[2 * layer] = 0.9 * m + 0.1 * acts.mean(0)
            expect[2 * layer + 1] = 0.9 * v + 0.1 * acts.var(0, ddof=1)
        for ours, want in zip(running, expect):
            np.testing.assert_allclose(ours.get_value(), want, rtol=1e-10, atol=1e-12)
        for ours, theirs in zip(params, model.params()):
            np.testing.assert_allclose(ours.get_value(), theirs, rtol=1e-10, atol=1e-12)


def test_single_function_form_with_the_running_updates_equals_the_two_functions():
    trainer, params, running = _ours(la.adam, dict(learning_rate=0.01))
    (l1, l2, l3), (bn1, bn2) = _init()
    vals = [l1[0], l2[0], l3[0], l3[1], bn1[0], bn1[1], bn2[0], bn2[1]]
    P = [_shared(v, f"s{i}") for i, v in enumerate(vals)]
    R = [(_shared(np.zeros(n), f"srm{i}"), _shared(np.ones(n), f"srv{i}"))
         for i, n in enumerate(SIZES[1:3])]
    x, t = pt.matrix("x", dtype="float64"), pt.vector("t", dtype="int64")
    h = x
    for i in range(2):
        h = pt.maximum(la.batch_norm(h @ P[i], P[4 + 2 * i], P[5 + 2 * i], *R[i]), 0)
    logits = h @ P[2] + P[3]
    logp = logits - pt.logsumexp(logits, axis=1, keepdims=True)
    loss = -logp[pt.arange(t.shape[0]), t].mean()
    updates = la.merge_updates(la.adam(loss, P, learning_rate=0.01, average=K,
                                       weight=x.shape[0]), la.batch_norm_updates(loss))
    train = pytensor.function([x, t], loss, updates=updates)
    X, T = _data([B] * K)
    for i in range(K * 3):
        s = slice(i * B, (i + 1) * B)
        trainer.step(X[s], T[s])
        train(X[s], T[s])
    for ours, single in zip(params, P):
        np.testing.assert_allclose(single.get_value(), ours.get_value(), rtol=1e-12)
    for ours, single in zip(running, [v for pair in R for v in pair]):
        np.testing.assert_allclose(single.get_value(), ours.get_value(), rtol=1e-12)


def test_running_statistics_are_checkpointed(tmp_path):
    trainer, params, running = _ours(la.sgd, dict(learning_rate=0.1))
    X, T = _data([B] * K)
    trainer.step(X[:B], T[:B])
    saved = [v.get_value().copy() for v in running]
    trainer.save(tmp_path / "c.npz")
    trainer.step(X[B:2 * B], T[B:2 * B])
    trainer.load(tmp_path / "c.npz")
    for v, s in zip(running, saved):
        np.testing.assert_array_equal(v.get_value(), s)


def test_bad_input_is_refused_and_nothing_is_lost():
    x = pt.matrix("x")
    g, b = _shared(np.ones(3), "g"), _shared(np.zeros(3), "b")
    rm, rv = _shared(np.zeros(3), "rm"), _shared(np.ones(3), "rv")
    with pytest.raises(ValueError, match="running_mean has shape \\(4,\\)"):
        la.batch_norm(x, g, b, _shared(np.zeros(4), "rm4"), rv)
    with pytest.raises(ValueError, match="gamma has shape"):
        la.batch_norm(x, _shared(np.ones((3, 1)), "g2"), b, rm, rv)
    with pytest.raises(TypeError, match="running_var must be a shared variable"):
        la.batch_norm(x, g, b, rm, np.ones(3))
    with pytest.raises(ValueError, match="alpha must be in"):
        la.batch_norm(x, g, b, rm, rv, alpha=0)
    with pytest.raises(ValueError, match="distinct axes"):
        la.batch_norm(x, g, b, rm, rv, axes=(0, 0))
    y = la.batch_norm(x, g, b, rm, rv)
    f = pytensor.function([x], y, updates=la.batch_norm_updates(y))
    with pytest.raises(AssertionError, match="unbiased variance, which the running variance"):
        f(np.ones((1, 3)))
    assert np.array_equal(rm.get_value(), np.zeros(3)) and \
        np.array_equal(rv.get_value(), np.ones(3))
    loss = y.sum()
    for kwargs, error, match in ((dict(running_stats="window"), ValueError, "running_stats"),
                                 (dict(batch_norm="sync"), ValueError, "batch_norm must be")):
        with pytest.raises(error, match=match):
            la.compile_accumulation([x], loss, [g, b], la.sgd, dict(learning_rate=0.1),
                                    **kwargs)


def test_recompute_running_stats_pools_every_batch():
    from lasagne_accum.batch_norm import recompute_running_stats

    rng = np.random.default_rng(4)
    x = pt.matrix("x")
    g, b = _shared(np.ones(3), "g"), _shared(np.zeros(3), "b")
    rm, rv = _shared(np.zeros(3), "rm"), _shared(np.ones(3), "rv")
    W = _shared(rng.normal(size=(2, 3)), "W")
    h = x @ W
    y = la.batch_norm(h, g, b, rm, rv)
    batches = [rng.normal(size=(n, 2)) for n in (3, 7, 5)]
    assert recompute_running_stats([x], y.sum(), [(X,) for X in batches]) == 1
    acts = np.concatenate(batches) @ W.get_value()
    np.testing.assert_allclose(rm.get_value(), acts.mean(0), rtol=1e-12)
    np.testing.assert_allclose(rv.get_value(), acts.var(0, ddof=1), rtol=1e-12)
    with pytest.raises(ValueError, match="batches is empty"):
        recompute_running_stats([x], y, [])
    with pytest.raises(ValueError, match="no training-mode"):
        recompute_running_stats([x], h.sum(), [(batches[0],)])


@pytest.mark.real_backend
@pytest.mark.parametrize("mode", ["NUMBA", "JAX"])
def test_the_same_numbers_in_c_numba_and_jax(mode):
    if mode == "JAX":
        pytest.importorskip("jax")
    X, T = _data([B] * K)
    results = {}
    for m in ("CVM", mode):
        trainer, params, running = _ours(la.adam, dict(learning_rate=0.01), mode=m)
        for i in range(2 * K):
            trainer.step(X[i * B:(i + 1) * B], T[i * B:(i + 1) * B])
        results[m] = [v.get_value() for v in params + running]
    for a, c in zip(results[mode], results["CVM"]):
        np.testing.assert_allclose(np.asarray(a), c, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("rule, sizes", [("momentum", (B,) * K), ("adam", (B,) * K),
                                         ("momentum", (5, 11, 8, 9))],
                         ids=["momentum", "adam", "unequal"])
def test_exact_pooled_equals_torch_on_the_concatenated_batch(rule, sizes):
    """batch_norm='exact' (running_stats='pooled') equals PyTorch training on the window's
    micro-batches concatenated, in one forward and backward (= SyncBatchNorm), after every
    window: parameters and running statistics."""
    fn, kwargs, torch_opt = RULES[rule]
    trainer, params, running = _ours(fn, kwargs, prefix="e", batch_norm="exact")
    model = TorchModel()
    opt = torch_opt(model.parameters())
    X, T = _data(sizes)
    start = 0
    for w in range(WINDOWS):
        total = sum(sizes)
        outs = []
        for size in sizes:
            outs.append(trainer.step(X[start:start + size], T[start:start + size]))
            start += size
        assert outs[:-1] == [None] * (len(sizes) - 1) and trainer.steps == w + 1
        opt.zero_grad()
        out = model(torch.tensor(X[start - total:start]))
        loss = torch.nn.functional.cross_entropy(out, torch.tensor(T[start - total:start]))
        loss.backward()
        opt.step()
        assert outs[-1] == pytest.approx(float(loss), rel=1e-10)
        # atol 1e-10: the large batch's gradient summed in another order differs at 1e-16 of
        # its scale, which Adam's first steps (g / |g|) enlarge for an element near 0
        for ours, theirs in zip(params, model.params()):
            np.testing.assert_allclose(ours.get_value(), theirs, rtol=1e-10, atol=1e-10,
                                       err_msg=f"{rule} window {w}")
        for ours, theirs in zip(running, model.running()):
            np.testing.assert_allclose(ours.get_value(), theirs, rtol=1e-10, atol=1e-12)


def test_exact_mode_refuses_what_it_cannot_do(tmp_path):
    trainer, params, running = _ours(la.sgd, dict(learning_rate=0.1), prefix="e",
                                     batch_norm="exact")
    X, T = _data([B] * K)
    trainer.step(X[:B], T[:B])
    before = [p.get_value().copy() for p in params]
    with pytest.raises(RuntimeError, match="holds 1 micro-batch"):
        trainer.save(tmp_path / "c.npz")
    assert trainer.flush() is True and trainer.steps == 1      # a window of one: the batch
    assert not all(np.array_equal(p.get_value(), b) for p, b in zip(params, before))
    trainer.save(tmp_path / "c.npz")                            # at a boundary: fine
    x, t = pt.matrix("x"), pt.vector("t", dtype="int64")
    g, b = _shared(np.ones(3), "g"), _shared(np.zeros(3), "b")
    y = la.batch_norm(x, g, b, _shared(np.zeros(3), "m"), _shared(np.ones(3), "v"))
    for kwargs, match in ((dict(running_stats="each", weight=x.shape[0]), "must be 'pooled'"),
                          (dict(), "needs weight="),
                          (dict(weight=x.shape[0], noise_scale=True), "noise_scale cannot")):
        with pytest.raises(ValueError, match=match):
            la.compile_accumulation([x], y.sum(), [g, b], la.sgd, dict(learning_rate=0.1),
                                    batch_norm="exact", **kwargs)


@pytest.mark.real_backend
def test_a_float32_layer_stays_float32_compiled():
    x = pt.matrix("x", dtype="float32")
    sh = lambda v, n: pytensor.shared(np.asarray(v, "float32"), name=n)  # noqa: E731
    rm, rv = sh(np.zeros(3), "rm32"), sh(np.ones(3), "rv32")
    y = la.batch_norm(x, sh(np.ones(3), "g32"), sh(np.zeros(3), "b32"), rm, rv)
    ev = la.batch_norm(x, sh(np.ones(3), "g32e"), sh(np.zeros(3), "b32e"), rm, rv,
                       deterministic=True)
    f = pytensor.function([x], [y, ev], updates=la.batch_norm_updates(y), mode=la.mode("CVM"))
    out = f(np.random.default_rng(0).normal(size=(4, 3)).astype("float32"))
    assert [o.dtype for o in out] == ["float32", "float32"]
    assert rm.get_value().dtype == rv.get_value().dtype == np.float32


def test_run_epoch_with_the_exact_mode_averages_the_windows_losses():
    trainer, params, running = _ours(la.sgd, dict(learning_rate=0.1), prefix="r",
                                     batch_norm="exact")
    X, T = _data([B] * K)
    batches = [(X[i * B:(i + 1) * B], T[i * B:(i + 1) * B]) for i in range(K + 2)]
    loss = la.run_epoch(trainer, batches, progress=False)
    assert trainer.steps == 2 and np.isfinite(loss)     # a full window and a flushed pair
