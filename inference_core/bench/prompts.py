"""The project's benchmark prompts (a copy of shared/prompts/bench.jsonl shipped with the package): one JSON object a
line with `id`, `kind` (chat, code, grounded, shared-prefix, long, completion), `prompt` and an optional `system`.
The bench, the tests and the playground's presets all read them from here."""

from __future__ import annotations

import json
from pathlib import Path

from inference_core.config import ConfigError
from inference_core.model.paths import DATA_DIR

DEFAULT_PROMPTS = DATA_DIR / "bench_prompts.jsonl"


def load_prompts(path: str | Path = DEFAULT_PROMPTS) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"prompt file {path} does not exist; pass an existing JSONL file to --prompts.")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}:{number}: not a JSON object ({error.msg}).") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ConfigError(f"{path}:{number}: each line needs a JSON object with a string 'prompt'.")
        row.setdefault("id", f"line-{number}")
        row.setdefault("kind", "chat")
        rows.append(row)
    return rows
