"""Hostile-input strategies shared by the fuzz tests: arbitrary JSON, JSON nested past the
decoder's recursion limit, raw bytes, and single-field mutations of a valid document."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

# Values that break naive parsers: beyond float range, beyond 64 bits, non-finite, odd text.
_NASTY_SCALARS: list[Any] = [
    10**400,
    -(10**400),
    2**64,
    -1,
    0,
    True,
    False,
    None,
    float("nan"),
    float("inf"),
    -float("inf"),
    "",
    " ",
    "²",  # str.isdigit() is true, int() refuses it
    "٣",  # an Arabic-Indic digit: isdigit() and int() both accept it
    "9" * 5000,  # int() refuses more than 4300 digits
    "\x00",
    "\ud800",  # a lone surrogate: valid in a JSON string, not encodable to UTF-8
    "-",
    "--5",
    "1e3",
    "0x10",
]

scalars = st.one_of(
    st.sampled_from(_NASTY_SCALARS),
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=20),
)
json_values = st.recursive(
    scalars,
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=12), kids, max_size=5),
    max_leaves=25,
)


def nested(depth: int, brackets: tuple[str, str] = ("[", "]")) -> str:
    """Valid JSON nested ``depth`` deep: past ~1000 levels json.loads raises RecursionError."""
    opener, closer = brackets
    return opener * depth + "0" + closer * depth


deep_json = st.builds(nested, st.integers(1, 3000), st.sampled_from([("[", "]"), ('{"a":', "}")]))
DEEP = nested(3000)  # for explicit examples: past the recursion limit, short enough to print


def _encode(doc: Any, ascii_only: bool, encoding: str) -> bytes:
    return json.dumps(doc, ensure_ascii=ascii_only).encode(encoding, errors="surrogatepass")


# json.loads detects UTF-8/16/32 in bytes; lone surrogates make them undecodable.
json_bytes = st.builds(_encode, json_values, st.booleans(), st.sampled_from(["utf-8", "utf-16", "utf-32"]))
raw_text = st.text(max_size=200)
raw_bytes = st.binary(max_size=300)


@dataclass(frozen=True)
class Mutation:
    """One change to a document: ``path`` names the node; ``value`` replaced it, or the key
    was deleted (``deleted``)."""

    doc: Any
    path: tuple[str | int, ...]
    deleted: bool

    @property
    def field(self) -> str | int | None:
        return self.path[-1] if self.path else None


@st.composite
def mutations(draw: st.DrawFn, doc: Any, values: st.SearchStrategy[Any] = json_values) -> Mutation:
    """``doc`` with one node (reached by a random walk from the root) replaced or deleted."""
    doc = copy.deepcopy(doc)
    path: list[str | int] = []
    parent: Any = None
    node = doc
    while isinstance(node, dict | list) and node and (not path or draw(st.booleans())):
        if isinstance(node, dict):
            name: str = draw(st.sampled_from(sorted(node)))
            parent, node = node, node[name]
            path.append(name)
        else:
            index = draw(st.integers(0, len(node) - 1))
            parent, node = node, node[index]
            path.append(index)
    if parent is None:
        return Mutation(draw(values), (), False)
    key = path[-1]
    if isinstance(parent, dict) and draw(st.booleans()):
        del parent[key]
        return Mutation(doc, tuple(path), True)
    parent[key] = draw(values)
    return Mutation(doc, tuple(path), False)


def dumps(doc: Any) -> str:
    """JSON text of a (mutated) document; lone surrogates are kept as escapes."""
    return json.dumps(doc)
