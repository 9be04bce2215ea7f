"""The builtin corpus: children's stories from a probabilistic grammar with exact log-probabilities.

Why a grammar: a model's bits per byte means little without a floor to compare it to. Here every
document is drawn from a known distribution, so -logprob of each text is its exact information and
the corpus entropy is known, not estimated.

Design. `RULES` is a weighted context-free grammar written as data: each nonterminal maps to
alternatives `(weight, body)`, where a body is a space-separated list of symbols:

    word , . ! ?     a terminal token (``/'' are opening/closing double quotes, || a paragraph break)
    <rule>           a nonterminal; <Rule> is the same rule with its first word capitalised
    [var:class]      draw a word from word class `class` (see `WORDS`) and remember it as `var`
    {var} {var.attr} repeat the remembered word, or a form derived from it ({hero.subj} -> she/he/
                     they by the gender of the name bound to `hero`); {var.Attr} capitalises it

Variables give the long-range structure (the protagonist's name, the pronouns that agree with it,
the object found early and mentioned in the conclusion) at no cost in entropy: a reference is a
deterministic function of earlier text. A document's log-probability is the sum of log(w/total) over
every choice made, including those that only decide length (optional adjectives, how many
sentences or paragraphs). Weights are integers, so every probability is an exact rational.

One description drives both directions. `generate` walks the compiled rules drawing each choice
from its own RNG; `score` walks the very same tables as a predictive parser, reading each choice
off the text. The two cannot drift apart: they share the tables, the log-probabilities and the
order in which those are summed, so `score(text)` reproduces `generate`'s float bit for bit.

Why the grammar is unambiguous. At import, `_compile` proves the grammar LL(1): for every
nonterminal, the sets of tokens that can start each alternative (FIRST, plus FOLLOW where the
alternative can be empty) are pairwise disjoint; variable references count every word their
variable could hold, an over-approximation that only makes the check stricter. So one token of
lookahead always determines the alternative, the parser is deterministic, and each token sequence
has at most one derivation. Text and token sequence are in bijection too: `_render` is undone by
`_tokenize` (words are letter runs, spacing is canonical, "a" becomes "an" before a vowel and "an"
is no terminal, a closing quote always follows punctuation), and `score` rejects any text that does
not re-render to itself. Hence p(text) = p(derivation), which is what `generate` records.
"""

from __future__ import annotations

import math
import random
import re
from bisect import bisect_right
from collections.abc import Iterator

GRAMMAR_VERSION = "1"

# ---------------------------------------------------------------------------------------------
# Vocabulary. "word*3" weighs a word 3 (default 1). A word's class is wherever it is listed; the
# LL(1) check at import rejects any overlap between classes that could make a text ambiguous.

# Protagonists, by the pronouns they take: f = she/her, m = he/him, n = they/them.
HERO_NAMES = {
    "f": "Mia Lily Emma Sara Lucy Anna Ella Zoe Ruby Nora Maya Hannah Grace Chloe Ivy Rosa Lena "
    "Kate Amy Jane Alice Molly Iris Elsie",
    "m": "Tom Ben Max Leo Jack Finn Noah Omar Luke Theo Oscar Hugo Eli Ryan Adam Jake Milo Owen "
    "Paul Felix Arlo Ezra Sami Otto",
    "n": "Alex Robin Jordan Riley Casey Quinn Jamie Taylor Morgan Avery Charlie Sky Rowan Ash",
}
# The friend's names are a separate pool, so "Mia met Mia" cannot happen and no choice point has
# to guess which character a name belongs to.
FRIEND_NAMES = {
    "f": "Daisy Maple Clover Hazel Poppy Willow Luna Bella Fern Pearl",
    "m": "Pip Bolt Rocky Biscuit Ziggy Buster Pepper Toby Rusty Sparky",
    "n": "Pebble Button Twig Moss Dot Sunny Bubbles Fluff Nibbles Jelly",
}
PRONOUNS = {
    "f": {"subj": "she", "obj": "her", "poss": "her", "self": "herself", "was": "was"},
    "m": {"subj": "he", "obj": "him", "poss": "his", "self": "himself", "was": "was"},
    "n": {"subj": "they", "obj": "them", "poss": "their", "self": "themselves", "was": "were"},
}

