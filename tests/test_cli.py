"""The ``speccache-rag`` command line, run in-process on the real SmolLM2 and the shipped demo documents.

Every command loads its model through ``speccache_rag.models.load``; the tests point that at the
session's already-loaded SmolLM2, so the model is loaded once for the whole file. The demo store is
filled once per module (the first ``precompute``) and shared by ``ask`` and ``demo``.
"""
from __future__ import annotations

import contextlib
import json
import re
from io import StringIO

import pytest

from speccache_rag import cli, models
from speccache_rag.chunking import (Document, approx_tokens, chunk_documents, chunk_text, load_documents,
                                    rank_chunks, token_counter)
from speccache_rag.data import demo_dir, demo_documents, demo_questions

DEMO = str(demo_dir())
QUESTION = "How many members does the Kettlewick Cooperative have?"


@pytest.fixture
def shared_model(smollm2, monkeypatch):
    """Make ``models.load("smollm2-135m")`` return the session's model; other names load as usual."""
    real_load = models.load

    def load(name, *args, **kwargs):
        return smollm2 if str(name) == "smollm2-135m" else real_load(name, *args, **kwargs)

    monkeypatch.setattr(models, "load", load)
    return smollm2


@pytest.fixture(scope="module")
def filled_store(tmp_path_factory, smollm2):
    """A directory store holding the demo chunks, and the output of the ``precompute`` that filled it."""
    store = tmp_path_factory.mktemp("cli") / "kv"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(models, "load", lambda name, *a, **k: smollm2)
        out, err = StringIO(), StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(["precompute", DEMO, "--store", str(store)])
    return store, code, out.getvalue(), err.getvalue()


def _stat(stderr: str, name: str) -> int:
    m = re.search(rf"\b{name}=(\d+)", stderr)
    assert m, f"no {name}= in stderr: {stderr!r}"
    return int(m.group(1))


# --------------------------------------------------------------------------------------------------
# demo data and chunking (no model)
# --------------------------------------------------------------------------------------------------
def test_demo_data_is_shipped_and_consistent(demo_docs):
    names = [n for n, _ in demo_docs]
    assert len(names) >= 6
    for name, text in demo_docs:
        assert 150 <= len(text.split()) <= 320, name
    questions = demo_questions()
    assert len(questions) >= 4
    assert sum(len(q["sources"]) >= 2 for q in questions) >= 2      # bridge questions
    texts = dict(demo_docs)
    for q in questions:
        assert set(q["sources"]) <= set(names)
        assert any(q["answer"] in texts[s] for s in q["sources"]), q


def test_chunking_respects_budget_and_is_deterministic():
    text = "# Title\n\n" + "\n\n".join(f"Paragraph {i}. " + "word " * (20 + 7 * i) for i in range(12))
    a = chunk_text(text, 64)
    assert a == chunk_text(text, 64)
    assert len(a) > 1 and all(approx_tokens(c) <= 64 for c in a)
    assert all(c.startswith("# Title") for c in a)                    # heading repeated in every chunk
    # nothing lost: every paragraph's words appear, in order
    body = " ".join(c.removeprefix("# Title").strip() for c in a)
    assert re.findall(r"Paragraph \d+", body) == [f"Paragraph {i}" for i in range(12)]
    # a single paragraph far over the budget is cut at sentences, then between words
    assert all(approx_tokens(c) <= 32 for c in chunk_text("One sentence. " * 40 + "x" * 80 + " y" * 200, 32))
    with pytest.raises(ValueError):
        chunk_text(text, 4)


def test_demo_chunks_with_real_tokenizer_fit_and_retrieve_the_answers(smollm2):
    _, tok = smollm2
    count = token_counter(tok)
    chunks = chunk_documents(load_documents([DEMO]), 256, count)
    assert all(count(c.text) <= 256 for c in chunks)
    for q in demo_questions():
        top = [chunks[i] for i in rank_chunks(q["question"], [c.text for c in chunks], 3)]
        assert any(q["answer"] in c.text for c in top), (q["question"], [c.label for c in top])


def test_load_documents_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_documents([tmp_path / "missing"])
    with pytest.raises(FileNotFoundError, match="no .txt or .md files"):
        load_documents([tmp_path])
    (tmp_path / "a.md").write_text("hello")
    (tmp_path / ".hidden.md").write_text("secret")
    assert [d.text for d in load_documents([tmp_path, tmp_path / "a.md"])] == ["hello"]
    assert chunk_documents([Document("x", "  \n\n ")]) == []


def test_a_file_that_is_not_text_is_skipped_with_one_warning_unless_strict(tmp_path):
    (tmp_path / "a.md").write_text("hello")
    (tmp_path / "b.txt").write_bytes(b"\xff\xfe\x00binary\x9c")
    (tmp_path / "c.md").write_text("world")
    warned: list[str] = []
    docs = load_documents([tmp_path], warn=warned.append)
    assert [d.text for d in docs] == ["hello", "world"]
    assert docs.skipped == [(str(tmp_path / "b.txt"), "not UTF-8 text")]
    assert warned == [f"skipped {tmp_path / 'b.txt'}: not UTF-8 text"]
    with pytest.raises(ValueError, match="b.txt is not UTF-8 text"):
        load_documents([tmp_path], strict=True)


