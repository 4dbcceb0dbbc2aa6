#!/usr/bin/env python
"""Write docs/performance.rst from the benchmark scripts' own output.

Each topic of the page is one benchmark script run with its usual arguments;
its output is kept as printed (a ratio table measured side by side in one run,
with the load average), dated, with the commit, the machine and the exact
command that reproduces it. The runs are kept in
``docs/_static/performance.json`` so that one topic can be measured again
without the others (``--only``); the page is rewritten from that file every
time. Nothing on the page is typed by hand: the summary table that opens it is read back
from the stored outputs (each topic's headline ratios and the target its script states),
and its figures (``docs/_static/performance-*.png``, drawn with matplotlib when it is
installed) are drawn from the same store.

    python benchmarks/performance_page.py                  # every topic (about an hour)
    python benchmarks/performance_page.py --only cold_start single_function
    python benchmarks/performance_page.py --render         # rewrite the page and figures
"""

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STORE = os.path.join(ROOT, "docs", "_static", "performance.json")
PAGE = os.path.join(ROOT, "docs", "performance.rst")
OUTPUTS = ("docs/performance.rst", "docs/_static/performance.json")

#: topic -> (title, what it answers, the command, relative to the repository)
TOPICS = {
    "cold_start": (
        "Cold start",
        "How long the demo takes on an empty compile cache, with the compile-speed tool "
        "(``tools/fastcompile.py``: precompiled headers, parallel compiles) and without.",
        ["benchmarks/cold_start.py"]),
    "single_function": (
        "The single-function form and its fast paths",
        "What a call of ``average=N`` costs against the two-function form's accumulate step, "
        "and what each fast path of ``lasagne_accum.mode()`` saves (``ifelse``: without the "
        "lazy step; ``select``: without the reset folded into ``Gemm``; ``switch``: "
        "``lazy=False``).",
        ["benchmarks/single_function.py", "--modes", "CVM", "NUMBA", "--processes", "3"]),
    "inplace": (
        "The accumulate step against a forward-backward call",
        "Whether the accumulate step adds the gradient into its buffer in place, at no more "
        "than the cost of computing the gradient.",
        ["benchmarks/inplace.py"]),
    "noise": (
        "The noise scale's cost",
        "What ``compile_accumulation(noise_scale=True)`` adds to a window (one squared-norm "
        "reduction per micro-batch, the estimates at each apply), in C and Numba.",
        ["benchmarks/noise.py"]),
    "batch_norm": (
        "Batch normalisation",
        "A window with the exact large batch's statistics (``batch_norm=\"exact\"``, 2 L + 1 "
        "passes) against ghost batches, one and two batch-norm layers.",
        ["benchmarks/batch_norm.py"]),
    "backends": (
        "Backends",
        "Milliseconds per call of the forward-backward, accumulate and apply steps on each "
        "installed backend (the reason for ``default_modes()``).",
        ["benchmarks/backends.py", "--threads", "1"]),
    "accumulation": (
        "Accumulation's memory",
        "What one accumulate call allocates, and the peak memory of an effective batch of "
        "N x 64 examples by accumulation against the real batch, for N up to 16 (the "
        "steps' speed is in the other topics: the accumulate step above, the apply step "
        "under Backends, a whole window under Against PyTorch and optax).",
        ["benchmarks/accumulation.py", "--memory-only"]),
    "peers": (
        "Against PyTorch and optax",
        "The same accumulation in PyTorch (a hand-written loop) and optax (``MultiSteps``).",
        ["benchmarks/peers.py"]),
    "distributed": (
        "The parameter server",
        "The parameter server beside torch.distributed, and where a push's time goes.",
        ["benchmarks/distributed.py"]),
    "gpu": (
        "Large batches on a device",
        "Time per window and peak device memory at an effective batch of 4096, beside "
        "optax's MultiSteps and a PyTorch loop.",
        ["benchmarks/gpu.py"]),
}


#: An absolute path of two or more parts (an install's library directory in BLAS flags,
#: a temporary log): it names the measuring machine's files, not something a reader has.
_PATH = re.compile(r"(?<![\w.~/-])/(?:[\w.+~-]+/)+[\w.+~-]*")


