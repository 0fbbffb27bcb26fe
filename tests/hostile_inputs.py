"""Hypothesis strategies for hostile and careless input: plan files, search-space files.

Both file kinds are generated the same way. A grammar close to the real schema draws a
document field by field; every field's value is drawn from a pool of valid values and a
pool of values the schema must refuse (wrong types for every field, out-of-range and huge
integers, control characters, odd unicode). The document is then written as YAML text by
:func:`emit`, which can also place text no Python value produces: integers of thousands of
digits, deep nesting, anchors and aliases (recursive ones too), tags. Finally the text may
be mutated byte-wise (a careless edit, a truncated copy, pasted garbage).

Each drawn document carries an expectation: ``"bad"`` when a field was drawn from a pool
the schema must refuse (so the file must be refused, whatever else it holds), ``"any"``
otherwise. Mutated text is always ``"any"``: the property there is only "a correct run or
one line".
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import yaml
from hypothesis import strategies as st

__all__ = ["CTR_NAMES", "CTR_RUNS", "TINY_CTR", "TOY_NAMES", "TOY_RUNS", "Alias", "Anchor", "Doc", "Raw", "emit",
           "huge_int_text", "mutated", "odd_text", "one_in", "plan_docs", "space_docs"]


# -- YAML text from a tree ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Raw:
    """YAML text written verbatim (what no Python value would be dumped as)."""

    text: str


@dataclasses.dataclass(frozen=True)
class Anchor:
    name: str
    value: Any


@dataclasses.dataclass(frozen=True)
class Alias:
    name: str


# Characters PyYAML accepts unescaped inside a double-quoted scalar (its reader refuses the
# others anywhere in a stream, so they are written as escapes and still reach the loader).
def _plain_char(c: str) -> bool:
    o = ord(c)
    return (0x20 <= o <= 0x7E or 0xA0 <= o <= 0xD7FF or 0xE000 <= o <= 0xFFFD or o >= 0x10000) and c not in '"\\'


def _quoted(s: str) -> str:
    out = []
    for c in s:
        if c == '"':
            out.append('\\"')
        elif c == "\\":
            out.append("\\\\")
        elif _plain_char(c):
            out.append(c)
        elif ord(c) <= 0xFF:
            out.append(f"\\x{ord(c):02x}")
        elif ord(c) <= 0xFFFF:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(f"\\U{ord(c):08x}")
    return '"' + "".join(out) + '"'


def emit(value: Any) -> str:
    """``value`` as flow-style YAML; strings always double-quoted, so ``"yes"`` stays a string."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, Anchor):
        return f"&{value.name} {emit(value.value)}"
    if isinstance(value, Alias):
        return f"*{value.name}"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan"
        if math.isinf(value):
            return ".inf" if value > 0 else "-.inf"
        text = repr(value)
        return text if "." in text or "e" not in text else text.replace("e", ".0e", 1)  # YAML 1.1 needs the dot
    if isinstance(value, str):
        return _quoted(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)}: {emit(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(emit(v) for v in value) + "]"
    raise TypeError(f"cannot emit {type(value).__name__}")


def _key(k: Any) -> str:
    if isinstance(k, (Raw, Anchor, Alias)) or not isinstance(k, (list, tuple, dict)):
        return emit(k)
    return "? " + emit(k)  # a complex key: PyYAML refuses it as unhashable


def _plain(value: Any) -> bool:
    """Whether ``yaml.safe_dump`` can write ``value`` (no Raw/Anchor/Alias, plain keys)."""
    if isinstance(value, (Raw, Anchor, Alias)):
        return False
    if isinstance(value, dict):
        return all(isinstance(k, (str, int, float, bool, type(None))) and _plain(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (str, int, float, bool)) and (
        not isinstance(value, int) or abs(value) < 10**4000)


def render(tree: Any, block: bool) -> str:
    """The document as YAML: block style through PyYAML's dumper where it can, else flow style."""
    if block and _plain(tree):
        return yaml.safe_dump(tree, sort_keys=False, allow_unicode=True)
    return emit(tree) + "\n"


@dataclasses.dataclass(frozen=True)
class Doc:
    """A generated file: its text, and whether the schema must refuse it (``"bad"``) or
    may accept it (``"any"``); ``why`` names what made it bad, for failure messages."""

    text: str
    expect: str
    why: str = ""


# -- values -----------------------------------------------------------------------------------

CONTROL = "".join(map(chr, range(0x20))) + "\x7f\x85\u2028\u2029"
ODD = ("\u202e", "\u200b", "\ufeff", "\xa0", "\u0301", "é", "ß", "İ", "٣", "🙂", "\U000e0041", "\ud800", "中")
"""Odd unicode: bidi override, zero-width space, BOM, no-break space, a combining accent,
letters that change under case folding, an Arabic digit, an emoji, a tag character, a
lone surrogate, a CJK letter."""


def huge_int_text(digits: int, sign: str = "") -> Raw:
    """An integer literal of ``digits`` digits (past 4300 Python refuses to convert it)."""
    return Raw(sign + "9" * digits)


def odd_text(min_size: int = 0) -> st.SearchStrategy[str]:
    """Short text mixing ASCII, control characters and odd unicode."""
    return st.text(st.one_of(st.sampled_from("abc.:_-0123456789 "), st.sampled_from(CONTROL),
                             st.sampled_from(ODD)), min_size=min_size, max_size=12)


HUGE_INTS = [2**31, 2**32, 2**40, 2**63, 2**64, 10**12, 10**30, -(10**12), 10**300]
HUGE_RAW = [huge_int_text(n) for n in (4300, 4301, 5000, 20000)] + [huge_int_text(5000, "-"), Raw("0x" + "f" * 5000)]
DEEP = [Raw("[" * n + "]" * n) for n in (33, 100, 600, 3000)] + [Raw("{a: " * 200 + "1" + "}" * 200)]
RECURSIVE = [Raw("&r [*r]"), Raw("&r {x: *r}"), Raw("&r [1, [2, *r]]"), Raw("*undefined")]
TAGGED = [Raw("!!binary aGVsbG8="), Raw("!!set {a, b}"), Raw("!!python/object/apply:os.system ['true']"),
          Raw("2020-01-01"), Raw("2020-01-01 10:00:00"), Raw("!!float 1e400"), Raw("1.0e400"), Raw("-1.0e400"),
          Raw("!!int '3'"), Raw("!!str 3"), Raw("190:20:30"), Raw("0b101"), Raw("0o17"), Raw("~"), Raw("<<")]
"""Tags and YAML 1.1 scalars: the first three no field takes, the others fit some fields
(sexagesimal 190:20:30 is an integer, ``~`` is null, ``!!int '3'`` is 3)."""


def hostile_values(containers: bool = True) -> st.SearchStrategy[Any]:
    """Values no typed field accepts: huge and unreadable integers, deep nesting, recursive and
    undefined aliases, tags; and, unless ``containers`` is false (for a field that is itself a
    list or mapping, where an empty one is valid), containers where a scalar belongs."""
    return st.one_of(
        st.sampled_from(HUGE_RAW + DEEP + RECURSIVE + TAGGED[:3]),
        st.sampled_from([[], {}, [[1]], {"a": {"b": 1}}, [None]] if containers else [[[1]], [None]]),
    )


def _wrong(*extra: Any, containers: bool = True) -> st.SearchStrategy[Any]:
    """Wrong values for a typed field: ``extra`` (the field's own) and :func:`hostile_values`."""
    return st.one_of(st.sampled_from(list(extra)), hostile_values(containers)) if extra else hostile_values(containers)


def one_in(n: int) -> st.SearchStrategy[bool]:
    """True about once in ``n`` draws. (A middle value: Hypothesis draws 0 and the bounds more
    often than others, which would make a rare fault common.)"""
    return st.integers(0, n - 1).map(lambda i: i == n // 2)


@st.composite
def field(draw: Any, valid: st.SearchStrategy[Any], bad: st.SearchStrategy[Any], why: str, odds: int = 8) -> tuple:
    """(value, bad?, why) of one field: from the refused pool one time in ``odds``, so that a
    good share of documents is valid throughout and gets past the schema to the model."""
    if draw(one_in(odds)):
        return draw(bad), True, why
    return draw(valid), False, ""


def refused(bad: st.SearchStrategy[Any], why: str) -> st.SearchStrategy[tuple]:
    """(value, True, why): a value from the refused pool, always."""
    return bad.map(lambda v: (v, True, why))


# -- plans -----------------------------------------------------------------------------------

TOY_NAMES = ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "blocks.0.fc", "blocks.2.fc", "towers.0",
             "towers.1", "towers.2", "towers.0.0", "towers.1.2", "over", "blocks", "towers"]
TOY_RUNS = ["blocks.0:2", "blocks.1:4", "blocks.0:4", "blocks.2:3", "towers.0:2", "towers.1:3", "towers.0.0:2",
            "towers.2.1:3"]
CTR_NAMES = [f"subarchs.{i}" for i in range(6)] + ["subarchs.0.model", "subarchs.4.down", "subarchs.5.attn", "over",
                                                    "dense", "sparse", "interaction", "subarchs"]
CTR_RUNS = ["subarchs.0:2", "subarchs.2:5", "subarchs.0.model.0:3", "dense.model.0:2", "subarchs.4.down.0:3"]


def target_pools(names: list[str], runs: list[str]) -> tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]:
    """Targets: names and runs of the model, well-formed ones it lacks; and targets the plan
    schema refuses before any model is seen."""
    well_formed = st.one_of(
        st.sampled_from(names + runs), st.sampled_from(names + runs), st.sampled_from(names + runs),
        st.sampled_from(["nope", "blocks.9", "towers.0:9", "layers.0:100000", "a.b.c.d.e.f", "blöcks.0", "٣.0:2",
                         "subarchs.7", "x" * 5000]),
        st.builds(lambda a, n: f"l{a}.{n}:{n + 20000}", st.integers(0, 3), st.integers(0, 10**8)),
    )
    bad = st.one_of(
        st.sampled_from(["", "a..b", ".a", "a.", "a b", "blocks.2:1", "blocks.1:1", "layers.0:100001",
                         "layers.0:100000000000", "layers.99999999999999999999:1", "a.-1:2", "x" * 100_000 + "!",
                         "blocks.0:2:3", "a.٣:٥", "blocks.0 : 2"]),
        odd_text(1).filter(lambda s: any(c in CONTROL for c in s)),
        _wrong(0, 1, -1, 1.5, True, None, 10**30),
    )
    return well_formed, bad


def targets(names: list[str], runs: list[str]) -> st.SearchStrategy[tuple]:
    return field(*target_pools(names, runs), "module")


def stream_pools(low: int) -> tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]:
    return st.integers(low, 4), _wrong(*([0] if low else []), -1, 65, 2**31, 10**12, "1", 1.0, True, False, None,
                                       *HUGE_INTS)


def bool_pools() -> tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]:
    return st.booleans(), _wrong(0, 1, "true", "yes", None, 1.0)


