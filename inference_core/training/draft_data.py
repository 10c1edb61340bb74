"""Training data for draft heads, made here: the model's own answers to varied chat prompts (self-distillation, so a
head learns what this model says), generated with our engine in batches.

`chat_prompts(count, seed)` builds prompts offline from task templates crossed with topics, coding tasks (write a
function; read, test, fix or speed up a given one), passages of the shipped public-domain calibration text (Pride
and Prejudice, chapters 1-5; the quality evaluation's text stays out), and the varied requests of `varied_prompts`.
A prompt that shares any four consecutive words with a benchmark prompt is dropped, so the benchmark set stays held
out. `generate(loaded, prompts, ...)` answers them, greedy or sampled, many requests per engine step, and returns each
sample's token ids (prompt through the chat template, then the answer) with the prompt's length; `save`/`load` keep
them as JSON lines.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path

from inference_core.config import EngineConfig
from inference_core.engine.engine import Engine
from inference_core.engine.request import FinishEvent
from inference_core.model.loader import LoadedModel
from inference_core.model.paths import DATA_DIR
from inference_core.sampling import SamplingParams
from inference_core.training.varied_prompts import varied_prompts

DATA = DATA_DIR
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
    "Write a Python function that {task}.", "Show Python code that {task}, with a short explanation.",
    "Implement a Python function that {task} and explain how it works.",
    "Write a short Python script with a function that {task}, and show an example call.",
)
CODE_TOPICS = (
    "reverses a string", "checks whether a number is prime", "counts the words in a text", "merges two sorted lists",
    "finds the largest element of a list", "removes duplicates from a list while keeping order",
    "computes the factorial of a number", "converts Celsius to Fahrenheit", "reads a CSV file into a list of rows",
    "checks whether a string is a palindrome", "flattens a nested list", "returns the n-th Fibonacci number",
    "groups words by their first letter", "computes the average of a list of numbers", "validates an email address",
    "sorts a list of dictionaries by a key", "counts how often each character appears in a string",
    "checks whether two strings are anagrams", "finds the second largest number in a list", "capitalizes every word",
    "converts a Roman numeral to an integer", "computes the greatest common divisor of two numbers",
    "splits a list into chunks of a given size", "returns the intersection of two lists", "parses a date string",
    "rotates a list by k positions", "finds the longest word in a sentence", "sums the digits of an integer",
    "checks whether a year is a leap year", "converts a binary string to a decimal number", "transposes a matrix",
    "implements binary search on a sorted list", "implements bubble sort", "counts the vowels in a string",
    "removes punctuation from a text", "generates all permutations of a string", "merges two dictionaries",
    "finds the most common element in a list", "checks whether brackets in a string are balanced",
    "writes a list of rows to a CSV file", "reads a JSON file and prints its keys", "computes a running total",
    "returns the prime factors of a number", "implements a simple stack class", "implements a queue with two stacks",
    "finds duplicate files by their size", "converts a string to snake_case", "computes the median of a list",
    "checks whether a number is a perfect square", "truncates a string to a maximum length with an ellipsis",
    "fetches the words that appear in both of two texts", "computes the dot product of two vectors",
    "memoizes an expensive function with a dictionary", "retries a function call up to three times",
    "measures how long another function takes to run", "counts the lines in a text file",
)
CODE_SNIPPETS = (
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n"
    "        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
    "def is_prime(n):\n    if n < 2:\n        return False\n    for d in range(2, n):\n        if n % d == 0:\n"
    "            return False\n    return True\n",
    "def flatten(items):\n    out = []\n    for item in items:\n        if isinstance(item, list):\n"
    "            out.extend(flatten(item))\n        else:\n            out.append(item)\n    return out\n",
    "def unique(items):\n    seen = []\n    for item in items:\n        if item not in seen:\n"
    "            seen.append(item)\n    return seen\n",
    "def fib(n):\n    if n <= 1:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "def longest_word(sentence):\n    best = ''\n    for word in sentence.split(' '):\n"
    "        if len(word) > len(best):\n            best = word\n    return best\n",
    "def read_numbers(path):\n    f = open(path)\n    numbers = []\n    for line in f:\n"
    "        numbers.append(int(line))\n    return numbers\n",
    "def total_price(cart):\n    total = 0\n    for name in cart:\n        total = total + cart[name]['price'] * "
    "cart[name]['qty']\n    return total\n",
    "def find_index(items, target):\n    index = 0\n    while index < len(items):\n        if items[index] == target:\n"
    "            return index\n        index += 1\n    return -1\n",
    "def join_names(names):\n    s = ''\n    for name in names:\n        s += name + ', '\n    return s\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n"
    "        self.count += 1\n        return self.count\n",
    "def celsius_table(start, stop):\n    rows = []\n    for c in range(start, stop):\n"
    "        rows.append((c, c * 9 / 5 + 32))\n    return rows\n",
    "def word_lengths(words):\n    return list(map(lambda w: len(w), words))\n",
    "def max_value(numbers):\n    biggest = numbers[0]\n    for number in numbers:\n        if number > biggest:\n"
    "            biggest = number\n    return biggest\n",
    "def reverse(s):\n    out = ''\n    for ch in s:\n        out = ch + out\n    return out\n",
    "def pairs_with_sum(numbers, target):\n    found = []\n    for a in numbers:\n        for b in numbers:\n"
    "            if a + b == target:\n                found.append((a, b))\n    return found\n",
    "def safe_divide(a, b):\n    try:\n        return a / b\n    except:\n        return None\n",
    "def load_config(path):\n    import json\n    with open(path) as handle:\n        data = json.load(handle)\n"
    "    return data['settings']\n",
    "def squares(limit):\n    result = []\n    n = 0\n    while n < limit:\n        result.append(n * n)\n"
    "        n += 1\n    return result\n",
    "def add_item(item, bucket=[]):\n    bucket.append(item)\n    return bucket\n",
)
CODE_SNIPPET_TASKS = (
    "What does this Python code do?\n\n{code}", "Add type hints and a docstring to this function:\n\n{code}",
    "Is there a bug or an edge case this code gets wrong?\n\n{code}",
    "Write pytest unit tests for this code:\n\n{code}",
    "Make this code more Pythonic and explain the changes:\n\n{code}",
    "How could this code run faster on large inputs?\n\n{code}",
)
PASSAGE_TASKS = ("Summarize this passage:\n\n{passage}", "What happens in this passage?\n\n{passage}",
                 "Who are the people in this passage, and what do they want?\n\n{passage}")
PROMPT_SETS = ("all", "templates", "varied")
VARIED_POOL = 8000  # prompts drawn from the varied grammar (seed 0) before the benchmark's are held out


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


def chat_prompts(count: int, seed: int = 0, prompt_set: str = "all") -> list[str]:
    """Up to `count` distinct prompts (fewer if the set runs out), in a seeded order, none sharing four consecutive
    words with a benchmark prompt. `prompt_set`: "templates" (task templates crossed with topics, code tasks and
    passages: about 3,000), "varied" (`varied_prompts`' grammar: VARIED_POOL) or "all" (both)."""
    if prompt_set not in PROMPT_SETS:
        raise ValueError(f"prompt_set must be one of {', '.join(PROMPT_SETS)}, got {prompt_set!r}")
    candidates = []
    if prompt_set in ("templates", "all"):
        candidates += [task.format(topic=topic) for task in TASKS for topic in TOPICS]
        candidates += [task.format(task=topic) for task in CODE_TASKS for topic in CODE_TOPICS]
        candidates += [task.format(code=code) for task in CODE_SNIPPET_TASKS for code in CODE_SNIPPETS]
        candidates += [task.format(passage=passage) for task in PASSAGE_TASKS for passage in _passages()]
    if prompt_set in ("varied", "all"):
        candidates += varied_prompts(VARIED_POOL)
    held_out = bench_four_grams()
    kept = sorted({prompt for prompt in candidates if not (_four_grams(prompt) & held_out)})
    random.Random(seed).shuffle(kept)
    return kept[:count]


def generate(loaded: LoadedModel, prompts: list[str], *, max_new_tokens: int = 128, temperature: float = 0.0,
             seed: int = 0, batch_size: int = 16, max_seq_len: int = 1024,
             progress: Callable[[int, int], None] | None = None) -> list[dict]:
    """The model's answers to `prompts` (greedy at temperature 0, else sampled with seed + index), `batch_size`
    requests per engine step, each within `max_seq_len` tokens (or the model's context, where shorter): a list of
    {"prompt": i, "temperature": t, "prompt_tokens": n, "ids": prompt ids + answer ids}."""
    prompt_ids = [loaded.tokenizer.encode_chat([{"role": "user", "content": prompt}]) for prompt in prompts]
    # The KV pool holds `batch_size` of the longest requests at once, so that `batch_size` answers are written side
    # by side (the engine's default pool holds one max_seq_len sequence: a handful of answers at a time).
    max_seq_len = min(max_seq_len, loaded.config.max_position_embeddings)
    longest = max(len(ids) for ids in prompt_ids) + max_new_tokens
    engine = Engine(loaded, EngineConfig(kv_mode="paged", max_seq_len=max_seq_len, max_num_seqs=batch_size,
                                         prefix_cache=False, kv_cache_tokens=batch_size * min(longest, max_seq_len)))
    requests = [None] * len(prompts)
    # Shortest prompts first, so that the requests decoding side by side have contexts of about the same length (a
    # step's decodes attend over the longest one's, padded).
    for index in sorted(range(len(prompts)), key=lambda i: len(prompt_ids[i])):
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                seed=None if temperature == 0 else seed + index)
        requests[index] = engine.enqueue(engine.make_request(prompt_ids[index], params))
    samples: list[dict | None] = [None] * len(prompts)
    done = 0
    while engine.has_work():
        engine.step()
        for index, request in enumerate(requests):
            while request.events:
                event = request.events.popleft()
                if isinstance(event, FinishEvent):
                    samples[index] = {"prompt": index, "temperature": temperature,
                                      "prompt_tokens": len(prompt_ids[index]),
                                      "ids": prompt_ids[index] + list(event.token_ids)}
                    done += 1
                    if progress is not None:
                        progress(done, len(prompts))
    return [sample for sample in samples if sample is not None]


def save(path: Path, samples: list[dict]) -> None:
    Path(path).write_text("".join(json.dumps(sample) + "\n" for sample in samples))


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
