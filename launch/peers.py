"""Peer engines decoding the same prompt ids: HF transformers (PyTorch) and llama.cpp.

`launch.benchmark --peers=hf,llamacpp` times them beside our methods, so that
"faster than llama.cpp" is a row of the same table, not a one-off script. Both
are optional and never runtime dependencies:

  hf        torch + transformers (setup.sh --test installs torch)
  llamacpp  pip install llama-cpp-python==0.3.36  (builds llama.cpp from source: ~7 min
            on 2 cores; not in CI)

Each peer decodes one prompt exactly as our `ar` does: the prompt in one
prefill, then one token per forward, greedy or sampled with the same
temperature / top-p / top-k (its own random numbers, so only greedy tokens can
be compared). Speeds are decode tokens/s, prefill excluded, as for our rows.
llama.cpp runs the GGUF it is given (--llamacpp_gguf): convert our weights with
`launch.convert --out=X.gguf` to compare at the same float32 precision. Its KV cache is
f16 by default, as llama.cpp's is; --llamacpp_cache=f32 keeps it in float32 as ours is
(and --key_dtype=bfloat16 gives ours 16-bit keys).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import statistics
import time

from hitree_jax.errors import UsageError

PEERS = ("hf", "llamacpp")
LLAMACPP_CACHES = ("f16", "f32")  # what llama.cpp's KV cache may store (f16: its default)


@dataclasses.dataclass
class PeerRun:
  prefill_s: float
  decode_s: float
  tokens: list[int]  # the generated ids; the first comes from the prefill's logits


def missing(name: str) -> str | None:
  """Why peer `name` cannot run here (the package to install), or None."""
  import importlib.util
  needs = {"hf": ("torch", "torch and transformers (./setup.sh --test)"),
           "llamacpp": ("llama_cpp", "llama-cpp-python (pip install llama-cpp-python==0.3.36)")}
  if name not in needs:
    return f"unknown peer {name!r}: expected one of {', '.join(PEERS)}"
  module, install = needs[name]
  return None if importlib.util.find_spec(module) else f"peer {name!r} needs {install}"


class HFPeer:
  """transformers' Llama in float32 on PyTorch, from the same GGUF our model loads (dequantized)."""

  def __init__(self, gguf_path: pathlib.Path, threads: int):
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    self.torch = torch
    self.model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                      dtype=torch.float32).eval()
    self.label = "hf"

  def _choose(self, logits, temperature: float, top_p: float, top_k: int, generator):
    torch = self.torch
    if temperature == 0:
      return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_k:
      probs = torch.where(probs >= torch.topk(probs, top_k).values[-1], probs, 0.0)
    if top_p < 1:
      sorted_probs, order = torch.sort(probs, descending=True)
      above = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly before each token
      keep = torch.zeros_like(probs, dtype=torch.bool).scatter(0, order, above < top_p * probs.sum())
      probs = torch.where(keep, probs, 0.0)
    return int(torch.multinomial(probs, 1, generator=generator))

  def run(self, ids: list[int], max_new_tokens: int, temperature: float, top_p: float, top_k: int,
          seed: int) -> PeerRun:
    torch = self.torch
    generator = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
      start = time.perf_counter()
      out = self.model(input_ids=torch.tensor([ids]), use_cache=True)
      tokens = [self._choose(out.logits[0, -1], temperature, top_p, top_k, generator)]
      prefill_s = time.perf_counter() - start
      start = time.perf_counter()
      past = out.past_key_values
      while len(tokens) < max_new_tokens:
        out = self.model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        tokens.append(self._choose(out.logits[0, -1], temperature, top_p, top_k, generator))
      return PeerRun(prefill_s, time.perf_counter() - start, tokens)


