"""omnijax against other libraries on the same weights, each side in its own processes.

What the scripts measure: streaming latency with the full context and with bounded retention against Hugging Face
transformers, and compressed prefill's time and peak memory against kvpress (`vs_transformers`). Results:
`bench/peers/RESULTS.md`.
"""
