"""The builtin corpus: children's stories from a probabilistic grammar with exact log-probabilities.

Why a grammar: a model's bits per byte means little without a floor to compare it to. Every
document here is drawn from a known distribution, so -logprob of a text is its exact information
content and the corpus entropy is known, not estimated.

Design. `RULES` is a weighted grammar written as data: each rule maps to alternatives
`(weight, body)`; a body is a space-separated list of symbols:

    word , . ! ?     a terminal token; `` and '' are opening and closing double quotes, || a
                     paragraph break
    <rule>           a rule; <Rule> is the same rule with its first word capitalised
    [var:class]      draw a word from the word class `class` (see `WORDS`) and remember it
    {var} {var.attr} repeat the remembered word, or a form of it: {hero.subj} is she, he or they
                     by the gender of the name in `hero`; {var.Attr} capitalises

Remembered words give the long-range structure (the protagonist named in the first sentence and
named again later, pronouns that agree with that name, the object found early and mentioned in
the conclusion) at no cost in entropy: a reference is a function of earlier text. A document's
logprob is the sum of log(w / total) over every choice made, including those that only decide
length (an optional adjective, one more sentence or paragraph). Weights are integers, so each
probability is an exact rational; each log is rounded once, identically on every platform.

One description drives both directions. `_compile` turns the rules into shared tables of
`_Choice` points; `generate` walks them drawing each choice from an RNG of its own, seeded from
(seed, index), and `score` walks the same tables as a predictive parser, reading each choice off
the text. They share the tables, the logs and the order of summation, so `score(text)` returns
exactly the float that `generate` recorded.

Why the grammar is unambiguous. At import `_compile` proves it LL(1): for every rule, the tokens
that can begin each alternative (its FIRST set, plus the rule's FOLLOW set where the alternative
can be empty) are disjoint from those of every other alternative. A reference counts as every
word its variable could hold, which only makes the check stricter. So one token of lookahead
always decides the alternative, the parser is deterministic, and a token sequence has at most one
derivation. Text and tokens are in bijection too: `_tokenize` undoes `_render` (words are runs
of letters, spacing is canonical, "a" becomes "an" only in rendering and "an" is no terminal, a
closing quote always follows punctuation, which is also checked at import), and `score` rejects a
text that does not re-render to itself. Hence p(text) = p(derivation): the recorded logprob is the
probability of the text, and mean -logprob is the corpus entropy (`document_entropy` gives its
exact value per document). `_compile` also checks that derivations are bounded (no recursion)
and that every reference follows a binding of its variable on every path.
"""

from __future__ import annotations

import decimal
import functools
import math
import random
import re
from bisect import bisect_right
from collections.abc import Iterator
from types import SimpleNamespace

GRAMMAR_VERSION = "1"

# ---------------------------------------------------------------------------------------------
# Vocabulary: word classes, each word equally likely within its class. A word may sit in several
# classes; the LL(1) check at import rejects any overlap that could make a text ambiguous.
# Avoid words whose article is not what their first letter says ("an hour", "a unicorn"): the
# a/an rule in _render goes by the letter.

# Protagonists, by the pronouns they take: f = she/her, m = he/him, n = they/them.
HERO_NAMES = {
    "f": (
        "Mia Lily Emma Sara Lucy Anna Ella Zoe Ruby Nora Maya Hannah Grace Chloe Ivy Rosa Lena "
        "Kate Amy Jane Alice Molly Iris Elsie Clara Julia Sophie Nina Tessa Lola Freya Olive "
        "Edith Ada Mabel Greta Vera Wren Esme June Bea Cora Daphne Eva Flora Gemma Holly Isla "
        "Jade Kara Leah Mara Nell Paige Rita"
    ),
    "m": (
        "Tom Ben Max Leo Jack Finn Noah Omar Luke Theo Oscar Hugo Eli Ryan Adam Jake Milo Owen "
        "Paul Felix Arlo Ezra Sami Otto Liam Evan Ivan Oliver Henry Peter Simon Carl Dylan Ethan "
        "Isaac Jonah Kai Louis Marco Nico Aaron Basil Caleb Dev Emil Frank George Harry Jasper "
        "Kevin Lucas Miles Nate Reuben Victor"
    ),
    "n": (
        "Alex Robin Jordan Riley Casey Quinn Jamie Taylor Morgan Avery Charlie Sky Rowan Ash "
        "Jesse Kit Remy Sasha Drew Frankie Ari Bailey Dale Eden Finley Hayden Jules Lane Marley "
        "Sage"
    ),
}
# The friend's names are a separate pool, so "Mia met Mia" cannot happen and no choice point has
# to guess which character a name belongs to.
FRIEND_NAMES = {
    "f": (
        "Daisy Maple Clover Hazel Poppy Willow Luna Bella Fern Pearl Rosie Honey Ginger Bluebell "
        "Peaches Tulip Violet Coral Misty Dolly Blossom Cookie Dottie Flossie Goldie Lulu Minnie "
        "Petal Sugar Trixie"
    ),
    "m": (
        "Pip Bolt Rocky Biscuit Ziggy Buster Pepper Toby Rusty Sparky Bruno Chip Dash Scout Gus "
        "Rex Duke Pogo Waffles Barney Bingo Chester Digby Fritz Hector Jingles Marmalade Nutty "
        "Percy Rufus"
    ),
    "n": (
        "Pebble Button Twig Moss Dot Sunny Bubbles Fluff Nibbles Jelly Noodle Sprout Tumble "
        "Puddle Wiggles Smudge Pickle Zippy Doodle Mochi Bean Cricket Fizz Gizmo Jinx Kiwi Mango "
        "Nugget Pudding Sprinkles"
    ),
}
PRONOUNS = {
    "f": {"subj": "she", "obj": "her", "poss": "her", "self": "herself", "was": "was"},
    "m": {"subj": "he", "obj": "him", "poss": "his", "self": "himself", "was": "was"},
    "n": {"subj": "they", "obj": "them", "poss": "their", "self": "themselves", "was": "were"},
}

