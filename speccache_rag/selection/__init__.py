"""Which reusable tokens the target recomputes: one module per method family, each registering itself.

Every selector chooses positions among ``Selection.reusable`` (tokens whose KV came from the store),
at most ``Selection.budget`` of them; the tokens that have no cached KV (template text, question,
store misses) are always recomputed. ``SELECTORS[method]`` runs one.
"""
from .base import Selection, adaptive_budget, budget_for, hidden_states, top_positions
from .registry import SELECTORS, blend_selector, position_selector
from . import cacheblend, deviation, norm, oracle, qattn, speccache, static  # noqa: F401  (they register)

__all__ = ["SELECTORS", "Selection", "adaptive_budget", "blend_selector", "budget_for", "hidden_states", "position_selector",
           "top_positions"]
