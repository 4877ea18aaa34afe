"""``speccache-rag bench --suite ttft``: time to first token of every method, in each compute dtype, in one run.

For each prompt length, the target is loaded once per dtype; every (dtype, method, draft) run is
timed in the same rounds (the order rotates each round, after warm-up rounds), and each median is
reported as a ratio to full prefill in float32 and in bfloat16 of the same prompt. ``overhead`` is
what TTFT spends outside the draft's forward pass and the target's recompute: rendering, store
reads, rotation, scoring, spans and mapping.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..hardware import dtype_name, native_bf16
from ..prompt import RAGPrompt
from .data import synthetic, tokenizer_counter
from .methods import BenchEngine, parse_method
from .metrics import median
from .results import RESULTS, SUITE_FILE
from .suites import DEFAULT, QWEN05, QWEN15, SMOL


@dataclass
class TimingSuite:
    pairs: list[tuple[str, str]] = field(default_factory=lambda: [(QWEN15, SMOL), (QWEN15, QWEN05)])
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    n_chunks: list[int] = field(default_factory=lambda: [8, 16])       # × 256 tokens: ~2 k and ~4 k prompts
    chunk_tokens: int = 256
    methods: list[str] = field(default_factory=lambda: ["full", "reuse", "epic@0.15", "cacheblend@0.15",
                                                        "qattn@0.15", DEFAULT, "speccache@0.15", "norm@0.15"])
    reps: int = 3
    warmup: int = 1
    seed: int = 1000

    def validate(self) -> "TimingSuite":
        for m in self.methods:
            parse_method(m)
        if "full" not in self.methods:
            raise ValueError("the ttft suite's methods must include 'full'")
        if self.reps < 1 or self.warmup < 0 or not self.n_chunks or not self.dtypes:
            raise ValueError("need reps >= 1, warmup >= 0, at least one prompt length and one dtype")
        self.dtypes = list(dict.fromkeys(dtype_name(d) for d in self.dtypes))
        return self


def _runs(suite: TimingSuite, drafts: list[str]) -> list[tuple[str, object, str | None]]:
    runs = []
    for dt in suite.dtypes:
        for spec in map(parse_method, suite.methods):
            for draft in (drafts if spec.uses_draft else [None]):
                runs.append((dt, spec, draft))
    return runs


def time_prompt(engines: dict[str, BenchEngine], drafts: dict[tuple[str, str], tuple], suite: TimingSuite,
                prompt: RAGPrompt, draft_names: list[str]) -> list[dict]:
    """Interleaved rounds over every (dtype, method, draft) → one row per run (medians, breakdown)."""
    runs = _runs(suite, draft_names)
    stats_of: dict[tuple, list] = {(dt, spec.name, d): [] for dt, spec, d in runs}
    for rnd in range(suite.warmup + suite.reps):
        shift = rnd % len(runs)
        for dt, spec, draft in runs[shift:] + runs[:shift]:
            engine = engines[dt]
            if draft is not None:
                engine.use_draft(*drafts[(draft, dt)])
            out = engine.run(spec, prompt, max_new_tokens=1)
            if rnd >= suite.warmup:
                stats_of[(dt, spec.name, draft)].append(out.stats)
    full = {dt: median([s.ttft_s for s in stats_of[(dt, "full", None)]]) for dt in suite.dtypes}
    rows = []
    for (dt, method, draft), stats in stats_of.items():
        med = median([s.ttft_s for s in stats])
        overhead = median([s.ttft_s - s.draft_forward_s - s.recompute_s for s in stats])
        row = {"kind": "ttft", "dtype": dt, "method": method, "draft": draft, "prompt_tokens": stats[0].prompt_tokens,
               "recomputed_tokens": stats[0].recomputed_tokens, "ttft_s": [s.ttft_s for s in stats],
               "ttft_median_s": med, "overhead_s": overhead, "overhead_share": overhead / med,
               "breakdown": {k: median([getattr(s, k) for s in stats])
                             for k in ("load_s", "draft_s", "draft_forward_s", "recompute_s", "first_decode_s")}}
        for ref_dt, ref in full.items():
            row[f"speedup_vs_full_{ref_dt}"] = ref / med
        rows.append(row)
    return rows


def run_ttft_suite(suite: TimingSuite, out: str | Path, progress: bool = True, command: str | None = None,
                   loader=None) -> Path:
    from tqdm.auto import tqdm

    from .suite_run import environment

    suite.validate()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(command)
    env.update(dtype_auto=dtype_name("auto"), native_bf16=native_bf16("cpu"))
    (out / SUITE_FILE).write_text(json.dumps({"suite": asdict(suite), "environment": env}, indent=2))
    if loader is None:
        from ..models import load as loader
    rows: list[dict] = []
    targets: dict[str, list[str]] = {}
    for target, draft in suite.pairs:
        targets.setdefault(target, []).append(draft)
    with (out / RESULTS).open("w", encoding="utf-8") as f:
        for target, draft_names in targets.items():
            models = {dt: loader(target, dtype=dt) for dt in suite.dtypes}
            drafts = {(d, dt): models[dt] if d == target else loader(d, dtype=dt)
                      for d in draft_names for dt in suite.dtypes}
            engines = {dt: BenchEngine(*models[dt], store="memory://", name=target) for dt in suite.dtypes}
            for n_chunks in tqdm(suite.n_chunks, desc=f"ttft {target}", unit="prompt", disable=not progress):
                ex = synthetic(1, suite.seed, n_chunks, suite.chunk_tokens, ("bridge",),
                               tokenizer_counter(engines[suite.dtypes[0]].tokenizer))[0]
                prompt = RAGPrompt(chunks=ex.chunks, question=ex.question)
                for engine in engines.values():
                    engine.precompute(ex.chunks)
                for row in time_prompt(engines, drafts, suite, prompt, draft_names):
                    row.update(target=target, n_chunks=n_chunks, example=ex.id)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    rows.append(row)
            for engine in engines.values():
                engine.close()
            del models, drafts, engines
    return write_ttft_report(out, rows, suite, env)


def write_ttft_report(out: Path, rows: list[dict], suite: TimingSuite, env: dict) -> Path:
    lines = ["# TTFT suite", "", f"- command: `{env['command']}`", f"- machine: {env['processor']}, "
             f"{env['torch_threads']} torch threads; `dtype=\"auto\"` here = {env['dtype_auto']} "
             f"(native bf16: {env['native_bf16']})",
             f"- {suite.warmup} warm-up round(s), then the median of {suite.reps} interleaved rounds; one process", ""]
    refs = [f"× full {dt}" for dt in suite.dtypes]
    for target in dict.fromkeys(r["target"] for r in rows):
        for n_chunks in suite.n_chunks:
            rs = [r for r in rows if r["target"] == target and r["n_chunks"] == n_chunks]
            if not rs:
                continue
            lines += [f"## {target}, {rs[0]['prompt_tokens']} prompt tokens ({n_chunks} chunks × ~{suite.chunk_tokens})",
                      "", "| method | draft | dtype | TTFT s | " + " | ".join(refs) + " | recomputed | overhead |",
                      "|---|---|---|---:|" + "---:|" * len(refs) + "---:|---:|"]
            for r in rs:
                ratios = " | ".join(f"{r[f'speedup_vs_full_{dt}']:.2f}×" for dt in suite.dtypes)
                lines.append(f"| {r['method']} | {r['draft'] or '—'} | {r['dtype']} | {r['ttft_median_s']:.2f} | "
                             f"{ratios} | {r['recomputed_tokens']} | {100 * r['overhead_share']:.1f} % |")
            lines.append("")
    path = out / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
