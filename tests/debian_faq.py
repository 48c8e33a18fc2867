#!/usr/bin/env python3
"""Derives a small labelled retrieval set (BEIR layout) from Debian's own FAQ.

    python3 tests/debian_faq.py OUT_DIR

Downloads the `debian-faq` package (`apt-get download`, into OUT_DIR) unless a
`debian-faq_*.deb` is already there, unpacks its plain-text FAQ, and writes:

  corpus.jsonl   one document per numbered section: its answer text (the question is left out)
  queries.jsonl  one query per section: the question as written in the FAQ
  qrels.tsv      each question's own section is its one relevant document

The FAQ text is not committed to this repository; only this script is.
"""

import glob
import gzip
import json
import os
import re
import subprocess
import sys

HEADING = re.compile(r"^(\d+(?:\.\d+)+)\.[\s\u00a0]+(\S.*)$")
CHAPTER = re.compile(r"^Chapter[\s\u00a0]+\d+\.")


def fetch(out):
    debs = glob.glob(os.path.join(out, "debian-faq_*.deb"))
    if not debs:
        subprocess.run(["apt-get", "download", "debian-faq"], cwd=out, check=True)
        debs = glob.glob(os.path.join(out, "debian-faq_*.deb"))
    unpacked = os.path.join(out, "pkg")
    subprocess.run(["dpkg-deb", "-x", sorted(debs)[-1], unpacked], check=True)
    (txt,) = glob.glob(os.path.join(unpacked, "usr/share/doc/debian/FAQ/debian-faq.en.txt.gz"))
    with gzip.open(txt, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def sections(lines):
    """(number, question, answer) per numbered section of the body (after the contents)."""
    body = next(i for i, l in enumerate(lines) if CHAPTER.match(l))
    out, current = [], None
    i = body
    while i < len(lines):
        line = lines[i]
        m = HEADING.match(line)
        if m:
            if current:
                out.append(current)
            question = m.group(2).strip()
            # A long question wraps onto unindented lines until the blank line.
            while i + 1 < len(lines) and lines[i + 1].strip() and not lines[i + 1].startswith(" "):
                i += 1
                question += " " + lines[i].strip()
            current = [m.group(1), question, []]
        elif CHAPTER.match(line):
            if current:
                out.append(current)
            current = None
        elif current:
            current[2].append(line)
        i += 1
    if current:
        out.append(current)
    result = []
    for number, question, answer in out:
        text = re.sub(r"\n{3,}", "\n\n", "\n".join(l.strip() for l in answer)).strip()
        if len(text) >= 80:  # a section that only points to its subsections is no answer
            result.append((number, question.replace("\u00a0", " "), text))
    return result


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    secs = sections(fetch(out))
    with open(os.path.join(out, "corpus.jsonl"), "w") as c, \
            open(os.path.join(out, "queries.jsonl"), "w") as q, \
            open(os.path.join(out, "qrels.tsv"), "w") as r:
        r.write("query-id\tcorpus-id\tscore\n")
        for number, question, answer in secs:
            c.write(json.dumps({"_id": "faq-" + number, "title": "", "text": answer}) + "\n")
            q.write(json.dumps({"_id": "q-" + number, "text": question}) + "\n")
            r.write(f"q-{number}\tfaq-{number}\t1\n")
    print(f"{len(secs)} questions and answers written to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
