"""Checkpoints: every piece of training state round-trips, bit for bit."""

import os
import zipfile

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import lasagne_accum as la
from lasagne_accum import collect_state, load_state, save_state

MODE = "CVM"


def _model(seed=0, dtype="float64"):
    rng = np.random.RandomState(seed)
    W = pytensor.shared(rng.randn(3, 2).astype(dtype), name="W")
    b = pytensor.shared(np.zeros(2, dtype), name="b")
    x = pt.matrix("x", dtype=dtype)
    y = pt.matrix("y", dtype=dtype)
    loss = ((pt.tanh(x @ W + b) - y) ** 2).mean()
    return x, y, [W, b], loss


def _batches(n, seed=1, dtype="float64"):
    rng = np.random.RandomState(seed)
    return [(rng.randn(k, 3).astype(dtype), rng.randn(k, 2).astype(dtype))
            for k in rng.randint(1, 5, size=n)]


def _values(named):
    return {k: np.array(v.get_value()) for k, v in named.items()}


def _assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert np.array_equal(a[k], b[k]), k


def _trainer(seed=0):
    x, y, params, loss = _model(seed)
    trainer = la.compile_accumulation([x, y], loss, params, la.adam, dict(learning_rate=0.05),
                                      every=3, weight=x.shape[0], mode=MODE)
    return trainer, params


def test_collect_state_names_everything_a_rule_touches():
    x, y, params, loss = _model()
    named = collect_state(la.adam(loss, params))
    assert list(named) == ["W.adam_m", "W.adam_v", "W", "b.adam_m", "b.adam_v", "b", "adam.t"]


def test_collect_state_disambiguates_repeated_names_in_order():
    a = pytensor.shared(0.0, name="t")
    b = pytensor.shared(1.0, name="t")
    c = pytensor.shared(2.0)
    assert list(collect_state([a, b, c])) == ["t", "t#2", "var2"]


def test_collect_state_rejects_other_objects():
    with pytest.raises(TypeError, match="cannot collect state"):
        collect_state(42)


def test_round_trip_restores_values_and_dtypes(tmp_path):
    x, y, params, loss = _model(dtype="float32")
    upd = la.adam(loss, params, 0.1)
    f = pytensor.function([x, y], loss, updates=upd, mode=MODE)
    for xb, yb in _batches(3, dtype="float32"):
        f(xb, yb)
    named = collect_state(upd)
    saved = _values(named)
    path = tmp_path / "ckpt.npz"
    assert save_state(path, upd) == list(named)
    for var in named.values():
        var.set_value(np.zeros_like(var.get_value()))
    load_state(path, upd)
    _assert_bitwise(_values(named), saved)
    with np.load(path, allow_pickle=False) as data:  # no pickle inside; numpy reads it
        assert all(data[k].dtype != object for k in data.files)
        np.testing.assert_array_equal(data["W.adam_m"], saved["W.adam_m"])


def test_two_function_form_resumes_mid_window_bit_identical(tmp_path):
    batches = _batches(10)
    reference, _ = _trainer()
    for batch in batches:
        reference.step(*batch)
    reference.flush()
    expected = _values(collect_state(reference))

    first, _ = _trainer()
    for batch in batches[:4]:  # one full window of 3 and one batch of the next
        first.step(*batch)
    assert first.pending == 1
    first.save(tmp_path / "mid.npz")

    resumed, _ = _trainer()
    resumed.load(tmp_path / "mid.npz")
    assert resumed.pending == 1
    for batch in batches[4:]:
        resumed.step(*batch)
    resumed.flush()
    _assert_bitwise(_values(collect_state(resumed)), expected)


def _single(seed=0):
    x, y, params, loss = _model(seed)
    upd = la.momentum(loss, params, 0.05, momentum=0.9, average=3, weight=x.shape[0])
    avg = la.ModelAverage(params, 0.5, 2, 4, updates=upd)
    upd.update(avg.updates)
    return pytensor.function([x, y], loss, updates=upd, mode=MODE), upd, avg


