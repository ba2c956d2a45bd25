"""Function tasks: small, common functions to write (the sum of the even numbers of a list, the
vowels of a string counted, a gcd, fizzbuzz), generated offline from a seed and judged by
rewards/code.py in the sandbox, as the other code tasks are (`task.name = "functions"`).

    FAMILIES: family -> its variants (one function each, names aside), listed once
       |  item (seed, i): a family, one of its variants of the split, the names, the inputs
       v  expected outputs: the variant's `value`, this module's own Python (no source runs here)
    Task(prompt: write `name(args)` that returns ..., one example; answer: the reference source;
         extra: tests [{args, output}], entry_point, variant)

A variant says one function three ways: the words of the prompt, the reference solution's
source (a template the names fill in: what `sft.data = generated` teaches) and a plain Python
callable that computes the expected outputs. Only the sandbox ever runs the source; a test
(tests/tasks/test_function_tasks.py) checks there that every variant's reference passes its
tests. A family's variants differ in a condition or a constant ("even", "greater than 3",
"divisible by 4"); the function and argument names are drawn per item on top.

Every EVAL_EVERY-th variant of each family is held out: the eval asks for functions (the same
families, other conditions and constants) that the training stream never asks for, under any
name. Items depend on (seed, index) alone and are made without a subprocess, so the stream
needs no threads and the held-out set no cache.
"""

from __future__ import annotations

import itertools
import math
import random
import textwrap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

from areal_aio.tasks.code_tasks import FUNCTION_INSTRUCTION
from areal_aio.tasks.task import Task

EVAL_EVERY = 5
"""Variant i of a family is held out when i % EVAL_EVERY == 0 (a family of 2 variants keeps one)."""
TESTS_PER_TASK = 6
"""Drawn inputs per item (then the family's edge cases); the prompt shows the first."""
TEST_DRAWS = 200
"""Inputs drawn at most to find TESTS_PER_TASK distinct ones with two distinct outputs."""
VALUES = range(-5, 16)
"""The integers list items are drawn from (conditions on them go both ways)."""
LETTERS = "acdeghilmnoprstw"
"""Letters a 'count' or 'remove' variant names: each is in several of WORDS."""
WORDS = ("apple", "river", "sun", "code", "moon", "tree", "bird", "stone", "light", "dog", "cat", "house",
         "road", "blue", "green", "fast", "slow", "happy", "small", "big", "rain", "snow", "fire", "water",
         "book", "pen", "hello", "world", "music", "night", "day", "star", "sky", "sea", "fish", "game",
         "play", "open", "idea", "echo", "under", "orange", "ice", "umbrella", "eagle", "art")

LISTS = (("numbers",), ("nums",), ("values",), ("items",), ("lst",), ("arr",), ("data",))
STRINGS = (("s",), ("text",), ("string",), ("phrase",))
INTS = (("n",), ("num",), ("number",), ("value",))
PAIRS = (("a", "b"), ("x", "y"), ("m", "n"), ("first", "second"))
"""Argument names to draw from; a body's own names (x, i, d, ch, w, result) are never among them."""
EMPTY_LIST, EMPTY_TEXT = (([],),), (("",),)
"""Edge cases: a call with an empty list, with an empty string."""


@dataclass(frozen=True, slots=True)
class Variant:
    """One function of a family, its names aside. `{0}`, `{1}` in `says` and `body` stand for
    the names of its arguments."""

    key: str
    """family/constants ("sum_if/above_3"): the variant's identity, in the task's extra."""
    says: str
    """What the function returns, as the prompt says it after "that returns"."""
    body: str
    """The reference's body, not indented."""
    value: Callable[..., Any]
    """The expected output for given arguments (this module's code: the tests' truth)."""
    names: tuple[str, ...]
    """Function names to draw from."""
    params: tuple[tuple[str, ...], ...]
    """Argument names to draw from (one tuple per choice)."""
    inputs: Callable[[random.Random], tuple]
    """Draws one call's arguments."""
    edges: tuple[tuple, ...] = ()
    """Arguments always tested besides the drawn ones (an empty list)."""
    imports: str = ""
    """Lines the reference needs above its def."""


@dataclass(frozen=True, slots=True)
class Condition:
    """A test on an integer: `key` names it (sum_even, count_above_3), `says` is what the prompt
    says of the integers that pass, `code` the test on the integer `{v}`, `holds` its value."""

    key: str
    says: str
    code: str
    holds: Callable[[int], bool]

    def on(self, name: str) -> str:
        return self.code.format(v=name)


# --------------------------------------------------------------------------- inputs


def _pick(rng: random.Random, pool: Sequence[Any], kind: Callable[[Any], Any]) -> Any:
    """A value of `pool`, its kind drawn first: rare kinds (primes, palindromes, the value on a
    threshold) come up as often as common ones."""
    groups: dict[Any, list[Any]] = {}
    for value in pool:
        groups.setdefault(kind(value), []).append(value)
    return rng.choice(groups[rng.choice(list(groups))])


def _int_list(rng: random.Random, holds: Callable[[int], bool] | None = None, least: int = 3) -> tuple:
    """A list of VALUES; given a condition, now and then one whose items all pass or all fail."""
    pool: Sequence[int] = VALUES
    if holds is not None and rng.random() < 0.4:
        side = rng.random() < 0.5
        pool = [v for v in VALUES if holds(v) == side]
    return ([rng.choice(pool) for _ in range(rng.randint(least, 7))],)


def _phrase(rng: random.Random, most: int = 4, letter: str = "") -> str:
    """1 to `most` of WORDS; half of them holding `letter` when one is given."""
    having = [w for w in WORDS if letter in w] if letter else WORDS
    return " ".join(rng.choice(having if rng.random() < 0.5 else WORDS) for _ in range(rng.randint(1, most)))


def _phrase_in(rng: random.Random, kind: str) -> tuple:
    """A phrase of lowercase words; `mixed`: some letters uppercase; `digits`: numbers among
    them; a single letter: half the words hold it."""
    if kind == "digits":
        return (" ".join(rng.choice(WORDS) + (str(rng.randint(0, 99)) if rng.random() < 0.5 else "")
                         for _ in range(rng.randint(1, 4))),)
    text = _phrase(rng, letter=kind if len(kind) == 1 else "")
    if kind == "mixed":
        text = "".join(ch.upper() if rng.random() < 0.4 else ch for ch in text)
    return (text,)


