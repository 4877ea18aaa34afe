"""``speccache-rag bench --suite offload``: SpeCache offloaded decoding against full-KV decode.

Per long prompt (needle-in-a-haystack, two-hop multi-document QA): one full prefill, then a full-KV greedy
decode (the reference) and, for each configuration (bits × top-k × speculative / non-speculative / k = 0),
a greedy decode over the two-tier cache. Reported: task accuracy, teacher-forced KL and top-1 agreement
against the reference's per-step distributions (a configuration that generated the reference tokens is
already teacher-forced; the others are run again on the reference tokens), resident bytes over full-KV
bytes (measured, and by formula at 16-bit elements), prefetch hit rates, decode tokens/s against full's.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..config import OffloadConfig
from ..gate import first_token_fidelity
from ..hardware import dtype_name
from ..layers import HFLayers
from ..offload import OffloadDecoder
from ..offload.tiers import resident_bytes_formula
from ..prompt import RAGPrompt, render
from ..runner import decode_one, full_prefill
from .data import make_example, tokenizer_counter
from .metrics import task_scores
from .report_tables import fmt
from .results import RESULTS, SUITE_FILE, read_rows

QWEN05, QWEN15 = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"


@dataclass
class OffloadSuite:
    targets: list[str] = field(default_factory=lambda: [QWEN05, QWEN15])
    contexts: list[int] = field(default_factory=lambda: [4096, 8192])    # prompt tokens (256-token chunks)
    tasks: tuple[str, ...] = ("needle", "bridge")
    n_per_task: int = 3
    bits: list[int] = field(default_factory=lambda: [2, 1])
    topks: list[int] = field(default_factory=lambda: [16, 64, 256])
    ablation_topk: int = 64                      # speculative=False at this k, and k = 0, per bit width
    max_new_tokens: int = 24                     # the answers restate the question: ~15 tokens
    dtype: str = "float32"
    seed: int = 2000
    # (target, context) → fewer prompts per task where a full grid costs too much on this machine
    per_task_at: dict[str, int] = field(default_factory=dict)

    def configs(self) -> list[tuple[str, OffloadConfig]]:
        out = []
        for b in self.bits:
            out += [(f"{b}bit-k{k}", OffloadConfig(bits=b, topk=k, oracle=True)) for k in self.topks]
            out.append((f"{b}bit-k{self.ablation_topk}-nonspec",
                        OffloadConfig(bits=b, topk=self.ablation_topk, speculative=False, oracle=True)))
            out.append((f"{b}bit-k0", OffloadConfig(bits=b, topk=0)))
        return out

    def per_task(self, target: str, context: int) -> int:
        return self.per_task_at.get(f"{target}@{context}", self.n_per_task)


def _greedy(step, first_logits: torch.Tensor, n: int, max_new: int, stops: set[int],
            forced: list[int] | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Tokens (ending at a stop token or max_new) and the logits after each token but the last."""
    tokens, logits = [int(first_logits.argmax())], []
    while tokens[-1] not in stops and len(tokens) < (len(forced) if forced else max_new):
        out = step(tokens[-1], n + len(tokens) - 1)
        logits.append(out)
        tokens.append(forced[len(tokens)] if forced else int(out.argmax()))
    return tokens, logits


def _stop_ids(tokenizer, model) -> set[int]:
    ids = {tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])}
    ids |= {i for t, i in tokenizer.get_vocab().items() if "\n" in tokenizer.convert_tokens_to_string([t])}
    gen = getattr(model.generation_config, "eos_token_id", None)
    ids.update(gen if isinstance(gen, list) else [gen])
    return {i for i in ids if isinstance(i, int) and i >= 0}