def test_single_function_form_and_model_average_resume_bit_identical(tmp_path):
    batches = _batches(11)
    f, upd, avg = _single()
    for batch in batches:
        f(*batch)
    expected = _values(collect_state(upd, avg))
    with avg.apply():
        expected_avg = [p.get_value().copy() for p in avg.params]

    f1, upd1, avg1 = _single()
    for batch in batches[:5]:  # mid-window: 5 = 3 + 2
        f1(*batch)
    save_state(tmp_path / "single.npz", upd1, avg1)

    f2, upd2, avg2 = _single()
    load_state(tmp_path / "single.npz", upd2, avg2)
    for batch in batches[5:]:
        f2(*batch)
    _assert_bitwise(_values(collect_state(upd2, avg2)), expected)
    with avg2.apply():
        for p, e in zip(avg2.params, expected_avg):
            assert np.array_equal(p.get_value(), e)


def _single_lazy(lazy):
    x, y, params, loss = _model()
    upd = la.with_accumulated_gradients(loss, params, 3, la.momentum, weight=x.shape[0],
                                        lazy=lazy, learning_rate=0.05, momentum=0.9)
    return pytensor.function([x, y], loss, updates=upd, mode=MODE), upd


@pytest.mark.parametrize("strict", [True, False])
def test_a_checkpoint_without_the_zeroed_flag_resumes_exactly(tmp_path, strict):
    """A 0.2.0 checkpoint of the single-function form has no ``average.zeroed``,
    and at a window's end its buffers still hold that window (0.2.0 reset them
    on the next call, as ``lazy=False`` does now). It loads, strict or not, and
    the flag is set False, so those buffers are not added to the next window."""
    batches = _batches(9)
    f, upd = _single_lazy(True)
    for batch in batches:
        f(*batch)
    expected = _values(collect_state(upd))

    f_old, upd_old = _single_lazy(False)  # what 0.2.0 did
    for batch in batches[:6]:  # two whole windows: count 0, the buffers hold the second
        f_old(*batch)
    state = _values(collect_state(upd_old))
    assert int(state["average.count"]) == 0 and state["W.grad_accu"].any()
    del state["average.zeroed"]
    la.checkpoint.save_arrays(tmp_path / "old.npz", state)

    f2, upd2 = _single_lazy(True)
    for batch in batches[:3]:  # a step: this model's flag is True now
        f2(*batch)
    metadata, _, names = la.checkpoint.read_state(tmp_path / "old.npz", [upd2], strict=strict)
    assert "average.zeroed" not in names and metadata == {}
    got = collect_state(upd2)
    assert not got["average.zeroed"].get_value()
    for batch in batches[6:]:
        f2(*batch)
    got = _values(got)
    assert got.keys() == expected.keys()
    for k in expected:
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-12, atol=1e-15, err_msg=k)


def test_mismatched_checkpoint_lists_every_problem_and_loads_nothing(tmp_path):
    x, y, params, loss = _model()
    upd = la.sgd(loss, params, 0.1)
    path = tmp_path / "ckpt.npz"
    save_state(path, upd)

    W2 = pytensor.shared(np.ones((3, 5)), name="W")  # wrong shape
    b2 = pytensor.shared(np.ones(2, dtype="float32"), name="b")  # wrong dtype
    c2 = pytensor.shared(np.ones(1), name="c")  # not in the checkpoint
    before = [v.get_value().copy() for v in (W2, b2, c2)]
    with pytest.raises(ValueError) as info:
        load_state(path, [W2, b2, c2])
    message = str(info.value)
    assert "W: shape (3, 2) in the checkpoint, (3, 5) in the model" in message
    assert "b: dtype float64 in the checkpoint, float32 in the model" in message
    assert "missing in the checkpoint: c" in message
    assert "nothing was loaded" in message
    for v, old in zip((W2, b2, c2), before):
        assert np.array_equal(v.get_value(), old)


def test_extra_names_in_checkpoint_are_reported(tmp_path):
    a = pytensor.shared(np.zeros(2), name="a")
    b = pytensor.shared(np.zeros(2), name="b")
    save_state(tmp_path / "c.npz", [a, b])
    with pytest.raises(ValueError, match="in the checkpoint but not in the model: b"):
        load_state(tmp_path / "c.npz", [a])
    a.set_value(np.ones(2))
    assert load_state(tmp_path / "c.npz", [a], strict=False) == {}
    assert a.get_value().tolist() == [0.0, 0.0]


