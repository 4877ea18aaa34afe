"""Validated configuration: the only place where defaults live."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_STORE = "./.speccache/kv"      # where engines, the connector and the drop-ins keep chunk KV by default
DEFAULT_TARGET = "smollm2-135m"       # the model a drop-in or the CLI loads when none is named


@dataclass(frozen=True)
class MethodTraits:
    draft: bool = False     # scores with the draft model: engines load one for it
    # Scores that concentrate where it matters, so recompute_ratio="auto" can size the budget by their mass
    # (deep-layer norms are nearly flat: their mass always asks for the upper bound).
    auto: bool = False


# Every reuse method, in the order the CLI and error messages list them, and what the engines need to know
# about it. Each one but "full" is a selector of that name (selection/registry.py takes no other name); the
# lists below are read from here, so a new method is its module under selection/ plus its line here.
METHOD_TRAITS = {
    "full": MethodTraits(),
    "reuse": MethodTraits(),
    "epic": MethodTraits(),
    "cacheblend": MethodTraits(auto=True),
    "speccache": MethodTraits(draft=True, auto=True),
    "norm": MethodTraits(draft=True),
    "deviation": MethodTraits(draft=True),
    "qattn": MethodTraits(auto=True),
    "random": MethodTraits(),
    "oracle": MethodTraits(),
}
METHODS = tuple(METHOD_TRAITS)
DRAFT_METHODS = tuple(m for m, t in METHOD_TRAITS.items() if t.draft)
AUTO_METHODS = tuple(m for m, t in METHOD_TRAITS.items() if t.auto)
SINK_POLICIES = ("bos", "prefix", "none")
SPAN_RULES = ("smooth", "none")
NEIGHBOR_POLICIES = ("preceding", "unseen", "retrieved", "nearest", "off")   # chunk variants with ingestion-time context (neighbors.py)


@dataclass(frozen=True)
class ReuseConfig:
    """Which prompt tokens the target recomputes, and how they are chosen.

    ``recompute_ratio`` is the share of *reusable* (cached-chunk) tokens that are recomputed on top
    of the tokens that are always recomputed (prefix, separators, question, store misses); ``"auto"``
    chooses it per prompt: the fewest top-scored tokens that hold ``auto_mass`` of the method's score
    mass, within ``auto_range``.
    """

    method: str = "qattn"               # chosen by evidence: docs/benchmarks.md
    recompute_ratio: float | str = 0.15
    auto_mass: float = 0.5              # recompute_ratio="auto": share of the score mass to cover
    auto_range: tuple[float, float] = (0.05, 0.30)   # recompute_ratio="auto": bounds of the ratio
    epic_k: int | None = None           # None: chosen so that the budget equals recompute_ratio
    cacheblend_check_layer: int = 1     # layers 0..check_layer run over every token
    draft_layers: float = 1 / 3         # norm/deviation/oracle read the last third of the layers
    span_rule: str = "smooth"
    tau_smooth: float = 0.4
    tau_cover: float = 0.7
    max_span: int = 16
    qattn_layers: tuple[float, float] = (0.5, 1.0)   # qattn and speccache score with the deeper half
    qattn_pool: int = 1                 # qattn: max-pool window over positions (1 = none)
    qattn_heads: str = "mean"           # qattn: "mean" or "max" over heads
    qattn_sink: int = 0                 # qattn: the first k tokens of every chunk are chosen first
    qattn_rounds: int = 1               # qattn: the budget in n parts, each re-scored over the repaired KV
    qattn_rows: int = 0                 # qattn: score with the question's last k rows only (0: every row)
    neighbors: str = "preceding"        # which stored variant of a chunk to read (neighbors.py)
    propagate: float = 0.75             # stale chunk tokens take this share of the mean KV correction of
    propagate_window: int = 2           # this many recomputed neighbours on each side (0: the nearest one),
                                        # layer by layer (propagate.py)
    seed: int = 0                       # for "random"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.recompute_ratio == "auto":
            if self.method not in AUTO_METHODS:
                raise ValueError(f"recompute_ratio='auto' needs a scoring method ({', '.join(AUTO_METHODS)}), "
                                 f"not {self.method!r}")
        elif not isinstance(self.recompute_ratio, (int, float)) or not 0.0 <= self.recompute_ratio <= 1.0:
            raise ValueError(f"recompute_ratio must be within [0, 1] or 'auto', got {self.recompute_ratio!r}")
        lo, hi = self.auto_range
        if not 0.0 <= lo <= hi <= 1.0 or not 0.0 < self.auto_mass <= 1.0:
            raise ValueError(f"need 0 <= auto_range[0] <= auto_range[1] <= 1 and auto_mass in (0, 1], got "
                             f"auto_range={self.auto_range!r}, auto_mass={self.auto_mass!r}")
        if self.epic_k is not None and self.epic_k < 0:
            raise ValueError(f"epic_k must be >= 0, got {self.epic_k}")
        if self.cacheblend_check_layer < 0:
            raise ValueError("cacheblend_check_layer must be >= 0")
        if not 0.0 < self.draft_layers <= 1.0:
            raise ValueError(f"draft_layers must be within (0, 1], got {self.draft_layers}")
        if self.span_rule not in SPAN_RULES:
            raise ValueError(f"unknown span_rule {self.span_rule!r}; choose one of {', '.join(SPAN_RULES)}")
        lo, hi = self.qattn_layers
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(f"qattn_layers must be (first, last) fractions with 0 <= first < last <= 1, "
                             f"got {self.qattn_layers!r}")
        if self.qattn_rounds < 1:
            raise ValueError(f"qattn_rounds must be >= 1, got {self.qattn_rounds}")
        if self.qattn_rows < 0:
            raise ValueError(f"qattn_rows must be >= 0, got {self.qattn_rows}")
        if self.qattn_pool < 1 or self.qattn_sink < 0:
            raise ValueError(f"need qattn_pool >= 1 and qattn_sink >= 0, got {self.qattn_pool}, {self.qattn_sink}")
        if self.qattn_heads not in ("mean", "max"):
            raise ValueError(f"qattn_heads must be 'mean' or 'max', got {self.qattn_heads!r}")
        if self.neighbors not in NEIGHBOR_POLICIES:
            raise ValueError(f"neighbors must be one of {', '.join(NEIGHBOR_POLICIES)}, got {self.neighbors!r}")
        if not 0.0 <= self.propagate <= 1.0:
            raise ValueError(f"propagate must be within [0, 1], got {self.propagate!r}")
        if self.propagate_window < 0:
            raise ValueError(f"propagate_window must be >= 0, got {self.propagate_window}")
        if self.tau_smooth < 0 or not 0.0 <= self.tau_cover <= 1.0 or self.max_span < 1:
            raise ValueError("need tau_smooth >= 0, tau_cover in [0, 1], max_span >= 1")


OFFLOAD_BITS = (1, 2, 4, 8)
PREFETCH_MODES = ("sync", "async")


@dataclass(frozen=True)
class OffloadConfig:
    """SpeCache offloaded decoding (docs/offload.md): the full KV in the host tier, a KIVI low-bit copy
    resident, and each step the top-``topk`` rows per KV head (chosen by the speculative token's attention)
    fetched back at full precision."""

    bits: int = 2                       # resident codes per value (1 = SpeCache's 1-bit variant)
    topk: int = 64                      # rows fetched per KV head and layer each step
    group: int = 64                     # quantization group: tokens per key group, channels per value group
    residual: int = 64                  # newest tokens kept at full precision (a multiple of ``group``)
    speculative: bool = True            # False: fetch by the current token's own attention (the ablation)
    prefetch: str = "sync"              # "async": fetches overlap the next step (a worker thread on CPU)
    oracle: bool = False                # also measure hits against full-precision top-k (reads the host tier)

    def __post_init__(self):
        if self.bits not in OFFLOAD_BITS:
            raise ValueError(f"bits must be one of {OFFLOAD_BITS}, got {self.bits!r}")
        if self.topk < 0 or self.group < 1:
            raise ValueError(f"need topk >= 0 and group >= 1, got topk={self.topk}, group={self.group}")
        if self.residual < self.group or self.residual % self.group:
            raise ValueError(f"residual must be a positive multiple of group={self.group}, got {self.residual}")
        if self.prefetch not in PREFETCH_MODES:
            raise ValueError(f"prefetch must be one of {', '.join(PREFETCH_MODES)}, got {self.prefetch!r}")

    @classmethod
    def parse(cls, text: "str | OffloadConfig | None") -> "OffloadConfig | None":
        """``"2bit"``, ``"1bit"`` (SpeCache defaults otherwise), an OffloadConfig, or None / "off"."""
        if text is None or isinstance(text, OffloadConfig):
            return text
        text = text.strip().lower()
        if text in ("", "off", "none"):
            return None
        bits = text.removesuffix("bit").removesuffix("-")
        if not bits.isdigit():
            raise ValueError(f"offload must look like '2bit' or '1bit', got {text!r}")
        return cls(bits=int(bits))


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 64
    temperature: float = 0.0            # 0 = greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be within (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class StoreConfig:
    max_bytes: int = 8 << 30            # directory store garbage-collects above this
    memory_max_bytes: int = 2 << 30     # memory:// LRU bound
