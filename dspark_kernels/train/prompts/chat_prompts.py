"""Chat prompts: tasks on passages from ``pydoc_data.topics`` and module docstrings, and requests built from the
word lists here (concepts, activities, story subjects, email situations, comparison pairs)."""

from __future__ import annotations

import ast
import codecs
import random
from collections.abc import Iterable
from functools import lru_cache

from .code_prompts import CODE_MODULES
from .splits import SPLITS, heldout_sources, make_record, pick, seeded_rng
from .stdlib_sources import parse_module

MAX_PASSAGE_CHARS = 1200
MIN_PASSAGE_CHARS = 200

# Modules whose docstrings seed chat passages: the code modules plus prose-rich packages; ``this`` is the Zen.
CHAT_MODULES = tuple(sorted(set(CODE_MODULES) | {
    "asyncio", "concurrent.futures", "email", "email.message", "http", "http.client", "http.cookiejar",
    "http.server", "importlib", "json", "logging.handlers", "multiprocessing", "sqlite3", "this", "unittest",
    "xml.etree.ElementTree",
}))

_PASSAGE_PHRASINGS = {
    "summarize": (
        "Summarize the following text in two sentences:\n\n{text}",
        "Give a one-paragraph summary of this passage from the Python documentation:\n\n{text}",
        "Summarize this in three bullet points:\n\n{text}",
        "TL;DR this for me:\n\n{text}",
    ),
    "explain_passage": (
        "Explain the following to a beginner in simple words:\n\n{text}",
        "I don't understand this paragraph. Can you explain it with an example?\n\n{text}",
        "Explain what this passage means as if I were new to programming:\n\n{text}",
    ),
    "key_points": (
        "List the key points of this text:\n\n{text}",
        "What are the main ideas in the passage below?\n\n{text}",
        "Pull out the three most important facts from this text:\n\n{text}",
    ),
    "questions": (
        "Write three quiz questions, with answers, that test understanding of this text:\n\n{text}",
        "After reading the passage below, what questions might a student ask? List three and answer them.\n\n{text}",
    ),
    "title": (
        "Suggest a short, descriptive title for this passage:\n\n{text}",
        "Give this text a headline and a one-sentence subtitle:\n\n{text}",
    ),
    "rewrite": (
        "Rewrite the following text so it is easier to read, keeping all the facts:\n\n{text}",
        "Rewrite this passage as a friendly message to a colleague:\n\n{text}",
        "Turn this text into a short FAQ entry:\n\n{text}",
    ),
}
_ZEN_PHRASINGS = (
    "What does the line \"{line}\" from the Zen of Python mean? Give an example.",
    "Explain the principle \"{line}\" and how it applies to writing code.",
    "Do you agree with the saying \"{line}\"? Discuss briefly.",
)

CONCEPTS = (
    "photosynthesis", "inflation", "compound interest", "supply and demand", "the water cycle", "gravity",
    "black holes", "vaccines", "the immune system", "DNA", "evolution by natural selection", "plate tectonics",
    "climate change", "the greenhouse effect", "electricity", "magnetism", "the internet", "encryption",
    "public-key cryptography", "machine learning", "neural networks", "recursion", "binary numbers", "hash tables",
    "version control", "databases", "operating systems", "compilers", "cloud computing", "the stock market",
    "interest rates", "budgeting", "credit scores", "opportunity cost", "the scientific method", "statistics",
    "probability", "the Pythagorean theorem", "fractions", "negative numbers", "prime numbers", "infinity",
    "the speed of light", "relativity", "atoms", "chemical reactions", "acids and bases", "the periodic table",
    "the solar system", "the seasons", "tides", "weather forecasts", "earthquakes", "volcanoes", "rainbows",
    "sound waves", "musical scales", "perspective in drawing", "color theory", "the printing press",
    "the industrial revolution", "supply chains", "exchange rates", "insurance", "mortgages", "index funds",
    "renewable energy", "solar panels", "nuclear power", "batteries", "electric cars", "GPS", "how airplanes fly",
    "refrigerators", "microwave ovens", "antibiotics", "sleep cycles", "memory", "habits", "metabolism",
    "nutrition labels", "calories", "the heart", "the brain", "bacteria and viruses", "ecosystems", "food chains",
    "biodiversity", "recycling", "object-oriented programming", "functional programming", "APIs", "HTTP", "DNS",
    "unit testing", "regular expressions", "big-O notation", "sorting algorithms", "caching", "garbage collection",
    "multithreading", "floating-point numbers", "Unicode", "open-source licenses", "spreadsheets", "time zones",
    "leap years", "the phases of the moon", "eclipses", "elections", "taxes", "the placebo effect", "entropy",
)
_AUDIENCES = ("a beginner", "a ten-year-old", "a high-school student", "someone with no technical background",
              "a busy manager", "a curious grandparent")
