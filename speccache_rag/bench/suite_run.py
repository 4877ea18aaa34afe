"""The sweep: quality and fidelity per example × method, interleaved TTFT timings, agreement rows.

Results are JSON lines in ``OUT/results.jsonl``, one per (kind, target, draft, example, method);
a run with ``resume=True`` skips every row already there, so a long suite can run in parts.
Draft-independent methods (full, reuse, epic, cacheblend, random, oracle) are recorded with
``draft: null`` and shared by the pairs that have the same target: one process runs all of a
target's drafts on each prompt, against one full-prefill reference and in the same timing rounds.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
import re
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from ..gate import first_token_fidelity
from ..prompt import RAGPrompt, render
from .data import Example, load_longbench, prose_fingerprint, synthetic, tokenizer_counter
from .methods import BenchEngine, MethodSpec, parse_method
from .metrics import median, rouge_l, task_scores
from .results import RESULTS, SUITE_FILE, read_rows, row_key
from .suites import Suite

class _Writer:
    def __init__(self, path: Path, done: set[tuple]):
        self.path, self.done = path, done
        self.f = path.open("a", encoding="utf-8")

    def write(self, row: dict) -> None:
        self.f.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.f.flush()
        self.done.add(row_key(row))

    def close(self) -> None:
        self.f.close()


def environment(command: str | None = None) -> dict:
    import transformers

    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command or shlex.join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "machine": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "prose": prose_fingerprint(),
    }


class _Models:
    """Loads each named model once per run (tokenizers alone when that is all a step needs)."""

    def __init__(self, loader: Callable | None = None):
        self.loaded: dict[str, tuple] = {}
        self.tokenizers: dict[str, object] = {}
        if loader is None:
            from ..models import load as loader
        self.loader = loader

    def get(self, name: str):
        if name not in self.loaded:
            self.loaded[name] = self.loader(name)
        return self.loaded[name]

    def tokenizer(self, name: str):
        if name in self.loaded:
            return self.loaded[name][1]
        if name not in self.tokenizers:
            from ..models import load_tokenizer

            self.tokenizers[name] = load_tokenizer(name)
        return self.tokenizers[name]


def _recompute_frac(tokens, stats) -> float:
    reusable = sum(s.end - s.start for s in tokens.chunk_segments())
    if stats.method == "full":
        return 1.0
    return (reusable - stats.reused_tokens) / reusable if reusable else 0.0


def _base(kind: str, suite: Suite, target: str, draft: str | None, ex: Example, spec: MethodSpec | None) -> dict:
    row = {"kind": kind, "suite": suite.name, "target": target, "draft": draft, "example": ex.id, "task": ex.task,
           "sink": suite.sink}
    if spec is not None:
        row.update(method=spec.name, family=spec.family, ratio=spec.ratio, epic_k=spec.epic_k)
    return row


def _quality_todo(suite: Suite, pair: tuple[str, str], ex: Example, methods: list[str], done: set) -> tuple:
    target, draft = pair
    specs = [parse_method(m) for m in methods]
    todo = [s for s in specs if _quality_key(target, draft, ex, s) not in done]
    return todo, suite.agreement and ("agreement", target, draft, ex.id, None) not in done


def _quality_key(target: str, draft: str, ex: Example, spec: MethodSpec) -> tuple:
    """The row key of a quality result: draft-independent methods are recorded once, with draft None."""
    return ("quality", target, draft if spec.uses_draft else None, ex.id, spec.name)


def _timed_runs(suite: Suite, target: str, drafts: list[str], ex: Example) -> list[tuple]:
    """(row key, method, draft name or None) of every timed run of a prompt: draft-independent methods
    once, the others once per draft."""
    runs = []
    for spec in map(parse_method, suite.ttft_methods):
        for draft in (drafts if spec.uses_draft else [None]):
            runs.append((("ttft", target, draft, ex.id, spec.name), spec, draft))
    return runs


def _safe(name: str) -> str:
    return re.sub(r"[^\w.-]+", "_", name)


def reference_path(refs: Path, target: str, example: str) -> Path:
    """Where ``refs`` keeps full prefill's reference for one target and prompt."""
    return refs / _safe(target) / (_safe(example) + ".safetensors")