def booleans(name: str) -> st.SearchStrategy[tuple]:
    return field(*bool_pools(), name)


def aux_pools() -> tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]:
    return (st.sampled_from([0.1, 1, 2.5, 1e-3, 7, 1e6]),
            _wrong(0, -1, 0.0, -0.5, math.inf, math.nan, "x", "1", True, None, Raw("1.0e400"), 10**400))


@st.composite
def entry(draw: Any, names: list[str], runs: list[str], placement: bool) -> tuple:
    """A cut (bare string or mapping) or a placement, as (value, bad?, why): valid, or with
    one fault (a refused target or field value, a required field missing, an unknown
    field, an entry that is not a mapping)."""
    fault = draw(st.sampled_from(["module", "missing", "unknown", "type", "field"])) if draw(one_in(8)) else None
    well_formed, bad_target = target_pools(names, runs)
    module = draw(bad_target if fault == "module" else well_formed)
    if fault == "type":
        return draw(_wrong(5, "", None, True)), True, "an entry that is not a mapping"
    if not placement and fault in (None, "module") and draw(one_in(4)):
        return module, fault is not None, "module"  # the bare-string shorthand of a cut
    fields: dict[str, tuple] = {"module": (well_formed, bad_target)}
    if placement:
        fields["stream"] = stream_pools(1)
    else:
        fields.update(stream=stream_pools(0), aux_weight=aux_pools(), graph=bool_pools())
    out: dict[Any, Any] = {"module": module}
    for name, (ok, _) in list(fields.items())[1:]:
        if placement or draw(st.booleans()):
            out[name] = draw(ok)
    why = fault or ""
    if fault == "missing":
        required = ["module", "stream"] if placement else ["module"]
        gone = draw(st.sampled_from(required))
        out.pop(gone, None)
        why = f"{gone} missing"
    elif fault == "unknown":
        key = draw(st.one_of(st.sampled_from(["modul", "weight", "streams", 1, None, True, 1.5]), odd_text(1)))
        if key in fields:
            return out, False, ""
        out[key] = draw(st.integers(0, 3))
        why = f"unknown field {key!r}"
    elif fault == "field":
        name = draw(st.sampled_from(list(fields)[1:]))
        out[name] = draw(fields[name][1])
        why = name
    return out, fault is not None, why


