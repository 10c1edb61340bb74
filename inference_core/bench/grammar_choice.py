"""`python -m inference_core.bench.grammar_choice`: which grammar library constrains our sampling more cheaply here.

Both candidates (xgrammar 0.2.8, llguidance 1.9.1) get the bundled model's tokenizer, its logits width and its stop
ids, and are timed on the same work: building the tokenizer info once; compiling any JSON object, the builtin JSON
grammar, five JSON schemas of different shape, a regex and a list of four choices (each to the first token mask, since
llguidance defers work that xgrammar does at compile time); and, per token of a valid ~60-token output, filling the
next-token bitmask, applying it to a [1, vocab] fp32 logits row, and accepting the token. Each library's import time is
measured in a fresh interpreter (after torch). Prints a table and writes JSON; the choice and its reasons are recorded
by hand in docs/structured_outputs.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from inference_core.bench.speed import machine_info, write_report
from inference_core.model.loader import load_model
from inference_core.structured import apply_bitmask_

# name -> (schema, a valid instance). Shapes: nesting, array of enums, number ranges, optional keys, string patterns.
SCHEMAS = {
    "nested object": ({"type": "object", "properties": {"name": {"type": "string"}, "address": {
        "type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                         "zip": {"type": "string"}},
        "required": ["street", "city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
        {"name": "Ada Lovelace", "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"}}),
    "array of enums": ({"type": "object", "properties": {"colors": {
        "type": "array", "items": {"enum": ["red", "green", "blue", "yellow"]}, "minItems": 1, "maxItems": 6}},
        "required": ["colors"], "additionalProperties": False}, {"colors": ["red", "blue", "blue", "yellow"]}),
    "number ranges": ({"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                                       "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["age", "score"], "additionalProperties": False}, {"age": 42, "score": 0.875}),
    "required and optional": ({"type": "object", "properties": {
        "id": {"type": "integer"}, "title": {"type": "string"}, "done": {"type": "boolean"},
        "note": {"type": ["string", "null"]}}, "required": ["id", "title"], "additionalProperties": False},
        {"id": 7, "title": "write the docs", "note": None}),
    "string pattern": ({"type": "object", "properties": {
        "date": {"type": "string", "pattern": "^\\d{4}-\\d{2}-\\d{2}$"},
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-\\d{4}$"}},
        "required": ["date", "sku"], "additionalProperties": False}, {"date": "2024-05-17", "sku": "ABC-1234"}),
}
REGEX = ("\\d{4}-\\d{2}-\\d{2}", "2024-05-17")  # an ISO date
CHOICES = (("positive", "negative", "neutral", "mixed"), "neutral")
# The per-token walk: a valid output of about 60 tokens under SCHEMAS["nested object"] (and any JSON object).
WALK = {"name": "Grace Brewster Murray Hopper, rear admiral", "address": {
    "street": "The Navy Yard, 1 Washington Avenue, Building 12", "city": "Arlington, Virginia", "zip": "22202-4305"}}
ROLLBACK_TOKENS = 16  # speculative decoding drafts up to 16 tokens
STEPS = ("fill", "apply", "apply_numpy", "accept")  # the timed parts of one constrained token


class Xgrammar:
    """xgrammar 0.2.8: tokenizer info from the vocabulary (special tokens as '' so that no grammar emits them)."""

    name = "xgrammar"
    install = "pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2"

    def __init__(self):
        import xgrammar  # imports transformers too (xgrammar/tokenizer_info.py)

        self.xgr = xgrammar

    def build(self, tokenizer, vocab_size: int, eos_ids: list[int]) -> None:
        """The tokenizer info and a compiler without a cache (every compile below is a cold one)."""
        xgrammar = self.xgr
        special = {token.content for token in tokenizer._tokenizer.get_added_tokens_decoder().values()
                   if token.special}
        encoded = [""] * vocab_size
        for token, token_id in tokenizer.vocabulary().items():
            encoded[token_id] = "" if token in special else token
        self.info = xgrammar.TokenizerInfo(encoded, xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                                           stop_token_ids=eos_ids, add_prefix_space=False)
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)

    def matcher(self, kind: str, spec):
        compiled = {"json_object": lambda: self.compiler.compile_json_schema('{"type": "object"}'),
                    "builtin_json": self.compiler.compile_builtin_json_grammar,
                    "json_schema": lambda: self.compiler.compile_json_schema(json.dumps(spec)),
                    "regex": lambda: self.compiler.compile_regex(spec),
                    "choice": lambda: self.compiler.compile_grammar(
                        "root ::= " + " | ".join(json.dumps(choice) for choice in spec))}[kind]()
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.accept_token(token_id)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)  # its native CPU kernel


class Llguidance:
    """llguidance 1.9.1: tokenizer info from the `tokenizers` JSON (it knows which added tokens are special)."""

    name = "llguidance"
    install = "pip install llguidance==1.9.1"

    def __init__(self):
        import llguidance

        self.llg = llguidance

    def build(self, tokenizer, vocab_size: int, eos_ids: list[int]) -> None:
        """The tokenizer info (llguidance has no compiled-grammar cache to turn off)."""
        self.eos_ids = frozenset(eos_ids)
        self.tokenizer = self.llg.LLTokenizer(tokenizer._tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos_ids)

    def matcher(self, kind: str, spec):
        grammar = {"json_object": lambda: self.llg.grammar_from("json_schema", '{"type": "object"}'),
                   "builtin_json": lambda: self.llg.grammar_from("json_schema", "{}"),
                   "json_schema": lambda: self.llg.grammar_from("json_schema", json.dumps(spec)),
                   "regex": lambda: self.llg.grammar_from("regex", spec),
                   "choice": lambda: self.llg.grammar_from("choice", list(spec))}[kind]()
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)

    def accept(self, matcher, token_id: int) -> bool:
        if token_id in self.eos_ids:  # try_consume_tokens never takes eos; consume_token does where the output may end
            return matcher.is_accepting() and matcher.consume_token(token_id)
        return matcher.try_consume_tokens([token_id]) == 1  # consume_token would leave a refused token's error state

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        apply_numpy(logits, bitmask)  # llguidance.torch's helper is torch.compile'd (see --compiled-apply)


def apply_numpy(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """inference_core.structured's apply (numpy unpack + copyto), which either library's bitmask fits: both lay out
    token 32 * w + j as bit j of int32 word w."""
    apply_bitmask_(logits, bitmask.numpy())


def apply_llguidance_compiled(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    import llguidance.torch

    llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)


def timed(function, *args) -> tuple[float, object]:
    """(seconds, result) of function(*args)."""
    start = time.perf_counter()
    result = function(*args)
    return time.perf_counter() - start, result


def import_seconds(module: str) -> dict:
    """Seconds to import `module` in a fresh interpreter that has imported torch, and whether it pulls transformers."""
    code = (f"import time, sys, torch\nstart = time.perf_counter()\nimport {module}\n"
            f"print(time.perf_counter() - start, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return {"import_s": round(float(out[0]), 3), "imports_transformers": out[1] == "True"}


def to_first_mask_ms(library, kind: str, spec, vocab_size: int, repeats: int) -> float:
    """Median milliseconds from grammar text to the first token mask."""
    bitmask = torch.empty((1, (vocab_size + 31) // 32), dtype=torch.int32)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        library.fill(library.matcher(kind, spec), bitmask, 0)
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 2)


def walks(library, tokenizer, kind: str, spec, text: str, eos_id: int) -> bool:
    """Whether the library accepts `text`'s tokens, undoes up to ROLLBACK_TOKENS of them and takes them again, then
    accepts eos."""
    try:
        matcher = library.matcher(kind, spec)
    except (RuntimeError, ValueError):
        return False
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not all(library.accept(matcher, token_id) for token_id in ids):
        return False
    matcher.rollback(min(ROLLBACK_TOKENS, len(ids)))
    redone = all(library.accept(matcher, token_id) for token_id in ids[-ROLLBACK_TOKENS:])
    return redone and library.accept(matcher, eos_id)


def walk_once(library, ids: list[int], row: torch.Tensor, times: dict[str, list[float]], compiled: bool) -> None:
    """One walk of `ids` under the nested-object schema, appending each step's seconds to `times`; `compiled` also
    times llguidance.torch's torch.compile'd apply."""
    bitmask = torch.empty((1, (row.shape[1] + 31) // 32), dtype=torch.int32)
    logits = row.clone()
    matcher = library.matcher("json_schema", SCHEMAS["nested object"][0])
    applies = {"apply": library.apply, "apply_numpy": apply_numpy,
               **({"apply_torch_compile": apply_llguidance_compiled} if compiled else {})}
    order = list(applies.items())
    for position, token_id in enumerate(ids):
        times["fill"].append(timed(library.fill, matcher, bitmask, 0)[0])
        shift = position % len(order)  # take turns going first: the first apply after a fill runs on colder caches
        for step, apply in order[shift:] + order[:shift]:
            logits.copy_(row)
            times[step].append(timed(apply, logits, bitmask)[0])
        accept_s, accepted = timed(library.accept, matcher, token_id)
        assert accepted, f"{library.name} refused token {token_id} of the walk"
        times["accept"].append(accept_s)


def per_token_us(libraries: list, tokenizer, vocab_size: int, repeats: int, compiled: bool) -> dict[str, dict]:
    """Median microseconds per token of fill, apply (the library's own CPU path; apply_numpy for both) and accept, by
    library, over `repeats` walks of WALK each. The libraries take turns walk by walk, so that both see the same load
    on a shared machine; the first round is a warm-up (and torch.compile's build, with `compiled`)."""
    ids = tokenizer.encode(json.dumps(WALK), add_special_tokens=False)
    row = torch.randn(1, vocab_size)  # logits: [1, vocab]
    steps = STEPS + (("apply_torch_compile",) if compiled else ())
    times = {library.name: {step: [] for step in steps} for library in libraries}
    for round_index in range(repeats + 1):
        for library in libraries:
            warm_up = {step: [] for step in steps}  # the first round's times are dropped
            walk_once(library, ids, row, times[library.name] if round_index else warm_up, compiled)
    results = {}
    for name, by_step in times.items():
        medians = {key + "_us": round(statistics.median(values) * 1e6, 1) for key, values in by_step.items()}
        medians["total_us"] = round(medians["fill_us"] + medians["apply_us"] + medians["accept_us"], 1)
        results[name] = {"walk_tokens": len(ids), **medians}
    return results


def measure(library, loaded, info_s: float, repeats: int) -> dict:
    """One library's import, tokenizer-info, compile and feature numbers (per-token numbers: per_token_us)."""
    tokenizer, vocab_size = loaded.tokenizer, loaded.config.vocab_size
    eos_id = min(loaded.eos_token_ids)
    cases = {"any JSON object": ("json_object", None, json.dumps(WALK)),
             "builtin JSON": ("builtin_json", None, json.dumps(WALK)),
             **{f"schema: {name}": ("json_schema", schema, json.dumps(instance))
                for name, (schema, instance) in SCHEMAS.items()},
             "regex (ISO date)": ("regex", REGEX[0], REGEX[1]),
             "choice (4)": ("choice", CHOICES[0], CHOICES[1])}
    compile_ms, supported = {}, {}
    for label, (kind, spec, text) in cases.items():
        supported[label] = walks(library, tokenizer, kind, spec, text, eos_id)
        compile_ms[label] = to_first_mask_ms(library, kind, spec, vocab_size, repeats) if supported[label] else None
    return {"library": library.name, "tokenizer_info_s": round(info_s, 3), **import_seconds(library.name),
            "to_first_mask_ms": compile_ms, "supported": supported}


def format_table(rows: list[dict]) -> str:
    names = [row["library"] for row in rows]
    lines = ["| measure | " + " | ".join(names) + " |", "|---" * (len(rows) + 1) + "|"]

    def add(label: str, values) -> None:
        lines.append(f"| {label} | " + " | ".join("n/a" if value is None else str(value) for value in values) + " |")

    add("import s (after torch)", [row["import_s"] for row in rows])
    add("imports transformers", [row["imports_transformers"] for row in rows])
    add("tokenizer info s", [row["tokenizer_info_s"] for row in rows])
    for case in rows[0]["to_first_mask_ms"]:
        add(f"to first mask ms: {case}", [row["to_first_mask_ms"][case] for row in rows])
    for case in rows[0]["supported"]:
        add(f"walks + eos + rollback {ROLLBACK_TOKENS}: {case}", [row["supported"][case] for row in rows])
    for key in rows[0]["per_token"]:
        add(f"per token: {key}", [row["per_token"][key] for row in rows])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/grammar_choice.json", help="where to write the JSON report")
    parser.add_argument("--repeats", type=int, default=5, help="cold compiles per grammar (the median is reported)")
    parser.add_argument("--walks", type=int, default=20, help="timed walks of the ~60-token output per library")
    parser.add_argument("--libraries", default="xgrammar,llguidance", help="comma-separated")
    parser.add_argument("--compiled-apply", action="store_true",
                        help="also time llguidance.torch's torch.compile'd apply (an inductor build: ~25 s here)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: stable times on a busy 2-core machine; the mask work is one row)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model("bundled", "cpu", "float32")
    libraries, rows = [], []
    for name in args.libraries.split(","):
        library_class = {"xgrammar": Xgrammar, "llguidance": Llguidance}[name]
        try:
            library = library_class()
        except ImportError as error:
            print(f"skipping {name} ({error}): {library_class.install}")
            continue
        info_s, _ = timed(library.build, loaded.tokenizer, loaded.config.vocab_size, sorted(loaded.eos_token_ids))
        libraries.append(library)
        rows.append(measure(library, loaded, info_s, args.repeats))
    if not rows:
        return 1
    per_token = per_token_us(libraries, loaded.tokenizer, loaded.config.vocab_size, args.walks, args.compiled_apply)
    for row in rows:
        row["per_token"] = per_token[row["library"]]
    print(format_table(rows))
    report = {"host": machine_info(torch.device("cpu")), "model": loaded.display_name,
              "vocab_size": loaded.config.vocab_size, "tokenizer_vocab_size": loaded.tokenizer.vocab_size,
              "threads": args.threads, "results": rows}
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