WORDS = {
    "hero_name": " ".join(HERO_NAMES.values()),
    "friend_name": " ".join(FRIEND_NAMES.values()),
    "creature": (
        "rabbit fox mouse bear duck kitten puppy owl frog squirrel hedgehog turtle penguin "
        "piglet goat lamb deer otter raccoon badger robot dragon elephant monkey tiger lion "
        "beaver hamster goose mole giraffe zebra panda koala kangaroo hippo llama pony donkey "
        "chicken crab seal whale dolphin parrot bee ladybug snail lizard wolf moose bunny cat "
        "dog horse cow sheep pig chipmunk skunk porcupine walrus octopus eagle flamingo peacock "
        "pelican toad newt beetle butterfly caterpillar dinosaur gorilla leopard cheetah rhino "
        "camel alpaca ferret weasel sloth"
    ),
    "char_adj": (
        "little tiny young small happy brave clever kind shy curious gentle quiet funny silly "
        "sleepy friendly lucky busy proud cheerful grumpy wise playful careful fluffy chubby "
        "lonely bold jolly clumsy speedy spotted striped hungry noisy lively merry fearless "
        "timid bouncy cuddly daring dreamy eager fancy fussy giggly helpful humble lazy mighty "
        "nosy plucky quick scruffy sneaky sporty tall thoughtful wiggly zany"
    ),
    "trait": (
        "kind brave clever shy curious gentle funny friendly cheerful careful playful patient "
        "polite smart strong quiet helpful generous thoughtful cheeky bold calm daring caring "
        "loyal silly"
    ),
    "land_adj": (
        "faraway green sunny quiet peaceful snowy sleepy misty distant hidden windy tiny golden "
        "lonely"
    ),
    "land": "valley kingdom village town forest land island country city realm hamlet",
    "dwelling": (
        "house cottage burrow nest cabin hut den treehouse barn tent igloo houseboat windmill "
        "apartment bungalow caravan lodge mill shack yurt shelter hive farmhouse"
    ),
    "home_adj": (
        "cozy little small warm tidy old snug bright messy tiny quiet yellow red blue green "
        "white pink tall crooked sunny shady neat"
    ),
    "near_place": (
        "woods river sea hills lake meadow mountains pond forest stream bridge beach farm "
        "orchard cliffs marsh harbor canal road railway market"
    ),
    "hobby_ing": (
        "singing dancing painting reading drawing swimming climbing baking running jumping "
        "exploring skipping gardening counting whistling fishing sledding knitting juggling "
        "building cooking hiking rhyming humming racing splashing stargazing writing surfing "
        "skating sewing drumming sketching tumbling rowing sailing bowling camping biking "
        "digging"
    ),
    "time_noun": "morning afternoon evening day night",
    "weather": (
        "sunny rainy windy cold warm snowy bright cloudy foggy chilly lovely quiet stormy breezy "
        "hot frosty drizzly crisp mild golden"
    ),
    "move_verb": (
        "walked ran skipped hurried wandered raced strolled hopped marched rushed dashed trotted "
        "scampered tiptoed zoomed waddled jogged paddled crawled galloped sprinted bounded "
        "scurried hiked flew"
    ),
    "adverb": (
        "quickly slowly happily quietly carefully cheerfully bravely eagerly gently proudly "
        "softly calmly boldly merrily swiftly sleepily brightly busily curiously gladly "
        "gracefully hungrily joyfully kindly loudly lazily nervously patiently playfully "
        "politely"
    ),
    "place": (
        "park forest beach garden meadow river lake hill village market library castle cave farm "
        "pond field zoo harbor island valley mountain orchard playground bakery museum shore "
        "jungle desert swamp station school fair circus lighthouse canyon creek waterfall square "
        "pier campsite greenhouse aquarium bay cliff dunes glacier grove hilltop lagoon marsh "
        "moor oasis palace plaza prairie quarry ranch reef riverbank seashore shop theater "
        "tunnel vineyard woods boardwalk carnival bookshop toyshop"
    ),
    "place_adj": (
        "quiet green busy sunny peaceful noisy beautiful big dark cool warm bright muddy sandy "
        "lovely calm empty misty windy wide crowded shady snowy grassy rocky breezy chilly "
        "colorful dusty foggy gloomy hilly lively magical pleasant silent sparkling still tidy "
        "wild"
    ),
    "find_verb": "found saw spotted noticed discovered uncovered glimpsed",
    "thing_adj": (
        "shiny old tiny big small strange heavy smooth round bright soft wooden golden silver "
        "magic broken dusty sparkly secret lost special pretty squeaky fuzzy bumpy lumpy wobbly "
        "crooked striped spotted enormous ancient fancy plain glittery rusty dented cracked icy "
        "odd warm cold new little curly dotted fluffy glowing hollow huge lovely muddy narrow "
        "neat polished precious rare rough scratchy shimmering slippery sticky tangled twisty "
        "velvet wet wild wrinkled chipped delicate faded frozen"
    ),
    "color": (
        "red blue green yellow purple orange pink white black brown gray violet scarlet crimson "
        "turquoise teal lilac maroon beige navy"
    ),
    "object": (
        "key ball box shell stone feather coin map hat book bell ring kite boat cup spoon clock "
        "lamp drum whistle marble umbrella egg acorn jar basket toy train doll crown star wand "
        "compass flute scarf mitten candle button ribbon bucket shovel sock glove boot pencil "
        "crayon paintbrush bottle teapot kettle ladder rope blanket pillow mirror necklace "
        "bracelet puzzle balloon trumpet violin guitar sled shoe jacket sweater helmet flag "
        "pinecone telescope magnet lantern envelope letter postcard sticker badge medal trophy "
        "gem crystal anchor apron bowl plate fork napkin vase jug mug saucer top yoyo rattle "
        "harmonica tambourine xylophone banjo recorder microphone camera watch bicycle scooter "
        "skateboard wheel hammer wrench nail paperclip notebook diary sketchbook eraser ruler "
        "wallet ticket bookmark calendar globe sandal slipper mask cape wig tiara locket brooch "
        "thimble spool quilt cushion rug teacup puppet pinwheel parasol chest sack crate oar "
        "easel ornament"
    ),
    "object_plural": (
        "shells stones feathers coins acorns pinecones marbles buttons leaves flowers seeds "
        "pebbles beads ribbons stickers"
    ),
    "landmark": (
        "tree bush log bench fence hedge stump mushroom rock flowerpot wagon wall gate sign "
        "swing slide sandbox fountain statue boulder haystack scarecrow mailbox shed barrel "
        "lamppost pine oak willow birch maple seesaw tractor cart doghouse birdhouse wheelbarrow "
        "well signpost pillar arch trellis gazebo dock rowboat hammock sundial birdbath"
    ),
    "greeting": "Hello Hi Hey Howdy Greetings Hiya Ahoy Yoohoo",
    "feeling": (
        "happy glad excited proud surprised sad scared worried sleepy curious calm thankful "
        "hungry tired nervous puzzled amazed delighted grumpy lonely silly bored brave cheerful "
        "confused cozy dizzy eager grateful hopeful joyful jumpy relaxed shy thrilled"
    ),
    "good_feeling": "happy glad proud thankful excited delighted cheerful content joyful grateful",
    "food": (
        "apples cookies berries sandwiches carrots cake honey bread soup cherries nuts pie "
        "grapes muffins cheese pancakes plums pears peaches crackers noodles popcorn pizza "
        "pretzels bananas strawberries blueberries jam toast waffles biscuits pudding cupcakes "
        "rice beans corn peas potatoes tomatoes cucumbers melons lemons figs oatmeal porridge "
        "yogurt candy chocolate donuts bagels raisins peanuts almonds salad pasta dumplings "
        "tacos jelly cereal"
    ),
    "shout_verb": (
        "shouted said cried yelled laughed giggled squealed called gasped cheered exclaimed"
    ),
    "say_verb": "said whispered replied explained announced added declared murmured",
    "game": (
        "tag catch hopscotch checkers leapfrog chess cards dominoes football soccer basketball "
        "baseball bingo charades croquet tennis"
    ),
    "build_thing": "castle tower fort bridge nest sandcastle snowman dam raft",
    "sky_thing": (
        "clouds stars birds butterflies leaves fireflies dragonflies kites raindrops snowflakes "
        "bubbles ducks geese"
    ),
    "water_thing": "pond puddle river stream creek brook",
    "container": "bag pocket basket backpack satchel pouch sack lunchbox",
    "ground": "grass mud sand snow leaves dirt moss",
    "tverb": (
        "carried held painted drew cleaned polished hid buried wrapped threw kicked caught shook "
        "opened washed fixed counted lifted rolled tossed sniffed tapped juggled balanced "
        "squeezed decorated grabbed spun dusted measured examined admired borrowed guarded "
        "patted pushed pulled dragged twisted flipped packed swung stacked"
    ),
    "ivverb": (
        "laughed danced jumped sang rested waited napped sneezed yawned stretched wiggled hummed "
        "whistled clapped cheered twirled splashed stomped wobbled tumbled bounced giggled "
        "shivered snored sighed grinned blinked nodded paused listened squeaked hiccuped "
        "shrugged cartwheeled somersaulted relaxed"
    ),
    "sun_event": "sunset nightfall dusk suppertime bedtime",
    "day_adj": (
        "wonderful lovely busy happy long magical perfect special fun sunny exciting splendid"
    ),
}


