"""Long-context layer: RULER-style synthetic tasks that need more than finding one needle.

Why: a KV-cache recipe can keep single pass-key retrieval (``compress.evals.needle``) at 100% while tasks that combine
several facts spread over the context fall apart: published 3-4-bit KV schemes did exactly that, and multi-step
reasoning lost 18 points. RULER (NVIDIA) answers this with tasks generated from a seed at any context length and scored
by exact match; this module is our own version of three of them, hidden in held-out evaluation text like the needle:

* ``variable_tracking``: a chain of assignments ("VAR QXJ = 48213." ... "VAR PLM = VAR QXJ." ...) and a distractor
  chain with another value, scattered through the filler; the question asks which number the chain's last variable
  holds, so the model must follow every hop (the last variable is never assigned a number directly).
* ``multi_key``: several "The special magic number for <word-word> is <7 digits>." needles at random depths; the
  question asks for one key's number, the others are distractors.
* ``frequent_words``: word lists spread through the filler in which three words occur ``FREQUENCY_FACTOR`` times as
  often as any other; the question asks for those three, so the whole context must be aggregated.

Prompt length: every prompt is *exactly* ``length`` tokens (filler takes up whatever the task's text leaves), with at
least as many filler tokens as hidden ones. Each prompt ends with the question and the answer's opening ("...
VAR PLM holds the number"), so a few greedy tokens answer it. ``minimum_length`` is the shortest length a task
accepts with a tokenizer, the same for every seed; a shorter one is a ``ValueError``, never a silent skip. The
evaluation text must hold at least ``length`` tokens (a little more than any prompt uses, so the check does not depend
on the seed either).

Chance, per task: the accuracy of a reader that picks uniformly among the answers the prompt itself offers and
follows no chain, matches no key and counts nothing (:func:`chance`). Copying one of the hidden numbers is right
with probability 1/2 on ``variable_tracking`` (the asked chain's number or the distractor chain's) and
1/``MULTI_KEY_NEEDLES`` on ``multi_key``; naming three of the listed words, 1/C(listed words, 3) on
``frequent_words`` (below 1e-3). The gate judges each task on its own against its own chance level: pooled, a
baseline that only copies numbers would look far above a chance of 0.
"""

from __future__ import annotations

import math
import random
import re
import string
from dataclasses import dataclass, field
from itertools import pairwise

from compress.evals.generation import Generator

TASKS = ("variable_tracking", "multi_key", "frequent_words")

# Common, short English nouns (each at most four tokens with a 384-token byte-level BPE, so three of them fit the
# answer budget even there; one token each with a real tokenizer). None occurs in the prompts' own wording.
WORDS = (
    "apple bread cloud dog door fish flower glass grass horse house lamp leaf lemon milk moon paper piano river salt "
    "sand ship shoe snow star stone sugar table tiger train tree water wolf bird boat book bottle box cake camera "
    "candle car card carpet castle cat cheese clock coat corn cow cup desk dress egg farm fire flag forest fork fruit "
    "gate hat hill island lake lion market mouse nest ocean orange owl park pillow plant plate rain rose sheep silver "
    "sky soap sock soup spoon storm street sun tea tent toy towel tower valley wall wheel wind wine winter wood"
).split()

VARIABLE_HOPS = 2  # variable-to-variable assignments between the number and the variable asked about
NAME_LETTERS = 3
VALUE_DIGITS = 5
VARIABLE_INTRO = (
    "Variable assignments are hidden inside a lot of irrelevant text. Follow them: you will be asked which number "
    "one variable holds.\n"
)
ASSIGN_VALUE = "\nVAR {name} = {value}.\n"
ASSIGN_VARIABLE = "\nVAR {name} = VAR {source}.\n"
VARIABLE_QUESTION = "\nQuestion: which number does VAR {name} hold? Answer: VAR {name} holds the number"