# --------------------------------------------------------------------------------------------------
# commands on the real model
# --------------------------------------------------------------------------------------------------
def test_precompute_then_again_is_idempotent(filled_store, shared_model, capsys):
    store, code, out, err = filled_store
    assert code == 0, err
    m = re.search(r"(\d+) chunks from (\d+) documents: (\d+) new entries", out)
    assert m, out
    n_chunks, n_docs, new = map(int, m.groups())
    assert n_docs == len(demo_documents()) and new == n_chunks > n_docs
    assert "precompute KV" in err                                       # the progress bar

    assert cli.main(["precompute", DEMO, "--store", str(store)]) == 0
    again = capsys.readouterr().out
    assert f"{n_chunks} chunks from {n_docs} documents: 0 new entries, {n_chunks} already stored" in again


@pytest.mark.parametrize("method", ["full", "speccache"])
def test_ask_answers_from_the_documents(filled_store, shared_model, capsys, method):
    store = filled_store[0]
    argv = ["ask", QUESTION, "--docs", DEMO, "--store", str(store), "--method", method, "--max-new-tokens", "12"]
    if method == "speccache":
        argv.append("--stream")
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "212" in out, out
    assert f"method={method}" in err and "ttft=" in err
    prompt = _stat(err, "prompt_tokens")
    if method == "full":
        assert _stat(err, "reused") == 0 and _stat(err, "recomputed") == prompt
    else:
        reused = _stat(err, "reused")
        assert reused > 0 and reused + _stat(err, "recomputed") == prompt
        assert _stat(err, "cache_hits") == 3 and _stat(err, "cache_misses") == 0
        assert "not in the store" not in err


def test_ask_with_offloaded_decoding(filled_store, shared_model, capsys):
    argv = ["ask", QUESTION, "--docs", DEMO, "--store", str(filled_store[0]), "--max-new-tokens", "12"]
    assert cli.main(argv) == 0
    plain = capsys.readouterr().out
    assert cli.main([*argv, "--offload", "2bit", "--offload-topk", "100000"]) == 0   # k ≥ context: exact
    out, err = capsys.readouterr()
    assert out == plain and "212" in out
    m = re.search(r"offload=2bit topk=100000 resident=[\d.]+MiB \(([\d.]+) of full KV", err)
    assert m and float(m.group(1)) > 1, err              # a fetch buffer that holds every row, on top
    assert cli.main([*argv, "--offload", "1bit"]) == 0
    m = re.search(r"offload=1bit topk=64 resident=[\d.]+MiB \(([\d.]+) of full KV", capsys.readouterr().err)
    assert m and float(m.group(1)) < 0.5
    assert cli.main([*argv, "--offload", "3bits"]) == 2
    assert "expected 2bit or 1bit" in capsys.readouterr().err


def test_demo_end_to_end(filled_store, shared_model, capsys):
    assert cli.main(["demo", "--store", str(filled_store[0]), "--max-new-tokens", "8", "--target", "smollm2-135m",
                     "--draft", "smollm2-135m", "--method", "speccache"]) == 0
    out, err = capsys.readouterr()
    n = len(demo_questions())
    assert re.search(r"^correctness gate: \d+ methods ok", err, re.M)       # its own line, at load time
    assert "0 new KV entries" in out                                    # the shared store was already full
    assert len(re.findall(r"^\s+full\s+TTFT", out, re.M)) == n
    assert len(re.findall(r"^\s+speccache\s+TTFT", out, re.M)) == n
    assert len(re.findall(r"TTFT full/speccache = \d+\.\d+x; reused [1-9]\d*", out)) == n
    assert out.count("cache hits 3/3") == n
    assert len(re.findall(r"same answer as full: (yes|no)$", out, re.M)) == n
    assert re.search(rf"Summary over {n} questions \(float32\): TTFT full/speccache geometric mean \d+\.\d+x "
                     rf"\(per question .*; \d/{n} faster than full\).*identical to full: \d/{n}", out)


def test_precompute_skips_a_file_that_is_not_text_unless_strict(shared_model, tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text(demo_documents()[0][1])
    (docs / "c.md").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    argv = ["precompute", str(docs), "--store", str(tmp_path / "kv")]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert err.count("warning: skipped") == 1 and f"{docs / 'c.md'}: not UTF-8 text" in err
    assert re.search(r"chunks from 1 documents: \d+ new entries.*; skipped 1 unreadable file;", out), out
    assert re.search(r"^correctness gate: \d+ methods ok in [\d.]+ s", err, re.M), err
    assert cli.main([*argv, "--strict"]) == 2
    assert "c.md is not UTF-8 text" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# user errors: one line, exit status 2, no traceback, no model load
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["ask", QUESTION, "--docs", DEMO, "--ratio", "1.5"], "--ratio must be within [0, 1]"),
    (["ask", "   ", "--docs", DEMO], "the question is empty"),
    (["ask", QUESTION, "--docs", DEMO, "--target", "no-such-model", "--store", "memory://"], "unknown model"),
    (["ask", QUESTION, "--docs", "/no/such/docs"], "no such file or directory"),
    (["precompute", "/no/such/docs", "--store", "memory://"], "no such file or directory"),
    (["ask", QUESTION, "--docs", DEMO, "--method", "bogus"], "invalid choice"),
    (["demo", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    ([], "required"),
])
def test_user_errors_exit_2_with_one_line(argv, message, capsys, monkeypatch):
    def no_load(name, *args, **kwargs):
        models.resolve(name)                                            # unknown names fail here
        pytest.fail(f"{name} was loaded")

    monkeypatch.setattr(models, "load", no_load)
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert "Traceback" not in err


def test_questions_json_is_valid_json():
    data = json.loads((demo_dir() / "questions.json").read_text())
    assert all({"question", "answer", "sources"} <= set(q) for q in data)
