"""Small caches for the lower levels of a speculative hierarchy.

`retrieval`: the target's own weights over a budget of chosen KV chunks (TriForce).
`streaming`: attention sinks plus a ring of recent tokens for the bottom draft (StreamingLLM).
Both are read-only `context` caches for model.forward.
"""

from hitree_jax.cache.retrieval import RetrievalCache, from_full, last_token_queries, reselect, select
from hitree_jax.cache.streaming import StreamingCache

__all__ = ["RetrievalCache", "StreamingCache", "from_full", "last_token_queries", "reselect", "select"]
