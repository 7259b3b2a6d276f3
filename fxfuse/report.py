"""The explain() report: what was fused, and why anything near a GEMM was not.

Entry point: ``Report`` (``str(report)`` is a readable table). Rows hold strings only, so a report can be
kept on an optimized module and pickled with it.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FusedRow:
    location: str        # module path and node of the GEMM
    replaced: list[str]  # names of the graph nodes the fused op replaced
    program: str         # the epilogue program (fxfuse.program)
    fused_node: str
    op: str = "gemm_epilogue"  # the fused op: gemm_epilogue, or gemm_epilogue_train in a training graph
    pool: int | None = None    # an avg_pool1d over the features that the GEMM's weight took (its kernel), if any

    def epilogue(self) -> str:
        """The table's text of the epilogue: the program, after the pool folded into the GEMM."""
        program = self.program.replace(";", "; ")
        if self.pool is None:
            return program
        return f"[weight rows averaged by {self.pool}: avg_pool1d] {program}".rstrip()


@dataclass
class MissRow:
    location: str
    node: str
    reason: str


@dataclass
class Report:
    fused: list[FusedRow] = field(default_factory=list)
    near_misses: list[MissRow] = field(default_factory=list)
    skipped: list[MissRow] = field(default_factory=list)  # modules that could not be traced

    def extend(self, other: "Report") -> None:
        self.fused += other.fused
        self.near_misses += other.near_misses
        self.skipped += other.skipped

    def __str__(self) -> str:
        lines = [f"fxfuse: {len(self.fused)} fused region(s), {len(self.near_misses)} near miss(es)"]
        if self.fused:
            lines.append(_table(["#", "where", "replaced nodes", "epilogue program"],
                                [[str(i), r.location, ", ".join(r.replaced), r.epilogue()]
                                 for i, r in enumerate(self.fused, 1)]))
            training = sum(r.op == "gemm_epilogue_train" for r in self.fused)
            if training:
                lines.append(f"{training} of them for training (gemm_epilogue_train: the backward reuses the GEMM "
                             "output)")
        if self.near_misses:
            lines.append("not fused:")
            lines.append(_table(["where", "node", "reason"],
                                [[m.location, m.node, m.reason] for m in self.near_misses]))
        if self.skipped:
            lines.append("left in eager (could not be traced):")
            lines.append(_table(["module", "", "reason"], [[m.location, m.node, m.reason] for m in self.skipped]))
        return "\n".join(lines)

    __repr__ = __str__


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    rule = "+".join("-" * (w + 2) for w in widths)
    fmt = lambda row: "|".join(f" {cell:<{w}} " for cell, w in zip(row, widths))  # noqa: E731
    return "\n".join([fmt(header), rule] + [fmt(r) for r in rows])
