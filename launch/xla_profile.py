"""Where a compiled forward's time goes, by XLA's own profiler: each op's time, attributed to a role.

Isolated timings (launch/step_cost.py) subtract one program from another, so
their parts carry each program's noise. Here one program runs under
`jax.profiler`, whose trace holds every op XLA:CPU executed (a thunk per HLO
instruction) with its duration, and each op is given a role by what it reads
in the optimized HLO:

  weights    a matrix product reading a parameter of the model (a projection)
  head       the product reading the output head (`lm_head` or the embedding)
  attention  every other matrix product (queries x cached keys, probabilities x values)
  other      every op that is not a matrix product (norms, RoPE, cache writes, softmax)
  runtime    the call's wall time minus the time some op ran (XLA's executor, dispatch, wait)

Ops that run side by side (XLA:CPU runs independent ones on different cores)
share the stretch they overlap, so the roles add up to the wall time.

A product is an HLO `dot` or a fusion whose computation holds one (YNNPACK's
`ynn_fusion`); what it reads is found by following its operands back through
bitcasts, copies and transposes to the program's parameters, which XLA names
after the argument's path (`params__layers_0____self_attn____q_proj____kernel__`).
The program must be loop-free (a forward): ops inside a loop would be counted
once per trip, with nothing telling trips apart.
"""

from __future__ import annotations

import collections
import gzip
import json
import pathlib
import re
import tempfile
from typing import Callable

import jax

from hitree_jax.decode.programs import compile_lowered
from hitree_jax.decode.timing import median_seconds

ROLES = ("weights", "head", "attention", "other", "runtime")
HEAD_PARAMS = ("lm_head", "embed_tokens")
_PASS_THROUGH = ("bitcast", "copy", "transpose", "reshape")

# `%name = f32[1,576]{1,0} dot(%a, %b), ...` or `ROOT %name = (..) fusion(...), calls=%comp`
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1}


class Instruction(collections.namedtuple("Instruction", "name shape opcode operands calls")):
  """One optimized-HLO instruction: its output shape text, opcode, operand names, called computation."""


def parse_hlo(text: str) -> dict[str, dict[str, Instruction]]:
  """Optimized HLO text -> {computation: {instruction name: Instruction}}; the entry is '__entry__'."""
  computations, current = {}, None
  for line in text.splitlines():
    if not line.startswith(" ") and line.endswith("{"):
      match = _COMPUTATION.match(line)
      if match:
        current = computations.setdefault("__entry__" if line.startswith("ENTRY") else match.group(1), {})
      continue
    match = _INSTRUCTION.match(line) if current is not None else None
    if not match:
      continue
    name, shape, opcode, rest = match.groups()
    operand_text = rest.split(")", 1)[0]
    calls = re.search(r"calls=%([\w.\-]+)", rest)
    current[name] = Instruction(name, shape, opcode, re.findall(r"%([\w.\-]+)", operand_text),
                                calls.group(1) if calls else None)
  return computations


def _shape_bytes(shape: str) -> int:
  match = re.match(r"(\w+)\[([\d,]*)\]", shape)
  if not match or match.group(1) not in _BYTES:
    return 0
  size = 1
  for dim in filter(None, match.group(2).split(",")):
    size *= int(dim)
  return size * _BYTES[match.group(1)]


def _source_parameter(name: str, entry: dict[str, Instruction]) -> Instruction | None:
  """The entry parameter an operand is a pass-through view of (bitcast/copy/transpose), or None."""
  seen = set()
  while name in entry and name not in seen:
    seen.add(name)
    op = entry[name]
    if op.opcode == "parameter":
      return op
    if len(op.operands) != 1 or not any(op.opcode.startswith(p) or op.name.startswith(p) for p in _PASS_THROUGH):
      return None
    name = op.operands[0]
  return None