MULTI_KEY_NEEDLES = 4  # one asked about, the rest distractors
KEY_DIGITS = 7
KEY_CHARS = 2 * max(map(len, WORDS)) + 1  # the longest word-word key
KEY_INTRO = (
    "Special magic numbers are hidden inside a lot of irrelevant text. Memorize them: you will be asked for one "
    "of them.\n"
)
KEY_NEEDLE = "\nThe special magic number for {key} is {value}.\n"
KEY_QUESTION = "\nQuestion: what is the special magic number for {key}? Answer: The special magic number for {key} is"

FREQUENT_WORDS = 3
FREQUENCY_FACTOR = 4  # each frequent word occurs this many times as often as any other word
MIN_RARE_WORDS = 8
WORDS_PER_LIST = 24
MIN_LISTS = 2
WORDS_INTRO = (
    "Word lists are hidden inside a lot of irrelevant text. Count the words in them: you will be asked which "
    "three words occur most often.\n"
)
LIST_OPEN = "\nWord list:"
LIST_CLOSE = ".\n"
WORDS_QUESTION = (
    "\nQuestion: which three words occur most often in the word lists? Answer: The three most frequent words are"
)

MAX_NEW_TOKENS = {"variable_tracking": 8, "multi_key": 12, "frequent_words": 16}


@dataclass
class LongContextItem:
    """One prompt and its expected answer: a number as text, or the three frequent words."""

    task: str
    length: int
    prompt_ids: list[int]
    answer: str | list[str]
    max_new_tokens: int
    distractors: list[str] = field(default_factory=list)
    """Wrong answers hidden in the prompt on purpose (the other chain's number, the other keys' numbers, the rarer
    words)."""


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _bos(tokenizer) -> list[int]:
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


def _bound(tokenizer, template: str, **slot_chars: int) -> int:
    """Most tokens ``template`` can take with each slot filled by that many ASCII characters: every character of a
    slot counted as a token, plus one for a split at its edge (byte-level BPE never needs more)."""
    empty = _ids(tokenizer, template.format(**dict.fromkeys(slot_chars, "")))
    return len(empty) + sum(template.count("{" + slot + "}") * (chars + 1) for slot, chars in slot_chars.items())


def _word_ids(tokenizer) -> dict[str, list[int]]:
    return dict(
        zip(WORDS, tokenizer([" " + word for word in WORDS], add_special_tokens=False)["input_ids"], strict=True)
    )


