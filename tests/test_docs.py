"""The repository as a newcomer reads it (issue 37): every Markdown table renders, the README stays
short, its links and the docs' links lead somewhere, and ``examples/`` stays small. CPU only."""

import os
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Folders that are not the project's own text.
SKIP_DIRS = {".git", ".venv", ".gpu", "node_modules", "build", "dist", "__pycache__", ".pytest_cache"}
README_MAX_LINES = 250
#: ``du -sb examples`` must stay under this many bytes (5 MB).
EXAMPLES_MAX_BYTES = 5_000_000

_DELIMITER_CELL = re.compile(r"^\s*:?-+:?\s*$")
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")


def markdown_files():
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        for name in sorted(filenames):
            if name.endswith(".md"):
                yield Path(dirpath) / name


def split_row(line: str) -> list:
    """The cells of a table row as GitHub splits them: at every pipe not escaped as ``\\|``. A pipe in a
    code span splits the cell too (GitHub splits rows before it reads code spans), so such a row gets
    more cells than its header and fails: write ``\\|`` there as well."""
    s = line.strip()
    if s.startswith("|"):
        s = s[1:]
    cells, cur, i = [], "", 0
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s):
            cur += s[i:i + 2]
            i += 2
            continue
        if c == "|":
            cells.append(cur)
            cur = ""
        else:
            cur += c
        i += 1
    if cur.strip() or not s.endswith("|"):
        cells.append(cur)
    return [c.strip() for c in cells]


def is_delimiter(line: str) -> bool:
    if "-" not in line:
        return False
    cells = split_row(line)
    return bool(cells) and all(_DELIMITER_CELL.match(c) for c in cells)


