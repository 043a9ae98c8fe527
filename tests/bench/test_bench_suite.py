"""``kvserve bench suite`` in smoke mode: the sections run end to end on tiny random
checkpoints, and their tables are checked for consistency (never for speed)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from kvserve.bench import kv_memory
from kvserve.bench.results import (
    Section,
    SuiteResult,
    Table,
    Target,
    hardware,
    render_markdown,
    table,
)
from kvserve.bench.suite import SuiteContext, run_sections
from kvserve.bench.timelines import random_workload

pytestmark = pytest.mark.slow

ENGINE_SECTIONS = [
    "engine_vs_transformers", "batching", "prefix_caching", "kv_memory", "lora",
]  # fmt: skip


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> SuiteContext:
    base = tmp_path_factory.mktemp("suite")
    return SuiteContext(out_dir=base / "out", work_dir=base / "work", smoke=True, rounds=1)


@pytest.fixture(scope="module")
def sections(ctx: SuiteContext) -> dict[str, Section]:
    return {s.name: s for s in run_sections(ctx, ENGINE_SECTIONS)}


def _table(section: Section, title_start: str) -> list[dict[str, Any]]:
    table = next(t for t in section.tables if t.title.startswith(title_start))
    return [dict(zip([c.header for c in table.columns], row, strict=True)) for row in table.rows]


def test_engine_vs_transformers(sections: dict[str, Section]) -> None:
    s = sections["engine_vs_transformers"]
    rows = _table(s, "Throughput")
    assert [r["engine"] for r in rows] == [
        "kvserve (continuous batching)",
        "transformers generate (static batches)",
        "transformers continuous batching",
    ]
    out_tokens = s.setup["output tokens"]
    for r in rows:
        # tok/s is the requested output tokens over the wall time of the same run
        wall = r["wall (s)"]  # rounded to 0.01 s
        assert out_tokens / (wall + 0.005) - 0.1 <= r["output (tok/s)"]
        assert r["output (tok/s)"] <= out_tokens / max(wall - 0.005, 1e-3) + 0.1
        assert 0 < r["TTFT p50 (ms)"] <= r["TTFT p99 (ms)"]
    assert [t.name for t in s.targets] == [
        "throughput vs transformers static batching",
        "throughput vs transformers continuous batching",
    ]
    assert all(t.measured is not None and t.measured > 0 for t in s.targets)


def test_engine_vs_transformers_runs_kvserve_in_the_suites_dtype(
    ctx: SuiteContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --dtype bfloat16 (scripts/cuda-check.sh) ran transformers in bf16 and kvserve in fp32.
    from kvserve.bench import engine_vs_transformers

    bf16 = dataclasses.replace(ctx, dtype="bfloat16")
    dtypes: list[str] = []
    build = bf16.llm

    def llm(model_dir: Path, **settings: Any) -> Any:
        dtypes.append(settings["dtype"])
        return build(model_dir, **settings)

    monkeypatch.setattr(bf16, "llm", llm)
    section = engine_vs_transformers.run(bf16)
    assert dtypes == ["bfloat16"] and section.setup["dtype"] == "bfloat16"


def test_batching(sections: dict[str, Section]) -> None:
    s = sections["batching"]
    rows = _table(s, "Throughput and TTFT")
    assert [(r["concurrency"], r["batching"]) for r in rows] == [
        (c, m) for c in (1, 4, 16) for m in ("static", "continuous")
    ]
    assert all(r["requests"] == 2 * r["concurrency"] for r in rows)  # smoke: 2 per slot
    ratios = {r["concurrency"]: r["throughput ratio (x)"] for r in _table(s, "Continuous")}
    by = {(r["concurrency"], r["batching"]): r for r in rows}
    for c, ratio in ratios.items():
        static, cont = by[(c, "static")]["wall (s)"], by[(c, "continuous")]["wall (s)"]
        half = 0.005  # walls are rounded to 0.01 s
        assert (static - half) / (cont + half) - 0.01 <= ratio
        assert ratio <= (static + half) / max(cont - half, 1e-3) + 0.01


def test_prefix_caching_counts_exactly_the_shared_full_blocks(
    sections: dict[str, Section],
) -> None:
    s = sections["prefix_caching"]
    rows = {r["prefix caching"]: r for r in _table(s, "Prefill work")}
    agents, shared = s.setup["agents"], int(s.setup["shared system prompt"].split()[0])
    assert rows["off"]["cached tokens"] == 0
    assert rows["off"]["prefill tokens computed"] == rows["off"]["prompt tokens"]
    # every agent after the first reuses the shared prompt's full blocks, nothing more
    assert rows["on"]["cached tokens"] == (agents - 1) * (shared // 16 * 16)
    assert rows["on"]["prefill tokens computed"] == (
        rows["on"]["prompt tokens"] - rows["on"]["cached tokens"]
    )
    (target,) = s.targets
    savings = _table(s, "Savings")[0]
    assert target.measured == savings["cut / shared share (%)"]


def test_lora_section_reports_every_side_and_its_costs(sections: dict[str, Section]) -> None:
    s = sections["lora"]
    rows = _table(s, "Throughput")
    assert [r["side"] for r in rows] == [
        "base model", "1 adapter", "4 adapters", "16 adapters (4 slots)",
    ]  # fmt: skip
    assert all(r["output tok/s"] > 0 for r in rows)
    assert rows[0]["vs base (%)"] == 100.0
    costs = {r["what"]: r["value"] for r in _table(s, "Adapter costs")}
    assert all(value > 0 for value in costs.values()), costs
    (target,) = s.targets
    assert target.measured is not None and target.measured > 0


def test_kv_memory_table(sections: dict[str, Section]) -> None:
    s = sections["kv_memory"]
    rows = _table(s, "Slots per step")
    assert [r["block size (tokens)"] for r in rows] == list(kv_memory.BLOCK_SIZES)
    # the schedule does not depend on the block size: the same tokens are held
    assert len({r["tokens held"] for r in rows}) == 1
    for r in rows:
        assert r["tokens held"] <= r["slots allocated"] <= r["slots if max_model_len reserved"]
    assert s.targets[0].op == "<="


def test_kv_memory_waste_is_only_the_last_block_tail(tmp_path: Path, ctx: SuiteContext) -> None:
    from kvserve import LLM

    model = ctx.checkpoint("tiny")
    work = random_workload(10, (3, 40), (1, 20), 500, seed=3)
    for block_size in (4, 16):
        llm = LLM(
            str(model),
            dtype="float32",
            device="cpu",
            block_size=block_size,
            max_num_seqs=4,
            enable_prefix_caching=False,
        )
        occ = kv_memory.measure(llm, work)
        assert occ.steps == len(occ.series) > 0
        for running, held, allocated, reserved in occ.series:
            assert 0 <= allocated - held < max(running, 1) * block_size
            assert reserved == running * llm.engine.max_model_len
        assert occ.held == sum(s[1] for s in occ.series)


def test_results_json_and_markdown(sections: dict[str, Section], ctx: SuiteContext) -> None:
    result = SuiteResult(
        date=SuiteResult.now(),
        command="kvserve bench suite --smoke",
        hardware=hardware("cpu"),
        smoke=True,
        sections=list(sections.values()),
    )
    js, md = result.write(ctx.out_dir)
    data = json.loads(js.read_text())
    assert data["schema_version"] == 1
    assert [s["name"] for s in data["sections"]] == ENGINE_SECTIONS
    assert data["hardware"]["cpus"] >= 1
    text = md.read_text()
    for s in sections.values():
        assert f"### {s.title}" in text
        for p in s.plots:
            assert (ctx.out_dir / p).stat().st_size > 0
            assert f"]({p})" in text
    assert "| KV waste at block size 16 |" in text


def test_target_and_table_rules() -> None:
    assert Target("x", 2.0, 2.5, "x").met is False
    assert Target("x", 3.5, 4.0, "%", op="<=").met is True
    assert Target("x", None, 1.0, "x").met is None
    with pytest.raises(ValueError, match="wrong width"):
        Table("t", [], [[1]])
    # Headers name each column and its unit, the way the Markdown tables print them.
    headers = ["engine", "wall (s)", "CPU per output token, serving / offline (×)"]
    t = table("t", " | ".join(headers), [[1, 2, 3]])
    assert [(c.name, c.unit) for c in t.columns] == [
        ("engine", ""),
        ("wall", "s"),
        ("CPU per output token, serving / offline", "×"),
    ]
    assert [c.header for c in t.columns] == headers


def test_cli_writes_results(tmp_path: Path) -> None:
    from kvserve.cli import main

    out = tmp_path / "out"
    argv = ["bench", "suite", "--only", "kv_memory", "--smoke", "--rounds", "1", "--out", str(out)]
    assert main([*argv, "--model-shape", "1b", "--dtype", "bfloat16"]) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["command"] == (
        "kvserve bench suite --only kv_memory --smoke --model-shape 1b --dtype bfloat16 "
        f"--rounds 1 --out {out}"
    )
    [section] = data["sections"]
    assert section["setup"]["dtype"] == "bfloat16"
    assert section["setup"]["hidden_size"] == 64  # smoke mode: tiny, whatever the shape
    assert section["error"] is None
    assert "kv_memory.png" in (out / "results.md").read_text()


def test_a_failing_section_is_reported_and_the_rest_still_run(ctx: SuiteContext) -> None:
    broken = ModuleType("broken")
    broken.TITLE = "A section that fails"  # type: ignore[attr-defined]

    def fail(_: SuiteContext) -> Section:
        raise RuntimeError("out of device memory")

    broken.run = fail  # type: ignore[attr-defined]
    modules = {"broken": broken, "kv_memory": kv_memory}
    failed, ran = run_sections(ctx, ["broken", "kv_memory"], load=modules.__getitem__)
    assert failed.error == "RuntimeError: out of device memory"
    assert (failed.name, failed.tables, failed.targets) == ("broken", [], [])
    assert ran.error is None and ran.tables
    result = SuiteResult("now", "kvserve bench suite", {}, True, [failed, ran])
    assert "**Failed:** RuntimeError: out of device memory" in render_markdown(result)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cli_refuses_a_gpu_this_machine_lacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvserve.cli import main

    assert main(["bench", "suite", "--smoke", "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "--device cuda, but CUDA is not available here" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_padded_positions_of_static_batches() -> None:
    from kvserve.bench.engine_vs_transformers import padded_positions
    from kvserve.bench.timelines import Workload

    work = Workload([[1, 2, 3], [1], [5, 6]], [2, 5, 1])
    assert padded_positions(work, 1) == work.prompt_tokens + work.output_tokens == 14
    assert padded_positions(work, 2) == 2 * (3 + 5) + 1 * (2 + 1)
    assert padded_positions(work, 3) == 3 * (3 + 5)
