"""Before/after timings of the fused decoder-layer kernels, the Gumbel-max sampler and the
padded lm_head, on a CUDA device (bf16):

    python scripts/bench_fused_ops.py [--baseline-llama path/to/old/llama.py] [--json out.json]

(a) one Qwen3-0.6B-geometry decoder layer, decode batch 256 (paged KV cache, short
    context so attention stays small), replayed as a CUDA graph; and the whole 28-layer
    forward. "before" = the torch path (roseray.layers.fused.fused_kernels(False)); with
    --baseline-llama, the given llama.py module (e.g. `git show <rev>:roseray/models/llama.py`)
    builds the "before" model instead, so its per-step cos/sin gather is measured as it was.
(b) the sampler at batch 256 x vocab 151936, temperature 0.6: full torch path vs fused.
(c) GPT-2's lm_head [128, 768] x [768, 50257]: plain weight vs padded rows (roseray.layers.vocab).
(d) GPT-2 W-seed step pieces at batch 128: residual add + LayerNorm (torch's two kernels vs the
    fused one) and greedy argmax over bf16 logits vs the old `.float()` copy + fp32 argmax.
Medians of triton.testing.do_bench (L2 flushed between runs) unless said otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from roseray.engine.request import Request
from roseray.engine import sampler as sampler_module
from roseray.engine.sampler import BatchParams, Sampler
from roseray.layers.attention import Attention, AttentionMetadata, attention_metadata, set_attention_backend
from roseray.layers.fused import fused_kernels
from roseray.layers.triton_backend import TritonAttentionBackend
from roseray.layers.vocab import padded_vocab_size, vocab_logits, vocab_parameter
from roseray.models.loader import build_model, load_model, load_model_config
from roseray_kernels import layernorm, sampling
from roseray.sampling_params import SamplingParams

DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16
BLOCK_SIZE = 16


def median_ms(fn, rep: int = 200) -> float:
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def graphed(fn):
    """fn captured in a CUDA graph (after warm-up on a side stream); returns the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def count_kernels(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def kernel_names(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def decode_metadata(batch: int, context: int, num_layers: int, config) -> tuple[AttentionMetadata, list]:
    """batch sequences, each with `context` cached tokens, decoding token context+1."""
    blocks_per_seq = (context + 1 + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    tables = torch.randperm(num_blocks, device=DEVICE).view(batch, blocks_per_seq).int()
    slots = tables[:, context // BLOCK_SIZE].long() * BLOCK_SIZE + context % BLOCK_SIZE
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.full((batch,), context + 1, dtype=torch.int32, device=DEVICE), block_tables=tables,
        max_query_len=1, max_seq_len=context + 1, num_seqs=batch, block_size=BLOCK_SIZE)
    shape = (num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    caches = [(torch.randn(shape, device=DEVICE, dtype=DTYPE), torch.randn(shape, device=DEVICE, dtype=DTYPE))
              for _ in range(num_layers)]
    return meta, caches


def bind(model, caches) -> None:
    for layer, (k_cache, v_cache) in zip([m for m in model.modules() if isinstance(m, Attention)], caches):
        layer.k_cache, layer.v_cache = k_cache, v_cache


def build_baseline(path: str, config, reference_model):
    spec = importlib.util.spec_from_file_location("baseline_llama", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)
    try:
        with torch.device(DEVICE):
            model = module.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.load_state_dict(reference_model.state_dict())
    return model.eval()


@torch.inference_mode()
def bench_layers(results: dict, baseline_llama: str | None, batch: int, context: int) -> None:
    config = load_model_config("random:qwen3-0.6b")
    model = load_model(config, "random:qwen3-0.6b", DEVICE, DTYPE)
    baseline = build_baseline(baseline_llama, config, model) if baseline_llama else None
    set_attention_backend(TritonAttentionBackend())
    meta, caches = decode_metadata(batch, context, config.num_hidden_layers, config)
    bind(model, caches)
    if baseline is not None:
        bind(baseline, caches)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size, (batch,), device=DEVICE, dtype=torch.int32, generator=gen)
    positions = torch.full((batch,), context, device=DEVICE, dtype=torch.int32)
    hidden = torch.randn(batch, config.hidden_size, device=DEVICE, dtype=DTYPE, generator=gen)
    residual = torch.randn(batch, config.hidden_size, device=DEVICE, dtype=DTYPE, generator=gen)
    layer = model.model.layers[1]
    out = {}
    with attention_metadata(meta):
        def new_layer():
            return layer(positions, hidden, residual)

        with fused_kernels(False):
            torch_layer_graph = graphed(new_layer)
            out["layer_torch_path_kernels"] = count_kernels(new_layer)
        fused_layer_graph = graphed(new_layer)
        out["layer_fused_kernels"] = count_kernels(new_layer)
        out["layer_torch_path_us"] = 1000 * median_ms(torch_layer_graph)
        out["layer_fused_us"] = 1000 * median_ms(fused_layer_graph)
        with fused_kernels(False):
            want_hidden, want_residual = new_layer()
        got_hidden, got_residual = new_layer()
        out["layer_max_abs_diff_hidden"] = float((got_hidden.float() - want_hidden.float()).abs().max())
        out["layer_max_abs_diff_residual"] = float((got_residual.float() - want_residual.float()).abs().max())
        if baseline is not None:
            old_layer = baseline.model.layers[1]
            cos_sin = baseline.model.rotary_emb(positions).to(DTYPE)
            add = hidden + residual  # the old layer takes the summed stream

            def old_layer_fn():
                return old_layer(cos_sin, add)

            with fused_kernels(False):
                old_graph = graphed(old_layer_fn)
                out["layer_baseline_kernels"] = count_kernels(old_layer_fn)
            out["layer_baseline_us"] = 1000 * median_ms(old_graph)

        # The whole forward (28 layers + final norm), as the engine's decode graph runs it.
        def forward():
            return model(input_ids, positions)

        with fused_kernels(False):
            torch_forward = graphed(forward)
        fused_forward = graphed(forward)
        out["forward_torch_path_us"] = 1000 * median_ms(torch_forward, rep=300)
        out["forward_fused_us"] = 1000 * median_ms(fused_forward, rep=300)
        out["forward_fused_kernels"] = count_kernels(forward)
        fused_logits = model.compute_logits(forward())
        with fused_kernels(False):
            torch_logits = model.compute_logits(forward())
        out["forward_argmax_agreement_vs_torch_path"] = float(
            (fused_logits.argmax(-1) == torch_logits.argmax(-1)).float().mean())
        # Both bf16 paths against an fp32 copy of the same weights (torch path): which is closer?
        model32 = build_model(config, DEVICE, torch.float32)
        model32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
        model32.eval()
        bind(model32, [(k.float(), v.float()) for k, v in caches])
        with fused_kernels(False):
            logits32 = model32.compute_logits(model32(input_ids, positions))
        top32 = logits32.argmax(-1)
        out["fp32_argmax_agreement_fused_bf16"] = float((fused_logits.argmax(-1) == top32).float().mean())
        out["fp32_argmax_agreement_torch_bf16"] = float((torch_logits.argmax(-1) == top32).float().mean())
        out["fp32_logits_max_abs_diff_fused_bf16"] = float((fused_logits - logits32).abs().max())
        out["fp32_logits_max_abs_diff_torch_bf16"] = float((torch_logits - logits32).abs().max())
        del model32, logits32
        if baseline is not None:
            def old_forward():
                return baseline(input_ids, positions)

            with fused_kernels(False):
                old_graph = graphed(old_forward)
                out["forward_baseline_kernels"] = count_kernels(old_forward)
                baseline_logits = baseline.compute_logits(old_forward())
            out["forward_baseline_us"] = 1000 * median_ms(old_graph, rep=300)
            out["forward_argmax_agreement_vs_baseline"] = float(
                (fused_logits.argmax(-1) == baseline_logits.argmax(-1)).float().mean())
            out["forward_logits_max_abs_diff_vs_baseline"] = float((fused_logits - baseline_logits).abs().max())
    results[f"qwen3_0.6b_decode_b{batch}_ctx{context}"] = out
    del model, baseline, caches
    torch.cuda.empty_cache()


def make_request(params: SamplingParams, i: int = 0, output: tuple[int, ...] = ()) -> Request:
    req = Request(f"r{i}", [5, 6], params, eos_token_ids=frozenset({3}), max_tokens=64)
    for token_id in output:
        req.output_token_ids.append(token_id)
        req.token_ids.append(token_id)
    return req


@torch.inference_mode()
def bench_sampler(results: dict, batch: int, vocab: int, temperature: float) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    logits = torch.randn(batch, vocab, device=DEVICE, generator=gen) * 3  # fp32, as compute_logits returns
    requests = [make_request(SamplingParams(temperature=temperature), i) for i in range(batch)]
    out = {}
    for name, fused in (("torch", False), ("fused", True)):
        sampler = Sampler(seed=0, fused=fused)
        for _ in range(5):
            sampler(logits, requests)
        torch.cuda.synchronize()
        out[f"{name}_device_us"] = 1000 * median_ms(lambda: sampler.launch(logits, requests).token_ids)
        walls = []
        for _ in range(50):
            torch.cuda.synchronize()
            start = time.perf_counter()
            sampler(logits, requests)
            walls.append(time.perf_counter() - start)
        out[f"{name}_call_wall_us"] = 1e6 * statistics.median(walls)
        out[f"{name}_kernels"] = count_kernels(lambda: sampler.launch(logits, requests).result())
    # The device work alone: the fused kernels in a CUDA graph vs the torch ops of the plain rows.
    temps = torch.full((batch,), temperature, device=DEVICE)
    seed = torch.tensor([7], device=DEVICE)
    tiny = torch.finfo(torch.float32).tiny

    def torch_chain():
        scaled = logits.to(torch.float32, copy=True).div_(temps.unsqueeze(1))
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_().clamp_min_(tiny)
        return probs.div_(noise).argmax(dim=-1)

    out["torch_ops_device_us"] = 1000 * median_ms(torch_chain)
    out["fused_kernel_graph_us"] = 1000 * median_ms(graphed(lambda: sampling.gumbel_max_sample(logits, temps, seed)))
    out["fused_kernel_eager_us"] = 1000 * median_ms(lambda: sampling.gumbel_max_sample(logits, temps, seed))
    walls = []
    for _ in range(50):
        start = time.perf_counter()
        BatchParams.from_requests(requests, vocab)
        walls.append(time.perf_counter() - start)
    out["batch_params_host_us"] = 1e6 * statistics.median(walls)
    # Host time of the fused path's other per-call pieces (suspects for its extra host overhead).
    generator = torch.Generator(device=DEVICE).manual_seed(5)
    pieces = {
        "randint_seed": lambda: torch.randint(0, 2**62, (1,), dtype=torch.int64, device=DEVICE, generator=generator),
        "temperatures_to_device": lambda: sampler_module._to_device([temperature] * batch, torch.float32, DEVICE),
        "gumbel_max_sample_call": lambda: sampling.gumbel_max_sample(logits, temps, seed),
        "fused_launch": lambda: Sampler(seed=0, fused=True).launch(logits, requests),
    }
    for name, fn in pieces.items():
        fn()
        torch.cuda.synchronize()
        walls = []
        for _ in range(30):
            start = time.perf_counter()
            fn()
            walls.append(time.perf_counter() - start)
            torch.cuda.synchronize()
        out[f"host_{name}_us"] = 1e6 * statistics.median(walls)
    sweep = {}
    defaults = (sampling.TARGET_PROGRAMS, sampling.NUM_WARPS)
    for block in (1024, 2048, 4096) if batch >= 256 else ():
        reference_tokens = sampling.gumbel_max_sample(logits, temps, seed, block=block)  # the noise depends on block
        for target in (1024, 2048, 4096, 8192):
            for warps in (4, 8):
                sampling.TARGET_PROGRAMS, sampling.NUM_WARPS = target, warps
                tokens = sampling.gumbel_max_sample(logits, temps, seed, block=block)
                us = 1000 * median_ms(graphed(lambda: sampling.gumbel_max_sample(logits, temps, seed, block=block)),
                                      rep=50)
                sweep[f"block{block}_target{target}_warps{warps}"] = [round(us, 1), bool(torch.equal(tokens, reference_tokens))]
    sampling.TARGET_PROGRAMS, sampling.NUM_WARPS = defaults
    if sweep:
        out["sweep_graph_us_and_same_tokens"] = sweep
    # Distribution check at full size: tokens drawn for one row's logits over many rows.
    row = (torch.randn(vocab, device=DEVICE, generator=gen) * 3)
    many = row.expand(batch * 16, -1).contiguous()
    sampler = Sampler(seed=3, fused=True)
    reqs = [make_request(SamplingParams(temperature=temperature), i) for i in range(batch * 16)]
    tokens = torch.tensor(sampler(many, reqs).token_ids, device=DEVICE)
    probs = torch.softmax(row / temperature, dim=-1)
    top = probs.topk(5)
    empirical = torch.stack([(tokens == t).float().mean() for t in top.indices])
    out["top5_probs"] = [round(p, 4) for p in top.values.tolist()]
    out["top5_empirical"] = [round(p, 4) for p in empirical.tolist()]
    out["fused_tokens_in_range"] = bool(((tokens >= 0) & (tokens < vocab)).all())
    results[f"sampler_b{batch}_v{vocab}_t{temperature}"] = out


@torch.inference_mode()
def bench_lm_head(results: dict, rows: int, hidden_size: int = 768, vocab: int = 50257) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)
    with torch.device(DEVICE):
        weight = vocab_parameter(vocab, hidden_size)  # [vocab, hidden] view of padded rows
    torch.set_default_dtype(previous)
    weight.data.normal_(0, 0.02, generator=gen)
    plain = weight.detach().clone()  # an ordinary [50257, 768] tensor: the "before"
    hidden = torch.randn(rows, hidden_size, device=DEVICE, dtype=DTYPE, generator=gen)
    out = {
        "plain_us": 1000 * median_ms(lambda: F.linear(hidden, plain)),
        "padded_us": 1000 * median_ms(lambda: vocab_logits(hidden, weight)),
        "plain_with_float_us": 1000 * median_ms(lambda: F.linear(hidden, plain).float()),
        "padded_with_float_us": 1000 * median_ms(lambda: vocab_logits(hidden, weight).float()),
        "plain_kernels": kernel_names(lambda: F.linear(hidden, plain)),
        "padded_kernels": kernel_names(lambda: vocab_logits(hidden, weight)),
        "max_abs_diff": float((vocab_logits(hidden, weight).float() - F.linear(hidden, plain).float()).abs().max()),
    }
    padded = weight.as_strided((padded_vocab_size(vocab), hidden_size), (hidden_size, 1))
    try:
        out["padded_mm_out_fp32_us"] = 1000 * median_ms(lambda: torch.mm(hidden, padded.t(), out_dtype=torch.float32))
        out["padded_mm_out_fp32_max_abs_diff"] = float(
            (torch.mm(hidden, padded.t(), out_dtype=torch.float32)[:, :vocab] - F.linear(hidden, plain).float()).abs().max())
    except Exception as exc:
        out["padded_mm_out_fp32_error"] = repr(exc)[:200]
    results[f"gpt2_lm_head_{rows}x{hidden_size}x{vocab}"] = out


@torch.inference_mode()
def bench_qwen_logits(results: dict, rows: int = 256, hidden_size: int = 1024, vocab: int = 151936) -> None:
    """compute_logits' bf16 matmul and its .float() copy at the W-nano decode size."""
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    weight = torch.randn(vocab, hidden_size, device=DEVICE, dtype=DTYPE, generator=gen) * 0.02
    hidden = torch.randn(rows, hidden_size, device=DEVICE, dtype=DTYPE, generator=gen)
    out = {"linear_bf16_us": 1000 * median_ms(lambda: F.linear(hidden, weight)),
           "linear_then_float_us": 1000 * median_ms(lambda: F.linear(hidden, weight).float())}
    try:
        out["mm_out_fp32_us"] = 1000 * median_ms(lambda: torch.mm(hidden, weight.t(), out_dtype=torch.float32))
    except Exception as exc:
        out["mm_out_fp32_error"] = repr(exc)[:200]
    results[f"qwen3_logits_{rows}x{hidden_size}x{vocab}"] = out


def per_call_us(fn, calls: int = 20) -> float:
    """Device time of one call: `calls` calls replayed as one CUDA graph (no launch gaps)."""
    return 1000 * median_ms(graphed(lambda: [fn() for _ in range(calls)])) / calls


@torch.inference_mode()
def bench_gpt2_pieces(results: dict, rows: int = 128, hidden_size: int = 768, vocab: int = 50257) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    x, residual = (torch.randn(rows, hidden_size, device=DEVICE, dtype=DTYPE, generator=gen) for _ in range(2))
    weight, bias = (torch.randn(hidden_size, device=DEVICE, dtype=DTYPE, generator=gen) for _ in range(2))

    def torch_add_norm():
        summed = x + residual
        return F.layer_norm(summed, (hidden_size,), weight, bias, 1e-5), summed

    fused_out, fused_sum = layernorm(x, weight, bias, 1e-5, residual)
    torch_out, torch_sum = torch_add_norm()
    logits = torch.randn(rows, padded_vocab_size(vocab), device=DEVICE, dtype=DTYPE, generator=gen)[:, :vocab]
    results[f"gpt2_pieces_b{rows}"] = {
        "add_layernorm_torch_us": per_call_us(torch_add_norm),
        "add_layernorm_fused_us": per_call_us(lambda: layernorm(x, weight, bias, 1e-5, residual)),
        "add_layernorm_out_max_abs_diff": float((fused_out.float() - torch_out.float()).abs().max()),
        "add_layernorm_out_mismatched_fraction": float((fused_out != torch_out).float().mean()),
        "add_layernorm_sum_equal": bool(torch.equal(fused_sum, torch_sum)),
        "greedy_float_copy_argmax_us": per_call_us(lambda: logits.float().argmax(dim=-1)),
        "greedy_bf16_argmax_us": per_call_us(lambda: logits.argmax(dim=-1)),
        "greedy_same_tokens": bool(torch.equal(logits.float().argmax(dim=-1), logits.argmax(dim=-1))),
    }


@torch.inference_mode()
def bench_syncs(results: dict) -> None:
    """Synchronizing CUDA calls per sampler call, as torch's sync debug mode counts them."""
    test_request = make_request
    logits = torch.randn(6, 1000, device=DEVICE) * 3
    requests = [
        test_request(SamplingParams(temperature=0.0)),
        test_request(SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=3)),
        test_request(SamplingParams(temperature=1.0, repetition_penalty=1.2, presence_penalty=0.5), output=[1, 2]),
        test_request(SamplingParams(temperature=1.0, logprobs=5, min_tokens=4)),
        test_request(SamplingParams(temperature=0.5, top_k=10)),
        test_request(SamplingParams(temperature=0.0, logprobs=0, frequency_penalty=1.0), output=[9]),
    ]
    plain = [test_request(SamplingParams(temperature=0.6)), test_request(SamplingParams(temperature=0.0))]
    batches = {"mixed": requests, "greedy": requests[:1], "seeded_top_k": requests[1:2], "plain": plain,
               "plain_and_others": plain[:1] + requests[1:]}
    out = {}
    for fused in (False, True):
        sampler = Sampler(seed=0, fused=fused)
        for batch in batches.values():
            sampler(logits[: len(batch)], batch)
        torch.cuda.synchronize()
        for name, batch in batches.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    sampler(logits[: len(batch)], batch)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            out[f"{'fused' if fused else 'torch'}_{name}"] = sum(
                "called a synchronizing CUDA operation" in str(w.message) for w in caught)
    results["sampler_sync_counts"] = out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline-llama", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--context", type=int, default=64)
    args = parser.parse_args()
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    import triton

    results["triton"] = triton.__version__
    for step in (lambda: bench_syncs(results), lambda: bench_gpt2_pieces(results), lambda: bench_lm_head(results, 128),
                 lambda: bench_lm_head(results, 256), lambda: bench_qwen_logits(results),
                 lambda: bench_sampler(results, 256, 151936, 0.6), lambda: bench_sampler(results, 32, 151936, 0.6),
                 lambda: bench_layers(results, args.baseline_llama, 256, args.context)):
        try:
            step()
        except Exception as exc:  # keep the other numbers
            results.setdefault("errors", []).append(repr(exc))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1), flush=True)


if __name__ == "__main__":
    main()
