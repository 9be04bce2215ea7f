"""The builtin corpus: children's stories from a probabilistic grammar with exact log-probabilities.

Why a grammar: a model's bits per byte means little without a floor to compare it to. Every
document here is drawn from a known distribution, so -logprob of a text is its exact information
content and the corpus entropy is known, not estimated.

Design. grammar.txt, beside this module, is a weighted grammar written as data: rules with
weighted alternatives, word classes, names by gender and their pronouns, in the notation its
header describes. `load` reads a grammar file, failing on a malformed entry with one line that
names its file:line; `builtin` is the shipped one, read and compiled on first use.

Remembered words give the long-range structure (the protagonist named in the first sentence and
named again later, pronouns that agree with that name, the object found early and mentioned in
the conclusion) at no cost in entropy: a reference is a function of earlier text. A document's
logprob is the sum of log(w / total) over every choice made, including those that only decide
length (an optional adjective, one more sentence or paragraph). Weights are integers, so each
probability is an exact rational; each log is rounded once, identically on every platform.

One description drives both directions. `_compile` turns the rules into tables of `_Choice`
points; `generate` walks them drawing each choice from an RNG of its own, seeded from
(seed, index). The parser in tests/unit/data/grammar_ll1.py walks the same tables as a predictive parser,
reading each choice off the text, with the same logs in the same order of summation, so its
score of a text is exactly the float that `generate` recorded.

Why the grammar is unambiguous. tests/unit/data/grammar_ll1.py proves it LL(1): for every rule, the tokens
that can begin each alternative (its FIRST set, plus the rule's FOLLOW set where the alternative
can be empty) are disjoint from those of every other alternative. A reference counts as every
word its variable could hold, which only makes the check stricter. So one token of lookahead
always decides the alternative, the parser is deterministic, and a token sequence has at most one
derivation. Text and tokens are in bijection too: the parser's tokenizer undoes `_render` (words
are runs of letters, spacing is canonical, "a" becomes "an" only in rendering and "an" is no
terminal, a closing quote always follows punctuation, which the proof checks too), and the parser
rejects a text that does not re-render to itself. Hence p(text) = p(derivation): the recorded
logprob is the probability of the text, and mean -logprob is the corpus entropy
(`document_entropy` gives its exact value per document). The proof also checks that derivations
are bounded (no recursion) and that every reference follows a binding of its variable on every
path. It runs in the tests, not at import: the file changes only with a commit, and the tests
prove each version, so proving it again at every import would only cost time.
"""

from __future__ import annotations

import decimal
import functools
import math
import random
import re
from bisect import bisect_right
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dsflow.errors import UsageError

GRAMMAR_VERSION = "1"
GRAMMAR_FILE = Path(__file__).with_name("grammar.txt")

PARAGRAPH = "\n\n"
OPEN_QUOTE, CLOSE_QUOTE = "``", "''"
_TERMINAL = re.compile(r"[A-Za-z]+|[.,!?]|``|''")


class GrammarError(UsageError):
    """A grammar file is malformed, or its rules are unsafe (not LL(1), recursive, ...)."""


# ---------------------------------------------------------------------------------------------
# The grammar file.


class Grammar:
    """A grammar file's entries: rules and word classes as written (alternatives, words), each
    name's gender and the pronoun forms by gender; for the builtin grammar, also the tables that
    `generate` walks. A plain class: a dataclass would import inspect, at every import."""

    def __init__(self, rules=None, words=None, genders=None, pronouns=None) -> None:
        self.rules: dict[str, str] = rules or {}
        self.words: dict[str, str] = words or {}
        self.genders: dict[str, str] = genders or {}
        self.pronouns: dict[str, dict[str, str]] = pronouns or {}
        self.where: dict[str, str] = {}  # an entry's file:line, for error messages
        self.stack: list = []  # the start symbol, compiled (see _compile), and its choice points
        self.choices: dict[str, _Choice] = {}


_ENTRY = re.compile(r"(\w+)(?:\s+(\w+))?\s*(->|=)(.*)")


def load(path: Path) -> Grammar:
    """The entries of a grammar file; GrammarError naming the file:line of a malformed one."""
    g = Grammar()
    for where, text in _entries(path):
        m = _ENTRY.fullmatch(text)
        if m is None:
            raise GrammarError(f"{where}: expected `rule -> alternatives` or `class = words`")
        name, tag, arrow, body = m[1], m[2], m[3], m[4].strip()
        key = f"{name} {tag}" if tag else name
        if key in g.where:
            raise GrammarError(f"{where}: {key} is already defined at {g.where[key]}")
        g.where[key] = where
        if arrow == "->" and tag:
            raise GrammarError(f"{where}: a rule has no gender: `{name} -> ...`")
        if arrow == "->":
            g.rules[name] = body
        elif name == "pronouns":
            g.pronouns[tag] = _pronoun_forms(where, tag, body)
        else:
            _add_words(g, where, name, tag, body)
    return g