@pytest.mark.parametrize("damage", ["truncate", "garbage", "foreign"])
def test_corrupt_or_foreign_file_is_a_clear_error(tmp_path, damage):
    a = pytensor.shared(np.arange(4.0), name="a")
    path = tmp_path / "c.npz"
    save_state(path, [a])
    if damage == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"not a checkpoint at all")
    else:
        np.savez(path, a=np.zeros(4))  # a valid npz, but not ours
    a.set_value(np.full(4, 7.0))
    with pytest.raises(ValueError, match="checkpoint"):
        load_state(path, [a])
    assert np.array_equal(a.get_value(), np.full(4, 7.0))


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    a = pytensor.shared(np.arange(4.0), name="a")
    path = tmp_path / "c.npz"
    save_state(path, [a])
    original = path.read_bytes()

    def crash(fh, array, **kwargs):
        fh.write(b"\x93NUMPY partial")
        raise OSError("disk full")

    monkeypatch.setattr(np.lib.format, "write_array", crash)
    a.set_value(np.zeros(4))
    with pytest.raises(OSError, match="disk full"):
        save_state(path, [a])
    assert path.read_bytes() == original
    assert os.listdir(tmp_path) == ["c.npz"]  # no temporary file left behind
    monkeypatch.undo()
    load_state(path, [a])
    assert np.array_equal(a.get_value(), np.arange(4.0))
    with zipfile.ZipFile(path) as z:
        assert sorted(z.namelist()) == ["__lasagne_accum_state__.npy", "a.npy"]


def test_a_save_flushes_the_file_then_the_directory_after_the_rename(tmp_path, monkeypatch):
    """Durable after a power loss: the data are on disk before the rename, and the renamed
    entry (the directory) after it."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}")
                       if os.path.exists("/proc/self/fd") else None))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.fspath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    save_state(tmp_path / "c.npz", [pytensor.shared(np.arange(3.0), name="a")])
    assert [e[0] for e in events] == ["fsync", "replace", "fsync"]
    assert events[1][1] == os.fspath(tmp_path / "c.npz")
    if events[0][1] is not None:                # /proc tells a directory from a file
        assert events[0][1] is False and events[2][1] is True


# ------------------------------------------------------------------ hostile names and files


@pytest.mark.parametrize("name", ["allow_pickle", "file", "args", "kwds", "__lasagne_accum_state__",
                                  "a/b", "../up", "x.npy", "caf\u00e9 \u2603", "nul\x00in"])
def test_any_name_round_trips(tmp_path, name):
    """np.savez(**arrays) dropped 'allow_pickle' silently and raised on 'file'."""
    a = pytensor.shared(np.arange(3.0), name=name)
    b = pytensor.shared(np.full(2, 5.0, "float32"), name="other")
    path = tmp_path / "c.npz"
    assert save_state(path, [a, b]) == [name, "other"]
    a.set_value(np.zeros(3))
    b.set_value(np.zeros(2, "float32"))
    assert load_state(path, [a, b]) == {}
    assert a.get_value().tolist() == [0.0, 1.0, 2.0]
    assert b.get_value().tolist() == [5.0, 5.0]


def _write_raw(path, members):
    """A zip of raw members (bytes), for hand-made headers."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for member, data in members.items():
            zf.writestr(member, data)


def _npy_header(shape, dtype="<f8"):
    import io
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, dict(descr=dtype, fortran_order=False, shape=shape))
    return buf.getvalue()


def _saved_members(path):
    with zipfile.ZipFile(path) as zf:
        return {m: zf.read(m) for m in zf.namelist()}


def test_huge_header_is_a_value_error_before_reading(tmp_path):
    """A header claiming 8 TB raised MemoryError; now the shape check refuses it first."""
    w = pytensor.shared(np.zeros((3, 2)), name="w")
    path = tmp_path / "c.npz"
    save_state(path, [w])
    members = _saved_members(path)
    members["w.npy"] = _npy_header((1 << 20, 1 << 20)) + b"\0" * 64
    _write_raw(path, members)
    with pytest.raises(ValueError, match=r"w: shape \(1048576, 1048576\) in the checkpoint, "
                                         r"\(3, 2\) in the model"):
        load_state(path, [w])