def run_example(ops: HFLayers, tokenizer, stops: set[int], suite: OffloadSuite, ex, configs) -> list[dict]:
    tokens = render(RAGPrompt(chunks=ex.chunks, question=ex.question), tokenizer)
    n, cap = len(tokens), len(tokens) + suite.max_new_tokens + 2
    with torch.inference_mode():
        cache, first = full_prefill(ops, tokens.ids, capacity=cap)
        t = time.perf_counter()
        ref, ref_logits = _greedy(lambda tok, pos: decode_one(ops, cache, tok, pos), first, n,
                                  suite.max_new_tokens, stops)
        full_tps = len(ref_logits) / max(1e-9, time.perf_counter() - t)

    def score(ids: list[int]) -> float:
        s = task_scores(text(ids), ex.answers, ex.values)
        return s.get(ex.metric, s["f1"])

    def text(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    base = dict(example=ex.id, task=ex.task, prompt_tokens=n, full_score=score(ref), full_decode_tps=full_tps,
                reference_tokens=len(ref))
    rows = [dict(base, config="full", answer=text(ref), score=score(ref), kl=0.0, top1=1.0, resident_ratio=1.0,
                 resident_ratio_16bit=1.0, decode_tps=full_tps)]
    for name, cfg in configs:
        dec = OffloadDecoder(ops, cache, n, cfg, cap)
        toks, logits = _greedy(dec.step, first, n, suite.max_new_tokens, stops)
        stats = dec.stats()
        dec.close()
        if toks != ref:                       # teacher-force the reference tokens for the fidelity numbers
            forced = OffloadDecoder(ops, cache, n, cfg, cap)
            _, logits = _greedy(forced.step, first, n, suite.max_new_tokens, stops, forced=ref)
            forced.close()
        fid = [first_token_fidelity(a, b) for a, b in zip(ref_logits, logits)]
        per_layer16 = resident_bytes_formula(n + stats.steps, ops.num_kv_heads, ops.head_dim, cfg, 2, cap)
        full16 = 2 * ops.num_kv_heads * (n + stats.steps) * ops.head_dim * 2
        rows.append(dict(base, config=name, bits=cfg.bits, topk=cfg.topk, speculative=cfg.speculative,
                         answer=text(toks), score=score(toks), same_tokens=toks == ref,
                         kl=sum(f["kl"] for f in fid) / max(1, len(fid)),
                         top1=sum(f["top1"] for f in fid) / max(1, len(fid)),
                         resident_ratio=stats.resident_ratio, resident_ratio_16bit=per_layer16 / full16,
                         resident_bytes=stats.resident_bytes, full_kv_bytes=stats.full_kv_bytes,
                         fetched_bytes_per_step=stats.fetched_bytes_per_step,
                         prefetch_hit_rate=stats.prefetch_hit_rate, oracle_hit_rate=stats.oracle_hit_rate,
                         spec_token_hit_rate=stats.spec_token_hit_rate, decode_tps=stats.decode_tokens_per_s))
    return rows


def rewrite_offload_report(out: str | Path) -> Path:
    """The report of a results directory as it stands (``--report-only``)."""
    out = Path(out)
    env = json.loads((out / SUITE_FILE).read_text()).get("environment", {}) if (out / SUITE_FILE).exists() else {}
    return write_offload_report(out, read_rows(out / RESULTS, key=None), env)


def run_offload_suite(suite: OffloadSuite, out: str | Path, resume: bool = False, progress: bool = True,
                      command: str | None = None, loader=None) -> Path:
    from tqdm.auto import tqdm

    from .suite_run import environment

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(command)
    (out / SUITE_FILE).write_text(json.dumps({"suite": asdict(suite), "environment": env}, indent=2))
    path = out / RESULTS
    rows = read_rows(path, key=None) if resume else []
    done = {(r["target"], r["context"], r["example"]) for r in rows if r["config"] == "full"}
    if loader is None:
        from ..models import load as loader
    configs = suite.configs()
    with path.open("a" if resume else "w", encoding="utf-8") as f:
        for target in suite.targets:
            model, tok = loader(target, dtype=suite.dtype)
            ops, stops = HFLayers(model), _stop_ids(tok, model)
            count = tokenizer_counter(tok)
            for context in suite.contexts:
                k = suite.per_task(target, context)
                examples = [make_example(t, i, suite.seed, n_chunks=context // 256, chunk_tokens=240, count=count)
                            for i in range(k) for t in suite.tasks]
                for ex in tqdm(examples, desc=f"offload {target} @{context}", unit="prompt", disable=not progress):
                    if (target, context, ex.id) in done:
                        continue
                    # a row is written only with its whole example: a resumed run never mixes half-done prompts
                    new = [dict(r, target=target, context=context, dtype=dtype_name(ops.dtype))
                           for r in run_example(ops, tok, stops, suite, ex, configs)]
                    for r in new:
                        f.write(json.dumps(r) + "\n")
                    f.flush()
                    rows += new
            del model, ops
    return write_offload_report(out, rows, env)


# ---- report ---------------------------------------------------------------------------------------------
def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize(rows: list[dict]) -> dict[tuple, dict]:
    """(target, context, config) → means over its prompts."""
    out: dict[tuple, dict] = {}
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["target"], r["context"], r["config"]), []).append(r)
    for key, rs in groups.items():
        full = _mean(r["full_score"] for r in rs)
        out[key] = dict(n=len(rs), score=_mean(r["score"] for r in rs), full=full,
                        of_full=_mean(r["score"] for r in rs) / full if full else None,
                        kl=_mean(r["kl"] for r in rs), top1=_mean(r["top1"] for r in rs),
                        resident=_mean(r["resident_ratio"] for r in rs),
                        resident16=_mean(r["resident_ratio_16bit"] for r in rs),
                        hit=_mean(r.get("prefetch_hit_rate") for r in rs),
                        oracle=_mean(r.get("oracle_hit_rate") for r in rs),
                        spec=_mean(r.get("spec_token_hit_rate") for r in rs),
                        tps=_mean(r["decode_tps"] / r["full_decode_tps"] for r in rs),
                        tokens=_mean(r["prompt_tokens"] for r in rs))
    return out


