"""The checked-in stubs of the native module are what ``./dev stubs`` generates from the built
module and the types in ``tools/native_types.pyi``."""

import ast

import pytest

from tools import stubs


def test_the_checked_in_native_stubs_are_generated_from_the_module():
    try:
        import mypy.stubgenc  # noqa: F401
    except ImportError:
        pytest.fail("generating the stubs needs mypy's stubgen: ./dev build installs it into .venv")
    assert stubs.is_current(stubs.STUB.read_text()), f"{stubs.STUB.name} is out of date: run {stubs.REGENERATE}"


def test_a_stub_that_says_something_else_is_not_current_and_layout_alone_does_not_count():
    text = stubs.STUB.read_text()
    assert stubs.is_current(text.replace("def parse_bytes(", "def parse_bytes(\n    ", 1).replace("\n\nclass ", "\nclass "))
    assert not stubs.is_current(text.replace("-> SystemModel", "-> int", 1))


def _module(text: str) -> ast.Module:
    return stubs._strip_docstring(ast.parse(text))


def test_an_overlay_whose_parameters_differ_from_the_module_is_refused():
    native = _module("def f(a, b=None): ...\nclass C:\n    def m(self, x): ...\n")
    for typed, named in [
        ("def f(a: int) -> int: ...", "f takes (a, b=None)"),
        ("def f(a: int, c: int = 1) -> int: ...", "f takes (a, b=None)"),
        ("def f(a: int, b: int = 3) -> int: ...", "f takes (a, b=None)"),
        ("class C:\n    def m(self) -> None: ...", "C.m takes (self, x)"),
        ("class C:\n    def n(self) -> None: ...", "C has no n"),
        ("def g() -> None: ...", "types g, which the native module does not have"),
    ]:
        with pytest.raises(stubs.StubError, match=named.replace("(", r"\(").replace(")", r"\)")):
            stubs.merge(native, _module(typed))


def test_the_overlay_types_what_it_names_and_the_rest_stays_as_the_module_has_it():
    native = _module("from _typeshed import Incomplete\ndef f(a, b=None): ...\ndef g(x): ...\nclass C:\n    size: Incomplete\n")
    typed = _module(
        "from typing import Optional\ndef f(a: int, b: Optional[int] = None) -> int: ...\nclass C:\n    @property\n    def size(self) -> int: ...\n"
    )
    out = ast.unparse(stubs.merge(native, typed))
    assert "def f(a: int, b: Optional[int]=None) -> int:" in out
    assert "def g(x):" in out
    assert "@property\n    def size(self) -> int:" in out
    assert "Incomplete" not in out, "an import nothing uses is left out"
