"""An all-to-all the caller waits on later (async_op=True), so the two micro-batches of two-batch overlap keep one
in flight while the other computes. framework.dist.Group waits on every collective it launches; this launches on
its process group and waits with the group's timeout, as Group does."""
from __future__ import annotations

import datetime
from typing import Any, Sequence

import torch
import torch.distributed as dist

from framework.dist.group import CollectiveError, CollectiveTimeout


class Pending:
    """A launched all-to-all: `wait()` returns its output (size 1: at once)."""

    def __init__(self, group, out: torch.Tensor, work: Any, what: str):
        self.group, self.out, self.work, self.what = group, out, work, what

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            g = self.group
            try:
                if g.timeout_s is None:
                    self.work.wait()
                elif not self.work.wait(timeout=datetime.timedelta(seconds=g.timeout_s)):
                    raise CollectiveTimeout(f"{self.what} did not complete in {g.timeout_s} s (rank {g.rank}, step "
                                            f"{g.step})")
            except RuntimeError as err:
                if isinstance(err, CollectiveError):
                    raise
                raise CollectiveError(f"{self.what} failed on rank {g.rank} at step {g.step}: {err}") from err
            self.work = None
        return self.out


def launch_all_to_all(group, x: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
                      what: str) -> Pending:
    """Send rows send_counts[j] of `x` to rank j, receive recv_counts[j] from rank j; returns before they arrive."""
    if group.size == 1:
        return Pending(group, x, None, what)
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), output_split_sizes=list(recv_counts),
                                  input_split_sizes=list(send_counts), group=group.pg, async_op=True)
    return Pending(group, out, work, what)


def exchange_counts(group, send_counts: Sequence[int]) -> list[int]:
    """What every rank will send this one: the count exchange before an uneven all-to-all (a host sync)."""
    if group.size == 1:
        return [int(send_counts[0])]
    sent = torch.tensor(list(send_counts), dtype=torch.int64, device=group.device)
    got = torch.empty_like(sent)
    Pending(group, got, dist.all_to_all_single(got, sent, group=group.pg, async_op=True), "count exchange").wait()
    return got.tolist()
