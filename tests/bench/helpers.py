"""What the benchmark tests share: W-seed's shape at a size the tiny engine runs in seconds."""

from roseray.sampling_params import SamplingParams


def small_seed_workload(num_requests: int, max_tokens: int):
    """W-seed's shape with a prompt token the tiny preset's vocabulary has (15496 is GPT-2's)."""
    return ([[7] for _ in range(num_requests)],
            [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens) for _ in range(num_requests)])
