"""The code blocks of docs/backends-gpu.rst run, and print what the page says they print."""

import doctest
import importlib.util
import os

import pytest

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                    "backends-gpu.rst")


@pytest.mark.skipif(importlib.util.find_spec("jax") is None
                    or importlib.util.find_spec("torch") is None,
                    reason="the page's examples use JAX and PyTorch")
def test_backends_gpu_page_examples():
    result = doctest.testfile(PAGE, module_relative=False, report=True,
                              optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 10
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"
