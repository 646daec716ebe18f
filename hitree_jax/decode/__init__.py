"""Decoding: `stack` (a stack of levels, statically), `engine` (every stack as one program),
`levels` (a level's caches in the loop), `drafters` (the bottom level), `verify` (exact tree
verification), `sampling`, `prefill`, `programs` (the compiled-program memo), `result`."""
