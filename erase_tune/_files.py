"""Reading the user's YAML files (plans, search spaces) with one-line errors.

Only ``yaml.safe_load``: loading a file never executes code from it. A file is a few
kilobytes of settings, so anything far larger or deeper is refused before it can cost
memory or time: files over :data:`MAX_FILE_BYTES`, nesting deeper than :data:`MAX_DEPTH`
(a recursive alias is infinitely deep), more than :data:`MAX_VALUES` values (aliases can
repeat a subtree exponentially often), integers too long to convert. Mapping keys must be
strings, and each may appear once in its mapping: YAML itself would let the last of two
``dispatch:`` lines win silently, so a duplicated key is refused with its line and the line of
its first use. Every error names the file and fits on one line.

It also owns the other checks of what a user writes or names, kept free of torch, Optuna and
SQLAlchemy so the runtime can use them: :func:`name_problem` (a module or study name must be
visible, printable text: ``towers\u200b.0`` looks like ``towers.0`` and is not),
:func:`aux_weight_problem` (λ must stay a normal, squarable number in the training dtype),
and the output side, :func:`check_output` and :func:`write_atomic` (an ``-o`` never replaces
the study's own database, a device node or a directory, and is replaced whole or not at all).

Nesting is refused while the file is parsed, not after: PyYAML's scanner looks up to 1024
characters ahead for a possible key at every open bracket, so a file of nothing but ``[``
cost about a second before Python's recursion limit stopped it.
"""

from __future__ import annotations

import functools
import math
import os
import re
import stat
import tempfile
import unicodedata
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from erase_tune.errors import EraseTuneError, one_line, shown

__all__ = ["MAX_FILE_BYTES", "MAX_DEPTH", "MAX_VALUES", "read_text", "load_yaml", "load_arg", "name_problem",
           "aux_weight_problem", "check_output", "write_atomic"]

MAX_FILE_BYTES = 1 << 20
"""Largest plan or search-space file read (1 MiB)."""
MAX_DEPTH = 32
"""Deepest nesting of mappings and lists accepted in a file."""
MAX_VALUES = 100_000
"""Most values (scalars, mappings, lists, with aliases counted each time they are used)."""