def _reference(engine: BenchEngine, suite: Suite, target: str, ex: Example, prompt: RAGPrompt,
               refs: Path | None) -> tuple:
    """Full prefill's greedy output on ``prompt`` and its wall time: computed, or read from ``refs`` (one
    safetensors file per target and prompt: first-token logits, tokens; text and stats in its metadata)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ..output import GenerationOutput, GenerationStats

    path = reference_path(refs, target, ex.id) if refs else None
    if path is not None and path.exists():
        with safe_open(str(path), "pt") as f:
            meta, t = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        stats = GenerationStats.from_dict(json.loads(meta["stats"]))
        return (GenerationOutput(meta["text"], t["token_ids"].tolist(), stats, meta["finish"], t["first_logits"]),
                float(meta["wall_s"]))
    t0 = time.perf_counter()
    ref = engine.run(parse_method("full"), prompt, suite.max_new_tokens, first_logits=True, stop=suite.stop)
    wall = time.perf_counter() - t0
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({"first_logits": ref.first_logits.contiguous(), "token_ids": torch.tensor(ref.token_ids)},
                  str(path), metadata={"text": ref.text, "finish": ref.finish_reason, "wall_s": str(wall),
                                       "stats": json.dumps(ref.stats.to_dict())})
    return ref, wall


def quality_example(engine: BenchEngine, suite: Suite, target: str, drafts: list[tuple], ex: Example,
                    methods: list[str], writer: _Writer, refs: Path | None = None,
                    context: dict[str, list[str]] | None = None) -> None:
    """Every method on one prompt, for each ``(name, model, tokenizer)`` draft of ``target``. One chunk
    precompute and one full-prefill reference serve every draft; draft-independent methods run once."""
    plans = [(draft, dmodel, dtok, *_quality_todo(suite, (target, draft), ex, methods, writer.done))
             for draft, dmodel, dtok in drafts]
    if not any(todo or want_agree for *_, todo, want_agree in plans):
        return
    prompt = _prompt(suite, ex)
    tokens = render(prompt, engine.tokenizer)
    _precompute(engine, suite, ex, context)
    with engine.memoized():
        ref, ref_wall = _reference(engine, suite, target, ex, prompt, refs)
        for draft, dmodel, dtok, todo, want_agree in plans:
            engine.use_draft(dmodel, dtok)
            # a draft-independent row may have been written for an earlier draft of this prompt
            todo = [s for s in todo if _quality_key(target, draft, ex, s) not in writer.done]
            fams = {s.family for s in todo}
            if "static" in fams:
                engine.prepare_draft(ex.chunks)
            for spec in todo:
                if spec.family == "full":
                    out, wall = ref, ref_wall
                else:
                    t = time.perf_counter()
                    out = engine.run(spec, prompt, suite.max_new_tokens, first_logits=True, stop=suite.stop)
                    wall = time.perf_counter() - t
                scores = task_scores(out.text, ex.answers, ex.values)
                row = _base("quality", suite, target, draft if spec.uses_draft else None, ex, spec)
                row.update(
                    metric=ex.metric, score=scores.get(ex.metric, scores["f1"]), **scores,
                    **first_token_fidelity(ref.first_logits, out.first_logits),
                    cont_rougeL=rouge_l(out.text, ref.text) if ref.text.strip() else float(out.text == ref.text),
                    same_continuation=out.token_ids == ref.token_ids,
                    prediction=out.text, reference=ex.answers[0] if ex.answers else "",
                    recompute_frac=_recompute_frac(tokens, out.stats), stats=out.stats.to_dict(), wall_s=wall)
                writer.write(row)
            if want_agree:
                from .agreement import agreement

                dtokens = render(prompt, dtok)
                row = _base("agreement", suite, target, draft, ex, None)
                row["method"] = None
                row.update(agreement(engine.capture(engine.ops, tokens.ids), engine.ops.num_layers, tokens,
                                     engine.capture(engine.draft_ops, dtokens.ids), engine.draft_ops.num_layers,
                                     dtokens, tokenizer=engine.tokenizer))
                writer.write(row)
    engine.forget_draft()


def timing_example(engine: BenchEngine, suite: Suite, target: str, drafts: list[tuple], ex: Example,
                   writer: _Writer, context: dict[str, list[str]] | None = None) -> None:
    """TTFT of every timed method, for every draft, on one prompt: warm-up, then ``ttft_reps`` interleaved
    rounds (the order rotates each round); ratios are to full's median on the same prompt, same process."""
    runs = _timed_runs(suite, target, [d for d, *_ in drafts], ex)
    draft_models = {d: (dmodel, dtok) for d, dmodel, dtok in drafts}
    if all(key in writer.done for key, *_ in runs):
        return
    prompt = _prompt(suite, ex)
    tokens = render(prompt, engine.tokenizer)
    _precompute(engine, suite, ex, context)
    fams = {spec.family for _, spec, _ in runs}
    if "static" in fams:
        for _, dmodel, dtok in drafts:
            engine.use_draft(dmodel, dtok)
            engine.prepare_draft(ex.chunks)
    stats_of: dict[tuple, list] = {key: [] for key, *_ in runs}
    for rnd in range(suite.ttft_warmup + suite.ttft_reps):
        shift = rnd % len(runs)
        for key, spec, draft in runs[shift:] + runs[:shift]:
            if draft is not None:
                engine.use_draft(*draft_models[draft])
            out = engine.run(spec, prompt, max_new_tokens=1)
            if rnd >= suite.ttft_warmup:
                stats_of[key].append(out.stats)
    full_med = median([s.ttft_s for s in stats_of[("ttft", target, None, ex.id, "full")]])
    for key, spec, _ in runs:
        stats = stats_of[key]
        med = median([s.ttft_s for s in stats])
        row = _base("ttft", suite, target, key[2], ex, spec)
        row.update(
            ttft_s=[s.ttft_s for s in stats], ttft_median_s=med, ratio_to_full=med / full_med,
            speedup=full_med / med, prompt_tokens=stats[0].prompt_tokens,
            recompute_frac=_recompute_frac(tokens, stats[0]),
            breakdown={k: median([getattr(s, k) for s in stats]) for k in ("load_s", "draft_s", "recompute_s",
                                                                             "first_decode_s")})
        writer.write(row)
    engine.forget_draft()