def provenance() -> st.SearchStrategy[tuple]:
    scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**63) + 1, 2**63 - 1), st.floats(allow_nan=True),
                       odd_text())
    plain = st.dictionaries(odd_text(), st.one_of(scalar, st.lists(scalar, max_size=3),
                                                  st.dictionaries(odd_text(), scalar, max_size=3)), max_size=4)
    bad = st.one_of(
        st.sampled_from([5, "x", [1], True, {"a": {"b": {"c": 1}}}, {"a": [[1]]}, {"a": 2**64}, {"a": -(2**64)},
                         {"a": Raw("2020-01-01")}, {"a": Raw("!!binary aGVsbG8=")}, {1: "x"}, {"a": {2: "x"}},
                         {"a": huge_int_text(5000)}, Raw("!!set {a, b}")]),
        st.sampled_from(RECURSIVE + DEEP),
    )
    return field(st.one_of(st.none(), plain), bad, "provenance")


TOP_PLAN = ("version", "num_streams", "dispatch", "whole_step_graph", "find_unused_parameters", "cuts", "placements",
            "provenance")


@st.composite
def plan_tree(draw: Any, names: list[str] = TOY_NAMES, runs: list[str] = TOY_RUNS) -> tuple:
    """A plan document as a Python tree, with (bad?, why)."""
    tree: dict[Any, Any] = {}
    reasons: list[str] = []

    def put(name: str, drawn: tuple) -> None:
        value, bad, why = drawn
        tree[name] = value
        if bad:
            reasons.append(why)

    if draw(one_in(4)):
        put("version", draw(field(st.just(1), _wrong(2, 0, -1, "1", 1.0, True, None, 10**30), "version")))
    for kind, most in (("cuts", 3), ("placements", 2)):
        if not draw(one_in(5)):
            if draw(one_in(11)):
                put(kind, draw(field(st.none(), _wrong(5, 0, False, "", "x", {"module": "a"}, True, containers=False), kind)))
                continue
            entries = draw(st.lists(entry(names, runs, kind == "placements"), max_size=most))
            tree[kind] = [e for e, _, _ in entries]
            reasons += [f"{kind}[{i}]: {w}" for i, (_, b, w) in enumerate(entries) if b]
    # Enough side streams for the entries' stream ids, mostly (a plan naming a stream it
    # lacks is refused too, but is no more interesting the hundredth time).
    used = [e.get("stream") for k in ("cuts", "placements") if isinstance(tree.get(k), list)
            for e in tree[k] if isinstance(e, dict)]
    need = max([u for u in used if type(u) is int and 0 <= u <= 4], default=0)
    if need or draw(st.booleans()):
        low = 0 if draw(one_in(8)) else need
        put("num_streams", draw(field(st.integers(low, 4), _wrong(-1, 65, 10**12, 2**64, "2", 2.0, True, None,
                                                                 *HUGE_INTS), "num_streams")))
    if draw(st.booleans()):
        put("dispatch", draw(field(st.sampled_from(["blocking", "threaded", "deferred"]),
                                   _wrong("fast", "Blocking", "", 1, None, True), "dispatch")))
    for flag in ("whole_step_graph", "find_unused_parameters"):
        if draw(one_in(4)):
            put(flag, draw(booleans(flag)))
    if draw(one_in(4)):
        put("provenance", draw(provenance()))
    if draw(one_in(13)):
        key = draw(st.one_of(st.sampled_from(["objectives", "seeds", "cut", "Cuts", 1, None, True, 2.5,
                                              Raw("2020-01-01")]), odd_text(1)))
        if key not in TOP_PLAN:
            tree[key] = draw(st.sampled_from([5, "x", None, []]))
            reasons.append(f"unknown field {key!r}")
    return tree, reasons