_CONCEPT_PHRASINGS = (
    "Explain {topic} to {audience}.",
    "Can you explain {topic} in simple terms for {audience}?",
    "How would you describe {topic} to {audience}? Use an everyday analogy.",
    "In a short paragraph, explain {topic} so that {audience} could understand it.",
)

ACTIVITIES = (
    "learning a new language", "running a first marathon", "starting a vegetable garden", "baking bread at home",
    "saving money on groceries", "studying for exams", "speaking in public", "preparing for a job interview",
    "working from home", "keeping a journal", "learning to play the guitar", "cooking for a large group",
    "traveling on a budget", "packing for a long trip", "camping in the rain", "hiking in the mountains",
    "taking better photos with a phone", "writing a resume", "negotiating a salary", "managing stress",
    "sleeping better", "staying focused while studying", "organizing a small kitchen", "decluttering a closet",
    "training a puppy", "caring for houseplants", "keeping an indoor cat entertained", "learning to swim",
    "cycling in the city", "commuting by train", "reading more books", "writing a novel", "starting a podcast",
    "making friends in a new city", "hosting a dinner party", "planning a birthday party", "moving to a new apartment",
    "painting a room", "fixing a leaky faucet", "assembling flat-pack furniture", "learning to code",
    "debugging a program", "writing clean code", "reviewing someone else's code", "contributing to open source",
    "writing documentation", "giving feedback to a coworker", "running a team meeting", "managing a small project",
    "managing your time", "learning math as an adult", "helping a child with homework", "teaching a class",
    "preparing a presentation", "writing a cover letter", "applying to college", "saving for retirement",
    "paying off debt", "creating a monthly budget", "buying a used car", "driving in snow", "staying safe online",
    "choosing strong passwords", "backing up your files", "reducing screen time", "starting a morning routine",
    "drinking more water", "eating more vegetables", "meal prepping for the week", "cooking rice",
    "making a good cup of coffee", "brewing loose-leaf tea", "starting to meditate", "practicing yoga at home",
    "building a home workout routine", "stretching after exercise", "recovering after a long run", "birdwatching",
    "stargazing", "learning chess", "solving crossword puzzles", "knitting a first scarf", "drawing portraits",
    "painting with watercolors", "writing poetry", "memorizing a speech", "volunteering in your community",
    "reducing household waste", "saving energy at home", "composting kitchen scraps", "growing tomatoes",
    "keeping backyard chickens", "keeping bees", "fishing from a pier", "kayaking on a lake", "skiing",
    "learning to surf", "visiting a museum with kids", "traveling with a toddler", "flying long-haul",
    "dealing with jet lag", "baking cookies", "decorating a small apartment", "buying a first home",
    "renting out a spare room", "learning to type faster", "taking notes in lectures", "writing a thank-you note",
)
_TIPS_PHRASINGS = (
    "Give three tips for {topic}.",
    "What are five practical tips for {topic}?",
    "I'm new to {topic}. What advice would you give me?",
    "What are the most common mistakes people make when {topic}, and how can I avoid them?",
    "Give me a short checklist for {topic}.",
)

