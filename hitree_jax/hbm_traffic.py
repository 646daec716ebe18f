"""The bytes a compiled TPU program moves to and from HBM, read from its final HLO.

`compiled.cost_analysis()["bytes accessed"]` counts every operand and result of every
instruction, whatever memory holds it. After the TPU compiler's memory-space assignment a
weight is first copied from HBM into VMEM (an async slice or copy), then read there by its
fusion: the analysis counts it three times or more. For a SmolLM2-sized forward on a v5e that is
4.5x the weights and cache the forward reads. The memory of every buffer is in its layout
(`{1,0:T(8,128)(2,1)S(1)}`: S(1) is VMEM; no S(n) is HBM), so the HBM traffic is summed here
instead, per top-level instruction of the entry computation:

  * an asynchronous copy, slice or collective reads its HBM source once (a slice: its bytes)
    and writes its destination if that is in HBM; the instruction that ends it moves nothing;
  * any other instruction reads its operands that are in HBM and writes its result if in HBM;
    a fusion reads of an HBM operand only what its dynamic-slices take (an embedding row);
  * bitcasts, tuples, parameters and constants move nothing.

A `while` loop's body would be counted once per trip; a single forward has none (callers
compile one forward, not a loop of them).
"""

from __future__ import annotations

import math
import re

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\](\{[^}]*\})?")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][a-z0-9-]*)\((.*)$")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
         "replica-id"}
_SLICERS = {"dynamic-slice", "slice", "gather"}


def _arrays(shape: str) -> list[tuple[int, bool]]:
  """[(bytes, in HBM)] of each array in an HLO shape (a tuple has several)."""
  out = []
  for dtype, dims, layout in _ARRAY.findall(shape):
    size = math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dtype]
    out.append((size, "S(" not in (layout or "")))
  return out


def _hbm(shape: str) -> int:
  return sum(size for size, in_hbm in _arrays(shape) if in_hbm)


def _computations(text: str) -> dict[str, list[tuple]]:
  """{computation name: [(name, shape, opcode, operand names, the rest of the line)]}; the entry
  computation under "ENTRY"."""
  computations, current = {}, None
  for line in text.splitlines():
    header = re.match(r"^(ENTRY )?%(\S+) .*\{\s*$", line)
    if header:
      current = computations.setdefault("ENTRY" if header.group(1) else header.group(2), [])
      continue
    match = _INSTRUCTION.match(line) if current is not None else None
    if match:
      name, shape, opcode, rest = match.groups()
      operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
      current.append((name, shape, opcode, operands, rest))
  return computations


def _fusion_reads(computation: list[tuple]) -> dict[int, int]:
  """{parameter index: bytes read} for a fused computation's parameters that are only sliced
  (their slices' bytes); others are absent (read whole)."""
  params = {name: int(re.match(r"(\d+)", rest).group(1))
            for name, _, opcode, _, rest in computation if opcode == "parameter"}
  uses: dict[str, list[tuple[str, str]]] = {name: [] for name in params}
  for _, shape, opcode, operands, _ in computation:
    for position, operand in enumerate(operands):
      if operand in uses:
        uses[operand].append((opcode if position == 0 else "index", shape))
  reads = {}
  for name, index in params.items():
    if uses[name] and all(opcode in _SLICERS for opcode, _ in uses[name]):
      reads[index] = sum(sum(size for size, _ in _arrays(shape)) for _, shape in uses[name])
  return reads


def hbm_bytes(hlo_text: str) -> int:
  """Bytes read from and written to HBM by one run of a compiled TPU program (its as_text())."""
  computations = _computations(hlo_text)
  shapes = {name: shape for body in computations.values() for name, shape, *_ in body}
  total = 0
  for name, shape, opcode, operands, rest in computations["ENTRY"]:
    if opcode in _FREE or opcode.endswith("-done"):
      continue
    if opcode.endswith("-start"):
      # An asynchronous transfer (a copy or slice into VMEM, a collective): it reads its source
      # (a slice of it: at most the destination's bytes) and writes its destination. Its shape is
      # (destination, source, context) for copy-start, ((operands), destination, ...) otherwise.
      destination, destination_in_hbm = _arrays(shape)[0 if opcode == "copy-start" else len(operands)]
      source = sum(_hbm(shapes.get(operand, "")) for operand in operands)
      total += min(source, destination) + destination * destination_in_hbm
      continue
    sliced = {}
    called = re.search(r"calls=%([\w.\-]+)", rest)
    if opcode == "fusion" and called and called.group(1) in computations:
      sliced = _fusion_reads(computations[called.group(1)])
    for position, operand in enumerate(operands):
      in_hbm = _hbm(shapes.get(operand, ""))
      total += min(in_hbm, sliced[position]) if position in sliced and in_hbm else in_hbm
    total += _hbm(shape)
  return total
