"""Checks the relative links of the repository's Markdown documents: every linked file exists, and
every #anchor names a heading of its file (GitHub's rule: lower case, punctuation dropped, spaces
to hyphens). External links (http:, https:, mailto:) are not followed.

    python3 docs/check_links.py [FILE.md ...]   # default: the files of DEFAULT

Exits 1, listing each broken link with its file and line, when any is broken.
"""

import glob
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT = ["README.md", "ARCHITECTURE.md", "docs/**/*.md", "deploy/**/*.md",
           "experiments/results/**/*.md"]

_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def slug(heading):
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # A link's text only.
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    found, counts, fenced = set(), {}, False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            m = None if fenced else _HEADING.match(line)
            if m:
                base = slug(m.group(2))
                n = counts.get(base, 0)
                counts[base] = n + 1
                found.add(base if n == 0 else "%s-%d" % (base, n))
    return found


def broken_links(path):
    """[(line number, link, why)] of the file's broken relative links."""
    out, fenced = [], False
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        for target in _LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) \
                if file_part else path
            if not os.path.exists(dest):
                out.append((number, target, "no such file"))
            elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                out.append((number, target, "no heading #%s in %s" %
                            (anchor, os.path.relpath(dest, ROOT))))
    return out


def main(argv):
    patterns = argv or DEFAULT
    files = sorted({f for p in patterns for f in glob.glob(os.path.join(ROOT, p), recursive=True)
                    if "/node_modules/" not in f})  # npm packages' own documents are not ours
    bad = 0
    for path in files:
        for number, target, why in broken_links(path):
            print("%s:%d: %s: %s" % (os.path.relpath(path, ROOT), number, target, why))
            bad += 1
    print("%d Markdown files, %d broken links" % (len(files), bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
