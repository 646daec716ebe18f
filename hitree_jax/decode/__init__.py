"""Decoding: `spec` (the --levels grammar as types), `stack` (a stack of levels, statically),
`sizes` (each level's static sizes), `engine` (every stack as one program: prefill, then `loop`
on device), `long_caches` (each level's long cache from the prompt), `levels` (a level's caches
in the loop), `drafters` (the bottom level), `features` (the target's features a feature drafter
reads), `verify` (exact tree verification), `step_aside` (rows that run plain rounds while their
drafts do not pay), `sampling`, `prefill`, `retrieve` (a retrieval cache chosen from a full
one), `programs` (the compiled-program memo), `timing` (each level's round timed alone),
`result`."""