def read_text(path: str | Path, what: str, error: type[EraseTuneError]) -> str:
    """The file's text, or ``error("<path>: <what> file not found")`` and the like."""
    p = Path(path)
    name = one_line(str(p), 300)
    try:
        # Non-blocking: opening a FIFO would otherwise wait forever for a writer.
        with os.fdopen(os.open(p, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)  # bounded: /dev/zero must not hang us either
    except FileNotFoundError:
        raise error(f"{name}: {what} file not found") from None
    except ValueError:  # a NUL byte in the path: no file can have that name
        raise error(f"{name}: not a file name (it holds a NUL character)") from None
    except OSError as e:
        raise error(f"{name}: cannot read {what} file: {one_line(e.strerror or str(e))}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise error(f"{name}: {what} file is larger than {MAX_FILE_BYTES // 1024} KiB; it should be a small YAML file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{name}: cannot read {what} file: not UTF-8 text (byte {e.start})") from None


def load_yaml(text: str, source: str, error: type[EraseTuneError]) -> Any:
    """Parse YAML safely; a syntax error becomes ``error("<source>: not valid YAML at line N: ...")``."""
    source = one_line(source, 300)
    if len(text) > MAX_FILE_BYTES:
        raise error(f"{source}: more than {MAX_FILE_BYTES // 1024} KiB of YAML; it should be a small file")
    try:
        data = yaml.load(text, Loader=_Loader)  # a SafeLoader, with a depth bound
    except _TooDeep:
        raise error(f"{source}: not valid YAML: nested more than {MAX_DEPTH} levels deep") from None
    except _Duplicate as e:
        raise error(f"{source}: line {e.line}: the key {shown(e.key)} appears twice in one mapping (first at line "
                    f"{e.first}); YAML would silently keep only the last: remove one") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise error(f"{source}: not valid YAML{where}: {one_line(problem)}") from None
    except RecursionError:
        raise error(f"{source}: not valid YAML: nested too deeply (at most {MAX_DEPTH} levels)") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise error(f"{source}: not valid YAML: a value cannot be read ({one_line(str(e).splitlines()[0])})") from None
    _check_shape(data, source, error)
    return data


def load_arg(text: str, source: str, error: type[EraseTuneError]) -> Any:
    """One value typed on a command line (``--arg key=value``), read as YAML within a file's
    bounds (a billion laughs in one argument would otherwise be repeated into every message and
    every JSON that shows it); text that YAML cannot read is kept as it is (``512-256-128``)."""
    source = one_line(source, 100)
    try:
        data = yaml.load(text, Loader=_Loader)
    except (yaml.YAMLError, ValueError):  # not YAML, or an integer too long: the text as typed
        return text
    except (_TooDeep, RecursionError):
        raise error(f"{source}: nested more than {MAX_DEPTH} levels deep") from None
    except _Duplicate as e:
        raise error(f"{source}: the key {shown(e.key)} appears twice") from None
    _check_shape(data, source, error)
    return data


class _TooDeep(Exception):
    """Raised by :class:`_Loader` past the nesting :func:`_check_shape` allows."""


_EXPONENT_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
"""``1e-3``, ``2.5e6``: floats to YAML 1.2 and to every reader of a config file, but strings to
PyYAML (YAML 1.1 wants a dot and a signed exponent), so ``aux_weight: 1e-3`` was refused as
"must be a number"."""


class _Duplicate(Exception):
    """Raised by :class:`_Loader` for a key given twice in one mapping."""

    def __init__(self, key: Any, line: int, first: int) -> None:
        super().__init__(key)
        self.key, self.line, self.first = key, line, first


_MERGE = "tag:yaml.org,2002:merge"


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that stops composing past the nesting :func:`_check_shape` allows
    (the document's root is at depth 1, a value inside MAX_DEPTH containers at MAX_DEPTH + 1)
    and refuses a key written twice in one mapping (keys brought in by a ``<<`` merge may be
    overridden: that is what a merge is for)."""

    _depth = 0

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE:
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise _Duplicate(key, line, seen[key])
                    seen[key] = line
                except TypeError:  # an unhashable key: SafeLoader's own error names it
                    continue
        return super().construct_mapping(node, deep)


    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH + 1:
                raise _TooDeep
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789"))


def _check_shape(data: Any, source: str, error: type[EraseTuneError]) -> None:
    """Refuse nesting deeper than MAX_DEPTH, more than MAX_VALUES values, non-string keys."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    count = 1
    while stack:
        value, path, depth = stack.pop()
        if not isinstance(value, (Mapping, list)):
            continue
        if depth >= MAX_DEPTH:
            raise error(f"{source}: {_bounded(path) or 'the file'} is nested more than {MAX_DEPTH} levels deep "
                        "(a recursive alias?)")
        count += len(value)
        if count > MAX_VALUES:  # checked before pushing, so the stack stays small too
            raise error(f"{source}: more than {MAX_VALUES} values (aliases count each time they are used)")
        if isinstance(value, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))
            continue
        for key, v in value.items():
            if not isinstance(key, str):
                where = _bounded(path) or "the top level"
                raise error(f"{source}: {where} has the key {shown(key)}: keys must be strings")
            stack.append((v, f"{path}.{_key(key)}" if path else _key(key), depth + 1))


def _bounded(path: str, limit: int = 200) -> str:
    """A path in the file for a message: 32 levels of 40-character keys would be a screenful."""
    return path if len(path) <= limit else path[: limit - 1] + "…"


def _key(key: str) -> str:
    """A mapping key as a path component: one line, bounded."""
    return one_line(key) if len(key) <= 40 else one_line(key[:39]) + "…"


# -- names -----------------------------------------------------------------------------------

_INVISIBLE_LETTERS = frozenset("\u115f\u1160\u3164\uffa0")
"""Hangul fillers: Unicode letters (so ``\\w`` and ``str.isidentifier`` accept them) that draw nothing."""


def name_problem(name: str, *, dotted: bool = False) -> str | None:
    """Why ``name`` is not a visible, printable name (None when it is); see :func:`_name_problem`.
    Short names are remembered: a plan's targets are checked on every plan built, and a search
    (``erase-tune check`` counting a space's plans) builds thousands of plans over a few names."""
    if isinstance(name, str) and len(name) <= 256:
        return _known_name_problem(name, dotted)
    return _name_problem(name, dotted=dotted)


@functools.lru_cache(maxsize=4096)
def _known_name_problem(name: str, dotted: bool) -> str | None:
    return _name_problem(name, dotted=dotted)


def _name_problem(name: str, *, dotted: bool = False) -> str | None:
    """Why ``name`` is not a visible, printable name (None when it is).

    Refused: control and format characters (zero-width spaces and joiners, bidi overrides,
    soft hyphens), invisible letters, whitespace other than a plain inner space, and text that
    Unicode compatibility normalisation (NFKC) changes, such as full-width letters or a
    combining accent written apart: each makes a name that looks like another. With
    ``dotted`` each dot-separated component must also be a Python identifier or a block
    index, as ``nn.Module`` names are.
    """
    if not name:
        return "is empty"
    if name != name.strip():
        return "begins or ends with white space"
    for i, c in enumerate(name):
        if c in _INVISIBLE_LETTERS or unicodedata.category(c) in ("Cc", "Cf", "Co", "Cs", "Cn", "Zl", "Zp") \
                or (c.isspace() and c != " "):
            return f"holds the invisible or control character U+{ord(c):04X} at position {i + 1}"
    if unicodedata.normalize("NFKC", name) != name:
        return "holds characters Unicode writes differently (full-width, ligatures, separate accents): retype it"
    if dotted:
        for part in name.split("."):
            if not (part.isidentifier() or (part.isascii() and part.isdigit())):
                return f"has the component {part!r}, which is neither an identifier nor a block index"
    return None


# -- numbers the runtime computes with ------------------------------------------------------------

_FLOAT_RANGE = {  # smallest normal and largest finite value (torch.finfo), without importing torch
    "float16": (6.103515625e-05, 65504.0),
    "bfloat16": (1.1754943508222875e-38, 3.3895313892515355e38),
    "float32": (1.1754943508222875e-38, 3.4028234663852886e38),
    "float64": (2.2250738585072014e-308, 1.7976931348623157e308),
}


def aux_weight_problem(weight: float, dtype: Any = "float32") -> str | None:
    """Why λ cannot weight a local loss in ``dtype`` (a torch dtype or its name); None if it can.

    λ scales the piece's loss and every gradient of the piece. Below the dtype's smallest
    normal number λ itself is 0 or keeps only a few bits, and the piece stops training; above
    the square root of its largest number, optimizers that square gradients (Adam's second
    moment) overflow to inf, and the loss soon after. ``float32`` is the default because plans
    are written before the model is known, and bfloat16 shares its range.
    """
    name = str(dtype).removeprefix("torch.")
    if name not in _FLOAT_RANGE:
        return None  # not a floating dtype the runtime trains in: nothing to compare with
    tiny, big = _FLOAT_RANGE[name]
    if not math.isfinite(weight) or weight <= 0:
        return "must be a finite number > 0"
    if weight < tiny:
        return (f"is below the smallest normal {name} number ({tiny:.3g}): the local loss and its gradients would be "
                "0 and the piece would never train")
    if weight > math.sqrt(big):
        return (f"is above {math.sqrt(big):.3g}, the square root of the largest {name} number: squared gradients "
                "(Adam) and soon the loss would overflow to inf")
    return None


# -- output paths -----------------------------------------------------------------------------------


def _same(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_output(path: str | Path, *, flag: str = "-o", protect: Iterable[str | Path] = (),
                 directory: bool = False) -> Path:
    """``path`` as a place to write, or one-line :class:`EraseTuneError` naming the problem.

    Nothing is written here. Refused: a name with a NUL; a directory where a file is wanted
    (or a file, device or FIFO where a directory is wanted); a device node, FIFO or socket
    (writing there would not make a file, or would block); a file in ``protect`` (the study's
    own database and its journal files), also when reached through a symlink or another
    relative spelling; for a file, a name ending in ``/``, ``/.`` or ``/..`` (a directory's
    spelling, also for one that does not exist yet, or for an existing file) and a parent
    directory that does not exist. ``path`` must be given as the user typed it: ``Path()``
    drops a trailing slash. A file is written through :func:`write_atomic`, so a symlink at
    ``path`` is replaced, never written through.
    """
    text = str(path)
    name = one_line(text, 300)
    if "\0" in text:
        raise EraseTuneError(f"{flag}: {name} is not a file name (it holds a NUL character)")
    if not text.strip():
        raise EraseTuneError(f"{flag}: the output path is empty")
    last = os.path.basename(text)
    if not directory and last in ("", ".", ".."):  # Path() drops a final "/" or "/.": a file would be written there
        raise EraseTuneError(f"{flag}: {name} names a directory (it ends in '{last or os.sep}'); give the path of "
                             "the file to write")
    p = Path(path)
    try:
        real = Path(os.path.realpath(p))
        for guarded in protect:
            g = Path(guarded)
            if real == Path(os.path.realpath(g)) or _same(p, g):
                raise EraseTuneError(f"{flag}: {name} is the study's own storage ({one_line(str(g), 200)}); "
                                     "writing there would destroy every trial: choose another file name")
        try:
            mode = os.stat(p).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None:
            if stat.S_ISDIR(mode) and not directory:
                raise EraseTuneError(f"{flag}: {name} is a directory; give the path of the file to write")
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                raise EraseTuneError(f"{flag}: {name} is a device node, not a file; give the path of a file")
            if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
                raise EraseTuneError(f"{flag}: {name} is a {'FIFO' if stat.S_ISFIFO(mode) else 'socket'}, not a file")
            if directory and not stat.S_ISDIR(mode):
                raise EraseTuneError(f"{flag}: {name} exists and is not a directory")
        parent = real.parent
        if not directory and not parent.is_dir():  # a directory to write in may be created
            raise EraseTuneError(f"{flag}: directory {one_line(str(parent), 300)} does not exist")
    except OSError as e:  # a name too long for the file system, a loop of symlinks, ...
        raise EraseTuneError(f"{flag}: {name}: {one_line(e.strerror or str(e))}") from None
    return p


def write_atomic(path: str | Path, data: bytes | str, *, flag: str = "-o", protect: Iterable[str | Path] = (),
                 mode: int = 0o666) -> Path:
    """Write ``data`` to ``path`` whole or not at all (a temporary file in the same directory,
    then ``os.replace``), after :func:`check_output`; an interrupted write leaves the old file.
    The file gets ``mode`` less the umask, as ``open()`` would give it."""
    path = check_output(path, flag=flag, protect=protect)
    parent = Path(os.path.realpath(path)).parent
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=parent)
    except OSError as e:
        raise EraseTuneError(f"{flag}: cannot write in {one_line(str(parent), 300)}: {e.strerror or e}") from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, mode & ~umask)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise EraseTuneError(f"{flag}: cannot write {one_line(str(path), 300)}: {e.strerror or e}") from None
    except BaseException:  # Ctrl-C mid-write: the old file stays, no temporary is left behind
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