def op_roles(hlo_text: str, weights_prefix: str = "params") -> dict[str, tuple[str, int]]:
  """{entry instruction name: (role, bytes of model parameters it reads)} for a loop-free program."""
  computations = parse_hlo(hlo_text)
  entry = computations["__entry__"]
  roles = {}
  for op in entry.values():
    if op.opcode in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
      continue
    is_product = op.opcode == "dot" or (op.calls is not None and any(
        inner.opcode == "dot" for inner in computations.get(op.calls, {}).values()))
    if not is_product:
      roles[op.name] = ("other", 0)
      continue
    sources = [_source_parameter(operand, entry) for operand in op.operands]
    params = [p for p in sources if p is not None and p.name.startswith(weights_prefix)]
    if not params:
      roles[op.name] = ("attention", 0)
    else:
      role = "head" if any(h in p.name for p in params for h in HEAD_PARAMS) else "weights"
      roles[op.name] = (role, sum(_shape_bytes(p.shape) for p in params))
  return roles


def _trace_events(trace_dir: pathlib.Path) -> list[dict]:
  files = sorted(trace_dir.rglob("*.trace.json.gz"))
  if not files:
    raise RuntimeError(f"jax.profiler wrote no trace under {trace_dir}")
  with gzip.open(files[-1]) as f:
    trace = json.load(f)
  return trace["traceEvents"] if isinstance(trace, dict) else trace


def shared_time(spans) -> dict[str, float]:
  """Each role's share of the time covered by op spans [(start, end, (role, _))]: XLA runs
  independent ops side by side on the cores, so a stretch where k ops run is split k ways
  and the shares add up to the wall time the ops cover, not to their summed durations."""
  spans = [span for span in spans if span[1] > span[0]]
  edges = sorted({t for start, end, _ in spans for t in (start, end)})
  index = {t: i for i, t in enumerate(edges)}
  starts, ends = collections.defaultdict(list), collections.defaultdict(list)
  for start, end, (role, _) in spans:
    starts[index[start]].append(role)
    ends[index[end]].append(role)
  shares, running = collections.Counter(), collections.Counter()
  for i in range(len(edges) - 1):
    for role in ends[i]:
      running[role] -= 1
    for role in starts[i]:
      running[role] += 1
    active = sum(running.values())
    if active:
      for role, n in running.items():
        if n:
          shares[role] += (edges[i + 1] - edges[i]) * n / active
  return dict(shares)


def breakdown(fn: Callable, *args, repeats: int = 10, weights_prefix: str = "params",
              wall_s: float | None = None) -> dict:
  """Milliseconds per call of a jitted, loop-free `fn(*args)` by role (ROLES), and the read rates.

  Returns {"<role>_ms": ..., "ops": ops per call, "weights_gb_per_s": ..., "head_gb_per_s": ...}.
  The wall time is wall_s when the caller has measured it (so the roles add up to the caller's
  figure), else the median of `repeats` untraced calls; the ops' shares (`shared_time`) are the
  traced calls' mean.
  """
  roles = op_roles(compile_lowered(fn.lower(*args)).as_text(), weights_prefix)
  wall = median_seconds(fn, *args, repeats=repeats) if wall_s is None else wall_s  # warm either way
  with tempfile.TemporaryDirectory() as tmp:
    jax.profiler.start_trace(tmp, create_perfetto_trace=True)
    try:
      for _ in range(repeats):
        jax.block_until_ready(fn(*args))
    finally:
      jax.profiler.stop_trace()
    events = _trace_events(pathlib.Path(tmp))
  spans = [(event["ts"], event["ts"] + event["dur"], roles[event["name"]]) for event in events
           if event.get("ph") == "X" and event.get("name") in roles]
  if not spans:
    raise RuntimeError("the profiler's trace names none of the program's ops: this jax's CPU trace "
                       "does not record XLA ops")
  seconds = {role: 1e-6 * us / repeats for role, us in shared_time(spans).items()}
  read = collections.Counter()
  for _, _, (role, nbytes) in spans:
    read[role] += nbytes / repeats
  result = {f"{role}_ms": 1e3 * seconds.get(role, 0.0) for role in ROLES[:-1]}
  result["runtime_ms"] = 1e3 * (wall - sum(seconds.values()))
  result["ops"] = len(spans) / repeats
  for role in ("weights", "head"):
    result[f"{role}_gb_per_s"] = read[role] / seconds[role] / 1e9 if seconds.get(role) else None
  return result