def _palindrome(rng: random.Random, case: bool, spaces: bool) -> tuple:
    """Letters mirrored (half the time one changed): with `case` some uppercase, with `spaces`
    spaces put in between."""
    half = [rng.choice("abdeilmnorst") for _ in range(rng.randint(1, 4))]
    chars = half + [rng.choice("aeo")] * rng.randint(0, 1) + half[::-1]
    if rng.random() < 0.5:
        chars[rng.randrange(len(chars))] = rng.choice("cgkuvz")
    if case:
        chars = [ch.upper() if rng.random() < 0.4 else ch for ch in chars]
    if spaces:
        chars = [ch + " " if rng.random() < 0.3 else ch for ch in chars[:-1]] + chars[-1:]
    return ("".join(chars),)


def _mirrored(rng: random.Random) -> list[int]:
    half = [rng.randint(0, 9) for _ in range(rng.randint(1, 3))]
    whole = half + [rng.randint(0, 9)] * rng.randint(0, 1) + half[::-1]
    if rng.random() < 0.5:
        whole[rng.randrange(len(whole))] += 1
    return whole


def _number(rng: random.Random) -> tuple:
    """A non-negative integer of 1 to 6 digits."""
    return (rng.randint(0, 10 ** rng.randint(1, 6) - 1),)


def _sharing(rng: random.Random) -> tuple:
    """Two positive integers with a common factor (often 1)."""
    g = rng.choice((1, 1, 2, 3, 4, 5, 6, 7, 9))
    return (g * rng.randint(1, 12), g * rng.randint(1, 12))


# ------------------------------------------------------------------------ conditions


@lru_cache(maxsize=1)
def conditions() -> tuple[Condition, ...]:
    """Tests on a list's items: even, odd, the sign, four comparisons with 1..9, divisibility."""
    out = [Condition("even", "even", "{v} % 2 == 0", lambda x: x % 2 == 0),
           Condition("odd", "odd", "{v} % 2 == 1", lambda x: x % 2 == 1),
           Condition("positive", "positive", "{v} > 0", lambda x: x > 0),
           Condition("negative", "negative", "{v} < 0", lambda x: x < 0)]
    for c in range(1, 10):
        out += [Condition(f"above_{c}", f"greater than {c}", f"{{v}} > {c}", lambda x, c=c: x > c),
                Condition(f"below_{c}", f"less than {c}", f"{{v}} < {c}", lambda x, c=c: x < c),
                Condition(f"at_least_{c}", f"at least {c}", f"{{v}} >= {c}", lambda x, c=c: x >= c),
                Condition(f"at_most_{c}", f"at most {c}", f"{{v}} <= {c}", lambda x, c=c: x <= c)]
    for k in range(3, 8):
        out += [Condition(f"div_by_{k}", f"divisible by {k}", f"{{v}} % {k} == 0", lambda x, k=k: x % k == 0),
                Condition(f"not_div_by_{k}", f"not divisible by {k}", f"{{v}} % {k} != 0",
                          lambda x, k=k: x % k != 0)]
    return tuple(out)


def _parity_and_divisors() -> list[Condition]:
    return [c for c in conditions() if c.key in ("even", "odd") or "div_by" in c.key]


# -------------------------------------------------------------------------- families
# Each returns its variants in a fixed order (the held-out split counts on it).


def _sum_if() -> list[Variant]:
    return [Variant(f"sum_if/{c.key}", f"the sum of the numbers in `{{0}}` that are {c.says}",
                    f"return sum(x for x in {{0}} if {c.on('x')})",
                    lambda xs, h=c.holds: sum(x for x in xs if h(x)), (f"sum_{c.key}", f"total_{c.key}"),
                    LISTS, lambda rng, h=c.holds: _int_list(rng, h), EMPTY_LIST) for c in conditions()]


def _count_if() -> list[Variant]:
    return [Variant(f"count_if/{c.key}", f"how many numbers in `{{0}}` are {c.says}",
                    f"return len([x for x in {{0}} if {c.on('x')}])",
                    lambda xs, h=c.holds: sum(1 for x in xs if h(x)), (f"count_{c.key}", f"how_many_{c.key}"),
                    LISTS, lambda rng, h=c.holds: _int_list(rng, h), EMPTY_LIST) for c in conditions()]


def _filter_if() -> list[Variant]:
    return [Variant(f"filter_if/{c.key}", f"a list of the numbers in `{{0}}` that are {c.says}, in their order",
                    f"return [x for x in {{0}} if {c.on('x')}]",
                    lambda xs, h=c.holds: [x for x in xs if h(x)], (f"keep_{c.key}", f"only_{c.key}", f"filter_{c.key}"),
                    LISTS, lambda rng, h=c.holds: _int_list(rng, h), EMPTY_LIST) for c in conditions()]


def _extreme_if() -> list[Variant]:
    out = []
    for word, fn, names in (("largest", max, ("largest", "max")), ("smallest", min, ("smallest", "min"))):
        out += [Variant(f"extreme_if/{fn.__name__}_{c.key}",
                        f"the {word} number in `{{0}}` that is {c.says}, or None if there is none",
                        f"found = [x for x in {{0}} if {c.on('x')}]\nreturn {fn.__name__}(found) if found else None",
                        lambda xs, h=c.holds, fn=fn: fn([x for x in xs if h(x)], default=None),
                        tuple(f"{n}_{c.key}" for n in names), LISTS,
                        lambda rng, h=c.holds: _int_list(rng, h), EMPTY_LIST) for c in conditions()]
    return out


def _all_any() -> list[Variant]:
    out = [Variant(f"all_any/all_{c.key}",
                   f"True if every number in `{{0}}` is {c.says}, else False (True for an empty list)",
                   f"return all({c.on('x')} for x in {{0}})", lambda xs, h=c.holds: all(h(x) for x in xs),
                   (f"all_{c.key}", f"every_{c.key}"), LISTS, lambda rng, h=c.holds: _int_list(rng, h), EMPTY_LIST)
           for c in conditions()]
    out += [Variant(f"all_any/any_{c.key}", f"True if at least one number in `{{0}}` is {c.says}, else False",
                    f"return any({c.on('x')} for x in {{0}})", lambda xs, h=c.holds: any(h(x) for x in xs),
                    (f"any_{c.key}", f"has_{c.key}"), LISTS, lambda rng, h=c.holds: _int_list(rng, h), EMPTY_LIST)
            for c in conditions()]
    return out


