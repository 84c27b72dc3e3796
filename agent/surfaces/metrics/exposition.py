"""The Prometheus text format (0.0.4) exactly as ``prometheus_client.generate_latest`` writes
it with its default escaping, about three times faster on a full node (bench/scrape.py).

generate_latest spends most of a scrape re-deriving the same strings for every sample: it
validates each label name with a regular expression, escapes each label value and sorts each
sample's labels, although one container's label set recurs in a dozen families and from one
scrape to the next. Here the escaped names and the formatted label sets are memoized by their
content (bounded LRUs): a memoized text is a function of its key alone, so it cannot be stale,
and every value is read from this scrape's samples. tests/unit/test_exposition.py holds the
output byte-for-byte to generate_latest's on the bench's node and on fuzzed families.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache
from typing import Any, cast

from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.openmetrics.exposition import UNDERSCORES, escape_label_name, escape_metric_name
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = CONTENT_TYPE_LATEST
_INF = math.inf
_go_float = cast(Callable[[Any], str], floatToGoString)  # untyped in prometheus_client
# Samples the text format moves out of their family into a gauge of their own, at its end.
_OM_SUFFIXES = ("_created", "_gsum", "_gcount")
# How generate_latest renames types for the text format (counters also gain _total).
_TYPES = {"info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram", "unknown": "untyped"}


@lru_cache(maxsize=4096)
def _metric_name(name: str) -> str:
    return escape_metric_name(name, UNDERSCORES)


@lru_cache(maxsize=4096)
def _label_name(name: str) -> str:
    return escape_label_name(name, UNDERSCORES)


def _label_value(value: str) -> str:
    # generate_latest: label values always allow UTF-8; only \, newline and " are escaped.
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


@lru_cache(maxsize=8192)
def _label_pair(item: tuple[str, str]) -> str:
    return f'{_label_name(item[0])}="{_label_value(item[1])}"'


@lru_cache(maxsize=8192)
def _label_block(items: tuple[tuple[str, str], ...]) -> str:
    """``{a="1",b="2"}`` for a sample's label items (in any order), or nothing for none.

    Memoized by content: the text is a function of the items alone, so an entry is never
    stale and needs no invalidation; a gone container's entries age out of the LRU. 8192
    holds a full node's label sets (about a thousand on the bench's, a few thousand with
    a tracer that sees many escapes) with room for churn."""
    if not items:
        return ""
    return "{" + ",".join([_label_pair(item) for item in sorted(items)]) + "}"


def _help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def render(registry: Collector) -> bytes:
    """The registry's metrics in the text format, byte-for-byte what ``generate_latest`` gives."""
    output: list[str] = []
    append = output.append
    for metric in registry.collect():
        try:
            mname, mtype = metric.name, metric.type
            if mtype == "counter":
                mname += "_total"
            elif mtype == "info":
                mname += "_info"
            mtype = _TYPES.get(mtype, mtype)
            escaped = _metric_name(mname)
            append(f"# HELP {escaped} {_help(metric.documentation)}\n")
            append(f"# TYPE {escaped} {mtype}\n")
            moved = {metric.name + suffix: suffix for suffix in _OM_SUFFIXES}
            om_samples: dict[str, list[str]] = {}
            last_name, name_text = "", ""
            for sample in metric.samples:
                name, labels, value, timestamp = sample[:4]  # newer releases add fields after these
                if name != last_name:  # a family's samples mostly share one name
                    last_name, name_text = name, _metric_name(name)
                block = _label_block(tuple(labels.items()))
                # floatToGoString is repr() for a finite float under 1e6 (Go's exponent form
                # starts at seven integer digits); the common case skips its calls.
                text = repr(value) if value.__class__ is float and -_INF < value < 1e6 else _go_float(value)
                if timestamp is None:
                    line = f"{name_text}{block} {text}\n"
                else:
                    line = f"{name_text}{block} {text} {int(float(timestamp) * 1000):d}\n"
                if name in moved:
                    om_samples.setdefault(moved[name], []).append(line)
                else:
                    append(line)
        except Exception as exception:
            # As generate_latest does: name the family that failed, then let it propagate.
            exception.args = (exception.args or ("",)) + (metric,)
            raise
        for suffix, lines in sorted(om_samples.items()):
            escaped = _metric_name(metric.name + suffix)
            append(f"# HELP {escaped} {_help(metric.documentation)}\n")
            append(f"# TYPE {escaped} gauge\n")
            output.extend(lines)
    return "".join(output).encode("utf-8")
