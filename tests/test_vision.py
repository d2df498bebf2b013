"""Vision-language RL: image rows in the standard layout, the model's processor, 3-D positions, rollout log-probs
equal to the training pass's, values and SFT on images, freeze_vision_tower, `prepare geo3k` / `visual-count`, and
the familiar VL command lines on the tiny Qwen2-VL model."""

import io
import json
import sys
from pathlib import Path

import pytest
import torch

from posttrain.config import load_config
from posttrain.data.batch import Batch
from posttrain.data.dataset import RLDataset, collate_prompts
from posttrain.data.rows import DataError
from posttrain.models.load import load_causal_lm, load_tokenizer
from posttrain.models.policy import PolicyModel, ValueModel
from posttrain.models.vision import MM_KEY, load_vision_processor, vision_token_ids

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    from posttrain.data.synthetic_visual import tokenizer_corpus
    from posttrain.models.tiny_vl import build_tiny_vl_model

    return build_tiny_vl_model(tmp_path_factory.mktemp("tiny_vl"), tokenizer_corpus(), seed=0)


@pytest.fixture(scope="module")
def visual_task(tmp_path_factory):
    from posttrain.data.synthetic_visual import write_visual_task

    return write_visual_task(tmp_path_factory.mktemp("visual"), seed=0, n_sft=64, n_rl=16, n_test=8)


@pytest.fixture(scope="module")
def vl(vl_dir):
    tok = load_tokenizer(str(vl_dir))
    return tok, load_vision_processor(str(vl_dir), tok)


