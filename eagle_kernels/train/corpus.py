"""Offline training text: CPython standard-library sources (code) and, for prose, Jane Austen's
novels (Debian ``r-cran-janeaustenr``), the King James Bible (Debian ``bible-kjv``) and the
Python documentation's reST sources (Debian ``python3.11-doc``).

Wider domains (``--domains`` of ``distill``; ``code`` and ``prose`` above are unchanged):

- ``pkgcode``: the Python sources of packages installed beside this one (torch, transformers,
  triton, setuptools, pip, hypothesis, ...; never numpy);
- ``docprose``: Debian's package documentation under ``/usr/share/doc`` (READMEs, NEWS, change
  logs, Markdown and text files; never the copyright files, nor the Python docs of ``prose``);
- ``chat``: instructions in the target's chat template (:mod:`.chat`).

Evaluation-only domains, whose documents are all held out and never enter a training cache:

- ``offcode``: numpy's sources;
- ``offprose``: the license texts of ``/usr/share/common-licenses`` and the packages'
  ``/usr/share/doc/*/copyright`` files;
- ``chat`` (held-out split): a fixed list of instructions written apart from the training ones.

Every document is a file (or a book); the train / held-out split is decided by the document's
name alone, so it never changes with the token budget or the machine.
"""

from __future__ import annotations

import glob
import gzip
import importlib.util
import os
import shutil
import subprocess
import sysconfig
import zlib
from dataclasses import dataclass

from . import chat

CODE, PROSE = "code", "prose"
PKGCODE, DOCPROSE, CHAT = "pkgcode", "docprose", "chat"
OFFCODE, OFFPROSE = "offcode", "offprose"
TRAIN_DOMAINS = (CODE, PROSE, PKGCODE, DOCPROSE, CHAT)  # what distill may draw training prompts from
DOMAINS = TRAIN_DOMAINS + (OFFCODE, OFFPROSE)
# Sources whose every document is held out (evaluation only); chat's held-out list is "chateval".
EVAL_SOURCES = ("numpy", "license", "copyright", "chateval")
# Packages whose sources make ``pkgcode`` (numpy is kept for evaluation), and the characters read
# per package (its files in CRC32 order), which bounds tokenisation time.
PACKAGES = ("torch", "transformers", "triton", "setuptools", "pip", "hypothesis", "_pytest", "pydantic", "rich",
            "huggingface_hub", "networkx", "sympy", "jinja2", "requests", "pygments", "accelerate", "click",
            "fsspec", "gguf", "anyio", "markdown_it", "mpmath", "filelock", "packaging")
PACKAGE_CHARS = 1_500_000
DOC_FILE_CHARS = 60_000  # characters kept per /usr/share/doc file
DOC_FILES_PER_PACKAGE = 12  # (git ships hundreds of release notes)
SHARE_DOC = "/usr/share/doc"
COMMON_LICENSES = "/usr/share/common-licenses"
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
        if self.name.split(":")[0] in EVAL_SOURCES:
            return True
        if self.name.startswith("chat:"):  # generated training instructions (held-out: "chateval")
            return False
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


def _python_files(root: str, prefix: str, limit: int | None = None) -> list[Document]:
    """Python files under ``root`` (tests and vendored code skipped), in CRC32 order of their
    path up to ``limit`` characters, as documents named ``prefix:relative/path``."""
    skip = ("test", "tests", "testing", "_vendor", "vendor", "__pycache__")
    paths = []
    for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
        rel = os.path.relpath(path, root)
        if not any(part in skip for part in rel.split(os.sep)):
            paths.append(rel)
    docs, total = [], 0
    for rel in sorted(paths, key=lambda r: (zlib.crc32(r.encode()), r)):
        text = _read(os.path.join(root, rel))
        if not text or len(text) <= 500:
            continue
        docs.append(Document(f"{prefix}:{rel}", CODE, text))
        total += len(text)
        if limit is not None and total >= limit:
            break
    return sorted(docs, key=lambda d: d.name)


