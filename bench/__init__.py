"""omnijax's benchmarks, one script per figure, grouped by the paper whose claims they measure.

- `bench.omnitide`: unit-aware retention, the KV layout it leaves and the paging / attention kernels that read it
  (seed 000);
- `bench.tidekv`: layer-major prefill with delayed eviction, its memory, time and fidelity (seed 001);
- `bench.metronome`: serving many live sessions: the unbounded-KV cliff, admission, and the per-step costs a server
  pays (pool size, answer tokens, text in and out, sessions per GPU) (seed 002);
- `bench.peers`: omnijax against other libraries on the same weights.

Every script runs from the repository root as `python -m bench.<group>.<script> [--smoke] [--out DIR]` on the shared
harness `bench.harness`; `bench/README.md` is the index of scripts, figures and commands.
"""
