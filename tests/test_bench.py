"""The benchmark harness: data, metrics, method names, report format, and one real `bench --suite quick` run."""
import json
import re

import pytest
import torch

from speccache_rag.bench.data import (TASKS, load_longbench, make_example, prose_paragraphs, split_passages,
                                      synthetic)
from speccache_rag.bench.methods import parse_method
from speccache_rag.bench.metrics import (exact_match, f1_score, normalize_answer, rouge_l,
                                         string_match, task_scores)
from speccache_rag.bench.suites import DEFAULT, SUITES, SWEEP, get_suite
from speccache_rag.bench.ttft import TimingSuite
from speccache_rag.config import ReuseConfig
from speccache_rag.gate import first_token_fidelity


# ---- metrics -------------------------------------------------------------------------------------
def test_longbench_normalization_and_scores():
    assert normalize_answer("The  Eiffel-Tower, in Paris!") == "eiffeltower in paris"
    assert exact_match("the Paris.", "Paris") == 1.0
    assert f1_score("Paris France", "Paris") == pytest.approx(2 / 3)
    assert f1_score("London", "Paris") == 0.0
    assert string_match("Members: Ada Vorn, Bel Quist.", ["Ada Vorn", "Bel Quist", "Cy Tam"]) == pytest.approx(2 / 3)
    assert rouge_l("a b c d", "a b c d") == pytest.approx(1.0)
    assert 0 < rouge_l("the cat sat on the mat", "the cat lay on a mat") < 1
    s = task_scores("It was Kiagammere.", ["Kiagammere"], ["Kiagammere"])
    assert s["match"] == 1.0 and s["em"] == 0.0 and 0 < s["f1"] < 1


def test_first_token_fidelity():
    a = torch.tensor([2.0, 1.0, 0.0])
    assert first_token_fidelity(a, a) == {"kl": 0.0, "top1": 1.0}
    f = first_token_fidelity(a, torch.tensor([0.0, 3.0, 0.0]))
    assert f["kl"] > 0 and f["top1"] == 0.0


# ---- data ----------------------------------------------------------------------------------------
def test_prose_is_real_text():
    paras = prose_paragraphs()
    assert len(paras) > 100
    assert all(len(p) >= 150 and ">>>" not in p and "::=" not in p for p in paras)


@pytest.mark.parametrize("task", TASKS)
def test_generator_is_seeded_and_places_facts_in_distinct_chunks(task):
    a = make_example(task, 3, seed=7, n_chunks=6, chunk_tokens=128)
    assert a == make_example(task, 3, seed=7, n_chunks=6, chunk_tokens=128)
    assert a != make_example(task, 4, seed=7, n_chunks=6, chunk_tokens=128)
    assert len(a.chunks) == 6 and a.question and a.values
    assert len(set(a.gold_chunks)) == len(a.gold_chunks) == {"needle": 1, "bridge": 2, "aggregate": 3}[task]
    # each reference value appears in the gold chunks; for the bridge, the two hops are in different chunks
    joined = " ".join(a.chunks[i] for i in a.gold_chunks)
    assert all(v in joined for v in a.values)
    if task == "bridge":
        founder = re.search(r"was founded by ([^.]+)\.", a.chunks[a.gold_chunks[0]] + a.chunks[a.gold_chunks[1]])
        assert founder and sum(founder.group(1) in a.chunks[i] for i in a.gold_chunks) == 2


def test_synthetic_interleaves_tasks():
    exs = synthetic(2, seed=0, n_chunks=4, chunk_tokens=64)
    assert [e.task for e in exs] == list(TASKS) * 2
    assert len({e.id for e in exs}) == 6


