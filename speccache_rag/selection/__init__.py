"""Which reusable tokens the target recomputes: one module per method family.

Every selector returns positions among ``Selection.reusable`` (tokens whose KV came from the
store), at most ``Selection.budget`` of them; the engine always adds the tokens that have no
cached KV (template text, question, store misses).
"""
from .base import Selection, budget_for, top_positions
from .cacheblend import cacheblend_prefill
from .oracle import oracle_select
from .question_attention import qattn_prefill
from .speculative import speculative_select
from .static import epic_select, random_select

__all__ = ["Selection", "budget_for", "top_positions", "cacheblend_prefill", "oracle_select", "qattn_prefill",
           "speculative_select", "epic_select", "random_select"]