def _maybe(symbol: str, present: int, absent: int) -> list[tuple[int, str]]:
    """An optional element: `symbol` with weight `present`, nothing with weight `absent`."""
    return [(present, symbol), (absent, "")]


# ---------------------------------------------------------------------------------------------
# Rules: "alt | alt | ...", each alternative optionally weighted "3: alt" (default 1); an empty
# body ("2:") is the empty alternative.

RULES: dict[str, str | list[tuple[int, str]]] = {
    "story": "<intro> || <outing> || <meeting> || <middle1>",
    # -- introduction: the protagonist is named in the first sentence
    "intro": "<opening> <intro_more>",
    "opening": (
        "4: Once upon a time , there was a <char_adj_opt> [hkind:creature] named [hero:hero_name]"
        " . <home_sent>"
        " | 3: There once was a <char_adj_opt> [hkind:creature] called [hero:hero_name] ."
        " <home_sent>"
        " | 3: [hero:hero_name] was a <char_adj_opt> [hkind:creature] who lived in a"
        " <home_adj_opt> [home:dwelling] <home_near> ."
        " | 2: Long ago , in a <land_adj_opt> <land> , there lived a [hkind:creature] named"
        " [hero:hero_name] . <home_sent>"
        " | 2: Far away , in a <land_adj_opt> <land> , lived a <char_adj_opt> [hkind:creature]"
        " named [hero:hero_name] . <home_sent>"
    ),
    "home_sent": (
        "3: {hero.Subj} lived in a <home_adj_opt> [home:dwelling] <home_near> ."
        " | 2: {hero.Poss} home was a <home_adj_opt> [home:dwelling] <home_near> ."
    ),
    "home_near": _maybe("<near_prep> the <near_place>", 3, 2),
    "near_prep": (
        "3: near | 2: by | beside | behind | below | at the edge of | close to | not far from"
    ),
    "intro_more": _maybe("<trait_sent> <intro_more2>", 1, 1),
    "intro_more2": _maybe("<trait_sent>", 1, 3),
    "trait_sent": (
        "2: {hero} loved <hobby_ing> , <hobby_ing> and <hobby_ing> ."
        " | 2: Every <time_noun> , {hero.subj} liked to <hobby> <pp_opt> ."
        " | 2: {hero.Subj} {hero.was} <very_opt> <trait> and <trait> ."
        " | Everyone knew that {hero} was <very_opt> <trait> ."
        " | 2: {hero.Poss} favorite <favorite> ."
    ),
    "favorite": (
        "color was <color> | food was <food> | toy was a <thing_adj_opt> <color_opt> <object>"
        " | game was <game>"
    ),
    "hobby": (
        "2: sing | 2: dance | paint | 2: read books | draw | swim | climb trees | bake cakes"
        " | 2: play games | collect <object_plural> | tell stories | explore"
        " | watch the <sky_thing> | build things | grow flowers | fly kites | ride bikes"
        " | write poems | pick berries | skip stones | make music | feed the ducks | count clouds"
        " | chase butterflies | splash in puddles"
    ),
    "very_opt": "very | really | 2:",
    # -- the outing: go somewhere, find the object that the ending will mention
    "outing": "<time_start> , <hero_subj> <journey> . <place_desc> <discovery> <object_desc>",
    "time_start": (
        "4: One <weather_opt> <time_noun> | 2: Early one morning | After breakfast"
        " | 2: The next day | 2: On a <weather> <time_noun>"
    ),
    "hero_subj": "{hero} | {hero.subj}",
    "journey": (
        "5: <move_verb> <adverb_opt> to the <place_adj_opt> [place:place] <with_opt>"
        " | 2: decided to visit the <place_adj_opt> [place:place]"
        " | set off for the <place_adj_opt> [place:place] <with_opt>"
        " | 2: went to the <place_adj_opt> [place:place] to <hobby>"
    ),
    "with_opt": _maybe("with {hero.poss} <thing_adj_opt> <color_opt> <object>", 1, 3),
    "place_desc": (
        "3: The {place} was <place_adj> and <place_adj> ."
        " | It was <very_opt> <place_adj> at the {place} . | Many <sky_thing> were out that day ."
        " | 4:"
    ),
    "discovery": "<find_lead> , {hero.subj} <find_verb> a <thing_adj_opt> <color_opt> "
    "[obj:object] <find_where> .",
    "find_lead": "3: Suddenly | 2: There | 2: Soon | 4: <Prep> a <thing_adj_opt> <landmark>",
    "prep": "3: under | 2: behind | 2: near | beside | next to | in front of | on top of",
    "find_where": "2: in the <ground> | on the ground | under some leaves | 6:",
    "object_desc": "2: It was <obj_state> . | The {obj} <obj_did> . | 3:",
    "obj_state": (
        "covered in <ground> | <very_opt> <thing_adj> | still warm | shining <adverb>"
        " | a little <thing_adj> | the prettiest thing {hero.subj} had ever seen"
        " | 2: as <thing_adj> as a <creature> | bigger than a <object>"
        " | about the size of a <food_single>"
    ),
    "food_single": (
        "grape | plum | pear | peach | cherry | lemon | melon | pumpkin | muffin | apple | egg"
        " | bean"
    ),
    "obj_did": "sparkled in the sun | made a tiny sound | felt cold",
    "pp_opt": _maybe("<pp>", 1, 1),
    # -- the friend arrives, greets the hero, and they talk about the object
    "meeting": "<meet_lead> , a <char_adj_opt> [fkind:creature] named [friend:friend_name] "
    "<arrived> . <greet_line> <reply_line>",
    "meet_lead": (
        "2: Just then | A moment later | Before long | All at once | Out of nowhere | Right then"
        " | Soon after | After a while | With a <thing_adj> hop | From behind a <landmark>"
    ),
    "arrived": (
        "3: came by | 2: appeared | peeked out from behind a <landmark>"
        " | 3: <move_verb> <adverb_opt> <arrive_from>"
    ),
    "arrive_from": "2: over | up | 2: out of the <thing_adj_opt> <landmark> | across the {place}",
    "greet_line": (
        "5: `` <greet_quote> | 2: {friend} <greet_act> and said , `` <greeting> , {hero} ! ''"
    ),
    "greet_act": "waved | smiled | nodded | bowed | grinned",
    "greet_quote": (
        "4: <greeting> , {hero} <greet_tail> <say_verb> {friend} ."
        " | 2: Good <day_part> , {hero} <greet_tail> <say_verb> {friend} ."
        " | 2: What do you have there , {hero} ? '' asked {friend} ."
        " | Is that your {obj} , {hero} ? '' asked {friend} ."
        " | Can I see the {obj} ? '' asked {friend} ."
    ),
    "day_part": "morning | afternoon | evening | day",
    "greet_tail": "3: ! <greet_more> | . What a <thing_adj> {obj} ! '' | , <greet_aside>",
    "greet_more": "2: '' | Do you want to <hobby> with me ? '' | I like your <color> <object> ! ''",
    "greet_aside": "where did you find that {obj} ? '' | I am so <good_feeling> to see you ! ''",
    "reply_line": (
        "2: `` <reply_quote>"
        " | {hero} <show_verb> the {obj} and <say_verb> , `` <hero_says> . ''"
        " | 3:"
    ),
    "show_verb": "held up | showed | lifted | pointed at",
    "reply_quote": (
        "3: Look , I found a <thing_adj> {obj} <found_where> ! '' <say_verb> {hero} ."
        " | 2: I found this {obj} <found_where> , '' <say_verb> {hero} ."
        " | It is a {obj} , and it is <thing_adj> ! '' <say_verb> {hero} ."
    ),
    "found_where": "2: <prep> a <landmark> | over there | just now | right here",
    # -- the middle: 0-3 event paragraphs, each 1-3 sentences; middle4 forces the ending
    "middle1": "4: <event_par> || <middle2> | <ending>",
    "middle2": "<event_par> || <middle3> | <ending>",
    "middle3": "<event_par> || <middle4> | <ending>",
    "middle4": "<ending>",
    "event_par": "<connective> , <event> <more1>",
    "more1": _maybe("<Sentence> <more2>", 3, 1),
    "more2": _maybe("<Sentence>", 1, 1),
    "connective": (
        "3: Then | 2: Later | 2: Soon | 3: After <after_what> | Next | For a while"
        " | All <time_noun> long | Meanwhile | Right away | A little later | Just then | Now"
        " | Without a sound | With a <thing_adj> smile | On the way | Up above | Nearby"
    ),
    "after_what": "that | 3: a <after_a> | lunch",
    "after_a": "while | nap | snack",
    "sentence": "6: <event> | 2: <adverb> , <event> | 3: <quote_line>",
    "event": (
        "5: {hero} <hero_pred> | 4: {hero.subj} <pron_pred> | 4: {friend} <friend_pred>"
        " | 2: the <the_subject> | both friends <both_pred> ."
        " | together , {hero} and {friend} <both_pred> . | a <char_adj_opt> <creature> <act> ."
    ),
    "hero_pred": (
        "3: and {friend} <both_pred> . | 5: <act> <and_act> ."
        " | 2: <social> {friend} <social_end> . | was <feeling_phrase> ."
        " | 2: <say_verb> , `` <hero_says> . ''"
    ),
    "pron_pred": (
        "5: <act> <and_act> . | 2: <social> {friend} <social_end> ."
        " | {hero.was} <feeling_phrase> . | told {hero.self} a <story_adj> story ."
    ),
    "friend_pred": (
        "5: <act> <and_act> . | 2: <social> {hero} <social_end> . | gave {hero} <gift> ."
        " | 2: <say_verb> , `` <friend_says> . ''"
    ),
    "the_subject": "3: {fkind} <friend_pred> | <weather_event> .",
    "story_adj": "funny | silly | long | happy | sleepy | new | strange | secret",
    "feeling_phrase": "3: <very_opt> <feeling> | so <feeling> that {hero.subj} <reaction>",
    "act": (
        "6: <tverb> <thing_np> <adverb_opt> <pp_opt>"
        " | 2: picked up <thing_np> <pp_opt>"
        " | 2: looked at <thing_np> <adverb_opt>"
        " | played with <thing_np> <pp_opt>"
        " | 4: <ivverb> <adverb_opt> <pp_opt>"
        " | 2: <move_verb> <adverb_opt> to the <thing_adj_opt> <landmark>"
        " | ate some <food_adj_opt> <food> <pp_opt>"
        " | felt <very_opt> <feeling>"
        " | watched the <sky_thing> <adverb_opt>"
        " | wanted to <hobby>"
        " | put the {obj} <put_where>"
        " | climbed a <thing_adj_opt> <landmark>"
        " | sat down <adverb_opt> <pp_opt>"
        " | wondered where the {obj} came from"
        " | dropped the {obj} into the <water_thing> and had to fish it out"
        " | made a <thing_adj_opt> <color_opt> <craft> for <craft_for>"
        " | tried to <hobby> <adverb_opt>"
        " | found <count> <object_plural> <pp_opt>"
        " | drank some <drink>"
        " | began to <hobby>"
    ),
    "and_act": _maybe("and <act>", 1, 2),
    "pp": "<prep> the <thing_adj_opt> <landmark>",
    "craft": "hat | card | crown | necklace | flag | mask",
    "craft_for": "2: a <char_adj_opt> <creature> | everyone",
    "count": "two | three | four | five | some | many",
    "drink": "water | milk | lemonade | juice | tea | cocoa",
    "food_adj_opt": "3: | fresh | sweet | warm | tasty | crunchy | yummy",
    "thing_np": "3: a <thing_adj_opt> <color_opt> <object> | 2: the {obj}",
    "put_where": "in a <container> | on a <landmark> | under a <landmark> | behind a <landmark>",
    "social": (
        "hugged | thanked | helped | followed | tickled | chased | smiled at | waved at"
        " | winked at | called"
    ),
    "social_end": "<adverb> | again | 2:",
    "gift": "2: some <food> | a <thing_adj_opt> <color_opt> <object>",
    "both_pred": (
        "5: <act> | 2: had a game of <game> <pp_opt>"
        " | built a <thing_adj_opt> <build_thing> <pp_opt> | took turns holding the {obj}"
        " | went for a walk around the {place}"
    ),
    "weather_event": (
        "sun came out | wind began to blow | sky turned <color> | rain started to fall"
        " | clouds drifted away"
    ),
    "reaction": (
        "jumped for joy | hid behind a <landmark> | forgot to eat lunch | could not stop smiling"
        " | sat down on the <ground>"
    ),
    "hero_says": (
        "3: I <i_say> | This is the best day ever | We make a good team"
        " | Let us go to the <landmark> | Thank you , {friend}"
    ),
    "i_say": (
        "2: love this {obj} | want to <hobby> | am so <good_feeling>"
        " | think the {obj} is <thing_adj>"
    ),
    "friend_says": (
        "I like your {obj} , {hero} | We should take good care of it"
        " | You are a good friend , {hero} | Maybe the {obj} is magic | Let us <hobby> together"
    ),
    "quote_line": "`` <quote_body>",
    "quote_body": (
        "3: <exclaim> ! '' <shout_verb> <speaker> . | 2: <question> ? '' asked <speaker> ."
    ),
    "speaker": "2: {hero} | 2: {friend} | the {fkind}",
    "exclaim": (
        "2: Wow | Look at the <thing_adj_opt> <color_opt> <object> | How fun | Hooray | Oh no"
        " | 2: What a <thing_adj> <object> | Yay | Watch out | Come on"
        " | I can see a <char_adj_opt> <creature> | Let us <hobby>"
        " | This <object> is so <thing_adj> | My <object> is <color>"
    ),
    "question": (
        "Can <can_who> keep the {obj}"
        " | Who left a <thing_adj_opt> <object> by the <landmark>"
        " | Have you ever seen a <char_adj_opt> <creature>"
        " | Would you like some <food>"
        " | Where did the {obj} come from"
        " | Do you want to <hobby>"
        " | Is the {obj} magic"
        " | Should we go home now"
        " | Why is the sky <color>"
        " | Are you <feeling>"
    ),
    "can_who": "I | we",
    # -- the ending always mentions the object, and often the friend, the place or the home
    "ending": "<end_time> , {hero} <end_vp> . <moral>",
    "end_time": (
        "3: In the end | 2: At <at_when> | 2: That <time_noun> | When the day was over"
        " | Before <before_what> | By evening | Once the sun went down"
    ),
    "before_what": "dinner | bedtime | supper",
    "at_when": "3: <sun_event> | last",
    "end_vp": (
        "3: took the {obj} home to {hero.poss} <home_adj_opt> {home}"
        " | 2: said goodbye to {friend} and <adverb_opt> carried the {obj} <home_dir>"
        " | 2: put the {obj} <home_spot> and fell asleep <adverb_opt>"
        " | showed the {obj} to {hero.poss} <family>"
        " | gave the {obj} to {friend} as a present"
        " | hung the {obj} <hang_spot>"
        " | wrapped the {obj} in a <color> <cloth> and hid it <home_spot>"
        " | told {hero.poss} <family> all about the {obj} and the <place_adj> {place}"
    ),
    "home_dir": "2: home | back to the {home} | all the way home",
    "home_spot": (
        "under {hero.poss} pillow | on a shelf | by the window | next to {hero.poss} bed"
        " | in a drawer"
    ),
    "hang_spot": "above {hero.poss} bed | by the door | on the wall",
    "cloth": "scarf | sock | blanket | handkerchief | napkin",
    "family": "mother | father | grandma | grandpa | sister | brother | aunt | uncle | cousin",
    "moral": (
        "3: {hero.Subj} {hero.was} <very_opt> <good_feeling> <and_feeling> ."
        " | 2: It had been a <day_adj> day for a <char_adj_opt> {hkind} ."
        " | 3: {hero} <moral_pred>"
        " | 2: The {obj} <obj_forever> ."
        " | 2: Tomorrow , {hero} and {friend} would <hobby> <pp_opt> ."
        " | 4:"
    ),
    "and_feeling": _maybe("and <very_opt> <feeling>", 1, 2),
    "moral_pred": (
        "2: and {friend} were best friends forever ."
        " | would never forget that <day_adj> day at the {place} ."
        " | smiled and closed {hero.poss} eyes ."
        " | could not wait to see {friend} again ."
    ),
    "obj_forever": (
        "became {hero.poss} favorite treasure | always reminded {hero.obj} of {friend}"
        " | sat on a shelf for many years | was the best thing {hero.subj} ever found"
    ),
    # -- optional modifiers: cheap in bytes, rich in information
    "char_adj_opt": _maybe("<char_adj>", 2, 1),
    "home_adj_opt": _maybe("<home_adj>", 1, 1),
    "land_adj_opt": _maybe("<land_adj>", 2, 1),
    "weather_opt": _maybe("<weather>", 1, 1),
    "adverb_opt": _maybe("<adverb>", 1, 1),
    "thing_adj_opt": _maybe("<thing_adj>", 3, 1),
    "color_opt": _maybe("<color>", 1, 1),
    "place_adj_opt": _maybe("<place_adj>", 2, 1),
}

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
        # "an" is produced only by _render, which is what lets _tokenize undo it.
        raise GrammarError(f"bad terminal {text!r}")
    return ("t", text)


