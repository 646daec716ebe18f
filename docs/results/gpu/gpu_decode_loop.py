"""The experiment behind docs/accelerators.md's "The 128K step, explained" (not part of the library).

`ar`'s real decode loop (loop.decode_loop with an empty Stack: the cache carried through the
loop and written every step) against launch.level_cost's timed step (profile.timed_forward,
the cache a constant), for Llama-2-7B's shapes in bfloat16 on one GPU. Per token from runs of
16 and 48 tokens (the middle of 3 each), and each kernel's time per token from a jax.profiler
trace of the 16-token run. The cache holds CONTEXT tokens in CONTEXT + 112 slots; choose
CONTEXT to choose the slot count (130960: 131,072 slots; 130944: 131,056). Run from the
repository's root:

  python docs/results/gpu/gpu_decode_loop.py OUT.json 32768 65536     # SMALL=1: tiny shapes (a CPU)
"""
import collections, gc, glob, gzip, importlib.util, json, os, sys, tempfile, time
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
from absl import flags
from launch import level_cost
from hitree_jax import stacks
from hitree_jax.cache.full import KVCache
from hitree_jax.decode import loop
from hitree_jax.decode.sampling import SamplingParams
from hitree_jax.decode.sizes import StackSizes
from hitree_jax.model.config import ModelConfig
from hitree_jax.decode.timing import median_seconds
from hitree_jax.planner.profile import FORWARDS_PER_CALL, timed_forward

SHORT, LONG = 16, 48


def kernels(folder, per):
  """[(name, us per token, calls per token)] of the device's kernels in a perfetto trace."""
  path, = glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True)
  events = json.load(gzip.open(path))
  events = events["traceEvents"] if isinstance(events, dict) else events
  names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
  device = any("GPU" in n for n in names.values())
  time_of, calls = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and ("GPU" in names.get(e["pid"], "")) == device:
      time_of[e["name"]] += e.get("dur", 0)
      calls[e["name"]] += 1
  return [(n, round(us / per, 1), round(calls[n] / per, 2)) for n, us in time_of.most_common(20)]


def full_cache(config, slots, context):
  """A cache of exactly `slots` slots (level_cost's would be rounded to the engine's bucket)
  holding `context` tokens of arbitrary keys and values."""
  empty = KVCache.init(config, 1, slots)
  fill = lambda buf, i: level_cost.noise(buf.shape, buf.dtype, i)
  return empty.replace(keys=tuple(fill(b, 2 * i) for i, b in enumerate(empty.keys)),
                       values=tuple(fill(b, 2 * i + 1) for i, b in enumerate(empty.values)),
                       lengths=jnp.full((1,), context, jnp.int32))


def main(out, contexts):
  flags.FLAGS(["gpu_decode_loop", "--repeats=3"])
  spec = importlib.util.spec_from_file_location("shapes", "configs/llama2_7b_128k.py")
  shapes = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(shapes)
  target = dict(shapes.get_config().target)
  if os.environ.get("SMALL") == "1":
    target.update(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=4,
                  head_dim=64, vocab_size=1000)
  config = ModelConfig.from_dict(target)
  arrays = level_cost.Arrays(config, None)
  params = arrays.params()
  sizes, weights = StackSizes(stacks.PLAIN, config, None, None), loop.Weights(params, None)
  record = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "runs": []}
  for context in contexts:
    slots = context + LONG + 64
    caches = (jax.jit(lambda: full_cache(config, slots, context))(),)
    start = loop.DecodeStart((jnp.zeros((1, config.vocab_size), jnp.float32), None), SamplingParams.create(),
                             jnp.int32(-1), jax.random.key(0), jnp.zeros((1, slots), jnp.int32),
                             jnp.full((1,), context, jnp.int32))

    def decode(n):   # the caches are donated: each run takes the last one's back, rewound
      nonlocal caches
      began = time.perf_counter()
      result = jax.block_until_ready(loop.decode_loop(sizes, weights, caches, start, n))
      caches = tuple(c.replace(lengths=jnp.full((1,), context, jnp.int32)) for c in result[-1])
      return time.perf_counter() - began

    for n in (SHORT, LONG):
      decode(n)   # compiles
    seconds = {n: sorted(decode(n) for _ in range(3))[1] for n in (SHORT, LONG)}
    run = {"context": context, "slots": slots, "loop_s": seconds,
           "loop_ms_per_token": 1e3 * (seconds[LONG] - seconds[SHORT]) / (LONG - SHORT),
           "timed_step_ms": 1e3 * median_seconds(timed_forward(config), params, jnp.zeros((1, 1), jnp.int32),
                                                 caches[0], repeats=3) / FORWARDS_PER_CALL}
    with tempfile.TemporaryDirectory() as folder:
      with jax.profiler.trace(folder, create_perfetto_trace=True):
        decode(SHORT)
      run["kernels_us_per_token"] = kernels(folder, SHORT)
    print(json.dumps(run), flush=True)
    record["runs"].append(run)
    del caches
    gc.collect()
  json.dump(record, open(out, "w"), indent=1)


if __name__ == "__main__":
  main(sys.argv[1], [int(c) for c in sys.argv[2:]])