def test_longbench_loader(tmp_path):
    rows = [
        {"input": "Who directed Film A?", "context": "Passage 1:\nFilm A\nFilm A was directed by Bob.\nPassage 2:\nBob\n"
                                                     "Bob was born in 1950.", "answers": ["Bob"], "_id": "x1",
         "dataset": "2wikimqa"},
        {"input": "", "context": "Alice: hi\nBob: hello\n\nAlice: bye", "answers": ["They greet."], "dataset": "samsum"},
    ]
    path = tmp_path / "lb.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    exs = load_longbench(path)
    assert exs[0].chunks == ["Film A\nFilm A was directed by Bob.", "Bob\nBob was born in 1950."]
    assert exs[0].metric == "f1" and exs[0].id == "x1"
    assert exs[1].metric == "rougeL" and exs[1].chunks and exs[1].question
    assert split_passages("no markers here") == ["no markers here"]
    (tmp_path / "bad.jsonl").write_text('{"input": "q"}\n')
    with pytest.raises(ValueError, match="missing field"):
        load_longbench(tmp_path / "bad.jsonl")


# ---- methods and suites --------------------------------------------------------------------------
def test_method_names():
    assert parse_method("speccache@0.15").reuse_config().recompute_ratio == 0.15
    assert parse_method("epic-k16").reuse_config().epic_k == 16
    assert parse_method("static@0.1").reuse_config().method == "norm"      # the norm family's spans and map
    assert parse_method("norm@0.15").uses_draft and parse_method("norm@0.15").reuse_config().method == "norm"
    assert parse_method("deviation@0.2").uses_draft and not parse_method("cacheblend@0.2").uses_draft
    auto = parse_method("qattn@auto:0.9").reuse_config()
    assert (auto.recompute_ratio, auto.auto_mass) == ("auto", 0.9)
    assert parse_method("qattn@auto").reuse_config().auto_mass == ReuseConfig().auto_mass
    opts = parse_method("qattn@0.15+sink=32+rounds=2+layers=0.25-1+heads=max+rows=4").reuse_config()
    assert (opts.qattn_sink, opts.qattn_rounds, opts.qattn_layers, opts.qattn_heads, opts.qattn_rows) == \
        (32, 2, (0.25, 1.0), "max", 4)
    assert parse_method("qattn@auto+auto_range=0.05-0.15").reuse_config().auto_range == (0.05, 0.15)
    # a name keeps the configuration it was measured with: the default's propagate only where spelled
    assert parse_method("qattn@0.15").reuse_config().propagate == 0.0 < ReuseConfig().propagate
    assert parse_method(DEFAULT).reuse_config() == ReuseConfig()
    # the suites that carry the product's claims measure what ships, not only the bare family name
    assert all(DEFAULT in get_suite(name).methods and DEFAULT in get_suite(name).ttft_methods
               for name in ("quality", "musique")) and DEFAULT in TimingSuite().methods
    assert parse_method("qattn@0.15+propagate=0.5").reuse_config().propagate_window == 0   # measured as the nearest
    for bad in ("nope", "speccache@2", "epic-kx", "speccache", "qattn@auto:0", "qattn@auto:x", "norm@auto:0.5",
                "qattn@0.15+bogus=1", "qattn@0.15+rounds=0", "qattn@0.15+sink", "qattn@0.15+propagate=2",
                "qattn@0.15+propagate_window=-1"):
        with pytest.raises(ValueError):
            parse_method(bad)


def test_static_scores_read_each_chunk_under_the_engines_sink_policy(smollm2):
    """The ``static`` experiment's ingestion-time draft pass follows the chunk-KV policy: behind the template
    prefix, the first chunk of a prompt reads exactly what it reads in the prompt, so its static norms equal
    its in-prompt norms; behind BOS alone they do not."""
    from speccache_rag.bench.methods import BenchEngine
    from speccache_rag.prompt import RAGPrompt, render
    from speccache_rag.selection import hidden_states
    from speccache_rag.selection.base import deep_layer_norms

    model, tok = smollm2
    chunks = ["Kiagammere was founded by Ilsa Varn in the valley of the river Oss.", "Ilsa Varn was born in Dulby."]
    tokens = render(RAGPrompt(chunks=chunks, question="Where was the founder of Kiagammere born?"), tok)
    first = tokens.chunk_segments()[0]
    gap = {}
    for sink in ("prefix", "bos"):
        engine = BenchEngine(model, tok, store="memory://", draft=model, draft_tokenizer=tok, sink=sink)
        engine.prepare_draft(chunks)
        static = engine._static_scores(tokens)[first.start:first.end]
        in_prompt = deep_layer_norms(hidden_states(engine.draft_ops, tokens.ids), engine.draft_ops.num_layers,
                                     engine.fraction)[first.start:first.end]
        gap[sink] = float((static - in_prompt).abs().max() / in_prompt.abs().max())
    assert gap["prefix"] < 1e-4 and gap["bos"] > 1e-2, gap


