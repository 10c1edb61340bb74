"""Text in and out: a thin wrapper over a `tokenizers` tokenizer.json, the model's Jinja chat template, and an
incremental detokenizer that turns a growing list of token ids into text deltas for streaming.

We read the files directly (no transformers import at run time) so that loading stays fast; the chat template is
rendered the way transformers renders it (sandboxed Jinja, `trim_blocks`, `lstrip_blocks`, `raise_exception`), and
rendered chat text is encoded without adding special tokens again, as transformers does.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as FastTokenizer

from inference_core.config import ConfigError


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, model_dir: Path):
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir} has no tokenizer.json; only fast (tokenizers) tokenizers are supported.")
        self._tokenizer = FastTokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.pad_token = _token_text(config.get("pad_token"))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text()
        self.chat_template = template
        self._compiled_template = None
        eos_id = self._tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids = () if eos_id is None else (eos_id,)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def vocabulary(self) -> dict[str, int]:
        """Every token string (added tokens included) and its id."""
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_string(self, token_id: int) -> str | None:
        """One token as the vocabulary spells it (a byte-level BPE token's 'Ġ' for a space: transformers'
        `convert_ids_to_tokens`); None for an id outside it."""
        return self._tokenizer.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes (a byte-level BPE token may hold part of a UTF-8 character, which `decode` shows
        as U+FFFD): what OpenAI's log-probabilities report as `bytes`."""
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:  # SentencePiece byte fallback
            return bytes([int(piece[3:5], 16)])
        byte_of = _byte_level_decoder()
        if all(char in byte_of for char in piece):
            return bytes(byte_of[char] for char in piece)
        return piece.replace("\u2581", " ").encode()  # SentencePiece's word boundary

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render `messages` ([{role, content}]), with the generation prompt appended unless told not to."""
        if not self.chat_template:
            raise ConfigError("this model has no chat template; use plain completion (--no-chat).")
        if self._compiled_template is None:
            def raise_exception(message):
                raise ConfigError(f"chat template: {message}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, indent=indent,
                                                                               ensure_ascii=False)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._compiled_template = env.from_string(self.chat_template)
        return self._compiled_template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                              bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)

    def prompt_ids(self, prompt: str | list[dict], system: str | None = None, chat: bool = True) -> list[int]:
        """Text (or chat messages) -> prompt token ids, through the chat template unless chat=False."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ConfigError("the prompt is empty; type some text.")
            if not chat:
                return self.encode(prompt)
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}]
        else:
            messages = prompt
            if not messages or not any(str(m.get("content", "")).strip() for m in messages):
                raise ConfigError("the conversation is empty; type a message.")
        return self.encode_chat(messages)


_BYTE_LEVEL: dict[str, int] = {}


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character that stands for each byte -> the byte."""
    if not _BYTE_LEVEL:
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                     *range(ord("\xae"), ord("\xff") + 1)]
        extra = 0
        for byte in range(256):
            if byte in printable:
                _BYTE_LEVEL[chr(byte)] = byte
            else:
                _BYTE_LEVEL[chr(256 + extra)] = byte
                extra += 1
    return _BYTE_LEVEL


class IncrementalDetokenizer:
    """Turns appended token ids into text deltas. Decodes a short window, not the whole text, each step; holds back a
    delta while it ends in an incomplete UTF-8 character (a byte-level BPE token can split one)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_ids[-6:])  # a little context so leading spaces decode as in the full text
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def add(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        skip = self.skip_special_tokens
        prefix_text = self.tokenizer.decode(self.token_ids[self.prefix_offset:self.read_offset], skip)
        full_text = self.tokenizer.decode(self.token_ids[self.prefix_offset:], skip)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return full_text[len(prefix_text):]
        return ""
