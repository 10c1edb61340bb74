"""Training data for draft heads, made here: the model's own answers to varied chat prompts (self-distillation, so a
head learns what this model says), generated with our engine in batches.

`chat_prompts(count, seed)` builds prompts offline from task templates crossed with topics, and passages of the
shipped public-domain calibration text (Pride and Prejudice, chapters 1-5; the quality evaluation's text stays
out). A prompt that shares any four consecutive words with a benchmark prompt is dropped, so the benchmark set stays
held out. `generate(loaded, prompts, ...)` answers them, greedy or sampled, many requests per engine step, and
returns each sample's token ids (prompt through the chat template, then the answer) with the prompt's length;
`save`/`load` keep them as JSON lines.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path

from inference_core.config import EngineConfig
from inference_core.engine import Engine, FinishEvent
from inference_core.loader import LoadedModel
from inference_core.sampling import SamplingParams

DATA = Path(__file__).parent / "data"
TASKS = (
    "Explain {topic} to a beginner.", "What are the main ideas behind {topic}?",
    "Give me three practical tips about {topic}.", "Write a short poem about {topic}.",
    "What are common mistakes people make with {topic}?", "Summarize the history of {topic} in a few sentences.",
    "How would you teach {topic} to a ten-year-old?", "List the pros and cons of {topic}.",
    "Write a short story that involves {topic}.", "What questions should I ask before starting with {topic}?",
    "Describe {topic} in one paragraph.", "Why do people care about {topic}?",
    "Write a friendly email inviting a colleague to learn about {topic}.", "What is a good first step with {topic}?",
    "Compare {topic} with something from everyday life.", "What would the world look like without {topic}?",
    "Write a limerick about {topic}.", "Give a short quiz with three questions about {topic}.",
    "What do experts disagree about when it comes to {topic}?", "Tell me a fun fact about {topic}.",
    "Write a tweet that makes people curious about {topic}.", "How has {topic} changed in the last hundred years?",
    "Plan a one-week study schedule for {topic}.", "What books or resources would help me understand {topic}?",
)
TOPICS = (
    "photosynthesis", "black holes", "compound interest", "sourdough baking", "machine learning", "volcanoes",
    "the water cycle", "public speaking", "chess openings", "recursion in programming", "climate change",
    "meditation", "the French Revolution", "budgeting", "electric cars", "bird migration", "the immune system",
    "jazz music", "rock climbing", "version control with git", "solar panels", "the Roman Empire", "coffee brewing",
    "time management", "earthquakes", "vaccines", "origami", "supply and demand", "the Moon landing", "beekeeping",
    "learning a new language", "databases", "sleep", "urban gardening", "the stock market", "rainbows",
    "renewable energy", "ancient Egypt", "knitting", "cybersecurity", "marathon training", "the printing press",
    "recycling", "dinosaurs", "cloud computing", "photography", "the human heart", "negotiation", "tea ceremonies",
    "sorting algorithms", "ocean tides", "first aid", "board games", "the Renaissance", "electricity", "friendship",
    "camping", "nutrition", "the internet", "mountains", "spreadsheets", "honeybees", "poetry", "bridges",
    "wind turbines", "the periodic table", "job interviews", "painting with watercolors", "coral reefs", "robots",
    "glaciers", "the Olympic Games", "typography", "vaccination schedules for pets", "fermentation", "lighthouses",
    "quantum computing", "the Silk Road", "composting", "gravity", "podcasts", "the Great Wall of China", "yoga",
    "cryptography", "deserts", "kindness", "opera", "airplanes", "the Amazon rainforest", "mushrooms", "tornadoes",
    "minimalism", "libraries", "submarines", "fossils", "the Pythagorean theorem", "credit scores", "owls",
    "video game design", "the speed of light", "hiking safety", "architecture", "mapmaking", "chocolate",
    "the Industrial Revolution", "team meetings", "sea turtles", "calligraphy", "satellites", "bread", "pianos",
    "wildfires", "statistics", "the Olympic marathon", "penguins", "home insulation", "folk tales", "microscopes",
)
CODE_TASKS = (
    "Write a Python function that {task}.", "Show how to {task} in Python, with a short explanation.",
)
CODE_TOPICS = (
    "reverses a string", "checks whether a number is prime", "counts the words in a text", "merges two sorted lists",
    "finds the largest element of a list", "removes duplicates from a list while keeping order",
    "computes the factorial of a number", "converts Celsius to Fahrenheit", "reads a CSV file into a list of rows",
    "checks whether a string is a palindrome", "flattens a nested list", "returns the n-th Fibonacci number",
    "groups words by their first letter", "computes the average of a list of numbers", "validates an email address",
)
PASSAGE_TASKS = ("Summarize this passage:\n\n{passage}", "What happens in this passage?\n\n{passage}",
                 "Who are the people in this passage, and what do they want?\n\n{passage}")


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def _four_grams(text: str) -> set[tuple[str, ...]]:
    words = _words(text)
    return {tuple(words[i:i + 4]) for i in range(len(words) - 3)}


def bench_four_grams() -> set[tuple[str, ...]]:
    grams = set()
    for line in (DATA / "bench_prompts.jsonl").read_text().splitlines():
        if line.strip():
            prompt = json.loads(line)
            grams |= _four_grams(prompt["prompt"] + " " + prompt.get("system", ""))
    return grams


def _passages(words_per_passage: int = 120) -> list[str]:
    text = (DATA / "calibration_text.txt").read_text()
    paragraphs = [p.strip().replace("\n", " ") for p in text.split("\n\n") if len(p.split()) >= 40]
    return [" ".join(p.split()[:words_per_passage]) for p in paragraphs]


def chat_prompts(count: int, seed: int = 0) -> list[str]:
    """Up to `count` distinct prompts (fewer if the templates run out), in a seeded order, none sharing four
    consecutive words with a benchmark prompt."""
    candidates = [task.format(topic=topic) for task in TASKS for topic in TOPICS]
    candidates += [task.format(task=topic) for task in CODE_TASKS for topic in CODE_TOPICS]
    candidates += [task.format(passage=passage) for task in PASSAGE_TASKS for passage in _passages()]
    held_out = bench_four_grams()
    kept = sorted({prompt for prompt in candidates if not (_four_grams(prompt) & held_out)})
    random.Random(seed).shuffle(kept)
    return kept[:count]


def generate(loaded: LoadedModel, prompts: list[str], *, max_new_tokens: int = 128, temperature: float = 0.0,
             seed: int = 0, batch_size: int = 16, max_seq_len: int = 1024,
             progress: Callable[[int, int], None] | None = None) -> list[dict]:
    """The model's answers to `prompts` (greedy at temperature 0, else sampled with seed + index), `batch_size`
    requests per engine step: a list of {"prompt": i, "prompt_tokens": n, "ids": prompt ids + answer ids}."""
    engine = Engine(loaded, EngineConfig(kv_mode="paged", max_seq_len=max_seq_len, max_num_seqs=batch_size))
    requests, prompt_ids = [], []
    for index, prompt in enumerate(prompts):
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                seed=None if temperature == 0 else seed + index)
        request = engine.make_request(prompt, params)
        prompt_ids.append(list(request.seq.token_ids))
        requests.append(engine.enqueue(request))
    samples: list[dict | None] = [None] * len(prompts)
    done = 0
    while engine.has_work():
        engine.step()
        for index, request in enumerate(requests):
            while request.events:
                event = request.events.popleft()
                if isinstance(event, FinishEvent):
                    samples[index] = {"prompt": index, "prompt_tokens": len(prompt_ids[index]),
                                      "ids": prompt_ids[index] + list(event.token_ids)}
                    done += 1
                    if progress is not None:
                        progress(done, len(prompts))
    return [sample for sample in samples if sample is not None]


def save(path: Path, samples: list[dict]) -> None:
    Path(path).write_text("".join(json.dumps(sample) + "\n" for sample in samples))


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