def _first_index(xs: list[int], holds: Callable[[int], bool]) -> int:
    return next((i for i, x in enumerate(xs) if holds(x)), -1)


def _first_index_of() -> list[Variant]:
    return [Variant(f"first_index/{c.key}",
                    f"the index of the first number in `{{0}}` that is {c.says}, or -1 if there is none",
                    f"for i, x in enumerate({{0}}):\n    if {c.on('x')}:\n        return i\nreturn -1",
                    lambda xs, h=c.holds: _first_index(xs, h), (f"find_{c.key}", f"index_of_{c.key}"),
                    LISTS, lambda rng, h=c.holds: _int_list(rng, h), EMPTY_LIST) for c in conditions()]


def _map_list() -> list[Variant]:
    ways: list[tuple[str, str, str, Callable[[int], int], tuple[str, ...]]] = []
    ways += [(f"times_{k}", f"multiplied by {k}", f"x * {k}", lambda x, k=k: x * k,
              (f"multiply_by_{k}", f"times_{k}", f"scale_by_{k}")) for k in range(2, 10)]
    ways += [(f"plus_{c}", f"increased by {c}", f"x + {c}", lambda x, c=c: x + c,
              (f"add_{c}", f"increase_by_{c}", f"plus_{c}")) for c in range(1, 10)]
    ways += [(f"minus_{c}", f"decreased by {c}", f"x - {c}", lambda x, c=c: x - c,
              (f"subtract_{c}", f"decrease_by_{c}", f"minus_{c}")) for c in range(1, 10)]
    ways += [("square", "squared", "x * x", lambda x: x * x, ("square_all", "square_each", "squares")),
             ("abs", "replaced by its absolute value", "abs(x)", abs, ("absolute_values", "abs_all")),
             ("negate", "negated", "-x", lambda x: -x, ("negate_all", "flip_signs"))]
    ways += [(f"mod_{k}", f"replaced by its remainder when divided by {k}", f"x % {k}", lambda x, k=k: x % k,
              (f"mod_{k}", f"remainders_{k}", f"mod_each_by_{k}")) for k in range(2, 8)]
    return [Variant(f"map_list/{key}", f"a new list with each number of `{{0}}` {says}",
                    f"return [{code} for x in {{0}}]", lambda xs, f=f: [f(x) for x in xs], names, LISTS,
                    _int_list, EMPTY_LIST) for key, says, code, f, names in ways]


ORDINALS = {2: "second", 3: "third", 4: "fourth", 5: "fifth"}


def _list_slices() -> list[Variant]:
    out = [Variant("list_slices/reverse", "the items of `{0}` in reverse order, as a new list", "return {0}[::-1]",
                   lambda xs: xs[::-1], ("reverse_list", "reversed_items", "backwards"), LISTS, _int_list, EMPTY_LIST)]
    for n in range(1, 6):
        out += [Variant(f"list_slices/first_{n}", f"a list of the first {n} items of `{{0}}` (all of them if it "
                        f"has fewer)", f"return {{0}}[:{n}]", lambda xs, n=n: xs[:n],
                        (f"first_{n}", f"take_{n}", f"head_{n}"), LISTS, _int_list, EMPTY_LIST),
                Variant(f"list_slices/last_{n}", f"a list of the last {n} items of `{{0}}` (all of them if it "
                        f"has fewer)", f"return {{0}}[-{n}:]", lambda xs, n=n: xs[-n:],
                        (f"last_{n}", f"tail_{n}"), LISTS, _int_list, EMPTY_LIST),
                Variant(f"list_slices/drop_{n}", f"`{{0}}` without its first {n} items, as a new list",
                        f"return {{0}}[{n}:]", lambda xs, n=n: xs[n:], (f"drop_{n}", f"skip_{n}"), LISTS,
                        _int_list, EMPTY_LIST)]
    out += [Variant(f"list_slices/every_{n}", f"a list of every {ORDINALS[n]} item of `{{0}}`, starting with "
                    f"the first (the items at positions 0, {n}, {2 * n}, ...)", f"return {{0}}[::{n}]",
                    lambda xs, n=n: xs[::n], (f"every_{ORDINALS[n]}", f"step_{n}"), LISTS, _int_list, EMPTY_LIST)
            for n in ORDINALS]
    return out


def _product(values: Iterator[int]) -> int:
    result = 1
    for v in values:
        result *= v
    return result


def _list_stats() -> list[Variant]:
    nonempty = lambda rng: _int_list(rng, least=1)  # noqa: E731
    rows: list[tuple[str, str, str, Callable[[list[int]], Any], tuple[str, ...]]] = [
        ("max", "the largest number in `{0}` (a non-empty list)", "return max({0})", max, ("largest", "max_value")),
        ("min", "the smallest number in `{0}` (a non-empty list)", "return min({0})", min, ("smallest", "min_value")),
        ("spread", "the difference between the largest and the smallest number in `{0}` (a non-empty list)",
         "return max({0}) - min({0})", lambda xs: max(xs) - min(xs), ("spread", "value_range", "max_minus_min")),
        ("sum_squares", "the sum of the squares of the numbers in `{0}`", "return sum(x * x for x in {0})",
         lambda xs: sum(x * x for x in xs), ("sum_of_squares", "square_sum")),
        ("product", "the product of the numbers in `{0}` (1 for an empty list)",
         "result = 1\nfor x in {0}:\n    result *= x\nreturn result", lambda xs: _product(iter(xs)),
         ("product", "multiply_all")),
        ("distinct", "how many different numbers there are in `{0}`", "return len(set({0}))",
         lambda xs: len(set(xs)), ("count_distinct", "num_unique")),
        ("mean", "the average of the numbers in `{0}` (a non-empty list)", "return sum({0}) / len({0})",
         lambda xs: sum(xs) / len(xs), ("average", "mean")),
        ("even_positions", "the sum of the numbers at the even positions of `{0}` (positions 0, 2, 4, ...)",
         "return sum({0}[::2])", lambda xs: sum(xs[::2]), ("sum_even_positions", "sum_even_indices")),
        ("sum_abs", "the sum of the absolute values of the numbers in `{0}`", "return sum(abs(x) for x in {0})",
         lambda xs: sum(abs(x) for x in xs), ("sum_abs", "abs_sum"))]
    return [Variant(f"list_stats/{key}", says, body, fn, names, LISTS, nonempty)
            for key, says, body, fn, names in rows]


