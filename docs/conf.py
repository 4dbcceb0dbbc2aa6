"""Sphinx configuration: the user guide (the .rst pages here) and the API reference.

``bash scripts/build-docs.sh`` builds it (warnings are errors). The API page
is generated from each public module's ``__all__`` at build time, so every
public name is documented and a new one needs no edit here.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import lasagne_accum  # noqa: E402

project = "lasagne_accum"
author = "The lasagne_accum maintainers"
copyright = "2026, The lasagne_accum maintainers"
release = lasagne_accum.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",      # .. math:: blocks and :math: roles in the docstrings
    "sphinx.ext.viewcode",
    "numpydoc",
]
autosummary_generate = True
autodoc_default_options = {"members": True, "show-inheritance": True}
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_attributes_as_param_list = False
exclude_patterns = ["_build"]
html_theme = "alabaster"
# code lines run to 100 characters: a page wide enough to show them without scrolling
html_theme_options = {"page_width": "1240px", "body_max_width": "none", "sidebar_width": "220px"}
nitpicky = False

#: (module, title): the modules whose ``__all__`` is the public API.
PUBLIC = [
    ("lasagne_accum", "Top level"),
    ("lasagne_accum.updates", "Update rules (lasagne_accum.updates)"),
    ("lasagne_accum.training", "Training helpers (lasagne_accum.training)"),
    ("lasagne_accum.checkpoint", "Checkpoints (lasagne_accum.checkpoint)"),
    ("lasagne_accum.distributed", "Parameter server (lasagne_accum.distributed)"),
]
TITLES = {"lasagne_accum.distributed.dask":
          "Parameter server on Dask (lasagne_accum.distributed.dask)"}
OPTIONAL = [   # documented when the module imports (its extra is installed)
    "lasagne_accum.schedules",
    "lasagne_accum.distributed.dask",
]


def _write_api_page(srcdir):
    import importlib

    modules = list(PUBLIC)
    for name in OPTIONAL:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        modules.append((name, TITLES.get(name, f"{name.rsplit('.', 1)[1].capitalize()} ({name})")))
    lines = ["API reference", "=============", "",
             "Every name in the ``__all__`` of the public modules.", ""]
    documented = set()
    for modname, title in modules:
        module = importlib.import_module(modname)
        names = [n for n in getattr(module, "__all__", [])
                 if not n.startswith("_")
                 and not isinstance(getattr(module, n), type(module))]
        # a name re-exported at the top level is documented once, where it is defined
        entries = []
        for n in names:
            obj = getattr(module, n)
            key = (getattr(obj, "__module__", modname), getattr(obj, "__qualname__", n))
            if key in documented:
                continue
            documented.add(key)
            entries.append(n)
        if not entries:
            continue
        lines += [title, "-" * len(title), "", f".. currentmodule:: {modname}", "",
                  ".. autosummary::", "   :toctree: generated", ""]
        lines += [f"   {n}" for n in entries] + [""]
    path = os.path.join(srcdir, "api.rst")
    text = "\n".join(lines)
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)


# Written when this file is read, before autosummary generates the stub pages.
_write_api_page(os.path.dirname(os.path.abspath(__file__)))