STORY_SUBJECTS = (
    "the ocean at night", "a lost umbrella", "the first snow of winter", "a lighthouse keeper", "an old bicycle",
    "a city waking up", "a robot learning to paint", "a cat who hates Mondays", "the smell of rain",
    "a forgotten library book", "a dragon afraid of the dark", "a train journey through the mountains",
    "autumn leaves", "a grandmother's kitchen", "a message in a bottle", "the last day of summer",
    "a garden after a storm", "a fox and a crow who become friends", "a clock that runs backwards",
    "a quiet morning coffee", "a star that wants to fall", "moving to a new town", "the moon over a small village",
    "a baker who starts work at four in the morning", "a mountain trail", "a lonely satellite",
    "an unexpected letter", "the sound of a violin", "a child's first day at school", "fireflies in June",
    "a busy market", "a paper boat in a puddle", "an astronaut looking at Earth", "a dog waiting at the door",
    "a winter cabin", "a kite on a windy day", "the desert at noon", "a bridge between two villages",
    "a very old tree", "a shy ghost", "a bookshop on a rainy afternoon", "a broken compass", "the first day of spring",
    "a fisherman at dawn", "an owl in the city", "a map with a missing island", "a snowman in April",
    "a river that changed course", "the night before a big exam", "learning to ride a bike", "a magic teapot",
    "a thunderstorm over the sea", "a quiet train station", "an old photograph", "a painter who cannot see colors",
    "a hot air balloon", "a deep forest", "a pirate who is afraid of water", "a detective cat",
    "a time traveler's lunch break", "a city made of glass", "a sea turtle's long journey",
    "a mailbox that only gets postcards", "a tiny house on a hill", "a music box", "a neighbor's secret garden",
    "the hum of a refrigerator at midnight", "the final mile of a marathon", "a candle in the window",
    "a dog who learns to whistle", "a sunflower field", "a volcano that fell asleep", "a lighthouse in the fog",
    "two strangers sharing an umbrella", "a spaceship's kitchen", "a rainy bus ride", "a lost mitten",
    "a library at midnight", "a garden gnome on vacation", "the first robot on Mars",
)
_STORY_PHRASINGS = {
    "write_poem": (
        "Write a short poem about {topic}.",
        "Write a haiku about {topic}.",
        "Write a four-line rhyming poem about {topic}.",
        "Write a limerick about {topic}.",
    ),
    "write_story": (
        "Write a short story about {topic}.",
        "Write a 100-word story about {topic}.",
        "Tell me a bedtime story about {topic}.",
        "Write the opening paragraph of a story about {topic}.",
    ),
}

EMAIL_SITUATIONS = (
    "asking your manager for a day off next Friday", "thanking a colleague for helping with a project",
    "following up after a job interview", "rescheduling a meeting", "apologizing for missing a deadline",
    "inviting the team to a farewell lunch", "requesting a refund for a damaged order",
    "introducing yourself to a new team", "asking a professor for an extension", "declining a job offer politely",
    "reminding a client about an unpaid invoice", "welcoming a new employee",
    "asking a neighbor to keep the noise down at night", "asking about an apartment for rent",
    "complaining about a delayed flight", "requesting a letter of recommendation",
    "announcing a change in office hours", "proposing a new project idea", "asking for feedback on a draft",
    "congratulating a friend on a new job", "canceling a gym membership", "booking a table for a group dinner",
    "asking a landlord to fix the heating", "sharing meeting notes with the team",
    "asking to work from home two days a week", "thanking a teacher at the end of the school year",
    "asking a supplier for a price quote", "reporting a bug to a software company",
    "inviting a guest speaker to a school event", "confirming the details of a delivery",
    "asking to join a community garden", "telling a client that a project will be late", "asking for a raise",
    "resigning from a job", "planning a surprise party with friends", "organizing a carpool to work",
    "requesting a meeting with a child's teacher", "replying to a customer complaint",
    "welcoming new members to a book club", "asking to borrow a friend's camping gear",
    "asking a coworker to cover your shift", "inviting neighbors to a street cleanup",
    "requesting a quiet desk in the office", "thanking volunteers after a charity event",
    "asking a doctor's office to move an appointment", "following up on an unanswered message",
    "introducing two colleagues who should meet", "asking for directions to an office building",
)
_EMAIL_PHRASINGS = (
    "Write a short email {topic}.",
    "Draft a polite email {topic}.",
    "Write a friendly but professional email {topic}. Keep it under 150 words.",
    "Help me write an email {topic}.",
)

