"""The CPU benchmarks' shared helpers: reading llama.cpp's build features, the CPU description, and the
fixed-schema CSV append."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest

# tests/benchmarks is a folder of scripts, not a package: load the helper module from its file.
_spec = importlib.util.spec_from_file_location("cpu_common", Path(__file__).with_name("cpu_common.py"))
cpu_common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpu_common)

# llama-cpp-python 0.3.x's llama_print_system_info() on a 2-core AMD EPYC with AVX2 (native build).
SYSTEM_INFO = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX_VNNI = 0 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
    "AVX512 = 0 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
)


def test_llama_cpp_features_keeps_the_enabled_ones_in_order() -> None:
    assert cpu_common.llama_cpp_features(SYSTEM_INFO) == [
        "SSE3", "SSSE3", "AVX", "AVX2", "F16C", "FMA", "BMI2", "LLAMAFILE", "OPENMP", "REPACK",
    ]  # fmt: skip


def test_llama_cpp_features_reads_every_backend_prefix_and_values_other_than_one() -> None:
    info = "CPU : AVX2 = 1 | AMX_INT8 = 0 | | Metal : EMBED_LIBRARY = 1 | CPU : AVX2 = 1 | SME = 2 |"
    assert cpu_common.llama_cpp_features(info) == ["AVX2", "EMBED_LIBRARY", "SME"]


def test_llama_cpp_features_of_the_installed_build() -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is an optional extra")
    info = llama_cpp.llama_print_system_info()
    features = cpu_common.llama_cpp_features(info.decode() if isinstance(info, bytes) else info)
    assert features, f"no feature read from {info!r}"
    _, flags = cpu_common.cpu_description()
    if "avx2" in flags.split():  # a native build uses what the CPU has
        assert "AVX2" in features


def test_cpu_description_keeps_the_model_and_the_vector_flags() -> None:
    cpuinfo = (
        "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 fma avx avx2 avx512f amx_tile\n\n"
        "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n"
    )
    assert cpu_common.cpu_description(cpuinfo) == ("AMD EPYC", "amx_tile avx2 avx512f")


def test_append_rows_writes_the_header_once_and_refuses_another_schema(tmp_path: Path) -> None:
    path = tmp_path / "cpu.csv"
    cpu_common.append_rows(path, ["a", "b"], [{"a": 1, "b": 2}])
    cpu_common.append_rows(path, ["a", "b"], [{"a": 3, "b": 4}])
    assert list(csv.reader(path.open())) == [["a", "b"], ["1", "2"], ["3", "4"]]
    with pytest.raises(ValueError, match="has the columns"):
        cpu_common.append_rows(path, ["a", "b", "c"], [{"a": 5}])
    assert len(path.read_text().splitlines()) == 3