def _count_chars() -> list[Variant]:
    rows: list[tuple[str, str, str, Callable[[str], int], tuple[str, ...], str]] = [
        ("vowels", "the number of vowels (a, e, i, o, u) in `{0}`", 'return sum(1 for ch in {0} if ch in "aeiou")',
         lambda s: sum(1 for ch in s if ch in "aeiou"), ("count_vowels", "vowel_count", "num_vowels"), "lower"),
        ("consonants", "the number of consonants (letters other than a, e, i, o, u) in `{0}`",
         'return sum(1 for ch in {0} if ch.isalpha() and ch not in "aeiou")',
         lambda s: sum(1 for ch in s if ch.isalpha() and ch not in "aeiou"), ("count_consonants",), "lower"),
        ("digits", "the number of digits in `{0}`", "return sum(1 for ch in {0} if ch.isdigit())",
         lambda s: sum(1 for ch in s if ch.isdigit()), ("count_digits", "digit_count"), "digits"),
        ("upper", "the number of uppercase letters in `{0}`", "return sum(1 for ch in {0} if ch.isupper())",
         lambda s: sum(1 for ch in s if ch.isupper()), ("count_upper", "count_capitals"), "mixed"),
        ("spaces", "the number of spaces in `{0}`", 'return {0}.count(" ")', lambda s: s.count(" "),
         ("count_spaces", "space_count"), "lower")]
    rows += [(f"letter_{c}", f"how many times the letter '{c}' appears in `{{0}}`", f'return {{0}}.count("{c}")',
              lambda s, c=c: s.count(c), (f"count_{c}", f"count_letter_{c}"), c) for c in LETTERS]
    return [Variant(f"count_chars/{key}", says, body, fn, names, STRINGS, lambda rng, k=kind: _phrase_in(rng, k),
                    EMPTY_TEXT) for key, says, body, fn, names, kind in rows]


def _remove_chars() -> list[Variant]:
    rows: list[tuple[str, str, str, Callable[[str], str], tuple[str, ...], str]] = [
        ("vowels", "`{0}` with every vowel (a, e, i, o, u) removed",
         'return "".join(ch for ch in {0} if ch not in "aeiou")', lambda s: "".join(ch for ch in s if ch not in "aeiou"),
         ("remove_vowels", "without_vowels", "disemvowel"), "lower"),
        ("digits", "`{0}` with every digit removed", 'return "".join(ch for ch in {0} if not ch.isdigit())',
         lambda s: "".join(ch for ch in s if not ch.isdigit()), ("remove_digits", "without_digits"), "digits"),
        ("spaces", "`{0}` with every space removed", 'return {0}.replace(" ", "")', lambda s: s.replace(" ", ""),
         ("remove_spaces", "without_spaces"), "lower")]
    rows += [(f"letter_{c}", f"`{{0}}` with every '{c}' removed", f'return {{0}}.replace("{c}", "")',
              lambda s, c=c: s.replace(c, ""), (f"remove_{c}", f"without_{c}"), c) for c in LETTERS]
    return [Variant(f"remove_chars/{key}", says, body, fn, names, STRINGS, lambda rng, k=kind: _phrase_in(rng, k),
                    EMPTY_TEXT) for key, says, body, fn, names, kind in rows]


def _change_case() -> list[Variant]:
    rows: list[tuple[str, str, str, Callable[[str], str], tuple[str, ...], str]] = [
        ("upper", "`{0}` with every letter in uppercase", "return {0}.upper()", str.upper, ("to_upper", "shout"),
         "mixed"),
        ("lower", "`{0}` with every letter in lowercase", "return {0}.lower()", str.lower, ("to_lower", "whisper"),
         "mixed"),
        ("swap", "`{0}` with the case of every letter swapped (lowercase to uppercase and uppercase to lowercase)",
         "return {0}.swapcase()", str.swapcase, ("swap_case", "invert_case"), "mixed"),
        ("words", "`{0}` with the first letter of every word in uppercase (its words are lowercase, separated by "
         "single spaces)", 'return " ".join(w.capitalize() for w in {0}.split(" "))',
         lambda s: " ".join(w[:1].upper() + w[1:] for w in s.split(" ")), ("capitalize_words", "title_case"),
         "lower"),
        ("first", "`{0}` with its first character in uppercase and the rest unchanged",
         "return {0}[:1].upper() + {0}[1:]", lambda s: s[:1].upper() + s[1:], ("capitalize_first", "upper_first"),
         "lower")]
    return [Variant(f"change_case/{key}", says, body, fn, names, STRINGS, lambda rng, k=kind: _phrase_in(rng, k),
                    EMPTY_TEXT) for key, says, body, fn, names, kind in rows]


def _string_slices() -> list[Variant]:
    words = "(its words are separated by single spaces)"
    out = [Variant("string_slices/reverse", "`{0}` reversed", "return {0}[::-1]", lambda s: s[::-1],
                   ("reverse_string", "backwards"), STRINGS, lambda rng: (_phrase(rng),)),
           Variant("string_slices/words", f"the words of `{{0}}` in reverse order, separated by single spaces {words}",
                   'return " ".join({0}.split(" ")[::-1])', lambda s: " ".join(s.split(" ")[::-1]),
                   ("reverse_words", "words_backwards"), STRINGS, lambda rng: (_phrase(rng),)),
           Variant("string_slices/each_word", f"`{{0}}` with each word reversed and the words kept in their order "
                   f"{words}", 'return " ".join(w[::-1] for w in {0}.split(" "))',
                   lambda s: " ".join(w[::-1] for w in s.split(" ")), ("reverse_each_word", "mirror_words"), STRINGS,
                   lambda rng: (_phrase(rng),)),
           Variant("string_slices/inner", "`{0}` without its first and last characters", "return {0}[1:-1]",
                   lambda s: s[1:-1], ("strip_ends", "drop_ends", "inner"), STRINGS, lambda rng: (_phrase(rng),))]
    for n in range(1, 5):
        out += [Variant(f"string_slices/first_{n}", f"the first {n} characters of `{{0}}` (all of it if it is shorter)",
                        f"return {{0}}[:{n}]", lambda s, n=n: s[:n], (f"first_{n}_chars", f"prefix_{n}"), STRINGS,
                        lambda rng: (_phrase(rng, 2),)),
                Variant(f"string_slices/last_{n}", f"the last {n} characters of `{{0}}` (all of it if it is shorter)",
                        f"return {{0}}[-{n}:]", lambda s, n=n: s[-n:], (f"last_{n}_chars", f"suffix_{n}"), STRINGS,
                        lambda rng: (_phrase(rng, 2),))]
    return out


