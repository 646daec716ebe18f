"""A compiled decode loop's first execution against its next ones (SmolLM2, greedy, 128 new tokens
after a chat instruction): decode milliseconds and the process's minor page faults per run.

  python docs/results/cpu/first_execution.py ar,sd/ngram/8
"""
import resource
import sys
import time

import jax

from hitree_jax import methods, stacks
from hitree_jax.decode import engine
from hitree_jax.decode.programs import Programs
from hitree_jax.loading import load_model
from hitree_jax.tokenizer import chat_prompt, load_tokenizer
from hitree_jax.train.instructions import OPEN_INSTRUCTIONS


def main(specs):
  model = load_model("smollm2")
  ids = chat_prompt(load_tokenizer(model.path), OPEN_INSTRUCTIONS[0])
  faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  print("| method | run | decode ms | minor page faults |\n|---|---|---|---|")
  for spec in specs:
    method = methods.parse_method(spec, methods.Knobs(), True).load_draft(model.config, model.params)
    stack, programs = (stacks.PLAIN if method.name == "ar" else method.stack), Programs()
    for run in range(3):
      ready, _ = engine.prefill(model.params, model.config, [ids], 128, stack, draft=method.draft,
                                programs=programs)
      loop = engine.decode_program(ready, programs)   # compiled (or loaded) before the clock starts
      before, start = faults(), time.perf_counter()
      jax.block_until_ready(loop(ready.weights, ready.long_caches, ready.start))
      print(f"| {spec} | {run} | {(time.perf_counter() - start) * 1e3:.0f} | {faults() - before} |", flush=True)


if __name__ == "__main__":
  main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["ar", "sd/ngram/8"])
