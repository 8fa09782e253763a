"""Write resources/prompts/train-synthetic.jsonl: varied training prompts for drafter heads.

The Self-Instruct files hold 427 prompts; a head trained on their answers alone overfits them. This
script composes more prompts, of the kinds a chat model gets (writing, role play, reasoning, maths,
code, extraction, summaries, explanations, translation, questions over a passage), from templates and
topic lists written here, random numbers, and passages of the Python standard library's own module
documentation. Nothing here comes from the benchmark prompts. Seeded, so a rerun on the same Python
version writes the same file.

    python packaging/make_training_prompts.py [--out PATH] [--seed N] [--exclude JSONL ...]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
from pathlib import Path

TOPICS = [
    "solar power", "the history of the printing press", "urban gardening", "remote work", "coral reefs",
    "the French Revolution", "machine translation", "public libraries", "electric cars", "sleep hygiene",
    "volcanoes", "the stock market", "jazz music", "bicycle commuting", "vaccines", "the Roman Empire",
    "recycling plastics", "black holes", "social media and teenagers", "minimalism", "honey bees",
    "the water cycle", "learning a second language", "chess", "antibiotic resistance", "the Silk Road",
    "3D printing", "meditation", "desert ecosystems", "the invention of the telephone", "inflation",
    "video game design", "coffee farming", "the Renaissance", "earthquakes", "open-source software",
    "marathon training", "renewable energy subsidies", "ancient Egyptian pyramids", "photosynthesis",
    "online privacy", "volunteering", "the Moon landing", "baking bread", "climate migration",
    "artificial intelligence in medicine", "the Olympic Games", "fast fashion", "wind turbines",
    "impressionist painting", "supply chains", "the human immune system", "space tourism", "tea culture",
    "public transport", "nuclear fusion", "the Great Wall of China", "budgeting for students",
    "rainforests", "Shakespeare's plays", "cybersecurity", "quantum computers", "plate tectonics",
    "the industrial revolution", "team sports", "the gig economy", "ocean plastic", "democracy in Athens",
    "smartphones", "vegetarian cooking", "the theory of evolution", "migratory birds", "wildfires",
    "the periodic table", "job interviews", "mountain climbing", "the blockchain", "music streaming",
    "the Cold War", "DNA sequencing", "home insulation", "board games", "the history of cinema",
]

WRITING = [
    "Write a short blog post about {t}.", "Write a persuasive paragraph arguing for more investment in {t}.",
    "Write a four-line poem about {t}.", "Write a short story in which {t} plays a central role.",
    "Draft an email to a colleague suggesting a workshop on {t}.", "Write a product description for a book about {t}.",
    "Write a catchy headline and a two-sentence summary for a news article on {t}.",
    "Compose a limerick about {t}.", "Write an opening paragraph for an essay on {t}.",
    "Write a tweet announcing a public talk on {t}.", "Write a short speech for a school assembly about {t}.",
    "Write a diary entry from someone who has just learned about {t}.",
]

EXPLAIN = [
    "Explain {t} to a ten-year-old.", "What are the main advantages and disadvantages of {t}?",
    "Give three interesting facts about {t}.", "Why does {t} matter today?", "Describe the history of {t} briefly.",
    "What are common misconceptions about {t}?", "How would you introduce {t} to a beginner?",
    "List five key terms related to {t} and define each one.", "What questions do experts still debate about {t}?",
    "Compare {t} with {u}.", "How has {t} changed over the last fifty years?", "What careers are connected to {t}?",
]

ROLES = [
    "a ship's captain", "a medieval blacksmith", "a museum tour guide", "a personal trainer", "a detective",
    "a nervous first-time pilot", "a friendly librarian", "a space station engineer", "a chef in a busy kitchen",
    "a travel agent", "a high-school chemistry teacher", "a park ranger", "a startup founder", "a wise old wizard",
    "a customer support agent", "a sports commentator", "a farmer during harvest", "a time traveller from 1900",
]

ROLEPLAY = [
    "Pretend you are {r}. Describe a typical day in your life.", "Act as {r} and give advice to a newcomer.",
    "You are {r}. A visitor asks you about {t}. What do you say?", "Imagine you are {r} writing a letter home.",
    "Role-play as {r} and explain what worries you most this week.",
    "As {r}, introduce yourself to a group of students.",
]

CODING = [
    "reverses the words in a sentence", "checks whether a string is a palindrome", "returns the n-th Fibonacci number",
    "merges two sorted lists", "counts how often each word appears in a text", "removes duplicates from a list while keeping order",
    "finds the largest prime factor of a number", "converts Celsius to Fahrenheit", "flattens a nested list",
    "checks whether two strings are anagrams", "computes the average of a list of numbers, ignoring None values",
    "returns the second largest number in a list", "validates an email address with a regular expression",
    "reads a CSV file and sums one column", "implements binary search", "rotates a matrix by 90 degrees",
    "computes the greatest common divisor of two numbers", "groups a list of words by their first letter",
    "parses a date string like 2024-03-15 into a date object", "implements a simple stack class",
    "finds the longest common prefix of a list of strings", "counts the vowels in a string",
    "returns all permutations of a short string", "checks whether parentheses in a string are balanced",
    "converts a Roman numeral to an integer", "implements bubble sort", "computes the factorial of n recursively",
    "returns the intersection of two lists", "capitalises the first letter of each word", "transposes a matrix",
]

LANGUAGES = ["Python", "JavaScript", "Java", "C++", "Go", "Rust"]

CODE_TASKS = [
    "Write a {lang} function that {c}.", "In {lang}, how would you write code that {c}? Explain briefly.",
    "Write a {lang} function that {c}, and add a short test.",
]

SENTENCES = [
    "The train leaves at seven in the morning.", "I would like a cup of coffee, please.",
    "Our meeting has been moved to Thursday.", "The museum is closed on Mondays.",
    "Could you tell me where the nearest pharmacy is?", "She has been learning the piano for three years.",
    "The weather will be sunny tomorrow.", "Please remember to lock the door when you leave.",
    "We are planning a trip to the mountains next summer.", "This book changed the way I think about history.",
    "The children played in the park until sunset.", "He forgot his umbrella at the office.",
]

TARGET_LANGUAGES = ["French", "German", "Spanish", "Italian", "Portuguese"]

PASSAGE_TASKS = [
    "Summarise the following text in two sentences.\n\n{p}", "Summarise the key points of this passage as a bulleted list.\n\n{p}",
    "Extract every technical term from the text below and list them.\n\n{p}",
    "Read the passage and answer: what is its main purpose?\n\n{p}",
    "Write three questions a student could answer from this passage.\n\n{p}",
    "Rewrite this text in plain language for a non-programmer.\n\n{p}",
    "Using only the passage below, explain what problem it solves.\n\n{p}",
    "Give this documentation a short title and a one-line summary.\n\n{p}",
]

QUESTIONS = [
    "What is the capital of {c} and what is it known for?", "What language is mainly spoken in {c}?",
    "Name two famous dishes from {c}.", "What is the climate like in {c}?", "Suggest a three-day itinerary for {c}.",
]

COUNTRIES = ["Japan", "Brazil", "Kenya", "Canada", "Norway", "India", "Mexico", "Egypt", "Australia", "Peru",
             "Vietnam", "Morocco", "Greece", "Argentina", "Ireland", "Thailand"]

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jules", "Kofi", "Lena"]
ITEMS = [("apples", 2), ("notebooks", 3), ("tickets", 12), ("pens", 1), ("sandwiches", 5), ("plants", 8)]

STDLIB = [
    "json", "csv", "collections", "itertools", "functools", "pathlib", "datetime", "random", "statistics", "string",
    "textwrap", "heapq", "bisect", "argparse", "logging", "sqlite3", "zipfile", "tarfile", "gzip", "hashlib", "hmac",
    "secrets", "uuid", "urllib.parse", "http.client", "email", "smtplib", "socket", "selectors", "asyncio", "threading",
    "multiprocessing", "subprocess", "shutil", "tempfile", "glob", "fnmatch", "difflib", "unittest", "doctest",
    "pickle", "copy", "pprint", "enum", "dataclasses", "typing", "contextlib", "abc", "decimal", "fractions", "math",
    "cmath", "array", "struct", "codecs", "locale", "gettext", "calendar", "zoneinfo", "sched", "queue", "weakref",
    "inspect", "ast", "dis", "tokenize", "timeit", "trace", "traceback", "warnings", "configparser", "tomllib",
    "base64", "binascii", "html", "html.parser", "xml.etree.ElementTree", "wave", "colorsys", "turtle", "shelve",
    "dbm", "mailbox", "mimetypes", "ipaddress", "getpass", "platform", "signal", "mmap", "filecmp", "graphlib",
]


def passages(rng: random.Random) -> list[str]:
    """Paragraphs of 200-900 characters from standard-library module and class documentation."""
    found = []
    for name in STDLIB:
        try:
            module = importlib.import_module(name)
        except Exception:
            continue
        docs = [inspect.getdoc(module) or ""]
        docs += [inspect.getdoc(obj) or "" for _, obj in inspect.getmembers(module, inspect.isclass)
                 if getattr(obj, "__module__", "") == module.__name__][:6]
        for doc in docs:
            for paragraph in doc.split("\n\n"):
                text = " ".join(paragraph.split())
                if 200 <= len(text) <= 900 and not text.startswith((">>>", "..")):
                    found.append(text)
    rng.shuffle(found)
    return found


def maths(rng: random.Random) -> str:
    kind = rng.randrange(5)
    a, b, c = rng.randint(2, 40), rng.randint(2, 30), rng.randint(2, 9)
    name, other = rng.sample(NAMES, 2)
    item, price = rng.choice(ITEMS)
    if kind == 0:
        return f"{name} buys {a} {item} at ${price} each and pays with a ${(a * price // 50 + 1) * 50} note. How much change does {name} get?"
    if kind == 1:
        return f"A train travels {a * 10} km in {c} hours. What is its average speed, and how far does it go in {b} hours at that speed?"
    if kind == 2:
        return f"{name} has {a} marbles and {other} has {b} more than twice as many. How many marbles do they have together?"
    if kind == 3:
        return f"Solve for x: {c}x + {a} = {b + a * c}. Show your steps."
    return f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter? If both sides grow by {c} cm, by how much does the area grow?"


def reasoning(rng: random.Random) -> str:
    kind = rng.randrange(4)
    x, y, z = rng.sample(NAMES, 3)
    if kind == 0:
        return f"{x} is taller than {y}, and {y} is taller than {z}. Who is the shortest? Explain your reasoning."
    if kind == 1:
        n = rng.randint(3, 9)
        return f"If it takes {n} machines {n} minutes to make {n} widgets, how long would it take {n * 10} machines to make {n * 10} widgets?"
    if kind == 2:
        a = rng.randint(2, 6)
        return f"A sequence starts {a}, {a * 2}, {a * 4}, {a * 8}. What are the next two numbers, and what is the rule?"
    return f"{x}, {y} and {z} each own a different pet: a cat, a dog and a parrot. {x} is allergic to fur, and {y} does not own the dog. Who owns which pet?"


def build(seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows: list[tuple[str, str]] = []
    for template in WRITING:
        rows += [("writing", template.format(t=t)) for t in rng.sample(TOPICS, 10)]
    for template in EXPLAIN:
        rows += [("explanation", template.format(t=t, u=rng.choice(TOPICS))) for t in rng.sample(TOPICS, 10)]
    for template in ROLEPLAY:
        rows += [("roleplay", template.format(r=r, t=rng.choice(TOPICS))) for r in rng.sample(ROLES, 10)]
    for task in CODING:
        rows += [("coding", rng.choice(CODE_TASKS).format(lang=lang, c=task)) for lang in rng.sample(LANGUAGES, 2)]
    for sentence in SENTENCES:
        rows += [("translation", f"Translate into {lang}: {sentence}") for lang in rng.sample(TARGET_LANGUAGES, 3)]
    for template in QUESTIONS:
        rows += [("question", template.format(c=c)) for c in rng.sample(COUNTRIES, 8)]
    rows += [("maths", maths(rng)) for _ in range(80)]
    rows += [("reasoning", reasoning(rng)) for _ in range(40)]
    for i, passage in enumerate(passages(rng)[:120]):
        rows.append(("passage", PASSAGE_TASKS[i % len(PASSAGE_TASKS)].format(p=passage)))
    unique = list(dict.fromkeys(rows))
    rng.shuffle(unique)
    return [{"id": f"synthetic_{i}", "category": category, "instruction": text} for i, (category, text) in enumerate(unique)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "resources/prompts/train-synthetic.jsonl"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exclude", action="append", default=[], metavar="JSONL",
                        help="leave out prompts already in this file (repeatable): new seeds add only new prompts")
    args = parser.parse_args()
    seen = {json.loads(line)["instruction"] for path in args.exclude
            for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()}
    rows = [row for row in build(args.seed) if row["instruction"] not in seen]
    Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["category"]] = counts.get(row["category"], 0) + 1
    print(f"{len(rows)} prompts -> {args.out}: {counts}")


if __name__ == "__main__":
    main()
