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

The tree width of the sources that rank their candidates (Medusa, EAGLE) is chosen the same way when a greedy request
leaves it open: a run that measured two widths or more keeps the fastest (k, width) pair of the source, and the best
width at each k measured (`best_k`'s "w=auto" entries, read by `default_tree_width`); `BUILT_IN_TREE_WIDTH` where
nothing was kept. A sampled request, or an adaptive k, verifies a chain.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from inference_core.model.paths import cache_root
from inference_core.spec.decoding import MAX_TREE_WIDTH
from inference_core.spec.draft_heads import fingerprint

# Where no measurement of this setup was kept: the best k measured on the project's 2-core CPU hosts, compiled, bf16,
# paged KV (docs/benchmarks.md, "Compiled, each draft length" and "Each source's draft length, measured and kept"):
# the trained heads and early exit at k=1 on every host; prompt lookup at k=4 on the Intel host with AMX (k=3 by a
# hair on the AMD one, where k=4 led on grounded prompts). A draft model's best k depends on the pair of models; 4
# (the default before k was measured) stands until `spec-bench --source draft --keep` measures the pair.
BUILT_IN_K = {"ngram": 4, "early-exit": 1, "draft": 4, "medusa": 1, "eagle": 1}
# The tree width a greedy request of a ranking source gets where nothing was kept, eager and compiled: the best
# measured on the project's 2-core hosts, bf16, paged KV, at k=1 (docs/benchmarks.md, "Trained draft heads" and "A
# tree width measured and kept"). Eager, a tree is clearly ahead (EAGLE 3 wide 1.34-1.51x plain against the chain's
# 1.17-1.26x over four runs; Medusa 5 wide 1.22-1.40x against 1.13x). Compiled, where a verification's extra rows
# cost more against the step, EAGLE 2 wide led the chain by 1.5-4% in four runs of five and tied it in the fifth,
# and Medusa 3 wide led its chain by 3% in the one run that measured it. With trees pruned by the drafter's
# confidence ("Trees that follow the drafter's confidence"), EAGLE k=1 2 wide read at least 1.42x plain on chat and
# on code in three runs of three; k=2 3 wide led the geometric mean in two of them but read 1.37x on code in the third,
# where a host's extra rows cost the most.
BUILT_IN_TREE_WIDTH = {"medusa": {"eager": 5, "compiled": 3}, "eagle": {"eager": 3, "compiled": 2}}
AUTO_WIDTH = "auto"  # setting_key's tree width for "the best measured": its entry names both k and the width
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


def setting_key(method: str, tree_width: int | str = 1, draft_layers: int | None = None) -> str:
    """One speculative setting but for its k: the source, its tree width (`AUTO_WIDTH`: the source's best measured
    pair of k and width), early exit's depth."""
    return method + (f" L={draft_layers}" if draft_layers else "") + (f" w={tree_width}" if tree_width != 1 else "")


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


BUILT_IN_WHERE = "the project's measurement (nothing measured on this host for this setup)"


def _measured(entry: dict) -> str:
    return f"measured on this host {entry.get('measured', '')}".strip()


def default_k(setup: str, method: str, tree_width: int = 1, draft_layers: int | None = None) -> tuple[int, str]:
    """The k a request of `method` gets when it leaves k to the engine, and where it came from."""
    entry = kept_k(setup, setting_key(method, tree_width, draft_layers))
    if entry is not None:
        return entry["k"], _measured(entry)
    return BUILT_IN_K[method], BUILT_IN_WHERE


def _geomeans(by_choice: dict) -> tuple[dict, dict]:
    """{choice: {kind: ratio}} -> the choices measured on every kind and each one's geometric mean of the ratios."""
    kinds = set().union(*(ratios.keys() for ratios in by_choice.values()))
    complete = {choice: ratios for choice, ratios in by_choice.items()
                if set(ratios) == kinds and min(ratios.values()) > 0}
    means = {choice: math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios))
             for choice, ratios in complete.items()}
    return complete, means


def best_k(rows: list[dict]) -> dict[str, dict]:
    """From spec-bench's table rows ({"kind", "setting_key", "k", "ratio", and for a ranking source "source_key" and
    "tree_width"}), each setting's k with the highest geometric mean of its ratios over the kinds measured (a kind
    where it was not measured counts against it: only the ks measured on every kind compete). A source measured at
    two tree widths or more also gets a `setting_key(source, AUTO_WIDTH)` entry: its fastest (k, width) pair and,
    at each k, the fastest width ("width_by_k")."""
    by_setting: dict[str, dict[int, dict[str, float]]] = {}
    by_pair: dict[str, dict[tuple[int, int], dict[str, float]]] = {}
    for row in rows:
        by_setting.setdefault(row["setting_key"], {}).setdefault(row["k"], {})[row["kind"]] = row["ratio"]
        if "source_key" in row:
            pair = (row["k"], row.get("tree_width", 1))
            by_pair.setdefault(row["source_key"], {}).setdefault(pair, {})[row["kind"]] = row["ratio"]
    best = {}
    for setting, by_k in by_setting.items():
        complete, means = _geomeans(by_k)
        if not complete:
            continue
        k = max(means, key=lambda candidate: (means[candidate], -candidate))  # a tie goes to the shorter draft
        best[setting] = {"k": k, "geomean_ratio": round(means[k], 3), "ratios": dict(sorted(complete[k].items())),
                         "others": {str(other): round(mean, 3) for other, mean in sorted(means.items())}}
    for source, by_k_width in by_pair.items():
        complete, means = _geomeans(by_k_width)
        if len({width for _, width in complete}) < 2:
            continue
        # a tie goes to the shorter draft, then to the narrower tree: fewer rows to verify for the same speed
        rank = {pair: (means[pair], -pair[0], -pair[1]) for pair in means}
        k, width = max(rank, key=rank.get)
        width_by_k = {str(at): max((pair for pair in rank if pair[0] == at), key=rank.get)[1]
                      for at in sorted({pair[0] for pair in rank})}
        best[setting_key(source, AUTO_WIDTH)] = {
            "k": k, "tree_width": width, "geomean_ratio": round(means[(k, width)], 3),
            "ratios": dict(sorted(complete[(k, width)].items())), "width_by_k": width_by_k,
            "others": {f"k={at} w={w}": round(mean, 3) for (at, w), mean in sorted(means.items())}}
    return best


def default_tree_width(setup: str, method: str, k: int | None, compiled: bool) -> tuple[int, str]:
    """The tree width a greedy request of a ranking source (Medusa, EAGLE) gets when it leaves the width open, at
    draft length `k` (None: open too, to be settled at the width returned), and where it came from: the fastest
    width measured at that k on this host (the source's fastest pair where k is open or was not measured), else the
    project's measurement."""
    entry = kept_k(setup, setting_key(method, AUTO_WIDTH)) or {}
    by_k = entry.get("width_by_k")
    width = by_k[str(k)] if isinstance(by_k, dict) and str(k) in by_k else entry.get("tree_width")
    if isinstance(width, int) and not isinstance(width, bool) and 1 <= width <= MAX_TREE_WIDTH:
        return width, _measured(entry)
    return BUILT_IN_TREE_WIDTH[method]["compiled" if compiled else "eager"], BUILT_IN_WHERE


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
