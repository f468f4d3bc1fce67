"""The device budget: what a device agent may cost a Pi Zero 2 W-class board, per frame and held.

Times are per frame on one thread of the x86 development machine, a proxy that
docs/raspberry-pi.md relates to the boards by published single-core ratios; memory is the
agent's peak resident set, on x86 and (what the program itself maps) on the emulated aarch64
userland. The device footprint benchmark checks every preset against these lines, and the docs
table is generated from them (``python -m ddnn.tools.docs``), so the two never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BudgetLine:
    """One line of the budget: ``key`` names the measured figure, ``limit`` its ceiling."""

    key: str
    what: str
    limit: float
    unit: str

    def passes(self, value: float | None) -> bool | None:
        """Whether ``value`` keeps within the line; None when it was not measured."""
        return None if value is None else value <= self.limit


SEGMENT_MS = BudgetLine("segment_ms", "device segment per frame, one x86 thread (p50)", 1.0,
                        "ms")
AGENT_MS = BudgetLine("agent_ms", "whole agent per frame: read, model, envelope, publish "
                      "(CPU of every thread, x86)", 10.0, "ms")
RSS_X86_MIB = BudgetLine("rss_x86_mib", "agent peak resident memory, x86-64", 80.0, "MiB")
RSS_AARCH64_MIB = BudgetLine("rss_aarch64_mib", "agent peak resident memory, aarch64 userland "
                             "(what the program maps, qemu left out)", 95.0, "MiB")
SEGMENT_FILE_BYTES = BudgetLine("segment_file_bytes", "one device segment file", 1_000_000,
                                "bytes")
BUDGET = (SEGMENT_MS, AGENT_MS, RSS_X86_MIB, RSS_AARCH64_MIB, SEGMENT_FILE_BYTES)


def _number(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:g}"


def markdown_table() -> str:
    """The budget as the docs show it."""
    rows = ["| budget line | limit |", "|---|---|"]
    rows += [f"| {b.what} | <= {_number(b.limit)} {b.unit} |" for b in BUDGET]
    return "\n".join(rows) + "\n"
