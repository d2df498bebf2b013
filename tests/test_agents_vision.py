"""Multi-turn episodes on a vision-language model (the tiny Qwen2-VL): an episode starts from the ids the model's
processor gives its prompt and images, each policy turn is what a full forward over the images and the whole
conversation so far gives (vision tokens never sampled), appended answers stay text, the batch of episodes keeps the
images so that the training pass's log-probs are the ones the episodes were sampled with, and GRPO trains on them."""

from __future__ import annotations

import io
import json
import shutil

import pytest
import torch

from posttrain.agents.environment import Reset, Step, register_environment
from posttrain.agents.loop import EpisodeRunner
from posttrain.agents.rollout import run_episodes
from posttrain.agents.settings import AgentSettings
from posttrain.agents.template import Template, encode_start, full_render
from posttrain.data.batch import Batch
from posttrain.data.dataset import collate_prompts, encode_with_images, PromptItem
from posttrain.models.load import load_causal_lm, load_tokenizer
from posttrain.models.policy import PolicyModel
from posttrain.models.vision import MM_KEY, forward_inputs, load_vision_processor, vision_token_ids
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.engine import DecodeEngine

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
QUESTIONS = ["<image>How many shapes?", "Look: <image> What is drawn there?"]
SIZES = [(56, 56), (84, 56)]  # 4 and 2 image tokens (the tiny processor resizes to about 56x56 pixels)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    from posttrain.data.synthetic_visual import tokenizer_corpus
    from posttrain.models.tiny_vl import build_tiny_vl_model

    return str(build_tiny_vl_model(tmp_path_factory.mktemp("tiny_vl"), tokenizer_corpus(), seed=0))


@pytest.fixture(scope="module")
def vl(vl_dir):
    tok = load_tokenizer(vl_dir)
    return tok, load_vision_processor(vl_dir, tok), PolicyModel(load_causal_lm(vl_dir)).eval()


def png(size, k: int) -> bytes:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).ellipse((4, 4, 14 + 8 * k, 30), fill="black")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def prompts(proc):
    """Each question with its image: the messages, and the ids and image inputs the dataset's processor gives."""
    out = []
    for k, (question, size) in enumerate(zip(QUESTIONS, SIZES)):
        messages = [{"role": "user", "content": question}]
        ids, images = encode_with_images(proc, messages, [png(size, k)], f"row {k}", "images")
        out.append((messages, ids, images))
    return out


class Retry:
    """Answers every turn with a text message, `turns` times, then ends the episode."""

    def __init__(self, turns=2, content=None):
        self.turns, self.seen, self.content = turns, 0, content

    def reset(self, row):
        return Reset(messages=row["prompt"])

    def step(self, episode):
        self.seen += 1
        if self.seen > self.turns:
            return Step(done=True)
        return Step(messages=[{"role": "tool", "content": self.content or f"try again {self.seen}"}])

    def close(self):
        pass


def runner_for(policy, tok, factory):
    engine = DecodeEngine(policy, tok, device=torch.device("cpu"), dtype=torch.float32)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    runner = EpisodeRunner(engine, tok, AgentSettings(tokenization_sanity_check_mode="disable"), environments=factory)
    runner.template = Template(tok, {im_end})
    engine.eos_ids = {t for t in range(len(tok)) if t % 5 == 0} | {im_end}  # turns end within a few tokens
    return runner, engine


def batch_of(proc, tok):
    rows = prompts(proc)
    items = [PromptItem(prompt_ids=ids, data_source="synthetic/visual-count", ground_truth="1") for _, ids, _ in rows]
    ids, mask = collate_prompts(items, tok.pad_token_id)
    return Batch({"prompts": ids, "prompt_mask": mask},
                 {"uid": ["p0", "p1"], "raw_prompt": [m for m, _, _ in rows], MM_KEY: [im for _, _, im in rows]})


