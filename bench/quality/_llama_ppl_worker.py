"""llama.cpp's per-token log-likelihood of given token ids, in its own process, run by `bench.quality.quantized
--accuracy` with the llama.cpp interpreter (`--llama-python`, a venv holding `llama-cpp-python`; never the
project's): standard library, numpy and `llama_cpp` only.

    LLAMA_PYTHON -P bench/quality/_llama_ppl_worker.py MODEL.gguf IDS.json THREADS [--no-extra-bufts]

`-P` (Python >= 3.11) keeps the script's folder off `sys.path`: it holds a `selectors.py` that would shadow the
standard library's. `IDS.json` holds `N + 1` token ids. The first `N` are evaluated in one context (no BOS added,
nothing else prepended: the ids as given) with every position's logits kept (`logits_all`), and the negative
log-likelihood of each next id (`ids[1:]`) is taken from a float64 log-softmax of those logits. Prints one JSON
line: `nll` (N floats), the evaluation's seconds, the library version and the system info. `--no-extra-bufts` loads
without llama.cpp's extra buffer types (weight repacking and AMX), for a build whose AMX kernels this machine
refuses.
"""

import json
import sys
import time

import numpy as np


def main(argv: list) -> int:
    model_path, ids_file, threads = argv[0], argv[1], int(argv[2])
    no_extra = "--no-extra-bufts" in argv[3:]
    import llama_cpp

    if no_extra:
        default = llama_cpp.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = False
            return p

        llama_cpp.llama.llama_cpp.llama_model_default_params = params
    with open(ids_file, encoding="utf-8") as f:
        ids = [int(i) for i in json.load(f)]
    n = len(ids) - 1
    llm = llama_cpp.Llama(model_path, n_ctx=n + 16, n_batch=512, n_ubatch=512, logits_all=True, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    started = time.time()
    llm.reset()
    llm.eval(ids[:-1])
    seconds = time.time() - started
    logits = np.asarray(llm.scores[:n], dtype=np.float64)  # [N, V]: row i predicts ids[i + 1]
    peak = logits.max(axis=-1, keepdims=True)
    logz = np.log(np.exp(logits - peak).sum(axis=-1)) + peak[:, 0]
    nll = logz - logits[np.arange(n), ids[1:]]
    print(json.dumps({"nll": nll.tolist(), "seconds": seconds, "version": llama_cpp.__version__,
                      "system_info": llama_cpp.llama_print_system_info().decode()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
