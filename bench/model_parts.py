"""Carry a file larger than one transfer (the SmolLM2 GGUF, 88.6 MiB) to a machine in parts.

A transfer to the GPU machine carries at most 64 MiB, and git-ignored files already there are
kept while the machine stays up. So the file is split here into parts under 64 MiB in a
git-ignored folder (default ``bench/.model_parts/``, see .gitignore), one part is carried per
run, and the GPU check reassembles them, verifying every part's and the whole file's SHA-256.

    python bench/model_parts.py split FILE [--dir DIR] [--part-mib 48] [--prompts PROMPTS.json]
    python bench/model_parts.py status [--dir DIR]     # parts present / missing / corrupt
    python bench/model_parts.py join OUT [--dir DIR]   # reassemble and verify, exit 1 on any fault
    python bench/model_parts.py plan [--dir DIR]       # one line per transfer: the paths to carry

``manifest.json`` names the file, its size and hash, and each part's; the first transfer
carries it with part 0, later ones the next part each (``plan``). ``join`` never writes a file
whose hash differs: it fails with the missing or corrupt parts named.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DIR = os.path.join(HERE, ".model_parts")
MANIFEST = "manifest.json"
CHUNK = 1 << 20


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def split(source: str, folder: str, part_bytes: int, prompts: str | None = None) -> dict:
    """Write ``source`` as parts of at most ``part_bytes`` bytes and the manifest into
    ``folder`` (old parts there are removed). Returns the manifest."""
    if part_bytes < 1:
        raise ValueError(f"part size: expected >= 1 byte, got {part_bytes}")
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(folder):
        if name.startswith("part-") or name == MANIFEST:
            os.remove(os.path.join(folder, name))
    parts = []
    with open(source, "rb") as f:
        index = 0
        while True:
            data = f.read(part_bytes)
            if not data:
                break
            name = f"part-{index:03d}"
            with open(os.path.join(folder, name), "wb") as out:
                out.write(data)
            parts.append({"file": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
            index += 1
    manifest = {"name": os.path.basename(source), "size": os.path.getsize(source), "sha256": sha256(source),
                "parts": parts}
    if prompts is not None:
        shutil.copyfile(prompts, os.path.join(folder, "prompts.json"))
        manifest["prompts"] = "prompts.json"
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def read_manifest(folder: str) -> dict:
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no manifest (run `python bench/model_parts.py split FILE` where the file is, "
                                "then carry the folder)")
    with open(path) as f:
        return json.load(f)


def status(folder: str) -> tuple[dict, list[str], list[str]]:
    """(manifest, missing part names, corrupt part names: wrong size or hash)."""
    manifest = read_manifest(folder)
    missing, corrupt = [], []
    for part in manifest["parts"]:
        path = os.path.join(folder, part["file"])
        if not os.path.exists(path):
            missing.append(part["file"])
        elif os.path.getsize(path) != part["size"] or sha256(path) != part["sha256"]:
            corrupt.append(part["file"])
    return manifest, missing, corrupt


def join(folder: str, out: str) -> str:
    """Reassemble the parts into ``out`` (a file path, or a folder to hold the manifest's name)
    and verify it. Raises RuntimeError naming missing or corrupt parts, or a whole-file hash
    mismatch (the partial output is removed). Returns the file's path."""
    manifest, missing, corrupt = status(folder)
    if missing or corrupt:
        raise RuntimeError(f"{folder}: {len(manifest['parts'])} parts expected; missing {missing or 'none'}, "
                           f"corrupt {corrupt or 'none'}: carry them again")
    if os.path.isdir(out):
        out = os.path.join(out, manifest["name"])
    if os.path.exists(out) and os.path.getsize(out) == manifest["size"] and sha256(out) == manifest["sha256"]:
        return out  # already reassembled by an earlier run
    tmp = out + ".partial"
    with open(tmp, "wb") as f:
        for part in manifest["parts"]:
            with open(os.path.join(folder, part["file"]), "rb") as src:
                shutil.copyfileobj(src, f, CHUNK)
    got = sha256(tmp)
    if got != manifest["sha256"]:
        os.remove(tmp)
        raise RuntimeError(f"{out}: reassembled SHA-256 {got} differs from the manifest's {manifest['sha256']}")
    os.replace(tmp, out)
    return out


def plan(folder: str) -> list[list[str]]:
    """The paths (relative to the repository root) each transfer carries, in order."""
    manifest = read_manifest(folder)
    root = os.path.dirname(HERE)
    rel = os.path.relpath(os.path.abspath(folder), root)
    extra = [os.path.join(rel, MANIFEST)] + ([os.path.join(rel, manifest["prompts"])] if "prompts" in manifest else [])
    return [(extra if i == 0 else [os.path.join(rel, MANIFEST)]) + [os.path.join(rel, p["file"])]
            for i, p in enumerate(manifest["parts"])]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("split")
    p.add_argument("file")
    p.add_argument("--part-mib", type=float, default=48.0, help="part size (< 64 MiB leaves room for the rest)")
    p.add_argument("--prompts", help="a JSON file of token-id prompts to carry with the first part")
    for name in ("status", "join", "plan"):
        q = sub.add_parser(name)
        if name == "join":
            q.add_argument("out")
    for q in sub.choices.values():
        q.add_argument("--dir", default=DEFAULT_DIR)
    args = parser.parse_args(argv)
    try:
        if args.command == "split":
            manifest = split(args.file, args.dir, int(args.part_mib * (1 << 20)), args.prompts)
            print(f"{manifest['name']}: {manifest['size']} bytes in {len(manifest['parts'])} parts under {args.dir}")
        elif args.command == "status":
            manifest, missing, corrupt = status(args.dir)
            print(f"{manifest['name']}: {len(manifest['parts'])} parts, missing {missing or 'none'}, "
                  f"corrupt {corrupt or 'none'}")
            return 0 if not (missing or corrupt) else 1
        elif args.command == "join":
            print(join(args.dir, args.out))
        else:
            for i, paths in enumerate(plan(args.dir)):
                print(f"transfer {i + 1}: {' '.join(paths)}")
    except (OSError, RuntimeError, ValueError, KeyError) as error:
        print(f"model_parts {args.command}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
