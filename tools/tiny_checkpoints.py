#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Tiny, seeded, random checkpoints for the EAGLE-3 targets and drafters.

Generated, never downloaded or committed: the same seed writes byte-identical
files. Kinds: ``deepseek-v3``, ``kimi-k25`` (the same text model under
``language_model.``, a tiny MoonViT tower and projector, and a media processor
shipped as checkpoint code, as the real one is), ``glm5`` and ``deepseek-v32``
(plus the DSA indexer weights), ``eagle3-drafter`` (a Llama draft layer) and
``eagle3-mla-drafter`` (the published "eagle3-mla" layout: a DeepSeek MLA draft
layer reading [embeds, hidden]). Weights are drawn so that a skipped norm or an
ignored routing correction bias changes the output. Every kind gets a
byte-level BPE tokenizer (one token per UTF-8 byte) plus special tokens.
The DeepSeek-V3 and Kimi-K2.5 targets and the MLA drafter use YaRN with the
published configs' rope_scaling (``DEEPSEEK_YARN``, ``KIMI_YARN``), as the
real models do; GLM-5 and DeepSeek-V3.2 keep plain RoPE.

Only torch and safetensors, so the GPU harness imports it as is::

    info = write_checkpoint("deepseek-v3", "/tmp/ckpt/dsv3", seed=0)
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
# Kimi-K2.5's media tokens (its processor and placeholder strings use these).
KIMI_MEDIA_TOKENS = ("<|media_begin|>", "<|media_content|>", "<|media_pad|>",
                     "<|media_end|>", "<|kimi_k25_video_placeholder|>")
BASE_SPECIALS: tuple[str, ...] = (BOS, EOS, PAD) + KIMI_MEDIA_TOKENS
# The config's vocab_size; tokens past the named ones are "<|reserved_N|>"
# specials, so every id the random lm_head can pick decodes cleanly.
VOCAB_SIZE = 320
# rope_scaling as published: DeepSeek-R1's config.json and TorchSpec's
# Kimi-K2.5 eagle3-mla drafter (tests/v1/spec_decode/published_configs). With
# mscale == mscale_all_dim the rotary itself is unscaled and the attention
# softmax scale is multiplied by (0.1 * ln(factor) + 1) ** 2 (1.87 and 2.00).
DEEPSEEK_YARN: dict[str, Any] = {
    "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
    "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn",
}
KIMI_YARN: dict[str, Any] = {
    "beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0,
    "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn",
}


def _yarn(rope: dict[str, Any]) -> dict[str, Any]:
    """Config fields for YaRN ``rope``: a copy (configs get patched in
    place) and the extended context it implies."""
    return {"rope_scaling": dict(rope), "max_position_embeddings": int(
        rope["original_max_position_embeddings"] * rope["factor"])}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode table (ByteLevel BPE)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    codes = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, codes)}


def special_token_ids(vocab_size: int = VOCAB_SIZE) -> dict[str, int]:
    """Ids of all special tokens: named ones first, then reserved fillers."""
    names = list(BASE_SPECIALS)
    names += [f"<|reserved_{i}|>" for i in range(vocab_size - 256 - len(names))]
    return {name: 256 + i for i, name in enumerate(names)}


def write_tokenizer(outdir: Path, vocab_size: int = VOCAB_SIZE) -> list[str]:
    """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json."""
    if vocab_size < 256 + len(BASE_SPECIALS):
        raise ValueError(f"vocab_size {vocab_size} too small for the tokenizer")
    b2u = _bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    specials = special_token_ids(vocab_size)
    added = [{"id": i, "content": name, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True}
             for name, i in specials.items()]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False,
                  "trim_offsets": True, "use_regex": True}
    bos_id = specials[BOS]

    def seq(name: str) -> dict[str, Any]:
        return {"Sequence": {"id": name, "type_id": 0}}

    bos_piece = {"SpecialToken": {"id": BOS, "type_id": 0}}
    tokenizer_json = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": added, "normalizer": None, "pre_tokenizer": byte_level,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [bos_piece, seq("A")],
            "pair": [bos_piece, seq("A"), bos_piece, seq("B")],
            "special_tokens": {BOS: {"id": BOS, "ids": [bos_id], "tokens": [BOS]}},
        },
        "decoder": dict(byte_level, add_prefix_space=True),
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None,
            "continuing_subword_prefix": None, "end_of_word_suffix": None,
            "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": vocab, "merges": [],
        },
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
        "add_bos_token": True, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": 4096,
        "chat_template": (
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
        ),
    }
    special_map = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    files = {
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": special_map,
    }
    for name, obj in files.items():
        _write_json(outdir / name, obj)
    return list(files)