def test_headers_are_checked_before_any_data_is_read(tmp_path, monkeypatch):
    """A big entry of the wrong shape is refused without reading its data."""
    big = pytensor.shared(np.zeros(200_000), name="big")
    small = pytensor.shared(np.zeros(2), name="small")
    path = tmp_path / "c.npz"
    save_state(path, [big, small])
    reads = []
    real = zipfile.ZipExtFile.read

    def counting(self, n=-1):
        data = real(self, n)
        reads.append(len(data))
        return data

    monkeypatch.setattr(zipfile.ZipExtFile, "read", counting)
    big2 = pytensor.shared(np.zeros(100), name="big")
    with pytest.raises(ValueError, match=r"big: shape \(200000,\) in the checkpoint"):
        load_state(path, [big2, small])
    assert sum(reads) < 10_000        # headers (and the small manifest), never the 1.6 MB


def test_truncated_member_and_lying_header_are_value_errors(tmp_path):
    w = pytensor.shared(np.zeros(1000), name="w")
    path = tmp_path / "c.npz"
    save_state(path, [w])
    members = _saved_members(path)
    members["w.npy"] = _npy_header((1000,)) + b"\0" * 80      # claims 8000 bytes, holds 80
    _write_raw(path, members)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_state(path, [w])
    assert np.array_equal(w.get_value(), np.zeros(1000))


def test_a_member_whose_bytes_changed_is_a_value_error_and_loads_nothing(tmp_path):
    """The zip's checksum catches data changed after the header: a clear error, no load."""
    w = pytensor.shared(np.arange(64.0), name="w")
    path = tmp_path / "c.npz"
    save_state(path, [w])
    data = bytearray(path.read_bytes())
    at = bytes(data).index(np.arange(64.0).tobytes())        # the stored array's bytes
    data[at + 8] ^= 0xFF
    path.write_bytes(bytes(data))
    w.set_value(np.zeros(64))
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_state(path, [w])
    assert np.array_equal(w.get_value(), np.zeros(64))


def test_a_fortran_order_member_loads_with_its_values(tmp_path):
    import io
    w = pytensor.shared(np.zeros((3, 2)), name="w")
    path = tmp_path / "c.npz"
    save_state(path, [w])
    members = _saved_members(path)
    value = np.asfortranarray(np.arange(6.0).reshape(3, 2))
    buf = io.BytesIO()
    np.lib.format.write_array(buf, value)
    assert b"'fortran_order': True" in buf.getvalue()[:128]
    members["w.npy"] = buf.getvalue()
    _write_raw(path, members)
    load_state(path, [w])
    assert w.get_value().tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


def test_unknown_format_version_is_refused(tmp_path):
    w = pytensor.shared(np.zeros(2), name="w")
    path = tmp_path / "c.npz"
    save_state(path, [w])
    members = _saved_members(path)
    import io
    for marker in (np.array(7), np.frombuffer(b'{"format": 3, "names": [["w", "w.npy"]]}',
                                                np.uint8)):
        buf = io.BytesIO()
        np.lib.format.write_array(buf, marker)
        members["__lasagne_accum_state__.npy"] = buf.getvalue()
        _write_raw(path, members)
        with pytest.raises(ValueError, match="format version [37].*upgrade"):
            load_state(path, [w])


def test_format_1_files_still_load(tmp_path):
    w = pytensor.shared(np.zeros(2), name="w")
    path = tmp_path / "old.npz"
    np.savez(path, w=np.array([3.0, 4.0]), __lasagne_accum_state__=np.array(1))
    assert load_state(path, [w]) == {}
    assert w.get_value().tolist() == [3.0, 4.0]


def _dead_pid():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                         capture_output=True, text=True, check=True, timeout=60)
    return int(out.stdout)


def test_a_save_never_removes_another_writers_temporary_file(tmp_path):
    """On a shared disk a live writer on another machine looks dead from here: a save
    leaves every temporary file but its own alone, whatever process id it names."""
    import socket

    a = pytensor.shared(np.arange(2.0), name="a")
    dead = _dead_pid()
    others = [f".tmp-c.npz-{dead}-abc123_x.npz",                  # an earlier version's name
              f".tmp-c.npz-otherhost-{dead}-abc123_x.npz",        # a writer elsewhere
              f".tmp-c.npz-{socket.gethostname()}-{dead}-zz9.npz",  # killed on this host
              f".tmp-d.npz-otherhost-{os.getpid()}-q.npz", ".tmp-c.npz-notours"]
    for name in others:
        (tmp_path / name).write_bytes(b"PK partial")
    save_state(tmp_path / "c.npz", [a])
    assert sorted(os.listdir(tmp_path)) == sorted(["c.npz", *others])
    a.set_value(np.zeros(2))
    load_state(tmp_path / "c.npz", [a])
    assert a.get_value().tolist() == [0.0, 1.0]


