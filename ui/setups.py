"""The race setups a newcomer picks from: each sets both lanes and, where it shows something off, the preset prompt,
and says in a sentence what the race shows and what to look for."""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from inference_core.bench.prompts import load_prompts
from inference_core.settings import LaneSettings


@dataclass(frozen=True)
class RaceSetup:
    lanes: dict[str, LaneSettings]
    prompt_id: str | None  # a benchmark prompt id, or None to keep the prompt as it is
    about: str


DEFAULT_LANES = {"A": LaneSettings(kv_mode="paged"), "B": LaneSettings(kv_mode="none")}
PERSON_SCHEMA = ('{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, '
                 '"required": ["name", "age"], "additionalProperties": false}')
RACE_SETUPS = {
    "paged KV cache vs no KV cache": RaceSetup(
        DEFAULT_LANES, None,
        "A KV cache keeps the keys and values of every token, so a step computes only the new one; with no KV cache "
        "(lane B) every step recomputes the whole text, and lane B slows down as the text grows."),
    "paged vs contiguous KV cache, long prompt": RaceSetup(
        {"A": LaneSettings(kv_mode="paged"), "B": LaneSettings(kv_mode="contiguous")}, "long-2",
        "Both caches keep every token and decode at about the same speed; they differ in memory: the contiguous "
        "cache reserves a whole context for one request, the paged pool only the blocks it fills (compare 'KV memory "
        "reserved' and the KV view)."),
    "prefix cache on vs off, shared system prompt": RaceSetup(
        {"A": LaneSettings(kv_mode="paged"), "B": LaneSettings(kv_mode="paged", prefix_cache=False)},
        "shared-prefix-2",
        "Lane A reuses the KV blocks of earlier requests on its engine that began with the same tokens. Run the race, "
        "then pick another shared-prefix question (same system prompt) or run it again: lane A computes only what "
        "is new, and its TTFT drops."),
    "compiled vs eager (both with the KV cache)": RaceSetup(
        {"A": LaneSettings(kv_mode="paged", compile=True), "B": LaneSettings(kv_mode="paged")}, None,
        "The same paged KV cache and greedy decoding; lane A's decode step runs compiled (fused C++ or "
        "CUDA kernels, fixed shapes), lane B's eagerly, op by op. The first time, lane A compiles before the race "
        "starts; its decode tokens/s is the part to compare. The texts match, except where the top two tokens were near-tied (the kernels sum in another order)."),
    "speculation: prompt lookup (k=5) vs plain decoding, grounded prompt": RaceSetup(
        {"A": LaneSettings(kv_mode="paged", spec_method="ngram", spec_k=5), "B": LaneSettings(kv_mode="paged")},
        "grounded-4",
        "The answer copies from the prompt, so prompt lookup's drafts are mostly accepted and lane A emits several "
        "tokens per step; the output stays exactly that of plain decoding (see the lossless check)."),
    "compiled vs compiled + prompt lookup, grounded prompt": RaceSetup(
        {"A": LaneSettings(kv_mode="paged", compile=True, spec_method="ngram", spec_k=4),
         "B": LaneSettings(kv_mode="paged", compile=True)},
        "grounded-4",
        "Both lanes decode compiled; lane A also speculates with prompt lookup, and its verifications (the last token "
        "and 4 drafts) run through a compiled step of their own, so speculation adds to compilation instead of "
        "falling back to the eager forward. The first time, lane A builds that step before the race starts (a few "
        "minutes on a 2-core CPU); on this prompt it then emits about four tokens a verification."),
    "compiled vs compiled + EAGLE (k=1), chat prompt": RaceSetup(
        {"A": LaneSettings(kv_mode="paged", compile=True, spec_method="eagle", spec_k=1, spec_tree_width=1),
         "B": LaneSettings(kv_mode="paged", compile=True)},
        "chat-med-3",
        "Both lanes decode compiled; lane A also drafts a token each step with the trained EAGLE layer and verifies it "
        "beside the step's last token through a compiled step of its own, which also returns the hidden states the "
        "layer reads for its next draft; the draft layer runs through compiled packages of its own. One draft a step "
        "is the length that measured best for these heads on a 2-core CPU, and there it ran at about 1.3x compiled "
        "plain decoding on chat and code prompts: the layer's first draft is accepted about 4 to 5 times in 10 "
        "(docs/benchmarks.md). The first time, lane A builds its steps before the race starts. The texts match, "
        "except where the top two tokens were near-tied (a two-row verification sums in another order than a "
        "one-row step)."),
    "speculation: early exit vs prompt lookup, grounded prompt": RaceSetup(
        {"A": LaneSettings(kv_mode="paged", spec_method="early-exit", spec_k=4),
         "B": LaneSettings(kv_mode="paged", spec_method="ngram", spec_k=5)},
        "grounded-4",
        "Two draft sources on one prompt. Early exit drafts with the model's own first layers, which this model was "
        "not trained for: nearly every draft is rejected and lane A pays for drafting and verifying anyway. Prompt "
        "lookup copies from the prompt and wins."),
    "speculation: trained draft heads (EAGLE) vs plain decoding, chat prompt": RaceSetup(
        {"A": LaneSettings(kv_mode="paged", spec_method="eagle", spec_k=2, spec_tree_width=3),
         "B": LaneSettings(kv_mode="paged")},
        "chat-med-3",
        "Lane A drafts with a small EAGLE layer trained on this model's own chat answers: it reads the model's last "
        "hidden state and guesses the next two tokens, three candidates for each (a tree: the best ones chained, the "
        "others beside them), and the model checks them all in one forward. On open chat, where prompt lookup finds "
        "nothing to copy, more than half of the first positions are accepted (green in the text, acceptance by "
        "position below); the output stays that of plain greedy decoding."),
    "structured output: a JSON schema vs free text": RaceSetup(
        {"A": LaneSettings(kv_mode="paged", constraint="json_schema", constraint_spec=PERSON_SCHEMA),
         "B": LaneSettings(kv_mode="paged")}, None,
        "Lane A's output is held to a JSON schema (a name and an age): at every step the grammar masks the tokens "
        "that would leave it, so its text always parses. Lane B answers freely. The table's 'constraint mask' row "
        "gives what the grammar cost per token; hover a token to see how sure the model was of it."),
    "int8 weights vs full precision": RaceSetup(
        {"A": LaneSettings(kv_mode="paged", weights="int8"), "B": LaneSettings(kv_mode="paged")}, None,
        "Lane A's projections are int8 with a scale per output channel: about a quarter of the fp32 weight bytes "
        "stream from memory each step (see 'weights' in the table), so it decodes faster where the kernel is fast. "
        "The check below shows how long the two greedy texts agree; the quality command measures perplexity."),
    "int8 KV cache vs full precision": RaceSetup(
        {"A": LaneSettings(kv_mode="paged", kv_dtype="int8"), "B": LaneSettings(kv_mode="paged")}, "long-2",
        "Lane A stores each token's keys and values as int8 with a scale per head: the same pool holds about 2x "
        "(vs 16-bit) or 4x (vs fp32) the tokens ('KV bytes per token' and 'KV memory' in the table, blocks in the "
        "KV view). It saves memory, not time: reads are dequantized on the fly."),
    "int4 KV cache vs model dtype": RaceSetup(
        {"A": LaneSettings(kv_mode="paged", kv_dtype="int4"), "B": LaneSettings(kv_mode="paged")}, "long-2",
        "Lane A stores keys and values in 4 bits as KIVI does: keys per channel over each 16-token block, values per "
        "token in groups of 32 channels, a sequence's newest block in the model dtype until it fills. Compare 'KV "
        "bytes per token' (about a sixth of fp32's, a third of bf16's, scales included), the greedy agreement below "
        "and, in the KV view, which blocks are int4 and which are still in full precision."),
    "sliding window with and without sinks on a long text": RaceSetup(
        {"A": LaneSettings(kv_mode="paged", sliding_window=128, attention_sinks=4),
         "B": LaneSettings(kv_mode="paged", sliding_window=128)}, "long-1",
        "Both lanes attend to the last 128 tokens of a 475-token text, and the paged pool gives back the blocks that "
        "fall out of the window. Lane A also keeps the text's first 4 tokens in view (StreamingLLM's attention sinks): "
        "a model trained with full attention puts much of its attention there, and without them (lane B) it loses "
        "its footing and tends to repeat itself. The KV view shows the sink block kept beside the window."),
}


def presets() -> dict[str, dict]:
    """The preset prompts by their dropdown label ('kind: id'), plain-completion rows left out (the race chats)."""
    return {f"{row['kind']}: {row['id']}": row for row in load_prompts() if row["kind"] != "completion"}


def setup_values(setup: RaceSetup, prompts: dict[str, dict], fields: tuple[str, ...]) -> list:
    """A setup's widget values: the preset key, prompt and system (left as they are without a prompt), the setup's
    description, then lane A's and lane B's settings in `fields` order."""
    key = next((key for key, row in prompts.items() if row["id"] == setup.prompt_id), None)
    head = [key, prompts[key]["prompt"], prompts[key].get("system", "")] if key else [gr.skip()] * 3
    return head + [setup.about] + [getattr(setup.lanes[name], field) for name in "AB" for field in fields]