def test_suites_are_valid():
    for name in SUITES:
        get_suite(name)
    quick = get_suite("quick")
    assert set(SWEEP) == set(quick.sweep_methods) and quick.sweep_examples >= 1 and "full" in quick.ttft_methods
    paper = get_suite("paper")
    assert paper.n_per_task >= 30 and {d for _, d in paper.pairs} == {"qwen2.5-coder-0.5b", "smollm2-135m"}
    with pytest.raises(ValueError):
        get_suite("quick").replace(ttft_methods=["reuse"])
    with pytest.raises(ValueError, match="singles needs neighbors >= 2"):
        get_suite("musique").replace(neighbors=1, singles=True)


# ---- the real thing ------------------------------------------------------------------------------
def _table_rows(md: str, header_start: str) -> list[str]:
    lines = md.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith(header_start))
    out = []
    for line in lines[i:]:
        if not line.startswith("|"):
            break
        out.append(line)
    return out


@pytest.mark.slow
def test_bench_quick_cli_writes_a_well_formed_report(tmp_path):
    """`speccache-rag bench --suite quick`, shrunk to fit CI (real SmolLM2 and Qwen2.5-Coder-0.5B, every method
    family), with two drafts for one target as the paper suite has."""
    from speccache_rag.cli import main

    out = tmp_path / "quick"
    methods = "full,reuse,epic-k8,cacheblend@0.15,speccache@0.15,speccache@0.25,static@0.15,deviation@0.15," \
              "random@0.15,oracle@0.15"
    pairs = "smollm2-135m:smollm2-135m,smollm2-135m:qwen2.5-coder-0.5b"
    argv = ["bench", "--suite", "quick", "--out", str(out), "--pairs", pairs, "--per-task", "1", "--chunks", "4",
            "--chunk-tokens", "48",
            "--max-new-tokens", "4", "--methods", methods, "--ttft-methods", "full,reuse,speccache@0.15",
            "--ttft-prompts", "1", "--reps", "1", "--sweep-prompts", "0", "--threads", "1", "--no-progress"]
    assert main(argv) == 0

    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    quality = [r for r in rows if r["kind"] == "quality"]
    # draft-independent methods run once per prompt (draft null), the 4 draft methods once per draft
    assert len(quality) == 3 * (6 + 2 * 4)
    assert sorted(r["method"] for r in quality if r["draft"] is None and r["example"] == quality[0]["example"]) == \
        ["cacheblend@0.15", "epic-k8", "full", "oracle@0.15", "random@0.15", "reuse"]
    assert {r["draft"] for r in quality if r["method"] == "deviation@0.15"} == {"smollm2-135m", "qwen2.5-coder-0.5b"}
    # timed in the same rounds: full and reuse once, speccache once per draft
    assert sorted((r["method"], r["draft"] or "") for r in rows if r["kind"] == "ttft") == [
        ("full", ""), ("reuse", ""), ("speccache@0.15", "qwen2.5-coder-0.5b"), ("speccache@0.15", "smollm2-135m")]
    assert len([r for r in rows if r["kind"] == "agreement"]) == 2 * 3
    for r in quality:
        assert 0.0 <= r["score"] <= 1.0 and r["kl"] >= 0.0 and r["top1"] in (0.0, 1.0)
        assert 0.0 <= r["recompute_frac"] <= 1.0 and isinstance(r["prediction"], str)
        if r["method"] == "full":
            assert r["kl"] == 0.0 and r["top1"] == 1.0 and r["recompute_frac"] == 1.0
        if r["method"] == "reuse":
            assert r["recompute_frac"] == 0.0
        if r["ratio"] is not None:
            assert abs(r["recompute_frac"] - r["ratio"]) < 0.05
    full_ttft = next(r for r in rows if r["kind"] == "ttft" and r["method"] == "full")
    assert full_ttft["ratio_to_full"] == 1.0 and len(full_ttft["ttft_s"]) == 1

    md = (out / "report.md").read_text()
    table = _table_rows(md, "| method | recomputed | task score | % of full | normalized | F1 |")
    assert len(table) == 2 + 10
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table[2:]}
    full_score, reuse_score = (sum(r["score"] for r in quality if r["method"] == m) for m in ("full", "reuse"))
    assert cells["full"][2] == ("100.0 %" if full_score else "–")
    assert (cells["full"][3], cells["reuse"][3]) == (("1.00", "0.00") if full_score != reuse_score else ("–", "–"))
    assert all(line.count("|") == table[0].count("|") for line in table)
    assert "### Time to first token" in md and "### Agreement analysis" in md
    both = _table_rows(md, "| method | recomputed | task score | aggregate |")       # one target, both drafts
    assert len(both) == 2 + 6 + 2 * 4 and "| speccache@0.15 ← qwen2.5-coder-0.5b |" in "\n".join(both)
    pngs = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", md)
    assert len(pngs) == 2 * 3
    for name in pngs:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # resuming a finished run does no work and keeps the rows
    assert main(["bench", "--suite", "quick", "--out", str(out), "--resume", "--no-progress"] + argv[5:]) == 0
    assert len((out / "results.jsonl").read_text().splitlines()) == len(rows)
    parts = json.loads((out / "suite.json").read_text())["parts"]
    assert len(parts) == 2 and "--resume" in parts[1]["command"] and "measured in 2 parts" in \
        (out / "report.md").read_text()
    # resuming with other prompts would mix rows of different prompts under one example id
    changed = [a if a != "48" else "64" for a in argv[5:]]
    assert main(["bench", "--suite", "quick", "--out", str(out), "--resume", "--no-progress"] + changed) == 2
    assert len((out / "results.jsonl").read_text().splitlines()) == len(rows)
    # an existing results file is not overwritten by accident
    assert main(["bench", "--suite", "quick", "--out", str(out), "--no-progress"] + argv[5:]) == 2