def test_two_writers_on_two_hosts_write_one_directory_at_once(tmp_path, monkeypatch):
    """Two writers named as two machines (the host name is the thread's name) save to
    one directory at once, to a shared target and their own, many times, some saves
    failing mid-write: every checkpoint loads, and each writer removes only its own
    temporary file. One writer is held mid-write while the other saves: its
    temporary file (named with its host and process id, which is not running here,
    as another machine's would not be) survives and completes."""
    import socket
    import threading

    pids = {"host-a": _dead_pid(), "host-b": os.getpid()}
    real_pid = os.getpid
    monkeypatch.setattr(socket, "gethostname", lambda: threading.current_thread().name)
    monkeypatch.setattr(os, "getpid", lambda: pids.get(threading.current_thread().name,
                                                       real_pid()))
    real_write, real_unlink = np.lib.format.write_array, os.unlink
    held, resume, removed = threading.Event(), threading.Event(), []

    def write_array(fh, array, **kwargs):
        real_write(fh, array, **kwargs)
        me = threading.current_thread()
        if me.name == "host-a" and array.size > 1000 and not held.is_set():
            held.set()                        # host-a's temporary file is half written
            assert resume.wait(120)
        if getattr(me, "fail", 0) and array.size == 3:
            me.fail -= 1
            raise OSError(f"{me.name}: disk full")

    def unlink(path, *args, **kwargs):
        removed.append((threading.current_thread().name, os.path.basename(path)))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(np.lib.format, "write_array", write_array)
    monkeypatch.setattr(os, "unlink", unlink)

    def writer(host, n, big=None):
        for i in range(n):
            for target in ("shared.npz", f"{host}.npz"):
                try:
                    save_state(tmp_path / target, [pytensor.shared(np.full(3, float(i)), name="w")],
                               metadata={"i": i, "host": host})
                except OSError as exc:
                    assert "disk full" in str(exc)
        if big is not None:
            save_state(tmp_path / "shared.npz", [big], metadata={"host": host})

    failures = []

    def run(host, *args):
        try:
            writer(host, *args)
        except BaseException as exc:          # noqa: BLE001 - reported below
            failures.append(exc)

    big = pytensor.shared(np.arange(5000.0), name="big")
    a = threading.Thread(target=run, args=("host-a", 0, big), name="host-a")
    a.start()
    try:
        while not held.wait(0.1):
            assert a.is_alive(), failures
        temps = [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]
        assert len(temps) == 1
        assert temps[0].startswith(f".tmp-shared.npz-host-a-{pids['host-a']}-")
        b = threading.Thread(target=run, args=("host-b", 10), name="host-b")
        b.fail = 3
        b.start()
        b.join(120)
        assert temps[0] in os.listdir(tmp_path)   # host-b's saves left it alone
    finally:
        resume.set()
        a.join(120)
    threads = [threading.Thread(target=run, args=(h, 25), name=h) for h in ("host-a", "host-b")]
    for t in threads:
        t.fail = 4
        t.start()
    for t in threads:
        t.join(300)
    assert not failures, failures
    assert sorted(os.listdir(tmp_path)) == ["host-a.npz", "host-b.npz", "shared.npz"]
    assert len(removed) == 3 + 4 + 4          # each failed save removed its own file only
    assert all(name.startswith(".tmp-") and f"-{host}-{pids[host]}-" in name
               for host, name in removed)
    monkeypatch.undo()
    w = pytensor.shared(np.zeros(3), name="w")
    for target in ("host-a", "host-b", "shared"):
        metadata = load_state(tmp_path / f"{target}.npz", [w])
        assert w.get_value().tolist() == [float(metadata["i"])] * 3
        assert metadata["host"] == target or target == "shared"


