"""Hub ids as model paths, all offline: a cache folder laid out as huggingface_hub lays it out is built here, and the
only server ever contacted is a silent socket on localhost."""

import shutil
import socket
import sys
import time
from types import SimpleNamespace

import pytest
from huggingface_hub import constants

from posttrain.config import ConfigError
from posttrain.models import hub
from posttrain.models.hub import model_source_problem, resolve_model_source

COMMIT = "0123456789abcdef0123456789abcdef01234567"
KEY = "actor_rollout_ref.model.path"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache under tmp_path, offline mode on, and a fresh per-process memo."""
    folder = tmp_path / "hf" / "hub"
    folder.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(folder))  # huggingface_hub read the variables at import
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "_resolved", {})
    return folder


def put_in_cache(cache, repo_id, model_dir):
    """`repo_id` cached as `hf download` leaves it: refs/main names a commit whose snapshot holds the files."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(model_dir, repo / "snapshots" / COMMIT)
    return repo / "snapshots" / COMMIT


def go_online(monkeypatch, endpoint):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 1)
    # huggingface_hub's own first request of a process also looks up a list of agents (3 s at most, once); the
    # test times posttrain's probe alone
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)


def test_a_cached_id_resolves_to_its_snapshot_and_loads(cache, tiny_model_dir, monkeypatch):
    from posttrain.models.load import load_causal_lm, load_tokenizer

    snapshot = put_in_cache(cache, "Tiny/model", tiny_model_dir)
    assert model_source_problem("Tiny/model", key=KEY) is None
    assert resolve_model_source("Tiny/model", key=KEY) == str(snapshot)
    fetches = []
    monkeypatch.setattr(hub, "_fetch", lambda *a: fetches.append(a))
    tok = load_tokenizer("Tiny/model", key=KEY)
    model = load_causal_lm("Tiny/model", key=KEY)
    assert fetches == []  # fetched once a process
    ids = tok("1+2=", return_tensors="pt").input_ids
    assert model(input_ids=ids).logits.shape[:2] == ids.shape


def test_a_local_directory_is_used_as_is(cache, tiny_model_dir):
    assert resolve_model_source(str(tiny_model_dir), key=KEY) == str(tiny_model_dir)
    assert model_source_problem(str(tiny_model_dir), key=KEY) is None


def test_a_missing_id_offline_fails_at_once_saying_how_to_get_it(cache):
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        resolve_model_source("Nobody/none", key=KEY)
    assert time.perf_counter() - start < 5
    message = str(err.value)
    for part in (KEY, "'Nobody/none'", str(cache), "HF_HUB_OFFLINE=1", "hf download Nobody/none", "local model directory"):
        assert part in message
    assert model_source_problem("Nobody/none", key=KEY) == message


@pytest.mark.parametrize("path", ["/nope", "./missing_dir", "missing_dir", "a/b/c"])
def test_a_path_that_is_neither_a_directory_nor_an_id_names_the_key(cache, path):
    with pytest.raises(ConfigError, match=f"{KEY}='{path}' is not a local directory") as err:
        resolve_model_source(path, key=KEY)
    assert model_source_problem(path, key=KEY) == str(err.value)


def test_a_file_is_not_a_model_directory(cache, tiny_model_dir):
    path = str(tiny_model_dir / "config.json")
    assert "is a file" in model_source_problem(path, key=KEY)
    with pytest.raises(ConfigError, match="is a file"):
        resolve_model_source(path, key=KEY)


