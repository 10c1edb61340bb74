"""EleutherAI's lm-evaluation-harness (0.4.13) against the running app's API and against lm-eval's own `hf` model on
the same weights, offline, compared sample by sample: what a scoring client reads from our log-probabilities.

Start the app first in fp32 on the reference engine (`python app.py --dtype float32 --serving reference`: lm-eval's
`hf` model runs the weights in fp32, eager), then run
`python scripts/lm_eval_check.py [--url http://127.0.0.1:7860] [--lm-eval /tmp/lm-eval-venv/bin/lm_eval]`.
The script
- writes two small local tasks into `--out` (docs/lm_eval): `playground_mc`, 24 multiple-choice questions scored
  from log-likelihoods (lm-eval's `local-completions` sends each context + choice as token ids with `echo`,
  `logprobs: 1` and `max_tokens: 1`, and sums the choice's prompt entries), and `playground_gen`, 8 short questions
  answered greedily through the chat template (`local-chat-completions` with `--apply_chat_template`);
- runs lm-eval on each: through the API (multiple choice twice: with the bundled model's tokenizer directory, and
  with `tokenizer_backend=remote`, the tokenizer read from the app's `/tokenize`, `/detokenize` and
  `/tokenizer_info`), and with `--model hf` on the bundled model's converted directory in fp32 (`--device cpu`);
- prints, per run, the accuracy and the sample-by-sample comparison with `hf`: for multiple choice the largest
  difference of a choice's log-likelihood and the choices whose greedy flag differs, for generation the answers that
  differ; writes it all to `--out`/comparison.json and exits 1 where a goal fails (every choice within `--tolerance`
  nats of `hf` with the same greedy flags; every generated answer equal).

Install lm-eval in its own virtual environment, with a CPU build of torch first (lm-eval requires torch, and plain
`torch` would pull a CUDA build of several GB; on this project's machines `pip install torch==2.13.0` takes a CPU
file from disk):

    python -m venv /tmp/lm-eval-venv
    /tmp/lm-eval-venv/bin/pip install torch==2.13.0
    /tmp/lm-eval-venv/bin/pip install "lm-eval[api,hf]==0.4.13"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.guidellm_bench import bundled_dir, served_model  # noqa: E402

INSTALL = ("python -m venv /tmp/lm-eval-venv && /tmp/lm-eval-venv/bin/pip install torch==2.13.0 && "
           "/tmp/lm-eval-venv/bin/pip install 'lm-eval[api,hf]==0.4.13'")
# (question, choices, index of the right one): general knowledge a small model gets partly right.
QUESTIONS = [
    ("Which season comes after winter?", ["spring", "summer", "autumn", "night"], 0),
    ("What colour is the sky on a clear day?", ["blue", "green", "red", "black"], 0),
    ("How many legs does a spider have?", ["eight", "six", "four", "ten"], 0),
    ("What do bees make?", ["honey", "milk", "silk", "wool"], 0),
    ("Which planet is closest to the Sun?", ["Mercury", "Venus", "Earth", "Mars"], 0),
    ("What is frozen water called?", ["ice", "steam", "sand", "glass"], 0),
    ("Which animal is known as the king of the jungle?", ["lion", "mouse", "cow", "fish"], 0),
    ("What is the capital of France?", ["Paris", "London", "Rome", "Berlin"], 0),
    ("How many days are in a week?", ["seven", "five", "ten", "twelve"], 0),
    ("What do plants need from the Sun to grow?", ["light", "sound", "salt", "smoke"], 0),
    ("Which organ pumps blood through the body?", ["heart", "lung", "liver", "brain"], 0),
    ("What is the opposite of hot?", ["cold", "warm", "wet", "loud"], 0),
    ("Which gas do humans breathe in to live?", ["oxygen", "helium", "neon", "argon"], 0),
    ("What is the largest ocean on Earth?", ["Pacific", "Atlantic", "Indian", "Arctic"], 0),
    ("How many hours are in a day?", ["twenty-four", "twelve", "sixty", "ten"], 0),
    ("Which fruit is yellow and curved?", ["banana", "apple", "grape", "cherry"], 0),
    ("What do you use to write on a blackboard?", ["chalk", "ink", "paint", "soap"], 0),
    ("Which month comes after June?", ["July", "May", "March", "December"], 0),
    ("What is two plus three?", ["five", "four", "six", "seven"], 0),
    ("Which bird is a symbol of peace?", ["dove", "crow", "eagle", "owl"], 0),
    ("What do cows drink?", ["water", "oil", "juice", "tea"], 0),
    ("Which instrument has black and white keys?", ["piano", "drum", "flute", "violin"], 0),
    ("Where do fish live?", ["water", "trees", "sand", "clouds"], 0),
    ("What shape has three sides?", ["triangle", "square", "circle", "hexagon"], 0),
]
PROMPTS = ["What is the capital of Italy? Answer in one word.", "Name a primary colour. Answer in one word.",
           "What is 3 times 4? Answer with a number.", "What is the opposite of up? Answer in one word.",
           "Which animal says moo? Answer in one word.", "What do we call a baby dog? Answer in one word.",
           "How many wheels does a bicycle have? Answer with a number.",
           "What is the chemical symbol for water? Answer briefly."]
MC_TASK = """task: playground_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
GEN_TASK = """task: playground_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: ""
generation_kwargs:
  until: []
  max_gen_toks: 24
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}


def write_tasks(folder: Path) -> Path:
    """The two tasks' data and YAML files under `folder`/tasks (lm-eval's --include_path)."""
    tasks = folder / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    mc, gen = tasks / "mc.jsonl", tasks / "gen.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    gen.write_text("".join(json.dumps({"question": q}) + "\n" for q in PROMPTS))
    (tasks / "playground_mc.yaml").write_text(MC_TASK.format(data=mc.resolve()))
    (tasks / "playground_gen.yaml").write_text(GEN_TASK.format(data=gen.resolve()))
    return tasks


def run_lm_eval(lm_eval: str, name: str, task: str, model: str, model_args: str, tasks: Path, out: Path,
                extra: tuple[str, ...] = ()) -> Path:
    """One lm-eval run with --log_samples; returns the folder its results and samples went to."""
    folder = out / "runs" / name
    command = [lm_eval, "--model", model, "--model_args", model_args, "--tasks", task, "--include_path", str(tasks),
               "--output_path", str(folder), "--log_samples", "--batch_size", "1", *extra]
    print(f"\n$ {' '.join(command)}", flush=True)
    log = out / f"{name}.log"
    with log.open("w") as file:
        done = subprocess.run(command, stdout=file, stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE})
    if done.returncode:
        sys.exit(f"lm-eval run {name!r} failed (exit {done.returncode}); its log: {log}\n"
                 + "\n".join(log.read_text().splitlines()[-25:]))
    return folder


def samples(folder: Path, task: str) -> list[dict]:
    files = sorted(folder.rglob(f"samples_{task}_*.jsonl"))
    if not files:
        sys.exit(f"no samples of {task} under {folder}")
    return sorted((json.loads(line) for line in files[-1].read_text().splitlines()), key=lambda s: s["doc_id"])


def compare_choices(ours: list[dict], reference: list[dict]) -> dict:
    """Multiple choice: per choice (log-likelihood, greedy) from each run's filtered responses."""
    worst, flags, rows = 0.0, [], []
    for a, b in zip(ours, reference):
        for index, ((ll_a, greedy_a), (ll_b, greedy_b)) in enumerate(zip(a["filtered_resps"], b["filtered_resps"])):
            worst = max(worst, abs(float(ll_a) - float(ll_b)))
            if bool(greedy_a) != bool(greedy_b):
                flags.append((a["doc_id"], index))
            rows.append({"doc": a["doc_id"], "choice": index, "ours": float(ll_a), "hf": float(ll_b),
                         "greedy_ours": bool(greedy_a), "greedy_hf": bool(greedy_b)})
    accuracy = [sum(s["acc"] for s in run) / len(run) for run in (ours, reference)]
    return {"choices": len(rows), "max_abs_diff_nats": worst, "greedy_flags_differ": flags,
            "accuracy": accuracy[0], "accuracy_hf": accuracy[1], "rows": rows}


