"""The order the suite's files go to pytest-xdist's workers (python_tests/conftest.py)."""

import importlib.util
import os
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
# By path: the name `conftest` may already be another folder's conftest module.
_spec = importlib.util.spec_from_file_location("suite_conftest", os.path.join(HERE, "conftest.py"))
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)


def test_long_files_exist():
    """A renamed or removed long file would silently lose its place at the front."""
    missing = [name for name in conftest.LONG_FILES if not os.path.isfile(os.path.join(HERE, name))]
    assert not missing, missing


def test_long_files_first_then_by_number_of_tests():
    """Long files first in LONG_FILES' order, then the others by their number of tests, each file's tests
    together and in their own order."""
    names = ["a/test_few.py::x", "a/test_many.py::x", "a/test_many.py::y", "a/test_many.py::z",
             "a/test_mid.py::x", "a/test_mid.py::y", *(f"python_tests/{name}::t{i}" for i, name in
                                                       enumerate(reversed(conftest.LONG_FILES[:2])))]
    items = [SimpleNamespace(nodeid=name) for name in names]
    got = [item.nodeid for item in conftest._longest_files_first(items)]
    assert got == [f"python_tests/{conftest.LONG_FILES[0]}::t1", f"python_tests/{conftest.LONG_FILES[1]}::t0",
                   "a/test_many.py::x", "a/test_many.py::y", "a/test_many.py::z", "a/test_mid.py::x",
                   "a/test_mid.py::y", "a/test_few.py::x"]
