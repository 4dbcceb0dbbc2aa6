"""Sphinx configuration: the user guide (the .rst pages here) and the API reference.

``bash scripts/build-docs.sh`` builds it (warnings are errors). The API page
is generated at build time from ``GROUPS`` below, by task; a public name (in a
public module's ``__all__``) that no group lists stops the build, so every
public name is documented.
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

#: The API page, grouped by task as the guide is: (title, what the group is for,
#: [(module, names)]). A name of a public module's ``__all__`` that no group lists
#: stops the build (``tests/test_docs.py`` checks the same without building).
GROUPS = [
    ("Update rules", "Lasagne's rules with Lasagne's signatures, and the large-batch rules; "
     "each returns an ``OrderedDict`` of updates and takes ``average=N``.",
     [("lasagne_accum", ["sgd", "momentum", "nesterov_momentum", "apply_momentum",
                         "apply_nesterov_momentum", "adagrad", "rmsprop", "adadelta", "adam",
                         "adamax", "amsgrad", "adamw", "lars", "lamb"])]),
    ("Gradients, constraints and merging", "Building blocks the rules use, for rules of "
     "your own.",
     [("lasagne_accum", ["get_or_compute_grads", "norm_constraint", "total_norm_constraint",
                         "merge_updates"])]),
    ("Schedules", "Learning rates as callables of the optimizer step (optax's definitions).",
     [("lasagne_accum.schedules", None)]),
    ("Accumulation", "The two-function form (:doc:`accumulation`) and the single-function "
     "form (``average=N``).",
     [("lasagne_accum", ["accumulate_gradients", "reset", "Accumulation",
                         "with_accumulated_gradients", "SteppingUpdates"]),
      ("lasagne_accum.accumulate", ["AccumulateUpdates"])]),
    ("Batch normalisation", "Ghost batches and running statistics under accumulation "
     "(:doc:`accumulation`).",
     [("lasagne_accum", ["batch_norm", "batch_norm_updates"]),
      ("lasagne_accum.batch_norm", ["PooledBatchNorm", "ExactBatchNorm", "BatchNormStats",
                                    "batch_norm_layers", "recompute_running_stats"]),
      ("lasagne_accum.training", ["ExactTrainer"])]),
    ("The batch size", "The gradient noise scale and batch-size schedules "
     "(:doc:`batch-size`).",
     [("lasagne_accum", ["gradient_noise", "GradientNoise", "NoiseEstimate",
                         "FollowNoiseScale"])]),
    ("Averaging", "Model averages over windows of steps, and the EMA (:doc:`averaging`).",
     [("lasagne_accum", ["ModelAverage", "ExponentialMovingAverage"])]),
    ("Checkpoints", "Every shared variable an update dictionary touches, and loop state "
     "(:doc:`checkpoints`).",
     [("lasagne_accum", ["save_state", "load_state", "collect_state"]),
      ("lasagne_accum.checkpoint", ["save_arrays", "read_arrays"])]),
    ("Training", "The two functions compiled and driven for you.",
     [("lasagne_accum", ["compile_accumulation", "AccumulationTrainer", "run_epoch"])]),
    ("Distributed", "The parameter server (:doc:`parameter-server`).",
     [("lasagne_accum.distributed", None), ("lasagne_accum.distributed.dask", None)]),
    ("Modes and memory", "Compiling with the library's fast paths and fixes, and what fits "
     "in memory (:doc:`backends`, :doc:`devices`).",
     [("lasagne_accum", ["mode", "default_modes", "show_config"]),
      ("lasagne_accum.modes", ["blas_available"]),
      ("lasagne_accum.machine", ["measured_modes", "ModeChoice", "blas_libraries", "blas_summary",
                                 "generic_kernel"]),
      ("lasagne_accum", ["memory_plan", "MemoryPlan", "step_memory", "StepMemory"]),
      ("lasagne_accum.memory", ["MB"])]),
]
#: Modules documented only when they import (their extra is installed).
OPTIONAL = ["lasagne_accum.schedules", "lasagne_accum.distributed.dask"]
#: Modules whose ``__all__`` every group together must cover.
PUBLIC = ["lasagne_accum", "lasagne_accum.updates", "lasagne_accum.training",
          "lasagne_accum.machine", "lasagne_accum.batch_norm",
          "lasagne_accum.checkpoint", "lasagne_accum.memory", "lasagne_accum.schedules",
          "lasagne_accum.distributed", "lasagne_accum.distributed.dask"]


def _public_names(module):
    """The functions and classes of `module`'s ``__all__`` (submodules left out)."""
    return [n for n in getattr(module, "__all__", [])
            if not n.startswith("_") and not isinstance(getattr(module, n), type(module))]


def _key(module, name):
    obj = getattr(module, name)
    if isinstance(obj, (int, float, str)):
        return (module.__name__, name)
    return (getattr(obj, "__module__", module.__name__), getattr(obj, "__qualname__", name))


def _module(modname):
    """The module, or None for an optional one whose extra is not installed."""
    import importlib

    try:
        return importlib.import_module(modname)
    except ImportError:
        if modname in OPTIONAL:
            return None
        raise


def api_groups():
    """GROUPS with every module's names filled in; and the public names no group lists."""
    groups, listed = [], set()
    for title, what, entries in GROUPS:
        blocks = []
        for modname, names in entries:
            module = _module(modname)
            if module is None:
                continue
            names = _public_names(module) if names is None else names
            blocks.append((modname, names))
            listed.update(_key(module, n) for n in names)
        if blocks:
            groups.append((title, what, blocks))
    missing = [f"{modname}.{n}" for modname in PUBLIC if (module := _module(modname)) is not None
               for n in _public_names(module) if _key(module, n) not in listed]
    return groups, sorted(set(missing))


def _write_api_page(srcdir):
    groups, missing = api_groups()
    if missing:
        raise RuntimeError(f"docs/conf.py: add to a group of GROUPS: {', '.join(missing)}")
    lines = ["API reference", "=============", "",
             "Every public name, grouped by the task it serves. Most are importable from "
             "``lasagne_accum`` itself; the rules also from ``lasagne_accum.updates``, as "
             "in Lasagne.", ""]
    for title, what, blocks in groups:
        lines += [title, "-" * len(title), "", what, ""]
        for modname, names in blocks:
            lines += [f".. currentmodule:: {modname}", "",
                      ".. autosummary::", "   :toctree: generated", ""]
            lines += [f"   {n}" for n in names] + [""]
    path = os.path.join(srcdir, "api.rst")
    text = "\n".join(lines)
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)


# Written when this file is read, before autosummary generates the stub pages.
_write_api_page(os.path.dirname(os.path.abspath(__file__)))