def _list_count(words: int) -> int:
    return max(MIN_LISTS, words // WORDS_PER_LIST)


def _words_budget(tokenizer) -> tuple[int, int]:
    """(tokens per list besides its words, most tokens one word takes)."""
    overhead = len(_ids(tokenizer, LIST_OPEN)) + len(_ids(tokenizer, LIST_CLOSE))
    return overhead, max(len(ids) for ids in _word_ids(tokenizer).values())


def _overhead(task: str, tokenizer) -> int:
    """Most tokens the BOS, intro and question can take."""
    intro, question = {
        "variable_tracking": (VARIABLE_INTRO, _bound(tokenizer, VARIABLE_QUESTION, name=NAME_LETTERS)),
        "multi_key": (KEY_INTRO, _bound(tokenizer, KEY_QUESTION, key=KEY_CHARS)),
        "frequent_words": (WORDS_INTRO, len(_ids(tokenizer, WORDS_QUESTION))),
    }[task]
    return len(_bos(tokenizer)) + len(_ids(tokenizer, intro)) + question


def _content_bound(task: str, tokenizer, hops: int) -> int:
    """Most tokens the task's hidden text can take at its smallest (frequent_words grows its lists with length)."""
    if task == "variable_tracking":
        value = _bound(tokenizer, ASSIGN_VALUE, name=NAME_LETTERS, value=VALUE_DIGITS)
        link = _bound(tokenizer, ASSIGN_VARIABLE, name=NAME_LETTERS, source=NAME_LETTERS)
        return 2 * (value + hops * link)
    if task == "multi_key":
        return MULTI_KEY_NEEDLES * _bound(tokenizer, KEY_NEEDLE, key=KEY_CHARS, value=KEY_DIGITS)
    overhead, word = _words_budget(tokenizer)
    words = FREQUENT_WORDS * FREQUENCY_FACTOR + MIN_RARE_WORDS
    return _list_count(words) * overhead + words * word


def _check_task(task: str, hops: int) -> None:
    if task not in TASKS:
        raise ValueError(f"unknown long-context task {task!r}; use one of {', '.join(TASKS)}")
    if hops < 1:
        raise ValueError(f"hops={hops}: variable_tracking needs at least 1 hop (the default is {VARIABLE_HOPS})")


def minimum_length(task: str, tokenizer, *, hops: int = VARIABLE_HOPS) -> int:
    """The shortest prompt ``task`` accepts with ``tokenizer``, for every seed: its intro and question plus its
    hidden text at the most tokens it can take, and at least as much filler again."""
    _check_task(task, hops)
    if task == "frequent_words":
        comma = len(_ids(tokenizer, ","))
        answer = FREQUENT_WORDS * _words_budget(tokenizer)[1] + (FREQUENT_WORDS - 1) * comma
        if answer > MAX_NEW_TOKENS[task]:
            raise ValueError(
                f"this tokenizer needs up to {answer} tokens to name three words; frequent_words answers in "
                f"{MAX_NEW_TOKENS[task]}: leave frequent_words out for it"
            )
    return _overhead(task, tokenizer) + 2 * _content_bound(task, tokenizer, hops)


def _check_length(task: str, tokenizer, filler_ids: list[int], length: int, hops: int) -> None:
    minimum = minimum_length(task, tokenizer, hops=hops)
    if length < minimum:
        raise ValueError(
            f"context length {length} is too short for {task}: it needs at least {minimum} tokens with this "
            f"tokenizer; raise the length to {minimum} or more, or leave {task} out"
        )
    if len(filler_ids) < length:
        raise ValueError(
            f"the evaluation text has {len(filler_ids)} tokens; {length}-token long-context prompts need at least "
            f"{length}: pass more evaluation text or shorter lengths"
        )


def _assemble(
    tokenizer, filler_ids: list[int], length: int, intro: str, pieces: list[list[int]], question: str, rng, spread
) -> list[int]:
    """BOS, intro, filler with ``pieces`` inserted in order, question: exactly ``length`` tokens. ``spread`` places
    them evenly (one per stretch of filler) instead of at independent random depths."""
    head, tail = _bos(tokenizer) + _ids(tokenizer, intro), _ids(tokenizer, question)
    hidden = sum(map(len, pieces))
    filler_length = length - len(head) - hidden - len(tail)
    if filler_length < hidden:  # minimum_length assumes at most a token per character of a random name or number
        raise ValueError(
            f"context length {length} leaves {filler_length} filler tokens for {hidden} hidden ones with this "
            f"tokenizer; use a longer length"
        )
    start = rng.randrange(len(filler_ids) - filler_length + 1)
    filler = filler_ids[start : start + filler_length]
    count = len(pieces)
    if spread:
        cuts = [
            rng.randint(index * filler_length // count, (index + 1) * filler_length // count) for index in range(count)
        ]
    else:
        cuts = sorted(rng.randint(0, filler_length) for _ in range(count))
    prompt, previous = list(head), 0
    for cut, piece in zip(cuts, pieces, strict=True):
        prompt += filler[previous:cut] + piece
        previous = cut
    return prompt + filler[previous:] + tail


def _names(rng: random.Random, count: int) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(NAME_LETTERS))
        if name not in names and name != "VAR":
            names.append(name)
    return names


def _variable_tracking(tokenizer, filler_ids, length, rng, hops) -> LongContextItem:
    names = _names(rng, 2 * (hops + 1))
    values = rng.sample(range(10 ** (VALUE_DIGITS - 1), 10**VALUE_DIGITS), 2)
    chains = [names[: hops + 1], names[hops + 1 :]]
    statements = [
        [ASSIGN_VALUE.format(name=chain[0], value=value)]
        + [ASSIGN_VARIABLE.format(name=name, source=source) for source, name in pairwise(chain)]
        for chain, value in zip(chains, values, strict=True)
    ]
    order = [0] * (hops + 1) + [1] * (hops + 1)
    rng.shuffle(order)  # the chains interleave; each keeps its own order, so every variable is set before it is read
    pieces = [_ids(tokenizer, statements[chain].pop(0)) for chain in order]
    question = VARIABLE_QUESTION.format(name=chains[0][-1])
    prompt = _assemble(tokenizer, filler_ids, length, VARIABLE_INTRO, pieces, question, rng, spread=False)
    return LongContextItem(
        "variable_tracking", length, prompt, str(values[0]), MAX_NEW_TOKENS["variable_tracking"], [str(values[1])]
    )


def _multi_key(tokenizer, filler_ids, length, rng) -> LongContextItem:
    words = rng.sample(WORDS, 2 * MULTI_KEY_NEEDLES)
    keys = [f"{first}-{second}" for first, second in zip(words[::2], words[1::2], strict=True)]
    values = [str(value) for value in rng.sample(range(10 ** (KEY_DIGITS - 1), 10**KEY_DIGITS), MULTI_KEY_NEEDLES)]
    pieces = [_ids(tokenizer, KEY_NEEDLE.format(key=key, value=value)) for key, value in zip(keys, values, strict=True)]
    target = rng.randrange(MULTI_KEY_NEEDLES)  # needles are in random order already: keys and depths are random
    prompt = _assemble(
        tokenizer, filler_ids, length, KEY_INTRO, pieces, KEY_QUESTION.format(key=keys[target]), rng, spread=False
    )
    distractors = values[:target] + values[target + 1 :]
    return LongContextItem("multi_key", length, prompt, values[target], MAX_NEW_TOKENS["multi_key"], distractors)


def _frequent_words(tokenizer, filler_ids, length, rng) -> LongContextItem:
    word_ids = _word_ids(tokenizer)
    overhead, widest = _words_budget(tokenizer)
    # Half of what the intro and question leave goes to the lists: as many words as fit at the widest word's size.
    budget = (length - _overhead("frequent_words", tokenizer)) // 2
    words = int(budget / (widest + overhead / WORDS_PER_LIST))
    while words > 0 and _list_count(words) * overhead + words * widest > budget:
        words -= 1
    frequent = rng.sample(WORDS, FREQUENT_WORDS)
    rare = [word for word in WORDS if word not in frequent]
    rng.shuffle(rare)
    # Rare words occur `repeats` times each, frequent ones FREQUENCY_FACTOR times as often; the filler takes the rest.
    repeats = max(1, words // (FREQUENT_WORDS * FREQUENCY_FACTOR + len(rare)))
    rare = rare[: min(len(rare), words - FREQUENT_WORDS * FREQUENCY_FACTOR)]
    sequence = frequent * (FREQUENCY_FACTOR * repeats) + rare * repeats
    rng.shuffle(sequence)
    lists = _list_count(len(sequence))
    bounds = [round(index * len(sequence) / lists) for index in range(lists + 1)]
    open_ids, close_ids = _ids(tokenizer, LIST_OPEN), _ids(tokenizer, LIST_CLOSE)
    pieces = [
        open_ids + [token for word in sequence[begin:end] for token in word_ids[word]] + close_ids
        for begin, end in pairwise(bounds)
    ]
    prompt = _assemble(tokenizer, filler_ids, length, WORDS_INTRO, pieces, WORDS_QUESTION, rng, spread=True)
    return LongContextItem("frequent_words", length, prompt, sorted(frequent), MAX_NEW_TOKENS["frequent_words"], rare)


def build_item(
    task: str, tokenizer, filler_ids: list[int], length: int, seed: int, *, hops: int = VARIABLE_HOPS
) -> LongContextItem:
    """One ``task`` prompt of exactly ``length`` tokens, the same for the same arguments."""
    _check_task(task, hops)
    _check_length(task, tokenizer, filler_ids, length, hops)
    rng = random.Random(seed)
    if task == "variable_tracking":
        return _variable_tracking(tokenizer, filler_ids, length, rng, hops)
    if task == "multi_key":
        return _multi_key(tokenizer, filler_ids, length, rng)
    return _frequent_words(tokenizer, filler_ids, length, rng)


def score(item: LongContextItem, reply: str) -> bool:
    """Exact match: the reply's first number is the answer, or its first three words from ``WORDS`` are the three
    frequent words in any order (naming more words does not help)."""
    if item.task == "frequent_words":
        named = [word for word in re.findall(r"[a-z]+", reply.lower()) if word in WORDS][:FREQUENT_WORDS]
        return sorted(named) == sorted(item.answer)
    match = re.search(r"\d+", reply)
    return match is not None and match.group() == item.answer


def chance(item: LongContextItem) -> float:
    """The accuracy of picking uniformly among the answers ``item``'s prompt offers: its answer and its distractors
    for the number tasks (exact match on the first number), any three of the listed words for ``frequent_words``."""
    if item.task == "frequent_words":
        return 1 / math.comb(len(item.answer) + len(item.distractors), FREQUENT_WORDS)
    return 1 / (1 + len(item.distractors))


def _check_arguments(tokenizer, filler_ids, lengths, tasks, trials, hops) -> None:
    if not lengths or not tasks:
        raise ValueError("long-context evaluation needs at least one length and one task")
    for name, values in (("lengths", lengths), ("tasks", tasks)):
        repeated = sorted({str(value) for value in values if list(values).count(value) > 1})
        if repeated:
            raise ValueError(f"{name} repeat {', '.join(repeated)}; list each once")
    if trials < 1:
        raise ValueError(f"trials={trials}; long-context evaluation needs at least 1 trial per task and length")
    for task in tasks:
        _check_task(task, hops)
        for length in lengths:
            _check_length(task, tokenizer, filler_ids, length, hops)


def _item_seed(seed: int, task: str, length: int, trial: int) -> int:
    """Keyed by values, not positions: adding a length or task leaves every other item as it was."""
    return random.Random(f"{seed}:{task}:{length}:{trial}").randrange(2**63)


def _accuracy(outcomes: list[int]) -> float:
    return sum(outcomes) / len(outcomes)


def evaluate_long_context(
    generator: Generator,
    tokenizer,
    filler_ids: list[int],
    lengths: list[int],
    tasks: list[str],
    trials: int,
    seed: int,
    *,
    hops: int = VARIABLE_HOPS,
) -> dict:
    """Accuracy overall (``long_context_accuracy``), per task and per length, each task's chance level
    (``per_task_chance``: the mean of :func:`chance` over its items; ``chance``: over all items), and every item's 0/1
    outcome in a fixed order (lengths, then tasks, then trials) that does not depend on the generator. Every prompt is
    built before the first is generated, so bad arguments fail before any model time is spent."""
    _check_arguments(tokenizer, filler_ids, lengths, tasks, trials, hops)
    keys = [(length, task, trial) for length in lengths for task in tasks for trial in range(trials)]
    items = [
        build_item(task, tokenizer, filler_ids, length, _item_seed(seed, task, length, trial), hops=hops)
        for length, task, trial in keys
    ]
    replies = generator.generate_batch([item.prompt_ids for item in items], [item.max_new_tokens for item in items])
    outcomes = [
        int(score(item, tokenizer.decode(reply, skip_special_tokens=True)))
        for item, reply in zip(items, replies, strict=True)
    ]
    return {
        "long_context_accuracy": _accuracy(outcomes),
        "per_task": {
            task: _accuracy([o for o, k in zip(outcomes, keys, strict=True) if k[1] == task]) for task in tasks
        },
        "per_length": {
            str(length): _accuracy([o for o, k in zip(outcomes, keys, strict=True) if k[0] == length])
            for length in lengths
        },
        "outcomes": outcomes,
        "items": [
            {"task": task, "length": length, "trial": trial, "correct": outcome}
            for (length, task, trial), outcome in zip(keys, outcomes, strict=True)
        ],
        "per_task_chance": {
            task: sum(chance(item) for item in items if item.task == task) / (trials * len(lengths)) for task in tasks
        },
        "chance": sum(map(chance, items)) / len(items),
        "lengths": list(lengths),
        "tasks": list(tasks),
        "trials": trials,
        "seed": seed,
        "hops": hops,
    }
