"""`native_build`: a C source is built with the headers beside it, and a change to one of them builds it anew."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from rayrunner.runtime import native_build


@pytest.mark.skipif(native_build.compiler() is None, reason="needs a C compiler")
def test_a_source_builds_with_the_header_beside_it_and_a_changed_header_rebuilds_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYRUNNER_CACHE_DIR", str(tmp_path / "cache"))
    source, header = tmp_path / "answer.c", tmp_path / "value.h"
    source.write_text('#include "value.h"\nint answer(void) { return VALUE; }\n')
    header.write_text("#define VALUE 41\n")
    signatures: native_build.Signatures = {"answer": ([], ctypes.c_int)}
    first = native_build.load(source, "RAYRUNNER_TEST_SWITCH", signatures)
    assert first is not None and first.answer() == 41
    built = native_build.target(source)
    header.write_text("#define VALUE 42\n")
    assert native_build.target(source) != built
    second = native_build.load(source, "RAYRUNNER_TEST_SWITCH", signatures)
    assert second is not None and second.answer() == 42