@dataclass
class WeightWriter:
    """Seeded tensor factory; tensors are drawn in insertion order."""

    seed: int
    dtype: torch.dtype
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.gen = torch.Generator(device="cpu").manual_seed(self.seed)

    def _add(self, name: str, t: torch.Tensor, keep_dtype: bool = False) -> None:
        if name in self.tensors:
            raise KeyError(f"duplicate tensor {name}")
        self.tensors[name] = t.contiguous() if keep_dtype else t.to(self.dtype).contiguous()

    def linear(self, name: str, out_f: int, in_f: int, bias: bool = False) -> None:
        """Weight ~ N(0, 1/in_f): activations keep their scale layer to layer."""
        w = torch.randn(out_f, in_f, generator=self.gen) / math.sqrt(in_f)
        self._add(f"{name}.weight", w)
        if bias:
            self._add(f"{name}.bias", 0.02 * torch.randn(out_f, generator=self.gen))

    def norm(self, name: str, dim: int, bias: bool = False) -> None:
        """Norm gains near 1 (not exactly 1, so a skipped norm is visible)."""
        self._add(f"{name}.weight", 1.0 + 0.1 * torch.randn(dim, generator=self.gen))
        if bias:
            self._add(f"{name}.bias", 0.02 * torch.randn(dim, generator=self.gen))

    def mlp(self, name: str, inter: int, h: int) -> None:
        self.linear(f"{name}.gate_proj", inter, h)
        self.linear(f"{name}.up_proj", inter, h)
        self.linear(f"{name}.down_proj", h, inter)

    def normal(self, name: str, shape: Sequence[int], std: float) -> None:
        self._add(name, std * torch.randn(*shape, generator=self.gen))

    def raw(self, name: str, t: torch.Tensor) -> None:
        self._add(name, t, keep_dtype=True)

    def save(self, path: Path, metadata: dict[str, str] | None = None) -> None:
        save_file(self.tensors, str(path), metadata=metadata or {"format": "pt"})

    def num_params(self) -> int:
        return sum(t.numel() for t in self.tensors.values())


def deepseek_v3_text_config(**overrides: Any) -> dict[str, Any]:
    """A tiny DeepSeek-V3 text config (HF field names, as in the real one)."""
    ids = special_token_ids()
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": VOCAB_SIZE, "hidden_size": 128, "intermediate_size": 256,
        "moe_intermediate_size": 64, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_shared_experts": 1, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_group": 4, "topk_group": 2, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "first_k_dense_replace": 2, "moe_layer_freq": 1,
        "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 48,
        "qk_rope_head_dim": 16, "v_head_dim": 64, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": None, "rope_interleave": True, "attention_bias": False,
        "attention_dropout": 0.0, "initializer_range": 0.02,
        "tie_word_embeddings": False, "use_cache": True, "num_nextn_predict_layers": 0,
        "bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD],
        "torch_dtype": "float32",
    }
    cfg.update(overrides)
    return cfg


