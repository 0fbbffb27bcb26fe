"""What the deploy tests read: the files under deploy/, their YAML documents, the containers
in them, and every ``erase-tune`` command line written anywhere in them.

Commands are found the way a reader would run them: shell text (README code blocks, RUN
lines, YAML strings such as a RayJob entrypoint, comments) is split like a POSIX shell
(``shlex``) with ``$(...)`` and ``${...}`` kept as opaque words; exec-form lists
(``[erase-tune, db, upgrade]``, ``CMD ["erase-tune", ...]``) are taken as argv; the string
after ``sh -c``/``bash -c`` is searched again. An ``erase-tune`` word (or a path ending in
``/erase-tune``) starts a command, which runs to the next shell operator.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERAY = DEPLOY / "kuberay"
README = DEPLOY / "README.md"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"

# The env files compose reads hold real secrets on a user's machine and are git-ignored
# (deploy/.gitignore): they are the user's, not part of what ships.
_USER_FILES = ("*.env",)


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def deploy_files() -> list[Path]:
    """Every file under deploy/, except the user's own env files."""
    return sorted(
        p for p in DEPLOY.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and not any(fnmatch.fnmatch(p.name, g) for g in _USER_FILES)
    )


def yaml_files() -> list[Path]:
    return [p for p in deploy_files() if p.suffix in (".yaml", ".yml")]


def load_docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def kuberay_objects() -> list[tuple[Path, dict]]:
    """(file, object) for every Kubernetes object under deploy/kuberay/ (not kustomize's own file)."""
    out = []
    for path in sorted(KUBERAY.rglob("*.yaml")):
        for doc in load_docs(path):
            if doc.get("kind") != "Kustomization":
                out.append((path, doc))
    return out


def objects_of_kind(kind: str) -> list[tuple[Path, dict]]:
    return [(p, d) for p, d in kuberay_objects() if d.get("kind") == kind]


def pod_templates(obj: dict) -> Iterator[tuple[str, dict]]:
    """(where, pod template) for every pod an object makes."""
    kind, spec = obj.get("kind"), obj.get("spec") or {}
    name = obj["metadata"]["name"]
    cluster = spec.get("rayClusterSpec") if kind == "RayJob" else spec if kind == "RayCluster" else None
    if cluster:
        yield f"{kind} {name} head", cluster["headGroupSpec"]["template"]
        for group in cluster.get("workerGroupSpecs") or []:
            yield f"{kind} {name} worker group {group['groupName']}", group["template"]
    if kind == "RayJob" and spec.get("submitterPodTemplate"):
        yield f"RayJob {name} submitter", spec["submitterPodTemplate"]
    if kind in ("Deployment", "StatefulSet", "Job", "DaemonSet"):
        yield f"{kind} {name}", spec["template"]


def containers(obj: dict) -> Iterator[tuple[str, dict, dict]]:
    """(where, container, pod spec) for every container and init container of an object."""
    for where, template in pod_templates(obj):
        pod = template["spec"]
        for c in (pod.get("initContainers") or []) + (pod.get("containers") or []):
            yield f"{where}, container {c.get('name')}", c, pod


# -- quantities -------------------------------------------------------------------------------

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}


