"""Benchmark methods: names ↔ ReuseConfig, and the experimental ``static`` selector beyond the paper.

Method names used in suites and results:
    full · reuse · epic@R (the largest k within the budget) · epic-kK · cacheblend@R · speccache@R · norm@R ·
    deviation@R · qattn@R · random@R · oracle@R · static@R

``static`` is an experiment (issue 5, part 6), implemented here on top of the engine without touching it:
draft scores computed per chunk at ingestion (chunk alone, after the draft's sink under the engine's
chunk-KV policy); zero draft cost at query time, but no cross-chunk signal. It feeds the same span
expansion and cross-tokenizer mapping as speccache. (``deviation``, the other experiment of issue 5, is now
an engine method; ``qattn2``, qattn in two rounds, was measured and removed: docs/benchmarks.md.)
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from ..config import AUTO_METHODS, DRAFT_METHODS, METHODS, ReuseConfig
from ..engine import SpecCacheEngine
from ..layers import HFLayers
from ..prompt import RAGPrompt, TokenizedPrompt, sink_token_ids, tokenize_piece
from ..runner import full_prefill
from ..selection import SELECTORS, Selection, hidden_states
from ..selection.base import deep_layer_norms
from ..selection.registry import recompute_picked
from ..selection.draft_spans import select_by_draft

EXPERIMENTS = ("static",)     # bench-only selectors (BenchEngine.selector), each scoring with the draft
FAMILIES = tuple(m for m in METHODS if m not in ("full", "reuse")) + EXPERIMENTS   # the ones named FAMILY@R
DRAFT_FAMILIES = DRAFT_METHODS + EXPERIMENTS


@dataclass(frozen=True)
class MethodSpec:
    name: str
    family: str                 # full, reuse, or one of FAMILIES
    ratio: float | str | None   # nominal recompute ratio (None: full, reuse, epic-kK; "auto")
    epic_k: int | None = None
    auto_mass: float | None = None   # "FAMILY@auto:M": ReuseConfig.auto_mass (None: its default)
    options: tuple[tuple[str, object], ...] = ()   # "+key=value" suffixes: ReuseConfig fields

    @property
    def uses_draft(self) -> bool:
        return self.family in DRAFT_FAMILIES

    def reuse_config(self) -> ReuseConfig:
        # a name is one configuration for good: runs written before the default took propagation resume and
        # pair with new ones unchanged, so the default is spelled out (suites.DEFAULT)
        options = {"propagate": 0.0, "propagate_window": 0, **dict(self.options)}
        if self.family == "full":
            return ReuseConfig(method="full", recompute_ratio=1.0, **options)
        if self.family == "reuse":
            # naive reuse is the baseline every KL gap is measured from: the plain chunks, unless asked
            return ReuseConfig(method="reuse", recompute_ratio=0.0, **{"neighbors": "off", **options})
        if self.family == "epic" and self.epic_k is not None:
            return ReuseConfig(method="epic", epic_k=self.epic_k, recompute_ratio=1.0, **options)
        engine_method = "norm" if self.family in EXPERIMENTS else self.family
        mass = {} if self.auto_mass is None else {"auto_mass": self.auto_mass}
        return ReuseConfig(method=engine_method, recompute_ratio=self.ratio, **mass, **options)


def _option(item: str) -> tuple[str, object]:
    """``"sink=4"`` → ("qattn_sink", 4): a ReuseConfig field, ``qattn_`` implied where that names one; ranges
    as ``0.25-1``."""
    key, sep, raw = item.partition("=")
    fields = {f.name: f for f in dataclasses.fields(ReuseConfig)}
    key = key if key in fields else f"qattn_{key}"
    if not sep or key not in fields or key in ("method", "recompute_ratio"):
        names = ", ".join(k.removeprefix("qattn_") for k in fields if k not in ("method", "recompute_ratio"))
        raise ValueError(f"unknown method option {item!r}: use +FIELD=VALUE with a ReuseConfig field ({names})")
    default = fields[key].default
    if default is None:                           # epic_k
        return key, int(raw)
    if isinstance(default, tuple):
        return key, tuple(float(x) for x in raw.split("-"))
    if isinstance(default, int):
        return key, int(raw)
    if isinstance(default, float):
        return key, float(raw)
    return key, raw


def parse_method(name: str) -> MethodSpec:
    """``"speccache@0.15"``, ``"qattn@auto:0.9"`` or ``"qattn@0.15+sink=4+layers=0-1"`` → MethodSpec; raises
    ValueError with the accepted forms."""
    base, *extra = name.split("+")
    if extra:
        spec = parse_method(base)
        options = tuple(_option(e) for e in extra)
        spec = dataclasses.replace(spec, name=name, options=options)
        spec.reuse_config()                       # a bad value fails here, before any model loads
        return spec
    if name in ("full", "reuse"):
        return MethodSpec(name, name, None)
    if name.startswith("epic-k"):
        try:
            return MethodSpec(name, "epic", None, epic_k=int(name[6:]))
        except ValueError:
            pass
    if "@" in name:
        family, _, r = name.partition("@")
        auto, colon, mass = r.partition(":")
        if family in AUTO_METHODS and auto == "auto":
            if not colon:
                return MethodSpec(name, family, "auto")
            value = _number(mass)
            if value is not None and 0.0 < value <= 1.0:
                return MethodSpec(name, family, "auto", auto_mass=value)
        ratio = _number(r)
        if family in FAMILIES and ratio is not None and 0.0 <= ratio <= 1.0:
            return MethodSpec(name, family, ratio)
    raise ValueError(f"unknown bench method {name!r}; use full, reuse, epic-kK, or FAMILY@R with FAMILY in "
                     f"{', '.join(FAMILIES)} and R in [0, 1] (or R = auto or auto:MASS with MASS in (0, 1], "
                     f"for {', '.join(AUTO_METHODS)})")


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


class BenchEngine(SpecCacheEngine):
    """The product engine plus: per-chunk draft scores for the ``static`` experiment, an optional memo of
    whole-prompt hidden states (quality pass only: draft scores do not depend on r, so one draft
    prefill serves every r), and the method variant to run."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("gate", False)           # the bench measures each method as asked, and times it
        self.variant: str | None = None            # "static" | None (set first: the engine warms up when built)
        self.fraction = ReuseConfig().draft_layers
        # keyed by (draft, chunk text): the pairs of one target keep their drafts' artifacts side by side
        self._static: dict[tuple[int, str], torch.Tensor] = {}
        self._memo: dict[tuple, dict[int, torch.Tensor]] | None = None
        super().__init__(*args, **kwargs)
        # the bench's own pipeline: the product's blender with the memo and the experiments plugged in
        self.blender.hidden_states, self.blender.selector = self.capture, self.selector
        self._draft_sink = sink_token_ids(self.draft_tokenizer, self.sink)
        self._layer_ops = {id(self.target): self.ops, id(self.draft): self.draft_ops}

    def use_draft(self, draft, draft_tokenizer) -> None:
        """Score with another draft from now on (the target, its store, the memo and every draft's
        ingestion artifacts are kept), so the pairs of one target share its chunk caches, its full-prefill
        reference and its timing rounds."""
        if id(draft) not in self._layer_ops:      # one LayerOps per model: memo keys are ids and stay valid
            self._layer_ops[id(draft)] = HFLayers(draft)
        self.draft, self.draft_tokenizer, self.draft_ops = draft, draft_tokenizer, self._layer_ops[id(draft)]
        self._draft_sink = sink_token_ids(draft_tokenizer, self.sink)

    # ---- ingestion-time draft artifacts ------------------------------------------------------
    @torch.inference_mode()
    def prepare_draft(self, texts: list[str]) -> None:
        for text in texts:
            key = (id(self.draft_ops), text)
            if key in self._static:
                continue
            ids, _ = tokenize_piece(self.draft_tokenizer, text)
            capture: dict[int, torch.Tensor] = {}
            full_prefill(self.draft_ops, torch.tensor(self._draft_sink + ids), capture=capture)
            skip = len(self._draft_sink)
            self._static[key] = deep_layer_norms({i: h[skip:] for i, h in capture.items()},
                                                 self.draft_ops.num_layers, self.fraction)

    def forget_draft(self) -> None:
        self._static.clear()

    # ---- whole-prompt hidden states -----------------------------------------------------------
    @torch.inference_mode()
    def capture(self, ops, ids: torch.Tensor) -> dict[int, torch.Tensor]:
        key = (id(ops), tuple(ids.tolist()))
        if self._memo is not None and key in self._memo:
            return self._memo[key]
        cap = hidden_states(ops, ids)
        if self._memo is not None:
            self._memo[key] = cap
        return cap

    @contextlib.contextmanager
    def memoized(self):
        """Within: draft and oracle scoring reuse one prefill per (model, prompt), so every r of a method
        costs one scoring pass. Quality only — never around timed calls."""
        self._memo = {}
        try:
            yield self
        finally:
            self._memo = None

    # ---- selection ----------------------------------------------------------------------------
    def selector(self, method: str):
        if self.variant is None:
            return SELECTORS[method]

        def select(sel: Selection, ops=None) -> torch.Tensor:
            return select_by_draft(sel, self._static_scores)

        return recompute_picked(select)

    def _static_scores(self, draft_tokens: TokenizedPrompt) -> torch.Tensor:
        scores = torch.zeros(len(draft_tokens))
        for seg in draft_tokens.chunk_segments():
            s = self._static.get((id(self.draft_ops), seg.text))
            if s is None:
                raise KeyError("static scores missing for a chunk: call prepare_draft() at ingestion")
            scores[seg.start:seg.end] = s
        return scores

    def run(self, spec: MethodSpec, prompt: RAGPrompt, max_new_tokens: int, first_logits: bool = False,
            stop: tuple[str, ...] = ()):
        """generate() with the method ``spec`` (greedy)."""
        self.variant = spec.family if spec.family in EXPERIMENTS else None
        try:
            return self.generate(prompt, max_new_tokens=max_new_tokens, reuse=spec.reuse_config(),
                                 stop=stop, return_first_logits=first_logits)
        finally:
            self.variant = None
