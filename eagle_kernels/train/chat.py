"""Chat instructions for self-distillation and evaluation.

The target is an instruct model and its users chat, so a draft head should see the target's own
answers to instructions. Training instructions are generated: templates x topics, the topics drawn
from the offline corpora (standard-library modules, the descriptions of the installed Debian
packages) and a list of everyday subjects. The held-out instructions (``HELD_OUT``) are a fixed
list written apart from the templates; they never enter a training cache.

Every instruction becomes a prompt through the tokenizer's chat template (SmolLM2's adds its
default system message), with the assistant turn opened: the target then answers it.
"""

from __future__ import annotations

import os
import random
import sysconfig

DPKG_STATUS = "/var/lib/dpkg/status"

# {t}: a topic. Code templates take programming topics, the others any topic.
CODE_TEMPLATES = (
    "Explain what the Python module `{t}` is used for, with a short example.",
    "Write a Python function that uses `{t}` and explain how it works.",
    "What are common mistakes when using Python's `{t}` module?",
    "Show me how to write a unit test for code that uses `{t}`.",
    "Give me a step-by-step tutorial on `{t}` in Python.",
    "Compare `{t}` with an alternative approach in Python.",
    "Write a small command-line tool in Python that relies on `{t}`.",
    "Document the main functions of the `{t}` module in a table.",
)
GENERAL_TEMPLATES = (
    "Explain {t} to a beginner.",
    "Write a short essay about {t}.",
    "Give me five interesting facts about {t}.",
    "What are the advantages and disadvantages of {t}?",
    "Write a short story that involves {t}.",
    "Summarize the history of {t} in a few paragraphs.",
    "How would you teach {t} to a ten-year-old?",
    "Write a blog post introduction about {t}.",
    "List the key ideas someone should know about {t}.",
    "Write a poem about {t}.",
    "Answer as an expert: what is the most misunderstood thing about {t}?",
    "Draft an email to a colleague asking for help with {t}.",
    "Create a study plan for learning about {t} in two weeks.",
    "Write a dialogue between two friends discussing {t}.",
    "Describe {t} in three sentences.",
    "What questions should I ask before getting started with {t}?",
)
GENERAL_TOPICS = (
    "photosynthesis", "the French Revolution", "black holes", "climate change", "the water cycle",
    "machine learning", "compound interest", "the immune system", "volcanoes", "the Roman Empire",
    "renewable energy", "sleep hygiene", "the stock market", "bread baking", "marathon training",
    "time management", "public speaking", "gardening in small spaces", "the history of the internet",
    "plate tectonics", "vaccines", "classical music", "chess openings", "the human brain",
    "saving for retirement", "learning a second language", "the printing press", "coral reefs",
    "electric cars", "the Industrial Revolution", "meditation", "ancient Egypt", "quantum computing",
    "job interviews", "healthy breakfasts", "the solar system", "democracy", "recycling", "honeybees",
    "the Silk Road", "databases", "open-source software", "encryption", "operating systems",
    "version control with git", "writing clean code", "cloud computing", "remote work",
    "friendship", "moving to a new city", "rainforests", "the theory of evolution", "earthquakes",
    "photography for beginners", "budget travel", "dinosaurs", "the Olympic Games", "coffee",
    "the novels of Jane Austen", "the Book of Genesis", "the Psalms", "Shakespeare's sonnets",
)


def _module_topics() -> list[str]:
    """Standard-library module names (dotted), as the ``code`` corpus holds them."""
    root = sysconfig.get_paths()["stdlib"]
    names = []
    for entry in sorted(os.listdir(root)):
        if entry.endswith(".py") and not entry.startswith("_"):
            names.append(entry[:-3])
        elif os.path.isfile(os.path.join(root, entry, "__init__.py")) and entry not in ("test", "idlelib"):
            names.append(entry)
    return names


def _package_topics(path: str = DPKG_STATUS) -> list[str]:
    """Short descriptions of the installed Debian packages, lowercased ("a tool to ...")."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    topics = set()
    for line in lines:
        if line.startswith("Description: "):
            text = line[len("Description: "):].strip().rstrip(".")
            if 12 <= len(text) <= 70 and "transitional" not in text and "(" not in text:
                topics.add(text[0].lower() + text[1:])
    return sorted(topics)


def training_instructions(count: int | None = None, seed: int = 0) -> list[str]:
    """Generated instructions (templates x topics), the first ``count``: three pools (code
    templates x standard-library modules, everyday subjects, Debian package descriptions), each
    shuffled with ``seed``, taking turns."""
    pools = [[t.format(t=m) for m in _module_topics() for t in CODE_TEMPLATES],
             [t.format(t=topic) for topic in GENERAL_TOPICS for t in GENERAL_TEMPLATES],
             [t.format(t=topic) for topic in _package_topics() for t in GENERAL_TEMPLATES]]
    rng = random.Random(seed)
    for pool in pools:
        rng.shuffle(pool)
    instructions = [pool[i] for i in range(max(map(len, pools))) for pool in pools if i < len(pool)]
    held = set(HELD_OUT)
    instructions = [i for i in dict.fromkeys(instructions) if i not in held]
    return instructions if count is None else instructions[:count]


def prompt_ids(tokenizer, instruction: str) -> list[int]:
    """``instruction`` as a user turn in the tokenizer's chat template, the assistant turn opened."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": instruction}], add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


# Held-out chat prompts: written apart from the templates above (no template produces them), on
# subjects and in forms (requests, rewrites, puzzles, advice) the training instructions do not use.
HELD_OUT = (
    "My tomato plants have yellow leaves at the bottom. What could be wrong and how do I fix it?",
    "Rewrite this sentence so it sounds more polite: 'Send me the report now.'",
    "I have 3 apples and buy twice as many as I have, then eat 2. How many apples do I have? Show your reasoning.",
    "Write a Python script that reads a CSV file and prints the average of the second column.",
    "Can you suggest a name for a small bakery that specialises in sourdough?",
    "Translate 'Where is the train station?' into Spanish, French and German.",
    "What is the difference between a list and a tuple in Python, and when should I use each?",
    "Plan a three-day itinerary for a first visit to Rome.",
    "My code raises 'KeyError: user_id' when I read a dictionary. How do I handle missing keys safely?",
    "Write a limerick about a cat who learns to program.",
    "Give me a recipe for a vegetarian lasagna, with quantities for four people.",
    "How do I politely decline an invitation to a wedding?",
    "Explain recursion using an example that computes the factorial of a number in JavaScript.",
    "What should I pack for a week-long hiking trip in the mountains?",
    "Write a SQL query that finds the ten customers with the highest total order value.",
    "Summarise the main arguments for and against a four-day working week.",
    "Help me write a cover letter for a junior data analyst position.",
    "Why is the sky blue? Keep the answer short.",
    "Write a bash one-liner that counts the lines of every .py file in a folder, sorted by size.",
    "I feel nervous before exams. Do you have any advice?",
    "Design a simple class hierarchy for a library system with books, members and loans.",
    "What are the rules of tic-tac-toe, and is there a strategy that never loses?",
    "Convert 72 degrees Fahrenheit to Celsius and explain the formula.",
    "Write a product description for noise-cancelling headphones.",
    "How does a hash table work, and what happens when two keys collide?",
    "Suggest five board games for a family evening with young children.",
    "Write a regular expression that matches e-mail addresses and explain each part.",
    "What is the capital of Australia, and why was it chosen?",
    "Tell me a bedtime story about a brave little turtle.",
    "How can I make my Python program run faster when it processes a large list?",
    "Draft a short speech for a friend's 30th birthday.",
    "Explain the difference between weather and climate.",
)
