"""Decode time of sd/ngram/4 with the round's lax.cond (offered) and without it (offered=None,
the same children): same tokens, same rounds; the difference is the cond's own cost."""
import statistics
import sys
from hitree_jax.data import book_prompts
from hitree_jax.decode import engine
from hitree_jax.decode.drafters import NGramDrafter
from hitree_jax.decode.programs import Programs
from hitree_jax.decode.sampling import SamplingParams
from hitree_jax.loading import load_model
from hitree_jax.tokenizer import load_tokenizer
from hitree_jax.tree import shapes

class NoCond(NGramDrafter):
  def propose(self, key, tree, inp):
    return super().propose(key, tree, inp).replace(offered=None)

model = load_model("smollm2")
tok = load_tokenizer(model.path)
n = int(sys.argv[1]); temp = float(sys.argv[2])
prompts = book_prompts(tok, n, 2)
sampling = SamplingParams.create(temp, 0.9 if temp else 1.0)
res = {"cond": [], "nocond": []}
progs = Programs()
for name, d in (("cond", NGramDrafter(3)), ("nocond", NoCond(3))):
  engine.generate(model.params, model.config, [prompts[0]], max_new_tokens=128, tree=shapes.chain(4), drafter=d, sampling=sampling, programs=progs)
for rep in range(3):
  for name, d in (("cond", NGramDrafter(3)), ("nocond", NoCond(3))):
    for i, p in enumerate(prompts):
      r = engine.generate(model.params, model.config, [p], max_new_tokens=128, tree=shapes.chain(4), drafter=d, sampling=sampling, seed=i, programs=progs)
      res[name].append(r.decode_s / r.target_forwards * 1000)
      print(name, i, round(r.decode_s, 3), r.target_forwards, r.tokens[0][:5], flush=True)
for k, v in res.items():
  print(k, "ms per round median", round(statistics.median(v), 2))
