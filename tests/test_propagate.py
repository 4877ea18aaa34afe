"""Stale chunk tokens borrow their nearest recomputed neighbour's KV correction (propagate.py)."""
import pytest
import torch

from speccache_rag.prompt import Segment, TokenizedPrompt
from speccache_rag.propagate import SINK_TOKENS, PropagatingCache
from speccache_rag.runner import KVCache

LAYERS, HEADS, DIM = 2, 1, 3


def _prompt() -> TokenizedPrompt:
    """A 2-token prefix, chunk 0 at [2, 14), chunk 1 at [14, 26), a 4-token question at [26, 30)."""
    segs = [Segment(0, 2, "prefix"), Segment(2, 14, "a", chunk=0), Segment(14, 26, "b", chunk=1),
            Segment(26, 30, "question")]
    return TokenizedPrompt(list(range(30)), segs)


class _ScaleRope:
    """Stands in for a model's RoPE: "rotating" to position p multiplies by p + 1, so a key correction must
    reach the stale token rotated to the stale token's own position."""

    @staticmethod
    def rotate(k_pre, positions, first_layer=0):
        return k_pre * (positions + 1.0)[None, None, :, None]


def _cache(share: float) -> tuple[PropagatingCache, torch.Tensor]:
    """Every stale value and pre-RoPE key: its own position (so the rotated key is p * (p + 1))."""
    tokens = _prompt()
    pos = torch.arange(30.0)[None, None, :, None].expand(LAYERS, HEADS, -1, DIM)
    cache = KVCache(pos * (pos + 1), pos.clone())
    reusable = torch.zeros(30, dtype=torch.bool)
    reusable[2:26] = True
    return PropagatingCache(cache, tokens, reusable, share, pos.clone(), _ScaleRope()), cache.v.clone()


def _write(cache: PropagatingCache, layer: int, positions: list[int], values: list[float]) -> None:
    """Recompute ``positions`` at ``layer``: value and pre-RoPE key both ``values``."""
    pos = torch.tensor(positions)
    v = torch.tensor(values)[None, :, None].expand(HEADS, -1, DIM).clone()
    cache.write(layer, pos, v, _ScaleRope.rotate(v[None], pos)[0], v)


def test_stale_tokens_take_a_share_of_their_nearest_recomputed_neighbours_correction():
    cache, before = _cache(0.5)
    # chunk 0: positions 8 and 12 recomputed, moved by +10 and −20; the question's rows (not reused) too
    _write(cache, 0, [8, 12, 27, 28], [18.0, -8.0, 100.0, 100.0])
    v = cache.v[0, 0, :, 0]
    for p in (6, 7, 9, 10):                      # nearer to 8 (10 is a tie: the left one)
        assert v[p] == before[0, 0, p, 0] + 5.0, p
    for p in (11, 13):                           # nearer to 12
        assert v[p] == before[0, 0, p, 0] - 10.0, p
    assert torch.equal(v[8], torch.tensor(18.0)) and torch.equal(v[12], torch.tensor(-8.0))
    untouched = [*range(0, 2 + SINK_TOKENS), *range(14, 26)]        # prefix, chunk 0's sink, chunk 1 (no source)
    assert torch.equal(v[untouched], before[0, 0, untouched, 0])
    assert torch.equal(cache.v[1], before[1])    # other layers wait for their own writes
    # the keys moved alike, before RoPE, then rotated to each stale token's own position
    k = cache.k[0, 0, :, 0]
    assert k[9] == (9.0 + 5.0) * 10 and k[13] == (13.0 - 10.0) * 14 and k[20] == 20.0 * 21
    assert cache.keys_pre[0, 0, 9, 0] == 14.0


def test_only_a_first_recompute_at_a_layer_lends_and_recomputed_tokens_take_nothing():
    cache, before = _cache(1.0)
    _write(cache, 0, [8], [18.0])                # +10 for the stale tokens of chunk 0
    assert cache.v[0, 0, 9, 0] == 19.0
    _write(cache, 0, [8, 9], [18.0, 30.0])       # 8 is not stale any more: only 9 lends (30 − 19 = +11)
    assert cache.v[0, 0, 8, 0] == 18.0 and cache.v[0, 0, 9, 0] == 30.0
    for p in (7, 10, 13):                        # the nearest among this write's lenders: 9
        assert cache.v[0, 0, p, 0] == before[0, 0, p, 0] + 10.0 + 11.0, p


def test_chunk_starts_neither_lend_nor_take():
    cache, before = _cache(1.0)
    _write(cache, 0, [2, 3], [50.0, 50.0])       # chunk 0's sink tokens
    assert torch.equal(cache.v[0, 0, 4:, 0], before[0, 0, 4:, 0])


def test_auto_share_is_fitted_per_distance_on_the_recomputed_pairs():
    """share="auto": pairs of neighbouring recomputed tokens whose corrections are (1, 0.5) × u fit 0.8 at distance
    1; lone ones 10 apart whose corrections alternate in sign fit −1, clamped to 0; the empty bins between take
    the nearer bin's factor. A stale token takes the factor of its own distance to the neighbour it borrows from."""
    n = 610
    tokens = TokenizedPrompt(list(range(n)), [Segment(0, 2, "prefix"), Segment(2, 602, "a", chunk=0),
                                              Segment(602, n, "question")])
    zeros = torch.zeros(1, 1, n, 1)
    reusable = torch.zeros(n, dtype=torch.bool)
    reusable[2:602] = True
    cache = PropagatingCache(KVCache(zeros.clone(), zeros.clone()), tokens, reusable, "auto", zeros.clone(), _ScaleRope())
    pairs = [p for j in range(20) for p in (10 + 10 * j, 11 + 10 * j)]
    lone = [250 + 10 * j for j in range(20)]
    moves = [m for _ in range(20) for m in (1.0, 0.5)] + [(-1.0) ** j for j in range(20)]
    sources = torch.tensor(pairs + lone)
    d = torch.tensor(moves)[None, :, None]
    assert torch.allclose(cache.fitted(sources, d), torch.tensor([0.8, 0.8, 0.8, 0.0]))

    v = torch.tensor(moves)[None, :, None]
    cache.write(0, sources, v, _ScaleRope.rotate(v[None], sources)[0], v)
    assert cache.v[0, 0, 12, 0] == pytest.approx(0.8 * 0.5)     # 1 from source 11
    assert cache.v[0, 0, 255, 0] == pytest.approx(0.8 * 1.0)    # 5 from source 250
    assert cache.v[0, 0, 230, 0] == 0.0                          # 20 from source 250: the far bin's 0