def _write_mla(w: WeightWriter, cfg: dict[str, Any], a: str, in_f: int) -> None:
    """MLA projections of the attention ``a`` over ``in_f`` inputs."""
    heads, q_lora, kv_lora = (cfg[k] for k in ("num_attention_heads", "q_lora_rank",
                                               "kv_lora_rank"))
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    if q_lora is None:
        w.linear(f"{a}.q_proj", heads * (nope + rope), in_f)
    else:
        w.linear(f"{a}.q_a_proj", q_lora, in_f)
        w.norm(f"{a}.q_a_layernorm", q_lora)
        w.linear(f"{a}.q_b_proj", heads * (nope + rope), q_lora)
    w.linear(f"{a}.kv_a_proj_with_mqa", kv_lora + rope, in_f)
    w.norm(f"{a}.kv_a_layernorm", kv_lora)
    w.linear(f"{a}.kv_b_proj", heads * (nope + v), kv_lora)
    w.linear(f"{a}.o_proj", cfg["hidden_size"], heads * v)


def _write_deepseek_text_weights(
    w: WeightWriter, cfg: dict[str, Any], prefix: str, indexer: bool = False
) -> None:
    """DeepSeek-V3 (and V3.2/GLM-5 with ``indexer``) text weights, HF names."""
    h, q_lora = cfg["hidden_size"], cfg["q_lora_rank"]
    n_exp, moe_i = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    m = f"{prefix}model"
    w.normal(f"{m}.embed_tokens.weight", (cfg["vocab_size"], h), std=1.0)
    for i in range(cfg["num_hidden_layers"]):
        p = f"{m}.layers.{i}"
        w.norm(f"{p}.input_layernorm", h)
        w.norm(f"{p}.post_attention_layernorm", h)
        a = f"{p}.self_attn"
        _write_mla(w, cfg, a, h)
        if indexer:
            ih, inh = cfg["index_head_dim"], cfg["index_n_heads"]
            w.linear(f"{a}.indexer.wq_b", inh * ih, q_lora)
            w.linear(f"{a}.indexer.wk", ih, h)
            w.norm(f"{a}.indexer.k_norm", ih, bias=True)
            w.linear(f"{a}.indexer.weights_proj", inh, h)
        dense = i < cfg["first_k_dense_replace"] or i % cfg.get("moe_layer_freq", 1)
        if dense:
            w.mlp(f"{p}.mlp", cfg["intermediate_size"], h)
            continue
        w.linear(f"{p}.mlp.gate", n_exp, h)
        # Non-zero and large enough to change which experts win: an engine
        # that ignored the correction bias would route differently.
        bias = 0.5 * (torch.rand(n_exp, generator=w.gen) - 0.5)
        w.raw(f"{p}.mlp.gate.e_score_correction_bias", bias.to(torch.float32))
        for j in range(n_exp):
            w.mlp(f"{p}.mlp.experts.{j}", moe_i, h)
        if cfg.get("n_shared_experts"):
            w.mlp(f"{p}.mlp.shared_experts", moe_i * cfg["n_shared_experts"], h)
    w.norm(f"{m}.norm", h)
    w.linear(f"{prefix}lm_head", cfg["vocab_size"], h)



@dataclass
class Written:
    kind: str
    outdir: Path
    files: list[str]
    num_params: int
    config: dict[str, Any]


def _finish(
    kind: str, outdir: Path, w: WeightWriter, config: dict[str, Any], extra: list[str]
) -> Written:
    _write_json(outdir / "config.json", config)
    ids = special_token_ids()
    _write_json(outdir / "generation_config.json",
                {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "do_sample": False})
    w.save(outdir / "model.safetensors")
    files = ["config.json", "generation_config.json", "model.safetensors", *extra]
    return Written(kind, outdir, files, w.num_params(), config)


def write_deepseek_v3(
    outdir: Path, seed: int, dtype: str = "float32", **overrides: Any
) -> Written:
    cfg = deepseek_v3_text_config(torch_dtype=dtype, **{**_yarn(DEEPSEEK_YARN), **overrides})
    w = WeightWriter(seed, DTYPES[dtype])
    _write_deepseek_text_weights(w, cfg, prefix="")
    return _finish("deepseek-v3", outdir, w, cfg, write_tokenizer(outdir))


