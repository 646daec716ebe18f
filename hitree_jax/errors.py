"""The one exception type for a mistake in what was asked, told apart from a bug.

A bad flag, path, method spec, prompt or pairing of models raises `UsageError`
(or `NotFound` for a path that names nothing), whose message names the bad
value. The launchers print its message on one line and exit with code 2;
every other exception is a bug and keeps its traceback. Both subclass
ValueError (and NotFound also FileNotFoundError), so a program that already
catches those keeps working.
"""

from __future__ import annotations

import os
from typing import Mapping


class UsageError(ValueError):
  """A mistake in the request, not in the library: its message names the bad value."""


class NotFound(UsageError, FileNotFoundError):
  """A path the user gave (a model, a draft, a prompt file, a config) that names nothing usable."""


OFF = ("", "0", "false", "no", "off")


def env_switch(name: str, default: bool, environ: Mapping[str, str] = os.environ) -> bool:
  """An environment switch read one way everywhere: unset is `default`; 0, false, no, off or
  empty are off; anything else is on (HITREE_TRACEBACK=1 on, HITREE_HUGE_PAGES=0 off)."""
  value = environ.get(name)
  if value is None:
    return default
  return value.strip().lower() not in OFF
