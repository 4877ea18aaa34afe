"""Draft deviation (method ``deviation``): CacheBlend's idea — recompute the tokens whose state the other
chunks change most — with the draft doing the measuring.

For every chunk token: the mean, over the draft's last ``draft_layers`` of layers, of ‖h_prompt − h_alone‖,
where h_prompt is its residual when the draft reads the whole prompt and h_alone when it reads the chunk
alone after its sink (the engine's chunk-KV policy in the draft's tokens, as the stored KV was computed).
Then the paper's steps 2 and 3. The chunk-alone passes run at query time, one per reused chunk, so the
draft reads the chunk text twice; storing h_alone with the chunk at ingestion would remove that cost but
change the store format, which the measured quality (docs/benchmarks.md) does not justify.
"""
from __future__ import annotations

import torch

from ..prompt import TokenizedPrompt, sink_token_ids
from .base import Selection, deep_layers
from .registry import position_selector
from .draft_spans import select_by_draft


@torch.inference_mode()
def deviation_scores(sel: Selection, draft_tokens: TokenizedPrompt) -> torch.Tensor:
    """How far each draft chunk token's deep residual moves between the chunk alone and the prompt → [Nd]."""
    draft = sel.draft
    layers = deep_layers(draft.num_layers, sel.config.draft_layers)
    in_prompt = sel.hidden_states(draft, draft_tokens.ids)
    sink = torch.tensor(sink_token_ids(sel.draft_tokenizer, sel.sink), dtype=torch.long, device=draft.device)
    reused = sel.reused_chunks()
    scores = torch.zeros(len(draft_tokens), device=draft.device)
    for seg in draft_tokens.chunk_segments():
        if seg.chunk not in reused or seg.end == seg.start:
            continue
        alone = sel.hidden_states(draft, torch.cat([sink, draft_tokens.ids[seg.start:seg.end].to(draft.device)]))
        moved = [(in_prompt[i][seg.start:seg.end].float() - alone[i][sink.numel():].float()).norm(dim=-1)
                 for i in layers]
        scores[seg.start:seg.end] = torch.stack(moved).mean(0)
    return scores


@position_selector("deviation")
def deviation_select(sel: Selection, ops=None) -> torch.Tensor:
    return select_by_draft(sel, lambda draft_tokens: deviation_scores(sel, draft_tokens))