def glm5_config(**overrides: Any) -> dict[str, Any]:
    """GLM-5's config shape (glm_moe_dsa), shrunk; DSA indexer fields kept."""
    cfg = deepseek_v3_text_config(
        architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa",
        n_group=1, topk_group=1, first_k_dense_replace=3, index_head_dim=32,
        index_n_heads=4, index_topk=64, indexer_rope_interleave=True,
        rms_norm_eps=1e-5, rope_theta=1000000.0)
    cfg.update(overrides)
    return cfg


def write_glm5(
    outdir: Path, seed: int, dtype: str = "float32", **overrides: Any
) -> Written:
    cfg = glm5_config(torch_dtype=dtype, **overrides)
    w = WeightWriter(seed, DTYPES[dtype])
    _write_deepseek_text_weights(w, cfg, prefix="", indexer=True)
    return _finish("glm5", outdir, w, cfg, write_tokenizer(outdir))


def write_deepseek_v32(
    outdir: Path, seed: int, dtype: str = "float32", **overrides: Any
) -> Written:
    """DeepSeek-V3.2 (deepseek_v32): DeepSeek-V3 plus the DSA indexer."""
    cfg = deepseek_v3_text_config(
        architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32",
        index_head_dim=32, index_n_heads=4, index_topk=128, torch_dtype=dtype)
    cfg.update(overrides)
    w = WeightWriter(seed, DTYPES[dtype])
    _write_deepseek_text_weights(w, cfg, prefix="", indexer=True)
    return _finish("deepseek-v32", outdir, w, cfg, write_tokenizer(outdir))


KIMI_PROCESSOR_CODE = '''\
# Generated by tools/tiny_checkpoints.py: a small stand-in for Kimi-K2.5's
# checkpoint-shipped media processor, with the interface vLLM 0.16's
# kimi_k25.py uses (preprocess, media_tokens_calculator, split_video_chunks,
# num_frames_per_chunk). Images are resized to a fixed small patch grid.
import numpy as np
import torch
from transformers.image_processing_utils import BaseImageProcessor


class TinyKimiK25MediaProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values", "grid_thws"]

    def __init__(self, patch_size=14, merge_kernel_size=(2, 2), grid_hw=(4, 4),
                 num_frames_per_chunk=4, **kwargs):
        super().__init__(**kwargs)
        self.patch_size = patch_size
        self.merge_kernel_size = list(merge_kernel_size)
        self.grid_hw = list(grid_hw)
        self.num_frames_per_chunk = num_frames_per_chunk

    def _frames(self, chunk):
        if chunk["type"] == "image":
            return [chunk["image"]]
        return list(chunk["video_chunk"])

    def media_tokens_calculator(self, chunk):
        gh, gw = self.grid_hw
        kh, kw = self.merge_kernel_size
        return (gh // kh) * (gw // kw)

    def split_video_chunks(self, video):
        n = self.num_frames_per_chunk
        frames = list(video)
        return [
            {"type": "video_chunk", "video_chunk": frames[i:i + n]}
            for i in range(0, len(frames), n)
        ]

    def _pixels(self, frame):
        gh, gw = self.grid_hw
        p = self.patch_size
        img = frame.convert("RGB").resize((gw * p, gh * p))
        x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 127.5 - 1.0)
        x = x.permute(2, 0, 1)  # 3, H, W
        x = x.reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4)
        return x.reshape(gh * gw, 3, p, p)

    def preprocess(self, vision_chunks, **kwargs):
        pixels, grids = [], []
        gh, gw = self.grid_hw
        for chunk in vision_chunks:
            frames = self._frames(chunk)
            pixels += [self._pixels(f) for f in frames]
            grids.append([len(frames), gh, gw])
        return {
            "pixel_values": torch.cat(pixels),
            "grid_thws": torch.tensor(grids, dtype=torch.int64),
        }
'''


