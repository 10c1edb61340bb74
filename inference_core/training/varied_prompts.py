"""The varied prompt set for draft-head training data: the questions and tasks people bring to a chat assistant, in
many phrasings, built offline from a small grammar (question forms, advice, comparisons, creative writing, letters,
arithmetic word problems, programming in several languages), each family crossed with its own subjects and, where it
fits, an audience and a format.

The templates set (`draft_data.TASKS` crossed with `TOPICS`) asks two dozen questions about each of a hundred topics,
so a layer trained on it learns those answers' openings: on the benchmark's chat prompts, which it never saw, the
shipped EAGLE layer agreed with the model's next token at 0.50 against 0.75 on its training prompts. This set is what
the model's answers to other kinds of requests look like. `varied_prompts(count, seed)` draws from it; draft_data
holds the benchmark prompts out of both sets."""

from __future__ import annotations

import random

AUDIENCES = ("a beginner", "a high school student", "my grandmother", "a new colleague", "a busy parent",
             "someone who has never heard of it", "an engineer", "a curious teenager", "a small business owner",
             "a nurse", "a first-year university student", "an artist")
FORMATS = ("in three bullet points", "in one short paragraph", "in under 100 words", "as a numbered list",
           "with a simple example", "using an analogy", "in a friendly tone", "as a short dialogue",
           "in two sentences", "with a table", "step by step", "with one surprising fact")
SUBJECTS = (
    "inflation", "the placebo effect", "plate tectonics", "the electoral college", "blockchains", "antibiotics",
    "the greenhouse effect", "jet lag", "interest rates", "DNA", "the Doppler effect", "evolution", "the blues",
    "impressionist painting", "the Cold War", "index funds", "habit formation", "sign language", "wind chill",
    "noise-cancelling headphones", "3D printing", "the Fibonacci sequence", "probability", "photosynthesis in algae",
    "the nervous system", "allergies", "tsunamis", "the Northern Lights", "human memory", "procrastination",
    "carbon dating", "neural networks", "the metric system", "ocean currents", "taxes", "insurance", "open source",
    "the scientific method", "a balanced diet", "stage fright", "empathy", "urban planning", "public transport",
    "desalination", "the ozone layer", "volunteering", "freelancing", "mortgages", "the Big Bang", "gene editing",
    "philosophy of mind", "stoicism", "supply chains", "hydroelectric power", "nuclear fusion", "exoplanets",
    "bacteria in the gut", "circadian rhythms", "the Treaty of Versailles", "the Ming dynasty", "the Aztecs",
    "Shakespeare's comedies", "haiku as a form", "the violin", "street art", "fast fashion", "food waste",
    "water purification", "the Mars rovers", "self-driving cars", "password managers", "phishing", "spam filters",
    "search engines", "compilers", "operating systems", "computer memory", "encryption keys", "data privacy",
    "the decimal system", "fractions", "prime numbers", "triangles", "logarithms", "climate models", "rain forests",
    "pollination", "soil erosion", "bird songs", "whales", "octopuses", "ants", "wolves", "elephants' memory",
)
EXPLAIN = ("Explain {s} to {a} {f}.", "Can you explain {s} {f}?", "Tell {a} about {s} {f}.",
           "What is {s}? Answer {f}.", "Help me understand {s}. I am {a}.", "Teach {a} the basics of {s} {f}.",
           "Give an overview of {s} {f}.", "What should {a} know about {s}?")