@st.composite
def with_alias(draw: Any, tree: Any) -> Any:
    """``tree`` with one value anchored and a later value (maybe inside it: recursion) an alias."""
    slots: list[tuple] = []

    def walk(node: Any, path: tuple) -> None:
        slots.append(path)
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*path, k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, (*path, i))

    walk(tree, ())
    if len(slots) < 2:
        return tree
    a = draw(st.integers(1, len(slots) - 1))
    b = draw(st.integers(a, len(slots) - 1))
    anchor, alias = slots[a], slots[b]

    def rebuild(node: Any, path: tuple) -> Any:
        if path == alias and path != anchor:
            return Alias("a")
        if isinstance(node, dict):
            out = {k: rebuild(v, (*path, k)) for k, v in node.items()}
        elif isinstance(node, list):
            out = [rebuild(v, (*path, i)) for i, v in enumerate(node)]
        else:
            out = node
        return Anchor("a", out) if path == anchor else out

    return rebuild(tree, ())


@st.composite
def documents(draw: Any, trees: st.SearchStrategy[tuple]) -> Doc:
    """A document from ``trees``, written as YAML, sometimes with an alias or a hostile value
    in place of a field's, sometimes with its text mutated."""
    tree, reasons = draw(trees)
    reasons = list(reasons)
    if draw(one_in(10)) and isinstance(tree, dict) and tree:
        key = draw(st.sampled_from(list(tree)))
        tree[key] = draw(st.sampled_from(HUGE_RAW + DEEP + RECURSIVE))
        reasons.append(f"{key!r}: hostile YAML value")
    unsure = draw(one_in(12))
    if unsure:  # an alias repeats a value where another was drawn: valid or not, nothing to expect
        tree = draw(with_alias(tree))
    if draw(one_in(12)) and isinstance(tree, dict) and tree:  # a tagged or odd scalar: valid in some fields
        tree[draw(st.sampled_from(list(tree)))] = draw(st.sampled_from(TAGGED))
        unsure = True
    if draw(one_in(41)):
        tree, reasons, unsure = draw(st.sampled_from([5, "x", [1, 2], None, True, 1.5, Raw("")])), ["not a mapping"], False
    text = render(tree, block=draw(st.booleans()))
    expect = "bad" if reasons and not unsure else "any"
    if draw(one_in(10)):
        return Doc(draw(mutated(text)), "any", "mutated")
    return Doc(text, expect, "; ".join(map(str, reasons)))


