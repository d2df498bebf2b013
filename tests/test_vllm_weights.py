"""The trainer's weights as the vLLM engine loads them (no vLLM needed): every tensor under its Hugging Face name,
whole, LoRA adapters merged as peft merges them; sharded units grouped into buckets of at most
update_weights_bucket_megabytes, a unit never split; a changed parameter changes the fingerprint."""

import copy

import torch

from posttrain.models.load import LoraSettings, load_causal_lm
from posttrain.models.policy import PolicyModel
from posttrain.rollout.vllm.trainer_weights import _buckets, _Entry, trainer_weights, weights_fingerprint


def test_every_weight_by_its_hugging_face_name(tiny_model_dir):
    lm = load_causal_lm(str(tiny_model_dir))
    pushed = dict(trainer_weights(PolicyModel(lm), 512 << 20, torch.bfloat16))
    expected = {n: p for n, p in lm.named_parameters()}  # the tied output head is the embedding, named once
    assert pushed.keys() == expected.keys() and "lm_head.weight" not in pushed
    assert all(pushed[n].dtype == torch.bfloat16 and torch.equal(pushed[n], expected[n].to(torch.bfloat16))
               for n in expected)


def test_lora_adapters_are_merged_into_the_weights_they_adapt(tiny_model_dir):
    torch.manual_seed(0)
    lora = LoraSettings(4, 8, "q_proj,v_proj").apply(load_causal_lm(str(tiny_model_dir)))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_()
    merged = copy.deepcopy(lora).merge_and_unload()
    pushed = dict(trainer_weights(PolicyModel(lora), 512 << 20, torch.float32))
    expected = dict(merged.named_parameters())
    assert pushed.keys() == expected.keys()
    assert all(torch.allclose(pushed[n], expected[n], atol=1e-6) for n in expected)
    assert not torch.allclose(pushed["model.layers.0.self_attn.q_proj.weight"],
                              lora.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight)


def test_buckets_hold_whole_units_up_to_the_size():
    units = [torch.nn.Linear(1, 1) for _ in range(4)]
    entries = [_Entry(f"u{u}.t{t}", units[u], 100, None) for u in (0, 1, 2, 3) for t in range(2)]  # 200 B a unit
    entries.append(_Entry("u0.late", units[0], 100, None))  # a unit's weights may come late (the root's norm)
    names = [[e.name for e in b] for b in _buckets(entries, 450)]
    assert names == [["u0.t0", "u0.t1", "u0.late"], ["u1.t0", "u1.t1", "u2.t0", "u2.t1"], ["u3.t0", "u3.t1"]]
    assert [len(b) for b in _buckets(entries, 1)] == [3, 2, 2, 2]  # a unit larger than the bucket goes alone


def test_the_fingerprint_follows_in_place_changes(tiny_model_dir):
    model = PolicyModel(load_causal_lm(str(tiny_model_dir)))
    before = weights_fingerprint(model)
    assert weights_fingerprint(model) == before
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert weights_fingerprint(model) != before