QUESTIONS = (
    "Why do leaves change color in the fall?", "Why does ice float on water?", "Why do we yawn?",
    "Why is the ocean salty?", "Why do cats purr?", "Why does bread go stale?", "Why do onions make you cry?",
    "Why do we dream?", "Why is Mars red?", "Why do airplanes leave white trails?", "Why do stars twinkle?",
    "Why does the Moon have phases?", "Why do we get goosebumps?", "Why are flamingos pink?",
    "Why does metal feel colder than wood?", "Why do we have leap years?", "Why do some people snore?",
    "Why does popcorn pop?", "Why do zebras have stripes?", "Why does a spoon look bent in a glass of water?",
    "How does a refrigerator keep food cold?", "How does GPS know where I am?", "How do vaccines train the body?",
    "How does a credit card payment go through?", "How do noise-cancelling headphones work?",
    "How does a bill become a law?", "How do plants know which way is up?", "How does a microwave heat food?",
    "How do bees make honey?", "How does a touchscreen detect a finger?", "How do airplanes stay in the air?",
    "How does the heart pump blood?", "How does Wi-Fi send data through the air?", "How do glaciers move?",
    "How are rainbows formed?", "How does a compass work?", "How do solar panels turn light into electricity?",
    "How does caffeine keep people awake?", "How does a search engine rank pages?", "How do fish breathe?",
    "What causes thunder?", "What makes a good night's sleep?", "What happens when we swallow?",
    "What is the tallest mountain in the solar system?", "What would happen if the Moon disappeared?",
    "What is inside a black hole?", "What makes some foods spicy?", "What is a light year?",
    "What causes the seasons?", "What keeps satellites in orbit?", "What does a central bank do?",
    "What makes a password strong?", "What is the origin of chess?", "What is the purpose of a fever?",
    "Is it better to stretch before or after running?", "Is coffee bad for you?", "Can animals recognize themselves?",
    "Do plants feel anything?", "Could humans live on the Moon?", "Are viruses alive?",
)
PAIRS = (
    ("weather", "climate"), ("viruses", "bacteria"), ("stocks", "bonds"), ("baking soda", "baking powder"),
    ("a crocodile", "an alligator"), ("renting", "buying a home"), ("TCP", "UDP"), ("RAM", "storage"),
    ("Python", "JavaScript"), ("a latte", "a cappuccino"), ("empathy", "sympathy"), ("a comet", "an asteroid"),
    ("speed", "velocity"), ("a simile", "a metaphor"), ("a virus", "a worm in computing"), ("mitosis", "meiosis"),
    ("a lake", "a pond"), ("an ape", "a monkey"), ("a democracy", "a republic"), ("affect", "effect"),
    ("butter", "margarine"), ("a hurricane", "a typhoon"), ("a violin", "a viola"), ("frogs", "toads"),
    ("introverts", "extroverts"), ("a credit card", "a debit card"), ("HTTP", "HTTPS"), ("SQL", "NoSQL databases"),
    ("machine learning", "traditional programming"), ("a novel", "a novella"), ("jogging", "running"),
    ("a resume", "a cover letter"), ("a psychologist", "a psychiatrist"), ("weathering", "erosion"),
    ("a list", "a set in Python"), ("git merge", "git rebase"), ("a compiler", "an interpreter"),
    ("classical music", "jazz"), ("a moth", "a butterfly"), ("an epidemic", "a pandemic"),
)
COMPARE = ("How do {x} and {y} differ?", "Compare {x} with {y}.", "Which should I choose, {x} or {y}, and why?",
           "What do {x} and {y} have in common, and where do they differ?", "Is {x} the same thing as {y}?",
           "Explain {x} versus {y} {f}.")
ACTIVITIES = (
    "renting my first apartment", "adopting a dog", "planting tomatoes", "running my first 5k", "learning the guitar",
    "starting a podcast", "buying a laptop for school", "moving to a new city", "hosting a dinner party",
    "traveling abroad for the first time", "preparing for a job interview", "starting a small business",
    "learning to swim as an adult", "saving for retirement", "painting a room", "writing a novel",
    "going camping in the rain", "taking better photos with my phone", "studying for a math exam",
    "asking for a raise", "making friends in a new town", "cooking rice without a rice cooker",
    "keeping houseplants alive", "reducing my screen time", "organizing a closet", "training a puppy",
    "learning to code", "giving a wedding toast", "negotiating the price of a car", "planning a road trip",
    "building a bird house", "brewing beer at home", "cleaning a cast iron pan", "fixing a flat tire",
    "writing a cover letter", "choosing a running shoe", "starting a compost pile", "baking my first cake",
)
ADVICE = ("How do I get started with {v}?", "Give me a checklist for {v}.", "What mistakes should I avoid when {v}?",
          "I need some advice about {v}. Where do I begin?", "What do I need for {v}? Keep it short.",
          "I'm nervous about {v}. Any advice?", "What is the best way to go about {v}?",
          "Make a plan for {v} {f}.")
FORMS = ("a short poem", "a limerick", "a two-sentence story", "a product description", "a thank-you note",
         "a motivational speech", "a riddle", "a diary entry", "a song chorus", "the opening of a fairy tale",
         "a news headline and its first paragraph", "a four-line rhyme", "a short bedtime story", "a toast",
         "an advertisement", "a letter from the future", "a movie plot summary", "a short scene with dialogue")
THEMES = ("a lighthouse keeper", "the first day of spring", "a lost umbrella", "a cat who wants to fly",
          "the ocean at night", "a robot learning to paint", "an old bookshop", "a snowy mountain village",
          "a dragon afraid of the dark", "a city bus at dawn", "a grandfather's pocket watch", "the last day of school",
          "a friendly ghost", "a garden after a storm", "a detective who loves cheese", "the smell of fresh coffee",
          "a train journey across a desert", "a message in a bottle", "a tiny island", "two rival bakers",
          "a kite that will not come down", "the hum of a refrigerator", "a fox in the city", "moving day")
CREATE = ("Write {m} about {t}.", "Compose {m} about {t}.", "Could you write {m} about {t}?",
          "Write {m} about {t}, {f}.")
