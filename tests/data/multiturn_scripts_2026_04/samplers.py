"""Stand-in for the user's copy of the module the curriculum example scripts name
(`pkg://tests.utils.dataset.test_create_rl_sampler_on_cpu`, a test module of verl's repository): its sampler class
`RandomCurriculumSampler`, with the same constructor and behaviour (a random order of the prompts from torch's
global generator, and an `update(batch)` that changes nothing). Written for these tests, not copied."""

from torch.utils.data import RandomSampler

from verl.experimental.dataset.sampler import AbstractCurriculumSampler


class RandomCurriculumSampler(AbstractCurriculumSampler):
    def __init__(self, data_source, data_config):
        self.sampler = RandomSampler(data_source=data_source)

    def __iter__(self):
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)

    def update(self, batch) -> None:
        return None
