"""Constrained decoding to valid JSON: a character-level JSON state machine lifted to the tokenizer's vocabulary.

The machine reads one character at a time and rejects any character that cannot continue a valid JSON object. For
every state it also knows the shortest text that completes the document (close the string, the containers, ...). A
token is allowed when its text keeps the machine alive *and* the shortest completion still fits in the tokens left,
so the output is always a complete object when the budget runs out: with a single-character token for every JSON
punctuation mark (any byte-level BPE has them), one allowed token always exists.

Per-state token masks are computed by walking a trie of the vocabulary's token strings (a rejected prefix prunes
every token below it) and cached, because decoding revisits the same few states (inside a string, after a value).
"""

from __future__ import annotations

import torch

# States are tuples (mode, stack, extra) so they hash and copy for free; stack holds "{" and "[" as a string.
START, VALUE, FIRST_VALUE, KEY, FIRST_KEY, COLON, AFTER, STRING, ESCAPE, UNICODE, LITERAL, NUMBER, DONE = range(13)
WHITESPACE = " \t\n\r"
DIGITS = "0123456789"
HEX = "0123456789abcdefABCDEF"
ESCAPES = '"\\/bfnrtu'
LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
# Number sub-states: which characters may follow, and whether the number may end here.
NUMBER_SIGN, NUMBER_ZERO, NUMBER_INT, NUMBER_POINT, NUMBER_FRACTION, NUMBER_E, NUMBER_E_SIGN, NUMBER_EXP = range(8)
NUMBER_CAN_END = {NUMBER_ZERO, NUMBER_INT, NUMBER_FRACTION, NUMBER_EXP}

INITIAL = (START, "", None)


def _closers(stack: str) -> str:
    return "".join("}" if opener == "{" else "]" for opener in reversed(stack))


def _value_done(stack: str):
    return (AFTER, stack, None) if stack else (DONE, "", None)


def _start_value(stack: str, ch: str):
    """The state after the first character of a value, or None."""
    if ch == "{":
        return (FIRST_KEY, stack + "{", None)
    if ch == "[":
        return (FIRST_VALUE, stack + "[", None)
    if ch == '"':
        return (STRING, stack, False)
    if ch in LITERALS:
        return (LITERAL, stack, LITERALS[ch])
    if ch == "-":
        return (NUMBER, stack, NUMBER_SIGN)
    if ch == "0":
        return (NUMBER, stack, NUMBER_ZERO)
    if ch in DIGITS:
        return (NUMBER, stack, NUMBER_INT)
    return None


def _number_step(kind: int, ch: str) -> int | None:
    if ch in DIGITS:
        if kind in (NUMBER_SIGN, NUMBER_INT):
            return NUMBER_ZERO if kind == NUMBER_SIGN and ch == "0" else NUMBER_INT
        if kind in (NUMBER_POINT, NUMBER_FRACTION):
            return NUMBER_FRACTION
        if kind in (NUMBER_E, NUMBER_E_SIGN, NUMBER_EXP):
            return NUMBER_EXP
        return None  # no digit after a leading zero
    if ch == "." and kind in (NUMBER_ZERO, NUMBER_INT):
        return NUMBER_POINT
    if ch in "eE" and kind in (NUMBER_ZERO, NUMBER_INT, NUMBER_FRACTION):
        return NUMBER_E
    if ch in "+-" and kind == NUMBER_E:
        return NUMBER_E_SIGN
    return None


def step(state, ch: str):
    """The state after reading ``ch``, or None when ``ch`` cannot continue a JSON object."""
    mode, stack, extra = state
    if mode == STRING:
        if ch == '"':
            return (COLON, stack, None) if extra else _value_done(stack)
        if ch == "\\":
            return (ESCAPE, stack, extra)
        return None if ord(ch) < 0x20 else state
    if mode == ESCAPE:
        if ch not in ESCAPES:
            return None
        return (UNICODE, stack, (extra, 4)) if ch == "u" else (STRING, stack, extra)
    if mode == UNICODE:
        is_key, left = extra
        if ch not in HEX:
            return None
        return (STRING, stack, is_key) if left == 1 else (UNICODE, stack, (is_key, left - 1))
    if mode == LITERAL:
        if ch != extra[0]:
            return None
        return (LITERAL, stack, extra[1:]) if len(extra) > 1 else _value_done(stack)
    if mode == NUMBER:
        following = _number_step(extra, ch)
        if following is not None:
            return (NUMBER, stack, following)
        if extra not in NUMBER_CAN_END:
            return None
        return step(_value_done(stack), ch)  # the number ended; ch belongs to what follows it
    if ch in WHITESPACE:
        return None if mode == DONE else state
    if mode == START:
        return (FIRST_KEY, "{", None) if ch == "{" else None
    if mode in (VALUE, FIRST_VALUE):
        if mode == FIRST_VALUE and ch == "]":
            return _value_done(stack[:-1])
        return _start_value(stack, ch)
    if mode in (KEY, FIRST_KEY):
        if mode == FIRST_KEY and ch == "}":
            return _value_done(stack[:-1])
        return (STRING, stack, True) if ch == '"' else None
    if mode == COLON:
        return (VALUE, stack, None) if ch == ":" else None
    if mode == AFTER:
        if ch == ",":
            return (KEY, stack, None) if stack[-1] == "{" else (VALUE, stack, None)
        if ch == _closers(stack[-1]):
            return _value_done(stack[:-1])
    return None


