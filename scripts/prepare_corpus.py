# SPDX-License-Identifier: Apache-2.0
"""Prepare a real English text corpus from Debian documentation packages (see ../shared/notes/corpus.md).

Sources (one Debian package each, installed with apt-get when missing, which needs root):

  python3.11-doc       Python 3.11 documentation, reStructuredText sources (html/_sources/**/*.rst.txt)
  linux-doc-6.1        Linux kernel documentation, reStructuredText sources (html/_sources/**/*.rst.txt)
  perl-doc             Perl documentation, POD rendered to plain text by `pod2text`
  debian-reference-en  The Debian Reference, one HTML file per chapter

Every file is one document. Markup is stripped (reST directives, roles, section underlines, link targets; POD
via pod2text; HTML tags), and each document goes to train or validation by a hash of its package and path, so
the split never changes between machines or runs. Output under --output-dir (default data/corpus, gitignored):

  train.txt, validation.txt        documents separated by one blank line (for tokenizer training, simple reads)
  train.jsonl, validation.jsonl    one {"package", "path", "text"} object per document (datasets' "json" loader)
  manifest.json                    packages, document and character counts per split

Usage:
  python scripts/prepare_corpus.py                                 # all four packages
  python scripts/prepare_corpus.py --packages python3.11-doc      # a subset
  python scripts/prepare_corpus.py --no-install                   # only locate; fail if a package is missing
"""

import argparse
import gzip
import hashlib
import html.parser
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("train", "validation")


@dataclass(frozen=True)
class DocumentSource:
    """Where a package keeps its documents and how to turn one file into plain text."""

    package: str
    root: Path
    pattern: str
    to_text: Callable[[Path], str]


# ---------------------------------------------------------------------------------------------------------------
# Markup stripping

_RST_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+(?:[\w-]+:)?([\w-]+)::.*$")  # ".. note::", ".. c:function:: ..."
_RST_COMMENT_OR_TARGET = re.compile(r"^(\s*)\.\.(\s.*)?$")  # comments, ".. _label:", ".. [1] ...", ".. |sub| ..."
_RST_FIELD = re.compile(r"^\s+:[\w -]+:.*$")  # directive options such as "   :maxdepth: 2"
_RST_UNDERLINE = re.compile(r"^\s*([=\-~^\"'`#*+<>_.:])\1{2,}\s*$")  # section adornment lines
_RST_ROLE = re.compile(r":[\w:.-]+:`[~!]?([^`<]*?)(?:\s*<[^`>]*>)?`")  # :func:`name`, :ref:`text <label>`
_RST_LINK = re.compile(r"`([^`<]+?)\s*<[^`>]*>`_{1,2}")  # `text <url>`_
_RST_REFERENCE = re.compile(r"`([^`]+)`_{1,2}")  # `name`_
_RST_LITERAL = re.compile(r"``([^`]+)``")
_RST_EMPHASIS = re.compile(r"\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*")
_RST_SUBSTITUTION = re.compile(r"\|([\w -]+)\|_?")
_BLANK_RUNS = re.compile(r"\n{3,}")
# Directives whose indented body is not prose (tables of contents, index entries, file inclusions): dropped whole.
# The bodies of all other directives (notes, code blocks, function descriptions) are kept as text.
_RST_NON_PROSE_DIRECTIVES = {
    "toctree", "index", "image", "figure", "include", "literalinclude", "highlight", "raw", "kernel-doc",
    "tabularcolumns", "only", "sectionauthor", "moduleauthor", "module", "currentmodule", "contents",
    "cssclass", "rst-class", "default-role", "role", "testsetup", "testcleanup", "kernel-abi", "kernel-feat",
    "kernel-include", "maintainers-include", "flat-table", "graphviz", "kfigure", "kernel-figure", "kernel-image",
}


