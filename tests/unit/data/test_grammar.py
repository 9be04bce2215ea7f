"""The builtin story grammar: determinism, exact scoring, rejection, normalisation, text shape."""

from __future__ import annotations

import hashlib
import math
import re
import shutil
import sys
from fractions import Fraction

import pytest

from conftest import ROOT, run
from dsflow.data import grammar
from dsflow.data.grammar import Grammar, GrammarError, _render
from dsflow.errors import UsageError
from grammar_ll1 import builtin_predict, compile_checked, parse, score

N_DOCS = 2000
SEED = 1234
# Written out rather than read from grammar.txt's pronouns, so that a wrong table fails the test.
PRONOUN_FORMS = {
    "f": {"she", "her", "herself"},
    "m": {"he", "him", "his", "himself"},
    "n": {"they", "them", "their", "themselves"},
}
ALL_PRONOUNS = set().union(*PRONOUN_FORMS.values())
BUILTIN = grammar.builtin()
HERO_NAMES = set(BUILTIN.words["hero_name"].split())


@pytest.fixture(scope="module")
def docs() -> list[tuple[str, float]]:
    return list(grammar.iter_documents(SEED, N_DOCS))


def hero_of(text: str) -> str:
    """The protagonist, found without the parser: the first hero name in the text."""
    return next(w for w in re.findall(r"[A-Za-z]+", text) if w in HERO_NAMES)


# -- determinism -------------------------------------------------------------------------------


def test_same_seed_and_index_give_the_same_document():
    assert grammar.generate(7, 3) == grammar.generate(7, 3)
    forward = [grammar.generate(7, i) for i in range(30)]
    backward = [grammar.generate(7, i) for i in reversed(range(30))][::-1]
    assert forward == backward
    assert list(grammar.iter_documents(7, 30)) == forward
    assert list(grammar.iter_documents(7, 10, start=20)) == forward[20:]


def test_different_seeds_and_indices_give_different_documents(docs):
    texts = [t for t, _ in docs]
    assert len(set(texts)) == len(texts)
    for i in range(20):
        assert grammar.generate(0, i)[0] != grammar.generate(1, i)[0]


def test_corpus_is_pinned():
    # Bump GRAMMAR_VERSION (and this digest) whenever the corpus changes: it is recorded in the
    # download manifest, and a Python whose `random` drew differently would fail here too.
    digest = hashlib.sha256()
    for text, logprob in grammar.iter_documents(0, 20):
        digest.update(text.encode())
        digest.update(repr(logprob).encode())
    assert (grammar.GRAMMAR_VERSION, digest.hexdigest()) == (
        "1",
        "744902894cf8a55218cf3c22a92d516e0cd0a886b75228c022fabecf307f5b41",
    )


# -- scoring -----------------------------------------------------------------------------------


def test_score_recomputes_the_recorded_logprob(docs):
    for text, logprob in docs:
        # The sampler and the parser add the same floats in the same order: exact equality.
        assert score(text) == logprob


def test_parse_recovers_the_story_elements(docs):
    for text, _ in docs[:200]:
        _, found = parse(text)
        paragraphs = text.split("\n\n")
        assert found["hero"] == hero_of(text)
        assert found["hero"] in text.split(".")[0]
        assert re.search(rf"\b{found['obj']}\b", paragraphs[1])  # found on the outing
        assert re.search(rf"\b{found['obj']}\b", paragraphs[-1])  # and mentioned at the end
        assert found["friend"] in paragraphs[2]


def _first_doc(docs, predicate):
    return next(text for text, _ in docs if predicate(text))