def scrub(text):
    """`text` without the measuring machine's absolute paths (each becomes ``<path>``)."""
    return _PATH.sub("<path>", text)


def _git(*args):
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine(python=sys.executable):
    """One line naming the machine the benchmark ran on, and `python`'s version."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        if names:
            cpu = names[0]
    except OSError:
        pass
    version = platform.python_version() if python == sys.executable else subprocess.run(
        [python, "-c", "import platform; print(platform.python_version())"],
        capture_output=True, text=True, check=True).stdout.strip()
    return (f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
            f"Python {version}")


def pytensor_release(python):
    """``"3.3"``: the PyTensor release (major.minor) that `python` imports."""
    done = subprocess.run([python, "-c", "import pytensor; print(pytensor.__version__)"],
                          capture_output=True, text=True, check=True)
    return ".".join(done.stdout.strip().split(".")[:2])


def store_key(topic, python):
    """Where a run is stored: the topic, and ``topic:3.3`` for another PyTensor release
    than this interpreter's (``--python``), so that both releases' tables stay."""
    if python == sys.executable:
        return topic
    return f"{topic}:{pytensor_release(python)}"


def blas_line(python=sys.executable):
    """One line: the BLAS library and kernel of PyTensor's C backend, NumPy and SciPy (Numba's
    products) in `python`'s environment (``lasagne_accum.machine.blas_summary``)."""
    done = subprocess.run([python, "-c", "from lasagne_accum.machine import blas_summary; "
                           "print(blas_summary())"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        return "BLAS not reported (lasagne_accum.machine.blas_summary failed)"
    return "BLAS: " + done.stdout.strip()


def run(topic, python=sys.executable):
    """Run one topic's benchmark; its record for the store, or None if it failed."""
    _, _, command = TOPICS[topic]
    if not os.path.exists(os.path.join(ROOT, command[0])):
        print(f"{topic}: {command[0]} does not exist; its section says not measured",
              file=sys.stderr)
        return None
    print(f"running {' '.join(command)} ...", flush=True)
    done = subprocess.run([python, *command], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        print(f"{topic}: exit {done.returncode}; its section keeps its last run\n"
              f"{done.stderr[-3000:]}", file=sys.stderr)
        return None
    # changes to tracked files other than this page and its store, which it writes itself
    dirty = any(line.split(maxsplit=1)[-1] not in OUTPUTS for line in
                _git("status", "--porcelain", "--untracked-files=no").splitlines())
    return {"date": datetime.date.today().isoformat(), "commit": _git("rev-parse", "--short",
                                                                        "HEAD"),
            "dirty": dirty, "machine": machine(python), "command": "python " + " ".join(command),
            "blas": scrub(blas_line(python)), "output": scrub(done.stdout.rstrip("\n"))}



# --- The summary at the top of the page --------------------------------------------------
# Each topic's headline ratios, read back from its stored output by the regular expressions
# below (nothing typed by hand): a row says what we measure, against what, the ratio for
# each configuration the script printed, and the target where the script states one.

#: The figures drawn from the store (``figures``), in ``docs/_static``; the page names them.
STATIC = os.path.join(ROOT, "docs", "_static")
RATIO_FIGURE = "performance-ratios.png"
SERVER_FIGURE = "performance-parameter-server.png"


class Row:
    """One row of the summary: `values` is ``[(label, number as printed)]``, `ratio` the
    ratio's short name (the figure's labels), `target` the stated target or None."""

    def __init__(self, measure, against, ratio, values, target=None, higher_is_better=False):
        self.measure, self.against, self.ratio = measure, against, ratio
        self.values, self.target, self.higher_is_better = values, target, higher_is_better

    def target_value(self):
        """The target's bound as a number (``"<= 1.05"`` -> 1.05), or None."""
        found = re.fullmatch(r"<= ([\d.]+)", self.target or "")
        return float(found.group(1)) if found else None


def _stated(pattern, output):
    """The first group of `pattern`'s first match in `output`, or None."""
    found = re.search(pattern, output, re.M)
    return found.group(1) if found else None


def _one_target(targets):
    """The target all of a row's configurations share (``"<= 1.0"``), or None."""
    targets = set(targets)
    return targets.pop() if len(targets) == 1 else None


def _cold_start(out):
    ratio = _stated(r"fastcompile / plain ([\d.]+)$", out)
    return [Row("The demo's wall time on an empty compile cache, with ``tools/fastcompile.py``",
                "the same without it", "fastcompile / plain", [("", ratio)] if ratio else [])]


def _single_function(out):
    # the default graph ("lazy"): its non-stepping call over the two-function accumulate step
    values = re.findall(r"^(\w+)\s+[\d.]+\s+[\d.]+\s+lazy\s+[\d.]+\s+[\d.]+\s+([\d.]+) \[",
                        out, re.M)
    return [Row("A non-stepping call of the single-function form (``average=N``, its default "
                "lazy step)", "the two-function form's accumulate step", "non-step / acc",
                values, _stated(r"targets (<= [\d.]+)", out))]


def _summary_lines(name, out):
    """``[(target, configuration, value)]`` of the SUMMARY lines ``PASS|MISS  n <name>
    <= t [configuration]: value``."""
    return re.findall(r"^\s+(?:PASS|MISS)\s+\d+\s+" + re.escape(name) +
                      r" (<= [\d.]+) \[([^\]]+)\]: ([\d.]+)$", out, re.M)


def _inplace(out):
    found = _summary_lines("accumulate / fwd-bwd", out)
    return [Row("The accumulate step (the gradient added into its buffer in place)",
                "a forward-backward call", "accumulate / fwd-bwd",
                [(config, value) for _, config, value in found],
                _one_target(t for t, _, _ in found))]


def _noise(out):
    found = _summary_lines("window with noise_scale / without", out)
    return [Row("A window with ``noise_scale=True``", "the same window without",
                "noise_scale / without", [(config, value) for _, config, value in found],
                _one_target(t for t, _, _ in found))]


def _batch_norm(out):
    values = re.findall(r"^(\d+)\s+\d+\s+[\d.]+\s+[\d.]+\s+([\d.]+)$", out, re.M)
    return [Row("A window with the exact large batch's statistics (``batch_norm=\"exact\"``)",
                "ghost batches", "exact / ghost",
                [(f"{n} layer{'s' * (n != '1')}", value) for n, value in values])]


def _backends(out):
    # no single ratio: a table of milliseconds per step and backend; the accumulate step in
    # float32 against torch's backward-accumulate is the column that compares the backends
    values = re.findall(r"^(\S+)\s+float32\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+"
                        r"([\d.]+)\s+[\d.]+$", out, re.M)
    return [Row("No single ratio: milliseconds per call of the forward-backward, accumulate "
                "and apply steps on each backend and dtype; here the accumulate step, float32",
                "torch's backward into ``.grad``", "accumulate / torch",
                [(backend, value) for backend, value in values if backend != "torch"])]


def _accumulation(out):
    values = re.findall(r"^\s+(\d+)\s+[\d.]+ /\s+[\d.]+ \|.*\| ([\d.]+)$", out, re.M)
    flat = re.search(r"varies by ([\d.]+%) \(claim: (<= [\d.]+%)\)", out)
    return [Row("Peak memory of an effective batch of N x 64 by accumulation",
                "the real batch of N x 64", "accumulation / batch, memory",
                [(f"N={n}", value) for n, value in values],
                f"flat over N, {flat.group(2)} (varies by {flat.group(1)})" if flat else None)]


def _peers(out):
    found = re.findall(r"^\s+(?:PASS|MISS)\s+\d+\s+ours / (.+?), (\d+) thread\(s\)\s+"
                       r"(<= [\d.]+): ([\d.]+)$", out, re.M)
    names = {"torch": "PyTorch (a hand-written loop)", "optax": "optax ``MultiSteps``"}
    rows = []
    for peer in dict.fromkeys(peer for peer, _, _, _ in found):
        mine = [(threads, t, v) for p, threads, t, v in found if p == peer]
        rows.append(Row("A window (N accumulate steps and one Adam step), ours in the default "
                        "modes", names.get(peer, peer), f"ours / {peer}",
                        [(f"{n} thread{'s' * (n != '1')}", v) for n, _, v in mine],
                        _one_target(t for _, t, _ in mine)))
    return rows


def server_trainers(out):
    """The two numbers of trainers of the side-by-side table (``[1, 2]``), or None."""
    found = re.search(r"^\| model \| system \| (\d+) process(?:es)? \| (\d+) processes \|",
                      out, re.M)
    return [int(n) for n in found.groups()] if found else None


def server_table(out):
    """The side-by-side table of ``benchmarks/distributed.py``: ``[(model, system, samples/s
    at 1 process, at 2, vs torch at 2 or "")]`` as printed."""
    return re.findall(r"^\| ([^|]+?) \| ([^|]+?) \| (\d+) \| (\d+) \| [\d.]+x \| "
                      r"(?:([\d.]+)x)? *\| [\d.]+ \|$", out, re.M)


def _distributed(out):
    table, trainers = server_table(out), server_trainers(out)
    most = trainers[-1] if trainers else "N"
    rows = []
    for mode in ("sync", "async"):
        ours = f"ours, Dask {mode}"
        # each of our rows is followed by the torch system it is compared with
        peers = {table[i + 1][1] for i, r in enumerate(table[:-1]) if r[1] == ours}
        rows.append(Row(f"Samples per second of training with {most} trainers, {mode} "
                        "(higher is faster)",
                        ", ".join(sorted(peers)) or "torch.distributed",
                        f"ours {mode} / torch, samples/s",
                        [(model, vs) for model, system, _, _, vs in table
                         if system == ours and vs], higher_is_better=True))
    return rows


def _gpu(out):
    batch = _stated(r"^effective batch (\d+)", out)
    where = (" (on the CPU: no GPU measured yet)" if re.search(r"^no GPU here", out, re.M)
             else "")
    found = re.findall(r"^(\w+): (.*)$", out, re.M)
    pairs = {}
    for model, rest in found:
        for ours, peer, value in re.findall(r"(\S+) / (\S+): time ([\d.]+)x", rest):
            pairs.setdefault((ours, peer), []).append((model, value))
    names = {"la-jax": "ours through JAX", "la-torch": "ours through PyTorch",
             "optax": "optax ``MultiSteps``", "torch-loop": "a PyTorch loop"}
    return [Row(f"Time per window at an effective batch of {batch}, "
                f"{names.get(ours, ours)}{where}", names.get(peer, peer),
                f"{ours} / {peer}, time", values)
            for (ours, peer), values in pairs.items()]


def _unsummarised(out):
    return [Row("Nothing read from this topic's output (a format the summary does not know)",
                "see the section", "", [])]


#: topic -> its rows of the summary, from its stored output
SUMMARY = {"cold_start": _cold_start, "single_function": _single_function, "inplace": _inplace,
           "noise": _noise, "batch_norm": _batch_norm, "backends": _backends,
           "accumulation": _accumulation, "peers": _peers, "distributed": _distributed,
           "gpu": _gpu}


def records(store, topic):
    """``[(key, record)]``: `topic`'s runs in the store, this release's first (``inplace``,
    then ``inplace:3.3``)."""
    return [(key, store[key]) for key in sorted(store)
            if key == topic or key.startswith(topic + ":")]


def summary(store):
    """``[(topic, key, Row)]``: every stored run's rows of the summary, in the page's order."""
    rows = []
    for topic in TOPICS:
        for key, record in records(store, topic):
            output = scrub(record["output"])
            rows += [(topic, key, row) for row in
                     SUMMARY.get(topic, _unsummarised)(output) or _unsummarised(output)]
    return rows


def ratio_cell(row):
    """The ratio column: each configuration's value as printed (``"CVM 1.181; NUMBA 1.168"``)."""
    if not row.values:
        return "not found in the stored output: see the section"
    return "; ".join(f"{label} {value}".strip() for label, value in row.values)


def summary_lines(store):
    """The summary table (a list-table) and the figures' directives, as lines of the page."""
    rows = summary(store)
    if not rows:
        return []
    lines = ["Each row is read from a topic's stored output below (its link leads there): "
             "a ratio is ours over the reference, measured side by side in one run, lower is "
             "cheaper unless the row says otherwise; the target is the one the benchmark "
             "script states, if any.", "",
             ".. list-table::", "   :header-rows: 1", "   :widths: 16 30 18 26 10", ""]
    for cells in [("Topic", "What we measure", "Against", "Ratio", "Target")] + [
            (f"`{TOPICS[topic][0]}`_" + (f" (PyTensor {key.split(':', 1)[1]})"
                                         if ":" in key else ""),
             row.measure, row.against, ratio_cell(row),
             (row.target or "none stated").replace("<=", "≤"))
            for topic, key, row in rows]:
        lines += [f"   * - {cells[0]}"] + [f"     - {cell}" for cell in cells[1:]]
    lines += [""]
    if any(row.values and not row.higher_is_better for _, _, row in rows):
        lines += [f".. figure:: _static/{RATIO_FIGURE}",
                  "   :alt: Each ratio of the table against its target", "",
                  "   Each ratio of the table where lower is cheaper, one bar per configuration "
                  "(log scale); a black mark is the stated target, a bar in red is above it.",
                  ""]
    server = scrub(store.get("distributed", {}).get("output", ""))
    if server_table(server) and server_trainers(server):
        lines += [f".. figure:: _static/{SERVER_FIGURE}",
                  "   :alt: The parameter server's samples per second against torch.distributed",
                  "", "   The parameter server's samples per second of training against "
                  "torch.distributed's, by number of trainers, for each model of "
                  "`The parameter server`_.", ""]
    return lines


def figures(store, directory=STATIC):
    """Draw the summary's figures from the store into `directory` (matplotlib, Agg); the
    paths written. Needs matplotlib (the ``examples`` extra); the page's text does not."""
    # (label, ratio, target, the summary row's index, the ratio as printed)
    bars = [(f"{row.ratio}, {label}".rstrip(", ") + (f" (PyTensor {key.split(':', 1)[1]})"
                                                     if ":" in key else ""),
             float(value), row.target_value(), n, value)
            for n, (topic, key, row) in enumerate(summary(store)) if not row.higher_is_better
            for label, value in row.values]
    server = scrub(store.get("distributed", {}).get("output", ""))
    table, trainers = server_table(server), server_trainers(server)
    if not bars and not (table and trainers):
        return []
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if bars:
        from matplotlib.patches import Patch
        from matplotlib.ticker import FixedLocator, NullLocator

        fig, ax = plt.subplots(figsize=(9, 0.26 * len(bars) + 1.6))
        y = list(range(len(bars)))[::-1]
        colours = {"above": "#c0392b", "within": "#2e8b57", "none": "#b0b0b0"}
        kind = ["none" if t is None else "above" if v > t else "within"
                for _, v, t, _, _ in bars]
        ax.barh(y, [v for _, v, _, _, _ in bars], color=[colours[k] for k in kind], height=0.7)
        for yi, (_, v, t, _, text) in zip(y, bars):
            ax.text(max(v, t or 0) * 1.025, yi, text, va="center", fontsize=7)
            if t is not None:
                ax.plot([t, t], [yi - 0.42, yi + 0.42], color="black", lw=1.5)
        # a faint line between the summary's rows
        for yi, (_, _, _, n, _), (_, _, _, m, _) in zip(y, bars, bars[1:]):
            if n != m:
                ax.axhline(yi - 0.5, color="#dddddd", lw=0.6)
        ax.axvline(1.0, color="#555555", lw=0.8, ls=":")
        ax.set_xscale("log")
        low = min(v for _, v, _, _, _ in bars)
        high = max(max(v, t or 0) for _, v, t, _, _ in bars)
        ticks = [t for t in (0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20)
                 if low / 1.5 <= t <= high * 1.5]
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([f"{t:g}" for t in ticks])
        ax.set_xlim(low / 1.15, high * 1.3)
        ax.set_yticks(y)
        ax.set_yticklabels([label for label, *_ in bars], fontsize=7)
        ax.set_ylim(-0.7, len(bars) - 0.3)
        ax.set_xlabel("ours / reference (log scale; lower is cheaper; dotted: parity)")
        ax.set_title("The summary's ratios and their targets", fontsize=10)
        ax.legend([Patch(color=colours[k]) for k in ("within", "above", "none")],
                  ["within the stated target (black mark)", "above it", "no target stated"],
                  loc="lower right", fontsize=7)
        fig.tight_layout()
        written.append(_save(fig, os.path.join(directory, RATIO_FIGURE)))
        plt.close(fig)
    if table and trainers:
        models = list(dict.fromkeys(model for model, *_ in table))
        fig, axes = plt.subplots(1, len(models), figsize=(3.2 * len(models), 3.4), squeeze=False)
        styles = {}
        for ax, model in zip(axes[0], models):
            for _, system, one, two, _ in (r for r in table if r[0] == model):
                ours = system.startswith("ours")
                style = styles.setdefault(system, dict(
                    color=f"C{len(styles) // 2}", ls="-" if ours else "--",
                    marker="o" if ours else "s"))
                ax.plot(trainers, [int(one), int(two)], label=system, **style)
            ax.set_title(model, fontsize=10)
            ax.set_xticks(trainers)
            ax.set_xlabel("trainers")
            ax.set_ylim(bottom=0)
        axes[0][0].set_ylabel("samples per second")
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8,
                   frameon=False)
        fig.tight_layout(rect=(0, 0.08, 1, 1))
        written.append(_save(fig, os.path.join(directory, SERVER_FIGURE)))
        plt.close(fig)
    return written


def _save(fig, path):
    # no matplotlib version in the file: the same store draws the same bytes
    fig.savefig(path, dpi=100, metadata={"Software": None})
    return path


def render(store):
    """Write the page from `store` (its text only: ``figures`` draws the images)."""
    lines = ["Performance", "===========", ""] + summary_lines(store) + [
             "Every table on this page is a benchmark script's own output, kept as it "
             "printed, with the date, the commit and the machine it ran on and the command "
             "that reproduces it (``python benchmarks/performance_page.py`` rewrote this page "
             "from ``docs/_static/performance.json``). The scripts measure ratios side by "
             "side in one run, interleaved, and print the load average: on a shared machine "
             "compare the ratios, not the absolute times.", ""]
    for topic, (title, what, _) in TOPICS.items():
        lines += [title, "-" * len(title), "", what, ""]
        runs = records(store, topic)
        if not runs:
            lines += ["Not measured yet.", ""]
            continue
        for key, record in runs:
            commit = record["commit"] + (" with local changes" if record.get("dirty") else "")
            release = (f" with PyTensor {key.split(':', 1)[1]}" if ":" in key else "")
            lines += [f"Measured on {record['date']} at commit ``{commit}`` on "
                      f"{record['machine']}{release}; reproduce with ``{record['command']}``.",
                      "", f"``{record['blas']}``" if record.get("blas") else
                      "BLAS and kernel not recorded (measured before the page recorded them).",
                      "", "::", ""]
            lines += ["    " + ln if ln.strip() else ""
                      for ln in scrub(record["output"]).splitlines()]
            lines += [""]
    text = "\n".join(lines)
    with open(PAGE, "w") as f:
        f.write(text)
    return PAGE


def publish(store):
    """Write the page and draw its figures from `store`."""
    print(f"wrote {render(store)}")
    try:
        drawn = figures(store)
    except ImportError:
        print("matplotlib is not installed (the examples extra): the figures in "
              "docs/_static were not redrawn", file=sys.stderr)
        return
    for path in drawn:
        print(f"wrote {os.path.relpath(path, ROOT)}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", choices=list(TOPICS), default=None,
                   help="measure these topics again, keep the others")
    p.add_argument("--render", action="store_true",
                   help="only rewrite the page and its figures from the stored runs "
                        "(measures nothing)")
    p.add_argument("--python", default=sys.executable,
                   help="the interpreter that runs the benchmarks (another one, with another "
                        "PyTensor release, adds that release's tables beside this one's)")
    args = p.parse_args(argv)
    store = {}
    if os.path.exists(STORE):
        with open(STORE) as f:
            store = json.load(f)
    store = {topic: dict(record, output=scrub(record["output"]))
             for topic, record in store.items()}
    if not args.render:
        failed = []
        for topic in args.only or list(TOPICS):
            record = run(topic, args.python)
            if record is None:
                failed.append(topic)
                continue
            store[store_key(topic, args.python)] = record
            with open(STORE, "w") as f:
                json.dump(store, f, indent=1, sort_keys=True)
        publish(store)
        if failed:
            raise SystemExit(f"not measured: {', '.join(failed)}")
        return
    with open(STORE, "w") as f:
        json.dump(store, f, indent=1, sort_keys=True)
    publish(store)


if __name__ == "__main__":
    main()
