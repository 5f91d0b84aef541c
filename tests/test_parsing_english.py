"""Raw English in, trees out: Penn Treebank words of untokenised text, and parses whose leaves are the user's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from ops.localstack import free_port
from pipeline.config import load_config
from pipeline.parsing.english import leaf, treebank_words, words_with_spans
from pipeline.parsing.trees import parse_tree
from pipeline.shards import build_shards
from pipeline import tracking
from pipeline.train import train
from tests.test_parsing import REPO, TINY_MODEL
from tests.test_tracking import _ok, _post, serving  # the serving tests' server and requests


# Each character class of news and web text, the treebank's words for a sentence of it (what the parser reads).
SENTENCES = [
    ('He said, "I don\'t know."', ["He", "said", ",", "``", "I", "do", "n't", "know", ".", "''"]),
    ("Profit (before taxes) rose 5% to $3.8 billion & more.",
     ["Profit", "-LRB-", "before", "taxes", "-RRB-", "rose", "5", "%", "to", "$", "3.8", "billion", "&", "more", "."]),
    ("The {braces} and [brackets] stay.", ["The", "-LCB-", "braces", "-RCB-", "and", "-LSB-", "brackets", "-RSB-",
                                          "stay", "."]),
    ("It rose 3/4 point -- a well-known *rule*.",
     ["It", "rose", "3\\/4", "point", "--", "a", "well-known", "\\*", "rule", "\\*", "."]),
    ("“It’s late,” she said—twice.", ["``", "It", "'s", "late", ",", "''", "she", "said", "--", "twice", "."]),
    ("Pages 10–12 – or not ― maybe‒no.",
     ["Pages", "10", "--", "12", "--", "or", "not", "--", "maybe", "--", "no", "."]),
    ("‘Zürich’ can't cannot.", ["`", "Zürich", "'", "ca", "n't", "can", "not", "."]),
    ("He waited… and waited... then left…", ["He", "waited", "...", "and", "waited", "...", "then", "left", "..."]),
    ("He said 'no' to 'the plan.'", ["He", "said", "`", "no", "'", "to", "`", "the", "plan", ".", "'"]),
    ("The students’ books of the ’80s and '90s.", ["The", "students", "'", "books", "of", "the", "'80s", "and",
                                                   "'90s", "."]),
    ("„Gut“, sagte er, «très» ‚bien‘ »ja« ‹non›.",
     ["``", "Gut", "''", ",", "sagte", "er", ",", "``", "très", "''", "`", "bien", "'", "``", "ja", "''", "`", "non",
      "'", "."]),
    ("It cost 1,000,000 dollars, or 3.5 million.", ["It", "cost", "1,000,000", "dollars", ",", "or", "3.5", "million",
                                                   "."]),
    ("He moved to the U.S.", ["He", "moved", "to", "the", "U.S.", "."]),
    ("She works at Apple Inc.", ["She", "works", "at", "Apple", "Inc.", "."]),
    ('He said "they met at 9 a.m."', ["He", "said", "``", "they", "met", "at", "9", "a.m.", ".", "''"]),
    ("The U.S. economy grew.", ["The", "U.S.", "economy", "grew", "."]),
    ("See https://example.com/a?b=c&d=e (or www.x.org/path).",
     ["See", "https:\\/\\/example.com\\/a?b=c&d=e", "-LRB-", "or", "www.x.org\\/path", "-RRB-", "."]),
    ("Mail jo.smith@example.co.uk, please.", ["Mail", "jo.smith@example.co.uk", ",", "please", "."]),
    ("Great job👍🏽! 😀 👨\u200d👩\u200d👧 🇩🇪 at 25°C",
     ["Great", "job", "👍🏽", "!", "😀", "👨\u200d👩\u200d👧", "🇩🇪", "at", "25°C"]),
    ("What?! No!! #1 @home", ["What", "?", "!", "No", "!", "!", "#", "1", "@", "home"]),
    ("Mr.  Smith\tleft;  she\u00a0stayed: 3:15 p.m. on Oct. 5.", ["Mr.", "Smith", "left", ";", "she", "stayed", ":",
                                                                "3:15", "p.m.", "on", "Oct.", "5", "."]),
    ("", []),
    ("   ", []),
]


@pytest.mark.parametrize("text, words", SENTENCES)
def test_treebank_words_follow_the_treebanks_conventions(text, words) -> None:
    assert treebank_words(text) == words


@pytest.mark.parametrize("text", [text for text, _ in SENTENCES])
def test_each_word_keeps_the_users_characters(text) -> None:
    """The words' spans cover the line, in order, with only whitespace between them: nothing lost, nothing added;
    the leaves a parse writes spell the line (a bracket as -LRB- / -RRB-)."""
    words = words_with_spans(text)
    assert [w.text for w in words] == [text[w.start:w.end] for w in words]
    gaps = zip([0, *(w.end for w in words)], [*(w.start for w in words), len(text)])
    assert all(start <= end and not text[start:end].strip() for start, end in gaps)
    assert all(w.text and not any(c.isspace() for c in w.text) for w in words)
    leaves = [leaf(w) for w in words]
    assert "(" not in "".join(leaves) and ")" not in "".join(leaves)  # a bracket cannot be a leaf
    assert "".join({"-LRB-": "(", "-RRB-": ")"}.get(x, x) for x in leaves) == "".join(text.split())


# ------------------------------------------------------------------------------ a parser of raw English

# Hard sentences: quotes (typographic and ASCII), parentheses, braces, hyphens, "n't", $, %, slashes, asterisks,
# dashes, non-ASCII letters, and a sentence near the model's limit of 1,024 positions (1,015 treebank words: a tree
# of them, n + 3 tokens at the least, fits the 1,023 output positions).
HARD = ['He said, "I don\'t know (or care)."',
        "“It’s a well-known fact,” she said—twice.",
        "Profit rose 5% to $3.8 billion -- a record {for now}.",
        "The café in Zürich isn't open [yet]; *some* 3/4 of us can't wait…",
        " ".join(["The cat sat on the mat ,"] * 145)]
DECODE = ["decode.beam_size=2", "decode.max_len_b=10"]
# Treebank input (EVALB-style scoring): words as the treebank writes them, separated by spaces.
TREEBANK = ["He said , `` I do n't know -LRB- or care -RRB- . ''", "Profit rose 5 % to $ 3.8 billion in the U.S. ."]


def _words(line: str) -> list[str]:
    """The leaves a parse of ``line`` must have: its words as written, brackets as the treebank writes them."""
    return [leaf(w) for w in words_with_spans(line)]


@pytest.fixture(scope="module")
def parser(ptb_stack, tmp_path_factory):
    """A tiny parser after two updates on the sample (its trees are poor: the round trip is what is tested)."""
    cfg, work, corpus, tok_dir = ptb_stack
    cfg = load_config("ptb-sample-cpu", [("data.root", cfg.data.root), ("work_dir", str(work)), *TINY_MODEL])
    run = train(cfg, build_shards(corpus, tok_dir, cfg.tokenizer, work), tmp_path_factory.mktemp("parser"))
    return cfg, run / "checkpoints" / "ckpt-00000002.pt", tok_dir


def _translate(parser, *args: str, input: str) -> subprocess.CompletedProcess:
    cfg, checkpoint, tok_dir = parser
    cmd = [sys.executable, "-m", "pipeline", "translate", "--config", "ptb-sample-cpu", "--checkpoint",
           str(checkpoint), "--tokenizer", str(tok_dir), *[a for s in DECODE for a in ("--set", s)], *args]
    return subprocess.run(cmd, input=input, capture_output=True, text=True, cwd=REPO, timeout=600)


@pytest.mark.integration
def test_translate_parses_raw_english_over_the_users_own_words(parser, tmp_path) -> None:
    """One command, a file of ordinary English: one tree per line, each over exactly the line's words as the user
    wrote them; ``--pretokenized`` reads treebank words and writes them as given."""
    raw = tmp_path / "raw.txt"
    raw.write_text("\n".join(HARD) + "\n", encoding="utf-8")
    res = _translate(parser, "--input", str(raw), input="")
    assert res.returncode == 0, res.stderr[-3000:]
    trees = [parse_tree(line) for line in res.stdout.splitlines()]
    assert [tree.words() for tree in trees] == [_words(line) for line in HARD]
    assert trees[0].words() == ["He", "said", ",", '"', "I", "do", "n't", "know", "-LRB-", "or", "care", "-RRB-",
                                ".", '"']
    assert trees[1].words() == ["“", "It", "’s", "a", "well-known", "fact", ",", "”", "she", "said", "—", "twice",
                                "."]
    for line, tree in zip(HARD, trees):  # nothing of the user's text lost or added
        text = "".join(tree.words()).replace("-LRB-", "(").replace("-RRB-", ")")
        assert text == "".join(line.split())
    assert "positions" not in res.stderr  # the long sentence fits the model

    treebank = "He said , `` I do n't know -LRB- or care -RRB- . ''\n"
    res = _translate(parser, "--pretokenized", input=treebank)
    assert res.returncode == 0, res.stderr[-3000:]
    assert parse_tree(res.stdout).words() == treebank.split()


@pytest.mark.integration
def test_a_sentence_beyond_the_models_positions_is_parsed_over_all_its_words(parser) -> None:
    """Past the model's positions the source is cut (a warning names the line) and no tree of its words fits the
    output positions: it is still parsed, as one flat constituent over every word."""
    long = " ".join(["The cat sat on the mat ,"] * 150) + " ."  # 1,051 treebank words
    res = _translate(parser, input=long + "\n")
    assert res.returncode == 0, res.stderr[-3000:]
    tree = parse_tree(res.stdout)
    assert tree.words() == _words(long) and all(child.is_preterminal for child in tree.children)
    assert "stdin: line 1 has" in res.stderr and "1 of 1 lines were longer" in res.stderr


@pytest.mark.integration
def test_pretokenized_is_for_parsing_and_an_empty_line_is_named(parser) -> None:
    res = _translate(parser, input="He left.\n\nShe stayed.\n")
    assert res.returncode == 2 and res.stderr.strip() == (
        "error: stdin: line 2 is empty; a parse needs at least one word"), res.stderr
    cfg, checkpoint, tok_dir = parser
    res = subprocess.run([sys.executable, "-m", "pipeline", "translate", "--config", "multi30k-cpu", "--checkpoint",
                          str(checkpoint), "--tokenizer", str(tok_dir), "--pretokenized"], input="A man .\n",
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert res.returncode == 2 and "--pretokenized: task 'translation' translates raw text" in res.stderr


@pytest.fixture(scope="module")
def served_parser(mlflow_server, parser) -> str:
    """The parser registered as the flow registers it (pyfunc, checkpoint config and all), with the decoding the
    CLI tests run; its model URI."""
    cfg, checkpoint, tok_dir = parser
    tracking.connect(mlflow_server, "test-parsing-english")
    c = MlflowClient(mlflow_server)
    run_id = c.create_run(c.get_experiment_by_name("test-parsing-english").experiment_id).info.run_id
    name = f"transformer-en-tree-{free_port()}"
    version = tracking.register_model(run_id, checkpoint, tok_dir, load_config("ptb-sample-cpu", DECODE).decode,
                                      name, {"dev.f1": 0.0})
    return f"models:/{name}/{version}"


# What a model logged before the pyfunc class was renamed holds in its python_model.pkl (cloudpickle names the
# class by its import path).
OLD_PYTHON_MODEL_PKL = (b"\x80\x05\x95.\x00\x00\x00\x00\x00\x00\x00\x8c\x18pipeline.tracking.pyfunc\x94"
                        b"\x8c\nTranslator\x94\x93\x94)\x81\x94.")


@pytest.mark.integration
def test_the_served_parser_returns_the_commands_trees(parser, served_parser, tmp_path) -> None:
    """The pyfunc of a parser takes raw English and returns what ``translate`` writes for it, and with the
    request's ``pretokenized`` param treebank words as ``translate --pretokenized`` does; a sentence with no word
    and an nbest it cannot give are refused with a message. A model logged under the class's old name loads."""
    import mlflow
    from mlflow.exceptions import MlflowException

    sentences = HARD[:4]
    res = _translate(parser, input="\n".join(sentences) + "\n")
    assert res.returncode == 0, res.stderr[-3000:]
    model = mlflow.pyfunc.load_model(served_parser)
    assert model.predict(sentences) == res.stdout.splitlines()
    assert model.predict(sentences[0]) == res.stdout.splitlines()[:1]  # a single string is one sentence
    with pytest.raises(MlflowException, match="request: line 2 is empty"):
        model.predict(["He left.", "  "])
    with pytest.raises(MlflowException, match="a parser returns one tree per sentence"):
        model.predict(sentences, params={"nbest": 2})

    res = _translate(parser, "--pretokenized", input="\n".join(TREEBANK) + "\n")
    assert res.returncode == 0, res.stderr[-3000:]
    assert model.predict(TREEBANK, params={"pretokenized": True}) == res.stdout.splitlines()
    assert [parse_tree(t).words() for t in res.stdout.splitlines()] == [line.split() for line in TREEBANK]
    assert model.predict(sentences, params={"pretokenized": False}) == model.predict(sentences)  # the default
    params = mlflow.models.get_model_info(served_parser).signature.params.params
    assert {p.name: p.default for p in params}["pretokenized"] is False

    old = tmp_path / "old-model"  # the registered model as the code before the rename logged it
    mlflow.artifacts.download_artifacts(served_parser, dst_path=str(old))
    (old / "python_model.pkl").write_bytes(OLD_PYTHON_MODEL_PKL)
    assert mlflow.pyfunc.load_model(str(old)).predict(sentences) == model.predict(sentences)