def _capitalise(word: str) -> str:
    return word[:1].upper() + word[1:]


class _Raw:
    """The rules as symbol tuples, with <Capitalised> variants derived on demand."""

    def __init__(self, rules: dict, words: dict[str, str], start: str) -> None:
        self.start = start
        self.alts: dict[str, list[tuple[int, list[tuple]]]] = {}
        self.classes = set(words)
        for name, spec in words.items():
            self.alts[name] = [(1, [("t", word)]) for word in spec.split()]
        for name, spec in rules.items():
            if name in self.alts:
                raise GrammarError(f"{name!r} is both a rule and a word class")
            alts = _alternatives(spec) if isinstance(spec, str) else spec
            self.alts[name] = [(w, [_parse_symbol(s) for s in body.split()]) for w, body in alts]
        for name in list(self.alts):
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


def _genders(*pools: dict[str, str]) -> dict[str, str]:
    """Name -> "f"/"m"/"n", the key into PRONOUNS."""
    out: dict[str, str] = {}
    for pool in pools:
        for gender, names in pool.items():
            for name in names.split():
                if name in out:
                    raise GrammarError(f"name {name!r} is listed twice")
                out[name] = gender
    return out


GENDERS = _genders(HERO_NAMES, FRIEND_NAMES)


def _forms(raw: _Raw, genders: dict[str, str]) -> dict[tuple[str, str], dict[str, str]]:
    """For each reference {var.attr}: the token it emits for every word `var` can be bound to."""
    domain: dict[str, set[str]] = {}
    for alts in raw.alts.values():
        for _, body in alts:
            for sym in body:
                if sym[0] == "bind":
                    words = {b[0][1] for _, b in raw.alts[sym[2]]}
                    domain.setdefault(sym[1], set()).update(words)
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
                    elif word in genders and base in PRONOUNS[genders[word]]:
                        value = PRONOUNS[genders[word]][base]
                    else:
                        raise GrammarError(f"{{{var}.{attr}}}: no form {base!r} for {word!r}")
                    form[word] = _capitalise(value) if cap else value
                forms[var, attr] = form
    return forms


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