def _precompute(engine: BenchEngine, suite: Suite, ex: Example, context: dict[str, list[str]] | None) -> None:
    """The prompt's chunks, and with ``context`` their variants after their corpus neighbours too."""
    engine.precompute(ex.chunks, context=[context[c] for c in ex.chunks] if context else None,
                      singles=suite.singles)


def _prompt(suite: Suite, ex: Example) -> RAGPrompt:
    system = {} if suite.system is None else {"system": suite.system}
    return RAGPrompt(chunks=ex.chunks, question=ex.question, **system)


def _examples(suite: Suite, tokenizer, longbench: str | None, ttft: bool = False) -> list[Example]:
    count = tokenizer_counter(tokenizer)
    if longbench:
        exs = load_longbench(longbench, chunk_tokens=suite.chunk_tokens, count=count)
        if suite.passages:
            exs = [dataclasses.replace(ex, chunks=ex.chunks[: suite.passages]) for ex in exs]
        return exs[: suite.ttft_examples] if ttft else exs[: suite.num_examples]
    if ttft and suite.ttft_n_chunks:
        n = -(-suite.ttft_examples // len(suite.tasks))
        exs = synthetic(n, suite.seed + 1000, suite.ttft_n_chunks, suite.ttft_chunk_tokens or suite.chunk_tokens,
                        suite.tasks, count)
        return exs[: suite.ttft_examples]
    exs = synthetic(suite.n_per_task, suite.seed, suite.n_chunks, suite.chunk_tokens, suite.tasks, count)
    return exs[: suite.ttft_examples] if ttft else exs


STAGES = ("quality", "ttft")
# What makes prompt i, its answers and its timings what they are: a resumed run must not change these,
# or its rows would sit beside rows of other prompts under the same example id.
SAME_ON_RESUME = ("n_chunks", "chunk_tokens", "seed", "max_new_tokens", "stop", "ttft_n_chunks", "ttft_chunk_tokens",
                  "ttft_reps", "ttft_warmup", "sink", "system", "passages", "neighbors", "singles")
_BEFORE_DEFAULTS = {"sink": "bos", "neighbors": 0, "singles": False}          # results written before the field existed


def _check_same_prompts(before: dict, now: dict, longbench_before: str | None, longbench_now: str | None) -> None:
    changed = [k for k in SAME_ON_RESUME if json.loads(json.dumps(now.get(k))) != before.get(k, _BEFORE_DEFAULTS.get(k))]
    if longbench_before != longbench_now:
        changed.append("longbench")
    if changed:
        raise ValueError("cannot resume: " + ", ".join(f"{k} was {before.get(k)!r}, now {now.get(k)!r}"
                                                      for k in changed) + " — use another --out or --fresh")


def run_suite(suite: Suite, out: str | Path, resume: bool = False, fresh: bool = False, progress: bool = True,
              longbench: str | None = None, loader: Callable | None = None, report: bool = True,
              stages: tuple[str, ...] = STAGES, shard: tuple[int, int] = (0, 1), skip: int = 0,
              command: str | None = None, kv_store: str | None = None) -> Path:
    """Run (or resume) ``suite`` into ``out``; returns the report's path (or the results' if report=False).

    ``stages``: "quality" (scores, fidelity, agreement) and/or "ttft" (interleaved timings).
    ``shard=(k, n)``: only prompts whose index is k mod n (run n processes on one ``out`` to split a suite).
    ``skip``: leave out the first ``skip`` prompts (to add new prompts to a sample an earlier run measured).
    ``command``: how this run was invoked, for suite.json (default: this process's argv).
    ``kv_store``: a store that keeps the chunk KV between runs (then full-prefill references are kept in
    ``out/refs``), so resuming with new methods costs those methods only."""
    k_shard, n_shard = shard
    if not 0 <= k_shard < n_shard:
        raise ValueError(f"shard must be K/N with 0 <= K < N, got {k_shard}/{n_shard}")
    if skip < 0:
        raise ValueError(f"skip must be >= 0, got {skip}")

    def ours(i: int) -> bool:                              # this shard's prompts, past the skipped ones
        return i >= skip and i % n_shard == k_shard
    from tqdm.auto import tqdm

    suite.validate()
    longbench = longbench or suite.longbench
    if longbench and not Path(longbench).is_file():
        raise FileNotFoundError(f"no LongBench file at {longbench} (suite {suite.name}: set $SPECCACHE_MUSIQUE or "
                                f"pass --longbench FILE)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / RESULTS
    if not stages or set(stages) - set(STAGES):
        raise ValueError(f"stages must be among {', '.join(STAGES)}, got {stages!r}")
    if results.exists() and results.stat().st_size and not (resume or fresh):
        raise ValueError(f"{results} already holds results: pass --resume to continue it or --fresh to start over")
    if fresh and results.exists():
        results.unlink()
    env = environment(command)
    parts = []
    if resume and results.exists() and (out / SUITE_FILE).exists():
        before = json.loads((out / SUITE_FILE).read_text())
        _check_same_prompts(before["suite"], asdict(suite), before.get("longbench"), longbench)
        parts = before.get("parts", [])
    parts.append({"command": env["command"], "date": env["date"], "stages": list(stages),
                  "shard": f"{k_shard}/{n_shard}", "skip": skip, "torch_threads": env["torch_threads"]})
    meta = {"suite": asdict(suite), "environment": env, "longbench": longbench, "parts": parts}
    (out / SUITE_FILE).write_text(json.dumps(meta, indent=2))
    done = {row_key(r) for r in read_rows(results)}
    writer = _Writer(results, done)
    models = _Models(loader)
    drafts_of: dict[str, list[str]] = {}                   # pairs grouped by target, in suite order
    for target, draft in suite.pairs:
        drafts_of.setdefault(target, []).append(draft)
    try:
        for target, draft_names in drafts_of.items():
            ttok = models.tokenizer(target)
            examples = _examples(suite, ttok, longbench)
            plan = [(ex, list(dict.fromkeys(list(suite.methods) + (list(suite.sweep_methods)
                                                                   if i < suite.sweep_examples else []))))
                    for i, ex in enumerate(examples) if ours(i)] if "quality" in stages else []
            timed = (_examples(suite, ttok, longbench, ttft=True)
                     if suite.ttft_methods and suite.ttft_examples and "ttft" in stages else [])
            timed = [ex for i, ex in enumerate(timed) if ours(i)]
            if not any(any(_quality_todo(suite, (target, d), ex, ms, done)) for ex, ms in plan for d in draft_names) \
                    and not any(key not in done for ex in timed
                                for key, *_ in _timed_runs(suite, target, draft_names, ex)):
                continue                                                  # resumed: nothing left for this target
            tmodel, ttok = models.get(target)
            drafts = [(d, *models.get(d)) for d in draft_names]
            engine = BenchEngine(tmodel, ttok, store=kv_store or "memory://", name=target, sink=suite.sink)
            refs = out / "refs" if kv_store else None
            context = None
            if suite.neighbors and longbench:
                from .corpus import neighbour_context

                context = neighbour_context(load_longbench(longbench, chunk_tokens=suite.chunk_tokens,
                                                           count=tokenizer_counter(ttok)), suite.neighbors)
            for ex, methods in tqdm(plan, desc=f"quality {target} ← {', '.join(draft_names)}", unit="prompt",
                                    disable=not progress):
                quality_example(engine, suite, target, drafts, ex, methods, writer, refs, context)
            for ex in tqdm(timed, desc=f"ttft {target} ← {', '.join(draft_names)}", unit="prompt",
                           disable=not progress):
                timing_example(engine, suite, target, drafts, ex, writer, context)
            engine.close()
    finally:
        writer.close()
    if not report:
        return results
    from .report import write_report

    return write_report(out)
