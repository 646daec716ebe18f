"""The cache family every level reads: `full` (KVCache: the full cache, and a level's short
recent cache), `retrieval` (the target's weights over a budget of chosen KV chunks: TriForce),
`streaming` (attention sinks plus a ring of recent tokens: StreamingLLM).

No re-exports here: the model imports `cache.full`, and `cache.retrieval` imports the model.
"""