WORDS = {
    "hero_name": " ".join(HERO_NAMES.values()),
    "friend_name": " ".join(FRIEND_NAMES.values()),
    "creature": "rabbit*3 fox*2 mouse*2 bear*2 duck kitten*2 puppy*2 owl frog squirrel hedgehog "
    "turtle penguin piglet goat lamb deer otter raccoon badger robot dragon elephant monkey tiger "
    "lion beaver hamster goose mole",
    "char_adj": "little*4 tiny*2 young small happy brave clever kind shy curious gentle quiet "
    "funny silly sleepy friendly lucky busy proud cheerful grumpy wise playful careful fluffy "
    "chubby",
    "trait": "kind brave clever shy curious gentle funny friendly cheerful careful playful "
    "patient polite smart strong quiet",
    "land_adj": "faraway green sunny quiet peaceful snowy sleepy misty",
    "land": "valley kingdom village town forest land island country",
    "dwelling": "house*3 cottage*2 burrow nest cabin hut den treehouse barn tent",
    "home_adj": "cozy little small warm tidy old snug bright",
    "near_place": "woods river sea hills lake meadow mountains pond forest stream",
    "hobby_ing": "singing dancing painting reading drawing swimming climbing baking running "
    "jumping exploring skipping gardening counting whistling fishing",
    "time_noun": "morning*3 afternoon*2 evening day*2",
    "weather": "sunny rainy windy cold warm snowy bright cloudy foggy chilly lovely quiet",
    "move_verb": "walked*3 ran*2 skipped hurried wandered raced strolled hopped marched rushed "
    "dashed trotted",
    "adverb": "quickly slowly happily quietly carefully cheerfully bravely eagerly",
    "place": "park*3 forest*2 beach*2 garden*2 meadow river lake hill village market library "
    "castle cave farm pond field zoo harbor island valley mountain orchard playground bakery "
    "museum shore jungle desert swamp",
    "place_adj": "quiet green busy sunny peaceful noisy beautiful big dark cool warm bright muddy "
    "sandy lovely calm empty misty windy wide",
    "find_verb": "found*3 saw*2 spotted noticed discovered",
    "thing_adj": "shiny old tiny big small strange heavy smooth round bright soft wooden golden "
    "silver magic broken dusty sparkly secret lost special little pretty",
    "color": "red blue green yellow purple orange pink white black brown gray",
    "object": "key ball box shell stone feather coin map hat book bell ring kite boat cup spoon "
    "clock lamp drum whistle marble umbrella egg acorn jar basket toy train doll crown star "
    "wand compass flute scarf mitten candle",
    "landmark": "tree*3 bush*2 log bench fence hedge stump mushroom rock flowerpot wagon",
    "greeting": "Hello*3 Hi*2 Hey",
    "feeling": "happy*3 glad excited proud surprised sad scared worried sleepy curious calm "
    "thankful hungry tired",
    "good_feeling": "happy*3 glad proud thankful excited",
    "food": "apples cookies berries sandwiches carrots cake honey bread soup cherries nuts pie "
    "grapes muffins cheese",
    "shout_verb": "shouted said*2 cried yelled laughed giggled",
    "game": "tag hide catch hopscotch checkers",
    "build_thing": "castle tower fort bridge house",
    "sky_thing": "clouds stars birds butterflies",
    "water_thing": "pond puddle river stream",
    "container": "bag pocket basket backpack",
}

# ---------------------------------------------------------------------------------------------
# Rules. A body "" is the empty alternative. A plain string is a single alternative of weight 1.