@pytest.mark.slow
def test_models_serve_parses_raw_english(mlflow_server, served_parser, tmp_path) -> None:
    """`mlflow models serve` of the registered parser answers raw English with the trees the loaded model gives,
    and treebank words with ``"params": {"pretokenized": true}``; refuses a sentence with no word and a param of
    the wrong type with a 400, and goes on serving."""
    import mlflow

    with serving(served_parser, mlflow_server, tmp_path / "serve.log") as (proc, port):
        want = mlflow.pyfunc.load_model(served_parser).predict(HARD[:4])
        assert [parse_tree(t).words() for t in want] == [_words(s) for s in HARD[:4]]
        assert _post(port, json.dumps({"inputs": HARD[:4]}).encode()) == (200, {"predictions": want})
        status, out = _post(port, json.dumps({"inputs": ["He left.", ""]}).encode())
        assert status == 400 and "line 2 is empty" in out["message"], out
        treebank = mlflow.pyfunc.load_model(served_parser).predict(TREEBANK, params={"pretokenized": True})
        body = {"inputs": TREEBANK, "params": {"pretokenized": True}}
        assert _post(port, json.dumps(body).encode()) == (200, {"predictions": treebank})
        assert [parse_tree(t).words() for t in treebank] == [line.split() for line in TREEBANK]
        status, out = _post(port, json.dumps({"inputs": TREEBANK, "params": {"pretokenized": "yes"}}).encode())
        assert status == 400 and "pretokenized" in out["message"], out
        assert proc.poll() is None and _ok(f"http://127.0.0.1:{port}/ping")
        assert "serving with PyTorch" in (tmp_path / "serve.log").read_text()
