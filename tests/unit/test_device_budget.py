"""The device budget: one set of named lines, checked by the footprint benchmark and shown in
the docs from the same constants."""

from pathlib import Path

from ddnn.benchmarks.device_budget import AGENT_MS, BUDGET, SEGMENT_FILE_BYTES, markdown_table

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_a_line_passes_at_its_limit_fails_above_and_says_nothing_unmeasured():
    assert AGENT_MS.passes(AGENT_MS.limit) is True
    assert AGENT_MS.passes(AGENT_MS.limit * 1.01) is False
    assert AGENT_MS.passes(None) is None
    assert SEGMENT_FILE_BYTES.passes(1_000_001) is False


def test_every_line_has_its_own_key_and_a_row_in_the_docs_table():
    assert len({b.key for b in BUDGET}) == len(BUDGET)
    table = markdown_table()
    assert all(f"| {b.what} |" in table for b in BUDGET)
    # The Raspberry Pi page shows this very table (generated: python -m ddnn.tools.docs).
    assert table in (DOCS / "raspberry-pi.md").read_text()