def test_bench_musique_suite_reads_passages_and_a_resume_pays_only_for_new_methods(tmp_path, monkeypatch):
    """The real-data suite on a stand-in LongBench file: the first N passages each one chunk, the suite's
    system message; with --kv-store a resumed run reads the full-prefill references instead of recomputing."""
    from speccache_rag.bench import suite_run
    from speccache_rag.cli import main

    rows = [{"input": f"Who founded company {c}?", "answers": [f"Person {c}"], "_id": f"q{c}", "dataset": "musique",
             "context": "\n\n".join(f"Passage {i}:\nCompany {c}{i} was founded by person {c}{i} in 19{i}0."
                                     for i in range(1, 5))} for c in "AB"]
    data = tmp_path / "musique_dev.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out, kv = tmp_path / "musique", tmp_path / "kv"
    argv = ["bench", "--suite", "musique", "--out", str(out), "--pairs", "smollm2-135m:smollm2-135m",
            "--longbench", str(data), "--per-task", "2", "--max-new-tokens", "3", "--stages", "quality",
            "--threads", "1", "--no-progress", "--kv-store", str(kv), "--methods", "full,reuse,qattn@0.15"]
    assert main(argv) == 0
    quality = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted({r["example"] for r in quality}) == ["qA", "qB"] and len(quality) == 2 * 3
    assert all(r["stats"]["cache_hits"] == 4 for r in quality if r["method"] == "reuse")     # a chunk a passage
    assert len(list((out / "refs").rglob("*.safetensors"))) == 2
    first = {r["example"]: r for r in quality if r["method"] == "qattn@0.15"}

    def no_full(*a, **k):
        raise AssertionError("a resumed run recomputed a stored full-prefill reference")

    real_run = suite_run.BenchEngine.run
    monkeypatch.setattr(suite_run.BenchEngine, "run",
                        lambda self, spec, *a, **k: no_full() if spec.family == "full" else real_run(self, spec, *a, **k))
    argv[-1] = "full,reuse,qattn@0.15,qattn@0.15+rounds=2"
    assert main([*argv, "--resume"]) == 0
    again = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(again) == 2 * 4
    two = {r["example"]: r for r in again if r["method"] == "qattn@0.15+rounds=2"}
    assert all(0.0 <= two[e]["kl"] and two[e]["recompute_frac"] <= 0.2 for e in two)
    assert {e: r["kl"] for e, r in first.items()} == {r["example"]: r["kl"] for r in again if r["method"] == "qattn@0.15"}
    md = (out / "report.md").read_text()
    assert "the first 2 rows, the first 6 passages of each as one chunk" in md and "five words" in md

    monkeypatch.undo()
    later = tmp_path / "later"                      # --skip: the next prompts only, for a larger paired sample
    argv[argv.index(str(out))], argv[-1] = str(later), "full,reuse"
    assert main([*argv, "--skip", "1"]) == 0
    assert {json.loads(line)["example"] for line in (later / "results.jsonl").read_text().splitlines()} == {"qB"}
    assert "rows 2–2 (--skip 1)" in (later / "report.md").read_text()

    # a row of a method spelling that no longer parses (an option since removed) is left out, not fatal
    from speccache_rag.bench.report import write_report
    results = later / "results.jsonl"
    gone = {**json.loads(results.read_text().splitlines()[-1]), "method": "qattn@0.15+propagate=auto"}
    results.write_text(results.read_text() + json.dumps(gone) + "\n")
    with pytest.warns(UserWarning, match="propagate=auto"):
        md = write_report(later).read_text()
    assert "Left out: rows of `qattn@0.15+propagate=auto`" in md and "| reuse |" in md


