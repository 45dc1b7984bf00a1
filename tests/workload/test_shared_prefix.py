"""workload=shared_prefix: SGLang's generated-shared-prefix shape, checked against its definition."""
import itertools

import pytest

from framework.core.registry import WORKLOAD
from plugins.workload.shared_prefix import SharedPrefixConfig


def build(seed=0, **kw):
    return WORKLOAD.build("shared_prefix", SharedPrefixConfig(**kw), seed).sessions()


def group_of(s):
    return int(s.sid.split("-")[1])


def test_shape_groups_share_exactly_their_system_prompt():
    ss = build(num_groups=5, prompts_per_group=4, system_prompt_len=100, question_len=20, output_len=7)
    assert len(ss) == 20
    for s in ss:
        assert len(s.turns) == 1 and s.turns[0].max_new_tokens == 7 and not s.carry_history
        prompt = s.prompt(0, [])
        assert prompt == s.prefix + s.turns[0].text
        assert len(prompt) == 100 + 2 + 20             # system + "\n\n" + question (ASCII: chars = tokens)
    by_group = {g: [s.prompt(0, []) for s in grp] for g, grp in
                itertools.groupby(sorted(ss, key=group_of), key=group_of)}
    assert sorted(by_group) == list(range(5)) and all(len(v) == 4 for v in by_group.values())
    for g, prompts in by_group.items():
        assert len({p[:102] for p in prompts}) == 1        # one system prompt per group
        assert len({p[102:] for p in prompts}) == 4        # different questions
    prefixes = {prompts[0][:102] for prompts in by_group.values()}
    assert len(prefixes) == 5
    for a, b in itertools.combinations(prefixes, 2):   # two groups share at most the "System N" header by chance
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        assert common < 12


def test_shuffled_so_consecutive_requests_change_group():
    ss = build(num_groups=16, prompts_per_group=8)
    groups = [group_of(s) for s in ss]
    same = sum(a == b for a, b in zip(groups, groups[1:]))
    assert same < len(groups) / 4                      # uniform shuffle: about 1/16 of neighbours match
    ordered = [group_of(s) for s in build(num_groups=16, prompts_per_group=8, shuffle=False)]
    assert ordered == sorted(ordered)


def test_deterministic_by_seed():
    a = [s.prompt(0, []) for s in build(seed=3)]
    assert a == [s.prompt(0, []) for s in build(seed=3)]
    assert a != [s.prompt(0, []) for s in build(seed=4)]


def test_caps_and_arrivals():
    ss = build(num_groups=4, prompts_per_group=4, num_requests=5)
    assert sum(len(s.turns) for s in ss) == 5
    timed = build(num_groups=4, prompts_per_group=4, request_rate=10.0)
    arrivals = [s.arrival_s for s in timed]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0
    assert 0.5 < arrivals[-1] < 4.0                    # 16 Poisson arrivals at 10/s: ~1.6 s


def test_bad_sizes_say_which():
    with pytest.raises(ValueError, match="num_groups"):
        build(num_groups=0)