RULES: dict[str, str | list[tuple[int, str]]] = {
    "story": "<intro> || <outing> || <meeting> || <middle1>",
    # -- introduction: the protagonist is named in the first sentence
    "intro": [
        (4, "Once upon a time , there was a <char_adj_opt> [hkind:creature] named "
         "[hero:hero_name] . <home_sent> <intro_more>"),
        (3, "There once was a <char_adj_opt> [hkind:creature] called [hero:hero_name] . "
         "<home_sent> <intro_more>"),
        (3, "[hero:hero_name] was a <char_adj_opt> [hkind:creature] who lived in a "
         "<home_adj_opt> [home:dwelling] <home_near> . <intro_more>"),
        (2, "Long ago , in a <land_adj_opt> <land> , there lived a [hkind:creature] named "
         "[hero:hero_name] . <home_sent> <intro_more>"),
    ],
    "home_sent": [
        (3, "{hero.Subj} lived in a <home_adj_opt> [home:dwelling] <home_near> ."),
        (2, "{hero.Poss} home was a <home_adj_opt> [home:dwelling] <home_near> ."),
    ],
    "home_near": [
        (2, "near the <near_place>"),
        (2, "by the <near_place>"),
        (1, "at the edge of the <near_place>"),
        (3, ""),
    ],
    "intro_more": [(3, "<trait_sent> <intro_more2>"), (2, "")],
    "intro_more2": [(1, "<trait_sent>"), (3, "")],
    "trait_sent": [
        (2, "{hero} loved to <hobby> ."),
        (2, "Every day , {hero.subj} liked to <hobby> ."),
        (2, "{hero.Subj} {hero.was} very <trait> and loved <hobby_ing> ."),
        (1, "Everyone knew that {hero} was <trait> ."),
    ],
    "hobby": [
        (2, "sing"), (2, "dance"), (1, "paint"), (2, "read books"), (1, "draw"), (1, "swim"),
        (1, "climb trees"), (1, "bake cakes"), (2, "play games"), (1, "collect stones"),
        (1, "tell stories"), (1, "explore"), (1, "watch the stars"), (1, "build things"),
        (1, "grow flowers"), (1, "fly kites"),
    ],
    # -- the outing: go somewhere, find the object that the ending will mention
    "outing": "<time_start> , <hero_subj> <journey> . <place_desc> <discovery> <object_desc>",
    "time_start": [
        (4, "One <weather_opt> <time_noun>"),
        (2, "Early one morning"),
        (1, "After breakfast"),
        (2, "The next day"),
        (2, "On a <weather> <time_noun>"),
    ],
    "hero_subj": [(1, "{hero}"), (1, "{hero.subj}")],
    "journey": [
        (5, "<move_verb> <adverb_opt> to the [place:place]"),
        (2, "decided to visit the [place:place]"),
        (1, "set off for the [place:place]"),
        (1, "went for a walk to the [place:place]"),
    ],
    "place_desc": [
        (3, "The {place} was <place_adj> and <place_adj> ."),
        (1, "It was very <place_adj> at the {place} ."),
        (3, ""),
    ],
    "discovery": "<find_lead> , {hero.subj} <find_verb> a <thing_adj_opt> <color_opt> "
    "[obj:object] <find_where> .",
    "find_lead": [
        (3, "Suddenly"),
        (2, "There"),
        (2, "Soon"),
        (2, "<Prep> a <thing_adj_opt> <landmark>"),
    ],
    "prep": [(3, "under"), (2, "behind"), (2, "near"), (1, "beside"), (1, "next to")],
    "find_where": [
        (1, "in the grass"),
        (1, "on the ground"),
        (1, "in the mud"),
        (1, "under some leaves"),
        (6, ""),
    ],
    "object_desc": [
        (2, "It was <obj_state> ."),
        (1, "The {obj} <obj_did> ."),
        (3, ""),
    ],
    "obj_state": [
        (1, "covered in sand"), (1, "very old"), (1, "still warm"), (1, "glowing softly"),
        (1, "a little dusty"), (1, "the prettiest thing {hero.subj} had ever seen"),
    ],
    "obj_did": [(1, "sparkled in the sun"), (1, "made a tiny sound"), (1, "felt cold")],
    # -- the friend arrives, greets the hero, and they talk about the object
    "meeting": "<meet_lead> , a <char_adj_opt> [fkind:creature] named [friend:friend_name] "
    "<arrived> . <greet_line> <reply_line> <friend_react>",
    "meet_lead": [(3, "Just then"), (1, "A moment later"), (1, "Before long"), (1, "All at once")],
    "arrived": [
        (3, "came by"), (1, "walked up"), (2, "appeared"), (1, "hopped over"), (1, "ran up"),
        (1, "peeked out from behind a <landmark>"),
    ],
    "greet_line": [
        (5, "`` <greet_quote>"),
        (2, "{friend} waved and said , `` <greeting> , {hero} ! ''"),
    ],
    "greet_quote": [
        (3, "<greeting> , {hero} ! '' said {friend} ."),
        (2, "What do you have there , {hero} ? '' asked {friend} ."),
    ],
    "reply_line": [
        (4, "`` <reply_quote>"),
        (2, "{hero} held up the {obj} and said , `` Look what I found ! ''"),
    ],
    "reply_quote": [
        (3, "Look , I found a <thing_adj> {obj} ! '' said {hero} ."),
        (2, "I found this {obj} <found_where> , '' said {hero} ."),
        (1, "It is a {obj} , and it is <thing_adj> ! '' said {hero} ."),
    ],
    "found_where": [(2, "here"), (1, "over there"), (1, "by the {place}"), (1, "just now")],
    "friend_react": [
        (2, "`` <react_quote>"),
        (1, "{friend} looked at the {obj} <adverb_opt> ."),
        (2, ""),
    ],
    "react_quote": [
        (2, "Wow ! Can I hold it ? '' asked {friend} ."),
        (2, "What a <thing_adj> {obj} ! '' said {friend} ."),
        (1, "I have never seen anything like it , '' said {friend} ."),
    ],
    # -- the middle: 0-3 event paragraphs, each 1-3 sentences; middle4 forces the ending
    "middle1": [(3, "<event_par> || <middle2>"), (2, "<ending>")],
    "middle2": [(2, "<event_par> || <middle3>"), (3, "<ending>")],
    "middle3": [(1, "<event_par> || <middle4>"), (3, "<ending>")],
    "middle4": "<ending>",
    "event_par": "<connective> , <event> <more1>",
    "more1": [(3, "<Sentence> <more2>"), (2, "")],
    "more2": [(1, "<Sentence>"), (2, "")],
    "connective": [
        (3, "Then"), (2, "Later"), (2, "Soon"), (2, "After <after_what>"), (1, "Next"),
        (1, "For a while"), (1, "All morning"),
    ],
    "after_what": [(2, "that"), (1, "a while"), (1, "lunch")],
    "sentence": [(5, "<event>"), (2, "<quote_line>")],
    "event": [
        (4, "{hero} <hero_pred>"),
        (3, "{hero.subj} <pron_pred>"),
        (3, "{friend} <friend_pred>"),
        (1, "both friends <both_pred> ."),
        (1, "the <weather_event> ."),
        (1, "a <char_adj_opt> <creature> <creature_pred> ."),
    ],
    "hero_pred": [
        (3, "and {friend} <both_pred> ."),
        (4, "<solo_vp> ."),
        (1, "was <feeling> ."),
        (2, "said , `` <hero_says> . ''"),
    ],
    "pron_pred": [(4, "<solo_vp> ."), (1, "{hero.was} so <feeling> that {hero.subj} <reaction> .")],
    "friend_pred": [(4, "<friend_vp> ."), (2, "said , `` <friend_says> . ''")],
    "solo_vp": [
        (2, "picked up the {obj}"),
        (2, "looked at the {obj} <adverb_opt>"),
        (2, "showed the {obj} to {friend}"),
        (1, "put the {obj} in {hero.poss} <container>"),
        (1, "dropped the {obj} into the <water_thing> and had to fish it out"),
        (1, "felt <feeling>"),
        (1, "climbed a <thing_adj_opt> <landmark>"),
        (1, "ate some <food>"),
        (1, "sat down <adverb_opt> to rest"),
        (1, "sang a <song_adj> song about the {obj}"),
        (1, "smiled at {friend}"),
        (1, "hugged {friend}"),
        (1, "told {friend} a <song_adj> story"),
        (1, "wondered where the {obj} came from"),
        (1, "laughed and spun around"),
        (1, "cleaned the {obj} with {hero.poss} <cloth>"),
    ],
    "friend_vp": [
        (2, "laughed <adverb_opt>"),
        (1, "smiled at {hero}"),
        (1, "gave {hero} some <food>"),
        (1, "shared some <food> with {hero}"),
        (1, "told a <song_adj> joke"),
        (1, "jumped up and down"),
        (1, "ran to the <landmark> and back"),
        (1, "helped {hero} <help_act>"),
        (1, "held the {obj} <adverb_opt>"),
        (1, "found a <thing_adj_opt> <color> <object>"),
    ],
    "both_pred": [
        (2, "played <game>"),
        (1, "built a <thing_adj_opt> <build_thing>"),
        (1, "ate some <food>"),
        (1, "sat under a <landmark>"),
        (1, "sang a <song_adj> song"),
        (1, "raced to the <landmark>"),
        (1, "looked at the <sky_thing>"),
        (1, "took turns holding the {obj}"),
        (1, "laughed together"),
        (1, "walked around the {place}"),
    ],
    "weather_event": [
        (1, "sun came out"), (1, "wind began to blow"), (1, "sky turned <color>"),
        (1, "rain started to fall"), (1, "clouds drifted away"),
    ],
    "creature_pred": [
        (1, "hopped past"), (1, "sang from a <landmark>"), (1, "watched them <adverb_opt>"),
        (1, "asked to see the {obj}"),
    ],
    "reaction": [
        (1, "jumped for joy"), (1, "hid behind a <landmark>"), (1, "forgot to eat lunch"),
        (1, "could not stop smiling"), (1, "sat down on the grass"),
    ],
    "help_act": [
        (1, "carry the {obj}"), (1, "find some <food>"), (1, "climb the <landmark>"),
        (1, "look for more <object_plural>"),
    ],
    "object_plural": [(1, "shells"), (1, "stones"), (1, "feathers"), (1, "coins"), (1, "acorns")],
    "song_adj": [(2, "funny"), (1, "silly"), (1, "long"), (1, "happy"), (1, "sleepy"), (1, "new")],
    "cloth": [(1, "scarf"), (1, "sleeve"), (1, "handkerchief")],
    "hero_says": [
        (2, "I love this {obj}"),
        (1, "This is the best day ever"),
        (1, "We make a good team"),
        (1, "I want to <hobby>"),
        (1, "Let us go to the <landmark>"),
        (1, "Thank you , {friend}"),
    ],
    "friend_says": [
        (1, "I like your {obj} , {hero}"),
        (1, "We should take good care of it"),
        (1, "You are a good friend , {hero}"),
        (1, "Maybe the {obj} is magic"),
        (1, "Let us play again tomorrow"),
    ],
    "quote_line": "`` <quote_body>",
    "quote_body": [
        (3, "<exclaim> ! '' <shout_verb> <speaker> ."),
        (2, "<question> ? '' asked <speaker> ."),
    ],
    "speaker": [(1, "{hero}"), (1, "{friend}")],
    "exclaim": [
        (2, "Wow"), (1, "Look at that"), (1, "How fun"), (1, "Hooray"), (1, "Oh no"),
        (1, "What a <thing_adj> {obj}"), (1, "Yay"),
    ],
    "question": [
        (1, "Can <can_who> keep the {obj}"),
        (1, "Where did the {obj} come from"),
        (1, "Do you want to play"),
        (1, "Is the {obj} magic"),
        (1, "Should we go home now"),
    ],
    "can_who": [(1, "I"), (1, "we")],
    # -- the ending always mentions the object, and often the friend, the place or the home
    "ending": "<end_first> <moral>",
    "end_first": [
        (3, "In the end , {hero} took the {obj} home to {hero.poss} {home} ."),
        (2, "When the sun began to set , {hero} said goodbye to {friend} and carried the {obj} "
         "home ."),
        (2, "That night , {hero} put the {obj} <home_spot> and fell asleep <adverb_opt> ."),
        (1, "From that day on , {hero} kept the {obj} in {hero.poss} {home} , and {hero.subj} "
         "often visited {friend} at the {place} ."),
    ],
    "home_spot": [
        (1, "under {hero.poss} pillow"), (1, "on a shelf"), (1, "by the window"),
        (1, "next to {hero.poss} bed"),
    ],
    "moral": [
        (3, "{hero.Subj} {hero.was} very <good_feeling> ."),
        (2, "It had been the best day ever ."),
        (2, "{hero} <moral_pred>"),
        (2, ""),
    ],
    "moral_pred": [
        (2, "and {friend} were best friends forever ."),
        (1, "would never forget the day at the {place} ."),
    ],
}