SNIPPETS = ["\n", "\t", "\x00", "\x1b[2J", "\r", "\ufeff", "\u2028", "\x85", "&a ", "*a", "*b", "[", "]", "{", "}",
            ": ", "- ", "? ", ",", "#", "'", '"', "|\n", ">\n", "~", "!!binary ", "!!python/object/apply:os.system ",
            "<<: *a\n", "%YAML 1.1\n---\n", "---\n", "...\n", "9" * 5000, "[" * 600, "{" * 200, "&a [*a]",
            "\ud800", "🙂", "x" * 10_000, "\\", "%", "@", "`"]


@st.composite
def mutated(draw: Any, text: str) -> str:
    """``text`` after one to three careless edits: insert a snippet, delete, duplicate, cut off."""
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(text)))
        j = draw(st.integers(i, min(len(text), i + 40)))
        op = draw(st.integers(0, 3))
        if op == 0:
            text = text[:i] + draw(st.one_of(st.sampled_from(SNIPPETS), odd_text(1))) + text[i:]
        elif op == 1:
            text = text[:i] + text[j:]
        elif op == 2:
            text = text[:j] + text[i:j] + text[j:]
        else:
            text = text[:i]
    return text


def plan_docs(names: list[str] = TOY_NAMES, runs: list[str] = TOY_RUNS) -> st.SearchStrategy[Doc]:
    return documents(plan_tree(names, runs))


# -- search spaces --------------------------------------------------------------------------

TINY_CTR = {"batch": 16, "num_tables": 2, "rows": 10, "train_batches": 1}
"""The smallest CTR workload: building, probing and sampling it takes milliseconds."""

