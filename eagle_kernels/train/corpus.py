"""Offline training text: CPython standard-library sources (code) and, for prose, Jane Austen's
novels (Debian ``r-cran-janeaustenr``), the King James Bible (Debian ``bible-kjv``) and the
Python documentation's reST sources (Debian ``python3.11-doc``).

Every document is a file (or a book); the train / held-out split is decided by the document's
name alone, so it never changes with the token budget or the machine.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sysconfig
import zlib
from dataclasses import dataclass

CODE, PROSE = "code", "prose"
HELD_OUT_EVERY = 10  # one document in ten (by name hash) is held out
DOCS_SOURCES = "/usr/share/doc/python3.11/html/_sources"
AUSTEN_HELD_OUT = "Persuasion"


@dataclass(frozen=True)
class Document:
    name: str  # stable identifier, e.g. "code:json/decoder.py"
    domain: str  # CODE or PROSE
    text: str

    @property
    def held_out(self) -> bool:
        if self.name == f"austen:{AUSTEN_HELD_OUT}":
            return True
        if self.name.startswith("austen:"):
            return False
        return zlib.crc32(self.name.encode()) % HELD_OUT_EVERY == 0


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (UnicodeDecodeError, OSError):
        return None


def stdlib_documents() -> list[Document]:
    """Python sources of the running interpreter's standard library (tests and vendored
    packages excluded: they are repetitive and unlike user code)."""
    root = sysconfig.get_paths()["stdlib"]
    skip = ("test", "tests", "idlelib", "site-packages", "lib2to3", "ensurepip", "turtledemo")
    docs = []
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, root)
        if any(part in skip for part in rel.split(os.sep)):
            continue
        text = _read(path)
        if text and len(text) > 500:
            docs.append(Document(f"code:{rel}", CODE, text))
    return docs


def python_docs_documents(folder: str = DOCS_SOURCES) -> list[Document]:
    docs = []
    for path in sorted(glob.glob(os.path.join(folder, "**", "*.rst.txt"), recursive=True)):
        text = _read(path)
        if text and len(text) > 500:
            docs.append(Document(f"pydoc:{os.path.relpath(path, folder)}", PROSE, text))
    return docs


def austen_documents() -> list[Document]:
    """The six novels, through R's janeaustenr data (one document per book)."""
    if shutil.which("Rscript") is None:
        return []
    script = ('suppressMessages(library(janeaustenr)); b <- austen_books(); '
              'for (t in unique(b$book)) { cat("\\x01", t, "\\n", sep=""); writeLines(b$text[b$book == t]) }')
    try:
        out = subprocess.run(["Rscript", "-e", script], capture_output=True, text=True, timeout=120, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    docs = []
    for block in out.split("\x01")[1:]:
        title, _, text = block.partition("\n")
        docs.append(Document(f"austen:{title.strip()}", PROSE, text))
    return docs


def kjv_documents() -> list[Document]:
    """The King James Bible through the ``bible`` program, one document per book."""
    if shutil.which("bible") is None:
        return []
    try:
        out = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], capture_output=True, text=True, timeout=120,
                             check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    books: dict[str, list[str]] = {}
    for line in out.splitlines():
        ref, _, verse = line.partition(" ")
        book = ref.rstrip("0123456789:")
        if verse:
            books.setdefault(book, []).append(verse)
    return [Document(f"kjv:{book}", PROSE, "\n".join(verses)) for book, verses in books.items()]


def documents(domains=(CODE, PROSE)) -> list[Document]:
    docs = []
    if CODE in domains:
        docs += stdlib_documents()
    if PROSE in domains:
        docs += austen_documents() + kjv_documents() + python_docs_documents()
    return docs


def split(docs: list[Document], held_out: bool) -> list[Document]:
    return [d for d in docs if d.held_out == held_out]


def held_out_prompts(tokenizer, domain: str, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens from held-out documents of ``domain`` (never in
    any training cache): for prose the sources take turns (Austen, KJV, Python docs). Each
    prompt is the window starting a third of the way into its document."""
    docs = sorted(split(documents((domain,)), held_out=True), key=lambda d: d.name)
    groups: dict[str, list] = {}
    for d in docs:
        groups.setdefault(d.name.split(":")[0], []).append(d)
    order = []
    for i in range(max((len(g) for g in groups.values()), default=0)):
        order += [g[i] for _, g in sorted(groups.items()) if i < len(g)]
    prompts = []
    for doc in order:
        ids = tokenizer(doc.text, add_special_tokens=False)["input_ids"]
        if len(ids) < 3 * length:
            continue
        start = len(ids) // 3
        prompts.append(ids[start:start + length])
        if len(prompts) == count:
            break
    return prompts