# Optional elements are written as `x_opt` -> x | empty: the weights decide how often they appear.
_OPTIONAL = {
    "char_adj_opt": ("char_adj", 2, 3),
    "home_adj_opt": ("home_adj", 1, 2),
    "land_adj_opt": ("land_adj", 2, 1),
    "weather_opt": ("weather", 1, 2),
    "adverb_opt": ("adverb", 1, 3),
    "thing_adj_opt": ("thing_adj", 2, 1),
    "color_opt": ("color", 1, 2),
}
for _name, (_word_class, _with, _without) in _OPTIONAL.items():
    RULES[_name] = [(_with, f"<{_word_class}>"), (_without, "")]

START = "story"
PARAGRAPH = "\n\n"
OPEN_QUOTE, CLOSE_QUOTE = "``", "''"
_PUNCT = frozenset(".,!?")
_TERMINAL = re.compile(r"[A-Za-z]+|[.,!?]|``|''")


class GrammarError(Exception):
    """The rules are malformed or not LL(1) (so possibly ambiguous)."""


# ---------------------------------------------------------------------------------------------
# Compiled form, shared by the sampler and the parser.


class _Choice:
    """A choice point: alternatives with exact weights, and the LL(1) table that parses them."""

    __slots__ = ("name", "thresholds", "total", "logps", "bodies", "predict", "weights")

    def __init__(self, name: str) -> None:
        self.name = name


