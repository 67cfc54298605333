"""The hand-rolled ITL histogram exports exactly what prometheus_client's Histogram would."""

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from roseray.openai_api.metrics import BisectHistogram

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.1, 1.0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.0, 0.001, 0.0025, 0.003, 0.01, 0.5, 1.0, 7.0]), st.integers(1, 4)),
                max_size=30))
def test_token_gap_histogram_matches_prometheus_client(observations):
    ours_registry, reference_registry = CollectorRegistry(), CollectorRegistry()
    ours = BisectHistogram("itl_seconds", "gaps", "m", BUCKETS)
    ours_registry.register(ours)
    reference = Histogram("itl_seconds", "gaps", ["model_name"], buckets=BUCKETS,
                          registry=reference_registry).labels("m")
    for value, count in observations:
        ours.observe(value, count)
        for _ in range(count):
            reference.observe(value)
    strip = lambda text: sorted(line for line in text.decode().split("\n") if line and "_created" not in line)  # noqa: E731
    ours_lines, reference_lines = strip(generate_latest(ours_registry)), strip(generate_latest(reference_registry))
    sums = [line for line in ours_lines if "_sum" in line], [line for line in reference_lines if "_sum" in line]
    assert [l for l in ours_lines if "_sum" not in l] == [l for l in reference_lines if "_sum" not in l]
    assert abs(float(sums[0][0].split()[-1]) - float(sums[1][0].split()[-1])) < 1e-9