_TINY_VALUES = {"batch": st.integers(1, 32), "num_tables": st.integers(1, 3), "rows": st.integers(1, 20),
                "train_batches": st.integers(1, 2), "eval_batches": st.integers(1, 2), "width": st.integers(1, 16),
                "depth": st.integers(1, 2), "emb_dim": st.integers(1, 8), "sub_out": st.integers(1, 8),
                "bag": st.integers(1, 2), "seed": st.integers(0, 2**32 - 1),
                "base_rate": st.sampled_from([0.1, 0.25, 0.9]), "lr": st.sampled_from([1e-3, 0.1, 1])}
# Far past each bound (or, for rows, past any machine's memory): refused before anything is built.
_HUGE_VALUES = {"batch": [2**21, 10**12], "num_tables": [1025, 10**9], "rows": [10**12, 2**40, 2**41, 10**30],
                "train_batches": [2**21, 10**12], "eval_batches": [2**21], "width": [2**17, 10**6],
                "depth": [65, 10**9], "emb_dim": [2**15, 10**9], "sub_out": [2**17], "bag": [1025, 10**9],
                "seed": [2**32, 2**40, -1], "base_rate": [0, 1, -0.5, 2], "lr": [0, -1, 10**400, math.inf, math.nan]}


@st.composite
def workload_args(draw: Any) -> tuple:
    args: dict[Any, Any] = dict(TINY_CTR)
    reasons = []
    for name in draw(st.lists(st.sampled_from(sorted(_TINY_VALUES)), max_size=3, unique=True)):
        if not draw(one_in(10)):
            args[name] = draw(_TINY_VALUES[name])
        else:
            wrong = ["8", True, None, "", *HUGE_RAW[:2]] + ([8.5] if name != "lr" else [])  # lr=8.5 is a valid rate
            args[name] = draw(st.one_of(st.sampled_from(_HUGE_VALUES[name]), _wrong(*wrong)))
            reasons.append(f"workload.args.{name}")
    if draw(one_in(11)):
        key = draw(st.one_of(st.sampled_from(["bogus", "Batch", 1, None]), odd_text(1)))
        if key not in _TINY_VALUES:
            args[key] = 1
            reasons.append(f"workload.args: unknown {key!r}")
    if draw(one_in(13)):
        args["data"] = draw(st.sampled_from(["/etc/passwd", "/nonexistent.tsv", "a\x00b", "", "/"]))
        reasons.append("workload.args.data")
    return args, reasons