def compare_answers(ours: list[dict], reference: list[dict]) -> dict:
    answers = [(a["filtered_resps"][0], b["filtered_resps"][0]) for a, b in zip(ours, reference)]
    return {"answers": len(answers), "equal": sum(x == y for x, y in answers),
            "differ": [{"doc": i, "ours": x, "hf": y} for i, (x, y) in enumerate(answers) if x != y]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:7860", help="the running app")
    parser.add_argument("--lm-eval", default="/tmp/lm-eval-venv/bin/lm_eval", help="lm-eval's command")
    parser.add_argument("--out", default=str(ROOT / "docs" / "lm_eval"), help="tasks, logs and the comparison")
    parser.add_argument("--tolerance", type=float, default=0.002, help="nats a choice may differ from hf's")
    args = parser.parse_args(argv)
    if not Path(args.lm_eval).exists():
        sys.exit(f"{args.lm_eval} not found; install lm-eval in its own environment:\n    {INSTALL}")
    url = args.url.rstrip("/")
    model = served_model(url)
    try:
        urllib.request.urlopen(f"{url}/tokenizer_info", timeout=10)
    except (urllib.error.URLError, OSError) as exc:
        sys.exit(f"GET {url}/tokenizer_info failed ({exc}): this app predates the tokenizer endpoints")
    weights = bundled_dir()
    out = Path(args.out)
    tasks = write_tasks(out)
    api = f"model={model},num_concurrent=1,max_retries=1,tokenized_requests=True"
    completions = f"{api},base_url={url}/v1/completions"
    chat = f"model={model},num_concurrent=1,max_retries=1,base_url={url}/v1/chat/completions"
    hf = f"pretrained={weights},dtype=float32"
    runs = {
        "mc-api": ("playground_mc", "local-completions", f"{completions},tokenizer={weights}", ()),
        "mc-api-remote-tokenizer": ("playground_mc", "local-completions", f"{completions},tokenizer_backend=remote",
                                    ()),
        "mc-hf": ("playground_mc", "hf", hf, ("--device", "cpu")),
        "gen-api": ("playground_gen", "local-chat-completions", f"{chat},tokenizer={weights}",
                    ("--apply_chat_template",)),
        "gen-hf": ("playground_gen", "hf", hf, ("--device", "cpu", "--apply_chat_template")),
    }
    found = {name: samples(run_lm_eval(args.lm_eval, name, task, kind, model_args, tasks, out, extra), task)
             for name, (task, kind, model_args, extra) in runs.items()}
    report = {"url": url, "model": model, "weights": str(weights), "tolerance": args.tolerance,
              "mc-api": compare_choices(found["mc-api"], found["mc-hf"]),
              "mc-api-remote-tokenizer": compare_choices(found["mc-api-remote-tokenizer"], found["mc-hf"]),
              "gen-api": compare_answers(found["gen-api"], found["gen-hf"])}
    (out / "comparison.json").write_text(json.dumps(report, indent=1) + "\n")
    failed = False
    print("\n| run against hf | compared | largest difference (nats) | greedy flags differ | accuracy (hf) |")
    print("|---|---|---|---|---|")
    for name in ("mc-api", "mc-api-remote-tokenizer"):
        row = report[name]
        print(f"| {name} | {row['choices']} choices | {row['max_abs_diff_nats']:.5f} | "
              f"{len(row['greedy_flags_differ'])} | {row['accuracy']:.3f} ({row['accuracy_hf']:.3f}) |")
        failed |= row["max_abs_diff_nats"] > args.tolerance or bool(row["greedy_flags_differ"])
    gen = report["gen-api"]
    print(f"| gen-api | {gen['answers']} answers | {gen['equal']} equal | | |")
    for row in gen["differ"]:
        print(f"  answer {row['doc']} differs: ours {row['ours']!r}, hf {row['hf']!r}")
    failed |= bool(gen["differ"])
    print(f"\nwritten: {out / 'comparison.json'}" + ("; a goal failed" if failed else "; every goal met"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
