"""Where files live: the data shipped inside the package (`DATA_DIR`: the benchmark prompts, the evaluation and
calibration texts, the bundled model's trained draft heads) and the local cache (`cache_root()`:
~/.cache/inference-playground, or $INFERENCE_CORE_CACHE), under which converted GGUF models, compiled decode steps,
AWQ files, draft-head training data and trained heads are kept. It imports nothing of the project."""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent / "data"


def cache_root() -> Path:
    """The local cache's root: $INFERENCE_CORE_CACHE, else ~/.cache/inference-playground."""
    root = os.environ.get("INFERENCE_CORE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "inference-playground"
