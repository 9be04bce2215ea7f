"""The grammar's proof of safety, and the parser that the proof makes possible.

dsflow.data.grammar's docstring argues that a text has at most one derivation, so its logprob is
exact. `compile_checked` proves what that argument needs, for any grammar and so for the shipped
grammar.txt: derivations are bounded (no rule contains itself), every {var} is bound before use
on every path, a closing quote always follows punctuation (how the tokenizer tells it apart),
and the rules are LL(1). The LL(1) proof yields the parser's table (per rule, the alternative
each lookahead token selects), and `parse` walks the generator's own tables with it, adding the
same floats in the same order, so its logprob is exactly the one `generate` recorded.
"""

from __future__ import annotations

import functools
import re
from types import SimpleNamespace

from dsflow.data import grammar
from dsflow.data.grammar import (
    CLOSE_QUOTE,
    OPEN_QUOTE,
    Grammar,
    GrammarError,
    _Choice,
    _Raw,
    _Ref,
    _render,
)

_PUNCT = frozenset(".,!?")
_TOKEN = re.compile(r"[A-Za-z]+|\n\n|\S")
_NOT_A_STORY = "not a story of this grammar"


def compile_checked(g: Grammar, start: str = "story") -> tuple[list, dict[str, _Choice], dict]:
    """grammar._compile's tables for `g`, proved safe first, and the LL(1) table: (start stack,
    choices by name, rule -> {lookahead token: alternative}). GrammarError if unsafe."""
    raw = _Raw(g, start)
    _check_acyclic(raw)
    _check_bound(raw)  # before _forms, whose error for an unbound {var} says less
    forms = grammar._forms(raw, g)
    _check_quotes(raw, forms)
    predict = _predict(raw, forms)
    stack, choices = grammar._tables(raw, forms)
    return stack, choices, predict


@functools.cache
def builtin_predict() -> dict[str, dict]:
    """The LL(1) table of the shipped grammar: proving it is what the import no longer does."""
    return compile_checked(grammar.builtin())[2]


def _predict(raw: _Raw, forms: dict) -> dict[str, dict]:
    """Per rule, the alternative each lookahead token selects (None: the end of the text).
    GrammarError if two alternatives of a rule share a token: not LL(1), so possibly ambiguous."""
    first, nullable = _first_sets(raw, forms)
    follow = _follow_sets(raw, first, nullable, forms)
    tables: dict[str, dict] = {}
    conflicts = []
    for name, alts in raw.alts.items():
        table = tables[name] = {}
        for i, (_, body) in enumerate(alts):
            f, null = _first_of(body, first, nullable, forms)
            for tok in f | follow[name] if null else f:
                if tok in table:
                    conflicts.append(f"<{name}> alternatives {table[tok]} and {i} on {tok!r}")
                table[tok] = i
    if conflicts:
        raise GrammarError("not LL(1), so possibly ambiguous: " + "; ".join(conflicts[:20]))
    return tables


def _first_sets(raw: _Raw | SimpleNamespace, forms: dict) -> tuple[dict[str, set], set[str]]:
    first: dict[str, set] = {name: set() for name in raw.alts}
    nullable: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, alts in raw.alts.items():
            for _, body in alts:
                f, null = _first_of(body, first, nullable, forms)
                if not f <= first[name]:
                    first[name] |= f
                    changed = True
                if null and name not in nullable:
                    nullable.add(name)
                    changed = True
    return first, nullable


def _first_of(body, first, nullable, forms) -> tuple[set, bool]:
    """FIRST of a symbol sequence, and whether it can derive the empty string."""
    out: set = set()
    for sym in body:
        kind = sym[0]
        if kind == "t":
            out.add(sym[1])
            return out, False
        if kind == "ref":
            out.update(forms[sym[1], sym[2]].values())
            return out, False
        name = sym[1] if kind == "nt" else sym[2]
        out |= first[name]
        if name not in nullable:
            return out, False
    return out, True


def _follow_sets(raw: _Raw | SimpleNamespace, first, nullable, forms) -> dict[str, set]:
    follow: dict[str, set] = {name: set() for name in raw.alts}
    follow[raw.start].add(None)  # None: the end of the document
    changed = True
    while changed:
        changed = False
        for name, alts in raw.alts.items():
            for _, body in alts:
                for i, sym in enumerate(body):
                    if sym[0] not in ("nt", "bind"):
                        continue
                    target = sym[1] if sym[0] == "nt" else sym[2]
                    f, null = _first_of(body[i + 1 :], first, nullable, forms)
                    if null:
                        f = f | follow[name]
                    if not f <= follow[target]:
                        follow[target] |= f
                        changed = True
    return follow