@functools.cache
def _log_ratio(numerator: int, denominator: int) -> float:
    """log(numerator / denominator), correctly rounded: libm's log may differ by an ulp between
    platforms, decimal's does not, so the recorded logprobs are the same everywhere."""
    with decimal.localcontext() as ctx:
        ctx.prec = 40
        return float((decimal.Decimal(numerator) / denominator).ln())


def _compile(
    rules: dict, words: dict[str, str], start: str = "story", genders: dict[str, str] = GENDERS
) -> tuple[list, dict[str, _Choice]]:
    """Check the grammar (LL(1), bounded, references bound) and build the shared tables.

    Returns the start symbol's body (reversed, ready for a stack) and the choice points by name.
    """
    raw = _Raw(rules, words, start)
    _check_acyclic(raw)
    _check_bound(raw)
    forms = _forms(raw, genders)
    _check_quotes(raw, forms)
    first, nullable = _first_sets(raw, forms)
    follow = _follow_sets(raw, first, nullable, forms)

    choices = {name: _Choice(name) for name in raw.alts}
    conflicts = []
    for name, alts in raw.alts.items():
        predict: dict = {}
        for i, (weight, body) in enumerate(alts):
            if not (isinstance(weight, int) and weight > 0):
                raise GrammarError(f"<{name}>: weights must be positive integers, got {weight!r}")
            f, null = _first_of(body, first, nullable, forms)
            for tok in f | follow[name] if null else f:
                if tok in predict:
                    conflicts.append(f"<{name}> alternatives {predict[tok]} and {i} on {tok!r}")
                predict[tok] = i
        choices[name].predict = predict
    if conflicts:
        raise GrammarError("not LL(1), so possibly ambiguous: " + "; ".join(conflicts[:20]))
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
    return list(reversed(compiled([("nt", start)]))), choices