def _palindromes() -> list[Variant]:
    same = "reads the same forwards and backwards"
    return [
        Variant("palindrome/exact", f"True if `{{0}}` {same}, else False", "return {0} == {0}[::-1]",
                lambda s: s == s[::-1], ("is_palindrome", "reads_same"), STRINGS,
                lambda rng: _palindrome(rng, False, False)),
        Variant("palindrome/case", f"True if `{{0}}` {same} when uppercase and lowercase letters count as the "
                "same, else False", "return {0}.lower() == {0}.lower()[::-1]", lambda s: s.lower() == s.lower()[::-1],
                ("is_palindrome_any_case", "palindrome_ignore_case"), STRINGS, lambda rng: _palindrome(rng, True, False)),
        Variant("palindrome/spaces", f"True if `{{0}}` {same} once its spaces are removed, else False",
                'letters = {0}.replace(" ", "")\nreturn letters == letters[::-1]',
                lambda s: s.replace(" ", "") == s.replace(" ", "")[::-1], ("is_palindrome_phrase", "palindrome_no_spaces"),
                STRINGS, lambda rng: _palindrome(rng, False, True)),
        Variant("palindrome/loose", f"True if `{{0}}` {same} once its spaces are removed and uppercase and "
                "lowercase letters count as the same, else False",
                'letters = {0}.replace(" ", "").lower()\nreturn letters == letters[::-1]',
                lambda s: s.replace(" ", "").lower() == s.replace(" ", "").lower()[::-1],
                ("is_loose_palindrome", "palindrome_loose"), STRINGS, lambda rng: _palindrome(rng, True, True)),
        Variant("palindrome/list", "True if the list `{0}` is the same in reverse order, else False",
                "return {0} == {0}[::-1]", lambda xs: xs == xs[::-1], ("is_symmetric", "is_palindrome_list"), LISTS,
                lambda rng: (_mirrored(rng),)),
        Variant("palindrome/number", "True if the digits of `{0}` (a non-negative integer) read the same forwards "
                "and backwards, else False", "return str({0}) == str({0})[::-1]",
                lambda n: str(n) == str(n)[::-1], ("is_palindrome_number", "palindromic"), INTS,
                lambda rng: (int("".join(map(str, _mirrored(rng)))),))]


def _words() -> list[Variant]:
    spaced = "(its words are separated by single spaces)"
    rows: list[tuple[str, str, str, Callable[[str], Any], tuple[str, ...]]] = [
        ("count", f"the number of words in `{{0}}` {spaced}", "return len({0}.split())", lambda s: len(s.split()),
         ("count_words", "word_count")),
        ("longest", f"the longest word in `{{0}}`, the first one if several are as long {spaced}",
         "return max({0}.split(), key=len)", lambda s: max(s.split(), key=len), ("longest_word", "longest")),
        ("shortest", f"the shortest word in `{{0}}`, the first one if several are as short {spaced}",
         "return min({0}.split(), key=len)", lambda s: min(s.split(), key=len), ("shortest_word", "shortest")),
        ("longest_length", f"the length of the longest word in `{{0}}` {spaced}",
         "return max(len(w) for w in {0}.split())", lambda s: max(len(w) for w in s.split()),
         ("longest_word_length", "max_word_length")),
        ("vowel_start", f"a list of the words of `{{0}}` that start with a vowel (a, e, i, o, u), in their order "
         f"{spaced}", 'return [w for w in {0}.split() if w[0] in "aeiou"]',
         lambda s: [w for w in s.split() if w[0] in "aeiou"], ("vowel_words", "words_starting_with_vowel")),
        ("initials", f"the first letters of the words of `{{0}}`, joined into one string {spaced}",
         'return "".join(w[0] for w in {0}.split())', lambda s: "".join(w[0] for w in s.split()),
         ("initials", "acronym", "first_letters")),
        ("lengths", f"a list of the lengths of the words of `{{0}}`, in their order {spaced}",
         "return [len(w) for w in {0}.split()]", lambda s: [len(w) for w in s.split()], ("word_lengths", "lengths"))]
    rows += [(f"longer_{n}", f"a list of the words of `{{0}}` that have more than {n} letters, in their order "
              f"{spaced}", f"return [w for w in {{0}}.split() if len(w) > {n}]",
              lambda s, n=n: [w for w in s.split() if len(w) > n], (f"long_words_{n}", f"words_longer_than_{n}"))
             for n in range(2, 6)]
    return [Variant(f"words/{key}", says, body, fn, names, STRINGS, lambda rng: (_phrase(rng, 5),))
            for key, says, body, fn, names in rows]


def _range_reduce() -> list[Variant]:
    filters: list[Condition | None] = [None, *[c for c in _parity_and_divisors() if "not" not in c.key]]
    small = lambda rng: (rng.randint(0, 12),)  # noqa: E731
    out = []
    for c in filters:
        that = f" that are {c.says}" if c else ""
        test = f" if {c.on('i')}" if c else ""
        holds = c.holds if c else (lambda i: True)
        tag = c.key if c else "all"
        out += [Variant(f"range_reduce/sum_{tag}", f"the sum of the integers from 1 to `{{0}}` (both included){that}"
                        f" (0 when there are none)",
                        f"return sum(i for i in range(1, {{0}} + 1){test})" if c else "return sum(range(1, {0} + 1))",
                        lambda n, h=holds: sum(i for i in range(1, n + 1) if h(i)),
                        (f"sum_{tag}_up_to", f"sum_{tag}_to") if c else ("sum_to", "sum_up_to", "triangle"),
                        INTS, small, ((0,),)),
                Variant(f"range_reduce/squares_{tag}", f"the sum of the squares of the integers from 1 to `{{0}}` "
                        f"(both included){that} (0 when there are none)",
                        f"return sum(i * i for i in range(1, {{0}} + 1){test})",
                        lambda n, h=holds: sum(i * i for i in range(1, n + 1) if h(i)),
                        (f"sum_squares_{tag}", f"square_sum_{tag}") if c else ("sum_of_squares", "square_sum_to"),
                        INTS, small, ((0,),))]
    for c in filters[:3]:  # the factorial, and the products of the even and of the odd integers
        that = f" that are {c.says}" if c else ""
        loop = (f"for i in range(1, {{0}} + 1):\n    if {c.on('i')}:\n        result *= i" if c
                else "for i in range(1, {0} + 1):\n    result *= i")
        holds = c.holds if c else (lambda i: True)
        out.append(Variant(f"range_reduce/product_{c.key if c else 'all'}",
                           f"the product of the integers from 1 to `{{0}}` (both included){that} (1 when there are "
                           f"none)", f"result = 1\n{loop}\nreturn result",
                           lambda n, h=holds: _product(i for i in range(1, n + 1) if h(i)),
                           (f"{c.key}_factorial", f"product_{c.key}_up_to") if c else ("factorial", "product_to"),
                           INTS, small, ((0,),)))
    return out


