"""workload=agent: agent loops behind long shared tool prefixes.

``num_agents`` agents, each with its own long prefix (system prompt and tool definitions, ``tools_len``
characters = tokens with the byte tokenizer); ``num_sessions`` sessions, each run by one agent picked with a Zipf-like
popularity (``agent_skew``: agent k is picked with weight 1 / (k + 1) ** skew, so a few agents are hot). A session is
a task, then ``steps`` - 1 tool observations, each answered by a short action (``output_len`` tokens); every request
carries the whole session so far. So requests share very long prefixes across sessions (an agent's tools) and grow
within one (its history), and the hot agents' prefixes concentrate load: what separates a router that only follows
prefixes from one that also bounds load.
"""
from __future__ import annotations

from dataclasses import dataclass

from framework.core.registry import WORKLOAD
from framework.contracts.workload import Session, Turn, Workload, WorkloadConfig, random_text


@dataclass
class AgentConfig(WorkloadConfig):
    name: str = "agent"
    num_agents: int = 4
    tools_len: int = 1024          # characters of each agent's shared prefix (system prompt + tool definitions)
    agent_skew: float = 1.0        # popularity of agent k ~ 1 / (k + 1) ** agent_skew (0: uniform)
    num_sessions: int = 24
    steps: int = 4                 # requests per session: the task, then one per tool observation
    task_len: int = 64
    observation_len: int = 128     # characters of each tool's output, appended to the session
    output_len: int = 16           # tokens of each action (the model's tool call)
    think_time_s: float = 0.0      # the tool's run time before the next step


@WORKLOAD.register("agent")
class Agent(Workload):
    Config = AgentConfig
    sized_by = ("num_sessions", "steps")

    def generate(self) -> list[Session]:
        c, rng = self.cfg, self.rng
        problems = [f"workload.{k}={getattr(c, k)} must be >= 1" for k in
                    ("num_agents", "tools_len", "num_sessions", "steps", "task_len", "observation_len", "output_len")
                    if getattr(c, k) < 1]
        problems += [f"workload.{k}={getattr(c, k)} must be >= 0" for k in ("agent_skew", "think_time_s")
                     if getattr(c, k) < 0]
        if problems:
            raise ValueError("; ".join(problems))
        prefixes = []
        for a in range(c.num_agents):
            head = f"Agent {a}. You can call these tools:\n"  # the agent number first: two agents share a few chars
            prefixes.append((head + random_text(rng, c.tools_len))[:c.tools_len] + "\n")
        weights = [1 / (k + 1) ** c.agent_skew for k in range(c.num_agents)]
        sessions = []
        for i in range(c.num_sessions):
            agent = rng.choices(range(c.num_agents), weights)[0]
            turns = [Turn(f"Task: {random_text(rng, c.task_len)}\nAction:", c.output_len)]
            turns += [Turn(f"\nObservation: {random_text(rng, c.observation_len)}\nAction:", c.output_len,
                           c.think_time_s) for _ in range(c.steps - 1)]
            sessions.append(Session(f"agent-{agent}-session-{i}", 0.0, turns, prefix=prefixes[agent]))
        return sessions