def write_kimi_k25(
    outdir: Path, seed: int, dtype: str = "float32", **overrides: Any
) -> Written:
    text = deepseek_v3_text_config(torch_dtype=dtype, **{**_yarn(KIMI_YARN), **overrides})
    text.pop("architectures")
    vis: dict[str, Any] = {
        "model_type": "kimi_k25_vision", "patch_size": 14,
        "init_pos_emb_height": 8, "init_pos_emb_width": 8, "init_pos_emb_time": 4,
        "pos_emb_type": "divided_fixed", "num_attention_heads": 2,
        "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
        "merge_kernel_size": [2, 2], "video_attn_type": "spatial_temporal",
        "merge_type": "sd2_tpool", "mm_projector_type": "patchmerger",
        "mm_hidden_size": text["hidden_size"], "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5,
    }
    specials = special_token_ids()
    cfg: dict[str, Any] = {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": text, "vision_config": vis,
        "media_placeholder_token_id": specials["<|media_pad|>"],
        "pad_token_id": specials[PAD], "bos_token_id": specials[BOS],
        "eos_token_id": specials[EOS], "ignore_index": -100,
        "use_unified_vision_chunk": False,
        "video_placeholder": "<|kimi_k25_video_placeholder|>", "torch_dtype": dtype,
    }
    w = WeightWriter(seed, DTYPES[dtype])
    _write_deepseek_text_weights(w, text, prefix="language_model.")
    d, mlp, ps = vis["hidden_size"], vis["intermediate_size"], vis["patch_size"]
    vt = "vision_tower"
    w.normal(f"{vt}.patch_embed.proj.weight", (d, 3, ps, ps), std=(3 * ps * ps) ** -0.5)
    w.normal(f"{vt}.patch_embed.proj.bias", (d,), std=0.02)
    w.normal(
        f"{vt}.patch_embed.pos_emb.weight",
        (vis["init_pos_emb_height"], vis["init_pos_emb_width"], d),
        std=0.02,
    )
    for i in range(vis["num_hidden_layers"]):
        b = f"{vt}.encoder.blocks.{i}"
        w.norm(f"{b}.norm0", d, bias=True)
        w.norm(f"{b}.norm1", d, bias=True)
        w.linear(f"{b}.wqkv", 3 * d, d, bias=True)
        w.linear(f"{b}.wo", d, d, bias=True)
        w.linear(f"{b}.mlp.fc0", mlp, d, bias=True)
        w.linear(f"{b}.mlp.fc1", d, mlp, bias=True)
    w.norm(f"{vt}.encoder.final_layernorm", d, bias=True)
    kh, kw = vis["merge_kernel_size"]
    merged = d * kh * kw
    w.norm("mm_projector.pre_norm", d, bias=True)
    w.linear("mm_projector.proj.0", merged, merged, bias=True)
    w.linear("mm_projector.proj.2", text["hidden_size"], merged, bias=True)

    extra = write_tokenizer(outdir)
    (outdir / "kimi_k25_media_processor.py").write_text(KIMI_PROCESSOR_CODE)
    proc = "TinyKimiK25MediaProcessor"
    _write_json(outdir / "preprocessor_config.json", {
        "auto_map": {"AutoImageProcessor": f"kimi_k25_media_processor.{proc}"},
        "image_processor_type": proc, "patch_size": ps,
        "merge_kernel_size": [kh, kw], "grid_hw": [4, 4], "num_frames_per_chunk": 4})
    extra += ["kimi_k25_media_processor.py", "preprocessor_config.json"]
    return _finish("kimi-k25", outdir, w, cfg, extra)


def _write_drafter(kind: str, outdir: Path, seed: int, dtype: str,
                   cfg: dict[str, Any], attn: Callable[..., None]) -> Written:
    """The layout both drafter kinds share; ``attn(w, prefix, in_features)``
    writes the draft layer's attention. The draft vocabulary is a seeded,
    sorted subset of the target's ids."""
    h, dv = cfg["hidden_size"], cfg["draft_vocab_size"]
    w = WeightWriter(seed, DTYPES[dtype])
    # Without explicit ids the target's default (3 layers) is used.
    n_aux = len(cfg.get("eagle_aux_hidden_state_layer_ids") or (0, 0, 0))
    w.linear("fc", h, n_aux * cfg["target_hidden_size"])
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        w.norm(f"midlayer.{norm}", h)
    attn(w, "midlayer.self_attn", 2 * h)  # the draft layer reads [embeds, hidden]
    w.mlp("midlayer.mlp", cfg["intermediate_size"], h)
    w.norm("norm", h)
    w.linear("lm_head", dv, h)
    keep = torch.randperm(cfg["vocab_size"], generator=w.gen)[:dv].sort().values
    w.raw("d2t", (keep - torch.arange(dv)).to(torch.int64))
    t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
    t2d[keep] = True
    w.raw("t2d", t2d)
    return _finish(kind, outdir, w, cfg, write_tokenizer(outdir))


