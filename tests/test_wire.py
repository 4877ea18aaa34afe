"""The wire protocol (speccache_rag/wire.py): what clients build is what the connector reads."""
import pytest

from speccache_rag import RAGPrompt, ReuseConfig, wire


def test_a_query_built_by_a_client_reads_back_whole():
    prompt = RAGPrompt(chunks=["a b c", "d e"], question="q?")
    reuse = ReuseConfig(method="qattn", recompute_ratio=0.2, qattn_sink=4)
    sent = wire.wrap(wire.query(reuse, "t1", spans=[[3, 8], [9, 12]], prompt=prompt))
    got = wire.parse(wire.read(sent["kv_transfer_params"]), n_tokens=20)
    assert (got.op, got.tag, got.method, got.recompute_ratio) == ("query", "t1", "qattn", 0.2)
    assert got.spans == [[3, 8], [9, 12]] and got.prompt == prompt
    assert ReuseConfig(method=got.method, recompute_ratio=got.recompute_ratio, **got.reuse) == reuse


def test_a_query_without_reuse_leaves_the_server_its_defaults():
    got = wire.parse(wire.query(None, "t", chunks=["k1", "k2"]), n_tokens=10)
    assert got.method is None and got.recompute_ratio is None and got.chunks == ["k1", "k2"] and got.spans is None


def test_precompute_and_info_requests():
    got = wire.parse(wire.precompute(1, 6, "t"), n_tokens=8)
    assert (got.op, got.spans) == ("precompute", [[1, 6]])
    assert wire.parse(wire.info(["a", "b"]), n_tokens=1).keys == ["a", "b"]


@pytest.mark.parametrize("params, match", [
    ("not an object", "must be an object"),
    ({"spans": [[5, 9], [8, 12]]}, "sorted, non-overlapping"),
    ({"spans": [[5, 30]]}, "inside the prompt"),
    ({"chunks": "k1"}, "list of store keys"),
    ({"reuse": [1]}, "ReuseConfig fields"),
    ({"op": "precompute", "span": [0, 20]}, "outside the prompt"),
    ({"op": "delete"}, "unknown op"),
    ({"op": "precompute"}, "malformed"),
    ({"spans": None}, "malformed"),
])
def test_bad_parameters_are_named(params, match):
    with pytest.raises(ValueError, match=match):
        wire.parse(params, n_tokens=20)


def test_reports_are_bounded_and_read_once():
    box = wire.Reports(limit=2)
    for tag in "abc":
        box.publish(tag, {"tag": tag})
    assert box.pop("a") is None                 # the oldest went when the third came
    assert box.pop("c") == {"tag": "c"} and box.pop("c") is None
