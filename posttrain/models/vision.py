"""Vision-language inputs: images of a data row -> the model's image inputs, and those inputs -> forward kwargs.

A row's image inputs (`pixel_values` (patches, D) and `image_grid_thw` (images, 3), as the model's processor makes
them) travel with the row in `Batch.meta["multi_modal_inputs"]`; any pass over a set of rows concatenates them in
row order, marks the image tokens (`mm_token_type_ids`) and computes the model's own 3-D rotary positions (Qwen2-VL's
`get_rope_index`), so that rollout, log-probs, reference, critic and SFT all see the same positions.

Vision special tokens are never sampled (`vision_token_ids` are suppressed in generation) and are excluded from the
policy's distribution in the log-prob passes too, so rollout and training log-probs describe the same policy.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

IMAGE_PLACEHOLDER = "<image>"
MM_KEY = "multi_modal_inputs"


class VisionDataError(ValueError):
    """A row's images cannot be read or do not match its `<image>` placeholders."""


def is_vision_config(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def vision_token_ids(config) -> list[int]:
    """The ids of the image/video placeholder and marker tokens a VL model reads but must never emit."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return sorted({int(getattr(config, n)) for n in names if getattr(config, n, None) is not None})


def load_image(value, where: str):
    """A PIL RGB image from bytes, a {"bytes", "path"} struct (the parquet layout of HF image columns), or a path."""
    from PIL import Image

    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    try:
        if isinstance(value, (bytes, bytearray)):
            image = Image.open(io.BytesIO(value))
        elif isinstance(value, (str, Path)):
            image = Image.open(Path(value).expanduser())
        elif isinstance(value, Image.Image):
            image = value
        else:
            raise VisionDataError(f"{where}: an image must be bytes, a path or a {{'bytes', 'path'}} struct, got "
                                  f"{type(value).__name__}")
        return image.convert("RGB")
    except (OSError, ValueError) as e:
        if isinstance(e, VisionDataError):
            raise
        raise VisionDataError(f"{where}: cannot read an image ({type(e).__name__}: {e})") from None


def image_messages(messages: list[dict], n_images: int, where: str) -> list[dict]:
    """Messages whose `<image>` placeholders become image parts of a content list (the chat templates of VL
    models render those as their vision tokens); the count must equal the row's number of images."""
    out, seen = [], 0
    for m in messages:
        content = m["content"]
        if not isinstance(content, str) or IMAGE_PLACEHOLDER not in content:
            out.append(m)
            continue
        parts = []
        for i, text in enumerate(content.split(IMAGE_PLACEHOLDER)):
            if i:
                parts.append({"type": "image"})
                seen += 1
            if text:
                parts.append({"type": "text", "text": text})
        out.append({**m, "content": parts})
    if seen != n_images:
        raise VisionDataError(f"{where}: the prompt has {seen} '{IMAGE_PLACEHOLDER}' placeholders but the row has "
                              f"{n_images} images")
    return out


class VisionProcessor:
    """The model's `AutoProcessor` (text + images -> input_ids with image tokens, pixel_values, image_grid_thw).

    Where the processor class cannot be built (Qwen2-VL's processor also builds a video processor, which needs
    torchvision), the model's image processor and tokenizer do the same job: each image placeholder token is widened
    to the image's token count (grid t*h*w / merge_size^2), as the processor does."""

    def __init__(self, path: str, tokenizer, *, trust_remote_code: bool = False):
        from transformers import AutoImageProcessor, AutoProcessor

        self.tokenizer = tokenizer
        try:
            self.processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
            self.image_processor = self.processor.image_processor
        except ImportError as e:
            self.processor = None
            self.image_processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
            log.warning("vision inputs: the processor of %s cannot be built here (%s); using its image processor "
                        "and tokenizer", path, str(e).strip().split(" but ")[0])
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.merge = int(getattr(self.image_processor, "merge_size", 1) or 1)

    def encode(self, messages: list[dict], images: list, *, template_kwargs: dict | None = None,
               add_generation_prompt: bool = True, tools: list[dict] | None = None) -> tuple[list[int], dict | None]:
        """Token ids of the templated conversation with its images (and the tool schemas `tools`, for the template's
        `tools=`), and the row's image inputs (None without images)."""
        template = self.processor if self.processor is not None else self.tokenizer
        text = template.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                            **({"tools": tools} if tools else {}), **(template_kwargs or {}))
        if not images:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"], None
        if self.processor is not None:
            out = self.processor(text=[text], images=images, return_tensors="pt")
            ids = out["input_ids"][0].tolist()
            pixels, grid = out["pixel_values"], out["image_grid_thw"]
        else:
            out = self.image_processor(images=images, return_tensors="pt")
            pixels, grid = out["pixel_values"], out["image_grid_thw"]
            pieces = text.split(self.image_token)
            if len(pieces) - 1 != len(images):
                raise VisionDataError(f"the chat template wrote {len(pieces) - 1} image tokens for {len(images)} "
                                      "images")
            counts = (grid.prod(-1) // self.merge ** 2).tolist()
            text = pieces[0] + "".join(self.image_token * n + p for n, p in zip(counts, pieces[1:]))
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids, {"pixel_values": pixels, "image_grid_thw": grid}


def widen_image_tokens(ids: list[int], config, image_inputs: dict) -> list[int]:
    """`ids` of a conversation rendered by the chat template alone (one image token per image) with each image token
    widened to its image's token count (grid t*h*w / merge_size^2), as the processor widens them: the ids the
    processor gives for the same conversation and images, from the image inputs it made (`image_grid_thw`)."""
    merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", None)
    if merge is None:
        raise TypeError(f"{type(config).__name__} has no vision_config.spatial_merge_size: not a Qwen2-VL style model")
    counts = (image_inputs["image_grid_thw"].prod(-1) // int(merge) ** 2).tolist()
    token = int(config.image_token_id)
    if ids.count(token) != len(counts):
        raise VisionDataError(f"the chat template wrote {ids.count(token)} image tokens for {len(counts)} images")
    out, k = [], 0
    for t in ids:
        if t == token:
            out += [token] * int(counts[k])
            k += 1
        else:
            out.append(t)
    return out


def load_vision_processor(path: str, tokenizer, *, trust_remote_code: bool = False, key: str = "model path",
                          chat_template: str | None = None) -> VisionProcessor | None:
    """The processor of a VL model at `path` (a folder or hub id, see hub.py), or None for a text-only model.
    `chat_template` replaces the processor's own (`model.custom_chat_template`, as verl sets it on the processor)."""
    from transformers import AutoConfig

    from .hub import resolve_model_source

    path = resolve_model_source(path, key=key)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if not is_vision_config(config):
        return None
    vision = VisionProcessor(path, tokenizer, trust_remote_code=trust_remote_code)
    if chat_template is not None and vision.processor is not None:
        vision.processor.chat_template = chat_template
    return vision


def _rope_owner(module):
    """The module that holds `get_rope_index` (the VL backbone under a *ForConditionalGeneration)."""
    for m in (module, getattr(module, "model", None)):
        if m is not None and hasattr(m, "get_rope_index"):
            return m
    raise TypeError(f"{type(module).__name__} has no get_rope_index: not a Qwen2-VL style model")


def forward_inputs(module, config, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   rows: list | None) -> dict:
    """Forward kwargs of a VL model for these rows: their image inputs concatenated in row order, the image-token
    types, and the model's 3-D rotary positions (left or right padding both ignored, as the model's own
    `get_rope_index` does). `rows` holds each row's image inputs (or None for a row without images)."""
    device = input_ids.device
    with_images = [r for r in rows or [] if r is not None]
    types = (input_ids == config.image_token_id).int()
    grid = torch.cat([r["image_grid_thw"] for r in with_images]).to(device) if with_images else None
    with torch.no_grad():
        positions, _ = _rope_owner(module).get_rope_index(input_ids, mm_token_type_ids=types, image_grid_thw=grid,
                                                          attention_mask=attention_mask)
    out = {"position_ids": positions, "mm_token_type_ids": types}
    if with_images:
        out["pixel_values"] = torch.cat([r["pixel_values"] for r in with_images]).to(device)
        out["image_grid_thw"] = grid
    return out


VISION_TOWER_NAMES = ("visual", "vision_tower", "vision_model")


def freeze_vision_tower(model, option: str = "actor_rollout_ref.actor.freeze_vision_tower") -> int:
    """Stop training the vision encoder of a VL model (`actor_rollout_ref.actor.freeze_vision_tower`); returns the
    number of frozen parameters. A model without one is an error: the setting would silently do nothing."""
    from ..errors import ConfigError

    towers = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in VISION_TOWER_NAMES]
    if not towers:
        raise ConfigError(f"{option}=True, but the model has no vision tower ({type(model).__name__} is "
                          "text-only)")
    frozen = 0
    for tower in towers:
        for p in tower.parameters():
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.json")


def copy_processor_files(source, dest) -> None:
    """The processor's config files of a VL model folder, copied beside a checkpoint's or an export's tokenizer so
    that the saved folder loads with its processor too (nothing to copy for text models)."""
    import shutil

    if not source:
        return
    for name in PROCESSOR_FILES:
        if (Path(source) / name).is_file() and Path(source).resolve() != Path(dest).resolve():
            shutil.copy(Path(source) / name, Path(dest) / name)
