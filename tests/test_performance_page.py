"""The summary that opens docs/performance.rst is read from the stored runs, not typed.

``benchmarks/performance_page.py`` renders the page from ``docs/_static/performance.json``
(``tests/test_docs.py`` checks the page is that rendering). Here: every stored run has a
row in the summary table, each row links to its section, and each ratio and target in it
equals what the topic's stored output printed, read back by regular expressions written
independently of the script's; the figures the page names exist and are drawn from the
store.
"""

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
STORE = json.loads((DOCS / "_static" / "performance.json").read_text())
PAGE = (DOCS / "performance.rst").read_text()


def load_page_module():
    spec = importlib.util.spec_from_file_location(
        "performance_page", ROOT / "benchmarks" / "performance_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def summary_table(text):
    """The rows (lists of 5 cells) of the list-table that opens the page, header left out."""
    start = text.index(".. list-table::")
    rows = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("   * - "):
            rows.append([line[len("   * - "):]])
        elif line.startswith("     - "):
            rows[-1].append(line[len("     - "):])
        elif line.strip() and not line.startswith("   :") and rows:
            break
    assert rows and rows[0] == ["Topic", "What we measure", "Against", "Ratio", "Target"]
    assert all(len(row) == 5 for row in rows)
    return rows[1:]


def section_titles(text):
    lines = text.splitlines()
    return {a for a, b in zip(lines, lines[1:]) if b and set(b) <= {"-", "="} and
            len(b) == len(a)}


def cell_values(cell):
    """``"CVM 1.030; NUMBA 1.029"`` -> ``{"CVM": "1.030", "NUMBA": "1.029"}``; ``"0.52"`` ->
    ``{"": "0.52"}``."""
    values = {}
    for part in cell.split("; "):
        label, _, value = part.rpartition(" ")
        values[label] = value
    return values


# --- what each topic's output printed, read independently of the script -------------------

def columns(output):
    return [line.split() for line in output.splitlines()]


def expect_cold_start(out):
    (ratio,) = re.findall(r"fastcompile / plain\s+(\S+)\s*$", out, re.M)
    return [({"": ratio}, "none stated")]


def expect_single_function(out):
    # backend acc apply variant non-step step non-step/acc [range] step/(acc+apply) [range]
    values = {c[0]: c[6] for c in columns(out) if len(c) > 6 and c[3] == "lazy"}
    (target,) = re.findall(r"targets <= (\S+?);", out)
    return [(values, f"≤ {target}")]


def expect_inplace(out):
    # mode dtype acc-ms fb-ms grads-ms acc/fb ...
    values = {f"{c[0]} {c[1]}": c[5] for c in columns(out)
              if len(c) > 5 and c[0] in ("NUMBA", "CVM") and c[1].startswith("float")}
    targets = set(re.findall(r"accumulate / fwd-bwd <= (\S+) \[", out))
    assert len(targets) == 1
    return [(values, f"≤ {targets.pop()}")]


def expect_noise(out):
    # mode batch plain-ms noise-ms noise/plain; the target is the batch of 64's
    values = {c[0]: c[4] for c in columns(out)
              if len(c) == 5 and c[0] in ("CVM", "NUMBA") and c[1] == "64"}
    targets = set(re.findall(r"noise_scale / without <= (\S+) \[", out))
    assert len(targets) == 1
    return [(values, f"≤ {targets.pop()}")]


def expect_batch_norm(out):
    # layers passes ghost-ms exact-ms exact/ghost
    values = {f"{c[0]} layer" + ("s" if c[0] != "1" else ""): c[4] for c in columns(out)
              if len(c) == 5 and c[0].isdigit()}
    return [(values, "none stated")]


def expect_backends(out):
    # backend dtype fwd-bwd accum adam acc/fb adam/acc acc/torch adam/torch
    values = {c[0]: c[7] for c in columns(out)
              if len(c) == 9 and c[1] == "float32" and c[0] != "torch"}
    return [(values, "none stated")]


def expect_accumulation(out):
    values = {}
    for line in out.splitlines():
        parts = line.split("|")
        if len(parts) == 4 and parts[0].split() and parts[0].split()[0].isdigit():
            values[f"N={parts[0].split()[0]}"] = parts[3].strip()
    claim = re.search(r"claim: <= (\S+)\)", out).group(1)
    varies = re.search(r"total over N varies by (\S+) ", out).group(1)
    return [(values, f"flat over N, ≤ {claim} (varies by {varies})")]


def expect_peers(out):
    rows = {}
    for line in out.splitlines():
        if line.strip().startswith(("PASS", "MISS")) and "ours / " in line:
            name, value = line.rsplit(":", 1)
            peer_threads, target = name.split("ours / ", 1)[1].split("<=")
            peer, threads = peer_threads.strip().rsplit(", ", 1)
            label = threads.replace(" thread(s)", " thread" + ("" if threads[0] == "1"
                                                                   else "s"))
            values, _ = rows.setdefault(peer, ({}, f"≤ {target.strip()}"))
            values[label] = value.strip()
    return list(rows.values())


def expect_distributed(out):
    found = {"sync": {}, "async": {}}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) == 9 and cells[2].startswith("ours, Dask "):
            found[cells[2].split()[-1]][cells[1]] = cells[6].rstrip("x")
    return [(found["sync"], "none stated"), (found["async"], "none stated")]