class _Bind:
    """Draw a word from a word class and remember it."""

    __slots__ = ("var", "choice", "tokens")

    def __init__(self, var: str, choice: _Choice, tokens: tuple[str, ...]) -> None:
        self.var, self.choice, self.tokens = var, choice, tokens


class _Ref:
    """Emit a deterministic function of a remembered word (itself, or a pronoun agreeing with it)."""

    __slots__ = ("var", "form")

    def __init__(self, var: str, form: dict[str, str]) -> None:
        self.var, self.form = var, form


def _words(spec: str) -> list[tuple[int, str]]:
    out = []
    for item in spec.split():
        word, _, weight = item.partition("*")
        out.append((int(weight or 1), word))
    return out


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
        # "an" is produced only by _render, which is what lets _tokenize undo it.
        raise GrammarError(f"bad terminal {text!r}")
    return ("t", text)


def _capitalise(word: str) -> str:
    return word[:1].upper() + word[1:]


class _Raw:
    """The rules as symbol tuples, with <Capitalised> variants derived on demand."""

    def __init__(self, rules: dict, words: dict[str, str]) -> None:
        self.alts: dict[str, list[tuple[int, list[tuple]]]] = {}
        self.classes = set(words)
        for name, spec in words.items():
            self.alts[name] = [(w, [("t", word)]) for w, word in _words(spec)]
        for name, spec in rules.items():
            if name in self.alts:
                raise GrammarError(f"{name!r} is both a rule and a word class")
            alts = [(1, spec)] if isinstance(spec, str) else spec
            self.alts[name] = [(w, [_parse_symbol(s) for s in body.split()]) for w, body in alts]
        for name in list(self.alts):
            for _, body in self.alts[name]:
                for sym in body:
                    self.resolve(sym)

    def resolve(self, sym: tuple) -> None:
        if sym[0] == "nt" and sym[1] not in self.alts:
            base = sym[1][:1].lower() + sym[1][1:]
            if base == sym[1] or base not in self.alts:
                raise GrammarError(f"unknown rule <{sym[1]}>")
            self.alts[sym[1]] = []  # placeholder against cycles through the derivation
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
        if head[0] == "t":
            head = ("t", _capitalise(head[1]))
        elif head[0] == "nt":
            head = ("nt", _capitalise(head[1]))
        elif head[0] == "ref":
            head = ("ref", head[1], _capitalise(head[2]) if head[2] else "^")
        else:
            raise GrammarError(f"<{name}> starts with a variable binding; cannot capitalise it")
        return [head, *body[1:]]