def _numbers_up_to() -> list[Variant]:
    return [Variant(f"numbers_up_to/{c.key}", f"a list of the integers from 1 to `{{0}}` (both included) that are "
                    f"{c.says}, in increasing order", f"return [i for i in range(1, {{0}} + 1) if {c.on('i')}]",
                    lambda n, h=c.holds: [i for i in range(1, n + 1) if h(i)], (f"{c.key}_up_to", f"list_{c.key}"),
                    INTS, lambda rng: (rng.randint(3, 20),), ((0,),)) for c in _parity_and_divisors()]


def _digits() -> list[Variant]:
    of = "of `{0}` (a non-negative integer)"
    rows: list[tuple[str, str, str, Callable[[int], int], tuple[str, ...]]] = [
        ("sum", f"the sum of the digits {of}", "return sum(int(d) for d in str({0}))",
         lambda n: sum(int(d) for d in str(n)), ("digit_sum", "sum_digits", "sum_of_digits")),
        ("count", f"the number of digits {of}", "return len(str({0}))", lambda n: len(str(n)),
         ("num_digits", "digit_count")),
        ("product", f"the product of the digits {of}", "result = 1\nfor d in str({0}):\n    result *= int(d)\n"
         "return result", lambda n: _product(int(d) for d in str(n)), ("digit_product", "product_of_digits")),
        ("largest", f"the largest digit {of}", "return max(int(d) for d in str({0}))",
         lambda n: max(int(d) for d in str(n)), ("largest_digit", "max_digit")),
        ("smallest", f"the smallest digit {of}", "return min(int(d) for d in str({0}))",
         lambda n: min(int(d) for d in str(n)), ("smallest_digit", "min_digit")),
        ("even", f"how many digits {of} are even", "return sum(1 for d in str({0}) if int(d) % 2 == 0)",
         lambda n: sum(1 for d in str(n) if int(d) % 2 == 0), ("count_even_digits", "even_digits")),
        ("odd", f"how many digits {of} are odd", "return sum(1 for d in str({0}) if int(d) % 2 == 1)",
         lambda n: sum(1 for d in str(n) if int(d) % 2 == 1), ("count_odd_digits", "odd_digits")),
        ("reverse", f"the number whose digits are those {of} in reverse order (leading zeros dropped)",
         "return int(str({0})[::-1])", lambda n: int(str(n)[::-1]), ("reverse_digits", "reverse_number"))]
    rows += [(f"digit_{d}", f"how many times the digit {d} appears in `{{0}}` (a non-negative integer)",
              f'return str({{0}}).count("{d}")', lambda n, d=d: str(n).count(str(d)),
              (f"count_{d}s", f"count_digit_{d}")) for d in range(10)]
    return [Variant(f"digits/{key}", says, body, fn, names, INTS, _number) for key, says, body, fn, names in rows]


def _two_numbers() -> list[Variant]:
    def spread(rng: random.Random) -> tuple:
        return (rng.randint(1, 60), rng.randint(1, 60))

    def divides(rng: random.Random) -> tuple:
        a = rng.randint(1, 12)
        return (a, a * rng.randint(1, 9) + (0 if rng.random() < 0.5 else rng.randint(1, a)))

    rows: list[tuple[str, str, str, Callable[[int, int], Any], tuple[str, ...], Callable, str]] = [
        ("gcd", "the greatest common divisor of `{0}` and `{1}` (two positive integers)",
         "while {1}:\n    {0}, {1} = {1}, {0} % {1}\nreturn {0}", math.gcd, ("gcd", "greatest_common_divisor"),
         _sharing, ""),
        ("lcm", "the least common multiple of `{0}` and `{1}` (two positive integers)",
         "return {0} * {1} // math.gcd({0}, {1})", lambda a, b: a * b // math.gcd(a, b),
         ("lcm", "least_common_multiple"), _sharing, "import math"),
        ("coprime", "True if `{0}` and `{1}` have no common divisor greater than 1, else False (two positive "
         "integers)", "return math.gcd({0}, {1}) == 1", lambda a, b: math.gcd(a, b) == 1,
         ("coprime", "are_coprime"), _sharing, "import math"),
        ("larger", "the larger of `{0}` and `{1}`", "return max({0}, {1})", max, ("larger", "bigger"), spread, ""),
        ("smaller", "the smaller of `{0}` and `{1}`", "return min({0}, {1})", min, ("smaller", "lesser"), spread, ""),
        ("distance", "the absolute difference between `{0}` and `{1}`", "return abs({0} - {1})",
         lambda a, b: abs(a - b), ("distance", "abs_difference", "gap"), spread, ""),
        ("divides", "True if `{0}` divides `{1}` evenly (`{1}` is a multiple of `{0}`), else False",
         "return {1} % {0} == 0", lambda a, b: b % a == 0, ("divides", "is_divisor", "is_factor"), divides, ""),
        ("range_sum", "the sum of the integers from `{0}` to `{1}`, both included (0 when `{0}` is greater than "
         "`{1}`)", "return sum(range({0}, {1} + 1))", lambda a, b: sum(range(a, b + 1)), ("range_sum", "sum_between"),
         lambda rng: (rng.randint(-5, 20), rng.randint(-5, 20)), ""),
        ("power", "`{0}` raised to the power `{1}`", "return {0} ** {1}", lambda a, b: a**b, ("power", "raise_to"),
         lambda rng: (rng.randint(0, 9), rng.randint(0, 6)), ""),
        ("average", "the average of `{0}` and `{1}`", "return ({0} + {1}) / 2", lambda a, b: (a + b) / 2,
         ("average", "mean_of_two", "midpoint"), spread, "")]
    return [Variant(f"two_numbers/{key}", says, body, fn, names, PAIRS, inputs, imports=imports)
            for key, says, body, fn, names, inputs, imports in rows]


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _number_is() -> list[Variant]:
    def prime(n: int) -> bool:
        return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))

    def balanced(pool: range, yes: Callable[[int], Any]) -> Callable[[random.Random], tuple]:
        return lambda rng: (_pick(rng, pool, yes),)

    leap = "(divisible by 4, except the years divisible by 100 that are not divisible by 400)"
    year_kind = lambda y: (y % 4 == 0, y % 100 == 0, y % 400 == 0)  # noqa: E731
    out = [Variant("number_is/prime", "True if `{0}` is a prime number, else False",
                   "return {0} > 1 and all({0} % d != 0 for d in range(2, {0}))", prime, ("is_prime", "check_prime"),
                   INTS, balanced(range(0, 200), prime)),
           Variant("number_is/square", "True if `{0}` (a non-negative integer) is the square of an integer, else False",
                   "return math.isqrt({0}) ** 2 == {0}", lambda n: math.isqrt(n) ** 2 == n,
                   ("is_square", "is_perfect_square"), INTS,
                   balanced(range(0, 401), lambda n: math.isqrt(n) ** 2 == n), imports="import math"),
           Variant("number_is/power_of_two", "True if `{0}` is a power of two (1, 2, 4, 8, ...), else False",
                   "while {0} > 1 and {0} % 2 == 0:\n    {0} //= 2\nreturn {0} == 1", _is_power_of_two,
                   ("is_power_of_two", "power_of_two"), INTS, balanced(range(1, 1100), _is_power_of_two)),
           Variant("number_is/leap_year", f"True if the year `{{0}}` is a leap year {leap}, else False",
                   "return {0} % 4 == 0 and ({0} % 100 != 0 or {0} % 400 == 0)",
                   lambda y: y % 4 == 0 and (y % 100 != 0 or y % 400 == 0), ("is_leap_year", "leap_year"),
                   (("year",), ("y",), ("yr",)), balanced(range(1600, 2401), year_kind))]
    out += [Variant(f"number_is/{c.key}", f"True if `{{0}}` is {c.says}, else False", f"return {c.on('{0}')}",
                    c.holds, (f"is_{c.key}", f"check_{c.key}"), INTS, balanced(range(-30, 100), c.holds))
            for c in _parity_and_divisors() if "not" not in c.key]
    return out