COMPARISONS = (
    ("a list", "a tuple"), ("weather", "climate"), ("a virus", "a bacterium"), ("speed", "velocity"),
    ("mass", "weight"), ("an alligator", "a crocodile"), ("stocks", "bonds"), ("renting a home", "buying a home"),
    ("a debit card", "a credit card"), ("RAM", "disk storage"), ("HTTP", "HTTPS"), ("a compiler", "an interpreter"),
    ("TCP", "UDP"), ("empathy", "sympathy"), ("a simile", "a metaphor"), ("baking soda", "baking powder"),
    ("a hurricane", "a tornado"), ("a comet", "an asteroid"), ("a lake", "a pond"), ("a fruit", "a vegetable"),
    ("a democracy", "a republic"), ("an epidemic", "a pandemic"), ("a latte", "a cappuccino"),
    ("a recession", "a depression"), ("a crocodile", "a lizard"), ("SQL", "NoSQL databases"),
    ("a process", "a thread"), ("a library", "a framework"), ("Git", "GitHub"), ("a router", "a modem"),
    ("AC", "DC electricity"), ("a nurse", "a doctor"), ("a will", "a trust"), ("jam", "jelly"),
    ("a violin", "a viola"), ("a sonnet", "a haiku"), ("an ocean", "a sea"), ("a moth", "a butterfly"),
    ("a rabbit", "a hare"), ("a cold", "the flu"), ("a hypothesis", "a theory"), ("affect", "effect"),
    ("an LED bulb", "an incandescent bulb"), ("walking", "running for exercise"), ("yoga", "pilates"),
    ("a podcast", "a radio show"), ("an e-book", "a printed book"), ("a laptop", "a desktop computer"),
    ("a savings account", "a checking account"), ("a freelancer", "an employee"), ("a sprint", "a marathon"),
    ("a frog", "a toad"), ("a star", "a planet"), ("lightning", "thunder"), ("a loan", "a grant"),
    ("a résumé", "a CV"), ("a pie", "a tart"), ("a tablespoon", "a teaspoon"), ("Python", "JavaScript"),
    ("a function", "a method"),
)
_COMPARE_PHRASINGS = (
    "What is the difference between {a} and {b}?",
    "Explain how {a} and {b} are alike and how they differ.",
    "Compare {a} and {b} in a short table.",
)


def _paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs without underline rules (``****``, ``====``) or grammar blocks."""
    out = []
    for block in text.split("\n\n"):
        lines = [line.rstrip() for line in block.splitlines()
                 if line.strip() and set(line.strip()) - set("*=-~^#")]
        block = "\n".join(lines).strip("\n")
        if block.strip() and "::=" not in block:
            out.append(block)
    return out


def _cut(paragraph: str, limit: int) -> str:
    if len(paragraph) <= limit:
        return paragraph
    head = paragraph[:limit]
    end = head.rfind(". ")
    return head[:end + 1] if end > limit // 3 else head.rsplit(None, 1)[0]


def _passages(text: str) -> list[str]:
    """Consecutive paragraphs joined into passages of at most ``MAX_PASSAGE_CHARS`` (at least ``MIN_PASSAGE_CHARS``)
    characters; a paragraph longer than the limit is cut at a sentence end."""
    out, current = [], ""
    for paragraph in _paragraphs(text):
        paragraph = _cut(paragraph, MAX_PASSAGE_CHARS)
        if current and len(current) + 2 + len(paragraph) > MAX_PASSAGE_CHARS:
            out.append(current)
            current = ""
        current = f"{current}\n\n{paragraph}" if current else paragraph
    if current:
        out.append(current)
    return [p for p in out if len(p) >= MIN_PASSAGE_CHARS]


@lru_cache(maxsize=None)
def _zen() -> tuple[str, ...]:
    """Lines of the Zen of Python, decoded from ``this.py``'s source (which is never imported)."""
    parsed = parse_module("this")
    if parsed is None:
        return ()
    for node in parsed[1].body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            if any(isinstance(t, ast.Name) and t.id == "s" for t in node.targets):
                return tuple(line for line in codecs.decode(node.value.value, "rot13").splitlines() if line.strip())
    return ()