@st.composite
def space_tree(draw: Any) -> tuple:
    """A search-space document around the tiny CTR workload, with (bad?, why)."""
    tree: dict[Any, Any] = {}
    reasons: list[str] = []

    def put(into: dict, name: str, drawn: tuple) -> None:
        value, bad, why = drawn
        into[name] = value
        if bad:
            reasons.append(why)

    args, why = draw(workload_args())
    reasons += why
    shape = draw(st.integers(0, 13))
    if shape == 6:
        put(tree, "workload", draw(refused(_wrong(5, "", [], None, True, {"args": {}}, {"name": 5},
                                                                 {"name": ""}, {"name": "ctr", "args": 0},
                                                                 {"name": "ctr", "args": []},
                                                                 {"name": "ctr", "args": "x"},
                                                                 {"name": "ctr", "bogus": 1}), "workload")))
    elif shape == 7:
        tree["workload"] = {"name": draw(st.sampled_from(["nosuch", "nosuch_pkg.mod:make", "erase_tune.workloads.ctr:nope",
                                                          "tests.runtime.models:Toy", "ctr\n", "a:b:c", ":", "ctr "])),
                            "args": args}
        reasons.append("workload.name")
    else:
        wl: dict[str, Any] = {"name": "ctr", "args": args}
        if draw(one_in(9)):
            put(wl, "working_dir", draw(field(st.sampled_from([".", "/tmp", "nonexistent-dir"]),
                                              _wrong(5, "", "a\x00b", True), "workload.working_dir", odds=20)))
        if draw(one_in(9)):
            put(wl, "py_modules", draw(field(st.sampled_from([[], ["."], None]),
                                             _wrong(5, 0, "", "x", [5], [""], ["a\x00b"], containers=False), "workload.py_modules", odds=20)))
        tree["workload"] = wl

    if not draw(one_in(5)):
        cuts: dict[Any, Any] = {}
        if draw(one_in(16)):
            put(tree, "cuts", draw(field(st.none(), _wrong(5, 0, "", False, [1], "x", containers=False), "cuts")))
        else:
            if not draw(one_in(4)):
                names = draw(st.lists(st.sampled_from(CTR_NAMES[:6] + CTR_RUNS[:2]), max_size=4, unique=True))
                if draw(one_in(7)):
                    drawn = draw(targets(CTR_NAMES, CTR_RUNS))
                    names.append(drawn[0])
                    reasons += [f"cuts.candidates: {drawn[2]}"] if drawn[1] else []
                cuts["candidates"] = names
                if draw(one_in(16)):
                    put(cuts, "candidates", draw(refused(_wrong(5, 0, "", "subarchs.0", {"a": 1}, ["a", "a"], [""], [None],
                                                                             containers=False),
                                                       "cuts.candidates")))
            if draw(st.booleans()):
                put(cuts, "max_streams", draw(field(st.integers(0, 4), _wrong(-1, 65, 10**12, "2", 2.0, True, None,
                                                                             *HUGE_INTS), "cuts.max_streams", odds=20)))
            ms = cuts.get("max_streams", 4)
            if draw(st.booleans()):
                modes_ok = st.lists(st.sampled_from(["keep", "place", "detach"] if ms else ["keep", "detach"]),
                                    min_size=1, max_size=3)
                put(cuts, "modes", draw(field(modes_ok, _wrong("teleport", 5, 0, "", [], ["keep", "teleport"],
                                                                 [["keep"]], None), "cuts.modes", odds=20)))
            if draw(one_in(4)):
                put(cuts, "streams", draw(field(st.sampled_from(["searched", "round_robin"]),
                                                _wrong("rr", 1, None, ""), "cuts.streams", odds=20)))
            if draw(one_in(3)):
                put(cuts, "dispatch", draw(field(st.one_of(st.sampled_from(["blocking", "threaded", "deferred"]),
                                                           st.lists(st.sampled_from(["blocking", "threaded", "deferred"]),
                                                                    min_size=1, max_size=3)),
                                                 _wrong("async", 5, 0, [], None, [{}]), "cuts.dispatch", odds=20)))
            for flag in ("graph", "whole_step_graph", "find_unused_parameters"):
                if draw(one_in(5)):
                    put(cuts, flag, draw(field(st.one_of(st.booleans(), st.lists(st.booleans(), min_size=1, max_size=2)),
                                               _wrong(0, 1, "yes", [], [0], None), f"cuts.{flag}", odds=20)))
            if draw(one_in(4)):
                low = draw(st.sampled_from([0.1, 0.5, 1]))
                aux_ok = st.one_of(st.sampled_from([1, 0.5, 3.0]),
                                   st.builds(lambda h, log: {"low": low, "high": low * h, "log": log},
                                             st.sampled_from([1, 2, 10]), st.booleans()))
                put(cuts, "aux_weight", draw(field(aux_ok, _wrong(0, -1, math.inf, math.nan, "x", None, True, [1],
                                                                  {"low": 2, "high": 1}, {"low": 0, "high": 1},
                                                                  {"low": 1, "high": 1e7}, {"low": 1, "high": 2, "log": 1},
                                                                  {"low": "a", "high": 1}, {"lo": 1},
                                                                  {"low": huge_int_text(400), "high": 1}),
                                                   "cuts.aux_weight", odds=20)))
            if draw(one_in(21)):
                cuts[draw(st.sampled_from(["candidate", 1, None, "\x1b"]))] = 1
                reasons.append("cuts: unknown field")
            tree["cuts"] = cuts

    if draw(one_in(7)):
        put(tree, "objectives", draw(field(st.just(["qps_gain", "ne_gap"]),
                                           _wrong(5, 0, "", "qps_gain", [], ["ne_gap", "qps_gain"], [[1]], None),
                                           "objectives", odds=20)))
    if draw(one_in(7)):
        put(tree, "gain_over", draw(field(st.just("eager"), _wrong("fastest", 5, None, ""), "gain_over", odds=20)))
    if draw(one_in(5)):
        put(tree, "max_ne_gap", draw(field(st.sampled_from([0, 0.02, 1, 100]),
                                           _wrong(-0.1, 101, math.nan, math.inf, "x", None, True, 10**400),
                                           "max_ne_gap", odds=20)))
    if draw(st.booleans()):
        name = draw(st.sampled_from(["tpe", "nsga2", "gp", "random"]))
        if draw(st.booleans()):
            put(tree, "sampler", draw(field(st.just(name), _wrong("cmaes", 5, None, "", "TPE"), "sampler", odds=20)))
        else:
            seed, bad, why = draw(field(st.one_of(st.none(), st.integers(0, 2**32 - 1)),
                                        _wrong(2**32, 2**40, -1, 1.5, "1", True, 10**30, 2**64), "sampler.seed"))
            tree["sampler"] = {"name": name, "seed": seed}
            reasons += [why] if bad else []
    if draw(st.booleans()):
        budget: dict[Any, Any] = {}
        for name, ok, low in (("warmup_steps", st.integers(5, 8), 5), ("windows", st.integers(1, 3), 1),
                              ("window_steps", st.integers(1, 3), 1), ("quality_steps", st.integers(0, 3), 0)):
            if draw(one_in(3)):
                put(budget, name, draw(field(ok, _wrong(low - 1, 10**6 + 1, 10**30, "5", 5.0, True, None,
                                                        *HUGE_RAW[:1]), f"budget.{name}", odds=20)))
        if draw(one_in(3)):
            put(budget, "timeout_s", draw(field(st.sampled_from([1, 60, 0.5, 7 * 86400]),
                                                _wrong(0, -1, 7 * 86400 + 1, math.inf, math.nan, "x", None, 10**400),
                                                "budget.timeout_s", odds=20)))
        if draw(one_in(16)):
            put(tree, "budget", draw(field(st.none(), _wrong(5, 0, "", False, [1], containers=False), "budget")))
        else:
            tree["budget"] = budget
    if draw(one_in(5)):
        put(tree, "trials", draw(field(st.integers(1, 100), _wrong(0, -1, 100_001, 10**30, "x", 1.0, True, None),
                                       "trials", odds=20)))
    if draw(one_in(5)):
        put(tree, "seed", draw(field(st.integers(0, 2**32 - 1), _wrong(-1, 2**32, 2**40, "x", 1.5, True, None),
                                     "seed", odds=20)))
    if draw(one_in(5)):
        put(tree, "device", draw(field(st.sampled_from(["auto", "cpu", "cuda"]), _wrong("gpu", 5, None, ""),
                                       "device", odds=20)))
    if draw(one_in(3)):
        if draw(one_in(11)):
            put(tree, "seeds", draw(field(st.none(), _wrong(5, 0, "", False, "x", {"plan": {}}, containers=False), "seeds")))
        else:
            seeds = []
            for i in range(draw(st.integers(0, 3))):
                plan, why = draw(plan_tree(CTR_NAMES, CTR_RUNS))
                reasons += [f"seeds[{i}].plan: {w}" for w in why]
                seed: dict[Any, Any] = {"plan": plan}
                if draw(st.booleans()):
                    seed["name"], bad, why = draw(field(odd_text(1).filter(str.strip),
                                                        _wrong("", " ", 5, None, 10**30), f"seeds[{i}].name"))
                    reasons += [why] if bad else []
                if draw(one_in(16)):
                    seed = draw(st.sampled_from([5, "x", None, {"name": "s"}, {"plan": {}, "bogus": 1},
                                                 {"plan": 0}, {"plan": False}, {"plan": "x"}, {"plan": 5}]))
                    reasons.append(f"seeds[{i}]: malformed")
                seeds.append(seed)
            tree["seeds"] = seeds
    if draw(one_in(13)):
        key = draw(st.one_of(st.sampled_from(["colour", "objective", 1, None, True, "Workload"]), odd_text(1)))
        if key not in ("workload", "cuts", "objectives", "gain_over", "max_ne_gap", "sampler", "budget", "trials",
                       "seed", "device", "seeds"):
            tree[key] = 1
            reasons.append(f"unknown field {key!r}")
    return tree, reasons


def space_docs() -> st.SearchStrategy[Doc]:
    return documents(space_tree())