class LlamaCppPeer:
  """llama.cpp through llama-cpp-python, on every core (the library's default is half of them).

  cache: what its KV cache stores, f16 (llama.cpp's default, named in no label) or f32 (our
  default's precision: the label says `f32 cache`)."""

  def __init__(self, gguf_path: pathlib.Path, threads: int, context: int, cache: str = "f16"):
    import llama_cpp
    if cache not in LLAMACPP_CACHES:
      raise UsageError(f"llama.cpp cache {cache!r}: expected one of {', '.join(LLAMACPP_CACHES)}")
    types = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32}
    self.llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=context, n_batch=512, n_threads=threads,
                               n_threads_batch=threads, type_k=types[cache], type_v=types[cache],
                               verbose=False)
    self.label = f"llama.cpp {gguf_file_type(gguf_path)}" + ("" if cache == "f16" else f", {cache} cache")

  def run(self, ids: list[int], max_new_tokens: int, temperature: float, top_p: float, top_k: int,
          seed: int) -> PeerRun:
    llm = self.llm
    llm.set_seed(seed)
    sample = lambda: llm.sample(temp=temperature, top_p=top_p, top_k=top_k, min_p=0.0, typical_p=1.0,
                                repeat_penalty=1.0)
    llm.reset()
    start = time.perf_counter()
    llm.eval(ids)
    tokens = [sample()]
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    while len(tokens) < max_new_tokens:
      llm.eval([tokens[-1]])
      tokens.append(sample())
    return PeerRun(prefill_s, time.perf_counter() - start, [int(t) for t in tokens])

  def forward_ms(self, ids: list[int], width: int, repeats: int) -> float:
    """Median ms of one forward of `width` tokens after the prompt `ids`, with logits at every
    position (what a verification needs), each time after dropping the previous one's cache."""
    llm = self.llm
    llm.reset()
    llm.eval(ids)
    past, extra = llm.n_tokens, list(ids[-width:])
    times = []
    for _ in range(repeats + 1):  # the first warms up
      llm._ctx.kv_cache_seq_rm(-1, past, -1)  # llama-cpp-python's own calls (Llama.eval)
      llm._batch.set_batch(batch=extra, n_past=past, logits_all=True)
      start = time.perf_counter()
      llm._ctx.decode(llm._batch)
      times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def gguf_file_type(path: pathlib.Path) -> str:
  """The type of a GGUF's matrices, as llama.cpp names files (F32, Q8_0, Q4_1, ...)."""
  import gguf
  reader = gguf.GGUFReader(str(path))
  kinds = {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2 and t.name != "token_embd.weight"}
  return "/".join(sorted(kinds))


def check(names: list[str], llamacpp_ggufs: list[str]) -> None:
  """Refuses, before any weights load, a peer that is unknown or not installed, or a missing GGUF."""
  for name in names:
    reason = missing(name)
    if reason:
      raise UsageError(f"--peers={name}: {reason}")
  for path in llamacpp_ggufs:
    if not path.endswith(".gguf") or not pathlib.Path(path).is_file():
      raise UsageError(f"--llamacpp_gguf={path}: expected an existing .gguf file "
                       "(python -m launch.convert --out=X.gguf writes one)")


def make_peer(name: str, model_path: pathlib.Path, llamacpp_gguf: str | None, context: int,
              llamacpp_cache: str = "f16"):
  """Peer `name` ready to run: hf on the model's own file; llamacpp on `llamacpp_gguf`
  (default: the model's own GGUF) with its KV cache in `llamacpp_cache`. Raises ValueError when
  it cannot run here (see `check`)."""
  gguf_path = pathlib.Path(llamacpp_gguf) if llamacpp_gguf else model_path
  check([name], [str(gguf_path)] if name == "llamacpp" else [])
  threads = os.cpu_count() or 1
  if name == "hf":
    if model_path.suffix != ".gguf":
      raise UsageError(f"--peers=hf loads a GGUF model; {model_path} is not one")
    return HFPeer(model_path, threads)
  return LlamaCppPeer(gguf_path, threads, context, llamacpp_cache)
