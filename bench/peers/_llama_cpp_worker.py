"""One llama.cpp measurement in its own process, run by `bench.peers.vs_llama_cpp` with the llama.cpp interpreter
(`--llama-python`, a venv holding `llama-cpp-python`; never the project's): standard library and `llama_cpp` only.

    LLAMA_PYTHON bench/peers/_llama_cpp_worker.py MODEL.gguf PROMPT_FILE TOKENS THREADS [--no-extra-bufts]

Prints one JSON line: the wall-clock times (`time.time()`) of the imports, the load, the prompt's submission, the
first generated token and the last; the process's CPU seconds (`time.process_time()`, every thread's) at the first
and the last generated token; the generated ids; resident memory (`VmRSS`) after the load and at the end, and
the process peak (`VmHWM`).
Greedy (top-k 1), through end-of-turn tokens, `TOKENS` tokens after the prompt (the prompt file's text, tokenized
with special tokens parsed). `--no-extra-bufts` loads without llama.cpp's extra buffer types (weight repacking and
AMX), for a build whose AMX kernels this machine's kernel refuses (SIGILL at the first batched matmul).
"""

import json
import sys
import time


def status_mb(field: str = "VmRSS") -> float:
    """A memory figure of this process from /proc/self/status, MB (`VmHWM`: the peak resident size since exec;
    `ru_maxrss` would count the parent's pages this process was forked with)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main(argv: list) -> int:
    model_path, prompt_file, tokens, threads = argv[0], argv[1], int(argv[2]), int(argv[3])
    no_extra = "--no-extra-bufts" in argv[4:]
    import llama_cpp

    marks = {"imported": time.time()}
    if no_extra:
        default = llama_cpp.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = False
            return p

        llama_cpp.llama.llama_cpp.llama_model_default_params = params
    llm = llama_cpp.Llama(model_path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    marks["loaded"] = time.time()
    rss_loaded = status_mb()
    prompt = llm.tokenize(open(prompt_file, encoding="utf-8").read().encode("utf-8"), add_bos=False, special=True)
    ids, times, cpu = [], [], []
    marks["prompt"] = time.time()
    for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        times.append(time.time())
        cpu.append(time.process_time())
        ids.append(int(token))
        if len(ids) >= tokens:
            break
    marks["first_token"], marks["last_token"] = times[0], times[-1]
    out = {"marks": marks, "cpu_marks": {"first_token": cpu[0], "last_token": cpu[-1]},
           "prompt_tokens": len(prompt), "ids": ids,
           "text": llm.detokenize(ids).decode("utf-8", "replace"), "rss_loaded_mb": rss_loaded,
           "rss_end_mb": status_mb(), "peak_mb": status_mb("VmHWM"),
           "system_info": llama_cpp.llama_print_system_info().decode(), "version": llama_cpp.__version__}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
