"""Progress lines with an ETA, so a long command says how far it is and when it will end.

  progress = Progress("benchmark", total=12)
  progress.step(detail="tree/self:8/kary:2x2 P=2048 prompt 1")
  # I... benchmark 3/12 (25%) elapsed 1m20s, ETA 4m00s: tree/self:8/kary:2x2 P=2048 prompt 1

The ETA assumes the remaining units take as long as the done ones on average.
"""

from __future__ import annotations

import time
from typing import Callable

from absl import logging


def duration(seconds: float) -> str:
  """45s, 1m20s, 2h05m: short enough to read at a glance in a log line."""
  seconds = max(int(round(seconds)), 0)
  if seconds < 60:
    return f"{seconds}s"
  minutes, seconds = divmod(seconds, 60)
  if minutes < 60:
    return f"{minutes}m{seconds:02d}s"
  hours, minutes = divmod(minutes, 60)
  return f"{hours}h{minutes:02d}m"


class Progress:
  """Counts done units of a known total and logs one line per step (at most every min_interval_s).

  clock and log are injectable so tests can drive it with a fake clock.
  """

  def __init__(self, name: str, total: int = 0, *, min_interval_s: float = 0.0,
               clock: Callable[[], float] = time.monotonic, log: Callable[..., None] = logging.info):
    self.name, self.total, self.done = name, total, 0
    self.min_interval_s, self.clock, self.log = min_interval_s, clock, log
    self.start = clock()
    self.last_logged = None

  def line(self, detail: str = "") -> str:
    elapsed = self.clock() - self.start
    percent = f" ({100 * self.done // self.total}%)" if self.total else ""
    text = f"{self.name} {self.done}/{self.total}{percent} elapsed {duration(elapsed)}"
    if 0 < self.done < self.total:
      text += f", ETA {duration(elapsed / self.done * (self.total - self.done))}"
    return text + (f": {detail}" if detail else "")

  def step(self, done: int = 1, detail: str = "") -> None:
    """Counts `done` more units; logs unless the last line is younger than min_interval_s."""
    self.done += done
    now = self.clock()
    due = (self.last_logged is None or self.done >= self.total
           or now - self.last_logged >= self.min_interval_s)
    if due:
      self.last_logged = now
      self.log("%s", self.line(detail))

  def update(self, done: int, total: int, detail: str = "") -> None:
    """The (done, total, detail) callback of library loops, which learn their total only as they
    start (a resumed run skips finished work): done=0 (re)starts the clock without logging."""
    self.total = total
    if done == 0:
      self.start, self.done, self.last_logged = self.clock(), 0, None
      return
    self.step(done - self.done, detail)