def reference_turn(policy, context: list[int], images: dict, eos: set[int], limit: int) -> list[int]:
    """Greedy tokens after `context` by full forwards over the images and every token (vision tokens excluded),
    up to and including an end-of-turn token."""
    lm, out = policy.lm, []
    vision = torch.tensor(vision_token_ids(lm.config))
    while len(out) < limit:
        ids = torch.tensor([context + out])
        mask = torch.ones_like(ids)
        with torch.no_grad():
            logits = lm(input_ids=ids, attention_mask=mask, **forward_inputs(lm, lm.config, ids, mask, [images])
                        ).logits[0, -1]
        logits[vision] = float("-inf")
        out.append(int(logits.argmax()))
        if out[-1] in eos:
            break
    return out


def test_a_vl_episode_starts_from_the_processor_s_ids_and_each_turn_is_the_full_forward_s(vl):
    """Two prompts whose images have 4 and 2 image tokens, 2 greedy episodes each, two text answers per episode:
    the prompt ids are the processor's; every policy span is the greedy continuation of a full forward over the
    images and everything before it; the full re-render (the tokenization check's) widens the image tokens alike."""
    tok, proc, policy = vl
    runner, engine = runner_for(policy, tok, lambda row: Retry())
    rows = [{"uid": f"p{k}", "prompt": m, MM_KEY: im} for k, (m, _, im) in enumerate(prompts(proc))]
    s = SamplingParams(n=2, do_sample=False, max_new_tokens=120)
    episodes = runner.run(rows, 2, s)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    for k, (messages, ids, images) in enumerate(prompts(proc)):
        for ep in episodes[2 * k: 2 * k + 2]:
            assert ep.prompt_ids == ids and ep.prompt_ids.count(pad) == (4, 2)[k]
            assert ep.images is rows[k][MM_KEY]
        assert encode_start(tok, messages, None, images=images, config=policy.config) == ids
        rendered = full_render(tok, messages + [{"role": "assistant", "content": "two"}], None, images=images,
                               config=policy.config)
        assert rendered[:len(ids)] == ids
    whole = 0
    for ep in episodes:
        i = 0
        while i < len(ep.tokens):
            j = i
            while j < len(ep.tokens) and ep.mask[j] == ep.mask[i]:
                j += 1
            if ep.mask[i] == 1:
                want = reference_turn(policy, ep.prompt_ids + ep.tokens[:i], ep.images, engine.eos_ids,
                                      s.max_new_tokens - i)
                assert ep.tokens[i:j] == want
            i = j
        assert not set(ep.tokens) & set(vision_token_ids(policy.config))
        whole += not ep.truncated and ep.assistant_turns == 3
    assert whole >= 2  # the budget leaves room for whole episodes: both answers appended and gone on from


def test_the_batch_of_vl_episodes_keeps_the_images_for_the_training_pass(vl):
    """Sampled episodes (n=2 per prompt) as the trainer's batch: each row carries its prompt's image inputs, and the
    training pass over that batch gives the log-probs the episodes were sampled with (within 1e-4); with another
    image in their place it does not."""
    tok, proc, policy = vl
    runner, engine = runner_for(policy, tok, lambda row: Retry())
    torch.manual_seed(0)
    out = run_episodes(runner, batch_of(proc, tok), SamplingParams(n=2, max_new_tokens=40, logprobs=True))
    assert len(out) == 4 and out.meta[MM_KEY][0] is out.meta[MM_KEY][1] is out.meta["episode"][0].images
    assert sum(e.assistant_turns for e in out.meta["episode"]) > 4  # answers were appended and gone on from
    mask = out["response_mask"].bool()
    assert (out["response_attention_mask"].bool() & ~mask).any()  # holes: the appended answers
    with torch.no_grad():
        logp, _ = policy(out["input_ids"], out["attention_mask"], out["responses"].shape[1],
                         images=out.meta[MM_KEY])
        _, other = encode_with_images(proc, [{"role": "user", "content": QUESTIONS[0]}], [png(SIZES[0], 5)], "r",
                                      "images")  # another drawing of the same size: as many image tokens
        swapped, _ = policy(out["input_ids"], out["attention_mask"], out["responses"].shape[1],
                            images=[other, other] + out.meta[MM_KEY][2:])
    assert torch.allclose(logp[mask], out["rollout_log_probs"][mask], atol=1e-4)
    assert not torch.allclose(swapped[:2][mask[:2]], out["rollout_log_probs"][:2][mask[:2]], atol=1e-3)