def expect_gpu(out):
    jax, torch = {}, {}
    for model, a, b in re.findall(r"^(\w+): la-jax / optax: time (\S+)x, .*"
                                  r"la-torch / torch-loop: time (\S+)x", out, re.M):
        jax[model], torch[model] = a, b
    return [(jax, "none stated"), (torch, "none stated")]


EXPECT = {"cold_start": expect_cold_start, "single_function": expect_single_function,
          "inplace": expect_inplace, "noise": expect_noise, "batch_norm": expect_batch_norm,
          "backends": expect_backends, "accumulation": expect_accumulation,
          "peers": expect_peers, "distributed": expect_distributed, "gpu": expect_gpu}


def topic_cell(title, key):
    return f"`{title}`_" + (f" (PyTensor {key.split(':', 1)[1]})" if ":" in key else "")


def test_every_stored_run_has_its_rows_with_the_ratios_and_targets_it_printed():
    page_py = load_page_module()
    rows = summary_table(PAGE)
    assert set(EXPECT) == set(page_py.TOPICS)
    expected_cells = []
    for topic, (title, _, _) in page_py.TOPICS.items():
        for key in sorted(k for k in STORE if k.split(":")[0] == topic):
            for values, target in EXPECT[topic](STORE[key]["output"]):
                assert values, (key, "the test's own reading found nothing")
                expected_cells.append((topic_cell(title, key), values, target))
    assert [row[0] for row in rows] == [cell for cell, _, _ in expected_cells]
    for row, (cell, values, target) in zip(rows, expected_cells):
        assert cell_values(row[3]) == values, (cell, row[3])
        assert row[4] == target, (cell, row[4])
        assert row[1] and row[2], cell
    # every topic of the store is in the table
    titles = {row[0].split("`")[1] for row in rows}
    assert titles == {page_py.TOPICS[k.split(":")[0]][0] for k in STORE}


def test_the_rows_link_to_sections_of_the_page():
    start = PAGE.index(".. list-table::")
    summary = PAGE[:PAGE.index("\n::\n", start)]
    links = set(re.findall(r"`([^`<]+)`_", summary))
    assert links and links <= section_titles(PAGE)
    for row in summary_table(PAGE):
        assert re.fullmatch(r"`[^`]+`_( \(PyTensor [\d.]+\))?", row[0]), row[0]


def test_the_page_opens_with_the_summary_and_keeps_the_raw_tables():
    title_end = PAGE.index("===========\n") + len("===========\n")
    first_section = min(PAGE.index(f"\n{title}\n{'-' * len(title)}\n")
                        for title in section_titles(PAGE) if title != "Performance")
    assert title_end < PAGE.index(".. list-table::") < first_section
    # each stored run's output is still on the page, verbatim, indented as a literal block
    page_py = load_page_module()
    for key, record in STORE.items():
        block = "\n".join("    " + ln if ln.strip() else ""
                          for ln in page_py.scrub(record["output"]).splitlines())
        assert block in PAGE, key


def test_the_figures_named_on_the_page_exist_and_are_drawn_from_the_store(tmp_path):
    named = re.findall(r"^\.\. (?:figure|image):: (\S+)$", PAGE, re.M)
    assert len(named) == 2
    for path in named:
        assert path.startswith("_static/performance-") and path.endswith(".png")
        assert (DOCS / path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pytest.importorskip("matplotlib", reason="the figures need the examples extra")
    page_py = load_page_module()
    drawn = page_py.figures(STORE, str(tmp_path))
    assert sorted(Path(p).name for p in drawn) == sorted(Path(p).name for p in named)
    again = tmp_path / "again"
    again.mkdir()
    for path in page_py.figures(STORE, str(again)):
        assert Path(path).read_bytes() == (tmp_path / Path(path).name).read_bytes()


def test_an_output_the_summary_cannot_read_says_so(tmp_path, monkeypatch):
    page_py = load_page_module()
    monkeypatch.setattr(page_py, "PAGE", str(tmp_path / "performance.rst"))
    record = {"date": "2026-01-02", "commit": "abc1234", "machine": "m",
              "command": "python benchmarks/x.py", "output": "a new table\n  row 1.5"}
    text = Path(page_py.render({topic: record for topic in page_py.TOPICS})).read_text()
    rows = summary_table(text)
    assert {row[0] for row in rows} == {f"`{t}`_" for t, _, _ in page_py.TOPICS.values()}
    assert all(row[3] == "not found in the stored output: see the section" for row in rows)
    assert "performance-ratios.png" not in text            # nothing to draw
    assert "performance-parameter-server.png" not in text
    assert not page_py.figures({topic: record for topic in page_py.TOPICS}, str(tmp_path))