@lru_cache(maxsize=None)
def _module_passages(module: str) -> tuple[str, ...]:
    """Passages from a module's docstring and its long (>= 300 character) class and function docstrings."""
    if module == "this":
        zen = _zen()
        return ("\n".join(zen),) if zen else ()
    parsed = parse_module(module)
    if parsed is None:
        return ()
    tree = parsed[1]
    docs = [ast.get_docstring(tree) or ""]
    docs += [ast.get_docstring(node) or "" for node in ast.walk(tree)
             if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    out: list[str] = []
    for i, doc in enumerate(docs):
        if i == 0 or len(doc) >= 300:
            out.extend(_passages(doc))
    return tuple(out)


@lru_cache(maxsize=None)
def _pydoc_topics() -> tuple[tuple[str, tuple[str, ...]], ...]:
    from pydoc_data.topics import topics

    return tuple((name, tuple(_passages(topics[name]))) for name in sorted(topics))


def _passage_records(source: str, passages: Iterable[str], rng: random.Random) -> list[dict]:
    out = []
    for passage in passages:
        for kind in sorted(_PASSAGE_PHRASINGS):
            out.append(make_record(kind, source, pick(rng, _PASSAGE_PHRASINGS[kind], text=passage)))
    return out


def _chat_candidates(selected: dict[str, frozenset[str]], rng: random.Random) -> list[dict]:
    """Candidates whose sources are in ``selected[family]`` for each family."""
    out = []
    for topic, passages in _pydoc_topics():
        if topic in selected["pydoc"]:
            out.extend(_passage_records(f"pydoc:{topic}", passages, rng))
    for module in CHAT_MODULES:
        if module in selected["module"]:
            out.extend(_passage_records(f"module:{module}", _module_passages(module), rng))
            if module == "this":
                out.extend(make_record("explain_quote", "module:this", phrasing.format(line=line))
                           for line in _zen()[1:] for phrasing in _ZEN_PHRASINGS)
    for topic in CONCEPTS:
        if topic in selected["concept"]:
            for audience in rng.sample(_AUDIENCES, 3):
                out.append(make_record("explain_concept", f"concept:{topic}",
                                   pick(rng, _CONCEPT_PHRASINGS, topic=topic, audience=audience)))
    for topic in ACTIVITIES:
        if topic in selected["activity"]:
            out.extend(make_record("tips", f"activity:{topic}", p.format(topic=topic))
                       for p in rng.sample(_TIPS_PHRASINGS, 3))
    for topic in STORY_SUBJECTS:
        if topic in selected["story"]:
            for kind in sorted(_STORY_PHRASINGS):
                out.extend(make_record(kind, f"story:{topic}", p.format(topic=topic))
                           for p in rng.sample(_STORY_PHRASINGS[kind], 2))
    for topic in EMAIL_SITUATIONS:
        if topic in selected["email"]:
            out.extend(make_record("write_email", f"email:{topic}", p.format(topic=topic))
                       for p in rng.sample(_EMAIL_PHRASINGS, 3))
    for a, b in COMPARISONS:
        if f"{a} | {b}" in selected["compare"]:
            out.extend(make_record("compare", f"compare:{a} | {b}", p.format(a=a, b=b)) for p in _COMPARE_PHRASINGS)
    return out


def _chat_families() -> dict[str, tuple[str, ...]]:
    return {"pydoc": tuple(name for name, _ in _pydoc_topics()), "module": CHAT_MODULES, "concept": CONCEPTS,
            "activity": ACTIVITIES, "story": STORY_SUBJECTS, "email": EMAIL_SITUATIONS,
            "compare": tuple(f"{a} | {b}" for a, b in COMPARISONS)}


def chat_splits(seed: int) -> dict[str, list[dict]]:
    families = _chat_families()
    held = {family: heldout_sources(names, f"chat-{family}") for family, names in families.items()}
    selected = {"heldout": held,
                "train": {family: frozenset(names) - held[family] for family, names in families.items()}}
    return {split: _chat_candidates(selected[split], seeded_rng(seed, "chat", split)) for split in SPLITS}