def png(size=(56, 56), color="white") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def write_rows(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def row(content, images, truth="1"):
    return {"data_source": "synthetic/visual-count", "prompt": [{"role": "user", "content": content}],
            "images": images, "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"index": 0}}


# ----------------------------------------------------------------------------------------------------- data


def test_image_rows_become_image_tokens_and_inputs(vl, tmp_path):
    """bytes, {"bytes", "path"} structs and paths all load; each `<image>` becomes the vision markers around as many
    image tokens as the processor's grid says."""
    tok, proc = vl
    (tmp_path / "a.png").write_bytes(png((112, 56)))
    files = [write_rows(tmp_path / "structs.parquet", [row("<image>How many?", [{"bytes": png(), "path": None}])]),
             write_rows(tmp_path / "bytes.parquet", [row("Left <image> right <image>", [png(), png((112, 56))])]),
             write_rows(tmp_path / "paths.parquet", [row("<image>", [str(tmp_path / "a.png")])])]
    data = RLDataset([str(f) for f in files], tok, processor=proc, max_prompt_length=128)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    first, second = data[0], data[1]
    assert first.images["image_grid_thw"].tolist() == [[1, 4, 4]]
    # the tiny processor's pixel budget is 56x56: a 112x56 image becomes a 2x4 patch grid
    assert second.images["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 4]]
    assert data[2].images["image_grid_thw"].tolist() == [[1, 2, 4]]
    for item in data.items:  # one image token per 2x2 patches, all in the prompt
        assert item.prompt_ids.count(pad) == int(item.images["image_grid_thw"].prod(-1).sum()) // 4
        assert item.images["pixel_values"].shape[0] == int(item.images["image_grid_thw"].prod(-1).sum())
    assert tok.decode(first.prompt_ids).startswith("<|im_start|>user\n<|vision_start|><|image_pad|>")


def test_the_models_own_processor_and_the_fallback_build_the_same_inputs(vl_dir, monkeypatch):
    """With torchvision installed, the model's `AutoProcessor` builds the inputs; without it (Qwen2-VL's processor
    also builds a video processor), its image processor and tokenizer do: both give the same ids and pixels."""
    pytest.importorskip("torchvision")
    import transformers
    from PIL import Image

    from posttrain.models.vision import image_messages, load_image

    tok = load_tokenizer(str(vl_dir))
    own = load_vision_processor(str(vl_dir), tok)
    assert own.processor is not None, "the processor class should build where torchvision is installed"

    def unavailable(*args, **kwargs):
        raise ImportError("Qwen2VLVideoProcessor requires the Torchvision library but it was not found")

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", unavailable)
    fallback = load_vision_processor(str(vl_dir), tok)
    assert fallback.processor is None
    images = [load_image(png(), "a"), load_image(png((112, 56), "black"), "b"), Image.new("RGB", (30, 90), "red")]
    messages = image_messages([{"role": "system", "content": "Count."},
                               {"role": "user", "content": "<image> and <image>, then <image>?"}], 3, "row")
    ids, inputs = own.encode(messages, images)
    ids_fb, inputs_fb = fallback.encode(messages, images)
    assert ids == ids_fb
    assert inputs["image_grid_thw"].tolist() == inputs_fb["image_grid_thw"].tolist()
    torch.testing.assert_close(inputs["pixel_values"], inputs_fb["pixel_values"], rtol=0, atol=1e-6)
    text_ids, none = own.encode([{"role": "user", "content": "no image"}], [])
    assert none is None and text_ids == fallback.encode([{"role": "user", "content": "no image"}], [])[0]


def test_bad_image_rows_are_named(vl, tiny_tokenizer, tmp_path):
    tok, proc = vl
    cases = [(row("no placeholder", [png()]), "0 '<image>' placeholders but the row has 1 images"),
             (row("<image>", [b"not an image"]), "cannot read an image"),
             (row("<image>" * 30, [png()] * 30), "never truncated")]
    for i, (bad, message) in enumerate(cases):
        path = write_rows(tmp_path / f"bad{i}.parquet", [bad])
        with pytest.raises(DataError, match=message):
            RLDataset(path, tok, processor=proc, max_prompt_length=64, truncation="left")
    with pytest.raises(DataError, match="holds images, but the model is text-only"):
        RLDataset(write_rows(tmp_path / "t.parquet", [row("<image>", [png()])]), tiny_tokenizer)


# --------------------------------------------------------------------------------------- log-probs, rollout


def _prompt_batch(tok, proc, sizes):
    from PIL import Image, ImageDraw

    from posttrain.data.dataset import PromptItem
    from posttrain.models.vision import image_messages

    items, images = [], []
    for k, size in enumerate(sizes):
        img = Image.new("RGB", size, "white")
        ImageDraw.Draw(img).ellipse((5, 5, 5 + 10 * (k + 1), 25), fill="black")
        ids, mm = proc.encode(image_messages([{"role": "user", "content": "<image>How many?" + " so" * k}], 1, "r"),
                              [img])
        items.append(PromptItem(prompt_ids=ids, data_source="synthetic/visual-count", ground_truth="1"))
        images.append(mm)
    ids, mask = collate_prompts(items, tok.pad_token_id)  # left-padded: the prompts differ in length
    return Batch({"prompts": ids, "prompt_mask": mask}, {"uid": [str(i) for i in range(len(items))],
                                                         MM_KEY: images})


@pytest.mark.parametrize("engine", ["hf", "posttrain"])
def test_rollout_logprobs_equal_training_logprobs(vl, vl_dir, engine, caplog):
    """Left-padded prompts with images of two sizes, n=2 samples: the log-probs the rollout sampled with equal the
    chunked training pass's on the same tokens (3-D positions computed by the model's get_rope_index); no vision
    token is ever sampled; the posttrain engine hands VL models to transformers' generate and says so."""
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.engine import DecodeEngine
    from posttrain.rollout.transformers_generate import TransformersGenerate

    tok, proc = vl
    policy = PolicyModel(load_causal_lm(str(vl_dir)))
    cls = TransformersGenerate if engine == "hf" else DecodeEngine
    rollout = cls(policy, tok, device=torch.device("cpu"), dtype=torch.float32)
    batch = _prompt_batch(tok, proc, [(56, 56), (84, 56), (56, 112)])
    torch.manual_seed(0)
    out = rollout.generate(batch, SamplingParams(n=2, max_new_tokens=8, logprobs=True))
    if engine == "posttrain":
        assert "vision-language model" in caplog.text and "transformers' generate" in caplog.text
    assert len(out) == 6 and out.meta[MM_KEY][0] is out.meta[MM_KEY][1]
    assert not torch.isin(out["responses"], torch.tensor(vision_token_ids(policy.config))).any()
    logp, ent = policy(out["input_ids"], out["attention_mask"], out["responses"].shape[1], chunk_size=5,
                       images=out.meta[MM_KEY])
    mask = out["response_mask"].bool()
    assert torch.allclose(logp[mask], out["rollout_log_probs"][mask], atol=1e-4)
    assert torch.isfinite(ent).all()


def test_images_change_logprobs_and_values(vl, vl_dir):
    """Actor and critic read the images: with every row given the first row's image (same tokens), the log-probs
    and values of the other rows change; the critic of a VL model is its backbone plus the value head."""
    tok, proc = vl
    batch = _prompt_batch(tok, proc, [(56, 56), (56, 56), (56, 56)])
    ids = torch.cat([batch["prompts"], torch.full((3, 3), 7)], dim=1)
    mask = torch.cat([batch["prompt_mask"], torch.ones(3, 3, dtype=torch.long)], dim=1)
    same = [batch.meta[MM_KEY][0]] * 3
    policy = PolicyModel(load_causal_lm(str(vl_dir))).eval()
    critic = ValueModel.from_pretrained(str(vl_dir)).eval()
    with torch.no_grad():
        lp, _ = policy(ids, mask, 3, images=batch.meta[MM_KEY])
        lp_same, _ = policy(ids, mask, 3, images=same)
        v = critic(ids, mask, 3, images=batch.meta[MM_KEY])
        v_same = critic(ids, mask, 3, images=same)
    assert v.shape == (3, 3)
    assert torch.equal(lp[0], lp_same[0]) and not torch.allclose(lp[1:], lp_same[1:])
    assert torch.equal(v[0], v_same[0]) and not torch.allclose(v[1:], v_same[1:])


# --------------------------------------------------------------------------------------------- training


def vl_config(vl_path, files, run_dir, steps, *extra):
    return load_config(None, [
        "algorithm.adv_estimator=grpo", "data.train_batch_size=4", "data.max_prompt_length=64",
        "data.max_response_length=6", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3", "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False", f"actor_rollout_ref.model.path={vl_path}",
        f"data.train_files={files['rl_train']}", f"data.val_files={files['test']}",
        f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={run_dir}", "trainer.logger=['jsonl']",
        "trainer.val_before_train=True", "trainer.test_freq=-1", "trainer.device=cpu", *extra])


def test_ppo_with_critic_reference_and_frozen_vision_tower(vl_dir, visual_task, tmp_path):
    """Two PPO steps (critic, KL loss against the reference) on image rows: the frozen vision tower keeps its
    weights while the language model's change; validation scores the held-out images."""
    from posttrain.trainer.rl import RLTrainer

    cfg = vl_config(vl_dir, visual_task, tmp_path / "run", 2, "algorithm.adv_estimator=gae",
                    "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.freeze_vision_tower=True",
                    "critic.ppo_micro_batch_size_per_gpu=3")
    trainer = RLTrainer(cfg)
    lm = trainer.parts.actor.model.lm
    before = {n: p.detach().clone() for n, p in lm.named_parameters()}
    trainer.fit()
    changed = {n for n, p in lm.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".visual." not in n and not n.startswith("model.visual") for n in changed)
    assert any("language_model" in n for n in changed)
    assert not any(p.requires_grad for n, p in lm.named_parameters() if "visual" in n)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "val-core/synthetic/visual-count/acc/mean@1" in rows[0]
    assert all("critic/vf_loss" in r and "actor/kl_loss" in r for r in rows if "actor/pg_loss" in r)


def test_freeze_vision_tower_of_a_text_model_is_refused(tiny_model_dir, small_task, tmp_path):
    from posttrain.config import ConfigError
    from posttrain.trainer.rl import RLTrainer
    from tests.test_rl_integration import rl_config

    out, files = small_task
    cfg = rl_config(out, files, "frozen_text", 1, "actor_rollout_ref.actor.freeze_vision_tower=True",
                    f"trainer.default_local_dir={tmp_path / 'run'}")
    with pytest.raises(ConfigError, match="freeze_vision_tower=True, but the model has no vision tower"):
        RLTrainer(cfg)


# ------------------------------------------------------------------------------------------------ prepare


def test_prepare_geo3k_from_the_original_layout(vl, tmp_path):
    """A small file set in the hiyouga/geometry3k layout (images, problem, answer): train and test splits in the
    layout, loadable by the dataset with the processor, scored by the boxed-answer scorer."""
    from posttrain.data.preprocess import prepare
    from posttrain.reward.registry import default_compute_score

    original = tmp_path / "geometry3k" / "data"
    original.mkdir(parents=True)
    for split, n in (("train", 3), ("validation", 1), ("test", 2)):
        write_rows(original / f"{split}-00000-of-00001.parquet",
                   [{"images": [{"bytes": png(), "path": f"{split}{i}.png"}],
                     "problem": f"<image>Find x. Triangle {i}.", "answer": str(10 + i)} for i in range(n)])
    summary = prepare("geo3k", tmp_path / "geometry3k", tmp_path / "out")
    assert {s: n for s, (_, n) in summary.items()} == {"train": 3, "test": 2}
    tok, proc = vl
    data = RLDataset(str(summary["test"][0]), tok, processor=proc, max_prompt_length=512)
    item = data[1]
    assert item.data_source == "hiyouga/geometry3k" and item.ground_truth == "11"
    assert item.images["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert "\\boxed{}" in item.raw_prompt[0]["content"]
    assert default_compute_score("hiyouga/geometry3k", "<think>x</think> \\boxed{11}", "11") == 1.0
    with pytest.raises(ValueError, match="only parquet"):
        prepare("geo3k", tmp_path / "geometry3k", tmp_path / "out2", fmt="jsonl")


def test_prepare_visual_count_cli(tmp_path):
    import subprocess

    run = subprocess.run([sys.executable, "-m", "posttrain", "prepare", "visual-count", "--output-dir",
                          str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "sft_train: 256 rows" in run.stdout and "test: 64 rows" in run.stdout
    import pyarrow.parquet as pq

    rows = pq.read_table(tmp_path / "test.parquet").to_pylist()
    assert rows[0]["prompt"][0]["content"].startswith("<image>") and rows[0]["images"][0]["bytes"][:4] == b"\x89PNG"


# ------------------------------------------------------------------------------------- familiar scripts


VL_SCRIPTS = ["grpo_trainer__run_qwen2_5_vl-7b.json", "grpo_trainer__run_qwen2_5_vl-7b_freeze_vision.json",
              "grpo_trainer__run_qwen2_5_vl-7b_seq_balance.json", "grpo_trainer__run_qwen2_5_vl-7b-sglang.json"]


def test_familiar_vl_command_lines_load_and_train(vl_dir, visual_task, tmp_path):
    """The recorded Qwen2.5-VL GRPO scripts with the model and data paths changed: they load, and the
    freeze-vision one trains two steps on the tiny VL model and the visual task."""
    sys.path.insert(0, str(ROOT / "tools"))
    from verl_examples import SMALL

    from posttrain.config import hydra_config
    from posttrain.trainer.rl import run_rl
    from tests.test_porting import POSTTRAIN_ENGINE, _script_argv

    for name in VL_SCRIPTS:
        _, hydra, overrides = _script_argv(name, str(vl_dir), str(visual_task["rl_train"]))
        config_file, base = hydra_config(hydra.get("--config-path"), hydra.get("--config-name", "").strip("'"))
        cfg = load_config(config_file, base + overrides)
        assert cfg.data.image_key == "images"
    assert cfg.actor_rollout_ref.actor.freeze_vision_tower is False
    _, hydra, overrides = _script_argv(VL_SCRIPTS[1], str(vl_dir), str(visual_task["rl_train"]))
    small = [s.replace("STEPS", "2").replace("RUN_DIR", str(tmp_path / "run")) for s in SMALL]
    # on posttrain's engine: vLLM's is refused for vision-language models here (docs/rollout_engines.md)
    cfg = load_config(None, overrides + small + ["data.train_max_samples=8", POSTTRAIN_ENGINE])
    assert cfg.actor_rollout_ref.actor.freeze_vision_tower is True
    run_rl(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2]


def test_sft_on_images_with_a_frozen_tower_then_eval(vl_dir, visual_task, tmp_path):
    """`posttrain sft` on image rows: the vision encoder keeps its weights with --freeze-vision-tower, the language
    model learns, the saved folder loads with its image processor, and `posttrain eval` scores held-out images."""
    from safetensors.torch import load_file

    from posttrain.trainer.evaluate import EvalArgs, run_eval
    from posttrain.trainer.sft import SFTArgs, run_sft

    out = tmp_path / "sft"
    run_sft(SFTArgs(model_path=str(vl_dir), train_files=[str(visual_task["sft_train"])], output_dir=str(out),
                    epochs=0.25, lr=1e-2, batch_size=8, max_length=64, eval_every=2, seed=0, quiet=True,
                    freeze_vision_tower=True, device="cpu"))
    before, after = load_file(str(vl_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert before.keys() == after.keys()
    visual = [k for k in before if "visual" in k]
    assert visual and all(torch.equal(before[k], after[k]) for k in visual)
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("model.layers."))
    assert (out / "preprocessor_config.json").is_file()
    metrics = run_eval(EvalArgs(model=str(out), data_files=[str(visual_task["test"])], output=str(tmp_path / "e.jsonl"),
                                max_new_tokens=6, max_prompt_length=64, num_workers=0, device="cpu", quiet=True))
    assert "val-core/synthetic/visual-count/acc/mean@1" in metrics


@pytest.mark.slow
def test_sft_then_grpo_raises_held_out_accuracy(vl_dir, tmp_path):
    """The tiny VL model learns to read the images: SFT on the counting task (30% of the demonstrations for four dots
    say five), then 15 seeded GRPO steps raise held-out greedy accuracy on 64 unseen images and the training
    reward. Measured (fp32, this project's 2-core machine, 1 thread): accuracy 25.0% -> 75.0%, the mean score of the
    first 4 steps 0.22 -> last 5 steps 0.35; seed 1 gave 31.2% -> 48.4%."""
    from posttrain.data.synthetic_visual import write_visual_task
    from posttrain.trainer.rl import RLTrainer
    from posttrain.trainer.sft import SFTArgs, run_sft

    files = write_visual_task(tmp_path / "data", seed=0, n_sft=256, n_rl=256, n_test=64, wrong_frac=0.7)
    run_sft(SFTArgs(model_path=str(vl_dir), train_files=[str(files["sft_train"])], output_dir=str(tmp_path / "sft"),
                    epochs=8, lr=5e-3, batch_size=32, max_length=64, eval_every=20, seed=0, dtype="fp32",
                    device="cpu", quiet=True))
    cfg = load_config(None, [
        "algorithm.adv_estimator=grpo", "data.train_batch_size=16", "data.max_prompt_length=64",
        "data.max_response_length=8", "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.optim.lr=3e-4", "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        f"actor_rollout_ref.model.path={tmp_path / 'sft'}", f"data.train_files={files['rl_train']}",
        f"data.val_files={files['test']}", "trainer.test_freq=5", "trainer.val_before_train=True",
        "trainer.total_training_steps=15", f"trainer.default_local_dir={tmp_path / 'rl'}", "trainer.logger=['jsonl']",
        "actor_rollout_ref.model.dtype=fp32", "actor_rollout_ref.rollout.dtype=fp32", "trainer.seed=0",
        "trainer.device=cpu"])
    final = RLTrainer(cfg).fit()
    rows = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    key = "val-core/synthetic/visual-count/acc/mean@1"
    before, after = rows[0][key], final[key]
    scores = [r["critic/score/mean"] for r in rows if "critic/score/mean" in r]
    assert after >= before + 0.15, ([(r["step"], r[key]) for r in rows if key in r], scores)
    assert sum(scores[-5:]) / 5 > sum(scores[:4]) / 4 + 0.05, scores
