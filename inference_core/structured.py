"""Structured outputs: constrain a request's tokens to any JSON object, a JSON schema, a regular expression or a list
of choices. This module owns the `Constraint` a request carries, the compiled grammars of one model's tokenizer
(`Grammars`, an LRU cache), one request's position in its grammar (`GrammarState`: accept, rollback, allowed ids) and
the masking of a batch of logits rows (`mask_logits_`). It knows nothing about sampling or scheduling.

The grammar work is llguidance's (chosen by measurement over xgrammar: docs/structured_outputs.md). It is imported when
the first `Grammars` is built, so the engine loads without it. The grammar's stop tokens are the model's eos ids, so a
complete output ends with EOS; eos is allowed exactly where the output may end. Ids past the tokenizer's vocabulary
(logits padding) are never allowed.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from inference_core.config import ConfigError

KINDS = ("json_object", "json_schema", "regex", "choice")
WHAT_TO_CHANGE = {"json_object": "request", "json_schema": "schema", "regex": "pattern", "choice": "choices"}
MAX_CHOICES = 64
CACHE_SIZE = 64  # compiled constraints kept per tokenizer
INSTALL_HINT = "structured outputs need llguidance: pip install llguidance==1.9.1"
ANY_OBJECT_SCHEMA = '{"type": "object"}'  # json_object: what OpenAI's response_format json_object asks for


class ConstraintError(ConfigError):
    """A ConfigError that quotes a request's grammar text or llguidance's words, which may hold braces (`\\d{4}` in a
    regex): its message is shown as written, never read for `{setting}` names to put in a surface's words."""

    def in_words(self, words: dict[str, str]) -> str:
        return self.template


def _import_llguidance():
    try:
        import llguidance
    except ImportError as error:
        raise ConfigError(INSTALL_HINT + ".") from error
    return llguidance


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request's output must match. spec: json_schema: the schema as JSON text; regex: the pattern (the whole
    output must match it); choice: the choices (a list becomes a tuple); json_object: None."""

    kind: str
    spec: str | tuple[str, ...] | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConstraintError(f"unknown constraint kind {self.kind!r}; use one of: {', '.join(KINDS)}.")
        if self.kind == "json_object" and self.spec is not None:
            raise ConstraintError("a json_object constraint takes no spec; use json_schema to give a schema.")
        if self.kind == "json_schema":
            _check_schema_text(self.spec)
        if self.kind == "regex" and (not isinstance(self.spec, str) or not self.spec):
            raise ConstraintError(f"a regex constraint needs the pattern as a non-empty string, not {self.spec!r}.")
        if self.kind == "choice":
            choices = self.spec
            if isinstance(choices, str) or not isinstance(choices, (list, tuple)):
                raise ConstraintError(f"a choice constraint needs a list of strings, not {type(choices).__name__}; "
                                      'give e.g. ["yes", "no"].')
            if not 1 <= len(choices) <= MAX_CHOICES:
                raise ConstraintError(f"a choice constraint needs 1 to {MAX_CHOICES} choices, not {len(choices)}.")
            bad = [choice for choice in choices if not isinstance(choice, str) or not choice]
            if bad:
                raise ConstraintError(f"every choice must be a non-empty string; change {bad[0]!r}.")
            object.__setattr__(self, "spec", tuple(choices))

    @property
    def label(self) -> str:
        """Short words for a person: 'JSON object', 'JSON schema', 'regex ^\\d{4}-…', 'one of 4 choices'."""
        if self.kind == "json_object":
            return "JSON object"
        if self.kind == "json_schema":
            return "JSON schema"
        if self.kind == "regex":
            return "regex " + (self.spec if len(self.spec) <= 24 else self.spec[:23] + "…")
        return f"one of {len(self.spec)} choice{'s' if len(self.spec) > 1 else ''}"


def _check_schema_text(spec) -> None:
    if not isinstance(spec, str):
        raise ConstraintError(f"a json_schema constraint needs the schema as JSON text, not {type(spec).__name__}; "
                              "pass json.dumps(schema).")
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as error:
        raise ConstraintError(f"the JSON schema is not valid JSON ({error}); fix the schema text.") from None
    if not isinstance(schema, dict):
        raise ConstraintError(f"a JSON schema must be a JSON object, not {type(schema).__name__}; "
                              'give e.g. {"type": "object", "properties": {...}}.')


def _one_line(error: str) -> str:
    """llguidance's error text on one line, without the caret lines and the grammar echo."""
    lines = [line.strip() for line in error.splitlines()]
    kept = [line for line in lines if line and set(line) != {"^"} and not line.split("|")[0].strip().isdigit()]
    return " ".join(kept)[:300]


