"""Where roles are set and what is refused: cluster.roles per local instance, the bootstrap fields all or none."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from framework.cluster.cluster import instance_roles
from framework.config import ClusterConfig
from framework.core.errors import ClusterError
from framework.engine.config import EngineConfig, Role
from framework.serving.http import protocol as P
from framework.serving.http.errors import ApiError


def test_roles_default_to_mixed_and_a_disaggregated_cluster_needs_both_roles():
    assert instance_roles(ClusterConfig(), 3) == [Role.mixed] * 3
    assert instance_roles(ClusterConfig(roles=["prefill", "decode", "decode"]), 3) == \
        [Role.prefill, Role.decode, Role.decode]
    for roles, message in ((["prefill", "prefill"], "at least one prefill and one decode"),
                           (["prefill", "decode", "mixed"], "no mixed one"),
                           (["prefill"], "one role per instance"),
                           (["prefil", "decode"], "each one of mixed, prefill, decode")):
        with pytest.raises(ClusterError, match=message):
            instance_roles(ClusterConfig(roles=roles), 2 if len(roles) == 1 else len(roles))
    with pytest.raises(ClusterError, match="set the roles per instance with cluster.roles"):
        instance_roles(ClusterConfig(), 2, "decode")
    with pytest.raises(ClusterError, match="servers started elsewhere"):
        instance_roles(ClusterConfig(roles=["prefill", "decode"], workers=["http://a", "http://b"]), 2)


def test_engine_config_refuses_an_unknown_role():
    with pytest.raises(ValueError, match="engine.role='both' is not one of mixed, prefill, decode"):
        EngineConfig(role="both").validate()


def test_bootstrap_fields_go_together_and_sglangs_extra_fields_are_accepted():
    body = ('{"text": "hi", "model": null, "sampling_params": {"max_new_tokens": 3}, "stream": false, '
            '"return_hidden_states": false, "log_metrics": true, "bootstrap_host": "127.0.0.1", '
            '"bootstrap_port": 8998, "bootstrap_room": 18446744073709551615}')   # what sglang-router 0.3.2 sends
    assert P.GenerateRequest.model_validate_json(body).bootstrap() == ("127.0.0.1", 8998, 2**64 - 1)
    chat = P.ChatCompletionRequest.model_validate_json(
        '{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3, "no_stop_trim": false, '
        '"separate_reasoning": true, "bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 5}')
    assert chat.bootstrap() == ("h", 1, 5) and chat.to_sampling_params().max_new_tokens == 3
    assert P.GenerateRequest(text="hi").bootstrap() is None
    with pytest.raises(ApiError, match="go together"):
        P.GenerateRequest(text="hi", bootstrap_room=5).bootstrap()
    with pytest.raises(ValidationError):
        P.GenerateRequest(text="hi", bootstrap_host="h", bootstrap_port=1, bootstrap_room=-1)