_START_STACK, CHOICES = _compile(RULES, WORDS)


# ---------------------------------------------------------------------------------------------
# Text <-> tokens.

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
_TOKEN = re.compile(r"[A-Za-z]+|\n\n|\S")


def _render(tokens: list[str]) -> str:
    text = " ".join(tokens)
    for spaced, tight in _TIGHTEN:
        text = text.replace(spaced, tight)
    return _A_BEFORE_VOWEL.sub(r"\1n ", text)


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


def _parse(stack: list, tokens: list[str]) -> tuple[float, dict[str, str]]:
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
        raise ValueError(
            f"{_NOT_A_STORY}: text goes on after the end (token {pos}: {tokens[pos]!r})"
        )
    return logprob, env


def _unexpected(look: str | None, pos: int, wanted: str) -> str:
    got = "the end of the text" if look is None else repr(look)
    return f"{_NOT_A_STORY}: {got} at token {pos}, expected {wanted}"


_NOT_A_STORY = "not a story of this grammar"


# ---------------------------------------------------------------------------------------------
# Public API.


def generate(seed: int, index: int) -> tuple[str, float]:
    """Document `index` of the corpus with seed `seed`, as (text, natural-log probability)."""
    rng = random.Random(f"dsflow-grammar:{seed}:{index}")
    tokens, logprob = _sample(list(_START_STACK), rng)
    return _render(tokens), logprob


def score(text: str) -> float:
    """The natural-log probability of `text`; ValueError if the grammar cannot produce it."""
    return parse(text)[0]


def parse(text: str) -> tuple[float, dict[str, str]]:
    """(logprob, bindings) of `text`: bindings are the remembered words of its one derivation
    (hero, friend, obj, place, home, hkind, fkind). ValueError if the grammar cannot produce it."""
    tokens = _tokenize(text)
    logprob, env = _parse(list(_START_STACK), tokens)
    if _render(tokens) != text:
        raise ValueError(f"{_NOT_A_STORY}: spacing, quotes or a/an are not canonical")
    return logprob, env


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