class Grammars:
    """Compiled grammars for one model's tokenizer, cached (LRU, CACHE_SIZE entries) by constraint."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        llguidance = _import_llguidance()
        self.vocab_size = vocab_size  # the logits width: the mask's width
        self.eos_token_ids = frozenset(eos_token_ids)
        if not self.eos_token_ids:
            raise ConfigError("structured outputs need the model's eos token id; this model declares none.")
        try:  # from the tokenizers JSON: llguidance reads the byte-level vocabulary and which added tokens are special
            self._tokenizer = llguidance.LLTokenizer(tokenizer._tokenizer.to_str(), n_vocab=vocab_size,
                                                     eos_token=sorted(self.eos_token_ids))
        except ValueError as error:
            raise ConstraintError(f"structured outputs cannot use this tokenizer: {error}.") from None
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self._llguidance = llguidance
        self._pristine: OrderedDict[Constraint, object] = OrderedDict()  # constraint -> matcher at the start

    def __len__(self) -> int:
        """How many compiled constraints are cached."""
        return len(self._pristine)

    def __contains__(self, constraint: Constraint) -> bool:
        return constraint in self._pristine

    def matcher(self, constraint: Constraint) -> GrammarState:
        """A fresh state at the start of `constraint`'s grammar (a copy of the cached compiled matcher)."""
        pristine = self._pristine.get(constraint)
        if pristine is None:
            pristine = self._compile(constraint)
            self._pristine[constraint] = pristine
            if len(self._pristine) > CACHE_SIZE:
                self._pristine.popitem(last=False)
        else:
            self._pristine.move_to_end(constraint)
        return GrammarState(pristine.deep_copy(), self.vocab_size, self.eos_token_ids, constraint)

    def _compile(self, constraint: Constraint):
        grammar_from = self._llguidance.grammar_from
        try:
            if constraint.kind == "choice":
                grammar = grammar_from("choice", list(constraint.spec))
            elif constraint.kind == "regex":
                grammar = grammar_from("regex", constraint.spec)
            else:
                grammar = grammar_from("json_schema", constraint.spec or ANY_OBJECT_SCHEMA)
        except ValueError as error:
            raise ConstraintError(f"the {constraint.label} cannot be used: {_one_line(str(error))}.") from None
        matcher = self._llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise ConstraintError(f"the {constraint.label} cannot be used: {_one_line(matcher.get_error())}; "
                                  f"change the {WHAT_TO_CHANGE[constraint.kind]}.")
        return matcher


