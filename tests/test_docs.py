"""The user guide's promises beyond its doctests (which pytest runs from docs/*.rst).

The site builds with warnings as errors; the API reference lists every public name;
every guide page is in the table of contents and every example on the examples page;
the performance page is what its generator renders from the stored runs, with no
machine's paths and no verdict against a target.
"""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
#: Pages that are not guide pages: the table of contents, the generated API page.
NOT_GUIDE = {"index.rst", "api.rst"}


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def guide_pages():
    return sorted(p.stem for p in DOCS.glob("*.rst") if p.name not in NOT_GUIDE)


def test_every_page_is_in_the_table_of_contents():
    index = (DOCS / "index.rst").read_text()
    listed = set(re.findall(r"^   ([\w-]+)$", index, re.M))
    assert set(guide_pages()) <= listed
    assert "api" in listed


def test_the_api_reference_groups_every_public_name():
    conf = load(DOCS / "conf.py", "docs_conf")
    groups, missing = conf.api_groups()
    assert missing == []
    titles = [title for title, _, _ in groups]
    for title in ("Update rules", "Accumulation", "Averaging", "Checkpoints", "Training",
                  "Distributed", "Modes and memory"):
        assert title in titles
    names = {f"{mod}.{n}" for _, _, blocks in groups for mod, ns in blocks for n in ns}
    assert {"lasagne_accum.accumulate.AccumulateUpdates", "lasagne_accum.memory.MB",
            "lasagne_accum.modes.blas_available"} <= names


def test_the_examples_page_names_every_example():
    page = (DOCS / "examples.rst").read_text()
    scripts = sorted(p.name for p in (ROOT / "examples").glob("*.py") if p.name != "models.py")
    assert len(scripts) == 14
    for script in scripts:
        assert f"``{script}``" in page, script


def test_the_performance_page_is_rendered_from_its_store(tmp_path, monkeypatch):
    page_py = load(ROOT / "benchmarks" / "performance_page.py", "performance_page")
    store = json.loads((DOCS / "_static" / "performance.json").read_text())
    # a topic, and the same topic on another PyTensor release ("inplace:3.3")
    assert {key.split(":")[0] for key in store} == set(page_py.TOPICS)
    monkeypatch.setattr(page_py, "PAGE", str(tmp_path / "performance.rst"))
    page_py.render(store)
    rendered = (tmp_path / "performance.rst").read_text()
    assert rendered == (DOCS / "performance.rst").read_text()
    # no machine's files, no verdict against a target the project does not hold
    assert page_py.scrub(rendered) == rendered
    assert re.search(r"(?<![\w.~/-])/(tmp|root|home|usr)/", rendered) is None
    # a verdict only against a target the issues hold: the accumulate step against a
    # forward-backward call, and a non-stepping single-function call against it
    held = ("accumulate / fwd-bwd <= 1.0", "non-step / acc <= 1.05",
            "window with noise_scale / without <= 1.05")
    assert all(any(t in line for t in held) for line in rendered.splitlines() if "MISS" in line)
    assert page_py.scrub("-Wl,-rpath,/opt/py/lib; log /tmp/x-1.log; 1/5/15 min; 2 / 1") == (
        "-Wl,-rpath,<path>; log <path>; 1/5/15 min; 2 / 1")


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    """What ``bash scripts/build-docs.sh`` (and CI) run, into a temporary directory."""
    pytest.importorskip("sphinx", reason="the docs extra (sphinx, numpydoc) is not installed")
    pytest.importorskip("numpydoc", reason="the docs extra (sphinx, numpydoc) is not installed")
    done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b",
                           "html", "-d", str(tmp_path / "doctrees"), str(DOCS),
                           str(tmp_path / "html")], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    html = tmp_path / "html"
    for page in guide_pages() + ["api"]:
        assert (html / f"{page}.html").exists(), page
    api = (html / "api.html").read_text()
    assert "AccumulateUpdates" in api and "blas_available" in api
