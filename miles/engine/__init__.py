"""The embedded inference engine: continuous batching over a token-slot KV cache, per-token
log-probs, prefix reuse and versioned weight updates, served over SGLang's native HTTP API.

Run it with `python -m miles.engine --model DIR`; start it from Python with
`miles.engine.process.start_engine`.
"""