class GrammarState:
    """One request's position in its grammar.

    eos is never handed to llguidance: accepting it only marks the state terminated (allowed where the grammar may
    end), and a rollback over it clears the mark. Every other token goes through try_consume_tokens, which leaves the
    state unchanged when it refuses (consume_token would leave the matcher in an error state for good)."""

    __slots__ = ("_eos_token_ids", "_matcher", "_num_accepted", "_terminated", "constraint", "vocab_size")

    def __init__(self, matcher, vocab_size: int, eos_token_ids: frozenset[int], constraint: Constraint):
        self.constraint = constraint
        self.vocab_size = vocab_size
        self._matcher = matcher
        self._eos_token_ids = eos_token_ids
        self._num_accepted = 0
        self._terminated = False

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar forbids it."""
        token_id = int(token_id)  # a numpy or 0-d tensor id would miss the eos set
        if self._terminated or not 0 <= token_id < self.vocab_size:
            return False
        if token_id in self._eos_token_ids:
            accepted = self._matcher.is_accepting()
            self._terminated = accepted
        else:
            accepted = self._matcher.try_consume_tokens([token_id]) == 1
        self._num_accepted += accepted
        return accepted

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative verification rejected them)."""
        if not 0 <= num_tokens <= self._num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._num_accepted} were accepted.")
        self._num_accepted -= num_tokens
        if self._terminated and num_tokens:
            self._terminated, num_tokens = False, num_tokens - 1
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens: {self._matcher.get_error()}")

    def is_terminated(self) -> bool:
        """The grammar accepted its stop token: the output is complete."""
        return self._terminated

    def allowed_ids(self) -> torch.Tensor:
        """[vocab_size] bool: the tokens allowed next (eos included where the output may end; after termination, only
        eos, so a caller that samples once more still stops)."""
        bitmask = np.empty((1, _words(self.vocab_size)), dtype=np.int32)
        self.fill_bitmask(bitmask[0])
        return torch.from_numpy(_unpack(bitmask, self.vocab_size)[0])

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the next-token bitmask into `row` ([ceil(vocab_size / 32)] int32, C-contiguous): bit j of word w
        set = token 32 * w + j allowed."""
        if self._terminated:
            row[:] = 0
            for eos_id in self._eos_token_ids:
                row.view(np.uint32)[eos_id // 32] |= np.uint32(1 << (eos_id % 32))
            return
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if self._matcher.is_error():
            raise ConstraintError(f"the {self.constraint.label} hit llguidance's limits here "
                                  f"({_one_line(self._matcher.get_error())}); simplify the "
                                  f"{WHAT_TO_CHANGE[self.constraint.kind]}.")


def _words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def _unpack(bitmask: np.ndarray, width: int) -> np.ndarray:
    """[rows, words] int32 -> [rows, width] bool. The int32 words are read as little-endian bytes (x86, arm64)."""
    return np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")[:, :width].view(bool)


def apply_bitmask_(logits: torch.Tensor, bitmask: np.ndarray) -> None:
    """-inf in `logits` ([rows, vocab]) wherever `bitmask` ([rows, ceil(vocab / 32)] int32) has a 0 bit."""
    width = logits.shape[1]
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        forbidden = _unpack(np.invert(bitmask), width)  # [rows, vocab] bool
        np.copyto(logits.detach().numpy(), -np.inf, where=forbidden)  # measured 16.5 us a row, 54 with masked_fill_
        return
    # numpy has no bfloat16, and a GPU should get 4 bytes per 32 tokens: unpack with torch where the logits are
    words = torch.from_numpy(bitmask).to(logits.device)
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=logits.device)) & 1  # [rows, words, 32]
    logits.masked_fill_(bits.view(bits.shape[0], -1)[:, :width] == 0, float("-inf"))


def mask_logits_(logits: torch.Tensor, states: list[GrammarState | None]) -> None:
    """logits: [rows, vocab_size], modified in place: row i gets -inf where states[i] forbids a token; None rows are
    untouched. One bitmask for the batch (None rows: every bit set), one apply."""
    if logits.dim() != 2 or logits.shape[0] != len(states):
        raise ValueError(f"logits {tuple(logits.shape)} need one row per state ({len(states)} states).")
    constrained = [(row, state) for row, state in enumerate(states) if state is not None]
    if not constrained:
        return
    width = logits.shape[1]
    for row, state in constrained:
        if state.vocab_size != width:
            raise ValueError(f"row {row}'s grammar masks {state.vocab_size} ids but the logits are {width} wide.")
    bitmask = np.full((len(states), _words(width)), -1, dtype=np.int32)
    for row, state in constrained:
        state.fill_bitmask(bitmask[row])
    apply_bitmask_(logits, bitmask)


def strict_schema(schema: dict) -> dict:
    """OpenAI's strict mode for a JSON schema: every object schema that does not say otherwise allows no properties
    beyond those it names (`additionalProperties: false`). A small model otherwise tends to add keys until it runs
    out of tokens. Returns a new schema; nested schemas (properties, items, unions, $defs) are closed too."""
    if isinstance(schema, list):
        return [strict_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict_schema(value) if key in _NESTED else value for key, value in schema.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(key), dict):
            out[key] = {name: strict_schema(value) for name, value in schema[key].items()}
    is_object = schema.get("type") == "object" or "properties" in schema
    if is_object and "additionalProperties" not in schema and "patternProperties" not in schema:
        out["additionalProperties"] = False
    return out


_NESTED = ("items", "prefixItems", "anyOf", "oneOf", "allOf", "not", "additionalProperties", "contains")