def _mutations(docs) -> dict[str, tuple[str, str]]:
    """What is changed -> (a generated text, the text changed so)."""
    text = docs[0][0]
    _, found = parse(text)
    obj, hero = found["obj"], found["hero"]
    other_obj = "lantern" if obj != "lantern" else "teapot"
    head, _, last = text.rpartition("\n\n")
    she = _first_doc(docs, lambda t: BUILTIN.genders[hero_of(t)] == "f" and " she " in t)
    his = _first_doc(docs, lambda t: BUILTIN.genders[hero_of(t)] == "m" and " his " in t)
    they = _first_doc(docs, lambda t: "They were" in t)
    an = _first_doc(docs, lambda t: " an " in t)
    return {
        "object changed in the ending": (text, head + "\n\n" + last.replace(obj, other_obj)),
        "unknown name": (text, text.replace(hero, "Zed")),
        "hero renamed once": (text, text.replace(hero, "Mia" if hero != "Mia" else "Tom", 1)),
        "pronoun disagrees (she -> he)": (she, she.replace(" she ", " he ", 1)),
        "pronoun disagrees (his -> her)": (his, his.replace(" his ", " her ", 1)),
        "verb disagrees (They were -> They was)": (they, they.replace("They were", "They was", 1)),
        "truncated mid-story": (text, text[: len(text) // 2]),
        "ending removed": (text, head),
        "final full stop removed": (text, text[:-1]),
        "extra text": (text, text + " The end."),
        "trailing newline": (text, text + "\n"),
        "double space": (text, text.replace(" ", "  ", 1)),
        "wrong article": (an, an.replace(" an ", " a ", 1)),
        "single line break": (text, text.replace("\n\n", "\n", 1)),
        "empty": (text, ""),
        "not a story": (text, "Hello, world!"),
    }


def test_score_rejects_texts_outside_the_language(docs):
    for what, (good, bad) in _mutations(docs).items():
        assert bad != good and score(good) < 0, what
        with pytest.raises(ValueError, match="not a story of this grammar"):
            score(bad)


# -- a proper, unambiguous distribution ---------------------------------------------------------


def test_every_choice_is_a_probability_distribution():
    assert len(BUILTIN.choices) > 100
    for choice in BUILTIN.choices.values():
        assert all(isinstance(w, int) and w > 0 for w in choice.weights), choice.name
        assert sum(Fraction(w, choice.total) for w in choice.weights) == 1
        assert math.fsum(math.exp(lp) for lp in choice.logps) == pytest.approx(1, abs=1e-12)
        for w, lp in zip(choice.weights, choice.logps, strict=True):
            assert lp == pytest.approx(math.log(w / choice.total), rel=1e-15, abs=1e-15)
        # The parser can tell the alternatives apart: each is predicted by some token.
        assert set(builtin_predict()[choice.name].values()) == set(range(len(choice.weights))), (
            choice.name
        )


def test_every_document_has_a_probability_below_one(docs):
    assert all(math.isfinite(lp) and lp < 0 for _, lp in docs)


def _derivations(seq: list, env: dict[str, str]):
    """Every (tokens, logprob) that a symbol sequence can derive; only for small rules."""
    if not seq:
        yield [], 0.0
        return
    head, rest = seq[0], seq[1:]
    if isinstance(head, str):
        heads = [([head], 0.0, rest)]
    elif isinstance(head, grammar._Ref):
        heads = [([head.form[env[head.var]]], 0.0, rest)]
    elif isinstance(head, grammar._Bind):
        for word, lp in zip(head.tokens, head.choice.logps, strict=True):
            for tokens, more in _derivations(rest, {**env, head.var: word}):
                yield [word, *tokens], lp + more
        return
    else:
        heads = [
            ([], lp, list(reversed(body)) + rest)
            for lp, body in zip(head.logps, head.bodies, strict=True)
        ]
    for prefix, lp, todo in heads:
        for tokens, more in _derivations(todo, env):
            yield prefix + tokens, lp + more


ENV = {"hero": "Mia", "friend": "Pip", "obj": "key", "place": "park", "home": "house"}


@pytest.mark.parametrize(
    "rule", ["time_start", "connective", "end_time", "find_lead", "greet_tail", "obj_state"]
)
def test_small_rules_sum_to_one_and_never_repeat_a_text(rule):
    # Brute force, independent of the LL(1) argument: all derivations, distinct texts.
    derivations = list(_derivations([BUILTIN.choices[rule]], ENV))
    assert len(derivations) > 10
    assert math.fsum(math.exp(lp) for _, lp in derivations) == pytest.approx(1, abs=1e-9)
    texts = [_render(tokens) for tokens, _ in derivations]
    assert len(set(texts)) == len(texts)


def test_mean_information_matches_the_exact_entropy(docs):
    # Monte Carlo: E_p[-log p] is the entropy computed from the rules. A sampler that drew with
    # other probabilities than it records, or a choice left out of the sum, would miss it.
    info = [-lp for _, lp in docs]
    mean = sum(info) / len(info)
    sd = math.sqrt(sum((x - mean) ** 2 for x in info) / (len(info) - 1))
    assert abs(mean - grammar.document_entropy()) < 5 * sd / math.sqrt(len(info))


def test_openings_are_drawn_with_their_weights(docs):
    counts = {"Once upon": 0, "There once": 0, "Long ago": 0, "Far away": 0, "name": 0}
    for text, _ in docs:
        key = next((k for k in counts if text.startswith(k)), "name")
        counts[key] += 1
    weights = {"Once upon": 4, "There once": 3, "Long ago": 2, "Far away": 2, "name": 3}
    for key, w in weights.items():
        p = w / sum(weights.values())
        sd = math.sqrt(N_DOCS * p * (1 - p))
        assert abs(counts[key] - N_DOCS * p) < 5 * sd, key


def test_bits_per_byte_is_in_range(docs):
    nats = -sum(lp for _, lp in docs)
    nbytes = sum(len(t.encode()) for t, _ in docs)
    bpb = nats / math.log(2) / nbytes
    assert 0.3 < bpb < 0.6


# -- checks that back the unambiguity argument ---------------------------------------------------

WORDS = {"noun": "cat dog", "adj": "big old", "name": "Mia Tom"}


def small(rules: dict[str, str]) -> Grammar:
    """A grammar of these rules over WORDS, with the builtin pronouns."""
    return Grammar(rules, WORDS, {"Mia": "f", "Tom": "m"}, BUILTIN.pronouns)


def test_the_shipped_grammar_is_proved_with_the_tables_generate_walks():
    # The import does not prove the grammar safe; this proves it on the same file, and checks
    # that the proof compiled the tables the import did.
    _, choices, predict = compile_checked(grammar.load(grammar.GRAMMAR_FILE))
    assert predict.keys() == choices.keys() == BUILTIN.choices.keys()
    for name, choice in BUILTIN.choices.items():
        assert (choices[name].weights, choices[name].logps) == (choice.weights, choice.logps)


@pytest.mark.parametrize(
    "rules, message",
    [
        ({"story": "<x> | <y>", "x": "hello world", "y": "hello world"}, "not LL"),
        ({"story": "a <adj_opt> <adj_opt> <noun> .", "adj_opt": "<adj> |"}, "not LL"),
        ({"story": "a <pet> .", "pet": "<noun> | dog"}, "not LL"),
        ({"story": "a <story> | b"}, "recursive"),
        ({"story": "{x} ."}, "before it is bound"),
        ({"story": "<maybe> {x} .", "maybe": "[x:name] |"}, "before it is bound"),
        ({"story": "`` hello ''"}, "closing quote"),
        ({"story": "`` hello <end>", "end": "'' | ! ''"}, "closing quote"),
        ({"story": "an <noun>"}, "bad terminal"),
        ({"story": "a <nope>"}, "unknown rule"),
        ({"story": "0: a | b"}, "positive"),
    ],
)
def test_compile_rejects_unsafe_grammars(rules, message):
    with pytest.raises(GrammarError, match=message):
        compile_checked(small(rules))


SMALL_FILE = """# a comment
pronouns f = subj:she
name f = Mia
noun = cat
  dog
story -> Mia saw a <noun> .
"""


@pytest.mark.parametrize(
    "entry, message",
    [
        ("story2 <noun> .", "expected `rule -> alternatives` or `class = words`"),
        ("noun = cow", "noun is already defined at {path}:4"),
        ("story2 f -> a", "a rule has no gender: `story2 -> ...`"),
        ("name x = Zed", "no `pronouns x = ...` line above for 'name'"),
        ("friend f = Mia", "name 'Mia' is listed twice"),
        ("pronouns m = he", "expected `pronouns GENDER = form:word ...`"),
        ("story2 -> an <noun>", "bad terminal 'an'"),
        ("story2 -> a <nope>", "unknown rule <nope>"),
        ("story2 -> a [x:nope]", "[x:nope]: 'nope' is not a word class"),
        ("story2 -> 0: a | b", "weights must be positive integers, got 0"),
        ("story2 -> [x:name] {x.subjj}", "{x.subjj}: no form 'subjj' for 'Mia'"),
    ],
)
def test_a_malformed_entry_is_one_line_naming_its_file_and_line(tmp_path, entry, message):
    path = tmp_path / "stories.txt"
    path.write_text(SMALL_FILE + entry + "\n")
    with pytest.raises(GrammarError) as e:
        grammar._compile(grammar.load(path))
    assert str(e.value) == f"{path}:7: " + message.replace("{path}", str(path))
    assert isinstance(e.value, UsageError)  # so the CLI prints it as one line


def test_a_malformed_grammar_fails_the_download_as_one_line(tmp_path):
    # The CLI imports every stage's module for its help: a grammar read at import would fail
    # there with a traceback.
    text = grammar.GRAMMAR_FILE.read_text()
    bad = tmp_path / "grammar.txt"
    bad.write_text(text.replace("can_who -> I | we", "can_who -> I | we <nope>"))
    line = 1 + text.splitlines().index("can_who -> I | we")
    shutil.copy(ROOT / "params.yaml", tmp_path)
    code = (
        "import sys; from pathlib import Path; from dsflow.data import grammar; "
        f"grammar.GRAMMAR_FILE = Path({str(bad)!r}); "
        "from dsflow.cli import main; sys.exit(main(['download']))"
    )
    proc = run([sys.executable, "-c", code], cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"dsflow download: error: {bad}:{line}: unknown rule <nope>"
    ]


def test_compile_accepts_a_small_grammar_with_agreement():
    rules = {
        "story": "[hero:name] saw a <adj_opt> <noun> . {hero.Subj} smiled .",
        "adj_opt": "<adj> |",
    }
    stack, _, _ = compile_checked(small(rules))
    texts = {_render(t) for t, _ in _derivations(list(reversed(stack)), {})}
    assert "Mia saw a big cat. She smiled." in texts
    assert "Tom saw an old dog. He smiled." in texts
    assert len(texts) == 2 * 3 * 2


# -- the texts -----------------------------------------------------------------------------------


def test_texts_are_ascii_and_well_formed(docs):
    for text, _ in docs:
        assert text.isascii() and text == text.strip()
        assert 200 <= len(text) <= 1400
        assert "  " not in text and "\n\n\n" not in text
        assert "\n" not in text.replace("\n\n", "")
        assert 4 <= len(text.split("\n\n")) <= 7
        assert text.count('"') % 2 == 0
    mean = sum(len(t) for t, _ in docs) / len(docs)
    assert 450 < mean < 750


def test_vocabulary_is_large(docs):
    vocab = set()
    for text, _ in docs:
        vocab.update(re.findall(r"[A-Za-z]+", text))
    assert len(vocab) > 800


def test_articles_agree_with_the_next_word(docs):
    for text, _ in docs:
        assert not re.search(r"\b[Aa] [aeiou]", text)
        assert not re.search(r"\b[Aa]n [^aeiou]", text)


def test_pronouns_agree_with_the_protagonist(docs):
    with_pronouns = 0
    for text, _ in docs:
        hero = hero_of(text)
        assert hero in text.split(".")[0]  # named in the first sentence
        assert text.count(hero) >= 2  # and referred back to by name later
        used = {w.lower() for w in re.findall(r"[A-Za-z]+", text)} & ALL_PRONOUNS
        assert used <= PRONOUN_FORMS[BUILTIN.genders[hero]], (hero, used)
        with_pronouns += bool(used)
        assert not re.search(r"\b(?:[Ss]he|[Hh]e) were\b|\b[Tt]hey was\b", text)
    assert with_pronouns > 0.95 * len(docs)