def _gender_of() -> dict[str, str]:
    return {
        name: g
        for pool in (HERO_NAMES, FRIEND_NAMES)
        for g, names in pool.items()
        for name in names.split()
    }


GENDERS = _gender_of()


def _forms(raw: _Raw) -> dict[tuple[str, str], dict[str, str]]:
    """For each reference {var.attr}: the token it emits for every word `var` can be bound to."""
    domain: dict[str, set[str]] = {}
    for alts in raw.alts.values():
        for _, body in alts:
            for sym in body:
                if sym[0] == "bind":
                    domain.setdefault(sym[1], set()).update(w for _, w in _words(WORDS[sym[2]]))
    forms = {}
    for alts in raw.alts.values():
        for _, body in alts:
            for sym in body:
                if sym[0] != "ref" or (sym[1], sym[2]) in forms:
                    continue
                var, attr = sym[1], sym[2]
                if var not in domain:
                    raise GrammarError(f"{{{var}}} refers to a variable that is never bound")
                cap = attr[:1].isupper() or attr == "^"
                base = "" if attr == "^" else attr.lower()
                form = {}
                for word in domain[var]:
                    if not base:
                        value = word
                    elif word in GENDERS and base in PRONOUNS[GENDERS[word]]:
                        value = PRONOUNS[GENDERS[word]][base]
                    else:
                        raise GrammarError(f"{{{var}.{attr}}}: no form {base!r} for {word!r}")
                    form[word] = _capitalise(value) if cap else value
                forms[var, attr] = form
    return forms


