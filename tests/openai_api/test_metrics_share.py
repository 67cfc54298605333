"""Request metrics summed over API processes (roseray.openai_api.metrics_share): a scrape adds
the siblings' published samples to this process's live ones, histograms and counters alike,
and a process that has not published yet adds nothing."""

from roseray.openai_api.metrics import ServerMetrics
from roseray.openai_api.metrics_share import MetricsShare
from roseray.runtime.async_engine import AsyncEngineStats
from tests.openai_api.helpers import metric


def observe(metrics: ServerMetrics, num_requests: int) -> None:
    for _ in range(num_requests):
        timer = metrics.request_timer(0.0)
        timer.on_tokens(1, 0.01)
        timer.on_tokens(2, 0.03)
        timer.on_finish("length", 0.05, num_prompt_tokens=3, num_output_tokens=3, arrival_time=0.0,
                        first_scheduled_time=0.001)


def test_a_scrape_sums_the_published_request_metrics_of_every_process(tmp_path):
    processes = [ServerMetrics("m", AsyncEngineStats, share=MetricsShare(str(tmp_path), i)) for i in range(3)]
    for metrics, num_requests in zip(processes, (2, 3, 4)):
        observe(metrics, num_requests)
    text = processes[0].render().decode()
    assert metric(text, "roseray:request_success_total") == 2  # nobody else published yet
    processes[1].share.publish(processes[1].registry)
    processes[2].share.publish(processes[2].registry)
    observe(processes[0], 1)  # this process's own part is live
    text = processes[0].render().decode()
    assert metric(text, 'roseray:request_success_total{finished_reason="length"') == 10
    assert metric(text, "roseray:e2e_request_latency_seconds_count") == 10
    assert metric(text, 'roseray:inter_token_latency_seconds_bucket{le="+Inf"') == 20  # 2 gaps per request
    assert metric(text, "roseray:request_prompt_tokens_sum") == 30
    assert metric(text, "roseray:num_requests_running") == 0  # the engine's, once
    assert "roseray:num_kv_blocks_total" in text and text.count("# TYPE roseray:num_kv_blocks_total") == 1


def test_one_process_renders_as_before():
    metrics = ServerMetrics("m", AsyncEngineStats)
    observe(metrics, 2)
    text = metrics.render().decode()
    assert metric(text, "roseray:request_success_total") == 2 and "roseray:engine_steps_total" in text
