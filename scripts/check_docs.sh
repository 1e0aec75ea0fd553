#!/usr/bin/env bash
# Keeps the docs honest, mechanically. Fails (exit 1), listing each offence
# as file:line, when
#  1. README.md or a docs/*.md names a repository path that does not exist.
#     A path is a word that starts with one of the tree's top-level folders
#     (apps/ bench/ cmake/ configs/ docs/ examples/ include/ python/ scripts/
#     src/ tests/) and is not part of a longer path (build/bench/... is a build
#     output and is not checked). Trailing punctuation is dropped. Placeholders
#     match anything: `*` (a glob), `<name>`, `{a,b}` (either); a path that
#     goes on with `...` is checked up to the folder before it. A path ending
#     in `/` must be a folder.
#  2. A file under src/, tests/ or bench/, docs/*.md or README.md refers to a
#     work item by number instead of stating the fact: `issue #12`, `PR #3`,
#     `item #4` (also issues, items, ticket, task, bug), or a bare number in
#     parentheses, `(#16 ...)`. Links to another project's tracker
#     (github.com/owner/repo/issues/123) are fine.
#  3. A docs/*.md page is not named in README.md (the landing page reaches
#     every page), or README.md is longer than 400 lines (the reference
#     belongs in docs/).
#  4. README.md or a docs/*.md names a config key in backquotes
#     (`zero_optimization.offload_optimizer.ratio`, `strata.hbm_budget`) that
#     the schema (src/config/schema.cc) does not declare, or that names no
#     section of it. Names of the Python package (`strata.launch`,
#     `strata.init`, ...; its modules and what python/strata/__init__.py
#     defines or imports) are not keys.
#  5. A `strata <subcommand>` command line in README.md or a docs/*.md (in
#     backquotes or a code block, continued lines joined) passes an option
#     that the subcommand's --help does not list. Needs the built command
#     (STRATA_BUILD_DIR, default build/); without it this check is skipped,
#     saying so.
#   scripts/check_docs.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python3 - "$ROOT" "${STRATA_BUILD_DIR:-$ROOT/build}" <<'PY'
import glob, os, re, subprocess, sys

root = sys.argv[1]
cli = os.path.join(sys.argv[2], "apps", "strata", "strata")
os.chdir(root)
errors = []

TOP = "apps|bench|cmake|configs|docs|examples|include|python|scripts|src|tests"
PATH_RE = re.compile(r"(?<![\w./@-])(?:%s)/[\w.*/{}<>,+-]*" % TOP)


def expand_braces(p):
    m = re.search(r"\{([^{}]*)\}", p)
    if not m:
        return [p]
    out = []
    for alt in m.group(1).split(","):
        out += expand_braces(p[: m.start()] + alt + p[m.end():])
    return out


def exists(p):
    must_be_dir = p.endswith("/")
    if "..." in p:  # "src/..." : the folder before the ellipsis
        p = p[: p.index("...")]
        p = p[: p.rfind("/") + 1] if "/" in p else p
        must_be_dir = True
    p = re.sub(r"<[^<>]*>", "*", p)
    for q in expand_braces(p):
        q = q.rstrip("/") or q
        hits = glob.glob(q) if any(c in q for c in "*?[") else ([q] if os.path.exists(q) else [])
        if not hits:
            return False
        if must_be_dir and not any(os.path.isdir(h) for h in hits):
            return False
    return True


docs = ["README.md"] + sorted(glob.glob("docs/*.md"))
paths = 0
for doc in docs:
    for n, line in enumerate(open(doc, encoding="utf-8"), 1):
        for m in PATH_RE.finditer(line):
            p = m.group(0)
            # Sentence punctuation and a dangling "," or "." are not part of it.
            p = re.sub(r"[.,:;]+$", "", p)
            if p.endswith(">") and "<" not in p:
                p = p[:-1]
            paths += 1
            if not exists(p):
                errors.append(f"{doc}:{n}: names {p}, which does not exist")

REF_RE = re.compile(
    r"\b(?:issues?|items?|PRs?|pull requests?|tickets?|tasks?|bugs?)\s*#\s*\d+|\(#\d+\b",
    re.IGNORECASE)
ref_files = docs[:]
for top in ("src", "tests", "bench"):
    for dirpath, _, names in os.walk(top):
        ref_files += [os.path.join(dirpath, f) for f in names]