def test_an_answer_with_an_image_ends_its_episode_counted(vl):
    """Appended messages are text: an environment answering with an image part (no image inputs for it) ends
    the episode as a template error instead of feeding the model image tokens without pixels."""
    tok, proc, policy = vl
    picture = [{"type": "image"}, {"type": "text", "text": "here"}]
    runner, _ = runner_for(policy, tok, lambda row: Retry(content=picture))
    messages, _, images = prompts(proc)[0]
    ep, = runner.run([{"uid": "p0", "prompt": messages, MM_KEY: images}], 1,
                     SamplingParams(n=1, do_sample=False, max_new_tokens=30))
    assert ep.tool_errors == {"template_error": 1} and ep.assistant_turns == 1 and all(ep.mask)


@register_environment("test_vl_try_again")
def _try_again(settings):
    return Retry(turns=1)


def test_grpo_trains_two_steps_on_vl_episodes(vl_dir, tmp_path):
    """GRPO on image rows whose episodes get one text answer each: two steps train, the episodes have more than one
    turn and holes in their policy mask, and the training pass's log-probs are the sampling ones (fp32)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from posttrain.config import load_config
    from posttrain.trainer.rl import RLTrainer

    model = tmp_path / "model"  # the tiny VL model, its turns ending on a fifth of its tokens (within a few tokens)
    shutil.copytree(vl_dir, model)
    generation = json.loads((model / "generation_config.json").read_text())
    generation["eos_token_id"] = [generation["eos_token_id"]] + list(range(5, 500, 5))
    (model / "generation_config.json").write_text(json.dumps(generation))
    rows = [{"data_source": "synthetic/visual-count", "prompt": [{"role": "user", "content": QUESTIONS[k % 2]}],
             "images": [png(SIZES[k % 2], k)], "reward_model": {"style": "rule", "ground_truth": str(k % 3)},
             "extra_info": {"index": k}} for k in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    run = tmp_path / "run"
    cfg = load_config(None, [
        "algorithm.adv_estimator=grpo", "data.train_batch_size=4", "data.max_prompt_length=64",
        "data.max_response_length=48", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.multi_turn.enable=True", "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
        "actor_rollout_ref.rollout.agent.default_agent_loop=test_vl_try_again",
        "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode=disable",
        "actor_rollout_ref.rollout.calculate_log_probs=True", "actor_rollout_ref.model.dtype=fp32",
        "actor_rollout_ref.rollout.dtype=fp32", "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False", f"actor_rollout_ref.model.path={model}",
        f"data.train_files={tmp_path / 'train.parquet'}", "trainer.total_training_steps=2", "trainer.test_freq=-1",
        "trainer.save_freq=-1", f"trainer.default_local_dir={run}", "trainer.logger=['jsonl']",
        "trainer.val_before_train=False", "trainer.device=cpu"])
    trainer = RLTrainer(cfg)
    before = {n: p.detach().clone() for n, p in trainer.parts.actor.model.lm.named_parameters()}
    trainer.fit()
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "actor/pg_loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["agent/turns/mean"] > 1 for m in steps)
    assert steps[0]["response_length/policy_tokens_mean"] < steps[0]["response_length/mean"]
    assert all(m["training/rollout_probs_diff_max"] < 1e-4 for m in steps)
    assert any(not torch.equal(p, before[n]) for n, p in trainer.parts.actor.model.lm.named_parameters())