def completion(state) -> str:
    """The shortest text that turns ``state`` into a complete document."""
    mode, stack, extra = state
    close = _closers(stack)
    if mode == START:
        return "{}"
    if mode in (FIRST_VALUE, FIRST_KEY, AFTER, DONE):
        return close
    if mode == VALUE:
        return "0" + close
    if mode == KEY:
        return '"":0' + close
    if mode == COLON:
        return ":0" + close
    if mode in (STRING, ESCAPE, UNICODE):
        is_key = extra[0] if mode == UNICODE else extra
        prefix = {STRING: "", ESCAPE: "n", UNICODE: "0" * (extra[1] if mode == UNICODE else 0)}[mode]
        return prefix + '"' + (":0" if is_key else "") + close
    if mode == LITERAL:
        return extra + close
    if mode == NUMBER:
        return close if extra in NUMBER_CAN_END else "0" + close
    raise ValueError(f"unknown state {state}")


def parse_prefix(text: str):
    """The state after ``text``, or None when ``text`` cannot start a JSON object (used by tests and checks)."""
    state = INITIAL
    for ch in text:
        state = step(state, ch)
        if state is None:
            return None
    return state


class _TrieNode:
    __slots__ = ("children", "token_ids")

    def __init__(self):
        self.children: dict[str, _TrieNode] = {}
        self.token_ids: list[int] = []


class JsonVocabulary:
    """The tokenizer's token strings in a trie, plus the per-state masks computed over it (shared by prompts)."""

    UNREACHABLE = 1 << 14  # completion length of a token that is not allowed at all

    def __init__(self, tokenizer, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos_id = tokenizer.eos_token_id
        special = set(tokenizer.all_special_ids)
        self.root = _TrieNode()
        for token_id in range(min(len(tokenizer), vocab_size)):
            if token_id in special:
                continue
            text = tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
            if not text or "\ufffd" in text:  # empty, or a partial UTF-8 byte: cannot be checked on its own
                continue
            node = self.root
            for ch in text:
                node = node.children.setdefault(ch, _TrieNode())
            node.token_ids.append(token_id)
        self._cache: dict[tuple, tuple[torch.Tensor, dict[int, tuple]]] = {}

    def completion_lengths(self, state) -> tuple[torch.Tensor, dict[int, tuple]]:
        """For every token: the completion length after it (UNREACHABLE if rejected), and the state it leads to."""
        if state not in self._cache:
            lengths = torch.full((self.vocab_size,), self.UNREACHABLE, dtype=torch.int32)
            next_states: dict[int, tuple] = {}
            pending = [(self.root, state)]
            while pending:
                node, node_state = pending.pop()
                for ch, child in node.children.items():
                    child_state = step(node_state, ch)
                    if child_state is None:
                        continue
                    if child.token_ids:
                        length = len(completion(child_state))
                        for token_id in child.token_ids:
                            lengths[token_id] = length
                            next_states[token_id] = child_state
                    pending.append((child, child_state))
            self._cache[state] = (lengths, next_states)
        return self._cache[state]


class JsonConstraint:
    """One generation's constraint (see ``compress.evals.generation.TokenConstraint``): a complete JSON object, then
    EOS."""

    def __init__(self, vocabulary: JsonVocabulary):
        self.vocabulary = vocabulary
        self.state = INITIAL

    def allowed(self, tokens_left: int) -> torch.Tensor:
        if self.state[0] == DONE:
            mask = torch.zeros(self.vocabulary.vocab_size, dtype=torch.bool)
            mask[self.vocabulary.eos_id] = True
            return mask
        lengths, _ = self.vocabulary.completion_lengths(self.state)
        return lengths <= tokens_left - 1

    def advance(self, token_id: int) -> None:
        if self.state[0] == DONE:
            return
        _, next_states = self.vocabulary.completion_lengths(self.state)
        self.state = next_states[token_id]