_KILLED_MID_WRITE = """
import socket, sys, time
import numpy as np, pytensor
import lasagne_accum as la

socket.gethostname = lambda: "node-7"

def half_then_hang(fh, array, **kwargs):
    np.lib.format.write_array_header_1_0(
        fh, np.lib.format.header_data_from_array_1_0(array))
    fh.write(array.tobytes()[: array.nbytes // 2])
    print("mid-write", flush=True)
    time.sleep(600)

np.lib.format.write_array = half_then_hang
w = pytensor.shared(np.ones(1 << 20), name="w")
la.save_state(sys.argv[1], [w])
"""


def test_a_writer_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    """SIGKILL mid-save: the previous checkpoint loads as it was saved; the killed
    writer's temporary file stays (named with host and pid) and later saves leave it."""
    import signal
    import subprocess
    import sys

    w = pytensor.shared(np.arange(1 << 20, dtype="float64"), name="w")
    path = tmp_path / "c.npz"
    save_state(path, [w], metadata={"epoch": 1})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = subprocess.Popen([sys.executable, "-c", _KILLED_MID_WRITE, str(path)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=root))
    try:
        line = child.stdout.readline()
        assert line.strip() == "mid-write", child.stderr.read()[-2000:]
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL
    left = [f for f in os.listdir(tmp_path) if f != "c.npz"]
    assert len(left) == 1 and left[0].startswith(f".tmp-c.npz-node-7-{child.pid}-")
    w.set_value(np.zeros(1 << 20))
    assert load_state(path, [w]) == {"epoch": 1}
    np.testing.assert_array_equal(w.get_value(), np.arange(1 << 20, dtype="float64"))
    w.set_value(np.full(1 << 20, 2.0))
    save_state(path, [w])                     # a later save works and leaves the leftover
    assert sorted(os.listdir(tmp_path)) == sorted(["c.npz", *left])
    w.set_value(np.zeros(1 << 20))
    load_state(path, [w])
    assert (w.get_value() == 2.0).all()


# A checkpoint written by the previous writer (0.2.0's successor, before np.savez wrote
# the archive), zlib-compressed and base64-encoded: W (float32, 2x3), adam.t (int64
# scalar), "file" (a member np.savez cannot name), "nul\x00in" (an escaped member), a
# PCG64 generator, metadata and the library's counters.
_OLD_WRITER_FILE = (
    "eNq9Vb+PEkEUHg64u1BcLCw016ybeKjZI7uzsOwSkztjosVFpTFEETdzMPxIYCG7yyWGIyFUlCQ2lHa2tsZEbfQv"
    "0NrK4hprO30PZuWWXAgR48AwM2/mG963771v80fR2D6ZtWvkyttv33+JtksuE9tuMo/VHG6zcrnbsj2f+dy2U07n"
    "RYRcIk8jM2Awvnz4+EH+SYSckF6ywr2ym8xJydOullSkZLXt+i5z7LZb4Wi/x5oeB7tXZx0O6xtUM5WbitSX/rol"
    "ejL8S4v5ck6iiiQ7rMU9mBeLckGGdQH9lkuKVJRZhbVSPhpns/lOtdHkaMdxbnW6zWddFVrDwU3bBnbgd0WfH3Gd"
    "Gm7BMLOBUW5xH+73GTjRk3mnXa4L1zzOHfRMUySaypT6YAo96SnA83kH/bf6/XwoTI/OyK0gTHEIUyEIyEQcCcYL"
    "A3K7ml4tIIqkrxmQmReDA/g5hC/0AfRXh2E6zz98TQV0EkBnHhLkNBLnRks5NcyVOK3HZ8opLvwIc3gz+XQn4LAN"
    "HIL0QQZjcWq8PCrmilFZl4OIys8D4c7HMJMfV9+VAiY7Uw04n+vIZyjODpfxOT3W/hefyEIs3ptnXwIGW8BAlCS6"
    "vieUau9fKJZmGOsr1nHDt2vc4S7z2y4Uu5y/e99Io5JMxVYIwWxmamnV0NWspVKa1nU1o9GMSnWdWqZJTc3KGFk1"
    "C5IiN5wyCo2habphmGlDp9QwYdOkGSutmhm4w9AtA3azlo7iU2ee3W04vk4Bp4IBF7zG0SMV1CeysR8NvyZQ87Hv"
    "knkbTJ/qkpfG4kUoZBOhV/HQRa/hqsJFEBSLkZCDRAhyskHOScciDgt0LIpwO4TLRcmfcl1EYTEMRarvhFCxGFko"
    "jUUspiHmGfatEPYzYEVS5o/im2jchE8RDl6frn4DGt+2rw=="
)