def eagle3_drafter_config(
    target_hidden_size: int = 128,
    target_vocab_size: int = VOCAB_SIZE,
    aux_layer_ids: Sequence[int] | None = (1, 3, 6),
    draft_vocab_size: int = 256,
    **overrides: Any,
) -> dict[str, Any]:
    """EAGLE-3 draft head config in the shape published drafters use.

    ``aux_layer_ids=None`` leaves ``eagle_aux_hidden_state_layer_ids`` out, as
    older drafters do: the engine then uses the target's default layers.
    """
    h = target_hidden_size
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": h, "target_hidden_size": h, "intermediate_size": 2 * h,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": h // 4, "hidden_act": "silu", "vocab_size": target_vocab_size,
        "draft_vocab_size": draft_vocab_size, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "norm_before_residual": False, "bos_token_id": special_token_ids()[BOS],
        "eos_token_id": special_token_ids()[EOS],
        "eagle_config": {"use_aux_hidden_state": True}, "torch_dtype": "float32",
    }
    _set_aux_layer_ids(cfg, aux_layer_ids)
    cfg.update(overrides)
    return cfg


def _set_aux_layer_ids(cfg: dict[str, Any], aux_layer_ids: Sequence[int] | None) -> None:
    """Both places drafters keep the ids (top level, as vLLM's runner reads
    them, and in eagle_config, as speculators writes them); None leaves the
    field out so the target's default applies."""
    if aux_layer_ids is not None:
        ids = [int(i) for i in aux_layer_ids]
        cfg["eagle_aux_hidden_state_layer_ids"] = ids
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids


def write_eagle3_drafter(
    outdir: Path,
    seed: int,
    dtype: str = "float32",
    aux_layer_ids: Sequence[int] | None = (1, 3, 6),
    target_hidden_size: int = 128,
    target_vocab_size: int = VOCAB_SIZE,
    **overrides: Any,
) -> Written:
    cfg = eagle3_drafter_config(
        target_hidden_size=target_hidden_size,
        target_vocab_size=target_vocab_size,
        aux_layer_ids=aux_layer_ids,
        torch_dtype=dtype,
        **overrides,
    )
    heads, kv_heads, hd = (cfg[k] for k in ("num_attention_heads",
                                            "num_key_value_heads", "head_dim"))

    def attn(w: WeightWriter, a: str, in_f: int) -> None:
        w.linear(f"{a}.q_proj", heads * hd, in_f)
        w.linear(f"{a}.k_proj", kv_heads * hd, in_f)
        w.linear(f"{a}.v_proj", kv_heads * hd, in_f)
        w.linear(f"{a}.o_proj", cfg["hidden_size"], heads * hd)

    return _write_drafter("eagle3-drafter", outdir, seed, dtype, cfg, attn)


def eagle3_mla_drafter_config(
    aux_layer_ids: Sequence[int] | None = (1, 3, 6),
    draft_vocab_size: int = 256,
    model_type: str = "deepseek_v3",
    **overrides: Any,
) -> dict[str, Any]:
    """Config of an EAGLE-3 drafter with a DeepSeek MLA draft layer: the
    target's DeepSeek-V3 text config cut to one dense layer, plus the EAGLE-3
    fields (as the published eagle3-mla drafters ship it)."""
    cfg = deepseek_v3_text_config(
        **_yarn(DEEPSEEK_YARN),
        architectures=["Eagle3DeepseekV2ForCausalLM"],
        model_type=model_type,
        num_hidden_layers=1,
        first_k_dense_replace=1,
        n_routed_experts=None,
        draft_vocab_size=draft_vocab_size,
        eagle_config={"use_aux_hidden_state": True},
    )
    cfg["target_hidden_size"] = cfg["hidden_size"]
    _set_aux_layer_ids(cfg, aux_layer_ids)
    cfg.update(overrides)
    return cfg