def goal_lines(summary: dict[tuple, dict]) -> list[str]:
    lines = []
    for (target, context, config), s in sorted(summary.items()):
        if config == "2bit-k64":
            ok = (s["of_full"] or 0) >= 0.98 and s["resident16"] <= 0.2
            lines.append(f"- {target} @{context}: 2-bit k=64 keeps {fmt(s['of_full'] and 100 * s['of_full'], 0)} % of "
                         f"full accuracy at {fmt(s['resident16'])}× full KV (16-bit) — goal ≥ 98 % at ≤ 0.2×: "
                         f"{'met' if ok else 'not met'}")
        if config == "1bit-k64":
            ok = (s["of_full"] or 0) >= 0.95 and s["resident16"] <= 0.12
            lines.append(f"- {target} @{context}: 1-bit k=64 keeps {fmt(s['of_full'] and 100 * s['of_full'], 0)} % at "
                         f"{fmt(s['resident16'])}× — goal ≥ 95 % at ≤ 0.12×: {'met' if ok else 'not met'}")
        if config.endswith("-k64-nonspec"):
            spec = summary.get((target, context, config.removesuffix("-nonspec")))
            if spec and spec["hit"] is not None and s["hit"] is not None:
                ahead = 100 * (spec["hit"] - s["hit"])
                lines.append(f"- {target} @{context}, {config.split('-')[0]}: speculative prefetch hits "
                             f"{100 * spec['hit']:.1f} % vs non-speculative {100 * s['hit']:.1f} % "
                             f"({ahead:+.1f} points; goal at most 5 below: {'met' if ahead >= -5 else 'not met'})")
    return lines


def write_offload_report(out: Path, rows: list[dict], env: dict) -> Path:
    summary = summarize(rows)
    lines = ["# Offloaded decoding (SpeCache)", "", f"- command: `{env.get('command')}`",
             f"- machine: {env.get('processor')}, {env.get('torch_threads')} torch threads", "",
             "Accuracy: the task's match score of the greedy answer; KL and top-1: teacher-forced on full-KV decode's "
             "tokens, mean over steps; resident: bytes on the accelerator over full-KV bytes — measured in the run's "
             "dtype, and by the formula at 16-bit elements (bf16/fp16 KV); hits: fetched rows ∩ the output token's "
             "own top-k over the mixed cache / over the full-precision cache; spec: speculative token = the next "
             "token; tok/s: decode tokens/s over full-KV decode's (CPU: both tiers are RAM, so this is a cost, "
             "not a saving).", ""]
    for target, context in dict.fromkeys((k[0], k[1]) for k in summary):
        configs = [k[2] for k in summary if k[:2] == (target, context)]
        s0 = summary[(target, context, "full")]
        plural = "s" if s0["n"] != 1 else ""
        lines += [f"## {target}, ~{s0['tokens']:.0f} prompt tokens ({s0['n']} prompt{plural})", "",
                  "| config | accuracy | % of full | KL | top-1 | resident | resident 16-bit | hits | oracle hits "
                  "| spec | tok/s × full |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for c in configs:
            s = summary[(target, context, c)]
            lines.append(f"| {c} | {fmt(s['score'], 2)} | {fmt(s['of_full'] and 100 * s['of_full'], 0)} | {fmt(s['kl'])} "
                         f"| {fmt(s['top1'], 2)} | {fmt(s['resident'])} | {fmt(s['resident16'])} | {fmt(s['hit'], 2)} "
                         f"| {fmt(s['oracle'], 2)} | {fmt(s['spec'], 2)} | {fmt(s['tps'], 2)} |")
        lines.append("")
    lines += ["## Goals", "", *goal_lines(summary), ""]
    plot = _plot(out, summary)
    if plot:
        lines += [f"![accuracy against resident bytes]({plot})", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def _plot(out: Path, summary: dict[tuple, dict]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax, kl_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for target, context in dict.fromkeys((k[0], k[1]) for k in summary):
        pts = sorted((s["resident16"], 100 * (s["of_full"] or 0), s["kl"], c) for (t, x, c), s in summary.items()
                     if (t, x) == (target, context) and c != "full")
        label = f"{target} @{context}"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", label=label)
        line, = kl_ax.plot([p[0] for p in pts], [max(p[2], 1e-4) for p in pts], "o", label=label)
        for x, _, kl, c in pts:
            kl_ax.annotate(c.replace("bit", "b"), (x, max(kl, 1e-4)), fontsize=5, xytext=(2, 2),
                           textcoords="offset points", color=line.get_color())
    ax.axhline(100, color="grey", lw=0.8)
    ax.set_xlabel("resident KV / full KV (16-bit elements)")
    ax.set_ylabel("accuracy, % of full-KV decode")
    kl_ax.set_yscale("log")
    kl_ax.set_xlabel("resident KV / full KV (16-bit elements)")
    kl_ax.set_ylabel("teacher-forced KL to full-KV decode (mean per step)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "offload_accuracy_vs_resident.png", dpi=120)
    plt.close(fig)
    return "offload_accuracy_vs_resident.png"