def outside_code(lines: list) -> list:
    """``(number, line)`` of the lines outside fenced code blocks."""
    out, fence = [], None
    for n, line in enumerate(lines, 1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
            continue
        if fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            continue
        out.append((n, line))
    return out


def tables(text: str):
    """Each table of ``text`` as ``(line number of its header, [(line number, cells), ...])``, header
    and delimiter rows first; a table's body runs to the first blank line, as on GitHub."""
    lines = outside_code(text.splitlines())
    i = 1
    while i < len(lines):
        (hn, header), (_dn, delim) = lines[i - 1], lines[i]
        if "|" in header and header.strip() and is_delimiter(delim) and lines[i - 1][0] + 1 == lines[i][0]:
            rows = [(hn, split_row(header)), (lines[i][0], split_row(delim))]
            j = i + 1
            while j < len(lines) and lines[j][1].strip() and lines[j][0] == lines[j - 1][0] + 1:
                rows.append((lines[j][0], split_row(lines[j][1])))
                j += 1
            yield hn, rows
            i = j + 1
        else:
            i += 1


def table_problems(text: str) -> list:
    problems = []
    for hn, rows in tables(text):
        want = len(rows[0][1])
        for n, cells in rows[1:]:
            if len(cells) != want:
                problems.append(f"line {n}: {len(cells)} cells, the header (line {hn}) has {want}")
    return problems


# ------------------------------------------------------------------------------------ the checker itself
def test_split_row_reads_escaped_pipes_and_splits_at_pipes_in_code_as_github_does():
    assert split_row("| a | b \\| c | `d` |") == ["a", "b \\| c", "`d`"]
    assert split_row("a | b") == ["a", "b"]
    assert split_row("| | |") == ["", ""]
    assert split_row("| `x \\| y` | z |") == ["`x \\| y`", "z"]
    assert split_row("| `x | y` | z |") == ["`x", "y`", "z"]  # GitHub renders three cells here


def test_checker_finds_a_delimiter_row_wider_than_its_header_and_skips_code_blocks():
    bad = "text\n\n| a | b |\n| --- | --- | --- |\n| 1 | 2 |\n"
    assert table_problems(bad) == ["line 4: 3 cells, the header (line 3) has 2"]
    short_row = "| a | b |\n| --- | ---: |\n| 1 | 2 |\n| 3 |\n\nafter | the table\n"
    assert table_problems(short_row) == ["line 4: 1 cells, the header (line 1) has 2"]
    fenced = "```\n| a | b |\n| --- | --- | --- |\n```\n"
    assert table_problems(fenced) == []
    assert table_problems("| a | b \\| c |\n| --- | --- |\n| `x \\| y` | z |\n") == []


# ------------------------------------------------------------------------------------ the repository
@pytest.mark.parametrize("path", list(markdown_files()), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_table_row_has_its_headers_cell_count(path):
    assert table_problems(path.read_text(encoding="utf-8")) == []


def test_markdown_files_are_found():
    found = {p.relative_to(ROOT).as_posix() for p in markdown_files()}
    assert "README.md" in found
    assert any(f.startswith("docs/") for f in found)
    assert any(f.startswith("examples/") for f in found)


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n < README_MAX_LINES, f"README.md has {n} lines; move sections into docs/"


def test_readme_keeps_the_ci_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "```bash\nmake test\n```" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def relative_links(path: Path) -> list:
    """``(line number, target)`` of the links of ``path`` into the repository (no URL, no bare anchor)."""
    return relative_links_of(path.read_text(encoding="utf-8"))


def relative_links_of(text: str) -> list:
    out = []
    for n, line in outside_code(text.splitlines()):
        line = re.sub(r"`[^`]*`", "", line)
        targets = [m.group(1) for m in _LINK.finditer(line)]
        if (m := _REF_LINK.match(line)):
            targets.append(m.group(1))
        for t in targets:
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", t) or t.startswith("#"):
                continue
            out.append((n, unquote(t.split("#", 1)[0])))
    return out


@pytest.mark.parametrize("path", list(markdown_files()), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files_that_exist(path):
    """README.md's, docs/'s and every other Markdown file's links into the repository (images too)."""
    links = relative_links(path)
    missing = [f"line {n}: {t}" for n, t in links
               if not (ROOT / t.lstrip("/") if t.startswith("/") else path.parent / t).exists()]
    assert missing == []


def test_the_readmes_links_are_checked():
    links = [t for _n, t in relative_links(ROOT / "README.md")]
    assert "docs/fast-path.md" in links and "examples/demo/h100-run/reward.png" in links
    assert relative_links_of("see [a](docs/x.md), `[b](not/a/link.md)`, [c](https://e.org/y.md), [d](#top)\n"
                             "```\n[e](in/code.md)\n```\n![f](img/g.png \"title\") [h](i.md#part)\n") \
        == [(1, "docs/x.md"), (5, "img/g.png"), (5, "i.md")]


def test_docs_exist_and_the_readme_links_every_page():
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert pages
    linked = {(ROOT / t).resolve() for _n, t in relative_links(ROOT / "README.md")}
    assert [p.name for p in pages if p.resolve() not in linked] == []


def du_bytes(top: Path) -> int:
    """What ``du -sb`` counts (the apparent size of every file, link and folder, hard links once),
    leaving out Python's bytecode caches, which are not committed."""
    seen, total = set(), 0
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for p in [dirpath] + [os.path.join(dirpath, f) for f in filenames]:
            st = os.lstat(p)
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def test_examples_stay_under_five_megabytes():
    size = du_bytes(ROOT / "examples")
    assert size < EXAMPLES_MAX_BYTES, f"examples/ holds {size} bytes; archive or drop raw run files"


def test_every_committed_comparison_keeps_its_report_config_commands_and_raw_archive():
    runs = sorted(p.parent for p in (ROOT / "examples" / "verl" / "compare").glob("*/comparison.md"))
    assert len(runs) >= 21
    for run in runs:
        for name in ("comparison.json", "comparison.png", "config.json", "raw.tar.xz"):
            assert (run / name).is_file(), f"{run.name}: {name}"
        assert list(run.glob("pair*/*/command.sh")), f"{run.name}: no command.sh"