def _first_sets(raw: _Raw, forms: dict) -> tuple[dict[str, set], set[str]]:
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


def _follow_sets(raw: _Raw, first, nullable, forms) -> dict[str, set]:
    follow: dict[str, set] = {name: set() for name in raw.alts}
    follow[START].add(None)  # None: the end of the document
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

    after(START, frozenset())


def _check_quotes(raw: _Raw) -> None:
    """A closing quote directly follows punctuation, which is how _tokenize tells it apart."""
    for name, alts in raw.alts.items():
        for _, body in alts:
            for i, sym in enumerate(body):
                if sym == ("t", CLOSE_QUOTE) and not (
                    i and body[i - 1][0] == "t" and body[i - 1][1] in _PUNCT
                ):
                    raise GrammarError(f"<{name}>: a closing quote must follow punctuation")


def _compile(rules: dict, words: dict[str, str]) -> tuple[list, dict[str, _Choice]]:
    """Check the grammar (LL(1), bounded, references bound) and build the shared tables.

    Returns the start symbol's body (reversed, ready for a stack) and the choice points by name.
    """
    raw = _Raw(rules, words)
    _check_acyclic(raw)
    _check_bound(raw)
    _check_quotes(raw)
    forms = _forms(raw)
    first, nullable = _first_sets(raw, forms)
    follow = _follow_sets(raw, first, nullable, forms)

    choices = {name: _Choice(name) for name in raw.alts}
    for name, alts in raw.alts.items():
        predict: dict = {}
        for i, (weight, body) in enumerate(alts):
            if not (isinstance(weight, int) and weight > 0):
                raise GrammarError(f"<{name}>: weights must be positive integers, got {weight!r}")
            f, null = _first_of(body, first, nullable, forms)
            for tok in f | follow[name] if null else f:
                if tok in predict:
                    raise GrammarError(
                        f"<{name}> is not LL(1): token {tok!r} starts alternatives "
                        f"{predict[tok]} and {i}"
                    )
                predict[tok] = i
        choice = choices[name]
        weights = [w for w, _ in alts]
        total = sum(weights)
        cumulative = [sum(weights[: i + 1]) for i in range(len(weights))]
        choice.weights = tuple(weights)
        choice.total = total
        # Thresholds without the last bound: bisect then lands in 0..n-1 even if the float
        # product random() * total rounds up to total.
        choice.thresholds = cumulative[:-1]
        choice.logps = tuple(math.log(w / total) for w in weights)
        choice.predict = predict

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
    return list(reversed(compiled([("nt", START)]))), choices