def test_bench_ttft_suite_times_every_method_in_both_dtypes(tmp_path):
    """`bench --suite ttft`, shrunk: one process, both dtypes in the same rounds, ratios to full in each."""
    from speccache_rag.cli import main

    out = tmp_path / "ttft"
    argv = ["bench", "--suite", "ttft", "--out", str(out), "--pairs", "smollm2-135m:smollm2-135m",
            "--dtypes", "float32,bfloat16", "--ttft-chunks", "4", "--chunk-tokens", "32", "--reps", "1",
            "--ttft-methods", "full,reuse,speccache@0.15,qattn@0.15", "--threads", "1", "--no-progress"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted((r["dtype"], r["method"]) for r in rows) == sorted(
        (dt, m) for dt in ("float32", "bfloat16") for m in ("full", "reuse", "speccache@0.15", "qattn@0.15"))
    by = {(r["dtype"], r["method"]): r for r in rows}
    assert by[("float32", "full")]["speedup_vs_full_float32"] == pytest.approx(1.0)
    assert by[("bfloat16", "full")]["speedup_vs_full_bfloat16"] == pytest.approx(1.0)
    for r in rows:
        assert r["ttft_median_s"] > 0 and 0 <= r["overhead_share"] < 1
        assert r["speedup_vs_full_float32"] == pytest.approx(
            by[("float32", "full")]["ttft_median_s"] / r["ttft_median_s"])
    assert by[("float32", "reuse")]["recomputed_tokens"] < by[("float32", "full")]["recomputed_tokens"]
    meta = json.loads((out / "suite.json").read_text())
    assert meta["environment"]["dtype_auto"] in ("float32", "bfloat16")
    report = (out / "report.md").read_text()
    assert "× full float32 | × full bfloat16" in report and report.count("| qattn@0.15 |") == 2


def test_bench_offload_suite_reports_every_config(tmp_path):
    """`bench --suite offload`, shrunk to SmolLM2 at ~1 k tokens; --resume adds only the missing prompts."""
    from speccache_rag.cli import main

    out = tmp_path / "offload"
    argv = ["bench", "--suite", "offload", "--out", str(out), "--targets", "smollm2-135m", "--contexts", "1024",
            "--max-new-tokens", "6", "--dtypes", "float32", "--no-progress"]
    assert main([*argv, "--per-task", "1"]) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    configs = {r["config"] for r in rows}
    assert configs == {"full"} | {f"{b}bit-{k}" for b in (1, 2) for k in ("k16", "k64", "k256", "k64-nonspec", "k0")}
    assert len(rows) == 2 * len(configs) and {r["task"] for r in rows} == {"needle", "bridge"}
    for r in rows:
        assert 800 < r["prompt_tokens"] < 1100 and r["kl"] >= 0 and 0 <= r["top1"] <= 1
        if r["config"] != "full":
            assert r["resident_ratio"] < 1 and r["resident_ratio_16bit"] < 1
            assert (r["prefetch_hit_rate"] is None) == (r["topk"] == 0)
            assert (r["spec_token_hit_rate"] is None) == (not r["speculative"])
            if r["same_tokens"]:
                assert r["score"] == r["full_score"]
    by = {(r["example"], r["config"]): r for r in rows}
    for ex in {r["example"] for r in rows}:           # fewer resident bits, more KL (k = 0: pure low-bit)
        assert by[(ex, "1bit-k0")]["kl"] >= by[(ex, "2bit-k0")]["kl"] * 0.5
        assert by[(ex, "2bit-k0")]["resident_ratio"] > by[(ex, "1bit-k0")]["resident_ratio"]
    report = (out / "report.md").read_text()
    assert report.count("| 2bit-k64 |") == 1 and "## Goals" in report and "2-bit k=64 keeps" in report
    assert (out / "offload_accuracy_vs_resident.png").exists()
    assert main([*argv, "--per-task", "2", "--resume"]) == 0
    again = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(again) == 4 * len(configs) and again[:len(rows)] == rows


def test_sign_test_and_paired_counts():
    from speccache_rag.bench.report_paired import paired, sign_test_p

    assert sign_test_p(10, 2) == pytest.approx(0.0386, abs=1e-4)       # 2 * P(X <= 2), X ~ Bin(12, 1/2)
    assert sign_test_p(3, 3) == 1.0 and sign_test_p(0, 0) == 1.0
    rows = [{"method": m, "example": e, "score": s, "kl": k}
            for m, e, s, k in [("a", 1, 1.0, 0.1), ("a", 2, 0.0, 0.5), ("a", 3, 1.0, 0.2),
                               ("b", 1, 0.0, 0.3), ("b", 2, 0.0, 0.4), ("b", 3, 1.0, 0.2), ("b", 4, 1.0, 0.0)]]
    assert paired(rows, "a", "b", "score") == (1, 0, 3)               # example 4 is b's alone: not paired
    assert paired(rows, "a", "b", "kl", lower_is_better=True) == (1, 1, 3)


def test_paired_permutation_test_of_the_mean():
    from speccache_rag.bench.report_paired import mean_diff_p, paired_diffs

    assert mean_diff_p([1.0] * 12) == pytest.approx(2 / 2 ** 12, abs=5e-4)   # only the all-same signs are as far
    assert mean_diff_p([1.0, -1.0] * 10) == 1.0 and mean_diff_p([]) == 1.0 and mean_diff_p([0.0, 0.0]) == 1.0
    # seven large wins, five small losses: the sign test (7/5, p = 0.77) only counts, the mean test sees size
    d = [1.0, 1.0, 1.0, -0.05, -0.05, -0.05, -0.05, -0.05, 1.0, 1.0, 1.0, 1.0]
    assert mean_diff_p(d) < 0.05
    rows = [{"method": m, "example": e, "kl": k} for m, e, k in [("a", 1, 0.1), ("a", 2, 0.5), ("b", 1, 0.3),
                                                                   ("b", 2, 0.4)]]
    assert paired_diffs(rows, "a", "b", "kl", lower_is_better=True) == pytest.approx([0.2, -0.1])


def test_the_goals_are_read_off_the_shipped_default_not_the_bare_family_name():
    from speccache_rag.bench.report_paired import goal_lines
    from speccache_rag.bench.report_tables import summarize

    kl = {"full": 0.0, "reuse": 1.0, "qattn@0.15": 0.4, DEFAULT: 0.1}
    rows = [{"task": "t", "score": 1.0, "kl": k, "top1": 1.0, "method": m, "example": e, "prediction": "x",
             "same_continuation": True} for e in range(3) for m, k in kl.items()]
    summary, _ = summarize(rows, list(kl))
    lines = goal_lines(summary, rows)
    assert len(lines) == 1 and lines[0].startswith(f"- {DEFAULT}:") and "closes 90.0 %" in lines[0]


def test_same_answer_forgives_spelling_not_a_different_answer():
    from speccache_rag.bench.report_tables import summarize

    base = {"task": "t", "score": 0.0, "kl": 0.0, "top1": 1.0}
    rows = [{**base, "method": m, "example": e, "prediction": p, "same_continuation": m == "full"}
            for m, e, p in [("full", 1, "The Eiffel Tower."), ("full", 2, "1887"), ("full", 3, "Paris\nbecause"),
                            ("a", 1, "eiffel tower"), ("a", 2, "1888"), ("a", 3, "Paris")]]
    summary, n = summarize(rows, ["full", "a"])
    assert n == 3 and summary["a"]["same_answer"] == pytest.approx(2 / 3) and summary["full"]["same_answer"] == 1.0
    assert summary["a"]["same_continuation"] == 0.0                   # token-exact: none of the three


def test_a_suite_method_on_few_prompts_gets_its_own_table_not_a_smaller_headline():
    from speccache_rag.bench.report_tables import tabulated_methods

    rows = [{"method": m, "example": e} for e in range(4) for m in ("full", "reuse", "qattn@0.15")]
    rows += [{"method": "deviation@0.15", "example": 0}, {"method": "qattn@0.05", "example": 0},
             {"method": "speccache@0.15", "example": 1}, {"method": "speccache@0.15", "example": 2}]
    suite = ["full", "reuse", "qattn@0.15", "speccache@0.15", "deviation@0.15"]
    # speccache has half of full's prompts (a run stopped midway): still headline; a sweep method is not listed
    assert tabulated_methods(suite, rows) == (["full", "reuse", "qattn@0.15", "speccache@0.15"], ["deviation@0.15"])


def test_divergence_analysis_locates_stale_kv(smollm2):
    """Layer 0's K/V of a reused chunk depend on its tokens alone (exact); deeper layers differ, and a method
    that recomputes every token leaves nothing stale."""
    from speccache_rag import RAGPrompt
    from speccache_rag.bench.divergence import analyse, report
    from speccache_rag.bench.methods import BenchEngine

    engine = BenchEngine(*smollm2, store="memory://")
    chunks = ["Company Alba was founded by Ivo Renn in 1950 in the port town of Sella.",
              "Ivo Renn was born in Kestrel, a village north of Sella, and studied law there."]
    row = analyse(engine, RAGPrompt(chunks=chunks, question="Where was the founder of Alba born?"),
                  ["qattn@0.5", "qattn@1.0"])
    reuse = row["reuse"]
    assert reuse["layer_v"][0] < 1e-4 < reuse["layer_v"][-1] and reuse["picked"] == 0
    assert row["qattn@0.5"]["picked"] > 0 and row["qattn@0.5"]["v_stale"] > 0
    assert row["qattn@1.0"]["picked"] == row["chunk_tokens"] and max(row["qattn@1.0"]["layer_v"]) < 1e-3
    md = report([row], ["qattn@0.5", "qattn@1.0"], "smollm2")
    assert "| qattn@0.5 |" in md and "by chunk index" in md


def test_budget_path_spends_the_budget_step_by_step_and_one_whole_step_is_full_prefill(smollm2):
    """Each step recomputes its own share of the chunk tokens; a single step covering all of them is full prefill."""
    from speccache_rag import RAGPrompt
    from speccache_rag.bench.budget_path import budget_path, settled
    from speccache_rag.bench.methods import BenchEngine
    from speccache_rag.prompt import render
    from speccache_rag.runner import full_prefill

    engine = BenchEngine(*smollm2, store="memory://")
    prompt = RAGPrompt(chunks=["Company Alba was founded by Ivo Renn in 1950 in the port town of Sella.",
                               "Ivo Renn was born in Kestrel, a village north of Sella, and studied law there."],
                       question="Where was the founder of Alba born?")
    engine.precompute(prompt.chunks)
    tokens = render(prompt, engine.tokenizer)
    full = full_prefill(engine.ops, tokens.ids)[1]
    steps = budget_path(engine, tokens, full, step=0.25, upto=0.5)
    shares = [s["r"] for s in steps]
    assert len(steps) == 3 and shares[0] == 0 < shares[1] < shares[2] and shares[2] == pytest.approx(0.5, abs=0.05)
    assert steps[0]["kl"] > 1e-3 and all(s["moved"] >= 0 for s in steps[1:])
    path = [{"r": 0.0}, {"r": 0.1, "moved": 0.5}, {"r": 0.2, "moved": 0.001}, {"r": 0.3, "moved": 0.0}]
    assert settled(path, 0.01)["r"] == 0.2 and settled(path, 0.0)["r"] == 0.3
    whole = budget_path(engine, tokens, full, step=1.0, upto=1.0)
    assert len(whole) == 2 and whole[0]["kl"] == steps[0]["kl"] and whole[1]["kl"] < 1e-4 and whole[1]["top1"] == 1.0


def test_selection_bounds_oracles_see_full_prefill_and_recomputing_everything_is_exact(smollm2):
    """The oracles score from full prefill's KV: the deviation is zero outside the chunks' reused tokens, and at
    r = 1 every scorer recomputes every chunk token, which is full prefill."""
    from speccache_rag import RAGPrompt
    from speccache_rag.bench.methods import BenchEngine
    from speccache_rag.bench.selection_bounds import SCORERS, bounds, summary
    from speccache_rag.prompt import render

    engine = BenchEngine(*smollm2, store="memory://")
    prompt = RAGPrompt(chunks=["Company Alba was founded by Ivo Renn in 1950 in the port town of Sella.",
                               "Ivo Renn was born in Kestrel, a village north of Sella, and studied law there."],
                       question="Where was the founder of Alba born?")
    engine.precompute(prompt.chunks)
    row = bounds(engine, render(prompt, engine.tokenizer), [0.3, 1.0])
    assert row["reuse"]["kl"] > 1e-3
    assert {k.split("@")[0] for k in row if k != "reuse"} == set(SCORERS)
    for name in SCORERS:
        assert row[f"{name}@1.0"]["kl"] < 1e-4 and row[f"{name}@1.0"]["top1"] == 1.0
        assert row[f"{name}@0.3"]["kl"] != row["reuse"]["kl"]
    lines = summary([{"example": "a", **row}, row])
    wins = int(row["impact@0.3"]["kl"] < row["qattn@0.3"]["kl"])
    losses = int(row["impact@0.3"]["kl"] > row["qattn@0.3"]["kl"])
    assert lines[0].startswith("2 questions") and any(line.startswith("| impact@0.3 |")
                                                      and f"{2 * wins}/{2 * losses}" in line for line in lines)


def test_compare_runs_pairs_two_runs_prompt_by_prompt(tmp_path, capsys):
    from speccache_rag.bench.compare_runs import main

    def run(name, kls):
        rows = [{"kind": "quality", "target": "t", "draft": None, "example": e, "method": m, "kl": k,
                 "prediction": p}
                for e, (kq, p) in enumerate(kls)
                for m, k, p in (("full", 0.0, "yes"), ("reuse", 1.0, "no"), ("qattn@0.15", kq, p))]
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        return str(tmp_path / name)
    a = run("a", [(0.1, "yes"), (0.2, "Yes."), (0.5, "no")])
    b = run("b", [(0.3, "no"), (0.4, "yes"), (0.4, "yes")])
    assert main([a, b]) == 0
    line = [row for row in capsys.readouterr().out.splitlines() if row.startswith("| qattn@0.15")][0]
    assert "| 3 | 0.2667 | 0.3667 | 73.3 % | 63.3 % | 2/1 (1, " in line and line.endswith("| 2/3 | 2/3 |")