def _entries(path: Path) -> list[tuple[str, str]]:
    """(file:line, text) of each entry: blank and comment lines dropped, indented lines joined
    to the entry above (so a long rule wraps)."""
    entries: list[tuple[str, str]] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line[0].isspace():
            entries.append((f"{path}:{n}", line.strip()))
        elif entries:
            entries[-1] = (entries[-1][0], f"{entries[-1][1]} {line.strip()}")
        else:
            raise GrammarError(
                f"{path}:{n}: an indented line continues an entry, but none is above"
            )
    return entries


def _pronoun_forms(where: str, gender: str | None, body: str) -> dict[str, str]:
    pairs = [form.split(":") for form in body.split()]
    if gender is None or not pairs or any(len(p) != 2 or not all(p) for p in pairs):
        raise GrammarError(f"{where}: expected `pronouns GENDER = form:word ...`")
    return dict(pairs)


def _add_words(g: Grammar, where: str, name: str, gender: str | None, body: str) -> None:
    """A line's words join the class `name`; with a gender, they are names of that gender."""
    if not body:
        raise GrammarError(f"{where}: {name} lists no words")
    if gender is not None:
        if gender not in g.pronouns:
            raise GrammarError(f"{where}: no `pronouns {gender} = ...` line above for {name!r}")
        for word in body.split():
            if word in g.genders:
                raise GrammarError(f"{where}: name {word!r} is listed twice")
            g.genders[word] = gender
    g.words[name] = f"{g.words[name]} {body}" if name in g.words else body


@contextmanager
def _located(where: str):
    """Prefix a GrammarError with the entry it is about."""
    try:
        yield
    except GrammarError as e:
        raise GrammarError(f"{where}: {e}") from None


# ---------------------------------------------------------------------------------------------
# Compiled form, shared by the sampler and the parser.


class _Choice:
    """A choice point: alternatives with exact weights."""

    __slots__ = ("name", "thresholds", "total", "logps", "bodies", "weights")

    def __init__(self, name: str) -> None:
        self.name = name


class _Bind:
    """Draw a word from a word class and remember it."""

    __slots__ = ("var", "choice", "tokens")

    def __init__(self, var: str, choice: _Choice, tokens: tuple[str, ...]) -> None:
        self.var, self.choice, self.tokens = var, choice, tokens


class _Ref:
    """Emit a function of a remembered word: the word itself, or a pronoun agreeing with it."""

    __slots__ = ("var", "form")

    def __init__(self, var: str, form: dict[str, str]) -> None:
        self.var, self.form = var, form


def _alternatives(spec: str) -> list[tuple[int, str]]:
    """Split a rule into weighted alternatives: 'a | 2: b c | 3:' is a, b c (weight 2), and
    the empty alternative (weight 3)."""
    out = []
    for alt in _BAR.split(spec):
        weighted = _WEIGHTED.fullmatch(alt.strip())
        out.append((int(weighted[1]), weighted[2]) if weighted else (1, alt.strip()))
    for weight, _ in out:
        if weight < 1:
            raise GrammarError(f"weights must be positive integers, got {weight}")
    return out


_BAR = re.compile(r"(?<!\|)\|(?!\|)")  # "|" separates alternatives, "||" is a paragraph break
_WEIGHTED = re.compile(r"(\d+):\s*(.*)")


def _parse_symbol(text: str) -> tuple:
    """One symbol of a rule body, as ("t", token) / ("nt", name) / ("bind", var, class) /
    ("ref", var, attr)."""
    if text == "||":
        return ("t", PARAGRAPH)
    if text.startswith("<") and text.endswith(">"):
        return ("nt", text[1:-1])
    if text.startswith("[") and text.endswith("]"):
        var, _, cls = text[1:-1].partition(":")
        return ("bind", var, cls)
    if text.startswith("{") and text.endswith("}"):
        var, _, attr = text[1:-1].partition(".")
        return ("ref", var, attr)
    if not _TERMINAL.fullmatch(text) or text.lower() == "an":
        # "an" is produced only by _render, which is what lets the parser's tokenizer undo it.
        raise GrammarError(f"bad terminal {text!r}")
    return ("t", text)


def _capitalise(word: str) -> str:
    return word[:1].upper() + word[1:]