RECIPIENTS = ("my landlord", "a teacher", "my team", "a customer", "my neighbor", "a hiring manager", "a friend",
              "my manager", "a local newspaper", "the city council", "a hotel", "an old classmate")
MATTERS = ("a broken heater", "missing a deadline", "a project update", "a refund request", "a noisy party",
           "following up after an interview", "a birthday surprise", "asking for a day off", "a late delivery",
           "a new recycling idea", "a room booking", "catching up after many years", "a change of address")
LETTERS = ("Write a short email to {r} about {x}.", "Draft a polite message to {r} about {x}.",
           "Help me write a note to {r} about {x}.", "Write a formal letter to {r} regarding {x}.")
LANGUAGES = ("Python", "JavaScript", "Java", "C", "Go", "Rust", "a Bash script", "SQL")
PROGRAMS = ("reverses the words in a sentence", "counts how many times each word appears in a file",
            "finds the largest number in an array", "checks whether a number is even", "prints a multiplication table",
            "converts minutes to hours and minutes", "removes empty lines from a text", "sums the numbers from 1 to n",
            "returns the unique values of a list", "finds all files larger than a given size",
            "checks whether a string contains only digits", "swaps two variables", "formats a date as YYYY-MM-DD",
            "computes the area of a circle", "finds the shortest string in a list", "reads a line of user input")
CODE = ("How would I write code in {l} that {p}?", "Show me {l} code that {p}.", "In {l}, write something that {p}.",
        "Write {l} code that {p}, with comments.")
CONCEPTS = ("a closure", "recursion", "a race condition", "Big-O notation", "a REST API", "garbage collection",
            "a linked list", "a hash function", "dependency injection", "unit testing", "a deadlock", "caching",
            "a binary tree", "version control", "an API key", "asynchronous code", "a memory leak", "polymorphism",
            "a regular expression", "an index in a database", "continuous integration", "a virtual machine",
            "immutability", "a callback", "a design pattern", "technical debt", "pagination", "a unit of work")
CONCEPT_TASKS = ("What is {c} in programming?", "Explain {c} {f}.", "When should I use {c}?",
                 "What are the pitfalls of {c}?", "Give a small example of {c}.")
WORD_PROBLEMS = (
    "A recipe needs {a} cups of flour for {b} people. How much flour do I need for {c} people?",
    "A train travels {a}0 km in {b} hours. What is its average speed?",
    "I save {a}0 dollars a week. How many weeks until I have {c}00 dollars?",
    "What is {a}{b} times {c}? Show your steps.", "What is {a}{c} percent of {b}00?",
    "A shirt costs {c}0 dollars and is on sale for {a}0% off. What is the sale price?",
    "If a rectangle is {a} meters by {c} meters, what are its area and perimeter?",
    "Split a bill of {a}{b} dollars among {c} friends with a {b}% tip. How much does each pay?",
)


def _draw(rng: random.Random) -> str:
    """One prompt from a family chosen by weight (explanations and questions most often, as in chat)."""
    family = rng.choices(("explain", "question", "compare", "advice", "create", "letter", "code", "concept",
                          "math"), weights=(20, 10, 10, 15, 12, 6, 10, 10, 5))[0]
    a, f = rng.choice(AUDIENCES), rng.choice(FORMATS)
    if family == "explain":
        return rng.choice(EXPLAIN).format(s=rng.choice(SUBJECTS), a=a, f=f)
    if family == "question":
        question = rng.choice(QUESTIONS)
        return question if rng.random() < 0.6 else f"{question} Answer {f}." if rng.random() < 0.5 else \
            f"{question} Explain it for {a}."
    if family == "compare":
        x, y = rng.choice(PAIRS)
        return rng.choice(COMPARE).format(x=x, y=y, f=f)
    if family == "advice":
        return rng.choice(ADVICE).format(v=rng.choice(ACTIVITIES), f=f)
    if family == "create":
        return rng.choice(CREATE).format(m=rng.choice(FORMS), t=rng.choice(THEMES), f=f)
    if family == "letter":
        return rng.choice(LETTERS).format(r=rng.choice(RECIPIENTS), x=rng.choice(MATTERS))
    if family == "code":
        return rng.choice(CODE).format(l=rng.choice(LANGUAGES), p=rng.choice(PROGRAMS))
    if family == "concept":
        return rng.choice(CONCEPT_TASKS).format(c=rng.choice(CONCEPTS), f=f)
    return rng.choice(WORD_PROBLEMS).format(a=rng.randint(2, 9), b=rng.randint(2, 9), c=rng.randint(2, 9))


def varied_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` distinct prompts drawn from the grammar with `seed` (fewer only if it runs out)."""
    rng, prompts = random.Random(seed), {}
    for _ in range(count * 20):
        prompts.setdefault(_draw(rng), None)
        if len(prompts) == count:
            break
    return list(prompts)
