"""Tiny random-weight models for Switchyard's real-engine tests and benchmarks.

Run with the engine environment's Python (it has torch, transformers,
tokenizers and safetensors); nothing is downloaded:

    python make_models.py --out DIR --qwen3-tokenizer-dir DIR [--sharegpt FILE]

writes, under DIR:

- ``qwen3-tiny/``: a 2-layer ``Qwen3ForCausalLM`` (hidden 256, head_dim 64)
  with random weights and the bundled Qwen3 tokenizer and chat template;
- ``qwen3-tiny-lora-a/``, ``-b/``, ``-c/``: three LoRA adapters for it
  (rank 8 on q_proj and v_proj, random weights), laid out as PEFT saves
  them (``adapter_config.json``, ``adapter_model.safetensors``);
- ``bpe-tiny/``: a second model with a tokenizer of its own: a byte-level
  BPE of 4,096 tokens trained here on the first ShareGPT conversations
  (or on a fixed text when no trace is given), a ChatML chat template, and
  a 2-layer ``Qwen3ForCausalLM`` sized to that vocabulary.

Weights come from a fixed seed, so two runs write the same models. A
directory that already holds a finished model (its ``.done`` marker) is
kept as it is.
"""

import argparse
import gzip
import json
import os
import shutil

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import Qwen3Config, Qwen3ForCausalLM

HIDDEN = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
LORA_RANK = 8

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def done(path):
    return os.path.isfile(os.path.join(path, ".done"))


def finish(part, path):
    with open(os.path.join(part, ".done"), "w") as f:
        f.write("ok\n")
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.replace(part, path)


def save_model(part, vocab_size, bos, eos, seed):
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(part, safe_serialization=True)


def qwen3_tiny(out, tokenizer_dir):
    path = os.path.join(out, "qwen3-tiny")
    if done(path):
        return
    part = path + ".part"
    shutil.rmtree(part, ignore_errors=True)
    os.makedirs(part)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        src = os.path.join(tokenizer_dir, name)
        if not os.path.isfile(src):
            src = os.path.join(tokenizer_dir, "qwen3-" + name)
        shutil.copyfile(src, os.path.join(part, name))
    # Qwen3's <|endoftext|> and <|im_end|>.
    save_model(part, 151936, 151643, 151645, seed=0)
    finish(part, path)


def lora(out, name, seed):
    path = os.path.join(out, name)
    if done(path):
        return
    part = path + ".part"
    shutil.rmtree(part, ignore_errors=True)
    os.makedirs(part)
    torch.manual_seed(seed)
    shapes = {"q_proj": (HEADS * HEAD_DIM, HIDDEN), "v_proj": (KV_HEADS * HEAD_DIM, HIDDEN)}
    tensors = {}
    for layer in range(LAYERS):
        for module, (out_features, in_features) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[key + ".lora_A.weight"] = torch.randn(LORA_RANK, in_features) * 0.02
            tensors[key + ".lora_B.weight"] = torch.randn(out_features, LORA_RANK) * 0.02
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(part, "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": os.path.join(out, "qwen3-tiny"),
        "r": LORA_RANK,
        "lora_alpha": 2 * LORA_RANK,
        "lora_dropout": 0.0,
        "target_modules": sorted(shapes),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    with open(os.path.join(part, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    finish(part, path)


def training_text(sharegpt, limit=400):
    if sharegpt is None:
        return ["The quick brown fox jumps over the lazy dog. " * 50]
    texts = []
    with gzip.open(sharegpt, "rt", encoding="utf-8") as f:
        for line in f:
            for turn in json.loads(line).get("conversations", []):
                texts.append(turn.get("value", ""))
            if len(texts) >= limit:
                break
    return texts


def bpe_tiny(out, sharegpt):
    path = os.path.join(out, "bpe-tiny")
    if done(path):
        return
    part = path + ".part"
    shutil.rmtree(part, ignore_errors=True)
    os.makedirs(part)
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(sharegpt), trainer=trainer)
    tokenizer.save(os.path.join(part, "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in special}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 8192,
        "chat_template": CHATML,
        "added_tokens_decoder": {
            str(ids[t]): {"content": t, "special": True, "lstrip": False,
                          "rstrip": False, "normalized": False, "single_word": False}
            for t in special
        },
    }
    with open(os.path.join(part, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    vocab = tokenizer.get_vocab_size()
    save_model(part, vocab, ids["<|endoftext|>"], ids["<|im_end|>"], seed=1)
    finish(part, path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--qwen3-tokenizer-dir", required=True)
    parser.add_argument("--sharegpt")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    qwen3_tiny(args.out, args.qwen3_tokenizer_dir)
    lora(args.out, "qwen3-tiny-lora-a", seed=10)
    lora(args.out, "qwen3-tiny-lora-b", seed=11)
    lora(args.out, "qwen3-tiny-lora-c", seed=12)
    bpe_tiny(args.out, args.sharegpt)
    print(args.out)


if __name__ == "__main__":
    main()
