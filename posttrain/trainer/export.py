"""`posttrain export RUN_DIR/global_step_N OUT_DIR`: a checkpoint (sharded, any layout) as a plain Hugging Face
folder that `from_pretrained` loads — LoRA merged into the weights, the tokenizer beside them. Runs in one process."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace



def load_checkpoint_model(step_dir: str | Path, *, role: str = "actor", runnable: bool = False):
    """(model, hf_dir) of one role of a checkpoint, on the CPU: a causal LM with any LoRA adapter merged (actor), or
    a ValueModel (critic). `hf_dir` holds its config and tokenizer. The structure is built on the meta device, which
    leaves the buffers a checkpoint does not hold (rotary frequencies) uninitialised: enough to save the weights;
    `runnable=True` builds a policy on the CPU instead, so that it can also run."""
    from ..models.load import load_causal_lm
    from ..models.policy import PolicyModel, ValueModel
    from ..parallel.checkpoint import load_role

    step_dir = Path(step_dir)
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
        model = PolicyModel(_cpu_skeleton(str(info_dir), lora) if runnable else
                            load_causal_lm(str(info_dir), meta=True, lora=lora))
    if not runnable or info["kind"] == "value":
        model.to_empty(device="cpu")
    load_role(step_dir / role, model, alone=True)  # also on rank 0 of a running job: no collective
    if info["kind"] != "value":
        model = model.lm.merge_and_unload() if info["lora"] else model.lm
    return model, info_dir


def export_checkpoint(step_dir: str | Path, out_dir: str | Path, *, role: str = "actor", quiet: bool = True) -> Path:
    """Write the folder; `quiet=False` shows a progress bar over the stages (load, write weights, tokenizer). Quiet, it
    draws nothing from Python's or torch's random streams, so that it can run beside training (rich's first import
    draws from Python's)."""
    import contextlib

    from ..models.load import load_tokenizer
    from ..models.vision import copy_processor_files
    from ..progress import ProgressBar

    out_dir = Path(out_dir)
    bar = (contextlib.nullcontext(SimpleNamespace(advance=lambda: None)) if quiet else
           ProgressBar("export", 3, unit="stages", stderr=True))
    with bar as bar:
        model, info_dir = load_checkpoint_model(step_dir, role=role)
        bar.advance()
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir, safe_serialization=True)
        bar.advance()
        load_tokenizer(str(info_dir)).save_pretrained(out_dir)
        copy_processor_files(info_dir, out_dir)
        bar.advance()
    return out_dir


def _cpu_skeleton(hf_dir: str, lora):
    """The causal LM of `hf_dir`'s config on the CPU, its weights left unset where transformers allows it (they are
    loaded next), its buffers computed."""
    import contextlib

    from transformers import AutoModelForCausalLM

    from ..models.load import model_config

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # another transformers release: initialise, then overwrite
        no_init_weights = contextlib.nullcontext
    with no_init_weights():
        lm = AutoModelForCausalLM.from_config(model_config(hf_dir))
    return lora.apply(lm) if lora is not None else lm


class _PeftSettings:
    """The saved adapter config applied as it was at training time."""

    def __init__(self, config):
        self.config = config

    def apply(self, model):
        from peft import get_peft_model

        return get_peft_model(model, self.config)
