"""Target question attention ("qattn"): the question picks the chunk tokens it needs, no draft involved.

The question and template tokens are recomputed anyway. Prefilling them first over the reused chunk
KV gives, in every layer, their attention over the chunk positions: the tokens the answer will read.
Those scores (question rows only, float32, only in the layers scored) choose the top-r chunk tokens;
then the chosen tokens — and every recomputed token after the first of them, whose KV read the stale
chunks — go through the model again. (ProphetKV, A³, FusionRAG score with the question's attention.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..prompt import TokenizedPrompt
from ..runner import KVCache, prefill, run_layers
from .base import Selection, adaptive_budget, top_positions
from .registry import blend_selector


def scored_layers(num_layers: int, span: tuple[float, float]) -> range:
    """Layer indices within the fraction ``span`` = (first, last) of the depth, at least one."""
    first = min(num_layers - 1, int(span[0] * num_layers))
    return range(first, max(first + 1, round(span[1] * num_layers)))


class QuestionAttention:
    """Accumulates, per key position, the attention the question rows pay it (mean over rows and layers; mean
    or max over heads).

    rows: indices into the recomputed tokens of the question rows; row_pos: their true positions [Q]."""

    def __init__(self, rows: torch.Tensor, row_pos: torch.Tensor, layers: range, scale: float, num_keys: int,
                 heads: str = "mean"):
        self.rows, self.row_pos, self.layers, self.scale, self.heads = rows, row_pos, layers, scale, heads
        self.scores = torch.zeros(num_keys, device=row_pos.device)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        if layer not in self.layers or self.rows.numel() == 0:
            return
        p = self.attention(q, k)
        self.scores[: k.shape[1]] += (p.amax(0) if self.heads == "max" else p.mean(0)) / len(self.layers)

    def attention(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """One layer's queries [H, S, D] and keys [KVH, T, D] → each head's attention over the keys, mean over
        the question rows [H, T]."""
        heads, kv_heads = q.shape[0], k.shape[0]
        # each key head serves a group of query heads: one product per group, no copy of the keys per head
        q = q[:, self.rows].float().reshape(kv_heads, -1, q.shape[-1])      # [KVH, G*Q, D]
        att = (q @ k.float().transpose(1, 2)).view(heads, -1, k.shape[1]) * self.scale       # [H, Q, T]
        att = att.masked_fill(torch.arange(k.shape[1], device=k.device)[None, :] > self.row_pos[:, None], float("-inf"))
        return att.softmax(-1).mean(dim=1)


def pool(scores: torch.Tensor, window: int) -> torch.Tensor:
    """Max over a centred window: a token next to an attended one is likely part of the same fact."""
    if window <= 1:
        return scores
    return F.max_pool1d(scores[None, None], window, stride=1, padding=window // 2)[0, 0, : scores.numel()]


def qattn_scores(probe: QuestionAttention, sel: Selection) -> torch.Tensor:
    """The probe's scores, pooled, with each chunk's first ``qattn_sink`` tokens (its private attention
    sink, as EPIC keeps) ahead of every other token."""
    cfg = sel.config
    scores = pool(probe.scores, cfg.qattn_pool).clone()
    if cfg.qattn_sink:
        for seg in sel.tokens.chunk_segments():
            scores[seg.start:min(seg.end, seg.start + cfg.qattn_sink)] += 1e3
    return scores


def question_probe(ops, sel: Selection, recomputed: torch.Tensor) -> QuestionAttention:
    """The probe for the first pass over ``recomputed`` (the always-recomputed positions): its question rows,
    in the configured layers."""
    rows = question_rows(sel, recomputed)
    layers = scored_layers(ops.num_layers, sel.config.qattn_layers)
    return QuestionAttention(rows, recomputed[rows], layers, ops.scaling,
                             len(sel.tokens), sel.config.qattn_heads)


def second_pass(probe: QuestionAttention, sel: Selection, recomputed: torch.Tensor, taken: torch.Tensor,
                share: float) -> tuple[torch.Tensor, torch.Tensor]:
    """After a pass over ``recomputed`` → (chosen positions, positions to recompute again): ``share`` of the
    budget, among candidates not ``taken`` by an earlier round. Recomputed tokens before the first chosen one
    read nothing stale: their pass is final; those after it (the question) are recomputed again. An earlier
    round's tokens are not: they read this round's as stale as any unchosen token, which keeps each round's
    cost to its own tokens."""
    cfg, candidates = sel.config, sel.reusable_positions
    budget = sel.budget
    if cfg.recompute_ratio == "auto":      # sized by the attention mass; the forced chunk sinks come on top
        reused = sel.reused_chunks()
        sinks = sum(min(cfg.qattn_sink, s.end - s.start) for s in sel.tokens.chunk_segments() if s.chunk in reused)
        budget = min(budget, adaptive_budget(pool(probe.scores, cfg.qattn_pool)[candidates], cfg) + sinks)
    candidates = candidates[~torch.isin(candidates, taken)]
    chosen = top_positions(qattn_scores(probe, sel), candidates, round((budget - taken.numel()) * share))
    if chosen.numel() == 0:
        return chosen, chosen
    return chosen, torch.cat([chosen, recomputed[recomputed > chosen[0]]]).unique()


def question_start(tokens: TokenizedPrompt) -> int:
    """Where the question rows begin: the first position after the last chunk (question, template suffix)."""
    chunks = tokens.chunk_segments()
    if not chunks:
        raise ValueError("question-attention selection needs a prompt with chunks")
    return chunks[-1].end


def question_rows(sel: Selection, always: torch.Tensor) -> torch.Tensor:
    """Of the always-recomputed positions, the indices of those after the last chunk (question, suffix), or
    of the last ``qattn_rows`` of them."""
    rows = (always >= question_start(sel.tokens)).nonzero().flatten()
    return rows[-sel.config.qattn_rows:] if sel.config.qattn_rows else rows


@blend_selector("qattn")
@torch.inference_mode()
def qattn_prefill(ops, cache: KVCache, sel: Selection, always: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blend ``cache`` (reused chunks loaded) in place → (last-token logits, positions recomputed at least once).

    With ``qattn_rounds`` = n > 1 the budget is spent in n equal parts, each chosen by the question's
    attention over the KV the earlier parts repaired (CacheBlend's gradual filtering, by attention): a
    question whose second hop sits in a passage that never saw the first can only find it once the first
    is repaired. A budget that covers every chunk token needs no choosing: one round, exact."""
    ids = sel.tokens.ids
    if sel.budget == 0:
        return prefill(ops, cache, ids[always], always), always
    rounds = sel.config.qattn_rounds if sel.budget < sel.reusable_positions.numel() else 1
    probe = question_probe(ops, sel, always)
    # the first pass's logits are wanted only where nothing is chosen after it
    h_last = run_layers(ops, cache, ops.embed(ids[always].to(ops.device)), always, observe=probe)[-1]
    logits, taken = None, always[:0]
    for r in range(rounds):
        chosen, again = second_pass(probe, sel, always, taken, share=1 / (rounds - r))
        if chosen.numel() == 0:
            break
        taken = torch.cat([taken, chosen])
        probe = question_probe(ops, sel, again) if r < rounds - 1 else None
        logits = prefill(ops, cache, ids[again], again, observe=probe)
    return (ops.logits(h_last) if logits is None else logits), torch.cat([taken, always]).unique()
