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
    def rope(positions, like):
        return (positions + 1.0)[None, None, :, None]

    @staticmethod
    def rotate(k_pre, positions, first_layer=0, rope=None):
        return k_pre * (rope if rope is not None else _ScaleRope.rope(positions, k_pre))


def _cache(share: float, window: int = 0) -> tuple[PropagatingCache, torch.Tensor]:
    """Every stale value and pre-RoPE key: its own position (so the rotated key is p * (p + 1))."""
    tokens = _prompt()
    pos = torch.arange(30.0)[None, None, :, None].expand(LAYERS, HEADS, -1, DIM)
    cache = KVCache(pos * (pos + 1), pos.clone())
    reusable = torch.zeros(30, dtype=torch.bool)
    reusable[2:26] = True
    return PropagatingCache(cache, tokens, reusable, share, pos.clone(), _ScaleRope(), window), cache.v.clone()


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



def test_a_window_lends_the_mean_correction_of_the_nearest_recomputed_tokens_on_each_side():
    """window=2: a stale token takes the share of the mean of up to 2 recomputed tokens' corrections on each side,
    within its chunk."""
    cache, before = _cache(0.5, window=2)
    # chunk 0 at [2, 14): 6, 8, 10 and 12 recomputed, moved by +4, +8, −4 and +12; chunk 1 gets nothing
    _write(cache, 0, [6, 8, 10, 12], [10.0, 16.0, 6.0, 24.0])
    v = cache.v[0, 0, :, 0] - before[0, 0, :, 0]
    assert v[9] == pytest.approx(0.5 * (4 + 8 - 4 + 12) / 4)            # two on each side
    assert v[7] == pytest.approx(0.5 * (4 + 8 - 4) / 3)                 # one on the left (6): the sink lends nothing
    assert v[11] == pytest.approx(0.5 * (8 - 4 + 12) / 3)               # one on the right
    assert v[13] == pytest.approx(0.5 * (-4 + 12) / 2)                  # none on the right
    assert torch.equal(v[14:26], torch.zeros(12))
    k = cache.k[0, 0, :, 0]
    assert k[13] == (13.0 + 2.0) * 14                          # keys alike, rotated to the stale token's position


def test_tokens_between_chunks_take_nothing_and_each_chunk_borrows_only_from_its_own():
    """The corrections are added over the span from the first chunk to the last: a separator inside that span
    stays as it was, and a chunk's stale tokens never borrow across it."""
    segs = [Segment(0, 2, "prefix"), Segment(2, 12, "a", chunk=0), Segment(12, 14, "sep"),
            Segment(14, 24, "b", chunk=1), Segment(24, 28, "question")]
    tokens = TokenizedPrompt(list(range(28)), segs)
    pos = torch.arange(28.0)[None, None, :, None].expand(LAYERS, HEADS, -1, DIM)
    cache = KVCache(pos * (pos + 1), pos.clone())
    reusable = torch.zeros(28, dtype=torch.bool)
    reusable[2:12] = reusable[14:24] = True
    before = cache.v.clone()
    for window in (0, 2):
        prop = PropagatingCache(KVCache(cache.k.clone(), cache.v.clone()), tokens, reusable, 1.0,
                                pos.clone(), _ScaleRope(), window)
        _write(prop, 0, [10, 20], [20.0, 10.0])          # chunk 0 moved +10, chunk 1 moved −10
        v = prop.v[0, 0, :, 0] - before[0, 0, :, 0]
        assert torch.equal(v[[12, 13, 24, 25]], torch.zeros(4)), window
        assert torch.equal(v[[6, 7, 11]], torch.full((3,), 10.0)), window
        assert torch.equal(v[[18, 19, 23]], torch.full((3,), -10.0)), window