def quantity(value: Any) -> float:
    """A Kubernetes resource quantity ("500m", "8Gi", 2) as a number."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([A-Za-z]*)", str(value).strip())
    if not m:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    number, suffix = float(m.group(1)), m.group(2)
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if suffix in _DECIMAL:
        return number * _DECIMAL[suffix]
    raise ValueError(f"not a Kubernetes quantity: {value!r}")


# -- the Dockerfile --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Instruction:
    line: int  # where it starts in the file
    keyword: str
    args: str


def dockerfile_instructions(text: str) -> list[Instruction]:
    """Instructions with their continuation lines joined (as Docker does: the backslash and
    newline go, comment lines inside a continuation are dropped)."""
    out: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending.append(line[:-1])
            continue
        pending.append(line)
        joined = "".join(pending).strip()
        pending = []
        keyword, _, args = joined.partition(" ")
        out.append(Instruction(start, keyword.upper(), args.strip()))
    return out


def dockerfile_stages(text: str) -> list[dict[str, Any]]:
    """Stages: their FROM (ARGs declared before the first FROM substituted), name, and instructions."""
    instructions = dockerfile_instructions(text)
    global_args: dict[str, str] = {}
    stages: list[dict[str, Any]] = []
    for ins in instructions:
        if ins.keyword == "FROM":
            words = ins.args.split()
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)",
                           lambda m: global_args.get(m.group(1) or m.group(2), m.group(0)), words[0])
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append({"from": image, "name": name, "instructions": []})
        elif not stages:
            if ins.keyword == "ARG":
                key, _, default = ins.args.partition("=")
                global_args[key] = default
        else:
            stages[-1]["instructions"].append(ins)
    return stages


def dockerignore_allows(patterns: list[str], path: str) -> bool:
    """Whether a .dockerignore keeps ``path`` (a file in the context) in the build context:
    the last pattern that matches the path or one of its parent directories decides."""
    parts = PurePosixPath(path).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    kept = True
    for raw in patterns:
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern[1:] if negate else pattern
        pattern = pattern.strip("/")
        for candidate in candidates:
            if _docker_match(pattern, candidate):
                kept = negate
                break
    return kept


def _docker_match(pattern: str, path: str) -> bool:
    # "**" matches any number of directories; "*" does not cross "/" (Go's filepath.Match).
    regex = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            regex += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            regex += ".*"
            i += 2
        elif pattern[i] == "*":
            regex += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            regex += "[^/]"
            i += 1
        else:
            regex += re.escape(pattern[i])
            i += 1
    return re.fullmatch(regex, path) is not None


# -- erase-tune command lines ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Command:
    where: str            # file and place, for the test id and messages
    argv: tuple[str, ...]  # what follows "erase-tune"

    @property
    def line(self) -> str:
        return shlex.join(("erase-tune", *self.argv))


_OPERATOR = re.compile(r"[;&|()<>\n]+")
_SUBSTITUTION = re.compile(r"\$\([^()]*\)|\$\{[^{}]*\}")
_SHELLS = {"sh", "bash", "dash", "zsh"}
# What can follow "erase-tune" in a command: its subcommands and global options.
FIRST_WORDS = ("start", "status", "export", "report", "dashboard", "db", "trial", "bench",
               "-v", "-q", "--version", "--help")
# Where erase-tune appears as a command in any text (not as a name such as erase-tune:0.1.0,
# job/erase-tune-ctr or "erase-tune[tune]", nor in prose such as "erase-tune is installed").
COMMAND_MENTION = re.compile(
    r"(?<![\w.\-])erase-tune[\"']?(?:\s*,\s*|\s+)[\"']?"
    r"(" + "|".join(re.escape(w) for w in FIRST_WORDS) + r")(?![\w-])"
)


def _is_erase_tune(word: str) -> bool:
    # The word, or the console script by path (.venv/bin/erase-tune); not a resource named
    # erase-tune, such as raycluster/erase-tune.
    path = PurePosixPath(word)
    return word == "erase-tune" or (path.name == "erase-tune" and path.parent.name == "bin")


def _opaque(text: str) -> str:
    # Innermost first, so that $(a $(b)) becomes one word.
    while True:
        new = _SUBSTITUTION.sub("SUBSTITUTED", text)
        if new == text:
            return text
        text = new


def shell_commands(text: str, where: str, prose: bool = False) -> list[Command]:
    """The erase-tune commands in a piece of shell. In ``prose`` (a comment line), only
    "erase-tune" followed by a subcommand or global option counts: "erase-tune is ..." is a
    sentence, not a command. Backticked spans in prose are inline code, read by _inline_code."""
    if prose:
        text = re.sub(r"`[^`\n]*`", " ", text)
    lexer = shlex.shlex(_opaque(text.replace("\\\n", " ")), posix=True, punctuation_chars=";&|()<>\n")
    lexer.whitespace = " \t\r"
    lexer.whitespace_split = True
    lexer.commenters = ""
    try:
        tokens = list(lexer)
    except ValueError as e:  # an unbalanced quote: prose, unless it names a command
        if COMMAND_MENTION.search(text):
            raise ValueError(f"{where}: cannot split {text!r} like a shell ({e})") from None
        return []
    words: list[str] = []
    comment = False
    for tok in tokens:  # a word starting with # begins a comment, up to the end of the line
        if "\n" in tok and _OPERATOR.fullmatch(tok):
            comment = False
        elif tok.startswith("#"):
            comment = True
        if not comment:
            words.append(tok)
    return _from_words(words, where, prose)


def _from_words(words: list[str], where: str, prose: bool = False) -> list[Command]:
    out: list[Command] = []
    for i, word in enumerate(words):
        if _is_erase_tune(word) and not (i and words[i - 1] == "install"):
            argv = []
            for w in words[i + 1:]:
                if _OPERATOR.fullmatch(w):
                    break
                argv.append(w)
            if not prose or (argv and argv[0] in FIRST_WORDS):
                out.append(Command(where, tuple(argv)))
        elif i >= 2 and words[i - 1] == "-c" and PurePosixPath(words[i - 2]).name in _SHELLS:
            out.extend(shell_commands(word, where, prose))
    return out


def exec_form(words: list[Any], where: str) -> list[Command]:
    """Commands in an exec-form list (a container's command/args, compose's command, CMD)."""
    if not all(isinstance(w, (str, int, float)) for w in words):
        return []
    words = [str(w) for w in words]
    out = []
    for i, word in enumerate(words):
        if _is_erase_tune(word):
            out.append(Command(where, tuple(words[i + 1:])))
            break
        if i >= 1 and words[i - 1] == "-c" and PurePosixPath(words[0]).name in _SHELLS:
            out.extend(shell_commands(word, where))
    return out


def _inline_code(text: str, where: str) -> list[Command]:
    """Backticked spans that start with erase-tune (in Markdown prose and in comments)."""
    out = []
    for span in re.findall(r"`([^`\n]+)`", text):
        if _is_erase_tune(span.split()[0]):
            # In prose a lone `erase-tune` is the tool's name, not a command line.
            out.extend(shell_commands(span, where, prose=True))
    return out


def _yaml_comments(text: str) -> Iterator[tuple[int, str]]:
    for number, line in enumerate(text.splitlines(), 1):
        quote = None
        for i, ch in enumerate(line):
            if quote:
                quote = None if ch == quote else quote
            elif ch in "'\"" and (i == 0 or line[i - 1] in " [{,:"):
                quote = ch
            elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
                yield number, line[i + 1:]
                break


def _walk_yaml(node: Any, path: str, where: str) -> list[Command]:
    out = []
    if isinstance(node, dict):
        for key, value in node.items():
            out.extend(_walk_yaml(value, f"{path}.{key}" if path else str(key), where))
    elif isinstance(node, list):
        found = exec_form(node, f"{where} {path}")
        out.extend(found)
        for i, value in enumerate(node):
            if not (found and isinstance(value, str)):  # an exec form's words are its argv
                out.extend(_walk_yaml(value, f"{path}[{i}]", where))
    elif isinstance(node, str) and re.search(r"\s", node.strip()):
        # A lone word such as "erase-tune" is a name (labels, metadata); a command has words.
        out.extend(shell_commands(node, f"{where} {path}"))
    return out


def yaml_commands(path: Path) -> list[Command]:
    text = path.read_text()
    out = []
    for i, doc in enumerate(load_docs(path)):
        out.extend(_walk_yaml(doc, "", f"{rel(path)} doc {i}"))
    for number, comment in _yaml_comments(text):
        where = f"{rel(path)}:{number} (comment)"
        out.extend(shell_commands(comment, where, prose=True))
        out.extend(_inline_code(comment, where))
    return out


def dockerfile_commands(path: Path) -> list[Command]:
    out = []
    text = path.read_text()
    for ins in dockerfile_instructions(text):
        where = f"{rel(path)}:{ins.line} {ins.keyword}"
        if ins.keyword in ("RUN", "CMD", "ENTRYPOINT", "HEALTHCHECK", "SHELL"):
            args = ins.args
            while args.startswith("--"):  # RUN --mount=... and HEALTHCHECK --interval=...
                args = args.split(None, 1)[1] if " " in args else ""
            if ins.keyword == "HEALTHCHECK" and args.upper().startswith("CMD "):
                args = args[4:].strip()
            if args.startswith("["):
                out.extend(exec_form(json.loads(args), where))
            else:
                out.extend(shell_commands(args, where))
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("#"):
            comment = line.lstrip()[1:]
            out.extend(shell_commands(comment, f"{rel(path)}:{number} (comment)", prose=True))
            out.extend(_inline_code(comment, f"{rel(path)}:{number} (comment)"))
    return out


def markdown_commands(path: Path) -> list[Command]:
    """Commands in fenced code blocks, and inline code spans in the prose."""
    out = []
    text = path.read_text()
    fence = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
    for m in fence.finditer(text):
        number = text.count("\n", 0, m.start()) + 1
        out.extend(shell_commands(m.group(1), f"{rel(path)}:{number} (code block)"))
    prose = fence.sub("", text)
    out.extend(_inline_code(prose, f"{rel(path)} (inline code)"))
    return out


def commands_in(path: Path) -> list[Command]:
    if path.suffix in (".yaml", ".yml"):
        return yaml_commands(path)
    if path.suffix == ".md":
        return markdown_commands(path)
    if path.name == "Dockerfile":
        return dockerfile_commands(path)
    return []


def all_commands() -> list[Command]:
    return [c for p in deploy_files() for c in commands_in(p)]