for f in ref_files:
    try:
        text = open(f, encoding="utf-8").read()
    except (UnicodeDecodeError, OSError):
        continue  # binary test data
    for n, line in enumerate(text.splitlines(), 1):
        for m in REF_RE.finditer(line):
            errors.append(f"{f}:{n}: \"{m.group(0)}\" refers to a work item; state the fact instead")

schema = open("src/config/schema.cc", encoding="utf-8").read()
keys = set(re.findall(r'^\s*\{"([A-Za-z0-9_.*]+)",', schema, re.M))
tops = sorted(k for k in keys if "." not in k)
init_py = open("python/strata/__init__.py", encoding="utf-8").read()
python_names = {os.path.splitext(os.path.basename(f))[0].lstrip("_")
                for f in glob.glob("python/strata/*")}
python_names |= set(re.findall(r"^(?:def|class)\s+(\w+)", init_py, re.M))
python_names |= set(re.findall(r"\bimport\s+([\w, ]+)", init_py)[0].replace(" ", "").split(",")
                    if re.search(r"\bimport\s+([\w, ]+)", init_py) else [])
for block in re.findall(r"from\s+\.[\w.]*\s+import\s+\(?([\w,\s]+)\)?", init_py):
    python_names |= {w for w in re.split(r"[,\s]+", block) if w}
KEY_RE = re.compile(r"`((?:%s)\.[A-Za-z0-9_.]+)`" % "|".join(map(re.escape, tops)))


def declared(k):
    if k in keys or any(x.startswith(k + ".") for x in keys):
        return True
    return any("*" in x and re.fullmatch(re.escape(x).replace(r"\*", "[^.]+"), k) for x in keys)


for doc in docs:
    for n, line in enumerate(open(doc, encoding="utf-8"), 1):
        for m in KEY_RE.finditer(line):
            k = m.group(1).rstrip(".")
            first = k.split(".")[1]
            if k.startswith("strata.") and (first in python_names or first[:1].isupper()
                                            or first == "h"):
                continue  # the Python package's strata.<name>, or strata.h
            if not declared(k):
                errors.append(f"{doc}:{n}: names the config key {k}, which the schema "
                              "(src/config/schema.cc) does not declare")

SUBCOMMANDS = {"bench adam", "bench accumulate", "bench fold", "bench nvme", "bench pcie",
               "bench comm", "tune nvme", "checkpoint info", "checkpoint export", "train", "plan",
               "info", "report"}
CMD_RE = re.compile(r"(?:^|[\s`/(\"'])strata ((?:bench|tune|checkpoint) [a-z]+|train|plan|info|"
                    r"report)\b")
options_of = {}
flags = 0
if os.access(cli, os.X_OK):
    for doc in docs:
        # Shell lines continued with a backslash, joined; numbered by their first.
        joined, start, pending = [], 0, ""
        for n, raw in enumerate(open(doc, encoding="utf-8").read().split("\n"), 1):
            if not pending:
                start = n
            if raw.rstrip().endswith("\\"):
                pending += raw.rstrip()[:-1] + " "
                continue
            joined.append((start, pending + raw))
            pending = ""
        for n, line in joined:
            for m in CMD_RE.finditer(line):
                sub = m.group(1)
                if sub not in SUBCOMMANDS:
                    continue
                if sub not in options_of:
                    r = subprocess.run([cli, *sub.split(), "--help"], stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
                    options_of[sub] = set(re.findall(r"--[a-z0-9][a-z0-9-]*", r.stdout))
                # This command's words: to the end of the backquoted span, a
                # shell separator or the next command.
                rest = re.split(r"[;|&`]|\bstrata\b", line[m.end():])[0]
                for flag in re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", rest):
                    flags += 1
                    if flag not in options_of[sub]:
                        errors.append(f"{doc}:{n}: `strata {sub} {flag}`: strata {sub} --help "
                                      "lists no such option")
else:
    print(f"docs check: {cli} is not built: the command lines' options are not checked")

readme = open("README.md", encoding="utf-8").read()
for page in docs[1:]:
    if page not in readme:
        errors.append(f"README.md: does not name {page}; link every page from the landing page")
if readme.count("\n") > 400:
    errors.append(f"README.md: {readme.count(chr(10))} lines, more than 400; move reference "
                  "material into a docs/ page")

for e in errors:
    print(e)
print(f"docs check: {paths} paths and {flags} command-line options in {len(docs)} docs, "
      f"{len(ref_files)} files searched for work-item references, {len(errors)} problem(s)")
sys.exit(1 if errors else 0)
PY