def test_a_checkpoint_of_the_previous_writer_still_loads(tmp_path):
    import base64
    import zlib

    path = tmp_path / "old.npz"
    path.write_bytes(zlib.decompress(base64.b64decode(_OLD_WRITER_FILE)))
    with zipfile.ZipFile(path) as zf:
        assert "file.npy" in zf.namelist()    # the old writer's member; the manifest says so
    variables = [pytensor.shared(np.zeros((2, 3), "float32"), name="W"),
                 pytensor.shared(np.int64(0), name="adam.t"),
                 pytensor.shared(np.zeros(2), name="file"),
                 pytensor.shared(np.zeros(2, bool), name="nul\x00in"),
                 pytensor.shared(np.random.default_rng(0), name="rng")]
    for again in (False, True):               # as written then, and saved again now
        metadata, library, names = la.checkpoint.read_state(path, [variables])
        W, t, file, nul, rng = (v.get_value() for v in variables)
        assert metadata == {"epoch": 2, "seen": [1, 2.5]} and library == {"steps": 9}
        assert names == ["W", "adam.t", "file", "nul\x00in", "rng"]
        assert W.dtype == np.float32 and W.tolist() == [[0, 1, 2], [3, 4, 5]]
        assert t.dtype == np.int64 and int(t) == 5
        assert file.tolist() == [1.5, -2.0] and nul.tolist() == [True, False]
        assert rng.random() == 0.22520718999059186
        if not again:
            rng.bit_generator.state = np.random.default_rng(7).bit_generator.state
            rng.random(3)
            la.checkpoint.write_state(path, [variables], {"epoch": 2, "seen": [1, 2.5]},
                                      {"steps": 9})
            for v in variables[:4]:
                v.set_value(np.zeros_like(v.get_value()))


def _replace_member(path, member, data):
    members = _saved_members(path)
    members[member] = data
    _write_raw(path, members)


def _npy(value):
    import io
    buf = io.BytesIO()
    np.lib.format.write_array(buf, value, allow_pickle=True)
    return buf.getvalue()


def _manifest(**manifest):
    import json
    return _npy(np.frombuffer(json.dumps(manifest).encode(), np.uint8))


@pytest.mark.parametrize("member, data, match", [
    ("w.npy", _npy(np.array([object(), 1], dtype=object)), r"w: holds Python objects \(pickle\)"),
    ("w.npy", b"\x93NUMPY\x09\x00" + b"\0" * 40, "unsupported .npy version 9.0"),
    ("w.npy", b"\x93NUMPY\x01\x00\x40\x00{'descr': '<f8'," + b" " * 40,
     "not a readable checkpoint"),
    ("__lasagne_accum_state__.npy", _npy(np.array([1, None], dtype=object)), "bad format marker"),
    ("__lasagne_accum_state__.npy", _npy(np.zeros(3)), "bad format marker"),
    ("__lasagne_accum_state__.npy", _npy(np.frombuffer(b"{not json", np.uint8)), "bad manifest"),
    ("__lasagne_accum_state__.npy", _npy(np.frombuffer(b"[2]", np.uint8)), "bad manifest"),
    ("__lasagne_accum_state__.npy", _manifest(format=2, names=[["w", "w.npy"]], metadata=[1]),
     r"bad manifest \(metadata\)"),
    ("__lasagne_accum_state__.npy", _manifest(format=2, names={"w": "w.npy"}),
     r"bad manifest \(names\)"),
    ("__lasagne_accum_state__.npy", _manifest(format=2, names=[["w", "w.npy"], ["w", "w.npy"]]),
     "'w' appears twice"),
    ("__lasagne_accum_state__.npy", _manifest(format=2, names=[["w", "x.npy"]]),
     "member 'x.npy' of 'w' is missing"),
    ("__lasagne_accum_state__.npy",
     _manifest(format=2, names=[["w", "__lasagne_accum_state__.npy"]]), "of 'w' is missing"),
])
def test_hostile_files_are_refused_and_load_nothing(tmp_path, member, data, match):
    w = pytensor.shared(np.arange(3.0), name="w")
    path = tmp_path / "c.npz"
    save_state(path, [w])
    _replace_member(path, member, data)
    w.set_value(np.full(3, 7.0))
    with pytest.raises(ValueError, match=match):
        load_state(path, [w])
    assert w.get_value().tolist() == [7.0] * 3


