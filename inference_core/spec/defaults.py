"""The draft length a request gets when it leaves k to the engine: the best this host measured for the setup, else
the best the project measured.

How many drafts pay depends on the draft source (how often its later drafts are accepted) and on the host (what a
verification of k + 1 tokens costs against a decode step: near a decode step's cost where the weights' read from
memory dominates, about k + 1 times it where the multiply-adds do). One k for every source is wrong for most: on the
2-core hosts the shipped EAGLE layer is accepted 0.40 at its first draft and 0.12 at its second, so k=1 is its best
(0.95-1.13x compiled plain decoding) and k=4 its worst (0.51-0.65x), while prompt lookup on a grounded prompt is best
at k=3-4 (2.1-2.4x) and barely pays at k=1 (docs/benchmarks.md, "Compiled, each draft length").

`spec-bench --keep` measures each k of each source on the benchmark prompts and keeps, for the engine's setup (the
model, its dtype and weights, the KV mode, compiled or not, the CPU or GPU), the k whose tokens/s over plain decoding
has the highest geometric mean over the prompt kinds (`best_k`); `kept_k` reads it back, and `BUILT_IN_K` is used
where nothing was kept. Greedy output is the same at every k (speculation is lossless), so only the speed differs.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from inference_core.model.paths import cache_root
from inference_core.spec.draft_heads import fingerprint

# Where no measurement of this setup was kept: the best k measured on the project's 2-core CPU hosts, compiled, bf16,
# paged KV (docs/benchmarks.md, "Compiled, each draft length" and "Each source's draft length, measured and kept"):
# the trained heads and early exit at k=1 on every host; prompt lookup at k=4 on the Intel host with AMX (k=3 by a
# hair on the AMD one, where k=4 led on grounded prompts). A draft model's best k depends on the pair of models; 4
# (the default before k was measured) stands until `spec-bench --source draft --keep` measures the pair.
BUILT_IN_K = {"ngram": 4, "early-exit": 1, "draft": 4, "medusa": 1, "eagle": 1}
FILE_NAME = "spec-defaults.json"


def setup_key(loaded, kv_mode: str, compiled: bool) -> str:
    """The setup a measured k belongs to: the model (its name and shape), its dtype and weights, the KV mode, compiled
    or eager, and the device (the CPU's instruction set, or the GPU's name)."""
    device = loaded.device
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"cpu {torch.backends.cpu.get_cpu_capability()} {torch.get_num_threads()} threads"
    weights = loaded.quant.name if loaded.quant is not None else "model dtype"
    return (f"{loaded.name} [{fingerprint(loaded.config)}] {loaded.dtype_name}, {weights} weights, {kv_mode} KV, "
            f"{'compiled' if compiled else 'eager'}, {where}")


def setting_key(method: str, tree_width: int = 1, draft_layers: int | None = None) -> str:
    """One speculative setting but for its k: the source, its tree width, early exit's depth."""
    return method + (f" L={draft_layers}" if draft_layers else "") + (f" w={tree_width}" if tree_width > 1 else "")


def _path() -> Path:
    return cache_root() / FILE_NAME


def _read() -> dict:
    try:
        kept = json.loads(_path().read_text())
    except (OSError, ValueError):
        return {}
    return kept if isinstance(kept, dict) else {}


def kept_k(setup: str, setting: str) -> dict | None:
    """What `keep` wrote for this setup and setting ({"k", "geomean_ratio", "ratios", ...}), or None."""
    entry = _read().get(setup, {}).get(setting)
    if not isinstance(entry, dict) or not isinstance(entry.get("k"), int) or isinstance(entry.get("k"), bool):
        return None
    return entry


def default_k(setup: str, method: str, tree_width: int = 1, draft_layers: int | None = None) -> tuple[int, str]:
    """The k a request of `method` gets when it leaves k to the engine, and where it came from."""
    entry = kept_k(setup, setting_key(method, tree_width, draft_layers))
    if entry is not None:
        return entry["k"], f"measured on this host {entry.get('measured', '')}".strip()
    return BUILT_IN_K[method], "the project's measurement (nothing measured on this host for this setup)"


def best_k(rows: list[dict]) -> dict[str, dict]:
    """From spec-bench's table rows ({"kind", "setting_key", "k", "ratio"}), each setting's k with the highest
    geometric mean of its ratios over the kinds measured (a kind where it was not measured counts against it: only
    the ks measured on every kind compete)."""
    by_setting: dict[str, dict[int, dict[str, float]]] = {}
    for row in rows:
        by_setting.setdefault(row["setting_key"], {}).setdefault(row["k"], {})[row["kind"]] = row["ratio"]
    best = {}
    for setting, by_k in by_setting.items():
        kinds = set().union(*(ratios.keys() for ratios in by_k.values()))
        complete = {k: ratios for k, ratios in by_k.items() if set(ratios) == kinds and min(ratios.values()) > 0}
        if not complete:
            continue
        means = {k: math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios)) for k, ratios in complete.items()}
        k = max(means, key=lambda candidate: (means[candidate], -candidate))  # a tie goes to the shorter draft
        best[setting] = {"k": k, "geomean_ratio": round(means[k], 3), "ratios": dict(sorted(complete[k].items())),
                         "others": {str(other): round(mean, 3) for other, mean in sorted(means.items())}}
    return best


def keep(setup: str, chosen: dict[str, dict], command: str) -> Path:
    """Keep `best_k`'s choices for `setup` (replacing that setup's earlier ones for the same settings)."""
    kept = _read()
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    kept.setdefault(setup, {}).update({setting: {**entry, "measured": stamp, "command": command}
                                       for setting, entry in chosen.items()})
    path = _path()
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")
    temporary.replace(path)
    return path
