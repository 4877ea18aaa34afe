"""Named benchmark suites: which models, prompts, methods and timings one command runs."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from .data import TASKS

# ReuseConfig() under its bench name. A name never changes meaning (methods.MethodSpec.reuse_config), so the
# bare family name stays propagate 0 as every earlier run measured it; tests check this one equals what ships.
DEFAULT = "qattn@0.15+propagate=0.75+propagate_window=2"
RATIOS = (0.10, 0.15, 0.20, 0.25)
# The sweep of EVALUATION.md / issue 5, plus the two draft experiments of issue 5 at r = 0.15.
SWEEP = (["full", "reuse", "epic-k8", "epic-k16", "epic-k32"]
         + [f"cacheblend@{r:.2f}" for r in RATIOS] + [f"speccache@{r:.2f}" for r in RATIOS]
         + ["epic@0.15", "random@0.15", "oracle@0.15", "static@0.15", "deviation@0.15"])
# Every method at r = 0.15 (what the headline table compares).
AT_015 = ["full", "reuse", "epic@0.15", "epic-k16", "cacheblend@0.15", "qattn@0.15", "speccache@0.15", "norm@0.15",
          "static@0.15",
          "deviation@0.15", "random@0.15", "oracle@0.15"]
# What the paper suite runs on every prompt: the methods its goals compare.
PAPER_ALL = ["full", "reuse", "epic-k16", "cacheblend@0.15", "qattn@0.15", "speccache@0.15", "norm@0.15"]
# Timed methods (oracle needs a full target prefill by construction: an analysis bound, not timed).
TTFT_015 = ["full", "reuse", "epic@0.15", "cacheblend@0.15", "qattn@0.15", "speccache@0.15", "norm@0.15",
            "static@0.15", "deviation@0.15",
            "random@0.15"]


@dataclass
class Suite:
    name: str
    description: str
    pairs: list[tuple[str, str]]                 # (target, draft)
    n_per_task: int = 2
    n_chunks: int = 6
    chunk_tokens: int = 256
    methods: list[str] = field(default_factory=lambda: list(AT_015))   # on every example
    sweep_methods: list[str] = field(default_factory=list)             # on the first sweep_examples only
    sweep_examples: int = 0
    ttft_methods: list[str] = field(default_factory=lambda: list(TTFT_015))
    ttft_examples: int = 2
    ttft_reps: int = 5
    ttft_warmup: int = 1
    ttft_n_chunks: int | None = None             # None: time the quality prompts themselves
    ttft_chunk_tokens: int | None = None
    max_new_tokens: int = 24
    stop: tuple[str, ...] = ()                   # greedy answers end at any of these (quality pass)
    seed: int = 0
    agreement: bool = True
    tasks: tuple[str, ...] = TASKS
    sink: str = "bos"                            # chunk-KV policy (``SpecCacheEngine(sink=...)``)
    system: str | None = None                    # the prompt's system message (None: RAGPrompt's default)
    longbench: str | None = None                 # a LongBench JSONL file this suite reads (--longbench overrides)
    passages: int | None = None                  # LongBench: the first N passages of each row (None: all)
    neighbors: int = 0                           # LongBench: chunks also stored after their k nearest passages
    singles: bool = False                        # … and after each of them alone (``precompute(singles=)``)

    def validate(self) -> "Suite":
        from .methods import parse_method

        for m in [*self.methods, *self.sweep_methods, *self.ttft_methods]:
            parse_method(m)
        if self.ttft_methods and "full" not in self.ttft_methods:
            raise ValueError("ttft_methods must include 'full' (ratios are to full, in the same run)")
        if self.neighbors < 0:
            raise ValueError(f"neighbors must be >= 0, got {self.neighbors}")
        if self.singles and self.neighbors < 2:
            raise ValueError("singles needs neighbors >= 2 (with one neighbour the variant is already a single)")
        if self.ttft_reps < 1 or self.n_per_task < 1:
            raise ValueError("need ttft_reps >= 1 and n_per_task >= 1")
        return self

    def replace(self, **changes) -> "Suite":
        changes = {k: v for k, v in changes.items() if v is not None}
        return dataclasses.replace(self, **changes).validate()

    @property
    def num_examples(self) -> int:
        return self.n_per_task * len(self.tasks)


# Real multi-hop RAG (issue 24): MuSiQue's dev rows with their retrieved Wikipedia passages, each passage one
# chunk. Third-party text: read from the shared data folder, never committed ($SPECCACHE_MUSIQUE overrides).
MUSIQUE = os.environ.get("SPECCACHE_MUSIQUE", os.path.join("..", "shared", "data", "musique_dev.jsonl"))
SHORT_ANSWER = "Answer the question using the context, in at most five words."
SMOL = "smollm2-135m"
QWEN05 = "qwen2.5-coder-0.5b"
QWEN15 = "qwen2.5-coder-1.5b"

SUITES: dict[str, Suite] = {
    "quick": Suite(
        name="quick",
        description="Smoke run: SmolLM2-135M target and draft, 2 prompts per task of 6 chunks × 256 tokens; the "
                    "goal methods on every prompt, the whole method × budget sweep on the first 2, TTFT on 1.",
        pairs=[(SMOL, SMOL)], n_per_task=2, n_chunks=6, chunk_tokens=256,
        methods=["full", "reuse", "epic-k16", "cacheblend@0.15", "speccache@0.15", "random@0.15"],
        sweep_methods=list(SWEEP), sweep_examples=2,
        ttft_methods=list(TTFT_015), ttft_examples=1, ttft_reps=5, max_new_tokens=12),
    "core": Suite(
        name="core",
        description="Every method at r = 0.15 on 21 prompts of 6 chunks × 128 target tokens, for target "
                    "SmolLM2-135M with draft SmolLM2-135M, and target Qwen2.5-Coder-0.5B with draft SmolLM2-135M; "
                    "TTFT interleaved on 2 of the prompts.",
        pairs=[(SMOL, SMOL), (QWEN05, SMOL)], n_per_task=7, n_chunks=6, chunk_tokens=128,
        methods=list(AT_015), ttft_methods=list(TTFT_015), ttft_examples=2, ttft_reps=5, max_new_tokens=10),
    "paper": Suite(
        name="paper",
        description="Qwen2.5-Coder-1.5B target with a same-family draft (Qwen2.5-Coder-0.5B) and a cross-family, "
                    "cross-tokenizer draft (SmolLM2-135M), both drafts on every prompt against one full-prefill "
                    "reference: the goal methods (full, reuse, epic-k16, cacheblend@0.15, qattn, speccache, norm at 0.15) on 30 "
                    "prompts per task of 4 chunks × 128 target tokens (~570 tokens); every other method and the "
                    "r-sweep on the first 3 prompts (one per task); TTFT interleaved on 1 prompt of 8 chunks × 256 "
                    "tokens (~2.1 k tokens). Sized by measurement on a 2-core CPU (see docs/benchmarks.md); "
                    "resumable: run it in parts with --resume.",
        pairs=[(QWEN15, QWEN05), (QWEN15, SMOL)], n_per_task=30, n_chunks=4, chunk_tokens=128,
        methods=list(PAPER_ALL), sweep_methods=list(dict.fromkeys(AT_015 + SWEEP)), sweep_examples=3,
        ttft_methods=["full", "reuse", "epic@0.15", "cacheblend@0.15", "speccache@0.15", "static@0.15"],
        ttft_examples=1, ttft_reps=3, ttft_n_chunks=8, ttft_chunk_tokens=256, max_new_tokens=16, stop=("\n",)),
    "quality": Suite(
        name="quality",
        description="Closer to real RAG: 8 chunks × 256 target tokens (~2.1 k tokens) per prompt, 30 prompts per "
                    "task, Qwen2.5-Coder-1.5B target with the SmolLM2-135M draft, in the machine's fast dtype "
                    "(bfloat16 with AVX512-BF16); every goal method at r = 0.15 on every prompt, the r-sweep "
                    "of qattn and speccache and qattn's adaptive ratio at three score masses on the first 9 "
                    "(3 per task); TTFT interleaved on the first prompt (5 rounds after a warm-up). Answers "
                    "capped at 24 tokens (three names fit). Sized by measurement: "
                    "~100 s per prompt for these methods in bfloat16 on 2 CPU cores, so ~2.5 h here (run it in "
                    "parts with --resume); the 0.5B target and the Qwen-0.5B draft are separate parts "
                    "(--pairs, same prompts: see docs/benchmarks.md).",
        pairs=[(QWEN15, SMOL)], n_per_task=30, n_chunks=8, chunk_tokens=256,
        methods=["full", "reuse", "epic-k16", "cacheblend@0.15", "random@0.15", "qattn@0.15", DEFAULT,
                 "speccache@0.15", "norm@0.15", "deviation@0.15"],
        sweep_methods=["qattn@0.05", "qattn@0.10", "qattn@0.25", "speccache@0.25",
                       "qattn@auto:0.8", "qattn@auto:0.9", "qattn@auto:0.95"], sweep_examples=9,
        ttft_methods=["full", "epic-k16", "cacheblend@0.15", "qattn@0.15", DEFAULT, "speccache@0.15", "norm@0.15",
                      "deviation@0.15"],
        ttft_examples=1, max_new_tokens=24, stop=("\n",), agreement=False),
    "musique": Suite(
        name="musique",
        description="Real multi-hop RAG (issue 24): MuSiQue dev questions (../shared/data/musique_dev.jsonl, "
                    "$SPECCACHE_MUSIQUE or --longbench for another split; never committed) with their first 6 "
                    "retrieved passages, each passage one chunk (~3.55 k Qwen tokens), answers in at most five "
                    "words, greedy, 12 new tokens stopping at a newline; both targets, plain chunks. Fidelity to "
                    "full prefill is the measure (these targets answer MuSiQue poorly): first-token KL gap closed, "
                    "top-1, the same greedy answer; TTFT on the first 3 questions, median of 5 after a warm-up. "
                    "Sized by measurement on 2 cores in bfloat16 (AVX512-BF16/AMX): ~50 s a question for either "
                    "target (chunk precompute, the full reference, these methods), so ~35 min per target for 40 "
                    "questions and ~10 min of timing: ~1.5 h in all, about three times that in float32. "
                    "--kv-store keeps chunk KV and references, so a resumed run with more --methods pays for those "
                    "only; --pairs, --per-task and --stages shrink it.",
        pairs=[(QWEN15, SMOL), (QWEN05, SMOL)], n_per_task=40, tasks=("musique",), longbench=MUSIQUE, passages=6,
        system=SHORT_ANSWER,
        methods=["full", "reuse", "epic@0.15", "cacheblend@0.15", "qattn@0.15", DEFAULT],
        ttft_methods=["full", "epic@0.15", "cacheblend@0.15", "qattn@0.15", DEFAULT],
        ttft_examples=3, ttft_reps=5, max_new_tokens=12, stop=("\n",), agreement=False),
}


def get_suite(name: str) -> Suite:
    try:
        return SUITES[name].validate()
    except KeyError:
        raise ValueError(f"unknown suite {name!r}; choose one of {', '.join(SUITES)}") from None