def test_an_entry_of_free_shape_beyond_max_bytes_is_refused_before_reading(tmp_path):
    path = tmp_path / "c.npz"
    la.checkpoint.save_arrays(path, {"gen": np.zeros(5000, np.uint8)})
    with pytest.raises(ValueError, match="gen: 5000 bytes in the checkpoint, more than the 4096"):
        la.checkpoint.read_arrays(path, {"gen": (None, np.uint8)}, max_bytes=4096)
    assert la.checkpoint.read_arrays(path, {"gen": (None, np.uint8)})["gen"].shape == (5000,)


def test_duplicate_and_missing_names_warn_at_save_and_refuse_at_load(tmp_path):
    a = pytensor.shared(np.zeros(2), name="t")
    b = pytensor.shared(np.ones(2), name="t")
    c = pytensor.shared(np.full(2, 2.0))
    path = tmp_path / "c.npz"
    with pytest.warns(UserWarning, match=r"3 variable\(s\) have no unique name.*t, t#2, var2"):
        save_state(path, [a, b, c])
    before = [v.get_value().copy() for v in (a, b, c)]
    for v in (a, b, c):
        v.set_value(np.full(2, 9.0))
    with pytest.raises(ValueError, match="t, t#2, var2 have no unique name"):
        load_state(path, [b, a, c])                   # swapped order: a guess would be wrong
    for v in (a, b, c):
        assert v.get_value().tolist() == [9.0, 9.0]
    assert before[0].tolist() == [0.0, 0.0]


def test_unique_names_save_without_warning(tmp_path, recwarn):
    a = pytensor.shared(np.zeros(2), name="a")
    save_state(tmp_path / "c.npz", [a])
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


# ------------------------------------------------------------------ metadata

_SAVE_IN_ANOTHER_PROCESS = """
import sys
import numpy as np, pytensor
import lasagne_accum as la
w = pytensor.shared(np.arange(3.0), name="w")
rng = np.random.default_rng(11)
rng.random(5)
la.save_state(sys.argv[1], la.sgd((w ** 2).sum(), [w], 0.1),
              metadata={"epoch": 4, "seen": [1, 2.5, None, True], "rng": rng.bit_generator.state,
                        "nested": {"a": {"b": "c"}}})
print(repr(rng.random()))
"""


def test_metadata_survives_a_new_process(tmp_path):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = tmp_path / "m.npz"
    done = subprocess.run([sys.executable, "-c", _SAVE_IN_ANOTHER_PROCESS, str(path)],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=root))
    assert done.returncode == 0, done.stderr[-2000:]
    w = pytensor.shared(np.zeros(3), name="w")
    meta = load_state(path, [w])
    assert w.get_value().tolist() == [0.0, 1.0, 2.0]
    assert meta["epoch"] == 4 and meta["seen"] == [1, 2.5, None, True]
    assert meta["nested"] == {"a": {"b": "c"}}
    rng = np.random.default_rng(0)
    rng.bit_generator.state = meta["rng"]
    assert repr(rng.random()) == done.stdout.strip()   # the stream resumes exactly


def _cycle():
    loop = {"a": []}
    loop["a"].append(loop)
    return loop


@pytest.mark.parametrize("metadata, error, match", [
    ([1, 2], TypeError, "metadata must be a dict"),
    ({1: "a"}, TypeError, r"key 1 is not a string"),
    ({"x": np.float32(1.0)}, TypeError, r"metadata\['x'\] is of type float32.*float\(\)"),
    ({"x": [1, {"y": object()}]}, TypeError, r"metadata\['x'\]\[1\]\['y'\] is of type object"),
    ({"x": float("nan")}, ValueError, "JSON cannot hold"),
    ({"x": "y" * (1 << 20)}, ValueError, "more than the 1048576"),
    (_cycle(), ValueError, "contains itself"),
])
def test_bad_metadata_is_refused_and_nothing_written(tmp_path, metadata, error, match):
    w = pytensor.shared(np.zeros(2), name="w")
    with pytest.raises(error, match=match):
        save_state(tmp_path / "m.npz", [w], metadata=metadata)
    assert not (tmp_path / "m.npz").exists()
