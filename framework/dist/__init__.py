"""Process groups and launch: the one layer through which every collective of an instance goes."""

from framework.dist.group import CollectiveError, CollectiveTimeout, Group
from framework.dist.launch import Channel, RankProcesses, RankFailed, launch, start
from framework.dist.rank import PortInUse

__all__ = [
    "Channel", "CollectiveError", "CollectiveTimeout", "Group", "RankProcesses", "PortInUse", "RankFailed",
    "launch", "start",
]
