"""/metrics parsed with prometheus_client's own parser; counters follow the traffic and the
engine figures follow the stats source."""

from __future__ import annotations

from serve.helpers import MODEL_ID, Served, scrape


def one_chat(served: Served, max_tokens: int = 8) -> None:
    served.client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=max_tokens,
        temperature=0,
    )


def test_serving_counters_grow_with_requests(served: Served) -> None:
    one_chat(served)
    before = scrape(served.url)
    one_chat(served, 8)
    one_chat(served, 8)
    after = scrape(served.url)
    ok = 'strata_serve_requests_total{route="/v1/chat/completions",status="200"}'
    assert after[ok] == before[ok] + 2
    assert (
        after["strata_serve_generated_tokens_total"]
        == before["strata_serve_generated_tokens_total"] + 16
    )
    assert after["strata_serve_prompt_tokens_total"] > before["strata_serve_prompt_tokens_total"]
    length = 'strata_serve_generations_total{reason="length"}'
    assert after[length] == before[length] + 2
    assert after["strata_serve_decode_tokens_per_second"] > 0
    assert after["strata_serve_prompt_tokens_per_second"] > 0
    assert after["strata_serve_queue_depth"] == 0
    assert after["strata_serve_queue_capacity"] == 8
    ttft = "strata_serve_time_to_first_token_seconds_count"
    assert after[ttft] == before[ttft] + 2


def test_error_statuses_are_counted(served: Served) -> None:
    import urllib.error
    import urllib.request

    key = 'strata_serve_requests_total{route="/v1/chat/completions",status="400"}'
    before = scrape(served.url).get(key, 0.0)
    req = urllib.request.Request(served.url + "/v1/chat/completions", data=b"{x")
    try:
        urllib.request.urlopen(req, timeout=30)
    except urllib.error.HTTPError as e:
        assert e.code == 400
    assert scrape(served.url)[key] == before + 1


def test_engine_metrics_follow_the_stats_source(served: Served) -> None:
    served.stats.set(
        hits=30,
        misses=10,
        bytes_read=123_456,
        stall_s=0.5,
        slots_in_use=5,
        slots_total=16,
        pred_correct=3,
        pred_predicted=4,
        pred_actual=6,
        per_layer_hit_rate=[0.5, None, 1.0],
        routed=80,
    )
    one_chat(served)  # the worker refreshes its snapshot after each request
    m = scrape(served.url)
    assert m["strata_expert_hits_total"] == 30
    assert m["strata_expert_misses_total"] == 10
    assert m["strata_expert_hit_rate"] == 0.75
    assert m["strata_expert_bytes_read_total"] == 123_456
    assert m["strata_expert_stall_seconds_total"] == 0.5
    assert m["strata_arena_slots_in_use"] == 5
    assert m["strata_arena_slots"] == 16
    assert m["strata_prefetch_precision"] == 0.75
    assert m["strata_prefetch_recall"] == 0.5
    assert m["strata_expert_routed_total"] == 80
    assert m["strata_expert_sharing"] == 2.0  # 80 choices over 40 look-ups
    assert m['strata_expert_layer_hit_rate{layer="0"}'] == 0.5
    assert 'strata_expert_layer_hit_rate{layer="1"}' not in m  # no look-ups: no value
    assert m['strata_expert_layer_hit_rate{layer="2"}'] == 1.0

    served.stats.set(hits=90, misses=10, bytes_read=200_000, stall_s=0.75)
    one_chat(served)
    m = scrape(served.url)
    assert m["strata_expert_hits_total"] == 90
    assert m["strata_expert_hit_rate"] == 0.9
    assert m["strata_expert_bytes_read_total"] == 200_000
    assert m["strata_expert_stall_seconds_total"] == 0.75
    # Only the generation worker reads the engine: never an HTTP thread.
    assert served.stats.callers == {"strata-serve-worker"}


def test_registries_are_per_server(served: Served) -> None:
    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value("strata_serve_generated_tokens_total") is None
    assert served.app.state.metrics.registry is not REGISTRY
