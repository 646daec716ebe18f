"""hitree_jax: speculative decoding for Llama-family models in JAX, exact to the target's output.

Importing it keeps jax to the CPU where libtpu is installed but no accelerator is attached, so a
library user sees none of libtpu's failed search for a TPU (topology.skip_absent_tpu).
"""

from hitree_jax import topology as _topology

_topology.skip_absent_tpu()