def _check_acyclic(raw: _Raw) -> None:
    """Bounded derivations: no rule may (even indirectly) contain itself."""
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            raise GrammarError("recursive rules: " + " -> ".join(path + [name]))
        state[name] = 1
        for _, body in raw.alts[name]:
            for sym in body:
                if sym[0] == "nt":
                    visit(sym[1], path + [name])
        state[name] = 2

    for name in raw.alts:
        visit(name, [])


def _check_bound(raw: _Raw) -> None:
    """Every reference is preceded, on every derivation, by a binding of its variable."""
    memo: dict[tuple[str, frozenset], frozenset] = {}

    def after(name: str, bound: frozenset) -> frozenset:
        key = (name, bound)
        if key not in memo:
            memo[key] = frozenset.intersection(*(walk(b, bound) for _, b in raw.alts[name]))
        return memo[key]

    def walk(body: list[tuple], bound: frozenset) -> frozenset:
        for sym in body:
            if sym[0] == "ref" and sym[1] not in bound:
                raise GrammarError(f"{{{sym[1]}}} may be used before it is bound")
            if sym[0] == "bind":
                bound = bound | {sym[1]}
            elif sym[0] == "nt":
                bound = after(sym[1], bound)
        return bound

    after(raw.start, frozenset())


def _check_quotes(raw: _Raw, forms: dict) -> None:
    """A closing quote always directly follows punctuation: that is how _tokenize tells it apart.

    The tokens that can precede a symbol are FIRST and FOLLOW of the grammar read backwards.
    """
    mirror = SimpleNamespace(
        start=raw.start,
        alts={name: [(w, body[::-1]) for w, body in alts] for name, alts in raw.alts.items()},
    )
    last, nullable = _first_sets(mirror, forms)
    before = _follow_sets(mirror, last, nullable, forms)
    for name, alts in mirror.alts.items():
        for _, body in alts:
            for i, sym in enumerate(body):
                if sym != ("t", CLOSE_QUOTE):
                    continue
                prev, null = _first_of(body[i + 1 :], last, nullable, forms)
                if null:
                    prev = prev | before[name]
                if not prev <= _PUNCT:
                    raise GrammarError(f"<{name}>: a closing quote must follow . , ! or ?")


# ---------------------------------------------------------------------------------------------
# The parser: the sampler's walk over the same tables, choosing by the text.


def _tokenize(text: str) -> list[str]:
    """The inverse of _render on canonical text (score checks canonicity by re-rendering)."""
    tokens = []
    for m in _TOKEN.finditer(text):
        tok = m.group()
        if tok == '"':
            after_punct = m.start() > 0 and text[m.start() - 1] in _PUNCT
            tok = CLOSE_QUOTE if after_punct else OPEN_QUOTE
        elif tok == "an" or tok == "An":
            tok = tok[0]
        tokens.append(tok)
    return tokens


def score(text: str) -> float:
    """The natural-log probability of `text`; ValueError if the grammar cannot produce it."""
    return parse(text)[0]


def parse(text: str) -> tuple[float, dict[str, str]]:
    """(logprob, bindings) of `text`: bindings are the remembered words of its one derivation
    (hero, friend, obj, place, home, hkind, fkind). ValueError if the grammar cannot produce it."""
    tokens = _tokenize(text)
    logprob, env = _parse(list(grammar.builtin().stack), tokens, builtin_predict())
    if _render(tokens) != text:
        raise ValueError(f"{_NOT_A_STORY}: spacing, quotes or a/an are not canonical")
    return logprob, env


def _parse(stack: list, tokens: list[str], predict: dict) -> tuple[float, dict[str, str]]:
    n = len(tokens)
    pos = 0
    env: dict[str, str] = {}
    logprob = 0.0
    pop, push = stack.pop, stack.extend
    while stack:
        sym = pop()
        look = tokens[pos] if pos < n else None
        kind = sym.__class__
        if kind is _Choice:
            i = predict[sym.name].get(look)
            if i is None:
                raise ValueError(_unexpected(look, pos, f"<{sym.name}>"))
            logprob += sym.logps[i]
            push(sym.bodies[i])
            continue
        if kind is str:
            expected = sym
        elif kind is _Ref:
            expected = sym.form[env[sym.var]]
        else:
            i = predict[sym.choice.name].get(look)
            if i is None:
                raise ValueError(_unexpected(look, pos, f"a word of <{sym.choice.name}>"))
            logprob += sym.choice.logps[i]
            env[sym.var] = expected = look
        if look != expected:
            raise ValueError(_unexpected(look, pos, repr(expected)))
        pos += 1
    if pos != n:
        raise ValueError(
            f"{_NOT_A_STORY}: text goes on after the end (token {pos}: {tokens[pos]!r})"
        )
    return logprob, env


def _unexpected(look: str | None, pos: int, wanted: str) -> str:
    got = "the end of the text" if look is None else repr(look)
    return f"{_NOT_A_STORY}: {got} at token {pos}, expected {wanted}"
