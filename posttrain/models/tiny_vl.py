"""Offline tiny vision-language model: a randomly initialised ``Qwen2VLForConditionalGeneration`` with its processor.

The tests and the visual demo task need a real Hugging Face VL model directory without touching the hub. The
tokenizer is tiny.py's byte-level BPE plus Qwen2-VL's vision specials; the image processor is transformers' own
Qwen2-VL one (the PIL backend, so torchvision is not needed) with a pixel budget small enough that a 56x56 image
becomes 4 image tokens; the vision tower is one block wide enough to tell a few drawn shapes apart. Everything is
saved with ``save_pretrained`` so that ``AutoProcessor`` / ``AutoModelForImageTextToText`` load it like a download.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration

from .tiny import IM_END, PAD_TOKEN, _mark_tokenizer_class, build_tokenizer

__all__ = ["VISION_START", "IMAGE_PAD", "VISION_END", "VL_CHAT_TEMPLATE", "build_tiny_vl_model"]

VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"
VISION_TOKENS = [VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD]

# tiny.py's ChatML, with Qwen2-VL's rendering of content lists: an image part is one <|image_pad|> between the
# vision markers (the processor widens it to the image's token count).
VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def tiny_image_processor(pixels: int = 56 * 56):
    """Qwen2-VL's image processor (PIL backend) resizing every image to about `pixels` pixels: 56x56 -> a 4x4
    patch grid -> 4 image tokens after the 2x2 merge."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels, patch_size=14, temporal_patch_size=2,
                                    merge_size=2)


def build_tiny_vl_model(out_dir: str | Path, texts: Iterable[str], *, vocab_size: int = 512, hidden_size: int = 128,
                        num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 256,
                        vision_dim: int = 64, vision_depth: int = 1, seed: int = 0) -> Path:
    """Tokenizer + processor + random ``Qwen2VLForConditionalGeneration`` saved into ``out_dir``; returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(texts, vocab_size=vocab_size, extra_special_tokens=VISION_TOKENS)
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    head_dim = hidden_size // num_heads
    eos_id, pad_id = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    text = dict(vocab_size=(len(tokenizer) + 7) // 8 * 8, hidden_size=hidden_size, intermediate_size=intermediate_size,
                num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=eos_id,
                pad_token_id=pad_id, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": _mrope_section(head_dim)})
    vision = dict(depth=vision_depth, embed_dim=vision_dim, hidden_size=hidden_size, num_heads=2, mlp_ratio=2,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=ids[IMAGE_PAD],
                           video_token_id=ids[VIDEO_PAD], vision_start_token_id=ids[VISION_START],
                           vision_end_token_id=ids[VISION_END], tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id,
                                               do_sample=False)
    model.save_pretrained(out, safe_serialization=True)
    tiny_image_processor().save_pretrained(out)
    tokenizer.save_pretrained(out)
    _mark_tokenizer_class(out)
    return out


def _mrope_section(head_dim: int) -> list[int]:
    """Qwen2-VL's split of the rotary half-dimension over (time, height, width): 1/4, 3/8, 3/8 as in the 7B's
    [16, 24, 24] for head_dim 128."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]