def write_eagle3_mla_drafter(
    outdir: Path,
    seed: int,
    dtype: str = "float32",
    aux_layer_ids: Sequence[int] | None = (1, 3, 6),
    **overrides: Any,
) -> Written:
    cfg = eagle3_mla_drafter_config(
        aux_layer_ids=aux_layer_ids, torch_dtype=dtype, **overrides
    )
    return _write_drafter("eagle3-mla-drafter", outdir, seed, dtype, cfg,
                          lambda w, a, in_f: _write_mla(w, cfg, a, in_f))



# ---------------------------------------------------------------------------
# Kimi-K2.5 INT4: the routed experts in compressed-tensors W4A16
# ---------------------------------------------------------------------------

# Routed experts only: the published quantization_config's `ignore` keeps
# attention, shared experts and the dense MLP in 16 bits, and the router gate
# is built unquantized by vLLM (deepseek_v2.py, quant_config=None).
_EXPERT_WEIGHT = ".mlp.experts."
_KIMI_TEXT_PREFIX = "language_model."


def _weight_args(quantization_config: dict[str, Any]):
    """The one weight scheme of a compressed-tensors config, as its library
    reads it (compressed_tensors is imported only here: the GPU harness and
    the CPU venv both have it, as a vLLM requirement)."""
    from compressed_tensors.quantization import QuantizationArgs

    if quantization_config.get("format") != "pack-quantized":
        raise ValueError(f"format {quantization_config.get('format')!r}: only pack-quantized is written")
    groups = quantization_config["config_groups"]
    if len(groups) != 1:
        raise ValueError(f"{len(groups)} config groups: one weight scheme expected")
    return QuantizationArgs(**next(iter(groups.values()))["weights"])


def quantize_w4a16(weight: torch.Tensor, quantization_config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One [out, in] weight rounded to the config's int grid (min-max scale
    per group, as its `observer: minmax` does) and packed by compressed_tensors'
    own compressor: {weight_packed, weight_scale, weight_shape}, the tensors
    vLLM's compressed-tensors loader reads (suffixes of the HF name's
    ``.weight`` stem)."""
    from compressed_tensors.compressors.quantized_compressors.pack_quantized import (
        PackedQuantizationCompressor,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    args = _weight_args(quantization_config)
    w = weight.to(torch.float32)
    out_f, in_f = w.shape
    g = args.group_size
    if in_f % g:
        raise ValueError(f"input width {in_f} is not a multiple of group_size {g}")
    grouped = w.view(out_f, in_f // g, g)
    scale, zp = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    # The scale is stored in the checkpoint's 16-bit dtype; quantize with the
    # stored value so that dequantizing the file gives back what was rounded.
    scale = scale.to(torch.bfloat16)
    comp = PackedQuantizationCompressor(config=None).compress_weight(
        w, scale.to(torch.float32), args, zero_point=zp if not args.symmetric else None)
    return {"weight_packed": comp["weight_packed"], "weight_scale": scale,
            "weight_shape": comp["weight_shape"].to(torch.int64)}


def dequantize_w4a16(tensors: dict[str, torch.Tensor], quantization_config: dict[str, Any]) -> torch.Tensor:
    """compressed_tensors' own decompression of one packed weight (float32)."""
    from compressed_tensors.compressors.quantized_compressors.pack_quantized import (
        PackedQuantizationCompressor,
    )

    args = _weight_args(quantization_config)
    data = {k: v.to(torch.float32) if k == "weight_scale" else v for k, v in tensors.items()}
    return PackedQuantizationCompressor(config=None).decompress_weight(data, args).to(torch.float32)


