#!/usr/bin/env bash
# Checks that the docs stay true to the repository:
# - every relative link in README.md, CONTRIBUTING.md and docs/src/*.md points at a file that
#   exists, and its #anchor (if any) at a heading of that file;
# - every repository path those files name in backticks (`src/...`, `tests/...`, ...) exists;
# - docs/src/SUMMARY.md lists every chapter, and every chapter it lists exists;
# - the commands of the README's "two commands" block are the ones .ci/run runs (or names,
#   with the reason, on a "# not run here:" line).
# Usage (from anywhere in the repository): scripts/check-docs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 - "$@" <<'PY'
import os, re, sys

ROOT = os.getcwd()
DOCS = ["README.md", "CONTRIBUTING.md"] + sorted(
    os.path.join("docs/src", f) for f in os.listdir("docs/src") if f.endswith(".md"))
# A backticked token is checked as a repository path when its first component is one of these.
TOP = {"src", "tests", "examples", "replay", "bench-burn", "benches", "scripts", "docs", ".ci",
       "Cargo.toml", "Cargo.lock", "README.md", "CHANGELOG.md", "CONTRIBUTING.md",
       "LICENSE-MIT", "LICENSE-APACHE"}
errors = []

def slug(heading):
    # GitHub's and mdBook's anchor of a heading: lower case, punctuation dropped, spaces to '-'.
    text = heading.strip().replace("`", "").replace("*", "").lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return "".join(c for c in text.replace(" ", "-") if c.isalnum() or c in "-_")

def anchors(path):
    out, fence = set(), False
    for line in open(path, encoding="utf-8"):
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            out.add(slug(line.lstrip("#").strip()))
    return out

def prose(path):
    """The file's lines outside fenced code blocks, with their numbers."""
    fence = False
    for n, line in enumerate(open(path, encoding="utf-8"), 1):
        if line.startswith("```"):
            fence = not fence
            continue
        if not fence:
            yield n, line

for doc in DOCS:
    base = os.path.dirname(doc)
    for n, line in prose(doc):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(base, path)) if path else doc
            if not os.path.exists(full):
                errors.append(f"{doc}:{n}: link to a missing file: {target}")
            elif anchor and full.endswith(".md") and anchor not in anchors(full):
                errors.append(f"{doc}:{n}: link to a missing heading: {target}")
        for token in re.findall(r"`([^`\s]+)`", line):
            token = re.sub(r"(::\w+|:\d+)+$", "", token)
            first = token.split("/")[0]
            if first not in TOP or any(c in token for c in "*{}<>$"):
                continue
            if not os.path.exists(token):
                errors.append(f"{doc}:{n}: names a path that does not exist: {token}")

# The book's table of contents and its chapters.
listed = set(re.findall(r"\]\(([^)#]+\.md)\)", open("docs/src/SUMMARY.md").read()))
for chapter in sorted(f for f in os.listdir("docs/src") if f.endswith(".md") and f != "SUMMARY.md"):
    if chapter not in listed:
        errors.append(f"docs/src/SUMMARY.md: does not list docs/src/{chapter}")

# The README's two commands against CI.
readme = open("README.md", encoding="utf-8").read()
block = re.search(r"## The two commands\s*```sh\n(.*?)```", readme, re.S)
if not block:
    errors.append("README.md: no '## The two commands' block with a ```sh fence")
else:
    commands = [l.split("#")[0].strip() for l in block.group(1).splitlines()]
    commands = [c for c in commands if c]
    ci = [l.strip() for l in open(".ci/run", encoding="utf-8")]
    for command in commands:
        ran = command in ci
        named = any(l.startswith("# not run here: " + command + " (") for l in ci)
        if not (ran or named):
            errors.append(f".ci/run: does not run the README's command `{command}` (nor name "
                          f"it on a '# not run here: {command} (why)' line)")
    for first in ("cargo run", "cargo test"):
        line = next((l for l in readme.splitlines() if re.match(r"\s*" + first, l)), None)
        if line is None or line.split("#")[0].strip() not in commands:
            errors.append(f"README.md: the first `{first}` line is not in the two-commands "
                          f"block (fresh-clone checks read it): {line!r}")

for e in errors:
    print(e)
print(f"check-docs: {len(DOCS)} files, {len(errors)} problem(s)")
sys.exit(1 if errors else 0)
PY
