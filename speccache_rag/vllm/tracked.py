"""``Tracked``: what the connector's scheduler side knows of one request until its worker report is out."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TRACKED_MAX = 4096          # finished requests still waiting for their worker report (blends that failed never report)


@dataclass
class Tracked:
    """What the scheduler knows of one request, from ``on_new_request`` until its report is out."""

    plan: dict | None = None              # the blend or precompute the worker runs (None: plain prefill)
    claimed: bool = False                 # its tokens were claimed; the worker blends it this step
    notes: dict = field(default_factory=dict)      # what the response tells the client (info, ignored keys)
    report: dict | None = None            # the worker's statistics
    prefill_stats: Any = None             # vLLM's PrefillStats of the request, corrected by the report
    finished: bool = False                # finished before its report came

    def correct_cached_tokens(self, report: dict) -> None:
        """vLLM counts every claimed token as cached; make it the tokens actually reused.

        The request's ``PrefillStats`` was handed to its first output earlier in this same
        ``update_from_output`` call (which then asks the connector for its output), and outputs are
        serialized only after it returns, so correcting the object now corrects what clients see.
        """
        stats, self.prefill_stats = self.prefill_stats, None
        if stats is None:
            return
        reused = min(int(report.get("reused_tokens", 0)), stats.num_prompt_tokens)
        stats.num_cached_tokens = stats.num_external_cached_tokens = reused
        stats.num_computed_tokens = stats.num_prompt_tokens - reused
