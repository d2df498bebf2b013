"""`posttrain export RUN_DIR/global_step_N OUT_DIR`: a checkpoint (sharded, any layout) as a plain Hugging Face
folder that `from_pretrained` loads — LoRA merged into the weights, the tokenizer beside them. Runs in one process."""

from __future__ import annotations

import json
from pathlib import Path



def export_checkpoint(step_dir: str | Path, out_dir: str | Path, *, role: str = "actor") -> Path:
    from ..models.load import load_causal_lm, load_tokenizer
    from ..models.policy import PolicyModel, ValueModel
    from ..parallel.checkpoint import load_role

    step_dir, out_dir = Path(step_dir), Path(out_dir)
    info_dir = step_dir / role / "hf"
    if not (info_dir / "role.json").is_file():
        raise FileNotFoundError(f"{step_dir} is not a posttrain checkpoint with a '{role}' (expected {info_dir})")
    info = json.loads((info_dir / "role.json").read_text())
    if info["kind"] == "value":
        model = ValueModel.from_pretrained(str(info_dir), meta=True)
    else:
        lora = None
        if info["lora"]:
            from peft import PeftConfig

            lora = _PeftSettings(PeftConfig.from_pretrained(str(info_dir)))
        model = PolicyModel(load_causal_lm(str(info_dir), meta=True, lora=lora))
    model.to_empty(device="cpu")
    load_role(step_dir / role, model)
    out_dir.mkdir(parents=True, exist_ok=True)
    if info["kind"] == "value":
        model.save_pretrained(out_dir, safe_serialization=True)
    else:
        lm = model.lm.merge_and_unload() if info["lora"] else model.lm
        lm.save_pretrained(out_dir, safe_serialization=True)
    load_tokenizer(str(info_dir)).save_pretrained(out_dir)
    return out_dir


class _PeftSettings:
    """The saved adapter config applied as it was at training time."""

    def __init__(self, config):
        self.config = config

    def apply(self, model):
        from peft import get_peft_model

        return get_peft_model(model, self.config)