def strip_rst(text: str) -> str:
    """Plain text from reStructuredText: comments, link targets, directive options and the bodies of non-prose
    directives dropped, section underlines dropped, roles, links, literals and emphasis reduced to their text."""
    lines = []
    skip_indent, skip_body = None, False  # inside a directive or comment that started at indent `skip_indent`
    for line in text.splitlines():
        if skip_indent is not None:
            indent = len(line) - len(line.lstrip())
            if line.strip() == "":
                if skip_body:
                    continue
                lines.append("")
                continue
            if indent > skip_indent and (skip_body or _RST_FIELD.match(line)):
                continue
            skip_indent = None
        directive = _RST_DIRECTIVE.match(line)
        if directive:
            skip_indent, skip_body = len(directive.group(1)), directive.group(2) in _RST_NON_PROSE_DIRECTIVES
            continue
        comment = _RST_COMMENT_OR_TARGET.match(line)
        if comment:
            skip_indent, skip_body = len(comment.group(1)), True
            continue
        if _RST_UNDERLINE.match(line):
            continue
        lines.append(line.rstrip())
    text = "\n".join(lines).replace("\\ ", "")
    # Inline markup may span lines, so it is reduced on the whole text.
    for pattern, replacement in (
        (_RST_ROLE, r"\1"), (_RST_LINK, r"\1"), (_RST_REFERENCE, r"\1"), (_RST_LITERAL, r"\1"),
        (_RST_SUBSTITUTION, r"\1"),
    ):
        text = pattern.sub(replacement, text)
    text = _RST_EMPHASIS.sub(lambda match: match.group(1) or match.group(2), text)
    return normalise_blank_lines(text)


class _HTMLText(html.parser.HTMLParser):
    """Text content of an HTML page without scripts, styles and the page navigation."""

    SKIPPED = {"script", "style", "head", "nav"}
    BLOCKS = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "dt", "dd", "table", "title"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip_depth = 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIPPED:
            self.skip_depth += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n\n")

    def handle_endtag(self, tag):
        if tag in self.SKIPPED:
            self.skip_depth = max(0, self.skip_depth - 1)
        elif tag in self.BLOCKS:
            self.parts.append("\n\n")

    def handle_data(self, data):
        if not self.skip_depth:
            self.parts.append(data)


def strip_html(text: str) -> str:
    parser = _HTMLText()
    parser.feed(text)
    lines = [re.sub(r"[ \t]+", " ", line).strip() for line in "".join(parser.parts).splitlines()]
    return normalise_blank_lines("\n".join(lines))


def normalise_blank_lines(text: str) -> str:
    return _BLANK_RUNS.sub("\n\n", text).strip()


def read_text(path: Path) -> str:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return raw.decode("utf-8", errors="replace")


def rst_file_text(path: Path) -> str:
    return strip_rst(read_text(path))


def html_file_text(path: Path) -> str:
    return strip_html(read_text(path))


def pod_file_text(path: Path) -> str:
    result = subprocess.run(["pod2text", str(path)], capture_output=True, text=True, errors="replace")
    if result.returncode not in (0, 1):  # 1: POD with errata, the text is still produced
        raise RuntimeError(f"pod2text failed on {path}: {result.stderr.strip()}")
    return normalise_blank_lines("\n".join(line.rstrip() for line in result.stdout.splitlines()))


# ---------------------------------------------------------------------------------------------------------------
# Packages

PERL_POD_ROOTS = sorted(Path("/usr/share/perl").glob("5.*/pod"))

SOURCES = {
    "python3.11-doc": DocumentSource(
        "python3.11-doc", Path("/usr/share/doc/python3.11/html/_sources"), "**/*.rst.txt", rst_file_text
    ),
    "linux-doc-6.1": DocumentSource(
        "linux-doc-6.1", Path("/usr/share/doc/linux-doc-6.1/html/_sources"), "**/*.rst.txt", rst_file_text
    ),
    "perl-doc": DocumentSource(
        "perl-doc", PERL_POD_ROOTS[-1] if PERL_POD_ROOTS else Path("/usr/share/perl/5/pod"), "*.pod", pod_file_text
    ),
    "debian-reference-en": DocumentSource(
        "debian-reference-en", Path("/usr/share/debian-reference"), "*.en.html", html_file_text
    ),
}


def package_installed(package: str) -> bool:
    if shutil.which("dpkg-query") is None:
        return False
    result = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True)
    return result.returncode == 0 and "install ok installed" in result.stdout


def ensure_installed(packages: list[str], install: bool) -> None:
    """Install the missing packages with apt-get (root), or fail with the command to run."""
    missing = [package for package in packages if not package_installed(package)]
    if not missing:
        return
    command = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
    if not install:
        raise SystemExit(f"Missing Debian packages {missing}; install them with: sudo {' '.join(command)}")
    if shutil.which("apt-get") is None or shutil.which("dpkg-query") is None:
        raise SystemExit(
            f"Missing Debian packages {missing}, and apt-get/dpkg are not available on this machine. This script "
            "needs a Debian or Ubuntu system with the documentation packages listed in its docstring."
        )
    if os.geteuid() != 0:
        raise SystemExit(f"Missing Debian packages {missing}; installing needs root: sudo {' '.join(command)}")
    print(f"installing {missing} with apt-get", flush=True)
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(command, env=environment).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=environment, check=True)
        subprocess.run(command, env=environment, check=True)