@pytest.fixture
def silent_hub():
    """A local 'Hub' that accepts connections and never answers, as a dead network path would behave."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()


def test_online_an_unreachable_hub_fails_within_seconds_or_falls_back_to_the_cache(cache, tiny_model_dir,
                                                                                    monkeypatch, silent_hub):
    go_online(monkeypatch, silent_hub)
    assert model_source_problem("Nobody/none", key=KEY) is None  # could still be downloaded: not checked here
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="the Hub could not be reached") as err:
        resolve_model_source("Nobody/none", key=KEY)
    assert time.perf_counter() - start < 3  # HF_HUB_ETAG_TIMEOUT=1
    assert str(cache) in str(err.value) and "hf download Nobody/none" in str(err.value)
    snapshot = put_in_cache(cache, "Tiny/model", tiny_model_dir)
    assert resolve_model_source("Tiny/model", key=KEY) == str(snapshot)


def test_online_a_missing_id_is_downloaded_once_without_other_weight_formats(cache, monkeypatch, silent_hub):
    """The Hub's answers stand in for it: a repo with safetensors (and a Llama-style original/ copy) is listed,
    and snapshot_download is asked to skip the formats transformers does not load."""
    import huggingface_hub

    go_online(monkeypatch, silent_hub)
    listing = [SimpleNamespace(rfilename=name) for name in
               ("config.json", "model.safetensors", "original/consolidated.00.pth", "tokenizer.json")]
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo_id, timeout: SimpleNamespace(
        siblings=listing))
    downloads = []

    def snapshot_download(repo_id, local_files_only=False, ignore_patterns=None):
        if local_files_only:
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        downloads.append((repo_id, ignore_patterns))
        return "/cache/snapshot"

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert resolve_model_source("Some/model", key=KEY) == "/cache/snapshot"
    assert resolve_model_source("Some/model", key=KEY) == "/cache/snapshot"
    assert downloads == [("Some/model", hub.OTHER_WEIGHTS)]
    assert {"original/*", "*.pth", "*.bin"} <= set(hub.OTHER_WEIGHTS)


class FakeDist(SimpleNamespace):
    """torch.distributed as one rank of a job of 2 nodes x 2 processes sees it: ranks 0 and 2 are local rank 0 of
    their node. `events` records the fetches and collectives in order; a collective hands out `others_say`, what
    the other ranks contributed (their failures)."""

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def get_world_size(self, group=None):
        return 4

    def get_rank(self):
        return self.rank

    def all_gather_object(self, out, mine, group=None):
        self.events.append("collective")
        out[:] = [mine if r == self.rank else self.others_say.get(r) for r in range(4)]

    def broadcast_object_list(self, objects, src, group=None):
        self.events.append("collective")
        if self.rank != src:
            objects[0] = self.others_say.get(src)


def as_rank(monkeypatch, rank, others_say=None):
    """Make this process rank `rank` of the fake 2 x 2 job; returns its event list."""
    from posttrain.parallel import context

    fake = FakeDist(rank=rank, events=[], others_say=others_say or {})
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)
    monkeypatch.setattr(context, "dist", fake)
    monkeypatch.setenv("LOCAL_RANK", str(rank % 2))
    monkeypatch.setattr(hub, "_resolved", {})
    monkeypatch.setattr(hub, "_fetch", lambda repo_id, key: fake.events.append("fetch") or "/snapshot")
    return fake.events


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_local_rank_0_of_each_node_fetches_first(rank, monkeypatch):
    """Caches are per node: the first process of every node downloads before any collective, and the node's other
    processes fetch (read the cache it filled) only after it."""
    events = as_rank(monkeypatch, rank)
    assert resolve_model_source("A/b", key=KEY) == "/snapshot"
    assert events == (["fetch", "collective"] if rank % 2 == 0 else ["collective", "fetch"])


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_a_failed_fetch_on_any_node_stops_every_rank(rank, monkeypatch):
    """Rank 2 (the first process of node 1) could not fetch: every other rank raises its message, and the ranks
    that had not fetched yet do not try."""
    events = as_rank(monkeypatch, rank, others_say={2: "rank 2: the Hub has no such model"})
    with pytest.raises(ConfigError, match="rank 2: the Hub has no such model"):
        resolve_model_source("A/b", key=KEY)
    assert events.count("fetch") == (1 if rank == 0 else 0)


def test_the_cli_reports_a_missing_id_in_one_line(cache, capsys, tmp_path):
    from posttrain.cli import main

    data = tmp_path / "train.jsonl"
    data.write_text("")
    start = time.perf_counter()
    rc = main(["train", "actor_rollout_ref.model.path=Nobody/none", f"data.train_files={data}"])
    assert time.perf_counter() - start < 5
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("config error: actor_rollout_ref.model.path='Nobody/none'")
    assert str(cache) in err[0] and "Traceback" not in err[0]


def test_training_and_sft_take_hub_ids(cache, tiny_model_dir, tmp_path):
    """Actor, tokenizer and critic all from one id (GAE needs a critic), and SFT's --model."""
    from posttrain.config import load_config
    from posttrain.data.synthetic import write_task
    from posttrain.trainer.rl import RLTrainer
    from posttrain.trainer.sft import SFTArgs, run_sft

    put_in_cache(cache, "Tiny/model", tiny_model_dir)
    files = write_task(tmp_path / "data", seed=0, operands=range(10), held_out=0, dev=4)
    cfg = load_config(None, [
        "algorithm.adv_estimator=gae", "data.train_batch_size=4", "data.max_prompt_length=32",
        "data.max_response_length=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.model.path=Tiny/model", "actor_rollout_ref.model.tokenizer_path=Tiny/model",
        "critic.model.path=Tiny/model", f"data.train_files={files['rl_train']}", "trainer.total_training_steps=1",
        f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.logger=['jsonl']", "trainer.val_before_train=False"])
    trainer = RLTrainer(cfg)
    assert trainer.parts.critic is not None
    trainer.fit()
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    run_sft(SFTArgs(model_path="Tiny/model", train_files=[str(files["sft_train"])], output_dir=str(tmp_path / "sft"),
                    epochs=0.01, batch_size=4, max_length=32, quiet=True))
    assert (tmp_path / "sft" / "config.json").is_file()