_START_STACK, CHOICES = _compile(RULES, WORDS)


# ---------------------------------------------------------------------------------------------
# Text <-> tokens.

_A_BEFORE_VOWEL = re.compile(r"\b([Aa]) (?=[AEIOUaeiou])")
_TOKEN = re.compile(r"[A-Za-z]+|\n\n|\S")


def _render(tokens: list[str]) -> str:
    text = " ".join(tokens)
    for spaced, tight in _TIGHTEN:
        text = text.replace(spaced, tight)
    return _A_BEFORE_VOWEL.sub(r"\1n ", text)


_TIGHTEN = (
    (" .", "."),
    (" ,", ","),
    (" !", "!"),
    (" ?", "?"),
    (f" {PARAGRAPH} ", PARAGRAPH),
    (f"{OPEN_QUOTE} ", '"'),
    (f" {CLOSE_QUOTE}", '"'),
)


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


# ---------------------------------------------------------------------------------------------
# The sampler and the parser: the same walk over the same tables, choosing by RNG or by text.


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


def _parse(stack: list, tokens: list[str]) -> float:
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
            i = sym.predict.get(look)
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
            i = sym.choice.predict.get(look)
            if i is None:
                raise ValueError(_unexpected(look, pos, f"a word of <{sym.choice.name}>"))
            logprob += sym.choice.logps[i]
            env[sym.var] = expected = look
        if look != expected:
            raise ValueError(_unexpected(look, pos, repr(expected)))
        pos += 1
    if pos != n:
        raise ValueError(f"text continues after the story ends (token {pos}: {tokens[pos]!r})")
    return logprob


def _unexpected(look: str | None, pos: int, wanted: str) -> str:
    got = "the end of the text" if look is None else repr(look)
    return f"not a story of this grammar: {got} at token {pos}, expected {wanted}"


# ---------------------------------------------------------------------------------------------
# Public API.


def generate(seed: int, index: int) -> tuple[str, float]:
    """Document `index` of the corpus with seed `seed`, as (text, natural-log probability)."""
    rng = random.Random(f"dsflow-grammar:{seed}:{index}")
    tokens, logprob = _sample(list(_START_STACK), rng)
    return _render(tokens), logprob


def score(text: str) -> float:
    """The natural-log probability of `text`; ValueError if the grammar cannot produce it."""
    tokens = _tokenize(text)
    logprob = _parse(list(_START_STACK), tokens)
    if _render(tokens) != text:
        raise ValueError("not a story of this grammar: spacing, quotes or a/an are not canonical")
    return logprob


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

    return of_body(tuple(_START_STACK))