def _fizzbuzz_value(n: int, a: int, b: int, yes: str, no: str) -> str:
    return yes + no if n % a == 0 and n % b == 0 else yes if n % a == 0 else no if n % b == 0 else str(n)


def _fizzbuzz() -> list[Variant]:
    out = []
    for a, b in ((2, 3), (2, 5), (3, 4), (3, 5), (3, 7), (4, 5), (5, 6), (5, 7)):
        for yes, no in (("Fizz", "Buzz"), ("Foo", "Bar"), ("Ping", "Pong"), ("Tic", "Tac")):
            both = yes + no
            body = (f'if {{0}} % {a} == 0 and {{0}} % {b} == 0:\n    return "{both}"\nif {{0}} % {a} == 0:\n'
                    f'    return "{yes}"\nif {{0}} % {b} == 0:\n    return "{no}"\nreturn str({{0}})')
            out.append(Variant(f"fizzbuzz/{a}_{b}_{both.lower()}",
                               f"'{both}' if `{{0}}` is divisible by both {a} and {b}, '{yes}' if it is divisible by "
                               f"{a} only, '{no}' if it is divisible by {b} only, and otherwise `{{0}}` as a string",
                               body, lambda n, a=a, b=b, yes=yes, no=no: _fizzbuzz_value(n, a, b, yes, no),
                               (both.lower(), f"{yes.lower()}_{no.lower()}", f"{both.lower()}_{a}_{b}"), INTS,
                               lambda rng, a=a, b=b: (_pick(rng, range(1, 101), lambda n: (n % a == 0, n % b == 0)),)))
    return out


def _threshold() -> list[Variant]:
    out = []
    for cut in (0, 10, 18, 50, 100):
        for op, tag, says in ((">", "above", "greater than"), (">=", "from", "at least")):
            for high, low in (("high", "low"), ("big", "small"), ("hot", "cold"), ("pass", "fail")):
                out.append(Variant(f"threshold/{tag}_{cut}_{high}", f"'{high}' if `{{0}}` is {says} {cut}, else '{low}'",
                                   f'return "{high}" if {{0}} {op} {cut} else "{low}"',
                                   lambda n, cut=cut, op=op, high=high, low=low:
                                   high if (n > cut if op == ">" else n >= cut) else low,
                                   ("classify", "label", f"{high}_or_{low}"), INTS,
                                   lambda rng, cut=cut: (cut + rng.choice((rng.randint(-3, 3), rng.randint(-40, 40))),)))
    return out


def _repeat() -> list[Variant]:
    seps = {"": ("joined", "with nothing between the copies"), " ": ("spaced", "with a space between the copies"),
            "-": ("dashed", "with '-' between the copies"), ", ": ("listed", "with ', ' between the copies")}
    times = {2: "twice", 3: "three_times", 4: "four_times"}
    word = lambda rng: (_phrase(rng, 2),)  # noqa: E731
    out = [Variant(f"repeat/{n}_{tag}", f"`{{0}}` repeated {n} times, {says}",
                   f"return {{0}} * {n}" if not sep else f'return "{sep}".join([{{0}}] * {n})',
                   lambda s, n=n, sep=sep: sep.join([s] * n), (f"repeat_{n}", times[n], f"echo_{n}"), STRINGS, word)
           for n in times for sep, (tag, says) in seps.items()]
    out += [Variant(f"repeat/chars_{n}", f"`{{0}}` with every character repeated {n} times ('ab' becomes "
                    f"'{'a' * n}{'b' * n}')", f'return "".join(ch * {n} for ch in {{0}})',
                    lambda s, n=n: "".join(ch * n for ch in s), (f"{times[n]}_each_char", f"stretch_{n}"), STRINGS,
                    word) for n in (2, 3)]
    return out