class _Raw:
    """The rules as symbol tuples, with <Capitalised> variants derived on demand."""

    def __init__(self, g: Grammar, start: str) -> None:
        self.start = start
        self.alts: dict[str, list[tuple[int, list[tuple]]]] = {}
        self.classes = set(g.words)
        for name, spec in g.words.items():
            self.alts[name] = [(1, [("t", word)]) for word in spec.split()]
        for name, spec in g.rules.items():
            with _located(g.where.get(name, f"<{name}>")):
                if name in self.alts:
                    raise GrammarError(f"{name!r} is both a rule and a word class")
                alts = _alternatives(spec)
                self.alts[name] = [(w, [_parse_symbol(s) for s in b.split()]) for w, b in alts]
        for name in g.rules:
            with _located(g.where.get(name, f"<{name}>")):
                for _, body in self.alts[name]:
                    for sym in body:
                        self.resolve(sym)
        if start not in self.alts:
            raise GrammarError(f"no start rule <{start}>")

    def resolve(self, sym: tuple) -> None:
        if sym[0] == "nt" and sym[1] not in self.alts:
            base = sym[1][:1].lower() + sym[1][1:]
            if base == sym[1] or base not in self.alts:
                raise GrammarError(f"unknown rule <{sym[1]}>")
            self.alts[sym[1]] = [(w, self.capitalised(body, base)) for w, body in self.alts[base]]
            for _, body in self.alts[sym[1]]:
                for s in body:
                    self.resolve(s)
        elif sym[0] == "bind" and sym[2] not in self.classes:
            raise GrammarError(f"[{sym[1]}:{sym[2]}]: {sym[2]!r} is not a word class")

    @staticmethod
    def capitalised(body: list[tuple], name: str) -> list[tuple]:
        if not body:
            raise GrammarError(f"<{name}> has an empty alternative, so cannot be capitalised")
        head = body[0]
        # A capitalised reference {var.^} is the remembered word itself, capitalised.
        if head[0] == "t":
            head = ("t", _capitalise(head[1]))
        elif head[0] == "nt":
            head = ("nt", _capitalise(head[1]))
        elif head[0] == "ref":
            head = ("ref", head[1], _capitalise(head[2]) if head[2] else "^")
        else:
            raise GrammarError(f"<{name}> starts with a variable binding; cannot capitalise it")
        return [head, *body[1:]]


def _forms(raw: _Raw, g: Grammar) -> dict[tuple[str, str], dict[str, str]]:
    """For each reference {var.attr}: the token it emits for every word `var` can be bound to."""
    domain: dict[str, set[str]] = {}
    for alts in raw.alts.values():
        for _, body in alts:
            for sym in body:
                if sym[0] == "bind":
                    domain.setdefault(sym[1], set()).update(b[0][1] for _, b in raw.alts[sym[2]])
    forms = {}
    for name, alts in raw.alts.items():
        with _located(g.where.get(name, f"<{name}>")):
            for _, body in alts:
                for sym in body:
                    if sym[0] == "ref" and sym[1:] not in forms:
                        forms[sym[1:]] = _form(sym[1], sym[2], domain.get(sym[1]), g)
    return forms


def _form(var: str, attr: str, domain: set[str] | None, g: Grammar) -> dict[str, str]:
    """The token {var.attr} emits for each word in `domain`, the words `var` can be bound to:
    the word itself, or its pronoun `attr`; {var.Attr} and {var.^} capitalise."""
    if domain is None:
        raise GrammarError(f"{{{var}}} refers to a variable that is never bound")
    cap = attr[:1].isupper() or attr == "^"
    base = "" if attr == "^" else attr.lower()
    form = {}
    for word in domain:
        pronouns = g.pronouns.get(g.genders.get(word), {})
        if base and base not in pronouns:
            raise GrammarError(f"{{{var}.{attr}}}: no form {base!r} for {word!r}")
        value = pronouns[base] if base else word
        form[word] = _capitalise(value) if cap else value
    return form


@functools.cache
def _log_ratio(numerator: int, denominator: int) -> float:
    """log(numerator / denominator), correctly rounded: libm's log may differ by an ulp between
    platforms, decimal's does not, so the recorded logprobs are the same everywhere."""
    with decimal.localcontext() as ctx:
        ctx.prec = 40
        return float((decimal.Decimal(numerator) / denominator).ln())


def _compile(g: Grammar, start: str = "story") -> tuple[list, dict[str, _Choice]]:
    """The tables `generate` walks: the start symbol's body (reversed, ready for a stack) and the
    choice points by name. tests/unit/data/grammar_ll1.py proves the rules safe first (see the docstring)."""
    raw = _Raw(g, start)
    return _tables(raw, _forms(raw, g))


