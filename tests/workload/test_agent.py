"""workload=agent: agent loops behind long shared tool prefixes, checked against its definition."""
from collections import Counter

import pytest

from framework.core.registry import WORKLOAD
from plugins.workload.agent import AgentConfig


def build(seed=0, **kw):
    return WORKLOAD.build("agent", AgentConfig(**kw), seed).sessions()


def test_sessions_share_their_agents_prefix_and_grow_step_by_step():
    ss = build(num_agents=3, tools_len=300, num_sessions=30, steps=4, observation_len=50, output_len=5)
    assert len(ss) == 30
    prefixes = {}
    for s in ss:
        agent = int(s.sid.split("-")[1])
        assert prefixes.setdefault(agent, s.prefix) == s.prefix and len(s.prefix) == 301
        assert len(s.turns) == 4 and all(t.max_new_tokens == 5 for t in s.turns) and s.carry_history
        answers = ["a1", "a2", "a3"]
        prompts = [s.prompt(k, answers) for k in range(4)]
        for k in range(1, 4):  # each step's prompt extends the last one and its answer
            assert prompts[k].startswith(prompts[k - 1] + answers[k - 1])
            assert s.turns[k].text.startswith("\nObservation: ")
    assert len(set(prefixes.values())) == len(prefixes)  # one prefix per agent


def test_popularity_follows_the_skew():
    def counts(skew):
        ss = build(num_agents=4, num_sessions=2000, agent_skew=skew, steps=1, tools_len=10)
        n = Counter(int(s.sid.split("-")[1]) for s in ss)
        return [n[k] for k in range(4)]
    for got, weights in ((counts(1.0), [1, 1 / 2, 1 / 3, 1 / 4]), (counts(0.0), [1, 1, 1, 1])):
        expected = [2000 * w / sum(weights) for w in weights]
        assert all(abs(g - e) < 0.2 * e for g, e in zip(got, expected)), (got, expected)  # > 4 sigma off fails
    assert [s.prompt(0, []) for s in build(seed=3)] == [s.prompt(0, []) for s in build(seed=3)]


@pytest.mark.parametrize("field", ["num_agents", "steps", "tools_len"])
def test_bad_sizes_name_the_field(field):
    with pytest.raises(ValueError, match=f"workload.{field}=0 must be >= 1"):
        build(**{field: 0})
