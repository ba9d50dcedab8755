#!/usr/bin/env python
"""Greedy generation with HuggingFace transformers, for ``tools/bench_decode.py --checkpoint``.

Runs in the reference environment (torch + transformers >= 5.15, see tests/fixtures/README.md), not in
the package's: ``HF_PYTHON tools/hf_generate.py HF_FOLDER 1,2,3 256 [--threads N]``. Prints one JSON line:
the ids (prompt + new), and the seconds spent importing and loading and in ``generate``. EOS never stops
it (``min_new_tokens`` = ``max_new_tokens``), as ``ms-deepseek generate --ignore-eos``.
"""

import argparse
import json
import time

START = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("prompt_ids")
    parser.add_argument("new_tokens", type=int)
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32).eval()
    loaded = time.perf_counter()
    prompt = torch.tensor([[int(x) for x in args.prompt_ids.split(",")]])
    n = args.new_tokens
    with torch.inference_mode():
        out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    done = time.perf_counter()
    print(json.dumps({"ids": out[0].tolist(), "load_s": loaded - START, "generate_s": done - loaded}))


if __name__ == "__main__":
    main()