def _tables(raw: _Raw, forms: dict) -> tuple[list, dict[str, _Choice]]:
    choices = {name: _Choice(name) for name in raw.alts}
    for name, alts in raw.alts.items():
        choice = choices[name]
        weights = [w for w, _ in alts]
        total = sum(weights)
        cumulative = [sum(weights[: i + 1]) for i in range(len(weights))]
        choice.weights = tuple(weights)
        choice.total = total
        # Thresholds without the last bound: bisect then lands in 0..n-1 even if the float
        # product random() * total rounds up to total.
        choice.thresholds = cumulative[:-1]
        choice.logps = tuple(_log_ratio(w, total) for w in weights)

    def compiled(body: list[tuple]) -> list:
        out = []
        for sym in body:
            if sym[0] == "t":
                out.append(sym[1])
            elif sym[0] == "ref":
                out.append(_Ref(sym[1], forms[sym[1], sym[2]]))
            elif sym[0] == "bind":
                cls = choices[sym[2]]
                out.append(_Bind(sym[1], cls, tuple(b[0][1] for _, b in raw.alts[sym[2]])))
            elif len(raw.alts[sym[1]]) == 1:
                out.extend(compiled(raw.alts[sym[1]][0][1]))  # no choice to make: inline it
            else:
                out.append(choices[sym[1]])
        return out

    for name, alts in raw.alts.items():
        choices[name].bodies = tuple(tuple(reversed(compiled(body))) for _, body in alts)
    return list(reversed(compiled([("nt", raw.start)]))), choices


@functools.cache
def builtin() -> Grammar:
    """grammar.txt and its tables, read on first use, not at import: the CLI imports every
    stage's module for its help, where a malformed file would fail as a traceback, not as the
    one line the stage that uses it reports."""
    g = load(GRAMMAR_FILE)
    g.stack, g.choices = _compile(g)
    return g


# ---------------------------------------------------------------------------------------------
# Tokens -> text.

# Tokens are joined by spaces, then punctuation and paragraph breaks take the space before them
# and quotes the space inside them. Nothing else is ever adjacent without a space, so letter runs
# and single marks split the text back into the same tokens.
_TIGHTEN = (
    (" .", "."),
    (" ,", ","),
    (" !", "!"),
    (" ?", "?"),
    (f" {PARAGRAPH} ", PARAGRAPH),
    (f"{OPEN_QUOTE} ", '"'),
    (f" {CLOSE_QUOTE}", '"'),
)
# By letter, not sound: the vocabulary avoids words where the two disagree.
_A_BEFORE_VOWEL = re.compile(r"\b([Aa]) (?=[AEIOUaeiou])")


def _render(tokens: list[str]) -> str:
    text = " ".join(tokens)
    for spaced, tight in _TIGHTEN:
        text = text.replace(spaced, tight)
    return _A_BEFORE_VOWEL.sub(r"\1n ", text)


# ---------------------------------------------------------------------------------------------
# The sampler and the public API.


def _sample(stack: list, rng: random.Random) -> tuple[list[str], float]:
    draw = rng.random
    out: list[str] = []
    env: dict[str, str] = {}
    logprob = 0.0
    pop, push, emit = stack.pop, stack.extend, out.append
    while stack:
        sym = pop()
        kind = sym.__class__
        if kind is str:
            emit(sym)
        elif kind is _Choice:
            i = bisect_right(sym.thresholds, draw() * sym.total)
            logprob += sym.logps[i]
            push(sym.bodies[i])
        elif kind is _Ref:
            emit(sym.form[env[sym.var]])
        else:
            choice = sym.choice
            i = bisect_right(choice.thresholds, draw() * choice.total)
            logprob += choice.logps[i]
            env[sym.var] = word = sym.tokens[i]
            emit(word)
    return out, logprob


def generate(seed: int, index: int) -> tuple[str, float]:
    """Document `index` of the corpus with seed `seed`, as (text, natural-log probability)."""
    rng = random.Random(f"dsflow-grammar:{seed}:{index}")
    tokens, logprob = _sample(list(builtin().stack), rng)
    return _render(tokens), logprob


def iter_documents(seed: int, n_docs: int, start: int = 0) -> Iterator[tuple[str, float]]:
    """(text, logprob) for documents start .. start + n_docs - 1."""
    for index in range(start, start + n_docs):
        yield generate(seed, index)


def document_entropy() -> float:
    """The exact entropy of a document in nats, E[-logprob], computed from the rules.

    Derivations and texts are in bijection, so this is the sum over choice points of their
    entropy weighted by how likely they are to be reached.
    """
    memo: dict[int, float] = {}

    def of_body(body: tuple) -> float:
        total = 0.0
        for sym in body:
            if sym.__class__ is _Choice:
                total += of_choice(sym)
            elif sym.__class__ is _Bind:
                total += of_choice(sym.choice)
        return total

    def of_choice(choice: _Choice) -> float:
        if id(choice) not in memo:
            memo[id(choice)] = sum(
                math.exp(lp) * (of_body(body) - lp)
                for lp, body in zip(choice.logps, choice.bodies, strict=True)
            )
        return memo[id(choice)]

    return of_body(tuple(builtin().stack))
