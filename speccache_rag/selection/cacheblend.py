"""CacheBlend: recompute layers 0..c over every token, keep the tokens whose V moved most at layer c."""
from __future__ import annotations

import torch

from ..runner import KVCache, run_layers
from .base import Selection, adaptive_budget, top_positions
from .registry import blend_selector


@blend_selector("cacheblend")
@torch.inference_mode()
def cacheblend_prefill(ops, cache: KVCache, sel: Selection, always: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blend ``cache`` (reused chunks loaded) in place → (last-token logits, positions recomputed past layer c).

    always: positions without cached KV, recomputed at every layer.
    """
    c = min(sel.config.cacheblend_check_layer, ops.num_layers - 1)
    n = len(sel.tokens)
    v_cached = cache.v[c, :, :n].clone()                                    # [KVH, N, D]
    h = run_layers(ops, cache, ops.embed(sel.tokens.ids.to(sel.device)), torch.arange(n, device=sel.device),
                   layers=range(c + 1))
    # float32: bfloat16 squared distances keep ~3 digits and tie near the top-r threshold
    deviation = (cache.v[c, :, :n].float() - v_cached.float()).pow(2).sum(dim=(0, 2))      # [N]
    candidates = sel.reusable_positions
    chosen = top_positions(deviation, candidates, min(sel.budget, adaptive_budget(deviation[candidates], sel.config)))
    keep = torch.cat([chosen, always]).unique()                             # sorted
    h = run_layers(ops, cache, h[keep], keep, layers=range(c + 1, ops.num_layers))
    return ops.logits(h[-1]), keep
