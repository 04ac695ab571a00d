"""A whole shard checked in one call, for the tests: the reader checks shards piece by piece
(``raymcn.data.formats.sample.ShardChecker``, fed by ``raymcn.data.read.stream``)."""

from __future__ import annotations

from collections.abc import Sequence

from raymcn.data.formats.sample import ShardChecker, ShardScan
from raymcn.data.formats.tarfmt import scan_spans


def check_shard(buf, expected: Sequence[str] | None = None, verify: bool = True) -> ShardScan:
    """Scan + check a whole shard buffer; with ``expected`` (the manifest's ids), also reports the
    samples that never appear (lost to truncation or a damaged header) and refuses unlisted keys."""
    checker = ShardChecker(expected, verify)
    spans, stop = scan_spans(buf, 0, len(buf), checker.damage)
    if stop < len(buf):
        checker.damage.append(f"shard truncated at byte {len(buf)}")
    scan = checker.feed(buf, spans)
    scan.bad.extend(checker.finish())
    return scan