def _divisors() -> list[Variant]:
    at_least_2 = lambda rng: (rng.randint(2, 100),)  # noqa: E731
    rows: list[tuple[str, str, str, Callable[[int], Any], tuple[str, ...], Callable]] = [
        ("list", "a list of the divisors of `{0}` (a positive integer), in increasing order",
         "return [d for d in range(1, {0} + 1) if {0} % d == 0]", lambda n: [d for d in range(1, n + 1) if n % d == 0],
         ("divisors", "factors", "list_divisors"), lambda rng: (rng.randint(1, 100),)),
        ("count", "the number of divisors of `{0}` (a positive integer)",
         "return len([d for d in range(1, {0} + 1) if {0} % d == 0])",
         lambda n: sum(1 for d in range(1, n + 1) if n % d == 0), ("count_divisors", "num_divisors"),
         lambda rng: (rng.randint(1, 100),)),
        ("proper_sum", "the sum of the divisors of `{0}` (a positive integer) that are smaller than `{0}`",
         "return sum(d for d in range(1, {0}) if {0} % d == 0)", lambda n: sum(d for d in range(1, n) if n % d == 0),
         ("sum_proper_divisors", "aliquot_sum"), lambda rng: (rng.randint(1, 100),)),
        ("smallest", "the smallest divisor of `{0}` that is greater than 1 (`{0}` is at least 2)",
         "return min(d for d in range(2, {0} + 1) if {0} % d == 0)",
         lambda n: next(d for d in range(2, n + 1) if n % d == 0), ("smallest_factor", "least_divisor"), at_least_2),
        ("largest", "the largest divisor of `{0}` that is smaller than `{0}` (`{0}` is at least 2)",
         "return max(d for d in range(1, {0}) if {0} % d == 0)",
         lambda n: max(d for d in range(1, n) if n % d == 0), ("largest_proper_divisor", "biggest_factor"), at_least_2)]
    return [Variant(f"divisors/{key}", says, body, fn, names, INTS, inputs)
            for key, says, body, fn, names, inputs in rows]


FAMILIES: dict[str, Callable[[], list[Variant]]] = {
    "sum_if": _sum_if, "count_if": _count_if, "filter_if": _filter_if, "extreme_if": _extreme_if,
    "all_any": _all_any, "first_index": _first_index_of, "map_list": _map_list, "list_slices": _list_slices,
    "list_stats": _list_stats, "count_chars": _count_chars, "remove_chars": _remove_chars,
    "change_case": _change_case, "string_slices": _string_slices, "palindrome": _palindromes, "words": _words,
    "range_reduce": _range_reduce, "numbers_up_to": _numbers_up_to, "digits": _digits,
    "two_numbers": _two_numbers, "number_is": _number_is, "fizzbuzz": _fizzbuzz, "threshold": _threshold,
    "repeat": _repeat, "divisors": _divisors}
"""family -> the builder of its variants; an item draws its family uniformly."""


# --------------------------------------------------------------------------- items


@cache
def variants(family: str) -> tuple[Variant, ...]:
    return tuple(FAMILIES[family]())


def split(family: str, held_out: bool) -> list[Variant]:
    """A family's variants of the training (False) or held-out (True) split."""
    return [v for i, v in enumerate(variants(family)) if (i % EVAL_EVERY == 0) == held_out]


def reference(variant: Variant, name: str, params: Sequence[str]) -> str:
    """The reference solution's source: the variant's body under `def name(params):`."""
    head = f"{variant.imports}\n\n\n" if variant.imports else ""
    body = textwrap.indent(variant.body.format(*params), "    ")
    return f"{head}def {name}({', '.join(params)}):\n{body}\n"


def call_text(name: str, args: Sequence[Any]) -> str:
    """A call as Python writes it: sum_even([1, 2]) (the example in the prompt)."""
    return f"{name}({', '.join(repr(a) for a in args)})"


def draw_tests(variant: Variant, rng: random.Random) -> list[dict[str, Any]]:
    """TESTS_PER_TASK distinct drawn calls (with at least two distinct outputs, so no constant
    function passes) and the variant's edge cases: [{args, output}], the output from
    `variant.value`. The first is the prompt's example."""
    tests: list[dict[str, Any]] = []
    seen: set[str] = set()
    for _ in range(TEST_DRAWS):
        if len(tests) >= TESTS_PER_TASK and len({repr(t["output"]) for t in tests}) > 1:
            break
        args = list(variant.inputs(rng))
        if repr(args) not in seen:
            seen.add(repr(args))
            tests.append({"args": args, "output": variant.value(*args)})
    shown = next((i for i, t in enumerate(tests) if t["output"] or type(t["output"]) is bool), 0)
    tests.insert(0, tests.pop(shown))  # the prompt's example: one with something to show (not 0, [], '')
    tests += [{"args": list(args), "output": variant.value(*args)} for args in variant.edges
              if repr(list(args)) not in seen]
    return tests


def function_prompt(variant: Variant, name: str, params: Sequence[str], example: dict[str, Any]) -> str:
    return (f"Write a Python function `{name}({', '.join(params)})` that returns {variant.says.format(*params)}.\n\n"
            f"For example, {call_text(name, example['args'])} returns {example['output']!r}.\n\n"
            f"{FUNCTION_INSTRUCTION}")


def variant_task(variant: Variant, rng: random.Random, task_id: str) -> Task:
    """A task of `variant`: its names and tests drawn with `rng`."""
    name, params = rng.choice(variant.names), rng.choice(variant.params)
    tests = draw_tests(variant, rng)
    return Task(id=task_id, prompt=function_prompt(variant, name, params, tests[0]),
                answer=reference(variant, name, params),
                extra={"tests": tests, "entry_point": name, "variant": variant.key})


def function_item(seed: int, index: int, held_out: bool = False) -> Task:
    """Item `index` of the stream `seed` (a function of the two alone): a family, then one of
    its variants of the split, then names and tests."""
    rng = random.Random(f"functions:{seed}:{index}")
    variant = rng.choice(split(rng.choice(list(FAMILIES)), held_out))
    return variant_task(variant, rng, f"{'e' if held_out else 't'}{index}")


def function_stream(task: Any, seed: int, start: int = 0) -> Iterator[Task]:
    """Endless training tasks (ids t<i>), item `start` first. `task` (TaskSettings) is taken
    for the common signature; nothing in it applies."""
    del task
    for index in itertools.count(start):
        yield function_item(seed, index)


def function_eval(task: Any, seed: int | None = None, size: int | None = None) -> list[Task]:
    """The held-out set: the first `size` (task.eval_size) items of stream task.eval_seed, drawn
    from the held-out variants (ids e<i>)."""
    seed = task.eval_seed if seed is None else seed
    size = task.eval_size if size is None else size
    return [function_item(seed, index, held_out=True) for index in range(size)]