def kimi_text_view(kimi: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """The text model of a kimi-k25 checkpoint as a DeepSeek-V3 checkpoint
    (what transformers 4.57 and the bench's training read): its text_config
    at the top level, ``language_model.`` stripped, the vision weights left
    out, the tokenizer copied. Packed experts are dequantized through
    compressed_tensors, so the view of an INT4 checkpoint is the independent
    reference of what it serves."""
    import shutil

    from safetensors.torch import load_file

    src, dst = Path(kimi), Path(out)
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    text = dict(cfg["text_config"], architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    q = text.pop("quantization_config", None)
    text["torch_dtype"] = "float32" if q else text.get("torch_dtype", "float32")
    weights = load_file(str(src / "model.safetensors"))
    view: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if not name.startswith(_KIMI_TEXT_PREFIX):
            continue
        name = name[len(_KIMI_TEXT_PREFIX):]
        if name.endswith(".weight_packed"):
            stem = name[: -len("_packed")]
            parts = {k: weights[f"{_KIMI_TEXT_PREFIX}{stem}_{k.split('_', 1)[1]}"]
                     for k in ("weight_packed", "weight_scale", "weight_shape")}
            view[stem] = dequantize_w4a16(parts, q)
        elif not name.endswith((".weight_scale", ".weight_shape")):
            view[name] = t.to(torch.float32) if q else t
    save_file({k: v.contiguous() for k, v in view.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    _write_json(dst / "config.json", text)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(src / f, dst / f)
    return dst


def write_kimi_k25_int4(
    kimi: str | os.PathLike[str], out: str | os.PathLike[str], quantization_config: dict[str, Any],
    text_weights: str | os.PathLike[str] | None = None,
) -> Written:
    """The kimi-k25 checkpoint ``kimi`` as an INT4 release: every routed
    expert's projections packed W4A16 by ``quantization_config`` (pass the
    published one, verbatim), which goes where Kimi-K2.5 keeps it, inside
    ``text_config``. ``text_weights``: a DeepSeek-V3 checkpoint
    (kimi_text_view, then trained) whose weights replace the text model's."""
    import shutil

    from safetensors.torch import load_file

    src, dst = Path(kimi), Path(out)
    dst.mkdir(parents=True, exist_ok=True)
    weights = load_file(str(src / "model.safetensors"))
    if text_weights is not None:
        for name, t in load_file(str(Path(text_weights) / "model.safetensors")).items():
            full = _KIMI_TEXT_PREFIX + name
            if full not in weights:
                raise KeyError(f"{text_weights}: {name} is not a tensor of {kimi}'s text model")
            weights[full] = t.to(weights[full].dtype)
    packed: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if _EXPERT_WEIGHT in name and name.endswith("_proj.weight"):
            stem = name[: -len(".weight")]
            for k, v in quantize_w4a16(t, quantization_config).items():
                packed[f"{stem}.{k}"] = v
        else:
            packed[name] = t
    if not any(k.endswith(".weight_packed") for k in packed):
        raise ValueError(f"{kimi}: no routed expert to quantize")
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["quantization_config"] = quantization_config
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, dst / f.name)
    _write_json(dst / "config.json", cfg)
    save_file({k: v.contiguous() for k, v in packed.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return Written("kimi-k25-int4", dst, sorted(f.name for f in dst.iterdir()),
                   sum(v.numel() for v in packed.values()), cfg)


WRITERS: dict[str, Callable[..., Written]] = {
    "deepseek-v3": write_deepseek_v3,
    "kimi-k25": write_kimi_k25,
    "glm5": write_glm5,
    "deepseek-v32": write_deepseek_v32,
    "eagle3-drafter": write_eagle3_drafter,
    "eagle3-mla-drafter": write_eagle3_mla_drafter,
}


def write_checkpoint(
    kind: str, outdir: str | os.PathLike[str], seed: int = 0, **kwargs: Any
) -> Written:
    """Write checkpoint ``kind`` into ``outdir`` (created); see module doc."""
    if kind not in WRITERS:
        raise ValueError(f"unknown kind {kind!r}; choose from {', '.join(WRITERS)}")
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    return WRITERS[kind](out, seed, **kwargs)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
