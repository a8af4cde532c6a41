"""Retention quality on real weights (issue 36 item 3): pass-key retrieval per retention policy, perplexity against
length with the attention-sink ablation, and TideKV's prefill selectors beside kvpress's presses. The model is
chosen by path (a converted checkpoint or a GGUF file), so the same scripts run any checkpoint omnijax loads; the
figures are in `bench/quality/RESULTS.md`."""