def _package_root(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def package_documents() -> list[Document]:
    """``pkgcode``: sources of the installed packages of ``PACKAGES`` (up to ``PACKAGE_CHARS``
    characters each), named ``pkg:PACKAGE/path``."""
    docs = []
    for name in PACKAGES:
        root = _package_root(name)
        if root:
            docs += [Document(f"pkg:{name}/{d.name.partition(':')[2]}", CODE, d.text)
                     for d in _python_files(root, "pkg", PACKAGE_CHARS)]
    return docs


def numpy_documents() -> list[Document]:
    """``offcode``: numpy's sources (evaluation only)."""
    root = _package_root("numpy")
    return _python_files(root, "numpy") if root else []


def _read_any(path: str) -> str | None:
    if path.endswith(".gz"):
        try:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                return f.read(DOC_FILE_CHARS)
        except (UnicodeDecodeError, OSError, EOFError):
            return None
    text = _read(path)
    return text[:DOC_FILE_CHARS] if text else text


def debian_doc_documents(folder: str = SHARE_DOC) -> list[Document]:
    """``docprose``: text documentation of the installed Debian packages (README, NEWS, change
    logs, ``.txt`` / ``.md`` / ``.rst``; copyright and license files and the Python docs
    excluded), named ``debdoc:package/file``."""
    text_ext = (".txt", ".md", ".rst", ".txt.gz", ".md.gz", ".rst.gz")
    stems = ("readme", "news", "changelog", "changes", "faq", "todo", "authors", "thanks", "usage", "history")
    docs, seen, per_package = [], set(), {}
    paths = glob.glob(os.path.join(folder, "**", "*"), recursive=True)
    for path in sorted(paths, key=lambda p: (zlib.crc32(p.encode()), p)):
        rel = os.path.relpath(path, folder)
        base = os.path.basename(path).lower()
        if (not os.path.isfile(path) or rel.startswith("python3.11") or "copyright" in base or "licen" in base
                or base.startswith("copying") or "/html/" in f"/{rel}"):
            continue
        if not (base.endswith(text_ext) or base.split(".")[0] in stems):
            continue
        text = _read_any(path)
        key = zlib.crc32(text.encode()) if text else None
        package = rel.split(os.sep)[0]
        if (text and len(text) > 500 and "\x00" not in text and key not in seen  # symlinked folders: once
                and per_package.get(package, 0) < DOC_FILES_PER_PACKAGE):
            seen.add(key)
            per_package[package] = per_package.get(package, 0) + 1
            docs.append(Document(f"debdoc:{rel}", PROSE, text))
    return sorted(docs, key=lambda d: d.name)


def chat_documents() -> list[Document]:
    """``chat``: every instruction of :mod:`.chat` as a document, ``chat:`` (the generated training
    instructions) and ``chateval:`` (``chat.HELD_OUT``, held out)."""
    docs = [Document(f"chat:{text}", CHAT, text) for text in chat.training_instructions()]
    return docs + [Document(f"chateval:{text}", CHAT, text) for text in chat.HELD_OUT]


def license_documents() -> list[Document]:
    """``offprose``: ``/usr/share/common-licenses`` and the packages' copyright files, each text
    once (evaluation only)."""
    docs, seen = [], set()
    paths = [("license", p) for p in sorted(glob.glob(os.path.join(COMMON_LICENSES, "*")))]
    paths += [("copyright", p) for p in sorted(glob.glob(os.path.join(SHARE_DOC, "*", "copyright")))]
    for source, path in paths:
        if not os.path.isfile(path):
            continue
        text = _read(path)
        key = zlib.crc32(text.encode()) if text else None
        if text and len(text) > 500 and key not in seen:
            seen.add(key)
            name = os.path.basename(path) if source == "license" else os.path.basename(os.path.dirname(path))
            docs.append(Document(f"{source}:{name}", PROSE, text))
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
    unknown = [d for d in domains if d not in DOMAINS]
    if unknown:
        raise ValueError(f"domains: unknown {unknown!r}, expected some of {DOMAINS!r}")
    docs = []
    if CODE in domains:
        docs += stdlib_documents()
    if PROSE in domains:
        docs += austen_documents() + kjv_documents() + python_docs_documents()
    if PKGCODE in domains:
        docs += package_documents()
    if DOCPROSE in domains:
        docs += debian_doc_documents()
    if CHAT in domains:
        docs += chat_documents()
    if OFFCODE in domains:
        docs += numpy_documents()
    if OFFPROSE in domains:
        docs += license_documents()
    return docs


def split(docs: list[Document], held_out: bool) -> list[Document]:
    return [d for d in docs if d.held_out == held_out]


def held_out_prompts(tokenizer, domain: str, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens from held-out documents of ``domain`` (never in
    any training cache): for prose the sources take turns (Austen, KJV, Python docs). Each
    prompt is the window starting a third of the way into its document. Chat prompts are whole
    held-out instructions in the tokenizer's chat template (``length`` does not apply)."""
    if domain == CHAT:
        return [chat.prompt_ids(tokenizer, text) for text in chat.HELD_OUT[:count]]
    docs = sorted(split(documents((domain,)), held_out=True), key=lambda d: d.name)
    if domain in (OFFCODE, OFFPROSE):  # all documents held out: spread over packages by a hash of the name
        docs = sorted(docs, key=lambda d: (zlib.crc32(d.name.encode()), d.name))
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