def iter_documents(source: DocumentSource) -> Iterator[tuple[str, str]]:
    """(path relative to the package root, clean text) for every non-empty document, in sorted path order."""
    if not source.root.is_dir():
        raise SystemExit(f"{source.package}: expected its documents under {source.root}, which does not exist.")
    paths = sorted(source.root.glob(source.pattern))
    if not paths:
        raise SystemExit(f"{source.package}: no files match {source.root / source.pattern}.")
    for path in paths:
        text = source.to_text(path)
        if text:
            yield str(path.relative_to(source.root)), text


def split_of(package: str, relative_path: str, validation_fraction: float) -> str:
    """Deterministic split by document: the first 8 bytes of sha256("package/path") as a fraction of 2**64."""
    digest = hashlib.sha256(f"{package}/{relative_path}".encode()).digest()
    return "validation" if int.from_bytes(digest[:8], "big") / 2**64 < validation_fraction else "train"


def prepare_corpus(output_dir: Path, packages: list[str], validation_fraction: float, install: bool = True) -> dict:
    """Write the split corpus under output_dir and return the manifest (also written as manifest.json)."""
    unknown = sorted(set(packages) - set(SOURCES))
    if unknown:
        raise SystemExit(f"Unknown packages {unknown}; choose from {sorted(SOURCES)}.")
    if not 0.0 < validation_fraction < 1.0:
        raise SystemExit(f"--validation-fraction must lie strictly between 0 and 1, got {validation_fraction}.")
    ensure_installed(packages, install)
    if "perl-doc" in packages and shutil.which("pod2text") is None:
        raise SystemExit("perl-doc needs `pod2text` (package perl) to render POD to text.")

    output_dir.mkdir(parents=True, exist_ok=True)
    manifest = {"validation_fraction": validation_fraction, "packages": {}, "splits": {}}
    texts = {split: open(output_dir / f"{split}.txt.tmp", "w", encoding="utf-8") for split in SPLITS}
    records = {split: open(output_dir / f"{split}.jsonl.tmp", "w", encoding="utf-8") for split in SPLITS}
    totals = {split: {"documents": 0, "characters": 0} for split in SPLITS}
    try:
        for package in packages:
            counts = {split: {"documents": 0, "characters": 0} for split in SPLITS}
            for relative_path, text in iter_documents(SOURCES[package]):
                split = split_of(package, relative_path, validation_fraction)
                if counts[split]["documents"] or totals[split]["documents"]:
                    texts[split].write("\n\n")
                texts[split].write(text)
                records[split].write(json.dumps({"package": package, "path": relative_path, "text": text}) + "\n")
                for tally in (counts[split], totals[split]):
                    tally["documents"] += 1
                    tally["characters"] += len(text)
            manifest["packages"][package] = counts
            print(
                f"{package:22s} train {counts['train']['documents']:5d} docs {counts['train']['characters'] / 1e6:7.2f} M chars"
                f" | validation {counts['validation']['documents']:4d} docs "
                f"{counts['validation']['characters'] / 1e6:6.2f} M chars",
                flush=True,
            )
    finally:
        for handle in (*texts.values(), *records.values()):
            handle.close()
    for split in SPLITS:
        os.replace(output_dir / f"{split}.txt.tmp", output_dir / f"{split}.txt")
        os.replace(output_dir / f"{split}.jsonl.tmp", output_dir / f"{split}.jsonl")
        totals[split]["bytes"] = (output_dir / f"{split}.txt").stat().st_size
    manifest["splits"] = totals
    (output_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for split in SPLITS:
        print(
            f"{split:10s} {totals[split]['documents']:6d} documents, {totals[split]['bytes'] / 1e6:7.2f} MB -> "
            f"{output_dir / (split + '.txt')}"
        )
    return manifest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=Path(__file__).resolve().parents[1] / "data" / "corpus")
    parser.add_argument("--packages", nargs="+", default=list(SOURCES), choices=list(SOURCES))
    parser.add_argument("--validation-fraction", type=float, default=0.05)
    parser.add_argument("--no-install", dest="install", action="store_false", help="fail instead of running apt-get")
    args = parser.parse_args(argv)
    prepare_corpus(args.output_dir, args.packages, args.validation_fraction, args.install)


if __name__ == "__main__":
    sys.exit(main())
