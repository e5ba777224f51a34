"""The benchmarks' own logic (bench/ is scripts, not a package): the CPU kind every header prints, vLLM's thread
settings, alternating rounds, medians, and labels on cross-precision ratios."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_vs_vllm  # noqa: E402
from aiperf_harness import Figures, median_figures  # noqa: E402
from cpu_kind import cpu_kind  # noqa: E402

AVX2_ONLY = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse avx avx2 fma\n"
AMX = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C\n"
       "flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
       "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C\n"
       "flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n")


def figures(tok_s: float, errors: int = 0) -> Figures:
    return Figures(output_tok_s=tok_s, ttft_p50_s=tok_s / 10, ttft_p99_s=1.0, itl_p50_s=0.05, output_tokens=64.0,
                   prompt_tokens=124.0, requests=16, errors=errors)


def test_cpu_kind_names_the_model_and_the_flags_that_rank_servers() -> None:
    assert cpu_kind(AVX2_ONLY) == "AMD EPYC 7B13 (avx2)"
    assert cpu_kind(AMX) == "Intel(R) Xeon(R) Platinum 8481C (amx_bf16 amx_int8 avx2 avx512_bf16)"


def test_cpu_kind_names_the_generation_a_vm_s_model_name_hides() -> None:
    zen5 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n"
            "flags\t\t: avx2 avx512_bf16 avx512_vnni\n")
    assert cpu_kind(zen5) == "AMD EPYC, family 26 model 2 (avx2 avx512_bf16 avx512_vnni)"


def test_cpu_kind_matches_whole_flags_only() -> None:
    text = "model name\t: Some CPU\nflags\t\t: avx avx2x avx512_bf16_extra\n"
    assert cpu_kind(text) == "Some CPU (none of amx_bf16 amx_int8 avx512_bf16 avx512_vnni avx2)"


def test_vllm_gets_the_same_thread_count_bound_to_the_first_cpus() -> None:
    assert bench_vs_vllm.vllm_thread_env(1, [3, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "1",
                                                        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    assert bench_vs_vllm.vllm_thread_env(2, [0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "0,1",
                                                        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    with pytest.raises(ValueError, match="--threads 3"):
        bench_vs_vllm.vllm_thread_env(3, [0, 1])


def test_rayrunner_side_gets_that_thread_count() -> None:
    spec = bench_vs_vllm.rayrunner_spec("smollm2-Q8_0", 1, "Q8_0")
    assert spec["engine"] == {"torch_threads": 1}
    assert spec["in_situ_quant"] == "Q8_0"


def test_rounds_alternate_the_sides(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[tuple[str, int]] = []

    def measure(base: str, model: str, tokenizer: Path, args: argparse.Namespace, out_dir: Path, round_: int
                ) -> dict[int, Figures]:
        calls.append((model, round_))  # the round seeds the prompts: both sides of a round get the same ones
        return {1: figures(float(len(calls)))}

    monkeypatch.setattr(bench_vs_vllm, "measure", measure)
    sides = [bench_vs_vllm.Side("vLLM bf16", "http://a", "A"), bench_vs_vllm.Side("rayrunner bf16", "http://b", "B")]
    rounds = bench_vs_vllm.alternate(sides, tmp_path, argparse.Namespace(rounds=3), tmp_path)
    assert calls == [("A", 0), ("B", 0), ("A", 1), ("B", 1), ("A", 2), ("B", 2)]
    assert [r[1].output_tok_s for r in rounds["vLLM bf16"]] == [1.0, 3.0, 5.0]
    assert bench_vs_vllm.medians(rounds, [1])["rayrunner bf16"][1].output_tok_s == 4.0


def test_median_figures_takes_each_figure_s_median_and_sums_requests() -> None:
    merged = median_figures([figures(10.0), figures(30.0, errors=1), figures(20.0)])
    assert merged.output_tok_s == 20.0
    assert merged.ttft_p50_s == 2.0
    assert (merged.requests, merged.errors) == (48, 1)


def test_ratio_across_precisions_is_labelled(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_vs_vllm.ratio_label("rayrunner bf16", "vLLM bf16") == "/ vLLM bf16"
    assert bench_vs_vllm.ratio_label("rayrunner Q8_0", "vLLM bf16") == "/ vLLM bf16 (Q8_0 vs bf16: cross-precision)"
    bench_vs_vllm.print_table({"vLLM bf16": {1: figures(10.0)}, "rayrunner Q8_0": {1: figures(15.0)}}, [1])
    table = capsys.readouterr().out
    assert "| c | figure | vLLM bf16 | rayrunner Q8_0 | / vLLM bf16 (Q8_0 vs bf16: cross-precision) |" in table
    assert "| 1 | output tok/s | 10.0 | 15.0 | 1.50x |" in table


def test_a_variant_names_a_side_with_its_engine_settings() -> None:
    name, engine = bench_vs_vllm.variant('chunk2048={"prefill_chunk_tokens": 2048}')
    spec = bench_vs_vllm.rayrunner_spec(f"{bench_vs_vllm.SERVED}-{name}", 1, engine=engine)
    assert spec["engine"] == {"torch_threads": 1, "prefill_chunk_tokens": 2048}
    assert bench_vs_vllm.side_name(spec) == "chunk2048 bf16"
    assert bench_vs_vllm.side_name(bench_vs_vllm.rayrunner_spec(bench_vs_vllm.SERVED, 1)) == "bf16"
    assert bench_vs_vllm.side_name(bench_vs_vllm.rayrunner_spec(f"{bench_vs_vllm.SERVED}-Q8_0", 1, "Q8_0")) == "Q8_0"
    with pytest.raises(argparse.ArgumentTypeError):
        bench_vs_vllm.variant("not a name=[1]")
