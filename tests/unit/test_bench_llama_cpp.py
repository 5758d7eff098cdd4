"""The llama.cpp baseline's plumbing (bench/llama_cpp.py, bench/suite.py): where a build is
looked for, the server's command line the benchmarks promise, and the suite going on with a
clear line when there is no build. (The baseline itself is never built or run in CI.)"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench import llama_cpp, suite


@pytest.fixture
def no_build(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(llama_cpp.LLAMA_CPP_ENV, raising=False)
    return tmp_path


def test_a_build_is_found_by_its_server_program(no_build, monkeypatch) -> None:
    assert llama_cpp.bin_dir() is None
    default = no_build / "cache" / "llama.cpp" / "bin"
    default.mkdir(parents=True)
    assert llama_cpp.bin_dir() is None  # a folder without llama-server is no build
    (default / "llama-server").touch()
    assert llama_cpp.bin_dir() == default
    elsewhere = no_build / "elsewhere"
    (elsewhere / "llama-server").parent.mkdir()
    (elsewhere / "llama-server").touch()
    monkeypatch.setenv(llama_cpp.LLAMA_CPP_ENV, str(elsewhere))
    assert llama_cpp.bin_dir() == elsewhere  # the variable wins


def test_the_server_runs_as_the_benchmarks_say(no_build) -> None:
    server = llama_cpp.LlamaServer.__new__(llama_cpp.LlamaServer)  # the command only: nothing started
    server.folder = no_build
    cmd = server.command("/m.gguf", "127.0.0.1", 8123, ())
    assert cmd[0] == str(no_build / "llama-server")
    text = " ".join(cmd)
    for flags in ("-m /m.gguf", "--host 127.0.0.1 --port 8123", "-t 2 -tb 2", "--parallel 8 --cont-batching", "-fa on"):
        assert flags in text


def test_the_suite_skips_llama_cpp_without_a_build_and_says_so(no_build, capsys) -> None:
    args = argparse.Namespace(model="default", concurrency=16, no_progress=True)
    timings: dict[str, float] = {}
    assert suite.run_llama_cpp(args, [], timings) == []
    said = capsys.readouterr().err
    assert "llama.cpp: skipped, no build found" in said and llama_cpp.LLAMA_CPP_ENV in said
    assert any(key.startswith("llama.cpp: skipped") for key in timings)


def test_the_suite_skips_llama_cpp_for_a_model_that_is_not_a_gguf(no_build, monkeypatch, capsys) -> None:
    monkeypatch.setenv(llama_cpp.LLAMA_CPP_ENV, str(no_build))
    (no_build / "llama-server").touch()
    args = argparse.Namespace(model=str(no_build / "hf-folder"), concurrency=16, no_progress=True)
    assert suite.run_llama_cpp(args, [], {}) == []
    assert "is not a GGUF file" in capsys.readouterr().err
