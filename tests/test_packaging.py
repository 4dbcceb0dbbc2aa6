"""The release artefacts: ``python -m build`` makes an sdist and a wheel that install and import.

Both are built from this checkout without build isolation (setuptools and
wheel come from the test environment, so no download is needed), then each is
installed with ``pip --no-deps`` into a fresh virtual environment that sees the
test environment's packages (pytensor, numpy...) through a ``.pth`` file, and
imported there from an empty directory: the installed copy is imported, not
this checkout.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import venv
import zipfile

import pytest

import lasagne_accum

pytest.importorskip("build", minversion="1.0")   # not a stray build/ directory
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    # a copy of the checkout: setuptools writes build/ and *.egg-info next to the sources
    src = tmp_path_factory.mktemp("src") / "lasagne_accum"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".venv-*", "build", "dist", "*.egg-info", "__pycache__", "_build", "generated",
        "out", ".hypothesis"))
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel",
                           "--outdir", str(out), str(src)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    files = sorted(os.listdir(out))
    version = lasagne_accum.__version__
    assert files == [f"lasagne_accum-{version}-py3-none-any.whl",
                     f"lasagne_accum-{version}.tar.gz"], files
    return {"wheel": out / files[0], "sdist": out / files[1]}


def test_wheel_contents(dist):
    names = zipfile.ZipFile(dist["wheel"]).namelist()
    assert "lasagne_accum/py.typed" in names
    assert "lasagne_accum/distributed/__init__.py" in names
    assert not [n for n in names if n.startswith(("tests/", "examples/", "benchmarks/"))]
    meta = zipfile.ZipFile(dist["wheel"]).read(
        f"lasagne_accum-{lasagne_accum.__version__}.dist-info/METADATA").decode()
    assert "License: MIT" in meta or "License-Expression: MIT" in meta
    assert "Author: The lasagne_accum maintainers" in meta or "The lasagne_accum maintainers" in meta
    (pytensor_req,) = [ln for ln in meta.splitlines() if ln.startswith("Requires-Dist: pytensor")]
    # bounded to the releases the seam in lasagne_accum/_pytensor is tested with
    from lasagne_accum._pytensor import SUPPORTED
    assert f">={SUPPORTED[0]}" in pytensor_req and f"<{SUPPORTED[1]}" in pytensor_req
    assert not [n for n in names if n.startswith("tools/")]


def test_sdist_contents(dist):
    names = tarfile.open(dist["sdist"]).getnames()
    prefix = f"lasagne_accum-{lasagne_accum.__version__}/"
    for name in ("LICENSE", "README.md", "setup.cfg", "lasagne_accum/py.typed",
                 "lasagne_accum/__init__.py"):
        assert prefix + name in names, name


def _fresh_env(path):
    """A venv without pip whose interpreter also sees this environment's packages."""
    venv.EnvBuilder(with_pip=False).create(path)
    python = os.path.join(path, "bin", "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = [sysconfig.get_path("purelib")] + [p for p in sys.path if p.endswith("site-packages")]
    with open(os.path.join(site, "test-env.pth"), "w") as f:
        f.write("\n".join(dict.fromkeys(ours)) + "\n")
    return python, site


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_installs_into_fresh_venv_and_imports(dist, kind, tmp_path):
    python, site = _fresh_env(tmp_path / "env")
    args = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
            "--target", site, str(dist[kind])]
    if kind == "sdist":
        args.insert(args.index("--target"), "--no-build-isolation")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    empty = tmp_path / "cwd"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [python, "-c", "import lasagne_accum, os; print(lasagne_accum.__version__); "
                       "print(os.path.dirname(lasagne_accum.__file__)); "
                       "print(lasagne_accum.adam.__module__)"],
        cwd=empty, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    version, where, module = out.stdout.split()
    assert version == lasagne_accum.__version__ == "0.2.0"
    assert where == os.path.join(site, "lasagne_accum")       # the installed copy
    assert module == "lasagne_accum.rules.lasagne"   # Lasagne's set, in rules/
    assert os.path.exists(os.path.join(where, "py.typed"))
